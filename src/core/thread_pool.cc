#include "core/thread_pool.h"

#include <algorithm>

namespace certkv {

namespace {

// The chunk [begin, end) of thread t when [0, n) is split into n_threads grain-aligned parts.
void chunk_of(int64_t n, int64_t grain, int n_threads, int t, int64_t* begin, int64_t* end) {
  const int64_t n_grains = (n + grain - 1) / grain;
  const int64_t per = n_grains / n_threads;
  const int64_t extra = n_grains % n_threads;
  const int64_t g0 = t * per + std::min<int64_t>(t, extra);
  const int64_t g1 = g0 + per + (t < extra ? 1 : 0);
  *begin = std::min(n, g0 * grain);
  *end = std::min(n, g1 * grain);
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n, grain;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      grain = job_grain_;
    }
    int64_t begin, end;
    chunk_of(n, grain, n_threads_, thread_index, &begin, &end);
    if (begin < end) (*job)(begin, end, thread_index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  int64_t begin, end;
  chunk_of(n, grain, n_threads_, 0, &begin, &end);
  if (begin < end) fn(begin, end, 0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
}

}  // namespace certkv
