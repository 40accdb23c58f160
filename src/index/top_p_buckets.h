// Top-p on quantized logits, the arithmetic both selections share: index::top_p_select on the
// CPU and the CUDA selection (attention/cuda/sparse_decode_cuda.cu) call these functions, so they
// compute the same buckets, threshold bucket, threshold and mass bit for bit. Host and device code,
// C++17, no CUDA headers. The definition and its guarantee are stated in top_p.h.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "format/numeric.h"

namespace certkv::index {

// Logits in 16-bit fixed point below the row's largest: 1/256 logit per step; gaps of 44 logits
// and more share the last bucket (there a token weighs less than one unit for every n, below).
inline constexpr int kTopPGapStepsPerLogit = 256;
inline constexpr int kTopPGapCap = 44 * kTopPGapStepsPerLogit;  // 11,264
inline constexpr int kTopPBuckets = kTopPGapCap + 1;
static_assert(kTopPGapCap <= UINT16_MAX, "a gap bucket is a 16-bit number");

// a_t = min(kTopPGapCap, floor(256 fl(l_max - l))): one rounded float subtraction, a product by a
// power of two (exact) and a round-down. REQUIRES: l <= l_max (then the gap is >= 0); NaN and
// overflow land in the last bucket.
CERTKV_HD inline int top_p_gap_bucket(float l, float l_max) {
#if defined(__CUDA_ARCH__)
  const float g = __fmul_rn(__fsub_rn(l_max, l), float(kTopPGapStepsPerLogit));
#else
  const float g = (l_max - l) * float(kTopPGapStepsPerLogit);
#endif
  return g < float(kTopPGapCap) ? int(g) : kTopPGapCap;
}

// Floats as unsigned integers in the order of their values (-0 just below +0).
CERTKV_HD inline uint32_t top_p_ordered_key(float x) {
  const uint32_t u = format::float_to_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
CERTKV_HD inline float top_p_key_float(uint32_t k) {
  return format::bits_to_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// theta(B): the smallest finite float x with top_p_gap_bucket(x, l_max) <= B, by bisection over
// the ordered keys of [-FLT_MAX, l_max] (fl(l_max - x) does not decrease as x decreases, so the
// bucket is monotone in x). Then for every float l (also l > l_max, as the widening compares),
// l >= theta(B) exactly when l is at or above bucket B. At most 32 steps.
// REQUIRES: l_max finite; 0 <= bucket <= kTopPGapCap.
CERTKV_HD inline float top_p_bucket_threshold(float l_max, int bucket) {
  if (top_p_gap_bucket(-FLT_MAX, l_max) <= bucket) return -FLT_MAX;
  uint32_t lo = top_p_ordered_key(-FLT_MAX), hi = top_p_ordered_key(l_max);  // outside, inside
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (top_p_gap_bucket(top_p_key_float(mid), l_max) <= bucket) hi = mid;
    else lo = mid;
  }
  return top_p_key_float(hi);
}

// The high 64 bits of a 64 x 64-bit product.
CERTKV_HD inline uint64_t top_p_mul_hi(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return uint64_t((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// ceil(p Z) exactly: p = m 2^-shift with an integer m < 2^53 (shift >= 52 since p <= 1), and m Z
// below 2^117. REQUIRES: 0 < p <= 1, Z >= 1.
CERTKV_HD inline uint64_t top_p_target(double p, uint64_t Z) {
  int exponent = 0;
#if defined(__CUDA_ARCH__)
  const double mantissa = ::frexp(p, &exponent);  // p = mantissa 2^exponent
  const auto m = static_cast<uint64_t>(::ldexp(mantissa, 53));
#else
  const double mantissa = std::frexp(p, &exponent);
  const auto m = static_cast<uint64_t>(std::ldexp(mantissa, 53));
#endif
  const int shift = 53 - exponent;
  if (shift >= 128) return 1;  // 0 < p Z < 1
  const uint64_t lo = m * Z, hi = top_p_mul_hi(m, Z);
  uint64_t T = 0, rem = 0;
  if (shift < 64) {
    T = (hi << (64 - shift)) | (lo >> shift);
    rem = lo & ((uint64_t(1) << shift) - 1);
  } else {
    T = shift == 64 ? hi : hi >> (shift - 64);
    rem = lo | (shift == 64 ? 0 : hi & ((uint64_t(1) << (shift - 64)) - 1));
  }
  return T + (rem != 0 ? 1 : 0);
}

// The selection's test (top_p.h): the exact mass of a set whose weight is at least `lower` while
// the rest weighs at most `upper_rest` is at least lower / (lower + upper_rest); it reaches p when
// lower >= ceil(p (lower + upper_rest)). REQUIRES: lower + upper_rest in [1, 2^64); 0 < p <= 1.
CERTKV_HD inline bool top_p_reaches(uint64_t lower, uint64_t upper_rest, double p) {
  return lower >= top_p_target(p, lower + upper_rest);
}

// lower / total rounded to the nearest double (ties to even), from the integers: restoring
// division until 64 significant quotient bits, the remainder as the sticky bit. Monotone, so a
// ratio >= p gives a double >= p. REQUIRES: 1 <= lower, lower <= total.
CERTKV_HD inline double top_p_mass(uint64_t lower, uint64_t total) {
  if (lower >= total) return 1.0;
  uint64_t r = lower, q = 0;
  int e = 0;  // lower / total = (q + r / total) 2^-e
  while ((q >> 63) == 0) {
    const uint64_t carry = r >> 63;
    r <<= 1;
    q <<= 1;
    ++e;
    if (carry != 0 || r >= total) {
      r -= total;
      q |= 1;
    }
  }
  uint64_t keep = q >> 11;
  const uint64_t rest = q & 0x7ffu;
  if (rest > 0x400u || (rest == 0x400u && (r != 0 || (keep & 1) != 0))) ++keep;
#if defined(__CUDA_ARCH__)
  return ::ldexp(double(keep), 11 - e);
#else
  return std::ldexp(double(keep), 11 - e);
#endif
}

// k = ceil(log2 n): weights carry s = 63 - k fraction bits, so n of them sum below 2^64.
CERTKV_HD inline int top_p_weight_shift(int64_t n) {
  int k = 0;
  while ((int64_t(1) << k) < n) ++k;
  return k;
}

// A bucket's weights at s = 63 - k from the s = 63 tables (top_p_bucket_weights): the upper
// rounded up, the lower down, so that they equal the tables' formulas evaluated at s directly
// (ceil(ceil(y) / 2^k) = ceil(y / 2^k) and floor(floor(y) / 2^k) = floor(y / 2^k)).
CERTKV_HD inline uint64_t top_p_upper_weight(uint64_t upper63, int k) {
  return (upper63 >> k) + ((upper63 & ((uint64_t(1) << k) - 1)) != 0 ? 1 : 0);
}
CERTKV_HD inline uint64_t top_p_lower_weight(uint64_t lower63, int k) { return lower63 >> k; }

}  // namespace certkv::index
