// Decode and prefill attention over the paged cache, SmolLM2-135M's shape (9 query heads,
// 3 KV heads, head_dim 64, 16-token blocks), one layer. Counters: time_per_token is wall time per
// token of context (decode) or per query token (prefill); kv_read is bf16 K+V bytes per second.
//
// BM_DecodeAttentionScheme compares GAAC pages with BF16 pages holding the same KV. The KV is
// real when CERTKV_BENCH_KV names a `certkv dump-kv` file of SmolLM2 and
// CERTKV_BENCH_GAAC_CALIBRATION a GAAC calibration of SmolLM2 made from another text: layer
// CERTKV_BENCH_LAYER (default 15) of the dump, its whole blocks repeated up to 32K tokens.
// Otherwise it is synthetic (per-channel scales 2^-4..2^4, normal values) with a calibration on
// other synthetic data. Extra counters: stored_bytes_per_token (measured from the cache's pools)
// and slot_fraction (blocks in GAAC slots).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
#include "core/thread_pool.h"
#include "format/numeric.h"
#include "format/safetensors.h"

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

constexpr int kBlockTokens = 16;

// K and V rows of one layer: [n_tokens][kKvHeads][kHeadDim] bf16 bits each.
struct LayerKv {
  int64_t n_tokens = 0;
  std::vector<uint16_t> k, v;
  std::string source;
};

LayerKv synthetic_kv(int64_t n_tokens, uint32_t seed) {
  LayerKv kv;
  kv.n_tokens = n_tokens;
  kv.source = "synthetic";
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (std::vector<uint16_t>* x : {&kv.k, &kv.v}) {
    x->resize(size_t(n_tokens) * kKvHeads * kHeadDim);
    for (size_t i = 0; i < x->size(); ++i) {
      const int c = int(i % (kKvHeads * kHeadDim));
      (*x)[i] = certkv::format::float_to_bf16(std::ldexp(normal(rng), (c * 5) % 9 - 4));
    }
  }
  return kv;
}

// Layer `layer` of a dump-kv file: tensors [kKvHeads][N][kHeadDim] -> token-major rows.
LayerKv dumped_kv(const std::string& path, int layer) {
  auto file = certkv::format::SafetensorsFile::open(path);
  LayerKv kv;
  kv.source = path + " layer " + std::to_string(layer);
  for (int which = 0; which < 2; ++which) {
    const std::string name = "layer" + std::to_string(layer) + (which == 0 ? ".k" : ".v");
    const certkv::format::SafetensorsTensor* t = file->find(name);
    if (t == nullptr || t->dtype != "BF16" || t->shape.size() != 3 || t->shape[0] != kKvHeads ||
        t->shape[2] != kHeadDim) {
      fprintf(stderr, "attention_bench: %s has no BF16 tensor %s [%d, N, %d]\n", path.c_str(),
              name.c_str(), kKvHeads, kHeadDim);
      std::exit(1);
    }
    const int64_t n = t->shape[1];
    kv.n_tokens = n;
    std::vector<uint16_t>& x = which == 0 ? kv.k : kv.v;
    x.resize(size_t(n) * kKvHeads * kHeadDim);
    for (int h = 0; h < kKvHeads; ++h) {
      for (int64_t p = 0; p < n; ++p) {
        for (int c = 0; c < kHeadDim; ++c) {
          uint16_t bits;
          std::memcpy(&bits, t->data + ((size_t(h) * size_t(n) + size_t(p)) * kHeadDim + size_t(c)) * 2, 2);
          x[(size_t(p) * kKvHeads + size_t(h)) * kHeadDim + size_t(c)] = bits;
        }
      }
    }
  }
  return kv;
}

certkv::codec::GaacShape one_layer_shape() {
  certkv::codec::GaacShape shape;
  shape.n_layers = 1;
  shape.n_kv_heads = kKvHeads;
  shape.head_dim = kHeadDim;
  shape.block_tokens = kBlockTokens;
  return shape;
}

std::shared_ptr<const certkv::codec::GaacCalibration> calibrate_on(const LayerKv& kv) {
  certkv::codec::GaacCalibrator calibrator(one_layer_shape());
  std::vector<uint16_t> rows(size_t(kv.n_tokens) * kHeadDim);
  for (int which = 0; which < 2; ++which) {
    const std::vector<uint16_t>& x = which == 0 ? kv.k : kv.v;
    for (int h = 0; h < kKvHeads; ++h) {
      for (int64_t p = 0; p < kv.n_tokens; ++p) {
        std::memcpy(&rows[size_t(p) * kHeadDim], &x[(size_t(p) * kKvHeads + size_t(h)) * kHeadDim], kHeadDim * 2);
      }
      calibrator.add_bf16(0, which, h, rows.data(), int(kv.n_tokens));
    }
  }
  return std::make_shared<const certkv::codec::GaacCalibration>(calibrator.finish());
}

// Layer `layer` of a SmolLM2 calibration file as a one-layer calibration.
std::shared_ptr<const certkv::codec::GaacCalibration> calibration_layer(const std::string& path,
                                                                        int layer) {
  certkv::codec::GaacShape smollm2 = one_layer_shape();
  smollm2.n_layers = 30;
  const certkv::codec::GaacCalibration full = certkv::codec::GaacCalibration::load(path, smollm2);
  auto one = std::make_shared<certkv::codec::GaacCalibration>(one_layer_shape());
  for (int which = 0; which < 2; ++which) {
    one->set_escape_capacity_bytes(0, which, full.escape_capacity_bytes(layer, which));
    for (int h = 0; h < kKvHeads; ++h) one->bases(0, which, h) = full.bases(layer, which, h);
  }
  return one;
}

// The same KV in a bf16 cache and in a gaac cache.
struct SchemeCaches {
  std::unique_ptr<cache::KvCache> kv[2];  // indexed by KvScheme
  cache::SeqId seq[2];
  std::string source;
};

const SchemeCaches& scheme_caches() {
  static const SchemeCaches caches = [] {
    const char* dump = std::getenv("CERTKV_BENCH_KV");
    const char* cal_path = std::getenv("CERTKV_BENCH_GAAC_CALIBRATION");
    const char* layer_env = std::getenv("CERTKV_BENCH_LAYER");
    const int layer = layer_env != nullptr ? std::atoi(layer_env) : 15;
    LayerKv kv;
    std::shared_ptr<const certkv::codec::GaacCalibration> calibration;
    if (dump != nullptr && cal_path != nullptr) {
      kv = dumped_kv(dump, layer);
      calibration = calibration_layer(cal_path, layer);
    } else {
      kv = synthetic_kv(4096, 11);
      calibration = calibrate_on(synthetic_kv(4096, 12));
    }
    SchemeCaches c;
    c.source = kv.source;
    const int64_t period = kv.n_tokens / kBlockTokens * kBlockTokens;  // whole blocks repeat
    constexpr int64_t kStep = 1024;
    std::vector<float> k(kStep * kKvHeads * kHeadDim), v(k.size());
    for (int scheme = 0; scheme < 2; ++scheme) {
      cache::KvCacheConfig cfg;
      cfg.n_layers = 1;
      cfg.n_kv_heads = kKvHeads;
      cfg.head_dim = kHeadDim;
      cfg.block_tokens = kBlockTokens;
      cfg.max_tokens = kMaxTokens;
      cfg.scheme = cache::KvScheme(scheme);
      if (cfg.scheme == cache::KvScheme::kGaac) cfg.gaac_calibration = calibration;
      c.kv[scheme] = std::make_unique<cache::KvCache>(cfg);
      c.seq[scheme] = c.kv[scheme]->create_sequence();
      for (int64_t done = 0; done < kMaxTokens; done += kStep) {
        for (int64_t i = 0; i < kStep; ++i) {
          const size_t src = size_t((done + i) % period) * kKvHeads * kHeadDim;
          for (size_t e = 0; e < size_t(kKvHeads * kHeadDim); ++e) {
            k[size_t(i) * kKvHeads * kHeadDim + e] = certkv::format::bf16_to_float(kv.k[src + e]);
            v[size_t(i) * kKvHeads * kHeadDim + e] = certkv::format::bf16_to_float(kv.v[src + e]);
          }
        }
        c.kv[scheme]->reserve(c.seq[scheme], kStep);
        c.kv[scheme]->write(c.seq[scheme], 0, k.data(), v.data(), kStep);
        c.kv[scheme]->commit(c.seq[scheme], kStep);
      }
    }
    return c;
  }();
  return caches;
}

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

// Args: scheme (0 bf16, 1 gaac), n_ctx, threads. The same KV in both caches; compare the two
// scheme rows of one (n_ctx, threads) for the GAAC/BF16 time ratio.
void BM_DecodeAttentionScheme(benchmark::State& state) {
  const int scheme = int(state.range(0));
  const int64_t n_ctx = state.range(1);
  const int n_threads = int(state.range(2));
  const SchemeCaches& c = scheme_caches();
  const cache::KvCache& kv = *c.kv[scheme];
  ThreadPool pool(n_threads);
  const std::vector<float> q = random_queries(1);
  std::vector<float> out(q.size());
  for (auto _ : state) {
    certkv::attention::decode_attention(kv, c.seq[scheme], 0, kShape, q.data(), n_ctx, out.data(), &pool);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const cache::MemoryStats m = kv.memory_stats();
  uint64_t slots = 0;
  for (const cache::StorageClassStats& s : m.by_class) {
    if (s.storage == certkv::format::StorageClass::kGaac) slots = s.pages_in_use;
  }
  state.SetLabel(std::string(cache::kv_scheme_name(kv.scheme())) + " " + c.source);
  state.counters["time_per_token"] = benchmark::Counter(
      double(n_ctx), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["kv_read"] = benchmark::Counter(double(n_ctx) * 2 * kKvHeads * kHeadDim * 2,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["stored_bytes_per_token"] = double(m.bytes_in_use) / double(kMaxTokens);
  state.counters["slot_fraction"] = m.pages_in_use > 0 ? double(slots) / double(m.pages_in_use) : 0.0;
}
BENCHMARK(BM_DecodeAttentionScheme)
    ->ArgNames({"scheme", "n_ctx", "threads"})
    ->ArgsProduct({{0, 1}, {4096, 8192, 32768}, {1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Decode attention of one layer per KV scheme, for the page classes' CPU paths
// (docs/attention.md). Two shapes: SmolLM2-135M (9 query / 3 KV heads, head_dim 64) and
// Qwen2.5-0.5B (14 / 2, head_dim 64, GQA 7), 16-token blocks, synthetic KV (keys normal with
// per-channel scales 2^-2..2^2 and two massive RoPE pairs, values normal), the same KV in every
// scheme's cache. Args: model (0 SmolLM2, 1 Qwen2.5-0.5B), scheme (cache::KvScheme), n_ctx,
// threads, metered (the meter of every head in the same pass; lossy schemes only). Compare the
// scheme rows of one (model, n_ctx, threads) with bf16's in the same run.
struct PagesShape {
  int n_q_heads, n_kv_heads, head_dim;
};
constexpr PagesShape kPagesShapes[] = {{9, 3, 64}, {14, 2, 64}};

struct PagesCache {
  std::unique_ptr<cache::KvCache> kv;
  cache::SeqId seq = 0;
};

const PagesCache& pages_cache(int model, cache::KvScheme scheme,
                              certkv::codec::WitnessCode witness = certkv::codec::WitnessCode::kFp16) {
  static std::map<std::tuple<int, int, int>, PagesCache> caches;
  auto it = caches.find({model, int(scheme), int(witness)});
  if (it != caches.end()) return it->second;
  const PagesShape sh = kPagesShapes[model];
  const size_t row = size_t(sh.n_kv_heads) * size_t(sh.head_dim);
  auto make_rows = [&](uint32_t seed, int64_t n, std::vector<float>* k, std::vector<float>* v) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    k->resize(size_t(n) * row);
    v->resize(size_t(n) * row);
    for (size_t i = 0; i < k->size(); ++i) {
      const int c = int(i % size_t(sh.head_dim));
      const bool massive = c == 5 || c == 5 + sh.head_dim / 2 || c == 29 || c == 29 + sh.head_dim / 2;
      (*k)[i] = massive ? 40.f + normal(rng) : std::ldexp(normal(rng), (c * 5) % 5 - 2);
      (*v)[i] = normal(rng);
    }
  };
  cache::KvCacheConfig cfg;
  cfg.n_layers = 1;
  cfg.n_kv_heads = sh.n_kv_heads;
  cfg.head_dim = sh.head_dim;
  cfg.block_tokens = kBlockTokens;
  cfg.max_tokens = kMaxTokens;
  cfg.scheme = scheme;
  cfg.rope_pairing = certkv::codec::RopePairing::kHalfSplit;
  cfg.witness = witness;
  std::vector<float> k, v;
  if (scheme == cache::KvScheme::kGaac) {
    // Calibrated on other synthetic rows of the same law.
    certkv::codec::GaacShape gs;
    gs.n_layers = 1;
    gs.n_kv_heads = sh.n_kv_heads;
    gs.head_dim = sh.head_dim;
    gs.block_tokens = kBlockTokens;
    certkv::codec::GaacCalibrator calibrator(gs);
    make_rows(12, 4096, &k, &v);
    std::vector<uint16_t> rows(size_t(4096) * size_t(sh.head_dim));
    for (int which = 0; which < 2; ++which) {
      for (int h = 0; h < sh.n_kv_heads; ++h) {
        const std::vector<float>& x = which == 0 ? k : v;
        for (int64_t p = 0; p < 4096; ++p)
          for (int c = 0; c < sh.head_dim; ++c)
            rows[size_t(p) * size_t(sh.head_dim) + size_t(c)] =
                certkv::format::float_to_bf16(x[size_t(p) * row + size_t(h) * size_t(sh.head_dim) + size_t(c)]);
        calibrator.add_bf16(0, which, h, rows.data(), 4096);
      }
    }
    cfg.gaac_calibration = std::make_shared<const certkv::codec::GaacCalibration>(calibrator.finish());
  }
  PagesCache c;
  c.kv = std::make_unique<cache::KvCache>(cfg);
  c.seq = c.kv->create_sequence();
  constexpr int64_t kStep = 1024;
  for (int64_t done = 0; done < kMaxTokens; done += kStep) {
    make_rows(uint32_t(100 + done / kStep), kStep, &k, &v);
    c.kv->reserve(c.seq, kStep);
    c.kv->write(c.seq, 0, k.data(), v.data(), kStep);
    c.kv->commit(c.seq, kStep);
  }
  return caches.emplace(std::make_tuple(model, int(scheme), int(witness)), std::move(c)).first->second;
}

void decode_pages(benchmark::State& state, int model, cache::KvScheme scheme, int64_t n_ctx, int n_threads, bool metered,
                  certkv::codec::WitnessCode witness);

void BM_DecodePages(benchmark::State& state) {
  decode_pages(state, int(state.range(0)), cache::KvScheme(state.range(1)), state.range(2), int(state.range(3)),
               state.range(4) != 0, certkv::codec::WitnessCode::kFp16);
}

// fp8-e4m3 with each witness its K pages can keep, metered and not (docs/meter.md section 7): the
// fp16 witness (read from the page beside the codes) against the exponent witness (no bytes, the
// bound made from the codes in the scores' pass). Args: witness (codec::WitnessCode), n_ctx,
// metered; SmolLM2's shape, one thread. Run with --benchmark_enable_random_interleaving for
// alternating repetitions.
void BM_DecodeFp8Witness(benchmark::State& state) {
  decode_pages(state, 0, cache::KvScheme::kFp8E4M3, state.range(1), 1, state.range(2) != 0,
               certkv::codec::WitnessCode(state.range(0)));
  state.SetLabel(std::string("smollm2 fp8-e4m3 witness ") +
                 certkv::codec::witness_code_name(certkv::codec::WitnessCode(state.range(0))) +
                 (state.range(2) != 0 ? " metered" : ""));
}
BENCHMARK(BM_DecodeFp8Witness)
    ->ArgNames({"witness", "n_ctx", "metered"})
    ->ArgsProduct({{int64_t(certkv::codec::WitnessCode::kFp16), int64_t(certkv::codec::WitnessCode::kExponent)},
                   {4096, 32768},
                   {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void decode_pages(benchmark::State& state, int model, cache::KvScheme scheme, int64_t n_ctx, int n_threads, bool metered,
                  certkv::codec::WitnessCode witness) {
  if (metered && !cache::kv_scheme_is_lossy(scheme)) {
    state.SkipWithError("the meter needs a lossy scheme");
    return;
  }
  const PagesShape sh = kPagesShapes[model];
  const PagesCache& c = pages_cache(model, scheme, witness);
  ThreadPool pool(n_threads);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(size_t(sh.n_q_heads) * size_t(sh.head_dim)), out(q.size());
  for (float& e : q) e = normal(rng);
  std::vector<certkv::attention::HeadMeter> meters(size_t(sh.n_q_heads));
  certkv::attention::DecodeOptions options;
  if (metered) options.meters = meters.data();
  options.meter.delta_loc = 1e-10;
  const AttentionShape shape{sh.n_q_heads, sh.n_kv_heads, sh.head_dim, 1.f / std::sqrt(float(sh.head_dim))};
  for (auto _ : state) {
    certkv::attention::decode_attention(*c.kv, c.seq, 0, shape, q.data(), n_ctx, out.data(), &pool, options);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(model == 0 ? "smollm2 " : "qwen2.5-0.5b ") + cache::kv_scheme_name(scheme) +
                 (metered ? " metered" : ""));
  state.counters["time_per_token"] = benchmark::Counter(
      double(n_ctx), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void pages_args(benchmark::internal::Benchmark* b) {
  using S = cache::KvScheme;
  const S schemes[] = {S::kBf16, S::kGaac, S::kFp8E4M3, S::kDither8, S::kRtn4, S::kKivi2};
  for (int model : {0, 1})
    for (S s : schemes)
      for (int64_t n : {256, 4096, 16384, 32768})
        for (int threads : {1, 2})
          for (int metered : {0, 1})
            if (metered == 0 || cache::kv_scheme_is_lossy(s)) b->Args({model, int64_t(s), n, threads, metered});
}
BENCHMARK(BM_DecodePages)
    ->ArgNames({"model", "scheme", "n_ctx", "threads", "metered"})
    ->Apply(pages_args)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The lossy page benchmarks' spec: a 16 x 64 page of layer 3, kv_head 1; dither8 K pages keep
// four outlier pairs.
certkv::codec::LossyPageSpec bench_lossy_spec(certkv::codec::LossyScheme scheme, bool key) {
  namespace codec = certkv::codec;
  codec::LossyPageSpec spec;
  spec.scheme = scheme;
  spec.key = key;
  spec.block_tokens = kBlockTokens;
  spec.head_dim = 64;
  spec.dither_key = codec::dither8_key(3, spec.key, 1);
  static const uint16_t kPairs[4] = {2, 9, 17, 30};
  if (spec.scheme == codec::LossyScheme::kDither8 && spec.key) {
    spec.n_outlier_pairs = 4;
    spec.outlier_pairs = kPairs;
  }
  return spec;
}

// The decode step of the lossy page classes alone: one 16 x 64 page per call, 4096 pages of
// synthetic (normal) values encoded by the reference coder, decoded by one kernel of
// codec::LossyPageDecoder (dither8 also writes its scales for the meter). Args: scheme
// (codec::LossyScheme), K (1) or V (0), kernel (codec::LossyKernel). Counter: ns per page.
void BM_LossyPageDecode(benchmark::State& state) {
  namespace codec = certkv::codec;
  const codec::LossyPageSpec spec = bench_lossy_spec(codec::LossyScheme(state.range(0)), state.range(1) != 0);
  const codec::LossyKernel kernel = codec::LossyKernel(state.range(2));
  if (!codec::lossy_kernel_supported(kernel)) {
    state.SkipWithError("the CPU does not run this kernel");
    return;
  }
  constexpr int kPages = 4096;
  const size_t page_bytes = codec::lossy_page_bytes(spec);
  std::vector<uint8_t> pages(kPages * page_bytes);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> x(size_t(kBlockTokens) * 64);
  for (int p = 0; p < kPages; ++p) {
    for (uint16_t& e : x) e = certkv::format::float_to_bf16(normal(rng));
    codec::lossy_encode_page_ref(spec, uint32_t(p), x.data(), pages.data() + size_t(p) * page_bytes);
  }
  const codec::LossyPageDecoder decoder(spec, kernel);
  std::vector<float> out(x.size()), scales(2 * kBlockTokens);
  const bool dither8 = spec.scheme == codec::LossyScheme::kDither8;
  for (auto _ : state) {
    for (int p = 0; p < kPages; ++p)
      decoder.decode(uint32_t(p), pages.data() + size_t(p) * page_bytes, kBlockTokens, out.data(),
                     dither8 ? scales.data() : nullptr, kBlockTokens);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(std::string(codec::lossy_scheme_name(spec.scheme)) + (spec.key ? " K " : " V ") +
                 codec::lossy_kernel_name(kernel));
  state.counters["ns_per_page"] = benchmark::Counter(
      double(kPages) * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_LossyPageDecode)
    ->ArgNames({"scheme", "key", "kernel"})
    ->ArgsProduct({{0, 3, 4, 5, 6}, {1, 0}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond);

// The encode of one lossy page at block finalize (what the cache does every block_tokens tokens
// for each (layer, K or V, kv_head)): a 16 x 64 page of synthetic (normal) values per call, 256
// distinct pages in turn, by lossy_encode_page_ref (path 0) or lossy_encode_page (path 1, the
// cache's; the same bytes). Args: scheme (codec::LossyScheme), K (1) or V (0), path. Counter: ns
// per page.
void BM_LossyPageEncode(benchmark::State& state) {
  namespace codec = certkv::codec;
  const codec::LossyPageSpec spec = bench_lossy_spec(codec::LossyScheme(state.range(0)), state.range(1) != 0);
  constexpr int kPages = 256;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> x(size_t(kPages) * kBlockTokens * 64);
  for (uint16_t& e : x) e = certkv::format::float_to_bf16(normal(rng));
  std::vector<uint8_t> page(codec::lossy_page_bytes(spec));
  const auto encode = state.range(2) == 0 ? &codec::lossy_encode_page_ref : &codec::lossy_encode_page;
  for (auto _ : state) {
    for (int p = 0; p < kPages; ++p)
      benchmark::DoNotOptimize(encode(spec, uint32_t(p), x.data() + size_t(p) * kBlockTokens * 64, page.data()));
  }
  state.SetLabel(std::string(codec::lossy_scheme_name(spec.scheme)) + (spec.key ? " K " : " V ") +
                 (state.range(2) == 0 ? "reference" : "production"));
  state.counters["ns_per_page"] = benchmark::Counter(
      double(kPages) * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_LossyPageEncode)
    ->ArgNames({"scheme", "key", "path"})
    ->ArgsProduct({{0, 1, 2, 3, 4, 5, 6}, {1, 0}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

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
