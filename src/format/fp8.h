// FP8 scalar formats of the OCP 8-bit floating point specification (OFP8, rev. 1.0):
//   E4M3: sign 1, exponent 4 (bias 7), mantissa 3. No infinities; S.1111.111 is NaN; the largest
//         finite value is 448 (S.1111.110). Subnormals 2^-6 * m/8.
//   E5M2: sign 1, exponent 5 (bias 15), mantissa 2, IEEE-like: S.11111.00 is Inf, S.11111.{01,
//         10,11} NaN; the largest finite value is 57344. Subnormals 2^-14 * m/4.
// Conversions from BF16 (and float) round to nearest, ties to even. E4M3 saturates: values whose
// magnitude rounds above 448, and infinities, become +-448. E5M2 does not saturate: overflow
// gives +-Inf, infinities stay infinite. NaN gives the canonical NaN with the input's sign
// (E4M3 S.1111.111, E5M2 S.11111.10). Shared by host and device code.
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::format {

// float -> FP8 with `exponent_bits` (4 or 5) and `mantissa_bits` (3 or 2) per the rules above.
CERTKV_HD inline uint8_t float_to_fp8_ref(float f, int exponent_bits, int mantissa_bits) {
  const uint32_t u = float_to_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  const bool e4m3 = exponent_bits == 4;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  // Largest finite encoding (without sign) and the Inf / NaN encodings.
  const uint32_t max_finite = e4m3 ? 0x7eu : 0x7bu;
  const uint8_t nan = e4m3 ? uint8_t(0x7f) : uint8_t(0x7e);
  if (abs > 0x7f800000u) return uint8_t(sign | nan);
  if (abs == 0x7f800000u) return uint8_t(sign | (e4m3 ? max_finite : 0x7cu));
  const int exponent = int(abs >> 23) - 127;  // unbiased float exponent
  uint32_t magnitude;
  if (exponent + bias >= 1) {
    // Normal in FP8: rebias, then round the 23-bit mantissa to mantissa_bits, ties to even;
    // a carry out of the mantissa bumps the exponent, as it should.
    const int shift = 23 - mantissa_bits;
    const uint32_t rebiased = abs - (uint32_t(127 - bias) << 23);
    magnitude = (rebiased + ((1u << (shift - 1)) - 1) + ((rebiased >> shift) & 1u)) >> shift;
  } else {
    // Subnormal or zero in FP8: count quanta of 2^(1 - bias - mantissa_bits), nearest even.
    // Scaling by a power of two is exact in float for these ranges.
    const float quanta = bits_to_float(abs) * bits_to_float(uint32_t(127 + bias - 1 + mantissa_bits) << 23);
    uint32_t q = uint32_t(quanta);
    const float rem = quanta - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    magnitude = q;  // q == 2^mantissa_bits is the smallest normal, encoded the same way
  }
  if (magnitude > max_finite) return uint8_t(sign | (e4m3 ? max_finite : 0x7cu));
  return uint8_t(sign | magnitude);
}

CERTKV_HD inline uint8_t bf16_to_fp8_e4m3_ref(uint16_t h) {
  return float_to_fp8_ref(bf16_to_float(h), 4, 3);
}
CERTKV_HD inline uint8_t bf16_to_fp8_e5m2_ref(uint16_t h) {
  return float_to_fp8_ref(bf16_to_float(h), 5, 2);
}

// FP8 -> float, exact for every encoding.
CERTKV_HD inline float fp8_to_float(uint8_t v, int exponent_bits, int mantissa_bits) {
  const bool e4m3 = exponent_bits == 4;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const uint32_t sign = uint32_t(v & 0x80u) << 24;
  const uint32_t exponent = (v >> mantissa_bits) & ((1u << exponent_bits) - 1);
  const uint32_t mantissa = v & ((1u << mantissa_bits) - 1);
  const uint32_t exponent_all_ones = (1u << exponent_bits) - 1;
  if (e4m3 && exponent == exponent_all_ones && mantissa == 7u) {
    return bits_to_float(sign | 0x7fc00000u);
  }
  if (!e4m3 && exponent == exponent_all_ones) {
    return bits_to_float(sign | 0x7f800000u | (mantissa << (23 - mantissa_bits)));
  }
  if (exponent == 0) {
    // m * 2^(1 - bias - mantissa_bits)
    const float v_abs = float(mantissa) * bits_to_float(uint32_t(127 + 1 - bias - mantissa_bits) << 23);
    return sign ? -v_abs : v_abs;
  }
  return bits_to_float(sign | ((exponent + uint32_t(127 - bias)) << 23) |
                       (mantissa << (23 - mantissa_bits)));
}

CERTKV_HD inline float fp8_e4m3_to_float(uint8_t v) { return fp8_to_float(v, 4, 3); }
CERTKV_HD inline float fp8_e5m2_to_float(uint8_t v) { return fp8_to_float(v, 5, 2); }

}  // namespace certkv::format
