#include "index/top_p.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

using Logits = std::vector<float>;

// The buckets and weights stated in top_p.h, recomputed here from the contract: the bucket by
// std::floor, the weights by the formulas at s (not by shifting the s = 63 tables).
struct Contract {
  std::vector<int> a;          // a_t
  std::vector<uint64_t> L, U;  // L(a_t), U(a_t)
  int s = 0;
  float l_max = 0;
};

uint64_t formula_upper(int a, int s) {
  return static_cast<uint64_t>(std::ceil(std::ldexp(
      std::exp(-double(a) * (1.0 - std::ldexp(1.0, -23)) / 256.0) * (1.0 + std::ldexp(1.0, -50)), s)));
}
uint64_t formula_lower(int a, int s) {
  if (a == kTopPGapCap) return 0;
  return static_cast<uint64_t>(std::floor(std::ldexp(
      std::exp(-double(a + 1) * (1.0 + std::ldexp(1.0, -23)) / 256.0) * (1.0 - std::ldexp(1.0, -50)), s)));
}

int contract_bucket(float l, float l_max) {
  const float g = (l_max - l) * 256.0f;
  return g < float(kTopPGapCap) ? static_cast<int>(std::floor(g)) : kTopPGapCap;
}

Contract contract_of(const Logits& logits) {
  const auto n = static_cast<int64_t>(logits.size());
  Contract out;
  int c = 0;
  while ((int64_t{1} << c) < n) ++c;
  out.s = 63 - c;
  out.l_max = *std::max_element(logits.begin(), logits.end());
  std::map<int, std::pair<uint64_t, uint64_t>> memo;  // bucket -> (L, U)
  for (float l : logits) {
    const int a = contract_bucket(l, out.l_max);
    auto it = memo.find(a);
    if (it == memo.end()) it = memo.emplace(a, std::make_pair(formula_lower(a, out.s), formula_upper(a, out.s))).first;
    out.a.push_back(a);
    out.L.push_back(it->second.first);
    out.U.push_back(it->second.second);
  }
  return out;
}

// Exactly: G >= p * Z. With p = m * 2^-shift (m an integer): m * Z <= G * 2^shift.
bool reaches_p(uint64_t G, uint64_t Z, double p) {
  int e = 0;
  const double f = std::frexp(p, &e);
  const auto m = static_cast<uint64_t>(std::ldexp(f, 53));
  const int shift = 53 - e;
  const unsigned __int128 mZ = static_cast<unsigned __int128>(m) * Z;
  if (shift >= 128) return G >= 1;
  const unsigned __int128 q = mZ >> shift;
  const bool exact = (mZ - (q << shift)) == 0;
  return q < G || (q == G && exact);
}

// lower and upper (top_p.h) of the tokens at or above bucket b.
std::pair<uint64_t, uint64_t> lower_upper(const Contract& c, int b) {
  uint64_t lower = 0, upper = 0;
  for (size_t t = 0; t < c.a.size(); ++t) {
    if (c.a[t] <= b) lower += c.L[t];
    else upper += c.U[t];
  }
  return {lower, upper};
}

// The exact softmax mass of {t : a_t <= b} (long double; 0 for b < 0).
long double exact_mass(const Logits& logits, const Contract& c, int b) {
  long double taken = 0, total = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const long double w = std::exp(static_cast<long double>(logits[t]) - static_cast<long double>(c.l_max));
    total += w;
    if (c.a[t] <= b) taken += w;
  }
  return taken / total;
}

struct Selected {
  TopPSelection selection;
  std::vector<uint8_t> mask;
};

Selected run_search(const Logits& logits, double p) {
  Selected r;
  r.mask.assign(logits.size(), 7);
  r.selection = top_p_select(logits.data(), static_cast<int64_t>(logits.size()), p, r.mask.data());
  return r;
}

Selected run_ref(const Logits& logits, double p) {
  Selected r;
  r.mask.assign(logits.size(), 7);
  r.selection = top_p_select_ref(logits.data(), static_cast<int64_t>(logits.size()), p, r.mask.data());
  return r;
}

// Checks everything the contract promises for one (logits, p); returns the search's run.
Selected check_case(const Logits& logits, double p, const std::string& what) {
  SCOPED_TRACE(what + " n=" + std::to_string(logits.size()) + " p=" + std::to_string(p));
  const Selected ref = run_ref(logits, p);
  const Selected got = run_search(logits, p);
  EXPECT_EQ(got.mask, ref.mask);
  EXPECT_EQ(std::bit_cast<uint32_t>(got.selection.threshold), std::bit_cast<uint32_t>(ref.selection.threshold));
  EXPECT_EQ(got.selection.bucket, ref.selection.bucket);
  EXPECT_EQ(got.selection.n_selected, ref.selection.n_selected);
  EXPECT_EQ(got.selection.mass, ref.selection.mass);
  EXPECT_EQ(got.selection.n_boundary, ref.selection.n_boundary);

  // The selection is {t : a_t <= B} = {t : logits[t] >= theta}, B the first bucket that passes.
  const Contract c = contract_of(logits);
  const int B = got.selection.bucket;
  const float theta = got.selection.threshold;
  int64_t n_selected = 0, in_bucket = 0;
  int previous = -1;  // the nonempty bucket before B
  for (size_t t = 0; t < logits.size(); ++t) {
    EXPECT_EQ(got.mask[t], c.a[t] <= B ? 1 : 0) << "not the bucket set at t=" << t;
    EXPECT_EQ(got.mask[t], logits[t] >= theta ? 1 : 0) << "not the threshold set at t=" << t;
    n_selected += got.mask[t];
    in_bucket += c.a[t] == B;
    if (c.a[t] < B) previous = std::max(previous, c.a[t]);
  }
  EXPECT_GE(in_bucket, 1) << "the threshold bucket is empty";
  EXPECT_EQ(got.selection.n_selected, n_selected);
  EXPECT_EQ(got.selection.n_boundary, in_bucket);
  EXPECT_LE(contract_bucket(theta, c.l_max), B);
  if (theta != -FLT_MAX) {
    EXPECT_GT(contract_bucket(std::nextafter(theta, -INFINITY), c.l_max), B) << "theta is not the bucket's lowest float";
  }
  const auto [lower, upper] = lower_upper(c, B);
  EXPECT_TRUE(reaches_p(lower, lower + upper, p)) << "B does not pass";
  if (previous >= 0) {
    const auto [lower_before, upper_before] = lower_upper(c, previous);
    EXPECT_FALSE(reaches_p(lower_before, lower_before + upper_before, p)) << "an earlier bucket passes";
  }
  EXPECT_GE(got.selection.mass, p);
  EXPECT_EQ(got.selection.mass,
            static_cast<double>(static_cast<long double>(lower) / static_cast<long double>(lower + upper)));

  // The guarantee: exact mass >= p (the exact Top-p set is inside), and without its threshold
  // bucket the set's exact mass m' has (1 - p) m' e^(-1/256) < p (1 - m') e^(1/256) (top_p.h; the
  // factors 1 -+ 1e-4 hold the tables' margins, n 2^-s the units' rounding).
  const long double m = exact_mass(logits, c, B);
  EXPECT_GE(m, static_cast<long double>(p) - 1e-12L) << "the selection holds less than p";
  const long double m_before = exact_mass(logits, c, B - 1);
  const long double slack = static_cast<long double>(logits.size()) * std::ldexp(1.0L, -c.s) + 1e-15L;
  EXPECT_LT((1 - p) * m_before * std::exp(-1.0L / 256) * (1 - 1e-4L),
            p * (1 - m_before) * std::exp(1.0L / 256) * (1 + 1e-4L) + slack)
      << "the threshold bucket was not needed";
  return got;
}

// Scores with a shape: flat, peaked, heavy-tailed, integer-valued (ties), few distinct values.
Logits random_logits(std::mt19937_64& rng, int64_t n, int shape) {
  Logits l(static_cast<size_t>(n));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::cauchy_distribution<float> cauchy(0.0f, 2.0f);
  std::uniform_int_distribution<int> few(0, 3);
  for (float& x : l) {
    switch (shape) {
      case 0: x = uniform(rng); break;
      case 1: x = 12.0f * normal(rng); break;
      case 2: x = std::clamp(cauchy(rng), -1e6f, 1e6f); break;
      case 3: x = std::round(3.0f * normal(rng)); break;
      default: {  // four values, zero drawn as +0 or -0 (equal scores, different bits)
        const int v = few(rng);
        x = v == 0 && (rng() & 1) != 0 ? -0.0f : static_cast<float>(v);
        break;
      }
    }
  }
  return l;
}

double random_p(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  switch (rng() % 4) {
    case 0: return std::ldexp(1.0, -static_cast<int>(rng() % 60) - 1);   // near 0
    case 1: return 1.0 - std::ldexp(1.0, -static_cast<int>(rng() % 52) - 1);  // near 1
    default: return std::max(unit(rng), std::numeric_limits<double>::denorm_min());
  }
}

TEST(TopP, KnownAnswerOnIntegerLogits) {
  // Weights e^3, e^2, e^1, e^0 over Z = e^3 + e^2 + e + 1: masses 0.6439, 0.8808, 0.9679, 1.
  // The gaps are whole logits (256 buckets apart); the certified lower bounds of those masses
  // (0.6430, 0.8804, 0.9678) decide the same sets.
  const Logits logits = {1.0f, 3.0f, 0.0f, 2.0f};
  const std::vector<std::pair<double, std::vector<uint8_t>>> cases = {
      {0.5, {0, 1, 0, 0}}, {0.7, {0, 1, 0, 1}}, {0.9, {1, 1, 0, 1}}, {0.98, {1, 1, 1, 1}}};
  for (const auto& [p, expected] : cases) {
    const Selected r = check_case(logits, p, "known answer");
    EXPECT_EQ(r.mask, expected) << "p=" << p;
  }
}

TEST(TopP, TiesAtTheBoundaryAreAllSelected) {
  // Top token alone has mass e^2 / (e^2 + 3 e) = 0.4754; with the tie group at 1: everything.
  const Logits logits = {1.0f, 2.0f, 1.0f, 1.0f};
  const Selected r = check_case(logits, 0.6, "tie group");
  EXPECT_EQ(r.selection.n_selected, 4);
  EXPECT_EQ(r.selection.bucket, 256);  // one logit below the top
  // theta is the lowest float of bucket 256, a little below the tied logits.
  EXPECT_EQ(r.selection.threshold, top_p_bucket_threshold(2.0f, 256));
  EXPECT_GT(r.selection.threshold, 2.0f - 257.0f / 256.0f);
  EXPECT_LE(r.selection.threshold, 1.0f);
  EXPECT_EQ(check_case(logits, 0.4, "above the tie").selection.n_selected, 1);
}

TEST(TopP, AllEqualScoresSelectEverything) {
  for (int64_t n : {1, 2, 3, 16, 17, 129, 501, 3771}) {
    const Logits logits(static_cast<size_t>(n), -4.25f);
    for (double p : {1e-300, 0.01, 0.5, 0.999, 1.0}) {
      const Selected r = check_case(logits, p, "all equal");
      EXPECT_EQ(r.selection.n_selected, n);
      EXPECT_EQ(r.selection.mass, 1.0);
    }
  }
}

TEST(TopP, SingleDominantToken) {
  for (int64_t n : {2, 3, 17, 129, 501, 3771}) {
    Logits logits(static_cast<size_t>(n), 0.0f);
    logits[static_cast<size_t>(n / 2)] = 60.0f;  // the others share mass below n * e^-60
    for (double p : {1e-9, 0.5, 0.999999}) {
      const Selected r = check_case(logits, p, "dominant");
      EXPECT_EQ(r.selection.n_selected, 1);
      EXPECT_EQ(r.mask[static_cast<size_t>(n / 2)], 1);
    }
  }
}

TEST(TopP, PNearZeroSelectsTheTopToken) {
  std::mt19937_64 rng(11);
  for (int64_t n : {1, 2, 3, 17, 129, 501, 3771}) {
    Logits logits = random_logits(rng, n, 0);
    logits[0] = 5.0f;  // a unique maximum
    for (double p : {std::numeric_limits<double>::denorm_min(), 1e-300, 1e-12}) {
      const Selected r = check_case(logits, p, "p near 0");
      EXPECT_EQ(r.selection.n_selected, 1);
      EXPECT_EQ(r.mask[0], 1);
    }
  }
}

TEST(TopP, POneSelectsEveryTokenEvenWeightlessOnes) {
  std::mt19937_64 rng(12);
  for (int64_t n : {1, 2, 3, 17, 129, 501, 3771}) {
    for (int shape = 0; shape < 5; ++shape) {
      Logits logits = random_logits(rng, n, shape);
      logits[0] = -std::numeric_limits<float>::max();  // exp underflows to 0 in double
      logits[static_cast<size_t>(n - 1)] = std::numeric_limits<float>::max();
      const Selected r = check_case(logits, 1.0, "p = 1");
      EXPECT_EQ(r.selection.n_selected, n);
      EXPECT_EQ(r.selection.mass, 1.0);
    }
  }
}

// >= 10^4 random cases over ragged n, five score shapes, p near 0, near 1, uniform, and p placed
// exactly on, just below and just above the mass of a selected set (the boundary).
TEST(TopP, SearchEqualsReferenceOnRandomInputs) {
  const std::vector<int64_t> sizes = {1, 2, 3, 16, 17, 129, 501, 3771};
  int cases = 0;
  for (uint64_t seed = 0; seed < 3000; ++seed) {
    std::mt19937_64 rng(seed);
    const int64_t n = sizes[seed % sizes.size()];
    const Logits logits = random_logits(rng, n, static_cast<int>(seed / sizes.size() % 5));
    const double p = random_p(rng);
    const double m = check_case(logits, p, "random seed " + std::to_string(seed)).selection.mass;
    check_case(logits, m, "on the boundary");
    check_case(logits, std::nextafter(m, 0.0), "below the boundary");
    if (m < 1.0) check_case(logits, std::nextafter(m, 1.0), "above the boundary");
    cases += m < 1.0 ? 4 : 3;
  }
  EXPECT_GE(cases, 10000);
}

TEST(TopP, SearchEqualsReferenceOnLongContexts) {
  for (uint64_t seed = 0; seed < 10; ++seed) {
    std::mt19937_64 rng(1000 + seed);
    const Logits logits = random_logits(rng, 100000, static_cast<int>(seed % 5));
    for (double p : {0.5, 0.9, 0.99}) check_case(logits, p, "n = 100000");
  }
}

TEST(TopP, SelectedSetGrowsWithP) {
  std::mt19937_64 rng(13);
  for (int64_t n : {3, 17, 129, 501}) {
    for (int shape = 0; shape < 5; ++shape) {
      const Logits logits = random_logits(rng, n, shape);
      Selected previous = run_search(logits, 1e-6);
      for (double p = 0.02; p <= 1.0; p += 0.02) {
        const Selected r = check_case(logits, std::min(p, 1.0), "monotone");
        EXPECT_LE(r.selection.threshold, previous.selection.threshold);
        EXPECT_GE(r.selection.mass, previous.selection.mass);
        for (size_t t = 0; t < logits.size(); ++t) EXPECT_GE(r.mask[t], previous.mask[t]);
        previous = r;
      }
    }
  }
}

// Quantization never drops a token that exact Top-p keeps. The top bucket holds the maximum and
// 1000 tokens just inside its lower edge (gap 0.999 / 256), 100 tokens sit exactly on the upper
// edge of bucket 1280 (gap 5): counting every token of a bucket at its bucket's top weight would
// overstate the top bucket's mass past p and stop there, although its exact mass is below p.
TEST(TopP, NeverDropsATokenThatExactTopPKeeps) {
  Logits logits(1101, -5.0f);
  logits[0] = 0.0f;
  const float inner = -0.999f / 256.0f;
  for (int i = 1; i <= 1000; ++i) logits[size_t(i)] = inner;
  const long double w_inner = std::exp(static_cast<long double>(inner)), w_far = std::exp(-5.0L);
  const long double exact_top = (1 + 1000 * w_inner) / (1 + 1000 * w_inner + 100 * w_far);
  const long double top_edge = 1001.0L / (1001 + 100 * w_far);
  const double p = static_cast<double>((exact_top + top_edge) / 2);
  ASSERT_LT(exact_top, p);  // exact Top-p needs the far tokens
  ASSERT_GT(top_edge, p);   // the top-edge count would not
  const Selected r = check_case(logits, p, "adversarial edges");
  EXPECT_EQ(r.selection.n_selected, 1101);
  EXPECT_EQ(r.selection.bucket, 1280);
}

// Gaps on and next to bucket edges: l_max - a / 256 lies in bucket a; with l_max = 0 (the
// subtraction exact) the next float above it lies in a - 1 and is theta(a - 1); elsewhere the
// subtraction rounds floats just above the edge back onto it, and theta(a - 1) is the first float
// that lands below (within the rounding of the gap and of l_max); the cap.
TEST(TopP, BucketsAndThresholdAtTheEdges) {
  for (float l_max : {0.0f, 1.0f, -3.5f, 1000.0f}) {
    for (int a : {1, 2, 255, 256, 257, 1280, kTopPGapCap - 1, kTopPGapCap}) {
      const float edge = l_max - float(a) / 256.0f;  // exact: l_max and a / 256 on a 2^-8 grid
      ASSERT_EQ(edge + float(a) / 256.0f, l_max);
      EXPECT_EQ(top_p_gap_bucket(edge, l_max), a) << l_max << " " << a;
      const float theta = top_p_bucket_threshold(l_max, a - 1);
      EXPECT_GT(theta, edge);
      EXPECT_LT(double(theta) - double(edge), std::ldexp(1.0, -13)) << l_max << " " << a;  // 2 ulp of 1000
      EXPECT_EQ(top_p_gap_bucket(theta, l_max), a - 1) << l_max << " " << a;
      EXPECT_EQ(top_p_gap_bucket(std::nextafter(theta, -INFINITY), l_max), a) << l_max << " " << a;
      if (l_max == 0.0f) {
        EXPECT_EQ(theta, std::nextafter(edge, INFINITY)) << a;
      }
    }
    EXPECT_EQ(top_p_gap_bucket(l_max, l_max), 0);
    EXPECT_EQ(top_p_gap_bucket(l_max - 1e30f, l_max), kTopPGapCap);
    EXPECT_EQ(top_p_gap_bucket(-FLT_MAX, l_max), kTopPGapCap);
    EXPECT_EQ(top_p_bucket_threshold(l_max, kTopPGapCap), -FLT_MAX);
  }
  // Random maxima and buckets: theta is in bucket B and the float below it is not.
  std::mt19937_64 rng(21);
  std::normal_distribution<float> normal(0.0f, 30.0f);
  std::uniform_int_distribution<int> any_bucket(0, kTopPGapCap);
  for (int i = 0; i < 2000; ++i) {
    const float l_max = normal(rng) * (i % 3 == 0 ? 1e4f : 1.0f);
    const int B = any_bucket(rng);
    const float theta = top_p_bucket_threshold(l_max, B);
    EXPECT_LE(top_p_gap_bucket(theta, l_max), B);
    if (theta != -FLT_MAX) {
      EXPECT_GT(top_p_gap_bucket(std::nextafter(theta, -INFINITY), l_max), B);
    }
  }
}

// top_p_mass: lower / total rounded to the nearest double, ties to even, checked against its
// two neighbours in exact integers (x 2^63 every double involved is an integer).
TEST(TopP, MassIsTheRoundedQuotient) {
  EXPECT_EQ(top_p_mass(1, 2), 0.5);
  EXPECT_EQ(top_p_mass(3, 4), 0.75);
  EXPECT_EQ(top_p_mass(7, 7), 1.0);
  EXPECT_EQ(top_p_mass(1, 3), 1.0 / 3.0);
  EXPECT_EQ(top_p_mass(1, UINT64_MAX), std::ldexp(1.0, -64));
  auto scaled = [](double x) {  // x 2^63, for doubles in [2^-10, 1]
    int e = 0;
    const double f = std::frexp(x, &e);
    return static_cast<unsigned __int128>(std::ldexp(f, 53)) << (e - 53 + 63);
  };
  auto even = [](double x) {
    int e = 0;
    return (static_cast<uint64_t>(std::ldexp(std::frexp(x, &e), 53)) & 1) == 0;
  };
  std::mt19937_64 rng(22);
  for (int i = 0; i < 100000; ++i) {
    const uint64_t total = (rng() >> (4 + rng() % 50)) | 1024;  // below 2^60
    const uint64_t lower = total - rng() % (total - total / 512);  // lower / total >= 2^-9
    const double got = top_p_mass(lower, total);
    ASSERT_GE(got, std::ldexp(1.0, -10));
    // 2 lower 2^63 against (x + neighbour) 2^63 total: below 2^124.
    const unsigned __int128 twice = static_cast<unsigned __int128>(lower) << 64;
    const unsigned __int128 g = scaled(got);
    const unsigned __int128 below = (g + scaled(std::nextafter(got, 0.0))) * total;
    ASSERT_TRUE(twice > below || (twice == below && even(got)))
        << lower << " / " << total << " rounds below " << got;
    if (got < 1.0) {
      const unsigned __int128 above = (g + scaled(std::nextafter(got, 2.0))) * total;
      ASSERT_TRUE(twice < above || (twice == above && even(got)))
          << lower << " / " << total << " rounds above " << got;
    }
  }
}

TEST(TopP, WideAndClusteredScoresEqualTheReference) {
  // Scores spread over the whole float range with clusters of adjacent floats (one gap bucket
  // holds a whole cluster, taken whole).
  Logits logits;
  for (float base : {-std::numeric_limits<float>::max(), -1.0f, 0.0f, 1e-30f, 1.0f, 7.0f}) {
    float x = base;
    for (int i = 0; i < 5; ++i) {
      logits.push_back(x);
      x = std::nextafter(x, 0.0f);
    }
  }
  logits.push_back(std::numeric_limits<float>::denorm_min());
  logits.push_back(-std::numeric_limits<float>::denorm_min());
  std::vector<double> ps;
  for (double p = 1e-3; p < 1.0; p += 0.01) ps.push_back(p);
  for (int k = 1; k < 50; ++k) ps.push_back(1.0 - std::ldexp(1.0, -k));
  int64_t max_boundary = 0;
  for (double p : ps) max_boundary = std::max(max_boundary, check_case(logits, p, "wide").selection.n_boundary);
  EXPECT_GE(max_boundary, 5);  // a cluster of adjacent floats shares a bucket
}

TEST(TopP, TheThresholdBucketIsTakenWhole) {
  // All equal: one bucket, every token in it.
  Logits equal(1000, 0.25f);
  EXPECT_EQ(check_case(equal, 0.5, "equal").selection.n_boundary, 1000);
  // One dominant token 50 logits above the rest: at p = 0.5 the top bucket holds only it; at
  // p = 1 the boundary is the capped bucket of the 999 others.
  Logits dominant(1000, -50.0f);
  dominant[17] = 0.0f;
  const Selected top = check_case(dominant, 0.5, "dominant");
  EXPECT_EQ(top.selection.n_boundary, 1);
  EXPECT_EQ(top.selection.n_selected, 1);
  const Selected all = check_case(dominant, 1.0, "dominant p=1");
  EXPECT_EQ(all.selection.n_boundary, 999);
  EXPECT_EQ(all.selection.n_selected, 1000);
  // Distinct logits 1/32 apart land in distinct buckets: one token in the threshold bucket.
  Logits spread;
  for (int i = 0; i < 300; ++i) spread.push_back(float(i) / 32.0f);
  for (double p : {0.1, 0.5, 0.9}) EXPECT_EQ(check_case(spread, p, "spread").selection.n_boundary, 1);
}

TEST(TopP, RejectsBadInput) {
  const Logits logits = {0.0f, 1.0f, 2.0f, 3.0f};
  std::vector<uint8_t> mask(4);
  auto expect_invalid = [&](auto select, const float* l, int64_t n, double p, uint8_t* m,
                            const std::string& names) {
    try {
      select(l, n, p, m);
      ADD_FAILURE() << "accepted bad input, expected an error naming " << names;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
    }
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (auto select : {&top_p_select, &top_p_select_ref}) {
    for (double p : {0.0, -0.5, 1.0000001, 2.0, nan}) {
      expect_invalid(select, logits.data(), 4, p, mask.data(), "p must be in (0, 1]");
    }
    expect_invalid(select, logits.data(), 0, 0.5, mask.data(), "n must be >= 1");
    expect_invalid(select, logits.data(), -3, 0.5, mask.data(), "n must be >= 1");
    expect_invalid(select, nullptr, 4, 0.5, mask.data(), "logits is null");
    expect_invalid(select, logits.data(), 4, 0.5, nullptr, "mask is null");
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      Logits with_bad = logits;
      with_bad[2] = bad;
      expect_invalid(select, with_bad.data(), 4, 0.5, mask.data(), "logits[2] is not finite");
    }
  }
}

// top_p_widen: exactly the unselected tokens with fl(l + fl(m norm)) >= theta join, with norms
// read at a stride; margin 0 adds nothing; bad arguments are refused.
TEST(TopP, WidenAddsTheTokensWhoseMarginReachesTheThreshold) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_real_distribution<float> uniform(0.f, 3.f);
  for (int64_t n : {1, 2, 7, 64, 1000, 4097}) {
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = normal(rng);
    const int64_t stride = 3;  // the norm is one field of a 3-float record
    std::vector<float> records(static_cast<size_t>(n * stride));
    for (float& r : records) r = uniform(rng);
    std::vector<uint8_t> mask(static_cast<size_t>(n));
    const TopPSelection sel = top_p_select(logits.data(), n, 0.7, mask.data());
    const std::vector<uint8_t> top_p_mask = mask;
    EXPECT_EQ(top_p_widen(logits.data(), n, sel.threshold, 0.f, records.data() + 1, stride, mask.data()), 0);
    EXPECT_EQ(mask, top_p_mask);
    int64_t previous = 0;
    for (float m : {0.1f, 0.5f, 2.f}) {
      std::vector<uint8_t> widened = top_p_mask;
      const int64_t added = top_p_widen(logits.data(), n, sel.threshold, m, records.data() + 1, stride, widened.data());
      int64_t expected = 0;
      for (int64_t t = 0; t < n; ++t) {
        volatile float margin = m * records[static_cast<size_t>(t * stride + 1)];
        volatile float reach = logits[static_cast<size_t>(t)] + margin;
        const bool take = top_p_mask[static_cast<size_t>(t)] != 0 || reach >= sel.threshold;
        ASSERT_EQ(widened[static_cast<size_t>(t)], take ? 1 : 0) << "n " << n << " m " << m << " t " << t;
        expected += top_p_mask[static_cast<size_t>(t)] == 0 && take;
      }
      EXPECT_EQ(added, expected);
      EXPECT_GE(added, previous);  // larger margins add more
      previous = added;
    }
    if (n >= 1000) {
      EXPECT_GT(previous, 0);
    }
  }
  std::vector<float> l{1.f, 0.f}, norms{1.f, 1.f};
  std::vector<uint8_t> mask{1, 0};
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, -0.5f, norms.data(), 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, NAN, norms.data(), 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, INFINITY, norms.data(), 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, 1.f, norms.data(), 0, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), -1, 1.f, 1.f, norms.data(), 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(nullptr, 2, 1.f, 1.f, norms.data(), 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, 1.f, nullptr, 1, mask.data()), Error);
  EXPECT_THROW(top_p_widen(l.data(), 2, 1.f, 1.f, norms.data(), 1, nullptr), Error);
  EXPECT_EQ(top_p_widen(l.data(), 2, 1.f, 1.f, norms.data(), 1, mask.data()), 1);  // 0 + 1 reaches 1
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 1}));
}

// The table and target a device port reads (attention/cuda/sparse_decode_cuda): the weights at
// s = 63, shifted to any s they equal the formulas at s; ceil(p Z) exactly.
TEST(TopP, BucketWeightsAndTargetUnitsForPorts) {
  const std::vector<uint64_t>& w = top_p_bucket_weights();
  ASSERT_EQ(w.size(), 2 * size_t(kTopPBuckets));
  const uint64_t* upper = w.data();
  const uint64_t* lower = w.data() + kTopPBuckets;
  EXPECT_EQ(upper[0], (uint64_t{1} << 63) + (uint64_t{1} << 13));  // 2^63 (1 + 2^-50)
  EXPECT_EQ(upper[kTopPGapCap], 1u);
  EXPECT_EQ(lower[kTopPGapCap], 0u);
  EXPECT_EQ(lower[kTopPGapCap - 1], 0u);  // 2^63 e^-44 < 1
  for (int a = 0; a < kTopPGapCap; ++a) {
    ASSERT_GE(upper[a], upper[a + 1]) << a;  // heavier for smaller gaps
    if (upper[a] > (uint64_t{1} << 20)) {
      ASSERT_GT(upper[a], upper[a + 1]) << a;
    }
    ASSERT_LT(lower[a], upper[a]) << a;
    ASSERT_LT(lower[a], upper[a + 1]) << a;  // the bucket below starts above this one's floor
    // The two edges of a bucket are e^(1/256) apart, plus the margins.
    if (lower[a] > (uint64_t{1} << 40)) {
      ASSERT_NEAR(double(upper[a]) / double(lower[a]), std::exp(1.0 / 256.0), 1e-5) << a;
    }
  }
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1000}, int64_t{131072}, int64_t{131073},
                    int64_t{1} << 24}) {
    const int k = top_p_weight_shift(n);
    EXPECT_EQ(int64_t{1} << k >= n && (k == 0 || int64_t{1} << (k - 1) < n), true) << n;
    for (int a = 0; a <= kTopPGapCap; a += (a < 512 ? 1 : 37)) {
      ASSERT_EQ(top_p_upper_weight(upper[a], k), formula_upper(a, 63 - k)) << n << " " << a;
      ASSERT_EQ(top_p_lower_weight(lower[a], k), formula_lower(a, 63 - k)) << n << " " << a;
    }
    EXPECT_EQ(top_p_upper_weight(upper[kTopPGapCap], k), 1u);
    // n tokens of the largest weight sum below 2^64.
    EXPECT_LT(static_cast<unsigned __int128>(top_p_upper_weight(upper[0], k)) * uint64_t(n),
              static_cast<unsigned __int128>(1) << 64);
  }
  EXPECT_EQ(top_p_target_units(1.0, 12345), 12345u);
  EXPECT_EQ(top_p_target_units(0.5, 7), 4u);            // ceil(3.5)
  EXPECT_EQ(top_p_target_units(0.5, 8), 4u);            // exact
  EXPECT_EQ(top_p_target_units(0.25, uint64_t{1} << 62), uint64_t{1} << 60);
  EXPECT_EQ(top_p_target_units(0.5, UINT64_MAX), uint64_t{1} << 63);
  EXPECT_EQ(top_p_target_units(1e-30, 5), 1u);          // 0 < p Z < 1 rounds up to one unit
  EXPECT_EQ(top_p_target_units(0.1, 10), 2u);  // the double 0.1 is just above 1/10: 10 p is just above 1
  EXPECT_TRUE(top_p_reaches(3, 1, 0.75));
  EXPECT_FALSE(top_p_reaches(2, 1, 0.75));
  EXPECT_FALSE(top_p_reaches(9, 1, 0.9));  // the double 0.9 is just above 9 / 10
  EXPECT_TRUE(top_p_reaches(5, 0, 1.0));
  EXPECT_FALSE(top_p_reaches(5, 1, 1.0));
  EXPECT_THROW(top_p_target_units(0.0, 5), Error);
  EXPECT_THROW(top_p_target_units(1.5, 5), Error);
}

}  // namespace
}  // namespace certkv::index
