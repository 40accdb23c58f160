// gaac_rows_to_float against the codec's reference decoder: known answer, random pages with every
// mode on ragged shapes, each kernel, partial row counts; corrupt slots are clean errors.
#include "attention/gaac_rows.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "core/status.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::attention {
namespace {

using format::GaacElement;

std::vector<GaacRowsKernel> kernels() {
  std::vector<GaacRowsKernel> k = {GaacRowsKernel::kPortable};
  if (gaac_rows_kernel_supported(GaacRowsKernel::kAvx512Vbmi)) k.push_back(GaacRowsKernel::kAvx512Vbmi);
  return k;
}

// One token of 8 channels, all 3-bit: exponent b3 + code, sign and mantissa from their byte.
TEST(GaacRows, KnownAnswerOneGroup) {
  constexpr int kBt = 1, kD = 8;
  const size_t fixed = format::gaac_page_fixed_bytes(GaacElement::kBf16, kBt, kD);
  ASSERT_EQ(fixed, 8u + 3u + 1u);
  std::vector<uint8_t> slot(fixed, 0);
  // sign+mantissa: element j = j (mantissa j), element 7 negative.
  for (int j = 0; j < 8; ++j) slot[size_t(j)] = uint8_t(j);
  slot[7] |= 0x80;
  // codes 0..7 packed 3 bits each, little-endian: element j has code j.
  uint32_t codes = 0;
  for (uint32_t j = 0; j < 8; ++j) codes |= j << (3 * j);
  slot[8] = uint8_t(codes);
  slot[9] = uint8_t(codes >> 8);
  slot[10] = uint8_t(codes >> 16);
  slot[11] = 0;  // tag 0: 3-bit
  codec::GaacBases bases;
  bases.b3.assign(kD, 120);
  bases.b4.assign(kD, 0);
  for (GaacRowsKernel kernel : kernels()) {
    float out[kD];
    gaac_rows_to_float(slot.data(), slot.size(), kBt, kD, bases, 1, out, kernel);
    for (int j = 0; j < 8; ++j) {
      const uint16_t bf16 = uint16_t((j == 7 ? 0x8000u : 0u) | uint32_t(120 + j) << 7 | uint32_t(j));
      EXPECT_EQ(format::float_to_bits(out[j]), uint32_t(bf16) << 16) << "element " << j;
    }
    // 2^(120 - 127) = 1/128 for element 0.
    EXPECT_EQ(out[0], 1.f / 128.f);
  }
}

// A page whose groups take every mode: most exponents near their channel's window, some groups
// spread over 16 values (4-bit), some over all 256 (raw, Inf/NaN patterns included).
std::vector<uint16_t> random_page(int bt, int d, const codec::GaacBases& bases, std::mt19937& rng) {
  std::vector<uint16_t> page(size_t(bt) * size_t(d));
  for (int t = 0; t < bt; ++t) {
    for (int g = 0; g < d / 8; ++g) {
      const uint32_t kind = rng() % 10;  // 0..5 3-bit, 6..8 4-bit, 9 raw
      for (int j = 0; j < 8; ++j) {
        const int c = 8 * g + j;
        unsigned e;
        if (kind < 6) e = bases.b3[size_t(c)] + rng() % 8;
        else if (kind < 9) e = bases.b4[size_t(c)] + rng() % 16;
        else e = rng() % 256;
        page[size_t(t) * size_t(d) + size_t(c)] = uint16_t((rng() & 1u) << 15 | e << 7 | (rng() & 0x7fu));
      }
    }
  }
  return page;
}

codec::GaacBases random_bases(int d, std::mt19937& rng) {
  codec::GaacBases b;
  for (int c = 0; c < d; ++c) {
    b.b3.push_back(uint8_t(rng() % 249));
    b.b4.push_back(uint8_t(rng() % 241));
  }
  return b;
}

struct Shape {
  int block_tokens;
  int head_dim;
};

TEST(GaacRows, MatchesTheCodecReferenceOnEveryMode) {
  std::mt19937 rng(2026);
  const Shape shapes[] = {{16, 64}, {16, 128}, {16, 256}, {7, 96}, {1, 8}, {3, 24}, {4, 16}, {17, 192}};
  for (const Shape& s : shapes) {
    for (int trial = 0; trial < 20; ++trial) {
      SCOPED_TRACE("block_tokens " + std::to_string(s.block_tokens) + " head_dim " +
                   std::to_string(s.head_dim) + " trial " + std::to_string(trial));
      const codec::GaacBases bases = random_bases(s.head_dim, rng);
      const std::vector<uint16_t> page = random_page(s.block_tokens, s.head_dim, bases, rng);
      const size_t capacity = format::gaac_page_max_escape_bytes(GaacElement::kBf16, s.block_tokens, s.head_dim);
      std::vector<uint8_t> slot(format::gaac_slot_bytes(GaacElement::kBf16, s.block_tokens, s.head_dim, capacity));
      const size_t used = codec::gaac_encode_page_ref(page.data(), s.block_tokens, s.head_dim, bases,
                                                      capacity, slot.data());
      ASSERT_NE(used, codec::kGaacDoesNotFit);
      const codec::GaacModeCounts modes =
          codec::gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), s.block_tokens, s.head_dim);
      if (trial == 0 && s.block_tokens * s.head_dim >= 512) {
        ASSERT_GT(modes.groups[0], 0u);
        ASSERT_GT(modes.groups[1], 0u);
        ASSERT_GT(modes.groups[2], 0u);
      }
      for (int n_rows : {0, 1, s.block_tokens / 2, s.block_tokens}) {
        const size_t count = size_t(n_rows) * size_t(s.head_dim);
        std::vector<float> want(count + 1, -7.f), got(count + 1, -7.f);
        gaac_rows_to_float_ref(slot.data(), used, s.block_tokens, s.head_dim, bases, n_rows, want.data());
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(format::float_to_bits(want[i]), uint32_t(page[i]) << 16) << "element " << i;
        }
        for (GaacRowsKernel kernel : kernels()) {
          gaac_rows_to_float(slot.data(), used, s.block_tokens, s.head_dim, bases, n_rows, got.data(), kernel);
          ASSERT_EQ(std::memcmp(got.data(), want.data(), count * sizeof(float)), 0)
              << "kernel " << int(kernel) << " n_rows " << n_rows;
          ASSERT_EQ(got[count], -7.f) << "wrote past the rows";
        }
      }
    }
  }
}

TEST(GaacRows, CorruptSlotsAreCleanErrors) {
  constexpr int kBt = 16, kD = 64;
  std::mt19937 rng(5);
  const codec::GaacBases bases = random_bases(kD, rng);
  const std::vector<uint16_t> page = random_page(kBt, kD, bases, rng);
  const size_t capacity = format::gaac_page_max_escape_bytes(GaacElement::kBf16, kBt, kD);
  const size_t fixed = format::gaac_page_fixed_bytes(GaacElement::kBf16, kBt, kD);
  std::vector<uint8_t> slot(fixed + capacity);
  const size_t used = codec::gaac_encode_page_ref(page.data(), kBt, kD, bases, capacity, slot.data());
  ASSERT_GT(used, fixed);  // the page has escapes
  std::vector<float> out(size_t(kBt) * kD);
  auto expect_corrupt = [&](const std::vector<uint8_t>& bytes, size_t n_bytes, const char* needle) {
    for (GaacRowsKernel kernel : kernels()) {
      try {
        gaac_rows_to_float(bytes.data(), n_bytes, kBt, kD, bases, kBt, out.data(), kernel);
        ADD_FAILURE() << "accepted; expected an error mentioning '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kCorrupt) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    }
    EXPECT_THROW(codec::gaac_decode_rows_ref(bytes.data(), n_bytes, kBt, kD, bases, 0, kBt,
                                             std::vector<uint16_t>(size_t(kBt) * kD).data()),
                 Error);
  };
  // Escapes cut short: the slot ends before the last group's escape bytes.
  expect_corrupt(slot, used - 1, "escape");
  // Shorter than the fixed part.
  expect_corrupt(slot, fixed - 1, "fixed part");
  // A tag of 3 in the middle of the page.
  std::vector<uint8_t> bad_tag = slot;
  const size_t tags = format::gaac_tile_tag_offset(GaacElement::kBf16, kBt, kD);
  bad_tag[tags + 13] |= 0x03;
  expect_corrupt(bad_tag, used, "tag 3");
}

TEST(GaacRows, BadArgumentsAreErrors) {
  codec::GaacBases bases;
  bases.b3.assign(64, 100);
  bases.b4.assign(64, 100);
  std::vector<uint8_t> slot(4096, 0);
  std::vector<float> out(32 * 256);
  EXPECT_THROW(gaac_rows_to_float(slot.data(), slot.size(), 16, 64, bases, 17, out.data()), Error);
  EXPECT_THROW(gaac_rows_to_float(slot.data(), slot.size(), 16, 200, bases, 1, out.data()), Error);
  EXPECT_THROW(gaac_rows_to_float(slot.data(), slot.size(), 16, 128, bases, 1, out.data()), Error);
  EXPECT_THROW(gaac_rows_to_float(slot.data(), slot.size(), 0, 64, bases, 0, out.data()), Error);
  if (!gaac_rows_kernel_supported(GaacRowsKernel::kAvx512Vbmi)) {
    EXPECT_THROW(gaac_rows_to_float(slot.data(), slot.size(), 16, 64, bases, 1, out.data(),
                                    GaacRowsKernel::kAvx512Vbmi),
                 Error);
  }
}

}  // namespace
}  // namespace certkv::attention
