// A C++ program on certkv's installed C++ API (certkv/certkv.hpp, RAII over the C API): the KV
// schemes the library serves, and a failure that arrives as certkv::ApiError. It loads no model.
#include <cstdio>
#include <cstring>
#include <string>

#include "certkv/certkv.hpp"

int main() {
  std::printf("certkv %s\n", certkv_version());

  // The scheme table: every scheme has a name and a meter tier; bf16 and gaac are lossless.
  const int32_t n_schemes = certkv_kv_scheme_count();
  int lossless = 0;
  int cuda_route = 0;
  for (int32_t i = 0; i < n_schemes; ++i) {
    certkv_kv_scheme_info info;
    certkv::check(certkv_kv_scheme_get(i, &info));
    std::printf("  %-16s meter %-4s %s\n", info.name, info.meter_tier, info.lossless ? "lossless" : "");
    lossless += info.lossless;
    cuda_route += info.cuda_route;
  }
  if (n_schemes < 2 || lossless < 2) {
    std::fprintf(stderr, "cpp_consumer: %d schemes, %d lossless; expected bf16 and gaac at least\n",
                 n_schemes, lossless);
    return 1;
  }
  // An index past the table is refused.
  certkv_kv_scheme_info past;
  if (certkv_kv_scheme_get(n_schemes, &past) != CERTKV_ERR_INVALID_ARGUMENT) {
    std::fprintf(stderr, "cpp_consumer: scheme %d past the table was not refused\n", n_schemes);
    return 1;
  }
#ifdef CERTKV_HAS_CUDA
  // Linked through certkv::cuda: the library carries the CUDA backend's device route.
  std::printf("CUDA backend: %d schemes served on the device\n", cuda_route);
  if (cuda_route == 0) return 1;
#endif

  // A missing model: certkv::ApiError with the status and the message naming the file.
  const std::string missing = "/nonexistent/certkv-cpp-consumer/model.gguf";
  try {
    certkv::Model model(missing);
    std::fprintf(stderr, "cpp_consumer: loading %s did not fail\n", missing.c_str());
    return 1;
  } catch (const certkv::ApiError& e) {
    std::printf("certkv::Model(missing): %s: %s\n", certkv_status_string(e.status()), e.what());
    if (e.status() != CERTKV_ERR_NOT_FOUND || std::strstr(e.what(), missing.c_str()) == nullptr) {
      std::fprintf(stderr, "cpp_consumer: expected not found naming %s\n", missing.c_str());
      return 1;
    }
  }
  std::printf("cpp_consumer: ok\n");
  return 0;
}
