// The C API's safetensors files: writing (certkv dump-kv writes KV dumps with it) and reading
// (the Python package reads KV dumps with it).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "api/api_status.h"
#include "certkv/certkv.h"
#include "format/safetensors.h"

using certkv::api::guarded;
using certkv::api::set_error;

// A parsed file and its metadata as an array, for access by index.
struct certkv_safetensors {
  std::unique_ptr<certkv::format::SafetensorsFile> file;
  std::vector<std::pair<std::string, std::string>> metadata;  // ascending keys
};

extern "C" {

certkv_status certkv_safetensors_write(const char* path, const certkv_tensor_view* tensors,
                                       size_t n_tensors, const certkv_metadata_entry* metadata,
                                       size_t n_metadata) {
  CERTKV_REQUIRE(path != nullptr, "certkv_safetensors_write: null path");
  CERTKV_REQUIRE(tensors != nullptr || n_tensors == 0, "certkv_safetensors_write: null tensors");
  CERTKV_REQUIRE(metadata != nullptr || n_metadata == 0, "certkv_safetensors_write: null metadata");
  std::vector<certkv::format::SafetensorsTensorView> views;
  for (size_t i = 0; i < n_tensors; ++i) {
    const certkv_tensor_view& t = tensors[i];
    const std::string where = "certkv_safetensors_write: tensor " + std::to_string(i);
    CERTKV_REQUIRE(t.name != nullptr && t.dtype != nullptr, where + ": null name or dtype");
    CERTKV_REQUIRE(t.n_dims >= 0 && t.n_dims <= 8, where + " '" + t.name + "': n_dims " +
                                                       std::to_string(t.n_dims) + " is not in [0, 8]");
    CERTKV_REQUIRE(t.shape != nullptr || t.n_dims == 0, where + " '" + t.name + "': null shape");
    CERTKV_REQUIRE(t.data != nullptr || t.n_bytes == 0, where + " '" + t.name + "': null data");
    views.push_back({t.name, t.dtype, std::vector<int64_t>(t.shape, t.shape + t.n_dims), t.data, t.n_bytes});
  }
  std::map<std::string, std::string> meta;
  for (size_t i = 0; i < n_metadata; ++i) {
    CERTKV_REQUIRE(metadata[i].key != nullptr && metadata[i].value != nullptr,
                   "certkv_safetensors_write: metadata entry " + std::to_string(i) + " has a null key or value");
    CERTKV_REQUIRE(meta.emplace(metadata[i].key, metadata[i].value).second,
                   std::string("certkv_safetensors_write: metadata key '") + metadata[i].key + "' given twice");
  }
  return guarded([&] { certkv::format::write_safetensors(path, views, meta); });
}

certkv_status certkv_safetensors_open(const char* path, certkv_safetensors** out) {
  CERTKV_REQUIRE(path != nullptr && out != nullptr, "certkv_safetensors_open: null path or out");
  *out = nullptr;
  return guarded([&] {
    auto f = std::make_unique<certkv_safetensors>();
    f->file = certkv::format::SafetensorsFile::open(path);
    f->metadata.assign(f->file->metadata().begin(), f->file->metadata().end());
    *out = f.release();
  });
}

void certkv_safetensors_free(certkv_safetensors* file) { delete file; }

certkv_status certkv_safetensors_count(const certkv_safetensors* file, size_t* n_tensors, size_t* n_metadata) {
  CERTKV_REQUIRE(file != nullptr && n_tensors != nullptr && n_metadata != nullptr,
                 "certkv_safetensors_count: null file, n_tensors or n_metadata");
  *n_tensors = file->file->tensors().size();
  *n_metadata = file->metadata.size();
  return CERTKV_OK;
}

certkv_status certkv_safetensors_tensor(const certkv_safetensors* file, size_t index, certkv_tensor_view* out) {
  CERTKV_REQUIRE(file != nullptr && out != nullptr, "certkv_safetensors_tensor: null file or out");
  const auto& tensors = file->file->tensors();
  if (index >= tensors.size())
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "certkv_safetensors_tensor: index " + std::to_string(index) +
                                                  " is past the " + std::to_string(tensors.size()) + " tensors");
  const certkv::format::SafetensorsTensor& t = tensors[index];
  *out = {t.name.c_str(), t.dtype.c_str(), t.shape.data(), int32_t(t.shape.size()), t.data, t.n_bytes};
  return CERTKV_OK;
}

certkv_status certkv_safetensors_metadata(const certkv_safetensors* file, size_t index, certkv_metadata_entry* out) {
  CERTKV_REQUIRE(file != nullptr && out != nullptr, "certkv_safetensors_metadata: null file or out");
  if (index >= file->metadata.size())
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "certkv_safetensors_metadata: index " + std::to_string(index) +
                                                  " is past the " + std::to_string(file->metadata.size()) +
                                                  " entries");
  *out = {file->metadata[index].first.c_str(), file->metadata[index].second.c_str()};
  return CERTKV_OK;
}

}  // extern "C"
