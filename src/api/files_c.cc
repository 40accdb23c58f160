// The C API's file writers: safetensors (certkv dump-kv writes KV dumps with it).
#include <map>
#include <string>
#include <vector>

#include "api/api_status.h"
#include "certkv/certkv.h"
#include "format/safetensors.h"

using certkv::api::guarded;
using certkv::api::set_error;

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

}  // extern "C"
