// A fixed pool of worker threads for data-parallel loops over rows, heads or tokens.
// A decode step issues hundreds of short loops, so both sides spin briefly (kSpinMicros) on
// atomics before sleeping on a condition variable: waking a sleeping thread costs tens of
// microseconds, which would dominate small matrix products.
// Thread safety: one parallel_for at a time per pool (the caller blocks until it finishes).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace certkv {

class ThreadPool {
 public:
  // n_threads >= 1 counts the calling thread: n_threads - 1 workers are started.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }

  // Calls fn(begin, end, thread_index) over a split of [0, n) into n_threads contiguous chunks
  // whose boundaries are multiples of `grain` (except the last). Returns when all are done.
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t begin, int64_t end, int thread_index)>& fn);

 private:
  void worker_loop(int thread_index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_grain_ = 1;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace certkv
