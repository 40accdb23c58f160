// What a device call returns: device code reports failures (bad shapes, out of device memory, a
// failed launch) as a status with a message instead of throwing, so that a caller on either side
// of the C API can turn it into its own error. Shared by the CUDA halves of every layer.
#pragma once

#include <string>

#include "core/status.h"

namespace certkv {

struct CudaStatus {
  bool ok = true;
  StatusCode code = StatusCode::kOk;
  std::string message;
};

inline CudaStatus cuda_error(StatusCode code, const std::string& message) {
  return CudaStatus{false, code, message};
}

// Throws certkv::Error with the status's code and message when it is not ok.
inline void throw_if_failed(const CudaStatus& status) {
  if (!status.ok) fail(status.code, status.message);
}

}  // namespace certkv
