#include "eval/quality.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::eval {
namespace {

// KL(softmax(r) || softmax(t)) in long double, straight from the definition (no max shift), for
// logits small enough that exp does not overflow.
double kl_by_definition(const std::vector<float>& r, const std::vector<float>& t) {
  long double zr = 0, zt = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    zr += std::exp(static_cast<long double>(r[i]));
    zt += std::exp(static_cast<long double>(t[i]));
  }
  long double kl = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const long double p = std::exp(static_cast<long double>(r[i])) / zr;
    const long double q = std::exp(static_cast<long double>(t[i])) / zt;
    kl += p * std::log(p / q);
  }
  return double(kl);
}

void expect_invalid(const std::vector<float>& ref, const std::vector<float>& test, const std::string& names) {
  try {
    compare_logits(ref.data(), test.data(), int(ref.size()));
    ADD_FAILURE() << "accepted logits, expected an error naming " << names;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
  }
}

TEST(CompareLogits, IdenticalLogitsGiveZeroKlAndFullAgreement) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.f, 4.f);
  for (int n_vocab : {1, 3, 5, 16, 17, 129, 501, 49152}) {
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    for (float& x : logits) x = normal(rng);
    const PositionQuality q = compare_logits(logits.data(), logits.data(), n_vocab);
    EXPECT_EQ(q.kl, 0.0) << n_vocab;
    EXPECT_TRUE(q.top1_agree) << n_vocab;
    EXPECT_EQ(q.top5_overlap, 1.0) << n_vocab;
  }
}

TEST(CompareLogits, TwoClassKnownValue) {
  // p = (1/2, 1/2), q = (e, 1) / (1 + e): KL = log((1 + e) / 2) - 1/2.
  const std::vector<float> ref = {0.f, 0.f};
  const std::vector<float> test = {1.f, 0.f};
  const PositionQuality q = compare_logits(ref.data(), test.data(), 2);
  EXPECT_NEAR(q.kl, std::log((1.0 + std::exp(1.0)) / 2.0) - 0.5, 1e-15);
  EXPECT_TRUE(q.top1_agree);  // tie in ref goes to index 0, which is test's argmax too
  EXPECT_EQ(q.top5_overlap, 1.0);

  // p = (e^2, 1) / (1 + e^2), q uniform: KL = log 2 - H(p). Swapping the roles changes the value:
  // KL is not symmetric, and the reference distribution is the first argument.
  const double p0 = std::exp(2.0) / (1.0 + std::exp(2.0));
  const double entropy = -(p0 * std::log(p0) + (1 - p0) * std::log(1 - p0));
  const std::vector<float> peaked = {2.f, 0.f};
  const PositionQuality forward = compare_logits(peaked.data(), ref.data(), 2);
  const PositionQuality backward = compare_logits(ref.data(), peaked.data(), 2);
  EXPECT_NEAR(forward.kl, std::log(2.0) - entropy, 1e-15);
  EXPECT_NEAR(backward.kl, 0.5 * std::log(0.5 / p0) + 0.5 * std::log(0.5 / (1 - p0)), 1e-15);
  EXPECT_GT(std::abs(forward.kl - backward.kl), 1e-3);
}

TEST(CompareLogits, ShiftedLogitsAreTheSameDistribution) {
  // Integer logits plus an integer shift are exact in float.
  const std::vector<float> ref = {3.f, -1.f, 0.f, 7.f, 2.f, 2.f, -4.f};
  std::vector<float> test = ref;
  for (float& x : test) x += 64.f;
  const PositionQuality q = compare_logits(ref.data(), test.data(), int(ref.size()));
  EXPECT_GE(q.kl, 0.0);
  EXPECT_LT(q.kl, 1e-14);
  EXPECT_TRUE(q.top1_agree);
  EXPECT_EQ(q.top5_overlap, 1.0);

  // A shift of 0.37 that float rounds differently per element: the true KL is ~1e-15, and the
  // double sum lands below zero; the result is clamped to 0, never negative.
  const std::vector<float> r3 = {1.f, -3.f, -1.f};
  const std::vector<float> t3 = {1.37f, -2.63f, -0.63f};
  const PositionQuality q3 = compare_logits(r3.data(), t3.data(), 3);
  EXPECT_GE(q3.kl, 0.0);
  EXPECT_NEAR(q3.kl, kl_by_definition(r3, t3), 1e-14);
}

TEST(CompareLogits, PermutedLogits) {
  // Ranks by logit: index 0 > 1 > ... > 7.
  const std::vector<float> ref = {8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f, 1.f};

  // Swap the first two: top-1 changes, the top-5 set does not.
  std::vector<float> swap_top = ref;
  std::swap(swap_top[0], swap_top[1]);
  PositionQuality q = compare_logits(ref.data(), swap_top.data(), 8);
  EXPECT_FALSE(q.top1_agree);
  EXPECT_EQ(q.top5_overlap, 1.0);
  EXPECT_NEAR(q.kl, kl_by_definition(ref, swap_top), 1e-12);
  EXPECT_GT(q.kl, 0.0);

  // Swap the 5th and 6th: top-1 agrees, one of five differs.
  std::vector<float> swap_edge = ref;
  std::swap(swap_edge[4], swap_edge[5]);
  q = compare_logits(ref.data(), swap_edge.data(), 8);
  EXPECT_TRUE(q.top1_agree);
  EXPECT_DOUBLE_EQ(q.top5_overlap, 0.8);
  EXPECT_NEAR(q.kl, kl_by_definition(ref, swap_edge), 1e-12);

  // Reverse: top-5 of the reverse is {7, 6, 5, 4, 3}, sharing {3, 4} with {0, 1, 2, 3, 4}.
  std::vector<float> reversed(ref.rbegin(), ref.rend());
  q = compare_logits(ref.data(), reversed.data(), 8);
  EXPECT_FALSE(q.top1_agree);
  EXPECT_DOUBLE_EQ(q.top5_overlap, 0.4);
  EXPECT_NEAR(q.kl, kl_by_definition(ref, reversed), 1e-12);
}

TEST(CompareLogits, TiesGoToTheLowestIndex) {
  // argmax(ref) = 1 (tie with 2); argmax(test) = 1 (tie with 3).
  const std::vector<float> ref = {1.f, 3.f, 3.f, 0.f};
  const std::vector<float> test = {1.f, 3.f, 2.f, 3.f};
  EXPECT_TRUE(compare_logits(ref.data(), test.data(), 4).top1_agree);
  // argmax(test2) = 2 (tie with 3), not 1.
  const std::vector<float> test2 = {1.f, 2.f, 3.f, 3.f};
  EXPECT_FALSE(compare_logits(ref.data(), test2.data(), 4).top1_agree);

  // Six equal logits: the top 5 are indices 0..4 in both, whatever else differs.
  const std::vector<float> flat = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  const std::vector<float> flat_then_low = {1.f, 1.f, 1.f, 1.f, 1.f, 0.f};
  EXPECT_EQ(compare_logits(flat.data(), flat_then_low.data(), 6).top5_overlap, 1.0);
  const std::vector<float> low_first = {0.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  EXPECT_DOUBLE_EQ(compare_logits(flat.data(), low_first.data(), 6).top5_overlap, 0.8);
}

TEST(CompareLogits, SmallVocabularies) {
  const float one_ref = -3.f, one_test = 40.f;
  const PositionQuality one = compare_logits(&one_ref, &one_test, 1);
  EXPECT_EQ(one.kl, 0.0);
  EXPECT_TRUE(one.top1_agree);
  EXPECT_EQ(one.top5_overlap, 1.0);

  // Three tokens: the top-k sets hold all of them, so any order overlaps fully.
  const std::vector<float> ref = {0.f, 1.f, 2.f};
  const std::vector<float> test = {2.f, 1.f, 0.f};
  const PositionQuality three = compare_logits(ref.data(), test.data(), 3);
  EXPECT_FALSE(three.top1_agree);
  EXPECT_EQ(three.top5_overlap, 1.0);
  EXPECT_NEAR(three.kl, kl_by_definition(ref, test), 1e-12);
}

TEST(CompareLogits, LargeLogitsStayFinite) {
  // p ~ (1, 0), q ~ (e^-1000, 1): KL ~ 1000; exp(1000) would overflow without the max shift.
  const std::vector<float> ref = {1000.f, 0.f};
  const std::vector<float> test = {0.f, 1000.f};
  const PositionQuality q = compare_logits(ref.data(), test.data(), 2);
  EXPECT_NEAR(q.kl, 1000.0, 1e-9);
  EXPECT_FALSE(q.top1_agree);

  const std::vector<float> huge = {3e38f, -3e38f, 0.f};
  const PositionQuality h = compare_logits(huge.data(), huge.data(), 3);
  EXPECT_EQ(h.kl, 0.0);
}

TEST(CompareLogits, RandomPairsMatchTheDefinition) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int n_vocab : {2, 3, 17, 129, 501, 3771}) {
    for (int trial = 0; trial < 8; ++trial) {
      std::vector<float> ref(static_cast<size_t>(n_vocab)), test(static_cast<size_t>(n_vocab));
      for (int i = 0; i < n_vocab; ++i) {
        ref[size_t(i)] = normal(rng);
        test[size_t(i)] = ref[size_t(i)] + 0.05f * float(trial) * normal(rng);
      }
      const PositionQuality q = compare_logits(ref.data(), test.data(), n_vocab);
      const double expected = kl_by_definition(ref, test);
      EXPECT_GE(q.kl, 0.0);
      EXPECT_NEAR(q.kl, expected, 1e-12 + 1e-9 * expected) << n_vocab << " trial " << trial;
    }
  }
}

TEST(CompareLogits, RejectsBadInput) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> good = {0.f, 1.f, 2.f};
  expect_invalid({0.f, nan, 2.f}, good, "ref logit 1");
  expect_invalid(good, {0.f, 1.f, inf}, "test logit 2");
  expect_invalid({-inf, 1.f, 2.f}, good, "ref logit 0");
  expect_invalid(good, {nan, nan, nan}, "test logit 0");
  try {
    compare_logits(good.data(), good.data(), 0);
    ADD_FAILURE() << "accepted n_vocab 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("n_vocab"), std::string::npos) << e.what();
  }
  EXPECT_THROW(compare_logits(nullptr, good.data(), 3), Error);
  EXPECT_THROW(compare_logits(good.data(), nullptr, 3), Error);
}

TEST(SortedQuantile, InterpolatesBetweenOrderStatistics) {
  std::vector<double> x(100);
  for (int i = 0; i < 100; ++i) x[size_t(i)] = i;
  EXPECT_EQ(sorted_quantile(x, 0.0), 0.0);
  EXPECT_EQ(sorted_quantile(x, 1.0), 99.0);
  EXPECT_DOUBLE_EQ(sorted_quantile(x, 0.5), 49.5);
  EXPECT_DOUBLE_EQ(sorted_quantile(x, 0.99), 98.01);
  EXPECT_EQ(sorted_quantile({4.0}, 0.3), 4.0);
  EXPECT_DOUBLE_EQ(sorted_quantile({1.0, 3.0}, 0.25), 1.5);
  EXPECT_THROW(sorted_quantile({}, 0.5), Error);
  EXPECT_THROW(sorted_quantile(x, 1.5), Error);
  EXPECT_THROW(sorted_quantile(x, std::nan("")), Error);
}

TEST(QualityAccumulator, SummaryOfKnownPositions) {
  QualityAccumulator acc;
  EXPECT_EQ(acc.summary().n_positions, 0);
  EXPECT_EQ(acc.summary().mean_kl, 0.0);
  // KL 99, 98, ..., 0 (added in decreasing order); top-1 agrees on every third position; the
  // overlap cycles through 0.2, 0.4, 0.6, 0.8.
  int agree = 0;
  double overlap_sum = 0;
  for (int i = 0; i < 100; ++i) {
    PositionQuality q;
    q.kl = 99 - i;
    q.top1_agree = i % 3 == 0;
    q.top5_overlap = 0.2 * (1 + i % 4);
    agree += q.top1_agree;
    overlap_sum += q.top5_overlap;
    acc.add(q);
  }
  const QualitySummary s = acc.summary();
  EXPECT_EQ(s.n_positions, 100);
  EXPECT_DOUBLE_EQ(s.mean_kl, 49.5);
  EXPECT_EQ(s.max_kl, 99.0);
  EXPECT_DOUBLE_EQ(s.p99_kl, 98.01);
  EXPECT_DOUBLE_EQ(s.top1, agree / 100.0);
  EXPECT_DOUBLE_EQ(s.top5, overlap_sum / 100.0);
  ASSERT_EQ(acc.positions().size(), 100u);
  EXPECT_EQ(acc.positions().front().kl, 99.0);
  EXPECT_EQ(acc.positions().back().kl, 0.0);
}

TEST(QualityAccumulator, AcceptsComparedLogits) {
  const std::vector<float> ref = {0.f, 0.f};
  const std::vector<float> test = {1.f, 0.f};
  QualityAccumulator acc;
  acc.add(compare_logits(ref.data(), ref.data(), 2));
  acc.add(compare_logits(ref.data(), test.data(), 2));
  const QualitySummary s = acc.summary();
  const double kl = std::log((1.0 + std::exp(1.0)) / 2.0) - 0.5;
  EXPECT_NEAR(s.mean_kl, kl / 2, 1e-15);
  EXPECT_NEAR(s.max_kl, kl, 1e-15);
  EXPECT_EQ(s.top1, 1.0);
}

TEST(QualityAccumulator, RejectsImpossibleValues) {
  QualityAccumulator acc;
  PositionQuality q;
  q.kl = -0.5;
  EXPECT_THROW(acc.add(q), Error);
  q.kl = std::nan("");
  EXPECT_THROW(acc.add(q), Error);
  q.kl = std::numeric_limits<double>::infinity();
  EXPECT_THROW(acc.add(q), Error);
  q.kl = 0.1;
  q.top5_overlap = 1.2;
  EXPECT_THROW(acc.add(q), Error);
  EXPECT_EQ(acc.summary().n_positions, 0);
}

}  // namespace
}  // namespace certkv::eval
