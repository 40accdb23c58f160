#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "attention/decode_gate.h"
#include "attention/sparse_decode.h"
#include "core/status.h"
#include "gate/meter.h"

namespace certkv::backend {

using model::ModelConfig;
using model::RopeLayout;


CpuBackend::CpuBackend(const model::Model& model, const BackendConfig& config)
    : model_(model), config_(config) {
  const ModelConfig& c = model.config();
  const CheckedConfig checked = check_backend_config(model, config);
  context_tokens_ = checked.context_tokens;
  metered_ = checked.metered;
  delta_loc_ = checked.delta_loc;
  recent_meters_ = std::make_unique<gate::RecentStepMeters>(c.n_layers, c.n_heads,
                                                            metered_ ? config.meter.recent_steps : 0);
  pool_ = std::make_unique<ThreadPool>(config.n_threads);
  host_ = std::make_unique<HostForward>(model, *pool_, config.activations);
  cache::KvCacheConfig kv;
  kv.n_layers = c.n_layers;
  kv.n_kv_heads = c.n_kv_heads;
  kv.head_dim = c.head_dim;
  kv.block_tokens = config.block_tokens;
  kv.max_tokens = config.pool_tokens > 0 ? config.pool_tokens : context_tokens_;
  kv.scheme = config.kv_scheme;
  kv.gaac_calibration = config.gaac_calibration;
  kv.rope_pairing = c.rope_layout == RopeLayout::kInterleaved ? codec::RopePairing::kInterleaved
                                                              : codec::RopePairing::kHalfSplit;
  kv.outlier_pairs = config.outlier_pairs;
  kv.fixed_outlier_pairs = config.outlier_pair_table;
  kv.recent_window_tokens = config.recent_window_tokens;
  kv.witness = config.witness;
  const SparseConfig& sparse = config.sparse;
  if (sparse.enabled) config_.sparse.window_tokens = checked.sparse_window_tokens;
  if (config.device == model::Device::kCuda) {
    // make_device_decoder refuses the schemes it does not serve (and, with sparse decode, every
    // scheme but bf16).
    if (config.recent_window_tokens > 0 && cache::kv_scheme_is_lossy(config.kv_scheme))
      fail(StatusCode::kUnsupported,
           "device cuda: a recent window of full-precision tokens is not served on the device yet");
    model::DeviceDecoderConfig dc;
    dc.n_layers = c.n_layers;
    dc.n_q_heads = c.n_heads;
    dc.n_kv_heads = c.n_kv_heads;
    dc.head_dim = c.head_dim;
    dc.block_tokens = config.block_tokens;
    dc.max_tokens = context_tokens_;
    dc.scale = c.attention_scale();
    dc.scheme = config.kv_scheme;
    dc.gaac_calibration = config.gaac_calibration;
    dc.rope_pairing = kv.rope_pairing;
    dc.outlier_pairs = config.outlier_pairs;
    dc.fixed_outlier_pairs = config.outlier_pair_table;
    dc.witness = config.witness;
    dc.delta_loc = delta_loc_;
    dc.sparse = sparse.enabled;
    dc.meter = metered_;
    device_ = model::make_device_decoder(dc);
  }
  cache_ = std::make_unique<cache::KvCache>(kv);
}

CpuBackend::~CpuBackend() = default;

CpuBackend::SequenceState CpuBackend::make_state() const {
  const ModelConfig& c = model_.config();
  SequenceState st;
  st.telemetry = gate::SequenceTelemetry(c.n_layers, config_.meter.tau, config_.meter.sample_every);
  if (config_.sparse.enabled) {
    cache::KeyIndexConfig ic;
    ic.n_layers = c.n_layers;
    ic.n_kv_heads = c.n_kv_heads;
    ic.head_dim = c.head_dim;
    ic.page_records = config_.block_tokens;
    ic.rotation = config_.sparse.rotation;
    ic.seed = config_.sparse.seed;
    st.index = std::make_unique<cache::KeyIndex>(ic);
  }
  st.sparse_stats.layer_cells.assign(size_t(c.n_layers), 0);
  st.sparse_stats.layer_sum_budget.assign(size_t(c.n_layers), 0.0);
  if (config_.capture_queries) st.last_queries.assign(size_t(c.n_layers), {});
  return st;
}

cache::SeqId CpuBackend::create_sequence() {
  if (device_ && !states_.empty())
    fail(StatusCode::kUnsupported,
         "device cuda: the device route serves one sequence at a time (free the other first)");
  const cache::SeqId seq = cache_->create_sequence();
  states_.emplace(seq, make_state());
  if (device_) device_->reset();
  return seq;
}

cache::SeqId CpuBackend::fork_prefix(cache::SeqId parent, int64_t n_tokens) {
  state(parent);
  if (device_)
    fail(StatusCode::kUnsupported, "device cuda: the device route serves one sequence at a time");
  const cache::SeqId seq = cache_->fork_prefix(parent, n_tokens);
  states_.emplace(seq, make_state());
  return seq;
}

void CpuBackend::free_sequence(cache::SeqId seq) {
  state(seq);
  cache_->free_sequence(seq);
  states_.erase(seq);
}

cache::SeqId CpuBackend::restart_sequence(cache::SeqId seq) {
  SequenceState old = std::move(state(seq));
  free_sequence(seq);
  const cache::SeqId fresh = create_sequence();
  SequenceState& st = states_.at(fresh);
  st.telemetry = std::move(old.telemetry);
  st.observer = std::move(old.observer);
  st.sparse_stats = std::move(old.sparse_stats);
  st.sparse_observer = std::move(old.sparse_observer);
  return fresh;
}

class CpuBackend::CpuSwappedSequence final : public SwappedSequence {
 public:
  CpuSwappedSequence(const CpuBackend* owner, cache::SwappedKv kv, SequenceState state)
      : owner_(owner), kv_(std::move(kv)), state_(std::move(state)) {}
  const cache::SwappedKv& kv() const override { return kv_; }
  uint64_t state_bytes() const override { return state_.index ? state_.index->bytes() : 0; }

  const CpuBackend* owner_;
  cache::SwappedKv kv_;
  SequenceState state_;
};

std::unique_ptr<SwappedSequence> CpuBackend::swap_out(cache::SeqId seq) {
  SequenceState& st = state(seq);
  if (device_)
    fail(StatusCode::kUnsupported, "device cuda: the device route does not swap sequences to host memory");
  cache::SwappedKv kv = cache_->swap_out(seq);
  auto swapped = std::make_unique<CpuSwappedSequence>(this, std::move(kv), std::move(st));
  states_.erase(seq);
  return swapped;
}

cache::SeqId CpuBackend::swap_in(std::unique_ptr<SwappedSequence>& swapped) {
  auto* mine = dynamic_cast<CpuSwappedSequence*>(swapped.get());
  if (mine == nullptr || mine->owner_ != this)
    fail(StatusCode::kInvalidArgument,
         swapped == nullptr ? "swap in of no sequence (null)"
                            : "swap in of a sequence swapped out of another backend");
  const cache::SeqId seq = cache_->swap_in(mine->kv_);
  states_.emplace(seq, std::move(mine->state_));
  swapped.reset();
  return seq;
}

int64_t CpuBackend::length(cache::SeqId seq) const { return cache_->length(seq); }

bool CpuBackend::reserve(cache::SeqId seq, int64_t n) {
  state(seq);
  try {
    cache_->reserve(seq, n);
  } catch (const Error& e) {
    if (e.code() == StatusCode::kOutOfMemory) return false;
    throw;
  }
  return true;
}

uint64_t CpuBackend::pool_pages_in_use() const { return cache_->memory_stats().pages_in_use; }

uint64_t CpuBackend::pages_referenced(std::span<const cache::SeqId> seqs) const {
  for (cache::SeqId seq : seqs) state(seq);
  return cache_->pages_referenced(seqs);
}

uint64_t CpuBackend::pool_capacity_pages() const {
  const ModelConfig& c = model_.config();
  const int64_t pool_tokens = config_.pool_tokens > 0 ? config_.pool_tokens : context_tokens_;
  const int64_t blocks = (pool_tokens + config_.block_tokens - 1) / config_.block_tokens;
  return uint64_t(blocks) * uint64_t(c.n_layers) * 2 * uint64_t(c.n_kv_heads);
}

CpuBackend::SequenceState& CpuBackend::state(cache::SeqId seq) {
  auto it = states_.find(seq);
  if (it == states_.end())
    fail(StatusCode::kNotFound, "sequence " + std::to_string(seq) + " is not live in the backend");
  return it->second;
}

const CpuBackend::SequenceState& CpuBackend::state(cache::SeqId seq) const {
  return const_cast<CpuBackend*>(this)->state(seq);
}

const std::vector<float>& CpuBackend::last_queries(cache::SeqId seq, int layer) const {
  const SequenceState& st = state(seq);
  if (!config_.capture_queries || layer < 0 || layer >= int(st.last_queries.size()) ||
      st.last_queries[size_t(layer)].empty())
    fail(StatusCode::kInvalidArgument, "queries were not captured for layer " + std::to_string(layer));
  return st.last_queries[size_t(layer)];
}

gate::Telemetry CpuBackend::telemetry(cache::SeqId seq) const { return state(seq).telemetry.all(); }

void CpuBackend::reset_telemetry(cache::SeqId seq) { state(seq).telemetry.reset(); }

void CpuBackend::record_meters(SequenceState& st, int layer) {
  for (size_t h = 0; h < meters_.size(); ++h) {
    const attention::HeadMeter& m = meters_[h];
    const bool overflow = std::isinf(m.log_a);
    st.telemetry.record(layer, m.meter, overflow);
    recent_meters_->record(layer, int(h), m.meter, overflow);
  }
}

void CpuBackend::set_meter_observer(cache::SeqId seq, MeterObserver observer) {
  state(seq).observer = std::move(observer);
}

const cache::KeyIndex* CpuBackend::key_index(cache::SeqId seq) const { return state(seq).index.get(); }

const SparseStats& CpuBackend::sparse_stats(cache::SeqId seq) const { return state(seq).sparse_stats; }

void CpuBackend::reset_sparse_stats(cache::SeqId seq) {
  SparseStats& s = state(seq).sparse_stats;
  const int n_layers = model_.config().n_layers;
  s = SparseStats{};
  s.layer_cells.assign(size_t(n_layers), 0);
  s.layer_sum_budget.assign(size_t(n_layers), 0.0);
}

void CpuBackend::set_sparse_observer(cache::SeqId seq, SparseObserver observer) {
  state(seq).sparse_observer = std::move(observer);
}

SequenceReport CpuBackend::report(cache::SeqId seq) const {
  const SequenceState& st = state(seq);
  SequenceReport r;
  r.metered = metered_;
  if (metered_) report_meter(st.telemetry, r);
  report_sparse(config_.sparse.enabled, st.sparse_stats, r);
  return r;
}

std::vector<cache::ClassBytes> CpuBackend::sequence_bytes(cache::SeqId seq) const {
  state(seq);
  return cache_->sequence_bytes(seq);
}

bool CpuBackend::sparse_layer(const SequenceState& st, int layer) const {
  return st.index_built && layer >= config_.sparse.dense_layers &&
         st.index->indexed_tokens(layer, 0) > 0;
}

void CpuBackend::update_key_index(cache::SeqId seq, SequenceState& st) {
  const ModelConfig& c = model_.config();
  const SparseConfig& sparse = config_.sparse;
  const auto start = std::chrono::steady_clock::now();
  const int64_t n = cache_->length(seq);
  const int64_t bt = config_.block_tokens;
  const int d = c.head_dim;
  const int group = c.n_heads / c.n_kv_heads;
  const int64_t target = cache::key_index_target(n, sparse.window_tokens, int(bt));
  const int64_t batch = cache::key_index_batch(sparse.window_tokens, int(bt));
  // One unit per (layer, kv_head) of the sparse layers: each touches only its own index head.
  const int64_t n_units = int64_t(c.n_layers - sparse.dense_layers) * c.n_kv_heads;
  std::vector<int64_t> appended_by_unit(size_t(std::max<int64_t>(n_units, 0)), 0);
  cache::KeyIndex& index = *st.index;
  pool_->parallel_for(n_units, 1, [&](int64_t begin, int64_t end, int) {
    std::vector<float> keys;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int layer = sparse.dense_layers + int(unit / c.n_kv_heads);
      const int h = int(unit % c.n_kv_heads);
      if (!st.index_built) {
        // Centroids: the mean of this prefill's keys, and of its group's queries.
        keys.resize(size_t(n) * size_t(d));
        cache_->read_token_range_exact(seq, layer, cache::KvTensor::kKey, h, 0, n, keys.data());
        std::vector<double> k_sum(static_cast<size_t>(d), 0.0);
        for (int64_t t = 0; t < n; ++t)
          for (int i = 0; i < d; ++i) k_sum[size_t(i)] += keys[size_t(t) * size_t(d) + size_t(i)];
        std::vector<float> c_k(static_cast<size_t>(d)), c_q(static_cast<size_t>(d));
        const double* q_sum =
            &st.query_sums[(size_t(layer) * size_t(c.n_kv_heads) + size_t(h)) * size_t(d)];
        for (int i = 0; i < d; ++i) {
          c_k[size_t(i)] = float(k_sum[size_t(i)] / double(n));
          c_q[size_t(i)] = float(q_sum[i] / double(st.query_count * group));
        }
        index.set_centroids(layer, h, std::move(c_q), std::move(c_k));
      }
      const int64_t from = index.indexed_tokens(layer, h);
      if (target - from < (st.index_built ? batch : 1)) continue;
      keys.resize(size_t(target - from) * size_t(d));
      cache_->read_token_range_exact(seq, layer, cache::KvTensor::kKey, h, from, target, keys.data());
      index.append(layer, h, keys.data(), target - from);
      appended_by_unit[size_t(unit)] = target - from;
    }
  });
  int64_t appended = 0;
  for (int64_t a : appended_by_unit) appended += a;
  if (!st.index_built) {
    st.index_built = true;
    st.query_sums.clear();
    st.query_sums.shrink_to_fit();
  }
  const int heads = (c.n_layers - sparse.dense_layers) * c.n_kv_heads;
  if (heads > 0) st.sparse_stats.index_appended_tokens += appended / heads;
  st.sparse_stats.index_build_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CpuBackend::decode_attention_sparse(cache::SeqId seq, SequenceState& st, int layer,
                                         const attention::AttentionShape& shape, int64_t pos0,
                                         const float* q, float* out) {
  const int64_t n_ctx = pos0 + 1;
  attention::SparseDecodeOptions options;
  options.p = config_.sparse.p;
  options.deviations = config_.sparse.deviations;
  options.rounding_seed = attention::sparse_step_rounding_seed(config_.sparse.seed, pos0, model_.config().n_layers, layer);
  if (metered_) {
    meters_.resize(size_t(shape.n_q_heads));
    options.meters = meters_.data();
    options.meter.delta_loc = delta_loc_;
  }
  if (st.sparse_observer) {
    options.attended = &attended_;
    options.estimated_logits = &estimated_logits_;
    options.query_norms = &query_norms_;
  }
  std::vector<attention::SparseHeadStats> stats(size_t(shape.n_q_heads));
  if (device_) {
    if (st.sparse_observer)
      fail(StatusCode::kUnsupported, "device cuda: the sparse audit reads the CPU path's selections (run it "
                                     "with --device cpu)");
    device_->attend_sparse(layer, q, out, *st.index, options.p, options.deviations,
                           options.rounding_seed, stats.data());
  } else {
    attention::sparse_decode_attention(*cache_, seq, layer, shape, q, n_ctx, *st.index, options,
                                       out, stats.data(), pool_.get());
  }
  SparseStats& ss = st.sparse_stats;
  if (layer == config_.sparse.dense_layers) {
    ss.steps += 1;
    ss.dense_cells += int64_t(config_.sparse.dense_layers) * shape.n_q_heads;
  }
  for (const attention::SparseHeadStats& s : stats) {
    const double budget = double(s.n_attended) / double(n_ctx);
    ss.cells += 1;
    ss.sum_budget += budget;
    ss.attended_tokens += s.n_attended;
    ss.widened_tokens += s.n_widened;
    ss.context_tokens += n_ctx;
    ss.layer_cells[size_t(layer)] += 1;
    ss.layer_sum_budget[size_t(layer)] += budget;
    if (s.n_indexed > 0) {
      ss.indexed_cells += 1;
      ss.sum_estimated_mass += s.estimated_mass;
    }
  }
  if (metered_) {
    record_meters(st, layer);
    if (st.observer) st.observer(MeterObservation{layer, pos0, q, n_ctx, meters_.data()});
  }
  if (st.sparse_observer)
    st.sparse_observer(SparseObservation{layer, pos0, q, n_ctx, st.index->indexed_tokens(layer, 0),
                                         &attended_, &estimated_logits_, &query_norms_});
}

void CpuBackend::decode_attention_device(cache::SeqId seq, SequenceState& st, int layer,
                                         const attention::AttentionShape& shape, int64_t pos0,
                                         const float* q, float* out) {
  if (!metered_) {
    device_->attend(layer, q, out, nullptr);
    return;
  }
  meters_.resize(size_t(shape.n_q_heads));
  const int group = shape.n_q_heads / shape.n_kv_heads;
  auto attend = [&] {
    device_->attend(layer, q, out, meters_.data());
    for (int h = 0; h < shape.n_q_heads; ++h) {
      attention::HeadMeter& m = meters_[size_t(h)];
      m.v_norm_max = cache_->value_norm_max(seq, layer, h / group);  // kept by the host cache
      m.output_bound = 2 * m.meter * m.v_norm_max + m.value_rho;
    }
  };
  attend();
  record_meters(st, layer);
  if (st.observer) st.observer(MeterObservation{layer, pos0, q, pos0 + 1, meters_.data()});
  if (!config_.meter.gate) return;
  // The host cache decides and repairs as on the CPU (its contributions: for fp8 the device's own
  // pages; for dither8 the same bounds over another dither); each block it repairs is copied,
  // exact, to the device's pages.
  gate_repairs(seq, st, layer, shape, pos0, q, attend, [&](int kv_head, int64_t b) {
    const format::PageRef kref = cache_->block_table(seq, layer, cache::KvTensor::kKey, kv_head)[b];
    const format::PageRef vref = cache_->block_table(seq, layer, cache::KvTensor::kValue, kv_head)[b];
    device_->repair_block(layer, kv_head, b, cache_->page_bf16(kref), cache_->page_bf16(vref));
  });
}

void CpuBackend::after_metered_attention(cache::SeqId seq, SequenceState& st, int layer,
                                         const attention::AttentionShape& shape, int64_t pos0,
                                         const float* q, float* out) {
  const int64_t n_ctx = pos0 + 1;
  record_meters(st, layer);
  if (st.observer) st.observer(MeterObservation{layer, pos0, q, n_ctx, meters_.data()});
  if (!config_.meter.gate) return;
  attention::DecodeOptions options;
  options.meters = meters_.data();
  options.meter.delta_loc = delta_loc_;
  auto attend = [&] {
    attention::decode_attention(*cache_, seq, layer, shape, q, n_ctx, out, pool_.get(), options);
  };
  gate_repairs(seq, st, layer, shape, pos0, q, attend, [](int, int64_t) {});
}

void CpuBackend::gate_repairs(cache::SeqId seq, SequenceState& st, int layer,
                              const attention::AttentionShape& shape, int64_t pos0, const float* q,
                              const std::function<void()>& attend,
                              const std::function<void(int, int64_t)>& repaired) {
  attention::MeterOptions meter_options;
  meter_options.delta_loc = delta_loc_;
  attention::gate_decode_step(*cache_, seq, layer, shape, q, pos0 + 1, meter_options, config_.meter.tau,
                              meters_.data(), attend, [&](int kv_head, int64_t block, uint64_t bytes) {
                                repaired(kv_head, block);
                                st.telemetry.add_repairs(layer, 2, int64_t(bytes));
                              });
}

bool CpuBackend::plain_decode(const SequenceState& st, int layer, int64_t n) const {
  return n == 1 && !device_ && !(st.index && sparse_layer(st, layer));
}

void CpuBackend::attend(cache::SeqId seq, SequenceState& st, int layer,
                        const attention::AttentionShape& shape, int64_t pos0, int64_t n,
                        const float* q, float* out) {
  if (n == 1 && st.index && sparse_layer(st, layer))
    decode_attention_sparse(seq, st, layer, shape, pos0, q, out);  // on the device too, with device_
  else if (n == 1 && device_)
    decode_attention_device(seq, st, layer, shape, pos0, q, out);
  else
    attention::prefill_attention(*cache_, seq, layer, shape, q, pos0, n, out, pool_.get());
}

void CpuBackend::forward(std::span<const BatchItem> items) {
  const ModelConfig& c = model_.config();
  // Everything is checked before anything changes.
  const StepRows rows = plan_step(items, c, context_tokens_, [&](cache::SeqId seq) {
    state(seq);
    return cache_->length(seq);
  });
  for (const BatchItem& it : items)
    if (!reserve(it.seq, it.n))
      fail(StatusCode::kOutOfMemory,
           "the KV pool cannot hold " + std::to_string(it.n) + " more tokens of sequence " +
               std::to_string(it.seq) + " (" + std::to_string(pool_pages_in_use()) + " of " +
               std::to_string(pool_capacity_pages()) + " pages in use)");
  if (rows.n_rows == 0) return;
  recent_meters_->begin_step();

  const int hd = c.head_dim;
  const int64_t q_dim = int64_t(c.n_heads) * hd;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * hd;
  attention::AttentionShape shape;
  shape.n_q_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = hd;
  shape.scale = c.attention_scale();
  const int group = c.n_heads / c.n_kv_heads;
  const std::vector<int64_t>& row0 = rows.row0;
  const std::vector<int64_t>& pos0 = rows.pos0;

  host_->run(rows, [&](int layer, const float* q_all, const float* k_all, const float* v_all, float* out_all) {
    for (size_t i = 0; i < items.size(); ++i) {
      const BatchItem& it = items[i];
      SequenceState& st = states_.at(it.seq);
      const float* q = q_all + row0[i] * q_dim;
      if (config_.capture_queries)
        st.last_queries[size_t(layer)].assign(q + (it.n - 1) * q_dim, q + it.n * q_dim);
      if (st.index && !st.index_built && layer >= config_.sparse.dense_layers) {
        // The query centroid of each (layer, kv_head): the mean over the first prefill's tokens
        // and the group's query heads.
        st.query_sums.resize(size_t(c.n_layers) * size_t(kv_dim), 0.0);
        double* sums = &st.query_sums[size_t(layer) * size_t(kv_dim)];
        for (int64_t t = 0; t < it.n; ++t)
          for (int h = 0; h < c.n_heads; ++h)
            for (int d = 0; d < hd; ++d)
              sums[size_t(h / group) * size_t(hd) + size_t(d)] += q[size_t(t * q_dim + h * hd + d)];
      }
      const float* k = k_all + row0[i] * kv_dim;
      const float* v = v_all + row0[i] * kv_dim;
      cache_->write(it.seq, layer, k, v, it.n);
      if (device_) device_->write(layer, pos0[i], k, v, it.n);
    }
    // The one-token steps of plain decode attention go to the pool together; the others (prefill
    // chunks, sparse and device steps) one by one.
    std::vector<attention::DecodeQuery> decodes;
    std::vector<size_t> decode_items;
    batch_meters_.resize(items.size() * size_t(c.n_heads));
    for (size_t i = 0; i < items.size(); ++i) {
      const BatchItem& it = items[i];
      SequenceState& st = states_.at(it.seq);
      const float* q = q_all + row0[i] * q_dim;
      float* out = out_all + row0[i] * q_dim;
      if (!plain_decode(st, layer, it.n)) {
        attend(it.seq, st, layer, shape, pos0[i], it.n, q, out);
        continue;
      }
      attention::DecodeQuery dq;
      dq.seq = it.seq;
      dq.q = q;
      dq.n_ctx = pos0[i] + 1;
      dq.out = out;
      if (metered_) {
        dq.options.meters = &batch_meters_[i * size_t(c.n_heads)];
        dq.options.meter.delta_loc = delta_loc_;
      }
      decodes.push_back(dq);
      decode_items.push_back(i);
    }
    if (!decodes.empty()) attention::decode_attention_batch(*cache_, layer, shape, decodes, pool_.get());
    if (metered_)
      for (size_t j = 0; j < decodes.size(); ++j) {
        const size_t i = decode_items[j];
        meters_.assign(decodes[j].options.meters, decodes[j].options.meters + c.n_heads);
        after_metered_attention(items[i].seq, states_.at(items[i].seq), layer, shape, pos0[i],
                                decodes[j].q, decodes[j].out);
      }
  });
  for (const BatchItem& it : items) {
    cache_->commit(it.seq, it.n);
    SequenceState& st = states_.at(it.seq);
    if (st.index && !st.index_built) st.query_count += it.n;
  }
  for (const BatchItem& it : items) {
    SequenceState& st = states_.at(it.seq);
    if (st.index && it.end_of_input) update_key_index(it.seq, st);
  }
}

}  // namespace certkv::backend
