#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/cuda/device_layer_params.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "backend/host_forward.h"
#include "cache/cuda/device_kv_cache.h"
#include "core/cuda_status.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "gate/meter.h"
#include "gate/telemetry.h"

namespace certkv::backend {
namespace {

using attention::cuda::PageFormat;
using attention::cuda::PagedDecodeParams;
using cache::cuda::DeviceBuffer;
using cache::cuda::PinnedBuffer;

// The features this backend does not serve yet, refused by name before any memory is taken.
void refuse_unserved(const model::Model& model, const BackendConfig& config) {
  const cache::KvSchemeInfo& info = cache::kv_scheme_info(config.kv_scheme);
  if (!info.cuda_route)
    fail(StatusCode::kUnsupported,
         std::string("KV scheme ") + info.name + " is not served by the cuda backend (" +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_route; }) + " are)");
  if (config.sparse.enabled)
    fail(StatusCode::kUnsupported,
         "sparse decode is not served by the cuda backend yet (a session's one-sequence device route serves it: "
         "certkv run --device cuda --sparse)");
  if (config.meter.gate)
    fail(StatusCode::kUnsupported,
         "the gate is not served by the cuda backend yet (a session's one-sequence device route serves it: "
         "certkv run --device cuda --gate)");
  if (config.recent_window_tokens > 0 && info.lossy)
    fail(StatusCode::kUnsupported, "the cuda backend has no full-precision recent window for lossy schemes yet");
  if (config.block_tokens != 16)
    fail(StatusCode::kUnsupported, "the cuda backend pages 16 tokens per block, not " +
                                       std::to_string(config.block_tokens));
  const model::ModelConfig& c = model.config();
  if (c.head_dim != 64 && c.head_dim != 128)
    fail(StatusCode::kUnsupported, "the cuda backend serves head_dim 64 or 128, not " + std::to_string(c.head_dim));
  if (c.n_heads % c.n_kv_heads != 0 || c.n_heads / c.n_kv_heads > 8)  // the decode kernels' largest group
    fail(StatusCode::kUnsupported, "the cuda backend serves at most 8 query heads per KV head");
  if (attention::cuda::device_count() < 1)
    fail(StatusCode::kUnsupported, "the cuda backend needs a CUDA device, and none is visible to this process");
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const model::Model& model, const BackendConfig& config) : model_(model), config_(config) {
    const CheckedConfig checked = check_backend_config(model, config);
    refuse_unserved(model, config);
    context_tokens_ = checked.context_tokens;
    metered_ = checked.metered;
    delta_loc_ = checked.delta_loc;
    recent_meters_ = std::make_unique<gate::RecentStepMeters>(model.config().n_layers, model.config().n_heads,
                                                              metered_ ? config.meter.recent_steps : 0);
    format_ = attention::cuda::page_format_of(config.kv_scheme);
    pool_ = std::make_unique<ThreadPool>(config.n_threads);
    host_ = std::make_unique<HostForward>(model, *pool_, config.activations);
    const model::ModelConfig& c = model.config();
    cache::cuda::DeviceKvCacheConfig kc;
    kc.n_layers = c.n_layers;
    kc.n_kv_heads = c.n_kv_heads;
    kc.head_dim = c.head_dim;
    kc.block_tokens = config.block_tokens;
    kc.max_tokens = context_tokens_;
    kc.scheme = config.kv_scheme;
    kc.gaac_calibration = config.gaac_calibration;
    kc.rope_pairing = c.rope_layout == model::RopeLayout::kInterleaved ? codec::RopePairing::kInterleaved
                                                                      : codec::RopePairing::kHalfSplit;
    kc.outlier_pairs = config.outlier_pairs;
    kc.fixed_outlier_pairs = config.outlier_pair_table;
    kc.witness = config.witness;
    kc.sequences = 0;
    throw_if_failed(cache::cuda::DeviceKvCache::create(kc, &cache_));
    const int64_t pool_tokens = config.pool_tokens > 0 ? config.pool_tokens : context_tokens_;
    capacity_pages_ = uint64_t((pool_tokens + config.block_tokens - 1) / config.block_tokens) * pages_per_block();
  }

  const char* name() const override { return "cuda"; }
  const BackendConfig& config() const override { return config_; }
  int64_t context_tokens() const override { return context_tokens_; }

  cache::SeqId create_sequence() override {
    SequenceState st = make_state();
    throw_if_failed(cache_->create_sequence(&st.slot));
    const cache::SeqId id = next_id_++;
    states_.emplace(id, std::move(st));
    return id;
  }

  cache::SeqId fork_prefix(cache::SeqId parent, int64_t n_tokens) override {
    const SequenceState& p = state(parent);
    if (n_tokens < 0 || n_tokens > p.length || n_tokens % config_.block_tokens != 0)
      fail(StatusCode::kInvalidArgument, "a shared prefix is whole blocks of the parent (" + std::to_string(n_tokens) +
                                             " tokens of " + std::to_string(p.length) + ")");
    SequenceState st = make_state();
    throw_if_failed(cache_->fork_prefix(p.slot, n_tokens, &st.slot));
    st.length = st.reserved = n_tokens;
    const cache::SeqId id = next_id_++;
    states_.emplace(id, std::move(st));
    return id;
  }

  void free_sequence(cache::SeqId seq) override {
    const SequenceState& st = state(seq);
    const int slot = st.slot;
    states_.erase(seq);
    throw_if_failed(cache_->free_sequence(slot));
  }

  int64_t length(cache::SeqId seq) const override { return state(seq).length; }

  // The device pool swaps nothing to host memory yet: the engine preempts by recompute here.
  bool can_swap() const override { return false; }
  std::unique_ptr<SwappedSequence> swap_out(cache::SeqId) override {
    fail(StatusCode::kUnsupported, "the cuda backend does not swap to host memory yet (preemption recomputes)");
  }
  cache::SeqId swap_in(std::unique_ptr<SwappedSequence>&) override {
    fail(StatusCode::kUnsupported, "the cuda backend does not swap to host memory yet (preemption recomputes)");
  }

  bool reserve(cache::SeqId seq, int64_t n) override {
    SequenceState& st = state(seq);
    const int64_t target = st.length + n;
    if (target <= st.reserved) return true;
    const uint64_t more = uint64_t(blocks(target) - blocks(st.reserved)) * pages_per_block();
    if (pool_pages_in_use() + more > capacity_pages_) return false;
    st.reserved = target;
    return true;
  }

  // Pages on the device (a shared page once) plus the pages reserved for blocks not written yet.
  uint64_t pool_pages_in_use() const override {
    const cache::cuda::DeviceKvStats s = cache_->stats();
    uint64_t pages = uint64_t(s.raw_pages_in_use + s.slots_in_use + s.lossy_pages_in_use);
    for (const auto& [id, st] : states_) pages += uint64_t(blocks(st.reserved) - blocks(st.length)) * pages_per_block();
    return pages;
  }
  uint64_t pool_capacity_pages() const override { return capacity_pages_; }
  uint64_t pages_referenced(std::span<const cache::SeqId> seqs) const override {
    std::vector<int> slots;
    uint64_t reserved = 0;
    for (cache::SeqId seq : seqs) {
      const SequenceState& st = state(seq);
      slots.push_back(st.slot);
      reserved += uint64_t(blocks(st.reserved) - blocks(st.length)) * pages_per_block();
    }
    return cache_->pages_referenced(slots) + reserved;
  }

  void forward(std::span<const BatchItem> items) override;
  const gate::RecentStepMeters& recent_meters() const override { return *recent_meters_; }

  SequenceReport report(cache::SeqId seq) const override {
    const SequenceState& st = state(seq);
    SequenceReport r;
    r.metered = metered_;
    if (metered_) report_meter(*st.telemetry, st.layer_telemetry, r);
    return r;
  }

  std::vector<cache::ClassBytes> sequence_bytes(cache::SeqId seq) const override {
    const cache::cuda::DeviceSequenceBytes b = cache_->sequence_bytes(state(seq).slot);
    std::vector<cache::ClassBytes> out{{raw_class(), b.raw}};
    if (coded_class() != raw_class()) out.push_back({coded_class(), b.coded});
    return out;
  }

  cache::MemoryStats memory_stats() const override {
    const cache::cuda::DeviceKvStats s = cache_->stats();
    cache::MemoryStats m{};
    m.bytes_reserved_from_allocator = s.bytes_reserved;
    m.bytes_in_use = s.bytes_in_use;
    m.block_table_bytes = s.bytes_in_use - s.raw_bytes_in_use - s.coded_bytes_in_use;
    m.pages_in_use = uint64_t(s.raw_pages_in_use + s.slots_in_use + s.lossy_pages_in_use);
    m.pages_free = capacity_pages_ > m.pages_in_use ? capacity_pages_ - m.pages_in_use : 0;
    cache::StorageClassStats raw{};
    raw.storage = raw_class();
    raw.page_bytes_in_use = s.raw_bytes_in_use;
    raw.pages_in_use = uint64_t(s.raw_pages_in_use);
    raw.n_pools = 1;
    m.by_class.push_back(raw);
    if (coded_class() != raw_class()) {
      cache::StorageClassStats coded{};
      coded.storage = coded_class();
      coded.page_bytes_in_use = s.coded_bytes_in_use;
      coded.pages_in_use = uint64_t(s.slots_in_use + s.lossy_pages_in_use);
      coded.n_pools = 1;
      m.by_class.push_back(coded);
    }
    m.exact_fallback_blocks = uint64_t(s.pages_kept_exact);
    return m;
  }

 private:
  struct SequenceState {
    int slot = -1;
    int64_t length = 0;
    int64_t reserved = 0;  // tokens whose pages are promised (>= length)
    std::unique_ptr<gate::Telemetry> telemetry;
    std::vector<gate::Telemetry> layer_telemetry;  // metered: [n_layers]
  };

  // The rows of one launch: a prefill chunk's rows, or the metered decode rows (the meter runs on
  // the one-token steps only, as on the CPU; which launch a row goes to depends on its own item).
  struct RowGroup {
    bool metered = false;
    std::vector<int64_t> rows;  // step rows, in launch order
    std::vector<int32_t> seq_lens, table_rows;
    int64_t max_len = 0;
    size_t first = 0;  // the group's first row in the staging order
  };

  SequenceState make_state() const {
    SequenceState st;
    st.telemetry = std::make_unique<gate::Telemetry>(config_.meter.tau, config_.meter.sample_every);
    if (metered_)
      st.layer_telemetry.assign(size_t(model_.config().n_layers),
                                gate::Telemetry(config_.meter.tau, config_.meter.sample_every));
    return st;
  }
  SequenceState& state(cache::SeqId seq) {
    auto it = states_.find(seq);
    if (it == states_.end())
      fail(StatusCode::kNotFound, "sequence " + std::to_string(seq) + " is not live in the cuda backend");
    return it->second;
  }
  const SequenceState& state(cache::SeqId seq) const { return const_cast<CudaBackend*>(this)->state(seq); }
  int64_t blocks(int64_t tokens) const { return (tokens + config_.block_tokens - 1) / config_.block_tokens; }
  uint64_t pages_per_block() const {
    return uint64_t(model_.config().n_layers) * 2 * uint64_t(model_.config().n_kv_heads);
  }
  // The classes of the device's raw pages and of its coded full blocks, from the scheme table.
  format::StorageClass raw_class() const {
    return cache::kv_scheme_info(config_.kv_scheme).element == format::GaacElement::kBf16 ? format::StorageClass::kBf16
                                                                                         : format::StorageClass::kFp8;
  }
  format::StorageClass coded_class() const { return cache::kv_scheme_info(config_.kv_scheme).full_blocks; }
  PagedDecodeParams layer_params(int layer) const;
  void ensure_step_buffers(size_t n_rows);
  void attend_layer(int layer, const std::vector<RowGroup>& groups, const float* q_all, float* out_all,
                    const std::vector<size_t>& item_of_row, std::span<const BatchItem> items);

  const model::Model& model_;
  BackendConfig config_;
  int64_t context_tokens_ = 0;
  bool metered_ = false;
  double delta_loc_ = 0;
  std::unique_ptr<gate::RecentStepMeters> recent_meters_;
  PageFormat format_ = PageFormat::kBf16;
  uint64_t capacity_pages_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<HostForward> host_;
  std::unique_ptr<cache::cuda::DeviceKvCache> cache_;
  std::unordered_map<cache::SeqId, SequenceState> states_;
  cache::SeqId next_id_ = 1;
  // Step buffers: queries, outputs, the meters ([3][rows][n_heads]: meter, A - 1, value side),
  // per row its length and table row; their page-locked staging; the split workspace.
  size_t step_rows_ = 0;
  DeviceBuffer q_, out_, meters_, lens_, workspace_;
  PinnedBuffer staging_;
};

PagedDecodeParams CudaBackend::layer_params(int layer) const {
  const model::ModelConfig& c = model_.config();
  const cache::cuda::DeviceLayerView v = cache_->view(layer);
  PagedDecodeParams p;
  p.format = format_;
  p.n_q_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.block_tokens = config_.block_tokens;
  p.sm_scale = c.attention_scale();
  p.rope_half_split = c.rope_layout != model::RopeLayout::kInterleaved;
  p.witness = config_.witness;
  p.delta_loc = delta_loc_;
  attention::cuda::set_layer_pages(v, p);
  p.split_blocks = kSplitBlocks;
  return p;
}

void CudaBackend::ensure_step_buffers(size_t n_rows) {
  if (n_rows <= step_rows_) return;
  const model::ModelConfig& c = model_.config();
  const size_t q_bytes = sizeof(float) * n_rows * size_t(c.n_heads) * size_t(c.head_dim);
  const size_t meter_bytes = metered_ ? sizeof(float) * 3 * n_rows * size_t(c.n_heads) : 0;
  const size_t lens_bytes = sizeof(int32_t) * 2 * n_rows;
  throw_if_failed(cache::cuda::synchronize_stream(nullptr));
  throw_if_failed(DeviceBuffer::allocate(q_bytes, &q_));
  throw_if_failed(DeviceBuffer::allocate(q_bytes, &out_));
  if (meter_bytes > 0) throw_if_failed(DeviceBuffer::allocate(meter_bytes, &meters_));
  throw_if_failed(DeviceBuffer::allocate(lens_bytes, &lens_));
  // Staging: queries in, outputs and meters out, lengths and table rows in, two error words.
  throw_if_failed(PinnedBuffer::allocate(2 * q_bytes + meter_bytes + lens_bytes + 2 * sizeof(uint32_t), &staging_));
  step_rows_ = n_rows;
}

void CudaBackend::forward(std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  // Everything is checked before anything changes.
  const StepRows rows = plan_step(items, c, context_tokens_, [&](cache::SeqId seq) { return state(seq).length; });
  for (const BatchItem& it : items)
    if (!reserve(it.seq, it.n))
      fail(StatusCode::kOutOfMemory, "the KV pool cannot hold " + std::to_string(it.n) + " more tokens of sequence " +
                                         std::to_string(it.seq) + " (" + std::to_string(pool_pages_in_use()) + " of " +
                                         std::to_string(capacity_pages_) + " pages in use)");
  if (rows.n_rows == 0) return;
  recent_meters_->begin_step();

  // Row groups: the metered one-token steps in one launch, every other row in another.
  std::vector<RowGroup> groups(2);
  groups[0].metered = metered_;
  std::vector<size_t> item_of_row(size_t(rows.n_rows));
  for (size_t i = 0; i < items.size(); ++i) {
    const SequenceState& st = state(items[i].seq);
    RowGroup& g = groups[metered_ && items[i].n == 1 ? 0 : 1];
    for (int64_t t = 0; t < items[i].n; ++t) {
      const int64_t r = rows.row0[i] + t;
      item_of_row[size_t(r)] = i;
      g.rows.push_back(r);
      g.seq_lens.push_back(int32_t(rows.pos0[i] + t + 1));
      g.table_rows.push_back(int32_t(st.slot));
      g.max_len = std::max(g.max_len, rows.pos0[i] + t + 1);
    }
  }
  groups[1].first = groups[0].rows.size();
  ensure_step_buffers(size_t(rows.n_rows));
  // Lengths and table rows, the same for every layer: uploaded once per step.
  {
    int32_t* lens = reinterpret_cast<int32_t*>(staging_.data() + staging_.size() - 2 * sizeof(uint32_t) -
                                               sizeof(int32_t) * 2 * step_rows_);
    size_t at = 0;
    for (const RowGroup& g : groups) {
      std::copy(g.seq_lens.begin(), g.seq_lens.end(), lens + at);
      std::copy(g.table_rows.begin(), g.table_rows.end(), lens + step_rows_ + at);
      at += g.rows.size();
    }
    throw_if_failed(lens_.upload_async(0, lens, sizeof(int32_t) * 2 * step_rows_, nullptr));
  }

  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  host_->run(rows, [&](int layer, const float* q_all, const float* k_all, const float* v_all, float* out_all) {
    for (size_t i = 0; i < items.size(); ++i) {
      const SequenceState& st = state(items[i].seq);
      throw_if_failed(cache_->write(st.slot, layer, k_all + rows.row0[i] * kv_dim, v_all + rows.row0[i] * kv_dim,
                                    items[i].n));
    }
    attend_layer(layer, groups, q_all, out_all, item_of_row, items);
  });
  for (const BatchItem& it : items) {
    SequenceState& st = state(it.seq);
    st.length += it.n;
    st.reserved = std::max(st.reserved, st.length);
  }
}

void CudaBackend::attend_layer(int layer, const std::vector<RowGroup>& groups, const float* q_all, float* out_all,
                               const std::vector<size_t>& item_of_row, std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  const size_t q_dim = size_t(c.n_heads) * size_t(c.head_dim);
  const size_t H = size_t(c.n_heads);
  float* host_q = reinterpret_cast<float*>(staging_.data());
  float* host_out = host_q + step_rows_ * q_dim;
  float* host_meters = host_out + step_rows_ * q_dim;
  uint32_t* host_error = reinterpret_cast<uint32_t*>(staging_.data() + staging_.size() - 2 * sizeof(uint32_t));
  // The queries in launch order.
  size_t n_rows = 0;
  for (const RowGroup& g : groups)
    for (int64_t r : g.rows) std::memcpy(host_q + (n_rows++) * q_dim, q_all + size_t(r) * q_dim, sizeof(float) * q_dim);
  throw_if_failed(q_.upload_async(0, host_q, sizeof(float) * n_rows * q_dim, nullptr));
  const PagedDecodeParams base = layer_params(layer);
  const int32_t* lens = reinterpret_cast<const int32_t*>(lens_.data());
  float* meters = reinterpret_cast<float*>(meters_.data());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const RowGroup& g = groups[gi];
    host_error[gi] = 0;
    if (g.rows.empty()) continue;
    PagedDecodeParams p = base;
    p.batch = int(g.rows.size());
    p.seq_lens = lens + g.first;
    p.table_rows = lens + step_rows_ + g.first;
    p.max_seq_len = g.max_len;
    p.q = reinterpret_cast<const float*>(q_.data()) + g.first * q_dim;
    p.out = reinterpret_cast<float*>(out_.data()) + g.first * q_dim;
    if (g.metered) {
      p.meter = meters;
      p.a_minus_1 = meters + step_rows_ * H;
      p.value_rho = meters + 2 * step_rows_ * H;
    }
    const size_t need = attention::cuda::workspace_bytes(p);
    if (workspace_.size() < need) {
      throw_if_failed(cache::cuda::synchronize_stream(nullptr));  // an earlier launch may use the old one
      throw_if_failed(DeviceBuffer::allocate(need, &workspace_));
    }
    p.workspace = workspace_.data();
    p.workspace_size = workspace_.size();
    throw_if_failed(attention::cuda::reset_error_word(p));
    throw_if_failed(attention::cuda::paged_decode(p));
    throw_if_failed(attention::cuda::copy_error_word_async(p, &host_error[gi]));
  }
  throw_if_failed(out_.download_async(0, host_out, sizeof(float) * n_rows * q_dim, nullptr));
  if (metered_ && !groups[0].rows.empty())
    throw_if_failed(meters_.download_async(0, host_meters, sizeof(float) * 3 * step_rows_ * H, nullptr));
  throw_if_failed(cache::cuda::synchronize_stream(nullptr));
  if (host_error[0] != 0 || host_error[1] != 0)
    fail(StatusCode::kCorrupt, "cuda backend: the attention kernels found " +
                                   std::to_string(host_error[0] + host_error[1]) +
                                   " corrupt page entries, slots or lengths in layer " + std::to_string(layer));
  size_t at = 0;
  for (const RowGroup& g : groups)
    for (int64_t r : g.rows) std::memcpy(out_all + size_t(r) * q_dim, host_out + (at++) * q_dim, sizeof(float) * q_dim);
  if (!metered_) return;
  // The meters of the decode rows: each row is one sequence's step.
  const RowGroup& g = groups[0];
  for (size_t j = 0; j < g.rows.size(); ++j) {
    SequenceState& st = state(items[item_of_row[size_t(g.rows[j])]].seq);
    for (size_t h = 0; h < H; ++h) {
      const double a_minus_1 = double(host_meters[step_rows_ * H + j * H + h]);  // lifted on the device
      const double log_a = std::isfinite(a_minus_1) ? std::log1p(std::max(a_minus_1, 0.0)) : INFINITY;
      const double meter = gate::meter_from_log_a(log_a);
      st.telemetry->record(meter, std::isinf(log_a));
      st.layer_telemetry[size_t(layer)].record(meter, std::isinf(log_a));
      recent_meters_->record(layer, int(h), meter, std::isinf(log_a));
    }
  }
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const model::Model& model, const BackendConfig& config) {
  return std::make_unique<CudaBackend>(model, config);
}

}  // namespace certkv::backend
