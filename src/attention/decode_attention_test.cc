#include "attention/decode_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace certkv::attention {
namespace {

DecodeOptions splits(int n_splits) {
  DecodeOptions options;
  options.n_splits = n_splits;
  return options;
}

using cache::KvTensor;
using testing::CaseShape;

constexpr int kLayer = 1;  // the last of two layers, so layer offsets matter

// q: [1][d]; two tokens with scores 0 and 1: p = (1, e) / (1 + e).
TEST(DecodeAttention, KnownAnswerTwoTokens) {
  const CaseShape c{1, 1, 8, 16};
  auto cache = testing::make_cache(c, 16, 1);
  const cache::SeqId seq = cache->create_sequence();
  std::vector<float> k(2 * 8, 0.f), v(2 * 8, 0.f);
  k[8 + 0] = 1.f;  // k_1 = e_0
  v[0] = 1.f;      // v_0 = e_0
  v[8 + 1] = 2.f;  // v_1 = 2 e_1
  cache->reserve(seq, 2);
  cache->write(seq, 0, k.data(), v.data(), 2);
  cache->commit(seq, 2);
  std::vector<float> q(8, 0.f);
  q[0] = 1.f;
  const AttentionShape shape{1, 1, 8, 1.f};
  std::vector<float> out(8);
  std::vector<double> ref(8);
  decode_attention(*cache, seq, 0, shape, q.data(), 2, out.data());
  decode_attention_ref(*cache, seq, 0, shape, q.data(), 2, ref.data());
  const double p0 = 0.2689414213699951;  // 1 / (1 + e)
  const double p1 = 0.7310585786300049;  // e / (1 + e)
  EXPECT_NEAR(ref[0], p0, 1e-15);
  EXPECT_NEAR(ref[1], 2 * p1, 1e-15);
  EXPECT_NEAR(out[0], p0, 1e-6);
  EXPECT_NEAR(out[1], 2 * p1, 1e-6);
  for (int c2 = 2; c2 < 8; ++c2) EXPECT_EQ(out[size_t(c2)], 0.f);
}

struct RaggedCase {
  CaseShape shape;
  const char* name;
};

void PrintTo(const RaggedCase& c, std::ostream* os) { *os << c.name; }

class DecodeRagged : public ::testing::TestWithParam<RaggedCase> {};

// Float path against the double reference on ragged lengths, with and without a thread pool.
TEST_P(DecodeRagged, MatchesReference) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 3800);
  ThreadPool pool(2);
  std::mt19937 rng(1234 + c.head_dim + c.block_tokens);
  for (int64_t n : {1, 3, 17, 129, 501, 3771}) {
    SCOPED_TRACE("n_ctx " + std::to_string(n));
    const cache::SeqId seq = cache->create_sequence();
    testing::append_random(*cache, seq, n, rng);
    const std::vector<float> q = testing::uniform_values(size_t(c.n_q_heads) * c.head_dim, -2, 2, rng);
    testing::expect_nondegenerate(q, "q");
    std::vector<double> ref(q.size());
    decode_attention_ref(*cache, seq, kLayer, shape, q.data(), n, ref.data());
    testing::expect_nondegenerate(ref, "reference output");
    std::vector<float> out(q.size()), out_pool(q.size());
    decode_attention(*cache, seq, kLayer, shape, q.data(), n, out.data());
    decode_attention(*cache, seq, kLayer, shape, q.data(), n, out_pool.data(), &pool);
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5);
    EXPECT_LT(testing::max_abs_diff(out_pool, ref), 2e-5);
    if (n > 1) {
      // Attention over a shorter prefix is a different answer: the comparison can fail.
      std::vector<double> ref_short(q.size());
      decode_attention_ref(*cache, seq, kLayer, shape, q.data(), n - 1, ref_short.data());
      EXPECT_GT(testing::max_abs_diff(out, ref_short), 1e-4);
      decode_attention(*cache, seq, kLayer, shape, q.data(), n - 1, out.data(), &pool);
      EXPECT_LT(testing::max_abs_diff(out, ref_short), 2e-5);
    }
    cache->free_sequence(seq);
  }
}

// Sharp softmax: logits spread over hundreds, so the running max moves between pages and
// most weights underflow.
TEST_P(DecodeRagged, MatchesReferenceWithLargeLogits) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c, 24.f);
  auto cache = testing::make_cache(c, 600);
  std::mt19937 rng(99);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 501, rng);
  const std::vector<float> q = testing::uniform_values(size_t(c.n_q_heads) * c.head_dim, -2, 2, rng);
  std::vector<double> ref(q.size());
  decode_attention_ref(*cache, seq, kLayer, shape, q.data(), 501, ref.data());
  testing::expect_nondegenerate(ref, "reference output");
  for (int n_splits : {1, 4}) {
    std::vector<float> out(q.size());
    decode_attention(*cache, seq, kLayer, shape, q.data(), 501, out.data(), nullptr, splits(n_splits));
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5) << n_splits << " splits";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeRagged,
    ::testing::Values(RaggedCase{{2, 2, 8, 16}, "gqa1_d8_bt16"}, RaggedCase{{2, 2, 8, 7}, "gqa1_d8_bt7"},
                      RaggedCase{{9, 3, 64, 16}, "gqa3_d64_bt16"}, RaggedCase{{9, 3, 64, 7}, "gqa3_d64_bt7"},
                      RaggedCase{{7, 1, 128, 16}, "gqa7_d128_bt16"},
                      RaggedCase{{14, 2, 128, 7}, "gqa7_d128_bt7"},
                      RaggedCase{{4, 4, 256, 16}, "gqa1_d256_bt16"}),
    [](const ::testing::TestParamInfo<RaggedCase>& info) { return std::string(info.param.name); });

// Integer q and k with a huge scale: each query head's softmax is one-hot on its best key, so
// both paths must return that token's value exactly. The winner is found here with integer
// arithmetic and the GQA mapping kv_head = h / (n_q_heads / n_kv_heads) written independently.
TEST(DecodeAttention, IntegerInputsGiveExactAnswers) {
  for (const CaseShape c : {CaseShape{3, 1, 8, 7}, CaseShape{14, 2, 64, 16}, CaseShape{6, 6, 8, 7}}) {
    SCOPED_TRACE("n_q_heads " + std::to_string(c.n_q_heads) + " n_kv_heads " + std::to_string(c.n_kv_heads));
    const int64_t n = 129;
    const int d = c.head_dim;
    const int group = c.n_q_heads / c.n_kv_heads;
    std::mt19937 rng(7);
    std::vector<float> k, v, q;
    std::vector<int64_t> winner(size_t(c.n_q_heads));
    // Redraw until every head has a unique best key (integer scores: a gap of at least 1).
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 100) << "could not draw data with unique winners";
      k = testing::integer_values(size_t(n) * c.n_kv_heads * d, -3, 3, rng);
      v = testing::integer_values(size_t(n) * c.n_kv_heads * d, -100, 100, rng);
      // Nonzero values: the reference adds e^-200-sized terms, invisible only next to a nonzero.
      for (float& e : v) e = e == 0.f ? 1.f : e;
      q = testing::integer_values(size_t(c.n_q_heads) * d, -3, 3, rng);
      bool unique = true;
      for (int h = 0; h < c.n_q_heads; ++h) {
        const int kv_head = h / group;
        int64_t best = -1, best_score = INT64_MIN, n_best = 0;
        for (int64_t t = 0; t < n; ++t) {
          int64_t score = 0;
          for (int ch = 0; ch < d; ++ch) {
            score += int64_t(q[size_t(h) * d + ch]) * int64_t(k[(size_t(t) * c.n_kv_heads + kv_head) * d + ch]);
          }
          if (score > best_score) {
            best_score = score;
            best = t;
            n_best = 1;
          } else if (score == best_score) {
            ++n_best;
          }
        }
        winner[size_t(h)] = best;
        unique = unique && n_best == 1;
      }
      if (unique) break;
    }
    testing::expect_nondegenerate(k, "k");
    testing::expect_nondegenerate(v, "v");
    testing::expect_nondegenerate(q, "q");
    auto cache = testing::make_cache(c, 200, 1);
    const cache::SeqId seq = cache->create_sequence();
    cache->reserve(seq, n);
    cache->write(seq, 0, k.data(), v.data(), n);
    cache->commit(seq, n);
    const AttentionShape shape{c.n_q_heads, c.n_kv_heads, d, 200.f};
    std::vector<double> ref(q.size());
    decode_attention_ref(*cache, seq, 0, shape, q.data(), n, ref.data());
    ThreadPool pool(2);
    for (int n_splits : {1, 3, 19}) {
      std::vector<float> out(q.size());
      decode_attention(*cache, seq, 0, shape, q.data(), n, out.data(), &pool, splits(n_splits));
      for (int h = 0; h < c.n_q_heads; ++h) {
        const size_t src = (size_t(winner[size_t(h)]) * c.n_kv_heads + size_t(h / group)) * d;
        for (int ch = 0; ch < d; ++ch) {
          ASSERT_EQ(out[size_t(h) * d + ch], v[src + ch]) << "head " << h << " channel " << ch;
          ASSERT_EQ(ref[size_t(h) * d + ch], double(v[src + ch])) << "head " << h << " channel " << ch;
        }
      }
    }
  }
}

// Two tied best keys in different splits: the merged output is exactly the mean of their values.
TEST(DecodeAttention, TiedWinnersInDifferentSplitsMergeExactly) {
  const CaseShape c{1, 1, 8, 7};
  const int64_t n = 100;
  std::mt19937 rng(11);
  std::vector<float> k = testing::integer_values(size_t(n) * 8, -2, 2, rng);
  std::vector<float> v = testing::integer_values(size_t(n) * 8, -50, 50, rng);
  const std::vector<float> q = {1, 1, 1, 1, 1, 1, 1, 1};
  for (int ch = 0; ch < 8; ++ch) {
    k[size_t(5) * 8 + ch] = 3.f;   // block 0
    k[size_t(93) * 8 + ch] = 3.f;  // block 13
    v[size_t(5) * 8 + ch] = float(2 * ch + 10);
    v[size_t(93) * 8 + ch] = float(-4 * ch);
  }
  auto cache = testing::make_cache(c, 112, 1);
  const cache::SeqId seq = cache->create_sequence();
  cache->reserve(seq, n);
  cache->write(seq, 0, k.data(), v.data(), n);
  cache->commit(seq, n);
  const AttentionShape shape{1, 1, 8, 100.f};
  for (int n_splits : {1, 2, 7, 15}) {
    std::vector<float> out(8);
    decode_attention(*cache, seq, 0, shape, q.data(), n, out.data(), nullptr, splits(n_splits));
    for (int ch = 0; ch < 8; ++ch) {
      EXPECT_EQ(out[size_t(ch)], float(2 * ch + 10 - 4 * ch) / 2) << n_splits << " splits, channel " << ch;
    }
  }
}

TEST(DecodeAttention, SplitsMatchASinglePass) {
  const CaseShape c{9, 3, 64, 16};
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 3800);
  std::mt19937 rng(5);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 3771, rng);
  const std::vector<float> q = testing::uniform_values(9 * 64, -2, 2, rng);
  std::vector<float> single(q.size());
  decode_attention(*cache, seq, kLayer, shape, q.data(), 3771, single.data(), nullptr, splits(1));
  testing::expect_nondegenerate(single, "single-pass output");
  ThreadPool pool(2);
  for (int n_splits : {2, 3, 8, 64, 236, 1000}) {
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      std::vector<float> split(q.size());
      decode_attention(*cache, seq, kLayer, shape, q.data(), 3771, split.data(), p, splits(n_splits));
      EXPECT_LT(testing::max_abs_diff(split, single), 1e-5) << n_splits << " splits";
    }
  }
  // The same split count gives bitwise the same answer with or without threads.
  std::vector<float> a(q.size()), b(q.size());
  decode_attention(*cache, seq, kLayer, shape, q.data(), 3771, a.data(), nullptr, splits(6));
  decode_attention(*cache, seq, kLayer, shape, q.data(), 3771, b.data(), &pool, splits(6));
  EXPECT_EQ(a, b);
}

TEST(DecodeAttention, ChoosesSplitsFromThreadsAndLength) {
  EXPECT_EQ(choose_decode_splits(32768, 16, 3, 1), 1);
  EXPECT_EQ(choose_decode_splits(100, 16, 3, 2), 1);
  EXPECT_EQ(choose_decode_splits(32768, 16, 3, 2), 3);
  EXPECT_EQ(choose_decode_splits(32768, 16, 32, 8), 1);
  EXPECT_EQ(choose_decode_splits(300, 16, 1, 8), 2);
}

// During a step, attention reads the step's written but uncommitted tokens.
TEST(DecodeAttention, ReadsTheUncommittedTokensOfTheStep) {
  const CaseShape c{9, 3, 64, 16};
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 200);
  std::mt19937 rng(21);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 30, rng);
  cache->reserve(seq, 5);
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float> k = testing::uniform_values(5 * 3 * 64, -2, 2, rng);
    const std::vector<float> v = testing::uniform_values(5 * 3 * 64, -2, 2, rng);
    cache->write(seq, layer, k.data(), v.data(), 5);
  }
  const std::vector<float> q = testing::uniform_values(9 * 64, -2, 2, rng);
  std::vector<double> ref(q.size());
  std::vector<float> out(q.size());
  decode_attention_ref(*cache, seq, kLayer, shape, q.data(), 35, ref.data());
  decode_attention(*cache, seq, kLayer, shape, q.data(), 35, out.data());
  EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5);
  EXPECT_THROW(decode_attention(*cache, seq, kLayer, shape, q.data(), 36, out.data()), Error);
}

// A fork reads the parent's pages: same answer, bitwise, before and after it appends.
TEST(DecodeAttention, ForkedSequenceReadsSharedPages) {
  const CaseShape c{9, 3, 64, 16};
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 1200);
  std::mt19937 rng(3);
  const cache::SeqId parent = cache->create_sequence();
  testing::append_random(*cache, parent, 501, rng);
  const cache::SeqId child = cache->fork_sequence(parent);
  EXPECT_EQ(cache->block_table(child, kLayer, KvTensor::kKey, 2)[3].page,
            cache->block_table(parent, kLayer, KvTensor::kKey, 2)[3].page);
  const std::vector<float> q = testing::uniform_values(9 * 64, -2, 2, rng);
  std::vector<float> from_parent(q.size()), from_child(q.size());
  decode_attention(*cache, parent, kLayer, shape, q.data(), 501, from_parent.data());
  decode_attention(*cache, child, kLayer, shape, q.data(), 501, from_child.data());
  testing::expect_nondegenerate(from_parent, "parent output");
  EXPECT_EQ(from_parent, from_child);
  testing::append_random(*cache, child, 20, rng);
  decode_attention(*cache, child, kLayer, shape, q.data(), 501, from_child.data());
  EXPECT_EQ(from_parent, from_child);
  std::vector<float> again(q.size());
  decode_attention(*cache, parent, kLayer, shape, q.data(), 501, again.data());
  EXPECT_EQ(from_parent, again);
  std::vector<double> ref(q.size());
  decode_attention_ref(*cache, child, kLayer, shape, q.data(), 521, ref.data());
  decode_attention(*cache, child, kLayer, shape, q.data(), 521, from_child.data());
  EXPECT_LT(testing::max_abs_diff(from_child, ref), 2e-5);
  cache->free_sequence(parent);
  decode_attention(*cache, child, kLayer, shape, q.data(), 501, from_child.data());
  EXPECT_EQ(from_parent, from_child);
}

TEST(DecodeAttention, BadArgumentsAreErrors) {
  const CaseShape c{9, 3, 64, 16};
  auto cache = testing::make_cache(c, 100);
  std::mt19937 rng(1);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 20, rng);
  std::vector<float> q(9 * 64, 1.f), out(9 * 64);
  std::vector<double> ref(9 * 64);
  auto expect_code = [](StatusCode code, const char* needle, auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const AttentionShape good{9, 3, 64, 0.125f};
  AttentionShape bad = good;
  bad.n_q_heads = 8;
  expect_code(StatusCode::kInvalidArgument, "not a multiple of n_kv_heads",
              [&] { decode_attention(*cache, seq, 0, bad, q.data(), 20, out.data()); });
  bad = good;
  bad.head_dim = 60;
  expect_code(StatusCode::kUnsupported, "head_dim 60",
              [&] { decode_attention(*cache, seq, 0, bad, q.data(), 20, out.data()); });
  bad.head_dim = 264;
  expect_code(StatusCode::kUnsupported, "head_dim 264",
              [&] { decode_attention_ref(*cache, seq, 0, bad, q.data(), 20, ref.data()); });
  bad = good;
  bad.head_dim = 128;
  expect_code(StatusCode::kInvalidArgument, "does not match the kv cache",
              [&] { decode_attention(*cache, seq, 0, bad, q.data(), 20, out.data()); });
  bad = good;
  bad.n_kv_heads = 1;
  expect_code(StatusCode::kInvalidArgument, "does not match the kv cache",
              [&] { decode_attention(*cache, seq, 0, bad, q.data(), 20, out.data()); });
  bad = good;
  bad.scale = NAN;
  expect_code(StatusCode::kInvalidArgument, "scale",
              [&] { decode_attention(*cache, seq, 0, bad, q.data(), 20, out.data()); });
  expect_code(StatusCode::kOutOfRange, "layer 2",
              [&] { decode_attention(*cache, seq, 2, good, q.data(), 20, out.data()); });
  expect_code(StatusCode::kOutOfRange, "n_ctx 21",
              [&] { decode_attention(*cache, seq, 0, good, q.data(), 21, out.data()); });
  expect_code(StatusCode::kOutOfRange, "n_ctx 0",
              [&] { decode_attention(*cache, seq, 0, good, q.data(), 0, out.data()); });
  expect_code(StatusCode::kOutOfRange, "n_ctx 21",
              [&] { decode_attention_ref(*cache, seq, 0, good, q.data(), 21, ref.data()); });
  expect_code(StatusCode::kNotFound, "sequence 77",
              [&] { decode_attention(*cache, 77, 0, good, q.data(), 20, out.data()); });
  expect_code(StatusCode::kInvalidArgument, "null",
              [&] { decode_attention(*cache, seq, 0, good, nullptr, 20, out.data()); });
}

}  // namespace
}  // namespace certkv::attention
