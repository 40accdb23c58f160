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

bool device_route_serves(cache::KvScheme scheme) {
  using cache::KvScheme;
  switch (scheme) {
    case KvScheme::kBf16:
    case KvScheme::kGaac:
    case KvScheme::kGaacE5M2:
    case KvScheme::kFp8E4M3:
    case KvScheme::kFp8E5M2:
    case KvScheme::kDither8: return true;
    default: return false;
  }
}

void refuse_unserved_scheme(cache::KvScheme scheme) {
  if (!device_route_serves(scheme))
    fail(StatusCode::kUnsupported, std::string("device cuda: KV scheme ") + cache::kv_scheme_name(scheme) +
                                       " is not served on the device yet (bf16, gaac, gaac-e5m2, fp8-e4m3, fp8-e5m2, "
                                       "dither8 are)");
}

}  // namespace certkv::model
