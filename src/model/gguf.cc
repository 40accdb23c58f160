#include "model/gguf.h"

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "core/status.h"
#include "format/mapped_file.h"
#include "model/ggml_type.h"

namespace certkv::model {
namespace {

constexpr uint32_t kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;
// Smallest encodings, used to bound a count by the bytes left before allocating for it:
// a key/value is a key length (8), a value type (4) and at least one value byte; a tensor info is
// a name length (8), n_dims (4), a type (4) and an offset (8).
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;

const char* gguf_type_name(uint32_t type) {
  switch (static_cast<GgufType>(type)) {
    case GgufType::kUint8: return "uint8";
    case GgufType::kInt8: return "int8";
    case GgufType::kUint16: return "uint16";
    case GgufType::kInt16: return "int16";
    case GgufType::kUint32: return "uint32";
    case GgufType::kInt32: return "int32";
    case GgufType::kFloat32: return "float32";
    case GgufType::kBool: return "bool";
    case GgufType::kString: return "string";
    case GgufType::kArray: return "array";
    case GgufType::kUint64: return "uint64";
    case GgufType::kInt64: return "int64";
    case GgufType::kFloat64: return "float64";
  }
  return "unknown";
}

bool is_integer_type(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64: return true;
    default: return false;
  }
}

bool is_float_type(GgufType type) {
  return type == GgufType::kFloat32 || type == GgufType::kFloat64;
}

// Encoded size of one scalar of `type`; strings count their 8-byte length prefix only.
uint64_t min_encoded_bytes(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool: return 1;
    case GgufType::kUint16:
    case GgufType::kInt16: return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32: return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
    case GgufType::kString: return 8;
    case GgufType::kArray: return 4 + 8;
  }
  return 1;
}

// Bounds-checked little-endian reader over the file bytes. Every failure names the file and the
// field being read.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  [[noreturn]] void corrupt(const std::string& what) const {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': " + what);
  }

  const uint8_t* take(uint64_t n_bytes, const std::string& field) {
    if (n_bytes > remaining()) {
      corrupt(field + " (" + std::to_string(n_bytes) + " bytes at offset " +
              std::to_string(pos_) + ") runs past the end of the file (" + std::to_string(size_) +
              " bytes)");
    }
    const uint8_t* p = data_ + pos_;
    pos_ += static_cast<size_t>(n_bytes);
    return p;
  }

  template <typename T>
  T read(const std::string& field) {
    const uint8_t* p = take(sizeof(T), field);
    T value;
    std::memcpy(&value, p, sizeof(T));  // GGUF is little-endian, as is every host certkv targets
    return value;
  }

  std::string read_string(const std::string& field) {
    const uint64_t length = read<uint64_t>(field + " length");
    if (length > remaining()) {
      corrupt(field + " length " + std::to_string(length) + " at offset " +
              std::to_string(pos_ - 8) + " runs past the end of the file (" +
              std::to_string(remaining()) + " bytes left)");
    }
    const uint8_t* p = take(length, field);
    return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(length));
  }

  // A count of elements of at least `min_bytes` each; rejects counts the rest of the file
  // cannot hold, so that no allocation is sized by an unchecked number.
  uint64_t read_count(const std::string& field, uint64_t min_bytes) {
    const uint64_t count = read<uint64_t>(field);
    if (count > remaining() / min_bytes) {
      corrupt(field + " " + std::to_string(count) + " at offset " + std::to_string(pos_ - 8) +
              " runs past the end of the file (" + std::to_string(remaining()) +
              " bytes left)");
    }
    return count;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  std::string name_;
  size_t pos_ = 0;
};

int64_t read_integer(Reader& r, GgufType type, const std::string& field) {
  switch (type) {
    case GgufType::kUint8: return r.read<uint8_t>(field);
    case GgufType::kInt8: return r.read<int8_t>(field);
    case GgufType::kUint16: return r.read<uint16_t>(field);
    case GgufType::kInt16: return r.read<int16_t>(field);
    case GgufType::kUint32: return r.read<uint32_t>(field);
    case GgufType::kInt32: return r.read<int32_t>(field);
    case GgufType::kInt64: return r.read<int64_t>(field);
    case GgufType::kUint64: {
      const uint64_t v = r.read<uint64_t>(field);
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        r.corrupt(field + " is a uint64 of " + std::to_string(v) + ", above the int64 range");
      }
      return static_cast<int64_t>(v);
    }
    default: r.corrupt(field + " is not an integer");
  }
}

double read_float(Reader& r, GgufType type, const std::string& field) {
  if (type == GgufType::kFloat32) return r.read<float>(field);
  return r.read<double>(field);
}

bool read_bool(Reader& r, const std::string& field) {
  const uint8_t v = r.read<uint8_t>(field);
  if (v > 1) r.corrupt(field + " is a bool of value " + std::to_string(v) + " (must be 0 or 1)");
  return v == 1;
}

GgufType read_value_type(Reader& r, const std::string& field) {
  const uint32_t type = r.read<uint32_t>(field + " type");
  if (type > static_cast<uint32_t>(GgufType::kFloat64)) {
    r.corrupt(field + " has unknown value type " + std::to_string(type));
  }
  return static_cast<GgufType>(type);
}

GgufValue read_value(Reader& r, GgufType type, const std::string& field) {
  GgufValue out;
  out.type = type;
  if (is_integer_type(type)) {
    out.value = read_integer(r, type, field);
  } else if (is_float_type(type)) {
    out.value = read_float(r, type, field);
  } else if (type == GgufType::kBool) {
    out.value = read_bool(r, field);
  } else if (type == GgufType::kString) {
    out.value = r.read_string(field);
  } else {
    const GgufType element = read_value_type(r, field + " element");
    if (element == GgufType::kArray) r.corrupt(field + " is an array of arrays (not supported)");
    out.array_type = element;
    const uint64_t count = r.read_count(field + " element count", min_encoded_bytes(element));
    const std::string item = field + " element";
    if (is_integer_type(element)) {
      std::vector<int64_t> values(count);
      for (auto& v : values) v = read_integer(r, element, item);
      out.value = std::move(values);
    } else if (is_float_type(element)) {
      std::vector<double> values(count);
      for (auto& v : values) v = read_float(r, element, item);
      out.value = std::move(values);
    } else if (element == GgufType::kBool) {
      std::vector<bool> values(count);
      for (uint64_t i = 0; i < count; ++i) values[i] = read_bool(r, item);
      out.value = std::move(values);
    } else {
      std::vector<std::string> values(count);
      for (auto& v : values) v = r.read_string(item);
      out.value = std::move(values);
    }
  }
  return out;
}

std::string describe_type(const GgufValue& v) {
  if (v.type == GgufType::kArray) {
    return std::string("array of ") + gguf_type_name(static_cast<uint32_t>(v.array_type));
  }
  return gguf_type_name(static_cast<uint32_t>(v.type));
}

}  // namespace

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // bounded at parse time: the product fits in int64
  return n;
}

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = path;
  file->mapping_ = format::MappedFile::open(path, "GGUF file");
  file->parse_all(file->mapping_->data(), file->mapping_->size());
  return file;
}

std::unique_ptr<GgufFile> GgufFile::parse(const uint8_t* data, size_t size,
                                          const std::string& name) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = name;
  file->parse_all(data, size);
  return file;
}

GgufFile::~GgufFile() = default;

// Layout (GGUF specification, ggml/docs/gguf.md): magic "GGUF", version u32, tensor_count u64,
// kv_count u64, the key/values, the tensor infos, padding to `general.alignment`, tensor data.
void GgufFile::parse_all(const uint8_t* data, size_t size) {
  Reader r(data, size, name_);
  const uint8_t* magic = r.take(4, "magic");
  if (std::memcmp(magic, "GGUF", 4) != 0) r.corrupt("not a GGUF file (bad magic)");

  version_ = r.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    const uint32_t swapped = __builtin_bswap32(version_);
    if (swapped == 2 || swapped == 3) {
      fail(StatusCode::kUnsupported, "GGUF file '" + name_ + "' is big-endian (not supported)");
    }
    fail(StatusCode::kUnsupported, "GGUF file '" + name_ + "' has version " +
                                       std::to_string(version_) + " (supported: 2 and 3)");
  }

  const uint64_t tensor_count = r.read<uint64_t>("tensor_count");
  const uint64_t kv_count = r.read<uint64_t>("kv_count");
  if (kv_count > r.remaining() / kMinKeyValueBytes) {
    r.corrupt("kv_count " + std::to_string(kv_count) + " runs past the end of the file");
  }
  if (tensor_count > r.remaining() / kMinTensorInfoBytes) {
    r.corrupt("tensor_count " + std::to_string(tensor_count) + " runs past the end of the file");
  }

  for (uint64_t i = 0; i < kv_count; ++i) {
    const std::string index = "key/value " + std::to_string(i);
    std::string key = r.read_string(index + " key");
    const std::string field = "value of '" + key + "'";
    const GgufType type = read_value_type(r, field);
    GgufValue value = read_value(r, type, field);
    if (!metadata_.emplace(key, std::move(value)).second) {
      r.corrupt("duplicate metadata key '" + key + "'");
    }
  }

  alignment_ = kDefaultAlignment;
  if (auto it = metadata_.find("general.alignment"); it != metadata_.end()) {
    if (it->second.type != GgufType::kUint32) {
      r.corrupt("general.alignment has type " + describe_type(it->second) + " (must be uint32)");
    }
    const int64_t a = std::get<int64_t>(it->second.value);
    if (a == 0 || (a & (a - 1)) != 0) {
      r.corrupt("general.alignment " + std::to_string(a) + " is not a nonzero power of two");
    }
    alignment_ = static_cast<uint64_t>(a);
  }

  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo info;
    info.name = r.read_string("tensor info " + std::to_string(i) + " name");
    const std::string field = "tensor '" + info.name + "'";
    const uint32_t n_dims = r.read<uint32_t>(field + " n_dims");
    if (n_dims > kMaxDims) {
      r.corrupt(field + " has " + std::to_string(n_dims) + " dimensions (at most " +
                std::to_string(kMaxDims) + ")");
    }
    info.dims.resize(n_dims);
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>(field + " dimension " + std::to_string(d));
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        r.corrupt(field + " dimension " + std::to_string(d) + " is " + std::to_string(dim) +
                  " (above the int64 range)");
      }
      info.dims[d] = static_cast<int64_t>(dim);
      if (__builtin_mul_overflow(n_elements, info.dims[d], &n_elements)) {
        r.corrupt(field + " has more elements than int64 can count");
      }
    }
    const uint32_t type_id = r.read<uint32_t>(field + " type");
    info.type = static_cast<format::GgmlType>(type_id);
    info.offset = r.read<uint64_t>(field + " offset");

    if (!ggml_type_known(type_id)) {
      fail(StatusCode::kUnsupported, "GGUF file '" + name_ + "': " + field +
                                         " has unsupported ggml type id " +
                                         std::to_string(type_id));
    }
    const int64_t block = ggml_block_elements(info.type);
    const int64_t row = n_dims > 0 ? info.dims[0] : 1;
    if (row % block != 0) {
      r.corrupt(field + " of type " + ggml_type_name(info.type) + " has a row of " +
                std::to_string(row) + " elements, not a multiple of the block size " +
                std::to_string(block));
    }
    // n_elements fits in int64 and n_bytes <= n_elements * block_bytes / block, so the product
    // below is checked against 64 bits only once.
    const uint64_t n_blocks = static_cast<uint64_t>(n_elements / block);
    if (__builtin_mul_overflow(n_blocks, static_cast<uint64_t>(ggml_block_bytes(info.type)),
                               &info.n_bytes)) {
      r.corrupt(field + " has more bytes than 64 bits can count");
    }
    if (info.offset % alignment_ != 0) {
      r.corrupt(field + " offset " + std::to_string(info.offset) +
                " is not a multiple of the alignment " + std::to_string(alignment_));
    }
    if (!tensor_index_.emplace(info.name, tensors_.size()).second) {
      r.corrupt("duplicate tensor name '" + info.name + "'");
    }
    tensors_.push_back(std::move(info));
  }

  // The data section starts at the next multiple of the alignment after the tensor infos.
  const uint64_t infos_end = r.pos();
  const uint64_t data_start = infos_end + (alignment_ - infos_end % alignment_) % alignment_;
  for (GgufTensorInfo& info : tensors_) {
    const uint64_t limit = size;
    const bool fits = data_start <= limit && info.offset <= limit - data_start &&
                      info.n_bytes <= limit - data_start - info.offset;
    if (!fits) {
      r.corrupt("tensor '" + info.name + "' data (offset " + std::to_string(info.offset) + ", " +
                std::to_string(info.n_bytes) + " bytes, data section at " +
                std::to_string(data_start) + ") runs past the end of the file (" +
                std::to_string(size) + " bytes)");
    }
    info.data = data + data_start + info.offset;
  }
}

std::optional<int64_t> GgufFile::get_int(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (!is_integer_type(it->second.type)) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected an integer");
  }
  return std::get<int64_t>(it->second.value);
}

std::optional<double> GgufFile::get_float(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (is_integer_type(it->second.type)) return static_cast<double>(std::get<int64_t>(it->second.value));
  if (!is_float_type(it->second.type)) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected a number");
  }
  return std::get<double>(it->second.value);
}

std::optional<bool> GgufFile::get_bool(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (it->second.type != GgufType::kBool) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected a bool");
  }
  return std::get<bool>(it->second.value);
}

std::optional<std::string> GgufFile::get_string(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (it->second.type != GgufType::kString) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected a string");
  }
  return std::get<std::string>(it->second.value);
}

std::optional<std::vector<std::string>> GgufFile::get_string_array(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (it->second.type != GgufType::kArray || it->second.array_type != GgufType::kString) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected an array of strings");
  }
  return std::get<std::vector<std::string>>(it->second.value);
}

std::optional<std::vector<double>> GgufFile::get_float_array(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  const GgufValue& v = it->second;
  if (v.type == GgufType::kArray && is_float_type(v.array_type)) {
    return std::get<std::vector<double>>(v.value);
  }
  if (v.type == GgufType::kArray && is_integer_type(v.array_type)) {
    const auto& ints = std::get<std::vector<int64_t>>(v.value);
    return std::vector<double>(ints.begin(), ints.end());
  }
  fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                 describe_type(v) + ", expected an array of numbers");
}

std::optional<std::vector<int64_t>> GgufFile::get_int_array(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return std::nullopt;
  if (it->second.type != GgufType::kArray || !is_integer_type(it->second.array_type)) {
    fail(StatusCode::kCorrupt, "GGUF file '" + name_ + "': metadata '" + key + "' is " +
                                   describe_type(it->second) + ", expected an array of integers");
  }
  return std::get<std::vector<int64_t>>(it->second.value);
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace certkv::model
