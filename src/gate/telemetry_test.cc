#include "gate/telemetry.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/status.h"

namespace certkv::gate {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Nearest rank: the value of rank max(1, ceil(q n)) in increasing order.
double exact_quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const int64_t n = int64_t(values.size());
  const int64_t rank = std::max<int64_t>(1, int64_t(std::ceil(q * double(n))));
  return values[size_t(rank - 1)];
}

// |estimate - exact| within the documented relative error, for values in the octave range.
void expect_quantiles_close(const Telemetry& telemetry, const std::vector<double>& values) {
  for (double q : {0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0}) {
    const double exact = exact_quantile(values, q);
    const double estimate = telemetry.quantile(q);
    EXPECT_LE(std::abs(estimate - exact), kTelemetryQuantileRelativeError * exact)
        << "q " << q << " exact " << exact << " estimate " << estimate << " n " << values.size();
  }
  EXPECT_EQ(telemetry.p50(), telemetry.quantile(0.5));
  EXPECT_EQ(telemetry.p99(), telemetry.quantile(0.99));
}

TEST(Telemetry, EmptyReportsZeros) {
  Telemetry telemetry(0.2);
  EXPECT_EQ(telemetry.cells(), 0);
  EXPECT_EQ(telemetry.offered(), 0);
  EXPECT_EQ(telemetry.coverage(), 0);
  EXPECT_EQ(telemetry.max(), 0);
  EXPECT_EQ(telemetry.p50(), 0);
  EXPECT_EQ(telemetry.p99(), 0);
  EXPECT_EQ(telemetry.overflow(), 0);
  EXPECT_EQ(telemetry.repairs(), 0);
  EXPECT_EQ(telemetry.pagein_bytes(), 0);
}

TEST(Telemetry, CountsCoverageMaxAndOverflow) {
  Telemetry telemetry(0.2);
  for (double v : {0.0, 0.05, 0.2, 0.2000001, 0.7, 1.0}) telemetry.record(v);
  telemetry.record(1.0, true);  // saturated by overflow
  telemetry.record(kInf);       // overflow without the flag
  telemetry.record(kNaN);       // never certified
  EXPECT_EQ(telemetry.offered(), 9);
  EXPECT_EQ(telemetry.cells(), 9);
  EXPECT_EQ(telemetry.covered(), 3);  // 0, 0.05 and 0.2 (<= tau)
  EXPECT_DOUBLE_EQ(telemetry.coverage(), 3.0 / 9);
  EXPECT_EQ(telemetry.overflow(), 3);
  EXPECT_EQ(telemetry.max(), 1.0);  // over finite, non-overflow cells
  EXPECT_EQ(telemetry.quantile(1.0), 1.0);
  EXPECT_EQ(telemetry.quantile(0.0), 0.0);
}

TEST(Telemetry, OverflowIsNeverCoveredEvenForRiskRanking) {
  Telemetry telemetry(1e9);  // tau >= 1: risk ranking
  telemetry.record(0.5, true);
  telemetry.record(3.0);
  EXPECT_EQ(telemetry.covered(), 1);
  EXPECT_EQ(telemetry.overflow(), 1);
  EXPECT_EQ(telemetry.max(), 3.0);
}

TEST(Telemetry, PercentilesMatchSortedValuesOnKnownData) {
  // Integers 1..n, a shuffled order: the nearest-rank quantile is ceil(q n).
  for (int n : {1, 3, 16, 17, 100, 1001}) {
    std::vector<double> values;
    for (int i = 1; i <= n; ++i) values.push_back(i);
    std::shuffle(values.begin(), values.end(), std::mt19937_64(n));
    Telemetry telemetry(0.5);
    for (double v : values) telemetry.record(v);
    expect_quantiles_close(telemetry, values);
    EXPECT_EQ(telemetry.quantile(1.0), n);
    EXPECT_EQ(telemetry.quantile(0.0), 1);
    EXPECT_EQ(telemetry.max(), n);
  }
}

TEST(Telemetry, PercentilesOfMeterLikeData) {
  std::mt19937_64 gen(123);
  std::uniform_real_distribution<double> unit(0, 1);
  for (int n : {17, 4096, 200000}) {
    std::vector<double> values;
    for (int i = 0; i < n; ++i) {
      // Log-uniform over [1e-12, 1], plus saturated cells and raw risk scores above 1.
      const double u = unit(gen);
      values.push_back(u < 0.9    ? std::pow(10.0, -12 * unit(gen))
                       : u < 0.95 ? 1.0
                                  : 1 + 1e3 * unit(gen));
    }
    Telemetry telemetry(0.2);
    for (double v : values) telemetry.record(v);
    expect_quantiles_close(telemetry, values);
    EXPECT_EQ(telemetry.max(), *std::max_element(values.begin(), values.end()));
    int64_t covered = 0;
    for (double v : values) covered += v <= 0.2;
    EXPECT_EQ(telemetry.covered(), covered);
  }
}

TEST(Telemetry, PercentilesAtBucketEdgesAndConstantData) {
  // Powers of two and their neighbours sit on bucket bounds.
  std::vector<double> edges;
  for (int e = -40; e <= 10; ++e) {
    const double p = std::ldexp(1.0, e);
    edges.push_back(p);
    edges.push_back(std::nextafter(p, 0.0));
    edges.push_back(p * (1 + 1.0 / kTelemetrySubBuckets));
  }
  Telemetry telemetry(0.2);
  for (double v : edges) telemetry.record(v);
  expect_quantiles_close(telemetry, edges);

  Telemetry constant(0.2);
  for (int i = 0; i < 1000; ++i) constant.record(0.0123);
  EXPECT_EQ(constant.p50(), 0.0123);  // clamped to the recorded [min, max]
  EXPECT_EQ(constant.p99(), 0.0123);
}

TEST(Telemetry, ValuesOutsideTheOctaveRange) {
  Telemetry telemetry(0.2);
  telemetry.record(0.0);
  telemetry.record(1e-300);
  telemetry.record(1e-17);
  telemetry.record(0.5);
  telemetry.record(1e6);
  telemetry.record(1e300);
  EXPECT_EQ(telemetry.quantile(0.0), 0.0);   // the bottom bucket reports the minimum
  EXPECT_EQ(telemetry.quantile(0.5), 0.0);  // rank 3: 1e-17, reported as the minimum 0
  EXPECT_NEAR(telemetry.quantile(4.0 / 6), 0.5, 0.5 * kTelemetryQuantileRelativeError);
  EXPECT_EQ(telemetry.quantile(1.0), 1e300);  // the top bucket reports the maximum
  EXPECT_EQ(telemetry.max(), 1e300);
}

TEST(Telemetry, SampleEveryKeepsEveryKthCell) {
  Telemetry telemetry(0.2, 3);
  // Offered values 1..10: kept are the 1st, 4th, 7th and 10th.
  for (int i = 1; i <= 10; ++i) telemetry.record(i / 100.0);
  EXPECT_EQ(telemetry.offered(), 10);
  EXPECT_EQ(telemetry.cells(), 4);
  EXPECT_EQ(telemetry.max(), 0.10);
  EXPECT_EQ(telemetry.quantile(0.0), 0.01);
  EXPECT_NEAR(telemetry.quantile(0.5), 0.04, 0.04 * kTelemetryQuantileRelativeError);
  EXPECT_NEAR(telemetry.quantile(0.75), 0.07, 0.07 * kTelemetryQuantileRelativeError);
  EXPECT_EQ(telemetry.covered(), 4);

  Telemetry sampled(0.2, 32), full(0.2);
  std::mt19937_64 gen(9);
  std::uniform_real_distribution<double> unit(0, 0.4);
  std::vector<double> kept;
  for (int i = 0; i < 32 * 1000; ++i) {
    const double v = unit(gen);
    sampled.record(v);
    if (i % 32 == 0) {
      full.record(v);
      kept.push_back(v);
    }
  }
  EXPECT_EQ(sampled.cells(), 1000);
  EXPECT_EQ(sampled.covered(), full.covered());
  EXPECT_EQ(sampled.p99(), full.p99());
  expect_quantiles_close(sampled, kept);
}

TEST(Telemetry, MergeEqualsSinglePass) {
  std::mt19937_64 gen(77);
  std::uniform_real_distribution<double> unit(0, 1);
  Telemetry single(0.2), parts[3] = {Telemetry(0.2), Telemetry(0.2), Telemetry(0.2)};
  for (int i = 0; i < 30000; ++i) {
    const double v = std::pow(unit(gen), 6);
    const bool overflow = unit(gen) < 0.01;
    single.record(v, overflow);
    parts[i % 3 == 0 ? 0 : 1].record(v, overflow);  // parts[2] stays empty
  }
  single.add_repairs(5, 5 * 4096);
  parts[1].add_repairs(2, 2 * 4096);
  parts[2].add_repairs(3, 3 * 4096);
  Telemetry merged(0.2);
  for (const Telemetry& p : parts) merged.merge(p);
  EXPECT_EQ(merged.offered(), single.offered());
  EXPECT_EQ(merged.cells(), single.cells());
  EXPECT_EQ(merged.covered(), single.covered());
  EXPECT_EQ(merged.overflow(), single.overflow());
  EXPECT_EQ(merged.coverage(), single.coverage());
  EXPECT_EQ(merged.max(), single.max());
  for (double q : {0.0, 0.1, 0.5, 0.9, 0.99, 1.0})
    EXPECT_EQ(merged.quantile(q), single.quantile(q)) << q;
  EXPECT_EQ(merged.repairs(), 5);
  EXPECT_EQ(merged.pagein_bytes(), 5 * 4096);
  EXPECT_GT(single.overflow(), 0);
  EXPECT_LT(single.coverage(), 1.0);
  EXPECT_GT(single.coverage(), 0.5);
}

// The histogram holds only the buckets between the lowest and the highest recorded, growing below
// and above as values arrive: values in octave bands that move down, then up, then span the
// whole range (0, the octaves, the top bucket), read at every stage and merged from parts of
// disjoint ranges, give the quantiles of the sorted values.
TEST(Telemetry, TheHistogramGrowsBelowAndAboveItsRange) {
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> unit(0, 1);
  Telemetry one(0.2), low(0.2), high(0.2);
  std::vector<double> values;
  const auto add = [&](double v) {
    one.record(v);
    (v < 1e-6 ? low : high).record(v);
    values.push_back(v);
  };
  for (const int e : {-10, -20, -30, -5, 0, -45}) {
    for (int i = 0; i < 700; ++i) add(std::ldexp(1 + unit(gen), e - int(unit(gen) * 3)));
    expect_quantiles_close(one, values);
  }
  add(0.0);
  add(1e-300);
  add(3e4);
  add(1.0);
  EXPECT_EQ(one.quantile(0.0), 0.0);
  EXPECT_EQ(one.quantile(1.0), 3e4);
  Telemetry merged(0.2);
  merged.merge(high);
  merged.merge(low);  // a range below the one it holds
  Telemetry merged_other_way(0.2);
  merged_other_way.merge(low);
  merged_other_way.merge(high);  // and above
  for (double q : {0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0}) {
    EXPECT_EQ(merged.quantile(q), one.quantile(q)) << q;
    EXPECT_EQ(merged_other_way.quantile(q), one.quantile(q)) << q;
  }
}

// Values reach the histogram in batches: reading a quantile (which folds the pending values in)
// at any point of the recording, merging while values are pending, and copying a telemetry with
// pending values change no statistic.
TEST(Telemetry, PendingValuesCountWhereverTheyAreRead) {
  std::mt19937_64 gen(78);
  std::uniform_real_distribution<double> unit(0, 1);
  Telemetry quiet(0.2), read_often(0.2);
  std::vector<double> values;
  const int n = 3 * kTelemetryPendingValues + 17;
  for (int i = 0; i < n; ++i) {
    const double v = std::pow(unit(gen), 4);
    values.push_back(v);
    quiet.record(v);
    read_often.record(v);
    if (i % 37 == 0 || i == kTelemetryPendingValues - 1) {
      // A copy taken now holds the values recorded so far, pending ones included.
      const Telemetry snapshot = read_often;
      std::vector<double> so_far(values.begin(), values.end());
      expect_quantiles_close(snapshot, so_far);
      EXPECT_EQ(read_often.quantile(1.0), *std::max_element(so_far.begin(), so_far.end()));
    }
  }
  for (double q : {0.0, 0.01, 0.5, 0.9, 0.99, 1.0}) EXPECT_EQ(read_often.quantile(q), quiet.quantile(q)) << q;
  expect_quantiles_close(quiet, values);
  // Merging two telemetries that both hold pending values.
  Telemetry a(0.2), b(0.2), whole(0.2);
  for (int i = 0; i < n; ++i) {
    (i < kTelemetryPendingValues + 5 ? a : b).record(values[size_t(i)]);
    whole.record(values[size_t(i)]);
  }
  a.merge(b);
  for (double q : {0.0, 0.01, 0.5, 0.9, 0.99, 1.0}) EXPECT_EQ(a.quantile(q), whole.quantile(q)) << q;
  EXPECT_EQ(a.cells(), whole.cells());
  EXPECT_EQ(a.covered(), whole.covered());
}

// A sequence's telemetry keeps each cell once, in its layer; the whole is the layers' merge and
// equals one telemetry that saw every cell.
TEST(SequenceTelemetry, TheWholeIsEveryLayersCells) {
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> unit(0, 1);
  SequenceTelemetry seq(5, 0.2);
  Telemetry single(0.2);
  std::vector<int64_t> per_layer(5, 0);
  for (int step = 0; step < 300; ++step)
    for (int layer = 0; layer < 5; ++layer)
      for (int head = 0; head < 3; ++head) {
        const double v = std::pow(unit(gen), 3 + layer);
        const bool overflow = unit(gen) < 0.002;
        seq.record(layer, v, overflow);
        single.record(v, overflow);
        ++per_layer[size_t(layer)];
      }
  seq.add_repairs(2, 2, 8192);
  seq.add_repairs(4, 4, 16384);
  single.add_repairs(6, 24576);
  const Telemetry all = seq.all();
  EXPECT_EQ(all.cells(), single.cells());
  EXPECT_EQ(all.covered(), single.covered());
  EXPECT_EQ(all.overflow(), single.overflow());
  EXPECT_EQ(all.max(), single.max());
  for (double q : {0.0, 0.01, 0.5, 0.99, 1.0}) EXPECT_EQ(all.quantile(q), single.quantile(q)) << q;
  EXPECT_EQ(all.repairs(), 6);
  EXPECT_EQ(all.pagein_bytes(), 24576);
  ASSERT_EQ(seq.n_layers(), 5);
  for (int layer = 0; layer < 5; ++layer) EXPECT_EQ(seq.layers()[size_t(layer)].cells(), per_layer[size_t(layer)]);
  EXPECT_EQ(seq.layers()[2].repairs(), 2);
  seq.reset();
  EXPECT_EQ(seq.all().cells(), 0);
  EXPECT_EQ(seq.all().repairs(), 0);
  EXPECT_EQ(seq.n_layers(), 5);
  EXPECT_THROW(SequenceTelemetry(-1, 0.2), Error);
}

TEST(Telemetry, RepairsAccumulate) {
  Telemetry telemetry(0.2);
  telemetry.add_repairs(0, 0);
  telemetry.add_repairs(3, 3 * 8192);
  telemetry.add_repairs(1, 8192);
  EXPECT_EQ(telemetry.repairs(), 4);
  EXPECT_EQ(telemetry.pagein_bytes(), 4 * 8192);
}

TEST(Telemetry, RejectsBadInput) {
  EXPECT_THROW(Telemetry{-0.1}, Error);
  EXPECT_THROW(Telemetry{kNaN}, Error);
  EXPECT_THROW((Telemetry{0.2, 0}), Error);
  Telemetry telemetry(0.2);
  EXPECT_THROW(telemetry.record(-1e-9), Error);
  EXPECT_THROW(telemetry.add_repairs(-1, 0), Error);
  EXPECT_THROW(telemetry.add_repairs(1, -4096), Error);
  EXPECT_THROW(telemetry.quantile(1.5), Error);
  EXPECT_THROW(telemetry.quantile(kNaN), Error);
  EXPECT_THROW(telemetry.merge(Telemetry(0.3)), Error);
  EXPECT_THROW(telemetry.merge(Telemetry(0.2, 4)), Error);
  try {
    telemetry.merge(Telemetry(0.3));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("tau"), std::string::npos);
  }
  EXPECT_EQ(telemetry.cells(), 0);  // a rejected value is not counted
}

}  // namespace
}  // namespace certkv::gate
