#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace certkv::attention {
namespace {

using testing::CaseShape;

constexpr int kLayer = 1;

struct PrefillCase {
  CaseShape shape;
  const char* name;
};

void PrintTo(const PrefillCase& c, std::ostream* os) { *os << c.name; }

class PrefillRagged : public ::testing::TestWithParam<PrefillCase> {};

// Against the double reference for prompts from scratch and continuations after a prefix;
// with a thread pool the answer is bitwise the same.
TEST_P(PrefillRagged, MatchesReference) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 700);
  ThreadPool pool(2);
  std::mt19937 rng(77 + c.head_dim * 3 + c.block_tokens);
  struct Span {
    int64_t pos0, n;
  };
  for (const Span span : {Span{0, 1}, Span{0, 3}, Span{0, 17}, Span{0, 129}, Span{0, 501},
                          Span{37, 100}, Span{500, 1}, Span{129, 17}}) {
    SCOPED_TRACE("pos0 " + std::to_string(span.pos0) + " n " + std::to_string(span.n));
    const cache::SeqId seq = cache->create_sequence();
    testing::append_random(*cache, seq, span.pos0 + span.n, rng);
    const size_t row = size_t(c.n_q_heads) * size_t(c.head_dim);
    const std::vector<float> q = testing::uniform_values(size_t(span.n) * row, -2, 2, rng);
    std::vector<double> ref(q.size());
    prefill_attention_ref(*cache, seq, kLayer, shape, q.data(), span.pos0, span.n, ref.data());
    testing::expect_nondegenerate(ref, "reference output");
    std::vector<float> out(q.size()), out_pool(q.size());
    prefill_attention(*cache, seq, kLayer, shape, q.data(), span.pos0, span.n, out.data());
    prefill_attention(*cache, seq, kLayer, shape, q.data(), span.pos0, span.n, out_pool.data(), &pool);
    EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5);
    EXPECT_EQ(out, out_pool);
    cache->free_sequence(seq);
  }
}

// Row i of a prefill is, bit for bit, the single-split decode of query i over positions
// [0, pos0 + i] (both update the softmax once per page, in page order), and a prefill cut into
// ragged chunks gives the rows of the whole one.
TEST_P(PrefillRagged, RowsAreTheDecodeOfEachPrefixBitForBit) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 300);
  std::mt19937 rng(8);
  const int64_t pos0 = 45, n = 70;
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, pos0 + n, rng);
  const size_t row = size_t(c.n_q_heads) * size_t(c.head_dim);
  const std::vector<float> q = testing::uniform_values(size_t(n) * row, -2, 2, rng);
  std::vector<float> out(q.size()), chunked(q.size()), one(row);
  ThreadPool pool(2);
  prefill_attention(*cache, seq, kLayer, shape, q.data(), pos0, n, out.data(), &pool);
  testing::expect_nondegenerate(out, "prefill output");
  DecodeOptions single_split;
  single_split.n_splits = 1;
  for (int64_t i = 0; i < n; ++i) {
    decode_attention(*cache, seq, kLayer, shape, q.data() + size_t(i) * row, pos0 + i + 1, one.data(),
                     &pool, single_split);
    const std::vector<float> prefill_row(out.begin() + size_t(i) * row, out.begin() + size_t(i + 1) * row);
    ASSERT_EQ(prefill_row, one) << "query " << i;
  }
  for (int64_t i = 0; i < n;) {
    const int64_t len = std::min<int64_t>(n - i, 1 + (i * 7) % 23);  // ragged: 1, 8, 16, ...
    prefill_attention(*cache, seq, kLayer, shape, q.data() + size_t(i) * row, pos0 + i, len,
                      chunked.data() + size_t(i) * row);
    i += len;
  }
  EXPECT_EQ(chunked, out);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillRagged,
    ::testing::Values(PrefillCase{{2, 2, 8, 16}, "gqa1_d8_bt16"}, PrefillCase{{2, 2, 8, 7}, "gqa1_d8_bt7"},
                      PrefillCase{{9, 3, 64, 16}, "gqa3_d64_bt16"}, PrefillCase{{9, 3, 64, 7}, "gqa3_d64_bt7"},
                      PrefillCase{{7, 1, 128, 16}, "gqa7_d128_bt16"},
                      PrefillCase{{14, 2, 128, 7}, "gqa7_d128_bt7"}),
    [](const ::testing::TestParamInfo<PrefillCase>& info) { return std::string(info.param.name); });

TEST(PrefillAttention, LongPromptMatchesReference) {
  const CaseShape c{7, 1, 8, 7};
  const AttentionShape shape = testing::attention_shape(c);
  auto cache = testing::make_cache(c, 3771, 2);
  std::mt19937 rng(4);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 3771, rng);
  const std::vector<float> q = testing::uniform_values(size_t(3771) * 7 * 8, -2, 2, rng);
  std::vector<double> ref(q.size());
  std::vector<float> out(q.size());
  prefill_attention_ref(*cache, seq, kLayer, shape, q.data(), 0, 3771, ref.data());
  ThreadPool pool(2);
  prefill_attention(*cache, seq, kLayer, shape, q.data(), 0, 3771, out.data(), &pool);
  testing::expect_nondegenerate(ref, "reference output");
  EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5);
}

// Causality, exactly: key t has t in channel 0, so the best key a query of an even head can see
// is its own position, and every future key would score higher; odd heads negate channel 0 and
// pick position 0. A huge scale makes the softmax one-hot: the output is that token's value.
TEST(PrefillAttention, CausalMaskIsExact) {
  const CaseShape c{6, 2, 8, 7};
  const int d = 8;
  const int64_t pos0 = 37, n = 150, total = pos0 + n;  // positions below 256: exact in bf16
  std::mt19937 rng(12);
  std::vector<float> k = testing::integer_values(size_t(total) * 2 * d, -2, 2, rng);
  std::vector<float> v = testing::integer_values(size_t(total) * 2 * d, -60, 60, rng);
  for (float& e : v) e = e == 0.f ? 3.f : e;
  for (int64_t t = 0; t < total; ++t) {
    for (int h = 0; h < 2; ++h) k[(size_t(t) * 2 + size_t(h)) * d] = float(t);
  }
  std::vector<float> q(size_t(n) * 6 * d, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < 6; ++h) q[(size_t(i) * 6 + size_t(h)) * d] = h % 2 == 0 ? 1.f : -1.f;
  }
  testing::expect_nondegenerate(v, "v");
  auto cache = testing::make_cache(c, 200, 1);
  const cache::SeqId seq = cache->create_sequence();
  cache->reserve(seq, total);
  cache->write(seq, 0, k.data(), v.data(), total);
  cache->commit(seq, total);
  const AttentionShape shape{6, 2, d, 200.f};
  std::vector<float> out(q.size());
  std::vector<double> ref(q.size());
  ThreadPool pool(2);
  prefill_attention(*cache, seq, 0, shape, q.data(), pos0, n, out.data(), &pool);
  prefill_attention_ref(*cache, seq, 0, shape, q.data(), pos0, n, ref.data());
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < 6; ++h) {
      const int kv_head = h / 3;
      const int64_t winner = h % 2 == 0 ? pos0 + i : 0;
      for (int ch = 0; ch < d; ++ch) {
        const float want = v[(size_t(winner) * 2 + size_t(kv_head)) * d + size_t(ch)];
        const size_t at = (size_t(i) * 6 + size_t(h)) * d + size_t(ch);
        ASSERT_EQ(out[at], want) << "query " << i << " head " << h << " channel " << ch;
        ASSERT_EQ(ref[at], double(want)) << "query " << i << " head " << h << " channel " << ch;
      }
    }
  }
}

TEST(PrefillAttention, BadArgumentsAreErrors) {
  const CaseShape c{9, 3, 64, 16};
  auto cache = testing::make_cache(c, 100);
  std::mt19937 rng(1);
  const cache::SeqId seq = cache->create_sequence();
  testing::append_random(*cache, seq, 20, rng);
  std::vector<float> q(20 * 9 * 64, 1.f), out(q.size());
  std::vector<double> ref(q.size());
  const AttentionShape good{9, 3, 64, 0.125f};
  auto expect_code = [](StatusCode code, const char* needle, auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_code(StatusCode::kOutOfRange, "[15, 21)",
              [&] { prefill_attention(*cache, seq, 0, good, q.data(), 15, 6, out.data()); });
  expect_code(StatusCode::kOutOfRange, "[0, 0)",
              [&] { prefill_attention(*cache, seq, 0, good, q.data(), 0, 0, out.data()); });
  expect_code(StatusCode::kOutOfRange, "[-1, 3)",
              [&] { prefill_attention_ref(*cache, seq, 0, good, q.data(), -1, 4, ref.data()); });
  AttentionShape bad = good;
  bad.n_q_heads = 10;
  expect_code(StatusCode::kInvalidArgument, "not a multiple",
              [&] { prefill_attention(*cache, seq, 0, bad, q.data(), 0, 4, out.data()); });
  expect_code(StatusCode::kOutOfRange, "layer 5",
              [&] { prefill_attention(*cache, seq, 5, good, q.data(), 0, 4, out.data()); });
}

}  // namespace
}  // namespace certkv::attention
