#include "server_metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "request_scheduler.h"

namespace certkv::server {

namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  // The shortest decimal that reads back as v.
  char buf[64];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void header(std::string* out, const std::string& name, const char* type, const char* help) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string* out, const std::string& name, const std::string& labels, double value) {
  out->append(name);
  if (!labels.empty()) out->append("{").append(labels).append("}");
  out->append(" ").append(number(value)).append("\n");
}

void single(std::string* out, const std::string& name, const char* type, const char* help, double value) {
  header(out, name, type, help);
  sample(out, name, "", value);
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < upper_bounds_.size() && value > upper_bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::write(std::string* out, const std::string& name, const std::string& labels) const {
  const std::string prefix = labels.empty() ? "" : labels + ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    cumulative += counts_[i];
    sample(out, name + "_bucket", prefix + "le=\"" + number(upper_bounds_[i]) + "\"", double(cumulative));
  }
  sample(out, name + "_bucket", prefix + "le=\"+Inf\"", double(count_));
  sample(out, name + "_sum", labels, sum_);
  sample(out, name + "_count", labels, double(count_));
}

ServerMetrics::ServerMetrics(std::string scheme, double tau, bool sparse)
    : scheme_(std::move(scheme)),
      tau_(tau),
      sparse_(sparse),
      ttft_seconds_({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_seconds_({0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5}),
      request_meter_max_({1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 0.99, 1}),
      request_meter_p99_({1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5, 0.99, 1}),
      request_sparse_budget_({0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1}),
      request_sparse_estimated_mass_({0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1}) {}

void ServerMetrics::record_finished(const GenerationResult& r) {
  std::lock_guard lock(mutex_);
  ++finished_by_reason_[r.finish_reason];
  prompt_tokens_ += uint64_t(r.prompt_tokens);
  generation_tokens_ += uint64_t(r.generated_tokens);
  prefix_hit_tokens_ += uint64_t(r.shared_prompt_tokens);
  if (r.generated_tokens > 0) ttft_seconds_.observe(r.ttft_ms / 1000.0);
  for (double ms : r.itl_ms) itl_seconds_.observe(ms / 1000.0);
  if (r.metered && r.meter_cells > 0) {
    request_meter_max_.observe(r.meter_max);
    request_meter_p99_.observe(r.meter_p99);
    meter_cells_ += uint64_t(r.meter_cells);
    meter_cells_within_tau_ += uint64_t(std::llround(r.coverage * double(r.meter_cells)));
  }
  gate_repairs_ += uint64_t(r.gate_repairs);
  if (sparse_ && r.generated_tokens > 1) request_sparse_budget_.observe(r.sparse_budget);
  if (sparse_ && r.sparse_indexed_cells > 0) request_sparse_estimated_mass_.observe(r.sparse_estimated_mass);
}

void ServerMetrics::record_rejected() {
  std::lock_guard lock(mutex_);
  ++rejected_;
}

void ServerMetrics::set_timed_out_connections(uint64_t n) {
  std::lock_guard lock(mutex_);
  timed_out_connections_ = n;
}

void ServerMetrics::set_engine_stats(const certkv_engine_stats& stats) {
  std::lock_guard lock(mutex_);
  engine_ = stats;
}

certkv_engine_stats ServerMetrics::engine_stats() const {
  std::lock_guard lock(mutex_);
  return engine_;
}

ServerMetrics::Totals ServerMetrics::totals() const {
  std::lock_guard lock(mutex_);
  Totals t;
  for (const auto& [reason, n] : finished_by_reason_) t.finished += n;
  t.rejected = rejected_;
  t.prompt_tokens = prompt_tokens_;
  t.generation_tokens = generation_tokens_;
  return t;
}

std::string ServerMetrics::prometheus_text() const {
  std::lock_guard lock(mutex_);
  std::string out;
  const std::string scheme_label = "scheme=\"" + scheme_ + "\"";
  single(&out, "certkv:requests_running", "gauge", "Requests decoding or prefilling.", double(engine_.running));
  single(&out, "certkv:requests_waiting", "gauge", "Requests queued for a sequence slot or pages.",
         double(engine_.waiting));
  header(&out, "certkv:requests_finished_total", "counter", "Requests finished, by finish reason.");
  for (const auto& [reason, n] : finished_by_reason_)
    sample(&out, "certkv:requests_finished_total", "reason=\"" + reason + "\"", double(n));
  single(&out, "certkv:requests_rejected_total", "counter",
         "Requests the engine refused at submit (prompt too long, bad sampling).", double(rejected_));
  single(&out, "certkv:http_connections_timed_out_total", "counter",
         "Connections closed because the client sent a request's head or body slower than the "
         "request timeout.",
         double(timed_out_connections_));
  single(&out, "certkv:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
         double(prompt_tokens_));
  single(&out, "certkv:generation_tokens_total", "counter", "Tokens generated by finished requests.",
         double(generation_tokens_));
  single(&out, "certkv:engine_steps_total", "counter", "Batched forward steps the engine ran.",
         double(engine_.steps));
  single(&out, "certkv:prefill_tokens_total", "counter",
         "Prompt tokens computed, recomputations after preemption included.", double(engine_.prefill_tokens));
  header(&out, "certkv:time_to_first_token_seconds", "histogram", "Submit to first token, per request.");
  ttft_seconds_.write(&out, "certkv:time_to_first_token_seconds", "");
  header(&out, "certkv:inter_token_latency_seconds", "histogram", "Time between consecutive tokens.");
  itl_seconds_.write(&out, "certkv:inter_token_latency_seconds", "");

  single(&out, "certkv:kv_pool_pages_in_use", "gauge",
         "KV pages the running requests hold (a page they share counted once), every page class.",
         double(engine_.live_pages_in_use));
  single(&out, "certkv:kv_pool_pages_cached", "gauge",
         "KV pages only the prefix cache holds (finished requests' prompt blocks; evicted when "
         "pages are needed).",
         double(engine_.pool_pages_in_use - engine_.live_pages_in_use));
  single(&out, "certkv:kv_pool_capacity_pages", "gauge", "KV pages the pool can hold.",
         double(engine_.pool_capacity_pages));
  single(&out, "certkv:kv_usage_ratio", "gauge", "KV pages the running requests hold over the pool's capacity.",
         engine_.pool_capacity_pages > 0
             ? double(engine_.live_pages_in_use) / double(engine_.pool_capacity_pages)
             : 0.0);
  header(&out, "certkv:kv_bytes_in_use", "gauge",
         "Bytes of the KV pages allocated (running requests and prefix cache), by page class.");
  for (int32_t i = 0; i < engine_.n_classes_in_use; ++i)
    sample(&out, "certkv:kv_bytes_in_use", std::string("class=\"") + engine_.in_use[i].storage + "\"",
           double(engine_.in_use[i].page_bytes_in_use));
  header(&out, "certkv:kv_pages_in_use", "gauge",
         "KV pages allocated (running requests and prefix cache), by page class.");
  for (int32_t i = 0; i < engine_.n_classes_in_use; ++i)
    sample(&out, "certkv:kv_pages_in_use", std::string("class=\"") + engine_.in_use[i].storage + "\"",
           double(engine_.in_use[i].pages_in_use));
  uint64_t bytes_in_use = 0;
  for (int32_t i = 0; i < engine_.n_classes_in_use; ++i) bytes_in_use += engine_.in_use[i].page_bytes_in_use;
  if (bytes_in_use > 0)
    single(&out, "certkv:kv_compression_ratio_vs_bf16", "gauge",
           "The KV pages allocated as raw bf16 pages over their bytes (absent while none is).",
           double(engine_.page_bytes_as_bf16) / double(bytes_in_use));
  single(&out, "certkv:preemptions_total", "counter", "Requests preempted when the pool ran out.",
         double(engine_.preemptions));
  single(&out, "certkv:prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens of finished requests taken from the prefix cache.", double(prefix_hit_tokens_));
  single(&out, "certkv:prefix_cache_shared_blocks_total", "counter",
         "Prompt blocks taken from the prefix cache at admissions.", double(engine_.shared_blocks));
  single(&out, "certkv:prefix_cache_cached_prefixes", "gauge",
         "Finished requests' prompt blocks kept for sharing.", double(engine_.cached_prefixes));
  single(&out, "certkv:prefix_cache_evictions_total", "counter",
         "Cached prefixes evicted to free pages for running requests.", double(engine_.evicted_prefixes));

  header(&out, "certkv:request_meter_max", "histogram",
         "Per metered request, the largest meter (bound on attention total variation) over its "
         "decode cells.");
  request_meter_max_.write(&out, "certkv:request_meter_max", scheme_label);
  header(&out, "certkv:request_meter_p99", "histogram",
         "Per metered request, the 99th percentile meter over its decode cells.");
  request_meter_p99_.write(&out, "certkv:request_meter_p99", scheme_label);
  header(&out, "certkv:meter_cells_total", "counter",
         "Metered (layer, query head, step) cells of finished requests.");
  sample(&out, "certkv:meter_cells_total", scheme_label, double(meter_cells_));
  header(&out, "certkv:meter_cells_within_tau_total", "counter", "Of those, cells with meter <= tau.");
  sample(&out, "certkv:meter_cells_within_tau_total", scheme_label + ",tau=\"" + number(tau_) + "\"",
         double(meter_cells_within_tau_));
  if (meter_cells_ > 0) {
    header(&out, "certkv:meter_coverage", "gauge",
           "Fraction of metered cells with meter <= tau (absent before the first metered cell).");
    sample(&out, "certkv:meter_coverage", scheme_label + ",tau=\"" + number(tau_) + "\"",
           double(meter_cells_within_tau_) / double(meter_cells_));
  }
  single(&out, "certkv:gate_repairs_total", "counter", "KV pages the gate repaired from exact KV.",
         double(gate_repairs_));
  if (sparse_) {
    header(&out, "certkv:request_sparse_budget", "histogram",
           "Per request, the mean fraction of the context its sparse decode attended.");
    request_sparse_budget_.write(&out, "certkv:request_sparse_budget", "");
    header(&out, "certkv:request_sparse_estimated_mass", "histogram",
           "Per request, the mean over its sparse cells of the key index's estimated softmax mass of "
           "the Top-p selection within the indexed tokens (>= p by construction): a recall proxy, not "
           "the recall an audit measures.");
    request_sparse_estimated_mass_.write(&out, "certkv:request_sparse_estimated_mass", "");
  }
  return out;
}

}  // namespace certkv::server
