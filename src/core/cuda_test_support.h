// For the CUDA test binaries: whether a device is here, the skip-or-fail rule, and device bytes
// owned by a test. Without a device the device cases skip (CI has none), unless the environment
// sets CERTKV_REQUIRE_DEVICE (scripts/run_cuda_tests.sh --run does): there a missing device, or
// a route that refuses to start, is a failure rather than a silent skip.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstddef>
#include <cstdint>

namespace certkv::testing {

inline bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline bool cuda_device_required() {
  const char* v = std::getenv("CERTKV_REQUIRE_DEVICE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// Device bytes owned by a test.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  void upload(const void* host, size_t n) {
    EXPECT_EQ(cudaMemcpy(data_, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(void* host, size_t n) const {
    EXPECT_EQ(cudaMemcpy(host, data_, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* data_ = nullptr;
};

}  // namespace certkv::testing

// In a test body: skip without a device, or fail when the run requires one.
#define CERTKV_NEED_CUDA_DEVICE()                                                          \
  do {                                                                                     \
    if (!::certkv::testing::cuda_device_present()) {                                       \
      if (::certkv::testing::cuda_device_required()) GTEST_FAIL() << "no CUDA device";     \
      GTEST_SKIP() << "no CUDA device: run these tests on the GPU machine";                \
    }                                                                                      \
  } while (0)
