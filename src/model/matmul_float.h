// Matrix products with float activations on quantized weights: y = x W^T where each weight row
// is dequantized (dequantize_row) and multiplied with the fp32 activations, with no activation
// quantization. Slower than matmul's int8 path for long prompts, but its only error against
// matmul_ref is fp32 rounding: it is the path for exact comparisons (reference logits, the
// lossless-KV bit-identity checks) and for users who want the model's own arithmetic.
// Thread safety: one call at a time per pool.
#pragma once

#include <cstdint>
#include <span>

#include "core/thread_pool.h"
#include "model/matmul.h"

namespace certkv::model {

// Which arithmetic the forward pass uses for weight products.
enum class ActivationFormat {
  kInt8,     // matmul: activations quantized to int8 blocks, as llama.cpp does (fast)
  kFloat32,  // matmul_float: fp32 activations against dequantized weights
};

const char* activation_format_name(ActivationFormat f);

// Same contract as matmul (x: [n_tokens][w.n_in], y: [n_tokens][w.n_out]).
void matmul_float(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool);

// Dispatches on the format.
void matmul(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool,
            ActivationFormat format);

// Several matrices sharing one input (same contract as matmul's list form): kInt8 quantizes x
// once for all of them; kFloat32 runs matmul_float on each.
void matmul(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
            std::span<float* const> y, ThreadPool& pool, ActivationFormat format);

}  // namespace certkv::model
