#include "request_scheduler.h"

#include <cstdio>

namespace certkv::server {

// ---- RequestChannel -----------------------------------------------------------------------------

RequestChannel::Submission RequestChannel::wait_submitted() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return submitted_; });
  return submission_;
}

bool RequestChannel::wait_for_text(std::string* text, std::chrono::milliseconds timeout,
                                   std::vector<certkv_token_logprob>* logprobs) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] {
    return finished_ || !pending_text_.empty() || (logprobs && !pending_logprobs_.empty());
  });
  text->append(pending_text_);
  pending_text_.clear();
  if (logprobs) {
    logprobs->insert(logprobs->end(), pending_logprobs_.begin(), pending_logprobs_.end());
    pending_logprobs_.clear();
  }
  return finished_;
}

void RequestChannel::set_submitted(certkv_status status, std::string error) {
  {
    std::lock_guard lock(mutex_);
    submitted_ = true;
    submission_ = Submission{status, std::move(error)};
  }
  changed_.notify_all();
}

void RequestChannel::append_text(const char* text, size_t n_bytes, const certkv_token_logprob* logprob) {
  if (n_bytes == 0 && !logprob) return;
  {
    std::lock_guard lock(mutex_);
    pending_text_.append(text, n_bytes);
    if (logprob) pending_logprobs_.push_back(*logprob);
  }
  changed_.notify_all();
}

void RequestChannel::finish(GenerationResult result) {
  {
    std::lock_guard lock(mutex_);
    result_ = std::move(result);
    finished_ = true;
  }
  changed_.notify_all();
}

// ---- RequestScheduler ---------------------------------------------------------------------------

RequestScheduler::RequestScheduler(certkv_engine* engine, ServerMetrics* metrics, MeterHistory* meter_history)
    : engine_(engine), metrics_(metrics), meter_history_(meter_history), thread_([this] { loop(); }) {}

RequestScheduler::~RequestScheduler() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::shared_ptr<RequestChannel> RequestScheduler::submit(GenerationRequest request) {
  auto channel = std::make_shared<RequestChannel>();
  {
    std::lock_guard lock(mutex_);
    queued_.push_back(Queued{std::move(request), channel});
  }
  wake_.notify_all();
  return channel;
}

void RequestScheduler::notify_cancel() { wake_.notify_all(); }

void RequestScheduler::cancel_all() {
  {
    std::lock_guard lock(mutex_);
    cancelling_all_ = true;
  }
  wake_.notify_all();
}

int RequestScheduler::on_token(void* user, int64_t request, int32_t token, const char* text,
                               size_t n_bytes) {
  auto* self = static_cast<RequestScheduler*>(user);
  const auto it = self->in_flight_.find(request);
  if (it == self->in_flight_.end()) return 0;
  InFlight& f = it->second;
  certkv_token_logprob logprob{};
  size_t n = 0;
  // The token's entry is recorded before its callback (token -1: held-back text, no token); the
  // channel gets the one before it.
  std::optional<certkv_token_logprob> previous;
  if (f.logprobs && token >= 0 &&
      certkv_engine_logprobs(self->engine_, request, 0, f.logprobs_read, &logprob, 1, &n) == CERTKV_OK &&
      n > f.logprobs_read) {
    ++f.logprobs_read;
    previous = f.held;
    f.held = logprob;
  }
  f.channel->append_text(text, n_bytes, previous ? &*previous : nullptr);
  return it->second.channel->cancel_requested() ? 1 : 0;
}

void RequestScheduler::submit_queued(std::deque<Queued> queued) {
  for (Queued& q : queued) {
    std::vector<const char*> stop;
    for (const std::string& s : q.request.stop) stop.push_back(s.c_str());
    certkv_request_params p = certkv_request_default_params();
    p.prompt = q.request.prompt.data();
    p.n_prompt = int32_t(q.request.prompt.size());
    p.max_tokens = q.request.max_tokens;
    p.sampler = q.request.sampler;
    p.stop = stop.data();
    p.n_stop = int32_t(stop.size());
    p.ignore_end = q.request.ignore_end ? 1 : 0;
    p.logprobs = q.request.logprobs;
    p.prompt_logprobs = q.request.prompt_logprobs ? 1 : 0;
    int64_t id = -1;
    const certkv_status st = certkv_engine_submit(engine_, &p, &id);
    if (st != CERTKV_OK) {
      metrics_->record_rejected();
      q.channel->set_submitted(st, certkv_last_error());
      continue;
    }
    in_flight_[id] = InFlight{q.channel, q.request.per_layer, q.request.logprobs >= 0 && q.request.stream, 0, std::nullopt};
    q.channel->set_submitted(CERTKV_OK, "");
  }
}

void RequestScheduler::cancel_abandoned() {
  for (auto& [id, f] : in_flight_) {
    if (!f.channel->cancel_requested()) continue;
    certkv_request_result r;
    if (certkv_engine_result(engine_, id, &r) == CERTKV_OK && !r.finished) certkv_engine_cancel(engine_, id);
  }
}

void RequestScheduler::collect_finished() {
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    certkv_request_result r;
    if (certkv_engine_result(engine_, it->first, &r) != CERTKV_OK || !r.finished) {
      ++it;
      continue;
    }
    GenerationResult g;
    g.finish_reason = r.finish_reason;
    g.error = r.error ? r.error : "";
    g.text.assign(r.text, r.text_bytes);
    g.prompt_tokens = r.prompt_tokens;
    g.generated_tokens = r.generated_tokens;
    g.shared_prompt_tokens = r.shared_prompt_tokens;
    g.preemptions = r.preemptions;
    g.ttft_ms = r.ttft_ms;
    size_t n_itl = 0;
    certkv_engine_itl(engine_, it->first, nullptr, 0, &n_itl);
    g.itl_ms.resize(n_itl);
    if (certkv_engine_itl(engine_, it->first, g.itl_ms.data(), g.itl_ms.size(), &n_itl) != CERTKV_OK)
      g.itl_ms.clear();
    g.metered = r.metered != 0;
    g.meter_max = r.meter_max;
    g.meter_p99 = r.meter_p99;
    g.coverage = r.coverage;
    g.meter_cells = r.meter_cells;
    g.gate_repairs = r.gate_repairs;
    g.sparse_budget = r.sparse_budget;
    g.sparse_estimated_mass = r.sparse_estimated_mass;
    g.sparse_indexed_cells = r.sparse_indexed_cells;
    for (int32_t i = 0; i < r.n_classes; ++i) g.kv_bytes.emplace_back(r.kv_bytes[i].storage, r.kv_bytes[i].bytes);
    for (const int prompt : {0, 1}) {
      std::vector<certkv_token_logprob>& out = prompt ? g.prompt_logprobs : g.logprobs;
      size_t n = 0;
      if (certkv_engine_logprobs(engine_, it->first, prompt, 0, nullptr, 0, &n) != CERTKV_OK || n == 0) continue;
      out.resize(n);
      if (certkv_engine_logprobs(engine_, it->first, prompt, 0, out.data(), out.size(), &n) != CERTKV_OK) out.clear();
    }
    // An end of generation that ended the text is not part of the answer (OpenAI leaves it out).
    const bool ended = g.finish_reason == "end";
    if (ended && !g.logprobs.empty()) g.logprobs.pop_back();
    if (it->second.held && !ended) it->second.channel->append_text("", 0, &*it->second.held);
    if (it->second.per_layer && g.metered) {
      size_t n_layers = 0;
      certkv_engine_result_layers(engine_, it->first, nullptr, 0, &n_layers);
      g.layers.resize(n_layers);
      if (certkv_engine_result_layers(engine_, it->first, g.layers.data(), g.layers.size(), &n_layers) != CERTKV_OK)
        g.layers.clear();
    }
    certkv_engine_release(engine_, it->first);
    metrics_->record_finished(g);
    it->second.channel->finish(std::move(g));
    it = in_flight_.erase(it);
  }
}

void RequestScheduler::fail_all(const std::string& error) {
  for (auto& [id, f] : in_flight_) {
    certkv_engine_cancel(engine_, id);
    certkv_engine_release(engine_, id);
    GenerationResult g;
    g.finish_reason = "error";
    g.error = error;
    f.channel->finish(std::move(g));
  }
  in_flight_.clear();
}

void RequestScheduler::loop() {
  certkv_engine_stats stats;
  // The pool's capacity is known before the first request.
  if (certkv_engine_get_stats(engine_, &stats) == CERTKV_OK) metrics_->set_engine_stats(stats);
  for (;;) {
    std::deque<Queued> queued;
    bool cancelling_all = false;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queued_.empty() || !in_flight_.empty(); });
      if (stopping_) break;
      queued.swap(queued_);
      cancelling_all = cancelling_all_;
    }
    submit_queued(std::move(queued));
    if (cancelling_all)
      for (auto& [id, f] : in_flight_) f.channel->request_cancel();
    cancel_abandoned();
    if (!in_flight_.empty()) {
      int active = 0;
      if (certkv_engine_step(engine_, &RequestScheduler::on_token, this, &active) != CERTKV_OK) {
        const std::string error = certkv_last_error();
        std::fprintf(stderr, "certkv serve: engine step failed: %s\n", error.c_str());
        fail_all(error);
      }
      // Before any request of the step is answered, so that a client sees its steps.
      if (const std::string error = meter_history_->update(engine_); !error.empty())
        std::fprintf(stderr, "certkv serve: the dashboard's meter history: %s\n", error.c_str());
    }
    // The gauges first: a client answered below finds its request gone from them.
    if (certkv_engine_get_stats(engine_, &stats) == CERTKV_OK) metrics_->set_engine_stats(stats);
    collect_finished();
  }
  // Shutting down: every request left ends as cancelled, its handler answered.
  std::deque<Queued> queued;
  {
    std::lock_guard lock(mutex_);
    queued.swap(queued_);
  }
  for (Queued& q : queued) q.channel->set_submitted(CERTKV_ERR_INTERNAL, "the server is shutting down");
  fail_all("the server is shutting down");
}

}  // namespace certkv::server
