// Sparse decode attention: the production path against the double reference (same attended
// sets), p = 1 against dense attention, budget and recall monotone in p, pages of every class,
// the meter over what is attended, and bad input.
#include "attention/sparse_decode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "index/rabitq.h"
#include "index/top_p.h"

namespace certkv::attention {
namespace {

using cache::KvScheme;
using cache::KvTensor;
using testing::CaseShape;

std::unique_ptr<cache::KvCache> make_cache(const CaseShape& c, KvScheme scheme, int64_t max_tokens) {
  cache::KvCacheConfig cfg;
  cfg.n_layers = 2;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  cfg.scheme = scheme;
  return std::make_unique<cache::KvCache>(cfg);
}

// Keys clustered around a shared offset with a few tokens aligned to `direction` (so attention
// is peaked and Top-p selects a minority); values normal. Ragged write steps.
void append(cache::KvCache& cache, cache::SeqId seq, int64_t n, const std::vector<float>& direction,
            std::mt19937& rng) {
  const int d = cache.config().head_dim;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  testing::append_in_ragged_steps(cache, seq, n, [&](float* k, float* v) {
    const float gain = u(rng) < 0.05f ? 3.f : 0.f;
    for (int c = 0; c < d; ++c) {
      k[c] = normal(rng) + 0.5f + gain * direction[size_t(c)];
      v[c] = normal(rng);
    }
  });
}

// An index of [0, n_indexed) of every (layer, kv_head), centroids from the exact keys and q.
std::unique_ptr<cache::KeyIndex> build_index(const cache::KvCache& cache, cache::SeqId seq,
                                             int64_t n_indexed, const std::vector<float>& q,
                                             int n_q_heads) {
  const cache::KvCacheConfig& cfg = cache.config();
  cache::KeyIndexConfig ic;
  ic.n_layers = cfg.n_layers;
  ic.n_kv_heads = cfg.n_kv_heads;
  ic.head_dim = cfg.head_dim;
  ic.page_records = cfg.block_tokens;
  auto idx = std::make_unique<cache::KeyIndex>(ic);
  const int d = cfg.head_dim;
  const int group = n_q_heads / cfg.n_kv_heads;
  const int64_t n = cache.length(seq);
  std::vector<float> k(size_t(n) * size_t(d));
  for (int layer = 0; layer < cfg.n_layers; ++layer)
    for (int h = 0; h < cfg.n_kv_heads; ++h) {
      cache.read_token_range_exact(seq, layer, KvTensor::kKey, h, 0, n, k.data());
      std::vector<float> c_k(size_t(d), 0.f), c_q(size_t(d), 0.f);
      for (int64_t t = 0; t < n; ++t)
        for (int c = 0; c < d; ++c) c_k[size_t(c)] += k[size_t(t) * size_t(d) + size_t(c)] / float(n);
      for (int g = 0; g < group; ++g)
        for (int c = 0; c < d; ++c) c_q[size_t(c)] += q[size_t(h * group + g) * size_t(d) + size_t(c)] / float(group);
      idx->set_centroids(layer, h, c_q, c_k);
      idx->append(layer, h, k.data(), n_indexed);
    }
  return idx;
}

std::vector<float> queries(const CaseShape& c, const std::vector<float>& direction, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 0.5f);
  std::vector<float> q(size_t(c.n_q_heads) * size_t(c.head_dim));
  for (size_t i = 0; i < q.size(); ++i) q[i] = normal(rng) + 2.f * direction[i % size_t(c.head_dim)];
  return q;
}

std::vector<float> unit_direction(int d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(d));
  double n2 = 0;
  for (float& e : x) {
    e = normal(rng);
    n2 += double(e) * e;
  }
  for (float& e : x) e = float(e / std::sqrt(n2)) * std::sqrt(float(d)) * 0.5f;
  return x;
}

// Exact attention probabilities of head h over [0, n_ctx) (double), from the exact keys.
std::vector<double> exact_probs(const cache::KvCache& cache, cache::SeqId seq, int layer,
                                const AttentionShape& shape, const float* qh, int kv_head,
                                int64_t n_ctx) {
  const int d = shape.head_dim;
  std::vector<float> k(size_t(n_ctx) * size_t(d));
  cache.read_token_range_exact(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k.data());
  std::vector<double> p(static_cast<size_t>(n_ctx));
  double m = -INFINITY, sum = 0;
  for (int64_t t = 0; t < n_ctx; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double(qh[c]) * k[size_t(t) * size_t(d) + size_t(c)];
    m = std::max(m, p[size_t(t)] = double(shape.scale) * dot);
  }
  for (double& x : p) sum += (x = std::exp(x - m));
  for (double& x : p) x /= sum;
  return p;
}

struct SparseCase {
  CaseShape shape;
  int64_t n_ctx;
  int64_t n_indexed_blocks;  // of the context
};

class SparseDecodeTest : public ::testing::TestWithParam<SparseCase> {};

// A case's bf16 cache of n_ctx peaked tokens, its queries, and the index of its prefix.
struct SparseSetup {
  std::unique_ptr<cache::KvCache> cache;
  cache::SeqId seq;
  std::vector<float> q;
  std::unique_ptr<cache::KeyIndex> index;
};

SparseSetup sparse_setup(const SparseCase& sc, uint32_t seed) {
  const CaseShape& c = sc.shape;
  std::mt19937 rng(seed);
  const std::vector<float> dir = unit_direction(c.head_dim, rng);
  SparseSetup s;
  s.cache = make_cache(c, KvScheme::kBf16, sc.n_ctx);
  s.seq = s.cache->create_sequence();
  append(*s.cache, s.seq, sc.n_ctx, dir, rng);
  s.q = queries(c, dir, rng);
  s.index = build_index(*s.cache, s.seq, sc.n_indexed_blocks * c.block_tokens, s.q, c.n_q_heads);
  return s;
}

TEST_P(SparseDecodeTest, MatchesTheReferenceAndDenseAtPOne) {
  const SparseCase sc = GetParam();
  const CaseShape& c = sc.shape;
  const SparseSetup setup = sparse_setup(sc, static_cast<uint32_t>(sc.n_ctx * 7 + c.head_dim));
  const auto& cache = setup.cache;
  const cache::SeqId seq = setup.seq;
  const std::vector<float>& q = setup.q;
  const auto& index = setup.index;
  const int64_t n_indexed = sc.n_indexed_blocks * c.block_tokens;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  const size_t n_out = size_t(c.n_q_heads) * size_t(c.head_dim);

  int64_t previous_selected = -1;
  std::vector<double> previous_recall(size_t(c.n_q_heads), 0.0);
  int64_t selected_at_09 = 0;
  for (double p : {0.5, 0.8, 0.9, 0.99, 1.0}) {
    SparseDecodeOptions opt;
    opt.p = p;
    opt.rounding_seed = 11;
    std::vector<std::vector<int32_t>> attended, attended_ref;
    opt.attended = &attended;
    std::vector<float> out(n_out);
    std::vector<double> ref(n_out);
    std::vector<SparseHeadStats> stats(size_t(c.n_q_heads));
    sparse_decode_attention(*cache, seq, 1, shape, q.data(), sc.n_ctx, *index, opt, out.data(),
                            stats.data(), &pool);
    opt.attended = nullptr;
    sparse_decode_attention_ref(*cache, seq, 1, shape, q.data(), sc.n_ctx, *index, opt,
                                ref.data(), &attended_ref);
    ASSERT_EQ(attended, attended_ref) << "p " << p;
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5) << "p " << p;
    int64_t total_selected = 0;
    for (int h = 0; h < c.n_q_heads; ++h) {
      const SparseHeadStats& st = stats[size_t(h)];
      EXPECT_EQ(st.n_indexed, n_indexed);
      EXPECT_EQ(st.n_attended, int64_t(attended[size_t(h)].size()));
      EXPECT_EQ(st.n_attended, st.n_selected + sc.n_ctx - n_indexed);
      if (n_indexed > 0) {
        EXPECT_GE(st.estimated_mass, p - 1e-12);
      }
      total_selected += st.n_selected;
      // Recall (exact attention mass of the attended set) is monotone in p.
      const std::vector<double> probs = exact_probs(*cache, seq, 1, shape,
                                                    q.data() + size_t(h) * size_t(c.head_dim),
                                                    h / (c.n_q_heads / c.n_kv_heads), sc.n_ctx);
      double recall = 0;
      for (int32_t t : attended[size_t(h)]) recall += probs[size_t(t)];
      EXPECT_GE(recall, previous_recall[size_t(h)] - 1e-12) << "p " << p;
      previous_recall[size_t(h)] = recall;
    }
    EXPECT_GE(total_selected, previous_selected) << "p " << p;
    previous_selected = total_selected;
    if (p == 0.9) selected_at_09 = total_selected;
    if (p == 1.0) {
      // Every token attended: the dense result.
      EXPECT_EQ(total_selected, int64_t(c.n_q_heads) * n_indexed);
      std::vector<float> dense(n_out);
      decode_attention(*cache, seq, 1, shape, q.data(), sc.n_ctx, dense.data(), &pool);
      EXPECT_LT(testing::max_abs_diff(out, dense), 2e-5);
      for (double r : previous_recall) EXPECT_NEAR(r, 1.0, 1e-9);
    }
  }
  // The test data is peaked: at p = 0.9 the index keeps a minority of the indexed tokens.
  if (n_indexed >= 128) {
    EXPECT_LT(selected_at_09, int64_t(c.n_q_heads) * n_indexed / 2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ragged, SparseDecodeTest,
    ::testing::Values(SparseCase{{1, 1, 32, 1}, 3, 2}, SparseCase{{3, 1, 64, 16}, 17, 1},
                      SparseCase{{7, 1, 64, 3}, 129, 40}, SparseCase{{6, 2, 128, 16}, 501, 24},
                      SparseCase{{4, 4, 96, 17}, 3771, 200}, SparseCase{{2, 1, 256, 16}, 700, 0},
                      SparseCase{{9, 3, 64, 16}, 2048, 120}, SparseCase{{8, 2, 32, 3}, 301, 90}));

// The Top-p set widened by z deviations per token: the production path equals the reference, the
// set is the Top-p set plus exactly the tokens with fl(l + fl(m ||k_t - c_k||)) >= theta, it grows
// with z, and so does the recall.
TEST_P(SparseDecodeTest, WideningAddsTheTokensWithinZDeviationsOfTheThreshold) {
  const SparseCase sc = GetParam();
  const CaseShape& c = sc.shape;
  const int64_t n_indexed = sc.n_indexed_blocks * c.block_tokens;
  const SparseSetup setup = sparse_setup(sc, static_cast<uint32_t>(sc.n_ctx * 5 + c.head_dim));
  const auto& cache = setup.cache;
  const cache::SeqId seq = setup.seq;
  const std::vector<float>& q = setup.q;
  const auto& index = setup.index;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  const size_t n_out = size_t(c.n_q_heads) * size_t(c.head_dim);
  const int group = c.n_q_heads / c.n_kv_heads;
  std::vector<std::vector<int32_t>> previous;
  std::vector<double> previous_recall(size_t(c.n_q_heads), 0.0);
  int64_t widened_total = 0;
  for (double z : {0.0, 1.0, 2.0, 4.0}) {
    SCOPED_TRACE("z " + std::to_string(z));
    SparseDecodeOptions opt;
    opt.p = 0.8;
    opt.deviations = z;
    opt.rounding_seed = 5;
    std::vector<std::vector<int32_t>> attended, attended_ref;
    std::vector<std::vector<float>> logits;
    opt.attended = &attended;
    opt.estimated_logits = &logits;
    std::vector<float> out(n_out);
    std::vector<double> ref(n_out);
    std::vector<SparseHeadStats> stats(size_t(c.n_q_heads));
    sparse_decode_attention(*cache, seq, 1, shape, q.data(), sc.n_ctx, *index, opt, out.data(), stats.data(), &pool);
    opt.attended = nullptr;
    opt.estimated_logits = nullptr;
    sparse_decode_attention_ref(*cache, seq, 1, shape, q.data(), sc.n_ctx, *index, opt, ref.data(), &attended_ref);
    ASSERT_EQ(attended, attended_ref);
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5);
    for (int h = 0; h < c.n_q_heads; ++h) {
      const SparseHeadStats& st = stats[size_t(h)];
      const std::vector<float>& l = logits[size_t(h)];
      ASSERT_EQ(int64_t(l.size()), n_indexed);
      if (n_indexed == 0) {  // nothing to select or widen: the window alone
        std::vector<int32_t> window;
        for (int64_t t = 0; t < sc.n_ctx; ++t) window.push_back(int32_t(t));
        EXPECT_EQ(attended[size_t(h)], window);
        EXPECT_EQ(st.n_widened, 0);
        continue;
      }
      // The expected set from the definition: the Top-p set of the logits, then the margin test
      // with each operation rounded to float (volatile keeps the compiler from fusing them).
      std::vector<uint8_t> mask(static_cast<size_t>(n_indexed));
      const index::TopPSelection sel = index::top_p_select(l.data(), n_indexed, opt.p, mask.data());
      float norm_q = 0;
      std::vector<float> scratch(static_cast<size_t>(n_indexed));
      index->estimate_scores(1, h / group, q.data() + size_t(h) * size_t(c.head_dim),
                             sparse_head_rounding_seed(opt.rounding_seed, h), scratch.data(), &norm_q);
      const float m = index::rabitq_logit_deviation_scale(z, shape.scale, norm_q, c.head_dim);
      std::vector<int32_t> expected;
      int64_t added = 0;
      for (int64_t t = 0; t < n_indexed; ++t) {
        volatile float margin = m * index->key_norm_centered(1, h / group, t);
        volatile float reach = l[size_t(t)] + margin;
        const bool in_top_p = mask[size_t(t)] != 0;
        if (in_top_p || reach >= sel.threshold) expected.push_back(int32_t(t));
        added += !in_top_p && reach >= sel.threshold;
      }
      for (int64_t t = n_indexed; t < sc.n_ctx; ++t) expected.push_back(int32_t(t));
      EXPECT_EQ(attended[size_t(h)], expected) << "head " << h;
      EXPECT_EQ(st.n_widened, added) << "head " << h;
      EXPECT_EQ(st.n_selected, sel.n_selected + added) << "head " << h;
      EXPECT_EQ(st.n_attended, int64_t(attended[size_t(h)].size()));
      if (z == 0) {
        EXPECT_EQ(st.n_widened, 0);
      }
      widened_total += st.n_widened;
      // The set, and its recall, grow with z.
      if (!previous.empty()) {
        EXPECT_TRUE(std::includes(attended[size_t(h)].begin(), attended[size_t(h)].end(),
                                  previous[size_t(h)].begin(), previous[size_t(h)].end()))
            << "head " << h;
      }
      const std::vector<double> probs =
          exact_probs(*cache, seq, 1, shape, q.data() + size_t(h) * size_t(c.head_dim), h / group, sc.n_ctx);
      double recall = 0;
      for (int32_t t : attended[size_t(h)]) recall += probs[size_t(t)];
      EXPECT_GE(recall, previous_recall[size_t(h)] - 1e-12) << "head " << h;
      previous_recall[size_t(h)] = recall;
    }
    previous = attended;
  }
  // At 4 deviations the widening takes tokens whenever the Top-p set left some out. With one
  // query head per KV head the query is its own centroid (build_index), its estimate exact and
  // its sigma 0: nothing to widen.
  if (n_indexed >= 128 && group > 1) {
    EXPECT_GT(widened_total, 0);
  }
}

// Selected tokens read from fp8 pages and from dither8 pages (with the meter over what is
// attended): the production path equals the reference (which reads read_token_range_ref), and
// the meter bounds the true TV between attention over the attended set with exact and stored keys.
TEST(SparseDecode, EveryPageClassAndTheMeterOverTheAttendedSet) {
  const CaseShape c{6, 2, 64, 16};
  for (KvScheme scheme : {KvScheme::kFp8PagesE4M3, KvScheme::kRtn8, KvScheme::kDither8}) {
    std::mt19937 rng(5);
    const std::vector<float> dir = unit_direction(c.head_dim, rng);
    auto cache = make_cache(c, scheme, 1024);
    const cache::SeqId seq = cache->create_sequence();
    const int64_t n_ctx = 1000;
    append(*cache, seq, n_ctx, dir, rng);
    const std::vector<float> q = queries(c, dir, rng);
    auto index = build_index(*cache, seq, 52 * 16, q, c.n_q_heads);
    const AttentionShape shape = testing::attention_shape(c);
    ThreadPool pool(2);
    SparseDecodeOptions opt;
    opt.p = 0.9;
    std::vector<HeadMeter> meters(size_t(c.n_q_heads));
    opt.meters = meters.data();
    opt.meter.delta_loc = 1e-6;
    std::vector<std::vector<int32_t>> attended;
    opt.attended = &attended;
    const size_t n_out = size_t(c.n_q_heads) * size_t(c.head_dim);
    std::vector<float> out(n_out);
    std::vector<double> ref(n_out);
    sparse_decode_attention(*cache, seq, 0, shape, q.data(), n_ctx, *index, opt, out.data(),
                            nullptr, &pool);
    opt.attended = nullptr;
    opt.meters = nullptr;
    sparse_decode_attention_ref(*cache, seq, 0, shape, q.data(), n_ctx, *index, opt, ref.data());
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5) << cache::kv_scheme_name(scheme);
    const bool lossy = cache::kv_scheme_is_lossy(scheme);
    std::vector<float> k_exact(size_t(n_ctx) * 64), k_stored(size_t(n_ctx) * 64);
    for (int h = 0; h < c.n_q_heads; ++h) {
      const int kv_head = h / 3;
      cache->read_token_range_exact(seq, 0, KvTensor::kKey, kv_head, 0, n_ctx, k_exact.data());
      cache->read_token_range_ref(seq, 0, KvTensor::kKey, kv_head, 0, n_ctx, k_stored.data());
      const std::vector<int32_t>& set = attended[size_t(h)];
      auto softmax = [&](const std::vector<float>& k) {
        std::vector<double> s(set.size());
        double m = -INFINITY, sum = 0;
        for (size_t i = 0; i < set.size(); ++i) {
          double dot = 0;
          for (int ch = 0; ch < 64; ++ch)
            dot += double(q[size_t(h) * 64 + size_t(ch)]) * k[size_t(set[i]) * 64 + size_t(ch)];
          m = std::max(m, s[i] = double(shape.scale) * dot);
        }
        for (double& x : s) sum += (x = std::exp(x - m));
        for (double& x : s) x /= sum;
        return s;
      };
      const std::vector<double> p = softmax(k_exact), p_stored = softmax(k_stored);
      double tv = 0;
      for (size_t i = 0; i < set.size(); ++i) tv += 0.5 * std::fabs(p[i] - p_stored[i]);
      if (lossy) {
        EXPECT_GT(tv, 0.0);
        EXPECT_GE(meters[size_t(h)].meter, tv) << cache::kv_scheme_name(scheme) << " head " << h;
        EXPECT_LT(meters[size_t(h)].meter, 1.0);
      } else {
        EXPECT_EQ(meters[size_t(h)].meter, 0.0);
      }
    }
  }
}

TEST(SparseDecode, BadInput) {
  const CaseShape c{4, 2, 64, 16};
  std::mt19937 rng(9);
  const std::vector<float> dir = unit_direction(c.head_dim, rng);
  auto cache = make_cache(c, KvScheme::kBf16, 256);
  const cache::SeqId seq = cache->create_sequence();
  append(*cache, seq, 200, dir, rng);
  const std::vector<float> q = queries(c, dir, rng);
  auto index = build_index(*cache, seq, 64, q, c.n_q_heads);
  const AttentionShape shape = testing::attention_shape(c);
  std::vector<float> out(size_t(c.n_q_heads) * 64);
  SparseDecodeOptions opt;
  for (double p : {0.0, -0.1, 1.01, double(NAN)}) {
    opt.p = p;
    EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, q.data(), 200, *index, opt, out.data()), Error) << p;
  }
  opt.p = 0.9;
  for (double z : {-0.5, double(NAN), double(INFINITY)}) {
    opt.deviations = z;
    EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, q.data(), 200, *index, opt, out.data()), Error) << z;
  }
  opt.deviations = 0;
  // The indexed prefix beyond n_ctx.
  EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, q.data(), 40, *index, opt, out.data()), Error);
  // kv heads indexed to different lengths.
  std::vector<float> k(16 * 64);
  cache->read_token_range_exact(seq, 0, KvTensor::kKey, 0, 64, 80, k.data());
  index->append(0, 0, k.data(), 16);
  EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, q.data(), 200, *index, opt, out.data()), Error);
  // A prefix that is not whole blocks.
  cache->read_token_range_exact(seq, 0, KvTensor::kKey, 1, 64, 67, k.data());
  auto partial = build_index(*cache, seq, 64, q, c.n_q_heads);
  for (int h = 0; h < 2; ++h) partial->append(1, h, k.data(), 3);
  EXPECT_THROW(sparse_decode_attention(*cache, seq, 1, shape, q.data(), 200, *partial, opt, out.data()), Error);
  // An index of another shape.
  cache::KeyIndexConfig other;
  other.n_layers = 2;
  other.n_kv_heads = 1;
  other.head_dim = 64;
  cache::KeyIndex wrong(other);
  EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, q.data(), 200, wrong, opt, out.data()), Error);
  EXPECT_THROW(sparse_decode_attention(*cache, seq, 0, shape, nullptr, 200, *index, opt, out.data()), Error);
}

}  // namespace
}  // namespace certkv::attention
