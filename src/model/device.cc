#include <string>

#include "core/status.h"
#include "model/device_decode.h"

namespace certkv::model {

const char* device_name(Device device) { return device == Device::kCuda ? "cuda" : "cpu"; }

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  fail(StatusCode::kInvalidArgument, "unknown device '" + std::string(name) + "' (known: cpu, cuda)");
}

}  // namespace certkv::model
