// GaacRowDecoder's float and BF16 rows against gaac_decode_rows_ref: a known answer, random pages
// with every mode on ragged shapes (every kernel, partial and middle row ranges, nothing written
// past the rows), corrupt slots as kCorrupt from every kernel.
#include "codec/gaac.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::codec {
namespace {

using format::GaacElement;

std::vector<GaacKernel> kernels() {
  std::vector<GaacKernel> k;
  for (GaacKernel kernel : {GaacKernel::kRef, GaacKernel::kAvx2, GaacKernel::kAvx512}) {
    if (gaac_kernel_supported(kernel)) k.push_back(kernel);
  }
  return k;
}

// One token of 8 channels, all 3-bit: exponent b3 + code, sign and mantissa from their byte.
TEST(GaacRowDecoder, KnownAnswerOneGroupAsFloats) {
  constexpr int kBt = 1, kD = 8;
  const size_t fixed = format::gaac_page_fixed_bytes(GaacElement::kBf16, kBt, kD);
  ASSERT_EQ(fixed, 8u + 3u + 1u);
  std::vector<uint8_t> slot(fixed, 0);
  // sign+mantissa: element j has mantissa j, element 7 is negative.
  for (int j = 0; j < 8; ++j) slot[size_t(j)] = uint8_t(j);
  slot[7] |= 0x80;
  // codes 0..7 packed 3 bits each, little-endian: element j has code j.
  uint32_t codes = 0;
  for (uint32_t j = 0; j < 8; ++j) codes |= j << (3 * j);
  slot[8] = uint8_t(codes);
  slot[9] = uint8_t(codes >> 8);
  slot[10] = uint8_t(codes >> 16);
  slot[11] = 0;  // tag 0: 3-bit
  GaacBases bases{std::vector<uint8_t>(kD, 120), std::vector<uint8_t>(kD, 0)};
  for (GaacKernel kernel : kernels()) {
    float out[kD];
    GaacRowDecoder(kBt, kD, bases, kernel).decode_rows(slot.data(), slot.size(), 0, 1, out);
    for (int j = 0; j < 8; ++j) {
      const uint16_t bf16 =
          uint16_t((j == 7 ? 0x8000u : 0u) | uint32_t(120 + j) << 7 | uint32_t(j));
      EXPECT_EQ(format::float_to_bits(out[j]), uint32_t(bf16) << 16)
          << gaac_kernel_name(kernel) << " element " << j;
    }
    EXPECT_EQ(out[0], 1.f / 128.f) << gaac_kernel_name(kernel);  // 2^(120 - 127)
  }
}

GaacBases random_bases(int d, std::mt19937& rng) {
  GaacBases b;
  for (int c = 0; c < d; ++c) {
    b.b3.push_back(uint8_t(rng() % 249));
    b.b4.push_back(uint8_t(rng() % 241));
  }
  return b;
}

// A page whose groups take every mode: most exponents inside their channel's 3-bit window, some
// groups spread over 16 values (4-bit), some over all 256 (raw, Inf/NaN patterns included).
// With `raw` false, 3- and 4-bit groups only (the SIMD paths' runs without a raw group).
std::vector<uint16_t> random_page(int bt, int d, const GaacBases& bases, std::mt19937& rng, bool raw = true) {
  std::vector<uint16_t> page(size_t(bt) * size_t(d));
  for (int t = 0; t < bt; ++t) {
    for (int g = 0; g < d / 8; ++g) {
      const uint32_t kind = rng() % (raw ? 10 : 9);  // 0..5 3-bit, 6..8 4-bit, 9 raw
      for (int j = 0; j < 8; ++j) {
        const int c = 8 * g + j;
        unsigned e;
        if (kind < 6) {
          e = bases.b3[size_t(c)] + rng() % 8;
        } else if (kind < 9) {
          e = bases.b4[size_t(c)] + rng() % 16;
        } else {
          e = rng() % 256;
        }
        page[size_t(t) * size_t(d) + size_t(c)] =
            uint16_t((rng() & 1u) << 15 | e << 7 | (rng() & 0x7fu));
      }
    }
  }
  return page;
}

struct Shape {
  int block_tokens;
  int head_dim;
};

// Every kernel against the reference on random pages of `shapes`: every mode (raw), or 3- and
// 4-bit groups only.
void expect_every_kernel_matches_the_reference(std::span<const Shape> shapes, bool raw, uint32_t seed) {
  std::mt19937 rng(seed);
  for (const Shape& s : shapes) {
    for (int trial = 0; trial < 12; ++trial) {
      SCOPED_TRACE("block_tokens " + std::to_string(s.block_tokens) + " head_dim " +
                   std::to_string(s.head_dim) + " trial " + std::to_string(trial));
      const GaacBases bases = random_bases(s.head_dim, rng);
      const std::vector<uint16_t> page = random_page(s.block_tokens, s.head_dim, bases, rng, raw);
      const size_t capacity =
          format::gaac_page_max_escape_bytes(GaacElement::kBf16, s.block_tokens, s.head_dim);
      std::vector<uint8_t> slot(
          format::gaac_slot_bytes(GaacElement::kBf16, s.block_tokens, s.head_dim, capacity));
      const size_t used = gaac_encode_page_ref(page.data(), s.block_tokens, s.head_dim, bases,
                                               capacity, slot.data());
      ASSERT_NE(used, kGaacDoesNotFit);
      if (trial == 0 && s.block_tokens * s.head_dim >= 512) {
        const GaacModeCounts modes = gaac_count_modes(GaacElement::kBf16, slot.data(),
                                                      slot.size(), s.block_tokens, s.head_dim);
        ASSERT_GT(modes.groups[0], 0u);
        ASSERT_GT(modes.groups[1], 0u);
        if (raw) {
          ASSERT_GT(modes.groups[2], 0u);
        } else {
          ASSERT_EQ(modes.groups[2], 0u);
        }
      }
      const int bt = s.block_tokens;
      const std::pair<int, int> ranges[] = {{0, 0},  {0, 1},          {0, bt / 2},
                                            {0, bt}, {bt / 3, bt - bt / 4}, {bt - 1, bt}};
      for (const auto& [t0, t1] : ranges) {
        const size_t count = size_t(t1 - t0) * size_t(s.head_dim);
        std::vector<uint16_t> want(count);
        gaac_decode_rows_ref(slot.data(), used, bt, s.head_dim, bases, t0, t1, want.data());
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(want[i], page[size_t(t0) * size_t(s.head_dim) + i]) << "element " << i;
        }
        for (GaacKernel kernel : kernels()) {
          const GaacRowDecoder decoder(bt, s.head_dim, bases, kernel);
          std::vector<float> floats(count + 1, -7.f);
          decoder.decode_rows(slot.data(), used, t0, t1, floats.data());
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(format::float_to_bits(floats[i]), uint32_t(want[i]) << 16)
                << gaac_kernel_name(kernel) << " rows [" << t0 << ", " << t1 << ") float " << i;
          }
          ASSERT_EQ(floats[count], -7.f) << gaac_kernel_name(kernel) << " wrote past the rows";
          std::vector<uint16_t> bits(count + 1, 0x5555);
          decoder.decode_rows(slot.data(), used, t0, t1, bits.data());
          ASSERT_EQ(std::memcmp(bits.data(), want.data(), count * sizeof(uint16_t)), 0)
              << gaac_kernel_name(kernel) << " rows [" << t0 << ", " << t1 << ")";
          ASSERT_EQ(bits[count], 0x5555) << gaac_kernel_name(kernel) << " wrote past the rows";
        }
      }
    }
  }
}

TEST(GaacRowDecoder, EveryKernelMatchesTheReferenceOnEveryMode) {
  // Tiles of 64 and 128 channels, several tiles, and rows of 9, 5, 12 and 3 groups (the 8-, 4-
  // and 1-group steps of the SIMD paths).
  const Shape shapes[] = {{16, 64}, {16, 128}, {16, 256}, {7, 96},  {1, 8},  {3, 24},
                          {4, 16},  {17, 192}, {3, 72},  {5, 40},  {129, 64}};
  expect_every_kernel_matches_the_reference(shapes, true, 2026);
}

// Pages without a raw group: the AVX-512 path that places every row's escapes from the page's
// tags up front (rows of whole runs of 8 groups, head_dim 64, 128 and 256), on whole pages, row
// ranges that start and end inside them, more rows than its buffers hold (129 x 128) and slots
// that end with the last escape byte.
TEST(GaacRowDecoder, EveryKernelMatchesTheReferenceOnThreeAndFourBitPages) {
  const Shape shapes[] = {{16, 64}, {16, 128}, {16, 256}, {1, 64}, {3, 128}, {17, 64}, {33, 128}, {129, 128},
                          {7, 96}};
  expect_every_kernel_matches_the_reference(shapes, false, 2027);
}

TEST(GaacRowDecoder, CorruptSlotsAreCorruptFromEveryKernel) {
  for (bool raw : {true, false}) {
    SCOPED_TRACE(raw ? "every mode" : "3- and 4-bit groups");
    constexpr int kBt = 16, kD = 256;  // two tiles
    std::mt19937 rng(5);
    const GaacBases bases = random_bases(kD, rng);
    const std::vector<uint16_t> page = random_page(kBt, kD, bases, rng, raw);
    const size_t capacity = format::gaac_page_max_escape_bytes(GaacElement::kBf16, kBt, kD);
    const size_t fixed = format::gaac_page_fixed_bytes(GaacElement::kBf16, kBt, kD);
    std::vector<uint8_t> slot(fixed + capacity);
    const size_t used = gaac_encode_page_ref(page.data(), kBt, kD, bases, capacity, slot.data());
    ASSERT_GT(used, fixed);  // the page has escapes
    auto expect_corrupt = [&](const std::vector<uint8_t>& bytes, size_t n_bytes, const char* needle) {
      // An exact-size copy, so a read past the slot is an ASan report.
      const std::vector<uint8_t> exact(bytes.begin(), bytes.begin() + ptrdiff_t(n_bytes));
      for (GaacKernel kernel : kernels()) {
        const GaacRowDecoder decoder(kBt, kD, bases, kernel);
        for (bool as_float : {true, false}) {
          try {
            if (as_float) {
              std::vector<float> out(size_t(kBt) * kD);
              decoder.decode_rows(exact.data(), n_bytes, 0, kBt, out.data());
            } else {
              std::vector<uint16_t> out(size_t(kBt) * kD);
              decoder.decode_rows(exact.data(), n_bytes, 0, kBt, out.data());
            }
            ADD_FAILURE() << gaac_kernel_name(kernel) << (as_float ? " float" : " bf16")
                          << " accepted; expected an error mentioning '" << needle << "'";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), StatusCode::kCorrupt) << e.what();
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          }
        }
      }
    };
    // Escapes cut short: the slot ends before the last group's escape bytes.
    expect_corrupt(slot, used - 1, "escape");
    // Shorter than the fixed part.
    expect_corrupt(slot, fixed - 1, "fixed part");
    // A tag of 3 in the middle of the first tile, and in the second tile.
    const size_t tags = format::gaac_tile_tag_offset(GaacElement::kBf16, kBt, 128);
    std::vector<uint8_t> bad_tag = slot;
    bad_tag[tags + 13] |= 0x03;
    expect_corrupt(bad_tag, used, "mode tag 3");
    bad_tag = slot;
    bad_tag[format::gaac_tile_fixed_bytes(GaacElement::kBf16, kBt, 128) + tags + 21] |= 0x30;
    expect_corrupt(bad_tag, used, "mode tag 3");
  }
}

// Adversarial bytes on pages without a raw group: every bit flip of every byte (tags that turn
// 3-bit groups into 4-bit, raw or invalid ones, escapes moved, codes changed) and every kernel
// agrees with the reference: the same floats and BF16 bits, or kCorrupt where it throws.
TEST(GaacRowDecoder, EveryKernelAgreesWithTheReferenceOnFlippedBytes) {
  std::mt19937 rng(31);
  const Shape shapes[] = {{16, 64}, {4, 128}};
  for (const Shape& s : shapes) {
    const int bt = s.block_tokens, d = s.head_dim;
    const GaacBases bases = random_bases(d, rng);
    const std::vector<uint16_t> page = random_page(bt, d, bases, rng, false);
    const size_t capacity = format::gaac_page_max_escape_bytes(GaacElement::kBf16, bt, d);
    std::vector<uint8_t> slot(format::gaac_slot_bytes(GaacElement::kBf16, bt, d, capacity));
    const size_t used = gaac_encode_page_ref(page.data(), bt, d, bases, capacity, slot.data());
    ASSERT_NE(used, kGaacDoesNotFit);
    slot.resize(used);
    size_t n_corrupt = 0;
    for (size_t i = 0; i < used; ++i) {
      for (int flip : {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff}) {
        std::vector<uint8_t> bad(slot);
        bad[i] ^= uint8_t(flip);
        for (const auto& [t0, t1] : {std::pair{0, bt}, std::pair{1, bt - 1}}) {
          const size_t count = size_t(t1 - t0) * size_t(d);
          std::vector<uint16_t> want(count);
          bool ref_threw = false;
          try {
            gaac_decode_rows_ref(bad.data(), bad.size(), bt, d, bases, t0, t1, want.data());
          } catch (const Error& e) {
            ASSERT_EQ(e.code(), StatusCode::kCorrupt) << e.what();
            ref_threw = true;
            ++n_corrupt;
          }
          for (GaacKernel kernel : kernels()) {
            const GaacRowDecoder decoder(bt, d, bases, kernel);
            std::vector<float> floats(count);
            std::vector<uint16_t> bits(count);
            bool threw = false;
            try {
              decoder.decode_rows(bad.data(), bad.size(), t0, t1, floats.data());
            } catch (const Error& e) {
              ASSERT_EQ(e.code(), StatusCode::kCorrupt) << e.what();
              threw = true;
            }
            ASSERT_EQ(threw, ref_threw) << gaac_kernel_name(kernel) << " byte " << i << " flip " << flip;
            if (threw) continue;
            decoder.decode_rows(bad.data(), bad.size(), t0, t1, bits.data());
            for (size_t k = 0; k < count; ++k) {
              ASSERT_EQ(format::float_to_bits(floats[k]), uint32_t(want[k]) << 16)
                  << gaac_kernel_name(kernel) << " byte " << i << " flip " << flip << " float " << k;
              ASSERT_EQ(bits[k], want[k]) << gaac_kernel_name(kernel) << " byte " << i << " flip " << flip;
            }
          }
        }
      }
    }
    EXPECT_GT(n_corrupt, 0u);
  }
}

}  // namespace
}  // namespace certkv::codec
