// The device KV store (backend/cuda/device_kv_store.h).
#include "backend/cuda/device_kv_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <string>
#include <utility>

#include "attention/cuda/device_layer_params.h"
#include "attention/cuda/key_index_cuda.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "attention/cuda/sparse_decode_cuda.h"
#include "attention/sparse_decode.h"
#include "backend/cuda/cuda_backend.h"
#include "cache/cuda/device_kv_cache.h"
#include "cache/cuda/device_pool.h"
#include "core/cuda_status.h"
#include "core/status.h"
#include "gate/meter.h"
#include "index/rabitq.h"
#include "index/top_p.h"

namespace certkv::backend::cuda {
namespace {

using attention::cuda::PagedDecodeParams;
using attention::cuda::PageFormat;
using cache::cuda::DeviceBuffer;
using cache::cuda::DeviceKvCache;
using cache::cuda::PinnedBuffer;

// Decode steps per staging ring: the ring waits for the stream once per this many steps.
constexpr int64_t kRingSteps = 512;
// Rows of one sequence that one round of an append stores (DeviceKvStore::append).
constexpr int64_t kAppendRoundTokens = 2048;
// Rows of a GAAC layer's first append its calibration reads, at most.
constexpr int64_t kCalibrationRows = 8192;
// Key index records reserved per (sequence, KV head) of a sparse layer at first; they grow by
// doubling (DeviceKvCache::reserve_index_records) to the layer's longest indexed prefix, so a
// store sized for many sequences' tokens does not reserve its whole capacity in every sequence.
constexpr int64_t kIndexRecordTokens = 512;
// The store's error words: corrupt page entries met by decode attention; a scratch word;
// bad keys met by the key index builder (zeroed before each update); queries the sparse steps
// could not quantize.
enum ErrorWord : size_t { kCorruptWord = 0, kScratchWord = 1, kIndexBuildWord = 2, kQueryWord = 3, kErrorWords = 4 };

// The store's device current for the scope of a call, the caller's restored after it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device && cudaSetDevice(device) != cudaSuccess)
      fail(StatusCode::kInternal, "device KV store: making device " + std::to_string(device) + " current failed");
  }
  ~DeviceScope() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

// The rows of a plan's device state per layer, n int32 each: where each planned sequence's next
// row goes (advanced on the device), the position it may not reach, where it started, its table
// row (slot), and whether its last append came past the limit (its step then not filed).
enum PlanRow : size_t { kPositions = 0, kLimits = 1, kStarts = 2, kTableRows = 3, kOverran = 4, kPlanRows = 5 };

// The calling thread may make the queries a stream capture would refuse (pointer attributes,
// the current device) for the scope; the launches are still captured.
class RelaxedCapture {
 public:
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

void require_device_memory(const void* p, int device, const char* name) {
  throw_if_failed(cache::cuda::require_device_memory(p, device, "device KV store", name));
}

class DeviceKvStoreImpl final : public DeviceKvStore {
 public:
  DeviceKvStoreImpl(const DeviceKvStoreConfig& config, LayerCalibrator calibrate_layer, gate::Telemetry& telemetry)
      : config_(config), calibrate_layer_(std::move(calibrate_layer)), telemetry_(telemetry) {
    if (cudaGetDevice(&device_) != cudaSuccess) fail(StatusCode::kInternal, "device KV store: no current CUDA device");
    format_ = attention::cuda::page_format_of(config.layer.scheme, config.layer.witness);
    metered_ = attention::cuda::page_format_metered(format_);
    sparse_ = config.sparse.enabled;
    layers_.resize(size_t(config.n_layers));
    make_ring(config.n_sequences);
    // The error words (ErrorWord).
    throw_if_failed(DeviceBuffer::allocate(kErrorWords * sizeof(uint32_t), &error_word_));
    if (cudaMemsetAsync(error_word_.data(), 0, kErrorWords * sizeof(uint32_t), stream()) != cudaSuccess)
      fail(StatusCode::kInternal, "device KV store: zeroing the error word failed");
    if (sparse_) make_sparse_constants();
    // Every layer's cache now, so that a configuration its cache refuses (a calibration's base,
    // the outlier pairs) fails here; a GAAC scheme calibrating on its first appends makes each
    // then.
    if (!(cache::kv_scheme_is_gaac(config.layer.scheme) && config.calibrations.empty()))
      for (int layer = 0; layer < config.n_layers; ++layer) make_layer(layer, nullptr, nullptr, 0);
  }

  int n_sequences() const override { return config_.n_sequences; }

  ~DeviceKvStoreImpl() override {
    // Launches may still read the ring and the workspace.
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) cudaSetDevice(device_);
    (void)cache::cuda::synchronize_stream(config_.stream);
    if (previous >= 0 && previous != device_) cudaSetDevice(previous);
  }

  void append(int layer, std::span<const int32_t> seqs, std::span<const int64_t> n_tokens, const float* k,
              const float* v) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    require_device_memory(k, device_, "k");
    require_device_memory(v, device_, "v");
    Layer& l = layers_[size_t(layer)];
    if (l.failed)
      fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                      " refuses appends after a failed one (make a new store)");
    int64_t total = 0, held = 0;
    for (size_t i = 0; i < seqs.size(); ++i) total += n_tokens[i];
    for (int s = 0; s < config_.n_sequences; ++s) held += length(s, layer);
    if (held + total > config_.layer.max_tokens)
      fail(StatusCode::kOutOfMemory, "device KV store: layer " + std::to_string(layer) + " holds " +
                                         std::to_string(held) + " positions; " + std::to_string(total) +
                                         " more pass its capacity of " + std::to_string(config_.layer.max_tokens) +
                                         " (max_tokens)");
    try {
      if (!l.cache) make_layer(layer, k, v, total);
      DeviceKvCache& c = *l.cache;
      // The previous append's encode results: their copy was enqueued then, after its encodes.
      if (c.pending_encodes() > 0) throw_if_failed(c.reconcile_encodes());
      const int64_t kv_dim = int64_t(config_.layer.n_kv_heads) * config_.layer.head_dim;
      std::vector<int64_t> first_row(seqs.size()), done(seqs.size(), 0);  // rows in k and v; rows stored
      for (size_t i = 0, row = 0; i < seqs.size(); row += n_tokens[i], ++i) first_row[i] = row;
      auto remaining = [&] {
        for (size_t i = 0; i < seqs.size(); ++i)
          if (done[i] < n_tokens[i]) return true;
        return false;
      };
      // One write of the rows [done[i], done[i] + n) of each sequence i of `part`; every write but
      // the append's last waits for its encode results, so the raw pages of the blocks it
      // completed return to the layer's pool before the next write takes more. The last one's
      // results are read at the layer's next append, without a wait (a decode step's append is
      // one write).
      std::vector<DeviceKvCache::SlotRows> writes;
      auto write = [&](const std::vector<std::pair<size_t, int64_t>>& part) {
        writes.clear();
        for (const auto& [i, n] : part) {
          const int64_t row = first_row[i] + done[i];
          writes.push_back({l.slots[size_t(seqs[i])], k + row * kv_dim, v + row * kv_dim, n,
                            DeviceKvCache::RowsMemory::kDevice});  // require_device_memory above
          done[i] += n;
        }
        throw_if_failed(c.write_rows(0, writes.data(), writes.size()));
        throw_if_failed(c.download_encode_results());
        if (remaining()) throw_if_failed(c.reconcile_encodes());
      };
      // dither8 chooses each head's outlier pairs from the first write that holds a whole block,
      // as the host store does, whose appends are whole: while the choice is open, each
      // sequence's rows go whole and alone.
      for (size_t i = 0; i < seqs.size() && c.choosing_outliers(0); ++i) write({{i, n_tokens[i]}});
      // Then rounds of at most kAppendRoundTokens rows per sequence: a long prompt needs raw
      // pages for a round, not for the whole prompt (the pools keep what they grew to).
      std::vector<std::pair<size_t, int64_t>> round;
      while (remaining()) {
        round.clear();
        for (size_t i = 0; i < seqs.size(); ++i)
          if (done[i] < n_tokens[i]) round.emplace_back(i, std::min(kAppendRoundTokens, n_tokens[i] - done[i]));
        write(round);
      }
    } catch (...) {
      l.failed = true;
      throw;
    }
  }

  void attend(int layer, std::span<const int32_t> seqs, const float* q, float* out, float* meters) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    const Layer& l = layers_[size_t(layer)];
    if (!l.cache) fail(StatusCode::kInvalidArgument, "device KV store: layer " + std::to_string(layer) + " holds nothing");
    if (l.failed)
      fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                      " is not read after a failed append (make a new store)");
    require_device_memory(q, device_, "q");
    require_device_memory(out, device_, "out");
    if (meters != nullptr) require_device_memory(meters, device_, "meters");
    const size_t n = seqs.size();
    const bool sparse_layer = sparse_ && layer >= config_.sparse.dense_layers;
    if (sparse_layer) update_key_index(layer, seqs, q);
    if (ring_used_ == kRingSteps) drain_ring();
    const size_t at = size_t(ring_used_++) * record_bytes_;
    int32_t* host_lens = reinterpret_cast<int32_t*>(host_ring_.data() + at);
    int32_t* host_indexed = host_lens + 2 * size_t(ring_rows_);
    int64_t max_len = 0, max_indexed = 0, max_window = 0;
    for (size_t i = 0; i < n; ++i) {
      host_lens[i] = int32_t(length(seqs[i], layer));
      host_lens[size_t(ring_rows_) + i] = l.slots[size_t(seqs[i])];
      host_indexed[i] = sparse_layer ? int32_t(l.index[size_t(seqs[i])].indexed) : 0;
      max_len = std::max<int64_t>(max_len, host_lens[i]);
      max_indexed = std::max<int64_t>(max_indexed, host_indexed[i]);
      max_window = std::max<int64_t>(max_window, host_lens[i] - host_indexed[i]);
    }
    int32_t* lens = reinterpret_cast<int32_t*>(ring_.data() + at);
    throw_if_failed(ring_.upload_async(at, host_lens, sizeof(int32_t) * 3 * size_t(ring_rows_), stream()));
    float* step_meters = reinterpret_cast<float*>(ring_.data() + at + meters_offset());
    // A sparse layer with no sequence holding records attends densely: each of its cells (and
    // every cell of a dense layer) counts as dense, as the CPU store counts them.
    if (sparse_) {
      for (size_t i = 0; i < n; ++i)
        if (host_indexed[i] == 0) sparse_stats_.dense_cells += config_.n_heads;
    }

    PagedDecodeParams p = layer_params(l, int(n));
    p.seq_lens = lens;
    p.table_rows = lens + ring_rows_;
    p.max_seq_len = max_len;
    p.split_blocks = kSplitBlocks;
    p.q = q;
    p.out = out;
    p.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + kCorruptWord;
    p.stream = config_.stream;
    const size_t H = size_t(config_.n_heads);
    if (max_indexed > 0) {
      attend_sparse(layer, p, at, max_indexed, max_window);
      if (meters != nullptr && cudaMemsetAsync(meters, 0, sizeof(float) * n * H, stream()) != cudaSuccess)
        fail(StatusCode::kInternal, "device KV store: writing the meters failed");
      ring_steps_.push_back({at, n, /*metered=*/false, /*sparse=*/true});
      return;
    }
    if (metered_) {
      p.meter = step_meters;
      p.a_minus_1 = step_meters + n * H;
      p.value_rho = step_meters + 2 * n * H;
    }
    const size_t need = attention::cuda::workspace_bytes(p);
    if (workspace_.size() < need) {
      throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // a launch may use the old one
      throw_if_failed(DeviceBuffer::allocate(need, &workspace_));
      workspace_layout_ = {};
    }
    p.workspace = workspace_.data();
    p.workspace_size = workspace_.size();
    // The bulk-copy kernels' split counters: a launch leaves its own layout's zero, one of another
    // layout zeroes them first (CudaBackend::zero_split_counters), through reset_error_word with
    // the scratch word in place of the error word, whose count it would otherwise drop.
    if (attention::cuda::page_format_bulk_copied(p.format)) {
      const WorkspaceLayout key{p.batch, attention::cuda::planned_splits(p)};
      if (!(key == workspace_layout_)) {
        PagedDecodeParams zero = p;  // the counters zeroed; the scratch word, not the error word
        zero.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + kScratchWord;
        throw_if_failed(attention::cuda::reset_error_word(zero));
        workspace_layout_ = key;
      }
    }
    throw_if_failed(attention::cuda::paged_decode(p));
    if (meters != nullptr) {
      const size_t bytes = sizeof(float) * n * H;
      if (metered_ ? cudaMemcpyAsync(meters, step_meters, bytes, cudaMemcpyDeviceToDevice, stream()) != cudaSuccess
                   : cudaMemsetAsync(meters, 0, bytes, stream()) != cudaSuccess)
        fail(StatusCode::kInternal, "device KV store: writing the meters failed");
    }
    if (metered_) {
      const size_t a_at = at + meters_offset() + sizeof(float) * n * H;
      throw_if_failed(ring_.download_async(a_at, host_ring_.data() + a_at, sizeof(float) * n * H, stream()));
      ring_steps_.push_back({at, n, /*metered=*/true, /*sparse=*/false});
    }
  }

  void note_queries(int layer, std::span<const int32_t> seqs, std::span<const int64_t> n_tokens,
                    const float* q) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    require_device_memory(q, device_, "q");
    Layer& l = layers_[size_t(layer)];
    if (l.index.empty()) return;  // a dense layer (or one holding nothing: no sequence to note)
    const int H = config_.layer.n_kv_heads, D = config_.layer.head_dim, group = config_.n_heads / H;
    const size_t row = size_t(H) * size_t(D);
    // The rows of the sequences that still take queries, their sums continued on the device.
    std::vector<int64_t> ranges;  // [noted][2]: the rows of q
    std::vector<size_t> noted;  // rows of seqs
    std::vector<double> sums;
    int64_t first = 0;
    for (size_t i = 0; i < seqs.size(); first += n_tokens[i], ++i) {
      const SeqIndex& x = l.index[size_t(seqs[i])];
      if (x.centroids) continue;
      noted.push_back(i);
      ranges.push_back(first);
      ranges.push_back(first + n_tokens[i]);
      if (x.query_sums.empty())
        sums.resize(sums.size() + row, 0.0);
      else
        sums.insert(sums.end(), x.query_sums.begin(), x.query_sums.end());
    }
    if (noted.empty()) return;
    // Up in stream order; the host buffers live until the wait below.
    DeviceBuffer device_ranges, device_sums;
    throw_if_failed(DeviceBuffer::allocate(sizeof(int64_t) * ranges.size(), &device_ranges));
    throw_if_failed(DeviceBuffer::allocate(sizeof(double) * sums.size(), &device_sums));
    throw_if_failed(device_ranges.upload_async(0, ranges.data(), sizeof(int64_t) * ranges.size(), config_.stream));
    throw_if_failed(device_sums.upload_async(0, sums.data(), sizeof(double) * sums.size(), config_.stream));
    attention::cuda::QuerySumParams p;
    p.n_seqs = int(noted.size());
    p.n_q_heads = config_.n_heads;
    p.n_kv_heads = H;
    p.head_dim = D;
    p.q = q;
    p.row_ranges = reinterpret_cast<const int64_t*>(device_ranges.data());
    p.sums = reinterpret_cast<double*>(device_sums.data());
    p.stream = config_.stream;
    throw_if_failed(attention::cuda::add_query_sums(p));
    std::vector<double> added(sums.size());
    throw_if_failed(device_sums.download_async(0, added.data(), sizeof(double) * added.size(), config_.stream));
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // the sums; the buffers freed after
    for (size_t b = 0; b < noted.size(); ++b) {
      SeqIndex& x = l.index[size_t(seqs[noted[b]])];
      x.query_sums.assign(added.begin() + std::ptrdiff_t(b * row), added.begin() + std::ptrdiff_t((b + 1) * row));
      x.query_rows += n_tokens[noted[b]] * group;
    }
  }

  bool plan(std::span<const int32_t> seqs, int64_t steps) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    refuse_after_failure();
    if (sparse_)
      fail(StatusCode::kUnsupported, "device KV store: planned steps are not served with sparse decode (each "
                                     "sparse step's index update waits for the host)");
    if (steps < 1 || steps > (int64_t(1) << 20))
      fail(StatusCode::kInvalidArgument, "device KV store: steps " + std::to_string(steps) + " is not in [1, 2^20]");
    // The eager steps' meters recorded first, so that finish records the planned ones after them (the
    // order an all-eager run records; it matters where telemetry samples every k-th cell).
    drain_ring();
    const size_t n = seqs.size(), L = layers_.size();
    for (size_t l = 0; l < L; ++l) {
      if (!layers_[l].cache)
        fail(StatusCode::kInvalidArgument, "device KV store: layer " + std::to_string(l) +
                                               " holds nothing (append each sequence's prompt first)");
      for (int32_t seq : seqs)
        if (length(seq, int(l)) < 1)
          fail(StatusCode::kInvalidArgument, "device KV store: seq " + std::to_string(seq) +
                                                 " holds no position of layer " + std::to_string(l) +
                                                 " (append its prompt first)");
    }
    // Host state, per layer (PlanRow): positions, limits, starts, table rows (slots), overrun flags.
    std::vector<int32_t> state(L * kPlanRows * n, 0);
    auto at = [&](size_t l, PlanRow row, size_t b) -> int32_t& { return state[(l * kPlanRows + row) * n + b]; };
    int64_t longest = 0;
    for (size_t l = 0; l < L; ++l) {
      int64_t held = 0;
      for (int s = 0; s < config_.n_sequences; ++s) held += length(s, int(l));
      if (held + int64_t(n) * steps > config_.layer.max_tokens)
        fail(StatusCode::kOutOfMemory, "device KV store: layer " + std::to_string(l) + " holds " +
                                           std::to_string(held) + " positions; " + std::to_string(int64_t(n) * steps) +
                                           " more pass its capacity of " + std::to_string(config_.layer.max_tokens) +
                                           " (max_tokens)");
      for (size_t b = 0; b < n; ++b) {
        const int64_t start = length(seqs[b], int(l));
        at(l, kPositions, b) = int32_t(start);  // advanced on the device
        at(l, kLimits, b) = int32_t(start + steps);
        at(l, kStarts, b) = int32_t(start);
        at(l, kTableRows, b) = layers_[l].slots[size_t(seqs[b])];
        longest = std::max(longest, start + steps);
      }
    }
    // The longest context a step may reach, rounded up to an eighth of the power of two above it
    // (so that later plans keep a captured graph valid, and a launch spans at most 1/8 more of the
    // context than it reads), within what the tables hold.
    const int64_t T = config_.layer.block_tokens;
    int64_t power = 256;
    while (power < longest) power *= 2;
    const int64_t unit = std::max<int64_t>(T, power / 8);
    const int64_t bucket = std::min((longest + unit - 1) / unit * unit, (config_.layer.max_tokens + T - 1) / T * T);
    // The buffers first (nothing reserved yet if one cannot be had).
    const size_t H = size_t(config_.n_heads);
    // A - 1, rho, meters; the steps' A - 1 (metered schemes only: bf16 and gaac pages keep none).
    const size_t per_layer = metered_ ? 3 * n * H + size_t(steps) * n * H : 0;
    grow(plan_.state, sizeof(int32_t) * state.size());
    grow(plan_.meters, sizeof(float) * per_layer * L);
    grow(plan_.overruns, sizeof(uint32_t));
    PagedDecodeParams p = layer_params(layers_[0], int(n));
    p.max_seq_len = bucket;
    p.split_blocks = kSplitBlocks;
    p.seq_lens = reinterpret_cast<const int32_t*>(plan_.state.data());
    p.table_rows = p.seq_lens;
    if (metered_) p.meter = p.a_minus_1 = p.value_rho = reinterpret_cast<float*>(plan_.meters.data());
    const size_t need = attention::cuda::workspace_bytes(p);
    const bool new_workspace = plan_.workspace.size() < need;
    if (new_workspace) throw_if_failed(DeviceBuffer::allocate(need, &plan_.workspace));
    // The pages of every planned position, all or none; then the state goes up.
    size_t reserved = 0;  // (layer, row) pairs reserved, in order
    try {
      for (size_t l = 0; l < L; ++l) {
        DeviceKvCache& c = *layers_[l].cache;
        if (c.pending_encodes() > 0) throw_if_failed(c.reconcile_encodes());
        for (size_t b = 0; b < n; ++b, ++reserved) throw_if_failed(c.reserve_rows(at(l, kTableRows, b), 0, steps));
      }
      const WorkspaceLayout key{int(n), attention::cuda::planned_splits(p)};
      if (new_workspace || !(key == plan_.layout)) {
        // The bulk-copy kernels' split counters start at zero (each launch leaves them so).
        plan_.layout = {};
        if (cudaMemsetAsync(plan_.workspace.data(), 0, plan_.workspace.size(), stream()) != cudaSuccess)
          fail(StatusCode::kInternal, "device KV store: zeroing the planned steps' workspace failed");
        plan_.layout = key;
      }
      throw_if_failed(plan_.state.upload_async(0, state.data(), sizeof(int32_t) * state.size(), config_.stream));
      // The steps' A - 1 start below zero: a step not attended is not recorded.
      const std::vector<float> unset(metered_ ? size_t(steps) * n * H : 0, -1.f);
      for (size_t l = 0; l < L && metered_; ++l)
        throw_if_failed(plan_.meters.upload_async(sizeof(float) * (l * per_layer + 3 * n * H), unset.data(),
                                                  sizeof(float) * unset.size(), config_.stream));
      if (cudaMemsetAsync(plan_.overruns.data(), 0, sizeof(uint32_t), stream()) != cudaSuccess)
        fail(StatusCode::kInternal, "device KV store: zeroing the overrun count failed");
      throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // replays may run on another stream
    } catch (...) {
      for (size_t i = 0; i < reserved; ++i) {
        const size_t l = i / n, b = i % n;
        (void)layers_[l].cache->commit_rows(at(l, kTableRows, b), 0, 0, steps);
      }
      throw;
    }
    plan_.open = true;
    plan_.seqs.assign(seqs.begin(), seqs.end());
    plan_.steps = steps;
    plan_.bucket = bucket;
    plan_.per_layer = per_layer;
    plan_.planned = std::move(state);
    // What a captured step reads, by value or through a pointer.
    std::vector<uintptr_t> signature{uintptr_t(n), uintptr_t(bucket), uintptr_t(steps),
                                     reinterpret_cast<uintptr_t>(plan_.state.data()),
                                     reinterpret_cast<uintptr_t>(plan_.meters.data()),
                                     reinterpret_cast<uintptr_t>(plan_.workspace.data()),
                                     reinterpret_cast<uintptr_t>(plan_.overruns.data())};
    for (size_t l = 0; l < L; ++l) {
      const cache::cuda::DeviceLayerView v = layers_[l].cache->view(0);
      for (const void* x : {static_cast<const void*>(v.k_pages), static_cast<const void*>(v.v_pages),
                            static_cast<const void*>(v.raw_pages), static_cast<const void*>(v.k_table),
                            static_cast<const void*>(v.v_table), static_cast<const void*>(v.gaac_bases),
                            static_cast<const void*>(v.dither_keys), static_cast<const void*>(v.outlier_channels)})
        signature.push_back(reinterpret_cast<uintptr_t>(x));
      for (int64_t x : {v.k_page_stride, v.v_page_stride, v.n_k_pages, v.n_v_pages, v.raw_page_stride, v.n_raw_pages,
                        v.table_stride, v.table_row_stride, v.n_table_rows, v.k_escape_capacity, v.v_escape_capacity,
                        int64_t(v.n_outlier_pairs)})
        signature.push_back(uintptr_t(x));
    }
    const bool recapture = signature != plan_.signature;
    plan_.signature = std::move(signature);
    return recapture;
  }

  void append_planned(int layer, const float* k, const float* v, void* stream) override {
    const RelaxedCapture relaxed;
    const DeviceScope scope(device_);
    const Layer& l = planned_layer(layer);
    require_device_memory(k, device_, "k");
    require_device_memory(v, device_, "v");
    const size_t n = plan_.seqs.size();
    int32_t* state = reinterpret_cast<int32_t*>(plan_.state.data()) + size_t(layer) * kPlanRows * n;
    cache::cuda::PlannedRowsArgs a = l.cache->planned_rows_args(0);
    a.k_rows = k;
    a.v_rows = v;
    a.batch = int(n);
    a.positions = state + kPositions * n;
    a.limits = state + kLimits * n;
    a.table_rows = state + kTableRows * n;
    a.overran = state + kOverran * n;
    a.overruns = reinterpret_cast<uint32_t*>(plan_.overruns.data());
    throw_if_failed(cache::cuda::append_planned_rows(a, stream ? stream : config_.stream));
  }

  void attend_planned(int layer, const float* q, float* out, float* meters, void* stream) override {
    const RelaxedCapture relaxed;
    const DeviceScope scope(device_);
    const Layer& l = planned_layer(layer);
    require_device_memory(q, device_, "q");
    require_device_memory(out, device_, "out");
    if (meters != nullptr) require_device_memory(meters, device_, "meters");
    const size_t n = plan_.seqs.size(), H = size_t(config_.n_heads);
    const int32_t* state = reinterpret_cast<const int32_t*>(plan_.state.data()) + size_t(layer) * kPlanRows * n;
    float* m = metered_ ? reinterpret_cast<float*>(plan_.meters.data()) + size_t(layer) * plan_.per_layer : nullptr;
    void* on = stream ? stream : config_.stream;
    PagedDecodeParams p = layer_params(l, int(n));
    p.seq_lens = state + kPositions * n;  // the positions after this step's row (append_planned came first)
    p.table_rows = state + kTableRows * n;
    p.max_seq_len = plan_.bucket;
    p.split_blocks = kSplitBlocks;
    p.q = q;
    p.out = out;
    p.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + kCorruptWord;
    p.stream = on;
    p.workspace = plan_.workspace.data();
    p.workspace_size = plan_.workspace.size();
    if (metered_) {
      p.a_minus_1 = m;
      p.value_rho = m + n * H;
      p.meter = meters != nullptr ? meters : m + 2 * n * H;
    }
    throw_if_failed(attention::cuda::paged_decode(p));
    if (metered_) {
      cache::cuda::PlannedStepValues r;
      r.values = m;
      r.positions = state + kPositions * n;
      r.starts = state + kStarts * n;
      r.skip = state + kOverran * n;
      r.out = m + 3 * n * H;
      r.batch = int(n);
      r.width = int(H);
      r.steps = plan_.steps;
      throw_if_failed(cache::cuda::store_planned_step_values(r, on));
    } else if (meters != nullptr &&
               cudaMemsetAsync(meters, 0, sizeof(float) * n * H, static_cast<cudaStream_t>(on)) != cudaSuccess) {
      fail(StatusCode::kInternal, "device KV store: writing the meters failed");
    }
  }

  void finish_planned(void* stream) override {
    const DeviceScope scope(device_);
    if (!plan_.open) fail(StatusCode::kInvalidArgument, "device KV store: no planned steps to finish");
    if (stream != nullptr) throw_if_failed(cache::cuda::synchronize_stream(stream));
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    const size_t n = plan_.seqs.size(), L = layers_.size(), H = size_t(config_.n_heads);
    std::vector<int32_t> state(L * kPlanRows * n);
    throw_if_failed(plan_.state.download(0, state.data(), sizeof(int32_t) * state.size()));
    uint32_t overruns = 0;
    throw_if_failed(plan_.overruns.download(0, &overruns, sizeof(overruns)));
    std::vector<float> meters;
    if (metered_) {
      meters.resize(plan_.per_layer * L);
      throw_if_failed(plan_.meters.download(0, meters.data(), sizeof(float) * meters.size()));
    }
    plan_.open = false;  // from here the store takes what ran, whatever fails
    // A replay after this writes nothing (every row past its limit of 0).
    for (size_t l = 0; l < L; ++l)
      (void)cudaMemsetAsync(plan_.state.data() + sizeof(int32_t) * (l * kPlanRows + kLimits) * n, 0,
                            sizeof(int32_t) * n, this->stream());
    // Every (layer, sequence) committed and its steps' meters recorded, whatever fails; the first
    // failure thrown after.
    std::exception_ptr first_failure;
    for (size_t l = 0; l < L; ++l)
      for (size_t b = 0; b < n; ++b) {
        const size_t row = l * kPlanRows * n + b;
        const int64_t done = int64_t(state[row + kPositions * n]) - plan_.planned[row + kStarts * n];
        try {
          throw_if_failed(layers_[l].cache->commit_rows(plan_.planned[row + kTableRows * n], 0,
                                                        std::clamp<int64_t>(done, 0, plan_.steps), plan_.steps));
        } catch (...) {
          layers_[l].failed = true;
          if (!first_failure) first_failure = std::current_exception();
        }
      }
    // In the order eager steps record them: step by step, then layer, sequence and head.
    for (int64_t step = 0; metered_ && step < plan_.steps; ++step)
      for (size_t l = 0; l < L; ++l)
        for (size_t j = 0; j < n * H; ++j) {
          const float a = meters[l * plan_.per_layer + 3 * n * H + size_t(step) * n * H + j];
          if (a < 0.f) continue;  // not attended
          telemetry_.record(gate::meter_from_a_minus_1(double(a)), !std::isfinite(a));
        }
    if (first_failure) std::rethrow_exception(first_failure);
    check_error_word();
    if (overruns > 0)
      fail(StatusCode::kOutOfRange, "device KV store: " + std::to_string(overruns) + " rows came past the " +
                                        std::to_string(plan_.steps) +
                                        " planned steps and were not written (plan more steps)");
  }

  bool planned() const override { return plan_.open; }

  int64_t length(int seq, int layer) const override {
    const Layer& l = layers_[size_t(layer)];
    return l.cache ? l.cache->written(l.slots[size_t(seq)], 0) : 0;
  }

  void read(int seq, int layer, int kv, int64_t begin, int64_t end, float* out) override {
    const DeviceScope scope(device_);
    const Layer& l = layers_[size_t(layer)];
    if (begin == end) return;
    if (!l.cache) fail(StatusCode::kOutOfRange, "device KV store: layer " + std::to_string(layer) + " holds nothing");
    if (l.failed)
      fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                      " is not read after a failed append (make a new store)");
    if (l.cache->pending_encodes() > 0) throw_if_failed(l.cache->reconcile_encodes());
    const size_t per_head = size_t(end - begin) * size_t(config_.layer.head_dim);
    for (int h = 0; h < config_.layer.n_kv_heads; ++h)
      throw_if_failed(l.cache->read_rows(l.slots[size_t(seq)], 0, cache::KvTensor(kv), h, begin, end,
                                         out + size_t(h) * per_head));
  }

  void crop(int seq, int64_t n_tokens) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    refuse_after_failure();
    // Every layer's cropped copy first: if one cannot be made, those made are freed and the store
    // is as it was.
    std::vector<int> made(layers_.size(), -1);
    // The key index of the prefix kept goes with the new slot (its records are the sequence's own).
    const int64_t keep = sparse_ ? cache::store_indexed_tokens(n_tokens, config_.sparse.window_tokens,
                                                               config_.layer.block_tokens)
                                 : 0;
    auto kept = [&](const Layer& l) {
      SeqIndex x = l.index[size_t(seq)];
      x.indexed = std::min(x.indexed, keep);
      return x;
    };
    try {
      for (size_t layer = 0; layer < layers_.size(); ++layer) {
        Layer& l = layers_[layer];
        if (l.cache && l.cache->written(l.slots[size_t(seq)], 0) != n_tokens) {
          throw_if_failed(l.cache->fork_sequence(l.slots[size_t(seq)], n_tokens, &made[layer]));
          if (!l.index.empty()) copy_key_index(l, l.slots[size_t(seq)], made[layer], kept(l));
        }
      }
    } catch (...) {
      for (size_t layer = 0; layer < layers_.size(); ++layer)
        if (made[layer] >= 0) (void)layers_[layer].cache->free_sequence(made[layer]);
      throw;
    }
    for (size_t layer = 0; layer < layers_.size(); ++layer) {
      if (made[layer] < 0) continue;
      Layer& l = layers_[layer];
      if (!l.index.empty()) l.index[size_t(seq)] = kept(l);
      throw_if_failed(l.cache->free_sequence(l.slots[size_t(seq)]));
      l.slots[size_t(seq)] = made[layer];
    }
  }

  void select(std::span<const int32_t> src) override {
    const DeviceScope scope(device_);
    refuse_while_planned();
    refuse_after_failure();
    // Every layer's new slots first (whole copies: the whole blocks shared, a partial last block's
    // raw pages copied on the device); if one cannot be made, those made are freed and the store
    // is as it was. Then the old slots are freed.
    std::vector<std::vector<int>> made(layers_.size());
    try {
      for (size_t layer = 0; layer < layers_.size(); ++layer) {
        Layer& l = layers_[layer];
        if (!l.cache) continue;
        for (size_t i = 0; i < src.size(); ++i) {
          const int parent = l.slots[size_t(src[i])];
          int child = -1;
          const CudaStatus s = l.cache->fork_sequence(parent, l.cache->written(parent, 0), &child);
          if (child >= 0) made[layer].push_back(child);
          throw_if_failed(s);
        }
        // Each copy's key index: the parent's records and centroids, copied on the device.
        if (!l.index.empty())
          for (size_t i = 0; i < src.size(); ++i)
            copy_key_index(l, l.slots[size_t(src[i])], made[layer][i], l.index[size_t(src[i])]);
      }
      if (int(src.size()) > ring_rows_) {
        drain_ring();  // waits for the stream; the ring's records hold the steps not yet recorded
        make_ring(int(src.size()));
      }
    } catch (...) {
      for (size_t layer = 0; layer < layers_.size(); ++layer)
        for (int child : made[layer]) (void)layers_[layer].cache->free_sequence(child);
      throw;
    }
    for (size_t layer = 0; layer < layers_.size(); ++layer) {
      Layer& l = layers_[layer];
      if (!l.cache) continue;
      for (int slot : l.slots) throw_if_failed(l.cache->free_sequence(slot));
      l.slots = std::move(made[layer]);
      if (!l.index.empty()) {
        std::vector<SeqIndex> index;
        for (int32_t from : src) index.push_back(l.index[size_t(from)]);
        l.index = std::move(index);
      }
    }
    config_.n_sequences = int(src.size());
  }

  void drain() override {
    const DeviceScope scope(device_);
    drain_ring();
  }

  DeviceKvStoreStats stats() override {
    const DeviceScope scope(device_);
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    DeviceKvStoreStats s;
    for (int s_i = 0; s_i < config_.n_sequences; ++s_i) s.tokens_layer0 += length(s_i, 0);
    s.bytes_reserved = ring_.size() + host_ring_.size() + workspace_.size() + plan_.state.size() + plan_.meters.size() +
                       plan_.workspace.size() + plan_.overruns.size();
    for (int layer = 0; layer < config_.n_layers; ++layer) {
      const Layer& l = layers_[size_t(layer)];
      int64_t tokens = 0;
      for (int s_i = 0; s_i < config_.n_sequences; ++s_i) tokens += length(s_i, layer);
      s.kv_bytes_bf16 += uint64_t(tokens) * 2 * uint64_t(config_.layer.n_kv_heads) * uint64_t(config_.layer.head_dim) * 2;
      if (!l.cache) continue;
      if (l.cache->pending_encodes() > 0) throw_if_failed(l.cache->reconcile_encodes());
      const cache::cuda::DeviceKvStats d = l.cache->stats();
      s.bytes_reserved += d.bytes_reserved;
      s.bytes_in_use += d.bytes_in_use;
      s.raw_bytes_in_use += d.raw_bytes_in_use;
      s.coded_bytes_in_use += d.coded_bytes_in_use;
      s.raw_pages_in_use += d.raw_pages_in_use;
      s.coded_pages_in_use += d.slots_in_use + d.lossy_pages_in_use;
      s.pages_kept_exact += d.pages_kept_exact;
    }
    return s;
  }

  DeviceSparseStats sparse_stats() override {
    const DeviceScope scope(device_);
    drain_ring();
    DeviceSparseStats s;
    s.counters = sparse_stats_;
    if (!sparse_) return s;
    const size_t H = size_t(config_.layer.n_kv_heads), D = size_t(config_.layer.head_dim);
    const uint64_t block_records = uint64_t(config_.layer.block_tokens);
    s.index_bytes = rotation_.size();
    for (const Layer& l : layers_)
      for (const SeqIndex& x : l.index) {
        s.indexed_tokens += x.indexed;
        const uint64_t records = (uint64_t(x.indexed) + block_records - 1) / block_records * block_records;
        s.index_bytes += records * H * index_record_bytes_;
        if (x.centroids) s.index_bytes += 2 * H * D * sizeof(float);
      }
    return s;
  }

 private:
  // A sequence's key index in a sparse layer (its records at its slot of the layer's cache).
  struct SeqIndex {
    int64_t indexed = 0;     // tokens with records, per KV head
    bool centroids = false;  // c_q and c_k set
    std::vector<double> query_sums;  // [n_kv_heads][head_dim]: the noted queries, until the centroids
    int64_t query_rows = 0;          // tokens x group heads noted
  };
  struct Layer {
    std::unique_ptr<DeviceKvCache> cache;
    std::vector<int> slots;  // the store's sequence i is slot slots[i] of the cache
    std::vector<SeqIndex> index;  // [sequence] in the sparse layers; empty in the others
    bool failed = false;
  };
  struct RingStep {
    size_t at = 0;  // the record's offset
    size_t rows = 0;
    bool metered = false;  // its A - 1 came down
    bool sparse = false;   // its sparse counts came down
  };
  // A decode launch's parameters over the pages of layer l for n sequences (the rest is the call's).
  PagedDecodeParams layer_params(const Layer& l, int n) const {
    PagedDecodeParams p;
    p.format = format_;
    p.batch = n;
    p.n_q_heads = config_.n_heads;
    p.n_kv_heads = config_.layer.n_kv_heads;
    p.head_dim = config_.layer.head_dim;
    p.block_tokens = config_.layer.block_tokens;
    p.sm_scale = config_.sm_scale;
    p.rope_half_split = config_.layer.rope_pairing == codec::RopePairing::kHalfSplit;
    p.witness = config_.layer.witness;
    p.delta_loc = config_.delta_loc;
    attention::cuda::set_layer_pages(l.cache->view(0), p);
    return p;
  }

  struct WorkspaceLayout {
    int batch = 0;
    int splits = 0;
    bool operator==(const WorkspaceLayout&) const = default;
  };

  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t cells(int rows) const { return size_t(rows) * size_t(config_.n_heads); }
  size_t meters_offset() const { return round_up(sizeof(int32_t) * 3 * size_t(ring_rows_)); }
  size_t seeds_offset() const { return meters_offset() + round_up(sizeof(float) * 3 * cells(ring_rows_)); }
  size_t counts_offset() const { return seeds_offset() + round_up(sizeof(uint64_t) * cells(ring_rows_)); }

  // The staging rings for decode steps of up to `rows` sequences. One record: lengths, table rows
  // and indexed lengths up ([3][rows] int32), then the meters of the step ([3][rows][n_heads]
  // float: meter, A - 1, value side; A - 1 comes down); with sparse decode the heads' rounding
  // seeds up ([rows][n_heads] uint64) and the sparse counts down ([3][rows][n_heads] of 8 bytes:
  // selected, widened, estimated mass). Beside them, the quantized queries of a step
  // ([rows][n_heads], read in stream order).
  // The old rings are freed only once the new ones are made; the stream must not read them.
  void make_ring(int rows) {
    size_t record_bytes = round_up(sizeof(int32_t) * 3 * size_t(rows)) + round_up(sizeof(float) * 3 * cells(rows));
    if (sparse_) record_bytes += round_up(sizeof(uint64_t) * cells(rows)) + round_up(sizeof(int64_t) * 3 * cells(rows));
    DeviceBuffer ring, queries;
    PinnedBuffer host_ring;
    throw_if_failed(DeviceBuffer::allocate(record_bytes * kRingSteps, &ring));
    throw_if_failed(PinnedBuffer::allocate(record_bytes * kRingSteps, &host_ring));
    if (sparse_)
      throw_if_failed(DeviceBuffer::allocate(sizeof(attention::cuda::DeviceRabitqQuery) * cells(rows), &queries));
    ring_ = std::move(ring);
    host_ring_ = std::move(host_ring);
    if (sparse_) queries_ = std::move(queries);
    record_bytes_ = record_bytes;
    ring_rows_ = rows;
  }

  // The sparse tier's constants on the device, up on the store's stream: the key index's rotation
  // (cache::KeyIndex's, from the sparse seed) and the Top-p bucket weights.
  void make_sparse_constants() {
    const int D = config_.layer.head_dim;
    index_record_bytes_ = D == 64 ? sizeof(index::RabitqRecord<64>) : sizeof(index::RabitqRecord<128>);
    const index::Rotation rotation(config_.sparse.rotation, D, config_.sparse.seed);
    const bool haar = rotation.kind() == index::RotationKind::kHaar;
    const std::vector<float>& params = haar ? rotation.p_transpose() : rotation.signs();
    throw_if_failed(DeviceBuffer::allocate(sizeof(float) * params.size(), &rotation_));
    throw_if_failed(rotation_.upload_async(0, params.data(), sizeof(float) * params.size(), config_.stream));
    rotation_view_.kind = rotation.kind();
    (haar ? rotation_view_.p_transpose : rotation_view_.signs) = reinterpret_cast<const float*>(rotation_.data());
    const std::vector<uint64_t>& w = index::top_p_bucket_weights();
    throw_if_failed(DeviceBuffer::allocate(sizeof(uint64_t) * w.size(), &topp_weights_));
    throw_if_failed(topp_weights_.upload_async(0, w.data(), sizeof(uint64_t) * w.size(), config_.stream));
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // the rotation's host copy goes now
  }

  // The records [0, x.indexed) of every KV head and the centroids of slot `from` into slot `to`,
  // on the stream (the caller frees `from` after: later writes to it are ordered after the copy).
  void copy_key_index(const Layer& l, int from, int to, const SeqIndex& x) {
    const cache::cuda::DeviceLayerView v = l.cache->view(0);
    const int H = config_.layer.n_kv_heads, D = config_.layer.head_dim;
    const size_t rb = index_record_bytes_;
    for (int h = 0; h < H && x.indexed > 0; ++h) {
      const size_t src = (size_t(from) * size_t(H) + size_t(h)) * size_t(v.index_record_stride) * rb;
      const size_t dst = (size_t(to) * size_t(H) + size_t(h)) * size_t(v.index_record_stride) * rb;
      if (cudaMemcpyAsync(v.index_records + dst, v.index_records + src, size_t(x.indexed) * rb,
                          cudaMemcpyDeviceToDevice, stream()) != cudaSuccess)
        fail(StatusCode::kInternal, "device KV store: copying a key index failed");
    }
    const size_t row = size_t(H) * 2 * size_t(D);
    if (x.centroids && cudaMemcpyAsync(v.index_centroids + size_t(to) * row, v.index_centroids + size_t(from) * row,
                                       sizeof(float) * row, cudaMemcpyDeviceToDevice, stream()) != cudaSuccess)
      fail(StatusCode::kInternal, "device KV store: copying a key index's centroids failed");
  }

  // Brings the key index of each of seqs in `layer` up to its context (the CPU store's
  // StoreKeyIndex::update): the centroids at a sequence's first sparse step (q: this step's
  // queries, device [n][n_heads][head_dim]), then the records of [indexed, store_indexed_tokens).
  // Waits for the stream when there is anything to build; fails on bad keys.
  void update_key_index(int layer, std::span<const int32_t> seqs, const float* q) {
    Layer& l = layers_[size_t(layer)];
    const int H = config_.layer.n_kv_heads, D = config_.layer.head_dim, group = config_.n_heads / H;
    std::vector<attention::cuda::KeyIndexRange> ranges;  // the centroid ranges, then the record ranges
    std::vector<size_t> builds;                           // rows of seqs whose centroids are set now
    std::vector<int64_t> targets(seqs.size());
    int64_t max_tokens = 0;
    for (size_t i = 0; i < seqs.size(); ++i)
      if (!l.index[size_t(seqs[i])].centroids) {
        const int64_t n = length(seqs[i], layer);
        builds.push_back(i);
        ranges.push_back({int32_t(l.slots[size_t(seqs[i])]), 0, int32_t(n)});
        max_tokens = std::max(max_tokens, n);
      }
    const size_t n_centroids = ranges.size();
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SeqIndex& x = l.index[size_t(seqs[i])];
      targets[i] = cache::store_indexed_tokens(length(seqs[i], layer), config_.sparse.window_tokens,
                                               config_.layer.block_tokens);
      if (targets[i] > x.indexed) {
        ranges.push_back({int32_t(l.slots[size_t(seqs[i])]), int32_t(x.indexed), int32_t(targets[i])});
        max_tokens = std::max(max_tokens, targets[i] - x.indexed);
      }
    }
    if (ranges.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    // Records up to the end of every record range (the centroids read the keys, not the records).
    int64_t reach = 0;
    for (size_t i = n_centroids; i < ranges.size(); ++i) reach = std::max<int64_t>(reach, ranges[i].end);
    throw_if_failed(l.cache->reserve_index_records(reach));
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // the queries, and the scratch free
    // c_q of the first builds (the CPU store's StoreKeyIndex::update): the noted queries' sums over
    // their rows, or this step's query over each KV head's group when none were noted; summed in
    // double (index::rabitq_add_query_sums) and rounded once.
    std::vector<float> c_q(builds.size() * size_t(H) * size_t(D));
    if (!builds.empty()) {
      const size_t q_row = size_t(config_.n_heads) * size_t(D);
      std::vector<float> host(q_row);
      for (size_t b = 0; b < builds.size(); ++b) {
        const SeqIndex& x = l.index[size_t(seqs[builds[b]])];
        std::vector<double> sums = x.query_sums;
        int64_t rows = x.query_rows;
        if (rows == 0) {
          throw_if_failed(cache::cuda::copy_to_host(q + builds[b] * q_row, host.data(), sizeof(float) * q_row));
          sums.assign(size_t(H) * size_t(D), 0.0);
          index::rabitq_add_query_sums(host.data(), 1, config_.n_heads, H, D, sums.data());
          rows = group;
        }
        for (size_t j = 0; j < sums.size(); ++j) c_q[b * sums.size() + j] = float(sums[j] / double(rows));
      }
    }
    // Up in stream order (the stream may be one that does not wait for the legacy stream); the
    // host buffers live until the wait below.
    DeviceBuffer device_ranges, device_c_q;
    throw_if_failed(DeviceBuffer::allocate(sizeof(attention::cuda::KeyIndexRange) * ranges.size(), &device_ranges));
    throw_if_failed(device_ranges.upload_async(0, ranges.data(), sizeof(attention::cuda::KeyIndexRange) * ranges.size(),
                                               config_.stream));
    if (!c_q.empty()) {
      throw_if_failed(DeviceBuffer::allocate(sizeof(float) * c_q.size(), &device_c_q));
      throw_if_failed(device_c_q.upload_async(0, c_q.data(), sizeof(float) * c_q.size(), config_.stream));
    }
    const uint32_t zero = 0;
    throw_if_failed(error_word_.upload_async(sizeof(uint32_t) * kIndexBuildWord, &zero, sizeof(zero), config_.stream));
    const cache::cuda::DeviceLayerView v = l.cache->view(0);
    attention::cuda::KeyIndexBuildParams p;
    p.n_kv_heads = H;
    p.head_dim = D;
    p.block_tokens = config_.layer.block_tokens;
    attention::cuda::set_layer_index(v, p);  // bf16: the raw pool
    p.max_range_tokens = max_tokens;
    p.rotation = rotation_view_;
    p.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + kIndexBuildWord;
    p.stream = config_.stream;
    const auto* device = reinterpret_cast<const attention::cuda::KeyIndexRange*>(device_ranges.data());
    if (n_centroids > 0) {
      p.ranges = device;
      p.n_ranges = int(n_centroids);
      p.query_centroids = reinterpret_cast<const float*>(device_c_q.data());
      throw_if_failed(attention::cuda::set_key_centroids(p));
    }
    if (ranges.size() > n_centroids) {
      p.ranges = device + n_centroids;
      p.n_ranges = int(ranges.size() - n_centroids);
      throw_if_failed(attention::cuda::build_key_records(p));
    }
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // the builds; the buffers freed after
    uint32_t errors = 0;
    throw_if_failed(error_word_.download(sizeof(uint32_t) * kIndexBuildWord, &errors, sizeof(errors)));
    if (errors != 0)
      fail(StatusCode::kInvalidArgument, "device KV store: the key index builder of layer " + std::to_string(layer) +
                                             " found " + std::to_string(errors) +
                                             " keys that are not finite, or ranges or pages outside the pools");
    for (size_t b : builds) {
      SeqIndex& x = l.index[size_t(seqs[b])];
      x.centroids = true;
      x.query_sums = {};
      x.query_rows = 0;
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      SeqIndex& x = l.index[size_t(seqs[i])];
      if (targets[i] > x.indexed) {
        sparse_stats_.index_appended_tokens += targets[i] - x.indexed;
        x.indexed = targets[i];
      }
    }
    sparse_stats_.index_build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // One sparse step of the ring record at `at` (lengths, table rows, indexed lengths there), over
  // the pages p describes: the heads' rounding seeds up, the queries quantized, sparse_decode into
  // p.out, the counts down.
  void attend_sparse(int layer, const PagedDecodeParams& p, size_t at, int64_t max_indexed, int64_t max_window) {
    const size_t n = size_t(p.batch), Hq = size_t(config_.n_heads);
    const int32_t* host_lens = reinterpret_cast<const int32_t*>(host_ring_.data() + at);
    const int32_t* lens = reinterpret_cast<const int32_t*>(ring_.data() + at);
    uint64_t* host_seeds = reinterpret_cast<uint64_t*>(host_ring_.data() + at + seeds_offset());
    for (size_t j = 0; j < n; ++j) {
      const uint64_t step =
          attention::sparse_step_rounding_seed(config_.sparse.seed, host_lens[j] - 1, config_.n_layers, layer);
      for (size_t h = 0; h < Hq; ++h) host_seeds[j * Hq + h] = attention::sparse_head_rounding_seed(step, int(h));
    }
    throw_if_failed(ring_.upload_async(at + seeds_offset(), host_seeds, sizeof(uint64_t) * n * Hq, stream()));
    const cache::cuda::DeviceLayerView v = layers_[size_t(layer)].cache->view(0);

    attention::cuda::QueryQuantizeParams qp;
    qp.batch = int(n);
    qp.n_q_heads = config_.n_heads;
    qp.n_kv_heads = config_.layer.n_kv_heads;
    qp.head_dim = config_.layer.head_dim;
    qp.q = p.q;
    qp.table_rows = p.table_rows;
    qp.n_table_rows = v.n_table_rows;
    qp.centroids = v.index_centroids;
    qp.rotation = rotation_view_;
    qp.rounding_seeds = reinterpret_cast<const uint64_t*>(ring_.data() + at + seeds_offset());
    qp.deviations = config_.sparse.deviations;
    qp.sm_scale = config_.sm_scale;
    qp.queries = reinterpret_cast<attention::cuda::DeviceRabitqQuery*>(queries_.data());
    qp.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + kQueryWord;
    qp.stream = config_.stream;
    throw_if_failed(attention::cuda::quantize_queries(qp));

    attention::cuda::SparseDecodeParams sp;
    attention::cuda::describe_pages(p, &sp);  // bf16 pages (the table's cuda_sparse)
    sp.n_q_heads = config_.n_heads;
    sp.sm_scale = config_.sm_scale;
    sp.p = config_.sparse.p;
    sp.table_rows = p.table_rows;
    sp.n_table_rows = v.n_table_rows;
    sp.table_row_stride = v.table_row_stride;
    sp.records = v.index_records;
    sp.record_stride = v.index_record_stride;
    sp.n_indexed = lens + 2 * size_t(ring_rows_);
    sp.max_indexed = max_indexed;
    sp.max_window = max_window;
    sp.queries = qp.queries;
    sp.topp_weights = reinterpret_cast<const uint64_t*>(topp_weights_.data());
    sp.q = p.q;
    sp.out = p.out;
    sp.n_selected = reinterpret_cast<int64_t*>(ring_.data() + at + counts_offset());
    sp.n_widened = sp.n_selected + n * Hq;
    sp.mass = reinterpret_cast<double*>(sp.n_widened + n * Hq);
    sp.split_chunks = kSplitChunks;
    sp.stream = config_.stream;
    const size_t need = attention::cuda::workspace_bytes(sp);
    if (sparse_workspace_.size() < need) {
      throw_if_failed(cache::cuda::synchronize_stream(config_.stream));  // a launch may use the old one
      throw_if_failed(DeviceBuffer::allocate(need, &sparse_workspace_));
    }
    sp.workspace = sparse_workspace_.data();
    sp.workspace_size = sparse_workspace_.size();
    throw_if_failed(attention::cuda::sparse_decode(sp));
    // The counts come down into the host record: [3][n][n_heads], as the kernel wrote them.
    throw_if_failed(ring_.download_async(at + counts_offset(), host_ring_.data() + at + counts_offset(),
                                         sizeof(int64_t) * 3 * n * Hq, stream()));
  }

  void refuse_while_planned() const {
    if (plan_.open)
      fail(StatusCode::kInvalidArgument, "device KV store: planned steps are open (finish them first: "
                                         "certkv_kv_store_finish_planned_device)");
  }
  void refuse_after_failure() const {
    for (size_t layer = 0; layer < layers_.size(); ++layer)
      if (layers_[layer].failed)
        fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                        " is not changed after a failed append (make a new store)");
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(config_.stream); }

  // The layer of a planned call: a plan open, the layer in range and served.
  const Layer& planned_layer(int layer) const {
    if (!plan_.open)
      fail(StatusCode::kInvalidArgument, "device KV store: no planned steps (certkv_kv_store_plan_device first)");
    const Layer& l = layers_[size_t(layer)];
    if (l.failed)
      fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                      " is not read after a failed append (make a new store)");
    return l;
  }
  // `buffer` holds at least `bytes` (a new one when short: what it held is not kept).
  static void grow(DeviceBuffer& buffer, size_t bytes) {
    if (buffer.size() < bytes) throw_if_failed(DeviceBuffer::allocate(bytes, &buffer));
  }

  // Layer `layer`'s cache; a GAAC scheme without calibrations calibrates it on rows k, v (n of them).
  void make_layer(int layer, const float* k, const float* v, int64_t n) {
    cache::cuda::DeviceKvCacheConfig kc;
    kc.n_layers = 1;
    kc.n_kv_heads = config_.layer.n_kv_heads;
    kc.head_dim = config_.layer.head_dim;
    kc.block_tokens = config_.layer.block_tokens;
    kc.max_tokens = config_.layer.max_tokens;
    kc.scheme = config_.layer.scheme;
    kc.rope_pairing = config_.layer.rope_pairing;
    kc.outlier_pairs = config_.layer.outlier_pairs;
    kc.witness = config_.layer.witness;
    kc.defer_encode_results = true;
    kc.stream = config_.stream;
    kc.sequences = config_.n_sequences;
    kc.first_model_layer = layer;
    const bool sparse_layer = sparse_ && layer >= config_.sparse.dense_layers;
    if (sparse_layer) {
      kc.index_record_bytes = index_record_bytes_;
      kc.index_record_tokens = kIndexRecordTokens;
    }
    if (cache::kv_scheme_is_gaac(config_.layer.scheme)) {
      if (!config_.calibrations.empty()) {
        kc.gaac_calibration = config_.calibrations[size_t(layer)];
      } else {
        // The first append's rows (at most kCalibrationRows of them, plenty for a window base per
        // channel) come to the host, after the work that wrote them.
        n = std::min(n, kCalibrationRows);
        const size_t elements = size_t(n) * size_t(config_.layer.n_kv_heads) * size_t(config_.layer.head_dim);
        std::vector<float> host(2 * elements);
        throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
        throw_if_failed(cache::cuda::copy_to_host(k, host.data(), sizeof(float) * elements));
        throw_if_failed(cache::cuda::copy_to_host(v, host.data() + elements, sizeof(float) * elements));
        kc.gaac_calibration = calibrate_layer_(host.data(), host.data() + elements, n);
      }
    }
    Layer& l = layers_[size_t(layer)];
    throw_if_failed(DeviceKvCache::create(kc, &l.cache));
    l.slots.resize(size_t(config_.n_sequences));
    for (int i = 0; i < config_.n_sequences; ++i) l.slots[size_t(i)] = i;
    if (sparse_layer) l.index.assign(size_t(config_.n_sequences), SeqIndex{});
  }

  // Corrupt entries and bad queries counted by the launches so far (reads the words: waits for
  // the stream). The query word is cleared once read (a bad query fails the drain that finds it);
  // a corrupt page entry stays corrupt, and so does its count.
  void check_error_word() {
    uint32_t words[kErrorWords] = {};
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    throw_if_failed(error_word_.download(0, words, sizeof(words)));
    if (words[kQueryWord] != 0) {
      const uint32_t zero = 0;
      throw_if_failed(error_word_.upload_async(sizeof(uint32_t) * kQueryWord, &zero, sizeof(zero), config_.stream));
      throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    }
    if (words[kCorruptWord] != 0)
      fail(StatusCode::kCorrupt, "device KV store: " + std::to_string(words[kCorruptWord]) +
                                     " corrupt page entries or lengths met by decode attention");
    if (words[kQueryWord] != 0)
      fail(StatusCode::kInvalidArgument, "device KV store: " + std::to_string(words[kQueryWord]) +
                                             " sparse queries are not finite or widen past the float range (sparse "
                                             "deviations " + std::to_string(config_.sparse.deviations) + ")");
  }

  // Waits for the stream, records the ring's meters and sparse counts, starts the ring over; then
  // fails if a launch counted a corrupt page entry or a bad query (the ring is recorded first, so
  // the store goes on).
  void drain_ring() {
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    const size_t H = size_t(config_.n_heads);
    for (const RingStep& r : ring_steps_) {
      if (r.metered) {
        const float* a = reinterpret_cast<const float*>(host_ring_.data() + r.at + meters_offset()) + r.rows * H;
        for (size_t j = 0; j < r.rows * H; ++j) {
          const double a_minus_1 = double(a[j]);  // lifted on the device
          telemetry_.record(gate::meter_from_a_minus_1(a_minus_1), !std::isfinite(a_minus_1));
        }
      }
      if (r.sparse) record_sparse_step(r);
    }
    ring_steps_.clear();
    ring_used_ = 0;
    check_error_word();
  }

  // A sparse step's counts into the counters (the CPU store's accounting): per sequence with
  // records one step, per head a cell of budget (selected + window) / context.
  void record_sparse_step(const RingStep& r) {
    const size_t H = size_t(config_.n_heads), n = r.rows;
    const int32_t* lens = reinterpret_cast<const int32_t*>(host_ring_.data() + r.at);
    const int32_t* indexed = lens + 2 * size_t(ring_rows_);
    const int64_t* selected = reinterpret_cast<const int64_t*>(host_ring_.data() + r.at + counts_offset());
    const int64_t* widened = selected + n * H;
    for (size_t j = 0; j < n; ++j) {
      if (indexed[j] == 0) continue;  // attended exactly: counted dense
      const int64_t n_ctx = lens[j];
      sparse_stats_.steps += 1;
      for (size_t h = 0; h < H; ++h) {
        sparse_stats_.cells += 1;
        sparse_stats_.sum_budget += double(selected[j * H + h] + (n_ctx - indexed[j])) / double(n_ctx);
        sparse_stats_.widened_tokens += widened[j * H + h];
        sparse_stats_.context_tokens += n_ctx;
      }
    }
  }

  // The open plan (plan()): its sequences, steps and device state. state: per layer
  // [kPlanRows][n] int32 (PlanRow); meters: per layer per_layer floats (A - 1, rho and meters of
  // the step [n][H] each, then the steps' A - 1 [steps][n][H]).
  struct Plan {
    bool open = false;
    std::vector<int32_t> seqs;
    int64_t steps = 0, bucket = 0;
    size_t per_layer = 0;
    std::vector<int32_t> planned;  // the state as planned, [layer][kPlanRows][n]
    DeviceBuffer state, meters, workspace, overruns;
    WorkspaceLayout layout;
    std::vector<uintptr_t> signature;  // of the last plan: what a captured step reads
  };

  DeviceKvStoreConfig config_;
  LayerCalibrator calibrate_layer_;
  int device_ = 0;  // the CUDA device current at create: the store's every call runs on it
  PageFormat format_ = PageFormat::kBf16;
  bool metered_ = false;
  std::vector<Layer> layers_;
  size_t record_bytes_ = 0;
  int ring_rows_ = 0;  // the sequences one ring record holds
  DeviceBuffer ring_, workspace_, error_word_;
  PinnedBuffer host_ring_;
  // Sparse decode: the rotation, the Top-p bucket weights, a step's quantized queries, the
  // sparse kernel's workspace; the counters.
  bool sparse_ = false;
  size_t index_record_bytes_ = 0;
  DeviceBuffer rotation_, topp_weights_, queries_, sparse_workspace_;
  attention::cuda::DeviceRotation rotation_view_;
  SparseStats sparse_stats_;
  int64_t ring_used_ = 0;
  std::vector<RingStep> ring_steps_;
  gate::Telemetry& telemetry_;
  WorkspaceLayout workspace_layout_;
  Plan plan_;
};

}  // namespace

std::unique_ptr<DeviceKvStore> make_device_kv_store(const DeviceKvStoreConfig& config, LayerCalibrator calibrate_layer,
                                                    gate::Telemetry& telemetry) {
  if (config.layer.block_tokens != 16)
    fail(StatusCode::kUnsupported, "device cuda pages 16 tokens per block, not " + std::to_string(config.layer.block_tokens));
  if (config.layer.head_dim != 64 && config.layer.head_dim != 128)
    fail(StatusCode::kUnsupported, "device cuda serves head_dim 64 or 128, not " + std::to_string(config.layer.head_dim));
  if (config.n_heads % config.layer.n_kv_heads != 0 || config.n_heads / config.layer.n_kv_heads > 8)
    fail(StatusCode::kUnsupported, "device cuda serves at most 8 query heads per KV head, not " +
                                       std::to_string(config.n_heads / config.layer.n_kv_heads));
  if (config.layer.scheme == cache::KvScheme::kDither8 && config.layer.outlier_pairs > cache::cuda::kMaxOutlierPairsOnDevice)
    fail(StatusCode::kUnsupported, "device cuda keeps at most " + std::to_string(cache::cuda::kMaxOutlierPairsOnDevice) +
                                       " dither8 outlier pairs per head, not " + std::to_string(config.layer.outlier_pairs));
  if (config.layer.max_tokens >= (int64_t(1) << 31))
    fail(StatusCode::kUnsupported, "device cuda serves max_tokens below 2^31, not " + std::to_string(config.layer.max_tokens));
  if (config.sparse.enabled) {
    if (!cache::kv_scheme_info(config.layer.scheme).cuda_sparse)
      fail(StatusCode::kUnsupported,
           std::string("sparse decode on device cuda reads ") +
               cache::kv_scheme_names([](const cache::KvSchemeInfo& s) { return s.cuda_sparse; }) + " pages, not " +
               cache::kv_scheme_name(config.layer.scheme) + " (device cpu serves sparse decode over every scheme)");
    if (config.sparse.window_tokens < 0 || config.sparse.dense_layers < 0 || config.sparse.dense_layers > config.n_layers)
      fail(StatusCode::kInvalidArgument, "device KV store: sparse window_tokens " +
                                             std::to_string(config.sparse.window_tokens) + " or dense_layers " +
                                             std::to_string(config.sparse.dense_layers) + " out of range");
    if (config.layer.max_tokens >= (int64_t(1) << 24))
      fail(StatusCode::kUnsupported, "sparse decode on device cuda serves max_tokens below 2^24, not " +
                                         std::to_string(config.layer.max_tokens));
  }
  if (attention::cuda::device_count() < 1)
    fail(StatusCode::kUnsupported, "device cuda: no CUDA device is visible to this process");
  return std::make_unique<DeviceKvStoreImpl>(config, std::move(calibrate_layer), telemetry);
}

}  // namespace certkv::backend::cuda
