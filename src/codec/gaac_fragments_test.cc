// GAAC pages in the device layout (codec/gaac_fragments.h): lossless round trips on real SmolLM2
// KV with its calibration's windows and on adversarial values at head_dim 64 and 128, the
// built-value arithmetic over every bf16 pattern, pages the encoder must keep exact, and corrupt
// pages read without a crash and reported.
#include "codec/gaac_fragments.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "format/fragment_layout.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace certkv::codec {
namespace {

namespace frag = format::fragment;
constexpr int kT = frag::kPageTokens;

// Encodes and decodes rows; expects the encoder's verdict `fits` and, when it fits, every bit back.
void expect_round_trip(const std::vector<uint16_t>& rows, bool key, int D, const std::vector<uint8_t>& bases, bool fits,
                       const std::string& what) {
  std::vector<uint8_t> page(size_t(frag::gaac_page_bytes(D)), 0xa5);
  ASSERT_EQ(gaac_fragment_encode_page_ref(rows.data(), key, D, bases.data(), page.data()), fits) << what;
  if (!fits) return;
  std::vector<uint16_t> back(rows.size(), 0x1234);
  ASSERT_TRUE(gaac_fragment_decode_page_ref(page.data(), key, D, bases.data(), back.data())) << what;
  for (size_t i = 0; i < rows.size(); ++i)
    ASSERT_EQ(back[i], rows[i]) << what << " element " << i << " (token " << i / size_t(D) << ", channel "
                                << i % size_t(D) << ")";
}

TEST(GaacFragments, PageSizesAndLayoutBits) {
  EXPECT_EQ(frag::gaac_page_bytes(64), 16 * 64 * 3 / 2 + 16);
  EXPECT_EQ(frag::gaac_page_bytes(128), 16 * 128 * 3 / 2 + 32);
  EXPECT_EQ(frag::gaac_page_bytes(128) % 16, 0);
  EXPECT_EQ(frag::gaac_page_bytes(64) % 16, 0);
  EXPECT_EQ(4 + 4 * frag::gaac_exception_capacity(64), frag::gaac_exception_bytes(64));
  EXPECT_EQ(4 + 4 * frag::gaac_exception_capacity(128), frag::gaac_exception_bytes(128));
  // The code and sign bits of a word's eight elements are 32 distinct bits, and the masks of the
  // decode separate them: codes of 0..3 under 0x7777, of 4..7 under 0x7777 << 16, signs of 0..3
  // under 0x80808080, of 4..7 under 0x80808080 >> 4.
  uint32_t used = 0;
  for (int e = 0; e < 8; ++e) {
    for (int b = 0; b < 3; ++b) {
      const uint32_t bit = 1u << (frag::gaac_code_bit(e) + b);
      EXPECT_EQ(used & bit, 0u);
      used |= bit;
      EXPECT_NE(bit & (e < 4 ? 0x7777u : 0x77770000u), 0u);
    }
    const uint32_t sign = 1u << frag::gaac_sign_bit(e);
    EXPECT_EQ(used & sign, 0u);
    used |= sign;
    EXPECT_NE(sign & (e < 4 ? 0x80808080u : 0x08080808u), 0u);
  }
  EXPECT_EQ(used, 0xffffffffu);
  // element_token / element_channel invert element_index on both maps.
  for (bool key : {true, false})
    for (int t = 0; t < kT; ++t)
      for (int c = 0; c < 128; ++c) {
        const int i = frag::element_index(key, t, c);
        ASSERT_EQ(frag::element_token(key, i), t);
        ASSERT_EQ(frag::element_channel(key, i), c);
      }
}

// Every bf16 pattern at bases across the range: whenever a built value exists, unbuilding it
// gives the pattern back; in-window normals always have one.
TEST(GaacFragments, BuiltValuesInvertForEveryBf16) {
  for (int base : {0, 1, 60, 111, 119, 127, 128, 200, 240}) {
    int built_ok = 0;
    for (uint32_t x = 0; x < 65536; ++x) {
      uint16_t built, back;
      const int e = int(x >> 7) & 0xff;
      const bool window = e >= 1 && e <= 254 && e >= base && e < base + 16;
      if (!gaac_built_bits(uint16_t(x), base, &built)) {
        EXPECT_FALSE(window) << "base " << base << " x " << x;
        uint16_t device_built;
        EXPECT_FALSE(frag::gaac_built(uint16_t(x), base, &device_built)) << "base " << base << " x " << x;
        continue;
      }
      EXPECT_EQ(frag::gaac_in_window(uint16_t(x), base), window);
      ++built_ok;
      ASSERT_TRUE(gaac_unbuilt_bits(built, base, &back)) << "base " << base << " x " << x;
      ASSERT_EQ(back, uint16_t(x)) << "base " << base << " x " << x;  // NaN payloads too
      if (window) {
        EXPECT_EQ((built >> 7) & 0xff, frag::kGaacBuilt + e - base);
      }
      uint16_t device_built = 0;  // the device encoder's exponent arithmetic agrees
      ASSERT_TRUE(frag::gaac_built(uint16_t(x), base, &device_built)) << "base " << base << " x " << x;
      ASSERT_EQ(device_built, built) << "base " << base << " x " << x;
    }
    EXPECT_GT(built_ok, 4 * 16 * 128) << base;
  }
}

class GaacFragmentsRealKv : public ::testing::Test {
 protected:
  static constexpr int kHeads = 3, kTokens = 32, kD = 64;
  void SetUp() override {
    file_ = format::SafetensorsFile::open(std::string(CERTKV_SOURCE_DIR) +
                                          "/src/codec/testdata/smollm2_kv_pages.safetensors");
    cal_ = GaacCalibration::load(std::string(CERTKV_SOURCE_DIR) +
                                     "/src/codec/testdata/smollm2_gaac_calibration.safetensors",
                                 GaacShape{30, kHeads, kD, kT, GaacElement::kBf16});
  }
  std::vector<uint16_t> page_rows(int layer, bool key, int head, int first) const {
    const format::SafetensorsTensor* t = file_->find("eval.layer" + std::to_string(layer) + (key ? ".k" : ".v"));
    EXPECT_NE(t, nullptr);
    std::vector<uint16_t> rows(size_t(kT) * kD);
    std::memcpy(rows.data(), t->data + (size_t(head) * kTokens + size_t(first)) * kD * 2, rows.size() * 2);
    return rows;
  }
  std::unique_ptr<format::SafetensorsFile> file_;
  GaacCalibration cal_;
};

// Calibrated on one book, another book's pages round trip; count how many a page keeps exact
// and the bytes against bf16.
TEST_F(GaacFragmentsRealKv, CalibratedWindowsEncodeAnotherBookLosslessly) {
  int pages = 0, exact = 0, exceptions = 0;
  for (int layer : {0, 15, 29})
    for (bool key : {true, false})
      for (int h = 0; h < kHeads; ++h)
        for (int first = 0; first < kTokens; first += kT) {
          const std::vector<uint16_t> rows = page_rows(layer, key, h, first);
          const std::vector<uint8_t>& b4 = cal_.bases(layer, key ? kGaacKey : kGaacValue, h).b4;
          const int n = gaac_fragment_exceptions(rows.data(), kD, b4.data());
          const bool fits = n <= frag::gaac_exception_capacity(kD);
          ++pages;
          exact += !fits;
          exceptions += n;
          expect_round_trip(rows, key, kD, b4, fits,
                            "layer " + std::to_string(layer) + (key ? " K" : " V") + " head " + std::to_string(h));
        }
  RecordProperty("pages", pages);
  RecordProperty("exact_pages", exact);
  RecordProperty("exceptions", exceptions);
  EXPECT_EQ(pages, 36);
  EXPECT_LE(exact, 2);  // the windows hold nearly every element of real KV
}

// The same pages with arbitrary windows (every exponent out of its window is an exception): each
// either round trips or is refused, never decoded wrong; at head_dim 128 two heads side by side.
TEST_F(GaacFragmentsRealKv, ShiftedWindowsAndHeadDim128) {
  std::mt19937 rng(7);
  for (int layer : {0, 29})
    for (bool key : {true, false}) {
      const std::vector<uint16_t> a = page_rows(layer, key, 0, 0), b = page_rows(layer, key, 1, 16);
      std::vector<uint16_t> wide(size_t(kT) * 128);
      for (int t = 0; t < kT; ++t)
        for (int c = 0; c < 128; ++c) wide[size_t(t) * 128 + c] = c < 64 ? a[size_t(t) * 64 + c] : b[size_t(t) * 64 + c - 64];
      std::vector<uint8_t> bases(128);
      const std::vector<uint8_t>& ka = cal_.bases(layer, key ? kGaacKey : kGaacValue, 0).b4;
      const std::vector<uint8_t>& kb = cal_.bases(layer, key ? kGaacKey : kGaacValue, 1).b4;
      for (int c = 0; c < 128; ++c) bases[size_t(c)] = c < 64 ? ka[size_t(c)] : kb[size_t(c - 64)];
      expect_round_trip(wide, key, 128, bases,
                        gaac_fragment_exceptions(wide.data(), 128, bases.data()) <= frag::gaac_exception_capacity(128),
                        "D 128 layer " + std::to_string(layer));
      for (int shift : {-3, -1, 1, 2}) {
        std::vector<uint8_t> moved(bases);
        for (auto& x : moved) x = uint8_t(std::clamp(int(x) + shift * int(rng() % 3), 0, 240));
        const int n = gaac_fragment_exceptions(wide.data(), 128, moved.data());
        expect_round_trip(wide, key, 128, moved, n <= frag::gaac_exception_capacity(128),
                          "D 128 shifted " + std::to_string(shift));
      }
    }
}

// Adversarial values: zeros of both signs, subnormals, infinities, NaNs with payloads, the
// largest and smallest normals, each an exception, a page at a time up to the capacity, over both
// maps and head_dims.
template <int D>
void adversarial_pages(uint32_t seed) {
  std::mt19937 rng(seed);
  const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc1, 0xffff, 0x7f7f, 0x0080, 0x8080};
  for (int rep = 0; rep < 40; ++rep) {
    std::vector<uint8_t> bases(D);
    for (auto& b : bases) b = uint8_t(100 + rng() % 30);
    std::vector<uint16_t> rows(size_t(kT) * D);
    for (int t = 0; t < kT; ++t)
      for (int c = 0; c < D; ++c) {
        const uint32_t e = bases[size_t(c)] + rng() % 16;
        rows[size_t(t) * D + c] = uint16_t(((rng() & 1) << 15) | (e << 7) | (rng() & 0x7f));
      }
    const int n = rep % (frag::gaac_exception_capacity(D) + 3);
    for (int i = 0; i < n; ++i) rows[rng() % rows.size()] = specials[rng() % std::size(specials)];
    const bool key = rep % 2 == 0;
    // The encoder's verdict from the rows alone: within the capacity, and every exception built.
    bool fits = gaac_fragment_exceptions(rows.data(), D, bases.data()) <= frag::gaac_exception_capacity(D);
    for (int i = 0; i < kT * D && fits; ++i) {
      uint16_t built;
      const int e = (rows[size_t(i)] >> 7) & 0xff, b = bases[size_t(i % D)];
      const bool window = e >= 1 && e <= 254 && e >= b && e < b + 16;
      fits = window || gaac_built_bits(rows[size_t(i)], b, &built);
    }
    expect_round_trip(rows, key, D, bases, fits, "D " + std::to_string(D) + " rep " + std::to_string(rep));
  }
}
TEST(GaacFragments, AdversarialValuesRoundTripOrStayExact) {
  adversarial_pages<64>(11);
  adversarial_pages<128>(12);
}

TEST(GaacFragments, PagesThatMustStayExact) {
  constexpr int D = 64;
  std::vector<uint8_t> bases(D, 120);
  std::vector<uint16_t> rows(size_t(kT) * D, uint16_t(121 << 7));
  std::vector<uint8_t> page(size_t(frag::gaac_page_bytes(D)));
  // One exception more than the page holds.
  for (int i = 0; i <= frag::gaac_exception_capacity(D); ++i) rows[size_t(7 * i)] = 0;
  EXPECT_FALSE(gaac_fragment_encode_page_ref(rows.data(), true, D, bases.data(), page.data()));
  rows[0] = uint16_t(121 << 7);
  EXPECT_TRUE(gaac_fragment_encode_page_ref(rows.data(), true, D, bases.data(), page.data()));
  // A subnormal that a right shift (base above the built exponent) would round.
  std::vector<uint8_t> high(D, 200);
  std::vector<uint16_t> one(size_t(kT) * D, uint16_t(205 << 7));
  one[5] = 0x0003;
  EXPECT_FALSE(gaac_fragment_encode_page_ref(one.data(), false, D, high.data(), page.data()));
  // A huge value whose built exponent would pass 254.
  one[5] = 0x7f00;
  EXPECT_FALSE(gaac_fragment_encode_page_ref(one.data(), false, D, std::vector<uint8_t>(D, 2).data(), page.data()));
}

// Corrupt pages: counts past the capacity, entries outside the page, built values with no bf16
// behind them, and random bytes: reported or decoded, never read past the page.
TEST(GaacFragments, CorruptPagesAreReported) {
  constexpr int D = 128;
  std::vector<uint8_t> bases(D, 110);
  std::vector<uint16_t> rows(size_t(kT) * D, uint16_t(115 << 7)), back(rows.size());
  rows[3] = 0;
  std::vector<uint8_t> page(size_t(frag::gaac_page_bytes(D)));
  ASSERT_TRUE(gaac_fragment_encode_page_ref(rows.data(), true, D, bases.data(), page.data()));
  uint8_t* exceptions = page.data() + frag::gaac_low_bytes(D) + frag::gaac_word_bytes(D);
  auto corrupt = [&](auto&& edit) {
    std::vector<uint8_t> bad(page);
    edit(bad.data() + (exceptions - page.data()));
    return gaac_fragment_decode_page_ref(bad.data(), true, D, bases.data(), back.data());
  };
  EXPECT_TRUE(corrupt([](uint8_t*) {}));
  EXPECT_FALSE(corrupt([](uint8_t* x) { x[0] = uint8_t(frag::gaac_exception_capacity(D) + 1); }));
  EXPECT_FALSE(corrupt([](uint8_t* x) { x[0] = 0xff; x[3] = 0xff; }));
  EXPECT_FALSE(corrupt([](uint8_t* x) {  // an element index past the page
    const uint32_t entry = frag::gaac_exception(kT * D, 0);
    std::memcpy(x + 4, &entry, 4);
  }));
  EXPECT_FALSE(corrupt([](uint8_t* x) {  // a built subnormal
    const uint32_t entry = frag::gaac_exception(5, 0x0001);
    std::memcpy(x + 4, &entry, 4);
  }));
  std::mt19937 rng(3);
  for (int rep = 0; rep < 200; ++rep) {
    for (auto& x : page) x = uint8_t(rng());
    gaac_fragment_decode_page_ref(page.data(), rep % 2 == 0, D, bases.data(), back.data());
  }
}

}  // namespace
}  // namespace certkv::codec
