// Helpers shared by the attention tests: caches filled with seeded data in ragged steps, and
// checks that test data is not degenerate. Test-only (included by *_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"

namespace certkv::attention::testing {

struct CaseShape {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
  int block_tokens;
};

inline AttentionShape attention_shape(const CaseShape& c, float scale_factor = 1.f) {
  return {c.n_q_heads, c.n_kv_heads, c.head_dim, scale_factor / std::sqrt(float(c.head_dim))};
}

inline std::unique_ptr<cache::KvCache> make_cache(const CaseShape& c, int64_t max_tokens,
                                                  int n_layers = 2) {
  cache::KvCacheConfig cfg;
  cfg.n_layers = n_layers;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  return std::make_unique<cache::KvCache>(cfg);
}

inline std::vector<float> uniform_values(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

inline std::vector<float> integer_values(size_t n, int lo, int hi, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = float(dist(rng));
  return x;
}

// Appends n tokens of uniform [-2, 2) K and V to every layer in steps of varying size (so that
// steps end inside blocks), committing each step.
inline void append_random(cache::KvCache& cache, cache::SeqId seq, int64_t n, std::mt19937& rng) {
  const cache::KvCacheConfig& cfg = cache.config();
  static constexpr int64_t kSteps[] = {5, 1, 13, 64, 2, 300};
  int64_t done = 0;
  for (int step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 6], n - done);
    cache.reserve(seq, m);
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      const size_t count = size_t(m) * size_t(cfg.n_kv_heads) * size_t(cfg.head_dim);
      const std::vector<float> k = uniform_values(count, -2.f, 2.f, rng);
      const std::vector<float> v = uniform_values(count, -2.f, 2.f, rng);
      cache.write(seq, layer, k.data(), v.data(), m);
    }
    cache.commit(seq, m);
    done += m;
  }
}

// Appends n tokens to every layer in steps of 37, 1, 200, 3, 64, ... tokens (steps end inside
// blocks), committing each step; fill_row(k, v) writes one token of one kv head: k, v: [head_dim].
template <typename FillRow>
void append_in_ragged_steps(cache::KvCache& cache, cache::SeqId seq, int64_t n, FillRow&& fill_row) {
  const cache::KvCacheConfig& cfg = cache.config();
  static constexpr int64_t kSteps[] = {37, 1, 200, 3, 64};
  int64_t done = 0;
  for (int step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 5], n - done);
    cache.reserve(seq, m);
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      const size_t rows = size_t(m) * size_t(cfg.n_kv_heads);
      std::vector<float> k(rows * size_t(cfg.head_dim)), v(rows * size_t(cfg.head_dim));
      for (size_t row = 0; row < rows; ++row)
        fill_row(k.data() + row * size_t(cfg.head_dim), v.data() + row * size_t(cfg.head_dim));
      cache.write(seq, layer, k.data(), v.data(), m);
    }
    cache.commit(seq, m);
    done += m;
  }
}

// Test data must be able to make a test fail: refuse data that is all zero or constant.
template <typename T>
void expect_nondegenerate(const std::vector<T>& x, const char* what) {
  ASSERT_FALSE(x.empty()) << what << " is empty";
  size_t nonzero = 0;
  for (T e : x) nonzero += e != T(0);
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  ASSERT_GT(nonzero, x.size() / 2) << what << " is mostly zero";
  ASSERT_LT(*lo, *hi) << what << " is constant";
}

// Largest |got - want| over the arrays.
template <typename G, typename W>
double max_abs_diff(const std::vector<G>& got, const std::vector<W>& want) {
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::fabs(double(got[i]) - double(want[i])));
  return m;
}

}  // namespace certkv::attention::testing
