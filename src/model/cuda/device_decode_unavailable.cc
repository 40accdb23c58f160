// The device route in a build without CUDA (CERTKV_CUDA off).
#include "core/status.h"
#include "model/device_decode.h"

namespace certkv::model {

std::unique_ptr<DeviceDecoder> make_device_decoder(const DeviceDecoderConfig& config) {
  refuse_unserved(config);
  fail(StatusCode::kUnsupported, "device cuda: this build of certkv has no CUDA backend (configure with "
                                 "-DCERTKV_CUDA=ON where nvcc is installed)");
}

}  // namespace certkv::model
