// Dynamic scheduling of independent work units on a certkv::ThreadPool. Internal to the
// attention layer.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/thread_pool.h"

namespace certkv::attention::detail {

// Runs work(unit, thread_index) once for every unit in [0, n_units), on the pool's threads when
// it has more than one (pool may be null). Threads take units in increasing order from a shared
// counter, so callers order the units heaviest first for balance.
template <typename Work>
void run_units(ThreadPool* pool, int64_t n_units, const Work& work) {
  const int n_threads = pool != nullptr ? pool->n_threads() : 1;
  if (n_threads <= 1 || n_units <= 1) {
    for (int64_t u = 0; u < n_units; ++u) work(u, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  pool->parallel_for(std::min<int64_t>(n_threads, n_units), 1,
                     [&](int64_t, int64_t, int thread_index) {
                       for (int64_t u = next.fetch_add(1); u < n_units; u = next.fetch_add(1)) {
                         work(u, thread_index);
                       }
                     });
}

}  // namespace certkv::attention::detail
