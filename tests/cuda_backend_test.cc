// The CUDA backend end to end on the real model (runs where a CUDA device is present:
// scripts/run_cuda_tests.sh --run; skipped elsewhere unless CERTKV_REQUIRE_DEVICE is set):
// many sequences over one device page pool, against the CPU backend and against themselves.
//  - Batch invariance on the device: every scheme the backend serves and the table marks batch
//    invariant gives each sequence the same logits bit for bit alone, in ragged batches and at any
//    position, and under ragged prefill chunks (lossy pages too).
//  - The logits agree with the CPU backend's (f32 activations, bf16 pages): teacher forced over
//    1,000 positions of a book passage, max KL below 1e-3 and top-1 agreement >= 0.99 (with
//    CERTKV_TEST_MODEL naming another model, e.g. Qwen2.5-0.5B, the same bar on it); dither8's
//    fragment-major pages against the CPU's dither8, logits and the Tier B meter.
//  - The engine on the device: continuous batching, prefix sharing and preemption on a small pool
//    give every request its output alone; cancel frees its pages; the meter's telemetry of the
//    lossy schemes comes from the decode steps.
//  - Sparse decode on the device: batch invariant like the dense path; against the CPU backend's
//    sparse decode, layer 0 (the same inputs) selects the same tokens, and the logits stay much
//    closer to the CPU's sparse run than sparse is to dense.
//  - Sampling on the device draws the host sampler's tokens from the same logits; gaac pages give
//    the text of bf16 pages.
//  - What the backend does not serve is refused by name.
//  - Deferred encode results give the logits and pages of waiting for them, and the engine's
//    batching, sharing and preemption over them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_forward.h"
#include "backend/host_forward.h"
#include <cuda_runtime.h>
#include "attention/cuda/paged_decode_cuda.h"
#include "cache/kv_scheme.h"
#include "codec/gaac.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/gaac_self_calibration.h"
#include "engine/outlier_pair_calibration.h"
#include "backend_test_support.h"
#include "gaac_e2e_support.h"
#include "model/model.h"
#include "model/sampler.h"
#include "test_paths.h"

namespace certkv::backend {
namespace {

using testing::expect_bit_identical;
using testing::ragged_prompts;
using testing::run_batched;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::string(v) : fallback;
}

bool cuda_required() {
  const char* v = std::getenv("CERTKV_REQUIRE_DEVICE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

int host_threads() { return int(std::max(2u, std::min(16u, std::thread::hardware_concurrency()))); }

const model::Model& smollm2() {
  static std::unique_ptr<model::Model> m =
      model::load_model(env_or("CERTKV_TEST_MODEL", testing::smollm2_gguf()));
  return *m;
}

std::string corpus_file(const std::string& book) {
  return env_or("CERTKV_TEST_CORPUS", testing::test_data_path("corpus")) + "/" + book;
}

BackendConfig device_config(cache::KvScheme scheme, int64_t context, int64_t pool) {
  BackendConfig cfg;
  cfg.device = model::Device::kCuda;
  cfg.context_tokens = context;
  cfg.pool_tokens = pool;
  cfg.n_threads = host_threads();
  cfg.kv_scheme = scheme;
  const cache::KvSchemeInfo& s = cache::kv_scheme_info(scheme);
  if (s.gaac && s.cuda_fragment_pages) {
    // GAAC device pages need windows where the model's exponents are: its calibration from the
    // built-in text, made once.
    static const auto calibrated = std::make_shared<const codec::GaacCalibration>(
        engine::calibrate_gaac_from_text(smollm2(), s.element, 16, host_threads()));
    cfg.gaac_calibration = calibrated;
  } else if (s.gaac) {
    // The calibration that fits every block (bases 0, the largest escape capacity): GAAC slots
    // for every full block.
    const model::ModelConfig& c = smollm2().config();
    codec::GaacShape shape;
    shape.n_layers = c.n_layers;
    shape.n_kv_heads = c.n_kv_heads;
    shape.head_dim = c.head_dim;
    shape.element = s.element;
    cfg.gaac_calibration = std::make_shared<const codec::GaacCalibration>(shape);
  }
  // dither8's outlier pairs fixed for the model, as the engine fixes them.
  if (scheme == cache::KvScheme::kDither8)
    cfg.outlier_pair_table = engine::outlier_pairs_from_text(smollm2(), cache::kDefaultOutlierPairs, 16, host_threads());
  return cfg;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    try {
      make_backend(smollm2(), device_config(cache::KvScheme::kBf16, 64, 64));
    } catch (const Error& e) {
      if (e.code() == StatusCode::kUnsupported && !cuda_required()) GTEST_SKIP() << "no cuda backend here: " << e.what();
      FAIL() << "the cuda backend did not start: " << e.what();
    }
  }
};

TEST_F(CudaBackendTest, BatchInvarianceOnTheDeviceForEveryServedScheme) {
  // Ragged prompts past one split (32 blocks = 512 tokens) so that sequences of a batch have
  // different split counts.
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(smollm2(), {1, 3, 17, 40, 530}, 7);
  const int decode_steps = 4;
  // Every served scheme with its default witness, then fp8-e4m3 with the exponent witness (its own
  // device pages, kFp8Fragments).
  std::vector<std::pair<cache::KvScheme, codec::WitnessCode>> runs;
  for (const cache::KvSchemeInfo& s : cache::kv_schemes())
    if (s.cuda_route && s.batch_invariant) runs.push_back({s.scheme, codec::WitnessCode::kFp16});
  runs.push_back({cache::KvScheme::kFp8E4M3, codec::WitnessCode::kExponent});
  int checked = 0;
  for (const auto& [scheme, witness] : runs) {
    SCOPED_TRACE(std::string(cache::kv_scheme_name(scheme)) + " witness " + codec::witness_code_name(witness));
    BackendConfig cfg = device_config(scheme, 544, 544 * 6);
    cfg.witness = witness;
    std::vector<std::vector<float>> alone(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) alone[i] = run_batched(smollm2(), cfg, {prompts[i]}, {1 << 20}, false, decode_steps)[0];
    const std::vector<int> whole(prompts.size(), 1 << 20);
    expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, whole, false, decode_steps), "one batch");
    expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, whole, true, decode_steps), "rotating batch");
    expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, {1, 2, 5, 16, 97}, true, decode_steps),
                         "ragged chunks, rotating batch");
    if (HasFatalFailure()) return;
    ++checked;
  }
  EXPECT_GE(checked, 7);  // bf16, gaac, gaac-e5m2, fp8-e4m3, fp8-e5m2, dither8; fp8-e4m3 with the exponent witness
}

// Deferred encode results (BackendConfig::defer_encode_results) against waiting for them in every
// layer: the same logits bit for bit and the same pages by class, for gaac (with layers whose
// escape capacity no block fits, so that their blocks stay raw while the others' become slots),
// fp8-e4m3 and dither8, over ragged prompts (a partial block, whole blocks, past one split) in one
// batch and in ragged chunks, and decode steps that cross block boundaries in different steps for
// different sequences (the prompt rows that read their own block exact included).
TEST_F(CudaBackendTest, DeferredEncodeResultsGiveTheLogitsAndPagesOfWaitingOnes) {
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(smollm2(), {1, 3, 17, 40, 530}, 29);
  const int decode_steps = 40;
  const model::ModelConfig& c = smollm2().config();
  for (cache::KvScheme scheme : {cache::KvScheme::kGaac, cache::KvScheme::kFp8E4M3, cache::KvScheme::kDither8}) {
    SCOPED_TRACE(cache::kv_scheme_name(scheme));
    BackendConfig waiting = device_config(scheme, 576, 576 * 6);
    waiting.defer_encode_results = false;
    if (scheme == cache::KvScheme::kGaac) {
      auto cal = std::make_shared<codec::GaacCalibration>(*waiting.gaac_calibration);
      // Windows at exponent 0 (layer 0, and layer 1's V): every element of a block is an exception,
      // so none fits a GAAC device page (nor a GAAC slot of escape capacity 0).
      for (auto [layer, kv] : {std::pair{0, codec::kGaacKey}, {0, codec::kGaacValue}, {1, codec::kGaacValue}}) {
        cal->set_escape_capacity_bytes(layer, kv, 0);
        for (int h = 0; h < c.n_kv_heads; ++h) {
          codec::GaacBases& b = cal->bases(layer, kv, h);
          std::fill(b.b3.begin(), b.b3.end(), uint8_t(0));
          std::fill(b.b4.begin(), b.b4.end(), uint8_t(0));
        }
      }
      waiting.gaac_calibration = cal;
    }
    BackendConfig deferred = waiting;
    deferred.defer_encode_results = true;
    const std::vector<std::vector<int>> chunkings = {std::vector<int>(prompts.size(), 1 << 20), {1, 2, 5, 16, 97}};
    for (size_t ci = 0; ci < chunkings.size(); ++ci) {
      SCOPED_TRACE(ci == 0 ? "whole prompts" : "ragged chunks");
      cache::MemoryStats want{}, got{};
      const std::vector<std::vector<float>> a =
          run_batched(smollm2(), waiting, prompts, chunkings[ci], true, decode_steps, &want);
      const std::vector<std::vector<float>> b =
          run_batched(smollm2(), deferred, prompts, chunkings[ci], true, decode_steps, &got);
      expect_bit_identical(a, b, "deferred encode results");
      EXPECT_EQ(got.pages_in_use, want.pages_in_use);
      EXPECT_EQ(got.bytes_in_use, want.bytes_in_use);
      EXPECT_EQ(got.exact_fallback_blocks, want.exact_fallback_blocks);
      ASSERT_EQ(got.by_class.size(), want.by_class.size());
      ASSERT_EQ(want.by_class.size(), 2u);
      for (size_t k = 0; k < want.by_class.size(); ++k) {
        EXPECT_EQ(got.by_class[k].storage, want.by_class[k].storage);
        EXPECT_EQ(got.by_class[k].pages_in_use, want.by_class[k].pages_in_use) << "class " << k;
        EXPECT_EQ(got.by_class[k].page_bytes_in_use, want.by_class[k].page_bytes_in_use) << "class " << k;
      }
      // Whole blocks were coded, and (gaac) more blocks stayed raw than the tails hold.
      EXPECT_GT(want.by_class[1].pages_in_use, 0u);
      if (scheme == cache::KvScheme::kGaac) {
        EXPECT_GT(want.by_class[0].pages_in_use, uint64_t(prompts.size()) * uint64_t(c.n_layers) * 2 * uint64_t(c.n_kv_heads))
            << "the layers of capacity 0 keep their blocks raw";
      }
      if (HasFatalFailure()) return;
    }
  }
}

// Sparse decode from early on: a window of 16 tokens (so 16-token prompts are indexed and every
// 16 decode steps index a block more), the first two layers dense.
BackendConfig sparse_config(int64_t context, int64_t pool) {
  BackendConfig cfg = device_config(cache::KvScheme::kBf16, context, pool);
  cfg.sparse.enabled = true;
  cfg.sparse.p = 0.9;
  cfg.sparse.window_tokens = 16;
  cfg.sparse.dense_layers = 2;
  return cfg;
}

TEST_F(CudaBackendTest, SparseBatchInvarianceOnTheDevice) {
  // Ragged prompts, two past one split of sparse decode (4 chunks of 1,024 tokens) is not needed:
  // what varies with the batch is the longest index and window, which these do.
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(smollm2(), {1, 3, 17, 40, 530}, 17);
  const int decode_steps = 20;  // lazy updates of the index for every prompt
  BackendConfig cfg = sparse_config(576, 576 * 6);
  std::vector<std::vector<float>> alone(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i)
    alone[i] = run_batched(smollm2(), cfg, {prompts[i]}, {1 << 20}, false, decode_steps)[0];
  const std::vector<int> whole(prompts.size(), 1 << 20);
  expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, whole, false, decode_steps), "sparse, one batch");
  expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, whole, true, decode_steps), "sparse, rotating batch");
  // bf16 is chunking invariant, and so is the index: its centroids sum the first input's
  // queries and keys in token order however the input was cut.
  expect_bit_identical(alone, run_batched(smollm2(), cfg, prompts, {1, 2, 5, 16, 97}, true, decode_steps),
                       "sparse, ragged chunks, rotating batch");
  // And it was sparse: the 530-token prompt attends a fraction of its context.
  std::unique_ptr<Backend> be = make_backend(smollm2(), cfg);
  const cache::SeqId s = be->create_sequence();
  BatchItem it{s, prompts[4].data(), int64_t(prompts[4].size()), nullptr, nullptr, true};
  be->forward({&it, 1});
  int32_t next = prompts[4][5];
  for (int step = 0; step < 3; ++step) {
    BatchItem d{s, &next, 1, nullptr, nullptr, true};
    be->forward({&d, 1});
  }
  const SparseStats& ss = be->sparse_stats(s);
  const model::ModelConfig& c = smollm2().config();
  EXPECT_EQ(ss.steps, 3);
  EXPECT_EQ(ss.cells, int64_t(3) * (c.n_layers - 2) * c.n_heads);
  EXPECT_EQ(ss.index_appended_tokens, (530 - 16) / 16 * 16);
  const SequenceReport r = be->report(s);
  EXPECT_TRUE(r.sparse);
  EXPECT_GT(r.sparse_budget, 0.0);
  EXPECT_LT(r.sparse_budget, 0.5) << "p 0.9 attends a fraction of 530 tokens";
}

double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  auto log_softmax = [n](const float* x) {
    const double m = *std::max_element(x, x + n);
    double s = 0;
    for (int i = 0; i < n; ++i) s += std::exp(double(x[i]) - m);
    std::vector<double> out(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) out[size_t(i)] = double(x[i]) - m - std::log(s);
    return out;
  };
  const std::vector<double> lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (int i = 0; i < n; ++i) kl += std::exp(lp[size_t(i)]) * (lp[size_t(i)] - lq[size_t(i)]);
  return kl;
}

TEST_F(CudaBackendTest, LogitsAgreeWithTheCpuBackend) {
  const model::Model& m = smollm2();
  std::vector<int32_t> tokens = m.tokenizer().encode(testing::read_text(corpus_file("melville-moby-dick.txt")), true, false);
  const int prompt = 960, steps = 40;  // 1,000 teacher-forced positions
  ASSERT_GE(tokens.size(), size_t(prompt + steps));
  tokens.resize(size_t(prompt + steps));
  const int nv = m.config().n_vocab;
  BackendConfig cfg = device_config(cache::KvScheme::kBf16, prompt + steps, prompt + steps);
  cfg.activations = model::ActivationFormat::kFloat32;
  BackendConfig cpu_cfg = cfg;
  cpu_cfg.device = model::Device::kCpu;
  std::unique_ptr<Backend> gpu = make_backend(m, cfg), cpu = make_backend(m, cpu_cfg);
  EXPECT_STREQ(gpu->name(), "cuda");
  const cache::SeqId sg = gpu->create_sequence(), sc = cpu->create_sequence();
  // The prompt in chunks of 256 (prefill attention on the device), then one token a step.
  std::vector<float> lg(size_t(prompt + steps) * size_t(nv)), lc(lg.size());
  for (int64_t at = 0; at < prompt + steps;) {
    const int64_t n = at < prompt ? std::min<int64_t>(256, prompt - at) : 1;
    BatchItem g{sg, tokens.data() + at, n, nullptr, &lg[size_t(at) * size_t(nv)], true};
    BatchItem c{sc, tokens.data() + at, n, nullptr, &lc[size_t(at) * size_t(nv)], true};
    gpu->forward({&g, 1});
    cpu->forward({&c, 1});
    at += n;
  }
  double kl_max = 0, kl_sum = 0;
  int agree = 0;
  const int positions = prompt + steps;
  for (int t = 0; t < positions; ++t) {
    const float* a = &lc[size_t(t) * size_t(nv)];
    const float* b = &lg[size_t(t) * size_t(nv)];
    for (int i = 0; i < nv; ++i) ASSERT_TRUE(std::isfinite(b[i])) << "position " << t;
    const double kl = kl_divergence(a, b, nv);
    kl_max = std::max(kl_max, kl);
    kl_sum += kl;
    agree += model::argmax(a, nv) == model::argmax(b, nv);
  }
  printf("[cuda backend] bf16, %d positions: mean KL %.3g, max KL %.3g, top-1 agree %d/%d\n", positions,
         kl_sum / positions, kl_max, agree, positions);
  EXPECT_LT(kl_max, 1e-3);
  EXPECT_GE(agree, positions * 99 / 100);
}

// The lossy schemes the device stores fragment-major against the CPU backend's same scheme,
// teacher forced over 1,000 positions of a book passage (prompt in chunks of 256: prefill rows
// read the finalized pages and their own blocks exact; then 40 decode steps, metered):
//  - dither8 (PageFormat::kDither8Fragments, the scheme table's cuda_fragment_pages): the pages'
//    dither is keyed by the block's position on both, but the device's activations come from
//    bf16 weight products, so the bars are the session's for dither8
//    (SessionCuda.LossySchemesDecodeWithTheMeterOnTheDevice): the device's distance from the exact
//    (bf16) CPU run of the order of the CPU dither8 run's, the Tier B meter's p99 and max within
//    10% of the CPU's;
//  - fp8-e4m3 with the exponent witness (kFp8Fragments: K pages of codes alone, the bound made
//    from the codes by one more tensor-core product): the logits the CPU's as bf16 pages are
//    (max KL 1e-3, top-1 99%), the meter's p99 and max within 2% of the CPU's page-rows bound
//    of the same form (as the session's fp8 meters are).
// In both the meter's cells are every (step, layer, head), coverage at tau within 0.01, each cell
// of the recent-step meters (RecentStepMeters) below 1 on the CPU within the scheme's bar of the
// CPU's for 99% of them, and pages kept exact are counted alike.
TEST_F(CudaBackendTest, FragmentPageLogitsAndMetersAgreeWithTheCpuBackend) {
  const model::Model& m = smollm2();
  std::vector<int32_t> tokens = m.tokenizer().encode(testing::read_text(corpus_file("melville-moby-dick.txt")), true, false);
  const int prompt = 960, steps = 40;
  ASSERT_GE(tokens.size(), size_t(prompt + steps));
  tokens.resize(size_t(prompt + steps));
  const int nv = m.config().n_vocab;
  BackendConfig exact_cfg = device_config(cache::KvScheme::kBf16, prompt + steps, prompt + steps);
  exact_cfg.activations = model::ActivationFormat::kFloat32;
  exact_cfg.device = model::Device::kCpu;
  std::vector<float> exact_logits(size_t(prompt + steps) * size_t(nv));
  {
    std::unique_ptr<Backend> exact = make_backend(m, exact_cfg);
    const cache::SeqId s = exact->create_sequence();
    for (int64_t at = 0; at < prompt + steps;) {
      const int64_t n = at < prompt ? std::min<int64_t>(256, prompt - at) : 1;
      BatchItem it{s, tokens.data() + at, n, nullptr, &exact_logits[size_t(at) * size_t(nv)], true};
      exact->forward({&it, 1});
      at += n;
    }
  }
  const std::pair<cache::KvScheme, codec::WitnessCode> runs[] = {
      {cache::KvScheme::kDither8, codec::WitnessCode::kFp16}, {cache::KvScheme::kFp8E4M3, codec::WitnessCode::kExponent}};
  for (const auto& [scheme, witness] : runs) {
    const bool dither8 = scheme == cache::KvScheme::kDither8;
    const attention::cuda::PageFormat format = attention::cuda::page_format_of(scheme, witness);
    SCOPED_TRACE(attention::cuda::page_format_name(format));
    EXPECT_EQ(format, dither8 ? attention::cuda::PageFormat::kDither8Fragments : attention::cuda::PageFormat::kFp8Fragments);
    BackendConfig cfg = device_config(scheme, prompt + steps, prompt + steps);
    cfg.activations = model::ActivationFormat::kFloat32;
    cfg.witness = witness;
    cfg.meter.recent_steps = steps;  // every decode step's meter cells, compared below
    BackendConfig cpu_cfg = cfg;
    cpu_cfg.device = model::Device::kCpu;
    std::unique_ptr<Backend> gpu = make_backend(m, cfg), cpu = make_backend(m, cpu_cfg);
    EXPECT_STREQ(gpu->name(), "cuda");
    Backend* backends[2] = {gpu.get(), cpu.get()};
    cache::SeqId seqs[2];
    std::vector<std::vector<float>> logits(2, std::vector<float>(size_t(prompt + steps) * size_t(nv)));
    for (int i = 0; i < 2; ++i) seqs[i] = backends[i]->create_sequence();
    for (int64_t at = 0; at < prompt + steps;) {
      const int64_t n = at < prompt ? std::min<int64_t>(256, prompt - at) : 1;
      for (int i = 0; i < 2; ++i) {
        BatchItem it{seqs[i], tokens.data() + at, n, nullptr, &logits[size_t(i)][size_t(at) * size_t(nv)], true};
        backends[i]->forward({&it, 1});
      }
      at += n;
    }
    double kl_sum = 0, kl_max = 0, gpu_exact_kl = 0, cpu_exact_kl = 0;
    int agree = 0;
    for (int t = prompt; t < prompt + steps; ++t) {
      const float* g = &logits[0][size_t(t) * size_t(nv)];
      const float* c = &logits[1][size_t(t) * size_t(nv)];
      const float* e = &exact_logits[size_t(t) * size_t(nv)];
      for (int i = 0; i < nv; ++i) ASSERT_TRUE(std::isfinite(g[i])) << "position " << t;
      const double kl = kl_divergence(c, g, nv);
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      gpu_exact_kl += kl_divergence(e, g, nv);
      cpu_exact_kl += kl_divergence(e, c, nv);
      agree += model::argmax(c, nv) == model::argmax(g, nv);
    }
    for (int t = 0; t < prompt; ++t)
      for (int i = 0; i < nv; ++i) ASSERT_TRUE(std::isfinite(logits[0][size_t(t) * size_t(nv) + size_t(i)])) << "position " << t;
    const SequenceReport rg = gpu->report(seqs[0]), rc = cpu->report(seqs[1]);
    printf("[cuda backend] %s (%s), %d decode steps: device vs CPU mean KL %.3g, max KL %.3g, top-1 agree %d/%d; "
           "vs exact: device %.3g, CPU %.3g; meter cells %lld / %lld, p99 %.4g / %.4g, max %.4g / %.4g (device / "
           "CPU); pages kept exact %lld / %lld\n",
           cache::kv_scheme_name(scheme), attention::cuda::page_format_name(format), steps, kl_sum / steps, kl_max,
           agree, steps, gpu_exact_kl / steps, cpu_exact_kl / steps, (long long)rg.meter_cells,
           (long long)rc.meter_cells, rg.meter_p99, rc.meter_p99, rg.meter_max, rc.meter_max,
           (long long)gpu->memory_stats().exact_fallback_blocks, (long long)cpu->memory_stats().exact_fallback_blocks);
    if (dither8) {
      EXPECT_LT(gpu_exact_kl, 3 * cpu_exact_kl + 1e-3 * steps);
    } else {
      EXPECT_LT(kl_max, 1e-3);
      EXPECT_GE(agree, steps - 1);
    }
    ASSERT_TRUE(rg.metered);
    ASSERT_TRUE(rc.metered);
    EXPECT_EQ(rg.meter_cells, rc.meter_cells);
    EXPECT_EQ(rg.meter_cells, int64_t(steps) * m.config().n_layers * m.config().n_heads);
    const double tol = dither8 ? 0.10 : 0.02;
    EXPECT_NEAR(rg.meter_p99, rc.meter_p99, tol * rc.meter_p99 + 1e-9);
    EXPECT_NEAR(rg.meter_max, rc.meter_max, tol * rc.meter_max + 1e-9);
    EXPECT_NEAR(rg.coverage, rc.coverage, 0.01);
    // fp8's meter saturates (p99 and max 1 over the whole model), so the agreement is read cell by
    // cell, every (step, layer, head) of the decode steps where the CPU's meter is below 1: the
    // same bar, on enough cells to mean something, met by 99% of them (a key whose bf16 product
    // on the device rounds to the next fp8 code moves its cell's bound by that code's step).
    const gate::RecentStepMeters &mg = gpu->recent_meters(), &mc = cpu->recent_meters();
    ASSERT_EQ(mg.size(), steps);
    ASSERT_EQ(mc.size(), steps);
    const int cells = m.config().n_layers * m.config().n_heads;
    int64_t compared = 0, off = 0;
    std::vector<double> rel;  // (device - CPU) / CPU of every compared cell
    for (int i = 0; i < steps; ++i) {
      const float* g = mg.step(i).meters;
      const float* c = mc.step(i).meters;
      for (int k = 0; k < cells; ++k) {
        if (!(c[k] < 1.f)) continue;
        ++compared;
        if (!(std::fabs(double(g[k]) - double(c[k])) <= tol * double(c[k]) + 1e-9)) ++off;
        rel.push_back((double(g[k]) - double(c[k])) / std::max(double(c[k]), 1e-30));
      }
    }
    printf("[cuda backend] %s: %lld of %lld (step, layer, head) cells below 1 on the CPU compared, %lld beyond %.0f%%\n",
           cache::kv_scheme_name(scheme), (long long)compared, (long long)steps * cells, (long long)off, 100 * tol);
    // How the cells differ, for reading a failure: a bias (the median's sign) points at the bounds'
    // arithmetic, a spread without one at the inputs (the device's keys from bf16 products).
    if (!rel.empty()) {
      std::vector<double> mag(rel.size());
      for (size_t i = 0; i < rel.size(); ++i) mag[i] = std::fabs(rel[i]);
      std::sort(rel.begin(), rel.end());
      std::sort(mag.begin(), mag.end());
      const auto at = [](const std::vector<double>& v, double q) { return v[size_t(q * double(v.size() - 1))]; };
      printf("[cuda backend] %s: (device - CPU) / CPU over those cells: median %+.3g, 1%% %+.3g, 99%% %+.3g; |.| 50%% "
             "%.3g, 90%% %.3g, 99%% %.3g, max %.3g\n",
             cache::kv_scheme_name(scheme), at(rel, 0.5), at(rel, 0.01), at(rel, 0.99), at(mag, 0.5), at(mag, 0.9),
             at(mag, 0.99), mag.back());
    }
    EXPECT_GE(compared, int64_t(steps) * cells / 10);
    EXPECT_LE(off, compared / 100);
    EXPECT_GT(rg.meter_max, 0.0) << "lossy pages carry a nonzero bound";
    EXPECT_EQ(gpu->memory_stats().exact_fallback_blocks, cpu->memory_stats().exact_fallback_blocks);
  }
}

// Sparse decode on the cuda backend against the CPU backend's, three sequences of a book in one
// ragged batch, teacher forced (f32 activations on the CPU). The device computes its queries and
// keys with bf16 weight products, so even layer 0's inputs differ from the CPU's in their last
// bits and a token at the Top-p threshold may fall on either side: the selections are compared
// by their budgets (per layer 0 and overall), the logits must stay far closer to the CPU's sparse
// run than sparse decode is to dense decode, and the device's sparse run must predict the dense
// run's top-1 as well as the CPU's sparse run does (a flipped threshold token may change a near
// tie's top-1 either way, so the two sparse runs are not held to each other's). (That the device selects
// the CPU's tokens bit for bit from the same inputs is tested where the inputs are the same: the
// session's device route, SessionCuda.SparseDecodeOnTheDeviceSelectsWhatTheCpuSelects, and the
// kernels' own tests.)
TEST_F(CudaBackendTest, SparseAgreesWithTheCpuBackend) {
  const model::Model& m = smollm2();
  const std::vector<int32_t> book =
      m.tokenizer().encode(testing::read_text(corpus_file("melville-moby-dick.txt")), true, false);
  const std::vector<int> prompt_lens{300, 520, 150};
  const int steps = 24, nv = m.config().n_vocab;
  const size_t n = prompt_lens.size();
  std::vector<std::vector<int32_t>> tokens;
  for (size_t i = 0; i < n; ++i) {
    const size_t from = 2000 * (i + 1);
    ASSERT_GE(book.size(), from + size_t(prompt_lens[i] + steps));
    tokens.emplace_back(book.begin() + long(from), book.begin() + long(from) + prompt_lens[i] + steps);
  }
  BackendConfig cfg = sparse_config(600, 600 * 4);
  cfg.sparse.dense_layers = 0;
  cfg.sparse.window_tokens = 32;
  cfg.sparse.deviations = 1.0;  // the widening too, with the device's margins
  cfg.activations = model::ActivationFormat::kFloat32;
  BackendConfig cpu_cfg = cfg;
  cpu_cfg.device = model::Device::kCpu;
  BackendConfig dense_cfg = cpu_cfg;
  dense_cfg.sparse = SparseConfig{};
  std::unique_ptr<Backend> gpu = make_backend(m, cfg), cpu = make_backend(m, cpu_cfg), dense = make_backend(m, dense_cfg);
  std::vector<cache::SeqId> sg, sc, sd;
  for (size_t i = 0; i < n; ++i) {
    sg.push_back(gpu->create_sequence());
    sc.push_back(cpu->create_sequence());
    sd.push_back(dense->create_sequence());
  }
  // Logits of the decode positions: [sequence][step][vocab] per backend.
  std::vector<std::vector<float>> lg(n, std::vector<float>(size_t(steps) * size_t(nv))), lc = lg, ld = lg;
  for (int step = -1; step < steps; ++step) {  // the prompts in one batch, then a token a step
    auto run = [&](Backend& be, const std::vector<cache::SeqId>& seqs, std::vector<std::vector<float>>& logits) {
      std::vector<BatchItem> items;
      for (size_t i = 0; i < n; ++i) {
        const int64_t at = step < 0 ? 0 : prompt_lens[i] + step;
        const int64_t len = step < 0 ? prompt_lens[i] : 1;
        float* out = step < 0 ? nullptr : &logits[i][size_t(step) * size_t(nv)];
        items.push_back({seqs[i], tokens[i].data() + at, len, out, nullptr, true});
      }
      be.forward(items);
    };
    run(*gpu, sg, lg);
    run(*cpu, sc, lc);
    run(*dense, sd, ld);
  }
  double kl_device = 0, kl_sparse = 0;
  int agree = 0, positions = 0, device_dense = 0, cpu_dense = 0;
  for (size_t i = 0; i < n; ++i)
    for (int t = 0; t < steps; ++t) {
      const float* g = &lg[i][size_t(t) * size_t(nv)];
      const float* c = &lc[i][size_t(t) * size_t(nv)];
      for (int v = 0; v < nv; ++v) ASSERT_TRUE(std::isfinite(g[v])) << "sequence " << i << " step " << t;
      kl_device += kl_divergence(c, g, nv);
      kl_sparse += kl_divergence(&ld[i][size_t(t) * size_t(nv)], c, nv);
      const int32_t dense_top = model::argmax(&ld[i][size_t(t) * size_t(nv)], nv);
      agree += model::argmax(c, nv) == model::argmax(g, nv);
      device_dense += model::argmax(g, nv) == dense_top;
      cpu_dense += model::argmax(c, nv) == dense_top;
      ++positions;
    }
  printf("[cuda backend] sparse p 0.9 (window 32, 1 deviation), %d decode positions: mean KL device vs cpu sparse "
         "%.3g, cpu sparse vs dense %.3g, top-1 agree %d/%d; top-1 of dense: device sparse %d, cpu sparse %d\n",
         positions, kl_device / positions, kl_sparse / positions, agree, positions, device_dense, cpu_dense);
  EXPECT_GT(kl_sparse, 0.0) << "sparse decode changed nothing: not sparse";
  EXPECT_LT(kl_device, 0.2 * kl_sparse);
  EXPECT_GE(device_dense, cpu_dense - 1 - positions / 50);
  for (size_t i = 0; i < n; ++i) {
    const SparseStats& a = gpu->sparse_stats(sg[i]);
    const SparseStats& b = cpu->sparse_stats(sc[i]);
    SCOPED_TRACE(::testing::Message() << "sequence " << i);
    EXPECT_EQ(a.steps, steps);
    EXPECT_EQ(a.cells, b.cells);
    EXPECT_EQ(a.index_appended_tokens, b.index_appended_tokens);
    EXPECT_EQ(a.layer_cells[0], b.layer_cells[0]);
    EXPECT_NEAR(a.layer_sum_budget[0] / double(a.layer_cells[0]), b.layer_sum_budget[0] / double(b.layer_cells[0]),
                0.02);
    EXPECT_LT(a.layer_sum_budget[0], 0.9 * double(a.layer_cells[0])) << "layer 0 is sparse";
    const double budget_a = a.sum_budget / double(a.cells), budget_b = b.sum_budget / double(b.cells);
    printf("[cuda backend] sequence %zu: mean budget %.4f (cpu %.4f), layer 0 %.4f (cpu %.4f), widened %lld (cpu %lld)\n",
           i, budget_a, budget_b, a.layer_sum_budget[0] / double(a.layer_cells[0]),
           b.layer_sum_budget[0] / double(b.layer_cells[0]), (long long)a.widened_tokens, (long long)b.widened_tokens);
    EXPECT_NEAR(budget_a, budget_b, 0.02);
    // The estimated mass of the Top-p sets: at least p where the index was scored, and close to
    // the CPU's (the same estimator over keys that drift apart after layer 0).
    ASSERT_EQ(a.indexed_cells, b.indexed_cells);
    const double mass_a = a.sum_estimated_mass / double(a.indexed_cells);
    const double mass_b = b.sum_estimated_mass / double(b.indexed_cells);
    printf("[cuda backend] sequence %zu: mean estimated mass %.4f (cpu %.4f)\n", i, mass_a, mass_b);
    EXPECT_GE(mass_a, 0.9);
    EXPECT_NEAR(mass_a, mass_b, 0.01);
  }
}

// Requests of different books' lengths, greedy.
std::vector<engine::RequestParams> requests_of(const std::vector<int>& lengths, int max_tokens, uint64_t seed) {
  std::vector<engine::RequestParams> out;
  for (const std::vector<int32_t>& p : ragged_prompts(smollm2(), lengths, seed)) {
    engine::RequestParams r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.ignore_end = true;
    out.push_back(r);
  }
  return out;
}

std::vector<std::vector<int32_t>> run_engine(engine::Engine& e, const std::vector<engine::RequestParams>& requests) {
  std::vector<engine::RequestId> ids;
  for (const engine::RequestParams& r : requests) ids.push_back(e.submit(r));
  e.run();
  std::vector<std::vector<int32_t>> out;
  for (engine::RequestId id : ids) {
    EXPECT_EQ(e.report(id).finish, engine::FinishReason::kLength) << e.report(id).error;
    out.push_back(e.report(id).tokens);
  }
  return out;
}

std::vector<std::vector<int32_t>> run_alone(const engine::EngineConfig& cfg,
                                            const std::vector<engine::RequestParams>& requests) {
  std::vector<std::vector<int32_t>> out;
  for (const engine::RequestParams& r : requests) {
    engine::Engine e(smollm2(), cfg);
    out.push_back(run_engine(e, {r})[0]);
  }
  return out;
}

TEST_F(CudaBackendTest, EngineBatchesSharesAndPreemptsOnTheDevice) {
  // The coded schemes again with deferred encode results: preemption, prefix sharing and frees
  // between steps read host tables the step's reconcile brought up to date.
  const std::vector<std::pair<cache::KvScheme, bool>> runs = {{cache::KvScheme::kBf16, false},
                                                              {cache::KvScheme::kGaac, false},
                                                              {cache::KvScheme::kFp8E4M3, false},
                                                              {cache::KvScheme::kGaac, true},
                                                              {cache::KvScheme::kFp8E4M3, true},
                                                              {cache::KvScheme::kDither8, false},
                                                              {cache::KvScheme::kDither8, true}};
  for (const auto& [scheme, defer] : runs) {
    SCOPED_TRACE(std::string(cache::kv_scheme_name(scheme)) + (defer ? ", deferred encode results" : ""));
    engine::EngineConfig cfg;
    cfg.backend = device_config(scheme, 256, 256 * 8);
    cfg.backend.defer_encode_results = defer;
    cfg.step_tokens = 48;  // prompts in chunks interleaved with the decodes
    cfg.max_sequences = 4;
    const std::vector<engine::RequestParams> requests = requests_of({1, 3, 17, 140, 33, 9, 90}, 20, 11);
    const std::vector<std::vector<int32_t>> alone = run_alone(cfg, requests);
    // The engine cuts prompts into chunks by the step's budget, which the other requests share:
    // outputs still equal those alone (a lossy scheme's prefill rows read what a decode step at
    // their position reads: the block their chunk completed exact, from its held raw page).
    auto expect_alone = [&](const std::vector<std::vector<int32_t>>& got, const char* what) {
      ASSERT_EQ(got.size(), alone.size()) << what;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].size(), alone[i].size()) << what;
        EXPECT_EQ(got[i], alone[i]) << what << ": request " << i;
      }
    };
    {
      engine::Engine e(smollm2(), cfg);
      expect_alone(run_engine(e, requests), "continuous batching");
      EXPECT_EQ(e.stats().preemptions, 0);
      e.drop_cached_prefixes();
      EXPECT_EQ(e.stats().pool_pages_in_use, 0u) << "every page returns to the pool";
    }
    {
      engine::EngineConfig small = cfg;
      small.backend.pool_tokens = 256;  // one whole sequence
      engine::Engine e(smollm2(), small);
      expect_alone(run_engine(e, requests), "preempted on a pool for one");
      EXPECT_GT(e.stats().preemptions, 0) << "the pool was meant to run out";
    }
    {
      // Four requests sharing a 160-token prefix.
      const std::vector<int32_t> prefix = ragged_prompts(smollm2(), {160}, 3)[0];
      std::vector<engine::RequestParams> shared;
      for (const std::vector<int32_t>& tail : ragged_prompts(smollm2(), {5, 9, 2, 20}, 4)) {
        engine::RequestParams r;
        r.prompt = prefix;
        r.prompt.insert(r.prompt.end(), tail.begin() + 1, tail.end());
        r.max_tokens = 12;
        r.ignore_end = true;
        shared.push_back(r);
      }
      engine::Engine e(smollm2(), cfg);
      const std::vector<std::vector<int32_t>> first = run_engine(e, {shared[0]});
      std::vector<engine::RequestParams> rest(shared.begin() + 1, shared.end());
      std::vector<std::vector<int32_t>> together = first;
      for (const std::vector<int32_t>& t : run_engine(e, rest)) together.push_back(t);
      const std::vector<std::vector<int32_t>> shared_alone = run_alone(cfg, shared);
      for (size_t i = 0; i < together.size(); ++i)
        EXPECT_EQ(together[i], shared_alone[i]) << "prefix sharing: request " << i;
      EXPECT_GE(e.stats().shared_blocks, 3 * 10) << "each later request shares the prefix's 10 blocks";
    }
  }
}

TEST_F(CudaBackendTest, CancelFreesPagesAndTheMeterComesFromTheDecodeSteps) {
  engine::EngineConfig cfg;
  cfg.backend = device_config(cache::KvScheme::kFp8E4M3, 256, 256 * 4);
  cfg.prefix_sharing = false;
  engine::Engine e(smollm2(), cfg);
  const std::vector<engine::RequestParams> requests = requests_of({50, 70}, 16, 5);
  const engine::RequestId a = e.submit(requests[0]), b = e.submit(requests[1]);
  e.step();
  e.step();
  const uint64_t both = e.stats().pool_pages_in_use;
  EXPECT_GT(both, 0u);
  e.cancel(b);
  EXPECT_LT(e.stats().pool_pages_in_use, both) << "cancel frees the request's pages at once";
  e.run();
  EXPECT_EQ(e.report(b).finish, engine::FinishReason::kCancelled);
  const engine::RequestReport& r = e.report(a);
  ASSERT_EQ(r.finish, engine::FinishReason::kLength);
  const model::ModelConfig& c = smollm2().config();
  EXPECT_TRUE(r.attention.metered);
  // The 15 decode steps after the first token (which ended the prefill), every layer and head.
  EXPECT_EQ(r.attention.meter_cells, int64_t(15) * c.n_layers * c.n_heads);
  EXPECT_GE(r.attention.meter_max, 0.0);
  EXPECT_LE(r.attention.meter_max, 1.0);
  EXPECT_GT(r.attention.meter_max, 0.0) << "fp8 pages carry a nonzero witness";
  uint64_t bytes = 0;
  for (const cache::ClassBytes& cb : r.kv_bytes) bytes += cb.bytes;
  EXPECT_GT(bytes, 0u);
}

// The device forward pass alone (attention replaced by out = q): the captured segments replay
// the eager launches bit for bit, and a row's logits do not depend on the rows beside it (1, 3, 8
// and 80 rows of different tokens and positions, the first row compared; 80 runs eagerly, past
// the graphs' rows, and in two product chunks).
TEST_F(CudaBackendTest, DeviceForwardGraphsReplayTheEagerLaunches) {
  const model::Model& m = smollm2();
  const int nv = m.config().n_vocab;
  const size_t q_bytes = sizeof(float) * size_t(m.config().n_heads) * size_t(m.config().head_dim);
  auto logits = [&](cuda::DeviceForward& f, int64_t n_rows) {
    std::vector<int32_t> tokens;
    for (int64_t r = 0; r < n_rows; ++r) tokens.push_back(int32_t((1 + 977 * r) % nv));
    std::vector<float> out(size_t(n_rows) * size_t(nv));
    std::vector<BatchItem> items;
    for (int64_t r = 0; r < n_rows; ++r)
      items.push_back({cache::SeqId(r + 1), &tokens[size_t(r)], 1, &out[size_t(r) * size_t(nv)], nullptr, true});
    const StepRows rows =
        plan_step(items, m.config(), 1 << 20, [](cache::SeqId seq) { return int64_t(seq) * 37; });  // ragged positions
    f.run(rows, [&](int, float* q, const float*, const float*, float* out_rows) {
      ASSERT_EQ(cudaMemcpy(out_rows, q, q_bytes * size_t(n_rows), cudaMemcpyDeviceToDevice), cudaSuccess);
    });
    return out;
  };
  std::unique_ptr<cuda::DeviceForward> graphed = cuda::DeviceForward::create(m, true);
  std::unique_ptr<cuda::DeviceForward> eager = cuda::DeviceForward::create(m, false);
  std::vector<float> first;
  // Each count twice (the second run replays the first's graphs), and row counts that grow past
  // earlier ones.
  for (const int64_t n_rows : {int64_t(1), int64_t(1), int64_t(3), int64_t(8), int64_t(3), int64_t(80), int64_t(8)}) {
    const std::vector<float> a = logits(*graphed, n_rows), b = logits(*eager, n_rows);
    ASSERT_EQ(a, b) << n_rows << " rows: the graphs differ from the eager launches";
    for (float v : a) ASSERT_TRUE(std::isfinite(v));
    if (first.empty()) first.assign(a.begin(), a.begin() + nv);
    EXPECT_TRUE(std::equal(first.begin(), first.end(), a.begin())) << "row 0 among " << n_rows << " rows";
  }
}

// Sampling on the device draws what the host's sampler draws from the same logits, greedy and
// seeded, with top-k and top-p; a sequence that takes no logits draws the same.
TEST_F(CudaBackendTest, DrawsTokensOnTheDeviceAsTheHostSamplerDoes) {
  testing::expect_draws_as_the_host(smollm2(), device_config(cache::KvScheme::kBf16, 128, 128 * 10), 12);
}

// The lossless tier on the device: gaac pages give the text of bf16 pages, token for token, for
// greedy and seeded requests run together through the engine.
TEST_F(CudaBackendTest, GaacAndBf16PagesGiveTheSameTextOnTheDevice) {
  std::vector<engine::RequestParams> requests = requests_of({40, 200, 7, 130}, 48, 5);
  for (size_t i = 1; i < requests.size(); i += 2) {
    requests[i].sampling.temperature = 0.9f;
    requests[i].sampling.top_p = 0.95f;
    requests[i].sampling.seed = 100 + i;
  }
  std::vector<std::vector<int32_t>> texts[2];
  int k = 0;
  for (cache::KvScheme scheme : {cache::KvScheme::kBf16, cache::KvScheme::kGaac}) {
    engine::EngineConfig cfg;
    cfg.backend = device_config(scheme, 320, 320 * 4);
    engine::Engine e(smollm2(), cfg);
    texts[k++] = run_engine(e, requests);
  }
  ASSERT_EQ(texts[0].size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(texts[0][i].size(), 48u);
    EXPECT_EQ(texts[1][i], texts[0][i]) << "request " << i;
  }
}

TEST_F(CudaBackendTest, RefusesWhatItDoesNotServeByName) {
  auto expect_refused = [](BackendConfig cfg, const std::string& words) {
    try {
      make_backend(smollm2(), cfg);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kUnsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_refused(device_config(cache::KvScheme::kRtn4, 64, 64), "rtn4 is not served by the cuda backend");
  // Sparse decode reads bf16 pages on the device: a scheme the backend serves otherwise is
  // refused with sparse decode, naming the scheme and the backend.
  for (cache::KvScheme scheme : {cache::KvScheme::kGaac, cache::KvScheme::kDither8}) {
    BackendConfig sparse = device_config(scheme, 64, 64);
    sparse.sparse.enabled = true;
    expect_refused(sparse, std::string("sparse decode on the cuda backend reads bf16 pages, not KV scheme ") +
                               cache::kv_scheme_name(scheme));
  }
  BackendConfig gate = device_config(cache::KvScheme::kFp8E4M3, 64, 64);
  gate.meter.gate = true;
  expect_refused(gate, "the gate is not served by the cuda backend");
  // Bad steps leave the backend as it was.
  std::unique_ptr<Backend> be = make_backend(smollm2(), device_config(cache::KvScheme::kBf16, 32, 64));
  const cache::SeqId s = be->create_sequence();
  std::vector<int32_t> toks(40, 5);
  BatchItem it{s, toks.data(), 40, nullptr, nullptr, true};
  EXPECT_THROW(be->forward({&it, 1}), Error);
  EXPECT_EQ(be->length(s), 0);
  it.n = 4;
  BatchItem twice[2] = {it, it};
  EXPECT_THROW(be->forward({twice, 2}), Error);
  EXPECT_EQ(be->length(s), 0);
  EXPECT_THROW(be->length(s + 100), Error);
  be->forward({&it, 1});
  EXPECT_EQ(be->length(s), 4);
  be->free_sequence(s);
  EXPECT_EQ(be->pool_pages_in_use(), 0u);
}

// A metered step's meters reach each sequence's telemetry while the next step runs on the device,
// or when a report asks first: a report right after a step counts it; a sequence freed with its
// last step's meters pending leaves the others' counts whole; the dashboard's ring has every
// step's cells at once.
TEST_F(CudaBackendTest, DeferredMeterBookkeepingMissesNoCell) {
  BackendConfig cfg = device_config(cache::KvScheme::kFp8E4M3, 64, 128);
  cfg.meter.recent_steps = 8;
  std::unique_ptr<Backend> be = make_backend(smollm2(), cfg);
  const model::ModelConfig& c = smollm2().config();
  const int64_t cells_per_step = int64_t(c.n_layers) * c.n_heads;
  const cache::SeqId a = be->create_sequence(), b = be->create_sequence();
  // Past one block (16 tokens), so that fp8 pages (and nonzero meters) exist.
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(smollm2(), {20, 18}, 3);
  int32_t next_a = 0, next_b = 0;
  BatchItem prefill[2] = {{a, prompts[0].data(), 20, nullptr, nullptr, true},
                          {b, prompts[1].data(), 18, nullptr, nullptr, true}};
  prefill[0].token = &next_a;
  prefill[1].token = &next_b;
  ASSERT_TRUE(be->reserve(a, 20) && be->reserve(b, 18));
  be->forward({prefill, 2});
  const auto decode_both = [&] {
    ASSERT_TRUE(be->reserve(a, 1) && be->reserve(b, 1));
    BatchItem step[2] = {{a, &next_a, 1, nullptr, nullptr, true}, {b, &next_b, 1, nullptr, nullptr, true}};
    step[0].token = &next_a;
    step[1].token = &next_b;
    be->forward({step, 2});
  };
  decode_both();
  EXPECT_EQ(be->report(a).meter_cells, cells_per_step);  // recorded for the report
  decode_both();                                          // pending after it
  be->free_sequence(a);
  ASSERT_TRUE(be->reserve(b, 1));
  BatchItem alone{b, &next_b, 1, nullptr, nullptr, true};
  alone.token = &next_b;
  be->forward({&alone, 1});  // records the step before, a's row skipped
  const SequenceReport rb = be->report(b);
  EXPECT_EQ(rb.meter_cells, 3 * cells_per_step);
  ASSERT_EQ(rb.layers.size(), size_t(c.n_layers));
  for (const auto& layer : rb.layers) EXPECT_EQ(layer.cells, 3 * c.n_heads);
  EXPECT_GT(rb.meter_max, 0.0);
  const gate::RecentStepMeters& recent = be->recent_meters();
  ASSERT_EQ(recent.size(), 3);
  EXPECT_EQ(recent.step(0).cells, 2 * cells_per_step);
  EXPECT_EQ(recent.step(1).cells, 2 * cells_per_step);
  EXPECT_EQ(recent.step(2).cells, cells_per_step);
  EXPECT_GT(be->step_times().meter_seconds, 0.0);
  be->free_sequence(b);
}

TEST_F(CudaBackendTest, KeepsItsStepsHostTimeByPhase) {
  std::unique_ptr<Backend> be = make_backend(smollm2(), device_config(cache::KvScheme::kBf16, 64, 128));
  EXPECT_EQ(be->step_times().steps, 0);
  const cache::SeqId a = be->create_sequence(), b = be->create_sequence();
  std::vector<int32_t> toks(9, 5);
  int32_t next_a = 0, next_b = 0;
  BatchItem prefill{a, toks.data(), 9, nullptr, nullptr, true};
  prefill.token = &next_a;
  const auto t0 = std::chrono::steady_clock::now();
  be->forward({&prefill, 1});
  BatchItem step[2] = {{a, &next_a, 1, nullptr, nullptr, true}, {b, toks.data(), 3, nullptr, nullptr, true}};
  step[0].token = &next_a;
  step[1].token = &next_b;
  be->forward({step, 2});
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const StepTimes t = be->step_times();
  EXPECT_EQ(t.steps, 2);
  for (double phase :
       {t.plan_seconds, t.enqueue_seconds, t.attention_seconds, t.wait_seconds, t.read_back_seconds, t.meter_seconds})
    EXPECT_GE(phase, 0.0);
  // The phases are disjoint spans of the two calls: together no more than their wall time, and the
  // launches and the wait take some of it.
  EXPECT_LE(t.plan_seconds + t.enqueue_seconds + t.attention_seconds + t.wait_seconds + t.read_back_seconds, wall);
  EXPECT_GT(t.enqueue_seconds, 0.0);
  EXPECT_GT(t.attention_seconds, 0.0);
  // A refused step counts nothing.
  BatchItem bad{a, toks.data(), 100, nullptr, nullptr, true};
  EXPECT_THROW(be->forward({&bad, 1}), Error);
  EXPECT_EQ(be->step_times().steps, 2);
}

// BackendConfig::pool_bytes: each class charged at its own page bytes, so that at equal memory a
// compressed scheme admits more sequences; what the pool holds never passes the bytes (pages on
// the device plus what the reservations will add); bad sizes and mixes are refused.
TEST_F(CudaBackendTest, PoolBytesAdmitsByEachClasssPageBytes) {
  const int64_t context = 200;  // 12 whole blocks and a tail of 8
  auto admitted = [&](cache::KvScheme scheme, uint64_t bytes, bool write) {
    BackendConfig cfg = device_config(scheme, context, 0);
    cfg.pool_bytes = bytes;
    std::unique_ptr<Backend> be = make_backend(smollm2(), cfg);
    std::vector<cache::SeqId> seqs;
    std::vector<int32_t> toks(context, 7);
    for (;;) {
      const cache::SeqId s = be->create_sequence();
      if (!be->reserve(s, context)) {
        be->free_sequence(s);
        break;
      }
      seqs.push_back(s);
      if (write) {
        BatchItem it{s, toks.data(), context, nullptr, nullptr, true};
        be->forward({&it, 1});
      }
      const cache::MemoryStats m = be->memory_stats();
      uint64_t page_bytes = 0;
      for (const cache::StorageClassStats& c : m.by_class) page_bytes += c.page_bytes_in_use;
      EXPECT_LE(page_bytes, bytes) << cache::kv_scheme_name(scheme);
    }
    return seqs.size();
  };
  const model::ModelConfig& c = smollm2().config();
  // bf16: a block of every table is 2 * layers * kv_heads pages of 16 x head_dim bf16.
  const uint64_t bf16_block = uint64_t(2 * c.n_layers * c.n_kv_heads) * 16 * uint64_t(c.head_dim) * 2;
  const uint64_t bf16_sequence = 13 * bf16_block;
  const uint64_t budget = 6 * bf16_sequence + bf16_sequence / 2;
  EXPECT_EQ(admitted(cache::KvScheme::kBf16, budget, false), 6u);
  EXPECT_EQ(admitted(cache::KvScheme::kBf16, budget, true), 6u);
  // fp8 and dither8 pages (a byte an element, with their scales and witness) hold more sequences
  // in the same bytes; the GAAC calibration here gives every slot the largest escape area, so it
  // is only held to the bytes.
  EXPECT_GT(admitted(cache::KvScheme::kFp8E4M3, budget, true), 6u);
  EXPECT_GT(admitted(cache::KvScheme::kDither8, budget, true), 6u);
  EXPECT_GE(admitted(cache::KvScheme::kGaac, budget, true), 1u);
  // Too small for one sequence, or bounded twice: refused by name.
  BackendConfig small = device_config(cache::KvScheme::kBf16, context, 0);
  small.pool_bytes = bf16_sequence - 1;
  EXPECT_THROW(
      {
        try {
          make_backend(smollm2(), small);
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
          EXPECT_NE(std::string(e.what()).find("cannot hold one sequence"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  BackendConfig both = device_config(cache::KvScheme::kBf16, context, 4 * context);
  both.pool_bytes = budget;
  EXPECT_THROW(make_backend(smollm2(), both), Error);
}

}  // namespace
}  // namespace certkv::backend
