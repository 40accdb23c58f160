// One generation stream over a loaded Model: the forward pass of the Llama family on the CPU,
// reading and writing a paged KV cache.
//
// Forward pass per token (Touvron et al. 2023): x = embed(token); per layer
//   h = x + W_o attn(rope(W_q n(x)), rope(W_k n(x)), W_v n(x));  x = h + W_down(silu(W_gate n(h)) * W_up n(h))
// with n = RMSNorm; logits = W_out n(x). Qwen2 adds q/k/v biases, Qwen3 RMS-normalizes each head
// of q and k before RoPE.
// Thread safety: a Session is used by one thread at a time; it owns its thread pool and cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/sparse_decode.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/thread_pool.h"
#include "gate/telemetry.h"
#include "model/device_decode.h"
#include "model/matmul_float.h"
#include "model/model.h"

namespace certkv::model {

// The meter and the gate (DESIGN.md section 4) on the decode steps of a lossy kv_scheme: every
// step (a forward of one token) computes the meter of each (layer, query head) in the attention
// pass and records it in the session's telemetry. Prefill chunks of several tokens are not
// metered; run a text with prefill_chunk_tokens = 1 to meter every position.
struct MeterConfig {
  bool enabled = true;
  // Request-level failure budget of the Tier B certificate (dither8), split evenly over
  // layers x query heads x planned_steps: delta_loc = delta_req / (L H T). REQUIRES: in (0, 1).
  double delta_req = 1e-2;
  int64_t planned_steps = 0;  // T; 0: the session's context length
  // Coverage threshold of the telemetry and the gate's threshold: tau < 1 certifies; tau >= 1
  // ranks risk (a meter above 1 is never reported, so only raw scores could exceed it).
  // REQUIRES: tau > 0.
  double tau = 0.2;
  // Repair when the meter of a (layer, head) exceeds tau: exact blocks are paged in from the
  // backing store in decreasing order of their share of A - 1 until the meter is at most tau.
  bool gate = false;
  int64_t sample_every = 1;  // telemetry records every k-th cell
};

// Called after the attention of every metered step and layer (for audits): q: [n_heads][head_dim]
// post-RoPE queries; meters: [n_heads] as reported before any repair; n_ctx tokens attended.
struct MeterObservation {
  int layer;
  int64_t step;  // position of the query token
  const float* q;
  int64_t n_ctx;
  const attention::HeadMeter* meters;
};
using MeterObserver = std::function<void(const MeterObservation&)>;

// The sparse tier (DESIGN.md section 5): decode steps of layers >= dense_layers attend the Top-p
// selection of the key index plus the local window (attention/sparse_decode.h). The first
// prefill sets each (layer, kv_head)'s centroids (the mean of its keys and of its group's
// queries) and indexes every whole block before the window; afterwards, once whole blocks
// amounting to at least the window lie before it, they are indexed in one batch (lazy update),
// so between window_tokens and about twice that many newest tokens are attended exactly.
struct SparseConfig {
  bool enabled = false;
  double p = 0.9;           // Top-p mass, in (0, 1]
  // The Top-p set widened by this many estimator deviations per token
  // (attention::SparseDecodeOptions::deviations); finite, >= 0; 0: no widening.
  double deviations = 0;
  // REQUIRES: 0 <= window_tokens <= the context; -1: 128, or the context when it is shorter.
  int window_tokens = -1;
  int dense_layers = 2;     // REQUIRES: 0 <= dense_layers <= n_layers
  index::RotationKind rotation = index::RotationKind::kHaar;
  uint64_t seed = 0x5eed0002;  // of the rotation and of the queries' randomized rounding
};

// Sparse decode counters since the session began (or reset_sparse_stats). A cell is one
// (layer, query head, step) of a sparse layer; budget = attended / context tokens.
struct SparseStats {
  int64_t steps = 0;            // decode steps with at least one sparse layer
  int64_t cells = 0;
  double sum_budget = 0;        // over sparse cells
  int64_t attended_tokens = 0;  // over sparse cells
  int64_t widened_tokens = 0;   // of them, added by the widening (SparseConfig::deviations)
  int64_t context_tokens = 0;   // over sparse cells
  int64_t dense_cells = 0;      // cells of the dense layers (budget 1) in the same steps
  std::vector<int64_t> layer_cells;      // [n_layers]
  std::vector<double> layer_sum_budget;  // [n_layers]
  double index_build_seconds = 0;  // centroids and records, prefill and lazy updates
  int64_t index_appended_tokens = 0;  // token x (layer, kv_head) records written, / heads
};

// Called after the attention of every sparse (step, layer), for audits: per query head the
// attended indices and the estimated logits of the indexed prefix [0, n_indexed).
struct SparseObservation {
  int layer;
  int64_t step;
  const float* q;  // [n_heads][head_dim], post-RoPE
  int64_t n_ctx;
  int64_t n_indexed;
  const std::vector<std::vector<int32_t>>* attended;
  const std::vector<std::vector<float>>* estimated_logits;
};
using SparseObserver = std::function<void(const SparseObservation&)>;

struct SessionConfig {
  int64_t context_tokens = 0;  // 0: the model's context length
  int n_threads = 2;
  int block_tokens = 16;       // tokens per KV page
  int prefill_chunk_tokens = 512;  // prefill runs in chunks of this many tokens
  bool capture_queries = false;    // keep the post-RoPE queries of the last position per layer
  ActivationFormat activations = ActivationFormat::kInt8;  // arithmetic of the weight products
  cache::KvScheme kv_scheme = cache::KvScheme::kBf16;      // how the KV cache stores full blocks
  // REQUIRED for the GAAC kv_schemes (kGaac, kGaacE4M3, kGaacE5M2): the model's calibration
  // (codec::GaacCalibration::load) of the scheme's element, shared by every session of the model;
  // its shape must match the model and block_tokens.
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  // Lossy kv_schemes: dither8's outlier RoPE pairs per (layer, kv_head) and the full-precision
  // recent window (-1: the scheme's defaults, cache::KvCacheConfig).
  int outlier_pairs = -1;
  int recent_window_tokens = -1;
  // Tier A lossy kv_schemes: how K pages store the meter's witness (cache::KvCacheConfig).
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  MeterConfig meter;
  SparseConfig sparse;
  // kCuda: decode attention runs on a CUDA device over a device copy of the KV cache, encoded
  // there (model/device_decode.h); the forward pass and prefill attention stay on the host.
  // Serves the bf16, gaac and gaac-e5m2 schemes, without the meter or sparse decode.
  Device device = Device::kCpu;
};


// progress(done_tokens, total_tokens), called after each prefill chunk.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

class Session {
 public:
  // REQUIRES: model outlives the session. Throws certkv::Error for a bad configuration (a gaac
  // scheme without a calibration, or with one of another model: kInvalidArgument).
  Session(const Model& model, const SessionConfig& config);
  ~Session();

  const Model& model() const { return model_; }
  const SessionConfig& config() const { return config_; }
  int64_t context_tokens() const { return context_tokens_; }
  // Tokens already in the KV cache.
  int64_t n_past() const;

  // Appends `tokens` to the sequence. last_logits: [n_vocab] of the last token, or null;
  // all_logits: [n][n_vocab], or null.
  // Throws certkv::Error kOutOfRange (nothing appended) when n_past + n exceeds the context, and
  // kInvalidArgument for a token id outside the vocabulary.
  void prefill(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits = nullptr,
               const ProgressFn& progress = {});
  // One token. logits: [n_vocab].
  void decode(int32_t token, float* logits);
  // Drops all tokens.
  void reset();

  const cache::KvCache& kv_cache() const { return *cache_; }
  cache::SeqId sequence() const { return seq_; }
  // Post-RoPE queries of the last processed position: [n_heads][head_dim].
  // REQUIRES: config.capture_queries and at least one token processed.
  const std::vector<float>& last_queries(int layer) const;

  // Meter telemetry of every metered step since the session began (or reset_telemetry).
  const gate::Telemetry& telemetry() const { return *telemetry_; }
  void reset_telemetry();
  // Called on every metered (step, layer); empty to stop.
  void set_meter_observer(MeterObserver observer) { observer_ = std::move(observer); }
  // Whether decode steps are metered (a lossy scheme with meter.enabled).
  bool metered() const { return metered_; }
  double delta_loc() const { return delta_loc_; }

  // The sparse tier (null unless config.sparse.enabled).
  const cache::KeyIndex* key_index() const { return index_.get(); }
  const SparseStats& sparse_stats() const { return sparse_stats_; }
  void reset_sparse_stats();
  void set_sparse_observer(SparseObserver observer) { sparse_observer_ = std::move(observer); }

  // The device route (null unless config.device is kCuda).
  const DeviceDecoder* device_decoder() const { return device_.get(); }
  DeviceDecoder* device_decoder() { return device_.get(); }

 private:
  void forward_chunk(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits);
  void ensure_buffers(int64_t n);
  // Decode attention of one layer on the device route; lossy schemes record the meters the
  // device computed in the same pass (telemetry, observer).
  void decode_attention_device(int layer, const attention::AttentionShape& shape, int64_t pos0);
  void decode_attention_metered(int layer, const attention::AttentionShape& shape, int64_t pos0);
  // The gate after a metered attention (meters_ filled): repairs the blocks with the largest share
  // of A - 1 in the host cache, calls repaired(kv_head, block) for each, and attend() again, until
  // every head is predicted under tau (at most 8 rounds).
  void gate_repairs(int layer, const attention::AttentionShape& shape, int64_t pos0,
                    const std::function<void()>& attend,
                    const std::function<void(int, int64_t)>& repaired);
  bool sparse_layer(int layer) const;
  void decode_attention_sparse(int layer, const attention::AttentionShape& shape, int64_t pos0);
  // After a prefill or decode call: the first one sets the centroids and indexes every whole
  // block before the window; later ones index in batches (SparseConfig).
  void update_key_index();

  const Model& model_;
  SessionConfig config_;
  int64_t context_tokens_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<cache::KvCache> cache_;
  cache::SeqId seq_ = 0;
  int64_t buffer_tokens_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, cos_, sin_;
  std::vector<std::vector<float>> last_queries_;
  bool metered_ = false;
  double delta_loc_ = 0;
  std::unique_ptr<gate::Telemetry> telemetry_;
  MeterObserver observer_;
  std::vector<attention::HeadMeter> meters_;
  std::vector<double> contributions_;
  std::unique_ptr<cache::KeyIndex> index_;
  bool index_built_ = false;
  std::vector<double> query_sums_;  // [layer][kv_head][head_dim] until the index is built
  int64_t query_count_ = 0;
  SparseStats sparse_stats_;
  SparseObserver sparse_observer_;
  std::vector<std::vector<int32_t>> attended_;
  std::vector<std::vector<float>> estimated_logits_;
  std::unique_ptr<DeviceDecoder> device_;
};

}  // namespace certkv::model
