// The engine and the batched backend end to end: batch invariance of the logits (ragged batches,
// any position in the batch, any prefill chunking), continuous batching against running each
// request alone, prefix sharing, preemption on a small pool, cancel, stop strings and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <span>

#include "backend/cpu/cpu_backend.h"
#include "backend/session.h"
#include "certkv/certkv.h"
#include "codec/gaac.h"
#include "core/status.h"
#include "engine/engine.h"
#include "engine/outlier_pair_calibration.h"
#include "model/model.h"
#include "model/sampler.h"
#include "backend_test_support.h"
#include "test_paths.h"

namespace certkv::engine {
namespace {

using backend::BackendConfig;
using backend::BatchItem;
using backend::CpuBackend;
using testing::expect_bit_identical;
using testing::ragged_prompts;
using testing::run_batched;

const model::Model& stories() {
  static std::unique_ptr<model::Model> m =
      model::load_llama2c(testing::stories_checkpoint(), testing::stories_tokenizer());
  return *m;
}

const model::Model& smollm2() {
  static std::unique_ptr<model::Model> m = model::load_model(testing::smollm2_gguf());
  return *m;
}

// Every sequence alone (one per backend, whole prompt), then all of them in ragged batches with
// ragged chunks and rotating batch positions: the same logits bit for bit.
void check_batch_invariance(const model::Model& m, BackendConfig cfg) {
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(m, {1, 3, 17, 40, 33}, 7);
  const int decode_steps = 6;
  std::vector<std::vector<float>> alone(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i)
    alone[i] = run_batched(m, cfg, {prompts[i]}, {1 << 20}, false, decode_steps)[0];
  const std::vector<int> whole(prompts.size(), 1 << 20);
  expect_bit_identical(alone, run_batched(m, cfg, prompts, whole, false, decode_steps), "one batch");
  expect_bit_identical(alone, run_batched(m, cfg, prompts, whole, true, decode_steps), "rotating batch");
  expect_bit_identical(alone, run_batched(m, cfg, prompts, {1, 2, 5, 16, 7}, true, decode_steps),
                       "ragged chunks, rotating batch");
}

constexpr int kNumKvSchemesCheckedAtLeast = 13;  // every scheme, dither8 included

TEST(BatchInvariance, StoriesBf16AnyBatchAnyChunking) {
  BackendConfig cfg;
  cfg.context_tokens = 64;
  cfg.pool_tokens = 64 * 6;
  check_batch_invariance(stories(), cfg);
}

// Every scheme the table marks batch invariant gives each sequence its logits alone in ragged,
// rotating batches and ragged prefill chunks (lossy pages too: prefill_attention). GAAC
// schemes use the calibration that fits every block (bases 0, the largest escape capacity).
TEST(BatchInvariance, SmolLM2EverySchemeTheTableMarks) {
  const model::ModelConfig& c = smollm2().config();
  int checked = 0;
  for (const cache::KvSchemeInfo& s : cache::kv_schemes()) {
    if (!s.batch_invariant) continue;
    SCOPED_TRACE(s.name);
    BackendConfig cfg;
    cfg.context_tokens = 64;
    cfg.pool_tokens = 64 * 6;
    cfg.kv_scheme = s.scheme;
    cfg.recent_window_tokens = s.lossy ? 0 : -1;  // every full block in a lossy page
    // dither8's outlier pairs fixed for the model, as the engine fixes them.
    if (s.scheme == cache::KvScheme::kDither8)
      cfg.outlier_pair_table = outlier_pairs_from_text(smollm2(), cache::kDefaultOutlierPairs, cfg.block_tokens, 2);
    if (s.gaac) {
      codec::GaacShape shape;
      shape.n_layers = c.n_layers;
      shape.n_kv_heads = c.n_kv_heads;
      shape.head_dim = c.head_dim;
      shape.element = s.element;
      cfg.gaac_calibration = std::make_shared<const codec::GaacCalibration>(shape);
    }
    check_batch_invariance(smollm2(), cfg);
    if (HasFatalFailure()) return;
    ++checked;
  }
  EXPECT_GE(checked, kNumKvSchemesCheckedAtLeast);
}

// Lossy pages with a recent window: a prompt row reads the blocks the window keeps exact at its
// own position, whatever the chunk (prefill_attention), so chunking still does not show.
TEST(BatchInvariance, SmolLM2LossyPagesWithARecentWindow) {
  for (cache::KvScheme scheme : {cache::KvScheme::kKivi2, cache::KvScheme::kRtn4}) {
    SCOPED_TRACE(cache::kv_scheme_name(scheme));
    BackendConfig cfg;
    cfg.context_tokens = 64;
    cfg.pool_tokens = 64 * 6;
    cfg.kv_scheme = scheme;
    cfg.recent_window_tokens = 16;
    check_batch_invariance(smollm2(), cfg);
    if (HasFatalFailure()) return;
  }
}

// With the model's own calibration too (blocks that overflow their slot stay raw, and still the
// same floats).
TEST(BatchInvariance, SmolLM2GaacWithItsCalibration) {
  BackendConfig cfg;
  cfg.context_tokens = 64;
  cfg.pool_tokens = 64 * 6;
  cfg.kv_scheme = cache::KvScheme::kGaac;
  const model::ModelConfig& c = smollm2().config();
  codec::GaacShape shape;
  shape.n_layers = c.n_layers;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  cfg.gaac_calibration = std::make_shared<const codec::GaacCalibration>(codec::GaacCalibration::load(
      testing::source_path("src/codec/testdata/smollm2_gaac_calibration.safetensors"), shape));
  check_batch_invariance(smollm2(), cfg);
}

TEST(CpuBackend, DrawsTokensInTheStepAsTheHostSamplerDoes) {
  BackendConfig cfg;
  cfg.context_tokens = 128;
  cfg.pool_tokens = 128 * 10;
  testing::expect_draws_as_the_host(stories(), cfg, 12);
}

TEST(CpuBackend, RefusesBadBatches) {
  BackendConfig cfg;
  cfg.context_tokens = 32;
  CpuBackend be(stories(), cfg);
  const cache::SeqId a = be.create_sequence();
  std::vector<int32_t> toks(40, 5);
  BatchItem it;
  it.seq = a;
  it.tokens = toks.data();
  it.n = 40;
  try {
    be.forward({&it, 1});
    FAIL() << "a too long input was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfRange) << e.what();
  }
  EXPECT_EQ(be.length(a), 0);
  it.n = 4;
  BatchItem twice[2] = {it, it};
  EXPECT_THROW(be.forward({twice, 2}), Error);
  it.seq = 999;
  EXPECT_THROW(be.forward({&it, 1}), Error);
  // A configuration the CPU backend refuses, with the code and words of its error.
  auto expect_refused = [](const BackendConfig& bad, StatusCode code, const std::string& words) {
    try {
      CpuBackend refused(stories(), bad);
      ADD_FAILURE() << "accepted; expected an error naming '" << words << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  cfg.pool_tokens = 16;  // smaller than one sequence
  expect_refused(cfg, StatusCode::kInvalidArgument, "pool");
  // A pool in bytes of each class's pages is the cuda backend's; bounded twice, refused anywhere.
  cfg.pool_tokens = 0;
  cfg.pool_bytes = uint64_t(1) << 24;
  expect_refused(cfg, StatusCode::kUnsupported, "pool_bytes");
  cfg.pool_tokens = 64;
  expect_refused(cfg, StatusCode::kInvalidArgument, "not both");
}

// ---- The engine -------------------------------------------------------------------------------

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish;
};

std::vector<Outcome> run_engine(Engine& engine, const std::vector<RequestParams>& requests,
                                std::vector<RequestId>* ids_out = nullptr) {
  std::vector<RequestId> ids;
  for (const RequestParams& p : requests) ids.push_back(engine.submit(p));
  std::map<RequestId, std::string> streamed;
  engine.run([&](RequestId id, int32_t, std::string_view text) { streamed[id] += text; });
  std::vector<Outcome> out;
  for (RequestId id : ids) {
    const RequestReport& r = engine.report(id);
    EXPECT_EQ(r.status, RequestStatus::kFinished);
    EXPECT_EQ(streamed[id], r.text) << "the streamed text is the report's";
    out.push_back({r.tokens, r.text, r.finish});
  }
  if (ids_out) *ids_out = ids;
  return out;
}

std::vector<Outcome> run_each_alone(const EngineConfig& cfg, const std::vector<RequestParams>& requests,
                                    const model::Model& m = stories()) {
  std::vector<Outcome> out;
  for (const RequestParams& p : requests) {
    Engine e(m, cfg);
    out.push_back(run_engine(e, {p})[0]);
  }
  return out;
}

std::vector<RequestParams> story_requests(const std::vector<int>& lengths, int max_tokens, uint64_t seed) {
  std::vector<RequestParams> out;
  int i = 0;
  for (std::vector<int32_t>& p : ragged_prompts(stories(), lengths, seed)) {
    RequestParams r;
    r.prompt = std::move(p);
    r.max_tokens = max_tokens + (i % 3) * 5;
    r.ignore_end = true;
    if (i % 2 == 1) {  // seeded sampling too: the sampler belongs to the request
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 40;
      r.sampling.seed = 1234 + uint64_t(i);
    }
    out.push_back(std::move(r));
    ++i;
  }
  return out;
}

void expect_same_outcomes(const std::vector<Outcome>& a, const std::vector<Outcome>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i;
    EXPECT_EQ(a[i].text, b[i].text) << "request " << i;
  }
}

TEST(Engine, ContinuousBatchingGivesEachRequestItsOutputAlone) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  cfg.backend.pool_tokens = 128 * 8;
  cfg.step_tokens = 13;  // prompts run in chunks interleaved with the decodes
  cfg.max_sequences = 3;  // requests join as others leave
  const std::vector<RequestParams> requests = story_requests({1, 3, 17, 40, 33, 9, 50}, 20, 11);
  Engine engine(stories(), cfg);
  const std::vector<Outcome> together = run_engine(engine, requests);
  expect_same_outcomes(together, run_each_alone(cfg, requests));
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.waiting, 0);
  EXPECT_EQ(s.preemptions, 0);
  EXPECT_GT(s.steps, 0);
  for (const Outcome& o : together) EXPECT_EQ(o.finish, FinishReason::kLength);
}

// Both policies: swap (the pages go to host memory and come back) and recompute.
TEST(Engine, PreemptsOnASmallPoolAndStillGivesEveryOutput) {
  for (Preemption preemption : {Preemption::kSwap, Preemption::kRecompute}) {
    SCOPED_TRACE(preemption_name(preemption));
    EngineConfig cfg;
    cfg.backend.context_tokens = 96;
    cfg.backend.pool_tokens = 96;  // one whole sequence
    cfg.step_tokens = 32;
    cfg.max_sequences = 6;
    cfg.preemption = preemption;
    const std::vector<RequestParams> requests = story_requests({30, 41, 17, 25, 33, 12}, 30, 5);
    Engine engine(stories(), cfg);
    const std::vector<Outcome> together = run_engine(engine, requests);
    const EngineStats s = engine.stats();
    EXPECT_GT(s.preemptions, 0) << "the pool was meant to run out";
    if (preemption == Preemption::kSwap) {
      // Those preempted in the step that admitted them had nothing to swap.
      EXPECT_GT(s.swap_outs, 0);
      EXPECT_LE(s.swap_outs, s.preemptions);
      EXPECT_EQ(s.swap_ins, s.swap_outs);
      EXPECT_GT(s.swapped_out_host_bytes, 0u);
      EXPECT_GT(s.host_bytes_peak, 0u);
      EXPECT_EQ(s.recomputed_tokens, 0);
    } else {
      EXPECT_EQ(s.swap_outs, 0);
      EXPECT_GT(s.recomputed_tokens, 0);
    }
    EXPECT_EQ(s.host_bytes_in_use, 0u);
    expect_same_outcomes(together, run_each_alone(cfg, requests));
    EXPECT_GT(s.cached_prefixes, 0);
    engine.drop_cached_prefixes();
    EXPECT_EQ(engine.stats().pool_pages_in_use, 0u) << "every page returns to the pool";
  }
}

// Swap preemption on SmolLM2 for bf16, gaac (the model's calibration: slots, raw fallbacks and
// tails GAAC-coded in host memory), rtn8 with the meter and bf16 with the sparse tier: every output
// is the one it has alone, and so are its certificate and sparse budget (the meter's telemetry and
// the key index travel with the swapped sequence). Decode runs past a partial block.
TEST(Engine, SwapPreemptionGivesEachRequestItsOutputAndMeterAloneSmolLM2) {
  const model::ModelConfig& c = smollm2().config();
  codec::GaacShape shape;
  shape.n_layers = c.n_layers;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  auto calibration = std::make_shared<const codec::GaacCalibration>(codec::GaacCalibration::load(
      testing::source_path("src/codec/testdata/smollm2_gaac_calibration.safetensors"), shape));
  std::vector<RequestParams> requests;
  int i = 0;
  // The first two fit the pool together until the first one's decode needs a third block: the
  // second, 20 tokens in, is swapped out.
  const int max_tokens[] = {12, 14, 10};
  for (std::vector<int32_t>& p : ragged_prompts(smollm2(), {30, 20, 14}, 31)) {
    RequestParams r;
    r.prompt = std::move(p);
    r.max_tokens = max_tokens[i++];
    r.ignore_end = true;
    requests.push_back(std::move(r));
  }
  const std::pair<cache::KvScheme, bool> configs[] = {{cache::KvScheme::kBf16, false},
                                                      {cache::KvScheme::kGaac, false},
                                                      {cache::KvScheme::kRtn8, false},
                                                      {cache::KvScheme::kDither8, false},
                                                      {cache::KvScheme::kBf16, true}};
  for (const auto& [scheme, sparse] : configs) {
    SCOPED_TRACE(std::string(cache::kv_scheme_name(scheme)) + (sparse ? " sparse" : ""));
    EngineConfig cfg;
    cfg.backend.sparse.enabled = sparse;
    cfg.backend.sparse.window_tokens = 16;
    cfg.backend.context_tokens = 64;
    cfg.backend.pool_tokens = 64;  // one whole sequence
    cfg.backend.kv_scheme = scheme;
    cfg.backend.recent_window_tokens = cache::kv_scheme_is_lossy(scheme) ? 0 : -1;
    if (scheme != cache::KvScheme::kBf16) cfg.backend.gaac_calibration = calibration;
    cfg.max_sequences = 3;
    cfg.preemption = Preemption::kSwap;
    std::vector<RequestId> ids;
    Engine engine(smollm2(), cfg);
    const std::vector<Outcome> together = run_engine(engine, requests, &ids);
    const EngineStats s = engine.stats();
    EXPECT_GT(s.swap_outs, 0) << "the pool was meant to run out";
    EXPECT_EQ(s.swap_ins, s.swap_outs);
    EXPECT_GT(s.swapped_out_host_bytes, 0u);
    if (scheme == cache::KvScheme::kGaac) {
      EXPECT_LT(s.swapped_out_host_bytes, s.swapped_out_pool_bytes) << "GAAC-coded in host memory";
    }
    std::vector<Outcome> alone;
    for (size_t j = 0; j < requests.size(); ++j) {
      Engine e(smollm2(), cfg);
      std::vector<RequestId> alone_id;
      alone.push_back(run_engine(e, {requests[j]}, &alone_id)[0]);
      const backend::SequenceReport& a = e.report(alone_id[0]).attention;
      const backend::SequenceReport& t = engine.report(ids[j]).attention;
      EXPECT_EQ(t.metered, cache::kv_scheme_is_lossy(scheme));
      EXPECT_EQ(t.meter_cells, a.meter_cells) << "request " << j;
      EXPECT_EQ(t.meter_max, a.meter_max) << "request " << j;
      EXPECT_EQ(t.meter_p99, a.meter_p99) << "request " << j;
      EXPECT_EQ(t.sparse, sparse);
      EXPECT_EQ(t.sparse_budget, a.sparse_budget) << "request " << j;
      // The first two (the second is the one swapped out) run past two windows of 16 tokens, so
      // their decode steps attend a Top-p selection of indexed blocks; the third (24 tokens) never does.
      if (sparse && j < 2) {
        EXPECT_LT(t.sparse_budget, 1.0) << "request " << j << " attended a selection";
      }
    }
    expect_same_outcomes(together, alone);
    if (scheme == cache::KvScheme::kRtn8) {
      int64_t cells = 0;
      for (RequestId id : ids) cells += engine.report(id).attention.meter_cells;
      EXPECT_GT(cells, 0) << "decode steps were metered";
    }
  }
}

// A request swapped out and waiting is cancelled: its host store is freed at once.
TEST(Engine, CancelOfASwappedOutRequestFreesItsHostStore) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 96;
  cfg.backend.pool_tokens = 96;
  cfg.step_tokens = 32;
  cfg.max_sequences = 4;
  cfg.preemption = Preemption::kSwap;
  Engine engine(stories(), cfg);
  std::vector<RequestId> ids;
  for (const RequestParams& p : story_requests({40, 41, 30}, 40, 6)) ids.push_back(engine.submit(p));
  RequestId swapped = 0;
  for (int step = 0; step < 200 && swapped == 0; ++step) {
    engine.step();
    for (RequestId id : ids) {
      const RequestReport& r = engine.report(id);
      if (r.status == RequestStatus::kWaiting && r.swapped_host_bytes > 0) swapped = id;
    }
  }
  ASSERT_NE(swapped, 0) << "no request was swapped out";
  const EngineStats before = engine.stats();
  const uint64_t its_bytes = engine.report(swapped).swapped_host_bytes;
  ASSERT_GE(before.host_bytes_in_use, its_bytes);
  engine.cancel(swapped);
  EXPECT_EQ(engine.report(swapped).finish, FinishReason::kCancelled);
  EXPECT_EQ(engine.report(swapped).swapped_host_bytes, 0u);
  EXPECT_EQ(engine.stats().host_bytes_in_use, before.host_bytes_in_use - its_bytes);
  engine.run();
  EXPECT_EQ(engine.stats().host_bytes_in_use, 0u);
  for (RequestId id : ids) {
    if (id != swapped) {
      EXPECT_EQ(engine.report(id).finish, FinishReason::kLength);
    }
  }
}

TEST(Engine, SwapRefusesBadInput) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 64;
  cfg.preemption = static_cast<Preemption>(7);
  try {
    Engine e(stories(), cfg);
    FAIL() << "an unknown preemption policy was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("preemption"), std::string::npos) << e.what();
  }
  try {
    parse_preemption("evict");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("swap, recompute"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_preemption("recompute"), Preemption::kRecompute);
  // The backend: a sequence swapped out of another backend, none at all, an unknown sequence.
  BackendConfig bc;
  bc.context_tokens = 32;
  CpuBackend a(stories(), bc), b(stories(), bc);
  const cache::SeqId seq = a.create_sequence();
  std::vector<int32_t> toks = {1, 5, 9, 13};
  BatchItem it;
  it.seq = seq;
  it.tokens = toks.data();
  it.n = 4;
  a.forward({&it, 1});
  std::unique_ptr<backend::SwappedSequence> swapped = a.swap_out(seq);
  EXPECT_THROW(a.length(seq), Error);
  try {
    b.swap_in(swapped);
    FAIL() << "a sequence of another backend was swapped in";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  }
  ASSERT_NE(swapped, nullptr) << "a refused swap in keeps the swapped sequence";
  std::unique_ptr<backend::SwappedSequence> none;
  EXPECT_THROW(a.swap_in(none), Error);
  EXPECT_THROW(a.swap_out(12345), Error);
  const cache::SeqId back = a.swap_in(swapped);
  EXPECT_EQ(swapped, nullptr);
  EXPECT_EQ(a.length(back), 4);
}

// Past 16 blocks decode splits the KV over the pool's threads, and a prefill row at the same
// position may round differently: a preempted request replays its generated tokens as decode
// steps. (On this tiny model the rounding never flipped a token either way; the SmolLM2 run of
// bench/engine_goals.sh is where prefilling them changed 2 outputs of 32.)
TEST(Engine, PreemptionPastTheSplitLengthStillGivesEveryOutput) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 340;
  cfg.backend.pool_tokens = 340;
  cfg.step_tokens = 96;
  cfg.max_sequences = 3;
  const std::vector<RequestParams> requests = story_requests({290, 270, 300}, 25, 8);
  Engine engine(stories(), cfg);
  const std::vector<Outcome> together = run_engine(engine, requests);
  EXPECT_GT(engine.stats().preemptions, 0) << "the pool was meant to run out";
  expect_same_outcomes(together, run_each_alone(cfg, requests));
}

// Page classes raw and lossy: a shared prefix's blocks are read as their first request stored
// them, and a prompt row reads what a decode step at its position reads, so sharing does not
// show. (Lossy schemes with a recent window share nothing: Engine.)
class EngineSharing : public ::testing::TestWithParam<cache::KvScheme> {};

TEST_P(EngineSharing, SharesPromptPrefixesAndGivesTheSameOutputs) {
  EngineConfig cfg;
  cfg.backend.kv_scheme = GetParam();
  cfg.backend.context_tokens = 256;
  cfg.backend.pool_tokens = 256 * 8;
  cfg.step_tokens = 128;  // a prompt alone in one chunk; with a shared prefix, its tail alone
  const std::vector<int32_t> prefix = ragged_prompts(smollm2(), {64}, 3)[0];
  std::vector<RequestParams> requests;
  for (const std::vector<int32_t>& tail : ragged_prompts(smollm2(), {5, 9, 1, 20}, 4)) {
    RequestParams r;
    r.prompt = prefix;
    r.prompt.insert(r.prompt.end(), tail.begin() + 1, tail.end());
    r.prompt.push_back(r.prompt[1]);
    r.max_tokens = 6;
    r.ignore_end = true;
    requests.push_back(r);
  }
  Engine engine(smollm2(), cfg);
  std::vector<RequestId> ids;
  const std::vector<Outcome> together = run_engine(engine, requests, &ids);
  const EngineStats s = engine.stats();
  // 64 tokens = 4 blocks; the 2nd..4th requests take them from the first.
  EXPECT_EQ(s.shared_blocks, 12);
  for (size_t i = 1; i < ids.size(); ++i)
    EXPECT_EQ(engine.report(ids[i]).shared_prompt_tokens, 64) << "request " << i;
  EXPECT_LT(s.prefill_tokens, int64_t(4 * 64));
  // Pages at the peak: one prefix plus the tails, not four prefixes.
  const model::ModelConfig& c = smollm2().config();
  const uint64_t pages_per_block = uint64_t(c.n_layers) * 2 * uint64_t(c.n_kv_heads);
  EXPECT_LT(s.peak_pages_in_use, 4 * 4 * pages_per_block);
  expect_same_outcomes(together, run_each_alone(cfg, requests, smollm2()));
}

INSTANTIATE_TEST_SUITE_P(PageClasses, EngineSharing,
                         ::testing::Values(cache::KvScheme::kBf16, cache::KvScheme::kFp8E4M3, cache::KvScheme::kRtn4,
                                           cache::KvScheme::kDither8),
                         [](const ::testing::TestParamInfo<cache::KvScheme>& info) {
                           std::string name = cache::kv_scheme_name(info.param);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The gate repairs a request's blocks with exact copies in its own tables: a request that shares
// its prompt blocks, while it runs or after it finished, still reads them as computed, so every
// output is the one it has alone (a prefix holder that took the repaired pages made the second
// request's text differ).
TEST(Engine, GateRepairsDoNotReachTheRequestsThatShareThePrefix) {
  EngineConfig cfg;
  cfg.backend.kv_scheme = cache::KvScheme::kFp8E5M2;
  cfg.backend.meter.gate = true;
  cfg.backend.meter.tau = 0.02;
  cfg.backend.context_tokens = 256;
  cfg.backend.pool_tokens = 256 * 8;
  const std::vector<int32_t> prefix = ragged_prompts(smollm2(), {64}, 5)[0];
  std::vector<RequestParams> requests;
  for (const std::vector<int32_t>& tail : ragged_prompts(smollm2(), {1, 9, 4}, 6)) {
    RequestParams r;
    r.prompt = prefix;
    r.prompt.insert(r.prompt.end(), tail.begin() + 1, tail.end());
    r.prompt.push_back(r.prompt[1]);
    r.max_tokens = 10;
    r.ignore_end = true;
    requests.push_back(r);
  }
  // Alone: each request's output and certificate (its repairs and largest meter, which a request
  // reading pages another one repaired would show first: it needs fewer repairs).
  std::vector<Outcome> alone;
  std::vector<backend::SequenceReport> alone_reports;
  for (const RequestParams& p : requests) {
    Engine e(smollm2(), cfg);
    std::vector<RequestId> id;
    alone.push_back(run_engine(e, {p}, &id)[0]);
    alone_reports.push_back(e.report(id[0]).attention);
    EXPECT_GT(alone_reports.back().gate_repairs, 0) << "the gate was meant to repair";
  }
  for (const int max_sequences : {1, 3}) {  // after the first finished; while it runs
    SCOPED_TRACE("max_sequences " + std::to_string(max_sequences));
    EngineConfig c = cfg;
    c.max_sequences = max_sequences;
    Engine engine(smollm2(), c);
    std::vector<RequestId> ids;
    const std::vector<Outcome> together = run_engine(engine, requests, &ids);
    EXPECT_EQ(engine.stats().shared_blocks, 8) << "the 2nd and 3rd requests take the prefix's 4 blocks";
    for (size_t i = 0; i < ids.size(); ++i) {
      const backend::SequenceReport& got = engine.report(ids[i]).attention;
      EXPECT_EQ(got.gate_repairs, alone_reports[i].gate_repairs) << "request " << i;
      EXPECT_EQ(got.meter_max, alone_reports[i].meter_max) << "request " << i;
      EXPECT_EQ(got.meter_cells, alone_reports[i].meter_cells) << "request " << i;
    }
    expect_same_outcomes(together, alone);
    engine.drop_cached_prefixes();
    EXPECT_EQ(engine.stats().pool_pages_in_use, 0u) << "every page returns to the pool";
  }
}

// Of the pages in use, those the running requests hold (a page they share counted once); the
// rest, held by cached prefixes alone, are not theirs.
TEST(Engine, LivePagesAreTheRunningRequestsAndNotTheCachedPrefixes) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  cfg.backend.pool_tokens = 128 * 4;
  Engine engine(stories(), cfg);
  const RequestParams request = story_requests({40}, 20, 11)[0];  // 2 whole blocks and a tail
  EXPECT_EQ(engine.stats().live_pages_in_use, 0u);
  engine.submit(request);
  engine.step();
  EngineStats s = engine.stats();
  EXPECT_GT(s.live_pages_in_use, 0u);
  EXPECT_EQ(s.live_pages_in_use, s.pool_pages_in_use) << "nothing is cached yet";
  engine.submit(request);  // takes the first request's blocks
  engine.step();
  s = engine.stats();
  EXPECT_EQ(s.running, 2);
  EXPECT_EQ(s.shared_blocks, 2);
  EXPECT_EQ(s.live_pages_in_use, s.pool_pages_in_use) << "a page two running requests share is one page";
  engine.run();
  s = engine.stats();
  EXPECT_EQ(s.live_pages_in_use, 0u);
  EXPECT_GT(s.cached_prefixes, 0);
  EXPECT_GT(s.pool_pages_in_use, 0u) << "the prefix cache keeps the prompt's blocks";
  engine.drop_cached_prefixes();
  EXPECT_EQ(engine.stats().pool_pages_in_use, 0u);
}

TEST(Engine, CancelFreesPagesAtOnce) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  cfg.backend.pool_tokens = 128 * 4;
  cfg.prefix_sharing = false;
  Engine engine(stories(), cfg);
  const std::vector<RequestParams> requests = story_requests({40, 30}, 50, 9);
  const RequestId a = engine.submit(requests[0]);
  const RequestId b = engine.submit(requests[1]);
  for (int i = 0; i < 4; ++i) engine.step();
  const uint64_t before = engine.stats().pool_pages_in_use;
  engine.cancel(a);
  EXPECT_LT(engine.stats().pool_pages_in_use, before);
  EXPECT_EQ(engine.report(a).finish, FinishReason::kCancelled);
  engine.run();
  EXPECT_EQ(engine.report(b).finish, FinishReason::kLength);
  EXPECT_THROW(engine.cancel(12345), Error);
  engine.release(a);
  EXPECT_THROW(engine.report(a), Error);
}

TEST(Engine, StopStringEndsTheTextBeforeIt) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  RequestParams p;
  p.prompt = {1};
  p.max_tokens = 40;
  Engine alone(stories(), cfg);
  const Outcome full = run_engine(alone, {p})[0];
  ASSERT_GT(full.text.size(), 30u) << full.text;
  const std::string stop = full.text.substr(20, 6);
  p.stop = {stop, "never appears in a story \x01"};
  Engine engine(stories(), cfg);
  const Outcome cut = run_engine(engine, {p})[0];
  EXPECT_EQ(cut.finish, FinishReason::kStop);
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
}

// A backend that fails one forward step, as a device error the backend recovers from would (the
// attention kernels' error word counting a corrupt page): everything else is the CPU backend's.
class StepFailingBackend final : public backend::Backend {
 public:
  StepFailingBackend(std::unique_ptr<backend::Backend> inner, int64_t failing_step)
      : inner_(std::move(inner)), failing_step_(failing_step) {}
  const char* name() const override { return inner_->name(); }
  const BackendConfig& config() const override { return inner_->config(); }
  int64_t context_tokens() const override { return inner_->context_tokens(); }
  cache::SeqId create_sequence() override { return inner_->create_sequence(); }
  cache::SeqId fork_prefix(cache::SeqId parent, int64_t n) override { return inner_->fork_prefix(parent, n); }
  void free_sequence(cache::SeqId seq) override { inner_->free_sequence(seq); }
  int64_t length(cache::SeqId seq) const override { return inner_->length(seq); }
  bool reserve(cache::SeqId seq, int64_t n) override { return inner_->reserve(seq, n); }
  std::unique_ptr<backend::SwappedSequence> swap_out(cache::SeqId seq) override { return inner_->swap_out(seq); }
  cache::SeqId swap_in(std::unique_ptr<backend::SwappedSequence>& s) override { return inner_->swap_in(s); }
  bool can_swap() const override { return inner_->can_swap(); }
  uint64_t pool_pages_in_use() const override { return inner_->pool_pages_in_use(); }
  uint64_t pool_capacity_pages() const override { return inner_->pool_capacity_pages(); }
  uint64_t pages_referenced(std::span<const cache::SeqId> seqs) const override { return inner_->pages_referenced(seqs); }
  void forward(std::span<const BatchItem> items) override {
    if (steps_++ == failing_step_) {
      // Part of the step done, as a launch failing halfway through the layers leaves it.
      inner_->forward(items);
      for (const BatchItem& it : items) failed_.push_back(it.seq);
      fail(StatusCode::kCorrupt, "simulated device error: the attention kernels found 1 corrupt page entry in layer 7");
    }
    inner_->forward(items);
  }
  backend::SequenceReport report(cache::SeqId seq) const override { return inner_->report(seq); }
  const backend::SparseStats& sparse_stats(cache::SeqId seq) const override { return inner_->sparse_stats(seq); }
  std::vector<cache::ClassBytes> sequence_bytes(cache::SeqId seq) const override { return inner_->sequence_bytes(seq); }
  cache::MemoryStats memory_stats() const override { return inner_->memory_stats(); }
  const gate::RecentStepMeters& recent_meters() const override { return inner_->recent_meters(); }
  const std::vector<cache::SeqId>& failed() const { return failed_; }

 private:
  std::unique_ptr<backend::Backend> inner_;
  int64_t failing_step_;
  int64_t steps_ = 0;
  std::vector<cache::SeqId> failed_;
};

// A forward step that fails mid-run: the requests of that step end with the error and its
// message, the others finish with their outputs alone, the failed requests' pages come back, and
// the engine serves the requests submitted after it.
TEST(Engine, AFailedStepEndsItsRequestsAndTheOthersGoOn) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  cfg.backend.pool_tokens = 128 * 8;
  cfg.step_tokens = 13;
  cfg.max_sequences = 3;  // the later requests are not in the failing step
  const std::vector<RequestParams> requests = story_requests({1, 3, 17, 40, 33, 9}, 20, 11);
  const std::vector<Outcome> alone = run_each_alone(cfg, requests);
  auto faulty = std::make_unique<StepFailingBackend>(backend::make_backend(stories(), cfg.backend), 4);
  StepFailingBackend* backend = faulty.get();
  Engine engine(stories(), cfg, std::move(faulty));
  std::vector<RequestId> ids;
  for (const RequestParams& p : requests) ids.push_back(engine.submit(p));
  engine.run();
  ASSERT_FALSE(backend->failed().empty());
  int failed = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const RequestReport& r = engine.report(ids[i]);
    EXPECT_EQ(r.status, RequestStatus::kFinished) << "request " << i;
    if (r.finish == FinishReason::kError) {
      ++failed;
      EXPECT_NE(r.error.find("simulated device error"), std::string::npos) << r.error;
      EXPECT_LT(r.tokens.size(), alone[i].tokens.size()) << "request " << i << " ended early";
      continue;
    }
    EXPECT_EQ(r.finish, FinishReason::kLength) << "request " << i;
    EXPECT_EQ(r.tokens, alone[i].tokens) << "request " << i << " is its output alone";
  }
  EXPECT_EQ(size_t(failed), backend->failed().size()) << "exactly the step's requests failed";
  EXPECT_LT(size_t(failed), ids.size()) << "the others went on";
  // Every page is back but the cached prefixes of the requests that finished.
  engine.drop_cached_prefixes();
  EXPECT_EQ(engine.stats().pool_pages_in_use, 0u);
  // And a request after the failure is served.
  const RequestId later = engine.submit(requests[2]);
  engine.run();
  EXPECT_EQ(engine.report(later).finish, FinishReason::kLength);
  EXPECT_EQ(engine.report(later).tokens, alone[2].tokens);
}

TEST(Engine, BadRequestsFailAloneAndTheOthersGoOn) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 64;
  Engine engine(stories(), cfg);
  RequestParams ok;
  ok.prompt = {1, 5, 9};
  ok.max_tokens = 10;
  ok.ignore_end = true;
  const RequestId id = engine.submit(ok);
  RequestParams too_long = ok;
  too_long.max_tokens = 62;
  try {
    engine.submit(too_long);
    FAIL() << "prompt plus max_tokens beyond the context was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
  RequestParams empty;
  EXPECT_THROW(engine.submit(empty), Error);
  RequestParams bad_token = ok;
  bad_token.prompt = {1, 1 << 30};
  EXPECT_THROW(engine.submit(bad_token), Error);
  RequestParams bad_sampling = ok;
  bad_sampling.sampling.top_p = 2.f;
  EXPECT_THROW(engine.submit(bad_sampling), Error);
  engine.run();
  EXPECT_EQ(engine.report(id).tokens.size(), 10u);
  EngineConfig small = cfg;
  small.backend.pool_tokens = 32;
  EXPECT_THROW(Engine(stories(), small), Error);
  // A scheme the CUDA backend does not serve: an error naming the scheme and the backend, from
  // the scheme table, before any device is looked for (a build without CUDA says so instead).
  EngineConfig cuda = cfg;
  cuda.backend.device = model::Device::kCuda;
  cuda.backend.kv_scheme = cache::KvScheme::kRtn4;
  try {
    Engine e(stories(), cuda);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kUnsupported);
    const std::string want = CERTKV_WITH_CUDA ? "KV scheme rtn4 is not served by the cuda backend (bf16, "
                                              : "the cuda backend is not in this build";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace certkv::engine

// ---- The C API over the engine -----------------------------------------------------------------

namespace certkv::engine {
namespace {

struct Streamed {
  std::map<int64_t, std::string> text;
  std::map<int64_t, int> tokens;
  int64_t cancel_after_3 = -1;
};

int on_engine_token(void* user, int64_t request, int32_t token, const char* text, size_t n) {
  auto* s = static_cast<Streamed*>(user);
  s->text[request].append(text, n);
  if (token >= 0) ++s->tokens[request];
  return request == s->cancel_after_3 && s->tokens[request] == 3 ? 1 : 0;
}

TEST(EngineCApi, RunsRequestsTogetherCancelsAndReports) {
  certkv_model* model = nullptr;
  ASSERT_EQ(certkv_model_load_llama2c(testing::stories_checkpoint().c_str(),
                                      testing::stories_tokenizer().c_str(), &model), CERTKV_OK);
  certkv_engine_params ep = certkv_engine_default_params();
  ep.session.context_tokens = 128;
  ep.max_sequences = 2;
  ep.step_tokens = 24;
  certkv_engine* engine = nullptr;
  ASSERT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_OK) << certkv_last_error();
  std::vector<std::vector<int32_t>> prompts = ragged_prompts(stories(), {30, 5, 41}, 21);
  std::vector<int64_t> ids;
  for (const auto& p : prompts) {
    certkv_request_params rp = certkv_request_default_params();
    EXPECT_EQ(rp.logprobs, -1);
    rp.prompt = p.data();
    rp.n_prompt = int32_t(p.size());
    rp.max_tokens = 12;
    rp.ignore_end = 1;
    if (ids.empty()) {  // the first asks for log-probabilities, its prompt's too
      rp.logprobs = 2;
      rp.prompt_logprobs = 1;
    }
    int64_t id = 0;
    ASSERT_EQ(certkv_engine_submit(engine, &rp, &id), CERTKV_OK) << certkv_last_error();
    ids.push_back(id);
  }
  certkv_request_params too_long = certkv_request_default_params();
  too_long.prompt = prompts[0].data();
  too_long.n_prompt = int32_t(prompts[0].size());
  too_long.max_tokens = 120;
  int64_t bad_id = -1;
  EXPECT_EQ(certkv_engine_submit(engine, &too_long, &bad_id), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_NE(std::string(certkv_last_error()).find("context"), std::string::npos);
  certkv_request_params too_many = certkv_request_default_params();
  too_many.prompt = prompts[0].data();
  too_many.n_prompt = int32_t(prompts[0].size());
  too_many.max_tokens = 4;
  too_many.logprobs = CERTKV_MAX_TOP_LOGPROBS + 1;
  EXPECT_EQ(certkv_engine_submit(engine, &too_many, &bad_id), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("logprobs"), std::string::npos);
  Streamed streamed;
  streamed.cancel_after_3 = ids[1];
  ASSERT_EQ(certkv_engine_run(engine, on_engine_token, &streamed), CERTKV_OK) << certkv_last_error();
  for (size_t i = 0; i < ids.size(); ++i) {
    certkv_request_result r;
    ASSERT_EQ(certkv_engine_result(engine, ids[i], &r), CERTKV_OK);
    EXPECT_EQ(r.finished, 1);
    EXPECT_STREQ(r.error, "") << "no error, and never a null one";
    EXPECT_EQ(std::string(r.text, r.text_bytes), streamed.text[ids[i]]);
    EXPECT_EQ(r.prompt_tokens, int32_t(prompts[i].size()));
    if (ids[i] == ids[1]) {
      EXPECT_STREQ(r.finish_reason, "cancelled");
      EXPECT_EQ(r.generated_tokens, 3);
    } else {
      EXPECT_STREQ(r.finish_reason, "length");
      EXPECT_EQ(r.generated_tokens, 12);
      EXPECT_GT(r.ttft_ms, 0);
      size_t n_itl = 0;
      EXPECT_EQ(certkv_engine_itl(engine, ids[i], nullptr, 0, &n_itl), CERTKV_ERR_OUT_OF_RANGE);
      EXPECT_EQ(n_itl, 11u);
      ASSERT_GE(r.n_classes, 1);
      EXPECT_STREQ(r.kv_bytes[0].storage, "bf16");
      EXPECT_GT(r.kv_bytes[0].bytes, 0u);
    }
  }
  // Log-probabilities: the count with no room, entries from an offset, none where not asked.
  size_t n_lp = 0;
  ASSERT_EQ(certkv_engine_logprobs(engine, ids[0], 0, 0, nullptr, 0, &n_lp), CERTKV_OK);
  EXPECT_EQ(n_lp, 12u);
  certkv_token_logprob lp[4];
  ASSERT_EQ(certkv_engine_logprobs(engine, ids[0], 0, 10, lp, 4, &n_lp), CERTKV_OK);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(lp[k].n_top, 2);
    EXPECT_LE(lp[k].logprob, 0.f);
    EXPECT_GE(lp[k].top_logprobs[0], lp[k].logprob);
    EXPECT_GE(lp[k].top_logprobs[0], lp[k].top_logprobs[1]);
  }
  ASSERT_EQ(certkv_engine_logprobs(engine, ids[0], 1, 0, lp, 1, &n_lp), CERTKV_OK);
  EXPECT_EQ(n_lp, prompts[0].size() - 1);
  EXPECT_EQ(lp[0].token, prompts[0][1]);  // entry 0: the prompt's second token
  EXPECT_EQ(certkv_engine_logprobs(engine, ids[0], 0, 13, lp, 4, &n_lp), CERTKV_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(certkv_engine_logprobs(engine, ids[2], 0, 0, lp, 4, &n_lp), CERTKV_OK);
  EXPECT_EQ(n_lp, 0u);
  EXPECT_EQ(certkv_engine_logprobs(engine, ids[2], 0, 0, nullptr, 4, &n_lp), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_engine_stats st;
  ASSERT_EQ(certkv_engine_get_stats(engine, &st), CERTKV_OK);
  EXPECT_EQ(st.running + st.waiting, 0);
  EXPECT_EQ(st.decode_tokens, 12 + 3 + 12);
  EXPECT_GT(st.peak_pages_in_use, 0u);
  // Pages now, by class: the finished requests' prompt blocks kept for sharing. Every page of
  // bf16 is a raw bf16 page, so the bf16 reference equals the bytes in use.
  ASSERT_GE(st.n_classes_in_use, 1);
  EXPECT_STREQ(st.in_use[0].storage, "bf16");
  uint64_t pages_in_use = 0, page_bytes_in_use = 0;
  for (int32_t i = 0; i < st.n_classes_in_use; ++i) {
    pages_in_use += st.in_use[i].pages_in_use;
    page_bytes_in_use += st.in_use[i].page_bytes_in_use;
  }
  EXPECT_EQ(pages_in_use, st.pool_pages_in_use);
  EXPECT_GT(pages_in_use, 0u);
  EXPECT_EQ(st.page_bytes_as_bf16, page_bytes_in_use);
  certkv_request_result unmetered;
  ASSERT_EQ(certkv_engine_result(engine, ids[0], &unmetered), CERTKV_OK);
  EXPECT_EQ(unmetered.metered, 0);
  EXPECT_EQ(unmetered.meter_cells, 0);
  size_t n_layers = 99;
  EXPECT_EQ(certkv_engine_result_layers(engine, ids[0], nullptr, 0, &n_layers), CERTKV_OK);
  EXPECT_EQ(n_layers, 0u);
  EXPECT_EQ(certkv_engine_release(engine, ids[0]), CERTKV_OK);
  certkv_request_result gone;
  EXPECT_EQ(certkv_engine_result(engine, ids[0], &gone), CERTKV_ERR_NOT_FOUND);
  certkv_engine_free(engine);
  // A pool that cannot hold one sequence is refused at create, naming both sizes.
  ep.pool_bytes = 1000;
  EXPECT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("fewer than one sequence"), std::string::npos)
      << certkv_last_error();
  // A device the engine has no backend for: the error names the device and the scheme.
  ep = certkv_engine_default_params();
  ep.session.context_tokens = 128;
  ep.session.device = "cuda";
  EXPECT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(certkv_last_error()).find("cuda"), std::string::npos);
  EXPECT_STREQ(certkv_version(), "0.1.0");
  certkv_model_free(model);
}

TEST(EngineCApi, ReportsTheMeterPerLayer) {
  certkv_model* model = nullptr;
  ASSERT_EQ(certkv_model_load(testing::smollm2_gguf().c_str(), &model), CERTKV_OK) << certkv_last_error();
  certkv_model_info info;
  ASSERT_EQ(certkv_model_get_info(model, &info), CERTKV_OK);
  certkv_engine_params ep = certkv_engine_default_params();
  ep.session.context_tokens = 128;
  ep.session.n_threads = 2;
  ep.session.kv = "rtn4";
  ep.max_sequences = 2;
  certkv_engine* engine = nullptr;
  ASSERT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_OK) << certkv_last_error();
  const std::string text = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep "
                           "in the long grass beside the river.";
  std::vector<int32_t> prompt(128);
  int32_t n_prompt = 0;
  ASSERT_EQ(certkv_tokenize(model, text.data(), text.size(), 1, 0, prompt.data(), 128, &n_prompt), CERTKV_OK);
  prompt.resize(size_t(n_prompt));
  ASSERT_GE(n_prompt, 17);  // a full block in rtn4 pages
  certkv_request_params rp = certkv_request_default_params();
  rp.prompt = prompt.data();
  rp.n_prompt = int32_t(prompt.size());
  rp.max_tokens = 10;
  rp.ignore_end = 1;
  int64_t id = 0;
  ASSERT_EQ(certkv_engine_submit(engine, &rp, &id), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_engine_run(engine, nullptr, nullptr), CERTKV_OK) << certkv_last_error();
  certkv_request_result r;
  ASSERT_EQ(certkv_engine_result(engine, id, &r), CERTKV_OK);
  ASSERT_EQ(r.metered, 1);
  // 9 decode steps (the first token comes from the prefill), every query head of every layer.
  EXPECT_EQ(r.meter_cells, int64_t(9) * info.n_layers * info.n_heads);
  size_t n = 0;
  EXPECT_EQ(certkv_engine_result_layers(engine, id, nullptr, 0, &n), CERTKV_ERR_OUT_OF_RANGE);
  ASSERT_EQ(n, size_t(info.n_layers));
  std::vector<certkv_layer_meter> layers(n);
  ASSERT_EQ(certkv_engine_result_layers(engine, id, layers.data(), layers.size(), &n), CERTKV_OK);
  int64_t cells = 0;
  double meter_max = 0, covered = 0;
  for (const certkv_layer_meter& l : layers) {
    EXPECT_EQ(l.cells, int64_t(9) * info.n_heads);
    EXPECT_LE(l.meter_p99, l.meter_max);
    cells += l.cells;
    covered += l.coverage * double(l.cells);
    meter_max = std::max(meter_max, l.meter_max);
  }
  EXPECT_EQ(cells, r.meter_cells);
  EXPECT_EQ(meter_max, r.meter_max);
  EXPECT_GT(meter_max, 0.0);  // rtn4 pages hold the prompt's full blocks: something to bound
  EXPECT_NEAR(covered / double(cells), r.coverage, 1e-12);
  EXPECT_EQ(certkv_engine_result_layers(engine, id + 1000, layers.data(), layers.size(), &n), CERTKV_ERR_NOT_FOUND);
  certkv_engine_free(engine);
  certkv_model_free(model);
}

// The recent step meters: per step and (layer, query head) the largest meter over the step's
// requests; over all steps they hold exactly the cells the requests' own reports count.
TEST(EngineCApi, KeepsTheMeterOfRecentStepsPerLayerAndHead) {
  certkv_model* model = nullptr;
  ASSERT_EQ(certkv_model_load(testing::smollm2_gguf().c_str(), &model), CERTKV_OK) << certkv_last_error();
  certkv_model_info info;
  ASSERT_EQ(certkv_model_get_info(model, &info), CERTKV_OK);
  certkv_engine_params ep = certkv_engine_default_params();
  EXPECT_EQ(ep.meter_recent_steps, 64);
  ep.session.context_tokens = 128;
  ep.session.n_threads = 2;
  ep.session.kv = "rtn4";
  ep.max_sequences = 2;
  certkv_engine* engine = nullptr;
  ASSERT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_OK) << certkv_last_error();
  const size_t cells_per_step = size_t(info.n_layers) * size_t(info.n_heads);
  size_t n = 99;
  int32_t n_layers = 0, n_heads = 0;
  ASSERT_EQ(certkv_engine_recent_meters(engine, 0, nullptr, nullptr, 0, &n, &n_layers, &n_heads), CERTKV_OK);
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(n_layers, info.n_layers);
  EXPECT_EQ(n_heads, info.n_heads);

  const std::vector<std::string> texts = {
      "The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the long grass.",
      "In the beginning of the year the river rose above its banks and the village moved its market up the "
      "hill, where the old church stood."};
  const std::vector<int32_t> max_tokens = {10, 6};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> ids;
  for (size_t i = 0; i < texts.size(); ++i) {
    std::vector<int32_t> prompt(128);
    int32_t n_prompt = 0;
    ASSERT_EQ(certkv_tokenize(model, texts[i].data(), texts[i].size(), 1, 0, prompt.data(), 128, &n_prompt),
              CERTKV_OK);
    prompt.resize(size_t(n_prompt));
    ASSERT_GE(n_prompt, 17);  // a full block in rtn4 pages: something to bound
    prompts.push_back(std::move(prompt));
    certkv_request_params rp = certkv_request_default_params();
    rp.prompt = prompts.back().data();
    rp.n_prompt = int32_t(prompts.back().size());
    rp.max_tokens = max_tokens[i];
    rp.ignore_end = 1;
    int64_t id = 0;
    ASSERT_EQ(certkv_engine_submit(engine, &rp, &id), CERTKV_OK) << certkv_last_error();
    ids.push_back(id);
  }
  ASSERT_EQ(certkv_engine_run(engine, nullptr, nullptr), CERTKV_OK) << certkv_last_error();

  // 9 + 5 decode rows in at most 9 steps (the first tokens come from the prefills).
  EXPECT_EQ(certkv_engine_recent_meters(engine, 0, nullptr, nullptr, 0, &n, nullptr, nullptr),
            CERTKV_ERR_OUT_OF_RANGE);
  ASSERT_EQ(n, 9u);
  std::vector<certkv_meter_step> steps(n);
  std::vector<float> meters(n * cells_per_step);
  ASSERT_EQ(certkv_engine_recent_meters(engine, 0, steps.data(), meters.data(), steps.size(), &n, nullptr, nullptr),
            CERTKV_OK);
  int64_t cells = 0;
  std::vector<float> layer_max(size_t(info.n_layers), 0.0f);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) {
      EXPECT_GT(steps[i].step, steps[i - 1].step);
    }
    EXPECT_TRUE(steps[i].cells == int64_t(cells_per_step) || steps[i].cells == 2 * int64_t(cells_per_step))
        << steps[i].cells;
    cells += steps[i].cells;
    for (size_t c = 0; c < cells_per_step; ++c) {
      const float m = meters[i * cells_per_step + c];
      ASSERT_FALSE(std::isnan(m)) << "step " << i << " cell " << c;  // every head of every layer metered
      EXPECT_GE(m, 0.0f);
      EXPECT_LE(m, 1.0f);
      float& l = layer_max[c / size_t(info.n_heads)];
      l = std::max(l, m);
    }
  }
  std::vector<double> expected_layer_max(size_t(info.n_layers), 0.0);
  int64_t expected_cells = 0;
  for (int64_t id : ids) {
    certkv_request_result r;
    ASSERT_EQ(certkv_engine_result(engine, id, &r), CERTKV_OK);
    expected_cells += r.meter_cells;
    std::vector<certkv_layer_meter> layers(size_t(info.n_layers));
    size_t n_layer_entries = 0;
    ASSERT_EQ(certkv_engine_result_layers(engine, id, layers.data(), layers.size(), &n_layer_entries), CERTKV_OK);
    for (size_t l = 0; l < layers.size(); ++l)
      expected_layer_max[l] = std::max(expected_layer_max[l], layers[l].meter_max);
  }
  EXPECT_EQ(cells, expected_cells);
  float overall = 0;
  for (size_t l = 0; l < layer_max.size(); ++l) {
    EXPECT_EQ(layer_max[l], float(expected_layer_max[l])) << "layer " << l;
    overall = std::max(overall, layer_max[l]);
  }
  EXPECT_GT(overall, 0.0f);

  // The stats name the newest step; after_step filters; a short capacity is refused.
  certkv_engine_stats stats;
  ASSERT_EQ(certkv_engine_get_stats(engine, &stats), CERTKV_OK);
  EXPECT_EQ(stats.last_metered_step, steps.back().step);
  const std::vector<certkv_meter_step> all_steps = steps;
  const std::vector<float> all_meters = meters;
  ASSERT_EQ(certkv_engine_recent_meters(engine, all_steps[5].step, steps.data(), meters.data(), steps.size(), &n,
                                        nullptr, nullptr),
            CERTKV_OK);
  ASSERT_EQ(n, 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(steps[i].step, all_steps[6 + i].step);
    EXPECT_EQ(steps[i].cells, all_steps[6 + i].cells);
  }
  EXPECT_TRUE(std::equal(meters.begin(), meters.begin() + std::ptrdiff_t(3 * cells_per_step),
                         all_meters.begin() + std::ptrdiff_t(6 * cells_per_step)));
  ASSERT_EQ(certkv_engine_recent_meters(engine, stats.last_metered_step, steps.data(), meters.data(), steps.size(), &n,
                                        nullptr, nullptr),
            CERTKV_OK);
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(certkv_engine_recent_meters(engine, 0, steps.data(), meters.data(), 2, &n, nullptr, nullptr),
            CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(n, 9u);
  EXPECT_EQ(certkv_engine_recent_meters(engine, -1, steps.data(), meters.data(), steps.size(), &n, nullptr, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_engine_recent_meters(engine, 0, nullptr, meters.data(), steps.size(), &n, nullptr, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  certkv_engine_free(engine);

  // A ring of 3 keeps the newest 3; bf16 and a ring of 0 keep none; a ring past the limit is refused.
  ep.meter_recent_steps = 3;
  ASSERT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_OK) << certkv_last_error();
  certkv_request_params rp = certkv_request_default_params();
  rp.prompt = prompts[0].data();
  rp.n_prompt = int32_t(prompts[0].size());
  rp.max_tokens = 8;
  rp.ignore_end = 1;
  int64_t id = 0;
  ASSERT_EQ(certkv_engine_submit(engine, &rp, &id), CERTKV_OK);
  ASSERT_EQ(certkv_engine_run(engine, nullptr, nullptr), CERTKV_OK);
  ASSERT_EQ(certkv_engine_recent_meters(engine, 0, steps.data(), meters.data(), steps.size(), &n, nullptr, nullptr),
            CERTKV_OK);
  ASSERT_EQ(n, 3u);
  ASSERT_EQ(certkv_engine_get_stats(engine, &stats), CERTKV_OK);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(steps[i].step, stats.last_metered_step - 2 + int64_t(i));
  certkv_engine_free(engine);
  for (const auto& [kv, recent] : std::vector<std::pair<const char*, int32_t>>{{"bf16", 64}, {"rtn4", 0}}) {
    ep.session.kv = kv;
    ep.meter_recent_steps = recent;
    ASSERT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(certkv_engine_submit(engine, &rp, &id), CERTKV_OK);
    ASSERT_EQ(certkv_engine_run(engine, nullptr, nullptr), CERTKV_OK);
    ASSERT_EQ(certkv_engine_recent_meters(engine, 0, steps.data(), meters.data(), steps.size(), &n, nullptr, nullptr),
              CERTKV_OK);
    EXPECT_EQ(n, 0u) << kv;
    ASSERT_EQ(certkv_engine_get_stats(engine, &stats), CERTKV_OK);
    EXPECT_EQ(stats.last_metered_step, 0) << kv;
    certkv_engine_free(engine);
  }
  ep.session.kv = "rtn4";
  for (int32_t bad : {-1, 4097}) {
    ep.meter_recent_steps = bad;
    EXPECT_EQ(certkv_engine_create(model, &ep, &engine), CERTKV_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(certkv_last_error()).find("recent_steps"), std::string::npos) << certkv_last_error();
  }
  certkv_model_free(model);
}

}  // namespace
}  // namespace certkv::engine

namespace certkv::engine {
namespace {

// Log-probabilities: the prompt's and each generated token's are token_logprob over the logits a
// session computes for the same tokens alone, whatever the chunking and the other requests; the
// prompt is computed whole even when its prefix is cached; bad counts are refused.
TEST(Engine, LogprobsAreThoseOfTheTokensLogitsAlone) {
  EngineConfig cfg;
  cfg.backend.context_tokens = 128;
  cfg.backend.pool_tokens = 128 * 4;
  cfg.step_tokens = 11;  // the prompt in chunks, beside another request's decodes
  cfg.max_sequences = 2;
  const model::Model& m = stories();
  const int32_t n_vocab = m.config().n_vocab;
  std::vector<RequestParams> requests = story_requests({40, 40}, 6, 21);
  requests[1].prompt = requests[0].prompt;  // the same prompt: its blocks are cached by then
  for (RequestParams& r : requests) {
    r.logprobs = 3;
    r.prompt_logprobs = true;
  }
  requests[0].sampling = {};  // greedy
  Engine engine(m, cfg);
  std::vector<RequestId> ids;
  run_engine(engine, requests, &ids);
  for (size_t q = 0; q < ids.size(); ++q) {
    const RequestReport& r = engine.report(ids[q]);
    const std::vector<int32_t>& prompt = requests[q].prompt;
    ASSERT_EQ(r.prompt_logprobs.size(), prompt.size() - 1) << q;
    ASSERT_EQ(r.logprobs.size(), r.tokens.size()) << q;
    EXPECT_EQ(r.shared_prompt_tokens, 0) << "a prompt whose log-probabilities are asked is computed whole";
    // The same tokens through a session alone: prompt then generated tokens, every row's logits.
    backend::Session alone(m, cfg.backend);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), r.tokens.begin(), r.tokens.end() - 1);
    std::vector<float> logits(all.size() * size_t(n_vocab));
    alone.prefill(all.data(), int64_t(all.size()), nullptr, logits.data());
    for (size_t i = 0; i + 1 < all.size() + 1; ++i) {
      const int32_t next = i + 1 < prompt.size() ? prompt[i + 1] : r.tokens[i + 1 - prompt.size()];
      const model::TokenLogprob want = model::token_logprob(logits.data() + i * size_t(n_vocab), n_vocab, next, 3);
      const model::TokenLogprob& got = i + 1 < prompt.size() ? r.prompt_logprobs[i] : r.logprobs[i + 1 - prompt.size()];
      ASSERT_EQ(got.token, next) << q << " " << i;
      EXPECT_EQ(got.logprob, want.logprob) << q << " " << i;
      EXPECT_EQ(got.top, want.top) << q << " " << i;
    }
    if (q == 0)  // greedy: each generated token is its position's most likely
      for (const model::TokenLogprob& g : r.logprobs) EXPECT_EQ(g.top.at(0).first, g.token);
  }
  // Preempted and recomputed, or swapped, mid-prompt and mid-generation: the same entries, once each.
  for (const Preemption preemption : {Preemption::kRecompute, Preemption::kSwap}) {
    EngineConfig tight = cfg;
    tight.backend.pool_tokens = 128;  // one context: two requests of 80 tokens cannot both stay
    tight.preemption = preemption;
    std::vector<RequestParams> long_requests = story_requests({50, 50}, 30, 23);
    for (RequestParams& r : long_requests) {
      r.logprobs = 2;
      r.prompt_logprobs = true;
      r.max_tokens = 30;
    }
    Engine alone_engine(m, cfg);
    std::vector<RequestId> alone_ids;
    run_engine(alone_engine, long_requests, &alone_ids);
    Engine squeezed(m, tight);
    std::vector<RequestId> squeezed_ids;
    run_engine(squeezed, long_requests, &squeezed_ids);
    EXPECT_GT(squeezed.stats().preemptions, 0) << int(preemption);
    for (size_t q = 0; q < long_requests.size(); ++q) {
      const RequestReport& a = alone_engine.report(alone_ids[q]);
      const RequestReport& b = squeezed.report(squeezed_ids[q]);
      ASSERT_EQ(b.prompt_logprobs.size(), a.prompt_logprobs.size());
      ASSERT_EQ(b.logprobs.size(), a.logprobs.size());
      for (size_t i = 0; i < a.prompt_logprobs.size(); ++i) {
        EXPECT_EQ(b.prompt_logprobs[i].token, a.prompt_logprobs[i].token);
        EXPECT_EQ(b.prompt_logprobs[i].logprob, a.prompt_logprobs[i].logprob);
      }
      for (size_t i = 0; i < a.logprobs.size(); ++i) {
        EXPECT_EQ(b.logprobs[i].token, a.logprobs[i].token);
        EXPECT_EQ(b.logprobs[i].logprob, a.logprobs[i].logprob);
        EXPECT_EQ(b.logprobs[i].top, a.logprobs[i].top);
      }
    }
  }
  RequestParams bad = requests[0];
  bad.logprobs = model::kMaxTopLogprobs + 1;
  EXPECT_THROW(engine.submit(bad), Error);
  bad.logprobs = -2;
  EXPECT_THROW(engine.submit(bad), Error);
  RequestParams none = requests[0];
  none.logprobs = -1;
  none.prompt_logprobs = false;
  const RequestId plain = engine.submit(none);
  engine.run();
  EXPECT_TRUE(engine.report(plain).logprobs.empty());
  EXPECT_TRUE(engine.report(plain).prompt_logprobs.empty());
  EXPECT_GT(engine.report(plain).shared_prompt_tokens, 0);  // without them the cached prefix is taken
}

}  // namespace
}  // namespace certkv::engine
