// The CPU backend: the forward pass on the host (backend/host_forward.h), batched over any set
// of sequences that share one paged KV cache (cache/kv_cache.h); attention runs on the host over
// each sequence's pages, the one-token steps of a layer together.
//
// With config.device kCuda decode attention runs on a CUDA device over a device copy of the one
// live sequence's KV cache (model/device_decode.h).
// Thread safety: used by one thread at a time; it owns its thread pool and cache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/host_forward.h"
#include "cache/key_index.h"
#include "core/thread_pool.h"
#include "gate/telemetry.h"
#include "model/model.h"

namespace certkv::backend {

class CpuBackend final : public Backend {
 public:
  // REQUIRES: model outlives the backend. Throws certkv::Error for a bad configuration (a gaac
  // scheme without a calibration, or with one of another model: kInvalidArgument; a pool that
  // cannot hold one sequence of the context: kInvalidArgument).
  CpuBackend(const model::Model& model, const BackendConfig& config);
  ~CpuBackend() override;

  const char* name() const override { return "cpu"; }
  const BackendConfig& config() const override { return config_; }
  int64_t context_tokens() const override { return context_tokens_; }
  const model::Model& model() const { return model_; }

  cache::SeqId create_sequence() override;
  cache::SeqId fork_prefix(cache::SeqId parent, int64_t n_tokens) override;
  void free_sequence(cache::SeqId seq) override;
  int64_t length(cache::SeqId seq) const override;
  bool reserve(cache::SeqId seq, int64_t n) override;
  std::unique_ptr<SwappedSequence> swap_out(cache::SeqId seq) override;
  cache::SeqId swap_in(std::unique_ptr<SwappedSequence>& swapped) override;
  bool can_swap() const override { return device_ == nullptr; }
  uint64_t pool_pages_in_use() const override;
  uint64_t pool_capacity_pages() const override;
  uint64_t pages_referenced(std::span<const cache::SeqId> seqs) const override;
  void forward(std::span<const BatchItem> items) override;
  SequenceReport report(cache::SeqId seq) const override;
  std::vector<cache::ClassBytes> sequence_bytes(cache::SeqId seq) const override;
  cache::MemoryStats memory_stats() const override { return cache_->memory_stats(); }
  const gate::RecentStepMeters& recent_meters() const override { return *recent_meters_; }

  // Drops every token of the sequence and returns the sequence that replaces it, which keeps its
  // telemetry, sparse counters and observers (the key index starts over).
  cache::SeqId restart_sequence(cache::SeqId seq);

  const cache::KvCache& kv_cache() const { return *cache_; }
  // Whether decode steps are metered (a lossy scheme with meter.enabled).
  bool metered() const { return metered_; }
  double delta_loc() const { return delta_loc_; }

  // Per sequence (certkv::Error kNotFound for one not live).
  // Post-RoPE queries of the last processed position: [n_heads][head_dim].
  // REQUIRES: config.capture_queries and at least one token processed (kInvalidArgument).
  const std::vector<float>& last_queries(cache::SeqId seq, int layer) const;
  // Meter telemetry of every metered step of the sequence (or since reset_telemetry).
  gate::Telemetry telemetry(cache::SeqId seq) const;
  void reset_telemetry(cache::SeqId seq);
  // Called on every metered (step, layer) of the sequence; empty to stop.
  void set_meter_observer(cache::SeqId seq, MeterObserver observer);
  // The sparse tier (null unless config.sparse.enabled).
  const cache::KeyIndex* key_index(cache::SeqId seq) const;
  const SparseStats& sparse_stats(cache::SeqId seq) const override;
  void reset_sparse_stats(cache::SeqId seq);
  void set_sparse_observer(cache::SeqId seq, SparseObserver observer);

  // The device route (null unless config.device is kCuda).
  const model::DeviceDecoder* device_decoder() const { return device_.get(); }
  model::DeviceDecoder* device_decoder() { return device_.get(); }

 private:
  struct SequenceState {
    gate::SequenceTelemetry telemetry{0, 0.0};  // make_state: one per layer
    MeterObserver observer;
    std::unique_ptr<cache::KeyIndex> index;
    bool index_built = false;
    std::vector<double> query_sums;  // [layer][kv_head][head_dim] until the index is built
    int64_t query_count = 0;
    SparseStats sparse_stats;
    SparseObserver sparse_observer;
    std::vector<std::vector<float>> last_queries;
  };

  class CpuSwappedSequence;

  SequenceState& state(cache::SeqId seq);
  const SequenceState& state(cache::SeqId seq) const;
  SequenceState make_state() const;
  // The meters of one metered attention (meters_) into the sequence's telemetry and the recent
  // step meters.
  void record_meters(SequenceState& st, int layer);
  // Whether a one-token step of the sequence goes through decode_attention (batched with the
  // step's other such sequences): not sparse, not on the device.
  bool plain_decode(const SequenceState& st, int layer, int64_t n) const;
  // The attention of one sequence's rows of a layer: q [n][n_heads][head_dim] -> out.
  void attend(cache::SeqId seq, SequenceState& st, int layer, const attention::AttentionShape& shape,
              int64_t pos0, int64_t n, const float* q, float* out);
  // Decode attention of one layer on the device route; lossy schemes record the meters the
  // device computed in the same pass (telemetry, observer).
  void decode_attention_device(cache::SeqId seq, SequenceState& st, int layer,
                               const attention::AttentionShape& shape, int64_t pos0,
                               const float* q, float* out);
  // After a metered decode attention whose meters are in meters_: the telemetry, the observer
  // and the gate (which may attend again).
  void after_metered_attention(cache::SeqId seq, SequenceState& st, int layer,
                               const attention::AttentionShape& shape, int64_t pos0,
                               const float* q, float* out);
  // The gate after a metered attention (meters_ filled): attention::gate_decode_step over the
  // host cache, each repair counted in the sequence's telemetry and passed to repaired(kv_head,
  // block).
  void gate_repairs(cache::SeqId seq, SequenceState& st, int layer,
                    const attention::AttentionShape& shape, int64_t pos0, const float* q,
                    const std::function<void()>& attend,
                    const std::function<void(int, int64_t)>& repaired);
  bool sparse_layer(const SequenceState& st, int layer) const;
  void decode_attention_sparse(cache::SeqId seq, SequenceState& st, int layer,
                               const attention::AttentionShape& shape, int64_t pos0,
                               const float* q, float* out);
  // After the last chunk of an input: the first one sets the centroids and indexes every whole
  // block before the window; later ones index in batches (SparseConfig).
  void update_key_index(cache::SeqId seq, SequenceState& st);

  const model::Model& model_;
  BackendConfig config_;
  int64_t context_tokens_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<HostForward> host_;
  std::unique_ptr<cache::KvCache> cache_;
  std::unordered_map<cache::SeqId, SequenceState> states_;
  bool metered_ = false;
  double delta_loc_ = 0;
  std::unique_ptr<gate::RecentStepMeters> recent_meters_;
  std::vector<attention::HeadMeter> meters_;
  std::vector<attention::HeadMeter> batch_meters_;  // [items][n_heads]: a batched decode's
  std::vector<std::vector<int32_t>> attended_;
  std::vector<std::vector<float>> estimated_logits_;
  std::vector<float> query_norms_;
  std::unique_ptr<model::DeviceDecoder> device_;
};

}  // namespace certkv::backend
