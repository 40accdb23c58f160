// Decode attention with and without the meter over lossy pages, SmolLM2-135M's shape (9 query
// heads, 3 KV heads, head_dim 64, 16-token blocks), one layer, one thread. The KV is synthetic
// (normal values, two large key channels). Arguments: KV scheme (cache::KvScheme), context
// tokens, metered (1) or not (0). Compare the metered and unmetered times of one scheme and
// context in one run (docs/meter.md).
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"

namespace {

namespace cache = certkv::cache;
using certkv::attention::AttentionShape;
using certkv::attention::DecodeOptions;
using certkv::attention::HeadMeter;

constexpr int kQHeads = 9;
constexpr int kKvHeads = 3;
constexpr int kHeadDim = 64;

struct Filled {
  std::unique_ptr<cache::KvCache> kv;
  cache::SeqId seq;
};

const Filled& filled(cache::KvScheme scheme, int64_t n) {
  static std::map<std::pair<int, int64_t>, Filled> caches;
  auto it = caches.find({int(scheme), n});
  if (it != caches.end()) return it->second;
  cache::KvCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = kKvHeads;
  cfg.head_dim = kHeadDim;
  cfg.max_tokens = n;
  cfg.scheme = scheme;
  Filled f{std::make_unique<cache::KvCache>(cfg), 0};
  f.seq = f.kv->create_sequence();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(size_t(n) * kKvHeads * kHeadDim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    const int c = int(i % kHeadDim);
    k[i] = normal(rng) * (c == 3 || c == 35 ? 12.f : 1.5f);
    v[i] = normal(rng);
  }
  f.kv->reserve(f.seq, n);
  f.kv->write(f.seq, 0, k.data(), v.data(), n);
  f.kv->commit(f.seq, n);
  return caches.emplace(std::make_pair(int(scheme), n), std::move(f)).first->second;
}

void BM_DecodeMeter(benchmark::State& state) {
  const cache::KvScheme scheme = cache::KvScheme(state.range(0));
  const int64_t n = state.range(1);
  const bool metered = state.range(2) != 0;
  const Filled& f = filled(scheme, n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(kQHeads * kHeadDim), out(q.size());
  for (float& x : q) x = normal(rng);
  std::vector<HeadMeter> meters(kQHeads);
  DecodeOptions options;
  options.n_splits = 1;
  if (metered) options.meters = meters.data();
  options.meter.delta_loc = 1e-8;
  const AttentionShape shape{kQHeads, kKvHeads, kHeadDim, 0.125f};
  for (auto _ : state) {
    certkv::attention::decode_attention(*f.kv, f.seq, 0, shape, q.data(), n, out.data(), nullptr, options);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(std::string(cache::kv_scheme_name(scheme)) + (metered ? " metered" : ""));
  state.counters["time_per_token"] =
      benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void schemes(benchmark::internal::Benchmark* b) {
  for (cache::KvScheme s : {cache::KvScheme::kRtn8, cache::KvScheme::kDither8, cache::KvScheme::kFp8E4M3})
    for (int metered : {0, 1}) b->Args({int64_t(s), 4096, metered});
}

BENCHMARK(BM_DecodeMeter)->Apply(schemes)->Unit(benchmark::kMicrosecond);

}  // namespace
