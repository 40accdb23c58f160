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

bool device_route_serves(cache::KvScheme scheme) { return cache::kv_scheme_info(scheme).cuda_route; }

void refuse_unserved(const DeviceDecoderConfig& config) {
  if (!device_route_serves(config.scheme))
    fail(StatusCode::kUnsupported,
         std::string("device cuda: KV scheme ") + cache::kv_scheme_name(config.scheme) +
             " is not served on the device yet (" +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_route; }) + " are)");
  if (config.sparse && !cache::kv_scheme_info(config.scheme).cuda_sparse)
    fail(StatusCode::kUnsupported,
         "device cuda: sparse decode on the device reads " +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_sparse; }) +
             " pages, not KV scheme " + cache::kv_scheme_name(config.scheme) + " (use --kv " +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_sparse; }) +
             " or --device cpu)");
  if (config.sparse && config.max_tokens >= (int64_t(1) << 24))
    fail(StatusCode::kUnsupported, "device cuda: sparse decode serves contexts below 2^24 tokens");
}

}  // namespace certkv::model
