#include "cache/cuda/device_kv_cache.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <string>
#include <utility>

#include "cache/cuda/append_rows_cuda.h"
#include "cache/cuda/place_encoded_cuda.h"
#include "codec/cuda/gaac_encode_cuda.h"
#include "codec/cuda/lossy_encode_cuda.h"
#include "codec/gaac.h"
#include "codec/gaac_fragments.h"
#include "codec/lossy_page.h"
#include "format/fp8.h"
#include "format/fragment_layout.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::cache::cuda {
namespace {

// Table entries of blocks not written yet: read by no kernel (lengths stop before them), and
// outside every pool if they were.
constexpr int32_t kUnwritten = std::numeric_limits<int32_t>::min();
// First capacities of the pools, in pages: raw pages for 4 blocks of each (K/V, kv_head) of a
// layer; slots for 64 blocks of each kv_head. Both double when full (and never shrink: the raw
// pool keeps the size of the largest prefill chunk, all raw until its blocks are encoded).
constexpr int64_t kFirstRawBlocks = 4;
constexpr int64_t kFirstSlotBlocks = 64;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Whether p points into device memory (rows written by the device's own forward pass).
bool on_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // an unregistered host pointer on older runtimes: not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

CudaStatus cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return cuda_error(StatusCode::kInternal, std::string(what) + " failed: " + cudaGetErrorString(e));
}

size_t round16(size_t n) { return (n + 15) / 16 * 16; }

// Replaces buf by a buffer of new_bytes holding its first old_bytes (ordered on the stream).
CudaStatus grow(DeviceBuffer& buf, size_t old_bytes, size_t new_bytes, void* stream) {
  DeviceBuffer bigger;
  CudaStatus s = DeviceBuffer::allocate(new_bytes, &bigger);
  if (!s.ok) return s;
  if (old_bytes > 0) {
    s = cuda_check(cudaMemcpyAsync(bigger.data(), buf.data(), old_bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
                   "pool growth copy");
    if (!s.ok) return s;
    s = cuda_check(cudaStreamSynchronize(as_stream(stream)), "pool growth");
    if (!s.ok) return s;
  }
  buf = std::move(bigger);
  return {};
}

format::GaacElement scheme_element(KvScheme scheme) {
  return scheme == KvScheme::kGaacE5M2 ? format::GaacElement::kFp8E5M2 : format::GaacElement::kBf16;
}

bool lossy_on_device(KvScheme scheme) {
  return scheme == KvScheme::kFp8E4M3 || scheme == KvScheme::kFp8E5M2 || scheme == KvScheme::kDither8;
}

}  // namespace

bool device_kv_serves(KvScheme scheme) {
  return scheme == KvScheme::kBf16 || scheme == KvScheme::kGaac || scheme == KvScheme::kGaacE5M2 ||
         lossy_on_device(scheme);
}

// A pool of fixed-stride pages with a host free list; pages [0, next) were handed out.
struct PagePool {
  DeviceBuffer buffer;
  size_t stride = 0;
  int64_t capacity = 0;
  int64_t next = 0;
  int64_t in_use = 0;
  std::vector<int32_t> free;
  std::vector<uint32_t> refs;  // [page]: tables naming it

  CudaStatus take(int64_t first_capacity, void* stream, int32_t* page) {
    if (!free.empty()) {
      *page = free.back();
      free.pop_back();
    } else {
      if (next == capacity) {
        // A quarter more each time: a pool holds at most 1.25x the pages it handed out (doubling
        // let a long prompt's pools reach 2x, more than a bf16 cache of the same tokens), and
        // each page is copied about four times on the way, a device-to-device copy per growth.
        const int64_t grown = std::max<int64_t>(first_capacity, capacity + std::max<int64_t>(1, capacity / 4));
        if (grown > std::numeric_limits<int32_t>::max())
          return cuda_error(StatusCode::kOutOfMemory, "a device page pool would pass 2^31 pages");
        CudaStatus s = grow(buffer, size_t(capacity) * stride, size_t(grown) * stride, stream);
        if (!s.ok) return s;
        capacity = grown;
      }
      *page = int32_t(next++);
    }
    if (refs.size() <= size_t(*page)) refs.resize(size_t(capacity), 0);
    refs[size_t(*page)] = 1;
    ++in_use;
    return {};
  }
  void retain(int32_t page) { ++refs[size_t(page)]; }
  bool shared(int32_t page) const { return refs[size_t(page)] > 1; }
  void give_back(int32_t page) {
    if (--refs[size_t(page)] > 0) return;
    free.push_back(page);
    --in_use;
  }
  void clear() {
    free.clear();
    std::fill(refs.begin(), refs.end(), 0u);
    next = 0;
    in_use = 0;
  }
};

struct DeviceKvCache::Layer {
  PagePool raw;                    // bf16: every page; GAAC, lossy: tails, blocks kept raw
  PagePool slots[2];               // GAAC: K and V slots; lossy: K and V pages
  size_t escape_capacity[2] = {0, 0};
  std::vector<uint32_t> slot_used[2];  // GAAC: used bytes of each slot (read_page)
  DeviceBuffer tables;             // [slot][2][n_kv_heads][table_stride] int32
  std::vector<int32_t> host_tables;
  std::vector<CompletedExactPage> completed_exact;  // hold_completed_exact: held raw pages
  DeviceBuffer bases;              // GAAC: [2][n_kv_heads][2][head_dim]
  DeviceBuffer index_records;      // key index: [slot][n_kv_heads][index_record_stride_] records
  DeviceBuffer index_centroids;    // key index: [slot][n_kv_heads][2][head_dim] float
  DeviceBuffer dither_keys;        // dither8: [2][n_kv_heads] uint64
  DeviceBuffer outlier_pairs;      // dither8: [n_kv_heads][m] uint16 (the encoder's lists)
  std::vector<uint16_t> host_outlier_pairs;  // dither8: the same, on the host (read_rows)
  DeviceBuffer outlier_channels;   // dither8: [n_kv_heads][2 m] int32 (the kernels' channels)
  std::vector<uint8_t> outliers_chosen;  // dither8: [n_kv_heads]
  bool all_outliers_chosen() const {
    return std::all_of(outliers_chosen.begin(), outliers_chosen.end(), [](uint8_t c) { return c != 0; });
  }
  // dither8: per slot, its K rows of positions [0, block_tokens), rounded to bf16, of each head
  // whose pairs are not chosen yet: [n_kv_heads][block_tokens][head_dim] (each slot's own: the
  // first block finalized, of whichever slot, chooses from its own rows).
  std::unordered_map<int, std::vector<float>> first_rows;
};

DeviceKvCache::~DeviceKvCache() {
  if (results_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(results_event_));
}

CudaStatus DeviceKvCache::create(const DeviceKvCacheConfig& config, std::unique_ptr<DeviceKvCache>* out) {
  const KvScheme scheme = config.scheme;
  if (!device_kv_serves(scheme))
    return cuda_error(StatusCode::kUnsupported, std::string("device KV cache: scheme ") + kv_scheme_name(scheme) +
                                                    " is not served on the device (bf16, gaac, gaac-e5m2, "
                                                    "fp8-e4m3, fp8-e5m2, dither8 are)");
  if (config.n_layers < 1 || config.n_kv_heads < 1 || config.head_dim < 8 || config.block_tokens < 1 ||
      config.max_tokens < 1 || config.max_tokens > std::numeric_limits<int32_t>::max())
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: n_layers, n_kv_heads, block_tokens and "
                                                    "max_tokens must be >= 1 (max_tokens below 2^31: lengths "
                                                    "are int32 on the device) and head_dim >= 8");
  if (config.index_record_bytes % 8 != 0 || config.index_record_bytes > 256)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: index_record_bytes " +
                                                        std::to_string(config.index_record_bytes) +
                                                        " is not a record size (a multiple of 8, at most 256)");
  // The scheme table decides the pages' byte order on the device (kv_scheme_device_fragment_pages).
  const bool fragment_pages = kv_scheme_device_fragment_pages(scheme, config.witness);
  if (fragment_pages && (config.block_tokens != format::fragment::kPageTokens || config.head_dim % 16 != 0))
    return cuda_error(StatusCode::kUnsupported,
                      std::string("device KV cache: scheme ") + kv_scheme_name(scheme) + " stores fragment-major pages of " +
                          std::to_string(format::fragment::kPageTokens) +
                          " tokens and a head_dim that is a multiple of 16, not block_tokens " +
                          std::to_string(config.block_tokens) + ", head_dim " + std::to_string(config.head_dim));
  const bool gaac = kv_scheme_is_gaac(scheme);
  const bool lossy = lossy_on_device(scheme);
  // gaac: pages in the device layout (codec/gaac_fragments.h), which the kernels read at head_dim
  // 64 and 128; gaac-e5m2 keeps the GAAC slots.
  if (fragment_pages && gaac && (scheme_element(scheme) != format::GaacElement::kBf16 || (config.head_dim != 64 && config.head_dim != 128)))
    return cuda_error(StatusCode::kUnsupported, std::string("device KV cache: scheme ") + kv_scheme_name(scheme) +
                                                    " stores GAAC device pages of bf16 at head_dim 64 or 128, not " +
                                                    std::to_string(config.head_dim));
  const format::GaacElement element = scheme_element(scheme);
  int n_outlier_pairs = 0;
  if (lossy) {
    if (scheme == KvScheme::kDither8)
      n_outlier_pairs = config.outlier_pairs < 0 ? kDefaultOutlierPairs : config.outlier_pairs;
    else if (config.outlier_pairs > 0)
      return cuda_error(StatusCode::kInvalidArgument, std::string("device KV cache: outlier pairs apply to dither8 "
                                                                  "only (scheme ") + kv_scheme_name(scheme) + ")");
    if (n_outlier_pairs > kMaxOutlierPairsOnDevice)
      return cuda_error(StatusCode::kUnsupported, "device KV cache: " + std::to_string(n_outlier_pairs) +
                                                      " outlier pairs per head; the device serves at most " +
                                                      std::to_string(kMaxOutlierPairsOnDevice));
  }
  if (gaac) {
    if (format::gaac_tile_channels(config.head_dim) == 0)
      return cuda_error(StatusCode::kUnsupported, "device KV cache: head_dim " + std::to_string(config.head_dim) +
                                                      " does not split into GAAC tiles");
    const codec::GaacShape want{config.n_layers, config.n_kv_heads, config.head_dim, config.block_tokens, element};
    if (!config.gaac_calibration || !(config.gaac_calibration->shape() == want))
      return cuda_error(StatusCode::kInvalidArgument,
                        std::string("device KV cache: scheme ") + kv_scheme_name(scheme) +
                            " needs a GAAC calibration of element " + codec::gaac_element_name(element) +
                            " and the model's shape");
  }
  std::unique_ptr<DeviceKvCache> c(new DeviceKvCache());
  c->config_ = config;
  c->lossy_ = lossy;
  c->fragment_pages_ = fragment_pages;
  c->n_outlier_pairs_ = n_outlier_pairs;
  c->placeholder_pairs_.resize(size_t(n_outlier_pairs));
  for (int j = 0; j < n_outlier_pairs; ++j) c->placeholder_pairs_[size_t(j)] = uint16_t(j);
  if (lossy) {
    c->lossy_scheme_ = kv_scheme_lossy(scheme);
    for (bool key : {true, false}) {
      const CudaStatus spec_ok = codec::cuda::check_lossy_encode(c->lossy_spec(key), 0, nullptr, nullptr, c->encode_layout());
      if (!spec_ok.ok) return cuda_error(spec_ok.code, "device KV cache: " + spec_ok.message);
    }
  }
  c->table_stride_ = (config.max_tokens + config.block_tokens - 1) / config.block_tokens;
  if (config.index_record_tokens < 0)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: index_record_tokens must be >= 0");
  {
    const int64_t context = c->table_stride_ * config.block_tokens;
    const int64_t wanted = (config.index_record_tokens + config.block_tokens - 1) / config.block_tokens * config.block_tokens;
    c->index_record_stride_ = config.index_record_tokens == 0 ? context : std::min(context, wanted);
  }
  c->raw_bytes_ = size_t(config.block_tokens) * size_t(config.head_dim) * size_t(format::gaac_element_bytes(element));
  if (config.sequences < 0)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: sequences at create must be >= 0");
  const int H = config.n_kv_heads;
  const int D = config.head_dim;
  CudaStatus s = {};
  for (int l = 0; s.ok && l < config.n_layers; ++l) {
    auto layer = std::make_unique<Layer>();
    layer->raw.stride = round16(c->raw_bytes_);
    if (s.ok && gaac) {
      std::vector<uint8_t> bases(size_t(2) * H * 2 * D);
      for (int kv = 0; kv < 2; ++kv) {
        layer->escape_capacity[kv] = config.gaac_calibration->escape_capacity_bytes(l, kv);
        layer->slots[kv].stride =
            round16(fragment_pages ? size_t(format::fragment::gaac_page_bytes(D))
                                   : format::gaac_slot_bytes(element, config.block_tokens, D, layer->escape_capacity[kv]));
        for (int h = 0; h < H; ++h) {
          const codec::GaacBases& gb = config.gaac_calibration->bases(l, kv, h);
          if (fragment_pages && *std::max_element(gb.b4.begin(), gb.b4.end()) > 240)
            s = cuda_error(StatusCode::kInvalidArgument, "device KV cache: a GAAC calibration window base above 240");
          std::copy_n(gb.b3.begin(), D, bases.begin() + ((size_t(kv) * H + h) * 2 + 0) * D);
          std::copy_n(gb.b4.begin(), D, bases.begin() + ((size_t(kv) * H + h) * 2 + 1) * D);
        }
      }
      if (s.ok) s = DeviceBuffer::allocate(bases.size(), &layer->bases);
      if (s.ok) s = layer->bases.upload(0, bases.data(), bases.size());
    }
    if (s.ok && lossy) {
      for (int kv = 0; kv < 2; ++kv) layer->slots[kv].stride = round16(codec::lossy_page_bytes(c->lossy_spec(kv == 0)));
      if (scheme == KvScheme::kDither8) {
        std::vector<uint64_t> keys(size_t(2) * H);
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < H; ++h) keys[size_t(kv) * H + h] = codec::dither8_key(config.first_model_layer + l, kv == 0, h);
        s = DeviceBuffer::allocate(keys.size() * sizeof(uint64_t), &layer->dither_keys);
        if (s.ok) s = layer->dither_keys.upload(0, keys.data(), keys.size() * sizeof(uint64_t));
        layer->outliers_chosen.assign(size_t(H), n_outlier_pairs == 0 ? 1 : 0);
        if (n_outlier_pairs > 0) {
          if (s.ok) s = DeviceBuffer::allocate(sizeof(uint16_t) * size_t(H) * n_outlier_pairs, &layer->outlier_pairs);
          if (s.ok)
            s = DeviceBuffer::allocate(sizeof(int32_t) * size_t(H) * 2 * n_outlier_pairs, &layer->outlier_channels);
          // Until a head's pairs are chosen its decode steps read raw pages only, yet the kernels
          // load (and check) its outlier channels: the placeholder pairs', never uninitialized
          // memory, which they would count as corrupt channels.
          for (int h = 0; h < H && s.ok; ++h) s = c->upload_outliers(*layer, h, c->placeholder_pairs_.data());
        }
      }
    }
    c->layers_.push_back(std::move(layer));
  }
  if (s.ok && n_outlier_pairs > 0 && config.fixed_outlier_pairs) {
    const std::vector<uint16_t>& fixed = *config.fixed_outlier_pairs;
    if (fixed.size() != size_t(config.n_layers) * size_t(H) * size_t(n_outlier_pairs))
      return cuda_error(StatusCode::kInvalidArgument,
                        "device KV cache: fixed_outlier_pairs holds " + std::to_string(fixed.size()) +
                            " pair indices, not n_layers x n_kv_heads x " + std::to_string(n_outlier_pairs));
    for (int l = 0; s.ok && l < config.n_layers; ++l)
      for (int h = 0; s.ok && h < H; ++h) {
        const uint16_t* pairs = fixed.data() + (size_t(l) * size_t(H) + size_t(h)) * size_t(n_outlier_pairs);
        for (int j = 0; j < n_outlier_pairs; ++j)
          if (pairs[j] >= D / 2 || (j > 0 && pairs[j] <= pairs[j - 1]))
            return cuda_error(StatusCode::kInvalidArgument,
                              "device KV cache: fixed outlier pairs of layer " + std::to_string(l) + ", kv head " +
                                  std::to_string(h) + " are not increasing pair indices below head_dim / 2");
        s = c->set_outliers(l, h, pairs);
      }
  }
  if (s.ok) s = c->grow_slots(std::max(config.sequences, 1));
  for (int i = 0; s.ok && i < config.sequences; ++i) {
    int slot = 0;
    s = c->create_sequence(&slot);
  }
  if (!s.ok) return s;
  *out = std::move(c);
  return {};
}

CudaStatus DeviceKvCache::grow_slots(int64_t slots) {
  if (slots <= slot_capacity_) return {};
  const int64_t grown = std::max<int64_t>(slots, slot_capacity_ * 2);
  const size_t per_slot = size_t(2) * size_t(config_.n_kv_heads) * size_t(table_stride_);
  // The host tables go up whole below: they must hold the deferred placements first.
  CudaStatus s = reconcile_encodes();
  if (!s.ok) return s;
  // The stream may still read the old tables and lengths.
  s = cuda_check(cudaStreamSynchronize(as_stream(config_.stream)), "table growth");
  for (auto& layer : layers_) {
    if (!s.ok) return s;
    layer->host_tables.resize(per_slot * size_t(grown), kUnwritten);
    s = DeviceBuffer::allocate(layer->host_tables.size() * sizeof(int32_t), &layer->tables);
    if (s.ok) s = upload_tables(*layer);
  }
  if (!s.ok) return s;
  if (config_.index_record_bytes > 0) {
    const size_t records = size_t(config_.n_kv_heads) * size_t(index_record_stride_) * config_.index_record_bytes;
    const size_t centroids = size_t(config_.n_kv_heads) * 2 * size_t(config_.head_dim) * sizeof(float);
    for (auto& layer : layers_) {
      s = grow(layer->index_records, records * size_t(slot_capacity_), records * size_t(grown), config_.stream);
      if (s.ok)
        s = grow(layer->index_centroids, centroids * size_t(slot_capacity_), centroids * size_t(grown), config_.stream);
      if (!s.ok) return s;
    }
  }
  const size_t old_lengths = lengths_.size();
  s = grow(lengths_, old_lengths, sizeof(int32_t) * size_t(grown) * size_t(config_.n_layers), config_.stream);
  if (s.ok)
    s = cuda_check(cudaMemsetAsync(lengths_.data() + old_lengths, 0, lengths_.size() - old_lengths,
                                   as_stream(config_.stream)),
                   "length growth");
  if (!s.ok) return s;
  written_.resize(size_t(grown) * size_t(config_.n_layers), 0);
  live_.resize(size_t(grown), 0);
  for (int64_t slot = grown - 1; slot >= slot_capacity_; --slot) free_slots_.push_back(int(slot));
  slot_capacity_ = grown;
  return {};
}

CudaStatus DeviceKvCache::upload_slot_lengths(int slot) {
  std::vector<int32_t> lengths(size_t(config_.n_layers));
  for (int l = 0; l < config_.n_layers; ++l) lengths[size_t(l)] = int32_t(written(slot, l));
  // Pageable host memory: staged before cudaMemcpyAsync returns.
  return cuda_check(cudaMemcpyAsync(lengths_.data() + sizeof(int32_t) * size_t(slot) * size_t(config_.n_layers),
                                    lengths.data(), sizeof(int32_t) * lengths.size(), cudaMemcpyHostToDevice,
                                    as_stream(config_.stream)),
                    "length upload");
}

CudaStatus DeviceKvCache::create_sequence(int* slot) {
  if (slot == nullptr) return cuda_error(StatusCode::kInvalidArgument, "device KV cache: create_sequence needs a slot");
  if (broken_)
    return cuda_error(StatusCode::kInternal, "device KV cache: an earlier call failed (" + broken_reason_ +
                                                 "); its pages and tables are no longer trusted: reset() it");
  if (free_slots_.empty()) {
    const CudaStatus s = grow_slots(slot_capacity_ + 1);
    if (!s.ok) return s;
  }
  *slot = free_slots_.back();
  free_slots_.pop_back();
  live_[size_t(*slot)] = 1;
  std::fill_n(written_.begin() + ptrdiff_t(*slot) * config_.n_layers, config_.n_layers, 0);
  // The slot's tables are unwritten (a freed slot's were reset); its lengths start at 0.
  return upload_slot_lengths(*slot);
}

void DeviceKvCache::release_entry(Layer& layer, int kv, int32_t entry) {
  if (entry == kUnwritten) return;
  const bool coded = config_.scheme != KvScheme::kBf16;
  if (!coded)
    layer.raw.give_back(entry);
  else if (entry < 0)
    layer.raw.give_back(-entry - 1);
  else
    layer.slots[kv].give_back(entry);
}

void DeviceKvCache::release_blocks(Layer& layer, int slot, int64_t block_begin, int64_t block_end) {
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < config_.n_kv_heads; ++h)
      for (int64_t b = block_begin; b < block_end; ++b) {
        int32_t& entry = layer.host_tables[entry_index(slot, kv, h, b)];
        release_entry(layer, kv, entry);
        entry = kUnwritten;
      }
}

CudaStatus DeviceKvCache::free_sequence(int slot) {
  if (!live(slot))
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: slot " + std::to_string(slot) + " is not live");
  // The pages to give back are those the reconciled host tables name.
  CudaStatus s = reconcile_encodes();
  if (!s.ok) return s;
  for (int l = 0; l < config_.n_layers; ++l) {
    Layer& layer = *layers_[size_t(l)];
    const int64_t blocks = (written(slot, l) + config_.block_tokens - 1) / config_.block_tokens;
    release_blocks(layer, slot, 0, blocks);
    if (s.ok && blocks > 0) s = upload_table_blocks(layer, slot, 0, blocks);
  }
  live_[size_t(slot)] = 0;
  std::fill_n(written_.begin() + ptrdiff_t(slot) * config_.n_layers, config_.n_layers, 0);
  free_slots_.push_back(slot);
  if (!s.ok) {
    broken_ = true;
    broken_reason_ = s.message;
  }
  return s;
}

CudaStatus DeviceKvCache::fork_prefix(int parent, int64_t n_tokens, int* child) {
  if (child == nullptr) return cuda_error(StatusCode::kInvalidArgument, "device KV cache: fork_prefix needs a slot");
  if (!live(parent))
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: slot " + std::to_string(parent) + " is not live");
  const int T = config_.block_tokens;
  for (int l = 0; l < config_.n_layers; ++l)
    if (n_tokens < 0 || n_tokens % T != 0 || n_tokens > written(parent, l))
      return cuda_error(StatusCode::kInvalidArgument,
                        "device KV cache: a shared prefix is whole blocks the parent has written (" +
                            std::to_string(n_tokens) + " tokens, layer " + std::to_string(l) + " holds " +
                            std::to_string(written(parent, l)) + ")");
  // The parent's entries are copied from the host tables: reconciled first.
  CudaStatus s = reconcile_encodes();
  if (s.ok) s = create_sequence(child);
  if (!s.ok) return s;
  const int H = config_.n_kv_heads;
  const bool coded = config_.scheme != KvScheme::kBf16;
  const int64_t blocks = n_tokens / T;
  for (int l = 0; l < config_.n_layers && s.ok; ++l) {
    Layer& layer = *layers_[size_t(l)];
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h)
        for (int64_t b = 0; b < blocks; ++b) {
          const int32_t entry = layer.host_tables[entry_index(parent, kv, h, b)];
          if (!coded)
            layer.raw.retain(entry);
          else if (entry < 0)
            layer.raw.retain(-entry - 1);
          else
            layer.slots[kv].retain(entry);
          layer.host_tables[entry_index(*child, kv, h, b)] = entry;
        }
    written_[size_t(*child) * size_t(config_.n_layers) + size_t(l)] = n_tokens;
    if (blocks > 0) s = upload_table_blocks(layer, *child, 0, blocks);
  }
  if (s.ok) s = upload_slot_lengths(*child);
  if (!s.ok) {
    broken_ = true;
    broken_reason_ = s.message;
  }
  return s;
}

CudaStatus DeviceKvCache::reserve_index_records(int64_t tokens) {
  if (config_.index_record_bytes == 0)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: reserve_index_records without a key index");
  const int64_t T = config_.block_tokens, context = table_stride_ * T;
  if (tokens < 0 || tokens > context)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: " + std::to_string(tokens) +
                                                        " index records per head past the context of " +
                                                        std::to_string(context));
  if (tokens <= index_record_stride_) return {};
  // Doubling, in whole blocks, up to the context: a sequence's records grow in O(log) copies.
  const int64_t grown = std::min(context, std::max((tokens + T - 1) / T * T, 2 * index_record_stride_));
  const size_t rb = config_.index_record_bytes, rows = size_t(slot_capacity_) * size_t(config_.n_kv_heads);
  std::vector<DeviceBuffer> bigger(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    CudaStatus s = DeviceBuffer::allocate(rows * size_t(grown) * rb, &bigger[l]);
    if (!s.ok) return s;  // nothing changed
  }
  for (size_t l = 0; l < layers_.size() && rows > 0; ++l) {
    const CudaStatus s = cuda_check(
        cudaMemcpy2DAsync(bigger[l].data(), size_t(grown) * rb, layers_[l]->index_records.data(),
                          size_t(index_record_stride_) * rb, size_t(index_record_stride_) * rb, rows,
                          cudaMemcpyDeviceToDevice, as_stream(config_.stream)),
        "index record growth copy");
    if (!s.ok) return s;  // the old records are intact
  }
  const CudaStatus s = cuda_check(cudaStreamSynchronize(as_stream(config_.stream)), "index record growth");
  if (!s.ok) return s;
  for (size_t l = 0; l < layers_.size(); ++l) layers_[l]->index_records = std::move(bigger[l]);
  index_record_stride_ = grown;
  return {};
}

CudaStatus DeviceKvCache::fork_sequence(int parent, int64_t n_tokens, int* child) {
  if (child == nullptr) return cuda_error(StatusCode::kInvalidArgument, "device KV cache: fork_sequence needs a slot");
  if (!live(parent))
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: slot " + std::to_string(parent) + " is not live");
  const int T = config_.block_tokens;
  const int H = config_.n_kv_heads;
  const int D = config_.head_dim;
  const int64_t whole = n_tokens / T * T;
  const int64_t tail = n_tokens - whole;
  for (int l = 0; l < config_.n_layers; ++l)
    if (n_tokens < 0 || n_tokens > written(parent, l))
      return cuda_error(StatusCode::kInvalidArgument, "device KV cache: fork_sequence of " + std::to_string(n_tokens) +
                                                          " positions; layer " + std::to_string(l) + " holds " +
                                                          std::to_string(written(parent, l)));
  if (tail == 0) return fork_prefix(parent, n_tokens, child);
  // The partial block's entries, as the reconciled host tables name them.
  CudaStatus s = reconcile_encodes();
  if (!s.ok) return s;
  const bool coded = config_.scheme != KvScheme::kBf16;
  const int64_t block = whole / T;
  auto raw_entry = [&](int32_t entry) { return !coded || entry < 0; };
  for (int l = 0; l < config_.n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h)
        if (lossy_ && !raw_entry(layers_[size_t(l)]->host_tables[entry_index(parent, kv, h, block)]))
          return cuda_error(StatusCode::kUnsupported,
                            "device KV cache: " + std::to_string(n_tokens) + " positions end inside block " +
                                std::to_string(block) + ", which the device keeps only as a lossy " +
                                kv_scheme_name(config_.scheme) + " page (layer " + std::to_string(l) +
                                "): its exact values are not kept; keep a multiple of " + std::to_string(T));
  s = fork_prefix(parent, whole, child);
  if (!s.ok) return s;
  std::vector<float> rows;
  for (int l = 0; l < config_.n_layers && s.ok; ++l) {
    Layer& layer = *layers_[size_t(l)];
    bool all_raw = !choosing_outliers(l);  // a head still choosing its pairs takes the rows through write()
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h) all_raw = all_raw && raw_entry(layer.host_tables[entry_index(parent, kv, h, block)]);
    if (all_raw) {
      // The parent's raw pages of the block, copied into pages of the child's own on the stream
      // (rows past the tail are copied too: a raw page's later rows are not read). The child's
      // length first: a failure halfway frees the entries set so far with the child.
      written_[size_t(*child) * size_t(config_.n_layers) + size_t(l)] = n_tokens;
      for (int kv = 0; kv < 2 && s.ok; ++kv)
        for (int h = 0; h < H && s.ok; ++h) {
          const int32_t from = layer.host_tables[entry_index(parent, kv, h, block)];
          const int64_t from_page = coded ? -int64_t(from) - 1 : from;
          int32_t page = 0;
          s = layer.raw.take(kFirstRawBlocks * 2 * H, config_.stream, &page);
          if (!s.ok) break;
          s = cuda_check(cudaMemcpyAsync(layer.raw.buffer.data() + size_t(page) * layer.raw.stride,
                                         layer.raw.buffer.data() + size_t(from_page) * layer.raw.stride, raw_bytes_,
                                         cudaMemcpyDeviceToDevice, as_stream(config_.stream)),
                         "tail page copy");
          layer.host_tables[entry_index(*child, kv, h, block)] = coded ? -page - 1 : page;
        }
      if (s.ok) s = upload_table_blocks(layer, *child, block, block + 1);
      continue;
    }
    // Decoded on the host (a lossless page cropped inside its block) and written again: the rows
    // are the values the pages hold exactly, so the write stores them as they were.
    rows.assign(2 * size_t(tail) * size_t(H) * size_t(D), 0.f);
    std::vector<float> head(size_t(tail) * size_t(D));
    for (int kv = 0; kv < 2 && s.ok; ++kv)
      for (int h = 0; h < H && s.ok; ++h) {
        s = read_rows(parent, l, KvTensor(kv), h, whole, n_tokens, head.data());
        for (int64_t t = 0; s.ok && t < tail; ++t)
          std::copy_n(head.data() + size_t(t) * size_t(D), D,
                      rows.data() + ((size_t(kv) * size_t(tail) + size_t(t)) * size_t(H) + size_t(h)) * size_t(D));
      }
    if (s.ok) s = write(*child, l, rows.data(), rows.data() + size_t(tail) * size_t(H) * size_t(D), tail);
  }
  if (s.ok) s = upload_slot_lengths(*child);
  if (!s.ok) {
    // The parent is untouched: the child goes, and the cache stays usable unless a copy or launch
    // failed (write() marks its own failures) or the child cannot be freed.
    const CudaStatus freed = free_sequence(*child);
    *child = -1;
    if (!freed.ok || s.code == StatusCode::kInternal) {
      broken_ = true;
      broken_reason_ = s.message;
    }
  }
  return s;
}

DeviceSequenceBytes DeviceKvCache::sequence_bytes(int slot) const {
  DeviceSequenceBytes bytes;
  if (!live(slot)) return bytes;
  const bool coded = config_.scheme != KvScheme::kBf16;
  for (int l = 0; l < config_.n_layers; ++l) {
    const Layer& layer = *layers_[size_t(l)];
    const int64_t blocks = (written(slot, l) + config_.block_tokens - 1) / config_.block_tokens;
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < config_.n_kv_heads; ++h)
        for (int64_t b = 0; b < blocks; ++b) {
          const int32_t entry = layer.host_tables[entry_index(slot, kv, h, b)];
          if (coded && entry >= 0)
            bytes.coded += layer.slots[kv].stride;
          else
            bytes.raw += layer.raw.stride;
        }
  }
  return bytes;
}

uint64_t DeviceKvCache::pages_referenced(std::span<const int> slots) const {
  // A page is (layer, pool, index): a coded scheme's K or V slot pool (entry >= 0), else the
  // layer's raw pool.
  const bool coded = config_.scheme != KvScheme::kBf16;
  std::vector<uint64_t> pages;
  for (int slot : slots) {
    if (!live(slot)) continue;
    for (int l = 0; l < config_.n_layers; ++l) {
      const Layer& layer = *layers_[size_t(l)];
      const int64_t blocks = (written(slot, l) + config_.block_tokens - 1) / config_.block_tokens;
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < config_.n_kv_heads; ++h)
          for (int64_t b = 0; b < blocks; ++b) {
            const int32_t entry = layer.host_tables[entry_index(slot, kv, h, b)];
            if (entry == kUnwritten) continue;
            const uint64_t pool = coded && entry >= 0 ? uint64_t(kv) : 2;
            pages.push_back(uint64_t(l) << 40 | pool << 32 | uint32_t(entry));
          }
    }
  }
  std::sort(pages.begin(), pages.end());
  return uint64_t(std::unique(pages.begin(), pages.end()) - pages.begin());
}

CudaStatus DeviceKvCache::upload_tables(const Layer& layer) {
  return cuda_check(cudaMemcpyAsync(layer.tables.data(), layer.host_tables.data(),
                                    layer.host_tables.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                    as_stream(config_.stream)),
                    "block table upload");
}

CudaStatus DeviceKvCache::upload_table_blocks(const Layer& layer, int slot, int64_t block_begin, int64_t block_end) {
  // Entries [block_begin, block_end) of every (K/V, kv_head) table of the slot: one 2D copy.
  const size_t pitch = sizeof(int32_t) * size_t(table_stride_);
  const size_t first = entry_index(slot, 0, 0, block_begin);
  return cuda_check(cudaMemcpy2DAsync(layer.tables.data() + sizeof(int32_t) * first, pitch,
                                      layer.host_tables.data() + first, pitch,
                                      sizeof(int32_t) * size_t(block_end - block_begin),
                                      size_t(2) * size_t(config_.n_kv_heads), cudaMemcpyHostToDevice,
                                      as_stream(config_.stream)),
                    "block table upload");
}

CudaStatus DeviceKvCache::write(int slot, int layer_index, const float* k, const float* v, int64_t n) {
  const SlotRows w{slot, k, v, n};
  return write_rows(layer_index, &w, 1);
}

CudaStatus DeviceKvCache::check_writable(int layer_index) const {
  if (broken_)
    return cuda_error(StatusCode::kInternal, "device KV cache: an earlier call failed (" + broken_reason_ +
                                                 "); its pages and tables are no longer trusted: reset() it");
  if (layer_index < 0 || layer_index >= config_.n_layers)
    return cuda_error(StatusCode::kOutOfRange, "device KV cache: layer " + std::to_string(layer_index) + " of " +
                                                   std::to_string(config_.n_layers));
  return {};
}

CudaStatus DeviceKvCache::write_rows(int layer_index, const SlotRows* writes, size_t count) {
  if (CudaStatus s = check_writable(layer_index); !s.ok) return s;
  for (size_t i = 0; i < count; ++i) {
    const SlotRows& w = writes[i];
    if (!live(w.slot))
      return cuda_error(StatusCode::kInvalidArgument, "device KV cache: slot " + std::to_string(w.slot) + " is not live");
    for (size_t j = 0; j < i; ++j)
      if (writes[j].slot == w.slot)
        return cuda_error(StatusCode::kInvalidArgument,
                          "device KV cache: slot " + std::to_string(w.slot) + " is written twice in one call");
    const int64_t first = written(w.slot, layer_index);
    if (w.n < 0 || w.n > config_.max_tokens - first)
      return cuda_error(StatusCode::kOutOfRange, "device KV cache: " + std::to_string(w.n) + " tokens after " +
                                                     std::to_string(first) + " pass the capacity of " +
                                                     std::to_string(config_.max_tokens));
    if (w.n > 0 && (w.k == nullptr || w.v == nullptr))
      return cuda_error(StatusCode::kInvalidArgument, "device KV cache: write needs its K and V rows");
  }
  // From here a failure leaves pages taken and tables half updated: the cache refuses every
  // call but reset() after one.
  // While dither8's outlier pairs are being chosen, the writes go one after another (each one's
  // blocks finalized before the next one's rows are noted: KvCache's order).
  CudaStatus s = {};
  if (n_outlier_pairs_ > 0 && !layers_[size_t(layer_index)]->all_outliers_chosen())
    for (size_t i = 0; i < count && s.ok; ++i) s = append(layer_index, writes + i, 1);
  else
    s = append(layer_index, writes, count);
  if (!s.ok) {
    broken_ = true;
    broken_reason_ = s.message;
  }
  return s;
}

CudaStatus DeviceKvCache::append(int layer_index, const SlotRows* writes, size_t count) {
  const int H = config_.n_kv_heads;
  const int D = config_.head_dim;
  const int T = config_.block_tokens;
  Layer& layer = *layers_[size_t(layer_index)];
  void* stream = config_.stream;
  // GAAC and lossy tables name raw pages by -r - 1.
  const bool coded = config_.scheme != KvScheme::kBf16;
  std::vector<int64_t> firsts(count);
  std::vector<uint8_t> device_rows(count);
  size_t host_floats = 0;  // rows to stage
  for (size_t i = 0; i < count; ++i) {
    const SlotRows& w = writes[i];
    const int64_t first = firsts[i] = written(w.slot, layer_index);
    if (w.n == 0) continue;
    device_rows[i] = w.memory == RowsMemory::kAsk ? on_device(w.k) && on_device(w.v) : w.memory == RowsMemory::kDevice;
    if (!device_rows[i]) host_floats += 2 * size_t(w.n) * H * D;
    if (n_outlier_pairs_ > 0 && !layer.all_outliers_chosen()) {
      // The choice reads the rows on the host: device rows come down for it (until it is made).
      const float* host_k = w.k;
      std::vector<float> copy;
      if (on_device(w.k)) {
        // On the cache's stream, after the work that wrote the rows (a non-blocking stream does
        // not wait for the legacy default stream), then waited for.
        copy.resize(size_t(w.n) * H * D);
        CudaStatus s = cuda_check(cudaMemcpyAsync(copy.data(), w.k, copy.size() * sizeof(float),
                                                  cudaMemcpyDeviceToHost, as_stream(stream)),
                                  "outlier rows download");
        if (s.ok) s = cuda_check(cudaStreamSynchronize(as_stream(stream)), "outlier rows download");
        if (!s.ok) return s;
        host_k = copy.data();
      }
      CudaStatus s = note_outlier_rows(layer_index, w.slot, first, host_k, w.n);
      if (!s.ok) return s;
    }
    // Raw pages for the blocks that start in this write (the tail block may have one already).
    const int64_t block_end = (first + w.n + T - 1) / T;
    const int64_t new_begin = (first + T - 1) / T;
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h)
        for (int64_t b = new_begin; b < block_end; ++b) {
          int32_t page = 0;
          CudaStatus s = layer.raw.take(kFirstRawBlocks * 2 * H, stream, &page);
          if (!s.ok) return s;
          layer.host_tables[entry_index(w.slot, kv, h, b)] = coded ? -page - 1 : page;
        }
    if (block_end > new_begin) {
      CudaStatus s = upload_table_blocks(layer, w.slot, new_begin, block_end);
      if (!s.ok) return s;
    }
  }
  CudaStatus s = {};
  if (staging_.size() < host_floats * sizeof(float)) {
    // The previous append may still read the old buffer.
    s = cuda_check(cudaStreamSynchronize(as_stream(stream)), "staging growth");
    if (s.ok) s = DeviceBuffer::allocate(host_floats * sizeof(float), &staging_);
    if (!s.ok) return s;
  }
  // The writes' arguments once every page is taken (a raw pool that grew moved); host rows
  // go up into the staging first, device rows are read where they are.
  std::vector<AppendRowsArgs> args;
  size_t staged = 0;
  for (size_t i = 0; i < count; ++i) {
    const SlotRows& w = writes[i];
    if (w.n == 0) continue;
    AppendRowsArgs a;
    a.k_rows = w.k;
    a.v_rows = w.v;
    if (!device_rows[i]) {
      const size_t floats = size_t(w.n) * H * D;
      float* k_stage = reinterpret_cast<float*>(staging_.data()) + staged;
      s = cuda_check(cudaMemcpyAsync(k_stage, w.k, floats * sizeof(float), cudaMemcpyDefault, as_stream(stream)),
                     "row upload");
      if (s.ok)
        s = cuda_check(cudaMemcpyAsync(k_stage + floats, w.v, floats * sizeof(float), cudaMemcpyDefault,
                                       as_stream(stream)),
                       "row upload");
      if (!s.ok) return s;
      a.k_rows = k_stage;
      a.v_rows = k_stage + floats;
      staged += 2 * floats;
    }
    a.n = w.n;
    a.first = firsts[i];
    a.n_kv_heads = H;
    a.head_dim = D;
    a.block_tokens = T;
    a.element = scheme_element(config_.scheme);
    a.tables = reinterpret_cast<const int32_t*>(layer.tables.data()) + entry_index(w.slot, 0, 0, 0);
    a.table_stride = table_stride_;
    a.raw_pages = layer.raw.buffer.data();
    a.raw_page_stride = int64_t(layer.raw.stride);
    a.n_raw_pages = layer.raw.capacity;
    a.length = reinterpret_cast<int32_t*>(lengths_.data()) + size_t(w.slot) * size_t(config_.n_layers) + size_t(layer_index);
    a.fragment_major = fragment_pages_;
    args.push_back(a);
  }
  for (size_t at = 0; at < args.size(); at += kMaxAppendBatch) {
    s = append_rows_batch(args.data() + at, int(std::min<size_t>(kMaxAppendBatch, args.size() - at)), stream);
    if (!s.ok) return s;
  }
  for (size_t i = 0; i < count; ++i) {
    const SlotRows& w = writes[i];
    if (w.n == 0) continue;
    // Blocks whose last row this write stored.
    const int64_t block_begin = firsts[i] / T;
    const int64_t done_end = (firsts[i] + w.n) / T;
    if (coded && done_end > block_begin) {
      s = lossy_ ? finalize_lossy(w.slot, layer_index, block_begin, done_end)
                 : finalize(w.slot, layer_index, block_begin, done_end);
      if (!s.ok) return s;
    }
    written_[size_t(w.slot) * size_t(config_.n_layers) + size_t(layer_index)] = firsts[i] + w.n;
  }
  return {};
}

CudaStatus DeviceKvCache::reserve_rows(int slot, int layer_index, int64_t n) {
  if (CudaStatus s = check_writable(layer_index); !s.ok) return s;
  if (!live(slot))
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: slot " + std::to_string(slot) + " is not live");
  const int64_t first = written(slot, layer_index);
  if (n < 0 || n > config_.max_tokens - first)
    return cuda_error(StatusCode::kOutOfRange, "device KV cache: " + std::to_string(n) + " tokens after " +
                                                   std::to_string(first) + " pass the capacity of " +
                                                   std::to_string(config_.max_tokens));
  if (choosing_outliers(layer_index))
    return cuda_error(StatusCode::kUnsupported, "device KV cache: layer " + std::to_string(layer_index) +
                                                    " has not chosen dither8's outlier pairs yet (write a whole "
                                                    "block first)");
  const int T = config_.block_tokens;
  const int64_t new_begin = (first + T - 1) / T, block_end = (first + n + T - 1) / T;
  if (block_end <= new_begin) return {};
  Layer& layer = *layers_[size_t(layer_index)];
  const bool coded = config_.scheme != KvScheme::kBf16;
  CudaStatus s = {};
  for (int kv = 0; kv < 2 && s.ok; ++kv)
    for (int h = 0; h < config_.n_kv_heads && s.ok; ++h)
      for (int64_t b = new_begin; b < block_end && s.ok; ++b) {
        int32_t page = 0;
        s = layer.raw.take(kFirstRawBlocks * 2 * config_.n_kv_heads, config_.stream, &page);
        if (s.ok) layer.host_tables[entry_index(slot, kv, h, b)] = coded ? -page - 1 : page;
      }
  if (!s.ok) {
    // No page (the pool could not grow): the pages taken go back and the cache is as it was.
    release_blocks(layer, slot, new_begin, block_end);
    return s;
  }
  return mark_broken(upload_table_blocks(layer, slot, new_begin, block_end));
}

CudaStatus DeviceKvCache::commit_rows(int slot, int layer_index, int64_t n_done, int64_t n) {
  if (CudaStatus s = check_writable(layer_index); !s.ok) return s;
  if (!live(slot) || n_done < 0 || n_done > n ||
      n > config_.max_tokens - written(slot, layer_index))
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: commit_rows(" + std::to_string(slot) + ", " +
                                                        std::to_string(layer_index) + ", " + std::to_string(n_done) +
                                                        ", " + std::to_string(n) + ") names no reservation");
  const int T = config_.block_tokens;
  const int64_t first = written(slot, layer_index);
  Layer& layer = *layers_[size_t(layer_index)];
  CudaStatus s = {};
  // The reserved pages of blocks no row reached go back.
  const int64_t kept_end = std::max((first + T - 1) / T, (first + n_done + T - 1) / T);
  const int64_t reserved_end = (first + n + T - 1) / T;
  if (reserved_end > kept_end) {
    release_blocks(layer, slot, kept_end, reserved_end);
    s = upload_table_blocks(layer, slot, kept_end, reserved_end);
  }
  // The blocks the rows completed, encoded as a write's.
  const int64_t block_begin = first / T, done_end = (first + n_done) / T;
  if (s.ok && config_.scheme != KvScheme::kBf16 && done_end > block_begin)
    s = lossy_ ? finalize_lossy(slot, layer_index, block_begin, done_end)
               : finalize(slot, layer_index, block_begin, done_end);
  if (s.ok) {
    written_[size_t(slot) * size_t(config_.n_layers) + size_t(layer_index)] = first + n_done;
    s = upload_slot_lengths(slot);
  }
  return mark_broken(s);
}

CudaStatus DeviceKvCache::stage_encode_tasks(const void* tasks, size_t task_bytes, size_t result_bytes,
                                             uint8_t** results) {
  // The tasks at the start of the encode buffer, the results after them (16-byte aligned).
  const size_t result_offset = round16(task_bytes);
  if (encode_buffer_.size() < result_offset + result_bytes) {
    CudaStatus s = DeviceBuffer::allocate(result_offset + result_bytes, &encode_buffer_);
    if (!s.ok) return s;
  }
  *results = encode_buffer_.data() + result_offset;
  return cuda_check(cudaMemcpyAsync(encode_buffer_.data(), tasks, task_bytes, cudaMemcpyHostToDevice,
                                    as_stream(config_.stream)),
                    "encode task upload");
}

CudaStatus DeviceKvCache::read_encode_results(const uint8_t* results, void* host, size_t bytes) {
  CudaStatus s = cuda_check(cudaMemcpyAsync(host, results, bytes, cudaMemcpyDeviceToHost, as_stream(config_.stream)),
                            "encode result download");
  if (s.ok) s = cuda_check(cudaStreamSynchronize(as_stream(config_.stream)), "block encode");
  return s;
}

CudaStatus DeviceKvCache::mark_broken(const CudaStatus& s) {
  if (!s.ok) {
    broken_ = true;
    broken_reason_ = s.message;
  }
  return s;
}

CudaStatus DeviceKvCache::stage_deferred_encode(int slot, int layer_index, int64_t block_begin, int64_t block_end,
                                                const std::vector<int32_t>& coded_pages, const void* tasks,
                                                size_t task_bytes, size_t result_bytes, DeferredEncode* out) {
  Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  cudaStream_t stream = as_stream(config_.stream);
  const size_t n = coded_pages.size();
  if (n > size_t(std::numeric_limits<int32_t>::max()))
    return cuda_error(StatusCode::kInternal, "device KV cache: more than 2^31 encode tasks in one write");
  // One upload: the tasks, then (16-byte aligned) their placements.
  const size_t placements_offset = round16(task_bytes);
  std::vector<uint8_t> upload(placements_offset + n * sizeof(TablePlacement));
  std::memcpy(upload.data(), tasks, task_bytes);
  auto* placements = reinterpret_cast<TablePlacement*>(upload.data() + placements_offset);
  // This finalize's results after every pending one's; encode_results_used_ stays a multiple of 16.
  const size_t result_offset = encode_results_used_;
  out->blocks.clear();
  out->blocks.reserve(n);
  size_t i = 0;
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < H; ++h)
      for (int64_t b = block_begin; b < block_end; ++b, ++i) {
        const size_t at = entry_index(slot, kv, h, b);
        const int32_t entry = layer.host_tables[at];
        if (entry >= 0 || entry == kUnwritten)
          return cuda_error(StatusCode::kInternal, "device KV cache: a block finalized twice or never written (entry " +
                                                       std::to_string(entry) + ")");
        placements[i] = TablePlacement{int64_t(at), coded_pages[i], int32_t(i)};
        out->blocks.push_back(PendingEncode{layer_index, slot, kv, h, b, coded_pages[i], -entry - 1,
                                            result_offset + i * result_bytes});
      }
  if (i != n) return cuda_error(StatusCode::kInternal, "device KV cache: encode tasks and blocks disagree");
  CudaStatus s = {};
  if (encode_tasks_.size() < upload.size()) {
    // The launches of an earlier finalize of this step may still read the old tasks.
    s = cuda_check(cudaStreamSynchronize(stream), "encode task staging growth");
    if (s.ok) s = DeviceBuffer::allocate(std::max(upload.size(), 2 * encode_tasks_.size()), &encode_tasks_);
    if (!s.ok) return s;
  }
  const size_t results_end = result_offset + round16(n * result_bytes);
  if (encode_results_.size() < results_end) {
    // The pending results move with a copy ordered after the launches that wrote them; grow()
    // waits for it before the old buffer is freed. Offsets stay valid.
    s = grow(encode_results_, encode_results_used_, std::max<size_t>({results_end, 2 * encode_results_.size(), 4096}),
             config_.stream);
    if (!s.ok) return s;
  }
  // Ordered after every launch enqueued before on the stream, those that read the previous tasks
  // included (pageable memory: staged before cudaMemcpyAsync returns).
  s = cuda_check(cudaMemcpyAsync(encode_tasks_.data(), upload.data(), upload.size(), cudaMemcpyHostToDevice, stream),
                 "encode task upload");
  if (!s.ok) return s;
  encode_results_used_ = results_end;
  out->tasks = encode_tasks_.data();
  out->placements = reinterpret_cast<const TablePlacement*>(encode_tasks_.data() + placements_offset);
  out->results = encode_results_.data() + result_offset;
  out->n = int(n);
  return {};
}

CudaStatus DeviceKvCache::place_deferred(int layer_index, const DeferredEncode& d, EncodeResult kind) {
  Layer& layer = *layers_[size_t(layer_index)];
  PlaceEncodedArgs a;
  a.tables = reinterpret_cast<int32_t*>(layer.tables.data());
  a.n_entries = int64_t(layer.host_tables.size());
  a.placements = d.placements;
  a.n = d.n;
  a.kind = kind;
  a.results = d.results;
  a.n_results = d.n;
  const CudaStatus s = place_encoded_pages(a, config_.stream);
  if (!s.ok) return s;
  for (const PendingEncode& p : d.blocks) {
    pending_.push_back(p);
    // Listed whatever the result: the block's exact page is its raw page until reconcile_encodes.
    if (config_.hold_completed_exact && lossy_)  // as finalize_lossy holds them (GAAC holds none)
      layer.completed_exact.push_back({p.slot, p.kv, p.kv_head, p.block, p.raw_page});
  }
  return {};
}

CudaStatus DeviceKvCache::download_encode_results() {
  if (pending_.empty()) return {};
  cudaStream_t stream = as_stream(config_.stream);
  CudaStatus s = {};
  if (results_event_ == nullptr) {
    cudaEvent_t e = nullptr;
    s = cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "encode result event");
    if (!s.ok) return mark_broken(s);
    results_event_ = e;
  }
  if (host_encode_results_.size() < encode_results_used_) {
    // A copy in flight may still write the old page-locked buffer.
    if (downloaded_pending_ > 0)
      s = cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(results_event_)), "encode result download");
    if (s.ok)
      s = PinnedBuffer::allocate(std::max(encode_results_used_, 2 * host_encode_results_.size()), &host_encode_results_);
    if (!s.ok) return mark_broken(s);
  }
  s = cuda_check(cudaMemcpyAsync(host_encode_results_.data(), encode_results_.data(), encode_results_used_,
                                 cudaMemcpyDeviceToHost, stream),
                 "encode result download");
  if (s.ok) s = cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(results_event_), stream), "encode result event");
  if (!s.ok) return mark_broken(s);
  downloaded_pending_ = pending_.size();
  return {};
}

CudaStatus DeviceKvCache::reconcile_encodes() {
  if (pending_.empty()) return {};
  CudaStatus s = {};
  // The copy must cover every pending block (a write after the last download added some).
  if (downloaded_pending_ != pending_.size()) s = download_encode_results();
  if (s.ok) s = cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(results_event_)), "encode result download");
  const uint8_t* host = host_encode_results_.data();
  for (size_t i = 0; s.ok && i < pending_.size(); ++i) {
    const PendingEncode& p = pending_[i];
    Layer& layer = *layers_[size_t(p.layer)];
    int32_t& entry = layer.host_tables[entry_index(p.slot, p.kv, p.kv_head, p.block)];
    // Every call that changes a host entry reconciles first: a pending entry still names its raw page.
    if (entry != -p.raw_page - 1) {
      s = cuda_error(StatusCode::kInternal, "device KV cache: the entry of a pending block changed before its "
                                            "encode result was read (layer " + std::to_string(p.layer) + ", slot " +
                                            std::to_string(p.slot) + ", block " + std::to_string(p.block) + ")");
      break;
    }
    // The same test as the placement launch's (place_encoded_cuda.cu).
    bool encoded = false;
    uint32_t used = 0;
    if (lossy_) {
      encoded = host[p.result_offset] == codec::cuda::kLossyEncoded;
    } else {
      std::memcpy(&used, host + p.result_offset, sizeof(used));
      encoded = used != codec::cuda::kGaacDeviceDoesNotFit;
    }
    if (!encoded) {  // the block stays raw: its entry is the raw page already, on both sides
      layer.slots[p.kv].give_back(p.coded_page);
      ++(lossy_ ? pages_kept_exact_ : blocks_not_fitting_);
      continue;
    }
    layer.raw.give_back(p.raw_page);
    entry = p.coded_page;
    if (!lossy_) {
      std::vector<uint32_t>& slot_used = layer.slot_used[p.kv];
      if (slot_used.size() <= size_t(p.coded_page)) slot_used.resize(size_t(p.coded_page) + 1);
      slot_used[size_t(p.coded_page)] = used;
    }
  }
  // Every listed exact page was a pending block's: the hold ends here (see the header).
  for (auto& layer : layers_) layer->completed_exact.clear();
  pending_.clear();
  encode_results_used_ = 0;
  downloaded_pending_ = 0;
  return mark_broken(s);
}

CudaStatus DeviceKvCache::finalize(int slot, int layer_index, int64_t block_begin, int64_t block_end) {
  Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  const int D = config_.head_dim;
  const int T = config_.block_tokens;
  void* stream = config_.stream;
  const format::GaacElement element = scheme_element(config_.scheme);
  std::vector<codec::cuda::GaacEncodeTask> tasks;
  std::vector<int32_t> slots;
  tasks.reserve(size_t(2) * H * size_t(block_end - block_begin));
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < H; ++h)
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int32_t entry = layer.host_tables[entry_index(slot, kv, h, b)];
        int32_t page = 0;
        CudaStatus s = layer.slots[kv].take(int64_t(H) * kFirstSlotBlocks, stream, &page);
        if (!s.ok) return s;
        codec::cuda::GaacEncodeTask t;
        t.src = layer.raw.buffer.data() + size_t(-int64_t(entry) - 1) * layer.raw.stride;
        t.dst = layer.slots[kv].buffer.data() + size_t(page) * layer.slots[kv].stride;
        t.b3 = layer.bases.data() + ((size_t(kv) * H + h) * 2 + 0) * D;
        t.b4 = layer.bases.data() + ((size_t(kv) * H + h) * 2 + 1) * D;
        t.escape_capacity = uint32_t(layer.escape_capacity[kv]);
        tasks.push_back(t);
        slots.push_back(page);
      }
  // A slot pool that grew while the tasks were made moved: point every task at the final pool.
  {
    size_t i = 0;
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h)
        for (int64_t b = block_begin; b < block_end; ++b, ++i)
          tasks[i].dst = layer.slots[kv].buffer.data() + size_t(slots[i]) * layer.slots[kv].stride;
  }
  // The encode launch(es): GAAC slots, or device pages (fragment_pages_), K tasks then V tasks.
  auto encode = [&](const codec::cuda::GaacEncodeTask* device_tasks, int n, uint32_t* used) {
    if (!fragment_pages_) return codec::cuda::gaac_encode_pages(element, T, D, device_tasks, n, used, stream);
    const int n_key = n / 2;  // tasks in (K/V, kv_head, block) order
    CudaStatus e = codec::cuda::gaac_fragment_encode_pages(D, true, device_tasks, n_key, used, stream);
    if (e.ok) e = codec::cuda::gaac_fragment_encode_pages(D, false, device_tasks + n_key, n - n_key, used + n_key, stream);
    return e;
  };
  if (config_.defer_encode_results) {
    DeferredEncode d;
    CudaStatus s = stage_deferred_encode(slot, layer_index, block_begin, block_end, slots, tasks.data(),
                                         tasks.size() * sizeof(codec::cuda::GaacEncodeTask), sizeof(uint32_t), &d);
    if (s.ok)
      s = encode(reinterpret_cast<const codec::cuda::GaacEncodeTask*>(d.tasks), d.n, reinterpret_cast<uint32_t*>(d.results));
    if (s.ok) s = place_deferred(layer_index, d, EncodeResult::kGaacUsedBytes);
    return s;
  }
  uint8_t* results = nullptr;
  CudaStatus s = stage_encode_tasks(tasks.data(), tasks.size() * sizeof(codec::cuda::GaacEncodeTask),
                                    tasks.size() * sizeof(uint32_t), &results);
  if (!s.ok) return s;
  s = encode(reinterpret_cast<const codec::cuda::GaacEncodeTask*>(encode_buffer_.data()), int(tasks.size()),
             reinterpret_cast<uint32_t*>(results));
  if (!s.ok) return s;
  std::vector<uint32_t> used(tasks.size());
  s = read_encode_results(results, used.data(), used.size() * sizeof(uint32_t));
  if (!s.ok) return s;
  size_t i = 0;
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < H; ++h)
      for (int64_t b = block_begin; b < block_end; ++b, ++i) {
        int32_t& entry = layer.host_tables[entry_index(slot, kv, h, b)];
        if (used[i] == codec::cuda::kGaacDeviceDoesNotFit) {
          layer.slots[kv].give_back(slots[i]);
          ++blocks_not_fitting_;
          continue;
        }
        layer.raw.give_back(-entry - 1);
        entry = slots[i];
        if (layer.slot_used[kv].size() <= size_t(slots[i])) layer.slot_used[kv].resize(size_t(slots[i]) + 1);
        layer.slot_used[kv][size_t(slots[i])] = used[i];
      }
  return upload_table_blocks(layer, slot, block_begin, block_end);
}

codec::LossyPageSpec DeviceKvCache::lossy_spec(bool key) const {
  codec::LossyPageSpec spec;
  spec.scheme = lossy_scheme_;
  spec.key = key;
  spec.block_tokens = config_.block_tokens;
  spec.head_dim = config_.head_dim;
  spec.pairing = config_.rope_pairing;
  if (!codec::lossy_scheme_is_tier_b(spec.scheme)) spec.witness = config_.witness;
  spec.n_outlier_pairs = key ? n_outlier_pairs_ : 0;
  // The pairs of each head travel with its encode tasks; the spec's list (0, 1, ..., m - 1) only
  // makes it valid for sizes and checks.
  spec.outlier_pairs = spec.n_outlier_pairs > 0 ? placeholder_pairs_.data() : nullptr;
  return spec;
}

CudaStatus DeviceKvCache::choose_outliers(int layer_index, int kv_head, const float* rows, int n_rows,
                                          size_t row_stride) {
  const int D = config_.head_dim;
  const int m = n_outlier_pairs_;
  std::vector<float> x(size_t(n_rows) * D);
  for (int r = 0; r < n_rows; ++r) std::copy_n(rows + size_t(r) * row_stride, D, x.begin() + size_t(r) * D);
  std::vector<uint16_t> pairs(static_cast<size_t>(m), 0);
  codec::select_outlier_pairs(x.data(), n_rows, D, config_.rope_pairing, m, pairs.data());
  return set_outliers(layer_index, kv_head, pairs.data());
}

CudaStatus DeviceKvCache::set_outliers(int layer_index, int kv_head, const uint16_t* pairs) {
  Layer& layer = *layers_[size_t(layer_index)];
  const CudaStatus s = upload_outliers(layer, kv_head, pairs);
  if (s.ok) layer.outliers_chosen[size_t(kv_head)] = 1;
  return s;
}

CudaStatus DeviceKvCache::upload_outliers(Layer& layer, int kv_head, const uint16_t* pairs) {
  const int D = config_.head_dim;
  const int m = n_outlier_pairs_;
  // The kernels' channel list: pair j's first channel, then its second (the record's order).
  std::vector<int32_t> channels(size_t(2) * m);
  for (int j = 0; j < m; ++j)
    for (int which = 0; which < 2; ++which)
      channels[size_t(2 * j + which)] = codec::rope_pair_channel(config_.rope_pairing, D, pairs[size_t(j)], which);
  layer.host_outlier_pairs.resize(size_t(config_.n_kv_heads) * size_t(m));
  std::copy_n(pairs, m, layer.host_outlier_pairs.begin() + ptrdiff_t(kv_head) * m);
  CudaStatus s = cuda_check(cudaMemcpyAsync(layer.outlier_pairs.data() + sizeof(uint16_t) * size_t(kv_head) * m,
                                            pairs, sizeof(uint16_t) * size_t(m), cudaMemcpyHostToDevice,
                                            as_stream(config_.stream)),
                            "outlier pair upload");
  if (s.ok)
    s = cuda_check(cudaMemcpyAsync(layer.outlier_channels.data() + sizeof(int32_t) * size_t(kv_head) * 2 * m,
                                   channels.data(), sizeof(int32_t) * channels.size(), cudaMemcpyHostToDevice,
                                   as_stream(config_.stream)),
                   "outlier channel upload");
  // The uploads read pageable host memory: they complete before cudaMemcpyAsync returns.
  return s;
}

bool DeviceKvCache::choosing_outliers(int layer) const {
  return n_outlier_pairs_ > 0 && !layers_[size_t(layer)]->all_outliers_chosen();
}

CudaStatus DeviceKvCache::note_outlier_rows(int layer_index, int slot, int64_t first, const float* k, int64_t n) {
  Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  const int D = config_.head_dim;
  const int T = config_.block_tokens;
  for (int h = 0; h < H; ++h) {
    if (layer.outliers_chosen[size_t(h)]) continue;
    if (n >= T) {  // KvCache: the float rows of the first write that holds a whole block
      CudaStatus s = choose_outliers(layer_index, h, k + size_t(h) * D, int(n), size_t(H) * D);
      if (!s.ok) return s;
      continue;
    }
    // Else the slot's first block's rows as stored (bf16), for the choice when that block completes.
    std::vector<float>& rows = layer.first_rows[slot];
    rows.resize(size_t(H) * size_t(T) * size_t(D), 0.f);
    for (int64_t r = 0; r < n && first + r < T; ++r)
      for (int c = 0; c < D; ++c)
        rows[(size_t(h) * T + size_t(first + r)) * D + c] =
            format::bf16_to_float(format::float_to_bf16(k[(size_t(r) * H + h) * D + c]));
  }
  return {};
}

CudaStatus DeviceKvCache::finalize_lossy(int slot, int layer_index, int64_t block_begin, int64_t block_end) {
  Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  const int D = config_.head_dim;
  const int T = config_.block_tokens;
  void* stream = config_.stream;
  const int m = n_outlier_pairs_;
  if (m > 0 && block_begin == 0 && !layer.all_outliers_chosen()) {
    // KvCache: else the bf16 rows of the first block finalized (this slot's own).
    std::vector<float>& rows = layer.first_rows[slot];
    rows.resize(size_t(H) * size_t(T) * size_t(D), 0.f);
    for (int h = 0; h < H; ++h) {
      if (layer.outliers_chosen[size_t(h)]) continue;
      CudaStatus s = choose_outliers(layer_index, h, rows.data() + size_t(h) * T * D, T, size_t(D));
      if (!s.ok) return s;
    }
    if (layer.all_outliers_chosen()) layer.first_rows.clear();
  }
  const bool dither8 = config_.scheme == KvScheme::kDither8;
  const int64_t per_kv = int64_t(H) * (block_end - block_begin);
  std::vector<codec::cuda::LossyEncodeTask> tasks;
  std::vector<int32_t> slots;
  tasks.reserve(size_t(2 * per_kv));
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < H; ++h)
      for (int64_t b = block_begin; b < block_end; ++b) {
        const int32_t entry = layer.host_tables[entry_index(slot, kv, h, b)];
        int32_t page = 0;
        CudaStatus s = layer.slots[kv].take(int64_t(H) * kFirstSlotBlocks, stream, &page);
        if (!s.ok) return s;
        codec::cuda::LossyEncodeTask t;
        t.src = reinterpret_cast<const uint16_t*>(layer.raw.buffer.data() + size_t(-int64_t(entry) - 1) * layer.raw.stride);
        t.block = uint32_t(b);  // dither8's counter: the block's position, never the slot
        if (dither8) t.dither_key = codec::dither8_key(config_.first_model_layer + layer_index, kv == 0, h);
        if (kv == 0 && m > 0)
          t.outlier_pairs = reinterpret_cast<const uint16_t*>(layer.outlier_pairs.data()) + size_t(h) * m;
        tasks.push_back(t);
        slots.push_back(page);
      }
  // Destinations once every slot is taken (a pool that grew moved).
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int kv = int64_t(i) < per_kv ? 0 : 1;
    tasks[i].dst = layer.slots[kv].buffer.data() + size_t(slots[i]) * layer.slots[kv].stride;
  }
  if (config_.defer_encode_results) {
    DeferredEncode d;
    CudaStatus s = stage_deferred_encode(slot, layer_index, block_begin, block_end, slots, tasks.data(),
                                         tasks.size() * sizeof(codec::cuda::LossyEncodeTask), 1, &d);
    const auto* device_tasks = reinterpret_cast<const codec::cuda::LossyEncodeTask*>(d.tasks);
    for (int kv = 0; kv < 2 && s.ok; ++kv)
      s = codec::cuda::lossy_encode_pages(lossy_spec(kv == 0), device_tasks + kv * per_kv, int(per_kv),
                                          d.results + kv * per_kv, stream, encode_layout());
    if (s.ok) s = place_deferred(layer_index, d, EncodeResult::kLossyStatus);
    return s;
  }
  uint8_t* results = nullptr;
  CudaStatus s = stage_encode_tasks(tasks.data(), tasks.size() * sizeof(codec::cuda::LossyEncodeTask), tasks.size(),
                                    &results);
  if (!s.ok) return s;
  const auto* device_tasks = reinterpret_cast<const codec::cuda::LossyEncodeTask*>(encode_buffer_.data());
  for (int kv = 0; kv < 2 && s.ok; ++kv)
    s = codec::cuda::lossy_encode_pages(lossy_spec(kv == 0), device_tasks + kv * per_kv, int(per_kv),
                                        results + kv * per_kv, stream, encode_layout());
  if (!s.ok) return s;
  std::vector<uint8_t> encoded(tasks.size());
  s = read_encode_results(results, encoded.data(), encoded.size());
  if (!s.ok) return s;
  size_t i = 0;
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < H; ++h)
      for (int64_t b = block_begin; b < block_end; ++b, ++i) {
        int32_t& entry = layer.host_tables[entry_index(slot, kv, h, b)];
        if (encoded[i] != codec::cuda::kLossyEncoded) {  // not finite, or a scale past fp16: stays exact
          layer.slots[kv].give_back(slots[i]);
          ++pages_kept_exact_;
          continue;
        }
        if (config_.hold_completed_exact)
          layer.completed_exact.push_back({slot, kv, h, b, -entry - 1});
        else
          layer.raw.give_back(-entry - 1);
        entry = slots[i];
      }
  return upload_table_blocks(layer, slot, block_begin, block_end);
}

CudaStatus DeviceKvCache::store_exact_block(int slot, int layer_index, int kv_head, int64_t block,
                                            const uint16_t* k_rows, const uint16_t* v_rows, uint64_t* bytes) {
  if (bytes == nullptr || k_rows == nullptr || v_rows == nullptr)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: store_exact_block needs its rows and a byte count");
  *bytes = 0;
  if (broken_)
    return cuda_error(StatusCode::kInternal, "device KV cache: an earlier call failed (" + broken_reason_ +
                                                 "); its pages and tables are no longer trusted: reset() it");
  if (!lossy_)
    return cuda_error(StatusCode::kInvalidArgument, std::string("device KV cache: store_exact_block needs a lossy "
                                                                "scheme, not ") + kv_scheme_name(config_.scheme));
  const int T = config_.block_tokens;
  if (!live(slot) || layer_index < 0 || layer_index >= config_.n_layers || kv_head < 0 ||
      kv_head >= config_.n_kv_heads || block < 0 || block >= written(slot, layer_index) / T)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: no whole block " + std::to_string(block) +
                                                        " at layer " + std::to_string(layer_index) + ", kv head " +
                                                        std::to_string(kv_head));
  Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  const size_t page_bytes = size_t(T) * size_t(config_.head_dim) * 2;
  // Whether a page is lossy is read from the host tables, and the block's entries go up from them.
  CudaStatus s = reconcile_encodes();
  if (!s.ok) return s;
  bool changed = false;
  std::vector<uint16_t> fragments(fragment_pages_ ? size_t(T) * size_t(config_.head_dim) : 0);
  for (int kv = 0; kv < 2 && s.ok; ++kv) {
    int32_t& entry = layer.host_tables[entry_index(slot, kv, kv_head, block)];
    if (entry < 0) continue;  // already exact
    int32_t page = 0;
    s = layer.raw.take(kFirstRawBlocks * 2 * H, config_.stream, &page);
    if (!s.ok) break;
    // Raw pages of a fragment-major scheme hold the rows in the K or V map, as append writes them.
    const uint16_t* rows = kv == 0 ? k_rows : v_rows;
    if (fragment_pages_) {
      format::fragment::bf16_page_to_fragments(kv == 0, config_.head_dim, rows, fragments.data());
      rows = fragments.data();
    }
    // Pageable host rows: staged before cudaMemcpyAsync returns.
    s = cuda_check(cudaMemcpyAsync(layer.raw.buffer.data() + size_t(page) * layer.raw.stride, rows, page_bytes,
                                   cudaMemcpyHostToDevice, as_stream(config_.stream)),
                   "exact block upload");
    if (!s.ok) break;
    layer.slots[kv].give_back(entry);
    entry = -page - 1;
    *bytes += page_bytes;
    changed = true;
  }
  if (s.ok && changed) s = upload_table_blocks(layer, slot, block, block + 1);
  if (!s.ok) {
    broken_ = true;
    broken_reason_ = s.message;
  }
  return s;
}

const int32_t* DeviceKvCache::host_table_row(int slot, int layer) const {
  return layers_[size_t(layer)]->host_tables.data() + entry_index(slot, 0, 0, 0);
}

const std::vector<CompletedExactPage>& DeviceKvCache::completed_exact(int layer) const {
  return layers_[size_t(layer)]->completed_exact;
}

void DeviceKvCache::release_completed_exact(int layer) {
  Layer& l = *layers_[size_t(layer)];
  // Deferred: a listed page is still pending (reconcile_encodes empties every list), and whether
  // it goes back (its block encoded) or stays in the tables (refused) is reconcile's to decide.
  if (!config_.defer_encode_results)
    for (const CompletedExactPage& page : l.completed_exact) l.raw.give_back(page.raw_page);
  l.completed_exact.clear();
}

CudaStatus DeviceKvCache::copy_exact_block_tables(int layer_index, std::span<const std::pair<int, int64_t>> blocks,
                                                  int32_t* dst, size_t dst_entries) {
  if (layer_index < 0 || layer_index >= config_.n_layers)
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: layer " + std::to_string(layer_index) + " of " +
                                                        std::to_string(config_.n_layers));
  const int H = config_.n_kv_heads;
  const int64_t T = config_.block_tokens;
  const size_t row = size_t(2) * size_t(H) * size_t(table_stride_);
  if (blocks.empty()) return {};
  if (dst == nullptr || dst_entries / row < blocks.size())
    return cuda_error(StatusCode::kInvalidArgument,
                      "device KV cache: " + std::to_string(blocks.size()) + " exact-block tables need " +
                          std::to_string(blocks.size() * row) + " entries, the destination holds " +
                          std::to_string(dst_entries));
  const Layer& layer = *layers_[size_t(layer_index)];
  // The held pages by their entry's index (completed_exact: the blocks encoded and held; a block
  // refused, or pending, still has its raw page in the host tables).
  std::unordered_map<size_t, int32_t> held;
  for (const CompletedExactPage& page : layer.completed_exact)
    held[entry_index(page.slot, page.kv, page.kv_head, page.block)] = -page.raw_page - 1;
  // One upload: the slots of the rows, then (16-byte aligned) the patches of each row's block.
  const size_t patches_offset = round16(sizeof(int32_t) * blocks.size());
  std::vector<uint8_t> upload(patches_offset + sizeof(TablePlacement) * blocks.size() * size_t(2 * H));
  auto* rows = reinterpret_cast<int32_t*>(upload.data());
  auto* patches = reinterpret_cast<TablePlacement*>(upload.data() + patches_offset);
  size_t n_patches = 0;
  for (size_t j = 0; j < blocks.size(); ++j) {
    const auto [slot, block] = blocks[j];
    if (!live(slot) || block < 0 || block >= written(slot, layer_index) / T)
      return cuda_error(StatusCode::kInvalidArgument, "device KV cache: no whole block " + std::to_string(block) +
                                                          " of slot " + std::to_string(slot) + " at layer " +
                                                          std::to_string(layer_index));
    rows[j] = int32_t(slot);
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < H; ++h) {
        const size_t at = entry_index(slot, kv, h, block);
        const auto it = held.find(at);
        const int32_t entry = it != held.end() ? it->second : layer.host_tables[at];
        if (entry >= 0 || entry == kUnwritten)
          return cuda_error(StatusCode::kInvalidArgument, "device KV cache: block " + std::to_string(block) +
                                                              " of slot " + std::to_string(slot) + " at layer " +
                                                              std::to_string(layer_index) +
                                                              " is encoded and its exact page is not held");
        const size_t at_patch = j * row + size_t(kv * H + h) * size_t(table_stride_) + size_t(block);
        patches[n_patches++] = TablePlacement{int64_t(at_patch), entry, 0};
      }
  }
  cudaStream_t stream = as_stream(config_.stream);
  CudaStatus s = {};
  if (exact_table_placements_.size() < upload.size()) {
    // A launch in flight (the previous layer's) may still read the old patches.
    s = cuda_check(cudaStreamSynchronize(stream), "exact-block table staging growth");
    if (s.ok)
      s = DeviceBuffer::allocate(std::max(upload.size(), 2 * exact_table_placements_.size()), &exact_table_placements_);
    if (!s.ok) return s;
  }
  // Ordered after the launches before it: the encode placements of this layer's write, and the
  // previous reader of the staging.
  s = cuda_check(cudaMemcpyAsync(exact_table_placements_.data(), upload.data(), upload.size(), cudaMemcpyHostToDevice,
                                 stream),
                 "exact-block table upload");
  constexpr size_t kRowsPerLaunch = 65535;  // copy_table_rows' grid
  for (size_t j = 0; s.ok && j < blocks.size(); j += kRowsPerLaunch) {
    CopyTableRowsArgs c;
    c.tables = reinterpret_cast<const int32_t*>(layer.tables.data());
    c.n_table_rows = slot_capacity_;
    c.row_entries = int64_t(row);
    c.rows = reinterpret_cast<const int32_t*>(exact_table_placements_.data()) + j;
    c.n = int(std::min(kRowsPerLaunch, blocks.size() - j));
    c.dst = dst + j * row;
    s = copy_table_rows(c, config_.stream);
  }
  if (!s.ok) return s;
  PlaceEncodedArgs a;
  a.tables = dst;
  a.n_entries = int64_t(blocks.size() * row);
  a.placements = reinterpret_cast<const TablePlacement*>(exact_table_placements_.data() + patches_offset);
  a.n = int(n_patches);
  a.kind = EncodeResult::kAlways;
  return place_encoded_pages(a, config_.stream);
}

CudaStatus DeviceKvCache::reset() {
  // Until every table is uploaded the cache stays refused (a failed reset leaves it so).
  broken_ = true;
  broken_reason_ = "reset() did not finish";
  std::fill(written_.begin(), written_.end(), 0);  // the live sequences stay live, empty
  blocks_not_fitting_ = 0;
  pages_kept_exact_ = 0;
  // Pending encodes are dropped: their placements may still run, but the tables go up as
  // unwritten after them (stream order), and the pools are emptied below.
  pending_.clear();
  encode_results_used_ = 0;
  downloaded_pending_ = 0;
  // dither8's outlier pairs stay chosen, as in KvCache (fixed per (layer, kv_head) once chosen).
  for (auto& layer : layers_) {
    layer->completed_exact.clear();
    layer->raw.clear();
    for (PagePool& p : layer->slots) p.clear();
    for (auto& used : layer->slot_used) used.clear();
    std::fill(layer->host_tables.begin(), layer->host_tables.end(), kUnwritten);
    CudaStatus s = upload_tables(*layer);
    if (!s.ok) return s;
  }
  CudaStatus s = cuda_check(cudaMemsetAsync(lengths_.data(), 0, lengths_.size(), as_stream(config_.stream)), "length reset");
  if (s.ok) s = cuda_check(cudaStreamSynchronize(as_stream(config_.stream)), "reset");
  if (!s.ok) return s;
  broken_ = false;
  broken_reason_.clear();
  return {};
}

PlannedRowsArgs DeviceKvCache::planned_rows_args(int layer_index) const {
  const Layer& layer = *layers_[size_t(layer_index)];
  PlannedRowsArgs a;
  a.tables = reinterpret_cast<const int32_t*>(layer.tables.data());
  a.table_stride = table_stride_;
  a.table_row_stride = 2 * int64_t(config_.n_kv_heads) * table_stride_;
  a.n_kv_heads = config_.n_kv_heads;
  a.head_dim = config_.head_dim;
  a.block_tokens = config_.block_tokens;
  a.element = scheme_element(config_.scheme);
  a.raw_pages = layer.raw.buffer.data();
  a.raw_page_stride = int64_t(layer.raw.stride);
  a.n_raw_pages = layer.raw.capacity;
  a.fragment_major = fragment_pages_;
  return a;
}

DeviceLayerView DeviceKvCache::view(int layer_index) const {
  const Layer& layer = *layers_[size_t(layer_index)];
  const int H = config_.n_kv_heads;
  DeviceLayerView v;
  const bool coded = config_.scheme != KvScheme::kBf16;
  const PagePool& kp = coded ? layer.slots[0] : layer.raw;
  const PagePool& vp = coded ? layer.slots[1] : layer.raw;
  v.k_pages = kp.buffer.data();
  v.v_pages = vp.buffer.data();
  v.k_page_stride = int64_t(kp.stride);
  v.v_page_stride = int64_t(vp.stride);
  v.n_k_pages = kp.capacity;
  v.n_v_pages = vp.capacity;
  if (coded) {
    v.raw_pages = layer.raw.buffer.data();
    v.raw_page_stride = int64_t(layer.raw.stride);
    v.n_raw_pages = layer.raw.capacity;
  }
  if (lossy_) {
    v.dither_keys = reinterpret_cast<const uint64_t*>(layer.dither_keys.data());
    v.outlier_channels = reinterpret_cast<const int32_t*>(layer.outlier_channels.data());
    v.n_outlier_pairs = n_outlier_pairs_;
  } else if (coded) {
    v.gaac_bases = layer.bases.data();
    v.k_escape_capacity = int64_t(layer.escape_capacity[0]);
    v.v_escape_capacity = int64_t(layer.escape_capacity[1]);
  }
  v.k_table = reinterpret_cast<const int32_t*>(layer.tables.data());
  v.v_table = v.k_table + size_t(H) * size_t(table_stride_);
  v.table_stride = table_stride_;
  v.table_row_stride = 2 * int64_t(H) * table_stride_;
  v.n_table_rows = slot_capacity_;
  if (config_.index_record_bytes > 0) {
    v.index_records = layer.index_records.data();
    v.index_record_stride = index_record_stride_;
    v.index_centroids = reinterpret_cast<float*>(layer.index_centroids.data());
  }
  v.length = reinterpret_cast<const int32_t*>(lengths_.data()) + layer_index;
  v.host_length = written(0, layer_index);
  return v;
}

DeviceKvStats DeviceKvCache::stats() const {
  DeviceKvStats st;
  st.blocks_not_fitting = blocks_not_fitting_;
  st.pages_kept_exact = pages_kept_exact_;
  st.bytes_reserved = staging_.size() + encode_buffer_.size() + lengths_.size() + encode_tasks_.size() +
                     encode_results_.size() + exact_table_placements_.size();
  for (uint8_t l : live_) st.sequences += l;
  for (const auto& layer : layers_) {
    st.raw_pages_in_use += layer->raw.in_use;
    st.bytes_in_use += uint64_t(layer->raw.in_use) * layer->raw.stride + layer->tables.size();
    st.raw_bytes_in_use += uint64_t(layer->raw.in_use) * layer->raw.stride;
    st.bytes_reserved += layer->raw.buffer.size() + layer->tables.size() + layer->bases.size() +
                         layer->dither_keys.size() + layer->outlier_pairs.size() + layer->outlier_channels.size() +
                         layer->index_records.size() + layer->index_centroids.size();
    for (const PagePool& p : layer->slots) {
      (lossy_ ? st.lossy_pages_in_use : st.slots_in_use) += p.in_use;
      st.bytes_in_use += uint64_t(p.in_use) * p.stride;
      st.coded_bytes_in_use += uint64_t(p.in_use) * p.stride;
      st.bytes_reserved += p.buffer.size();
    }
  }
  return st;
}

CudaStatus DeviceKvCache::read_page(int slot, int layer_index, KvTensor kv, int kv_head, int64_t block,
                                    DevicePageBytes* out) const {
  if (!live(slot) || layer_index < 0 || layer_index >= config_.n_layers || kv_head < 0 ||
      kv_head >= config_.n_kv_heads || (kv != KvTensor::kKey && kv != KvTensor::kValue) || block < 0 ||
      block >= (written(slot, layer_index) + config_.block_tokens - 1) / config_.block_tokens)
    return cuda_error(StatusCode::kOutOfRange, "device KV cache: no page at layer " + std::to_string(layer_index) +
                                                   ", kv head " + std::to_string(kv_head) + ", block " +
                                                   std::to_string(block));
  if (!pending_.empty())
    return cuda_error(StatusCode::kInvalidArgument, "device KV cache: read_page with " +
                                                        std::to_string(pending_.size()) +
                                                        " encodes pending: reconcile_encodes() first");
  const Layer& layer = *layers_[size_t(layer_index)];
  const int k = int(kv);
  const int32_t entry = layer.host_tables[entry_index(slot, k, kv_head, block)];
  const bool coded = config_.scheme != KvScheme::kBf16;
  out->gaac_slot = coded && !lossy_ && entry >= 0;
  out->lossy_page = lossy_ && entry >= 0;
  out->slot = coded && entry >= 0 ? entry : -1;
  const uint8_t* src = nullptr;
  size_t bytes = 0;
  if (out->gaac_slot || out->lossy_page) {
    src = layer.slots[k].buffer.data() + size_t(entry) * layer.slots[k].stride;
    bytes = out->gaac_slot ? size_t(layer.slot_used[k][size_t(entry)]) : codec::lossy_page_bytes(lossy_spec(k == 0));
  } else {
    src = layer.raw.buffer.data() + size_t(entry >= 0 ? entry : -int64_t(entry) - 1) * layer.raw.stride;
    bytes = raw_bytes_;
  }
  out->stored.resize(bytes);
  CudaStatus s = cuda_check(cudaStreamSynchronize(as_stream(config_.stream)), "read_page");
  if (s.ok) s = cuda_check(cudaMemcpy(out->stored.data(), src, bytes, cudaMemcpyDeviceToHost), "page download");
  if (!s.ok) return s;
  out->bytes = out->stored;
  if (fragment_pages_) {  // the codec's byte order again (the device page is its transcoding)
    const int D = config_.head_dim;
    if (out->gaac_slot) {
      // GAAC device pages are their codec's pages (codec/gaac_fragments.h): no other order.
    } else if (out->lossy_page && lossy_scheme_ == codec::LossyScheme::kDither8) {
      format::fragment::dither8_page_from_fragments(k == 0, D, D / codec::kQuantGroup, k == 0 ? n_outlier_pairs_ : 0,
                                                   out->stored.data(), out->bytes.data());
    } else if (out->lossy_page) {  // fp8-e4m3 with the exponent witness
      format::fragment::fp8_page_from_fragments(k == 0, D, out->stored.data(), out->bytes.data());
    } else {
      format::fragment::bf16_page_from_fragments(k == 0, D, reinterpret_cast<const uint16_t*>(out->stored.data()),
                                                 reinterpret_cast<uint16_t*>(out->bytes.data()));
    }
  }
  return {};
}

CudaStatus DeviceKvCache::read_rows(int slot, int layer_index, KvTensor kv, int kv_head, int64_t begin, int64_t end,
                                    float* out) const {
  if (!live(slot) || layer_index < 0 || layer_index >= config_.n_layers || begin < 0 || begin > end ||
      end > written(slot, layer_index))
    return cuda_error(StatusCode::kOutOfRange, "device KV cache: read_rows of positions [" + std::to_string(begin) +
                                                   ", " + std::to_string(end) + ") outside what slot " +
                                                   std::to_string(slot) + " holds");
  const int T = config_.block_tokens;
  const int D = config_.head_dim;
  const int k = int(kv);
  const format::GaacElement element = kv_scheme_element(config_.scheme);
  std::vector<float> block_rows(size_t(T) * size_t(D));
  std::vector<uint16_t> bf16(size_t(T) * size_t(D));
  std::vector<uint8_t> fp8(size_t(T) * size_t(D));
  const int exponent_bits = element == format::GaacElement::kFp8E4M3 ? 4 : 5;
  const int mantissa_bits = element == format::GaacElement::kFp8E4M3 ? 3 : 2;
  for (int64_t b = begin / T; b * T < end; ++b) {
    DevicePageBytes page;
    CudaStatus s = read_page(slot, layer_index, kv, kv_head, b, &page);
    if (!s.ok) return s;
    if (page.lossy_page) {
      codec::LossyPageSpec spec = lossy_spec(k == 0);
      spec.dither_key = codec::dither8_key(config_.first_model_layer + layer_index, k == 0, kv_head);
      if (spec.n_outlier_pairs > 0)
        spec.outlier_pairs = layers_[size_t(layer_index)]->host_outlier_pairs.data() + size_t(kv_head) * size_t(n_outlier_pairs_);
      codec::lossy_decode_page_ref(spec, uint32_t(b), page.bytes.data(), block_rows.data());
    } else if (element == format::GaacElement::kBf16) {
      if (page.gaac_slot) {
        const codec::GaacBases& bases = config_.gaac_calibration->bases(layer_index, k, kv_head);
        if (fragment_pages_) {
          if (!codec::gaac_fragment_decode_page_ref(page.bytes.data(), k == 0, D, bases.b4.data(), bf16.data()))
            return cuda_error(StatusCode::kCorrupt, "device KV cache: the GAAC page of layer " +
                                                        std::to_string(layer_index) + ", block " + std::to_string(b) +
                                                        " does not decode");
        } else {
          const size_t slot_bytes = format::gaac_slot_bytes(element, T, D, layers_[size_t(layer_index)]->escape_capacity[k]);
          page.bytes.resize(std::max(page.bytes.size(), slot_bytes), 0);  // the used bytes; the rest unread
          codec::gaac_decode_page_ref(page.bytes.data(), slot_bytes, T, D, bases, bf16.data());
        }
      } else {
        std::memcpy(bf16.data(), page.bytes.data(), std::min(page.bytes.size(), bf16.size() * sizeof(uint16_t)));
      }
      for (size_t i = 0; i < bf16.size(); ++i) block_rows[i] = format::bf16_to_float(bf16[i]);
    } else {  // fp8 elements (the GAAC fp8 schemes): a slot or a raw page
      if (page.gaac_slot) {
        const size_t slot_bytes = format::gaac_slot_bytes(element, T, D, layers_[size_t(layer_index)]->escape_capacity[k]);
        page.bytes.resize(std::max(page.bytes.size(), slot_bytes), 0);
        codec::gaac_decode_page_fp8_ref(element, page.bytes.data(), slot_bytes, T, D,
                                        config_.gaac_calibration->bases(layer_index, k, kv_head), fp8.data());
      } else {
        std::memcpy(fp8.data(), page.bytes.data(), std::min(page.bytes.size(), fp8.size()));
      }
      for (size_t i = 0; i < fp8.size(); ++i) block_rows[i] = format::fp8_to_float(fp8[i], exponent_bits, mantissa_bits);
    }
    const int64_t first = std::max(begin, b * T), last = std::min(end, (b + 1) * T);
    std::copy(block_rows.begin() + (first - b * T) * D, block_rows.begin() + (last - b * T) * D,
              out + (first - begin) * D);
  }
  return {};
}

}  // namespace certkv::cache::cuda
