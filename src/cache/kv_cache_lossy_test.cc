// The lossy KV schemes of KvCache: bf16 tails, complete blocks in lossy pages of their class,
// the exact blocks in the backing store, the recent window, dither8's outlier pairs, repair,
// sharing, accounting, non-finite input and bad configurations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
#include "core/status.h"
#include "format/numeric.h"

namespace certkv::cache {
namespace {

using format::PageRef;
using format::StorageClass;

constexpr KvScheme kLossySchemes[] = {KvScheme::kFp8E4M3, KvScheme::kFp8E5M2,
                                      KvScheme::kFp8E4M3Scaled, KvScheme::kRtn8,
                                      KvScheme::kRtn4, KvScheme::kKivi2, KvScheme::kDither8};

KvCacheConfig lossy_config(KvScheme scheme, int head_dim = 64, int block_tokens = 16) {
  KvCacheConfig c;
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = head_dim;
  c.block_tokens = block_tokens;
  c.max_tokens = 2048;
  c.scheme = scheme;
  c.rope_pairing = codec::RopePairing::kHalfSplit;
  return c;
}

// Keys and values with a few large channels (the massive activations of real keys).
std::vector<float> kv_values(size_t n_rows, int d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(n_rows * size_t(d));
  for (size_t r = 0; r < n_rows; ++r)
    for (int c = 0; c < d; ++c) x[r * size_t(d) + c] = normal(rng) * (c == 3 || c == 32 ? 40.f : 1.f);
  return x;
}

float bf16_round(float x) { return format::bf16_to_float(format::float_to_bf16(x)); }

// Writes n tokens in steps of the given sizes to every layer; returns what was written:
// [layer][kv][position][kv_head][head_dim].
std::vector<std::vector<float>> fill(KvCache& cache, SeqId seq, const std::vector<int64_t>& steps,
                                     std::mt19937& rng) {
  const KvCacheConfig& cfg = cache.config();
  std::vector<std::vector<float>> written(size_t(cfg.n_layers) * 2);
  for (int64_t m : steps) {
    cache.reserve(seq, m);
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      const std::vector<float> k = kv_values(size_t(m) * size_t(cfg.n_kv_heads), cfg.head_dim, rng);
      const std::vector<float> v = kv_values(size_t(m) * size_t(cfg.n_kv_heads), cfg.head_dim, rng);
      cache.write(seq, layer, k.data(), v.data(), m);
      auto& wk = written[size_t(layer) * 2];
      auto& wv = written[size_t(layer) * 2 + 1];
      wk.insert(wk.end(), k.begin(), k.end());
      wv.insert(wv.end(), v.begin(), v.end());
    }
    cache.commit(seq, m);
  }
  return written;
}

class LossyCacheTest : public ::testing::TestWithParam<KvScheme> {};

TEST_P(LossyCacheTest, TailsStayExactBlocksAreLossyAndTheBackingStoreIsExact) {
  const KvScheme scheme = GetParam();
  std::mt19937 rng(7);
  for (const std::vector<int64_t>& steps :
       std::vector<std::vector<int64_t>>{{1, 1, 1, 17, 3, 300, 1}, {320}, {5, 64, 13, 2, 250}}) {
    KvCache cache(lossy_config(scheme));
    const SeqId seq = cache.create_sequence();
    const auto written = fill(cache, seq, steps, rng);
    const KvCacheConfig& cfg = cache.config();
    const int64_t n = cache.length(seq);
    const int d = cfg.head_dim;
    const int64_t window = scheme == KvScheme::kKivi2 ? 128 : 0;
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < cfg.n_kv_heads; ++h) {
          const PageRef* table = cache.block_table(seq, layer, KvTensor(kv), h);
          for (int64_t b = 0; b < cache.n_blocks(seq); ++b) {
            const bool complete_and_old = (b + 1) * cfg.block_tokens <= n - window;
            const StorageClass want = complete_and_old ? (scheme == KvScheme::kDither8
                                                              ? StorageClass::kDither8
                                                              : StorageClass::kLossy)
                                                       : StorageClass::kBf16;
            ASSERT_EQ(table[b].storage, want) << kv_scheme_name(scheme) << " block " << b << " of " << n;
          }
          std::vector<float> exact(size_t(n) * size_t(d)), recon(size_t(n) * size_t(d));
          cache.read_token_range_exact(seq, layer, KvTensor(kv), h, 0, n, exact.data());
          cache.read_token_range_ref(seq, layer, KvTensor(kv), h, 0, n, recon.data());
          const std::vector<float>& w = written[size_t(layer) * 2 + size_t(kv)];
          double diff = 0;
          for (int64_t t = 0; t < n; ++t) {
            for (int c = 0; c < d; ++c) {
              const float want = bf16_round(w[(size_t(t) * size_t(cfg.n_kv_heads) + size_t(h)) * size_t(d) + c]);
              ASSERT_EQ(exact[size_t(t) * d + c], want) << "exact read, position " << t;
              const float got = recon[size_t(t) * d + c];
              const bool lossy_block = (t / cfg.block_tokens + 1) * cfg.block_tokens <= n - window;
              if (!lossy_block) {
                ASSERT_EQ(got, want) << "tail position " << t;
              }
              ASSERT_TRUE(std::isfinite(got));
              diff = std::max(diff, double(std::fabs(got - want)));
            }
          }
          // A lossy block really is lossy (the test would pass on an exact cache otherwise).
          if (n - window >= cfg.block_tokens) {
            EXPECT_GT(diff, 0.0) << kv_scheme_name(scheme);
          }
        }
      }
    }
    MemoryStats m = cache.memory_stats();
    EXPECT_GT(m.backing_pages_in_use, 0u);
    EXPECT_EQ(m.exact_fallback_blocks, 0u);
  }
}

TEST_P(LossyCacheTest, ReconstructionIsTheCodecsDecodeOfTheStoredPage) {
  const KvScheme scheme = GetParam();
  std::mt19937 rng(11);
  KvCache cache(lossy_config(scheme));
  const SeqId seq = cache.create_sequence();
  fill(cache, seq, {200}, rng);
  const int bt = cache.block_tokens(), d = cache.head_dim();
  for (int kv = 0; kv < 2; ++kv) {
    const PageRef ref = cache.block_table(seq, 1, KvTensor(kv), 1)[3];
    ASSERT_NE(ref.storage, StorageClass::kBf16);
    std::vector<float> want(size_t(bt) * d), got(size_t(bt) * d);
    codec::lossy_decode_page_ref(cache.lossy_spec(1, KvTensor(kv), 1), 3,
                                 cache.page_bytes_of(ref), want.data());
    cache.read_token_range_ref(seq, 1, KvTensor(kv), 1, 3 * bt, 4 * bt, got.data());
    EXPECT_EQ(got, want);
  }
}

TEST_P(LossyCacheTest, RepairPagesInTheExactBlockAndCountsItsBytes) {
  const KvScheme scheme = GetParam();
  std::mt19937 rng(13);
  KvCache cache(lossy_config(scheme));
  const SeqId seq = cache.create_sequence();
  fill(cache, seq, {300}, rng);
  const int bt = cache.block_tokens(), d = cache.head_dim();
  const uint64_t backing_before = cache.memory_stats().backing_pages_in_use;
  const uint64_t bytes = cache.repair_block(seq, 0, 1, 2);
  EXPECT_EQ(bytes, 2 * cache.page_bytes());
  for (int kv = 0; kv < 2; ++kv) {
    EXPECT_EQ(cache.block_table(seq, 0, KvTensor(kv), 1)[2].storage, StorageClass::kBf16);
    std::vector<float> exact(size_t(bt) * d), recon(size_t(bt) * d);
    cache.read_token_range_exact(seq, 0, KvTensor(kv), 1, 2 * bt, 3 * bt, exact.data());
    cache.read_token_range_ref(seq, 0, KvTensor(kv), 1, 2 * bt, 3 * bt, recon.data());
    EXPECT_EQ(recon, exact);
  }
  EXPECT_EQ(cache.memory_stats().backing_pages_in_use, backing_before - 2);
  EXPECT_EQ(cache.repair_block(seq, 0, 1, 2), 0u);           // already exact
  EXPECT_EQ(cache.repair_block(seq, 0, 1, 300 / bt), 0u);    // the bf16 tail
  EXPECT_THROW(cache.repair_block(seq, 0, 1, 1000), Error);
  EXPECT_THROW(cache.repair_block(seq, 0, 5, 0), Error);
}

TEST_P(LossyCacheTest, ForksShareLossyPagesAndFreeingReleasesTheBackingStore) {
  const KvScheme scheme = GetParam();
  std::mt19937 rng(17);
  KvCache cache(lossy_config(scheme));
  const SeqId a = cache.create_sequence();
  fill(cache, a, {200}, rng);
  const SeqId b = cache.fork_sequence(a);
  fill(cache, b, {40}, rng);
  const PageRef shared = cache.block_table(a, 0, KvTensor::kKey, 0)[0];
  EXPECT_EQ(cache.ref_count(shared), 2u);
  // Repairing in one sequence leaves the other's lossy page alone.
  EXPECT_GT(cache.repair_block(b, 0, 0, 0), 0u);
  EXPECT_EQ(cache.block_table(a, 0, KvTensor::kKey, 0)[0].storage, shared.storage);
  EXPECT_EQ(cache.ref_count(shared), 1u);
  cache.free_sequence(a);
  cache.free_sequence(b);
  const MemoryStats m = cache.memory_stats();
  EXPECT_EQ(m.pages_in_use, 0u);
  EXPECT_EQ(m.backing_pages_in_use, 0u);
}

TEST_P(LossyCacheTest, NonFiniteBlocksStayExactAndAreCounted) {
  const KvScheme scheme = GetParam();
  KvCache cache(lossy_config(scheme));
  const SeqId seq = cache.create_sequence();
  const KvCacheConfig& cfg = cache.config();
  const int64_t n = 64;
  std::mt19937 rng(19);
  cache.reserve(seq, n);
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    std::vector<float> k = kv_values(size_t(n) * 2, cfg.head_dim, rng);
    std::vector<float> v = kv_values(size_t(n) * 2, cfg.head_dim, rng);
    if (layer == 1) {
      k[(size_t(5) * 2 + 1) * size_t(cfg.head_dim) + 7] = std::numeric_limits<float>::infinity();
      v[(size_t(20) * 2 + 0) * size_t(cfg.head_dim) + 3] = std::numeric_limits<float>::quiet_NaN();
    }
    cache.write(seq, layer, k.data(), v.data(), n);
  }
  cache.commit(seq, n);
  const MemoryStats m = cache.memory_stats();
  if (scheme == KvScheme::kKivi2) {
    EXPECT_EQ(m.exact_fallback_blocks, 0u);  // 64 tokens are all inside the 128-token window
    return;
  }
  EXPECT_EQ(m.exact_fallback_blocks, 2u);
  EXPECT_EQ(cache.block_table(seq, 1, KvTensor::kKey, 1)[0].storage, StorageClass::kBf16);
  EXPECT_EQ(cache.block_table(seq, 1, KvTensor::kValue, 0)[1].storage, StorageClass::kBf16);
  EXPECT_NE(cache.block_table(seq, 1, KvTensor::kKey, 0)[0].storage, StorageClass::kBf16);
}

INSTANTIATE_TEST_SUITE_P(AllLossy, LossyCacheTest, ::testing::ValuesIn(kLossySchemes),
                         [](const ::testing::TestParamInfo<KvScheme>& info) {
                           std::string name = kv_scheme_name(info.param);
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

TEST(LossyCache, SchemeNamesParseAndClassify) {
  for (int i = 0; i < kNumKvSchemes; ++i) {
    const KvScheme s = KvScheme(i);
    EXPECT_EQ(parse_kv_scheme(kv_scheme_name(s)), s);
  }
  EXPECT_TRUE(kv_scheme_is_lossy(KvScheme::kDither8));
  EXPECT_FALSE(kv_scheme_is_lossy(KvScheme::kFp8PagesE4M3));
  EXPECT_FALSE(kv_scheme_is_lossy(KvScheme::kGaac));
  EXPECT_EQ(kv_scheme_lossy(KvScheme::kRtn4), codec::LossyScheme::kRtn4);
  EXPECT_THROW(kv_scheme_lossy(KvScheme::kBf16), Error);
  try {
    parse_kv_scheme("int3");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dither8"), std::string::npos) << e.what();
  }
}

TEST(LossyCache, RecentWindowKeepsTheNewestBlocksExact) {
  KvCacheConfig cfg = lossy_config(KvScheme::kRtn8);
  cfg.recent_window_tokens = 64;
  KvCache cache(cfg);
  const SeqId seq = cache.create_sequence();
  std::mt19937 rng(23);
  fill(cache, seq, {79}, rng);  // block 0 ends at 16 > 79 - 64: raw
  const PageRef* t = cache.block_table(seq, 0, KvTensor::kKey, 0);
  EXPECT_EQ(t[0].storage, StorageClass::kBf16);
  fill(cache, seq, {1}, rng);  // 80: block 0 leaves the window
  t = cache.block_table(seq, 0, KvTensor::kKey, 0);
  EXPECT_EQ(t[0].storage, StorageClass::kLossy);
  EXPECT_EQ(t[1].storage, StorageClass::kBf16);
  for (int i = 0; i < 15; ++i) fill(cache, seq, {1}, rng);  // 95: block 1 ends at 32 > 31
  t = cache.block_table(seq, 0, KvTensor::kKey, 0);
  EXPECT_EQ(t[1].storage, StorageClass::kBf16);
  fill(cache, seq, {1}, rng);  // 96: block 1 ends at 32 <= 32
  t = cache.block_table(seq, 0, KvTensor::kKey, 0);
  EXPECT_EQ(t[1].storage, StorageClass::kLossy);
  EXPECT_EQ(t[2].storage, StorageClass::kBf16);
}

TEST(LossyCache, Dither8OutlierPairsAreChosenOnceAndKeptExact) {
  KvCacheConfig cfg = lossy_config(KvScheme::kDither8);
  cfg.outlier_pairs = 2;
  KvCache cache(cfg);
  const SeqId seq = cache.create_sequence();
  std::mt19937 rng(29);
  const auto written = fill(cache, seq, {64}, rng);
  const codec::LossyPageSpec spec = cache.lossy_spec(0, KvTensor::kKey, 0);
  ASSERT_EQ(spec.n_outlier_pairs, 2);
  // Channel 3 (and 32 = 3 + 29) are the large ones; half-split pairs are (j, j + 32).
  std::vector<int> pairs = {spec.outlier_pairs[0], spec.outlier_pairs[1]};
  EXPECT_EQ(pairs, (std::vector<int>{0, 3}));
  std::vector<float> recon(size_t(64) * 64);
  cache.read_token_range_ref(seq, 0, KvTensor::kKey, 0, 0, 64, recon.data());
  for (int t = 0; t < 64; ++t)
    for (int c : {0, 32, 3, 35})
      EXPECT_EQ(recon[size_t(t) * 64 + c], bf16_round(written[0][(size_t(t) * 2) * 64 + c]));
  EXPECT_EQ(cache.lossy_spec(0, KvTensor::kValue, 0).n_outlier_pairs, 0);
  fill(cache, seq, {64}, rng);
  EXPECT_EQ(cache.lossy_spec(0, KvTensor::kKey, 0).outlier_pairs[1], 3);
}

TEST(LossyCache, AllocatorBytesPerTokenFollowThePageLayout) {
  // dither8 at head_dim 128: 136 B per token per head at m = 0, 152 B at m = 4 (K), 136 B (V).
  for (int m : {0, 4}) {
    KvCacheConfig cfg = lossy_config(KvScheme::kDither8, 128);
    cfg.outlier_pairs = m;
    cfg.n_layers = 1;
    cfg.n_kv_heads = 1;
    cfg.max_tokens = 4096;
    KvCache cache(cfg);
    EXPECT_EQ(cache.slot_pool(0).page_bytes(), size_t(16) * (m == 0 ? 136 : 152));
    EXPECT_EQ(cache.slot_pool(1).page_bytes(), size_t(16) * 136);
  }
}

// A GAAC calibration of (layer, K/V, kv_head) rows drawn like kv_values.
std::shared_ptr<const codec::GaacCalibration> calibrate(const KvCacheConfig& cfg) {
  codec::GaacShape shape{cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.block_tokens,
                         format::GaacElement::kBf16};
  codec::GaacCalibrator calibrator(shape);
  std::mt19937 rng(99);
  for (int l = 0; l < cfg.n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const std::vector<float> x = kv_values(512, cfg.head_dim, rng);
        std::vector<uint16_t> rows(x.size());
        for (size_t i = 0; i < x.size(); ++i) rows[i] = format::float_to_bf16(x[i]);
        calibrator.add_bf16(l, kv, h, rows.data(), 512);
      }
  return std::make_shared<const codec::GaacCalibration>(calibrator.finish());
}

TEST(LossyCache, GaacCodedBackingStoreIsExactAndSmaller) {
  for (KvScheme scheme : {KvScheme::kRtn4, KvScheme::kDither8}) {
    KvCacheConfig plain_cfg = lossy_config(scheme);
    KvCacheConfig coded_cfg = plain_cfg;
    coded_cfg.gaac_calibration = calibrate(coded_cfg);
    KvCache plain(plain_cfg), coded(coded_cfg);
    const SeqId a = plain.create_sequence(), b = coded.create_sequence();
    std::mt19937 rng_a(5), rng_b(5);
    const auto written = fill(plain, a, {37, 1, 400, 3}, rng_a);
    fill(coded, b, {37, 1, 400, 3}, rng_b);
    const int64_t n = coded.length(b);
    const int d = coded.head_dim();
    for (int layer = 0; layer < 2; ++layer)
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < 2; ++h) {
          std::vector<float> exact(size_t(n) * d), recon_a(size_t(n) * d), recon_b(size_t(n) * d);
          coded.read_token_range_exact(b, layer, KvTensor(kv), h, 0, n, exact.data());
          for (int64_t t = 0; t < n; ++t)
            for (int c = 0; c < d; ++c)
              ASSERT_EQ(exact[size_t(t) * d + c],
                        bf16_round(written[size_t(layer) * 2 + kv][(size_t(t) * 2 + h) * d + c]));
          // The lossy pages do not depend on how the backing store keeps its blocks.
          plain.read_token_range_ref(a, layer, KvTensor(kv), h, 0, n, recon_a.data());
          coded.read_token_range_ref(b, layer, KvTensor(kv), h, 0, n, recon_b.data());
          ASSERT_EQ(recon_a, recon_b);
        }
    const MemoryStats pm = plain.memory_stats(), cm = coded.memory_stats();
    EXPECT_EQ(pm.backing_pages_in_use, cm.backing_pages_in_use);
    EXPECT_LT(double(cm.backing_bytes_reserved_from_allocator),
              0.85 * double(pm.backing_bytes_reserved_from_allocator))
        << "GAAC should code normal bf16 data well below its raw size";
    // Repair from a GAAC-coded backing block gives the exact values.
    EXPECT_EQ(coded.repair_block(b, 1, 1, 4), 2 * coded.page_bytes());
    std::vector<float> exact(size_t(16) * d), recon(size_t(16) * d);
    coded.read_token_range_exact(b, 1, KvTensor::kValue, 1, 64, 80, exact.data());
    coded.read_token_range_ref(b, 1, KvTensor::kValue, 1, 64, 80, recon.data());
    EXPECT_EQ(recon, exact);
    coded.free_sequence(b);
    EXPECT_EQ(coded.memory_stats().backing_pages_in_use, 0u);
  }
  // A calibration of another shape is refused.
  KvCacheConfig cfg = lossy_config(KvScheme::kRtn8);
  KvCacheConfig other = cfg;
  other.head_dim = 32;
  cfg.gaac_calibration = calibrate(other);
  EXPECT_THROW(KvCache{cfg}, Error);
}

TEST(LossyCache, BadConfigurationsAreClearErrors) {
  KvCacheConfig cfg = lossy_config(KvScheme::kRtn8);
  cfg.outlier_pairs = 2;
  EXPECT_THROW(KvCache{cfg}, Error);
  cfg = lossy_config(KvScheme::kDither8);
  cfg.outlier_pairs = 33;  // head_dim 64 has 32 pairs
  EXPECT_THROW(KvCache{cfg}, Error);
  cfg = lossy_config(KvScheme::kKivi2);
  cfg.recent_window_tokens = 20;  // not a multiple of 16
  EXPECT_THROW(KvCache{cfg}, Error);
  cfg = lossy_config(KvScheme::kRtn8, 48);  // not a multiple of 32 channels
  EXPECT_THROW(KvCache{cfg}, Error);
  KvCacheConfig bf16;
  bf16.n_layers = 1;
  bf16.n_kv_heads = 1;
  bf16.head_dim = 64;
  bf16.max_tokens = 64;
  KvCache cache(bf16);
  EXPECT_THROW(cache.lossy_spec(0, KvTensor::kKey, 0), Error);
}

}  // namespace
}  // namespace certkv::cache

namespace certkv::cache {
namespace {

// dither8 with its outlier pairs fixed for the model: every head's pairs are the given ones from
// the start, whatever is written first; a table of the wrong size or with a bad list is refused.
TEST(LossyCacheFixedOutlierPairs, TheGivenPairsHoldFromTheStart) {
  KvCacheConfig config;
  config.n_layers = 2;
  config.n_kv_heads = 2;
  config.head_dim = 64;
  config.block_tokens = 16;
  config.max_tokens = 64;
  config.scheme = KvScheme::kDither8;
  config.outlier_pairs = 3;
  auto table = std::make_shared<std::vector<uint16_t>>();
  for (int i = 0; i < 4; ++i)
    for (uint16_t p : {uint16_t(1 + i), uint16_t(7 + i), uint16_t(20 + i)}) table->push_back(p);
  config.fixed_outlier_pairs = table;
  KvCache cache(config);
  for (int layer = 0; layer < 2; ++layer)
    for (int h = 0; h < 2; ++h) {
      const codec::LossyPageSpec spec = cache.lossy_spec(layer, KvTensor::kKey, h);
      ASSERT_EQ(spec.n_outlier_pairs, 3);
      const int i = layer * 2 + h;
      EXPECT_EQ(std::vector<uint16_t>(spec.outlier_pairs, spec.outlier_pairs + 3),
                (std::vector<uint16_t>{uint16_t(1 + i), uint16_t(7 + i), uint16_t(20 + i)}));
    }
  // A write of large keys on other channels leaves them as they were.
  const SeqId seq = cache.create_sequence();
  std::vector<float> k(size_t(32) * 2 * 64, 0.5f), v(k.size(), 0.25f);
  for (size_t e = 0; e < k.size(); e += 64) k[e + 40] = 1000.f;
  cache.reserve(seq, 32);
  for (int layer = 0; layer < 2; ++layer) cache.write(seq, layer, k.data(), v.data(), 32);
  cache.commit(seq, 32);
  const codec::LossyPageSpec after = cache.lossy_spec(1, KvTensor::kKey, 1);
  EXPECT_EQ(std::vector<uint16_t>(after.outlier_pairs, after.outlier_pairs + 3), (std::vector<uint16_t>{4, 10, 23}));
  KvCacheConfig short_table = config;
  short_table.fixed_outlier_pairs = std::make_shared<std::vector<uint16_t>>(table->begin(), table->end() - 1);
  EXPECT_THROW(KvCache{short_table}, Error);
  KvCacheConfig unordered = config;
  auto bad = std::make_shared<std::vector<uint16_t>>(*table);
  (*bad)[1] = 0;  // head 0: 1, 0, 20
  unordered.fixed_outlier_pairs = bad;
  EXPECT_THROW(KvCache{unordered}, Error);
}

}  // namespace
}  // namespace certkv::cache
