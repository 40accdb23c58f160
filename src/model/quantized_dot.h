// The quantized-activation dot product of matmul (model/matmul.h), in plain scalar code. It is
// llama.cpp's scheme (ggml-quants.c: quantize_row_q8_0 / q8_1 / q8_K and vec_dot_*_q8_*) with
// fp32 activation scales:
//
//  1. Activations. A row of x is cut into blocks of B elements (B = 32 for Q4_0, Q4_1, Q5_0, Q5_1
//     and Q8_0 weights, 256 for Q4_K, Q5_K, Q6_K). Per block: amax = max |x_i|, d = amax / 127,
//     id = (d != 0 ? 1 / d : 0), q_i = round-half-to-even(x_i * id) in [-127, 127], all in fp32.
//     s = d * sum(q) (fp32) per block, and sum32 = sum(q) over each 32 elements. A block holding
//     an Inf or NaN gets d = s = NaN and q = 0, so the products it enters become NaN.
//  2. Dot product with one weight row, blocks summed in order in fp32, integer sums exact:
//       Q4_0, Q5_0, Q8_0:  (d_w * d) * sum_i c_i q_i        c = signed code (q-8, q-16, q)
//       Q4_1, Q5_1:        (d_w * d) * sum_i c_i q_i + m_w * s
//       Q4_K, Q5_K:        (d_w * d) * sum_j sc_j sum_{i in j} c_i q_i - (dmin_w * d) * sum_j m_j
//       sum32_j Q6_K:              (d_w * d) * sum_j sc_j sum_{i in j} (c_i - 32) q_i
//     with j the sub-blocks of the super-block (8 of 32, or 16 of 16 for Q6_K).
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "format/ggml_blocks.h"

namespace certkv::model {

// Activation block length used with weights of `type`: 32 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
// 256 for Q4_K, Q5_K, Q6_K; 0 for every other type (float weights take float activations).
int64_t activation_block_elements(format::GgmlType type);

// One row of activations quantized as in step 1 above.
struct QuantizedActivation {
  int64_t block_elements = 0;
  std::vector<int8_t> q;       // n codes
  std::vector<float> d;        // n / block_elements scales
  std::vector<float> s;        // n / block_elements values d * sum(q)
  std::vector<int32_t> sum32;  // n / 32 sums of q
};

// x: n floats. REQUIRES block_elements in {32, 256}, n >= 0 and a multiple of block_elements;
// otherwise throws certkv::Error kInvalidArgument.
QuantizedActivation quantize_activation_ref(const float* x, int64_t n, int64_t block_elements);

// Step 2 for one weight row of `type` holding x.q.size() elements (ggml_row_bytes(type, n) bytes).
// REQUIRES activation_block_elements(type) == x.block_elements != 0; otherwise throws
// certkv::Error (kUnsupported naming the type, or kInvalidArgument).
float vec_dot_quantized_ref(format::GgmlType type, const void* w_row, const QuantizedActivation& x);

}  // namespace certkv::model
