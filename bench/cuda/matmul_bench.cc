// The device weight products (backend/cuda/device_matmul.h) timed per kernel and row count on
// Qwen2.5-0.5B's shapes, and checked for batch invariance: row 0 of every count must carry the
// bits of row 0 alone. One JSON line per (kernel, shape, rows): the median of 10 timed products
// (CUDA events), TFLOP/s counted as the three bf16 products, and whether row 0 kept its bits.
// usage: certkv_cuda_matmul_bench [--rows 1,8,32,64,256,1024,4096]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/device_matmul.h"

using namespace certkv;
using namespace certkv::backend::cuda;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void check(const CudaStatus& s) {
  if (!s.ok) {
    std::fprintf(stderr, "%s\n", s.message.c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> counts = {1, 8, 32, 64, 256, 1024, 4096};
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--rows") {
      counts.clear();
      std::stringstream in(argv[i + 1]);
      std::string part;
      while (std::getline(in, part, ',')) counts.push_back(std::stoll(part));
    }
  const int64_t max_rows = *std::max_element(counts.begin(), counts.end());
  const std::pair<int64_t, int64_t> shapes[] = {{896, 1152}, {896, 896}, {896, 9728}, {4864, 896}, {896, 151936}};
  struct Kernel {
    const char* name;
    ProductKernel kernel;
    int64_t pin_rows;
  };
  const Kernel kernels[] = {{"heuristic", ProductKernel::kHeuristic, 64},
                            {"pinned", ProductKernel::kPinned, 64},
                            {"pinned", ProductKernel::kPinned, 256},
                            {"pinned", ProductKernel::kPinned, 2048}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const auto& [n_in, n_out] : shapes) {
    std::vector<float> w(static_cast<size_t>(n_in * n_out)), x(static_cast<size_t>(max_rows * n_in));
    for (float& v : w) v = 0.05f * normal(rng);
    for (float& v : x) v = normal(rng);
    model::WeightMatrix wm;
    wm.type = format::GgmlType::kF32;
    wm.data = reinterpret_cast<const uint8_t*>(w.data());
    wm.n_in = n_in;
    wm.n_out = n_out;
    wm.row_bytes = size_t(n_in) * 4;
    DeviceMatrix dm;
    check(upload_matrix(wm, &dm));
    float *dx = nullptr, *dy = nullptr;
    check(cudaMalloc(&dx, x.size() * 4), "cudaMalloc");
    check(cudaMalloc(&dy, size_t(max_rows * n_out) * 4), "cudaMalloc");
    check(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice), "upload");
    for (const Kernel& k : kernels) {
      std::unique_ptr<DeviceMatmul> mm;
      const CudaStatus made = DeviceMatmul::create(nullptr, &mm, k.kernel, k.pin_rows);
      if (made.ok) {
        const CudaStatus r = mm->reserve(n_in, n_out);
        if (!r.ok) {
          std::printf("{\"kernel\": \"%s\", \"pin_rows\": %lld, \"n_in\": %lld, \"n_out\": %lld, \"error\": \"%s\"}\n",
                      k.name, (long long)k.pin_rows, (long long)n_in, (long long)n_out, r.message.c_str());
          continue;
        }
      } else {
        check(made);
      }
      std::vector<float> alone(static_cast<size_t>(n_out)), row0(static_cast<size_t>(n_out));
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      for (const int64_t rows : counts) {
        check(mm->multiply(dm, dx, rows, dy));
        check(cudaMemcpy(row0.data(), dy, row0.size() * 4, cudaMemcpyDeviceToHost), "download");
        if (rows == counts.front()) alone = row0;
        const bool same = std::memcmp(row0.data(), alone.data(), row0.size() * 4) == 0;
        std::vector<float> ms;
        for (int rep = 0; rep < 12; ++rep) {
          cudaEventRecord(a);
          check(mm->multiply(dm, dx, rows, dy));
          cudaEventRecord(b);
          cudaEventSynchronize(b);
          float t = 0;
          cudaEventElapsedTime(&t, a, b);
          if (rep >= 2) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const double med = ms[ms.size() / 2];
        std::printf("{\"kernel\": \"%s\", \"pin_rows\": %lld, \"n_in\": %lld, \"n_out\": %lld, \"rows\": %lld, "
                    "\"ms\": %.4f, \"tflops_3_products\": %.2f, \"row0_bits_as_alone\": %s}\n",
                    k.name, (long long)k.pin_rows, (long long)n_in, (long long)n_out, (long long)rows, med,
                    3.0 * 2.0 * double(n_in) * double(n_out) * double(rows) / (med * 1e-3) / 1e12,
                    same ? "true" : "false");
        std::fflush(stdout);
      }
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  return 0;
}
