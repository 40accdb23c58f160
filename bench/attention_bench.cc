// Decode and prefill attention over the paged BF16 cache, SmolLM2-135M's shape (9 query heads,
// 3 KV heads, head_dim 64, 16-token blocks), one layer. Counters: time_per_token is wall time per
// token of context (decode) or per query token (prefill); kv_read is bf16 K+V bytes per second.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"
#include "core/thread_pool.h"

namespace {

using certkv::ThreadPool;
using certkv::attention::AttentionShape;
namespace cache = certkv::cache;

constexpr int kQHeads = 9;
constexpr int kKvHeads = 3;
constexpr int kHeadDim = 64;
constexpr int64_t kMaxTokens = 32768;

// One sequence of kMaxTokens random tokens, built once and shared by every benchmark.
struct FilledCache {
  std::unique_ptr<cache::KvCache> kv;
  cache::SeqId seq;
};

const FilledCache& filled_cache() {
  static const FilledCache filled = [] {
    cache::KvCacheConfig cfg;
    cfg.n_layers = 1;
    cfg.n_kv_heads = kKvHeads;
    cfg.head_dim = kHeadDim;
    cfg.block_tokens = 16;
    cfg.max_tokens = kMaxTokens;
    FilledCache f{std::make_unique<cache::KvCache>(cfg), 0};
    f.seq = f.kv->create_sequence();
    std::mt19937 rng(2024);
    std::uniform_real_distribution<float> dist(-2.f, 2.f);
    constexpr int64_t kStep = 1024;
    std::vector<float> k(kStep * kKvHeads * kHeadDim), v(k.size());
    for (int64_t done = 0; done < kMaxTokens; done += kStep) {
      for (float& e : k) e = dist(rng);
      for (float& e : v) e = dist(rng);
      f.kv->reserve(f.seq, kStep);
      f.kv->write(f.seq, 0, k.data(), v.data(), kStep);
      f.kv->commit(f.seq, kStep);
    }
    return f;
  }();
  return filled;
}

std::vector<float> random_queries(int64_t n_tokens) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  std::vector<float> q(size_t(n_tokens) * kQHeads * kHeadDim);
  for (float& e : q) e = dist(rng);
  return q;
}

const AttentionShape kShape{kQHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(float(kHeadDim))};

// Args: n_ctx, threads.
void BM_DecodeAttention(benchmark::State& state) {
  const int64_t n_ctx = state.range(0);
  const int n_threads = int(state.range(1));
  const FilledCache& f = filled_cache();
  ThreadPool pool(n_threads);
  const std::vector<float> q = random_queries(1);
  std::vector<float> out(q.size());
  for (auto _ : state) {
    certkv::attention::decode_attention(*f.kv, f.seq, 0, kShape, q.data(), n_ctx, out.data(), &pool);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["time_per_token"] = benchmark::Counter(
      double(n_ctx), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["kv_read"] = benchmark::Counter(double(n_ctx) * 2 * kKvHeads * kHeadDim * 2,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"n_ctx", "threads"})
    ->ArgsProduct({{512, 4096, 32768}, {1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Args: n query tokens (a prompt from position 0), threads.
void BM_PrefillAttention(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int n_threads = int(state.range(1));
  const FilledCache& f = filled_cache();
  ThreadPool pool(n_threads);
  const std::vector<float> q = random_queries(n);
  std::vector<float> out(q.size());
  for (auto _ : state) {
    certkv::attention::prefill_attention(*f.kv, f.seq, 0, kShape, q.data(), 0, n, out.data(), &pool);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["time_per_token"] = benchmark::Counter(
      double(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PrefillAttention)
    ->ArgNames({"n", "threads"})
    ->ArgsProduct({{512, 4096}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
