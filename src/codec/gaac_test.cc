#include "codec/gaac.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/numeric.h"

namespace certkv::codec {
namespace {

using format::GaacElement;

GaacBases uniform_bases(int head_dim, uint8_t b3, uint8_t b4) {
  return GaacBases{std::vector<uint8_t>(size_t(head_dim), b3),
                   std::vector<uint8_t>(size_t(head_dim), b4)};
}

std::vector<GaacKernel> supported_kernels() {
  std::vector<GaacKernel> kernels;
  for (GaacKernel k : {GaacKernel::kRef, GaacKernel::kAvx2, GaacKernel::kAvx512}) {
    if (gaac_kernel_supported(k)) kernels.push_back(k);
  }
  return kernels;
}

size_t slot_size(int block_tokens, int head_dim, size_t capacity) {
  return format::gaac_slot_bytes(GaacElement::kBf16, block_tokens, head_dim, capacity);
}

// Encodes with the plain coder and every SIMD path (identical bytes and return value), decodes
// with every path (whole page, every single row, a middle range, floats) and checks the bits.
// Returns the plain encoder's result; the encoded slot (exactly slot_size bytes) in *slot_out.
size_t check_round_trip(const std::vector<uint16_t>& page, int block_tokens, int head_dim,
                        const GaacBases& bases, size_t capacity,
                        std::vector<uint8_t>* slot_out = nullptr) {
  const size_t slot_bytes = slot_size(block_tokens, head_dim, capacity);
  std::vector<uint8_t> ref(slot_bytes, 0xcd);
  const size_t used =
      gaac_encode_page_ref(page.data(), block_tokens, head_dim, bases, capacity, ref.data());
  EXPECT_EQ(used, gaac_escape_bytes_needed(page.data(), block_tokens, head_dim, bases) <= capacity
                      ? format::gaac_page_fixed_bytes(GaacElement::kBf16, block_tokens, head_dim) +
                            gaac_escape_bytes_needed(page.data(), block_tokens, head_dim, bases)
                      : kGaacDoesNotFit);
  for (GaacKernel k : supported_kernels()) {
    std::vector<uint8_t> simd(slot_bytes, 0xcd);
    const size_t simd_used = gaac_encode_page(page.data(), block_tokens, head_dim, bases,
                                              capacity, simd.data(), k);
    EXPECT_EQ(simd_used, used) << gaac_kernel_name(k);
    if (used != kGaacDoesNotFit) {
      EXPECT_TRUE(std::equal(ref.begin(), ref.begin() + ptrdiff_t(used), simd.begin()))
          << gaac_kernel_name(k);
    }
  }
  if (used == kGaacDoesNotFit) return used;
  const size_t n = page.size();
  for (GaacKernel k : supported_kernels()) {
    std::vector<uint16_t> out(n, 0x5555);
    if (k == GaacKernel::kRef) {
      gaac_decode_page_ref(ref.data(), slot_bytes, block_tokens, head_dim, bases, out.data());
    } else {
      gaac_decode_page(ref.data(), slot_bytes, block_tokens, head_dim, bases, out.data(), k);
    }
    EXPECT_EQ(out, page) << gaac_kernel_name(k);
    const GaacRowDecoder decoder(block_tokens, head_dim, bases, k);
    std::vector<uint16_t> by_decoder(n, 0x5555);
    decoder.decode_rows(ref.data(), slot_bytes, 0, block_tokens, by_decoder.data());
    EXPECT_EQ(by_decoder, page) << gaac_kernel_name(k);
    for (int t = 0; t < block_tokens; ++t) {
      std::vector<uint16_t> row(static_cast<size_t>(head_dim));
      gaac_decode_rows(ref.data(), slot_bytes, block_tokens, head_dim, bases, t, t + 1,
                       row.data(), k);
      EXPECT_TRUE(std::equal(row.begin(), row.end(), page.begin() + ptrdiff_t(t * head_dim)))
          << gaac_kernel_name(k) << " row " << t;
    }
    const int t0 = block_tokens / 3;
    const int t1 = block_tokens - block_tokens / 4;
    std::vector<float> rows(size_t(t1 - t0) * size_t(head_dim));
    gaac_decode_rows(ref.data(), slot_bytes, block_tokens, head_dim, bases, t0, t1, rows.data(),
                     k);
    for (size_t i = 0; i < rows.size(); ++i) {
      const uint32_t want = uint32_t(page[size_t(t0 * head_dim) + i]) << 16;
      EXPECT_EQ(format::float_to_bits(rows[i]), want) << gaac_kernel_name(k) << " float " << i;
    }
  }
  if (slot_out) *slot_out = ref;
  return used;
}

TEST(Gaac, KnownAnswerOneTokenThreeModes) {
  // One token, 24 channels: group 0 in the 3-bit window, group 1 in the 4-bit window only,
  // group 2 raw (exponents 0, 255, 1, 254, ...). Bytes worked out by hand from
  // docs/format/gaac.md.
  const std::vector<uint16_t> page = {
      0x3c00, 0xbc89, 0x3d12, 0xbd9b, 0x3e24, 0xbead, 0x3f36, 0xbfbf, 0xba05, 0x4192, 0xbe1f, 0x3dac,
      0xbbb9, 0x4046, 0xbad3, 0x3ee0, 0x0003, 0x7fa0, 0x00bd, 0x7f5a, 0xbff7, 0xc014, 0xbc31, 0x83ce};
  const std::vector<uint8_t> expected = {
      0x00, 0x89, 0x12, 0x9b, 0x24, 0xad, 0x36, 0xbf, 0x85, 0x12, 0x9f, 0x2c, 0xb9, 0x46,
      0xd3, 0x60, 0x03, 0x20, 0x3d, 0x5a, 0xf7, 0x94, 0xb1, 0xce, 0x88, 0xc6, 0xfa, 0x38,
      0x3e, 0x26, 0x78, 0x7c, 0xe0, 0x24, 0xa6, 0xe0, 0x83, 0xff, 0xe0, 0x03};
  const GaacBases bases = uniform_bases(24, 120, 116);
  std::vector<uint8_t> slot;
  ASSERT_EQ(check_round_trip(page, 1, 24, bases, 6, &slot), expected.size());
  EXPECT_EQ(std::vector<uint8_t>(slot.begin(), slot.begin() + 40), expected);
  const GaacModeCounts counts = gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), 1, 24);
  EXPECT_EQ(counts.groups[0], 1u);
  EXPECT_EQ(counts.groups[1], 1u);
  EXPECT_EQ(counts.groups[2], 1u);
  EXPECT_EQ(counts.escape_bytes, 6u);
  // One escape byte short: does not fit, on every path.
  EXPECT_EQ(check_round_trip(page, 1, 24, bases, 5), kGaacDoesNotFit);
}

// Every BF16 bit pattern (+-0, +-Inf, NaNs with every payload, subnormals, extreme normals) in
// pages of 16 x 64, so each group holds 8 consecutive patterns and the pages together cover
// every exponent 0..255 in every channel position.
TEST(Gaac, EveryBf16PatternRoundTrips) {
  const int t = 16, d = 64;
  const size_t page_elems = size_t(t) * d;
  std::mt19937 rng(7);
  for (const auto& [b3, b4] : std::vector<std::pair<uint8_t, uint8_t>>{
           {0, 0}, {120, 116}, {248, 240}, {127, 120}}) {
    const GaacBases bases = uniform_bases(d, b3, b4);
    for (uint32_t start = 0; start < 65536; start += uint32_t(page_elems)) {
      std::vector<uint16_t> page(page_elems);
      for (size_t i = 0; i < page_elems; ++i) page[i] = uint16_t(start + i);
      // Shuffle within pages for half the pages so groups mix exponents.
      if ((start / page_elems) % 2 == 1) std::shuffle(page.begin(), page.end(), rng);
      check_round_trip(page, t, d, bases,
                       format::gaac_page_max_escape_bytes(GaacElement::kBf16, t, d));
    }
  }
}

TEST(Gaac, EveryExponentInsideOneGroup) {
  // Group k of this page holds exponents 8k .. 8k+7 (k = 0..31) with all sign/mantissa mixes.
  const int t = 4, d = 64;
  std::vector<uint16_t> page(size_t(t) * d);
  for (size_t i = 0; i < page.size(); ++i) {
    const uint32_t e = uint32_t(i % 256);
    page[i] = uint16_t(((i / 256) & 1) << 15 | e << 7 | ((i * 37) & 0x7f));
  }
  for (uint8_t b3 : {0, 96, 248}) {
    const GaacBases bases = uniform_bases(d, b3, uint8_t(std::min(240, int(b3))));
    std::vector<uint8_t> slot;
    const size_t used = check_round_trip(page, t, d, bases, 5 * 32, &slot);
    ASSERT_NE(used, kGaacDoesNotFit);
    const GaacModeCounts counts = gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), t, d);
    // Exactly one group (exponents b3..b3+7) is 3-bit.
    EXPECT_EQ(counts.groups[0], 1u) << int(b3);
  }
  // Eight exponents 0, 37, 74, ... 255 in one group: raw.
  std::vector<uint16_t> spread(8);
  for (int j = 0; j < 8; ++j) spread[size_t(j)] = uint16_t(std::min(255, 37 * j) << 7);
  spread[7] = uint16_t(255 << 7 | 0x41);
  std::vector<uint8_t> slot;
  ASSERT_EQ(check_round_trip(spread, 1, 8, uniform_bases(8, 0, 0), 5, &slot), 8u + 3 + 1 + 5);
  EXPECT_EQ(gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), 1, 8).groups[2], 1u);
}

// The mode of a group of 8 equal exponents at e, with b3 = 100 and b4 = 96.
unsigned mode_of(int e) {
  const std::vector<uint16_t> page(8, uint16_t(e << 7 | 0x15));
  std::vector<uint8_t> slot;
  EXPECT_NE(check_round_trip(page, 1, 8, uniform_bases(8, 100, 96), 5, &slot), kGaacDoesNotFit);
  const GaacModeCounts c = gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), 1, 8);
  for (unsigned m = 0; m < 3; ++m) {
    if (c.groups[m] == 1) return m;
  }
  return 3;
}

TEST(Gaac, ModeBoundaries) {
  EXPECT_EQ(mode_of(100), format::kGaacMode3Bit);  // offset 0
  EXPECT_EQ(mode_of(107), format::kGaacMode3Bit);  // offset 7
  EXPECT_EQ(mode_of(108), format::kGaacMode4Bit);  // offset 8 from b3, 12 from b4
  EXPECT_EQ(mode_of(99), format::kGaacMode4Bit);   // below b3, inside b4's window
  EXPECT_EQ(mode_of(96), format::kGaacMode4Bit);   // b4 offset 0
  EXPECT_EQ(mode_of(111), format::kGaacMode4Bit);  // b4 offset 15
  EXPECT_EQ(mode_of(112), format::kGaacModeRaw);   // b4 offset 16
  EXPECT_EQ(mode_of(95), format::kGaacModeRaw);    // below b4
  EXPECT_EQ(mode_of(0), format::kGaacModeRaw);
  EXPECT_EQ(mode_of(255), format::kGaacModeRaw);
  // One element out of the window widens the whole group.
  std::vector<uint16_t> page(8, uint16_t(103 << 7));
  page[5] = uint16_t(108 << 7);
  std::vector<uint8_t> slot;
  check_round_trip(page, 1, 8, uniform_bases(8, 100, 96), 1, &slot);
  EXPECT_EQ(gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), 1, 8).groups[1], 1u);
  // Per-channel bases: channel 3 alone has a high window.
  GaacBases bases = uniform_bases(8, 100, 96);
  bases.b3[3] = 200;
  bases.b4[3] = 196;
  page.assign(8, uint16_t(101 << 7));
  page[3] = uint16_t(207 << 7);
  check_round_trip(page, 1, 8, bases, 0, &slot);
  EXPECT_EQ(gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), 1, 8).groups[0], 1u);
}

// Random pages: per-channel magnitudes like KV (a few outlier channels), NaN/Inf/zero sprinkles,
// random bases and capacities, ragged shapes.
TEST(Gaac, RandomPagesManySeeds) {
  const int shapes[][2] = {{1, 8},   {3, 24},  {16, 64}, {17, 40},
                           {16, 128}, {5, 192}, {16, 256}, {2, 120}};
  for (uint32_t seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed);
    const auto& shape = shapes[seed % 8];
    const int t = shape[0], d = shape[1];
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> scale(static_cast<size_t>(d));
    for (auto& s : scale) s = std::exp2(float(int(rng() % 12) - 6));
    std::vector<uint16_t> page(size_t(t) * d);
    for (size_t i = 0; i < page.size(); ++i) {
      const uint32_t r = rng() % 1000;
      if (r == 0) {
        page[i] = uint16_t(rng());  // any pattern
      } else if (r == 1) {
        page[i] = (rng() & 1) ? 0x8000 : 0x0000;
      } else {
        page[i] = format::float_to_bf16(normal(rng) * scale[i % size_t(d)]);
      }
    }
    GaacBases bases{std::vector<uint8_t>(size_t(d)), std::vector<uint8_t>(size_t(d))};
    for (int c = 0; c < d; ++c) {
      const int center = 127 + int(std::log2(scale[size_t(c)])) + int(rng() % 3) - 1;
      bases.b3[size_t(c)] = uint8_t(std::clamp(center - 5, 0, 248));
      bases.b4[size_t(c)] = uint8_t(std::clamp(center - 11, 0, 240));
    }
    const size_t need = gaac_escape_bytes_needed(page.data(), t, d, bases);
    const size_t capacity = seed % 3 == 0 ? need : seed % 3 == 1 ? need + 7 : need / 2;
    const size_t used = check_round_trip(page, t, d, bases, capacity);
    if (capacity >= need) {
      EXPECT_NE(used, kGaacDoesNotFit) << seed;
    }
  }
}

TEST(Gaac, UnrelatedCalibrationStaysLossless) {
  // Bases fitted to values near 1 encode values near 1e-30 and 1e30 losslessly, at a worse size.
  const int t = 16, d = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const GaacBases bases = uniform_bases(d, 122, 118);
  size_t used_near = 0;
  for (float magnitude : {1.0f, 1e-30f, 1e30f}) {
    std::vector<uint16_t> page(size_t(t) * d);
    for (auto& v : page) v = format::float_to_bf16(normal(rng) * magnitude);
    const size_t used = check_round_trip(page, t, d, bases, 640);
    ASSERT_NE(used, kGaacDoesNotFit);
    if (magnitude == 1.0f) {
      used_near = used;
    } else {
      EXPECT_EQ(used, 1440u + 640u);  // every group raw
      EXPECT_GT(used, used_near);
    }
  }
}

TEST(Gaac, ZeroCapacityAndFullSlots) {
  const int t = 16, d = 64;
  std::vector<uint16_t> page(size_t(t) * d, format::float_to_bf16(1.5f));
  const GaacBases bases = uniform_bases(d, 124, 120);
  EXPECT_EQ(check_round_trip(page, t, d, bases, 0), 1440u);
  page[100] = format::float_to_bf16(1e10f);  // one raw group
  EXPECT_EQ(check_round_trip(page, t, d, bases, 4), kGaacDoesNotFit);
  EXPECT_EQ(check_round_trip(page, t, d, bases, 5), 1445u);
}

// Encodes a page with a mix of modes for the corruption tests.
std::vector<uint8_t> mixed_page_slot(int t, int d, GaacBases* bases, size_t* slot_bytes,
                                     std::vector<uint16_t>* page_out = nullptr) {
  std::mt19937 rng(11);
  std::vector<uint16_t> page(size_t(t) * d);
  for (size_t i = 0; i < page.size(); ++i) {
    const uint32_t r = rng() % 20;
    const int e = r == 0 ? int(rng() % 256) : r < 4 ? 112 + int(rng() % 16) : 120 + int(rng() % 8);
    page[i] = uint16_t((rng() & 1) << 15 | uint32_t(e) << 7 | (rng() & 0x7f));
  }
  *bases = uniform_bases(d, 120, 112);
  const size_t need = gaac_escape_bytes_needed(page.data(), t, d, *bases);
  *slot_bytes = slot_size(t, d, need);
  std::vector<uint8_t> slot;
  EXPECT_NE(check_round_trip(page, t, d, *bases, need, &slot), kGaacDoesNotFit);
  if (page_out) *page_out = page;
  return slot;
}

// Decodes with every path; all must agree: the same values or all kCorrupt.
void expect_decode_agrees_or_corrupt(const std::vector<uint8_t>& slot, int t, int d,
                                     const GaacBases& bases, const std::string& what) {
  std::vector<uint16_t> first;
  bool first_threw = false;
  bool have_first = false;
  for (GaacKernel k : supported_kernels()) {
    // An exact-size heap copy, so a read past the slot is an ASan report.
    std::vector<uint8_t> copy(slot);
    std::vector<uint16_t> out(size_t(t) * d);
    bool threw = false;
    try {
      if (k == GaacKernel::kRef) {
        gaac_decode_page_ref(copy.data(), copy.size(), t, d, bases, out.data());
      } else {
        gaac_decode_page(copy.data(), copy.size(), t, d, bases, out.data(), k);
      }
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), StatusCode::kCorrupt) << what << ": " << e.what();
      threw = true;
    }
    if (!have_first) {
      first = out;
      first_threw = threw;
      have_first = true;
    } else {
      ASSERT_EQ(threw, first_threw) << what << " " << gaac_kernel_name(k);
      if (!threw) {
        ASSERT_EQ(out, first) << what << " " << gaac_kernel_name(k);
      }
    }
  }
}

TEST(Gaac, EverySingleByteFlipDecodesOrIsCorrupt) {
  for (const auto& [t, d] : std::vector<std::pair<int, int>>{{16, 64}, {3, 24}, {2, 256}}) {
    GaacBases bases;
    size_t slot_bytes = 0;
    const std::vector<uint8_t> slot = mixed_page_slot(t, d, &bases, &slot_bytes);
    ASSERT_EQ(slot.size(), slot_bytes);
    size_t n_corrupt = 0;
    for (size_t i = 0; i < slot.size(); ++i) {
      for (int flip : {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff}) {
        std::vector<uint8_t> bad(slot);
        bad[i] ^= uint8_t(flip);
        expect_decode_agrees_or_corrupt(bad, t, d, bases, "byte " + std::to_string(i));
        try {
          std::vector<uint16_t> out(size_t(t) * d);
          gaac_decode_page_ref(bad.data(), bad.size(), t, d, bases, out.data());
        } catch (const Error&) {
          ++n_corrupt;
        }
      }
    }
    // Tag flips that make 3 or push escapes past the slot are caught.
    EXPECT_GT(n_corrupt, 0u);
  }
}

TEST(Gaac, TruncatedSlotIsCorrupt) {
  const int t = 16, d = 64;
  GaacBases bases;
  size_t slot_bytes = 0;
  const std::vector<uint8_t> slot = mixed_page_slot(t, d, &bases, &slot_bytes);
  ASSERT_GT(slot_bytes, 1440u);  // has escapes
  for (size_t n = 0; n < slot_bytes; ++n) {
    const std::vector<uint8_t> cut(slot.begin(), slot.begin() + ptrdiff_t(n));
    for (GaacKernel k : supported_kernels()) {
      std::vector<uint16_t> out(size_t(t) * d);
      try {
        gaac_decode_page(cut.data(), cut.size(), t, d, bases, out.data(), k);
        ADD_FAILURE() << "slot cut to " << n << " bytes decoded on " << gaac_kernel_name(k);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kCorrupt);
      }
    }
  }
}

TEST(Gaac, TagThreeIsRejectedNamingTheGroup) {
  const int t = 16, d = 64;
  GaacBases bases;
  size_t slot_bytes = 0;
  std::vector<uint8_t> slot = mixed_page_slot(t, d, &bases, &slot_bytes);
  const size_t tag_offset = format::gaac_tile_tag_offset(GaacElement::kBf16, t, d);
  slot[tag_offset + 9] |= 0x30;  // group 38
  for (GaacKernel k : supported_kernels()) {
    std::vector<uint16_t> out(size_t(t) * d);
    try {
      gaac_decode_page(slot.data(), slot.size(), t, d, bases, out.data(), k);
      ADD_FAILURE() << "tag 3 accepted by " << gaac_kernel_name(k);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kCorrupt);
      EXPECT_NE(std::string(e.what()).find("group 38"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(gaac_count_modes(GaacElement::kBf16, slot.data(), slot.size(), t, d), Error);
}

TEST(Gaac, RowDecodeReadsOnlyTheRowsEscapes) {
  // Rows decoded alone match the page, for every row range; a range before a corrupted tag of a
  // later row still decodes (its escape position does not depend on later tags).
  const int t = 16, d = 64;
  GaacBases bases;
  size_t slot_bytes = 0;
  std::vector<uint16_t> page;
  std::vector<uint8_t> slot = mixed_page_slot(t, d, &bases, &slot_bytes, &page);
  for (GaacKernel k : supported_kernels()) {
    for (int t0 = 0; t0 <= t; ++t0) {
      for (int t1 = t0; t1 <= t; ++t1) {
        std::vector<uint16_t> rows(size_t(t1 - t0) * d + 1, 0x7777);
        gaac_decode_rows(slot.data(), slot.size(), t, d, bases, t0, t1, rows.data(), k);
        ASSERT_TRUE(std::equal(rows.begin(), rows.end() - 1, page.begin() + ptrdiff_t(t0 * d)));
        ASSERT_EQ(rows.back(), 0x7777);  // nothing written past the rows
      }
    }
  }
  const size_t tag_offset = format::gaac_tile_tag_offset(GaacElement::kBf16, t, d);
  slot[tag_offset + 31] = 0xff;  // last token's groups
  std::vector<uint16_t> rows(size_t(15) * d);
  gaac_decode_rows(slot.data(), slot.size(), t, d, bases, 0, 15, rows.data());
  EXPECT_TRUE(std::equal(rows.begin(), rows.end(), page.begin()));
  EXPECT_THROW(gaac_decode_rows(slot.data(), slot.size(), t, d, bases, 15, 16, rows.data()), Error);
}

TEST(Gaac, EscapesBeforeTheRowsPastTheSlotAreCorrupt) {
  // Regression (found by fuzz/gaac_fuzz.cc): group 0 is 4-bit but the slot has no escape bytes;
  // decoding only token 2 (a 3-bit group) must still report the page corrupt on every path.
  const int t = 3, d = 8;
  std::vector<uint8_t> slot(format::gaac_page_fixed_bytes(GaacElement::kBf16, t, d), 0x11);
  slot.back() = 0x01;  // tags: group 0 = 4-bit, groups 1, 2 = 3-bit
  for (GaacKernel k : supported_kernels()) {
    std::vector<uint16_t> row(d);
    EXPECT_THROW(gaac_decode_rows(slot.data(), slot.size(), t, d, uniform_bases(d, 100, 96), 2,
                                  3, row.data(), k),
                 Error)
        << gaac_kernel_name(k);
    // An empty row range reads nothing and succeeds.
    gaac_decode_rows(slot.data(), slot.size(), t, d, uniform_bases(d, 100, 96), 2, 2, row.data(),
                     k);
  }
}

TEST(Gaac, BadArgumentsAreClearErrors) {
  std::vector<uint16_t> page(16 * 64);
  std::vector<uint8_t> slot(4096);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return StatusCode::kOk;
  };
  const GaacBases good = uniform_bases(64, 120, 116);
  EXPECT_EQ(code_of([&] { gaac_encode_page_ref(page.data(), 16, 12, good, 0, slot.data()); }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { gaac_encode_page_ref(page.data(), 0, 64, good, 0, slot.data()); }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              gaac_encode_page_ref(page.data(), 16, 64, uniform_bases(32, 1, 1), 0, slot.data());
            }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              gaac_encode_page(page.data(), 16, 64, uniform_bases(64, 249, 0), 0, slot.data());
            }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              gaac_decode_page(slot.data(), slot.size(), 16, 64, uniform_bases(64, 0, 241),
                               page.data());
            }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              gaac_decode_rows(slot.data(), slot.size(), 16, 64, good, 3, 17, page.data());
            }),
            StatusCode::kOutOfRange);
  EXPECT_EQ(code_of([&] {
              gaac_decode_rows(slot.data(), slot.size(), 16, 64, good, 4, 3, page.data());
            }),
            StatusCode::kOutOfRange);
}

TEST(Gaac, RefusesAllZeroSuccess) {
  // A decoder that wrote nothing would pass round trips of zero pages; this page has no zeros.
  const int t = 16, d = 64;
  std::vector<uint16_t> page(size_t(t) * d);
  for (size_t i = 0; i < page.size(); ++i) page[i] = uint16_t(0x3f00 + (i % 200) + 1);
  std::vector<uint8_t> slot;
  check_round_trip(page, t, d, uniform_bases(d, 124, 120), 640, &slot);
  for (GaacKernel k : supported_kernels()) {
    std::vector<uint16_t> out(page.size(), 0);
    gaac_decode_page(slot.data(), slot.size(), t, d, uniform_bases(d, 124, 120), out.data(), k);
    EXPECT_EQ(std::count(out.begin(), out.end(), uint16_t(0)), 0);
    EXPECT_EQ(out, page);
  }
}

}  // namespace
}  // namespace certkv::codec
