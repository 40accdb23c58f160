// Swapping a sequence of KvCache to host memory and back (KvCache::swap_out / swap_in): every
// scheme reads the same bits after a round trip (dither8 too: its pages are encoded again from
// their exact blocks at swap-in, and its dither is keyed by the block's position, so they come
// back as they were), shared prefix pages stay their other holders', the pool gets
// the pages back, and bad input is refused with nothing changed.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/status.h"

namespace certkv::cache {
namespace {

KvCacheConfig swap_config(KvScheme scheme) {
  KvCacheConfig c;
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.block_tokens = 16;
  c.max_tokens = 256;
  c.scheme = scheme;
  c.rope_pairing = codec::RopePairing::kHalfSplit;
  if (kv_scheme_is_lossy(scheme)) c.recent_window_tokens = 0;
  // The calibration that fits every block (bases 0, the largest escape capacity): the gaac
  // schemes need one; a lossy scheme given one keeps its backing store GAAC-coded.
  const bool bf16_calibration = kv_scheme_is_lossy(scheme) && scheme != KvScheme::kDither8;
  if (kv_scheme_is_gaac(scheme) || bf16_calibration) {
    codec::GaacShape shape;
    shape.n_layers = c.n_layers;
    shape.n_kv_heads = c.n_kv_heads;
    shape.head_dim = c.head_dim;
    shape.block_tokens = c.block_tokens;
    shape.element = kv_scheme_element(scheme);
    c.gaac_calibration = std::make_shared<const codec::GaacCalibration>(shape);
  }
  return c;
}

// Writes n tokens of normal values (a few large channels) to every layer, in one write, and commits.
void append(KvCache& cache, SeqId seq, int64_t n, std::mt19937& rng) {
  const KvCacheConfig& cfg = cache.config();
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t row = size_t(cfg.n_kv_heads) * size_t(cfg.head_dim);
  std::vector<float> k(size_t(n) * row), v(k.size());
  cache.reserve(seq, n);
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = normal(rng) * (i % size_t(cfg.head_dim) == 3 ? 40.f : 1.f);
      v[i] = normal(rng);
    }
    cache.write(seq, layer, k.data(), v.data(), n);
  }
  cache.commit(seq, n);
}

// Every position of every (layer, K/V, kv_head), as attention reads it (exact: the backing store).
std::vector<float> read_all(const KvCache& cache, SeqId seq, bool exact) {
  const KvCacheConfig& cfg = cache.config();
  const int64_t n = cache.length(seq);
  std::vector<float> out, part(size_t(n) * size_t(cfg.head_dim));
  for (int layer = 0; layer < cfg.n_layers; ++layer)
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue})
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        if (exact) cache.read_token_range_exact(seq, layer, kv, h, 0, n, part.data());
        else cache.read_token_range_ref(seq, layer, kv, h, 0, n, part.data());
        out.insert(out.end(), part.begin(), part.end());
      }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(KvCacheSwap, RoundTripReadsTheSameBitsForEveryScheme) {
  int checked = 0;
  for (const KvSchemeInfo& info : kv_schemes()) {
    SCOPED_TRACE(info.name);
    KvCache cache(swap_config(info.scheme));
    std::mt19937 rng(17);
    const SeqId other = cache.create_sequence();
    append(cache, other, 40, rng);
    const SeqId seq = cache.create_sequence();
    append(cache, seq, 53, rng);  // 3 whole blocks and a partial tail
    const std::vector<float> before = read_all(cache, seq, false);
    const std::vector<float> before_exact = read_all(cache, seq, true);
    const std::vector<float> other_before = read_all(cache, other, false);
    const std::vector<float> nonzero(before.size(), 0.f);
    ASSERT_FALSE(same_bits(before, nonzero));
    const uint64_t pages_with = cache.memory_stats().pages_in_use;
    SwappedKv swapped = cache.swap_out(seq);
    EXPECT_FALSE(cache.has_sequence(seq));
    EXPECT_EQ(swapped.length(), 53);
    EXPECT_EQ(swapped.pages(), 4u * 2 * 2 * 2);
    EXPECT_EQ(cache.memory_stats().pages_in_use, pages_with - swapped.pages());
    EXPECT_GT(swapped.host_bytes(), 0u);
    if (info.gaac) {
      EXPECT_GE(swapped.gaac_coded_pages(), 3u * 2 * 2 * 2) << "the whole blocks' slots";
    }
    if (info.scheme == KvScheme::kBf16) {
      EXPECT_EQ(swapped.gaac_coded_pages(), 0u) << "no calibration";
    }
    // The pages it freed are taken by another sequence in between.
    const SeqId filler = cache.create_sequence();
    append(cache, filler, 48, rng);
    const SeqId back = cache.swap_in(swapped);
    EXPECT_EQ(cache.length(back), 53);
    EXPECT_TRUE(same_bits(read_all(cache, back, true), before_exact));
    EXPECT_TRUE(same_bits(read_all(cache, back, false), before));
    EXPECT_TRUE(same_bits(read_all(cache, other, false), other_before));
    // It goes on as before: a write that finalizes its partial tail block.
    append(cache, back, 20, rng);
    EXPECT_EQ(cache.length(back), 73);
    cache.free_sequence(back);
    cache.free_sequence(filler);
    cache.free_sequence(other);
    EXPECT_EQ(cache.memory_stats().pages_in_use, 0u);
    ++checked;
  }
  EXPECT_GE(checked, 13);
}

TEST(KvCacheSwap, SharedPrefixPagesStayWithTheirOtherHolder) {
  for (KvScheme scheme : {KvScheme::kBf16, KvScheme::kGaac, KvScheme::kRtn8}) {
    SCOPED_TRACE(kv_scheme_name(scheme));
    KvCache cache(swap_config(scheme));
    std::mt19937 rng(5);
    const SeqId holder = cache.create_sequence();
    append(cache, holder, 48, rng);
    const SeqId child = cache.fork_prefix(holder, 32);
    append(cache, child, 10, rng);
    const std::vector<float> holder_values = read_all(cache, holder, false);
    const std::vector<float> child_values = read_all(cache, child, false);
    const format::PageRef shared = cache.block_table(holder, 0, KvTensor::kKey, 0)[0];
    ASSERT_EQ(cache.ref_count(shared), 2u);
    const uint64_t pages_with = cache.memory_stats().pages_in_use;
    SwappedKv swapped = cache.swap_out(child);
    EXPECT_EQ(cache.ref_count(shared), 1u) << "only the child's reference went";
    EXPECT_EQ(cache.memory_stats().pages_in_use, pages_with - 1u * 2 * 2 * 2) << "its own tail block";
    EXPECT_TRUE(same_bits(read_all(cache, holder, false), holder_values));
    const SeqId back = cache.swap_in(swapped);
    EXPECT_TRUE(same_bits(read_all(cache, back, false), child_values));
    EXPECT_EQ(cache.ref_count(shared), 1u) << "the swapped-in sequence has its own copies";
    cache.free_sequence(holder);
    EXPECT_TRUE(same_bits(read_all(cache, back, false), child_values));
  }
}

TEST(KvCacheSwap, RefusesBadInputWithNothingChanged) {
  KvCache cache(swap_config(KvScheme::kGaac));
  std::mt19937 rng(9);
  const SeqId seq = cache.create_sequence();
  append(cache, seq, 100, rng);
  // During a step (written, not committed).
  cache.reserve(seq, 4);
  std::vector<float> k(4 * 2 * 64, 1.f);
  cache.write(seq, 0, k.data(), k.data(), 4);
  try {
    cache.swap_out(seq);
    FAIL() << "a swap out during a step was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  }
  cache.write(seq, 1, k.data(), k.data(), 4);
  cache.commit(seq, 4);
  EXPECT_THROW(cache.swap_out(12345), Error);
  SwappedKv swapped = cache.swap_out(seq);
  // The pool refills: the swap in is refused, and the pool is as it was.
  const SeqId big = cache.create_sequence();
  append(cache, big, 200, rng);
  const uint64_t in_use = cache.memory_stats().pages_in_use;
  try {
    cache.swap_in(swapped);
    FAIL() << "a swap in beyond the pool was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfMemory) << e.what();
  }
  EXPECT_EQ(cache.memory_stats().pages_in_use, in_use);
  EXPECT_EQ(cache.n_sequences(), 1u);
  // Another cache's, and one that was never swapped out.
  KvCache other(swap_config(KvScheme::kGaac));
  EXPECT_THROW(other.swap_in(swapped), Error);
  EXPECT_THROW(cache.swap_in(SwappedKv{}), Error);
  cache.free_sequence(big);
  const SeqId back = cache.swap_in(swapped);
  EXPECT_EQ(cache.length(back), 104);
}

}  // namespace
}  // namespace certkv::cache
