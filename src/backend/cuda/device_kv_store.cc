// The device KV store (backend/cuda/device_kv_store.h).
#include "backend/cuda/device_kv_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "attention/cuda/device_layer_params.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "backend/cuda/cuda_backend.h"
#include "cache/cuda/device_kv_cache.h"
#include "cache/cuda/device_pool.h"
#include "core/cuda_status.h"
#include "core/status.h"
#include "gate/meter.h"

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

// kInvalidArgument unless p is memory the store's device can read and write (device or managed
// memory of that device): a host or foreign pointer would fault in a launch, leaving an error in
// the CUDA context of the whole process.
void require_device_memory(const void* p, int device, const char* name) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // the query's error is not sticky: clear it
    fail(StatusCode::kInvalidArgument, std::string("device KV store: ") + name + " is not CUDA memory");
  }
  const bool ok = (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) && a.device == device;
  if (!ok)
    fail(StatusCode::kInvalidArgument, std::string("device KV store: ") + name + " is not memory of CUDA device " +
                                           std::to_string(device) + " (host or another device's memory)");
}

class DeviceKvStoreImpl final : public DeviceKvStore {
 public:
  DeviceKvStoreImpl(const DeviceKvStoreConfig& config, LayerCalibrator calibrate_layer, gate::Telemetry& telemetry)
      : config_(config), calibrate_layer_(std::move(calibrate_layer)), telemetry_(telemetry) {
    if (cudaGetDevice(&device_) != cudaSuccess) fail(StatusCode::kInternal, "device KV store: no current CUDA device");
    format_ = attention::cuda::page_format_of(config.layer.scheme, config.layer.witness);
    metered_ = attention::cuda::page_format_metered(format_);
    layers_.resize(size_t(config.n_layers));
    make_ring(config.n_sequences);
    // The error word, and a scratch word that resetting the split counters zeroes instead of it.
    throw_if_failed(DeviceBuffer::allocate(2 * sizeof(uint32_t), &error_word_));
    if (cudaMemsetAsync(error_word_.data(), 0, 2 * sizeof(uint32_t), stream()) != cudaSuccess)
      fail(StatusCode::kInternal, "device KV store: zeroing the error word failed");
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
    const Layer& l = layers_[size_t(layer)];
    if (!l.cache) fail(StatusCode::kInvalidArgument, "device KV store: layer " + std::to_string(layer) + " holds nothing");
    if (l.failed)
      fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                      " is not read after a failed append (make a new store)");
    require_device_memory(q, device_, "q");
    require_device_memory(out, device_, "out");
    if (meters != nullptr) require_device_memory(meters, device_, "meters");
    const size_t n = seqs.size();
    if (ring_used_ == kRingSteps) drain_ring();
    const size_t at = size_t(ring_used_++) * record_bytes_;
    int32_t* host_lens = reinterpret_cast<int32_t*>(host_ring_.data() + at);
    int64_t max_len = 0;
    for (size_t i = 0; i < n; ++i) {
      host_lens[i] = int32_t(length(seqs[i], layer));
      host_lens[size_t(ring_rows_) + i] = l.slots[size_t(seqs[i])];
      max_len = std::max<int64_t>(max_len, host_lens[i]);
    }
    int32_t* lens = reinterpret_cast<int32_t*>(ring_.data() + at);
    throw_if_failed(ring_.upload_async(at, host_lens, sizeof(int32_t) * 2 * size_t(ring_rows_), stream()));
    float* step_meters = reinterpret_cast<float*>(ring_.data() + at + meters_offset());

    PagedDecodeParams p;
    p.format = format_;
    p.batch = int(n);
    p.n_q_heads = config_.n_heads;
    p.n_kv_heads = config_.layer.n_kv_heads;
    p.head_dim = config_.layer.head_dim;
    p.block_tokens = config_.layer.block_tokens;
    p.sm_scale = config_.sm_scale;
    p.rope_half_split = config_.layer.rope_pairing == codec::RopePairing::kHalfSplit;
    p.witness = config_.layer.witness;
    p.delta_loc = config_.delta_loc;
    attention::cuda::set_layer_pages(l.cache->view(0), p);
    p.seq_lens = lens;
    p.table_rows = lens + ring_rows_;
    p.max_seq_len = max_len;
    p.split_blocks = kSplitBlocks;
    p.q = q;
    p.out = out;
    p.error_word = reinterpret_cast<uint32_t*>(error_word_.data());
    p.stream = config_.stream;
    const size_t H = size_t(config_.n_heads);
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
        zero.error_word = reinterpret_cast<uint32_t*>(error_word_.data()) + 1;
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
      ring_steps_.push_back({at, n});
    }
  }

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
    refuse_after_failure();
    // Every layer's cropped copy first: if one cannot be made, those made are freed and the store
    // is as it was.
    std::vector<int> made(layers_.size(), -1);
    try {
      for (size_t layer = 0; layer < layers_.size(); ++layer) {
        Layer& l = layers_[layer];
        if (l.cache && l.cache->written(l.slots[size_t(seq)], 0) != n_tokens)
          throw_if_failed(l.cache->fork_sequence(l.slots[size_t(seq)], n_tokens, &made[layer]));
      }
    } catch (...) {
      for (size_t layer = 0; layer < layers_.size(); ++layer)
        if (made[layer] >= 0) (void)layers_[layer].cache->free_sequence(made[layer]);
      throw;
    }
    for (size_t layer = 0; layer < layers_.size(); ++layer) {
      if (made[layer] < 0) continue;
      Layer& l = layers_[layer];
      throw_if_failed(l.cache->free_sequence(l.slots[size_t(seq)]));
      l.slots[size_t(seq)] = made[layer];
    }
  }

  void select(std::span<const int32_t> src) override {
    const DeviceScope scope(device_);
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
    s.bytes_reserved = ring_.size() + host_ring_.size() + workspace_.size();
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

 private:
  struct Layer {
    std::unique_ptr<DeviceKvCache> cache;
    std::vector<int> slots;  // the store's sequence i is slot slots[i] of the cache
    bool failed = false;
  };
  struct RingStep {
    size_t at = 0;  // the record's offset
    size_t rows = 0;
  };
  struct WorkspaceLayout {
    int batch = 0;
    int splits = 0;
    bool operator==(const WorkspaceLayout&) const = default;
  };

  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t meters_offset() const { return round_up(sizeof(int32_t) * 2 * size_t(ring_rows_)); }

  // The staging rings for decode steps of up to `rows` sequences. One record: lengths and table
  // rows up ([2][rows] int32), then the meters of the step ([3][rows][n_heads] float: meter,
  // A - 1, value side); A - 1 comes down.
  // The old rings are freed only once both new ones are made; the stream must not read them.
  void make_ring(int rows) {
    const size_t record_bytes = round_up(sizeof(int32_t) * 2 * size_t(rows)) +
                                round_up(sizeof(float) * 3 * size_t(rows) * size_t(config_.n_heads));
    DeviceBuffer ring;
    PinnedBuffer host_ring;
    throw_if_failed(DeviceBuffer::allocate(record_bytes * kRingSteps, &ring));
    throw_if_failed(PinnedBuffer::allocate(record_bytes * kRingSteps, &host_ring));
    ring_ = std::move(ring);
    host_ring_ = std::move(host_ring);
    record_bytes_ = record_bytes;
    ring_rows_ = rows;
  }

  void refuse_after_failure() const {
    for (size_t layer = 0; layer < layers_.size(); ++layer)
      if (layers_[layer].failed)
        fail(StatusCode::kInternal, "device KV store: layer " + std::to_string(layer) +
                                        " is not changed after a failed append (make a new store)");
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(config_.stream); }

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
  }

  // Corrupt entries counted by the launches so far (reads the word: waits for the stream).
  void check_error_word() {
    uint32_t corrupt = 0;
    throw_if_failed(cache::cuda::synchronize_stream(config_.stream));
    throw_if_failed(error_word_.download(0, &corrupt, sizeof(corrupt)));
    if (corrupt != 0)
      fail(StatusCode::kCorrupt, "device KV store: " + std::to_string(corrupt) +
                                     " corrupt page entries or lengths met by decode attention");
  }

  // Waits for the stream, records the ring's meters, starts the ring over.
  void drain_ring() {
    check_error_word();
    const size_t H = size_t(config_.n_heads);
    for (const RingStep& r : ring_steps_) {
      const float* a = reinterpret_cast<const float*>(host_ring_.data() + r.at + meters_offset()) + r.rows * H;
      for (size_t j = 0; j < r.rows * H; ++j) {
        const double a_minus_1 = double(a[j]);  // lifted on the device
        telemetry_.record(gate::meter_from_a_minus_1(a_minus_1), !std::isfinite(a_minus_1));
      }
    }
    ring_steps_.clear();
    ring_used_ = 0;
  }

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
  int64_t ring_used_ = 0;
  std::vector<RingStep> ring_steps_;
  gate::Telemetry& telemetry_;
  WorkspaceLayout workspace_layout_;
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
  if (attention::cuda::device_count() < 1)
    fail(StatusCode::kUnsupported, "device cuda: no CUDA device is visible to this process");
  return std::make_unique<DeviceKvStoreImpl>(config, std::move(calibrate_layer), telemetry);
}

}  // namespace certkv::backend::cuda
