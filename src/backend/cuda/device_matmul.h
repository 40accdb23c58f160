// Weight products on a CUDA device for the CUDA backend's whole forward pass: a GGUF weight
// matrix dequantized once at load (model::dequantize_row, then rounded to bf16 with
// format::float_to_bf16) and kept on the device, multiplied with bf16 activation rows by cuBLAS
// (bf16 inputs, fp32 accumulation and output: the products of bf16 values are exact in fp32,
// the sums are fp32 in cuBLAS's order).
//   y[t][o] = sum_i x[t][i] W[o][i],  t < rows, o < n_out
// Reference: device_matmul_ref (the same bf16 weights and activations, sums in double).
// Thread safety: one owner; launches go to the stream given at create.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/cuda/device_pool.h"
#include "core/cuda_status.h"
#include "model/matmul.h"

namespace certkv::backend::cuda {

// One weight matrix on the device: n_out rows of n_in bf16 values.
struct DeviceMatrix {
  cache::cuda::DeviceBuffer data;
  int64_t n_in = 0, n_out = 0;
};

// The bf16 values a DeviceMatrix holds for w, on the host: [n_out][n_in].
std::vector<uint16_t> bf16_weights(const model::WeightMatrix& w);

// Uploads bf16_weights(w). kUnsupported for a type model::dequantize_row does not read,
// kOutOfMemory when the device cannot hold it.
CudaStatus upload_matrix(const model::WeightMatrix& w, DeviceMatrix* out);

class DeviceMatmul {
 public:
  // kInternal when cuBLAS cannot start (its status named).
  static CudaStatus create(void* stream, std::unique_ptr<DeviceMatmul>* out);
  ~DeviceMatmul();
  DeviceMatmul(const DeviceMatmul&) = delete;
  DeviceMatmul& operator=(const DeviceMatmul&) = delete;

  // y = x W^T: x [rows][w.n_in] bf16, y [rows][w.n_out] float (device pointers). Enqueued on the
  // stream. kInvalidArgument for null pointers or rows < 0.
  CudaStatus multiply(const DeviceMatrix& w, const uint16_t* x, int64_t rows, float* y);

 private:
  DeviceMatmul() = default;
  void* handle_ = nullptr;  // cublasHandle_t
  void* stream_ = nullptr;
};

// y[t][o] = sum_i bf16 x[t][i] * bf16 w[o][i] in double; x, w as bf16 bit patterns on the host.
void device_matmul_ref(const uint16_t* w, int64_t n_in, int64_t n_out, const uint16_t* x, int64_t rows, double* y);

}  // namespace certkv::backend::cuda
