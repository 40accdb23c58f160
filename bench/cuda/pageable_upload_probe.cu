// Whether a cudaMemcpyAsync from pageable host memory waits for the stream's earlier work on this
// device and driver (the CUDA documentation says only that the driver "may" synchronize with the
// stream to stage such a copy). The device caches upload block tables and encode tasks from
// pageable vectors in the middle of a step; if each such copy waits for the kernels enqueued before
// it, the host cannot run ahead of the device in those steps.
//
// For each size, a kernel that spins about 20 ms is enqueued, then one copy of that many bytes
// (contiguous, or 2D as the block tables go up) from pageable, then from page-locked memory; the host time the copy call took
// is printed (about 20 ms: it waited for the kernel; microseconds: it did not), with the time the
// stream then took to finish. One JSON line per (copy, size, memory); then the cost of a
// cudaPointerGetAttributes call. Not part of the build; run it by hand on the device:
//   nvcc -O2 -std=c++17 bench/cuda/pageable_upload_probe.cu -o /tmp/pageable_probe && /tmp/pageable_probe
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "pageable_upload_probe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device properties");
  int driver = 0;
  check(cudaDriverGetVersion(&driver), "driver version");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  // About 20 ms of spinning at the SM clock.
  int clock_khz = 0;
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0), "clock rate");
  const long long cycles = static_cast<long long>(clock_khz) * 20;
  const size_t sizes[] = {64, 4096, 65536, size_t(1) << 20};
  void* device = nullptr;
  check(cudaMalloc(&device, sizes[3]), "device buffer");
  std::vector<unsigned char> pageable(sizes[3], 1);
  void* pinned = nullptr;
  check(cudaMallocHost(&pinned, sizes[3]), "page-locked buffer");
  std::memset(pinned, 1, sizes[3]);
  // shape 0: one contiguous copy of `bytes`; shape 1: a 2D copy of 16 rows of bytes / 16 at a 4 KiB
  // pitch (the caches' block-table upload: the new blocks' entries of every table of a slot).
  for (int round = 0; round < 2; ++round)  // the first round warms every path up
    for (const int shape : {0, 1})
      for (const size_t bytes : sizes)
        for (const bool is_pinned : {false, true}) {
          if (shape == 1 && bytes / 16 > 4096) continue;
          const void* src = is_pinned ? pinned : static_cast<const void*>(pageable.data());
          spin<<<1, 1, 0, stream>>>(cycles);
          check(cudaGetLastError(), "spin launch");
          const auto t0 = std::chrono::steady_clock::now();
          if (shape == 0)
            check(cudaMemcpyAsync(device, src, bytes, cudaMemcpyHostToDevice, stream), "copy");
          else
            check(cudaMemcpy2DAsync(device, 4096, src, 4096, bytes / 16, 16, cudaMemcpyHostToDevice, stream), "2D copy");
          const double call_ms = ms_since(t0);
          check(cudaStreamSynchronize(stream), "synchronize");
          const double total_ms = ms_since(t0);
          if (round == 1)
            std::printf("{\"gpu\": \"%s\", \"driver\": %d, \"copy\": \"%s\", \"bytes\": %zu, \"memory\": \"%s\", "
                        "\"copy_call_ms\": %.4f, \"until_stream_done_ms\": %.3f, \"waited_for_kernel\": %s}\n",
                        prop.name, driver, shape == 0 ? "cudaMemcpyAsync" : "cudaMemcpy2DAsync", bytes,
                        is_pinned ? "pinned" : "pageable", call_ms, total_ms, call_ms > 0.5 * total_ms ? "true" : "false");
        }
  // What asking the driver where a pointer lives costs (the device caches asked it of every write's
  // K and V rows, twice a sequence and layer of a step, until the callers said so).
  for (const bool on_device : {true, false}) {
    constexpr int kCalls = 20000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) {
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, on_device ? device : static_cast<const void*>(pageable.data())) != cudaSuccess)
        cudaGetLastError();
    }
    std::printf("{\"gpu\": \"%s\", \"call\": \"cudaPointerGetAttributes\", \"pointer\": \"%s\", \"us_per_call\": %.3f}\n",
                prop.name, on_device ? "device" : "pageable", 1e3 * ms_since(t0) / kCalls);
  }
  check(cudaFreeHost(pinned), "free page-locked");
  check(cudaFree(device), "free device");
  check(cudaStreamDestroy(stream), "destroy stream");
  return 0;
}
