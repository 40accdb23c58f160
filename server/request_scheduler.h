// The scheduler thread of the server: it alone calls the engine (certkv_engine_*); HTTP handler
// threads hand it requests through RequestChannels and read tokens back from them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "certkv/certkv.h"
#include "meter_history.h"
#include "server_metrics.h"

namespace certkv::server {

// What a request asks of the engine, its prompt already tokenized.
struct GenerationRequest {
  std::vector<int32_t> prompt;
  int32_t max_tokens = 16;
  certkv_sampler_params sampler{};
  std::vector<std::string> stop;
  bool ignore_end = false;  // generate past end-of-generation tokens
  bool per_layer = false;  // copy the meter per layer into the result
  int32_t logprobs = -1;   // certkv_request_params.logprobs
  bool prompt_logprobs = false;
  bool stream = false;     // the channel gets each token's log-probability as it comes
};

// A finished request, copied out of the engine before the scheduler releases it.
struct GenerationResult {
  std::string finish_reason;  // "length", "stop", "end", "cancelled", "error"
  std::string error;          // finish_reason "error": why
  std::string text;
  int32_t prompt_tokens = 0;
  int32_t generated_tokens = 0;
  int32_t shared_prompt_tokens = 0;
  int32_t preemptions = 0;
  double ttft_ms = 0;
  std::vector<double> itl_ms;
  bool metered = false;
  double meter_max = 0, meter_p99 = 0, coverage = 0;
  int64_t meter_cells = 0;
  int64_t gate_repairs = 0;
  double sparse_budget = 1;
  double sparse_estimated_mass = 0;  // mean over sparse_indexed_cells (0 with none)
  int64_t sparse_indexed_cells = 0;
  std::vector<std::pair<std::string, uint64_t>> kv_bytes;  // by page class
  std::vector<certkv_layer_meter> layers;  // asked for (per_layer) and metered: one per layer
  std::vector<certkv_token_logprob> logprobs;         // asked for: one per generated token (an end of
                                                      // generation that ends the text has none)
  std::vector<certkv_token_logprob> prompt_logprobs;  // asked for: one per prompt token after the first
};

// One request between its HTTP handler and the scheduler. Thread safe.
class RequestChannel {
 public:
  struct Submission {
    certkv_status status = CERTKV_OK;
    std::string error;  // status != OK: the engine's message
  };

  // ---- The handler's side.
  // Blocks until the scheduler has submitted the request to the engine (or refused it).
  Submission wait_submitted();
  // Blocks until new text or tokens, the end, or the timeout; appends the new text to *text and,
  // when logprobs is given, the new tokens' log-probabilities (GenerationRequest::logprobs) to
  // *logprobs. Returns whether the request has finished (then result() is final).
  bool wait_for_text(std::string* text, std::chrono::milliseconds timeout,
                     std::vector<certkv_token_logprob>* logprobs = nullptr);
  // REQUIRES: finished.
  const GenerationResult& result() const { return result_; }
  // The client is gone: the scheduler cancels the request and frees its pages.
  void request_cancel() { cancel_requested_.store(true); }
  bool cancel_requested() const { return cancel_requested_.load(); }

  // ---- The scheduler's side.
  void set_submitted(certkv_status status, std::string error);
  // A generated token's text (possibly none yet), and its log-probability when asked for.
  void append_text(const char* text, size_t n_bytes, const certkv_token_logprob* logprob = nullptr);
  void finish(GenerationResult result);

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool submitted_ = false;
  Submission submission_;
  std::string pending_text_;
  std::vector<certkv_token_logprob> pending_logprobs_;
  bool finished_ = false;
  GenerationResult result_;
  std::atomic<bool> cancel_requested_{false};
};

class RequestScheduler {
 public:
  // REQUIRES: engine, metrics and meter_history outlive the scheduler; no other thread uses the
  // engine. Starts the scheduler thread, which feeds meter_history after each step (before it
  // answers the requests the step finished) and metrics after it.
  RequestScheduler(certkv_engine* engine, ServerMetrics* metrics, MeterHistory* meter_history);
  // Cancels what remains and joins the thread.
  ~RequestScheduler();
  RequestScheduler(const RequestScheduler&) = delete;
  RequestScheduler& operator=(const RequestScheduler&) = delete;

  // Queues a request; the channel reports its submission, text and end.
  std::shared_ptr<RequestChannel> submit(GenerationRequest request);
  // Wakes the thread to look at cancellations.
  void notify_cancel();
  // Cancels every request, queued or running, and every one submitted later (the server stops).
  void cancel_all();

 private:
  struct Queued {
    GenerationRequest request;
    std::shared_ptr<RequestChannel> channel;
  };
  struct InFlight {
    std::shared_ptr<RequestChannel> channel;
    bool per_layer = false;
    bool logprobs = false;       // the channel gets each token's log-probability
    size_t logprobs_read = 0;    // of them
    // The last one read, held until the next token or the end: an end of generation that ends
    // the text is not sent.
    std::optional<certkv_token_logprob> held;
  };

  void loop();
  void submit_queued(std::deque<Queued> queued);
  void cancel_abandoned();
  void collect_finished();
  void fail_all(const std::string& error);
  static int on_token(void* user, int64_t request, int32_t token, const char* text, size_t n_bytes);

  certkv_engine* engine_;
  ServerMetrics* metrics_;
  MeterHistory* meter_history_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Queued> queued_;
  bool stopping_ = false;
  bool cancelling_all_ = false;
  std::map<int64_t, InFlight> in_flight_;  // scheduler thread only
  std::thread thread_;
};

}  // namespace certkv::server
