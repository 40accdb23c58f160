// Scalar number formats shared by host and device code: bf16 and fp16 <-> float.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CERTKV_HD __host__ __device__
#define CERTKV_UNROLL _Pragma("unroll")
#else
#define CERTKV_HD
#define CERTKV_UNROLL
#endif

namespace certkv::format {

CERTKV_HD inline float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

CERTKV_HD inline uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

CERTKV_HD inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round to nearest, ties to even; NaN stays NaN (quiet bit set).
CERTKV_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE binary16 -> float, exact for every input including subnormals, Inf and NaN.
CERTKV_HD inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    // Subnormal: value = mant * 2^-24.
    float v = float(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> IEEE binary16, round to nearest even; overflow gives Inf.
CERTKV_HD inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> Inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: value / 2^-24, rounded to nearest even.
    const float a = bits_to_float(abs) * 16777216.0f;
    uint32_t q = uint32_t(a);
    const float rem = a - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return uint16_t(sign | ((rounded - (112u << 23)) >> 13));
}

// float -> IEEE binary16 rounded toward +inf: the smallest fp16 >= f (+Inf above 65504; NaN stays
// NaN). For the directed bounds of the meter's side data, host and device alike.
CERTKV_HD inline uint16_t float_to_fp16_upward(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  // The magnitude truncated to fp16 (rounded toward zero).
  uint16_t truncated;
  if (abs >= 0x47800000u) {
    truncated = abs == 0x7f800000u ? uint16_t(0x7c00u) : uint16_t(0x7bffu);  // >= 65536: 65504, Inf stays
  } else if (abs >= 0x38800000u) {
    truncated = uint16_t((abs - (112u << 23)) >> 13);  // normal: rebias, drop 13 mantissa bits
  } else {
    // Subnormal: quanta of 2^-24 (an exact product), truncated by the conversion.
    truncated = uint16_t(uint32_t(bits_to_float(abs) * 16777216.0f));
  }
  // Toward +inf: a negative value truncated is already rounded up; a positive one moves up a step
  // when truncation lost something (65504 steps to Inf).
  if (sign == 0 && fp16_to_float(truncated) < bits_to_float(abs)) ++truncated;
  return uint16_t(sign | truncated);
}

// double -> float rounded toward +inf: the smallest float >= v (+Inf above the largest float).
CERTKV_HD inline float float_upward(double v) {
  if (v > double(bits_to_float(0x7f7fffffu))) return bits_to_float(0x7f800000u);
  float f = float(v);  // nearest even, subnormals kept (__double2float_rn on the device)
  if (double(f) < v) {
    // The next float up: for f >= 0 the next bit pattern; for f < 0 the previous one.
    if (f == 0.0f) return bits_to_float(1u);  // the smallest subnormal
    const uint32_t bits = float_to_bits(f);
    f = bits_to_float(f > 0.0f ? bits + 1 : bits - 1);
  }
  return f;
}

}  // namespace certkv::format
