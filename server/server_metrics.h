// The server's metrics in the Prometheus text format (GET /metrics), names prefixed "certkv:".
// Counters and histograms are fed from each finished request's report; gauges from the engine's
// stats after each step. Thread safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "certkv/certkv.h"

namespace certkv::server {

struct GenerationResult;

// A Prometheus histogram: cumulative counts at upper bounds, plus +Inf, sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // Appends the _bucket, _sum and _count lines; labels: "" or `scheme="x"` (no braces).
  void write(std::string* out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> upper_bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; last: above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  // scheme: the KV scheme; tau: the coverage threshold; sparse: sparse decode is on.
  ServerMetrics(std::string scheme, double tau, bool sparse);

  void record_finished(const GenerationResult& result);
  void record_rejected();  // refused by the engine at submit (too long, bad sampling)
  void set_engine_stats(const certkv_engine_stats& stats);
  // Connections closed because their client missed the request timeout (connection.h).
  void set_timed_out_connections(uint64_t n);

  std::string prometheus_text() const;

  // For the dashboard: the engine's stats of the last step, and totals over finished requests.
  struct Totals {
    uint64_t finished = 0;  // every finish reason
    uint64_t rejected = 0;
    uint64_t prompt_tokens = 0, generation_tokens = 0;
  };
  certkv_engine_stats engine_stats() const;
  Totals totals() const;

 private:
  const std::string scheme_;
  const double tau_;
  const bool sparse_;
  mutable std::mutex mutex_;
  certkv_engine_stats engine_{};
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0, prefix_hit_tokens_ = 0;
  uint64_t rejected_ = 0;
  uint64_t timed_out_connections_ = 0;
  std::map<std::string, uint64_t> finished_by_reason_;
  Histogram ttft_seconds_, itl_seconds_;
  Histogram request_meter_max_, request_meter_p99_, request_sparse_budget_, request_sparse_estimated_mass_;
  uint64_t meter_cells_ = 0, meter_cells_within_tau_ = 0, gate_repairs_ = 0;
};

}  // namespace certkv::server
