// The per-row operations of the forward pass on a CUDA device, for the CUDA backend's whole
// forward pass (the GPU runtime): embedding rows, RMSNorm, RoPE, SwiGLU, bias and residual adds,
// the two-term bf16 split of the weight products (DeviceMatmul), and greedy argmax. Each is the host
// operation of backend/forward_ops.h (or model::argmax, format::float_to_bf16) computed on the
// device, row by row, so that a row's result depends on that row alone (batch invariance):
//  - rms_norm_rows: the sum of squares in float by a fixed tree per row (the host sums in
//    double), y = x * (1 / sqrt(ss / n + eps)) * w; relative difference to the host about 1e-6;
//  - rope_rows: the host's arithmetic (x0 c - x1 s, x0 s + x1 c) with the host's cos / sin
//    tables (the caller uploads them: the model's frequencies stay in one place);
//  - swiglu_rows: g / (1 + e^-g) * u with the device's expf (a few ulps from the host's exp);
//  - split_bf16_rows, sum_split_products, add_rows, add_bias_rows, embed_rows, gather_rows, scatter_rows: exact (the same bits as the host).
// Pointers are device pointers; every launch goes to `stream` (a cudaStream_t; null: the default
// stream) and returns at once. Bad shapes or null pointers are refused with kInvalidArgument
// before any launch. Host code only includes this header (the kernels' translation unit is C++17).
#pragma once

#include <cstdint>

#include "core/cuda_status.h"

namespace certkv::backend::cuda {

// y[r][i] = x[r][i] * inv_rms(x[r]) * w[i], r < rows, i < n (y may be x).
CudaStatus rms_norm_rows(const float* x, int64_t rows, int n, const float* w, float eps, float* y, void* stream);

// Rotates every head of rows x[r][n_heads][head_dim] in place by the angles of row r:
// cos, sin [rows][head_dim / 2]. half_split: pairs (j, j + head_dim / 2), else (2j, 2j + 1).
CudaStatus rope_rows(float* x, int64_t rows, int n_heads, int head_dim, bool half_split, const float* cos,
                     const float* sin, void* stream);

// out[r][i] = silu(gate[r * stride + i]) * up[r * stride + i], r < rows, i < width (stride >=
// width: gate and up may be the two halves of one product's rows); out [rows][width] may be gate
// when stride is width.
CudaStatus swiglu_rows(const float* gate, const float* up, int64_t rows, int width, int64_t stride, float* out,
                       void* stream);

// The column ranges of rows [rows][width] copied out, one launch: parts[j].dst[r][i] =
// src[r][parts[j].from + i], i < parts[j].width (the q, k, v of one product).
struct ColumnPart {
  float* dst = nullptr;
  int from = 0;
  int width = 0;
};
CudaStatus split_columns(const float* src, int64_t rows, int width, const ColumnPart* parts, int n_parts,
                         void* stream);

// x[i] += y[i], i < n.
CudaStatus add_rows(float* x, const float* y, int64_t n, void* stream);

// x[r][i] += b[i], r < rows, i < width.
CudaStatus add_bias_rows(float* x, const float* b, int64_t rows, int width, void* stream);

// x[r][i] = float(table[tokens[r]][i]) (+ float(table_lo[tokens[r]][i]) when table_lo is not
// null: a two-term table, DeviceMatrix's), r < rows, i < dim: the embedding rows of a bf16 table
// of n_vocab rows. A token outside [0, n_vocab) gives a row of NaN (the caller checks tokens
// first).
CudaStatus embed_rows(const int32_t* tokens, int64_t rows, const uint16_t* table, const uint16_t* table_lo, int n_vocab,
                      int dim, float* x, void* stream);

// dst[j][i] = src[index[j]][i], j < n, i < width: rows of a step gathered into launch order.
CudaStatus gather_rows(const float* src, const int32_t* index, int64_t n, int width, float* dst, void* stream);

// dst[index[j]][i] = src[j][i], j < n, i < width: the inverse of gather_rows (distinct indices).
CudaStatus scatter_rows(const float* src, const int32_t* index, int64_t n, int width, float* dst, void* stream);

// The two-term bf16 split of float rows for the weight products (DeviceMatmul): hi_lo[0][r][i] =
// h = bf16(x[r][i]), hi_lo[1][r][i] = bf16(x[r][i] - h), r < rows, i < width (x - h is exact
// in float; h + l is x to about 2^-16 of |x|).
CudaStatus split_bf16_rows(const float* x, int64_t rows, int width, uint16_t* hi_lo, void* stream);

// y[r][o] = (t[r][o] + t[rows + r][o]) + u[r][o], r < rows, o < width: the three partial products
// of a split weight product (W_hi x_hi, W_hi x_lo, W_lo x_hi) summed in that order.
CudaStatus sum_split_products(const float* t, const float* u, int64_t rows, int width, float* y, void* stream);

// Fused forms, one launch each where the unfused take two or more, with the same arithmetic (the
// same bits; ForwardKernels.FusedFormsGiveTheUnfusedBits):
//  - rms_norm_split_rows: split_bf16_rows of rms_norm_rows's output, hi_lo [2][rows][n];
//  - sum_split_add_rows: x += sum_split_products (a product's sum into the residual stream);
//  - sum_split_swiglu_split_rows: the summed [gate | up] products (t [2][rows][2 width], u [rows]
//    [2 width]) through swiglu_rows, split for the next product: hi_lo [2][rows][width];
//  - sum_split_qkv_rows: the summed [q | k | v] products (width q_width + 2 kv_width) into q, k, v
//    ([rows][q_width], [rows][kv_width]) with each part's bias added where one is given (split_columns
//    then add_bias_rows).
CudaStatus rms_norm_split_rows(const float* x, int64_t rows, int n, const float* w, float eps, uint16_t* hi_lo,
                               void* stream);
CudaStatus sum_split_add_rows(const float* t, const float* u, int64_t rows, int width, float* x, void* stream);
CudaStatus sum_split_swiglu_split_rows(const float* t, const float* u, int64_t rows, int width, uint16_t* hi_lo,
                                       void* stream);
CudaStatus sum_split_qkv_rows(const float* t, const float* u, int64_t rows, int q_width, int kv_width, const float* bq,
                              const float* bk, const float* bv, float* q, float* k, float* v, void* stream);

}  // namespace certkv::backend::cuda
