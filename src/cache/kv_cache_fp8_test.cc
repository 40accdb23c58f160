// The FP8 KV schemes: raw FP8 pages (fp8-e4m3-pages, fp8-e5m2-pages) and GAAC-coded FP8 pages (gaac-e4m3,
// gaac-e5m2): page classes, memory by class, the values read back, and calibration checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/status.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::cache {
namespace {

using format::GaacElement;
using format::StorageClass;

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kDim = 64;
constexpr int kBlock = 16;

float fp8_rounded(GaacElement e, float x) {
  const uint16_t h = format::float_to_bf16(x);
  return e == GaacElement::kFp8E4M3 ? format::fp8_e4m3_to_float(format::bf16_to_fp8_e4m3_ref(h))
                                    : format::fp8_e5m2_to_float(format::bf16_to_fp8_e5m2_ref(h));
}

// [n][kHeads][kDim]: channel c scaled by 2^(c % 7 - 3); with `wild`, every element of the
// row is scaled by 2^[-6, 6] as well (exponents outside any calibrated window).
std::vector<float> rows(int64_t n, std::mt19937& rng, bool wild = false) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> spread(-6, 6);
  std::vector<float> x(size_t(n) * kHeads * kDim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = int(i % kDim);
    x[i] = std::ldexp(normal(rng), c % 7 - 3 + (wild ? spread(rng) : 0));
  }
  return x;
}

std::shared_ptr<const codec::GaacCalibration> calibrate(GaacElement e) {
  codec::GaacCalibrator calibrator(codec::GaacShape{kLayers, kHeads, kDim, kBlock, e});
  std::mt19937 rng(7);
  constexpr int kTokens = 256;
  const std::vector<float> x = rows(kTokens, rng);
  std::vector<uint8_t> head(size_t(kTokens) * kDim);
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kHeads; ++h) {
        for (int t = 0; t < kTokens; ++t) {
          for (int c = 0; c < kDim; ++c) {
            const uint16_t b = format::float_to_bf16(x[(size_t(t) * kHeads + h) * kDim + c]);
            head[size_t(t) * kDim + c] = e == GaacElement::kFp8E4M3 ? format::bf16_to_fp8_e4m3_ref(b)
                                                                    : format::bf16_to_fp8_e5m2_ref(b);
          }
        }
        calibrator.add_fp8(layer, kv, h, head.data(), kTokens);
      }
    }
  }
  return std::make_shared<const codec::GaacCalibration>(calibrator.finish());
}

KvCacheConfig config(KvScheme scheme, int64_t max_tokens) {
  KvCacheConfig cfg;
  cfg.n_layers = kLayers;
  cfg.n_kv_heads = kHeads;
  cfg.head_dim = kDim;
  cfg.block_tokens = kBlock;
  cfg.max_tokens = max_tokens;
  cfg.scheme = scheme;
  if (kv_scheme_is_gaac(scheme) && scheme != KvScheme::kGaac) {
    cfg.gaac_calibration = calibrate(kv_scheme_element(scheme));
  }
  return cfg;
}

// Writes n tokens in ragged steps; returns every layer's K and V inputs, [layer][kv] rows.
std::vector<std::vector<float>> fill_cache(KvCache& cache, SeqId seq, int64_t n, std::mt19937& rng) {
  static constexpr int64_t kSteps[] = {5, 1, 13, 64, 2, 300};
  std::vector<std::vector<float>> all(2 * kLayers);
  for (int64_t done = 0, step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 6], n - done);
    cache.reserve(seq, m);
    for (int layer = 0; layer < kLayers; ++layer) {
      const bool wild = step % 4 == 3;
      const std::vector<float> k = rows(m, rng, wild), v = rows(m, rng, wild);
      cache.write(seq, layer, k.data(), v.data(), m);
      all[2 * layer].insert(all[2 * layer].end(), k.begin(), k.end());
      all[2 * layer + 1].insert(all[2 * layer + 1].end(), v.begin(), v.end());
    }
    cache.commit(seq, m);
    done += m;
  }
  return all;
}

TEST(KvCacheFp8, SchemeNamesRoundTrip) {
  for (KvScheme s : {KvScheme::kBf16, KvScheme::kGaac, KvScheme::kFp8PagesE4M3, KvScheme::kFp8PagesE5M2,
                     KvScheme::kGaacE4M3, KvScheme::kGaacE5M2}) {
    EXPECT_EQ(parse_kv_scheme(kv_scheme_name(s)), s);
  }
  EXPECT_EQ(kv_scheme_element(KvScheme::kGaacE5M2), GaacElement::kFp8E5M2);
  EXPECT_EQ(kv_scheme_element(KvScheme::kFp8PagesE4M3), GaacElement::kFp8E4M3);
  EXPECT_TRUE(kv_scheme_is_gaac(KvScheme::kGaacE4M3));
  EXPECT_FALSE(kv_scheme_is_gaac(KvScheme::kFp8PagesE5M2));
  try {
    parse_kv_scheme("fp8");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gaac-e5m2"), std::string::npos) << e.what();
  }
}

class KvCacheFp8Raw : public ::testing::TestWithParam<KvScheme> {};

TEST_P(KvCacheFp8Raw, PagesAreFp8AndReadBackRounded) {
  const KvScheme scheme = GetParam();
  const GaacElement e = kv_scheme_element(scheme);
  for (int64_t n : {1, 3, 17, 129, 501}) {
    SCOPED_TRACE("n " + std::to_string(n));
    KvCache cache(config(scheme, n));
    EXPECT_EQ(cache.page_bytes(), size_t(kBlock) * kDim);
    const SeqId seq = cache.create_sequence();
    std::mt19937 rng{uint32_t(n)};
    const auto in = fill_cache(cache, seq, n, rng);
    const int64_t n_blocks = cache.n_blocks(seq);
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kHeads; ++h) {
          const format::PageRef* table = cache.block_table(seq, layer, KvTensor(kv), h);
          for (int64_t b = 0; b < n_blocks; ++b) ASSERT_EQ(table[b].storage, StorageClass::kFp8);
          EXPECT_THROW(cache.page_bf16(table[0]), Error);
          std::vector<float> got(size_t(n) * kDim);
          cache.read_token_range_ref(seq, layer, KvTensor(kv), h, 0, n, got.data());
          size_t changed = 0;
          for (int64_t t = 0; t < n; ++t) {
            for (int c = 0; c < kDim; ++c) {
              const float x = in[2 * layer + kv][(size_t(t) * kHeads + h) * kDim + c];
              ASSERT_EQ(got[size_t(t) * kDim + c], fp8_rounded(e, x)) << "t " << t << " c " << c;
              changed += fp8_rounded(e, x) != format::bf16_to_float(format::float_to_bf16(x));
            }
          }
          EXPECT_GT(changed, 0u) << "the FP8 cast must be lossy on this data";
        }
      }
    }
    const MemoryStats m = cache.memory_stats();
    ASSERT_EQ(m.by_class.size(), 1u);
    EXPECT_EQ(m.by_class[0].storage, StorageClass::kFp8);
    EXPECT_EQ(m.by_class[0].pages_in_use, uint64_t(n_blocks) * 2 * kLayers * kHeads);
    EXPECT_EQ(m.by_class[0].page_bytes_in_use, m.by_class[0].pages_in_use * kBlock * kDim);
    EXPECT_EQ(&cache.pool(StorageClass::kFp8), &cache.pool(StorageClass::kFp8));
    EXPECT_THROW(cache.pool(StorageClass::kBf16), Error);
  }
}

INSTANTIATE_TEST_SUITE_P(Elements, KvCacheFp8Raw,
                         ::testing::Values(KvScheme::kFp8PagesE4M3, KvScheme::kFp8PagesE5M2));

class KvCacheGaacFp8 : public ::testing::TestWithParam<KvScheme> {};

TEST_P(KvCacheGaacFp8, SlotsAndFallbacksReadAsRawFp8) {
  const KvScheme coded_scheme = GetParam();
  const KvScheme raw_scheme =
      coded_scheme == KvScheme::kGaacE4M3 ? KvScheme::kFp8PagesE4M3 : KvScheme::kFp8PagesE5M2;
  uint64_t total_slots = 0, total_raw_complete = 0;
  for (int64_t n : {1, 3, 17, 129, 501}) {
    SCOPED_TRACE("n " + std::to_string(n));
    KvCache coded(config(coded_scheme, n)), raw(config(raw_scheme, n));
    const SeqId cs = coded.create_sequence(), rs = raw.create_sequence();
    std::mt19937 rng_a{uint32_t(n)}, rng_b{uint32_t(n)};
    fill_cache(coded, cs, n, rng_a);
    fill_cache(raw, rs, n, rng_b);
    uint64_t slots = 0, raw_pages = 0;
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kHeads; ++h) {
          const format::PageRef* table = coded.block_table(cs, layer, KvTensor(kv), h);
          for (int64_t b = 0; b < coded.n_blocks(cs); ++b) {
            const bool complete = (b + 1) * kBlock <= n;
            if (table[b].storage == StorageClass::kGaacFp8) {
              ASSERT_TRUE(complete) << "a partial block in a slot";
              ++slots;
            } else {
              ASSERT_EQ(table[b].storage, StorageClass::kFp8);
              ++raw_pages;
              total_raw_complete += complete;
            }
          }
          std::vector<float> got(size_t(n) * kDim), want(size_t(n) * kDim);
          coded.read_token_range_ref(cs, layer, KvTensor(kv), h, 0, n, got.data());
          raw.read_token_range_ref(rs, layer, KvTensor(kv), h, 0, n, want.data());
          ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
        }
      }
    }
    total_slots += slots;
    const MemoryStats m = coded.memory_stats();
    ASSERT_EQ(m.by_class.size(), 2u);
    EXPECT_EQ(m.by_class[0].storage, StorageClass::kFp8);
    EXPECT_EQ(m.by_class[1].storage, StorageClass::kGaacFp8);
    EXPECT_EQ(m.by_class[0].pages_in_use, raw_pages);
    EXPECT_EQ(m.by_class[1].pages_in_use, slots);
    EXPECT_EQ(m.by_class[0].page_bytes_in_use, raw_pages * kBlock * kDim);
    // Slots are smaller than the raw FP8 page they replace.
    if (slots > 0) {
      EXPECT_LT(m.by_class[1].page_bytes_in_use, slots * kBlock * kDim);
    }
  }
  EXPECT_GT(total_slots, 0u);
  EXPECT_GT(total_raw_complete, 0u);
}

TEST_P(KvCacheGaacFp8, ForkSharesSlotsAndCopiesTail) {
  const KvScheme scheme = GetParam();
  KvCache cache(config(scheme, 200));
  const SeqId a = cache.create_sequence();
  std::mt19937 rng(3);
  fill_cache(cache, a, 37, rng);
  const SeqId b = cache.fork_sequence(a);
  const std::vector<float> k = rows(1, rng), v = rows(1, rng);
  cache.reserve(b, 1);
  for (int layer = 0; layer < kLayers; ++layer) cache.write(b, layer, k.data(), v.data(), 1);
  cache.commit(b, 1);
  std::vector<float> ra(37 * kDim), rb(37 * kDim);
  cache.read_token_range_ref(a, 1, KvTensor::kValue, 1, 0, 37, ra.data());
  cache.read_token_range_ref(b, 1, KvTensor::kValue, 1, 0, 37, rb.data());
  EXPECT_EQ(std::memcmp(ra.data(), rb.data(), ra.size() * sizeof(float)), 0);
  const format::PageRef* ta = cache.block_table(a, 1, KvTensor::kValue, 1);
  const format::PageRef* tb = cache.block_table(b, 1, KvTensor::kValue, 1);
  EXPECT_EQ(ta[0].page, tb[0].page);
  EXPECT_NE(ta[2].page, tb[2].page);
  EXPECT_EQ(tb[2].storage, StorageClass::kFp8);
}

TEST_P(KvCacheGaacFp8, CalibrationOfAnotherElementIsRejected) {
  const KvScheme scheme = GetParam();
  KvCacheConfig cfg = config(scheme, 64);
  cfg.gaac_calibration = calibrate(scheme == KvScheme::kGaacE4M3 ? GaacElement::kFp8E5M2
                                                                 : GaacElement::kFp8E4M3);
  try {
    KvCache cache(cfg);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("element"), std::string::npos) << e.what();
  }
  cfg.gaac_calibration = nullptr;
  try {
    KvCache cache(cfg);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(kv_scheme_name(scheme)), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Elements, KvCacheGaacFp8,
                         ::testing::Values(KvScheme::kGaacE4M3, KvScheme::kGaacE5M2));

}  // namespace
}  // namespace certkv::cache
