#include "gate/recent_step_meters.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/status.h"

namespace certkv::gate {
namespace {

TEST(RecentStepMeters, KeepsTheMaxOverSequencesPerLayerAndHead) {
  RecentStepMeters ring(2, 3, 4);
  ring.begin_step();
  ring.record(0, 1, 0.25, false);  // sequence a
  ring.record(0, 1, 0.5, false);   // sequence b: the larger stays
  ring.record(1, 2, 0.75, false);
  ring.record(1, 2, 0.125, false);
  ASSERT_EQ(ring.size(), 1);
  const RecentStepMeters::Step s = ring.step(0);
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.cells, 4);
  EXPECT_EQ(s.meters[0 * 3 + 1], 0.5f);
  EXPECT_EQ(s.meters[1 * 3 + 2], 0.75f);
  for (int cell : {0, 2, 3, 4}) EXPECT_TRUE(std::isnan(s.meters[cell])) << cell;
}

// The largest of several cells recorded at once is the same step as one record() per cell.
TEST(RecentStepMeters, SeveralCellsAtOnceEqualOneRecordEach) {
  RecentStepMeters at_once(2, 2, 4), one_by_one(2, 2, 4);
  at_once.begin_step();
  one_by_one.begin_step();
  at_once.record(0, 1, 0.5, false, 3);
  for (const double m : {0.25, 0.5, 0.125}) one_by_one.record(0, 1, m, false);
  at_once.record(1, 0, 0.0, true, 2);
  one_by_one.record(1, 0, 0.0, false);
  one_by_one.record(1, 0, 0.0, true);
  const RecentStepMeters::Step a = at_once.step(0), b = one_by_one.step(0);
  EXPECT_EQ(a.cells, 5);
  EXPECT_EQ(a.cells, b.cells);
  for (int cell = 0; cell < 4; ++cell) {
    if (std::isnan(b.meters[cell])) {
      EXPECT_TRUE(std::isnan(a.meters[cell])) << cell;
    } else {
      EXPECT_EQ(a.meters[cell], b.meters[cell]) << cell;
    }
  }
  EXPECT_EQ(a.meters[1 * 2 + 0], 1.0f);
}

TEST(RecentStepMeters, OverflowReadsOne) {
  RecentStepMeters ring(1, 3, 2);
  ring.begin_step();
  ring.record(0, 0, 0.1, true);
  ring.record(0, 1, std::numeric_limits<double>::infinity(), false);
  ring.record(0, 2, std::numeric_limits<double>::quiet_NaN(), false);
  const RecentStepMeters::Step s = ring.step(0);
  for (int h = 0; h < 3; ++h) EXPECT_EQ(s.meters[h], 1.0f) << h;
}

TEST(RecentStepMeters, StepsWithoutCellsAreNotKept) {
  RecentStepMeters ring(1, 1, 4);
  ring.begin_step();  // a prefill-only step
  ring.begin_step();
  ring.record(0, 0, 0.3, false);
  ring.begin_step();  // another
  EXPECT_EQ(ring.steps_begun(), 3);
  ASSERT_EQ(ring.size(), 1);
  EXPECT_EQ(ring.step(0).step, 2);
}

TEST(RecentStepMeters, RingDropsTheOldestAndListsOldestFirst) {
  RecentStepMeters ring(1, 1, 3);
  for (int i = 1; i <= 5; ++i) {
    ring.begin_step();
    ring.record(0, 0, 0.1 * i, false);
  }
  ASSERT_EQ(ring.size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ring.step(i).step, 3 + i);
    EXPECT_FLOAT_EQ(ring.step(i).meters[0], float(0.1 * (3 + i)));
    EXPECT_EQ(ring.step(i).cells, 1);
  }
}

TEST(RecentStepMeters, ZeroCapacityKeepsNothing) {
  RecentStepMeters ring(2, 2, 0);
  ring.begin_step();
  ring.record(1, 1, 0.5, false);
  EXPECT_EQ(ring.size(), 0);
  EXPECT_EQ(ring.steps_begun(), 1);
}

TEST(RecentStepMeters, BadArgumentsAreRefused) {
  EXPECT_THROW(RecentStepMeters(0, 1, 1), Error);
  EXPECT_THROW(RecentStepMeters(1, 0, 1), Error);
  EXPECT_THROW(RecentStepMeters(1, 1, -1), Error);
  RecentStepMeters ring(1, 1, 2);
  EXPECT_THROW(ring.step(0), Error);
}

}  // namespace
}  // namespace certkv::gate
