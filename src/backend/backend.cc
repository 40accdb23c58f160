#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cache/key_index.h"
#include "core/status.h"
#include "gate/meter.h"

namespace certkv::backend {

void report_sparse(bool enabled, const SparseStats& s, SequenceReport& r) {
  r.sparse = enabled;
  if (s.cells > 0) r.sparse_budget = s.sum_budget / double(s.cells);
  r.sparse_indexed_cells = s.indexed_cells;
  if (s.indexed_cells > 0) r.sparse_estimated_mass = s.sum_estimated_mass / double(s.indexed_cells);
}

void report_meter(const gate::SequenceTelemetry& telemetry, SequenceReport& r) {
  const gate::Telemetry all = telemetry.all();
  const std::vector<gate::Telemetry>& layers = telemetry.layers();
  r.metered = true;
  r.meter_cells = all.cells();
  r.meter_max = all.overflow() > 0 ? 1.0 : all.max();
  r.meter_p99 = all.quantile(0.99);
  r.coverage = all.cells() > 0 ? all.coverage() : 1.0;
  r.gate_repairs = all.repairs();
  r.layers.clear();
  for (const gate::Telemetry& l : layers)
    r.layers.push_back({l.overflow() > 0 ? 1.0 : l.max(), l.quantile(0.99), l.cells() > 0 ? l.coverage() : 1.0,
                        l.cells(), l.repairs()});
}

CheckedConfig check_backend_config(const model::Model& model, const BackendConfig& config) {
  const model::ModelConfig& c = model.config();
  CheckedConfig out;
  if (config.context_tokens < 0) fail(StatusCode::kInvalidArgument, "context size must be positive");
  out.context_tokens = config.context_tokens > 0 ? config.context_tokens : c.context_length;
  if (config.pool_tokens < 0 || (config.pool_tokens > 0 && config.pool_tokens < out.context_tokens))
    fail(StatusCode::kInvalidArgument,
         "the KV pool (" + std::to_string(config.pool_tokens) + " tokens) cannot hold one sequence of the context (" +
             std::to_string(out.context_tokens) + " tokens): enlarge the pool or shorten the context");
  if (config.pool_bytes > 0 && config.pool_tokens > 0)
    fail(StatusCode::kInvalidArgument, "the KV pool is bounded by pool_tokens or by pool_bytes, not both");
  if (config.pool_bytes > 0 && config.device != model::Device::kCuda)
    fail(StatusCode::kUnsupported,
         "pool_bytes (a pool in bytes of each class's pages) is served by the cuda backend; the cpu backend's pool "
         "is counted in tokens (pool_tokens)");
  if (config.n_threads < 1 || config.n_threads > 256)
    fail(StatusCode::kInvalidArgument, "thread count must be in [1, 256]");
  if (config.block_tokens < 1 || config.block_tokens > 4096)
    fail(StatusCode::kInvalidArgument, "block_tokens must be in [1, 4096]");
  if (config.prefill_chunk_tokens < 1) fail(StatusCode::kInvalidArgument, "prefill chunk must be positive");
  if (cache::kv_scheme_is_gaac(config.kv_scheme) && !config.gaac_calibration)
    fail(StatusCode::kInvalidArgument, std::string("KV scheme ") + cache::kv_scheme_name(config.kv_scheme) +
                                           " needs a GAAC calibration of this model (BackendConfig.gaac_calibration)");
  if (config.outlier_pairs > c.head_dim / 2)
    fail(StatusCode::kInvalidArgument, "outlier pairs " + std::to_string(config.outlier_pairs) +
                                           " exceed head_dim / 2 = " + std::to_string(c.head_dim / 2));
  const MeterConfig& meter = config.meter;
  if (!(meter.tau > 0))
    fail(StatusCode::kInvalidArgument, "meter tau must be positive, got " + std::to_string(meter.tau));
  if (!(meter.delta_req > 0 && meter.delta_req < 1))
    fail(StatusCode::kInvalidArgument, "meter delta must be in (0, 1), got " + std::to_string(meter.delta_req));
  if (meter.planned_steps < 0 || meter.sample_every < 1)
    fail(StatusCode::kInvalidArgument, "meter planned_steps must be >= 0 and sample_every >= 1");
  if (meter.recent_steps < 0 || meter.recent_steps > kMaxRecentMeterSteps)
    fail(StatusCode::kInvalidArgument, "meter recent_steps must be in [0, " + std::to_string(kMaxRecentMeterSteps) +
                                           "], got " + std::to_string(meter.recent_steps));
  const bool lossy = cache::kv_scheme_is_lossy(config.kv_scheme);
  if (meter.gate && !lossy)
    fail(StatusCode::kInvalidArgument, std::string("the gate needs a lossy KV scheme (this one is ") +
                                           cache::kv_scheme_name(config.kv_scheme) + ")");
  if (meter.gate && !meter.enabled) fail(StatusCode::kInvalidArgument, "the gate needs the meter (meter.enabled)");
  out.metered = meter.enabled && lossy;
  const SparseConfig& sparse = config.sparse;
  if (!sparse.enabled && sparse.deviations != 0)
    fail(StatusCode::kInvalidArgument, "sparse deviations widen sparse decode's selection: enable sparse decode");
  if (sparse.enabled) {
    if (!(sparse.p > 0 && sparse.p <= 1))
      fail(StatusCode::kInvalidArgument, "sparse p must be in (0, 1], got " + std::to_string(sparse.p));
    if (!(sparse.deviations >= 0) || !std::isfinite(sparse.deviations))
      fail(StatusCode::kInvalidArgument,
           "sparse deviations must be finite and >= 0, got " + std::to_string(sparse.deviations));
    if (sparse.window_tokens == -1)
      out.sparse_window_tokens = int(std::min<int64_t>(128, out.context_tokens));
    else if (sparse.window_tokens < 0 || sparse.window_tokens > out.context_tokens)
      fail(StatusCode::kInvalidArgument, "sparse window " + std::to_string(sparse.window_tokens) +
                                             " tokens must be in [0, the context = " +
                                             std::to_string(out.context_tokens) + "]");
    else
      out.sparse_window_tokens = sparse.window_tokens;
    if (sparse.dense_layers < 0 || sparse.dense_layers > c.n_layers)
      fail(StatusCode::kInvalidArgument, "sparse dense layers " + std::to_string(sparse.dense_layers) +
                                             " must be in [0, " + std::to_string(c.n_layers) + "]");
    if (!c.rope_declared)
      fail(StatusCode::kUnsupported,
           "sparse decode needs the model's RoPE metadata (GGUF <arch>.rope.freq_base or "
           "config.json rope_theta): the key index scores post-RoPE keys, and this model file "
           "does not state its position encoding");
    if (!cache::key_index_supports_head_dim(c.head_dim))
      fail(StatusCode::kUnsupported, "sparse decode: head_dim " + std::to_string(c.head_dim) +
                                         " is not supported by the key index (32, 64, 96, 128, 256)");
    if (meter.gate && out.metered)
      fail(StatusCode::kUnsupported, "the gate and sparse decode do not combine yet (the meter does: drop --gate)");
  }
  out.delta_loc = gate::local_delta(meter.delta_req, c.n_layers, c.n_heads,
                                    meter.planned_steps > 0 ? meter.planned_steps : out.context_tokens);
  return out;
}

std::unique_ptr<Backend> make_backend(const model::Model& model, const BackendConfig& config) {
  if (config.device == model::Device::kCuda) return make_cuda_backend(model, config);
  return std::make_unique<CpuBackend>(model, config);
}

}  // namespace certkv::backend
