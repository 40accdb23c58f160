#include "format/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include "core/status.h"
#include "format/mapped_file.h"
#include "format/json.h"

namespace certkv::format {
namespace {

constexpr const char* kMetadataKey = "__metadata__";

[[noreturn]] void corrupt(const std::string& file, const std::string& what) {
  fail(StatusCode::kCorrupt, "safetensors file '" + file + "': " + what);
}

// product(shape) * element_bytes, or false on overflow or a negative dimension.
bool tensor_bytes(const std::vector<int64_t>& shape, size_t element_bytes, uint64_t* out) {
  uint64_t n = element_bytes;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t nonnegative_integer(const JsonValue& v, const std::string& file, const std::string& what) {
  if (!v.is_integer() || v.as_int() < 0) corrupt(file, what + " is not a non-negative integer");
  return static_cast<uint64_t>(v.as_int());
}

}  // namespace

size_t safetensors_dtype_bytes(std::string_view dtype) {
  static const std::pair<std::string_view, size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2},  {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8},  {"U64", 8},     {"F64", 8},
  };
  for (const auto& [name, bytes] : kSizes) {
    if (name == dtype) return bytes;
  }
  return 0;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->name_ = path;
  file->mapping_ = format::MappedFile::open(path, "safetensors file");
  file->parse_all(file->mapping_->data(), file->mapping_->size());
  return file;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::parse(const uint8_t* data, size_t size,
                                                        const std::string& name) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->name_ = name;
  file->parse_all(data, size);
  return file;
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::parse_all(const uint8_t* data, size_t size) {
  if (size < 8) corrupt(name_, "shorter than its 8-byte header length");
  uint64_t header_bytes;
  std::memcpy(&header_bytes, data, 8);  // little-endian, as is every host certkv targets
  if (header_bytes > kSafetensorsMaxHeaderBytes) {
    corrupt(name_, "header length " + std::to_string(header_bytes) + " exceeds the limit of " +
                       std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  }
  if (header_bytes > size - 8) {
    corrupt(name_, "header length " + std::to_string(header_bytes) +
                       " runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  const std::string_view text(reinterpret_cast<const char*>(data + 8),
                              static_cast<size_t>(header_bytes));
  const JsonValue header = parse_json(text, name_);
  if (!header.is_object()) corrupt(name_, "header is not a JSON object");

  const uint8_t* section = data + 8 + header_bytes;
  const uint64_t section_bytes = size - 8 - header_bytes;
  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;

  for (const auto& [key, entry] : header.as_object()) {
    if (key == kMetadataKey) {
      if (!entry.is_object()) corrupt(name_, "__metadata__ is not an object");
      for (const auto& [mkey, mvalue] : entry.as_object()) {
        if (!mvalue.is_string()) corrupt(name_, "__metadata__ value of '" + mkey + "' is not a string");
        metadata_.emplace(mkey, mvalue.as_string());
      }
      continue;
    }
    const std::string what = "tensor '" + key + "'";
    if (!entry.is_object()) corrupt(name_, what + " is not an object");
    for (const auto& member : entry.as_object()) {
      if (member.first != "dtype" && member.first != "shape" && member.first != "data_offsets") {
        corrupt(name_, what + " has an unexpected field '" + member.first + "'");
      }
    }
    const JsonValue* dtype = entry.find("dtype");
    const JsonValue* shape = entry.find("shape");
    const JsonValue* offsets = entry.find("data_offsets");
    if (dtype == nullptr || !dtype->is_string()) corrupt(name_, what + " has no string dtype");
    if (shape == nullptr || !shape->is_array()) corrupt(name_, what + " has no shape array");
    if (offsets == nullptr || !offsets->is_array() || offsets->as_array().size() != 2) {
      corrupt(name_, what + " has no data_offsets pair");
    }

    SafetensorsTensor t;
    t.name = key;
    t.dtype = dtype->as_string();
    const size_t element_bytes = safetensors_dtype_bytes(t.dtype);
    if (element_bytes == 0) {
      fail(StatusCode::kUnsupported, "safetensors file '" + name_ + "': " + what +
                                         " has unsupported dtype '" + t.dtype + "'");
    }
    for (const JsonValue& d : shape->as_array()) {
      const uint64_t dim = nonnegative_integer(d, name_, what + " shape entry");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t begin = nonnegative_integer(offsets->as_array()[0], name_, what + " begin offset");
    const uint64_t end = nonnegative_integer(offsets->as_array()[1], name_, what + " end offset");
    if (end < begin) {
      corrupt(name_, what + " data_offsets [" + std::to_string(begin) + ", " +
                         std::to_string(end) + "] end before they begin");
    }
    if (end > section_bytes) {
      corrupt(name_, what + " data_offsets [" + std::to_string(begin) + ", " +
                         std::to_string(end) + "] run past the data section (" +
                         std::to_string(section_bytes) + " bytes)");
    }
    uint64_t expected = 0;
    if (!tensor_bytes(t.shape, element_bytes, &expected) || expected != end - begin) {
      corrupt(name_, what + " of dtype " + t.dtype + " and shape " + shape_string(t.shape) +
                         " does not match its " + std::to_string(end - begin) + " data bytes");
    }
    t.data = section + begin;
    t.n_bytes = static_cast<size_t>(end - begin);
    if (t.n_bytes > 0) ranges.push_back({begin, end, tensors_.size()});
    index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      corrupt(name_, "tensors '" + tensors_[ranges[i - 1].tensor].name + "' and '" +
                         tensors_[ranges[i].tensor].name + "' overlap");
    }
  }
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string where = "write_safetensors '" + path + "': ";
  std::string header = "{";
  if (!metadata.empty()) {
    header += json_quote(kMetadataKey) + ":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ",";
      first = false;
      header += json_quote(key) + ":" + json_quote(value);
    }
    header += "}";
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsTensorView& t : tensors) {
    const std::string what = "tensor '" + t.name + "'";
    if (t.name == kMetadataKey || !names.insert(t.name).second) {
      fail(StatusCode::kInvalidArgument, where + what + " is a reserved or repeated name");
    }
    const size_t element_bytes = safetensors_dtype_bytes(t.dtype);
    if (element_bytes == 0) {
      fail(StatusCode::kInvalidArgument, where + what + " has unknown dtype '" + t.dtype + "'");
    }
    uint64_t expected = 0;
    if (!tensor_bytes(t.shape, element_bytes, &expected) || expected != t.n_bytes) {
      fail(StatusCode::kInvalidArgument, where + what + " of dtype " + t.dtype + " and shape " +
                                             shape_string(t.shape) + " does not match its " +
                                             std::to_string(t.n_bytes) + " bytes");
    }
    if (t.n_bytes > 0 && t.data == nullptr) {
      fail(StatusCode::kInvalidArgument, where + what + " has no data");
    }
    if (header.size() > 1) header += ",";
    header += json_quote(t.name) + ":{\"dtype\":" + json_quote(t.dtype) + ",\"shape\":" +
              shape_string(t.shape) + ",\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.n_bytes) + "]}";
    offset += t.n_bytes;
  }
  header += "}";
  header.resize((header.size() + 7) / 8 * 8, ' ');

  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) {
    const int err = errno;
    fail(StatusCode::kIo, where + "cannot create the file: " + std::strerror(err));
  }
  const uint64_t header_bytes = header.size();
  bool ok = std::fwrite(&header_bytes, 8, 1, out) == 1 &&
            std::fwrite(header.data(), 1, header.size(), out) == header.size();
  for (const SafetensorsTensorView& t : tensors) {
    if (ok && t.n_bytes > 0) ok = std::fwrite(t.data, 1, t.n_bytes, out) == t.n_bytes;
  }
  int err = ok ? 0 : errno;
  if (std::fclose(out) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) std::remove(path.c_str());
    fail(StatusCode::kIo, where + "write failed: " + std::strerror(err));
  }
}

}  // namespace certkv::format
