// Matrix products on SmolLM2-135M's weight shapes (model/matmul.h): the Q4_1 projections
// [576 -> 576] (q, o), [576 -> 192] (k, v), [576 -> 1536] (gate, up), [1536 -> 576] (down) and the
// tied Q8_0 output head [576 -> 49152], at 1 token (decode) and 512 tokens (prefill), on 1 and 2
// threads. Weights are random codes with finite scales (speed does not depend on the values).
//
// Counters: GFLOP/s = 2 n_in n_out n_tokens / time. Decode also reports weight_GB/s, the weight
// bytes read per second. "hot" runs repeat one matrix (it stays in cache); "cold" runs rotate
// through copies filling 128 MiB, so every call streams its weights from DRAM as a real decode
// step does. BM_DecodeAllMatmuls runs every matrix product of one SmolLM2 decode step (30 layers
// of 7 products, then the output head) on distinct weights, for 1 and 8 sequences: tokens/s is the
// ceiling that the matrix products alone put on decode speed. BM_PrefillAllMatmuls does the same for a 512-token
// prompt (the 210 layer products; the head only sees the last token, so it is left out).
// On a shared machine run with --benchmark_repetitions=N: the "min" statistic (fastest
// repetition) is the least disturbed by other processes.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "format/numeric.h"
#include "model/ggml_type.h"
#include "model/matmul.h"
#include "model/matmul_tiles.h"

namespace {

using certkv::ThreadPool;
using certkv::format::GgmlType;
using certkv::model::WeightMatrix;

struct Shape {
  GgmlType type;
  int64_t n_in, n_out;
};

const Shape kShapes[] = {
    {GgmlType::kQ4_1, 576, 576},  {GgmlType::kQ4_1, 576, 192},   {GgmlType::kQ4_1, 576, 1536},
    {GgmlType::kQ4_1, 1536, 576}, {GgmlType::kQ8_0, 576, 49152},
};

// n_copies matrices of one shape in one buffer, random codes, fp16 scales in [0.001, 0.01].
struct Weights {
  std::vector<uint8_t> bytes;
  std::vector<WeightMatrix> matrices;
  std::vector<std::vector<uint8_t>> tiles;
};

// With tiles (model/matmul_tiles.h), as a model loaded on a CPU with AMX has them. Returns false
// where the tile path is not available (the benchmark then reports an error).
bool attach_tiles(Weights& w) {
  if (!certkv::model::matmul_tiles_available()) return false;
  for (WeightMatrix& m : w.matrices) {
    w.tiles.emplace_back(certkv::model::matmul_tiles_bytes(m));
    certkv::model::tile_weights(m, w.tiles.back().data());
    m.tiles = w.tiles.back().data();
  }
  return true;
}

Weights make_weights(const Shape& s, int64_t n_copies, uint32_t seed) {
  Weights w;
  const size_t row_bytes = certkv::model::ggml_row_bytes(s.type, s.n_in);
  const size_t matrix_bytes = row_bytes * size_t(s.n_out);
  w.bytes.resize(matrix_bytes * size_t(n_copies));
  std::mt19937 rng(seed);
  for (auto& b : w.bytes) b = uint8_t(rng());
  const size_t block_bytes = certkv::model::ggml_block_bytes(s.type);
  std::uniform_real_distribution<float> scale(0.001f, 0.01f);
  for (size_t b = 0; b < w.bytes.size() / block_bytes; ++b) {
    const uint16_t d = certkv::format::float_to_fp16(scale(rng));
    std::memcpy(w.bytes.data() + b * block_bytes, &d, 2);
    if (s.type == GgmlType::kQ4_1) std::memcpy(w.bytes.data() + b * block_bytes + 2, &d, 2);
  }
  for (int64_t c = 0; c < n_copies; ++c)
    w.matrices.push_back(
        certkv::model::weight_matrix(s.type, w.bytes.data() + size_t(c) * matrix_bytes, s.n_in, s.n_out));
  return w;
}

std::vector<float> make_activations(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = normal(rng);
  return x;
}

// Args: shape index, n_tokens, threads, cold (0/1), tiles (0/1).
void BM_Matmul(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  const int64_t n_tokens = state.range(1);
  const int threads = int(state.range(2));
  const bool cold = state.range(3) != 0;
  const size_t matrix_bytes = certkv::model::ggml_row_bytes(s.type, s.n_in) * size_t(s.n_out);
  const int64_t n_copies =
      cold ? std::max<int64_t>(2, int64_t((size_t(128) << 20) / matrix_bytes)) : 1;
  Weights w = make_weights(s, n_copies, 1);
  if (state.range(4) != 0 && !attach_tiles(w)) return state.SkipWithError("no AMX tiles here");
  const std::vector<float> x = make_activations(n_tokens * s.n_in, 2);
  std::vector<float> y(size_t(n_tokens * s.n_out));
  ThreadPool pool(threads);
  int64_t next = 0;
  for (auto _ : state) {
    certkv::model::matmul(w.matrices[size_t(next)], x.data(), n_tokens, y.data(), pool);
    next = (next + 1) % n_copies;
    benchmark::DoNotOptimize(y.data());
  }
  const double flops = 2.0 * double(s.n_in) * double(s.n_out) * double(n_tokens);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (n_tokens == 1)
    state.counters["weight_GB/s"] = benchmark::Counter(
        double(matrix_bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(certkv::model::ggml_type_name(s.type)) + " " + std::to_string(s.n_in) +
                 "->" + std::to_string(s.n_out) + (cold ? " cold" : " hot"));
}

void matmul_args(benchmark::internal::Benchmark* b) {
  for (int64_t shape = 0; shape < int64_t(std::size(kShapes)); ++shape)
    for (int64_t threads : {1, 2})
      for (int64_t tiles : {0, 1}) {
        b->Args({shape, 1, threads, 0, tiles});
        b->Args({shape, 1, threads, 1, tiles});
        b->Args({shape, 8, threads, 0, tiles});
        b->Args({shape, 8, threads, 1, tiles});
        b->Args({shape, 512, threads, 0, tiles});
      }
}
double fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

BENCHMARK(BM_Matmul)
    ->Apply(matmul_args)
    ->ArgNames({"shape", "tokens", "threads", "cold", "tiles"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->ComputeStatistics("min", fastest);

constexpr int kLayers = 30;

// The 7 products of every layer (q, k, v, o, gate, up, down), kLayers copies each, with tiles
// when `tiles` (false if the tile path is not available).
bool layer_weights(bool tiles, std::vector<Weights>* weights) {
  const Shape layer[] = {kShapes[0], kShapes[1], kShapes[1], kShapes[0],
                         kShapes[2], kShapes[2], kShapes[3]};
  for (const Shape& s : layer) {
    weights->push_back(make_weights(s, kLayers, 3 + uint32_t(weights->size())));
    if (tiles && !attach_tiles(weights->back())) return false;
  }
  return true;
}

// One decode step's matrix products for a batch of sequences (one token each: the engine's
// decode step). Args: threads, tokens, tiles (0/1).
void BM_DecodeAllMatmuls(benchmark::State& state) {
  const int threads = int(state.range(0));
  const int64_t tokens = state.range(1);
  const bool tiles = state.range(2) != 0;
  std::vector<Weights> weights;
  Weights head = make_weights(kShapes[4], 1, 99);
  if (!layer_weights(tiles, &weights) || (tiles && !attach_tiles(head)))
    return state.SkipWithError("no AMX tiles here");
  const std::vector<float> x = make_activations(size_t(tokens) * 1536, 4);
  std::vector<float> y(size_t(tokens) * 49152);
  ThreadPool pool(threads);
  double bytes = 0;
  for (const Weights& w : weights) bytes += double(w.bytes.size());
  bytes += double(head.bytes.size());
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l)
      for (const Weights& w : weights)
        certkv::model::matmul(w.matrices[size_t(l)], x.data(), tokens, y.data(), pool);
    certkv::model::matmul(head.matrices[0], x.data(), tokens, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_DecodeAllMatmuls)
    ->ArgsProduct({{1, 2}, {1, 8}, {0, 1}})
    ->ArgNames({"threads", "tokens", "tiles"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", fastest);

// A 512-token prompt's layer products. Args: threads, tiles (0/1).
void BM_PrefillAllMatmuls(benchmark::State& state) {
  constexpr int64_t kTokens = 512;
  const int threads = int(state.range(0));
  std::vector<Weights> weights;
  if (!layer_weights(state.range(1) != 0, &weights)) return state.SkipWithError("no AMX tiles here");
  const std::vector<float> x = make_activations(kTokens * 1536, 4);
  std::vector<float> y(size_t(kTokens) * 1536);
  ThreadPool pool(threads);
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l)
      for (const Weights& w : weights)
        certkv::model::matmul(w.matrices[size_t(l)], x.data(), kTokens, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(kTokens), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PrefillAllMatmuls)
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->ArgNames({"threads", "tiles"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ComputeStatistics("min", fastest);

}  // namespace
