#include "index/top_p.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

using Logits = std::vector<float>;

// The fixed-point weights stated in top_p.h, recomputed here from the contract.
struct ContractMasses {
  std::vector<uint64_t> W;
  uint64_t Z = 0;
  int s = 0;
};

ContractMasses contract_masses(const Logits& logits) {
  const auto n = static_cast<int64_t>(logits.size());
  ContractMasses out;
  int c = 0;
  while ((int64_t{1} << c) < n) ++c;
  out.s = 63 - c;
  const float l_max = *std::max_element(logits.begin(), logits.end());
  for (float l : logits) {
    const float gap = (l_max - l) * 64.0f;
    const int a = gap < float(kTopPGapCap) ? static_cast<int>(std::floor(gap)) : kTopPGapCap;
    const double scaled = std::ldexp(std::exp(-double(a) / 64.0), out.s);
    out.W.push_back(a == kTopPGapCap ? 1 : std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(scaled))));
    out.Z += out.W.back();
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

uint64_t weight_at_or_above(const ContractMasses& cm, const Logits& logits, float theta,
                            bool strict) {
  uint64_t G = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    if (strict ? logits[t] > theta : logits[t] >= theta) G += cm.W[t];
  }
  return G;
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
  r.selection =
      top_p_select_ref(logits.data(), static_cast<int64_t>(logits.size()), p, r.mask.data());
  return r;
}

// Checks everything the contract promises for one (logits, p); returns the search's run.
Selected check_case(const Logits& logits, double p, const std::string& what) {
  SCOPED_TRACE(what + " n=" + std::to_string(logits.size()) + " p=" + std::to_string(p));
  const Selected ref = run_ref(logits, p);
  const Selected got = run_search(logits, p);
  EXPECT_EQ(got.mask, ref.mask);
  EXPECT_EQ(got.selection.threshold, ref.selection.threshold);
  EXPECT_EQ(got.selection.n_selected, ref.selection.n_selected);
  EXPECT_EQ(got.selection.mass, ref.selection.mass);
  EXPECT_GE(got.selection.n_boundary, 1);
  EXPECT_LE(got.selection.n_boundary, int64_t(logits.size()));

  const float theta = got.selection.threshold;
  int64_t n_selected = 0;
  bool theta_is_a_score = false;
  for (size_t t = 0; t < logits.size(); ++t) {
    EXPECT_EQ(got.mask[t], logits[t] >= theta ? 1 : 0) << "not the threshold set at t=" << t;
    n_selected += got.mask[t];
    theta_is_a_score |= logits[t] == theta;
  }
  EXPECT_TRUE(theta_is_a_score);
  EXPECT_EQ(got.selection.n_selected, n_selected);

  const ContractMasses cm = contract_masses(logits);
  const uint64_t G = weight_at_or_above(cm, logits, theta, /*strict=*/false);
  const uint64_t G_without_theta = weight_at_or_above(cm, logits, theta, /*strict=*/true);
  EXPECT_TRUE(reaches_p(G, cm.Z, p)) << "selected mass below p";
  EXPECT_FALSE(reaches_p(G_without_theta, cm.Z, p)) << "not minimal: tie group at theta unneeded";
  EXPECT_GE(got.selection.mass, p);
  EXPECT_EQ(got.selection.mass,
            static_cast<double>(static_cast<long double>(G) / static_cast<long double>(cm.Z)));
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
  EXPECT_EQ(r.selection.threshold, 1.0f);
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

TEST(TopP, AgreesWithDoubleSoftmaxWithinTheFixedPointBound) {
  std::mt19937_64 rng(14);
  for (int64_t n : {17, 501, 3771}) {
    for (int shape = 0; shape < 5; ++shape) {
      const Logits logits = random_logits(rng, n, shape);
      const float l_max = *std::max_element(logits.begin(), logits.end());
      const int s = contract_masses(logits).s;
      for (double p : {0.3, 0.9, 0.999}) {
        const Selected r = run_search(logits, p);
        double selected = 0.0, total = 0.0;
        for (size_t t = 0; t < logits.size(); ++t) {
          const double w = std::exp(double{logits[t]} - double{l_max});
          total += w;
          if (r.mask[t] != 0) selected += w;
        }
        // Rounding each weight up by < 2^-s moves a mass by at most n * 2^-s (top_p.h), plus
        // the double summation error of n terms; quantizing the gaps to 1/64 scales each
        // weight by a factor in [1, e^(1/64)), so a mass moves by a factor in (e^-(1/64), e^(1/64)).
        const double bound = static_cast<double>(n) * (std::ldexp(1.0, -s) + 1e-15);
        const double gap_factor = std::exp(1.0 / 64.0);
        const double truth = selected / total;
        EXPECT_GE(truth, p / gap_factor - bound) << "n=" << n << " shape=" << shape;
        EXPECT_LE(truth, r.selection.mass * gap_factor + bound);
        EXPECT_GE(truth, r.selection.mass / gap_factor - bound);
      }
    }
  }
}

TEST(TopP, WideAndClusteredScoresEqualTheReference) {
  // Scores spread over the whole float range with clusters of adjacent floats (one gap bucket
  // holds a whole cluster; the bucket's own order decides).
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

TEST(TopP, OnlyTheBoundaryBucketIsOrdered) {
  // All equal: one bucket, every token a candidate.
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
  // Distinct logits 1/32 apart land in distinct buckets: one candidate.
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

// The table and target a device port reads (attention/cuda/sparse_decode_cuda): the weights the
// selections use, and ceil(p Z) exactly.
TEST(TopP, WeightTableAndTargetUnitsForPorts) {
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1000}, int64_t{131072}, int64_t{131073}}) {
    const std::vector<uint64_t>& w = top_p_weight_table(n);
    ASSERT_EQ(w.size(), size_t(kTopPGapCap) + 1);
    int ceil_log2 = 0;
    while ((int64_t{1} << ceil_log2) < n) ++ceil_log2;
    EXPECT_EQ(w[0], uint64_t{1} << (63 - ceil_log2)) << n;  // the largest token weighs 2^s
    EXPECT_EQ(w[size_t(kTopPGapCap)], 1u);
    EXPECT_TRUE(std::is_sorted(w.rbegin(), w.rend())) << n;  // heavier for smaller gaps
    // n tokens of the largest weight sum to at most 2^63.
    EXPECT_LE(static_cast<unsigned __int128>(w[0]) * uint64_t(n), static_cast<unsigned __int128>(1) << 63);
  }
  // A selection with these weights: mass >= p exactly when the weight reaches the target.
  const std::vector<float> logits = {3.f, 1.f, 0.5f, -2.f, 3.f};
  std::vector<uint8_t> mask(logits.size());
  const TopPSelection sel = top_p_select(logits.data(), int64_t(logits.size()), 0.7, mask.data());
  const std::vector<uint64_t>& w = top_p_weight_table(int64_t(logits.size()));
  uint64_t z = 0, taken = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const int gap = int((3.f - logits[t]) * float(kTopPGapStepsPerLogit));
    z += w[size_t(std::min(gap, kTopPGapCap))];
    if (mask[t]) taken += w[size_t(std::min(gap, kTopPGapCap))];
  }
  EXPECT_GE(taken, top_p_target_units(0.7, z));
  EXPECT_EQ(top_p_target_units(1.0, z), z);
  EXPECT_EQ(top_p_target_units(0.5, 7), 4u);            // ceil(3.5)
  EXPECT_EQ(top_p_target_units(0.5, 8), 4u);            // exact
  EXPECT_EQ(top_p_target_units(0.25, uint64_t{1} << 62), uint64_t{1} << 60);
  EXPECT_EQ(top_p_target_units(1e-30, 5), 1u);          // 0 < p Z < 1 rounds up to one unit
  EXPECT_EQ(top_p_target_units(0.1, 10), 2u);  // the double 0.1 is just above 1/10: 10 p is just above 1
  EXPECT_GE(sel.mass, 0.7);
  EXPECT_THROW(top_p_weight_table(0), Error);
  EXPECT_THROW(top_p_target_units(0.0, 5), Error);
  EXPECT_THROW(top_p_target_units(1.5, 5), Error);
}

}  // namespace
}  // namespace certkv::index
