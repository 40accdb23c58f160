// The CUDA backend in a build without CUDA (CERTKV_CUDA off): it refuses, saying why.
#include "backend/cuda/cuda_backend.h"

#include "core/status.h"

namespace certkv::backend {

std::unique_ptr<Backend> make_cuda_backend(const model::Model&, const BackendConfig&) {
  fail(StatusCode::kUnsupported,
       "the cuda backend is not in this build (configure with -DCERTKV_CUDA=ON where nvcc is installed)");
}

}  // namespace certkv::backend
