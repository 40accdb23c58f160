#include "backend/cuda/device_matmul.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend/cuda/forward_kernels.h"
#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"

namespace certkv::backend::cuda {

std::vector<float> dequantized_weights(const model::WeightMatrix& w) {
  std::vector<float> out(size_t(w.n_in) * size_t(w.n_out));
  for (int64_t o = 0; o < w.n_out; ++o)
    model::dequantize_row(w.type, w.data + size_t(o) * w.row_bytes, &out[size_t(o) * size_t(w.n_in)], w.n_in);
  return out;
}

CudaStatus upload_matrix(const model::WeightMatrix& w, DeviceMatrix* out) { return upload_stacked({&w}, out); }

CudaStatus upload_stacked(const std::vector<const model::WeightMatrix*>& ws, DeviceMatrix* out) {
  if (!out || ws.empty()) return cuda_error(StatusCode::kInvalidArgument, "upload_matrix: no matrix or no output");
  int64_t n_out = 0;
  for (const model::WeightMatrix* w : ws) {
    if (!w || !w->data || w->n_in < 1 || w->n_out < 1)
      return cuda_error(StatusCode::kInvalidArgument, "upload_matrix: an empty weight matrix");
    if (w->n_in != ws[0]->n_in)
      return cuda_error(StatusCode::kInvalidArgument, "upload_matrix: stacked matrices of different input widths (" +
                                                          std::to_string(w->n_in) + ", " +
                                                          std::to_string(ws[0]->n_in) + ")");
    n_out += w->n_out;
  }
  const int64_t n_in = ws[0]->n_in;
  const size_t n = size_t(n_in) * size_t(n_out);
  std::vector<uint16_t> terms(2 * n);
  size_t at = 0;
  for (const model::WeightMatrix* w : ws) {
    std::vector<float> values;
    try {
      values = dequantized_weights(*w);
    } catch (const Error& e) {
      return cuda_error(e.code(), std::string("upload_matrix: ") + e.what());
    }
    for (size_t i = 0; i < values.size(); ++i, ++at) {
      const uint16_t hi = format::float_to_bf16(values[i]);
      terms[at] = hi;
      terms[n + at] = format::float_to_bf16(values[i] - format::bf16_to_float(hi));
    }
  }
  CudaStatus s = cache::cuda::DeviceBuffer::allocate(terms.size() * sizeof(uint16_t), &out->data);
  if (s.ok) s = out->data.upload(0, terms.data(), terms.size() * sizeof(uint16_t));
  out->n_in = n_in;
  out->n_out = n_out;
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
  constexpr size_t kWorkspaceBytes = size_t(32) << 20;
  CudaStatus s = cache::cuda::DeviceBuffer::allocate(kWorkspaceBytes, &m->workspace_);
  if (!s.ok) return s;
  st = cublasSetWorkspace(h, m->workspace_.data(), kWorkspaceBytes);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS workspace: ") + cublasGetStatusString(st));
  *out = std::move(m);
  return {};
}

DeviceMatmul::~DeviceMatmul() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

int64_t DeviceMatmul::lo_product_offset(int64_t n_out) { return (2 * kProductRows * n_out + 63) / 64 * 64; }

CudaStatus DeviceMatmul::gemm(const uint16_t* w, int64_t n_in, int64_t n_out, const uint16_t* x, int64_t rows,
                              float* y) {
  // Column-major: Y^T [n_out x rows] = W [n_in x n_out]^T X^T [n_in x rows].
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st =
      cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, int(n_out), int(rows), int(n_in),
                   &alpha, w, CUDA_R_16BF, int(n_in), x, CUDA_R_16BF, int(n_in), &beta, y, CUDA_R_32F, int(n_out),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("device matmul: cuBLAS: ") + cublasGetStatusString(st));
  return {};
}

CudaStatus DeviceMatmul::multiply(const DeviceMatrix& w, const float* x, int64_t rows, float* y) {
  if (rows < 0 || !x || !y || !w.data.data())
    return cuda_error(StatusCode::kInvalidArgument, "device matmul: null weights, rows or output, or rows < 0");
  if (rows == 0) return {};
  CudaStatus s = reserve(w.n_in, w.n_out);
  if (!s.ok) return s;
  const uint16_t* w_hi = reinterpret_cast<const uint16_t*>(w.data.data());
  const uint16_t* w_lo = w_hi + w.n_in * w.n_out;
  // Chunks of at most kProductRows rows, each its own split and products (a row's result then
  // comes from a product of 1 to kProductRows rows, whatever the step's row count).
  for (int64_t r0 = 0; r0 < rows && s.ok; r0 += kProductRows) {
    const int64_t m = std::min(kProductRows, rows - r0);
    uint16_t* terms = reinterpret_cast<uint16_t*>(split_.data());  // [2][m][n_in]: x_hi, x_lo
    float* t = reinterpret_cast<float*>(partial_.data());            // [2][m][n_out]: W_hi x_hi, W_hi x_lo
    float* u = t + lo_product_offset(w.n_out);                       // [m][n_out]: W_lo x_hi
    s = split_bf16_rows(x + r0 * w.n_in, m, int(w.n_in), terms, stream_);
    if (s.ok) s = gemm(w_hi, w.n_in, w.n_out, terms, 2 * m, t);
    if (s.ok) s = gemm(w_lo, w.n_in, w.n_out, terms, m, u);
    if (s.ok) s = sum_split_products(t, u, m, int(w.n_out), y + r0 * w.n_out, stream_);
  }
  return s;
}

CudaStatus DeviceMatmul::reserve(int64_t n_in, int64_t n_out) {
  // Room for whole chunks: the third product's output sits at a fixed offset (its alignment,
  // which cuBLAS may choose a kernel by, never depends on the chunk's rows).
  const size_t split_bytes = size_t(kProductRows) * size_t(n_in) * 2 * sizeof(uint16_t);
  const size_t partial_bytes = (size_t(lo_product_offset(n_out)) + size_t(kProductRows) * size_t(n_out)) * sizeof(float);
  if (split_.size() >= split_bytes && partial_.size() >= partial_bytes) return {};
  // An earlier product may still read the old scratch.
  CudaStatus s = cache::cuda::synchronize_stream(stream_);
  if (s.ok && split_.size() < split_bytes) s = cache::cuda::DeviceBuffer::allocate(split_bytes, &split_);
  if (s.ok && partial_.size() < partial_bytes) s = cache::cuda::DeviceBuffer::allocate(partial_bytes, &partial_);
  ++generation_;
  return s;
}

void device_matmul_ref(const float* w, int64_t n_in, int64_t n_out, const float* x, int64_t rows, double* y) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t o = 0; o < n_out; ++o) {
      double sum = 0;
      for (int64_t i = 0; i < n_in; ++i) sum += double(x[t * n_in + i]) * double(w[o * n_in + i]);
      y[t * n_out + o] = sum;
    }
}

}  // namespace certkv::backend::cuda
