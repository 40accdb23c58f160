// The integer term of RaBitQ's estimate (seed 002, Eq. 20): <c_b, q_u> = sum_i c_b[i] q_u[i] for
// a 1-bit code c_b and a 4-bit quantized query q_u held as bit planes (plane b: bit i set iff
// q_u[i] has bit b), that is sum_b 2^b popcount(c_b & plane_b). Shared by host and device code.
//
// code_dot_planes_ref counts plane by plane: 4 x W popcounts of 32-bit words.
// code_dot_planes adds the W x 4 masked words first as bit-sliced numbers in carry-save form: a
// full adder turns three words of weight 2^k into one of weight 2^k (their XOR) and one of weight
// 2^(k+1) (their majority), bit for bit a + b + c = sum + 2 carry, so the weighted popcount of the
// words is unchanged at every step; what is left, one word per weight, is counted. At W = 4
// (head_dim 128) that is 6 popcounts instead of 16 for 10 full and 2 half adders (two 3-input
// logic operations each), at W = 2 (head_dim 64) 5 instead of 8. On an H200 the popcount form was
// bound by POPC (16 per clock and multiprocessor); the adders run on the integer pipes.
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::index {

CERTKV_HD inline int32_t popcount32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// code[w]: bits 32 w .. 32 w + 31 of c_b; planes[b][w] likewise of plane b.
template <int W>
CERTKV_HD inline int32_t code_dot_planes_ref(const uint32_t (&code)[W], const uint32_t (&planes)[4][W]) {
  int32_t sum = 0;
  for (int b = 0; b < 4; ++b) {
    int32_t count = 0;
    for (int w = 0; w < W; ++w) count += popcount32(code[w] & planes[b][w]);
    sum += count << b;
  }
  return sum;
}

namespace code_dot_detail {
CERTKV_HD inline void full_add(uint32_t a, uint32_t b, uint32_t c, uint32_t& sum, uint32_t& carry) {
  sum = a ^ b ^ c;
  carry = (a & b) | (c & (a ^ b));
}
CERTKV_HD inline void half_add(uint32_t a, uint32_t b, uint32_t& sum, uint32_t& carry) {
  sum = a ^ b;
  carry = a & b;
}
}  // namespace code_dot_detail

template <int W>
CERTKV_HD inline int32_t code_dot_planes(const uint32_t (&code)[W], const uint32_t (&planes)[4][W]) {
  using code_dot_detail::full_add;
  using code_dot_detail::half_add;
  if constexpr (W == 4) {
    uint32_t x[4][4];  // x[b][w]: weight 2^b
    for (int b = 0; b < 4; ++b)
      for (int w = 0; w < 4; ++w) x[b][w] = code[w] & planes[b][w];
    uint32_t s, t, s1, s2, s4, s8, s16, s32;
    uint32_t k1, k2, m1, m2, m3, n1, n2, n3, o1, o2, o3;
    // weight 1: four words -> one, two carries of weight 2
    full_add(x[0][0], x[0][1], x[0][2], s, k1);
    half_add(s, x[0][3], s1, k2);
    // weight 2: four words and two carries -> one, three carries of weight 4
    full_add(x[1][0], x[1][1], x[1][2], s, m1);
    full_add(x[1][3], k1, k2, t, m2);
    half_add(s, t, s2, m3);
    // weight 4: four words and three carries -> one, three carries of weight 8
    full_add(x[2][0], x[2][1], x[2][2], s, n1);
    full_add(x[2][3], m1, m2, t, n2);
    full_add(s, t, m3, s4, n3);
    // weight 8: likewise -> one, three carries of weight 16
    full_add(x[3][0], x[3][1], x[3][2], s, o1);
    full_add(x[3][3], n1, n2, t, o2);
    full_add(s, t, n3, s8, o3);
    // weight 16: three carries -> one, one of weight 32
    full_add(o1, o2, o3, s16, s32);
    return popcount32(s1) + 2 * popcount32(s2) + 4 * popcount32(s4) + 8 * popcount32(s8) +
           16 * popcount32(s16) + 32 * popcount32(s32);
  } else if constexpr (W == 2) {
    uint32_t s1, s2, s4, s8, c, d;
    half_add(code[0] & planes[0][0], code[1] & planes[0][1], s1, c);
    full_add(code[0] & planes[1][0], code[1] & planes[1][1], c, s2, d);
    full_add(code[0] & planes[2][0], code[1] & planes[2][1], d, s4, c);
    full_add(code[0] & planes[3][0], code[1] & planes[3][1], c, s8, d);
    return popcount32(s1) + 2 * popcount32(s2) + 4 * popcount32(s4) + 8 * popcount32(s8) + 16 * popcount32(d);
  } else {
    return code_dot_planes_ref<W>(code, planes);
  }
}

}  // namespace certkv::index
