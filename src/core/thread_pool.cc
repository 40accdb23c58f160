#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CERTKV_CPU_RELAX() _mm_pause()
#else
#define CERTKV_CPU_RELAX() std::this_thread::yield()
#endif

namespace certkv {

namespace {

constexpr int64_t kSpinMicros = 200;

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

// Spins until done() or kSpinMicros pass; returns done().
template <typename Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CERTKV_CPU_RELAX();
    }
    if (std::chrono::steady_clock::now() > deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true);
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  for (;;) {
    auto started = [&] {
      return stopping_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    if (!spin_until(started)) {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, started);
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    int64_t begin, end;
    chunk_of(job_n_, job_grain_, n_threads_, thread_index, &begin, &end);
    if (begin < end) (*job_)(begin, end, thread_index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_cv_.notify_one();
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
    pending_.store(n_threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_cv_.notify_all();
  int64_t begin, end;
  chunk_of(n, grain, n_threads_, 0, &begin, &end);
  if (begin < end) fn(begin, end, 0);
  auto finished = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(finished)) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, finished);
  }
}

}  // namespace certkv
