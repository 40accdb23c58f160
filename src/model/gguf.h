// GGUF (llama.cpp's model file format), versions 2 and 3: header, metadata key/values, tensor
// table and the aligned tensor data section. The file is memory-mapped; tensor data pointers stay
// valid for the lifetime of the GgufFile.
// Every error is a certkv::Error whose message names the file and what is wrong with it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "format/ggml_blocks.h"
#include "format/mapped_file.h"

namespace certkv::model {

enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// One metadata value. Scalars of every integer width are held as int64_t (uint64 values above
// INT64_MAX are rejected as corrupt), floats as double; arrays keep their element type.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  GgufType array_type = GgufType::kUint8;  // element type when type == kArray
  std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>,
               std::vector<bool>, std::vector<std::string>>
      value;
};

struct GgufTensorInfo {
  std::string name;
  format::GgmlType type;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the contiguous (innermost) dimension
  uint64_t offset = 0;        // from the start of the data section
  uint64_t n_bytes = 0;       // computed from type and dims
  const uint8_t* data = nullptr;
  int64_t n_elements() const;
};

class GgufFile {
 public:
  // Maps and parses the file. REQUIRES: path names a regular file.
  static std::unique_ptr<GgufFile> open(const std::string& path);
  // Parses a buffer the caller keeps alive (used by tests and the fuzzer); `name` is used in errors.
  static std::unique_ptr<GgufFile> parse(const uint8_t* data, size_t size, const std::string& name);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;  // owns the mapping
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }

  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  // Typed getters: nullopt when the key is absent; an Error when it has an incompatible type.
  std::optional<int64_t> get_int(const std::string& key) const;
  std::optional<double> get_float(const std::string& key) const;  // accepts integer values too
  std::optional<bool> get_bool(const std::string& key) const;
  std::optional<std::string> get_string(const std::string& key) const;
  std::optional<std::vector<std::string>> get_string_array(const std::string& key) const;
  std::optional<std::vector<double>> get_float_array(const std::string& key) const;
  std::optional<std::vector<int64_t>> get_int_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensorInfo* find_tensor(const std::string& name) const;

 private:
  GgufFile() = default;
  void parse_all(const uint8_t* data, size_t size);

  std::string name_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
  std::unique_ptr<format::MappedFile> mapping_;  // null for parse()
};

}  // namespace certkv::model
