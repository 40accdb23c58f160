// Sparse decode attention against dense decode attention on the CPU, one layer of real KV, and
// the key index's build time per token (issue 5; docs/sparse.md).
//
// The KV comes from a dump of the model (certkv dump-kv), named by the environment:
//   CERTKV_SPARSE_KV=kv.safetensors  CERTKV_SPARSE_LAYER=10 (default)
// The dump's [n_kv_heads][S][head_dim] keys and values of the layer are tiled to the context
// length of each benchmark (a 32K context repeats an 8K dump four times, which keeps the
// selection's fraction of the context and the page reads realistic), and the dump's last-position
// queries of that layer are the query. The index's query centroid is 0 (the dump holds one
// query per head, too few for a centroid); the key centroid is the mean key.
// Arguments: context tokens, p in thousandths (0: dense decode_attention), threads.
// Counters: budget (attended / context, mean over heads) and selected tokens per head.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/sparse_decode.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "core/thread_pool.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace {

namespace cache = certkv::cache;
namespace attention = certkv::attention;

constexpr int kBlockTokens = 16;
constexpr int kWindowTokens = 128;

struct Dump {
  int n_kv_heads = 0, n_q_heads = 0, head_dim = 0;
  int64_t tokens = 0;
  std::vector<float> k, v;  // [n_kv_heads][tokens][head_dim]
  std::vector<float> q;     // [n_q_heads][head_dim]
  std::string error;
};

const Dump& dump() {
  static Dump d = [] {
    Dump out;
    const char* path = std::getenv("CERTKV_SPARSE_KV");
    if (path == nullptr) {
      out.error = "set CERTKV_SPARSE_KV to a certkv dump-kv file";
      return out;
    }
    const char* layer_env = std::getenv("CERTKV_SPARSE_LAYER");
    const std::string layer = layer_env ? layer_env : "10";
    auto file = certkv::format::SafetensorsFile::open(path);
    const auto* k = file->find("layer" + layer + ".k");
    const auto* v = file->find("layer" + layer + ".v");
    const auto* q = file->find("layer" + layer + ".q");
    if (!k || !v || !q || k->shape.size() != 3 || q->shape.size() != 2) {
      out.error = std::string(path) + " has no layer " + layer + " K, V and q";
      return out;
    }
    out.n_kv_heads = int(k->shape[0]);
    out.tokens = k->shape[1];
    out.head_dim = int(k->shape[2]);
    out.n_q_heads = int(q->shape[0]);
    auto widen = [](const certkv::format::SafetensorsTensor* t) {
      std::vector<float> x(t->n_bytes / 2);
      const auto* bits = reinterpret_cast<const uint16_t*>(t->data);
      for (size_t i = 0; i < x.size(); ++i) x[i] = certkv::format::bf16_to_float(bits[i]);
      return x;
    };
    out.k = widen(k);
    out.v = widen(v);
    const auto* qf = reinterpret_cast<const float*>(q->data);
    out.q.assign(qf, qf + q->n_bytes / 4);
    return out;
  }();
  return d;
}

struct Filled {
  std::unique_ptr<cache::KvCache> kv;
  cache::SeqId seq = 0;
  std::unique_ptr<cache::KeyIndex> index;
};

// The dump tiled to n tokens in a bf16 cache, and its index of every whole block before the
// window.
const Filled& filled(int64_t n) {
  static std::map<int64_t, Filled> caches;
  auto it = caches.find(n);
  if (it != caches.end()) return it->second;
  const Dump& d = dump();
  Filled f;
  cache::KvCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = d.n_kv_heads;
  cfg.head_dim = d.head_dim;
  cfg.block_tokens = kBlockTokens;
  cfg.max_tokens = n;
  f.kv = std::make_unique<cache::KvCache>(cfg);
  f.seq = f.kv->create_sequence();
  const size_t row = size_t(d.n_kv_heads) * size_t(d.head_dim);
  std::vector<float> k(size_t(n) * row), v(size_t(n) * row);
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < d.n_kv_heads; ++h)
      for (int c = 0; c < d.head_dim; ++c) {
        const size_t src = (size_t(h) * size_t(d.tokens) + size_t(t % d.tokens)) * size_t(d.head_dim) + size_t(c);
        k[size_t(t) * row + size_t(h) * size_t(d.head_dim) + size_t(c)] = d.k[src];
        v[size_t(t) * row + size_t(h) * size_t(d.head_dim) + size_t(c)] = d.v[src];
      }
  f.kv->reserve(f.seq, n);
  f.kv->write(f.seq, 0, k.data(), v.data(), n);
  f.kv->commit(f.seq, n);
  cache::KeyIndexConfig ic;
  ic.n_layers = 1;
  ic.n_kv_heads = d.n_kv_heads;
  ic.head_dim = d.head_dim;
  ic.page_records = kBlockTokens;
  f.index = std::make_unique<cache::KeyIndex>(ic);
  const int64_t indexed = (n - kWindowTokens) / kBlockTokens * kBlockTokens;
  std::vector<float> keys(size_t(n) * size_t(d.head_dim));
  for (int h = 0; h < d.n_kv_heads; ++h) {
    f.kv->read_token_range_exact(f.seq, 0, cache::KvTensor::kKey, h, 0, n, keys.data());
    std::vector<float> c_k(static_cast<size_t>(d.head_dim), 0.f);
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < d.head_dim; ++c) c_k[size_t(c)] += keys[size_t(t) * size_t(d.head_dim) + size_t(c)] / float(n);
    f.index->set_centroids(0, h, std::vector<float>(size_t(d.head_dim), 0.f), c_k);
    f.index->append(0, h, keys.data(), indexed);
  }
  return caches.emplace(n, std::move(f)).first->second;
}

void BM_DecodeAttention(benchmark::State& state) {
  const Dump& d = dump();
  if (!d.error.empty()) {
    state.SkipWithError(d.error.c_str());
    return;
  }
  const int64_t n = state.range(0);
  const double p = double(state.range(1)) / 1000.0;
  const int threads = int(state.range(2));
  const Filled& f = filled(n);
  const attention::AttentionShape shape{d.n_q_heads, d.n_kv_heads, d.head_dim,
                                        1.f / std::sqrt(float(d.head_dim))};
  std::unique_ptr<certkv::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<certkv::ThreadPool>(threads);
  std::vector<float> out(size_t(d.n_q_heads) * size_t(d.head_dim));
  std::vector<attention::SparseHeadStats> stats(size_t(d.n_q_heads));
  attention::SparseDecodeOptions options;
  options.p = p;
  uint64_t step = 0;
  for (auto _ : state) {
    if (p == 0) {
      attention::decode_attention(*f.kv, f.seq, 0, shape, d.q.data(), n, out.data(), pool.get());
    } else {
      options.rounding_seed = ++step;
      attention::sparse_decode_attention(*f.kv, f.seq, 0, shape, d.q.data(), n, *f.index,
                                         options, out.data(), stats.data(), pool.get());
    }
    benchmark::DoNotOptimize(out.data());
  }
  if (p > 0) {
    double budget = 0, selected = 0;
    for (const auto& s : stats) {
      budget += double(s.n_attended) / double(n);
      selected += double(s.n_selected);
    }
    state.counters["budget"] = budget / double(stats.size());
    state.counters["selected_per_head"] = selected / double(stats.size());
  }
}

// Indexing one block of keys of every kv head: record encoding (rotation, sign code, Eq. 6
// scalars). Reported per token and kv head.
void BM_IndexBuild(benchmark::State& state) {
  const Dump& d = dump();
  if (!d.error.empty()) {
    state.SkipWithError(d.error.c_str());
    return;
  }
  const auto rotation = certkv::index::RotationKind(state.range(0));
  cache::KeyIndexConfig ic;
  ic.n_layers = 1;
  ic.n_kv_heads = d.n_kv_heads;
  ic.head_dim = d.head_dim;
  ic.rotation = rotation;
  const int64_t batch = kWindowTokens;
  int64_t done = 0;
  std::unique_ptr<cache::KeyIndex> index;
  for (auto _ : state) {
    if (!index || done + batch > d.tokens) {
      state.PauseTiming();
      index = std::make_unique<cache::KeyIndex>(ic);
      for (int h = 0; h < d.n_kv_heads; ++h)
        index->set_centroids(0, h, std::vector<float>(size_t(d.head_dim), 0.f),
                             std::vector<float>(size_t(d.head_dim), 0.f));
      done = 0;
      state.ResumeTiming();
    }
    for (int h = 0; h < d.n_kv_heads; ++h)
      index->append(0, h, d.k.data() + (size_t(h) * size_t(d.tokens) + size_t(done)) * size_t(d.head_dim), batch);
    done += batch;
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * batch * d.n_kv_heads);
}

}  // namespace

BENCHMARK(BM_DecodeAttention)
    ->ArgsProduct({{8192, 32768}, {0, 900, 950}, {1, 2}})
    ->ArgNames({"ctx", "p_milli", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_IndexBuild)->Arg(0)->Arg(1)->ArgNames({"rotation"})->Unit(benchmark::kMicrosecond);
