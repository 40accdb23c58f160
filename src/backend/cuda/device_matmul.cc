#include "backend/cuda/device_matmul.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
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

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

CudaStatus lt_failed(const char* what, cublasStatus_t st) {
  return cuda_error(StatusCode::kInternal, std::string("device matmul: cuBLASLt ") + what + ": " + cublasGetStatusString(st));
}

// The descriptors of Y^T [n_out x rows] = W^T X^T in column-major (W stored [n_out][n_in] bf16,
// X [rows][n_in] bf16, Y [rows][n_out] float), fp32 accumulation.
struct LtProduct {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  LtProduct(int64_t n_in, int64_t n_out, int64_t rows) {
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (ok()) status = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (ok()) status = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (ok()) status = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (ok()) status = cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, uint64_t(n_in), uint64_t(n_out), n_in);
    if (ok()) status = cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, uint64_t(n_in), uint64_t(rows), n_in);
    if (ok()) status = cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, uint64_t(n_out), uint64_t(rows), n_out);
  }
  ~LtProduct() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  bool ok() const { return status == CUBLAS_STATUS_SUCCESS; }
};

}  // namespace

CudaStatus DeviceMatmul::create(void* stream, std::unique_ptr<DeviceMatmul>* out, ProductKernel kernel,
                                int64_t pin_rows) {
  if (pin_rows < 1 || pin_rows > 2 * kPinnedProductRows)
    return cuda_error(StatusCode::kInvalidArgument, "device matmul: pin_rows outside [1, " +
                                                        std::to_string(2 * kPinnedProductRows) + "]");
  std::unique_ptr<DeviceMatmul> m(new DeviceMatmul());
  m->kernel_ = kernel;
  m->pin_rows_ = pin_rows;
  cublasHandle_t h = nullptr;
  cublasStatus_t st = cublasCreate(&h);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS did not start: ") + cublasGetStatusString(st));
  m->handle_ = h;
  m->stream_ = stream;
  st = cublasSetStream(h, static_cast<cudaStream_t>(stream));
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS stream: ") + cublasGetStatusString(st));
  if (kernel == ProductKernel::kPinned) {
    cublasLtHandle_t lt = nullptr;
    st = cublasLtCreate(&lt);
    if (st != CUBLAS_STATUS_SUCCESS) return lt_failed("did not start", st);
    m->lt_handle_ = lt;
  }
  CudaStatus s = cache::cuda::DeviceBuffer::allocate(kWorkspaceBytes, &m->workspace_);
  if (!s.ok) return s;
  st = cublasSetWorkspace(h, m->workspace_.data(), kWorkspaceBytes);
  if (st != CUBLAS_STATUS_SUCCESS)
    return cuda_error(StatusCode::kInternal, std::string("cuBLAS workspace: ") + cublasGetStatusString(st));
  *out = std::move(m);
  return {};
}

DeviceMatmul::~DeviceMatmul() {
  if (lt_handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(lt_handle_));
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

int64_t DeviceMatmul::lo_product_offset(int64_t n_out) const { return (2 * chunk_rows() * n_out + 63) / 64 * 64; }

const DeviceMatmul::Pinned* DeviceMatmul::pinned(int64_t n_in, int64_t n_out) const {
  for (const Pinned& p : pinned_)
    if (p.n_in == n_in && p.n_out == n_out) return &p;
  return nullptr;
}

CudaStatus DeviceMatmul::pin(int64_t n_in, int64_t n_out) {
  if (pinned(n_in, n_out)) return {};
  cublasLtHandle_t lt = static_cast<cublasLtHandle_t>(lt_handle_);
  const LtProduct at_pin(n_in, n_out, pin_rows_), at_one(n_in, n_out, 1), at_most(n_in, n_out, 2 * kPinnedProductRows);
  if (!at_pin.ok()) return lt_failed("descriptors", at_pin.status);
  if (!at_one.ok()) return lt_failed("descriptors", at_one.status);
  if (!at_most.ok()) return lt_failed("descriptors", at_most.status);
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_failed("preference", st);
  const uint64_t ws = kWorkspaceBytes;
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t found[16] = {};
  int n_found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(lt, at_pin.op, at_pin.a, at_pin.b, at_pin.c, at_pin.c, pref, 16, found, &n_found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_failed("heuristic", st);
  // The first candidate that runs 1 to the most rows with split-K off.
  for (int i = 0; i < n_found; ++i) {
    cublasLtMatmulAlgo_t algo = found[i].algo;
    const int32_t one = 1;
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)) !=
            CUBLAS_STATUS_SUCCESS)
      continue;
    bool runs = true;
    for (const LtProduct* p : {&at_one, &at_pin, &at_most}) {
      cublasLtMatmulHeuristicResult_t check{};
      runs = runs && cublasLtMatmulAlgoCheck(lt, p->op, p->a, p->b, p->c, p->c, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
             check.workspaceSize <= kWorkspaceBytes;
    }
    if (!runs) continue;
    Pinned p;
    p.n_in = n_in;
    p.n_out = n_out;
    static_assert(sizeof(p.algo) == sizeof(algo));
    std::memcpy(p.algo, &algo, sizeof(algo));
    pinned_.push_back(p);
    return {};
  }
  return cuda_error(StatusCode::kInternal, "device matmul: cuBLASLt offers no algorithm for " + std::to_string(n_in) +
                                               " -> " + std::to_string(n_out) +
                                               " that runs every row count without split-K (" +
                                               std::to_string(n_found) + " candidates)");
}

CudaStatus DeviceMatmul::gemm(const uint16_t* w, int64_t n_in, int64_t n_out, const uint16_t* x, int64_t rows,
                              float* y) {
  // Column-major: Y^T [n_out x rows] = W [n_in x n_out]^T X^T [n_in x rows].
  const float alpha = 1.f, beta = 0.f;
  if (kernel_ == ProductKernel::kPinned) {
    const Pinned* p = pinned(n_in, n_out);
    if (!p) return cuda_error(StatusCode::kInternal, "device matmul: a product's shape was not pinned (reserve first)");
    const LtProduct d(n_in, n_out, rows);
    if (!d.ok()) return lt_failed("descriptors", d.status);
    cublasLtMatmulAlgo_t algo;
    std::memcpy(&algo, p->algo, sizeof(algo));
    const cublasStatus_t st = cublasLtMatmul(static_cast<cublasLtHandle_t>(lt_handle_), d.op, &alpha, w, d.a, x, d.b,
                                             &beta, y, d.c, y, d.c, &algo, workspace_.data(), kWorkspaceBytes,
                                             static_cast<cudaStream_t>(stream_));
    if (st != CUBLAS_STATUS_SUCCESS) return lt_failed("matmul", st);
    return {};
  }
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
  // Chunks of at most chunk_rows() rows, each its own split and products (a row's result then
  // comes from a product of 1 to chunk_rows() rows, whatever the step's row count). The pinned
  // kernel runs one algorithm for every row count; the heuristic kernel's products run at the whole
  // chunk's size, so that cuBLAS picks the same kernel whatever the chunk's rows (the columns past
  // them read stale scratch; a column's sums never read another's).
  const int64_t chunk = chunk_rows();
  for (int64_t r0 = 0; r0 < rows && s.ok; r0 += chunk) {
    const int64_t m = std::min(chunk, rows - r0);
    const int64_t run = kernel_ == ProductKernel::kPinned ? m : chunk;
    uint16_t* terms = reinterpret_cast<uint16_t*>(split_.data());  // [2][m][n_in]: x_hi, x_lo
    float* t = reinterpret_cast<float*>(partial_.data());            // [2][m][n_out]: W_hi x_hi, W_hi x_lo
    float* u = t + lo_product_offset(w.n_out);                       // [m][n_out]: W_lo x_hi
    s = split_bf16_rows(x + r0 * w.n_in, m, int(w.n_in), terms, stream_);
    if (s.ok) s = gemm(w_hi, w.n_in, w.n_out, terms, 2 * run, t);
    if (s.ok) s = gemm(w_lo, w.n_in, w.n_out, terms, run, u);
    if (s.ok) s = sum_split_products(t, u, m, int(w.n_out), y + r0 * w.n_out, stream_);
  }
  return s;
}

CudaStatus DeviceMatmul::products(const DeviceMatrix& w, const uint16_t* hi_lo, int64_t rows, const float** t,
                                  const float** u) {
  if (kernel_ != ProductKernel::kPinned || rows < 1 || rows > kPinnedProductRows || !hi_lo || !t || !u ||
      !w.data.data())
    return cuda_error(StatusCode::kInvalidArgument,
                      "device matmul: products() needs the pinned kernel, 1 to " + std::to_string(kPinnedProductRows) +
                          " rows, the input's terms and outputs");
  CudaStatus s = reserve(w.n_in, w.n_out);
  if (!s.ok) return s;
  const uint16_t* w_hi = reinterpret_cast<const uint16_t*>(w.data.data());
  const uint16_t* w_lo = w_hi + w.n_in * w.n_out;
  float* tt = reinterpret_cast<float*>(partial_.data());
  float* uu = tt + lo_product_offset(w.n_out);
  s = gemm(w_hi, w.n_in, w.n_out, hi_lo, 2 * rows, tt);
  if (s.ok) s = gemm(w_lo, w.n_in, w.n_out, hi_lo, rows, uu);
  *t = tt;
  *u = uu;
  return s;
}

CudaStatus DeviceMatmul::reserve(int64_t n_in, int64_t n_out) {
  // Room for whole chunks: the third product's output sits at a fixed offset (its alignment,
  // which cuBLAS may choose a kernel by, never depends on the chunk's rows).
  if (kernel_ == ProductKernel::kPinned) {
    CudaStatus s = pin(n_in, n_out);
    if (!s.ok) return s;
  }
  const size_t split_bytes = size_t(chunk_rows()) * size_t(n_in) * 2 * sizeof(uint16_t);
  const size_t partial_bytes = (size_t(lo_product_offset(n_out)) + size_t(chunk_rows()) * size_t(n_out)) * sizeof(float);
  if (split_.size() >= split_bytes && partial_.size() >= partial_bytes) return {};
  // An earlier product may still read the old scratch.
  CudaStatus s = cache::cuda::synchronize_stream(stream_);
  if (s.ok && split_.size() < split_bytes) s = cache::cuda::DeviceBuffer::allocate(split_bytes, &split_);
  if (s.ok && partial_.size() < partial_bytes) s = cache::cuda::DeviceBuffer::allocate(partial_bytes, &partial_);
  // Zeroed once: the heuristic kernel's whole-chunk products read rows past a short chunk's own.
  if (s.ok && cudaMemset(split_.data(), 0, split_.size()) != cudaSuccess)
    s = cuda_error(StatusCode::kInternal, "device matmul: zeroing the scratch failed");
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
