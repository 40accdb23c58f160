#include "model/dequant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/numeric.h"
#include "model/ggml_type.h"
#include "model/gguf.h"

namespace certkv::model {
namespace {

using format::GgmlType;

constexpr uint16_t kHalfOne = 0x3C00;      // 1.0
constexpr uint16_t kHalfMax = 0x7BFF;      // 65504, the largest finite fp16
constexpr uint16_t kHalfNegMax = 0xFBFF;   // -65504
constexpr uint16_t kHalfQuarter = 0x3400;  // 0.25
constexpr uint16_t kHalfEighth = 0x3000;   // 0.125
constexpr uint16_t kHalfHalf = 0x3800;     // 0.5
constexpr uint16_t kHalfTwo = 0x4000;      // 2.0
constexpr uint16_t kHalfNegOne = 0xBC00;   // -1.0

// Both functions must give exactly `expected` (bit for bit).
void expect_dequantizes_to(GgmlType type, const std::vector<uint8_t>& src,
                           const std::vector<float>& expected) {
  const int64_t n = int64_t(expected.size());
  ASSERT_EQ(src.size(), ggml_row_bytes(type, n)) << ggml_type_name(type);
  std::vector<float> ref(expected.size(), -7.f), simd(expected.size(), -7.f);
  dequantize_row_ref(type, src.data(), ref.data(), n);
  dequantize_row(type, src.data(), simd.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(format::float_to_bits(ref[i]), format::float_to_bits(expected[i]))
        << ggml_type_name(type) << " element " << i << ": " << ref[i] << " vs " << expected[i];
    EXPECT_EQ(format::float_to_bits(simd[i]), format::float_to_bits(expected[i]))
        << ggml_type_name(type) << " (dequantize_row) element " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Known answers: hand-built blocks, expected floats from the block definition.

TEST(DequantKnownAnswer, F32IsACopy) {
  const std::vector<float> v = {1.5f, -0.f, 3.0e38f, 1.0e-45f, -INFINITY};
  std::vector<uint8_t> src(v.size() * 4);
  std::memcpy(src.data(), v.data(), src.size());
  expect_dequantizes_to(GgmlType::kF32, src, v);
}

TEST(DequantKnownAnswer, F16) {
  const std::vector<uint16_t> h = {0x3C00, 0xC000, kHalfMax, 0x0001, 0x8000, 0x7C00,
                                   0x3555, 0x0400, 0x03FF,   0xFC00, 0x3C01, 0x5640,
                                   0x2E66, 0xB800, 0x0200,   0x7A00, 0xC900};
  const std::vector<float> expected = {1.f,
                                       -2.f,
                                       65504.f,
                                       5.9604645e-08f,
                                       -0.f,
                                       INFINITY,
                                       0.333251953125f,
                                       6.1035156e-05f,
                                       6.0975552e-05f,
                                       -INFINITY,
                                       1.0009765625f,
                                       100.f,
                                       0.0999755859375f,
                                       -0.5f,
                                       3.0517578e-05f,
                                       49152.f,
                                       -10.f};
  std::vector<uint8_t> s(h.size() * 2);
  std::memcpy(s.data(), h.data(), s.size());
  expect_dequantizes_to(GgmlType::kF16, s, expected);
}

TEST(DequantKnownAnswer, BF16) {
  const std::vector<uint16_t> h = {0x3F80, 0xC0A0, 0x7F7F, 0x0001, 0xFF80, 0x8000,
                                   0x3EAB, 0x4049, 0x0080, 0x42C8, 0xBF00, 0x7F80,
                                   0x3C23, 0x4780, 0xC2F6, 0x3F81, 0x1234};
  const std::vector<float> expected = {
      1.f,           -5.f,      3.3895314e38f,  9.1835496e-41f, -INFINITY,     -0.f,
      0.333984375f,  3.140625f, 1.1754944e-38f, 100.f,          -0.5f,         INFINITY,
      0.0099487305f, 65536.f,   -123.f,         1.0078125f,     5.6797985e-28f};
  std::vector<uint8_t> s(h.size() * 2);
  std::memcpy(s.data(), h.data(), s.size());
  expect_dequantizes_to(GgmlType::kBF16, s, expected);
}

TEST(DequantKnownAnswer, Q4_0) {
  // Block 0: d = 0.5, byte j = j | (15 - j) << 4, so element j = (j - 8) / 2 and element 16 + j
  // = (7 - j) / 2. Block 1 (extreme): d = 65504, low nibbles 15, high nibbles 0.
  std::vector<format::BlockQ4_0> blocks(2);
  blocks[0].d = kHalfHalf;
  for (int j = 0; j < 16; ++j) blocks[0].qs[j] = uint8_t(j | (15 - j) << 4);
  blocks[1].d = kHalfMax;
  for (int j = 0; j < 16; ++j) blocks[1].qs[j] = 0x0F;
  std::vector<float> expected(64);
  for (int j = 0; j < 16; ++j) {
    expected[j] = 0.5f * float(j - 8);
    expected[16 + j] = 0.5f * float(7 - j);
    expected[32 + j] = 458528.f;   // 65504 * 7
    expected[48 + j] = -524032.f;  // 65504 * -8
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ4_0) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ4_0, src, expected);
}

TEST(DequantKnownAnswer, Q4_1) {
  // Block 0: d = 0.25, m = -1, byte j = j | (15 - j) << 4: element j = j/4 - 1, element 16 + j
  // = (15 - j)/4 - 1. Block 1: d = 65504, m = -65504, codes 15 (low) and 0 (high).
  std::vector<format::BlockQ4_1> blocks(2);
  blocks[0].d = kHalfQuarter;
  blocks[0].m = kHalfNegOne;
  for (int j = 0; j < 16; ++j) blocks[0].qs[j] = uint8_t(j | (15 - j) << 4);
  blocks[1].d = kHalfMax;
  blocks[1].m = kHalfNegMax;
  for (int j = 0; j < 16; ++j) blocks[1].qs[j] = 0x0F;
  std::vector<float> expected(64);
  for (int j = 0; j < 16; ++j) {
    expected[j] = 0.25f * float(j) - 1.f;
    expected[16 + j] = 0.25f * float(15 - j) - 1.f;
    expected[32 + j] = 917056.f;  // 65504 * 15 - 65504
    expected[48 + j] = -65504.f;
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ4_1) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ4_1, src, expected);
}

// Q5_0 / Q5_1 blocks have no struct in format/ggml_blocks.h: d, [m,] qh (4 bytes), qs (16).
std::vector<uint8_t> q5_block(uint16_t d, const uint16_t* m, uint32_t qh, const uint8_t qs[16]) {
  std::vector<uint8_t> b;
  auto put16 = [&](uint16_t v) {
    b.push_back(uint8_t(v));
    b.push_back(uint8_t(v >> 8));
  };
  put16(d);
  if (m) put16(*m);
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(qh >> (8 * i)));
  b.insert(b.end(), qs, qs + 16);
  return b;
}

TEST(DequantKnownAnswer, Q5_0) {
  // Block 0: d = 1, qh = 0x0000FFFF, every byte 0xF3: elements 0-15 have q = 3 | 16 = 19 -> 3,
  // elements 16-31 have q = 15 -> -1. Block 1 (extreme): d = 65504, qh = 0x80000001, qs = 0xF0:
  // element 0: q = 16 -> 0; elements 1-15: 0 -> -16 * 65504; 16-30: 15 -> -65504; 31: 31 -> 15 *
  // 65504.
  uint8_t qs0[16], qs1[16];
  std::memset(qs0, 0xF3, 16);
  std::memset(qs1, 0xF0, 16);
  std::vector<uint8_t> src = q5_block(kHalfOne, nullptr, 0x0000FFFFu, qs0);
  const std::vector<uint8_t> b1 = q5_block(kHalfMax, nullptr, 0x80000001u, qs1);
  src.insert(src.end(), b1.begin(), b1.end());
  std::vector<float> expected(64);
  for (int j = 0; j < 16; ++j) {
    expected[j] = 3.f;
    expected[16 + j] = -1.f;
    expected[32 + j] = -1048064.f;
    expected[48 + j] = -65504.f;
  }
  expected[32] = 0.f;
  expected[63] = 982560.f;
  expect_dequantizes_to(GgmlType::kQ5_0, src, expected);
}

TEST(DequantKnownAnswer, Q5_1) {
  // Block 0: d = 2, m = 0.5, qh = 0xFFFF0000, byte j = j | (15 - j) << 4: element j = 2j + 0.5,
  // element 16 + j = 2 (31 - j) + 0.5. Block 1 (extreme): d = m = 65504, every code 31.
  uint8_t qs0[16], qs1[16];
  for (int j = 0; j < 16; ++j) qs0[j] = uint8_t(j | (15 - j) << 4);
  std::memset(qs1, 0xFF, 16);
  const uint16_t m0 = kHalfHalf, m1 = kHalfMax;
  std::vector<uint8_t> src = q5_block(kHalfTwo, &m0, 0xFFFF0000u, qs0);
  const std::vector<uint8_t> b1 = q5_block(kHalfMax, &m1, 0xFFFFFFFFu, qs1);
  src.insert(src.end(), b1.begin(), b1.end());
  std::vector<float> expected(64);
  for (int j = 0; j < 16; ++j) {
    expected[j] = 2.f * float(j) + 0.5f;
    expected[16 + j] = 2.f * float(31 - j) + 0.5f;
    expected[32 + j] = expected[48 + j] = 2096128.f;  // 65504 * 31 + 65504
  }
  expect_dequantizes_to(GgmlType::kQ5_1, src, expected);
}

TEST(DequantKnownAnswer, Q8_0) {
  // Block 0: d = 0.125, q_j = j - 16. Block 1 (extreme): d = 65504, q = -128 / 127 alternating.
  std::vector<format::BlockQ8_0> blocks(2);
  blocks[0].d = kHalfEighth;
  blocks[1].d = kHalfMax;
  std::vector<float> expected(64);
  for (int j = 0; j < 32; ++j) {
    blocks[0].qs[j] = int8_t(j - 16);
    blocks[1].qs[j] = int8_t(j % 2 ? 127 : -128);
    expected[j] = float(j - 16) / 8.f;
    expected[32 + j] = j % 2 ? 8319008.f : -8384512.f;
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ8_0) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ8_0, src, expected);
}

// The 12 scale bytes of a Q4_K / Q5_K super-block holding 6-bit scales sc[8] and mins m[8].
void pack_k_scales(const int sc[8], const int m[8], uint8_t out[12]) {
  for (int j = 0; j < 4; ++j) {
    out[j] = uint8_t((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
    out[j + 4] = uint8_t((m[j] & 63) | (m[j + 4] >> 4) << 6);
    out[j + 8] = uint8_t((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
  }
}

TEST(DequantKnownAnswer, KQuantScalePacking) {
  const int sc[8] = {1, 2, 63, 0, 17, 33, 48, 63};
  const int m[8] = {0, 1, 2, 63, 5, 16, 32, 63};
  uint8_t packed[12];
  pack_k_scales(sc, m, packed);
  for (int j = 0; j < 8; ++j) {
    uint8_t s, mm;
    k_quant_scale_min(j, packed, &s, &mm);
    EXPECT_EQ(s, sc[j]) << j;
    EXPECT_EQ(mm, m[j]) << j;
  }
}

// Q4_K / Q5_K test pattern: in chunk c, byte l of qs = (l % 16) | (15 - l % 16) << 4, so the
// code of element e (sub-block s = e / 32, l = e % 32) is l % 16 for even s, 15 - l % 16 for odd.
int k_pattern_code(int e) { return (e / 32) % 2 == 0 ? (e % 32) % 16 : 15 - (e % 32) % 16; }

TEST(DequantKnownAnswer, Q4_K) {
  const int sc[8] = {1, 2, 63, 0, 17, 33, 48, 63};
  const int m[8] = {0, 1, 2, 63, 5, 16, 32, 63};
  std::vector<format::BlockQ4_K> blocks(2);
  blocks[0].d = kHalfQuarter;
  blocks[0].dmin = kHalfEighth;
  pack_k_scales(sc, m, blocks[0].scales);
  for (int i = 0; i < 128; ++i) blocks[0].qs[i] = uint8_t((i % 16) | (15 - i % 16) << 4);
  // Extreme: d = dmin = 65504, all scales and mins 63, all codes 15.
  blocks[1].d = blocks[1].dmin = kHalfMax;
  std::memset(blocks[1].scales, 0xFF, 12);
  std::memset(blocks[1].qs, 0xFF, 128);
  std::vector<float> expected(512);
  for (int e = 0; e < 256; ++e) {
    const int s = e / 32;
    expected[e] = (0.25f * float(sc[s])) * float(k_pattern_code(e)) - 0.125f * float(m[s]);
    expected[256 + e] = 57774528.f;  // 65504 * 63 * 15 - 65504 * 63
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ4_K) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ4_K, src, expected);
}

TEST(DequantKnownAnswer, Q5_K) {
  const int sc[8] = {1, 2, 63, 0, 17, 33, 48, 63};
  const int m[8] = {0, 1, 2, 63, 5, 16, 32, 63};
  std::vector<format::BlockQ5_K> blocks(2);
  blocks[0].d = kHalfQuarter;
  blocks[0].dmin = kHalfEighth;
  pack_k_scales(sc, m, blocks[0].scales);
  for (int i = 0; i < 128; ++i) blocks[0].qs[i] = uint8_t((i % 16) | (15 - i % 16) << 4);
  // Fifth bit of element 32 s + l is bit s of qh[l]; qh[l] = 7 l + 3 (mod 256).
  for (int l = 0; l < 32; ++l) blocks[0].qh[l] = uint8_t(7 * l + 3);
  blocks[1].d = blocks[1].dmin = kHalfMax;
  std::memset(blocks[1].scales, 0xFF, 12);
  std::memset(blocks[1].qh, 0xFF, 32);
  std::memset(blocks[1].qs, 0xFF, 128);
  std::vector<float> expected(512);
  for (int e = 0; e < 256; ++e) {
    const int s = e / 32, l = e % 32;
    const int code = k_pattern_code(e) + 16 * (((7 * l + 3) & 0xFF) >> s & 1);
    expected[e] = (0.25f * float(sc[s])) * float(code) - 0.125f * float(m[s]);
    expected[256 + e] = 123802560.f;  // 65504 * 63 * 31 - 65504 * 63
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ5_K) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ5_K, src, expected);
}

TEST(DequantKnownAnswer, Q6_K) {
  // Block 0: ql[i] = i, qh[i] = 255 - i, scales[j] = 8 - j (some negative), d = 0.5. Expected
  // values follow ggml's loop: for each half n and l < 32, four elements take their bits from
  // ql[l], ql[l + 32], qh[l] and scales[8n + l/16 + {0, 2, 4, 6}].
  std::vector<format::BlockQ6_K> blocks(2);
  for (int i = 0; i < 128; ++i) blocks[0].ql[i] = uint8_t(i);
  for (int i = 0; i < 64; ++i) blocks[0].qh[i] = uint8_t(255 - i);
  for (int j = 0; j < 16; ++j) blocks[0].scales[j] = int8_t(8 - j);
  blocks[0].d = kHalfHalf;
  // Extreme: d = 65504, scales -128; codes 0 in the first half, 63 in the second.
  std::memset(blocks[1].ql, 0, 64);
  std::memset(blocks[1].ql + 64, 0xFF, 64);
  std::memset(blocks[1].qh, 0, 32);
  std::memset(blocks[1].qh + 32, 0xFF, 32);
  for (int j = 0; j < 16; ++j) blocks[1].scales[j] = -128;
  blocks[1].d = kHalfMax;
  std::vector<float> expected(512);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = blocks[0].ql + 64 * n;
    const uint8_t* qh = blocks[0].qh + 32 * n;
    const int8_t* sc = blocks[0].scales + 8 * n;
    float* y = expected.data() + 128 * n;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
      const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
      const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
      y[l] = (0.5f * float(sc[is + 0])) * float(q1);
      y[l + 32] = (0.5f * float(sc[is + 2])) * float(q2);
      y[l + 64] = (0.5f * float(sc[is + 4])) * float(q3);
      y[l + 96] = (0.5f * float(sc[is + 6])) * float(q4);
    }
  }
  for (int e = 0; e < 128; ++e) {
    expected[256 + e] = 268304384.f;         // 65504 * -128 * (0 - 32)
    expected[256 + 128 + e] = -259919872.f;  // 65504 * -128 * (63 - 32)
  }
  std::vector<uint8_t> src(sizeof(format::BlockQ6_K) * 2);
  std::memcpy(src.data(), blocks.data(), src.size());
  expect_dequantizes_to(GgmlType::kQ6_K, src, expected);
}

// ---------------------------------------------------------------------------------------------
// Errors.

TEST(DequantErrors, UnsupportedTypeIsNamed) {
  const std::vector<uint8_t> src(1024, 0);
  std::vector<float> dst(256);
  for (GgmlType type : {GgmlType::kQ2_K, GgmlType::kQ3_K, GgmlType::kQ8_1, GgmlType::kQ8_K}) {
    for (auto* fn : {&dequantize_row_ref, &dequantize_row}) {
      try {
        fn(type, src.data(), dst.data(), 256);
        ADD_FAILURE() << ggml_type_name(type) << " was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kUnsupported);
        EXPECT_NE(std::string(e.what()).find(ggml_type_name(type)), std::string::npos) << e.what();
      }
    }
    EXPECT_FALSE(dequantize_supports(type));
  }
  try {
    dequantize_row_ref(static_cast<GgmlType>(99), src.data(), dst.data(), 32);
    ADD_FAILURE() << "type id 99 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("99"), std::string::npos) << e.what();
  }
}

TEST(DequantErrors, PartialBlockIsRejected) {
  const std::vector<uint8_t> src(1024, 0);
  std::vector<float> dst(300, 1.f);
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kQ6_K}) {
    for (int64_t n : {int64_t(31), int64_t(33), int64_t(-32), int64_t(255)}) {
      if (n == 255 && type != GgmlType::kQ6_K) continue;
      try {
        dequantize_row(type, src.data(), dst.data(), n);
        ADD_FAILURE() << ggml_type_name(type) << " accepted " << n << " elements";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find(ggml_type_name(type)), std::string::npos);
      }
    }
  }
  for (float v : dst) EXPECT_EQ(v, 1.f);  // nothing was written
}

// ---------------------------------------------------------------------------------------------
// dequantize_row against dequantize_row_ref on random blocks of every type.

const GgmlType kAllTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ4_0,
                              GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                              GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

TEST(Dequant, VectorizedMatchesReferenceOnRandomBytes) {
  std::mt19937 rng(123);
  for (GgmlType type : kAllTypes) {
    for (int64_t blocks : {1, 3, 17, 129}) {
      const int64_t n = blocks * ggml_block_elements(type);
      std::vector<uint8_t> src(ggml_row_bytes(type, n));
      for (auto& b : src) b = uint8_t(rng());
      std::vector<float> ref(static_cast<size_t>(n)), simd(static_cast<size_t>(n));
      dequantize_row_ref(type, src.data(), ref.data(), n);
      dequantize_row(type, src.data(), simd.data(), n);
      int64_t nonzero = 0;
      for (int64_t i = 0; i < n; ++i) {
        nonzero += ref[i] != 0.f;
        if (std::isnan(ref[i])) {
          EXPECT_TRUE(std::isnan(simd[i])) << ggml_type_name(type) << " element " << i;
        } else {
          ASSERT_EQ(format::float_to_bits(simd[i]), format::float_to_bits(ref[i]))
              << ggml_type_name(type) << " n=" << n << " element " << i;
        }
      }
      EXPECT_GT(nonzero, n / 2) << ggml_type_name(type);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Golden rows decoded by the Python gguf package (scripts/make_dequant_golden.py).

struct GoldenRecord {
  GgmlType type;
  uint32_t source;  // 0 inline bytes, 1 row of the SmolLM2 model
  std::string name;
  uint64_t row = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> expected;
};

std::vector<GoldenRecord> read_golden() {
  const std::string path = std::string(CERTKV_SOURCE_DIR) + "/tests/golden/dequant_golden.bin";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open (run scripts/make_dequant_golden.py)");
  const std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  size_t pos = 0;
  auto take = [&](void* dst, size_t n) {
    if (data.size() - pos < n) throw std::runtime_error(path + ": truncated");
    if (n == 0) return;  // dst may be the null data() of an empty vector
    std::memcpy(dst, data.data() + pos, n);
    pos += n;
  };
  char magic[8];
  take(magic, 8);
  if (std::memcmp(magic, "CKDQGLD1", 8) != 0) throw std::runtime_error(path + ": bad magic");
  uint32_t count;
  take(&count, 4);
  std::vector<GoldenRecord> records(count);
  for (auto& r : records) {
    uint32_t type, name_len;
    uint64_t n, n_bytes;
    take(&type, 4);
    take(&r.source, 4);
    take(&name_len, 4);
    r.name.resize(name_len);
    take(r.name.data(), name_len);
    take(&r.row, 8);
    take(&n, 8);
    take(&n_bytes, 8);
    r.type = static_cast<GgmlType>(type);
    r.bytes.resize(n_bytes);
    take(r.bytes.data(), n_bytes);
    r.expected.resize(n);
    take(r.expected.data(), n * 4);
  }
  if (pos != data.size()) throw std::runtime_error(path + ": trailing bytes");
  return records;
}

void expect_matches_golden(const GoldenRecord& r, const uint8_t* bytes) {
  const int64_t n = int64_t(r.expected.size());
  std::vector<float> ref(r.expected.size()), simd(r.expected.size());
  dequantize_row_ref(r.type, bytes, ref.data(), n);
  dequantize_row(r.type, bytes, simd.data(), n);
  int64_t mismatches = 0, nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    nonzero += r.expected[i] != 0.f;
    if (format::float_to_bits(ref[i]) != format::float_to_bits(r.expected[i]) ||
        format::float_to_bits(simd[i]) != format::float_to_bits(r.expected[i])) {
      if (++mismatches <= 3)
        ADD_FAILURE() << r.name << " (" << ggml_type_name(r.type) << ") element " << i << ": ref "
                      << ref[i] << ", vectorized " << simd[i] << ", gguf " << r.expected[i];
    }
  }
  EXPECT_EQ(mismatches, 0) << r.name;
  EXPECT_GT(nonzero, n / 2) << r.name << ": golden row is mostly zero";
}

TEST(DequantGolden, InlineRowsMatchGgufPackage) {
  const std::vector<GoldenRecord> records = read_golden();
  int checked = 0;
  bool seen[64] = {};
  for (const auto& r : records) {
    if (r.source != 0) continue;
    ASSERT_EQ(r.bytes.size(), ggml_row_bytes(r.type, int64_t(r.expected.size()))) << r.name;
    expect_matches_golden(r, r.bytes.data());
    seen[uint32_t(r.type) % 64] = true;
    ++checked;
  }
  EXPECT_GE(checked, 10);
  for (GgmlType type : kAllTypes) {
    if (type == GgmlType::kF32) continue;  // covered by the model rows
    EXPECT_TRUE(seen[uint32_t(type)]) << "no golden record of " << ggml_type_name(type);
  }
}

TEST(DequantGolden, SmolLM2RowsMatchGgufPackage) {
  const std::string path = std::string(CERTKV_MODELS_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::ifstream(path)) FAIL() << path << " is missing: run scripts/fetch_models.sh";
  const auto file = GgufFile::open(path);
  int checked = 0;
  for (const auto& r : read_golden()) {
    if (r.source != 1) continue;
    const GgufTensorInfo* t = file->find_tensor(r.name);
    ASSERT_NE(t, nullptr) << r.name;
    ASSERT_EQ(t->type, r.type) << r.name;
    ASSERT_EQ(t->dims[0], int64_t(r.expected.size())) << r.name;
    const size_t row_bytes = ggml_row_bytes(t->type, t->dims[0]);
    ASSERT_LE((r.row + 1) * row_bytes, t->n_bytes) << r.name;
    expect_matches_golden(r, t->data + r.row * row_bytes);
    ++checked;
  }
  EXPECT_GE(checked, 7);
}

}  // namespace
}  // namespace certkv::model
