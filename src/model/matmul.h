// Matrix products of activations with ggml weight matrices on the CPU: y = x W^T.
//
// Two algorithms:
//  * matmul_ref: dequantize each weight row to float and accumulate in double (the exact product
//    of the stored weights with x, up to the final rounding to float).
//  * matmul: the production path. For quantized weights it follows llama.cpp: every token row of
//    x is quantized once per call to int8 blocks (model/quantized_dot.h states the algorithm and
//    gives its plain reference, matmul_quantized_ref), then blocks are multiplied in integers and
//    scaled in fp32. It is therefore an approximation of matmul_ref: with the activation block
//    scale d = amax/127 and round-to-nearest, every activation element is off by at most d/2, so
//      |matmul - matmul_ref| <= sum_i |W[o][i]| * amax(block of i) / 254 + fp32 rounding.
//    Float weights (F32, F16, BF16) are multiplied in fp32 without any activation quantization.
//    With AVX-512 (F, BW, VL, VNNI, VBMI), or else AVX2 with FMA and F16C, the kernels are
//    vectorized and the weights of one output row are unpacked once per tile of up to 8 tokens;
//    without either a scalar path computes the same algorithm. The kernels are chosen at run time
//    from the CPU (matmul_kernel), whatever the build's -march, so that a portable build runs
//    them too. On every path each token's outputs are computed the same way whatever the number
//    of tokens or threads in the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/status.h"
#include "core/thread_pool.h"
#include "format/ggml_blocks.h"

namespace certkv::model {

// A weight matrix in ggml layout: n_out rows of n_in elements; row o starts at
// data + o * row_bytes and holds ggml_row_bytes(type, n_in) bytes. Not owning.
struct WeightMatrix {
  format::GgmlType type = format::GgmlType::kF32;
  const uint8_t* data = nullptr;
  int64_t n_in = 0;
  int64_t n_out = 0;
  size_t row_bytes = 0;
  // The matrix repacked for the AMX tile path (model/matmul_tiles.h), or null. Owned by whoever
  // made it (the Model); when set, matmul takes the tile path for every number of tokens.
  const uint8_t* tiles = nullptr;
};

// The matrix of n_out rows of n_in elements of `type` at data, rows packed (row_bytes =
// ggml_row_bytes(type, n_in)), without tiles.
WeightMatrix weight_matrix(format::GgmlType type, const uint8_t* data, int64_t n_in, int64_t n_out);

// The kernels of matmul's quantized and float products (the tile path of model/matmul_tiles.h
// aside), widest first. matmul_kernel() is the one this process uses: the widest the CPU runs
// (kAvx512: AVX-512 F, BW, VL, DQ, VNNI and VBMI; kAvx2: AVX2, FMA and F16C), capped by the
// environment variable CERTKV_MATMUL_KERNEL when it names a kernel ("portable", "avx2",
// "avx512"; read once, at the first call). The kernels round differently, so one process uses one.
enum class MatmulKernel : uint8_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
MatmulKernel matmul_kernel();
const char* matmul_kernel_name(MatmulKernel kernel);

// True for the weight types matmul and matmul_ref accept: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q4_K, Q5_K, Q6_K.
bool matmul_supports(format::GgmlType type);

// y[t][o] = sum_i x[t][i] * W[o][i] for t < n_tokens, o < w.n_out.
// x: [n_tokens][w.n_in] floats, y: [n_tokens][w.n_out] floats (must not overlap x).
// REQUIRES: matmul_supports(w.type); w.n_in a multiple of the type's block length;
// w.row_bytes >= ggml_row_bytes(w.type, w.n_in); n_tokens >= 0. Violations throw certkv::Error
// (kUnsupported naming the type, kInvalidArgument naming the shape) before anything is written.
// Finite activations are expected; an Inf or NaN in a token row makes that token's outputs NaN
// (float weights: NaN or +-Inf), and leaves the other tokens' outputs alone.
// Uses `pool` for the rows of W (and for quantizing x when n_tokens is large). The calling
// thread keeps the quantized activations in scratch memory that lives as long as the thread
// (about 1.3 bytes per element of x for 32-element blocks, 2 for k-quants; it only grows).
// Thread safety: one call at a time per pool.
void matmul(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool);

// The products of one input with several matrices, y[m] = x w[m]^T for m < w.size() (a layer's
// q, k and v, or its gate and up): x is quantized once per activation block length, and the rows
// of all the matrices are spread over the pool as one parallel section. y[m] is bit-identical to
// what matmul(w[m], x, n_tokens, y[m], pool) writes.
// x: [n_tokens][n_in] floats, y[m]: [n_tokens][w[m].n_out] floats (none overlapping x or another).
// REQUIRES: w.size() == y.size(); each w[m] meets matmul's REQUIRES; all w[m].n_in are equal.
// Violations throw certkv::Error before anything is written. Thread safety: as matmul.
void matmul(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
            std::span<float* const> y, ThreadPool& pool);

// Exact reference: dequantize_row_ref on each weight row, products accumulated in double.
// Same REQUIRES and errors as matmul. Single-threaded.
void matmul_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y);

// The algorithm of matmul in plain scalar code: for quantized weights, quantize_activation_ref
// on each token row then vec_dot_quantized_ref (model/quantized_dot.h); for float weights, fp32
// multiply-adds in element order. matmul equals it up to the order of fp32 additions.
// Same REQUIRES and errors as matmul. Single-threaded.
void matmul_quantized_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y);

}  // namespace certkv::model
