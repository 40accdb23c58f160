// GAAC on FP8 pages (E4M3, E5M2): the same exponent coding on the narrower exponent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "core/status.h"
#include "format/fp8.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace certkv::codec {
namespace {

using format::GaacElement;

GaacBases uniform_bases(int head_dim, uint8_t b3, uint8_t b4) {
  return GaacBases{std::vector<uint8_t>(size_t(head_dim), b3),
                   std::vector<uint8_t>(size_t(head_dim), b4)};
}

// Encodes, checks the escape count, decodes bit-exactly; returns bytes used or kGaacDoesNotFit.
size_t round_trip(GaacElement element, const std::vector<uint8_t>& page, int t, int d,
                  const GaacBases& bases, size_t capacity, std::vector<uint8_t>* slot_out = nullptr) {
  std::vector<uint8_t> slot(format::gaac_slot_bytes(element, t, d, capacity));
  const size_t used = gaac_encode_page_fp8_ref(element, page.data(), t, d, bases, capacity, slot.data());
  const size_t need = gaac_escape_bytes_needed_fp8(element, page.data(), t, d, bases);
  EXPECT_EQ(used, need <= capacity ? format::gaac_page_fixed_bytes(element, t, d) + need
                                   : kGaacDoesNotFit);
  if (used == kGaacDoesNotFit) return used;
  std::vector<uint8_t> out(page.size(), 0xa5);
  gaac_decode_page_fp8_ref(element, slot.data(), slot.size(), t, d, bases, out.data());
  EXPECT_EQ(out, page);
  if (slot_out) *slot_out = slot;
  return used;
}

TEST(GaacFp8, KnownAnswerE5M2ThreeModes) {
  const std::vector<uint8_t> page = {0x31, 0xb6, 0x3b, 0xbc, 0x41, 0xc6, 0x4b, 0xcc,
                                     0xa0, 0x5d, 0xc2, 0x3f, 0xac, 0x51, 0xa6, 0x47,
                                     0x03, 0xfc, 0x05, 0xfa, 0x3f, 0xc0, 0x31, 0x9e};
  const std::vector<uint8_t> expected = {0xf1, 0x18, 0x8f, 0x8c, 0xc7, 0x78, 0x63, 0x3c,
                                         0xc6, 0x88, 0xc6, 0xfa, 0x38, 0x3e, 0x26, 0x78,
                                         0x7c, 0xf0, 0x24, 0xa6, 0xcc, 0x19};
  std::vector<uint8_t> slot;
  ASSERT_EQ(round_trip(GaacElement::kFp8E5M2, page, 1, 24, uniform_bases(24, 12, 8), 3, &slot), 22u);
  EXPECT_EQ(slot, expected);
  EXPECT_EQ(round_trip(GaacElement::kFp8E5M2, page, 1, 24, uniform_bases(24, 12, 8), 2), kGaacDoesNotFit);
}

TEST(GaacFp8, KnownAnswerE4M3ThreeBitAndRaw) {
  const std::vector<uint8_t> page = {0x29, 0xb6, 0x3b, 0xc0, 0x4d, 0xd2, 0x5f, 0xe4,
                                     0x84, 0x79, 0x8e, 0x73, 0xb8, 0x45, 0xaa, 0x1f};
  const std::vector<uint8_t> expected = {0xe1, 0x83, 0xa5, 0xc7, 0x1c, 0x3e, 0x58, 0x7a,
                                         0x88, 0xc6, 0xfa, 0x78, 0x7c, 0x74, 0x08, 0x2a};
  std::vector<uint8_t> slot;
  ASSERT_EQ(round_trip(GaacElement::kFp8E4M3, page, 1, 16, uniform_bases(16, 5, 0), 1, &slot), 16u);
  EXPECT_EQ(slot, expected);
  const GaacModeCounts m = gaac_count_modes(GaacElement::kFp8E4M3, slot.data(), slot.size(), 1, 16);
  EXPECT_EQ(m.groups[0], 1u);
  EXPECT_EQ(m.groups[1], 0u);
  EXPECT_EQ(m.groups[2], 1u);
}

TEST(GaacFp8, EveryEncodingInEveryPositionRoundTrips) {
  for (GaacElement element : {GaacElement::kFp8E4M3, GaacElement::kFp8E5M2}) {
    const int n_exponents = element == GaacElement::kFp8E4M3 ? 16 : 32;
    std::mt19937 rng(5);
    for (int rotation = 0; rotation < 256; rotation += 37) {
      std::vector<uint8_t> page(4 * 64);
      for (size_t i = 0; i < page.size(); ++i) page[i] = uint8_t(i + size_t(rotation));
      if (rotation % 2) std::shuffle(page.begin(), page.end(), rng);
      for (int b3 = 0; b3 + 8 <= n_exponents; b3 += 3) {
        const int b4 = std::min(b3, n_exponents - 16);
        round_trip(element, page, 4, 64, uniform_bases(64, uint8_t(b3), uint8_t(b4)),
                   format::gaac_page_max_escape_bytes(element, 4, 64));
      }
    }
  }
}

TEST(GaacFp8, RandomPagesFromBf16) {
  for (uint32_t seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int t = 1 + int(seed % 17), d = seed % 2 ? 64 : 24;
    std::vector<uint8_t> e4(size_t(t) * d), e5(size_t(t) * d);
    for (size_t i = 0; i < e4.size(); ++i) {
      const uint16_t h = format::float_to_bf16(normal(rng) * float(1 + i % 5));
      e4[i] = format::bf16_to_fp8_e4m3_ref(h);
      e5[i] = format::bf16_to_fp8_e5m2_ref(h);
    }
    round_trip(GaacElement::kFp8E4M3, e4, t, d, uniform_bases(d, 4, 0), size_t(seed % 40));
    round_trip(GaacElement::kFp8E5M2, e5, t, d, uniform_bases(d, 11, 7), size_t(seed % 40));
  }
}

TEST(GaacFp8, FourBitTagInE4M3IsCorruptAndFlipsAreSafe) {
  std::mt19937 rng(9);
  for (GaacElement element : {GaacElement::kFp8E4M3, GaacElement::kFp8E5M2}) {
    std::vector<uint8_t> page(16 * 64);
    for (auto& v : page) v = uint8_t(rng() % 8 == 0 ? rng() : 0x30 + rng() % 24);
    const GaacBases bases = element == GaacElement::kFp8E4M3 ? uniform_bases(64, 5, 0)
                                                             : uniform_bases(64, 11, 8);
    const size_t need = gaac_escape_bytes_needed_fp8(element, page.data(), 16, 64, bases);
    std::vector<uint8_t> slot;
    ASSERT_NE(round_trip(element, page, 16, 64, bases, need, &slot), kGaacDoesNotFit);
    ASSERT_GT(need, 0u);
    const size_t tag_offset = format::gaac_tile_tag_offset(element, 16, 64);
    if (element == GaacElement::kFp8E4M3) {
      std::vector<uint8_t> bad(slot);
      bad[tag_offset + 3] = uint8_t((bad[tag_offset + 3] & ~0x0cu) | 0x04u);  // group 13: tag 1
      std::vector<uint8_t> out(page.size());
      try {
        gaac_decode_page_fp8_ref(element, bad.data(), bad.size(), 16, 64, bases, out.data());
        ADD_FAILURE() << "4-bit tag accepted in an E4M3 page";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kCorrupt);
        EXPECT_NE(std::string(e.what()).find("group 13"), std::string::npos) << e.what();
      }
    }
    for (size_t i = 0; i < slot.size(); ++i) {
      for (int flip : {0x01, 0x10, 0x80, 0xff}) {
        std::vector<uint8_t> bad(slot);
        bad[i] ^= uint8_t(flip);
        std::vector<uint8_t> out(page.size());
        try {
          gaac_decode_page_fp8_ref(element, bad.data(), bad.size(), 16, 64, bases, out.data());
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), StatusCode::kCorrupt);
        }
      }
    }
    for (size_t n = 0; n < slot.size(); ++n) {
      std::vector<uint8_t> cut(slot.begin(), slot.begin() + ptrdiff_t(n));
      std::vector<uint8_t> out(page.size());
      EXPECT_THROW(gaac_decode_page_fp8_ref(element, cut.data(), cut.size(), 16, 64, bases,
                                            out.data()),
                   Error);
    }
  }
}

TEST(GaacFp8, BadElementAndBases) {
  std::vector<uint8_t> page(64), slot(256);
  EXPECT_THROW(gaac_encode_page_fp8_ref(GaacElement::kBf16, page.data(), 1, 64,
                                        uniform_bases(64, 0, 0), 0, slot.data()),
               Error);
  // E4M3: b4 must be 0 (16-wide window of a 4-bit exponent), b3 at most 8.
  EXPECT_THROW(gaac_encode_page_fp8_ref(GaacElement::kFp8E4M3, page.data(), 1, 64,
                                        uniform_bases(64, 9, 0), 0, slot.data()),
               Error);
  EXPECT_THROW(gaac_encode_page_fp8_ref(GaacElement::kFp8E4M3, page.data(), 1, 64,
                                        uniform_bases(64, 0, 1), 0, slot.data()),
               Error);
}

// Real KV converted to FP8: calibrated (bases and capacity) on one book, encoded from another;
// lossless, and smaller than plain FP8.
TEST(GaacFp8, RealKvSmallerThanPlainFp8) {
  const auto file = format::SafetensorsFile::open(
      std::string(CERTKV_SOURCE_DIR) + "/src/codec/testdata/smollm2_kv_pages.safetensors");
  const int layers[3] = {0, 15, 29};
  for (GaacElement element : {GaacElement::kFp8E4M3, GaacElement::kFp8E5M2}) {
    auto fp8_rows = [&](const std::string& book, int l, int kv, int h) {
      const auto* t = file->find(book + ".layer" + std::to_string(layers[l]) + (kv ? ".v" : ".k"));
      const size_t n = size_t(t->shape[1]) * 64;
      std::vector<uint8_t> out(n);
      for (size_t i = 0; i < n; ++i) {
        uint16_t h16;
        memcpy(&h16, t->data + (size_t(h) * n + i) * 2, 2);
        out[i] = element == GaacElement::kFp8E4M3 ? format::bf16_to_fp8_e4m3_ref(h16)
                                                  : format::bf16_to_fp8_e5m2_ref(h16);
      }
      return out;
    };
    GaacCalibrator calibrator(GaacShape{3, 3, 64, 16, element});
    for (int l = 0; l < 3; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < 3; ++h) {
          const auto r = fp8_rows("calib", l, kv, h);
          calibrator.add_fp8(l, kv, h, r.data(), int(r.size() / 64));
        }
      }
    }
    const GaacCalibration cal = calibrator.finish();
    size_t plain = 0, stored = 0;
    for (int l = 0; l < 3; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < 3; ++h) {
          const auto r = fp8_rows("eval", l, kv, h);
          for (size_t p = 0; p + 1024 <= r.size(); p += 1024) {
            const std::vector<uint8_t> page(r.begin() + ptrdiff_t(p), r.begin() + ptrdiff_t(p + 1024));
            plain += 1024;
            const size_t used = round_trip(element, page, 16, 64, cal.bases(l, kv, h),
                                           cal.escape_capacity_bytes(l, kv));
            stored += used == kGaacDoesNotFit ? 1024 : cal.slot_bytes(l, kv);
          }
        }
      }
    }
    EXPECT_LT(stored, plain) << gaac_element_name(element);
  }
}

}  // namespace
}  // namespace certkv::codec
