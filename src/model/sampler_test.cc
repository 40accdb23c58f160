// model::sample_uniform and model::sample_token against their definition (model/sampler.h):
// hand-computed draws, the cuts, ties, the two zeros and NaN, the distribution of a seeded
// stream, and bad parameters.
#include "model/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "core/status.h"

namespace certkv::model {
namespace {

SamplerParams with(float temperature, int top_k = 0, float top_p = 1.f) {
  SamplerParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  return p;
}

TEST(Sampler, UniformsAreDeterministicDistinctAndInsideTheUnitInterval) {
  std::set<double> seen;
  double sum = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = sample_uniform(42, uint64_t(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ASSERT_EQ(u, std::ldexp(std::floor(std::ldexp(u, 53)), -53));  // a multiple of 2^-53
    seen.insert(u);
    sum += u;
  }
  EXPECT_EQ(seen.size(), size_t(n));
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  EXPECT_EQ(sample_uniform(42, 7), sample_uniform(42, 7));
  EXPECT_NE(sample_uniform(42, 7), sample_uniform(43, 7));
  EXPECT_NE(sample_uniform(42, 7), sample_uniform(42, 8));
}

// logits ln 1, ln 2, ln 3 at temperature 1: sorted ids 2, 1, 0 with weights 1, 2/3, 1/3 (mass 2).
TEST(Sampler, DrawsByTheCumulativeWeightsOfTheSortedCandidates) {
  const float logits[3] = {0.f, std::log(2.f), std::log(3.f)};
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 0.0), 2);
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 0.49), 2);   // r = 0.98 < 1
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 0.51), 1);   // r = 1.02
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 0.82), 1);   // r = 1.64 < 5/3
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 0.84), 0);   // r = 1.68
  EXPECT_EQ(sample_token(logits, 3, with(1.f), 1.0 - 0x1.0p-53), 0);
  // top-k 2 keeps ids 2 and 1 (mass 5/3): u = 0.59 gives r = 0.983, u = 0.61 gives 1.017.
  EXPECT_EQ(sample_token(logits, 3, with(1.f, 2), 0.59), 2);
  EXPECT_EQ(sample_token(logits, 3, with(1.f, 2), 0.61), 1);
  EXPECT_EQ(sample_token(logits, 3, with(1.f, 2), 0.999), 1);
  // top-p 0.5 keeps id 2 alone (mass 1/2 reaches 0.5); 0.6 keeps 2 and 1.
  EXPECT_EQ(sample_token(logits, 3, with(1.f, 0, 0.5f), 0.999), 2);
  EXPECT_EQ(sample_token(logits, 3, with(1.f, 0, 0.6f), 0.999), 1);
  // Greedy ignores the uniform.
  EXPECT_EQ(sample_token(logits, 3, with(0.f), 0.999), 2);
}

TEST(Sampler, EqualKeysTakeTheLowerIdFirstAndTheZerosAreOneKey) {
  const float ties[4] = {1.f, 5.f, 5.f, 5.f};  // ids 1, 2, 3 equal: thirds of about 1/3 each
  EXPECT_EQ(sample_token(ties, 4, with(1.f), 0.1), 1);
  EXPECT_EQ(sample_token(ties, 4, with(1.f), 0.5), 2);
  EXPECT_EQ(sample_token(ties, 4, with(1.f), 0.9), 3);
  EXPECT_EQ(sample_token(ties, 4, with(1.f, 1), 0.9), 1);  // top-k 1: the lowest id of the maxima
  EXPECT_EQ(sample_key(-0.f, 1.f), 0.f);
  EXPECT_FALSE(std::signbit(sample_key(-0.f, 1.f)));
  const float zeros[3] = {-0.f, -9.f, 0.f};  // ids 0 and 2 share a key: id 0 first
  EXPECT_EQ(sample_token(zeros, 3, with(1.f), 0.2), 0);
  EXPECT_EQ(sample_token(zeros, 3, with(1.f), 0.8), 2);
}

TEST(Sampler, NanLogitsAreNeverDrawn) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float logits[5] = {nan, 1.f, nan, 2.f, nan};
  EXPECT_EQ(sample_key(nan, 1.f), -std::numeric_limits<float>::infinity());
  for (int i = 0; i < 200; ++i) {
    const int32_t t = sample_token(logits, 5, with(1.5f), sample_uniform(3, uint64_t(i)));
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  // Past the last boundary (u at its largest): the last candidate of positive weight, not a NaN.
  EXPECT_EQ(sample_token(logits, 5, with(1.5f), 1.0 - 0x1.0p-53), 1);
  // No positive weight at all: the first candidate.
  const float all_nan[3] = {nan, nan, nan};
  EXPECT_EQ(sample_token(all_nan, 3, with(1.f), 0.5), 0);
}

// A seeded stream's frequencies against softmax(logits / T) within top-k and top-p: Pearson's
// chi-square over 40,000 draws against its 0.001 critical value (the stream is fixed, so the
// statistic is one number).
TEST(Sampler, AStreamFollowsTheTruncatedSoftmax) {
  const float logits[6] = {0.5f, 2.f, -1.f, 1.f, 1.5f, -3.f};
  struct Case {
    SamplerParams p;
    std::vector<int> kept;
  };
  const Case cases[] = {{with(1.f), {0, 1, 2, 3, 4, 5}}, {with(0.7f, 5), {0, 1, 2, 3, 4}},
                        {with(2.f, 0, 0.9f), {}}};
  for (const Case& c : cases) {
    std::vector<double> w(6, 0.0);
    for (int i = 0; i < 6; ++i) w[size_t(i)] = std::exp(double(logits[i] / c.p.temperature));
    std::vector<int> kept = c.kept;
    if (kept.empty()) {  // the nucleus of 0.9 at T = 2, by hand from the sorted weights
      std::vector<int> order = {1, 4, 3, 0, 2, 5};
      double total = 0, mass = 0;
      for (double x : w) total += x;
      for (int i : order) {
        kept.push_back(i);
        mass += w[size_t(i)];
        if (mass / total >= 0.9) break;
      }
    }
    double kept_mass = 0;
    for (int i : kept) kept_mass += w[size_t(i)];
    Sampler s(c.p);
    std::vector<int> count(6, 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) ++count[size_t(s.sample(logits, 6))];
    EXPECT_EQ(s.draws(), uint64_t(draws));
    double chi2 = 0;
    for (int i = 0; i < 6; ++i) {
      const bool in = std::find(kept.begin(), kept.end(), i) != kept.end();
      if (!in) {
        EXPECT_EQ(count[size_t(i)], 0) << "id " << i << " is outside the cut";
        continue;
      }
      const double expected = draws * w[size_t(i)] / kept_mass;
      chi2 += (count[size_t(i)] - expected) * (count[size_t(i)] - expected) / expected;
    }
    const double critical[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52};  // chi-square, p = 0.001, by degrees
    ASSERT_GE(kept.size(), size_t(2));
    EXPECT_LT(chi2, critical[kept.size() - 1]) << "T " << c.p.temperature;
  }
}

TEST(Sampler, TheSameSeedGivesTheSameTokens) {
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(double(i))) * 3.f;
  SamplerParams p = with(1.f, 50, 0.95f);
  p.seed = 99;
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.sample(logits.data(), 1000), b.sample(logits.data(), 1000));
  // Counting a draw made elsewhere moves the stream on as a draw does.
  Sampler c(p), d(p);
  c.sample(logits.data(), 1000);
  d.count_draw();
  EXPECT_EQ(c.sample(logits.data(), 1000), d.sample(logits.data(), 1000));
}

// Temperatures below kGreedyTemperature draw the argmax: at 1e-40, logit / T is +inf for every
// positive logit, and the weights exp(inf - inf) were NaN (the lowest id among them was drawn).
TEST(Sampler, TemperaturesNearZeroDrawTheArgmax) {
  const std::vector<float> logits = {3.f, 7.5f, 7.25f, -2.f, 1.f};
  for (float t : {1e-40f, 1e-38f, 1e-30f, 1e-7f, 0.f}) {
    SamplerParams p;
    p.temperature = t;
    EXPECT_TRUE(sample_greedy(p)) << t;
    for (double u : {0.0, 0.5, 0.999})
      EXPECT_EQ(sample_token(logits.data(), int32_t(logits.size()), p, u), 1) << "T " << t << " u " << u;
  }
  SamplerParams p;
  p.temperature = kGreedyTemperature;  // the first temperature that samples
  EXPECT_FALSE(sample_greedy(p));
  // Keys 7.5e6 and 7.25e6 apart by 2.5e5: the weight of the second is exp(-2.5e5) = 0.
  EXPECT_EQ(sample_token(logits.data(), int32_t(logits.size()), p, 0.999), 1);
}

TEST(Sampler, RefusesBadParameters) {
  EXPECT_THROW(Sampler(with(-1.f)), Error);
  EXPECT_THROW(Sampler(with(std::numeric_limits<float>::infinity())), Error);
  EXPECT_THROW(Sampler(with(std::numeric_limits<float>::quiet_NaN())), Error);
  EXPECT_THROW(Sampler(with(1.f, -1)), Error);
  EXPECT_THROW(Sampler(with(1.f, 0, 0.f)), Error);
  EXPECT_THROW(Sampler(with(1.f, 0, 1.5f)), Error);
  const float one = 1.f;
  EXPECT_THROW(sample_token(&one, 0, with(1.f), 0.5), Error);
}

}  // namespace
}  // namespace certkv::model

namespace certkv::model {
namespace {

// token_logprob against the log-softmax written out in long double, with ties, a NaN and -inf.
TEST(TokenLogprob, IsTheLogSoftmaxWithTheMostLikelyTokensFirst) {
  const std::vector<float> logits = {1.5f, -2.f, 3.25f, 3.25f, NAN, -INFINITY, 0.f, 7.f};
  long double sum = 0;
  for (float x : logits)
    if (std::isfinite(x)) sum += std::exp((long double)x);
  const long double lse = std::log(sum);
  for (int32_t t = 0; t < int32_t(logits.size()); ++t) {
    const TokenLogprob lp = token_logprob(logits.data(), int32_t(logits.size()), t, 4);
    EXPECT_EQ(lp.token, t);
    if (std::isfinite(logits[size_t(t)]))
      EXPECT_NEAR(lp.logprob, double(logits[size_t(t)] - lse), 1e-6) << t;
    else
      EXPECT_EQ(lp.logprob, -INFINITY) << t;  // NaN counts as -inf
    ASSERT_EQ(lp.top.size(), 4u);
    EXPECT_EQ(lp.top[0].first, 7);
    EXPECT_EQ(lp.top[1].first, 2);  // tied with 3: the lower id first
    EXPECT_EQ(lp.top[2].first, 3);
    EXPECT_EQ(lp.top[3].first, 0);
    EXPECT_NEAR(lp.top[1].second, double(3.25L - lse), 1e-6);
  }
  double total = 0;
  for (int32_t t = 0; t < int32_t(logits.size()); ++t)
    total += std::exp(double(token_logprob(logits.data(), int32_t(logits.size()), t, 0).logprob));
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_TRUE(token_logprob(logits.data(), int32_t(logits.size()), 0, 0).top.empty());
  // Huge logits do not overflow (the largest is subtracted first).
  const std::vector<float> huge = {1e30f, 1e30f};
  EXPECT_NEAR(token_logprob(huge.data(), 2, 1, 2).logprob, std::log(0.5), 1e-6);
  EXPECT_THROW(token_logprob(logits.data(), int32_t(logits.size()), 8, 0), Error);
  EXPECT_THROW(token_logprob(logits.data(), int32_t(logits.size()), 0, kMaxTopLogprobs + 1), Error);
  EXPECT_THROW(token_logprob(logits.data(), int32_t(logits.size()), -1, 0), Error);
}

}  // namespace
}  // namespace certkv::model
