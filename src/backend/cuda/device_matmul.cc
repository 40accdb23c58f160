#include "backend/cuda/device_matmul.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"

namespace certkv::backend::cuda {

std::vector<uint16_t> bf16_weights(const model::WeightMatrix& w) {
  std::vector<uint16_t> out(size_t(w.n_in) * size_t(w.n_out));
  std::vector<float> row(size_t(w.n_in));
  for (int64_t o = 0; o < w.n_out; ++o) {
    model::dequantize_row(w.type, w.data + size_t(o) * w.row_bytes, row.data(), w.n_in);
    for (int64_t i = 0; i < w.n_in; ++i) out[size_t(o) * size_t(w.n_in) + size_t(i)] = format::float_to_bf16(row[size_t(i)]);
  }
  return out;
}

CudaStatus upload_matrix(const model::WeightMatrix& w, DeviceMatrix* out) {
  if (!out || !w.data || w.n_in < 1 || w.n_out < 1)
    return cuda_error(StatusCode::kInvalidArgument, "upload_matrix: an empty weight matrix or no output");
  std::vector<uint16_t> host;
  try {
    host = bf16_weights(w);
  } catch (const Error& e) {
    return cuda_error(e.code(), std::string("upload_matrix: ") + e.what());
  }
  CudaStatus s = cache::cuda::DeviceBuffer::allocate(host.size() * sizeof(uint16_t), &out->data);
  if (s.ok) s = out->data.upload(0, host.data(), host.size() * sizeof(uint16_t));
  out->n_in = w.n_in;
  out->n_out = w.n_out;
  return s;
}

CudaStatus DeviceMatmul::create(void* stream, std::unique_ptr<DeviceMatmul>* out) {
  std::unique_ptr<DeviceMatmul> m(new DeviceMatmul());
  cublasHandle_t h = nullptr;
  cublasStatus_t st = cublasCreate(&h);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS did not start: ") + cublasGetStatusString(st));
  m->handle_ = h;
  m->stream_ = stream;
  st = cublasSetStream(h, static_cast<cudaStream_t>(stream));
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS stream: ") + cublasGetStatusString(st));
  *out = std::move(m);
  return {};
}

DeviceMatmul::~DeviceMatmul() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

CudaStatus DeviceMatmul::multiply(const DeviceMatrix& w, const uint16_t* x, int64_t rows, float* y) {
  if (rows < 0 || !x || !y || !w.data.data())
    return cuda_error(StatusCode::kInvalidArgument, "device matmul: null weights, rows or output, or rows < 0");
  if (rows == 0) return {};
  // Column-major: Y^T [n_out x rows] = W [n_in x n_out]^T X^T [n_in x rows].
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st =
      cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, int(w.n_out), int(rows), int(w.n_in),
                   &alpha, w.data.data(), CUDA_R_16BF, int(w.n_in), x, CUDA_R_16BF, int(w.n_in), &beta, y, CUDA_R_32F,
                   int(w.n_out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("device matmul: cuBLAS: ") + cublasGetStatusString(st));
  return {};
}

void device_matmul_ref(const uint16_t* w, int64_t n_in, int64_t n_out, const uint16_t* x, int64_t rows, double* y) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      double sum = 0;
      for (int64_t i = 0; i < n_in; ++i)
        sum += double(format::bf16_to_float(x[t * n_in + i])) * double(format::bf16_to_float(w[o * n_in + i]));
      y[t * n_out + o] = sum;
    }
}

}  // namespace certkv::backend::cuda
