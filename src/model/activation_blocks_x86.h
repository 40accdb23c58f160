// AVX-512 forms of quantized_dot.h's step 1 for blocks of 32 activations, shared by the weight
// products (model/matmul_x86.cc) and the tile products (model/matmul_tiles.cc): the same codes,
// scale and sums as quantize_activation_ref. Compiled where AVX-512 F and BW are the build's
// target, or under a `#pragma GCC target` that enables them with CERTKV_ACTIVATION_BLOCKS_AVX512
// defined (matmul_x86.cc). The functions are internal to each file that includes them, so a copy
// compiled for wider instructions is never the one another file calls.
#pragma once

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(CERTKV_ACTIVATION_BLOCKS_AVX512)
#include <cstdint>
#include <cstring>

#include "core/x86_simd.h"

namespace certkv::model::detail {
namespace {

// No lane Inf or NaN (fpclass categories: QNaN 0x01, +Inf 0x08, -Inf 0x10, SNaN 0x80).
inline bool all_finite(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x10 | 0x80) == 0; }

// round-half-to-even(v * id) in 16 int32 lanes.
inline __m512i quantize_16(__m512 v, float id) {
  return _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// One block of 32 activations: codes in element order into q, the scale into *d, d * sum(q) into
// *s and, when sum is given, the exact sum(q) into *sum. A block with an Inf or NaN gets zero
// codes and d = s = NaN (and sum 0).
inline void quantize_block32(const float* x, int8_t* q, float* d, float* s, int32_t* sum = nullptr) {
  const __m512 v0 = _mm512_loadu_ps(x);
  const __m512 v1 = _mm512_loadu_ps(x + 16);
  if (!all_finite(v0) || !all_finite(v1)) {
    std::memset(q, 0, 32);
    *d = *s = __builtin_nanf("");
    if (sum != nullptr) *sum = 0;
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *d = amax / 127.f;
  const float id = *d != 0.f ? 1.f / *d : 0.f;
  const __m512i q0 = quantize_16(v0, id), q1 = quantize_16(v1, id);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  if (sum != nullptr) *sum = total;
  *s = *d * float(total);
}

}  // namespace
}  // namespace certkv::model::detail
#endif
