#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/cuda/device_layer_params.h"
#include "attention/cuda/key_index_cuda.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "attention/cuda/sparse_decode_cuda.h"
#include "attention/sparse_decode.h"
#include "backend/cuda/device_forward.h"
#include "backend/cuda/forward_kernels.h"
#include "backend/host_forward.h"
#include "cache/cuda/device_kv_cache.h"
#include "cache/key_index.h"
#include "core/cuda_status.h"
#include "core/status.h"
#include "gate/meter.h"
#include "gate/telemetry.h"
#include "index/rabitq.h"
#include "index/rotation.h"
#include "index/top_p.h"

namespace certkv::backend {
namespace {

using attention::cuda::PageFormat;
using attention::cuda::PagedDecodeParams;
using cache::cuda::DeviceBuffer;
using cache::cuda::PinnedBuffer;

// The features this backend does not serve yet, refused by name before any memory is taken.
void refuse_unserved(const model::Model& model, const BackendConfig& config, int64_t checked_context) {
  const cache::KvSchemeInfo& info = cache::kv_scheme_info(config.kv_scheme);
  if (!info.cuda_route)
    fail(StatusCode::kUnsupported,
         std::string("KV scheme ") + info.name + " is not served by the cuda backend (" +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_route; }) + " are)");
  if (config.sparse.enabled && !info.cuda_sparse)
    fail(StatusCode::kUnsupported,
         std::string("sparse decode on the cuda backend reads ") +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_sparse; }) +
             " pages, not KV scheme " + info.name + " (use --kv " +
             cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_sparse; }) +
             ", or the cpu backend, which serves sparse decode over every scheme)");
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
  if (config.sparse.enabled && checked_context >= (int64_t(1) << 24))
    fail(StatusCode::kUnsupported, "sparse decode on the cuda backend serves contexts below 2^24 tokens");
  if (attention::cuda::device_count() < 1)
    fail(StatusCode::kUnsupported, "the cuda backend needs a CUDA device, and none is visible to this process");
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const model::Model& model, const BackendConfig& config) : model_(model), config_(config) {
    const CheckedConfig checked = check_backend_config(model, config);
    refuse_unserved(model, config, checked.context_tokens);
    context_tokens_ = checked.context_tokens;
    metered_ = checked.metered;
    delta_loc_ = checked.delta_loc;
    recent_meters_ = std::make_unique<gate::RecentStepMeters>(model.config().n_layers, model.config().n_heads,
                                                              metered_ ? config.meter.recent_steps : 0);
    format_ = attention::cuda::page_format_of(config.kv_scheme, config.witness);
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
    kc.hold_completed_exact = cache::kv_scheme_is_lossy(config.kv_scheme);
    kc.defer_encode_results = config.defer_encode_results;
    kc.sequences = 0;
    sparse_ = config.sparse.enabled;
    if (sparse_) {
      config_.sparse.window_tokens = checked.sparse_window_tokens;
      kc.index_record_bytes = c.head_dim == 64 ? sizeof(index::RabitqRecord<64>) : sizeof(index::RabitqRecord<128>);
    }
    throw_if_failed(cache::cuda::DeviceKvCache::create(kc, &cache_));
    forward_ = cuda::DeviceForward::create(model);
    if (sparse_) {
      // The key index's rotation P (cache::KeyIndex's: one for every head, from the sparse seed).
      const index::Rotation rotation(config.sparse.rotation, c.head_dim, config.sparse.seed);
      const std::vector<float>& params =
          rotation.kind() == index::RotationKind::kHaar ? rotation.p_transpose() : rotation.signs();
      throw_if_failed(DeviceBuffer::allocate(sizeof(float) * params.size(), &rotation_));
      throw_if_failed(rotation_.upload(0, params.data(), sizeof(float) * params.size()));
      rotation_view_.kind = rotation.kind();
      (rotation.kind() == index::RotationKind::kHaar ? rotation_view_.p_transpose : rotation_view_.signs) =
          reinterpret_cast<const float*>(rotation_.data());
      throw_if_failed(DeviceBuffer::allocate(sizeof(uint32_t), &index_error_));
    }
    // A block's pages over every (layer, K/V, kv_head) table: coded (what a whole block is stored
    // as) and raw (a partial tail block); the same for bf16 pages.
    for (int l = 0; l < c.n_layers; ++l) {
      const cache::cuda::DeviceLayerView v = cache_->view(l);
      coded_block_bytes_ += uint64_t(c.n_kv_heads) * uint64_t(v.k_page_stride + v.v_page_stride);
      raw_block_bytes_ += uint64_t(2 * c.n_kv_heads) * uint64_t(v.raw_page_stride > 0 ? v.raw_page_stride : v.k_page_stride);
    }
    if (config.pool_bytes > 0) {
      capacity_bytes_ = config.pool_bytes;
      if (charge(context_tokens_) > capacity_bytes_)
        fail(StatusCode::kInvalidArgument,
             "the KV pool of " + std::to_string(capacity_bytes_) + " bytes cannot hold one sequence of the context (" +
                 std::to_string(context_tokens_) + " tokens take " + std::to_string(charge(context_tokens_)) +
                 " bytes of " + cache::kv_scheme_name(config.kv_scheme) + " pages)");
      // Pages are bounded by the bytes: as many as the smallest page allows.
      capacity_pages_ = capacity_bytes_ / std::max<uint64_t>(1, std::min(coded_block_bytes_, raw_block_bytes_) /
                                                                      pages_per_block()) + pages_per_block();
    } else {
      const int64_t pool_tokens = config.pool_tokens > 0 ? config.pool_tokens : context_tokens_;
      capacity_pages_ = uint64_t((pool_tokens + config.block_tokens - 1) / config.block_tokens) * pages_per_block();
    }
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
    if (capacity_bytes_ > 0) {
      const uint64_t before = charge(st.reserved), after = charge(target);
      if (after > before && pool_bytes_in_use() + (after - before) > capacity_bytes_) return false;
    }
    st.reserved = target;
    return true;
  }

  // Bytes of the pages on the device (a shared page once) plus what the reserved tokens not written
  // yet will add (BackendConfig::pool_bytes).
  uint64_t pool_bytes_in_use() const {
    const cache::cuda::DeviceKvStats s = cache_->stats();
    uint64_t bytes = s.raw_bytes_in_use + s.coded_bytes_in_use;
    for (const auto& [id, st] : states_) {
      const uint64_t reserved = charge(st.reserved), written = charge(st.length);
      if (reserved > written) bytes += reserved - written;
    }
    return bytes;
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
  StepTimes step_times() const override { return step_times_; }

  SequenceReport report(cache::SeqId seq) const override {
    const_cast<CudaBackend*>(this)->record_pending_meters();  // completes deferred work: logically const
    const SequenceState& st = state(seq);
    SequenceReport r;
    r.metered = metered_;
    if (metered_) report_meter(st.telemetry, r);
    report_sparse(sparse_, st.sparse_stats, r);
    return r;
  }

  const SparseStats& sparse_stats(cache::SeqId seq) const override { return state(seq).sparse_stats; }

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
    gate::SequenceTelemetry telemetry{0, 0.0};  // make_state: one per layer
    // The sparse tier (CpuBackend's rule): the end of the first input sets the centroids and
    // indexes every whole block before the window, later inputs index in batches of the window.
    // The records and centroids live on the device beside the slot's pages
    // (DeviceLayerView::index_records); the host keeps the query sums until the centroids are set.
    bool index_built = false;
    int64_t indexed = 0;             // tokens indexed in every sparse (layer, kv head)
    std::vector<double> query_sums;  // [layer][kv_head][head_dim] until the index is built
    int64_t query_count = 0;
    SparseStats sparse_stats;
  };

  // The meters of the last metered step not yet in its sequences' telemetry (the gate off): per
  // layer, per decode row and query head, A - 1 as the device lifted it ([layer][row][head]), and
  // each row's sequence. The next step records them while its own launches run on the device;
  // report() first, if it comes before. The dashboard's per-step maxima (recent_meters_) are
  // recorded at once.
  std::vector<float> pending_a_minus_1_;
  std::vector<cache::SeqId> pending_seqs_;
  // Records the pending meters (a sequence freed since is skipped) and clears them.
  void record_pending_meters();

  // Whether a one-token step of the sequence attends sparsely in the sparse layers.
  bool sparse_row(const SequenceState& st, int64_t n) const { return n == 1 && st.index_built && st.indexed > 0; }

  // The rows of one launch (which launch a row goes to depends on its own item):
  //  - kMeteredDecode: the one-token steps of a metered scheme (the meter runs on them only, as on
  //    the CPU);
  //  - kSparseDecode: the one-token steps of sparse sequences with an index (sparse_decode in the
  //    sparse layers);
  //  - kOwnBlockExact (lossy schemes): the prompt rows whose own block their write completed;
  //    they read that block exact, as a decode step at their position reads it (the incomplete
  //    tail then), through tables of their own (own_block_tables_);
  //  - kOther: every other row.
  enum Group : size_t { kMeteredDecode = 0, kOther = 1, kSparseDecode = 2, kOwnBlockExact = 3, kGroups = 4 };
  struct RowGroup {
    bool metered = false;
    std::vector<int64_t> rows;  // step rows, in launch order
    std::vector<int32_t> seq_lens, table_rows;
    int64_t max_len = 0;
    size_t first = 0;  // the group's first row in the staging order
    int64_t max_indexed = 0, max_window = 0;  // sparse rows: the longest index and window
  };

  SequenceState make_state() const {
    SequenceState st;
    st.sparse_stats.layer_cells.assign(size_t(model_.config().n_layers), 0);
    st.sparse_stats.layer_sum_budget.assign(size_t(model_.config().n_layers), 0.0);
    st.telemetry = gate::SequenceTelemetry(model_.config().n_layers, config_.meter.tau, config_.meter.sample_every);
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
  // The page bytes a sequence's tables hold once n tokens are written: its whole blocks coded, a
  // partial tail block raw.
  uint64_t charge(int64_t n) const {
    const int64_t T = config_.block_tokens;
    return uint64_t(n / T) * coded_block_bytes_ + (n % T != 0 ? raw_block_bytes_ : 0);
  }
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
  // The fragment kernel's split counters (kDither8Fragments: the last CTA of a row group merges
  // its splits) zeroed before a launch whose workspace layout differs from the last launch's
  // (attention::cuda::reset_error_word, which also zeroes the launch's own error word, already
  // zero for the step).
  void zero_split_counters(const PagedDecodeParams& p);
  // The step's staging (page-locked). A step enqueues every layer without waiting and reads
  // what came back once, at its end, so each layer has its own part:
  //  - per step row, in launch order: its length, its table row and its row in the step;
  //  - per layer, the row groups' error words, then per layer (metered) the meters
  //    [3][rows][n_heads]: step_results_ on the device holds these two parts in the same layout,
  //    so that one copy after the last layer brings back every layer's.
  size_t layer_meter_floats(size_t n) const { return metered_ ? 3 * n * size_t(model_.config().n_heads) : 0; }
  size_t layer_meter_floats() const { return layer_meter_floats(step_rows_); }
  int32_t* staged_lens() const { return reinterpret_cast<int32_t*>(staging_.data()); }
  uint32_t* staged_errors(int layer) const {
    return reinterpret_cast<uint32_t*>(staged_lens() + 3 * step_rows_) + size_t(layer) * kGroups;
  }
  float* staged_meters(int layer) const {
    return reinterpret_cast<float*>(staged_errors(model_.config().n_layers)) + size_t(layer) * layer_meter_floats();
  }
  size_t staging_bytes(size_t n) const {
    return 3 * n * sizeof(int32_t) +
           size_t(model_.config().n_layers) * (kGroups * sizeof(uint32_t) + layer_meter_floats(n) * sizeof(float));
  }
  // The sparse staging (page-locked): per step row its indexed length (8 bytes); per layer, per
  // row and head a rounding seed, the selected and widened counts and the estimated mass of the
  // Top-p set, then a zero word and the quantizer's error word. (The Top-p bucket weights are one
  // table for every row, uploaded with the first step buffers.)
  size_t sparse_layer_bytes(size_t n) const { return 32 * n * size_t(model_.config().n_heads) + 2 * sizeof(uint32_t); }
  size_t sparse_layer_bytes() const { return sparse_layer_bytes(step_rows_); }
  size_t sparse_staging_bytes(size_t n) const {
    return n * 8 + size_t(model_.config().n_layers) * sparse_layer_bytes(n);
  }
  int32_t* staged_indexed() const { return reinterpret_cast<int32_t*>(sparse_staging_.data()); }
  uint8_t* staged_sparse_layer(int layer) const {
    return sparse_staging_.data() + step_rows_ * 8 + size_t(layer) * sparse_layer_bytes();
  }
  uint64_t* staged_seeds(int layer) const { return reinterpret_cast<uint64_t*>(staged_sparse_layer(layer)); }
  int64_t* staged_counts(int layer) const {
    return reinterpret_cast<int64_t*>(staged_seeds(layer) + step_rows_ * size_t(model_.config().n_heads));
  }
  uint32_t* staged_words(int layer) const {
    return reinterpret_cast<uint32_t*>(staged_counts(layer) + 3 * step_rows_ * size_t(model_.config().n_heads));
  }
  void ensure_step_buffers(size_t n_rows);
  // Enqueues one layer's attention for every row group: the step's queries (device, step order)
  // gathered into launch order, the launches, the outputs scattered back into out_all (device);
  // the error words, meters and sparse counts come down into the layer's staging.
  void attend_layer(int layer, const std::vector<RowGroup>& groups, const float* q_all, float* out_all);
  // After the step's work has finished: the error words of every layer checked, the meters into
  // the telemetry, the sparse selections into the sparse counters.
  void read_back_step(const std::vector<RowGroup>& groups, const std::vector<size_t>& item_of_row,
                      std::span<const BatchItem> items);
  // The tables of the kOwnBlockExact rows of a layer: per (sequence slot, block) their slot's
  // tables with the block's entries naming its held exact raw pages, in own_block_tables_. With
  // deferred encode results they are copied from the device's tables (the host's do not know this
  // step's encodes yet); else made from the host's and uploaded.
  void upload_own_block_tables(int layer, const std::vector<std::pair<int, int64_t>>& own_blocks);
  // The sparse rows' per-step data (indexed lengths, Top-p weight tables) up to the device.
  void stage_sparse_step(RowGroup& g, const std::vector<size_t>& item_of_row, std::span<const BatchItem> items);
  // Enqueues one sparse layer for the rows of g: their rounding seeds up, the queries quantized,
  // sparse_decode; the counts come down with the outputs.
  void launch_sparse_layer(int layer, const RowGroup& g);
  // The selections of the sparse rows into each sequence's sparse counters (after the sync).
  void record_sparse_layer(int layer, const RowGroup& g, const std::vector<size_t>& item_of_row,
                           std::span<const BatchItem> items);
  // After a step: the key index of every sparse sequence that ended an input, on the device.
  void update_key_indexes(std::span<const BatchItem> items);

  const model::Model& model_;
  BackendConfig config_;
  int64_t context_tokens_ = 0;
  bool metered_ = false;
  double delta_loc_ = 0;
  std::unique_ptr<gate::RecentStepMeters> recent_meters_;
  PageFormat format_ = PageFormat::kBf16;
  uint64_t capacity_pages_ = 0;
  std::unique_ptr<cuda::DeviceForward> forward_;
  StepTimes step_times_;
  // BackendConfig::pool_bytes: the capacity (0: none), and a block's page bytes over every table.
  uint64_t capacity_bytes_ = 0, coded_block_bytes_ = 0, raw_block_bytes_ = 0;
  std::unique_ptr<cache::cuda::DeviceKvCache> cache_;
  std::unordered_map<cache::SeqId, SequenceState> states_;
  cache::SeqId next_id_ = 1;
  // Step buffers: queries and outputs in launch order, the meters ([3][rows][n_heads]: meter,
  // A - 1, value side), per row its length, table row and row in the step; their page-locked
  // staging; the split workspace.
  size_t step_rows_ = 0;
  DeviceBuffer q_, out_, step_results_, lens_, workspace_, own_block_tables_;
  // The workspace layout (rows, splits) of the last fragment launch, whose split counters it left
  // zero; {} when unknown (a new workspace, a failed step).
  struct WorkspaceLayoutKey {
    int batch = 0;
    int splits = 0;
    bool operator==(const WorkspaceLayoutKey&) const = default;
  };
  WorkspaceLayoutKey workspace_layout_;
  // Whether the step's launch order is its row order (one row group, or groups in row order, no
  // sparse rows): attention then reads the forward's queries and writes its output in place.
  bool launch_in_step_order_ = false;
  std::vector<int32_t> host_own_block_tables_;
  int64_t own_block_table_rows_ = 0;  // the tables in own_block_tables_ (one per own block)
  PinnedBuffer staging_;
  // The sparse tier: the rotation's parameters, the index builder's error word; per step the
  // sparse rows' indexed lengths, Top-p weight tables, rounding seeds, quantized queries, selected
  // and widened counts ([2][rows][n_heads]) and their page-locked staging; the split workspace.
  bool sparse_ = false;
  DeviceBuffer rotation_, index_error_, index_ranges_;
  attention::cuda::DeviceRotation rotation_view_;
  DeviceBuffer sparse_indexed_, topp_weights_, seeds_, rabitq_queries_, selected_, sparse_workspace_;
  PinnedBuffer sparse_staging_;
};

void CudaBackend::upload_own_block_tables(int layer, const std::vector<std::pair<int, int64_t>>& own_blocks) {
  const int64_t H = model_.config().n_kv_heads;
  const int64_t stride = cache_->view(layer).table_stride;
  const size_t row = size_t(2 * H * stride);
  own_block_table_rows_ = int64_t(own_blocks.size());
  if (config_.defer_encode_results) {
    const size_t bytes = own_blocks.size() * row * sizeof(int32_t);
    if (own_block_tables_.size() < bytes) {
      throw_if_failed(cache::cuda::synchronize_stream(nullptr));  // an earlier launch may read the old one
      throw_if_failed(DeviceBuffer::allocate(bytes, &own_block_tables_));
    }
    // On the cache's stream (the null stream, as the attention launches): after this layer's
    // placements, after the previous layer's launches that read the buffer.
    int32_t* tables = reinterpret_cast<int32_t*>(own_block_tables_.data());
    throw_if_failed(
        cache_->copy_exact_block_tables(layer, own_blocks, tables, own_block_tables_.size() / sizeof(int32_t)));
    return;
  }
  host_own_block_tables_.resize(own_blocks.size() * row);
  for (size_t j = 0; j < own_blocks.size(); ++j) {
    const int32_t* tables = cache_->host_table_row(own_blocks[j].first, layer);
    std::copy(tables, tables + row, host_own_block_tables_.begin() + std::ptrdiff_t(j * row));
  }
  // The block's pages the encoder took (an entry it refused stays raw, exact already).
  for (const cache::cuda::CompletedExactPage& page : cache_->completed_exact(layer)) {
    for (size_t j = 0; j < own_blocks.size(); ++j) {
      if (own_blocks[j] != std::pair<int, int64_t>{page.slot, page.block}) continue;
      host_own_block_tables_[j * row + size_t((page.kv * H + page.kv_head) * stride + page.block)] = -page.raw_page - 1;
    }
  }
  const size_t bytes = host_own_block_tables_.size() * sizeof(int32_t);
  if (own_block_tables_.size() < bytes) {
    throw_if_failed(cache::cuda::synchronize_stream(nullptr));  // an earlier launch may read the old one
    throw_if_failed(DeviceBuffer::allocate(bytes, &own_block_tables_));
  }
  // Synchronous: the host vector is refilled by the next layer.
  throw_if_failed(own_block_tables_.upload(0, host_own_block_tables_.data(), bytes));
}

void CudaBackend::zero_split_counters(const PagedDecodeParams& p) {
  if (!attention::cuda::page_format_bulk_copied(p.format)) return;
  // The counters' place in the workspace follows the launch's rows and splits (the head counts
  // and head_dim are the model's): a launch leaves its own counters zero, so the next launch of
  // the same shape needs nothing, and one of another shape zeroes its own (stream-ordered after
  // the launches before it, which used that memory for partials).
  const WorkspaceLayoutKey key{p.batch, attention::cuda::planned_splits(p)};
  if (key == workspace_layout_) return;
  throw_if_failed(attention::cuda::reset_error_word(p));
  workspace_layout_ = key;
}

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
  const size_t result_bytes = size_t(c.n_layers) * (kGroups * sizeof(uint32_t) + layer_meter_floats(n_rows) * sizeof(float));
  const size_t lens_bytes = sizeof(int32_t) * 3 * n_rows;
  throw_if_failed(cache::cuda::synchronize_stream(nullptr));
  // Every buffer allocated first, then all taken at once: a failed allocation leaves the step
  // buffers as they were, step_rows_ with them.
  DeviceBuffer q, out, results, lens, indexed, weights, seeds, queries, selected;
  PinnedBuffer staging, sparse_staging;
  throw_if_failed(DeviceBuffer::allocate(q_bytes, &q));
  throw_if_failed(DeviceBuffer::allocate(q_bytes, &out));
  throw_if_failed(DeviceBuffer::allocate(result_bytes, &results));
  throw_if_failed(DeviceBuffer::allocate(lens_bytes, &lens));
  throw_if_failed(PinnedBuffer::allocate(staging_bytes(n_rows), &staging));
  if (sparse_) {
    const size_t cells = n_rows * size_t(c.n_heads);
    throw_if_failed(DeviceBuffer::allocate(sizeof(int32_t) * n_rows, &indexed));
    if (topp_weights_.size() == 0) {  // the Top-p bucket weights: one table for every row, once
      const std::vector<uint64_t>& w = index::top_p_bucket_weights();
      throw_if_failed(DeviceBuffer::allocate(sizeof(uint64_t) * w.size(), &weights));
      throw_if_failed(weights.upload(0, w.data(), sizeof(uint64_t) * w.size()));
    }
    throw_if_failed(DeviceBuffer::allocate(sizeof(uint64_t) * cells, &seeds));
    throw_if_failed(DeviceBuffer::allocate(sizeof(attention::cuda::DeviceRabitqQuery) * cells, &queries));
    throw_if_failed(DeviceBuffer::allocate(sizeof(int64_t) * 3 * cells, &selected));  // selected, widened, mass
    throw_if_failed(PinnedBuffer::allocate(sparse_staging_bytes(n_rows), &sparse_staging));
  }
  q_ = std::move(q);
  out_ = std::move(out);
  step_results_ = std::move(results);
  lens_ = std::move(lens);
  staging_ = std::move(staging);
  if (sparse_) {
    if (weights.size() > 0) topp_weights_ = std::move(weights);
    sparse_indexed_ = std::move(indexed);
    seeds_ = std::move(seeds);
    rabitq_queries_ = std::move(queries);
    selected_ = std::move(selected);
    sparse_staging_ = std::move(sparse_staging);
  }
  step_rows_ = n_rows;
}

void CudaBackend::forward(std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  using step_clock = std::chrono::steady_clock;
  const auto seconds = [](step_clock::time_point a, step_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const step_clock::time_point t_begin = step_clock::now();
  double attention_seconds = 0;
  // Everything is checked before anything changes.
  const StepRows rows = plan_step(items, c, context_tokens_, [&](cache::SeqId seq) { return state(seq).length; });
  for (const BatchItem& it : items)
    if (!reserve(it.seq, it.n))
      fail(StatusCode::kOutOfMemory, "the KV pool cannot hold " + std::to_string(it.n) + " more tokens of sequence " +
                                         std::to_string(it.seq) + " (" + std::to_string(pool_pages_in_use()) + " of " +
                                         std::to_string(capacity_pages_) + " pages in use)");
  if (rows.n_rows == 0) return;

  // Row groups (RowGroup).
  std::vector<RowGroup> groups(kGroups);
  groups[kMeteredDecode].metered = metered_;
  std::vector<size_t> item_of_row(size_t(rows.n_rows));
  std::vector<std::pair<int, int64_t>> own_blocks;  // (slot, block) of each kOwnBlockExact table
  const bool lossy = cache::kv_scheme_is_lossy(config_.kv_scheme);
  const int64_t bt = config_.block_tokens;
  for (size_t i = 0; i < items.size(); ++i) {
    const SequenceState& st = state(items[i].seq);
    const int64_t end = rows.pos0[i] + items[i].n;
    const Group item_group = metered_ && items[i].n == 1                     ? kMeteredDecode
                             : sparse_ && sparse_row(st, items[i].n) ? kSparseDecode
                                                                     : kOther;
    for (int64_t t = 0; t < items[i].n; ++t) {
      const int64_t r = rows.row0[i] + t, p = rows.pos0[i] + t;
      const int64_t block_end = (p / bt + 1) * bt;
      // A decode step at p reads its block as the incomplete tail unless p is the block's last.
      const bool own_block_exact = lossy && block_end <= end && p + 1 < block_end;
      RowGroup& g = groups[own_block_exact ? kOwnBlockExact : item_group];
      int32_t table_row = int32_t(st.slot);
      if (own_block_exact) {
        if (own_blocks.empty() || own_blocks.back() != std::pair<int, int64_t>{st.slot, p / bt})
          own_blocks.emplace_back(st.slot, p / bt);
        table_row = int32_t(own_blocks.size() - 1);
      }
      item_of_row[size_t(r)] = i;
      g.rows.push_back(r);
      g.seq_lens.push_back(int32_t(p + 1));
      g.table_rows.push_back(table_row);
      g.max_len = std::max(g.max_len, p + 1);
    }
  }
  for (size_t gi = 1; gi < kGroups; ++gi) groups[gi].first = groups[gi - 1].first + groups[gi - 1].rows.size();
  ensure_step_buffers(size_t(rows.n_rows));
  // Lengths, table rows and step rows in launch order, the same for every layer: uploaded once.
  {
    int32_t* lens = staged_lens();
    size_t at = 0;
    for (const RowGroup& g : groups) {
      std::copy(g.seq_lens.begin(), g.seq_lens.end(), lens + at);
      std::copy(g.table_rows.begin(), g.table_rows.end(), lens + step_rows_ + at);
      for (int64_t r : g.rows) lens[2 * step_rows_ + at++] = int32_t(r);
    }
    throw_if_failed(lens_.upload_async(0, lens, sizeof(int32_t) * 3 * step_rows_, nullptr));
    launch_in_step_order_ = groups[kSparseDecode].rows.empty();
    for (size_t j = 0; j < at && launch_in_step_order_; ++j) launch_in_step_order_ = lens[2 * step_rows_ + j] == int32_t(j);
  }
  // Every layer's error words zeroed at once (attend_layer brings them back after the last).
  if (cudaMemsetAsync(step_results_.data(), 0, sizeof(uint32_t) * kGroups * size_t(c.n_layers), nullptr) != cudaSuccess)
    fail(StatusCode::kInternal, "cuda backend: zeroing the step's error words failed");
  if (!groups[kSparseDecode].rows.empty()) stage_sparse_step(groups[kSparseDecode], item_of_row, items);

  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim;
  const int group = c.n_heads / c.n_kv_heads;
  std::vector<float> host_q;
  std::vector<cache::cuda::DeviceKvCache::SlotRows> writes(items.size());
  std::vector<int> slots(items.size());  // each item's slot, looked up once a step
  for (size_t i = 0; i < items.size(); ++i) slots[i] = state(items[i].seq).slot;
  const cuda::DeviceLayerAttention attend_layers = [&](int layer, float* q_all, const float* k_all, const float* v_all,
                                                       float* out_all) {
    const step_clock::time_point t_layer = step_clock::now();
    if (sparse_ && layer >= config_.sparse.dense_layers)
      for (size_t i = 0; i < items.size(); ++i) {
        SequenceState& st = state(items[i].seq);
        if (st.index_built) continue;
        // The query centroid of each (layer, kv_head): the mean over the first input's tokens and
        // the group's query heads (CpuBackend's sums, in its order), from the queries brought
        // down for it.
        st.query_sums.resize(size_t(c.n_layers) * size_t(kv_dim), 0.0);
        double* sums = &st.query_sums[size_t(layer) * size_t(kv_dim)];
        host_q.resize(size_t(items[i].n * q_dim));
        throw_if_failed(cache::cuda::copy_to_host(q_all + rows.row0[i] * q_dim, host_q.data(),
                                                  sizeof(float) * host_q.size()));
        const float* q = host_q.data();
        for (int64_t t = 0; t < items[i].n; ++t)
          for (int h = 0; h < c.n_heads; ++h)
            for (int d = 0; d < c.head_dim; ++d)
              sums[size_t(h / group) * size_t(c.head_dim) + size_t(d)] += q[size_t(t * q_dim + h * c.head_dim + d)];
      }
    for (size_t i = 0; i < items.size(); ++i)
      writes[i] = {slots[i], k_all + rows.row0[i] * kv_dim, v_all + rows.row0[i] * kv_dim, items[i].n,
                   cache::cuda::DeviceKvCache::RowsMemory::kDevice};  // the forward's K and V
    throw_if_failed(cache_->write_rows(layer, writes.data(), writes.size()));
    if (!own_blocks.empty()) upload_own_block_tables(layer, own_blocks);
    attend_layer(layer, groups, q_all, out_all);
    // The held pages go back to the free lists; the launches that read them run first (one
    // stream), and a later write reuses them only after.
    cache_->release_completed_exact(layer);
    // Deferred encode results: every layer's come back in one copy after the last layer, which
    // the step's wait at the end of DeviceForward::run covers.
    if (layer + 1 == c.n_layers) throw_if_failed(cache_->download_encode_results());
    attention_seconds += seconds(t_layer, step_clock::now());
  };
  const step_clock::time_point t_run = step_clock::now();
  try {
    forward_->run(rows, attend_layers, [this] { record_pending_meters(); });
  } catch (...) {
    // The step failed halfway: its launches drain (errors ignored: the step's error is the one
    // to report) before the staging is reused, and no held exact page outlives it.
    cudaDeviceSynchronize();
    cudaGetLastError();
    workspace_layout_ = {};  // a launch may not have run: its counters are zeroed again
    for (int layer = 0; layer < c.n_layers; ++layer) cache_->release_completed_exact(layer);
    // The encodes enqueued before the failure are placed on the host too (a failure here leaves
    // the cache refusing until reset, and the step's error is the one to report).
    (void)cache_->reconcile_encodes();
    throw;
  }
  // The step's wait is behind us: the host's tables, free lists and counters catch up with this
  // step's encodes (DeviceForward::run's wait covered the results' copy, since its last segment
  // runs after the null stream's work; the event wait in reconcile_encodes only confirms it),
  // before anything reads the host tables (the key indexes, the engine's free_sequence and
  // fork_prefix, the next step's reserve and own-block tables).
  const step_clock::time_point t_ran = step_clock::now();
  throw_if_failed(cache_->reconcile_encodes());
  recent_meters_->begin_step();
  read_back_step(groups, item_of_row, items);
  for (const BatchItem& it : items) {
    SequenceState& st = state(it.seq);
    st.length += it.n;
    st.reserved = std::max(st.reserved, st.length);
    if (sparse_ && !st.index_built) st.query_count += it.n;
  }
  if (sparse_) update_key_indexes(items);
  const double run_seconds = seconds(t_run, t_ran), wait_seconds = forward_->last_wait_seconds();
  step_times_.steps += 1;
  step_times_.plan_seconds += seconds(t_begin, t_run);
  step_times_.attention_seconds += attention_seconds;
  step_times_.wait_seconds += wait_seconds;
  step_times_.enqueue_seconds += std::max(0.0, run_seconds - attention_seconds - wait_seconds);
  step_times_.read_back_seconds += seconds(t_ran, step_clock::now());
}

void CudaBackend::attend_layer(int layer, const std::vector<RowGroup>& groups, const float* q_all, float* out_all) {
  const model::ModelConfig& c = model_.config();
  const size_t q_dim = size_t(c.n_heads) * size_t(c.head_dim);
  const size_t H = size_t(c.n_heads);
  const size_t L = size_t(c.n_layers);
  size_t n_rows = 0;
  for (const RowGroup& g : groups) n_rows += g.rows.size();
  const int32_t* lens = reinterpret_cast<const int32_t*>(lens_.data());
  const int32_t* launch_rows = lens + 2 * step_rows_;
  // The queries in launch order (where that is not the step's own).
  const float* q_launch = q_all;
  float* out_launch = out_all;
  if (!launch_in_step_order_) {
    throw_if_failed(cuda::gather_rows(q_all, launch_rows, int64_t(n_rows), int(q_dim), reinterpret_cast<float*>(q_.data()),
                                      nullptr));
    q_launch = reinterpret_cast<const float*>(q_.data());
    out_launch = reinterpret_cast<float*>(out_.data());
  }
  const PagedDecodeParams base = layer_params(layer);
  // This layer's error words and meters in step_results_ (staged_errors / staged_meters' layout).
  uint32_t* words = reinterpret_cast<uint32_t*>(step_results_.data()) + size_t(layer) * kGroups;
  float* meters = reinterpret_cast<float*>(step_results_.data() + L * kGroups * sizeof(uint32_t)) +
                  size_t(layer) * layer_meter_floats();
  // The sparse rows attend sparsely from the first sparse layer on, densely before it.
  const bool sparse_layer = sparse_ && layer >= config_.sparse.dense_layers && !groups[kSparseDecode].rows.empty();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const RowGroup& g = groups[gi];
    if (g.rows.empty() || (gi == kSparseDecode && sparse_layer)) continue;
    PagedDecodeParams p = base;
    p.batch = int(g.rows.size());
    p.seq_lens = lens + g.first;
    p.table_rows = lens + step_rows_ + g.first;
    p.max_seq_len = g.max_len;
    if (gi == kOwnBlockExact) {
      const int64_t row_stride = 2 * int64_t(c.n_kv_heads) * p.table_stride;
      p.k_table = reinterpret_cast<const int32_t*>(own_block_tables_.data());
      p.v_table = p.k_table + int64_t(c.n_kv_heads) * p.table_stride;
      p.table_row_stride = row_stride;
      p.n_table_rows = own_block_table_rows_;
    }
    p.q = q_launch + g.first * q_dim;
    p.out = out_launch + g.first * q_dim;
    p.error_word = words + gi;
    if (g.metered) {
      p.meter = meters;
      p.a_minus_1 = meters + step_rows_ * H;
      p.value_rho = meters + 2 * step_rows_ * H;
    }
    const size_t need = attention::cuda::workspace_bytes(p);
    if (workspace_.size() < need) {
      throw_if_failed(cache::cuda::synchronize_stream(nullptr));  // an earlier launch may use the old one
      workspace_layout_ = {};
      throw_if_failed(DeviceBuffer::allocate(need, &workspace_));
    }
    p.workspace = workspace_.data();
    p.workspace_size = workspace_.size();
    zero_split_counters(p);
    throw_if_failed(attention::cuda::paged_decode(p));
  }
  if (sparse_layer) launch_sparse_layer(layer, groups[kSparseDecode]);
  if (!launch_in_step_order_)
    throw_if_failed(cuda::scatter_rows(out_launch, launch_rows, int64_t(n_rows), int(q_dim), out_all, nullptr));
  // After the last layer, every layer's error words (and meters) come back in one copy.
  if (layer + 1 == c.n_layers) {
    const bool meters_back = metered_ && !groups[kMeteredDecode].rows.empty();
    const size_t bytes = L * (kGroups * sizeof(uint32_t) + (meters_back ? layer_meter_floats() * sizeof(float) : 0));
    throw_if_failed(step_results_.download_async(0, staged_errors(0), bytes, nullptr));
  }
}

void CudaBackend::read_back_step(const std::vector<RowGroup>& groups, const std::vector<size_t>& item_of_row,
                                 std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  const size_t H = size_t(c.n_heads);
  // DeviceForward::run has waited for the step's work.
  for (int layer = 0; layer < c.n_layers; ++layer) {
    uint64_t errors = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) errors += staged_errors(layer)[gi];
    if (errors != 0)
      fail(StatusCode::kCorrupt, "cuda backend: the attention kernels found " + std::to_string(errors) +
                                     " corrupt page entries, slots or lengths in layer " + std::to_string(layer));
  }
  const bool any_sparse = sparse_ && !groups[kSparseDecode].rows.empty();
  if (any_sparse)
    for (int layer = config_.sparse.dense_layers; layer < c.n_layers; ++layer) {
      if (staged_words(layer)[1] != 0)
        fail(StatusCode::kInvalidArgument, "cuda backend: " + std::to_string(staged_words(layer)[1]) +
                                               " sparse queries of layer " + std::to_string(layer) +
                                               " are not finite or widen past the float range (sparse deviations " +
                                               std::to_string(config_.sparse.deviations) + ")");
      record_sparse_layer(layer, groups[kSparseDecode], item_of_row, items);
    }
  if (!metered_) return;
  // The meters of the decode rows: each row is one sequence's step.
  const RowGroup& g = groups[kMeteredDecode];
  if (g.rows.empty()) return;
  record_pending_meters();  // a step that ran no launch (an empty forward) left them
  const size_t rows_h = g.rows.size() * H;
  pending_a_minus_1_.resize(size_t(c.n_layers) * rows_h);
  pending_seqs_.resize(g.rows.size());
  for (size_t j = 0; j < g.rows.size(); ++j) pending_seqs_[j] = items[item_of_row[size_t(g.rows[j])]].seq;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    // A - 1 as the device lifted it: [rows][heads] after the meters' first part.
    const float* a_minus_1 = staged_meters(layer) + step_rows_ * H;
    std::copy(a_minus_1, a_minus_1 + rows_h, pending_a_minus_1_.begin() + ptrdiff_t(size_t(layer) * rows_h));
    // The dashboard's cell of (layer, head): the largest meter over the rows, from the largest
    // A - 1 (the meter is nondecreasing in it); a NaN or +inf one makes it overflow.
    for (size_t h = 0; h < H; ++h) {
      float largest = 0;
      bool overflow = false;
      for (size_t j = 0; j < g.rows.size(); ++j) {
        const float a = a_minus_1[j * H + h];
        overflow |= !std::isfinite(a);
        largest = std::max(largest, a);
      }
      recent_meters_->record(layer, int(h), gate::meter_from_a_minus_1(largest), overflow, int64_t(g.rows.size()));
    }
  }
}

void CudaBackend::record_pending_meters() {
  if (pending_seqs_.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  // Taken off the list first: a record that throws (an allocation) never records a row twice.
  std::vector<cache::SeqId> seqs;
  seqs.swap(pending_seqs_);
  const int L = model_.config().n_layers;
  const size_t H = size_t(model_.config().n_heads), rows_h = seqs.size() * H;
  for (size_t j = 0; j < seqs.size(); ++j) {
    const auto it = states_.find(seqs[j]);
    if (it == states_.end()) continue;  // freed since its step
    gate::SequenceTelemetry& telemetry = it->second.telemetry;
    for (int layer = 0; layer < L; ++layer) {
      const float* a_minus_1 = pending_a_minus_1_.data() + size_t(layer) * rows_h + j * H;
      for (size_t h = 0; h < H; ++h)
        // (A^2 - 1) / 2 from A - 1 as the CPU backend computes it, with no logarithm or
        // exponential; a NaN or +inf A - 1 gives meter 1 and counts as overflow.
        telemetry.record(layer, gate::meter_from_a_minus_1(double(a_minus_1[h])), !std::isfinite(a_minus_1[h]));
    }
  }
  seqs.clear();
  pending_seqs_.swap(seqs);  // its capacity back for the next step's rows
  step_times_.meter_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void CudaBackend::stage_sparse_step(RowGroup& g, const std::vector<size_t>& item_of_row,
                                    std::span<const BatchItem> items) {
  int32_t* indexed = staged_indexed();
  g.max_indexed = g.max_window = 0;
  for (size_t j = 0; j < g.rows.size(); ++j) {
    const SequenceState& st = state(items[item_of_row[size_t(g.rows[j])]].seq);
    indexed[j] = int32_t(st.indexed);
    g.max_indexed = std::max(g.max_indexed, st.indexed);
    g.max_window = std::max<int64_t>(g.max_window, g.seq_lens[j] - st.indexed);
  }
  throw_if_failed(sparse_indexed_.upload_async(0, indexed, sizeof(int32_t) * g.rows.size(), nullptr));
}

void CudaBackend::launch_sparse_layer(int layer, const RowGroup& g) {
  const model::ModelConfig& c = model_.config();
  const size_t Hq = size_t(c.n_heads), q_dim = Hq * size_t(c.head_dim), n = g.rows.size();
  const cache::cuda::DeviceLayerView v = cache_->view(layer);
  const int32_t* lens = reinterpret_cast<const int32_t*>(lens_.data());
  // Each head's rounding seed, as the CPU backend draws it (the step's seed of the row's position
  // and layer, then the head's).
  uint64_t* seeds = staged_seeds(layer);
  for (size_t j = 0; j < n; ++j) {
    const uint64_t step = attention::sparse_step_rounding_seed(config_.sparse.seed, g.seq_lens[j] - 1, c.n_layers, layer);
    for (size_t h = 0; h < Hq; ++h) seeds[j * Hq + h] = attention::sparse_head_rounding_seed(step, int(h));
  }
  throw_if_failed(seeds_.upload_async(0, seeds, sizeof(uint64_t) * n * Hq, nullptr));
  uint32_t* words = staged_words(layer);
  words[0] = 0;
  throw_if_failed(index_error_.upload_async(0, &words[0], sizeof(uint32_t), nullptr));

  attention::cuda::QueryQuantizeParams qp;
  qp.batch = int(n);
  qp.n_q_heads = c.n_heads;
  qp.n_kv_heads = c.n_kv_heads;
  qp.head_dim = c.head_dim;
  qp.q = reinterpret_cast<const float*>(q_.data()) + g.first * q_dim;
  qp.table_rows = lens + step_rows_ + g.first;
  qp.n_table_rows = v.n_table_rows;
  qp.centroids = v.index_centroids;
  qp.rotation = rotation_view_;
  qp.rounding_seeds = reinterpret_cast<const uint64_t*>(seeds_.data());
  qp.deviations = config_.sparse.deviations;
  qp.sm_scale = c.attention_scale();
  qp.queries = reinterpret_cast<attention::cuda::DeviceRabitqQuery*>(rabitq_queries_.data());
  qp.error_word = reinterpret_cast<uint32_t*>(index_error_.data());
  throw_if_failed(attention::cuda::quantize_queries(qp));
  throw_if_failed(index_error_.download_async(0, &words[1], sizeof(uint32_t), nullptr));

  attention::cuda::SparseDecodeParams sp;
  attention::cuda::describe_pages(layer_params(layer), &sp);  // bf16 pages (the table's cuda_sparse)
  sp.batch = int(n);
  sp.n_q_heads = c.n_heads;
  sp.sm_scale = c.attention_scale();
  sp.p = config_.sparse.p;
  sp.seq_lens = lens + g.first;
  sp.max_seq_len = g.max_len;
  sp.table_rows = lens + step_rows_ + g.first;
  sp.n_table_rows = v.n_table_rows;
  sp.table_row_stride = v.table_row_stride;
  sp.records = v.index_records;
  sp.record_stride = v.index_record_stride;
  sp.n_indexed = reinterpret_cast<const int32_t*>(sparse_indexed_.data());
  sp.max_indexed = g.max_indexed;
  sp.max_window = g.max_window;
  sp.queries = qp.queries;
  sp.topp_weights = reinterpret_cast<const uint64_t*>(topp_weights_.data());
  sp.q = qp.q;
  sp.out = reinterpret_cast<float*>(out_.data()) + g.first * q_dim;
  sp.n_selected = reinterpret_cast<int64_t*>(selected_.data());
  sp.n_widened = sp.n_selected + n * Hq;
  sp.mass = reinterpret_cast<double*>(sp.n_widened + n * Hq);
  sp.split_chunks = kSplitChunks;
  const size_t need = attention::cuda::workspace_bytes(sp);
  if (sparse_workspace_.size() < need) {
    throw_if_failed(cache::cuda::synchronize_stream(nullptr));  // an earlier layer may use the old one
    throw_if_failed(DeviceBuffer::allocate(need, &sparse_workspace_));
  }
  sp.workspace = sparse_workspace_.data();
  sp.workspace_size = sparse_workspace_.size();
  throw_if_failed(attention::cuda::sparse_decode(sp));
  throw_if_failed(selected_.download_async(0, staged_counts(layer), sizeof(int64_t) * 3 * n * Hq, nullptr));
}

void CudaBackend::record_sparse_layer(int layer, const RowGroup& g, const std::vector<size_t>& item_of_row,
                                      std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  const size_t Hq = size_t(c.n_heads), n = g.rows.size();
  const int64_t* selected = staged_counts(layer);
  const int64_t* widened = selected + n * Hq;
  const double* mass = reinterpret_cast<const double*>(widened + n * Hq);
  for (size_t j = 0; j < n; ++j) {
    SequenceState& st = state(items[item_of_row[size_t(g.rows[j])]].seq);
    const int64_t n_ctx = g.seq_lens[j];
    SparseStats& ss = st.sparse_stats;
    if (layer == config_.sparse.dense_layers) {
      ss.steps += 1;
      ss.dense_cells += int64_t(config_.sparse.dense_layers) * c.n_heads;
    }
    for (size_t h = 0; h < Hq; ++h) {
      const int64_t attended = selected[j * Hq + h] + (n_ctx - st.indexed);  // the Top-p set and the window
      const double budget = double(attended) / double(n_ctx);
      ss.cells += 1;
      ss.sum_budget += budget;
      ss.attended_tokens += attended;
      ss.widened_tokens += widened[j * Hq + h];
      ss.context_tokens += n_ctx;
      ss.layer_cells[size_t(layer)] += 1;
      ss.layer_sum_budget[size_t(layer)] += budget;
      ss.indexed_cells += 1;  // a sparse row has an index (sparse_row)
      ss.sum_estimated_mass += mass[j * Hq + h];
    }
  }
}

void CudaBackend::update_key_indexes(std::span<const BatchItem> items) {
  const model::ModelConfig& c = model_.config();
  const SparseConfig& sparse = config_.sparse;
  const auto start = std::chrono::steady_clock::now();
  const int64_t bt = config_.block_tokens;
  const int H = c.n_kv_heads, D = c.head_dim, group = c.n_heads / c.n_kv_heads;
  // cache::key_index_target's rule: the first input indexes every whole block before the window,
  // later ones in batches of at least key_index_batch.
  const int64_t batch = cache::key_index_batch(sparse.window_tokens, int(bt));
  struct Update {
    SequenceState* st;
    int64_t from, target;
  };
  std::vector<Update> updates;
  std::vector<attention::cuda::KeyIndexRange> ranges;  // the centroid ranges, then the record ranges
  std::vector<SequenceState*> first_builds;
  for (const BatchItem& it : items) {
    if (!it.end_of_input) continue;
    SequenceState& st = state(it.seq);
    const int64_t target = cache::key_index_target(st.length, sparse.window_tokens, int(bt));
    if (!st.index_built) {
      first_builds.push_back(&st);
      ranges.push_back({int32_t(st.slot), 0, int32_t(st.length)});
      if (target >= 1) updates.push_back({&st, 0, target});
    } else if (target - st.indexed >= batch) {
      updates.push_back({&st, st.indexed, target});
    }
  }
  const size_t n_centroids = ranges.size();
  int64_t max_tokens = 0;
  for (const SequenceState* st : first_builds) max_tokens = std::max(max_tokens, st->length);
  for (const Update& u : updates) {
    ranges.push_back({int32_t(u.st->slot), int32_t(u.from), int32_t(u.target)});
    max_tokens = std::max(max_tokens, u.target - u.from);
  }
  if (!ranges.empty()) {
    // The query centroids of the first builds, [sparse layer][build][kv head][head_dim].
    const int sparse_layers = c.n_layers - sparse.dense_layers;
    std::vector<float> c_q(size_t(std::max(sparse_layers, 0)) * first_builds.size() * size_t(H) * size_t(D));
    for (int l = 0; l < sparse_layers; ++l)
      for (size_t b = 0; b < first_builds.size(); ++b) {
        const SequenceState& st = *first_builds[b];
        const double* sums = &st.query_sums[size_t(sparse.dense_layers + l) * size_t(H) * size_t(D)];
        float* out = &c_q[((size_t(l) * first_builds.size() + b) * size_t(H)) * size_t(D)];
        for (size_t i = 0; i < size_t(H) * size_t(D); ++i) out[i] = float(sums[i] / double(st.query_count * group));
      }
    DeviceBuffer c_q_d;
    if (!c_q.empty()) {
      throw_if_failed(DeviceBuffer::allocate(sizeof(float) * c_q.size(), &c_q_d));
      throw_if_failed(c_q_d.upload(0, c_q.data(), sizeof(float) * c_q.size()));
    }
    if (index_ranges_.size() < sizeof(attention::cuda::KeyIndexRange) * ranges.size())
      throw_if_failed(DeviceBuffer::allocate(sizeof(attention::cuda::KeyIndexRange) * ranges.size(), &index_ranges_));
    throw_if_failed(index_ranges_.upload(0, ranges.data(), sizeof(attention::cuda::KeyIndexRange) * ranges.size()));
    const uint32_t zero = 0;
    throw_if_failed(index_error_.upload(0, &zero, sizeof(zero)));
    const auto* device_ranges = reinterpret_cast<const attention::cuda::KeyIndexRange*>(index_ranges_.data());
    for (int layer = sparse.dense_layers; layer < c.n_layers; ++layer) {
      const cache::cuda::DeviceLayerView v = cache_->view(layer);
      attention::cuda::KeyIndexBuildParams p;
      p.n_kv_heads = H;
      p.head_dim = D;
      p.block_tokens = config_.block_tokens;
      attention::cuda::set_layer_index(v, p);  // bf16: the raw pool
      p.max_range_tokens = max_tokens;
      p.rotation = rotation_view_;
      p.error_word = reinterpret_cast<uint32_t*>(index_error_.data());
      if (n_centroids > 0) {
        p.ranges = device_ranges;
        p.n_ranges = int(n_centroids);
        p.query_centroids =
            reinterpret_cast<const float*>(c_q_d.data()) + size_t(layer - sparse.dense_layers) * n_centroids * H * D;
        throw_if_failed(attention::cuda::set_key_centroids(p));
      }
      if (ranges.size() > n_centroids) {
        p.ranges = device_ranges + n_centroids;
        p.n_ranges = int(ranges.size() - n_centroids);
        throw_if_failed(attention::cuda::build_key_records(p));
      }
    }
    uint32_t errors = 0;
    throw_if_failed(index_error_.download(0, &errors, sizeof(errors)));  // waits for the builds
    if (errors != 0)
      fail(StatusCode::kInvalidArgument, "cuda backend: the key index builder found " + std::to_string(errors) +
                                             " keys that are not finite, or ranges or pages outside the pools");
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (SequenceState* st : first_builds) {
    st->index_built = true;
    st->query_sums.clear();
    st->query_sums.shrink_to_fit();
  }
  for (const Update& u : updates) {
    u.st->indexed = u.target;
    u.st->sparse_stats.index_appended_tokens += u.target - u.from;
  }
  for (const BatchItem& it : items)
    if (it.end_of_input) state(it.seq).sparse_stats.index_build_seconds += seconds;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const model::Model& model, const BackendConfig& config) {
  return std::make_unique<CudaBackend>(model, config);
}

}  // namespace certkv::backend
