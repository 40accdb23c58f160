// Lossy KV page codecs: round trips and error bounds of every scheme on ragged shapes, Tier A
// witness / rho soundness, the dither8 proof-kernel contract, the dither generator, page bytes,
// and bad input (non-finite values, scale overflow, bad specs, garbage pages).
#include "codec/lossy_page.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/dither8_generator.h"
#include "format/fp8.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace certkv::codec {
namespace {

using format::bf16_to_float;
using format::float_to_bf16;
using format::fp16_to_float;

constexpr int kHeadDims[] = {32, 64, 96, 128, 256};
constexpr int kBlockTokenCounts[] = {1, 3, 16, 17};
constexpr RopePairing kPairings[] = {RopePairing::kInterleaved, RopePairing::kHalfSplit};
constexpr uint64_t kTestDitherKey = 0x5eed5eed12345678ull;

LossyScheme scheme_at(int i) { return static_cast<LossyScheme>(i); }

uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
float fp16_at(const uint8_t* p) { return fp16_to_float(load_u16(p)); }

uint32_t float_bits(float f) { return format::float_to_bits(f); }

LossyPageSpec make_spec(LossyScheme scheme, bool key, int bt, int d, RopePairing pairing,
                        const std::vector<uint16_t>& outliers = {}) {
  LossyPageSpec spec;
  spec.scheme = scheme;
  spec.key = key;
  spec.block_tokens = bt;
  spec.head_dim = d;
  spec.pairing = pairing;
  spec.dither_key = kTestDitherKey;
  spec.n_outlier_pairs = int(outliers.size());
  spec.outlier_pairs = outliers.empty() ? nullptr : outliers.data();
  return spec;
}

std::vector<float> to_float(const std::vector<uint16_t>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_to_float(x[i]);
  return f;
}

// One block of keys or values: every channel normal with its own log-normal scale, plus massive
// activations on both channels of RoPE pairs 1 and P - 2, and for K pages one value of 1000
// (beyond E4M3's 448) in token 1.
std::vector<uint16_t> make_block(uint64_t seed, int bt, int d, RopePairing pairing, bool key) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> sigma(static_cast<size_t>(d)), massive(size_t(d), 0.0f);
  for (float& s : sigma) s = std::exp(0.5f * normal(rng));
  const int n_pairs = d / 2;
  for (int pair : {1, n_pairs - 2}) {
    for (int which = 0; which < 2; ++which) {
      massive[size_t(rope_pair_channel(pairing, d, pair, which))] =
          (which ? -1.0f : 1.0f) * (120.0f + float(pair % 3) * 60.0f);
    }
  }
  std::vector<uint16_t> x(size_t(bt) * d);
  for (int t = 0; t < bt; ++t) {
    for (int c = 0; c < d; ++c) {
      const float v =
          massive[c] != 0.0f ? massive[c] * (1.0f + 0.05f * normal(rng)) : sigma[c] * normal(rng);
      x[size_t(t) * d + c] = float_to_bf16(v);
    }
  }
  if (key && bt >= 2)
    x[size_t(d) + size_t(rope_pair_channel(pairing, d, 1, 0))] = float_to_bf16(1000.0f);
  return x;
}

// The calibration-style outlier pairs of a block: its m pairs of largest magnitude.
std::vector<uint16_t> outliers_of(const std::vector<uint16_t>& x, int d, RopePairing pairing,
                                  int m) {
  std::vector<uint16_t> pairs(static_cast<size_t>(m));
  const std::vector<float> f = to_float(x);
  select_outlier_pairs(f.data(), int(x.size()) / d, d, pairing, m, pairs.data());
  return pairs;
}

std::vector<uint8_t> outlier_mask(const LossyPageSpec& spec) {
  std::vector<uint8_t> mask(size_t(spec.head_dim), 0);
  for (int i = 0; i < spec.n_outlier_pairs; ++i) {
    for (int which = 0; which < 2; ++which) {
      mask[size_t(rope_pair_channel(spec.pairing, spec.head_dim, spec.outlier_pairs[i], which))] =
          1;
    }
  }
  return mask;
}

// Encodes (expecting success) into a freshly poisoned page and decodes it.
std::vector<float> round_trip(const LossyPageSpec& spec, uint32_t slot,
                              const std::vector<uint16_t>& x, std::vector<uint8_t>* page) {
  page->assign(lossy_page_bytes(spec), 0xa5);
  EXPECT_TRUE(lossy_encode_page_ref(spec, slot, x.data(), page->data()));
  std::vector<float> recon(x.size(), std::numeric_limits<float>::quiet_NaN());
  lossy_decode_page_ref(spec, slot, page->data(), recon.data());
  return recon;
}

// The largest |x^ - x| the scheme allows for element (t, c), read from the page's own
// parameters as docs/format/lossy_pages.md lays them out.
double element_bound(const LossyPageSpec& spec, const uint8_t* page,
                     const std::vector<float>& scales, int t, int c, float x, float recon) {
  const int d = spec.head_dim, groups = d / kQuantGroup, bt = spec.block_tokens;
  const double ax = std::fabs(double(x));
  switch (spec.scheme) {
    case LossyScheme::kFp8E4M3:
      // Saturation at 448, else half an E4M3 step: 2^-4 relative, 2^-10 among subnormals.
      return ax > 448.0 ? ax - 448.0 : std::max(ax * 0x1p-4, 0x1p-10);
    case LossyScheme::kFp8E5M2:
      return std::max(ax * 0x1p-3, 0x1p-17);
    case LossyScheme::kFp8E4M3Scaled: {
      const double s = fp16_at(page + size_t(t) * (d + 2) + d);
      return std::max(ax * 0x1p-4, s * 0x1p-10);
    }
    case LossyScheme::kRtn8:
      return 0.5 * fp16_at(page + size_t(t) * (d + 2 * groups) + d + 2 * (c / kQuantGroup));
    case LossyScheme::kRtn4:
      return 0.5 * fp16_at(page + size_t(t) * (d / 2 + 2 * groups) + d / 2 + 2 * (c / kQuantGroup));
    case LossyScheme::kKivi2: {
      const size_t pair = spec.key ? size_t(c) : size_t(t) * groups + size_t(c / kQuantGroup);
      const double min = fp16_at(page + size_t(bt) * d / 4 + 4 * pair);
      const double step = fp16_at(page + size_t(bt) * d / 4 + 4 * pair + 2);
      // min rounds down and step up: every value lies in [min, min + 3 step].
      EXPECT_LE(min, double(x));
      EXPECT_LE(double(x), min + 3.0 * step);
      // min + step q is rounded once in float.
      return 0.5 * step + std::fabs(double(recon)) * 0x1p-24;
    }
    case LossyScheme::kDither8:
      return double(scales[size_t(t) * groups + c / kQuantGroup]) * (0.5 + double(kDither8Slack));
  }
  return 0.0;
}

// Every element within its scheme's bound; dither8 outlier channels exact with zero code bytes.
void expect_element_bounds(const LossyPageSpec& spec, const std::vector<uint16_t>& x,
                           const std::vector<uint8_t>& page, const std::vector<float>& recon) {
  const int d = spec.head_dim, bt = spec.block_tokens;
  std::vector<float> scales;
  std::vector<uint8_t> outlier(size_t(d), 0);
  if (spec.scheme == LossyScheme::kDither8) {
    scales.resize(size_t(bt) * (d / kQuantGroup));
    dither8_scales(spec, page.data(), scales.data());
    outlier = outlier_mask(spec);
  }
  const size_t record = size_t(d) + 2 * size_t(d / kQuantGroup) + 4 * size_t(spec.n_outlier_pairs);
  int violations = 0;
  for (int t = 0; t < bt; ++t) {
    for (int c = 0; c < d; ++c) {
      const size_t i = size_t(t) * d + c;
      const float xv = bf16_to_float(x[i]);
      if (outlier[c]) {
        EXPECT_EQ(float_bits(recon[i]), float_bits(xv))
            << "outlier channel " << c << " token " << t;
        EXPECT_EQ(page[size_t(t) * record + c], 0) << "outlier code byte, channel " << c;
        continue;
      }
      const double r = std::fabs(double(recon[i]) - double(xv));
      const double bound = element_bound(spec, page.data(), scales, t, c, xv, recon[i]);
      if (!(r <= bound) && violations++ < 5) {
        ADD_FAILURE() << lossy_scheme_name(spec.scheme) << " token " << t << " channel " << c
                      << ": x " << xv << " recon " << recon[i] << " |r| " << r << " > bound "
                      << bound;
      }
    }
  }
  EXPECT_EQ(violations, 0);
}

// The band of channel c, straight from the definitions: its RoPE pair, P / n_bands pairs a band.
int band_of_channel(RopePairing pairing, int d, int c) {
  const int n_pairs = d / 2;
  const int pair = pairing == RopePairing::kInterleaved ? c / 2 : c % n_pairs;
  return pair / (n_pairs / witness_bands(d));
}

// Tier A: every witness / rho entry bounds the exact residual norm from above, and by no more
// than the fp16 upward rounding (2^-10 relative, 2^-24 absolute). dither8 V: rho bounds it.
void expect_side_data_bounds(const LossyPageSpec& spec, const std::vector<uint16_t>& x,
                             const std::vector<uint8_t>& page, const std::vector<float>& recon) {
  const int d = spec.head_dim, bt = spec.block_tokens;
  const int n_bands = spec.key ? witness_bands(d) : 1;
  const uint16_t* side = nullptr;
  std::vector<float> dither_rho, witness;  // witness: Tier A K pages, band-major
  long double top = 0;                     // a kPageScaled8 page's scale
  if (spec.scheme == LossyScheme::kDither8) {
    if (spec.key) return;
    dither_rho.resize(size_t(bt));
    dither8_value_rho(spec, page.data(), dither_rho.data());
    // rho_t is sqrt(sum_c (s_c (1/2 + kDither8Slack))^2), rounded up.
    std::vector<float> scales(size_t(bt) * (d / kQuantGroup));
    dither8_scales(spec, page.data(), scales.data());
    for (int t = 0; t < bt; ++t) {
      long double sum_sq = 0.0L;
      for (int c = 0; c < d; ++c) {
        const long double r_max =
            (long double)scales[size_t(t) * (d / kQuantGroup) + c / kQuantGroup] *
            (0.5L + (long double)kDither8Slack);
        sum_sq += r_max * r_max;
      }
      const long double formula = std::sqrt(sum_sq);
      EXPECT_GE((long double)dither_rho[size_t(t)], formula) << "token " << t;
      EXPECT_LE((long double)dither_rho[size_t(t)], formula * (1.0L + 0x1p-22L)) << "token " << t;
    }
  } else if (spec.key && spec.witness == WitnessCode::kExponent) {
    // No side data: each channel's bound is its code's u = 2^(E - 4) + 2^-10, at least |x^ - x|,
    // and at most a step above it (the code's whole step 2^(E - 3), or 2^-9 near zero).
    EXPECT_EQ(lossy_page_bytes(spec), lossy_payload_bytes(spec));
    witness.resize(size_t(d) * size_t(bt));
    lossy_witness_bounds(spec, page.data(), witness.data());
    for (int t = 0; t < bt; ++t) {
      for (int c = 0; c < d; ++c) {
        const size_t i = size_t(t) * d + c;
        const float u = witness[size_t(c) * bt + t];
        EXPECT_EQ(u, exponent_witness_bound_of_code(page[i])) << "token " << t << " channel " << c;
        const long double r = std::fabs((long double)recon[i] - (long double)bf16_to_float(x[i]));
        EXPECT_GE((long double)u, r) << "token " << t << " channel " << c << " x " << bf16_to_float(x[i]);
        EXPECT_LE((long double)u, r + 2 * std::max((long double)std::fabs(recon[i]) / 8, 0x1p-10L) + 0x1p-10L)
            << "token " << t << " channel " << c;
      }
    }
    return;
  } else if (spec.key) {
    witness.resize(size_t(n_bands) * size_t(bt));
    lossy_witness_bounds(spec, page.data(), witness.data());
    if (spec.witness == WitnessCode::kFp16) {
      const uint16_t* fp16 = lossy_witness(spec, page.data());
      EXPECT_EQ(reinterpret_cast<const uint8_t*>(fp16), page.data() + lossy_payload_bytes(spec));
      for (size_t i = 0; i < witness.size(); ++i) EXPECT_EQ(witness[i], fp16_to_float(fp16[i])) << i;
    } else {
      // The page's scale, after the codes, is the largest bound: at least every bound read back.
      const size_t cells = witness.size();
      top = fp16_to_float(uint16_t(page[lossy_payload_bytes(spec) + cells] |
                                   (page[lossy_payload_bytes(spec) + cells + 1] << 8)));
      for (size_t i = 0; i < cells; ++i) {  // exactly top (c + 1) / 256, vector and scalar tails alike
        EXPECT_LE(witness[i], top);
        EXPECT_EQ(witness[i], float(top) * float(page[lossy_payload_bytes(spec) + i] + 1) / 256.f) << i;
      }
    }
  } else {
    side = lossy_value_rho(spec, page.data());
    EXPECT_EQ(reinterpret_cast<const uint8_t*>(side), page.data() + lossy_payload_bytes(spec));
  }
  for (int t = 0; t < bt; ++t) {
    std::vector<long double> sum_sq(size_t(n_bands), 0.0L);
    for (int c = 0; c < d; ++c) {
      const size_t i = size_t(t) * d + c;
      const long double r = (long double)recon[i] - (long double)bf16_to_float(x[i]);
      sum_sq[size_t(spec.key ? band_of_channel(spec.pairing, d, c) : 0)] += r * r;
    }
    for (int b = 0; b < n_bands; ++b) {
      const long double exact = std::sqrt(sum_sq[size_t(b)]);
      if (!witness.empty()) {
        // fp16: within its upward rounding; codes: within one step of the page's scale, 1 / 256.
        const long double w = witness[size_t(b) * bt + t];  // band-major
        EXPECT_GE(w, exact) << lossy_scheme_name(spec.scheme) << " token " << t << " band " << b;
        EXPECT_LE(w, 1.001L * exact + 0x1p-24L + top / 256)
            << lossy_scheme_name(spec.scheme) << " " << witness_code_name(spec.witness) << " token " << t
            << " band " << b;
        continue;
      }
      if (side == nullptr) {
        EXPECT_GE((long double)dither_rho[size_t(t)], exact) << "dither8 rho, token " << t;
        continue;
      }
      const long double w = fp16_to_float(side[size_t(b) * bt + t]);
      EXPECT_GE(w, exact) << lossy_scheme_name(spec.scheme) << " token " << t << " band " << b;
      EXPECT_LE(w, 1.001L * exact + 0x1p-24L)
          << lossy_scheme_name(spec.scheme) << " token " << t << " band " << b;
    }
  }
}

void expect_page_sound(const LossyPageSpec& spec, const std::vector<uint16_t>& x, uint32_t slot) {
  std::vector<uint8_t> page;
  const std::vector<float> recon = round_trip(spec, slot, x, &page);
  expect_element_bounds(spec, x, page, recon);
  expect_side_data_bounds(spec, x, page, recon);
  // Deterministic: a second encode writes the same bytes, a second decode the same floats.
  std::vector<uint8_t> again(page.size(), 0x5a);
  ASSERT_TRUE(lossy_encode_page_ref(spec, slot, x.data(), again.data()));
  EXPECT_EQ(again, page);
  std::vector<float> recon_again(recon.size());
  lossy_decode_page_ref(spec, slot, page.data(), recon_again.data());
  EXPECT_EQ(std::memcmp(recon.data(), recon_again.data(), recon.size() * sizeof(float)), 0);
}

TEST(LossyPage, EverySchemeShapeAndPairingRoundTripsWithinItsBounds) {
  uint64_t seed = 1;
  for (int si = 0; si < kNumLossySchemes; ++si) {
    const LossyScheme scheme = scheme_at(si);
    for (bool key : {true, false}) {
      for (int d : kHeadDims) {
        for (int bt : kBlockTokenCounts) {
          for (RopePairing pairing : kPairings) {
            const std::vector<uint16_t> x = make_block(seed++, bt, d, pairing, key);
            const bool with_outliers = scheme == LossyScheme::kDither8 && key;
            for (int m : with_outliers ? std::vector<int>{0, 3} : std::vector<int>{0}) {
              const std::vector<uint16_t> pairs = outliers_of(x, d, pairing, m);
              LossyPageSpec spec = make_spec(scheme, key, bt, d, pairing, pairs);
              const bool tier_a_key = key && !lossy_scheme_is_tier_b(scheme);
              for (int code = 0; code < (tier_a_key ? kNumWitnessCodes : 1); ++code) {
                if (tier_a_key && !lossy_witness_supported(scheme, WitnessCode(code))) continue;
                spec.witness = WitnessCode(code);
                SCOPED_TRACE(std::string(lossy_scheme_name(scheme)) + (key ? " K" : " V") + " d " +
                             std::to_string(d) + " bt " + std::to_string(bt) + " pairing " +
                             std::to_string(int(pairing)) + " m " + std::to_string(m) + " witness " +
                             witness_code_name(spec.witness));
                if (tier_a_key && spec.witness == WitnessCode::kExponent) {
                  // The block's 1000 saturates the cast: refused (kept exact); at the limit, 464
                  // (448's half-step above it), accepted and bounded.
                  std::vector<uint16_t> clipped = x;
                  bool saturates = false;
                  for (uint16_t& v : clipped)
                    if (std::fabs(bf16_to_float(v)) > kExponentWitnessLimit) {
                      saturates = true;
                      v = float_to_bf16(std::copysign(kExponentWitnessLimit, bf16_to_float(v)));
                    }
                  std::vector<uint8_t> page(lossy_page_bytes(spec));
                  EXPECT_EQ(lossy_encode_page_ref(spec, 0, x.data(), page.data()), !saturates);
                  expect_page_sound(spec, clipped, uint32_t(seed % 1000));
                  continue;
                }
                expect_page_sound(spec, x, uint32_t(seed % 1000));
              }
            }
          }
        }
      }
    }
  }
}

TEST(LossyPage, ZeroInputGivesZeroReconstructionAndSideData) {
  for (int si = 0; si < kNumLossySchemes; ++si) {
    for (bool key : {true, false}) {
      const std::vector<uint16_t> x(size_t(17) * 96, 0);
      const std::vector<uint16_t> pairs = si == int(LossyScheme::kDither8) && key
                                              ? std::vector<uint16_t>{0, 7}
                                              : std::vector<uint16_t>{};
      const LossyPageSpec spec =
          make_spec(scheme_at(si), key, 17, 96, RopePairing::kHalfSplit, pairs);
      SCOPED_TRACE(lossy_scheme_name(spec.scheme));
      std::vector<uint8_t> page;
      const std::vector<float> recon = round_trip(spec, 3, x, &page);
      for (float v : recon) ASSERT_EQ(v, 0.0f);
      if (spec.scheme == LossyScheme::kDither8) {
        std::vector<float> scales(size_t(17) * 3, -1.0f);
        dither8_scales(spec, page.data(), scales.data());
        for (float s : scales) EXPECT_EQ(s, 0.0f);
        const size_t payload = lossy_payload_bytes(spec);
        EXPECT_EQ(std::count(page.begin(), page.begin() + ptrdiff_t(payload), uint8_t(0)),
                  ptrdiff_t(payload));
      } else {
        const uint16_t* side =
            key ? lossy_witness(spec, page.data()) : lossy_value_rho(spec, page.data());
        const size_t n = key ? size_t(17) * witness_bands(96) : 17;
        for (size_t i = 0; i < n; ++i) EXPECT_EQ(side[i], 0u);
      }
    }
  }
}

// WitnessCode::kPageScaled8: the layout (codes band-major, then the page's fp16 scale), a page
// whose residual is 0 everywhere (scale 0, every bound 0), the same payload as the fp16 witness's
// page, and pages that are not Tier A K pages refused by the accessors.
TEST(LossyPage, PageScaledWitnessLayoutAndZeroPage) {
  for (const LossyScheme scheme : {LossyScheme::kFp8E4M3, LossyScheme::kRtn8, LossyScheme::kKivi2}) {
    for (const int bt : {1, 16, 17}) {
      SCOPED_TRACE(std::string(lossy_scheme_name(scheme)) + " bt " + std::to_string(bt));
      LossyPageSpec spec = make_spec(scheme, true, bt, 128, RopePairing::kHalfSplit);
      const size_t fp16_bytes = lossy_page_bytes(spec);
      spec.witness = WitnessCode::kPageScaled8;
      const size_t cells = size_t(bt) * size_t(witness_bands(128));
      EXPECT_EQ(lossy_page_bytes(spec), lossy_payload_bytes(spec) + cells + 2);
      EXPECT_EQ(fp16_bytes - lossy_page_bytes(spec), cells - 2);
      const std::vector<uint16_t> x = make_block(uint64_t(bt) * 31 + uint64_t(scheme), bt, 128, RopePairing::kHalfSplit, true);
      std::vector<uint8_t> coded(lossy_page_bytes(spec)), plain(fp16_bytes);
      ASSERT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), coded.data()));
      LossyPageSpec fp16_spec = spec;
      fp16_spec.witness = WitnessCode::kFp16;
      ASSERT_TRUE(lossy_encode_page_ref(fp16_spec, 0, x.data(), plain.data()));
      const size_t payload = lossy_payload_bytes(spec);
      EXPECT_EQ(std::memcmp(coded.data(), plain.data(), payload), 0) << "the witness code changed the payload";
      // The scale is the largest fp16 bound of the fp16 page.
      const uint16_t* w16 = lossy_witness(fp16_spec, plain.data());
      const uint16_t top = uint16_t(coded[payload + cells] | (coded[payload + cells + 1] << 8));
      EXPECT_EQ(fp16_to_float(top), fp16_to_float(*std::max_element(w16, w16 + cells,
                                                  [](uint16_t a, uint16_t b) { return fp16_to_float(a) < fp16_to_float(b); })));
      EXPECT_THROW(lossy_witness(spec, coded.data()), Error);
    }
  }
  // A block that every scheme keeps exactly (zeros): scale 0, codes 0, every bound 0.
  LossyPageSpec spec = make_spec(LossyScheme::kFp8E4M3, true, 16, 64, RopePairing::kInterleaved);
  spec.witness = WitnessCode::kPageScaled8;
  const std::vector<uint16_t> zeros(size_t(16) * 64, 0);
  std::vector<uint8_t> page(lossy_page_bytes(spec), 0xa5);
  ASSERT_TRUE(lossy_encode_page_ref(spec, 0, zeros.data(), page.data()));
  for (size_t i = lossy_payload_bytes(spec); i < page.size(); ++i) EXPECT_EQ(page[i], 0u) << i;
  std::vector<float> w(size_t(16) * witness_bands(64), -1.f);
  lossy_witness_bounds(spec, page.data(), w.data());
  for (float v : w) EXPECT_EQ(v, 0.f);
  // V pages and dither8 pages carry no witness.
  LossyPageSpec v_spec = make_spec(LossyScheme::kFp8E4M3, false, 16, 64, RopePairing::kInterleaved);
  v_spec.witness = WitnessCode::kPageScaled8;
  EXPECT_EQ(lossy_page_bytes(v_spec), size_t(16) * 64 + 32) << "a V page keeps its fp16 rho";
  std::vector<uint8_t> v_page(lossy_page_bytes(v_spec));
  EXPECT_THROW(lossy_witness_bounds(v_spec, v_page.data(), w.data()), Error);
  const LossyPageSpec d8 = make_spec(LossyScheme::kDither8, true, 16, 64, RopePairing::kInterleaved);
  std::vector<uint8_t> d8_page(lossy_page_bytes(d8));
  EXPECT_THROW(lossy_witness_bounds(d8, d8_page.data(), w.data()), Error);
}

// A corrupt coded witness never reads below the stored bound: any code byte reads as at most the
// scale; a scale that is NaN or negative reads as +inf everywhere (the meter then says 1).
TEST(LossyPage, CorruptPageScaledWitnessReadsAsALooserBound) {
  LossyPageSpec spec = make_spec(LossyScheme::kRtn8, true, 16, 128, RopePairing::kInterleaved);
  spec.witness = WitnessCode::kPageScaled8;
  const std::vector<uint16_t> x = make_block(99, 16, 128, RopePairing::kInterleaved, true);
  std::vector<uint8_t> page(lossy_page_bytes(spec));
  ASSERT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), page.data()));
  const size_t cells = size_t(16) * witness_bands(128), at = lossy_payload_bytes(spec);
  std::vector<float> w(cells);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 64; ++trial) {
    std::vector<uint8_t> bad = page;
    for (size_t i = 0; i < cells; ++i) bad[at + i] = uint8_t(rng());
    lossy_witness_bounds(spec, bad.data(), w.data());
    const float top = fp16_to_float(uint16_t(bad[at + cells] | (bad[at + cells + 1] << 8)));
    for (size_t i = 0; i < cells; ++i) {
      ASSERT_GT(w[i], 0.f);
      ASSERT_LE(w[i], top);
      ASSERT_EQ(w[i], top * float(bad[at + i] + 1) / 256.f);
    }
  }
  for (const uint16_t scale : {uint16_t(0x7e00), uint16_t(0xfe00), uint16_t(0xbc00), uint16_t(0x8001), uint16_t(0xfc00)}) {
    std::vector<uint8_t> bad = page;
    bad[at + cells] = uint8_t(scale & 0xff);
    bad[at + cells + 1] = uint8_t(scale >> 8);
    lossy_witness_bounds(spec, bad.data(), w.data());
    for (float v : w) ASSERT_EQ(v, std::numeric_limits<float>::infinity()) << std::hex << scale;
  }
  // +inf as the scale (a bound past fp16): +inf everywhere as well.
  std::vector<uint8_t> big = page;
  big[at + cells] = 0x00;
  big[at + cells + 1] = 0x7c;
  lossy_witness_bounds(spec, big.data(), w.data());
  for (float v : w) ASSERT_EQ(v, std::numeric_limits<float>::infinity());
}

TEST(LossyPage, WitnessCodeNamesRoundTrip) {
  for (int i = 0; i < kNumWitnessCodes; ++i) {
    WitnessCode parsed = WitnessCode(9);
    ASSERT_TRUE(parse_witness_code(witness_code_name(WitnessCode(i)), &parsed));
    EXPECT_EQ(parsed, WitnessCode(i));
  }
  WitnessCode untouched = WitnessCode::kPageScaled8;
  for (const char* bad : {"", "U8", "fp8", "u8 ", "fp16x"}) EXPECT_FALSE(parse_witness_code(bad, &untouched));
  EXPECT_EQ(untouched, WitnessCode::kPageScaled8);
  EXPECT_STREQ(witness_code_name(WitnessCode(7)), "unknown");
  LossyPageSpec spec = make_spec(LossyScheme::kRtn8, true, 16, 64, RopePairing::kInterleaved);
  spec.witness = WitnessCode(2);
  EXPECT_THROW(validate_lossy_page_spec(spec), Error);
}

// Values far below fp16's normal range: scales and KIVI minima fall among fp16 subnormals (or
// below the smallest one), where bf16 values are no longer fp16 values and the rounding
// directions decide the bounds.
// Both witness codes: a coded page's scale among fp16 subnormals too.
TEST(LossyPage, TinyValuesKeepTheirBounds) {
  for (int si = 0; si < kNumLossySchemes; ++si) {
    for (bool key : {true, false}) {
      for (float magnitude : {3e-6f, 1e-7f, 1e-9f}) {
        std::vector<uint16_t> x = make_block(31, 16, 64, RopePairing::kInterleaved, key);
        for (uint16_t& v : x) v = float_to_bf16(bf16_to_float(v) * magnitude);
        LossyPageSpec spec = make_spec(scheme_at(si), key, 16, 64, RopePairing::kInterleaved);
        const bool tier_a_key = key && !lossy_scheme_is_tier_b(spec.scheme);
        for (int code = 0; code < (tier_a_key ? kNumWitnessCodes : 1); ++code) {
          if (tier_a_key && !lossy_witness_supported(spec.scheme, WitnessCode(code))) continue;
          spec.witness = WitnessCode(code);
          SCOPED_TRACE(std::string(lossy_scheme_name(spec.scheme)) + (key ? " K " : " V ") +
                       std::to_string(magnitude) + " witness " + witness_code_name(spec.witness));
          expect_page_sound(spec, x, 12);
        }
      }
    }
  }
}

// Residual norms past fp16's range (the raw E4M3 cast saturates at 448, so keys near 10^6 leave
// residuals of that size): the fp16 witness stores +inf where a norm overflows, the coded one a
// scale of +inf (every bound +inf). The exponent witness refuses such a page (it saturates).
TEST(LossyPage, WitnessPastFp16RangeReadsAsInfinity) {
  for (const LossyScheme scheme : {LossyScheme::kFp8E4M3}) {
    std::vector<uint16_t> x = make_block(77, 16, 64, RopePairing::kInterleaved, true);
    for (uint16_t& v : x) v = float_to_bf16(bf16_to_float(v) * 1e6f);
    LossyPageSpec spec = make_spec(scheme, true, 16, 64, RopePairing::kInterleaved);
    spec.witness = WitnessCode::kExponent;
    std::vector<uint8_t> refused(lossy_page_bytes(spec));
    EXPECT_FALSE(lossy_encode_page_ref(spec, 0, x.data(), refused.data()));
    for (const WitnessCode code : {WitnessCode::kFp16, WitnessCode::kPageScaled8}) {
      spec.witness = code;
      SCOPED_TRACE(std::string(lossy_scheme_name(scheme)) + " witness " + witness_code_name(spec.witness));
      std::vector<uint8_t> page(lossy_page_bytes(spec));
      ASSERT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), page.data()));  // the raw cast never refuses
      std::vector<float> w(size_t(16) * witness_bands(64));
      lossy_witness_bounds(spec, page.data(), w.data());
      const int infinite = int(std::count(w.begin(), w.end(), std::numeric_limits<float>::infinity()));
      EXPECT_GT(infinite, 0) << "no bound overflowed fp16: the test needs larger values";
      if (spec.witness == WitnessCode::kPageScaled8) {
        EXPECT_EQ(infinite, int(w.size()));
      }
      for (float v : w) EXPECT_GT(v, 0.f);  // the finite fp16 bounds of the tokens that did not overflow
    }
  }
}

// Page bytes per token and head at head_dim 128, block 16 (docs/format/lossy_pages.md). dither8
// K: 128 codes + 4 scales = 136 B, plus 4 B per outlier pair (152 B at m = 4), as WitCert's
// packed store measures; Tier A K pages add a 32 B witness, V pages a 2 B rho.
TEST(LossyPage, PageBytesKnownAnswer) {
  struct Row {
    LossyScheme scheme;
    int m;
    size_t k_payload_per_token, k_side_per_token, v_payload_per_token, v_side_per_token;
  };
  // kivi2 payloads per token: 32 code bytes, plus K (min, step) per channel over the block
  // (128 * 4 B / 16 tokens = 32 B) or V per token group (4 groups * 4 B = 16 B).
  const Row rows[] = {
      {LossyScheme::kFp8E4M3, 0, 128, 32, 128, 2},
      {LossyScheme::kFp8E5M2, 0, 128, 32, 128, 2},
      {LossyScheme::kFp8E4M3Scaled, 0, 130, 32, 130, 2},
      {LossyScheme::kRtn8, 0, 136, 32, 136, 2},
      {LossyScheme::kRtn4, 0, 72, 32, 72, 2},
      {LossyScheme::kKivi2, 0, 64, 32, 48, 2},
      {LossyScheme::kDither8, 0, 136, 0, 136, 0},
      {LossyScheme::kDither8, 4, 152, 0, 136, 0},
  };
  const std::vector<uint16_t> none, four = {3, 9, 40, 63};
  for (const Row& row : rows) {
    SCOPED_TRACE(std::string(lossy_scheme_name(row.scheme)) + " m " + std::to_string(row.m));
    const LossyPageSpec k =
        make_spec(row.scheme, true, 16, 128, RopePairing::kInterleaved, row.m ? four : none);
    const LossyPageSpec v = make_spec(row.scheme, false, 16, 128, RopePairing::kInterleaved);
    EXPECT_EQ(lossy_payload_bytes(k), 16 * row.k_payload_per_token);
    EXPECT_EQ(lossy_page_bytes(k), 16 * (row.k_payload_per_token + row.k_side_per_token));
    EXPECT_EQ(lossy_payload_bytes(v), 16 * row.v_payload_per_token);
    EXPECT_EQ(lossy_page_bytes(v), 16 * (row.v_payload_per_token + row.v_side_per_token));
  }
  // rtn8 at 128: 128 codes + 8 scale bytes + 32 witness bytes = 168 B per token.
  EXPECT_EQ(
      lossy_page_bytes(make_spec(LossyScheme::kRtn8, true, 16, 128, RopePairing::kInterleaved)),
      16u * 168u);
  // kivi2 K parameters are per block, not per token: block 17 at head_dim 96.
  EXPECT_EQ(
      lossy_payload_bytes(make_spec(LossyScheme::kKivi2, true, 17, 96, RopePairing::kInterleaved)),
      17u * 24u + 96u * 4u);
}

// Hand-computed rtn8 page: s = 63.5 / 127 = 0.5 exactly; ties round to even.
TEST(LossyPage, Rtn8KnownAnswer) {
  std::vector<uint16_t> x(32, 0);
  const float values[] = {63.5f, -63.5f, 1.25f, 1.75f, 0.25f, 0.75f, -0.75f, -2.5f};
  for (int c = 0; c < 8; ++c) x[size_t(c)] = float_to_bf16(values[c]);
  const LossyPageSpec spec = make_spec(LossyScheme::kRtn8, true, 1, 32, RopePairing::kInterleaved);
  std::vector<uint8_t> page;
  const std::vector<float> recon = round_trip(spec, 0, x, &page);
  std::vector<uint8_t> expected = {0x7f, 0x81, 0x02, 0x04, 0x00, 0x02, 0xfe, 0xfb};
  expected.resize(32, 0);
  expected.push_back(0x00);  // scale 0.5 = fp16 0x3800, little-endian
  expected.push_back(0x38);
  // Witness: band 0 exact; bands 1 and 2 sqrt(0.125) -> 0x35a9 (0.35376); band 3 has one
  // residual of 0.25, bumped one fp16 step by the (1 + 2^-40) safety factor -> 0x3401.
  const uint16_t witness[16] = {0, 0x35a9, 0x35a9, 0x3401};
  for (uint16_t w : witness) {
    expected.push_back(uint8_t(w));
    expected.push_back(uint8_t(w >> 8));
  }
  EXPECT_EQ(page, expected);
  EXPECT_EQ(recon[2], 1.0f);
  EXPECT_EQ(recon[3], 2.0f);
  EXPECT_EQ(recon[7], -2.5f);
}

// Hand-computed kivi2 V page: min 0, max 3, so step 1; codes round to even.
TEST(LossyPage, Kivi2KnownAnswer) {
  std::vector<uint16_t> x(32, float_to_bf16(0.25f));
  const float values[] = {0.0f, 3.0f, 0.5f, 1.5f, 2.5f, 1.0f, 2.75f};
  for (int c = 0; c < 7; ++c) x[size_t(c)] = float_to_bf16(values[c]);
  const LossyPageSpec spec =
      make_spec(LossyScheme::kKivi2, false, 1, 32, RopePairing::kInterleaved);
  std::vector<uint8_t> page;
  const std::vector<float> recon = round_trip(spec, 0, x, &page);
  // Codes 0 3 0 2 | 2 1 3 0 | 0 ...: channel 4i + k in bits 2k of byte i.
  std::vector<uint8_t> expected = {0x8c, 0x36, 0, 0, 0, 0, 0, 0};
  const uint8_t params_and_rho[] = {0x00, 0x00, 0x00, 0x3c,  // min 0, step 1.0
                                    0x2b, 0x3e};             // rho: sqrt(2.375) up = 1.542
  expected.insert(expected.end(), std::begin(params_and_rho), std::end(params_and_rho));
  EXPECT_EQ(page, expected);
  EXPECT_EQ(recon[3], 2.0f);
  EXPECT_EQ(recon[4], 2.0f);
}

// dither8 keeps the m outlier pairs out of the group amax: the group holding a massive channel
// gets the scale of its ordinary channels.
TEST(LossyPage, Dither8OutlierPairsLeaveTheGroupAmax) {
  for (RopePairing pairing : kPairings) {
    const int d = 128, bt = 16;
    const std::vector<uint16_t> x = make_block(77, bt, d, pairing, true);
    const std::vector<uint16_t> pairs = outliers_of(x, d, pairing, 2);
    EXPECT_EQ(pairs, (std::vector<uint16_t>{1, uint16_t(d / 2 - 2)}));
    const LossyPageSpec spec = make_spec(LossyScheme::kDither8, true, bt, d, pairing, pairs);
    std::vector<uint8_t> page;
    round_trip(spec, 0, x, &page);
    std::vector<float> scales(size_t(bt) * 4);
    dither8_scales(spec, page.data(), scales.data());
    const std::vector<uint8_t> outlier = outlier_mask(spec);
    const int massive_channel = rope_pair_channel(pairing, d, 1, 0);
    for (int t = 0; t < bt; ++t) {
      for (int g = 0; g < 4; ++g) {
        float amax = 0.0f, amax_all = 0.0f;
        for (int c = g * 32; c < g * 32 + 32; ++c) {
          const float v = std::fabs(bf16_to_float(x[size_t(t) * d + c]));
          amax_all = std::max(amax_all, v);
          if (!outlier[c]) amax = std::max(amax, v);
        }
        const float s = scales[size_t(t) * 4 + g];
        EXPECT_EQ(s, fp16_to_float(float_to_fp16_upward(float(double(amax) / 126.5))));
        if (g == massive_channel / 32) {
          EXPECT_LT(s * 126.5f * 5.0f, amax_all);
        }
      }
    }
  }
}

// ---- dither8 proof-kernel contract ----------------------------------------------------------

struct Dither8Page {
  LossyPageSpec spec;
  std::vector<uint16_t> pairs;
  std::vector<uint8_t> page;
  std::vector<float> recon, scales;
};

Dither8Page encode_dither8(const std::vector<uint16_t>& x, bool key, int bt, int d,
                           RopePairing pairing, int m, uint32_t slot, uint64_t dither_key) {
  Dither8Page p;
  p.pairs = outliers_of(x, d, pairing, key ? m : 0);
  p.spec = make_spec(LossyScheme::kDither8, key, bt, d, pairing, p.pairs);
  p.spec.dither_key = dither_key;
  p.recon = round_trip(p.spec, slot, x, &p.page);
  p.scales.resize(size_t(bt) * (d / kQuantGroup));
  dither8_scales(p.spec, p.page.data(), p.scales.data());
  return p;
}

int8_t code_at(const Dither8Page& p, int t, int c) {
  const size_t record = size_t(p.spec.head_dim) + 2 * size_t(p.spec.head_dim / kQuantGroup) +
                        4 * size_t(p.spec.n_outlier_pairs);
  return int8_t(p.page[size_t(t) * record + c]);
}

// q is round(x / s + xi) exactly: s (q - 1/2 - xi) <= x <= s (q + 1/2 - xi). Each product is
// exact in double (an fp16 scale times a multiple of 2^-9 below 128), so this check does not
// share the encoder's arithmetic.
bool code_is_nearest(double x, double s, int q, double xi) {
  return s * (q - 0.5 - xi) <= x && x <= s * (q + 0.5 - xi);
}

// (a) The read side regenerates the write side's dither: x^ == s16 (q - xi(key, slot * bt + row,
// c)) bit for bit, with xi recomputed here (K pages; V pages are not dithered: xi = 0). (b) Every
// code is the nearest integer to x / s16 + xi with the STORED fp16 scale. (c) No clipping:
// |x / s16| <= 126.5 and |q| <= 127.
TEST(Dither8Contract, DecodeRegeneratesTheDitherAndCodesUseTheStoredScale) {
  uint64_t seed = 100;
  for (int d : kHeadDims) {
    for (int bt : kBlockTokenCounts) {
      for (bool key : {true, false}) {
        const RopePairing pairing = kPairings[seed % 2];
        const uint32_t slot = uint32_t(seed * 7919 % 100000);
        const std::vector<uint16_t> x = make_block(seed++, bt, d, pairing, key);
        const Dither8Page p = encode_dither8(x, key, bt, d, pairing, 4, slot, kTestDitherKey);
        const std::vector<uint8_t> outlier = outlier_mask(p.spec);
        int regenerated = 0, nearest = 0, clipped = 0, checked = 0;
        for (int t = 0; t < bt; ++t) {
          for (int c = 0; c < d; ++c) {
            if (outlier[c]) continue;
            const size_t i = size_t(t) * d + c;
            const float s = p.scales[size_t(t) * (d / kQuantGroup) + c / kQuantGroup];
            const int q = code_at(p, t, c);
            const float xi =
                key ? dither8_xi(kTestDitherKey, uint64_t(slot) * bt + uint64_t(t), c) : 0.0f;
            const float expected = s * (float(q) - xi);
            regenerated += float_bits(p.recon[i]) == float_bits(expected);
            const double xv = bf16_to_float(x[i]);
            nearest += s == 0.0f ? q == 0 : code_is_nearest(xv, s, q, xi);
            clipped += std::fabs(xv) > 126.5 * double(s) || q < -127 || q > 127;
            ++checked;
          }
        }
        EXPECT_EQ(regenerated, checked) << "d " << d << " bt " << bt;
        EXPECT_EQ(nearest, checked) << "d " << d << " bt " << bt;
        EXPECT_EQ(clipped, 0) << "d " << d << " bt " << bt;
      }
    }
  }
}

// The same contract on real SmolLM2 keys and values (src/codec/testdata/README.md), and the
// variant that quantizes with the fp32 scale amax / 126.5 while storing the fp16 one: it gives
// different codes, and those codes break |x^ - x| <= s16 / 2, so check (b) above would catch it.
TEST(Dither8Contract, Fp32ScaleVariantIsCaughtOnRealKv) {
  const auto file = format::SafetensorsFile::open(
      std::string(CERTKV_SOURCE_DIR) + "/src/codec/testdata/smollm2_kv_pages.safetensors");
  constexpr int kHeads = 3, kTokens = 32, kBt = 16, kD = 64;
  int pages = 0, mismatches = 0, variant_violations = 0, stored_violations = 0, values = 0;
  for (int layer : {0, 15, 29}) {
    for (bool key : {true, false}) {
      const std::string suffix = ".layer" + std::to_string(layer) + (key ? ".k" : ".v");
      const format::SafetensorsTensor* eval = file->find("eval" + suffix);
      const format::SafetensorsTensor* calib = file->find("calib" + suffix);
      ASSERT_NE(eval, nullptr);
      ASSERT_NE(calib, nullptr);
      for (int h = 0; h < kHeads; ++h) {
        const size_t head_elems = size_t(kTokens) * kD;
        std::vector<uint16_t> calib_rows(head_elems), eval_rows(head_elems);
        std::memcpy(calib_rows.data(), calib->data + h * head_elems * 2, head_elems * 2);
        std::memcpy(eval_rows.data(), eval->data + h * head_elems * 2, head_elems * 2);
        // Outlier pairs fixed per (layer, kv_head) from the calibration book.
        const std::vector<uint16_t> pairs =
            key ? outliers_of(calib_rows, kD, RopePairing::kInterleaved, 2)
                : std::vector<uint16_t>{};
        const uint64_t dither_key = dither8_key(layer, key, h);
        for (int first = 0; first < kTokens; first += kBt) {
          const std::vector<uint16_t> x(eval_rows.begin() + first * kD,
                                        eval_rows.begin() + (first + kBt) * kD);
          LossyPageSpec spec =
              make_spec(LossyScheme::kDither8, key, kBt, kD, RopePairing::kInterleaved, pairs);
          spec.dither_key = dither_key;
          const uint32_t slot = uint32_t(pages++);
          std::vector<uint8_t> page;
          const std::vector<float> recon = round_trip(spec, slot, x, &page);
          expect_element_bounds(spec, x, page, recon);
          expect_side_data_bounds(spec, x, page, recon);
          std::vector<float> scales(size_t(kBt) * 2);
          dither8_scales(spec, page.data(), scales.data());
          const std::vector<uint8_t> outlier = outlier_mask(spec);
          const size_t record = size_t(kD) + 4 + 4 * pairs.size();
          for (int t = 0; t < kBt; ++t) {
            for (int g = 0; g < 2; ++g) {
              float amax = 0.0f;
              for (int c = g * 32; c < g * 32 + 32; ++c) {
                if (!outlier[c])
                  amax = std::max(amax, std::fabs(bf16_to_float(x[size_t(t) * kD + c])));
              }
              const float s16 = scales[size_t(t) * 2 + g];
              const float s32 = amax / 126.5f;
              if (s16 == 0.0f) continue;
              for (int c = g * 32; c < g * 32 + 32; ++c) {
                if (outlier[c]) continue;
                const double xv = bf16_to_float(x[size_t(t) * kD + c]);
                const double xi =
                    key ? dither8_xi(dither_key, uint64_t(slot) * kBt + uint64_t(t), c) : 0.0;
                const int q = int8_t(page[size_t(t) * record + c]);
                const int q_variant = int(std::nearbyint(xv / double(s32) + xi));
                ++values;
                stored_violations += !code_is_nearest(xv, s16, q, xi);
                mismatches += q_variant != q;
                variant_violations += !code_is_nearest(xv, s16, q_variant, xi);
              }
            }
          }
        }
      }
    }
  }
  RecordProperty("values", values);
  RecordProperty("fp32_scale_code_mismatches", mismatches);
  RecordProperty("fp32_scale_bound_violations", variant_violations);
  EXPECT_GT(values, 10000);
  EXPECT_EQ(stored_violations, 0);
  EXPECT_GT(mismatches, 0);
  EXPECT_GT(variant_violations, 0);
}

// (d) The dither of a K page is a function of (key, slot, row, channel) alone: the same ones give
// the same page; another slot or another key gives other codes (about a third differ), and
// reading a page under the wrong slot breaks the error bound. A V page is not dithered: the same
// codes in any slot under any key, each the nearest integer to x / s16.
TEST(Dither8Contract, DitherIsKeyedBySlotAndKey) {
  const int d = 128, bt = 16;
  const std::vector<uint16_t> x = make_block(5, bt, d, RopePairing::kInterleaved, true);
  const Dither8Page a =
      encode_dither8(x, true, bt, d, RopePairing::kInterleaved, 0, 41, kTestDitherKey);
  const Dither8Page same =
      encode_dither8(x, true, bt, d, RopePairing::kInterleaved, 0, 41, kTestDitherKey);
  const Dither8Page other_slot =
      encode_dither8(x, true, bt, d, RopePairing::kInterleaved, 0, 42, kTestDitherKey);
  const Dither8Page other_key =
      encode_dither8(x, true, bt, d, RopePairing::kInterleaved, 0, 41, kTestDitherKey + 1);
  const Dither8Page value =
      encode_dither8(x, false, bt, d, RopePairing::kInterleaved, 0, 41, kTestDitherKey);
  EXPECT_EQ(value.page, encode_dither8(x, false, bt, d, RopePairing::kInterleaved, 0, 42,
                                       kTestDitherKey + 1).page);
  for (int t = 0; t < bt; ++t) {
    for (int c = 0; c < d; ++c) {
      const double s = value.scales[size_t(t) * 4 + c / 32];
      const int q = code_at(value, t, c);
      EXPECT_TRUE(s == 0.0 ? q == 0 : code_is_nearest(bf16_to_float(x[size_t(t) * d + c]), s, q, 0.0))
          << t << " " << c;
    }
  }
  EXPECT_EQ(a.page, same.page);
  auto differing_codes = [&](const Dither8Page& b) {
    int n = 0;
    for (int t = 0; t < bt; ++t) {
      for (int c = 0; c < d; ++c) n += code_at(a, t, c) != code_at(b, t, c);
    }
    return double(n) / double(bt * d);
  };
  EXPECT_GT(differing_codes(other_slot), 0.2);
  EXPECT_LT(differing_codes(other_slot), 0.5);
  EXPECT_GT(differing_codes(other_key), 0.2);
  // The page of slot 41 read as if it lived in slot 42.
  std::vector<float> wrong(x.size());
  lossy_decode_page_ref(a.spec, 42, a.page.data(), wrong.data());
  int outside = 0;
  for (int t = 0; t < bt; ++t) {
    for (int c = 0; c < d; ++c) {
      const size_t i = size_t(t) * d + c;
      const double s = a.scales[size_t(t) * 4 + c / 32];
      outside +=
          std::fabs(double(wrong[i]) - double(bf16_to_float(x[i]))) > s * (0.5 + kDither8Slack);
    }
  }
  EXPECT_GT(outside, bt * d / 10);
  // Row t of slot p uses counter p * bt + t and nothing else: row t of this page, stored alone
  // as a one-token page in slot 41 * bt + t, gets the same codes.
  for (int t = 0; t < bt; t += 5) {
    const std::vector<uint16_t> row(x.begin() + t * d, x.begin() + (t + 1) * d);
    const Dither8Page single = encode_dither8(row, true, 1, d, RopePairing::kInterleaved, 0,
                                              uint32_t(41 * bt + t), kTestDitherKey);
    for (int c = 0; c < d; ++c) EXPECT_EQ(code_at(single, 0, c), code_at(a, t, c)) << t << " " << c;
  }
  // Keys of distinct (layer, K/V, kv_head) differ.
  std::vector<uint64_t> keys;
  for (int layer = 0; layer < 40; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int head = 0; head < 16; ++head) keys.push_back(dither8_key(layer, kv == 1, head));
    }
  }
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(std::adjacent_find(keys.begin(), keys.end()), keys.end());
}

// (e) Over many values the normalized residual e = (x^ - x) / s has mean 0 and variance 1/12 (the
// uniform distribution on [-1/2, 1/2)), within 6 standard errors of the sample plus the
// deterministic offset kDither8Slack; and so it does when every value sits at the same fraction
// of its step, where rounding without dither would make e constant.
void expect_uniform_residual(const std::vector<double>& e, const std::string& what) {
  const double n = double(e.size());
  double sum = 0.0, sum_sq = 0.0;
  for (double v : e) {
    sum += v;
    sum_sq += v * v;
  }
  const double mean = sum / n, second = sum_sq / n;
  // sd(e) = 1/sqrt(12); sd(e^2) = sqrt(1/80 - 1/144) = 1/sqrt(180).
  EXPECT_LE(std::fabs(mean), 6.0 / std::sqrt(12.0 * n) + double(kDither8Slack)) << what;
  EXPECT_LE(std::fabs(second - 1.0 / 12.0), 6.0 / std::sqrt(180.0 * n) + double(kDither8Slack))
      << what;
  ::testing::Test::RecordProperty(what + "_mean", std::to_string(mean));
  ::testing::Test::RecordProperty(what + "_second_moment", std::to_string(second));
}

// (K pages: the dithered ones.)
TEST(Dither8Contract, NormalizedResidualIsUniform) {
  const int d = 128, bt = 16;
  std::vector<double> e_random, e_fixed_fraction;
  for (uint32_t slot = 0; slot < 512; ++slot) {
    const std::vector<uint16_t> x = make_block(1000 + slot, bt, d, RopePairing::kHalfSplit, true);
    const Dither8Page p =
        encode_dither8(x, true, bt, d, RopePairing::kHalfSplit, 0, slot, kTestDitherKey);
    for (int t = 0; t < bt; ++t) {
      for (int c = 0; c < d; ++c) {
        const double s = p.scales[size_t(t) * 4 + c / 32];
        const size_t i = size_t(t) * d + c;
        e_random.push_back((double(p.recon[i]) - double(bf16_to_float(x[i]))) / s);
      }
    }
  }
  // Channel 0 of each group holds amax = 126.5 (s = 1 exactly); the others hold 37.25.
  std::vector<uint16_t> fixed(size_t(bt) * d, float_to_bf16(37.25f));
  for (int t = 0; t < bt; ++t) {
    for (int g = 0; g < d / 32; ++g) fixed[size_t(t) * d + g * 32] = float_to_bf16(126.5f);
  }
  for (uint32_t slot = 0; slot < 256; ++slot) {
    const Dither8Page p =
        encode_dither8(fixed, true, bt, d, RopePairing::kHalfSplit, 0, slot, kTestDitherKey);
    for (int t = 0; t < bt; ++t) {
      for (int c = 0; c < d; ++c) {
        if (c % 32 == 0) continue;
        EXPECT_EQ(p.scales[size_t(t) * 4 + c / 32], 1.0f);
        e_fixed_fraction.push_back(double(p.recon[size_t(t) * d + c]) - 37.25);
      }
    }
  }
  expect_uniform_residual(e_random, "random");
  expect_uniform_residual(e_fixed_fraction, "fixed_fraction");
}

// ---- the generator ----------------------------------------------------------------------------

// Values frozen from an independent implementation of docs/format/dither8.md, these lines of
// Python 3 (run once; the test compares with their output):
//   M32, M64 = 2**32 - 1, 2**64 - 1
//   def mix(z):
//       z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
//       z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
//       return z ^ (z >> 31)
//   def key(layer, is_key, head):
//       return mix((((layer << 32) | (head << 1) | is_key) + 0x9e3779b97f4a7c15) & M64)
//   def fmix32(h):
//       h ^= h >> 16; h = (h * 0x85ebca6b) & M32
//       h ^= h >> 13; h = (h * 0xc2b2ae35) & M32
//       return h ^ (h >> 16)
//   def row_seed(k, n): return fmix32(fmix32((n & M32) ^ (k >> 32)) ^ (n >> 32) ^ (k & M32))
//   def word(seed, w): return fmix32((seed + w * 0x9e3779b9) & M32)
//   def u(k, n, c): return (word(row_seed(k, n), c // 4) >> (8 * (c % 4))) & 0xff
// fmix32(1) = 0x514e28b7 is also the published MurmurHash3 finalizer value. A change here changes
// every stored dither8 page.
static_assert(format::dither8_fmix32(0) == 0u);
static_assert(format::dither8_fmix32(1) == 0x514e28b7u);
static_assert(format::dither8_fmix32(0xdeadbeefu) == 0x0de5c6a9u);

TEST(Dither8Generator, KnownAnswer) {
  EXPECT_EQ(dither8_key(0, true, 0), 0x910a2dec89025cc1ull);
  EXPECT_EQ(dither8_key(0, false, 0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(dither8_key(3, true, 5), 0xe5d3f9146c285f0dull);
  EXPECT_EQ(dither8_key(29, false, 2), 0xfc94b0bc037884c2ull);
  const uint64_t key = dither8_key(3, true, 5);
  struct Case {
    uint64_t counter;
    int channel;
    uint32_t row_seed, word, u;
  };
  const Case cases[] = {
      {0, 0, 0x352654f8, 0x9ccd954f, 79},
      {0, 1, 0x352654f8, 0x9ccd954f, 149},
      {0, 2, 0x352654f8, 0x9ccd954f, 205},
      {0, 3, 0x352654f8, 0x9ccd954f, 156},
      {0, 4, 0x352654f8, 0x3be57a68, 104},
      {17, 100, 0xe9ca3b9d, 0xa8209731, 49},
      {123456789, 255, 0x357429c0, 0x893639f5, 137},
      {(1ull << 40) + 3, 37, 0x1c7770ee, 0x0ec98a08, 138},             // counter above 2^32
      {(1ull << 57) + (1ull << 33) + 5, 130, 0x36f8677b, 0xe92188d2, 33},  // high word enters
  };
  for (const Case& c : cases) {
    EXPECT_EQ(format::dither8_row_seed(key, c.counter), c.row_seed) << c.counter;
    EXPECT_EQ(format::dither8_word(c.row_seed, c.channel / 4), c.word)
        << c.counter << " " << c.channel;
    EXPECT_EQ(format::dither8_u(c.word, c.channel), c.u) << c.counter << " " << c.channel;
    EXPECT_EQ(dither8_xi(key, c.counter, c.channel), float((c.u + 0.5) / 256.0 - 0.5))
        << c.counter << " " << c.channel;
  }
}

// Values lie on the 2^8 cell centres (u + 1/2) / 256 - 1/2 inside (-1/2, 1/2), odd multiples of
// 2^-9 that fp16 holds exactly, symmetric about 0; the grid's mean over all u is exactly 0 and the
// sample mean is 0 within 6 standard errors; the histograms are flat (chi-square over 256 bins:
// of u, and of the high nibbles of pairs of neighbouring channels of one word, of channels in
// neighbouring words, and of neighbouring counters); the threshold 415 is where chi-square with
// 255 degrees of freedom has tail probability about 1e-9 (Wilson-Hilferty, z = 6).
TEST(Dither8Generator, UniformOnTheCellCentres) {
  // The grid itself: exact in fp16, symmetric, mean exactly 0.
  double grid_sum = 0.0;
  int grid_bad = 0;
  for (int u = 0; u < 256; ++u) {
    const float xi = (float(u) + 0.5f) / 256.0f - 0.5f;
    const float mirror = (float(255 - u) + 0.5f) / 256.0f - 0.5f;
    grid_bad += double(xi) != (u + 0.5) / 256.0 - 0.5;
    grid_bad += fp16_to_float(format::float_to_fp16(xi)) != xi;
    grid_bad += mirror != -xi;
    grid_sum += xi;
  }
  EXPECT_EQ(grid_bad, 0);
  EXPECT_EQ(grid_sum, 0.0);

  const uint64_t key = dither8_key(7, false, 3);
  constexpr int kCounters = 1 << 12, kChannels = 256;
  std::vector<double> hist_u(256, 0), hist_channels(256, 0), hist_words(256, 0),
      hist_counters(256, 0);
  double sum = 0.0;
  int off_grid = 0;
  auto cell = [](float xi) { return double(xi) * 256.0 + 127.5; };  // u, from xi
  for (int n = 0; n < kCounters; ++n) {
    for (int c = 0; c < kChannels; ++c) {
      const float xi = dither8_xi(key, uint64_t(n), c);
      ASSERT_GT(xi, -0.5f);
      ASSERT_LT(xi, 0.5f);
      const double u = cell(xi);
      off_grid += u != std::floor(u) || u < 0 || u > 255;
      // -xi is the cell centre of 255 - u: the grid is symmetric.
      off_grid += cell(-xi) != 255.0 - u;
      sum += xi;
      const int ui = int(u);
      hist_u[size_t(ui)] += 1;
      if (c % 2 == 0) {  // c and c + 1 share a word
        const int next = int(cell(dither8_xi(key, uint64_t(n), c + 1)));
        hist_channels[size_t((ui >> 4) * 16 + (next >> 4))] += 1;
      }
      if (c % 8 < 4) {  // c and c + 4 lie in neighbouring words
        const int next = int(cell(dither8_xi(key, uint64_t(n), c + 4)));
        hist_words[size_t((ui >> 4) * 16 + (next >> 4))] += 1;
      }
      if (n % 2 == 0) {
        const int next = int(cell(dither8_xi(key, uint64_t(n) + 1, c)));
        hist_counters[size_t((ui >> 4) * 16 + (next >> 4))] += 1;
      }
    }
  }
  EXPECT_EQ(off_grid, 0);
  const double n = double(kCounters) * kChannels;
  EXPECT_LE(std::fabs(sum / n), 6.0 / std::sqrt(12.0 * n));
  auto chi_square = [](const std::vector<double>& hist) {
    double total = 0.0, chi = 0.0;
    for (double v : hist) total += v;
    const double expected = total / double(hist.size());
    for (double v : hist) chi += (v - expected) * (v - expected) / expected;
    return chi;
  };
  EXPECT_LT(chi_square(hist_u), 415.0);
  EXPECT_LT(chi_square(hist_channels), 415.0);
  EXPECT_LT(chi_square(hist_words), 415.0);
  EXPECT_LT(chi_square(hist_counters), 415.0);
  // A flat histogram also fails a generator that is constant: the test can fail.
  std::vector<double> constant(256, 0);
  constant[3] = n;
  EXPECT_GT(chi_square(constant), 415.0);
}

// One word serves four channels: its bytes 0..3 are the u of channels 4w .. 4w + 3 (so byte c of
// the row's words stored little-endian is u_c), and the 64 words of one row are distinct (the
// finalizer is a bijection on distinct inputs), for thousands of random keys and counters.
TEST(Dither8Generator, WordBytesServeFourChannelsAndRowWordsAreDistinct) {
  std::mt19937_64 rng(20240917);
  constexpr int kRows = 4000, kWords = 64;
  int byte_mismatches = 0, rows_with_repeats = 0;
  for (int r = 0; r < kRows; ++r) {
    const uint64_t key = rng();
    const uint64_t counter = rng() >> (r % 2 == 0 ? 20 : 0);  // below 2^44, and any 64 bits
    const uint32_t row_seed = format::dither8_row_seed(key, counter);
    uint32_t words[kWords];
    for (int w = 0; w < kWords; ++w) words[w] = format::dither8_word(row_seed, w);
    uint8_t bytes[4 * kWords];
    std::memcpy(bytes, words, sizeof(bytes));
    for (int c = 0; c < 4 * kWords; ++c) {
      const uint32_t u = (words[c / 4] >> (8 * (c % 4))) & 0xffu;
      byte_mismatches += format::dither8_u(words[c / 4], c) != u;
      byte_mismatches += bytes[c] != u;
      byte_mismatches += dither8_xi(key, counter, c) != float((u + 0.5) / 256.0 - 0.5);
    }
    std::sort(words, words + kWords);
    rows_with_repeats += std::adjacent_find(words, words + kWords) != words + kWords;
  }
  EXPECT_EQ(byte_mismatches, 0);
  EXPECT_EQ(rows_with_repeats, 0);
}

// ---- bad input ------------------------------------------------------------------------------

TEST(LossyPage, NonFiniteInputIsRefusedByEveryScheme) {
  const int d = 64, bt = 3;
  const uint16_t bad_values[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1};  // +Inf, -Inf, NaN, -NaN
  for (int si = 0; si < kNumLossySchemes; ++si) {
    for (bool key : {true, false}) {
      const std::vector<uint16_t> base = make_block(9, bt, d, RopePairing::kInterleaved, key);
      const std::vector<uint16_t> pairs = si == int(LossyScheme::kDither8) && key
                                              ? outliers_of(base, d, RopePairing::kInterleaved, 2)
                                              : std::vector<uint16_t>{};
      const LossyPageSpec spec =
          make_spec(scheme_at(si), key, bt, d, RopePairing::kInterleaved, pairs);
      std::vector<uint8_t> page(lossy_page_bytes(spec));
      ASSERT_TRUE(lossy_encode_page_ref(spec, 0, base.data(), page.data()));
      // First, last, middle, and an outlier channel (both channels of pair 1 are outliers).
      for (size_t at : {size_t(0), base.size() - 1, size_t(d + 17), size_t(2 * d + 2)}) {
        for (uint16_t bad : bad_values) {
          std::vector<uint16_t> x = base;
          x[at] = bad;
          EXPECT_FALSE(lossy_encode_page_ref(spec, 0, x.data(), page.data()))
              << lossy_scheme_name(spec.scheme) << (key ? " K" : " V") << " at " << at << " value "
              << std::hex << bad;
        }
      }
    }
  }
}

// A scale (or KIVI min / step) that does not fit fp16, and E5M2 overflow to Inf, refuse the
// page; just below each limit it is accepted. Raw E4M3 saturates instead: accepted, with a
// witness that saturates to +Inf when the residual passes 65504.
TEST(LossyPage, ScaleOverflowIsRefused) {
  struct Case {
    LossyScheme scheme;
    float accepted, refused;  // one value in a page of small ones
  };
  const Case cases[] = {
      {LossyScheme::kFp8E4M3Scaled, 223.0f * 131072.0f, 224.0f * 131072.0f},  // 448 * 65536
      {LossyScheme::kRtn8, 126.0f * 65536.0f, 127.0f * 65536.0f},             // 127 * 65536
      {LossyScheme::kRtn4, 223.0f * 2048.0f, 224.0f * 2048.0f},               // 7 * 65536
      {LossyScheme::kDither8, 126.0f * 65536.0f, 127.0f * 65536.0f},          // 126.5 * 65795
      {LossyScheme::kKivi2, 191.0f * 1024.0f, 192.0f * 1024.0f},  // step 65536 = 196608 / 3
      {LossyScheme::kKivi2, -65280.0f, -65536.0f},                // min below -65504
      {LossyScheme::kFp8E5M2, 57344.0f, 61440.0f},                // 61440 rounds to Inf
  };
  for (const Case& c : cases) {
    for (bool key : {true, false}) {
      const LossyPageSpec spec = make_spec(c.scheme, key, 3, 32, RopePairing::kInterleaved);
      SCOPED_TRACE(std::string(lossy_scheme_name(c.scheme)) + (key ? " K" : " V") + " " +
                   std::to_string(c.refused));
      std::vector<uint16_t> x(3 * 32, float_to_bf16(0.5f));
      std::vector<uint8_t> page(lossy_page_bytes(spec));
      x[40] = float_to_bf16(c.accepted);
      ASSERT_EQ(bf16_to_float(x[40]), c.accepted);
      EXPECT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), page.data()));
      x[40] = float_to_bf16(c.refused);
      ASSERT_EQ(bf16_to_float(x[40]), c.refused);
      EXPECT_FALSE(lossy_encode_page_ref(spec, 0, x.data(), page.data()));
    }
  }
  const LossyPageSpec spec =
      make_spec(LossyScheme::kFp8E4M3, true, 1, 32, RopePairing::kInterleaved);
  std::vector<uint16_t> x(32, float_to_bf16(1.0f));
  x[5] = float_to_bf16(1e30f);
  std::vector<uint8_t> page;
  const std::vector<float> recon = round_trip(spec, 0, x, &page);
  EXPECT_EQ(recon[5], 448.0f);
  EXPECT_EQ(lossy_witness(spec, page.data())[2], 0x7c00u);  // channel 5 is in band 2
  EXPECT_EQ(lossy_witness(spec, page.data())[0], 0u);
}

TEST(LossyPage, ValidateRejectsUnusableSpecs) {
  const std::vector<uint16_t> one = {3}, repeated = {3, 3}, decreasing = {5, 3}, beyond = {16};
  std::vector<uint16_t> seventeen(17), sixty_five(65), sixty_four(64), sixteen(16);
  for (size_t i = 0; i < 65; ++i) {
    if (i < 17) seventeen[i] = uint16_t(i);
    if (i < 16) sixteen[i] = uint16_t(i);
    if (i < 64) sixty_four[i] = uint16_t(i);
    sixty_five[i] = uint16_t(i);
  }
  auto spec_with = [](LossyScheme scheme, bool key, int bt, int d,
                      const std::vector<uint16_t>& pairs) {
    return make_spec(scheme, key, bt, d, RopePairing::kInterleaved, pairs);
  };
  struct Case {
    LossyPageSpec spec;
    StatusCode code;
    std::string message_part;
  };
  std::vector<Case> cases = {
      {spec_with(LossyScheme::kRtn8, true, 16, 48, {}), StatusCode::kInvalidArgument, "head_dim"},
      {spec_with(LossyScheme::kRtn8, true, 16, 0, {}), StatusCode::kInvalidArgument, "head_dim"},
      {spec_with(LossyScheme::kRtn8, true, 16, -32, {}), StatusCode::kInvalidArgument, "head_dim"},
      {spec_with(LossyScheme::kRtn8, true, 16, 512, {}), StatusCode::kUnsupported, "head_dim"},
      {spec_with(LossyScheme::kRtn8, true, 0, 64, {}), StatusCode::kInvalidArgument,
       "block_tokens"},
      {spec_with(LossyScheme::kRtn8, true, 4097, 64, {}), StatusCode::kInvalidArgument,
       "block_tokens"},
      {spec_with(LossyScheme::kDither8, false, 16, 64, one), StatusCode::kInvalidArgument,
       "V page"},
      {spec_with(LossyScheme::kRtn8, true, 16, 64, one), StatusCode::kInvalidArgument,
       "only dither8"},
      {spec_with(LossyScheme::kKivi2, true, 16, 64, one), StatusCode::kInvalidArgument,
       "only dither8"},
      {spec_with(LossyScheme::kDither8, true, 16, 64, repeated), StatusCode::kInvalidArgument,
       "repeats"},
      {spec_with(LossyScheme::kDither8, true, 16, 64, decreasing), StatusCode::kInvalidArgument,
       "increase"},
      {spec_with(LossyScheme::kDither8, true, 16, 32, beyond), StatusCode::kInvalidArgument,
       "outside"},
      {spec_with(LossyScheme::kDither8, true, 16, 32, seventeen), StatusCode::kInvalidArgument,
       "n_outlier_pairs"},
      {spec_with(LossyScheme::kDither8, true, 16, 256, sixty_five), StatusCode::kInvalidArgument,
       "n_outlier_pairs"},
  };
  LossyPageSpec null_pairs = spec_with(LossyScheme::kDither8, true, 16, 64, {});
  null_pairs.n_outlier_pairs = 2;
  cases.push_back({null_pairs, StatusCode::kInvalidArgument, "outlier_pairs is null"});
  LossyPageSpec negative = spec_with(LossyScheme::kDither8, true, 16, 64, {});
  negative.n_outlier_pairs = -1;
  cases.push_back({negative, StatusCode::kInvalidArgument, "negative"});
  LossyPageSpec bad_scheme = spec_with(LossyScheme::kRtn8, true, 16, 64, {});
  bad_scheme.scheme = static_cast<LossyScheme>(7);
  cases.push_back({bad_scheme, StatusCode::kInvalidArgument, "scheme"});
  LossyPageSpec bad_pairing = spec_with(LossyScheme::kRtn8, true, 16, 64, {});
  bad_pairing.pairing = static_cast<RopePairing>(2);
  cases.push_back({bad_pairing, StatusCode::kInvalidArgument, "pairing"});
  for (const Case& c : cases) {
    try {
      validate_lossy_page_spec(c.spec);
      ADD_FAILURE() << "accepted; expected an error naming " << c.message_part;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), c.code) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.message_part), std::string::npos) << e.what();
    }
    // Every entry point checks the spec.
    EXPECT_THROW(lossy_page_bytes(c.spec), Error);
    std::vector<uint16_t> x(16 * 64, 0);
    std::vector<uint8_t> page(1 << 16);
    EXPECT_THROW(lossy_encode_page_ref(c.spec, 0, x.data(), page.data()), Error);
  }
  // The limits themselves are accepted.
  EXPECT_NO_THROW(
      validate_lossy_page_spec(spec_with(LossyScheme::kDither8, true, 4096, 256, sixty_four)));
  EXPECT_NO_THROW(validate_lossy_page_spec(spec_with(LossyScheme::kDither8, true, 1, 32, sixteen)));
  // Side data accessors refuse pages without that side data; the generator refuses bad inputs.
  std::vector<uint8_t> page(1 << 16);
  std::vector<float> out(64);
  EXPECT_THROW(lossy_witness(spec_with(LossyScheme::kRtn8, false, 16, 64, {}), page.data()), Error);
  EXPECT_THROW(lossy_witness(spec_with(LossyScheme::kDither8, true, 16, 64, {}), page.data()),
               Error);
  EXPECT_THROW(lossy_value_rho(spec_with(LossyScheme::kRtn8, true, 16, 64, {}), page.data()),
               Error);
  EXPECT_THROW(
      dither8_scales(spec_with(LossyScheme::kRtn8, true, 16, 64, {}), page.data(), out.data()),
      Error);
  EXPECT_THROW(
      dither8_value_rho(spec_with(LossyScheme::kRtn4, false, 16, 64, {}), page.data(), out.data()),
      Error);
  EXPECT_THROW(dither8_xi(1, 0, 256), Error);
  EXPECT_THROW(dither8_xi(1, 0, -1), Error);
  EXPECT_THROW(dither8_key(-1, true, 0), Error);
  std::vector<float> rows(64, 1.0f);
  std::vector<uint16_t> picked(64);
  EXPECT_THROW(
      select_outlier_pairs(rows.data(), 1, 64, RopePairing::kInterleaved, 33, picked.data()),
      Error);
  EXPECT_THROW(witness_band_of_pair(64, 32), Error);
}

// Random bytes decode without crashing, deterministically, writing every output element.
TEST(LossyPage, GarbagePagesDecodeWithoutCrashingAndBothDecodersAgree) {
  std::mt19937_64 rng(2024);
  const uint32_t sentinel = 0x7fc0dead;
  for (int si = 0; si < kNumLossySchemes; ++si) {
    for (bool key : {true, false}) {
      for (int trial = 0; trial < 1000; ++trial) {
        const int d = kHeadDims[rng() % 5], bt = kBlockTokenCounts[rng() % 4];
        const RopePairing pairing = kPairings[rng() % 2];
        std::vector<uint16_t> pairs;
        if (si == int(LossyScheme::kDither8) && key) {
          for (int p = 0; p < d / 2; ++p) {
            if (rng() % 16 == 0 && pairs.size() < size_t(kMaxOutlierPairs))
              pairs.push_back(uint16_t(p));
          }
        }
        const LossyPageSpec spec = make_spec(scheme_at(si), key, bt, d, pairing, pairs);
        std::vector<uint8_t> page(lossy_page_bytes(spec));
        for (uint8_t& b : page) b = uint8_t(rng());
        std::vector<float> out(size_t(bt) * d, format::bits_to_float(sentinel)), again(out.size());
        const uint32_t slot = uint32_t(rng());
        lossy_decode_page_ref(spec, slot, page.data(), out.data());
        lossy_decode_page_ref(spec, slot, page.data(), again.data());
        for (float v : out) ASSERT_NE(float_bits(v), sentinel);
        ASSERT_EQ(std::memcmp(out.data(), again.data(), out.size() * sizeof(float)), 0);
        // The attention decoder gives the reference's floats bit for bit.
        std::vector<float> fast(out.size(), format::bits_to_float(sentinel));
        lossy_decode_page(spec, slot, page.data(), fast.data());
        ASSERT_EQ(std::memcmp(out.data(), fast.data(), out.size() * sizeof(float)), 0);
        std::vector<float> side(static_cast<size_t>(bt));
        if (spec.scheme == LossyScheme::kDither8) {
          dither8_value_rho(spec, page.data(), side.data());
        } else {
          const uint16_t* s =
              key ? lossy_witness(spec, page.data()) : lossy_value_rho(spec, page.data());
          side[0] = fp16_to_float(s[0]);
        }
      }
    }
  }
}

// ---- LossyPageDecoder: every kernel against the reference ------------------------------------

// Every kernel this CPU runs (the AVX2 one also where AVX-512 is there), on encoded and on garbage
// pages of every scheme, ragged shapes and row counts: the reference's floats bit for bit, and for
// dither8 the stored scales band-major as dither8_scales gives them.
// dither8 K and V pages on every kernel, through every path of the AVX-512 one (head_dim a
// multiple of 64 or not, up to 64 rows and 16 outlier pairs or more, scales finite and nonzero or
// not): encoded pages, and pages whose codes, scales and outlier values are adversarial bytes
// (every code, fp16 scales from subnormal to 65504, one scale 0, -0, Inf or NaN, bf16 outliers of
// any bits).
TEST(LossyPageDecoder, Dither8PagesGiveTheReferenceFloatsOnEveryKernel) {
  std::mt19937_64 rng(77);
  for (bool key : {true, false}) {
    for (int d : {64, 96, 128, 192, 256}) {
      for (int bt : {1, 3, 16, 17, 64, 65}) {
        for (int m : {0, 1, 4, 16, 17}) {
          if (m > d / 2 || (!key && m > 0)) continue;
          for (int variant = 0; variant < 6; ++variant) {
            SCOPED_TRACE(std::string(key ? "K" : "V") + " d " + std::to_string(d) + " bt " + std::to_string(bt) + " m " + std::to_string(m) +
                         " variant " + std::to_string(variant));
            const RopePairing pairing = kPairings[rng() % 2];
            const std::vector<uint16_t> x = make_block(rng(), bt, d, pairing, key);
            const std::vector<uint16_t> pairs = outliers_of(x, d, pairing, m);
            const LossyPageSpec spec = make_spec(LossyScheme::kDither8, key, bt, d, pairing, pairs);
            std::vector<uint8_t> page(lossy_page_bytes(spec));
            const uint32_t block = variant % 2 ? uint32_t(0xffffffffu / uint32_t(bt)) : uint32_t(rng());
            if (!lossy_encode_page_ref(spec, block, x.data(), page.data())) continue;
            const int groups = d / kQuantGroup;
            const size_t record = page.size() / size_t(bt);
            if (variant >= 1) {
              // Every byte of a record random; then finite nonzero scales, but for variants 2-5 one
              // scale of one row is 0, -0, Inf or NaN.
              for (uint8_t& b : page) b = uint8_t(rng());
              for (int t = 0; t < bt; ++t)
                for (int g = 0; g < groups; ++g) {
                  uint16_t h = uint16_t(rng());
                  if ((h & 0x7c00) == 0x7c00) h = uint16_t(h & ~0x4000);  // finite
                  if ((h & 0x7fff) == 0) h = 0x0001;                       // nonzero (subnormal)
                  if (t == 0 && g == 0) h = 0x7bff;                        // 65504
                  std::memcpy(&page[size_t(t) * record + size_t(d) + 2 * size_t(g)], &h, 2);
                }
              const uint16_t special[] = {0x0000, 0x8000, 0x7c00, 0xfe01};
              if (variant >= 2) {
                const size_t t = size_t(rng() % uint64_t(bt)), g = size_t(rng() % uint64_t(groups));
                std::memcpy(&page[t * record + size_t(d) + 2 * g], &special[variant - 2], 2);
              }
            }
            std::vector<float> ref(size_t(bt) * size_t(d));
            lossy_decode_page_ref(spec, block, page.data(), ref.data());
            std::vector<float> want_scales(size_t(bt) * size_t(groups));
            dither8_scales(spec, page.data(), want_scales.data());
            for (LossyKernel kernel : {LossyKernel::kPortable, LossyKernel::kAvx2, LossyKernel::kAvx512}) {
              if (!lossy_kernel_supported(kernel)) continue;
              const LossyPageDecoder decoder(spec, kernel);
              for (int n_rows : {1, (bt + 1) / 2, bt}) {
                std::vector<float> out(size_t(bt) * size_t(d) + 1, format::bits_to_float(0x7fc0dead));
                const size_t stride = size_t(bt) + 3;
                std::vector<float> scales(size_t(groups) * stride, -1.f);
                decoder.decode(block, page.data(), n_rows, out.data(), scales.data(), stride);
                ASSERT_EQ(std::memcmp(out.data(), ref.data(), size_t(n_rows) * size_t(d) * sizeof(float)), 0)
                    << lossy_kernel_name(kernel) << " n_rows " << n_rows;
                for (size_t i = size_t(n_rows) * size_t(d); i < out.size(); ++i)
                  ASSERT_EQ(float_bits(out[i]), 0x7fc0deadu) << lossy_kernel_name(kernel) << " wrote past row " << n_rows;
                for (int t = 0; t < n_rows; ++t)
                  for (int g = 0; g < groups; ++g)
                    ASSERT_EQ(float_bits(scales[size_t(g) * stride + size_t(t)]),
                              float_bits(want_scales[size_t(t) * size_t(groups) + size_t(g)]))
                        << lossy_kernel_name(kernel) << " scale of row " << t << " group " << g;
              }
            }
          }
        }
      }
    }
  }
}

TEST(LossyPageDecoder, EveryKernelGivesTheReferenceFloatsOnRaggedRows) {
  std::mt19937_64 rng(31);
  int kernels_run = 0;
  for (LossyKernel kernel : {LossyKernel::kPortable, LossyKernel::kAvx2, LossyKernel::kAvx512}) {
    if (!lossy_kernel_supported(kernel)) {
      EXPECT_THROW(LossyPageDecoder(make_spec(LossyScheme::kRtn8, true, 16, 64, RopePairing::kInterleaved), kernel),
                   Error);
      continue;
    }
    ++kernels_run;
    for (int si = 0; si < kNumLossySchemes; ++si) {
      for (bool key : {true, false}) {
        for (int d : kHeadDims) {
          for (int bt : kBlockTokenCounts) {
            for (int garbage = 0; garbage < 2; ++garbage) {
              SCOPED_TRACE(std::string(lossy_kernel_name(kernel)) + " " + lossy_scheme_name(scheme_at(si)) +
                           (key ? " K" : " V") + " d " + std::to_string(d) + " bt " + std::to_string(bt) +
                           (garbage ? " garbage" : ""));
              const RopePairing pairing = kPairings[rng() % 2];
              const std::vector<uint16_t> x = make_block(rng(), bt, d, pairing, key);
              std::vector<uint16_t> pairs;
              if (si == int(LossyScheme::kDither8) && key) pairs = outliers_of(x, d, pairing, int(rng() % 5));
              const LossyPageSpec spec = make_spec(scheme_at(si), key, bt, d, pairing, pairs);
              std::vector<uint8_t> page(lossy_page_bytes(spec));
              // Odd blocks where the low 32 bits of the counters (block * bt + row) wrap inside
              // the page: the dither8 kernels form row seeds several rows at a time.
              const uint32_t block = rng() % 2 ? uint32_t(rng()) : uint32_t(0xffffffffu / uint32_t(bt));
              if (garbage) {
                for (uint8_t& b : page) b = uint8_t(rng());
              } else if (!lossy_encode_page_ref(spec, block, x.data(), page.data())) {
                continue;  // refused (e.g. E5M2 past its range): nothing to read
              }
              std::vector<float> ref(size_t(bt) * size_t(d));
              lossy_decode_page_ref(spec, block, page.data(), ref.data());
              const LossyPageDecoder decoder(spec, kernel);
              ASSERT_EQ(decoder.kernel(), kernel);
              for (int n_rows : {1, (bt + 1) / 2, bt}) {
                std::vector<float> out(size_t(bt) * size_t(d), format::bits_to_float(0x7fc0dead));
                const int groups = d / kQuantGroup;
                const size_t stride = size_t(bt) + 3;
                std::vector<float> scales(size_t(groups) * stride, -1.f);
                decoder.decode(block, page.data(), n_rows, out.data(), scales.data(), stride);
                ASSERT_EQ(std::memcmp(out.data(), ref.data(), size_t(n_rows) * size_t(d) * sizeof(float)), 0)
                    << "n_rows " << n_rows;
                for (size_t i = size_t(n_rows) * size_t(d); i < out.size(); ++i)
                  ASSERT_EQ(float_bits(out[i]), 0x7fc0deadu) << "wrote past row " << n_rows;
                if (spec.scheme != LossyScheme::kDither8) continue;
                std::vector<float> want(size_t(bt) * size_t(groups));
                dither8_scales(spec, page.data(), want.data());
                for (int t = 0; t < n_rows; ++t)
                  for (int g = 0; g < groups; ++g)
                    ASSERT_EQ(float_bits(scales[size_t(g) * stride + size_t(t)]),
                              float_bits(want[size_t(t) * size_t(groups) + size_t(g)]));
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GE(kernels_run, 1);
  EXPECT_STREQ(lossy_kernel_name(LossyKernel::kAvx512), "avx512");
  EXPECT_TRUE(lossy_kernel_supported(lossy_best_kernel()));
}

// A NaN scale of an fp8-e4m3-scaled record (a corrupt page) gives every element of its token the
// scale's NaN with the quiet bit set, NaN codes included, on the reference and every kernel: the
// product of two NaNs would keep whichever operand the compiler put first.
TEST(LossyPageDecoder, ScaledFp8NanScaleGivesItsRowTheQuietedScale) {
  const int d = 64, bt = 3;
  const LossyPageSpec spec = make_spec(LossyScheme::kFp8E4M3Scaled, true, bt, d, RopePairing::kInterleaved);
  std::vector<uint8_t> page(lossy_page_bytes(spec));
  const size_t record = size_t(d) + 2;
  const uint16_t scales[bt] = {0xfd01, 0x3c00, 0x7e55};  // a signaling NaN, 1, a quiet NaN
  for (int t = 0; t < bt; ++t) {
    for (int c = 0; c < d; ++c) page[size_t(t) * record + size_t(c)] = uint8_t(c % 3 == 0 ? 0x7f : c);  // NaN codes too
    page[size_t(t) * record + size_t(d)] = uint8_t(scales[t]);
    page[size_t(t) * record + size_t(d) + 1] = uint8_t(scales[t] >> 8);
  }
  std::vector<float> ref(size_t(bt) * size_t(d));
  lossy_decode_page_ref(spec, 0, page.data(), ref.data());
  for (int t : {0, 2}) {
    const uint32_t want = float_bits(fp16_to_float(scales[t])) | 0x00400000u;
    for (int c = 0; c < d; ++c) ASSERT_EQ(float_bits(ref[size_t(t) * d + size_t(c)]), want) << "token " << t << " channel " << c;
  }
  for (int c = 1; c < d; c += 3) EXPECT_EQ(ref[size_t(d) + size_t(c)], format::fp8_e4m3_to_float(uint8_t(c)));  // s = 1
  for (LossyKernel kernel : {LossyKernel::kPortable, LossyKernel::kAvx2, LossyKernel::kAvx512}) {
    if (!lossy_kernel_supported(kernel)) continue;
    std::vector<float> out(ref.size());
    LossyPageDecoder(spec, kernel).decode(0, page.data(), bt, out.data());
    ASSERT_EQ(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)), 0) << lossy_kernel_name(kernel);
  }
}

// ---- the production encoder ------------------------------------------------------------------

// Blocks that put the production encoder's shortcuts on their edges, a row kind at a time:
//   0  edge values: zeros of both signs, bf16 subnormals, the largest finite bf16, fp8's
//      saturation and E5M2's overflow, values just around them;
//   1  exact ties of the scheme's rounding: a group whose largest magnitude is top 2^j (so that
//      its fp16 scale is 2^j exactly) and whose other values are (k + 1/2) 2^j (rtn8, rtn4,
//      dither8's V pages; its K pages add the dither, so these are no ties there); kivi2 sets from 0 to 3 2^j with the others at (k + 1/2) 2^j (by
//      channel on K pages, whose sets are channels); fp8 casts the midpoints of adjacent codes;
//   2  one value for the whole row;
//   3  any finite bit pattern of magnitude below 2^20 (scales that fit fp16).
// *ties counts the values of kind 1 placed at a tie.
std::vector<uint16_t> adversarial_block(uint64_t seed, int bt, int d, LossyScheme scheme, bool key, int64_t* ties) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> x(size_t(bt) * size_t(d));
  const uint16_t edges[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x7f7f, 0xff7f, 0x43e0, 0x43e8,
                            0x43f0, 0xc3e8, 0x4760, 0x4770, 0x3f00, 0x3fc0, 0x4020, 0xbfc0, 0x3e80, 0x3c00};
  const double top = scheme == LossyScheme::kRtn8 ? 127.0 : scheme == LossyScheme::kRtn4 ? 7.0 : 126.5;
  const bool fp8_cast = scheme == LossyScheme::kFp8E4M3 || scheme == LossyScheme::kFp8E5M2;
  const auto at = [&](int t, int c) -> uint16_t& { return x[size_t(t) * size_t(d) + size_t(c)]; };
  const int kind_k = int(rng() % 4);  // kivi2 K pages: one kind for the whole block (its sets are columns)
  for (int t = 0; t < bt; ++t) {
    const int kind = scheme == LossyScheme::kKivi2 && key ? kind_k : int(rng() % 4);
    for (int c0 = 0; c0 < d; c0 += kQuantGroup) {
      const int j = int(rng() % 20) - 10;  // the group's power of two
      for (int c = c0; c < c0 + kQuantGroup; ++c) {
        uint16_t v = 0;
        switch (kind) {
          case 0:
            v = edges[rng() % std::size(edges)];
            break;
          case 1:
            if (fp8_cast) {
              const int e = scheme == LossyScheme::kFp8E4M3 ? 4 : 5, m = 7 - e;
              const uint8_t code = uint8_t(rng() % (scheme == LossyScheme::kFp8E4M3 ? 0x7e : 0x7b));
              const float mid = 0.5f * (format::fp8_to_float(code, e, m) + format::fp8_to_float(uint8_t(code + 1), e, m));
              v = float_to_bf16(rng() % 2 ? -mid : mid);  // exact: one mantissa bit more than the codes'
              ++*ties;
            } else if (scheme == LossyScheme::kKivi2) {
              const int r = key ? t : c - c0;  // the value's place in its set
              const double q = r == 0 ? 0.0 : r == 1 ? 3.0 : double(rng() % 3) + 0.5;
              v = float_to_bf16(float(std::ldexp(q, key ? (c % 20) - 10 : j)));
              *ties += r >= 2;
            } else {
              const double k = c == c0 ? top : double(int(rng() % uint64_t(2 * top - 1)) - int(top) + 1) + 0.5;
              v = float_to_bf16(float(std::ldexp(k, j)));
              *ties += c != c0 && !(scheme == LossyScheme::kDither8 && key);  // K pages add the dither
            }
            break;
          case 2:
            v = c == 0 ? uint16_t(rng() & 0x7f7f) : at(t, 0);
            break;
          default:
            do v = uint16_t(rng()); while ((v & 0x7f80) >= 0x4980);  // |v| < 2^20, finite
            break;
        }
        at(t, c) = v;
      }
    }
  }
  return x;
}

TEST(LossyPage, EncoderWritesTheReferenceBytes) {
  constexpr int kDims[] = {32, 64, 96, 128, 160, 192, 224, 256};
  constexpr int kTokens[] = {1, 3, 16, 17, 64};
  constexpr size_t kGuard = 64;
  std::mt19937_64 rng(47);
  int64_t compared = 0, refused_finite = 0, refused_nonfinite = 0, ties_compared = 0;
  for (int si = 0; si < kNumLossySchemes; ++si) {
    for (bool key : {true, false}) {
      for (int wi = 0; wi < kNumWitnessCodes; ++wi) {
        const WitnessCode witness = WitnessCode(wi);
        if (key && witness != WitnessCode::kFp16 && !lossy_witness_supported(scheme_at(si), witness)) continue;
        if (!key && witness != WitnessCode::kFp16) continue;
        for (int d : kDims) {
          for (int bt : kTokens) {
            for (RopePairing pairing : kPairings) {
              for (int kind = 0; kind < 3; ++kind) {
                SCOPED_TRACE(std::string(lossy_scheme_name(scheme_at(si))) + (key ? " K " : " V ") +
                             witness_code_name(witness) + " d " + std::to_string(d) + " bt " + std::to_string(bt) +
                             " kind " + std::to_string(kind));
                int64_t ties = 0;
                std::vector<uint16_t> x = kind == 1 ? adversarial_block(rng(), bt, d, scheme_at(si), key, &ties)
                                                    : make_block(rng(), bt, d, pairing, key);
                if (kind == 2) x[size_t(rng() % x.size())] = uint16_t(rng() % 2 ? 0x7f80 : 0xffc1);  // refused by both
                std::vector<uint16_t> pairs;
                if (si == int(LossyScheme::kDither8) && key) pairs = outliers_of(x, d, pairing, int(rng() % 17));
                LossyPageSpec spec = make_spec(scheme_at(si), key, bt, d, pairing, pairs);
                spec.witness = witness;
                const uint32_t block = rng() % 2 ? uint32_t(rng()) : uint32_t(0xffffffffu / uint32_t(bt));
                const size_t bytes = lossy_page_bytes(spec);
                std::vector<uint8_t> want(bytes + kGuard, 0xa5), got(bytes + kGuard, 0x5a);
                const bool ok_ref = lossy_encode_page_ref(spec, block, x.data(), want.data());
                const bool ok = lossy_encode_page(spec, block, x.data(), got.data());
                ASSERT_EQ(ok, ok_ref);
                for (size_t i = bytes; i < bytes + kGuard; ++i) ASSERT_EQ(got[i], 0x5a) << "wrote past the page";
                if (kind == 2) {
                  EXPECT_FALSE(ok);
                  ++refused_nonfinite;
                  continue;
                }
                if (!ok) {
                  ++refused_finite;
                  continue;
                }
                ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0);
                ++compared;
                ties_compared += ties;
              }
            }
          }
        }
      }
    }
  }
  // Enough of each: pages compared byte for byte, refusals of finite blocks (a scale past fp16,
  // E5M2 overflow, the exponent witness's limit), and exact ties on compared pages.
  EXPECT_GT(compared, 1500);
  EXPECT_GT(refused_finite, 50);
  EXPECT_GT(refused_nonfinite, 1000);
  EXPECT_GT(ties_compared, 10000);
  printf("[encoder] %lld pages compared, %lld finite blocks refused, %lld non-finite refused, %lld ties on compared pages\n",
         (long long)compared, (long long)refused_finite, (long long)refused_nonfinite, (long long)ties_compared);
}

// ---- outlier selection, bands, fp16 rounding, names -----------------------------------------

TEST(LossyPage, SelectOutlierPairsKnownAnswer) {
  // head_dim 8, three rows. Interleaved pairs (0,1) (2,3) (4,5) (6,7); half-split (0,4) (1,5)
  // (2,6) (3,7). Peaks: channel 5 -> 9, channel 3 -> -7, channel 6 -> 5, all else <= 1.
  const float x[3 * 8] = {0.5f, -1.0f, 0.25f, 0.0f,  1.0f, 0.5f, 0.0f, 0.75f,
                          0.0f, 0.5f,  0.0f,  -7.0f, 0.0f, 1.0f, 5.0f, 0.0f,
                          1.0f, 0.0f,  -0.5f, 0.0f,  0.5f, 9.0f, 0.0f, -1.0f};
  auto pick = [&](RopePairing pairing, int m) {
    std::vector<uint16_t> out(static_cast<size_t>(m));
    select_outlier_pairs(x, 3, 8, pairing, m, out.data());
    return out;
  };
  EXPECT_EQ(pick(RopePairing::kInterleaved, 2), (std::vector<uint16_t>{1, 2}));  // 7 and 9
  EXPECT_EQ(pick(RopePairing::kHalfSplit, 2), (std::vector<uint16_t>{1, 3}));    // 9 and 7
  EXPECT_EQ(pick(RopePairing::kInterleaved, 1), (std::vector<uint16_t>{2}));
  EXPECT_EQ(pick(RopePairing::kHalfSplit, 3), (std::vector<uint16_t>{1, 2, 3}));
  EXPECT_EQ(pick(RopePairing::kInterleaved, 0), (std::vector<uint16_t>{}));
  EXPECT_EQ(pick(RopePairing::kHalfSplit, 4), (std::vector<uint16_t>{0, 1, 2, 3}));
  // Equal peaks: the lower pair first.
  const float flat[4] = {1.0f, -1.0f, 1.0f, 1.0f};
  std::vector<uint16_t> out(1);
  select_outlier_pairs(flat, 1, 4, RopePairing::kInterleaved, 1, out.data());
  EXPECT_EQ(out[0], 0);
}

TEST(LossyPage, WitnessBandsCoverContiguousPairRanges) {
  for (int d : kHeadDims) {
    const int n_bands = witness_bands(d), n_pairs = d / 2;
    EXPECT_EQ(n_bands, 16);
    for (int b = 0; b < n_bands; ++b) {
      for (int pair = b * n_pairs / n_bands; pair < (b + 1) * n_pairs / n_bands; ++pair) {
        EXPECT_EQ(witness_band_of_pair(d, pair), b) << d << " " << pair;
      }
    }
  }
  // Fewer bands than 16 when head_dim / 2 < 16, and uneven bands: P = 5 pairs over 5 bands,
  // P = 10 (head_dim 20) over 10.
  EXPECT_EQ(witness_bands(10), 5);
  EXPECT_EQ(witness_band_of_pair(10, 4), 4);
  EXPECT_EQ(witness_bands(40), 16);  // P = 20: bands of one or two pairs
  for (int b = 0; b < 16; ++b) {
    for (int pair = b * 20 / 16; pair < (b + 1) * 20 / 16; ++pair)
      EXPECT_EQ(witness_band_of_pair(40, pair), b);
  }
}

TEST(LossyPage, WitnessBandFirstPairIsTheInverseOfTheBandOfAPair) {
  // Every head_dim from 2 to 256, even and odd, power of two or not.
  for (int d = 2; d <= 256; ++d) {
    const int n_bands = witness_bands(d), n_pairs = d / 2;
    EXPECT_EQ(witness_band_first_pair(d, 0), 0) << d;
    EXPECT_EQ(witness_band_first_pair(d, n_bands), n_pairs) << d;
    for (int b = 0; b < n_bands; ++b) {
      EXPECT_LT(witness_band_first_pair(d, b), witness_band_first_pair(d, b + 1)) << d << " " << b;
      for (int pair = witness_band_first_pair(d, b); pair < witness_band_first_pair(d, b + 1); ++pair)
        ASSERT_EQ(witness_band_of_pair(d, pair), b) << d << " " << pair;
    }
  }
}

TEST(LossyPage, Fp16UpwardExhaustive) {
  // Every fp16 value is its own upward rounding (NaN stays NaN).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    const uint16_t r = float_to_fp16_upward(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(r))) << std::hex << h;
    } else {
      ASSERT_EQ(r, h) << std::hex << h;
    }
  }
  // Strictly between two neighbours: up to the upper one; for negatives toward zero (+inf).
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const float lo = fp16_to_float(uint16_t(h)), hi = fp16_to_float(uint16_t(h + 1));
    const float inside[] = {std::nextafter(lo, hi), 0.5f * (lo + hi), std::nextafter(hi, lo)};
    for (float f : inside) {
      ASSERT_EQ(float_to_fp16_upward(f), h + 1) << std::hex << h << " " << f;
      ASSERT_EQ(float_to_fp16_upward(-f), 0x8000u | h) << std::hex << h << " " << -f;
    }
  }
  EXPECT_EQ(float_to_fp16_upward(65505.0f), 0x7c00u);
  EXPECT_EQ(float_to_fp16_upward(std::nextafter(65504.0f, 1e9f)), 0x7c00u);
  EXPECT_EQ(float_to_fp16_upward(1e10f), 0x7c00u);
  EXPECT_EQ(float_to_fp16_upward(std::numeric_limits<float>::max()), 0x7c00u);
  EXPECT_EQ(float_to_fp16_upward(-65505.0f), 0xfbffu);
  EXPECT_EQ(float_to_fp16_upward(0.0f), 0u);
  EXPECT_EQ(float_to_fp16_upward(std::numeric_limits<float>::denorm_min()), 1u);
  EXPECT_EQ(float_to_fp16_upward(1.0f + 0x1p-23f), 0x3c01u);
}

TEST(LossyPage, SchemeNamesRoundTrip) {
  for (int i = 0; i < kNumLossySchemes; ++i) {
    LossyScheme parsed = LossyScheme::kRtn8;
    ASSERT_TRUE(parse_lossy_scheme(lossy_scheme_name(scheme_at(i)), &parsed));
    EXPECT_EQ(parsed, scheme_at(i));
    EXPECT_EQ(lossy_scheme_is_tier_b(scheme_at(i)), i == int(LossyScheme::kDither8));
  }
  LossyScheme untouched = LossyScheme::kRtn4;
  EXPECT_FALSE(parse_lossy_scheme("int8", &untouched));
  EXPECT_FALSE(parse_lossy_scheme("", &untouched));
  EXPECT_EQ(untouched, LossyScheme::kRtn4);
  EXPECT_STREQ(lossy_scheme_name(LossyScheme::kFp8E4M3Scaled), "fp8-e4m3-scaled");
}


// WitnessCode::kExponent on every bf16 value a raw E4M3 cast takes without saturating: the code's
// bound u = 2^(E - 4) + 2^-10 (exponent_witness_bound_of_code) is at least |fp8(x) - x| for every
// finite bf16 x with |x| <= 464 (all 2 x 17,000-odd of them, subnormals and -0 included), equals
// it at the ties that round to a code's far side; and past 464 the saturated code bounds nothing,
// which is why such a K page is refused. Without the 2^-10 term the zero and subnormal codes are
// not covered (the negative control: the check can fail).
TEST(ExponentWitness, EveryCodeBoundsItsRoundingUpToTheSaturationLimit) {
  int checked = 0, tight = 0, uncovered_without_floor = 0, saturated_uncovered = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float x = bf16_to_float(uint16_t(bits));
    if (!std::isfinite(x)) continue;
    const uint8_t code = format::float_to_fp8_ref(x, 4, 3);
    const long double err = std::fabs((long double)format::fp8_to_float(code, 4, 3) - (long double)x);
    const long double u = exponent_witness_bound_of_code(code);
    if (std::fabs(x) > kExponentWitnessLimit) {
      saturated_uncovered += err > u;
      continue;
    }
    ++checked;
    EXPECT_GE(u, err) << "x " << x << " code " << int(code);
    tight += err == u - 0x1p-10L;
    uncovered_without_floor += err > u - 0x1p-10L;
  }
  EXPECT_EQ(checked, 2 * (0x43e8 + 1));  // |x| <= 464 = bf16 0x43e8, from +0 and from -0
  EXPECT_GT(tight, 0) << "half a step is reached: the bound is tight";
  EXPECT_GT(uncovered_without_floor, 0) << "the 2^-10 floor is needed (zero and subnormal codes)";
  EXPECT_GT(saturated_uncovered, 1000) << "past 464 the saturated code bounds nothing";
  // The table: 2^-10 for both zeros, +inf for both NaNs, 16 + 2^-10 for +-448, 2^-13 + 2^-10 for
  // the smallest subnormal 2^-9 (its float exponent, as the device's fp16 operand has it).
  EXPECT_EQ(exponent_witness_bound_of_code(0x00), 0x1p-10f);
  EXPECT_EQ(exponent_witness_bound_of_code(0x80), 0x1p-10f);
  EXPECT_EQ(exponent_witness_bound_of_code(0x7f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(exponent_witness_bound_of_code(0xff), std::numeric_limits<float>::infinity());
  EXPECT_EQ(exponent_witness_bound_of_code(0x7e), 16.f + 0x1p-10f);
  EXPECT_EQ(exponent_witness_bound_of_code(0xfe), 16.f + 0x1p-10f);
  EXPECT_EQ(exponent_witness_bound_of_code(0x01), 0x1p-13f + 0x1p-10f);
  EXPECT_EQ(exponent_witness_bound_of_code(0x08), 0x1p-10f + 0x1p-10f);  // 2^-6, the smallest normal
}

// The layout: an fp8-e4m3 K page with the exponent witness is its codes alone (16 x 128 bytes at
// D = 128, against 16 x 160 with the fp16 witness); its V pages keep rho.
TEST(ExponentWitness, KPagesStoreNoWitnessBytes) {
  for (const int d : {32, 64, 128, 256}) {
    LossyPageSpec spec = make_spec(LossyScheme::kFp8E4M3, true, 16, d, RopePairing::kInterleaved, {});
    spec.witness = WitnessCode::kExponent;
    EXPECT_EQ(lossy_page_bytes(spec), size_t(16) * size_t(d));
    EXPECT_EQ(witness_width(spec), d);
    LossyPageSpec fp16 = spec;
    fp16.witness = WitnessCode::kFp16;
    EXPECT_EQ(lossy_page_bytes(fp16) - lossy_page_bytes(spec), size_t(16) * 2 * size_t(witness_bands(d)));
    LossyPageSpec v = spec;
    v.key = false;
    EXPECT_EQ(lossy_page_bytes(v), size_t(16) * size_t(d) + 32);
  }
  LossyPageSpec spec = make_spec(LossyScheme::kFp8E4M3, true, 16, 64, RopePairing::kInterleaved, {});
  spec.witness = WitnessCode::kExponent;
  std::vector<uint8_t> page(lossy_page_bytes(spec));
  EXPECT_THROW(lossy_witness(spec, page.data()), Error);  // no fp16 witness to point at
}

// Schemes whose codes do not bound their own error refuse the witness by name: the scaled cast
// (its fp16 scale is not a power of two), fp8-e5m2 (another step; not served), rtn8, rtn4, kivi2,
// dither8; on K and V pages alike.
TEST(ExponentWitness, SchemesItCannotBoundRefuseIt) {
  for (int si = 0; si < kNumLossySchemes; ++si) {
    const LossyScheme scheme = scheme_at(si);
    EXPECT_EQ(lossy_witness_supported(scheme, WitnessCode::kExponent), scheme == LossyScheme::kFp8E4M3);
    if (scheme == LossyScheme::kFp8E4M3) continue;
    for (bool key : {true, false}) {
      LossyPageSpec spec = make_spec(scheme, key, 16, 64, RopePairing::kInterleaved, {});
      spec.witness = WitnessCode::kExponent;
      try {
        validate_lossy_page_spec(spec);
        ADD_FAILURE() << lossy_scheme_name(scheme) << " took the exponent witness";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
        const std::string what = e.what();
        EXPECT_NE(what.find("witness exponent"), std::string::npos) << what;
        EXPECT_NE(what.find(lossy_scheme_name(scheme)), std::string::npos) << what;
      }
      EXPECT_THROW(lossy_page_bytes(spec), Error);
    }
  }
}

// A saturating block is refused (the cache keeps it exact), on K pages only (V pages keep rho,
// which a saturated cast's residual does not break); NaN and Inf are refused as before; a corrupt
// NaN code reads as an infinite bound.
TEST(ExponentWitness, SaturationIsRefusedAndNanCodesBoundNothing) {
  LossyPageSpec spec = make_spec(LossyScheme::kFp8E4M3, true, 16, 64, RopePairing::kInterleaved, {});
  spec.witness = WitnessCode::kExponent;
  std::vector<uint8_t> page(lossy_page_bytes(spec));
  for (const float edge : {464.f, -464.f, 448.f, 0.f, -0.f, 0x1p-9f, 0x1p-133f}) {
    std::vector<uint16_t> x(16 * 64, float_to_bf16(1.f));
    x[77] = float_to_bf16(edge);
    EXPECT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), page.data())) << edge;
  }
  for (const float past : {466.f, -466.f, 1e6f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<uint16_t> x(16 * 64, float_to_bf16(1.f));
    x[77] = float_to_bf16(past);
    EXPECT_FALSE(lossy_encode_page_ref(spec, 0, x.data(), page.data())) << past;
    LossyPageSpec v = spec;
    v.key = false;
    std::vector<uint8_t> v_page(lossy_page_bytes(v));
    EXPECT_EQ(lossy_encode_page_ref(v, 0, x.data(), v_page.data()), std::isfinite(past)) << past;
  }
  std::vector<uint16_t> x(16 * 64, float_to_bf16(0.5f));
  ASSERT_TRUE(lossy_encode_page_ref(spec, 0, x.data(), page.data()));
  page[5 * 64 + 9] = 0xff;  // a NaN code
  std::vector<float> u(64 * 16);
  lossy_witness_bounds(spec, page.data(), u.data());
  EXPECT_EQ(u[9 * 16 + 5], std::numeric_limits<float>::infinity());
  EXPECT_EQ(u[9 * 16 + 4], 0x1p-5f + 0x1p-10f);  // 0.5 = 2^-1: 2^-5 + 2^-10
}

}  // namespace
}  // namespace certkv::codec
