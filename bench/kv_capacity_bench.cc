// KV memory per token of every scheme, measured from the allocator (KvCache::memory_stats): a
// cache of one layer and one kv_head filled with 8,192 tokens of keys and values drawn like real
// ones (normal, a few large channels), at head_dim 64 (SmolLM2) and 128 (7B-class models).
// Counters: bytes_per_token_per_head (K and V pages together, chunks obtained from the system,
// block tables included, backing store excluded), capacity_vs_bf16 (tokens held at equal memory),
// backing_bytes_per_token (the host copy the gate repairs from). The timed part is the fill.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "cache/kv_cache.h"

namespace {

using certkv::cache::KvCache;
using certkv::cache::KvCacheConfig;
using certkv::cache::KvScheme;

constexpr int64_t kTokens = 8192;

struct Filled {
  double bytes_per_token;
  double backing_per_token;
};

Filled fill(KvScheme scheme, int head_dim, int outlier_pairs) {
  KvCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = 1;
  cfg.head_dim = head_dim;
  cfg.max_tokens = kTokens;
  cfg.scheme = scheme;
  cfg.outlier_pairs = scheme == KvScheme::kDither8 ? outlier_pairs : -1;
  KvCache cache(cfg);
  const auto seq = cache.create_sequence();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(size_t(kTokens) * head_dim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    const int c = int(i % size_t(head_dim));
    k[i] = normal(rng) * (c == 3 || c == 40 ? 30.f : 1.f);
    v[i] = normal(rng);
  }
  cache.reserve(seq, kTokens);
  cache.write(seq, 0, k.data(), v.data(), kTokens);
  cache.commit(seq, kTokens);
  const auto m = cache.memory_stats();
  return {double(m.bytes_reserved_from_allocator + m.block_table_bytes) / kTokens,
          double(m.backing_bytes_reserved_from_allocator) / kTokens};
}

void BM_KvBytesPerToken(benchmark::State& state) {
  const KvScheme scheme = KvScheme(state.range(0));
  const int head_dim = int(state.range(1));
  const int m = int(state.range(2));
  Filled f{};
  for (auto _ : state) f = fill(scheme, head_dim, m);
  const Filled bf16 = fill(KvScheme::kBf16, head_dim, 0);
  state.counters["bytes_per_token_per_head"] = f.bytes_per_token;
  state.counters["capacity_vs_bf16"] = bf16.bytes_per_token / f.bytes_per_token;
  state.counters["backing_bytes_per_token"] = f.backing_per_token;
  state.SetLabel(std::string(certkv::cache::kv_scheme_name(scheme)) + " d" +
                 std::to_string(head_dim) + (scheme == KvScheme::kDither8 ? " m" + std::to_string(m) : ""));
}

void schemes(benchmark::internal::Benchmark* b) {
  for (int d : {64, 128}) {
    for (KvScheme s : {KvScheme::kBf16, KvScheme::kFp8E4M3, KvScheme::kFp8E4M3Scaled,
                       KvScheme::kRtn8, KvScheme::kRtn4, KvScheme::kKivi2})
      b->Args({int64_t(s), d, 0});
    for (int m : {0, 2, 4, 8, 16}) b->Args({int64_t(KvScheme::kDither8), d, m});
  }
}

BENCHMARK(BM_KvBytesPerToken)->Apply(schemes)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
