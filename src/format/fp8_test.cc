#include "format/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace certkv::format {
namespace {

struct Fp8Kind {
  int exponent_bits, mantissa_bits;
  bool e4m3() const { return exponent_bits == 4; }
};

bool is_nan_encoding(uint8_t v, Fp8Kind k) {
  const unsigned e = (v >> k.mantissa_bits) & ((1u << k.exponent_bits) - 1);
  const unsigned m = v & ((1u << k.mantissa_bits) - 1);
  const unsigned all_ones = (1u << k.exponent_bits) - 1;
  return k.e4m3() ? (e == all_ones && m == 7) : (e == all_ones && m != 0);
}

// The expected conversion found by search: the nearest representable magnitude (E5M2: Inf
// counts as 65536, so overflow past the midpoint 61440 gives Inf; E4M3: the nearest finite value,
// which saturates at 448), ties to the even encoding.
uint8_t nearest_by_search(double x, Fp8Kind k) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  // Far beyond the range every answer is the same (448 or Inf); clamping keeps the distances
  // exact in double.
  const double a = std::fmin(std::fabs(x), 1e6);
  int best = -1;
  double best_distance = 0;
  for (int v = 0; v < 128; ++v) {
    if (is_nan_encoding(uint8_t(v), k)) continue;
    double value = fp8_to_float(uint8_t(v), k.exponent_bits, k.mantissa_bits);
    if (std::isinf(value)) {
      if (v != 0x7c) continue;
      value = 65536.0;
    }
    const double distance = std::fabs(value - a);
    if (best < 0 || distance < best_distance ||
        (distance == best_distance && (v & 1) == 0 && (best & 1) == 1)) {
      best = v;
      best_distance = distance;
    }
  }
  return uint8_t(sign | best);
}

TEST(Fp8, EveryBf16ConvertsToTheNearestEven) {
  for (Fp8Kind k : {Fp8Kind{4, 3}, Fp8Kind{5, 2}}) {
    for (uint32_t h = 0; h < 65536; ++h) {
      const float x = bf16_to_float(uint16_t(h));
      const uint8_t got = k.e4m3() ? bf16_to_fp8_e4m3_ref(uint16_t(h)) : bf16_to_fp8_e5m2_ref(uint16_t(h));
      uint8_t want;
      if (std::isnan(x)) {
        want = uint8_t((h & 0x8000u ? 0x80 : 0) | (k.e4m3() ? 0x7f : 0x7e));
      } else if (std::isinf(x)) {
        want = uint8_t((h & 0x8000u ? 0x80 : 0) | (k.e4m3() ? 0x7e : 0x7c));
      } else {
        want = nearest_by_search(x, k);
      }
      ASSERT_EQ(got, want) << (k.e4m3() ? "e4m3" : "e5m2") << " bf16 0x" << std::hex << h;
    }
  }
}

TEST(Fp8, EveryEncodingRoundTripsThroughFloat) {
  for (Fp8Kind k : {Fp8Kind{4, 3}, Fp8Kind{5, 2}}) {
    for (int v = 0; v < 256; ++v) {
      const float f = fp8_to_float(uint8_t(v), k.exponent_bits, k.mantissa_bits);
      if (is_nan_encoding(uint8_t(v), k)) {
        EXPECT_TRUE(std::isnan(f));
        continue;
      }
      EXPECT_EQ(float_to_fp8_ref(f, k.exponent_bits, k.mantissa_bits), uint8_t(v)) << v;
    }
  }
}

TEST(Fp8, KnownValues) {
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e5m2_to_float(0x7b), 57344.0f);
  EXPECT_EQ(fp8_e5m2_to_float(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(fp8_e5m2_to_float(0x3c), 1.0f);
  EXPECT_TRUE(std::isinf(fp8_e5m2_to_float(0xfc)) && fp8_e5m2_to_float(0xfc) < 0);
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(1000.0f)), 0x7e);   // saturates
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(-1000.0f)), 0xfe);
  EXPECT_EQ(bf16_to_fp8_e5m2_ref(float_to_bf16(1e6f)), 0x7c);      // Inf
  EXPECT_EQ(bf16_to_fp8_e5m2_ref(float_to_bf16(61440.0f)), 0x7c);  // midpoint ties to even: Inf
  EXPECT_EQ(bf16_to_fp8_e5m2_ref(float_to_bf16(60000.0f)), 0x7b);
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(1.0625f)), 0x38);   // tie 1 / 1.125: even
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(1.1875f)), 0x3a);   // tie 1.125 / 1.25: even
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(0x8000), 0x80);                   // -0
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(std::ldexp(1.0f, -10))), 0x00);  // tie 0 / 2^-9
  EXPECT_EQ(bf16_to_fp8_e4m3_ref(float_to_bf16(std::ldexp(3.0f, -11))), 0x01);
}

}  // namespace
}  // namespace certkv::format
