// Page encoding of device memory in a build without CUDA (CERTKV_CUDA off): it refuses, saying why.
#include "backend/cuda/device_page_codecs.h"

#include "core/status.h"

namespace certkv::backend::cuda {
namespace {

[[noreturn]] void refuse() {
  fail(StatusCode::kUnsupported,
       "device page encode: this build of certkv has no CUDA backend (configure with -DCERTKV_CUDA=ON where nvcc is "
       "installed)");
}

}  // namespace

void encode_gaac_pages_on_device(const DeviceGaacPages&, const void*, int64_t, uint8_t*, uint32_t*, void*) { refuse(); }

void encode_lossy_pages_on_device(const codec::LossyPageSpec&, uint32_t, const uint16_t*, int64_t, uint8_t*, uint8_t*,
                                  void*) {
  refuse();
}

}  // namespace certkv::backend::cuda
