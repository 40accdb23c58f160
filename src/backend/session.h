// One generation stream over a loaded Model: a thin one-sequence wrapper over the CPU backend
// (backend/cpu/cpu_backend.h), which runs the forward pass and owns the paged KV cache.
// Thread safety: a Session is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"

namespace certkv::backend {

// progress(done_tokens, total_tokens), called after each prefill chunk.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

class Session {
 public:
  // REQUIRES: model outlives the session. Throws certkv::Error for a bad configuration (a gaac
  // scheme without a calibration, or with one of another model: kInvalidArgument).
  Session(const model::Model& model, const BackendConfig& config);
  ~Session();

  const model::Model& model() const { return backend_.model(); }
  const BackendConfig& config() const { return backend_.config(); }
  int64_t context_tokens() const { return backend_.context_tokens(); }
  // Tokens already in the KV cache.
  int64_t n_past() const { return backend_.length(seq_); }

  // Appends `tokens` to the sequence in chunks of config.prefill_chunk_tokens. last_logits:
  // [n_vocab] of the last token, or null; all_logits: [n][n_vocab], or null.
  // Throws certkv::Error kOutOfRange (nothing appended) when n_past + n exceeds the context, and
  // kInvalidArgument for a token id outside the vocabulary.
  void prefill(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits = nullptr,
               const ProgressFn& progress = {});
  // One token. logits: [n_vocab].
  void decode(int32_t token, float* logits);
  // Drops all tokens.
  void reset();

  const cache::KvCache& kv_cache() const { return backend_.kv_cache(); }
  cache::SeqId sequence() const { return seq_; }
  // Post-RoPE queries of the last processed position: [n_heads][head_dim].
  // REQUIRES: config.capture_queries and at least one token processed.
  const std::vector<float>& last_queries(int layer) const { return backend_.last_queries(seq_, layer); }

  // Meter telemetry of every metered step since the session began (or reset_telemetry).
  gate::Telemetry telemetry() const { return backend_.telemetry(seq_); }
  void reset_telemetry() { backend_.reset_telemetry(seq_); }
  // Called on every metered (step, layer); empty to stop.
  void set_meter_observer(MeterObserver observer) { backend_.set_meter_observer(seq_, std::move(observer)); }
  // Whether decode steps are metered (a lossy scheme with meter.enabled).
  bool metered() const { return backend_.metered(); }
  double delta_loc() const { return backend_.delta_loc(); }

  // The sparse tier (null unless config.sparse.enabled).
  const cache::KeyIndex* key_index() const { return backend_.key_index(seq_); }
  const SparseStats& sparse_stats() const { return backend_.sparse_stats(seq_); }
  void reset_sparse_stats() { backend_.reset_sparse_stats(seq_); }
  void set_sparse_observer(SparseObserver observer) { backend_.set_sparse_observer(seq_, std::move(observer)); }

  // The device route (null unless config.device is kCuda).
  const model::DeviceDecoder* device_decoder() const { return backend_.device_decoder(); }
  model::DeviceDecoder* device_decoder() { return backend_.device_decoder(); }

 private:
  CpuBackend backend_;
  cache::SeqId seq_ = 0;
};

}  // namespace certkv::backend
