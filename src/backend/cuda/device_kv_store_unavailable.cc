// The device KV store in a build without CUDA (CERTKV_CUDA off): it refuses, saying why.
#include "backend/cuda/device_kv_store.h"

#include "core/status.h"

namespace certkv::backend::cuda {

std::unique_ptr<DeviceKvStore> make_device_kv_store(const DeviceKvStoreConfig&, LayerCalibrator, gate::Telemetry&) {
  fail(StatusCode::kUnsupported,
       "device cuda: this build of certkv has no CUDA backend (configure with -DCERTKV_CUDA=ON where nvcc is "
       "installed)");
}

}  // namespace certkv::backend::cuda
