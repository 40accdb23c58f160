#include "gate/meter.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "codec/lossy_page.h"
#include "core/status.h"
#include "format/numeric.h"

namespace certkv::gate {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Soundness checks compare a bound with a TV computed in double; both carry rounding of order
// 1e-15, far below this margin.
constexpr double kTvRounding = 1e-12;

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  double uniform(double a, double b) { return std::uniform_real_distribution<double>(a, b)(gen_); }
  double log_uniform(double a, double b) { return std::exp(uniform(std::log(a), std::log(b))); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen_); }
  int integer(int a, int b) { return std::uniform_int_distribution<int>(a, b)(gen_); }
  bool coin() { return integer(0, 1) == 1; }

 private:
  std::mt19937_64 gen_;
};

MeterState state_of(const std::vector<double>& s_tilde, const std::vector<double>& c) {
  MeterState state;
  for (size_t t = 0; t < s_tilde.size(); ++t) state.add(s_tilde[t], c[t], 0, 0);
  return state;
}

double log_sum_exp(const std::vector<double>& x) {
  double m = -kInf;
  for (double v : x) m = std::max(m, v);
  double sum = 0;
  for (double v : x) sum += std::exp(v - m);
  return m + std::log(sum);
}

// log A- = LSE_t(s~_t - c_t) - LSE_t(s~_t) (Proposition 1).
double log_a_minus_of(const std::vector<double>& s_tilde, const std::vector<double>& c) {
  std::vector<double> shifted(s_tilde.size());
  for (size_t t = 0; t < s_tilde.size(); ++t) shifted[t] = s_tilde[t] - c[t];
  return log_sum_exp(shifted) - log_sum_exp(s_tilde);
}

// The unsound bound (1) of the seed: (1/2) e^{2 c_max} (E_p~[|c - c_bar|] + c_bar (e^{c_max} - 1)).
double flawed_dispersion_bound(const std::vector<double>& s_tilde, const std::vector<double>& c) {
  const double lse = log_sum_exp(s_tilde);
  double c_bar = 0, c_max = 0;
  for (size_t t = 0; t < c.size(); ++t) {
    c_bar += std::exp(s_tilde[t] - lse) * c[t];
    c_max = std::max(c_max, c[t]);
  }
  double dispersion = 0;
  for (size_t t = 0; t < c.size(); ++t)
    dispersion += std::exp(s_tilde[t] - lse) * std::abs(c[t] - c_bar);
  return 0.5 * std::exp(2 * c_max) * (dispersion + c_bar * std::expm1(c_max));
}

// ---------------------------------------------------------------------------------------------
// meter_from_log_a, meter_two_sided_from_logs

TEST(MeterFromLogA, EdgeCases) {
  EXPECT_EQ(meter_from_log_a(0), 0);
  EXPECT_EQ(meter_from_log_a(-1e-17), 0);  // rounding below zero
  EXPECT_EQ(meter_from_log_a(-kInf), 0);
  // Tiny: (e^{2x} - 1) / 2 = x + x^2 + ..., no cancellation to zero.
  EXPECT_EQ(meter_from_log_a(1e-300), 1e-300);
  EXPECT_DOUBLE_EQ(meter_from_log_a(1e-9), 1e-9 + 1e-18);
  // The saturation boundary A^2 = 3, i.e. log A = log sqrt(3).
  const double boundary = std::log(std::sqrt(3.0));
  EXPECT_NEAR(meter_from_log_a(boundary), 1.0, 4e-16);
  EXPECT_LE(meter_from_log_a(boundary), 1.0);
  EXPECT_EQ(meter_from_log_a(0.5 * std::log(3.0)), 1.0);
  const double below = boundary - 1e-6;
  EXPECT_LT(meter_from_log_a(below), 1.0);
  EXPECT_NEAR(meter_from_log_a(below), 0.5 * std::expm1(2 * below), 1e-15);
  EXPECT_EQ(meter_from_log_a(1.0), 1.0);
  EXPECT_EQ(meter_from_log_a(400.0), 1.0);  // e^{800} would overflow
  EXPECT_EQ(meter_from_log_a(1e300), 1.0);
  EXPECT_EQ(meter_from_log_a(kInf), 1.0);
  EXPECT_EQ(meter_from_log_a(kNaN), 1.0);  // never certify NaN
}

TEST(MeterFromLogA, MatchesTheoremOneAndIsMonotone) {
  const long double a = std::exp(0.1L);
  EXPECT_NEAR(meter_from_log_a(0.1), double((a * a - 1) / 2), 1e-16);
  EXPECT_NEAR(meter_from_log_a(0.1), 0.1107013790800849, 1e-15);
  double previous = 0;
  for (int i = 1; i <= 100000; ++i) {
    const double log_a = i * 1e-5;
    const double value = meter_from_log_a(log_a);
    ASSERT_GE(value, previous) << log_a;
    previous = value;
  }
  EXPECT_EQ(previous, 1.0);
}

// meter_from_a_minus_1 is meter_from_log_a of log1p(A - 1) without the logarithm and exponential:
// the same values to a few units of the last place, the same edges, monotone.
TEST(MeterFromAMinus1, IsMeterFromLogAOfTheSameA) {
  EXPECT_EQ(meter_from_a_minus_1(0), 0);
  EXPECT_EQ(meter_from_a_minus_1(-1e-17), 0);
  EXPECT_EQ(meter_from_a_minus_1(1e-300), 1e-300);
  EXPECT_EQ(meter_from_a_minus_1(kInf), 1.0);
  EXPECT_EQ(meter_from_a_minus_1(kNaN), 1.0);  // never certify NaN
  EXPECT_EQ(meter_from_a_minus_1(1.0), 1.0);
  EXPECT_EQ(meter_from_a_minus_1(std::sqrt(3.0) - 1 + 1e-12), 1.0);  // past A^2 = 3
  EXPECT_LT(meter_from_a_minus_1(std::sqrt(3.0) - 1 - 1e-9), 1.0);
  double previous = 0;
  for (int e = -300; e <= 2; ++e) {
    for (const double m : {1.0, 1.37, 2.9, 7.77}) {
      const double a_minus_1 = m * std::pow(10.0, e);
      const double value = meter_from_a_minus_1(a_minus_1);
      const double via_logs = meter_from_log_a(std::log1p(a_minus_1));
      EXPECT_NEAR(value, via_logs, 8e-16 * via_logs) << a_minus_1;
      // (A^2 - 1) / 2 = a + a^2 / 2, in long double.
      const long double a = a_minus_1;
      if (value < 1) {
        EXPECT_NEAR(value, double(a + a * a / 2), 4e-16 * value) << a_minus_1;
      }
      ASSERT_GE(value, previous) << a_minus_1;
      previous = value;
    }
  }
}

TEST(MeterTwoSided, KnownValuesAndEdges) {
  // A = e^{0.1}, A- = e^{-0.1}: (A / A- - A- / A) / 2 = sinh(0.2).
  EXPECT_NEAR(meter_two_sided_from_logs(0.1, -0.1), std::sinh(0.2), 1e-16);
  EXPECT_NEAR(meter_two_sided_from_logs(0.1, -0.1), 0.201336002541094, 1e-15);
  EXPECT_EQ(meter_two_sided_from_logs(0, 0), 0);
  EXPECT_EQ(meter_two_sided_from_logs(0.3, 0.3 + 1e-17), 0);  // rounding below zero
  EXPECT_NEAR(meter_two_sided_from_logs(std::asinh(1.0) - 1e-9, 0), 1.0, 2e-9);
  EXPECT_LT(meter_two_sided_from_logs(std::asinh(1.0) - 1e-9, 0), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(std::asinh(1.0), 0), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(900, -900), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(kInf, -1), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(1, -kInf), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(kInf, kInf), 1.0);  // NaN difference
  EXPECT_EQ(meter_two_sided_from_logs(kNaN, 0), 1.0);
  EXPECT_EQ(meter_two_sided_from_logs(0, kNaN), 1.0);
}

// ---------------------------------------------------------------------------------------------
// MeterState

TEST(MeterState, EmptyStateIsZero) {
  MeterState state;
  EXPECT_EQ(state.log_a(), 0);
  EXPECT_EQ(state.meter(), 0);
  EXPECT_EQ(state.value_rho(), 0);
  EXPECT_EQ(state.output_error_bound(), 0);
  MeterState other;
  state.merge(other);
  EXPECT_EQ(state.log_a(), 0);
  EXPECT_EQ(state.l, 0);
}

TEST(MeterState, SingleTokenGivesItsBound) {
  for (double c : {0.0, 1e-7, 0.03, 0.5, 3.0, 600.0}) {
    MeterState state;
    state.add(17.25, c, 0.125, 2.0);
    EXPECT_NEAR(state.log_a(), c, 1e-14 * std::max(1.0, c)) << c;
    EXPECT_EQ(state.value_rho(), 0.125);
    EXPECT_DOUBLE_EQ(state.output_error_bound(), 2 * meter_from_log_a(state.log_a()) * 2.0 + 0.125);
  }
}

TEST(MeterState, MatchesDirectFormula) {
  Rng rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = rng.integer(1, 40);
    std::vector<double> s(n), c(n), rho(n), v_norm(n);
    for (int t = 0; t < n; ++t) {
      s[t] = rng.uniform(-30, 30);
      c[t] = rng.log_uniform(1e-4, 3);
      rho[t] = rng.uniform(0, 0.1);
      v_norm[t] = rng.uniform(0, 5);
    }
    long double z = 0, a = 0, rho_sum = 0;
    for (int t = 0; t < n; ++t) {
      z += std::exp((long double)s[t]);
      a += std::exp((long double)s[t] + c[t]);
      rho_sum += std::exp((long double)s[t]) * rho[t];
    }
    MeterState state;
    for (int t = 0; t < n; ++t) state.add(s[t], c[t], rho[t], v_norm[t]);
    const double log_a = double(std::log(a / z));
    // The state holds s + c rounded to double, an error of half an ulp of |s| + c (|s| <= 30,
    // c <= 3): log A is exact to a few ulps of 33 in absolute terms, not relative to log A.
    ASSERT_NEAR(state.log_a(), log_a, 1e-14 * log_a + 4 * 33 * DBL_EPSILON) << trial;
    ASSERT_NEAR(state.value_rho(), double(rho_sum / z), 1e-13) << trial;
    ASSERT_EQ(state.v_norm_max, *std::max_element(v_norm.begin(), v_norm.end()));
    ASSERT_DOUBLE_EQ(state.output_error_bound(),
                     2 * meter_from_log_a(state.log_a()) * state.v_norm_max + state.value_rho());
  }
}

TEST(MeterState, InfiniteOrOverflowingBoundGivesInfiniteLogA) {
  for (int position = 0; position < 3; ++position) {
    MeterState state;
    for (int t = 0; t < 3; ++t) state.add(0.5 * t, t == position ? kInf : 0.1, 0, 1);
    EXPECT_EQ(state.log_a(), kInf) << position;
    EXPECT_EQ(state.meter(), 1.0);
    EXPECT_EQ(state.value_rho(), 0);
    EXPECT_EQ(state.output_error_bound(), 2.0);
  }
  MeterState two_infinite;
  two_infinite.add(0, kInf, 0, 0);
  two_infinite.add(1, kInf, 0, 0);
  EXPECT_EQ(two_infinite.log_a(), kInf);
  // s + c overflows double although c is finite: never truncated.
  MeterState overflow;
  overflow.add(1e308, 1.7e308, 0, 0);
  EXPECT_EQ(overflow.log_a(), kInf);
  EXPECT_EQ(overflow.meter(), 1.0);
  // A large finite c is carried in the log domain, not truncated.
  MeterState large;
  large.add(0, 800, 0, 0);
  large.add(0, 0, 0, 0);
  EXPECT_NEAR(large.log_a(), 800 - std::log(2.0), 1e-12);
}

TEST(MeterState, MergePropagatesInfinity) {
  MeterState finite, infinite;
  finite.add(0, 0.1, 0, 0);
  infinite.add(-3, kInf, 0, 0);
  MeterState a = finite;
  a.merge(infinite);
  EXPECT_EQ(a.log_a(), kInf);
  MeterState b = infinite;
  b.merge(finite);
  EXPECT_EQ(b.log_a(), kInf);
  MeterState empty;
  empty.merge(infinite);
  EXPECT_EQ(empty.log_a(), kInf);
}

TEST(MeterState, NaNNeverCertifies) {
  MeterState nan_c;
  nan_c.add(0, 0.1, 0, 0);
  nan_c.add(1, kNaN, 0, 0);
  nan_c.add(2, 0.1, 0, 0);
  EXPECT_TRUE(std::isnan(nan_c.log_a()));
  EXPECT_EQ(nan_c.meter(), 1.0);

  MeterState nan_first;
  nan_first.add(0, kNaN, 0, 0);
  nan_first.add(1, 0.1, 0, 0);
  EXPECT_EQ(nan_first.meter(), 1.0);

  MeterState nan_s;
  nan_s.add(0, 0.1, 0, 0);
  nan_s.add(kNaN, 0.1, 0, 0);
  EXPECT_EQ(nan_s.meter(), 1.0);

  MeterState nan_norm;
  nan_norm.add(0, 0.1, 0, kNaN);
  nan_norm.add(0, 0.1, 0, 1.0);
  EXPECT_EQ(nan_norm.output_error_bound(), kInf);

  MeterState nan_rho;
  nan_rho.add(0, 0.1, kNaN, 1.0);
  EXPECT_EQ(nan_rho.output_error_bound(), kInf);

  MeterState merged;
  merged.add(5, 0.1, 0, 0);
  merged.merge(nan_c);
  EXPECT_EQ(merged.meter(), 1.0);
  MeterState merged_norm;
  merged_norm.add(5, 0.1, 0, 2.0);
  merged_norm.merge(nan_norm);
  EXPECT_EQ(merged_norm.output_error_bound(), kInf);
}

TEST(MeterState, MaskedTokensCarryNoWeight) {
  MeterState state, reference;
  state.add(-kInf, 5.0, 1.0, 0.5);
  state.add(2.0, 0.2, 0.0, 0.5);
  state.add(-kInf, 7.0, 1.0, 0.5);
  reference.add(2.0, 0.2, 0.0, 0.5);
  EXPECT_EQ(state.log_a(), reference.log_a());
  EXPECT_EQ(state.value_rho(), 0);
  MeterState only_masked;
  only_masked.add(-kInf, 1.0, 1.0, 0);
  EXPECT_EQ(only_masked.log_a(), 0);
}

TEST(MeterState, NegativeBoundIsRejected) {
  MeterState state;
  try {
    state.add(0, -0.5, 0, 0);
    FAIL() << "expected certkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("c"), std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------------
// softmax_tv

TEST(SoftmaxTv, KnownValuesAndShiftInvariance) {
  const double s[2] = {-0.125, 0.125};
  const double s_tilde[2] = {0, 0};
  EXPECT_NEAR(softmax_tv(s, s_tilde, 2), 0.5 - 1 / (1 + std::exp(0.25)), 1e-16);
  // Shifts by exactly representable amounts keep the logit differences exact.
  const double shifted[2] = {700 - 0.125, 700 + 0.125};
  const double shifted_tilde[2] = {-500, -500};
  EXPECT_NEAR(softmax_tv(shifted, shifted_tilde, 2), softmax_tv(s, s_tilde, 2), 1e-16);
  EXPECT_EQ(softmax_tv(s, s, 2), 0);
  // A masked token: p = (1, 0) against q = (1/2, 1/2).
  const double masked[2] = {0, -kInf};
  EXPECT_NEAR(softmax_tv(masked, s_tilde, 2), 0.5, 1e-16);
  // Disjoint supports give TV 1.
  const double left[3] = {0, -kInf, -kInf}, right[3] = {-kInf, 3, -kInf};
  EXPECT_EQ(softmax_tv(left, right, 3), 1.0);
  EXPECT_EQ(softmax_tv(nullptr, nullptr, 0), 0);
}

TEST(SoftmaxTv, RejectsBadInput) {
  const double s[2] = {0, 1};
  const double all_masked[2] = {-kInf, -kInf};
  EXPECT_THROW(softmax_tv(s, s, -1), Error);
  EXPECT_THROW(softmax_tv(nullptr, s, 2), Error);
  EXPECT_THROW(softmax_tv(s, all_masked, 2), Error);
}

// ---------------------------------------------------------------------------------------------
// The two-token counterexample of the seed (section 3).

TEST(Soundness, TwoTokenCounterexample) {
  const std::vector<double> s_tilde = {0, 0};  // p~ = (1/2, 1/2)
  const std::vector<double> c = {0.1, 0.1};
  const std::vector<double> eps = {0.1, -0.1};
  std::vector<double> s(2);
  for (int t = 0; t < 2; ++t) s[t] = s_tilde[t] - eps[t];
  const double tv = softmax_tv(s.data(), s_tilde.data(), 2);
  EXPECT_NEAR(tv, 0.049834, 1e-6);

  const double flawed = flawed_dispersion_bound(s_tilde, c);
  EXPECT_NEAR(flawed, 0.006423, 1e-6);
  EXPECT_GT(tv, flawed) << "the flawed bound must be violated by the counterexample";
  EXPECT_GT(tv / flawed, 7.7);

  const MeterState state = state_of(s_tilde, c);
  EXPECT_NEAR(state.log_a(), 0.1, 1e-15);
  EXPECT_GE(state.meter(), tv);
  EXPECT_NEAR(state.meter(), 0.5 * std::expm1(0.2), 1e-15);
  EXPECT_GE(meter_two_sided_from_logs(state.log_a(), log_a_minus_of(s_tilde, c)), tv);
}

// ---------------------------------------------------------------------------------------------
// Theorem 1 and Proposition 1: a randomized adversarial suite, checked per query.

enum class LogitShape { kPeaked, kFlat, kRandom, kExtreme };
enum class BoundShape { kTiny, kLogUniform, kAllEqual, kSingleSpike, kLarge, kSomeZero };
enum class ErrorShape { kPlus, kMinus, kAlternating, kRandomSign, kInside, kZero, kByRank };

struct Trial {
  std::vector<double> s_tilde, c, eps, s;
};

void draw_trial(Rng& rng, Trial& trial) {
  const int pick = rng.integer(0, 19);
  const int n = pick == 0 ? 1 : pick == 1 ? 2 : rng.integer(1, 64);
  trial.s_tilde.resize(n);
  trial.c.resize(n);
  trial.eps.resize(n);
  trial.s.resize(n);

  switch (LogitShape(rng.integer(0, 3))) {
    case LogitShape::kPeaked: {
      for (double& v : trial.s_tilde) v = rng.normal();
      trial.s_tilde[rng.integer(0, n - 1)] += rng.uniform(5, 60);
      break;
    }
    case LogitShape::kFlat: {
      const double v = rng.uniform(-20, 20);
      std::fill(trial.s_tilde.begin(), trial.s_tilde.end(), v);
      break;
    }
    case LogitShape::kRandom: {
      const double sigma = rng.log_uniform(0.1, 10);
      for (double& v : trial.s_tilde) v = sigma * rng.normal();
      break;
    }
    case LogitShape::kExtreme: {
      for (double& v : trial.s_tilde) v = rng.uniform(0, 80);
      trial.s_tilde[rng.integer(0, n - 1)] = 0;
      trial.s_tilde[rng.integer(0, n - 1)] = 80;
      break;
    }
  }

  switch (BoundShape(rng.integer(0, 5))) {
    case BoundShape::kTiny:
      for (double& v : trial.c) v = 1e-6 * rng.uniform(0.5, 1);
      break;
    case BoundShape::kLogUniform:
      for (double& v : trial.c) v = rng.log_uniform(1e-6, 20);
      break;
    case BoundShape::kAllEqual: {
      const double v = rng.log_uniform(1e-6, 20);
      std::fill(trial.c.begin(), trial.c.end(), v);
      break;
    }
    case BoundShape::kSingleSpike: {
      const double base = rng.coin() ? 0.0 : rng.log_uniform(1e-6, 1e-2);
      std::fill(trial.c.begin(), trial.c.end(), base);
      trial.c[rng.integer(0, n - 1)] = rng.uniform(1, 20);
      break;
    }
    case BoundShape::kLarge:
      for (double& v : trial.c) v = rng.uniform(5, 20);
      break;
    case BoundShape::kSomeZero:
      for (double& v : trial.c) v = rng.coin() ? 0.0 : rng.log_uniform(1e-6, 20);
      break;
  }

  const ErrorShape error_shape = ErrorShape(rng.integer(0, 6));
  double median = 0;
  if (error_shape == ErrorShape::kByRank) {
    std::vector<double> sorted = trial.s_tilde;
    std::nth_element(sorted.begin(), sorted.begin() + n / 2, sorted.end());
    median = sorted[n / 2];
  }
  for (int t = 0; t < n; ++t) {
    const double c = trial.c[t];
    double e = 0;
    switch (error_shape) {
      case ErrorShape::kPlus: e = c; break;
      case ErrorShape::kMinus: e = -c; break;
      case ErrorShape::kAlternating: e = t % 2 == 0 ? c : -c; break;
      case ErrorShape::kRandomSign: e = rng.coin() ? c : -c; break;
      case ErrorShape::kInside: e = rng.uniform(-c, c); break;
      case ErrorShape::kZero: e = 0; break;
      case ErrorShape::kByRank: e = trial.s_tilde[t] >= median ? c : -c; break;
    }
    trial.eps[t] = e;
  }
  // eps = s~ - s, or its negative: |eps_t| <= c_t either way.
  const double direction = rng.coin() ? 1.0 : -1.0;
  for (int t = 0; t < n; ++t) trial.s[t] = trial.s_tilde[t] - direction * trial.eps[t];
}

TEST(Soundness, TheoremOneAndPropositionOneAdversarial) {
  constexpr int kTrials = 1000000;
  Rng rng(20240601);
  Trial trial;
  int64_t one_sided_violations = 0, two_sided_violations = 0, flawed_violations = 0;
  int64_t informative = 0, two_sided_informative = 0, n_one = 0, n_two = 0;
  double tightest = 0;  // max TV / meter over informative trials
  for (int i = 0; i < kTrials; ++i) {
    draw_trial(rng, trial);
    const int64_t n = int64_t(trial.s.size());
    n_one += n == 1;
    n_two += n == 2;
    const double tv = softmax_tv(trial.s.data(), trial.s_tilde.data(), n);

    MeterState state;
    for (int64_t t = 0; t < n; ++t) state.add(trial.s_tilde[t], trial.c[t], 0, 0);
    const double meter = state.meter();
    if (!(tv <= meter + kTvRounding)) {
      if (one_sided_violations++ < 5)
        ADD_FAILURE() << "Theorem 1 violated: trial " << i << " n " << n << " tv " << tv
                      << " meter " << meter;
    }
    if (meter < 1) {
      ++informative;
      if (meter > 1e-9) tightest = std::max(tightest, tv / meter);
    }

    const double two_sided =
        meter_two_sided_from_logs(state.log_a(), log_a_minus_of(trial.s_tilde, trial.c));
    if (!(tv <= two_sided + kTvRounding)) {
      if (two_sided_violations++ < 5)
        ADD_FAILURE() << "Proposition 1 violated: trial " << i << " n " << n << " tv " << tv
                      << " bound " << two_sided;
    }
    two_sided_informative += two_sided < 1;

    if (i % 16 == 0 && tv > flawed_dispersion_bound(trial.s_tilde, trial.c) + kTvRounding)
      ++flawed_violations;
  }
  std::printf("Theorem 1 suite: %d trials (%lld with n = 1, %lld with n = 2); informative %lld "
              "(one-sided), %lld (two-sided); max TV / meter %.6f; the flawed bound (1) failed "
              "%lld of %d checked trials\n",
              kTrials, (long long)n_one, (long long)n_two, (long long)informative,
              (long long)two_sided_informative, tightest, (long long)flawed_violations,
              kTrials / 16);
  EXPECT_EQ(one_sided_violations, 0);
  EXPECT_EQ(two_sided_violations, 0);
  // The suite is not vacuous: many certificates are informative, some are nearly tight, both
  // small sizes occur, and the same trials expose the unsound bound (1).
  EXPECT_GT(informative, kTrials / 4);
  EXPECT_GT(two_sided_informative, kTrials / 4);
  EXPECT_GT(tightest, 0.9);
  EXPECT_GT(n_one, kTrials / 40);
  EXPECT_GT(n_two, kTrials / 40);
  EXPECT_GT(flawed_violations, 0);
}

// ---------------------------------------------------------------------------------------------
// LSE merge: split states merge to the single-pass state.

double relative_difference(double a, double b) {
  if (a == b) return 0;
  return std::abs(a - b) / std::max(std::abs(a), std::abs(b));
}

TEST(MeterState, MergeOfSplitsEqualsSinglePass) {
  Rng rng(7);
  double worst_log_a = 0, worst_rho = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = rng.integer(0, 200);
    const double spread = rng.log_uniform(0.1, 60);
    std::vector<double> s(n), c(n), rho(n), v_norm(n);
    for (int t = 0; t < n; ++t) {
      s[t] = rng.uniform(-spread, spread);
      c[t] = rng.log_uniform(1e-3, 20);
      rho[t] = rng.uniform(0, 0.5);
      v_norm[t] = rng.uniform(0, 10);
    }
    MeterState single;
    for (int t = 0; t < n; ++t) single.add(s[t], c[t], rho[t], v_norm[t]);

    const int parts = rng.integer(1, 8);
    std::vector<int> cuts = {0, n};
    for (int p = 1; p < parts; ++p) cuts.push_back(rng.integer(0, n));  // repeats: empty parts
    std::sort(cuts.begin(), cuts.end());
    std::vector<MeterState> split(cuts.size() - 1);
    for (size_t p = 0; p + 1 < cuts.size(); ++p)
      for (int t = cuts[p]; t < cuts[p + 1]; ++t) split[p].add(s[t], c[t], rho[t], v_norm[t]);

    // Left to right, and right to left (as split-KV reductions may order them).
    MeterState forward, backward;
    for (size_t p = 0; p < split.size(); ++p) forward.merge(split[p]);
    for (size_t p = split.size(); p-- > 0;) backward.merge(split[p]);

    for (const MeterState* merged : {&forward, &backward}) {
      ASSERT_EQ(merged->m, single.m) << trial;
      ASSERT_EQ(merged->mc, single.mc) << trial;
      ASSERT_EQ(merged->v_norm_max, single.v_norm_max) << trial;
      ASSERT_LE(relative_difference(merged->l, single.l), 1e-13) << trial;
      ASSERT_LE(relative_difference(merged->lc, single.lc), 1e-13) << trial;
      const double d_log_a = relative_difference(merged->log_a(), single.log_a());
      const double d_rho = relative_difference(merged->value_rho(), single.value_rho());
      ASSERT_LE(d_log_a, 1e-12) << trial << " log A " << single.log_a();
      ASSERT_LE(d_rho, 1e-12) << trial;
      worst_log_a = std::max(worst_log_a, d_log_a);
      worst_rho = std::max(worst_rho, d_rho);
    }
  }
  std::printf("LSE merge: worst relative difference log A %.3g, value rho %.3g\n", worst_log_a,
              worst_rho);
}

// ---------------------------------------------------------------------------------------------
// Value side: ||y - y^|| <= 2 TV max ||v|| + sum p~ rho, with the meter in place of TV.

TEST(Soundness, OutputErrorBound) {
  constexpr int kDim = 24;
  Rng rng(99);
  Trial trial;
  int64_t violations = 0;
  double tightest = 0;
  for (int i = 0; i < 50000; ++i) {
    draw_trial(rng, trial);
    const size_t n = trial.s.size();
    const double ls = log_sum_exp(trial.s), ls_tilde = log_sum_exp(trial.s_tilde);
    std::vector<double> y(kDim, 0.0), y_hat(kDim, 0.0);
    MeterState state;
    for (size_t t = 0; t < n; ++t) {
      double v[kDim], dir[kDim], v_norm2 = 0, dir_norm2 = 0;
      const double v_scale = rng.log_uniform(0.01, 10);
      for (int j = 0; j < kDim; ++j) {
        v[j] = v_scale * rng.normal();
        dir[j] = rng.normal();
        v_norm2 += v[j] * v[j];
        dir_norm2 += dir[j] * dir[j];
      }
      const double rho_t = rng.coin() ? 0.0 : rng.log_uniform(1e-6, 1);
      const double p = std::exp(trial.s[t] - ls), p_tilde = std::exp(trial.s_tilde[t] - ls_tilde);
      for (int j = 0; j < kDim; ++j) {
        y[j] += p * v[j];
        y_hat[j] += p_tilde * (v[j] + rho_t * dir[j] / std::sqrt(dir_norm2));
      }
      state.add(trial.s_tilde[t], trial.c[t], rho_t, std::sqrt(v_norm2));
    }
    double err2 = 0;
    for (int j = 0; j < kDim; ++j) err2 += (y[j] - y_hat[j]) * (y[j] - y_hat[j]);
    const double err = std::sqrt(err2), bound = state.output_error_bound();
    if (!(err <= bound * (1 + kTvRounding) + kTvRounding) && violations++ < 5)
      ADD_FAILURE() << "output bound violated: trial " << i << " err " << err << " bound " << bound;
    if (bound > 0) tightest = std::max(tightest, err / bound);
  }
  EXPECT_EQ(violations, 0);
  EXPECT_GT(tightest, 0.3);
}

// ---------------------------------------------------------------------------------------------
// Theorem 2 and Lemma 1: the band-norm witness bounds the logit error of any post-RoPE query.

enum class Pairing { kInterleaved, kHalfSplit };

int pair_channel(Pairing pairing, int head_dim, int pair, int which) {
  return pairing == Pairing::kInterleaved ? 2 * pair + which : pair + which * (head_dim / 2);
}

// RoPE at position `position`: pair j rotates by position * theta_j, theta_j = 10000^{-2j/d}.
void rope_rotate(Pairing pairing, int head_dim, double position, const double* x, double* out) {
  for (int j = 0; j < head_dim / 2; ++j) {
    const double angle = position * std::pow(10000.0, -2.0 * j / head_dim);
    const double cos_a = std::cos(angle), sin_a = std::sin(angle);
    const int a = pair_channel(pairing, head_dim, j, 0), b = pair_channel(pairing, head_dim, j, 1);
    out[a] = x[a] * cos_a - x[b] * sin_a;
    out[b] = x[a] * sin_a + x[b] * cos_a;
  }
}

// Band norms: band b covers the pairs [b P / B, (b + 1) P / B), P = d / 2, B = min(16, P).
int band_count(int head_dim) { return std::min(16, head_dim / 2); }

void band_norms(Pairing pairing, int head_dim, const double* x, double* norms) {
  const int n_pairs = head_dim / 2, n_bands = band_count(head_dim);
  for (int b = 0; b < n_bands; ++b) {
    double sum = 0;
    for (int j = b * n_pairs / n_bands; j < (b + 1) * n_pairs / n_bands; ++j)
      for (int which = 0; which < 2; ++which) {
        const double v = x[pair_channel(pairing, head_dim, j, which)];
        sum += v * v;
      }
    norms[b] = std::sqrt(sum);
  }
}

// The stored witness: float, rounded toward +inf.
float round_up_to_float(double w) {
  float f = float(w);
  if (double(f) < w) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

TEST(Soundness, TheoremTwoWitnessBoundUnderRope) {
  constexpr int kTrials = 120000;
  // |q . r| and the bound are each a double sum of at most 128 products; a mode-2 residual makes
  // them equal in exact arithmetic, so the check allows their rounding (relative 1e-12).
  constexpr double kDotRounding = 1e-12;
  Rng rng(4242);
  int64_t violations = 0, lemma_violations = 0;
  double tightest = 0;
  double q_pre[256], q_rot[256], r_pre[256], r_rot[256], r_back[256], tmp[256];
  double q_norms[16], r_norms[16], rotated_norms[16];
  float witness[16];
  for (int i = 0; i < kTrials; ++i) {
    const int head_dim = std::array<int, 3>{32, 64, 128}[rng.integer(0, 2)];
    const Pairing pairing = rng.coin() ? Pairing::kInterleaved : Pairing::kHalfSplit;
    const int n_bands = band_count(head_dim), n_pairs = head_dim / 2;
    const double sm_scale = 1 / std::sqrt(double(head_dim));
    const double query_position = rng.integer(0, 1 << 20);
    const double key_position = rng.integer(0, 1 << 20);

    const double q_scale = rng.log_uniform(0.1, 30);
    for (int ch = 0; ch < head_dim; ++ch) q_pre[ch] = q_scale * rng.normal();
    if (rng.coin()) q_pre[rng.integer(0, head_dim - 1)] *= 50;  // a massive channel
    rope_rotate(pairing, head_dim, query_position, q_pre, q_rot);

    const int mode = rng.integer(0, 4);
    const double r_scale = rng.log_uniform(1e-4, 1);
    if (mode == 0) {  // dense Gaussian residual with uneven band energy
      for (int ch = 0; ch < head_dim; ++ch) r_pre[ch] = r_scale * rng.normal();
    } else if (mode == 1 || mode == 2) {
      // Aligned with the post-RoPE query: within one band (mode 1) or within every band with a
      // common sign (mode 2, where Cauchy-Schwarz is an equality overall), then rotated back to
      // the key's pre-RoPE frame.
      const int only = mode == 1 ? rng.integer(0, n_bands - 1) : -1;
      const double sign = rng.coin() ? 1.0 : -1.0;
      std::fill(r_rot, r_rot + head_dim, 0.0);
      for (int b = 0; b < n_bands; ++b) {
        if (only >= 0 && b != only) continue;
        const double alpha = sign * r_scale * rng.uniform(0.1, 1);
        for (int j = b * n_pairs / n_bands; j < (b + 1) * n_pairs / n_bands; ++j)
          for (int which = 0; which < 2; ++which) {
            const int ch = pair_channel(pairing, head_dim, j, which);
            r_rot[ch] = alpha * q_rot[ch];
          }
      }
      rope_rotate(pairing, head_dim, -key_position, r_rot, r_pre);
    } else if (mode == 3) {  // one channel
      std::fill(r_pre, r_pre + head_dim, 0.0);
      r_pre[rng.integer(0, head_dim - 1)] = r_scale * (rng.coin() ? 1 : -1);
    } else {  // a quantizer-like residual, uniform within half a step
      for (int ch = 0; ch < head_dim; ++ch) r_pre[ch] = r_scale * rng.uniform(-0.5, 0.5);
    }
    rope_rotate(pairing, head_dim, key_position, r_pre, r_back);

    band_norms(pairing, head_dim, r_pre, r_norms);
    for (int b = 0; b < n_bands; ++b) witness[b] = round_up_to_float(r_norms[b]);
    band_norms(pairing, head_dim, q_rot, q_norms);

    // Lemma 1: the band norms do not depend on the RoPE position.
    band_norms(pairing, head_dim, r_back, rotated_norms);
    band_norms(pairing, head_dim, q_pre, tmp);
    for (int b = 0; b < n_bands; ++b) {
      if (std::abs(rotated_norms[b] - r_norms[b]) > 1e-12 * r_norms[b] ||
          std::abs(q_norms[b] - tmp[b]) > 1e-12 * tmp[b])
        ++lemma_violations;
    }

    double dot = 0;
    for (int ch = 0; ch < head_dim; ++ch) dot += q_rot[ch] * r_back[ch];
    const double eps = std::abs(sm_scale * dot);
    const double c = tier_a_bound(q_norms, witness, n_bands, sm_scale);
    if (!(eps <= c * (1 + kDotRounding))) {
      if (violations++ < 5)
        ADD_FAILURE() << "Theorem 2 violated: trial " << i << " d " << head_dim << " mode "
                      << mode << " |eps| " << eps << " c " << c;
    }
    if (c > 0) tightest = std::max(tightest, eps / c);
  }
  std::printf("Theorem 2 suite: %d trials, max |eps| / c = %.12f\n", kTrials, tightest);
  EXPECT_EQ(violations, 0);
  EXPECT_EQ(lemma_violations, 0);
  EXPECT_GT(tightest, 1 - 1e-6);  // the aligned residuals reach the bound
}

TEST(TierA, BoundKnownAnswerAndValidation) {
  const double q[3] = {1.0, 2.0, 0.5};
  const float w[3] = {0.25f, 0.125f, 4.0f};
  EXPECT_DOUBLE_EQ(tier_a_bound(q, w, 3, 0.125), 0.125 * (0.25 + 0.25 + 2.0));
  EXPECT_EQ(tier_a_bound(q, w, 1, 1.0), 0.25);
  const float zero[3] = {0, 0, 0};
  EXPECT_EQ(tier_a_bound(q, zero, 3, 0.125), 0);  // repaired: zero witness
  EXPECT_THROW(tier_a_bound(q, w, 0, 1.0), Error);
}

// ---------------------------------------------------------------------------------------------
// Lemma 2: the uniform distribution is sub-Gaussian with proxy equal to its variance.

TEST(LemmaTwo, ContinuousUniformMgf) {
  // sinh(x) / x <= e^{x^2 / 6} on a dense grid and at random points, |x| <= 50. Below about
  // 1e-3 the two sides agree to long double precision; the series check covers that range.
  int64_t checked = 0;
  auto holds = [&](long double x) {
    ++checked;
    return std::sinh(x) / x <= std::exp(x * x / 6);
  };
  for (int k = 1; k <= 50000; ++k) {
    const long double x = k * 1e-3L;
    ASSERT_TRUE(holds(x)) << double(x);
    ASSERT_TRUE(holds(-x)) << double(-x);
  }
  Rng rng(5);
  for (int i = 0; i < 200000; ++i) {
    const long double x = rng.coin() ? rng.uniform(-50, 50) : rng.log_uniform(1e-3, 50);
    if (std::abs(x) < 1e-3L) continue;
    ASSERT_TRUE(holds(x)) << double(x);
  }
  // Term by term: sinh(x)/x = sum x^{2k} / (2k+1)!, e^{x^2/6} = sum x^{2k} / (6^k k!), and
  // (2k+1)! >= 6^k k! for every k, so the inequality holds for all real x.
  for (int k = 0; k <= 150; ++k)
    ASSERT_GE(std::lgamma(2.0L * k + 2), k * std::log(6.0L) + std::lgamma(k + 1.0L)) << k;
  // The constant 6 is the right one: 7 fails.
  EXPECT_GT(std::sinh(1.0L), std::exp(1.0L / 7));
  EXPECT_GT(checked, 299000);
}

// MGF of the centred uniform distribution on the N cell centres x_k = (k + 1/2) / N - 1/2 of
// [-1/2, 1/2): (1/N) e^{lambda x_0} sum_k r^k with r = e^{lambda / N}.
long double discrete_uniform_mgf(long double lambda, int n_cells) {
  if (lambda == 0) return 1;
  const long double x0 = 0.5L / n_cells - 0.5L;
  return std::exp(lambda * x0) * std::expm1(lambda) / std::expm1(lambda / n_cells) / n_cells;
}

TEST(LemmaTwo, DiscreteDitherMgf) {
  constexpr int kCells = 1 << 16;
  // The closed form against the direct sum.
  for (long double lambda : {-150.0L, -3.5L, 0.25L, 7.0L, 200.0L}) {
    long double direct = 0;
    for (int k = 0; k < kCells; ++k)
      direct += std::exp(lambda * ((k + 0.5L) / kCells - 0.5L));
    direct /= kCells;
    EXPECT_NEAR(double(discrete_uniform_mgf(lambda, kCells) / direct), 1.0, 1e-14)
        << double(lambda);
  }
  Rng rng(6);
  int64_t checked = 0;
  for (int i = 0; i < 400000; ++i) {
    long double lambda;
    if (i < 40000)
      lambda = (i + 1) * 5e-3L;  // a grid over (0, 200]
    else if (i % 2 == 0)
      lambda = rng.uniform(-200, 200);
    else
      lambda = (rng.coin() ? 1 : -1) * rng.log_uniform(1e-2, 200);
    if (std::abs(lambda) < 1e-2L) continue;
    const long double mgf = discrete_uniform_mgf(lambda, kCells);
    ASSERT_LE(std::log(mgf), lambda * lambda / 24) << double(lambda);
    ++checked;
  }
  EXPECT_GT(checked, 390000);
  // Near zero the proxy is tight: the variance (1 - 1/N^2) / 12 makes 1/25 in place of 1/24 fail.
  EXPECT_GT(std::log(discrete_uniform_mgf(0.5L, kCells)), 0.25L / 25);
}

// ---------------------------------------------------------------------------------------------
// Tier B end to end: subtractive dither with per-token group-of-32 scales s = amax / 126.5.

TEST(TierB, RadiusKnownAnswerAndValidation) {
  // u = sqrt(2 sigma2 log(2 S / delta)) makes the union bound 2 S e^{-u^2 / (2 sigma2)} = delta.
  const double u = tier_b_radius(0.04, 4096, 1e-6);
  EXPECT_NEAR(u, std::sqrt(2 * 0.04 * std::log(2 * 4096 / 1e-6)), 1e-15);
  EXPECT_NEAR(2 * 4096 * std::exp(-u * u / (2 * 0.04)), 1e-6, 1e-18);
  EXPECT_EQ(tier_b_radius(0, 10, 0.5), 0);
  EXPECT_EQ(tier_b_radius(kInf, 10, 0.5), kInf);
  EXPECT_TRUE(std::isnan(tier_b_radius(kNaN, 10, 0.5)));  // never certifies: meter 1
  EXPECT_THROW(tier_b_radius(-1e-3, 10, 0.5), Error);
  EXPECT_THROW(tier_b_radius(1, 0, 0.5), Error);
  EXPECT_THROW(tier_b_radius(1, 10, 0), Error);
  EXPECT_THROW(tier_b_radius(1, 10, 1), Error);
  EXPECT_THROW(tier_b_radius(1, 10, kNaN), Error);
}

TEST(TierB, LocalDelta) {
  EXPECT_DOUBLE_EQ(local_delta(1e-2, 30, 9, 1000), 1e-2 / 270000);
  EXPECT_EQ(local_delta(0.5, 1, 1, 1), 0.5);
  // Large counts stay exact in double (no int overflow).
  EXPECT_DOUBLE_EQ(local_delta(0.1, 100000, 100000, int64_t(1) << 40),
                   0.1 / (1e10 * std::ldexp(1.0, 40)));
  EXPECT_THROW(local_delta(0, 1, 1, 1), Error);
  EXPECT_THROW(local_delta(1, 1, 1, 1), Error);
  EXPECT_THROW(local_delta(-0.1, 1, 1, 1), Error);
  EXPECT_THROW(local_delta(kNaN, 1, 1, 1), Error);
  EXPECT_THROW(local_delta(0.1, 0, 1, 1), Error);
  EXPECT_THROW(local_delta(0.1, 1, 0, 1), Error);
  EXPECT_THROW(local_delta(0.1, 1, 1, 0), Error);
  try {
    local_delta(0.1, 1, -2, 1);
    FAIL() << "expected certkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("n_heads"), std::string::npos);
  }
}

// Fraction of dither draws in which some token's logit error exceeds its radius scaled by
// `radius_factor`. Keys and the query are fixed; every draw regenerates the dither.
struct DitherRun {
  double fraction;
  int64_t clipped;  // quantized integers outside [-127, 127] (must be 0)
  double max_residual_steps;  // max |r_c| / s_c (at most 1/2)
};

DitherRun dither_violation_fraction(int n_tokens, int head_dim, int n_draws, double delta_loc,
                                    double radius_factor, uint64_t seed) {
  constexpr int kGroup = 32;
  Rng rng(seed);
  const double sm_scale = 1 / std::sqrt(double(head_dim));
  // A dense query of near-equal magnitudes makes each logit error close to Gaussian, the case
  // where the sub-Gaussian tail is tightest.
  std::vector<double> q(head_dim);
  for (double& v : q) v = (rng.coin() ? 1 : -1) * rng.uniform(2, 3);
  std::vector<double> x(size_t(n_tokens) * head_dim), scale(x.size()), radius(n_tokens);
  for (int t = 0; t < n_tokens; ++t) {
    double* row = &x[size_t(t) * head_dim];
    for (int ch = 0; ch < head_dim; ++ch) row[ch] = rng.normal() * rng.log_uniform(0.1, 3);
    row[rng.integer(0, head_dim - 1)] *= 20;  // a massive channel in one group
    double sigma2 = 0;
    for (int g = 0; g < head_dim / kGroup; ++g) {
      double amax = 0;
      for (int ch = g * kGroup; ch < (g + 1) * kGroup; ++ch)
        amax = std::max(amax, std::abs(row[ch]));
      const double s = amax / 126.5;
      for (int ch = g * kGroup; ch < (g + 1) * kGroup; ++ch) {
        scale[size_t(t) * head_dim + ch] = s;
        sigma2 += q[ch] * q[ch] * s * s / 12;
      }
    }
    radius[t] = radius_factor * tier_b_radius(sm_scale * sm_scale * sigma2, n_tokens, delta_loc);
  }
  DitherRun run{0, 0, 0};
  int64_t failed_draws = 0;
  for (int draw = 0; draw < n_draws; ++draw) {
    bool failed = false;
    for (int t = 0; t < n_tokens; ++t) {
      double dot = 0;
      for (int ch = 0; ch < head_dim; ++ch) {
        const size_t i = size_t(t) * head_dim + ch;
        const double s = scale[i], xi = rng.uniform(-0.5, 0.5);
        const double level = std::nearbyint(x[i] / s + xi);
        if (std::abs(level) > 127) ++run.clipped;
        const double residual = s * (level - xi) - x[i];  // x^ - x
        run.max_residual_steps = std::max(run.max_residual_steps, std::abs(residual) / s);
        dot += q[ch] * residual;
      }
      if (std::abs(sm_scale * dot) > radius[t]) failed = true;
    }
    failed_draws += failed;
  }
  run.fraction = double(failed_draws) / n_draws;
  return run;
}

TEST(TierB, DitherMonteCarloStaysWithinDelta) {
  constexpr double kDeltaLoc = 0.05;
  constexpr int kDraws = 20000;
  for (int n_tokens : {1, 3, 17, 64}) {
    const DitherRun run = dither_violation_fraction(n_tokens, 128, kDraws, kDeltaLoc, 1.0,
                                                    1000 + n_tokens);
    std::printf("Tier B, S = %d, %d draws: observed failure fraction %.5f (delta_loc %.2f)\n",
                n_tokens, kDraws, run.fraction, kDeltaLoc);
    EXPECT_EQ(run.clipped, 0);
    EXPECT_LE(run.max_residual_steps, 0.5 + 1e-12);
    // The Lemma 2 union bound gives at most delta_loc; 3 standard errors below it.
    EXPECT_LE(run.fraction, kDeltaLoc - 3 * std::sqrt(kDeltaLoc * (1 - kDeltaLoc) / kDraws))
        << n_tokens;
    // Power: half the radius fails far more often than delta_loc.
    const DitherRun half = dither_violation_fraction(n_tokens, 128, 4000, kDeltaLoc, 0.5,
                                                     2000 + n_tokens);
    EXPECT_GT(half.fraction, 2 * kDeltaLoc) << n_tokens;
  }
}

// The same check on the codec's dither8 pages (src/codec/lossy_page.h): each draw encodes the
// same block at another block position, which regenerates its dither. The radius adds the
// codec's deterministic slack sm_scale sum_c |q_c| s_c kDither8Slack (its 2^8-cell dither);
// outlier pairs are exact and leave sigma2.
struct Dither8Run {
  double fraction;
  int64_t outlier_errors;  // nonzero residuals on outlier channels (must be 0)
};

Dither8Run dither8_violation_fraction(int block_tokens, int n_outlier_pairs, int n_draws,
                                      double delta_loc, double radius_factor, uint64_t seed) {
  constexpr int kHeadDim = 128;
  Rng rng(seed);
  const double sm_scale = 1 / std::sqrt(double(kHeadDim));
  std::vector<double> q(kHeadDim);
  for (double& v : q) v = (rng.coin() ? 1 : -1) * rng.uniform(2, 3);
  std::vector<uint16_t> x(size_t(block_tokens) * kHeadDim);
  std::vector<float> x_float(x.size());
  const int massive_pair = rng.integer(0, kHeadDim / 2 - 1);
  for (int t = 0; t < block_tokens; ++t)
    for (int ch = 0; ch < kHeadDim; ++ch) {
      double v = rng.normal() * rng.log_uniform(0.1, 3);
      if (ch == 2 * massive_pair) v *= 40;
      const size_t i = size_t(t) * kHeadDim + ch;
      x[i] = format::float_to_bf16(float(v));
      x_float[i] = format::bf16_to_float(x[i]);
    }
  std::vector<uint16_t> pairs(static_cast<size_t>(n_outlier_pairs));
  codec::select_outlier_pairs(x_float.data(), block_tokens, kHeadDim,
                              codec::RopePairing::kInterleaved, n_outlier_pairs, pairs.data());
  std::vector<uint8_t> outlier(kHeadDim, 0);
  for (uint16_t pair : pairs) outlier[2 * pair] = outlier[2 * pair + 1] = 1;

  codec::LossyPageSpec spec;
  spec.scheme = codec::LossyScheme::kDither8;
  spec.key = true;
  spec.block_tokens = block_tokens;
  spec.head_dim = kHeadDim;
  spec.pairing = codec::RopePairing::kInterleaved;
  spec.dither_key = codec::dither8_key(5, true, 2);
  spec.n_outlier_pairs = n_outlier_pairs;
  spec.outlier_pairs = pairs.data();
  std::vector<uint8_t> page(codec::lossy_page_bytes(spec));
  constexpr int kGroups = kHeadDim / codec::kQuantGroup;
  std::vector<float> recon(x.size()), scales(size_t(block_tokens) * kGroups);

  Dither8Run run{0, 0};
  int64_t failed_draws = 0;
  std::vector<double> radius(block_tokens);
  for (int draw = 0; draw < n_draws; ++draw) {
    const uint32_t slot = uint32_t(draw);
    EXPECT_TRUE(codec::lossy_encode_page_ref(spec, slot, x.data(), page.data()));
    codec::lossy_decode_page_ref(spec, slot, page.data(), recon.data());
    codec::dither8_scales(spec, page.data(), scales.data());
    bool failed = false;
    for (int t = 0; t < block_tokens; ++t) {
      double sigma2 = 0, slack = 0, dot = 0;
      for (int ch = 0; ch < kHeadDim; ++ch) {
        const size_t i = size_t(t) * kHeadDim + ch;
        const double residual = double(recon[i]) - double(x_float[i]);
        dot += q[ch] * residual;
        if (outlier[ch]) {
          run.outlier_errors += residual != 0;
          continue;
        }
        const double s = scales[size_t(t) * kGroups + ch / codec::kQuantGroup];
        sigma2 += q[ch] * q[ch] * s * s / 12;
        slack += std::abs(q[ch]) * s * double(codec::kDither8Slack);
      }
      const double u = tier_b_radius(sm_scale * sm_scale * sigma2, block_tokens, delta_loc) +
                       sm_scale * slack;
      if (std::abs(sm_scale * dot) > radius_factor * u) failed = true;
    }
    failed_draws += failed;
  }
  run.fraction = double(failed_draws) / n_draws;
  return run;
}

TEST(TierB, Dither8PagesStayWithinDelta) {
  constexpr double kDeltaLoc = 0.05;
  constexpr int kDraws = 10000;
  for (int block_tokens : {1, 17})
    for (int n_outlier_pairs : {0, 4}) {
      const Dither8Run run = dither8_violation_fraction(block_tokens, n_outlier_pairs, kDraws,
                                                        kDeltaLoc, 1.0, 3000 + block_tokens);
      std::printf("Tier B dither8 pages, S = %d, m = %d, %d draws: observed failure fraction "
                  "%.5f (delta_loc %.2f)\n",
                  block_tokens, n_outlier_pairs, kDraws, run.fraction, kDeltaLoc);
      EXPECT_EQ(run.outlier_errors, 0);
      EXPECT_LE(run.fraction, kDeltaLoc - 3 * std::sqrt(kDeltaLoc * (1 - kDeltaLoc) / kDraws))
          << block_tokens << " " << n_outlier_pairs;
      const Dither8Run half = dither8_violation_fraction(block_tokens, n_outlier_pairs, 2000,
                                                         kDeltaLoc, 0.5, 4000 + block_tokens);
      EXPECT_GT(half.fraction, 2 * kDeltaLoc) << block_tokens << " " << n_outlier_pairs;
    }
}

}  // namespace
}  // namespace certkv::gate
