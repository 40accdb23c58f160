// safetensors (Hugging Face's tensor file format): an 8-byte little-endian header length N, N
// bytes of JSON describing the tensors, then the tensor data. The header is an object mapping
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets from the start of
// the data section, end exclusive) plus an optional "__metadata__" object of string values.
// Reading validates every offset and size against the file; the data is memory-mapped and the
// pointers stay valid for the lifetime of the SafetensorsFile. Tensor data is not necessarily
// aligned: read it with memcpy or byte loads.
// Every error is a certkv::Error whose message names the file and what is wrong with it.
// Thread safety: a SafetensorsFile is immutable after open/parse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "format/mapped_file.h"

namespace certkv::format {

// The largest JSON header accepted (the limit of the reference implementation).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Bytes per element of a safetensors dtype ("F32" -> 4, "BF16" -> 2, "BOOL" -> 1, ...); 0 for
// a dtype certkv does not know.
size_t safetensors_dtype_bytes(std::string_view dtype);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;  // row-major, outermost dimension first
  const uint8_t* data = nullptr;
  size_t n_bytes = 0;
};

class SafetensorsFile {
 public:
  // Maps and parses the file: kNotFound when it does not exist, kIo when it is not a readable
  // regular file, kCorrupt when its contents are malformed, kUnsupported for an unknown dtype.
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  // Parses a buffer the caller keeps alive; `name` is used in errors.
  static std::unique_ptr<SafetensorsFile> parse(const uint8_t* data, size_t size,
                                                const std::string& name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& name() const { return name_; }
  // In the order of the JSON header.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void parse_all(const uint8_t* data, size_t size);

  std::string name_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<MappedFile> mapping_;  // null for parse()
};

struct SafetensorsTensorView {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;  // row-major, outermost dimension first
  const void* data = nullptr;  // n_bytes bytes, borrowed
  size_t n_bytes = 0;
};

// Writes `tensors` (data laid out in the given order) and `metadata` to `path`, replacing it.
// The JSON header is padded with spaces to a multiple of 8 bytes.
// REQUIRES: unique names other than "__metadata__", known dtypes, non-negative shapes,
// n_bytes == product(shape) * dtype size (else kInvalidArgument). A failed write is kIo naming
// the path.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorView>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace certkv::format
