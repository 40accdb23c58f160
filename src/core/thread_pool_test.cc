#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace certkv {
namespace {

TEST(ThreadPool, CoversEveryIndexOnceWithGrainAlignedChunks) {
  for (int threads : {1, 2, 3, 7})
    for (int64_t n : {1, 3, 17, 129, 501, 3771})
      for (int64_t grain : {1, 4, 16}) {
        ThreadPool pool(threads);
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad_boundary{0};
        pool.parallel_for(n, grain, [&](int64_t b, int64_t e, int t) {
          if (b % grain != 0 || t < 0 || t >= threads) ++bad_boundary;
          for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << n << " " << grain;
        EXPECT_EQ(bad_boundary.load(), 0);
      }
}

TEST(ThreadPool, ManyShortLoopsAndIdleGapsComplete) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 2000; ++round) {
    pool.parallel_for(64, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    if (round % 500 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // workers fall asleep
  }
  EXPECT_EQ(sum.load(), int64_t(2000) * (63 * 64 / 2));
}

TEST(ThreadPool, UsesMoreThanOneThread) {
  ThreadPool pool(2);
  std::atomic<int> mask{0};
  pool.parallel_for(2, 1, [&](int64_t, int64_t, int t) { mask |= 1 << t; });
  EXPECT_EQ(mask.load(), 3);
}

}  // namespace
}  // namespace certkv
