#include "eval/audit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"

namespace certkv::eval {
namespace {

AuditCell cell(int layer, int head, int64_t step, double meter, double tv, bool overflow = false) {
  AuditCell c;
  c.layer = layer;
  c.head = head;
  c.step = step;
  c.meter = meter;
  c.tv = tv;
  c.overflow = overflow;
  return c;
}

auto key(const AuditCell& c) { return std::make_tuple(c.layer, c.head, c.step); }

void expect_rejected(const AuditCell& c, const std::string& field) {
  AuditAccumulator acc(0.2);
  try {
    acc.add(c);
    ADD_FAILURE() << "accepted a cell with a bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
  EXPECT_EQ(acc.summary().cells, 0);
}

TEST(AuditAccumulator, EmptySummary) {
  const AuditSummary s = AuditAccumulator(0.2).summary();
  EXPECT_EQ(s.tau, 0.2);
  EXPECT_EQ(s.violation_tolerance, 1e-9);
  EXPECT_EQ(s.cells, 0);
  EXPECT_EQ(s.violations, 0);
  EXPECT_EQ(s.coverage_at_tau, 0.0);
  EXPECT_EQ(s.tightness_cells, 0);
  EXPECT_TRUE(s.layers.empty());
}

TEST(AuditAccumulator, CountsCoverageViolationsAndMaxima) {
  AuditAccumulator acc(0.2, 1e-9);
  acc.add(cell(0, 0, 0, 0.10, 0.01));              // covered, sound
  acc.add(cell(0, 1, 0, 0.20, 0.19));              // covered (meter == tau), sound
  acc.add(cell(0, 2, 0, 0.05, 0.05 + 5e-10));      // covered, inside the tolerance: not a violation
  acc.add(cell(1, 0, 0, 0.05, 0.05 + 5e-9));       // covered, a violation beyond the tolerance
  acc.add(cell(1, 1, 3, 1.0, 0.6, true));          // overflow: saturated, not covered
  acc.add(cell(1, 2, 3, 0.7, 0.3));                // not covered
  const AuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 6);
  EXPECT_EQ(s.violations, 1);
  EXPECT_EQ(s.overflows, 1);
  EXPECT_DOUBLE_EQ(s.coverage_at_tau, 4.0 / 6.0);
  EXPECT_EQ(s.max_meter, 1.0);
  EXPECT_EQ(s.max_tv, 0.6);
  // The worst cell is the violation: tv - meter = 5e-9 is the largest margin against soundness.
  EXPECT_EQ(key(s.worst), std::make_tuple(1, 0, int64_t(0)));

  ASSERT_EQ(s.layers.size(), 2u);
  EXPECT_EQ(s.layers[0].layer, 0);
  EXPECT_EQ(s.layers[0].cells, 3);
  EXPECT_EQ(s.layers[0].violations, 0);
  EXPECT_EQ(s.layers[0].coverage_at_tau, 1.0);
  EXPECT_EQ(s.layers[0].max_meter, 0.2);
  EXPECT_EQ(s.layers[0].max_tv, 0.19);
  EXPECT_EQ(s.layers[1].layer, 1);
  EXPECT_EQ(s.layers[1].cells, 3);
  EXPECT_EQ(s.layers[1].violations, 1);
  EXPECT_DOUBLE_EQ(s.layers[1].coverage_at_tau, 1.0 / 3.0);
  EXPECT_EQ(s.layers[1].max_meter, 1.0);
  EXPECT_EQ(s.layers[1].max_tv, 0.6);
}

TEST(AuditAccumulator, ZeroToleranceCountsEveryShortfall) {
  AuditAccumulator strict(0.5, 0.0);
  strict.add(cell(0, 0, 0, 0.05, 0.05 + 5e-10));
  strict.add(cell(0, 0, 1, 0.05, 0.05));  // equal is sound
  EXPECT_EQ(strict.summary().violations, 1);
}

TEST(AuditAccumulator, LayersAreSortedWhateverTheOrderOfCells) {
  AuditAccumulator acc(0.1);
  // meter 0.25 on layers 17 and 29 (not covered), 0 on layers 0 and 3 (covered).
  for (int layer : {29, 3, 17, 0, 3, 29, 29})
    acc.add(cell(layer, 0, 0, layer > 10 ? 0.25 : 0.0, 0.0));
  const AuditSummary s = acc.summary();
  ASSERT_EQ(s.layers.size(), 4u);
  EXPECT_EQ(s.layers[0].layer, 0);
  EXPECT_EQ(s.layers[0].coverage_at_tau, 1.0);
  EXPECT_EQ(s.layers[1].layer, 3);
  EXPECT_EQ(s.layers[1].cells, 2);
  EXPECT_EQ(s.layers[2].layer, 17);
  EXPECT_EQ(s.layers[2].coverage_at_tau, 0.0);
  EXPECT_EQ(s.layers[3].layer, 29);
  EXPECT_EQ(s.layers[3].cells, 3);
  EXPECT_EQ(s.layers[3].max_meter, 0.25);
  EXPECT_DOUBLE_EQ(s.coverage_at_tau, 3.0 / 7.0);
}

TEST(AuditAccumulator, TightnessQuantilesOverInformativeCells) {
  AuditAccumulator acc(0.5);
  // Informative: tv = 0.005, meter = r * tv for r = 1..101, added in a scrambled order.
  for (int i = 0; i < 101; ++i) {
    const int r = 1 + (i * 37) % 101;
    acc.add(cell(i % 4, i % 9, i, 0.005 * r, 0.005));
  }
  // Excluded: a tiny TV (ratio meaningless), a saturated meter, an overflow.
  acc.add(cell(0, 0, 500, 0.3, 1e-13));
  acc.add(cell(0, 0, 501, 0.0, 0.0));
  acc.add(cell(0, 0, 502, 1.0, 0.4));
  acc.add(cell(0, 0, 503, std::numeric_limits<double>::infinity(), 0.9, true));
  const AuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 105);
  EXPECT_EQ(s.tightness_cells, 101);
  EXPECT_DOUBLE_EQ(s.tightness_q01, 2.0);
  EXPECT_DOUBLE_EQ(s.tightness_q10, 11.0);
  EXPECT_DOUBLE_EQ(s.tightness_q50, 51.0);
  EXPECT_DOUBLE_EQ(s.tightness_q90, 91.0);
  EXPECT_DOUBLE_EQ(s.tightness_q99, 100.0);
  EXPECT_EQ(s.violations, 0);
  EXPECT_EQ(s.overflows, 1);
  EXPECT_EQ(s.max_meter, std::numeric_limits<double>::infinity());
  EXPECT_EQ(s.max_tv, 0.9);
}

TEST(AuditAccumulator, RejectsBadCellsAndParameters) {
  expect_rejected(cell(-1, 0, 0, 0.1, 0.1), "layer");
  expect_rejected(cell(0, -2, 0, 0.1, 0.1), "layer, head and step");
  expect_rejected(cell(0, 0, -5, 0.1, 0.1), "step");
  expect_rejected(cell(0, 0, 0, std::nan(""), 0.1), "meter");
  expect_rejected(cell(0, 0, 0, -0.1, 0.1), "meter");
  expect_rejected(cell(0, 0, 0, 0.1, -0.1), "tv");
  expect_rejected(cell(0, 0, 0, 0.1, 1.5), "tv");
  expect_rejected(cell(0, 0, 0, 0.1, std::nan("")), "tv");
  expect_rejected(cell(0, 0, 0, 0.4, 0.1, true), "overflow");
  EXPECT_THROW(AuditAccumulator(-0.1), Error);
  EXPECT_THROW(AuditAccumulator(std::nan("")), Error);
  EXPECT_THROW(AuditAccumulator(std::numeric_limits<double>::infinity()), Error);
  EXPECT_THROW(AuditAccumulator(0.2, -1e-9), Error);
  // tau >= 1 is risk ranking: allowed.
  AuditAccumulator ranking(1.5);
  ranking.add(cell(0, 0, 0, 1.2, 0.3));
  EXPECT_EQ(ranking.summary().coverage_at_tau, 1.0);
}

std::vector<AuditCell> grid_cells() {
  std::vector<AuditCell> cells;
  for (int layer = 0; layer < 5; ++layer)
    for (int head = 0; head < 3; ++head)
      for (int64_t step = 0; step < 17; ++step) {
        const double x = double((layer * 51 + head * 17 + step) % 97) / 97.0;
        cells.push_back(cell(layer, head, step, 0.5 * x + 0.1, 0.4 * x * x));
      }
  // Put the extremes far from the front, in different cells.
  cells[200].tv = 0.95;
  cells[200].meter = 0.97;
  cells[151].meter = 0.99;
  return cells;
}

TEST(SelectDumpCells, IncludesExtremesAndIsDeterministic) {
  const std::vector<AuditCell> cells = grid_cells();
  ASSERT_EQ(cells.size(), 255u);
  for (int64_t n : {2, 3, 16, 17, 254}) {
    const std::vector<AuditCell> a = select_dump_cells(cells, n, 42);
    ASSERT_EQ(a.size(), size_t(n));
    std::set<std::tuple<int, int, int64_t>> keys;
    for (const AuditCell& c : a) keys.insert(key(c));
    EXPECT_EQ(keys.size(), size_t(n)) << "duplicates";
    EXPECT_TRUE(keys.count(key(cells[200]))) << "largest tv missing, n " << n;
    EXPECT_TRUE(keys.count(key(cells[151]))) << "largest meter missing, n " << n;
    // Input order is kept.
    EXPECT_TRUE(std::is_sorted(a.begin(), a.end(), [](const AuditCell& x, const AuditCell& y) {
      return key(x) < key(y);
    }));
    const std::vector<AuditCell> b = select_dump_cells(cells, n, 42);
    ASSERT_EQ(b.size(), a.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(key(a[i]), key(b[i]));
  }
  // Another seed picks other random cells.
  const std::vector<AuditCell> s1 = select_dump_cells(cells, 16, 1);
  const std::vector<AuditCell> s2 = select_dump_cells(cells, 16, 2);
  bool differ = false;
  for (size_t i = 0; i < s1.size(); ++i) differ |= key(s1[i]) != key(s2[i]);
  EXPECT_TRUE(differ);
}

TEST(SelectDumpCells, OneCellHoldingBothExtremes) {
  std::vector<AuditCell> cells = grid_cells();
  cells[151].meter = 0.5;  // now cell 200 has both the largest tv and the largest meter
  const std::vector<AuditCell> a = select_dump_cells(cells, 3, 9);
  ASSERT_EQ(a.size(), 3u);
  int found = 0;
  for (const AuditCell& c : a) found += key(c) == key(cells[200]);
  EXPECT_EQ(found, 1);
}

TEST(SelectDumpCells, SmallInputsAndBadArguments) {
  const std::vector<AuditCell> cells = {cell(0, 0, 0, 0.1, 0.05), cell(0, 1, 0, 0.2, 0.01), cell(1, 0, 0, 0.3, 0.02)};
  EXPECT_EQ(select_dump_cells(cells, 3, 0).size(), 3u);
  EXPECT_EQ(select_dump_cells(cells, 100, 0).size(), 3u);
  EXPECT_TRUE(select_dump_cells({}, 4, 0).empty());
  const std::vector<AuditCell> two = select_dump_cells(cells, 2, 5);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(key(two[0]), key(cells[0]));  // largest tv
  EXPECT_EQ(key(two[1]), key(cells[2]));  // largest meter
  EXPECT_THROW(select_dump_cells(cells, 1, 0), Error);
  EXPECT_THROW(select_dump_cells(cells, -3, 0), Error);
  std::vector<AuditCell> bad = cells;
  bad[1].tv = std::nan("");
  EXPECT_THROW(select_dump_cells(bad, 2, 0), Error);
}

}  // namespace
}  // namespace certkv::eval
