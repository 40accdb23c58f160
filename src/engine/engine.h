// The engine: requests go to a scheduler that runs one batched forward step at a time over one
// backend's shared page pool (DESIGN.md section 1).
//
// Each step runs every decoding request's next token and, in what the step's token budget
// leaves, chunks of the prompts being prefilled (chunked prefill interleaved with decode);
// requests join and leave at step boundaries (continuous batching).
//
// Prefix sharing: every whole block of a prompt, once computed, is registered under a hash of
// the tokens up to its end. A request whose prompt begins with registered blocks starts from a
// sequence that shares those pages (ref-counted, any page class) and prefills only the rest; a
// request whose prompt shares blocks that another request is still prefilling waits for them.
// When a request finishes, the blocks it registered stay cached in a holder sequence until the
// pool needs their pages (least recently used first). With the gate, whose repairs give a
// request exact copies of its blocks, a request's blocks move to such a holder as soon as they
// are all registered, so that the cache holds them as computed. Schemes whose complete blocks change after
// they are written (a lossy scheme's full-precision recent window) are not shared.
//
// Pool exhaustion: when a step's pages cannot be had, cached prefixes are evicted first, then the
// newest request is preempted (EngineConfig::preemption). kSwap: its pages and the backend's state
// of its sequence go to host memory (GAAC-coded where the cache can, backend::SwappedSequence),
// and when it is admitted again they come back bit for bit and it goes on where it stopped (a
// backend that cannot swap, Backend::can_swap, recomputes instead). kRecompute: its pages are freed, and when it is admitted again its prompt is prefilled again
// and its generated tokens replayed one a step, as they were first computed. A request is never
// lost: the pool holds at least one sequence of the whole context, so the oldest request always
// completes.
//
// Determinism: a request's logits are those of running it alone (backend/backend.h), so with
// greedy sampling, or a seeded sampler, its output does not depend on the other requests; with
// the chunking-invariant schemes (cache/kv_scheme.h) not even after a preemption.
//
// Thread safety: an Engine is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"
#include "model/sampler.h"

namespace certkv::engine {

using RequestId = int64_t;

// What preemption does with the newest request's KV (docs/engine.md, "Preemption").
enum class Preemption { kRecompute, kSwap };
const char* preemption_name(Preemption preemption);  // "recompute", "swap"
// kInvalidArgument naming the choices for any other name.
Preemption parse_preemption(std::string_view name);

struct EngineConfig {
  backend::BackendConfig backend;
  int max_sequences = 8;       // requests decoding or prefilling at once (-np)
  int64_t step_tokens = 512;   // the most tokens one step runs (decodes first, then prefill chunks)
  bool prefix_sharing = true;
  // Swap won on the 32-requests-on-a-pool-for-4 goal (docs/engine.md, "Preemption").
  Preemption preemption = Preemption::kSwap;
};

struct RequestParams {
  std::vector<int32_t> prompt;     // tokens, BOS included when the model wants one
  int64_t max_tokens = 128;        // new tokens at most; REQUIRES >= 1
  model::SamplerParams sampling;
  std::vector<std::string> stop;   // the text ends before the first occurrence of any of them
  bool ignore_end = false;         // keep generating past end-of-generation tokens
  // Log-probabilities (model::token_logprob: the model's distribution, before the sampler's
  // temperature and truncation): -1 none; 0 to model::kMaxTopLogprobs, each generated token's
  // and that many most likely alternatives.
  int32_t logprobs = -1;
  // Also the prompt's: for tokens 1 .. n_prompt - 1, given the tokens before (with
  // max(logprobs, 0) alternatives). Its prompt is computed whole: no prefix is taken from the cache.
  bool prompt_logprobs = false;
};

enum class RequestStatus { kWaiting, kRunning, kFinished };
enum class FinishReason { kNone, kLength, kStop, kEnd, kCancelled, kError };
const char* finish_reason_name(FinishReason reason);  // "length", "stop", "end", ...

// What a request measured of itself.
struct RequestReport {
  RequestStatus status = RequestStatus::kWaiting;
  FinishReason finish = FinishReason::kNone;
  std::string error;               // kError: why
  std::string text;                // generated text emitted so far (valid UTF-8)
  std::vector<int32_t> tokens;     // generated tokens (an end token included)
  int64_t prompt_tokens = 0;
  int64_t shared_prompt_tokens = 0;  // taken from the prefix cache at its (last) admission
  int64_t preemptions = 0;
  uint64_t swapped_host_bytes = 0;  // host memory its KV takes while swapped out (else 0)
  double ttft_ms = 0;              // submit to first token
  std::vector<double> itl_ms;      // between consecutive tokens
  backend::SequenceReport attention;   // meter, gate repairs, sparse budget (of its last run)
  // RequestParams::logprobs >= 0: one per generated token, in order, recorded before the token's
  // callback; prompt_logprobs: one per prompt token after the first.
  std::vector<model::TokenLogprob> logprobs;
  std::vector<model::TokenLogprob> prompt_logprobs;
  std::vector<cache::ClassBytes> kv_bytes;  // its pages by class at the end
};

// on_token(id, token, text): after each generated token, with the new text it completed (may
// be empty: bytes held back until a UTF-8 character or a possible stop string is complete).
using TokenCallback = std::function<void(RequestId, int32_t, std::string_view)>;

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;      // prompt tokens computed (recomputations included)
  int64_t decode_tokens = 0;       // tokens generated
  double prefill_seconds = 0;      // steps' time shared out by their tokens
  double decode_seconds = 0;
  int64_t preemptions = 0;
  // Preemption by swap: sequences swapped out and back in; the host bytes their stores took and
  // the pool page bytes they freed (totals over every swap out); host bytes held now and at most.
  int64_t swap_outs = 0, swap_ins = 0;
  uint64_t swapped_out_host_bytes = 0, swapped_out_pool_bytes = 0;
  uint64_t host_bytes_in_use = 0, host_bytes_peak = 0;
  double swap_seconds = 0;         // in swap out and swap in
  // Preemption by recompute: tokens computed again (prompt chunks and replayed tokens) and their
  // share of the steps' time.
  int64_t recomputed_tokens = 0;
  double recompute_seconds = 0;
  int64_t shared_blocks = 0;       // blocks taken from the prefix cache at admissions
  int64_t evicted_prefixes = 0;
  int64_t cached_prefixes = 0;     // holder sequences of prompt blocks (finished requests', and gated ones')
  int64_t running = 0, waiting = 0;
  uint64_t pool_pages_in_use = 0, pool_capacity_pages = 0;
  // Of pool_pages_in_use: the pages the running requests' sequences hold (a page they share
  // counted once). The rest are held by cached prefixes alone, and eviction can free them.
  uint64_t live_pages_in_use = 0;
  uint64_t peak_pages_in_use = 0;
  std::vector<cache::ClassBytes> peak_bytes;  // per class, the most page bytes in use after a step
  std::vector<cache::StorageClassStats> in_use_by_class;  // per class, pages and bytes now
  // The number of the newest forward step kept in recent_meters() (0: none yet), so a reader
  // can tell whether a step was added since it last looked.
  int64_t last_metered_step = 0;
};

class Engine {
 public:
  // REQUIRES: model outlives the engine. Throws certkv::Error (kInvalidArgument) for a bad
  // configuration, including a pool that cannot hold one sequence of the context.
  Engine(const model::Model& model, const EngineConfig& config);
  // An engine over a backend the caller made for model and config.backend (a backend of its own,
  // or one wrapped to inject faults); the same checks.
  Engine(const model::Model& model, const EngineConfig& config, std::unique_ptr<backend::Backend> backend);
  ~Engine();

  const backend::Backend& backend() const { return *backend_; }
  const EngineConfig& config() const { return config_; }

  // Queues a request. Throws certkv::Error for it alone (nothing queued): kOutOfRange when its
  // prompt plus max_tokens exceeds the context, kInvalidArgument for an empty prompt, a token
  // outside the vocabulary or bad sampling parameters.
  RequestId submit(RequestParams params);
  // Frees the request's pages at once and finishes it (kCancelled). kNotFound for an unknown id;
  // a finished request is left as it is.
  void cancel(RequestId id);
  // One batched step. Returns whether requests remain (running or waiting). When the backend's
  // forward step fails (certkv::Error: a corrupt page, a failed device launch), the requests of
  // that step end with FinishReason::kError and the error's message (their pages freed, nothing
  // of them kept for sharing), and the others go on.
  bool step(const TokenCallback& on_token = {});
  // Steps until no request remains.
  void run(const TokenCallback& on_token = {});

  // Frees every cached prefix (the pages finished requests left for sharing).
  void drop_cached_prefixes();

  // kNotFound for an unknown id.
  const RequestReport& report(RequestId id) const;
  // Forgets a finished request (its report). kInvalidArgument while it is not finished.
  void release(RequestId id);
  EngineStats stats() const;
  // The meter of the recent metered decode steps over every request (backend::MeterConfig::
  // recent_steps of config().backend): per step and (layer, query head), the largest meter.
  const gate::RecentStepMeters& recent_meters() const { return backend_->recent_meters(); }

 private:
  struct Request;
  struct PrefixEntry {
    cache::SeqId holder;
    std::vector<int32_t> tokens;  // the block's tokens, checked on a hit
  };

  Request& request(RequestId id);
  void admit();
  // Blocks of the request's prompt found in the prefix cache, and the sequence holding them.
  int64_t lookup_prefix(const Request& r, cache::SeqId* holder);
  // Whether r records its prompt's log-probabilities and some are still to come.
  bool wants_prompt_logprobs(const Request& r) const;
  bool waits_for_a_prefill(const Request& r, int64_t cached_blocks) const;
  void register_blocks(Request& r);
  // The prefix entries naming r's sequence move to a new holder sharing their pages (cached,
  // evicted first when the pool runs out).
  void move_entries_to_a_holder(Request& r);
  void drop_entries_of(cache::SeqId seq);
  bool evict_one_prefix();
  void preempt(Request& r);
  // Admits a swapped-out request if its pages can be had; false when not.
  bool admit_swapped(Request& r);
  void drop_swapped(Request& r);
  void finish(Request& r, FinishReason reason, const TokenCallback& on_token);
  void free_sequence_of(Request& r, bool keep_prefix);
  void on_token(Request& r, int32_t token, const TokenCallback& cb);
  // Pages of n_tokens new tokens in every (layer, K/V, kv_head) table.
  uint64_t pages_for(int64_t n_tokens) const;
  void sample_peaks();

  const model::Model& model_;
  EngineConfig config_;
  std::unique_ptr<backend::Backend> backend_;
  bool share_prefixes_ = false;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  std::deque<RequestId> waiting_;   // by arrival
  std::vector<RequestId> running_;  // by arrival
  RequestId next_id_ = 1;
  std::unordered_map<uint64_t, PrefixEntry> prefixes_;
  std::deque<cache::SeqId> holders_;  // least recently used first
  std::vector<int32_t> tokens_;  // the tokens the step's items draw
  std::vector<float> logits_;  // the step's logits for log-probabilities: [rows][n_vocab]
  // Rows of a prompt chunk whose log-probabilities are recorded (RequestParams::prompt_logprobs).
  static constexpr int64_t kLogprobRows = 64;
  EngineStats stats_;
};

}  // namespace certkv::engine
