// The device forward kernels (backend/cuda/forward_kernels.h): one thread block per row for the
// row reductions (RMSNorm), a flat grid for the elementwise operations.
#include "backend/cuda/forward_kernels.h"

#include <cuda_runtime.h>

#include <string>

#include "format/numeric.h"

namespace certkv::backend::cuda {

namespace {

constexpr int kRowThreads = 256;
constexpr int kFlatThreads = 256;

CudaStatus launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return {};
  return cuda_error(StatusCode::kInternal, std::string(what) + ": launch failed: " + cudaGetErrorString(e));
}

CudaStatus refuse(const char* what, const std::string& why) {
  return cuda_error(StatusCode::kInvalidArgument, std::string(what) + ": " + why);
}

unsigned flat_blocks(int64_t n) { return unsigned((n + kFlatThreads - 1) / kFlatThreads); }

// The sum of v over the block's threads, by a fixed tree (the same order for every row).
__device__ float block_sum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kRowThreads / 32 ? shared[lane] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const float total = shared[0];
  __syncthreads();
  return total;
}

// The two bf16 terms of v: hi = bf16(v), lo = bf16(v - hi) (v - hi is exact in float).
__device__ __forceinline__ void split_value(float v, uint16_t* hi, uint16_t* lo) {
  const uint16_t h = format::float_to_bf16(v);
  *hi = h;
  *lo = format::float_to_bf16(v - format::bf16_to_float(h));
}

// A split product's three partial sums in their order: (W_hi x_hi + W_hi x_lo) + W_lo x_hi.
__device__ __forceinline__ float sum_split_value(float t_hi, float t_lo, float u) { return (t_hi + t_lo) + u; }

__device__ __forceinline__ float swiglu_value(float g, float up) { return g / (1.f + expf(-g)) * up; }

// Where an RMSNorm row goes: floats, or the two bf16 terms of a product's input ([2][rows][n]).
struct FloatRows {
  float* y;
  __device__ void put(int64_t i, float v, int64_t) const { y[i] = v; }
};
struct SplitRows {
  uint16_t* hi_lo;
  __device__ void put(int64_t i, float v, int64_t total) const { split_value(v, hi_lo + i, hi_lo + total + i); }
};

template <typename Out>
__global__ void rms_norm_kernel(const float* x, int n, const float* w, float eps, Out out, int64_t total) {
  __shared__ float shared[kRowThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += kRowThreads) ss = fmaf(xr[i], xr[i], ss);
  const float inv = 1.f / sqrtf(block_sum(ss, shared) / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += kRowThreads) {
    out.put(row * n + i, xr[i] * inv * w[i], total);
  }
}

__global__ void rope_kernel(float* x, int64_t rows, int n_heads, int head_dim, bool half_split, const float* cos,
                            const float* sin) {
  const int half = head_dim / 2;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (row, head, j)
  if (i >= rows * n_heads * half) return;
  const int j = int(i % half);
  const int64_t row_head = i / half;
  const int64_t row = row_head / n_heads;
  float* v = x + row_head * head_dim;
  const int a = half_split ? j : 2 * j, b = half_split ? j + half : 2 * j + 1;
  const float c = cos[row * half + j], s = sin[row * half + j];
  const float x0 = v[a], x1 = v[b];
  v[a] = x0 * c - x1 * s;
  v[b] = x0 * s + x1 * c;
}

__global__ void gather_kernel(const float* src, const int32_t* index, int64_t n, int width, float* dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t j = i / width;
  dst[i] = src[int64_t(index[j]) * width + i % width];
}

__global__ void scatter_kernel(const float* src, const int32_t* index, int64_t n, int width, float* dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t j = i / width;
  dst[int64_t(index[j]) * width + i % width] = src[i];
}

__global__ void swiglu_kernel(const float* gate, const float* up, int64_t n, int width, int64_t stride, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t at = i / width * stride + i % width;
  const float g = gate[at];
  out[i] = swiglu_value(g, up[at]);
}

constexpr int kMaxColumnParts = 4;
struct ColumnParts {
  ColumnPart part[kMaxColumnParts];
  int count;
};
static_assert(sizeof(ColumnParts) <= 4096, "a kernel's parameters by value fit in 4 KiB");

__global__ void split_columns_kernel(const float* src, int64_t rows, int width, ColumnParts parts) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * width) return;
  const int64_t r = i / width;
  const int c = int(i % width);
  for (int j = 0; j < parts.count; ++j) {
    const ColumnPart& p = parts.part[j];
    if (c >= p.from && c < p.from + p.width) p.dst[r * p.width + (c - p.from)] = src[i];
  }
}

__global__ void split_bf16_kernel(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  split_value(x[i], hi + i, lo + i);
}

__global__ void sum_split_kernel(const float* t, const float* u, int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = sum_split_value(t[i], t[n + i], u[i]);
}

__global__ void sum_split_add_kernel(const float* t, const float* u, int64_t n, float* x) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] += sum_split_value(t[i], t[n + i], u[i]);
}

// [gate | up] products of width 2 w a row, summed, through SwiGLU, split: hi_lo [2][rows][w].
__global__ void sum_split_swiglu_split_kernel(const float* t, const float* u, int64_t rows, int w, uint16_t* hi_lo) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n = rows * w;
  if (i >= n) return;
  const int64_t at = i / w * (2 * int64_t(w)) + i % w;  // the gate column; up is w further
  const int64_t m = rows * 2 * int64_t(w);                // t's second half
  const float g = sum_split_value(t[at], t[m + at], u[at]);
  const float up = sum_split_value(t[at + w], t[m + at + w], u[at + w]);
  split_value(swiglu_value(g, up), hi_lo + i, hi_lo + n + i);
}

// [q | k | v] products summed, each part's bias added (where given), into q, k, v.
__global__ void sum_split_qkv_kernel(const float* t, const float* u, int64_t rows, int qw, int kw, const float* bq,
                                     const float* bk, const float* bv, float* q, float* k, float* v) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int width = qw + 2 * kw;
  const int64_t n = rows * width;
  if (i >= n) return;
  const int64_t r = i / width;
  const int c = int(i % width);
  float x = sum_split_value(t[i], t[n + i], u[i]);
  if (c < qw) {
    if (bq) x += bq[c];
    q[r * qw + c] = x;
  } else if (c < qw + kw) {
    if (bk) x += bk[c - qw];
    k[r * kw + (c - qw)] = x;
  } else {
    if (bv) x += bv[c - qw - kw];
    v[r * kw + (c - qw - kw)] = x;
  }
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void add_bias_kernel(float* x, const float* b, int64_t n, int width) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += b[i % width];
}

__global__ void embed_kernel(const int32_t* tokens, int64_t n, const uint16_t* table, const uint16_t* table_lo,
                             int n_vocab, int dim, float* x) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t token = tokens[i / dim];
  if (token < 0 || token >= n_vocab) {
    x[i] = __int_as_float(0x7fc00000);
    return;
  }
  const int64_t at = int64_t(token) * dim + i % dim;
  const float hi = format::bf16_to_float(table[at]);
  x[i] = table_lo ? hi + format::bf16_to_float(table_lo[at]) : hi;
}

}  // namespace

CudaStatus rms_norm_rows(const float* x, int64_t rows, int n, const float* w, float eps, float* y, void* stream) {
  if (rows < 0 || n < 1) return refuse("rms_norm_rows", "needs rows >= 0 and n >= 1");
  if (!x || !w || !y) return refuse("rms_norm_rows", "null input, weights or output");
  if (!(eps >= 0.f)) return refuse("rms_norm_rows", "eps must be >= 0");
  if (rows == 0) return {};
  rms_norm_kernel<<<unsigned(rows), kRowThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, n, w, eps, FloatRows{y},
                                                                                        rows * n);
  return launched("rms_norm_rows");
}

CudaStatus rms_norm_split_rows(const float* x, int64_t rows, int n, const float* w, float eps, uint16_t* hi_lo,
                               void* stream) {
  if (rows < 0 || n < 1) return refuse("rms_norm_split_rows", "needs rows >= 0 and n >= 1");
  if (!x || !w || !hi_lo) return refuse("rms_norm_split_rows", "null input, weights or output");
  if (!(eps >= 0.f)) return refuse("rms_norm_split_rows", "eps must be >= 0");
  if (rows == 0) return {};
  rms_norm_kernel<<<unsigned(rows), kRowThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, n, w, eps,
                                                                                        SplitRows{hi_lo}, rows * n);
  return launched("rms_norm_split_rows");
}

CudaStatus sum_split_add_rows(const float* t, const float* u, int64_t rows, int width, float* x, void* stream) {
  if (rows < 0 || width < 1) return refuse("sum_split_add_rows", "needs rows >= 0 and width >= 1");
  if (!t || !u || !x) return refuse("sum_split_add_rows", "null products or rows");
  const int64_t n = rows * width;
  if (n == 0) return {};
  sum_split_add_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(t, u, n, x);
  return launched("sum_split_add_rows");
}

CudaStatus sum_split_swiglu_split_rows(const float* t, const float* u, int64_t rows, int width, uint16_t* hi_lo,
                                       void* stream) {
  if (rows < 0 || width < 1) return refuse("sum_split_swiglu_split_rows", "needs rows >= 0 and width >= 1");
  if (!t || !u || !hi_lo) return refuse("sum_split_swiglu_split_rows", "null products or output");
  const int64_t n = rows * width;
  if (n == 0) return {};
  sum_split_swiglu_split_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(t, u, rows,
                                                                                                        width, hi_lo);
  return launched("sum_split_swiglu_split_rows");
}

CudaStatus sum_split_qkv_rows(const float* t, const float* u, int64_t rows, int q_width, int kv_width, const float* bq,
                              const float* bk, const float* bv, float* q, float* k, float* v, void* stream) {
  if (rows < 0 || q_width < 1 || kv_width < 1) return refuse("sum_split_qkv_rows", "needs rows >= 0 and widths >= 1");
  if (!t || !u || !q || !k || !v) return refuse("sum_split_qkv_rows", "null products or outputs");
  const int64_t n = rows * (int64_t(q_width) + 2 * int64_t(kv_width));
  if (n == 0) return {};
  sum_split_qkv_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      t, u, rows, q_width, kv_width, bq, bk, bv, q, k, v);
  return launched("sum_split_qkv_rows");
}

CudaStatus rope_rows(float* x, int64_t rows, int n_heads, int head_dim, bool half_split, const float* cos,
                     const float* sin, void* stream) {
  if (rows < 0 || n_heads < 1 || head_dim < 2 || head_dim % 2 != 0)
    return refuse("rope_rows", "needs rows >= 0, n_heads >= 1 and an even head_dim >= 2");
  if (!x || !cos || !sin) return refuse("rope_rows", "null rows or angle tables");
  const int64_t n = rows * n_heads * (head_dim / 2);
  if (n == 0) return {};
  rope_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, rows, n_heads, head_dim,
                                                                                      half_split, cos, sin);
  return launched("rope_rows");
}

CudaStatus split_bf16_rows(const float* x, int64_t rows, int width, uint16_t* hi_lo, void* stream) {
  if (rows < 0 || width < 1) return refuse("split_bf16_rows", "needs rows >= 0 and width >= 1");
  if (!x || !hi_lo) return refuse("split_bf16_rows", "null rows or output");
  const int64_t n = rows * width;
  if (n == 0) return {};
  split_bf16_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, n, hi_lo, hi_lo + n);
  return launched("split_bf16_rows");
}

CudaStatus sum_split_products(const float* t, const float* u, int64_t rows, int width, float* y, void* stream) {
  if (rows < 0 || width < 1) return refuse("sum_split_products", "needs rows >= 0 and width >= 1");
  if (!t || !u || !y) return refuse("sum_split_products", "null products or output");
  const int64_t n = rows * width;
  if (n == 0) return {};
  sum_split_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(t, u, n, y);
  return launched("sum_split_products");
}

CudaStatus swiglu_rows(const float* gate, const float* up, int64_t rows, int width, int64_t stride, float* out,
                       void* stream) {
  if (rows < 0 || width < 1 || stride < width) return refuse("swiglu_rows", "needs rows >= 0, width >= 1 and stride >= width");
  if (!gate || !up || !out) return refuse("swiglu_rows", "null gate, up or output");
  const int64_t n = rows * width;
  if (n == 0) return {};
  swiglu_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(gate, up, n, width, stride, out);
  return launched("swiglu_rows");
}

CudaStatus split_columns(const float* src, int64_t rows, int width, const ColumnPart* parts, int n_parts,
                         void* stream) {
  if (rows < 0 || width < 1 || n_parts < 1 || n_parts > kMaxColumnParts || !parts)
    return refuse("split_columns", "needs rows >= 0, width >= 1 and 1 to 4 parts");
  ColumnParts p{};
  p.count = n_parts;
  for (int j = 0; j < n_parts; ++j) {
    if (!parts[j].dst || parts[j].from < 0 || parts[j].width < 1 || parts[j].from + parts[j].width > width)
      return refuse("split_columns", "a part outside the rows or without an output");
    p.part[j] = parts[j];
  }
  if (!src) return refuse("split_columns", "null rows");
  const int64_t n = rows * width;
  if (n == 0) return {};
  split_columns_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, rows, width, p);
  return launched("split_columns");
}

CudaStatus add_rows(float* x, const float* y, int64_t n, void* stream) {
  if (n < 0 || ((!x || !y) && n > 0)) return refuse("add_rows", "needs n >= 0 and both arrays");
  if (n == 0) return {};
  add_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, y, n);
  return launched("add_rows");
}

CudaStatus add_bias_rows(float* x, const float* b, int64_t rows, int width, void* stream) {
  if (rows < 0 || width < 1) return refuse("add_bias_rows", "needs rows >= 0 and width >= 1");
  if (!x || !b) return refuse("add_bias_rows", "null rows or bias");
  const int64_t n = rows * width;
  if (n == 0) return {};
  add_bias_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, b, n, width);
  return launched("add_bias_rows");
}

CudaStatus embed_rows(const int32_t* tokens, int64_t rows, const uint16_t* table, const uint16_t* table_lo, int n_vocab,
                      int dim, float* x, void* stream) {
  if (rows < 0 || n_vocab < 1 || dim < 1) return refuse("embed_rows", "needs rows >= 0, n_vocab >= 1 and dim >= 1");
  if (!tokens || !table || !x) return refuse("embed_rows", "null tokens, table or rows");
  const int64_t n = rows * dim;
  if (n == 0) return {};
  embed_kernel<<<flat_blocks(n), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(tokens, n, table, table_lo,
                                                                                       n_vocab, dim, x);
  return launched("embed_rows");
}

CudaStatus gather_rows(const float* src, const int32_t* index, int64_t n, int width, float* dst, void* stream) {
  if (n < 0 || width < 1) return refuse("gather_rows", "needs n >= 0 and width >= 1");
  if (n == 0) return {};
  if (!src || !index || !dst) return refuse("gather_rows", "null rows, index or output");
  gather_kernel<<<flat_blocks(n * width), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, index, n * width,
                                                                                                width, dst);
  return launched("gather_rows");
}

CudaStatus scatter_rows(const float* src, const int32_t* index, int64_t n, int width, float* dst, void* stream) {
  if (n < 0 || width < 1) return refuse("scatter_rows", "needs n >= 0 and width >= 1");
  if (n == 0) return {};
  if (!src || !index || !dst) return refuse("scatter_rows", "null rows, index or output");
  scatter_kernel<<<flat_blocks(n * width), kFlatThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, index, n * width,
                                                                                                 width, dst);
  return launched("scatter_rows");
}

}  // namespace certkv::backend::cuda
