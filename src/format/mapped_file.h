// A read-only memory mapping of a whole file, unmapped on destruction. Model and tensor files
// are read in place through it.
// Errors name the file with `kind` in front ("GGUF file 'x.gguf' not found"): kNotFound for a
// missing path, kIo for a directory, an unreadable file or a failed mapping.
// Thread safety: immutable after open.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace certkv::format {

class MappedFile {
 public:
  static std::unique_ptr<MappedFile> open(const std::string& path, const std::string& kind);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // null for an empty file.
  const uint8_t* data() const { return static_cast<const uint8_t*>(mapping_); }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  void* mapping_ = nullptr;
  size_t size_ = 0;
};

}  // namespace certkv::format
