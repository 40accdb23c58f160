#include "cache/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "core/status.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::cache {

namespace {

using format::PageRef;
using format::StorageClass;

constexpr int kMaxHeadDim = 256;

[[noreturn]] void fail_cache(StatusCode code, const std::string& message) {
  fail(code, "kv cache: " + message);
}

void check_positive(int64_t value, const char* field) {
  if (value <= 0) {
    fail_cache(StatusCode::kInvalidArgument,
               std::string("config.") + field + " must be positive, got " + std::to_string(value));
  }
}


const char* kv_name(KvTensor kv) { return kv == KvTensor::kKey ? "K" : "V"; }

// Slot strides are multiples of 16 bytes (vector loads on the device): at most 15 bytes of padding.
// SmolLM2's calibrated slots (1440 + 18..35 bytes) fall into two strides, 1472 and 1488 bytes,
// 0.6% above their exact sizes; one pool of the largest slot would cost 1.0% more.
constexpr size_t kSlotAlignBytes = 16;

bool is_pending(const PageRef& ref) { return ref.page == format::kNoPage; }

PageRef pending_ref() {
  PageRef ref{};
  ref.page = format::kNoPage;
  ref.storage = StorageClass::kBf16;
  return ref;
}

}  // namespace

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  check_positive(config.n_layers, "n_layers");
  check_positive(config.n_kv_heads, "n_kv_heads");
  check_positive(config.head_dim, "head_dim");
  check_positive(config.block_tokens, "block_tokens");
  check_positive(config.max_tokens, "max_tokens");
  if (config.first_model_layer < 0)
    fail_cache(StatusCode::kInvalidArgument,
               "config.first_model_layer " + std::to_string(config.first_model_layer) + " is negative");
  if (config.head_dim % 8 != 0 || config.head_dim > kMaxHeadDim) {
    fail_cache(StatusCode::kUnsupported, "config.head_dim " + std::to_string(config.head_dim) +
                                             " is not supported (need a multiple of 8, at most " +
                                             std::to_string(kMaxHeadDim) + ")");
  }
  const uint64_t n_tables = 2ull * uint64_t(config.n_layers) * uint64_t(config.n_kv_heads);
  const uint64_t blocks = (uint64_t(config.max_tokens) + config.block_tokens - 1) / config.block_tokens;
  const uint64_t capacity_pages = blocks * n_tables;
  if (capacity_pages >= uint64_t(format::kNoPage)) {
    fail_cache(StatusCode::kInvalidArgument,
               "config.max_tokens " + std::to_string(config.max_tokens) + " needs " +
                   std::to_string(capacity_pages) + " pages, above the limit of " +
                   std::to_string(format::kNoPage - 1));
  }
  capacity_pages_ = capacity_pages;
  if (int(config.scheme) < int(KvScheme::kBf16) || int(config.scheme) >= kNumKvSchemes) {
    fail_cache(StatusCode::kInvalidArgument,
               "config.scheme " + std::to_string(int(config.scheme)) + " is not a KV scheme");
  }
  const bool gaac = kv_scheme_is_gaac(config.scheme);
  gaac_ = gaac;
  lossy_ = kv_scheme_is_lossy(config.scheme);
  element_ = kv_scheme_element(config.scheme);
  const bool fp8 = element_ != format::GaacElement::kBf16;
  raw_class_ = fp8 ? StorageClass::kFp8 : StorageClass::kBf16;
  slot_class_ = fp8 ? StorageClass::kGaacFp8 : StorageClass::kGaac;
  auto chunk_pages = [&](uint64_t default_pages) {
    const uint64_t want = config.pages_per_chunk != 0 ? config.pages_per_chunk : default_pages;
    return uint32_t(std::min<uint64_t>(want, std::max<uint64_t>(capacity_pages, 1)));
  };
  // The gaac scheme keeps only tails and raw fallbacks in the raw pool, and grows every pool by
  // small chunks so that the bytes obtained follow the bytes in use closely.
  bf16_pool_ = std::make_unique<PagePool>(
      raw_class_, page_bytes(), uint32_t(capacity_pages),
      chunk_pages(gaac || lossy_ ? 2 * uint64_t(config.n_kv_heads) : 4 * n_tables));
  block_scratch_.resize(page_bytes());
  check_kv_witness(config.scheme, config.witness, "config.witness");
  if (lossy_) {
    lossy_scheme_ = kv_scheme_lossy(config.scheme);
    slot_class_ = codec::lossy_scheme_is_tier_b(lossy_scheme_) ? StorageClass::kDither8
                                                                : StorageClass::kLossy;
    const bool dither8 = lossy_scheme_ == codec::LossyScheme::kDither8;
    n_outlier_pairs_ = dither8 ? (config.outlier_pairs < 0 ? kDefaultOutlierPairs : config.outlier_pairs) : 0;
    if (!dither8 && config.outlier_pairs > 0) {
      fail_cache(StatusCode::kInvalidArgument,
                 "config.outlier_pairs applies to dither8 only (scheme " +
                     std::string(kv_scheme_name(config.scheme)) + ")");
    }
    if (n_outlier_pairs_ > config.head_dim / 2 || n_outlier_pairs_ > codec::kMaxOutlierPairs) {
      fail_cache(StatusCode::kInvalidArgument,
                 "config.outlier_pairs " + std::to_string(n_outlier_pairs_) +
                     " is above head_dim / 2 = " + std::to_string(config.head_dim / 2) +
                     " (or the limit of " + std::to_string(codec::kMaxOutlierPairs) + ")");
    }
    window_tokens_ = config.recent_window_tokens >= 0
                         ? config.recent_window_tokens
                         : kv_scheme_info(config.scheme).default_window_tokens;
    if (window_tokens_ % config.block_tokens != 0) {
      fail_cache(StatusCode::kInvalidArgument,
                 "config.recent_window_tokens " + std::to_string(window_tokens_) +
                     " is not a multiple of block_tokens " + std::to_string(config.block_tokens));
    }
    std::vector<uint16_t> placeholder(static_cast<size_t>(n_outlier_pairs_));
    for (int j = 0; j < n_outlier_pairs_; ++j) placeholder[size_t(j)] = uint16_t(j);
    outliers_.assign(size_t(config.n_layers) * size_t(config.n_kv_heads), placeholder);
    outliers_chosen_.assign(outliers_.size(), 0);
    if (config.fixed_outlier_pairs) {
      const std::vector<uint16_t>& fixed = *config.fixed_outlier_pairs;
      if (fixed.size() != outliers_.size() * size_t(n_outlier_pairs_))
        fail(StatusCode::kInvalidArgument,
             "config.fixed_outlier_pairs holds " + std::to_string(fixed.size()) + " pair indices, not " +
                 std::to_string(outliers_.size() * size_t(n_outlier_pairs_)) +
                 " (n_layers x n_kv_heads x outlier pairs)");
      for (size_t i = 0; i < outliers_.size(); ++i) {
        std::copy_n(fixed.begin() + ptrdiff_t(i * size_t(n_outlier_pairs_)), n_outlier_pairs_, outliers_[i].begin());
        outliers_chosen_[i] = 1;
      }
      // Each head's list as a page spec takes it (in range, increasing).
      for (int layer = 0; layer < config.n_layers; ++layer)
        for (int h = 0; h < config.n_kv_heads; ++h) codec::validate_lossy_page_spec(lossy_spec(layer, KvTensor::kKey, h));
    }
    const uint64_t tables_per_kv = uint64_t(config.n_layers) * uint64_t(config.n_kv_heads);
    for (int kv = 0; kv < 2; ++kv) {
      codec::LossyPageSpec spec = lossy_spec(0, KvTensor(kv), 0);
      codec::validate_lossy_page_spec(spec);
      slot_pools_.push_back(std::make_unique<PagePool>(
          slot_class_, codec::lossy_page_bytes(spec), uint32_t(blocks * tables_per_kv),
          chunk_pages(tables_per_kv), kSlotAlignBytes));
    }
    backing_of_.resize(2);
    backing_pool_ = std::make_unique<PagePool>(StorageClass::kBf16, page_bytes(),
                                               uint32_t(capacity_pages),
                                               chunk_pages(2 * uint64_t(config.n_kv_heads)));
    // With a GAAC calibration (of bf16 pages) the backing store keeps its blocks GAAC-coded.
    if (config.gaac_calibration) build_gaac_slot_pools(StorageClass::kGaac, backing_slot_pools_, blocks);
    return;
  }
  if (!gaac) return;
  if (config.gaac_calibration == nullptr) {
    fail_cache(StatusCode::kInvalidArgument,
               std::string("KV scheme ") + kv_scheme_name(config.scheme) +
                   " needs a calibration (config.gaac_calibration is null)");
  }
  build_gaac_slot_pools(slot_class_, slot_pools_, blocks);
}

void KvCache::build_gaac_slot_pools(StorageClass storage,
                                    std::vector<std::unique_ptr<PagePool>>& pools,
                                    uint64_t blocks) {
  const KvCacheConfig& config = config_;
  const codec::GaacCalibration* cal = config.gaac_calibration.get();
  if (format::gaac_tile_channels(config.head_dim) == 0) {
    fail_cache(StatusCode::kUnsupported, "config.head_dim " + std::to_string(config.head_dim) +
                                             " does not split into GAAC tiles of at most " +
                                             std::to_string(format::kGaacMaxTileChannels) +
                                             " channels (multiples of 8)");
  }
  const codec::GaacShape want{config.n_layers, config.n_kv_heads, config.head_dim,
                              config.block_tokens, element_};
  const codec::GaacShape& got = cal->shape();
  if (!(got == want)) {
    fail_cache(StatusCode::kInvalidArgument,
               "the GAAC calibration is for n_layers " + std::to_string(got.n_layers) +
                   ", n_kv_heads " + std::to_string(got.n_kv_heads) + ", head_dim " +
                   std::to_string(got.head_dim) + ", block_tokens " +
                   std::to_string(got.block_tokens) + ", element " +
                   codec::gaac_element_name(got.element) + "; this cache has " +
                   std::to_string(want.n_layers) + ", " + std::to_string(want.n_kv_heads) + ", " +
                   std::to_string(want.head_dim) + ", " + std::to_string(want.block_tokens) +
                   ", " + codec::gaac_element_name(want.element) +
                   " (a calibration of another model or KV scheme?)");
  }
  auto chunk_pages = [&](uint64_t default_pages) {
    const uint64_t want_pages = config.pages_per_chunk != 0 ? config.pages_per_chunk : default_pages;
    return uint32_t(std::min<uint64_t>(want_pages, std::max<uint64_t>(capacity_pages_, 1)));
  };
  // One slot pool per distinct slot stride; (layer, K/V) pairs of equal stride share it.
  const size_t n_pairs = 2 * size_t(config.n_layers);
  slot_bytes_.resize(n_pairs);
  slot_pool_of_.resize(n_pairs);
  std::map<size_t, std::vector<size_t>> pairs_by_stride;
  for (size_t pair = 0; pair < n_pairs; ++pair) {
    slot_bytes_[pair] = cal->slot_bytes(int(pair / 2), int(pair % 2));
    const size_t stride = (slot_bytes_[pair] + kSlotAlignBytes - 1) / kSlotAlignBytes * kSlotAlignBytes;
    pairs_by_stride[stride].push_back(pair);
  }
  if (pairs_by_stride.size() > 255) {
    fail_cache(StatusCode::kUnsupported, "the GAAC calibration has " +
                                             std::to_string(pairs_by_stride.size()) +
                                             " distinct slot sizes; at most 255 are supported");
  }
  for (const auto& [stride, pairs] : pairs_by_stride) {
    const uint64_t tables_served = uint64_t(pairs.size()) * uint64_t(config.n_kv_heads);
    for (size_t pair : pairs) slot_pool_of_[pair] = uint8_t(pools.size());
    pools.push_back(std::make_unique<PagePool>(storage, stride, uint32_t(blocks * tables_served),
                                               chunk_pages(tables_served), kSlotAlignBytes));
  }
}

KvCache::~KvCache() = default;

size_t KvCache::page_bytes() const {
  const size_t element_bytes = kv_scheme_element(config_.scheme) == format::GaacElement::kBf16 ? 2 : 1;
  return size_t(config_.block_tokens) * size_t(config_.head_dim) * element_bytes;
}

PageRef KvCache::raw_ref(uint32_t page) const {
  PageRef ref{};
  ref.page = page;
  ref.storage = raw_class_;
  return ref;
}

void KvCache::store_row(const float* x, uint8_t* dst) const {
  const int d = config_.head_dim;
  switch (element_) {
    case format::GaacElement::kBf16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(dst);
      for (int c = 0; c < d; ++c) out[c] = format::float_to_bf16(x[c]);
      break;
    }
    case format::GaacElement::kFp8E4M3:
      for (int c = 0; c < d; ++c) dst[c] = format::bf16_to_fp8_e4m3_ref(format::float_to_bf16(x[c]));
      break;
    case format::GaacElement::kFp8E5M2:
      for (int c = 0; c < d; ++c) dst[c] = format::bf16_to_fp8_e5m2_ref(format::float_to_bf16(x[c]));
      break;
  }
}

KvCache::Sequence& KvCache::sequence(SeqId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) {
    fail_cache(StatusCode::kNotFound, "sequence " + std::to_string(seq) + " does not exist");
  }
  return it->second;
}

const KvCache::Sequence& KvCache::sequence(SeqId seq) const {
  return const_cast<KvCache*>(this)->sequence(seq);
}

void KvCache::check_layer(int layer, const char* what) const {
  if (layer < 0 || layer >= config_.n_layers) {
    fail_cache(StatusCode::kOutOfRange, std::string(what) + ": layer " + std::to_string(layer) +
                                            " out of range [0, " +
                                            std::to_string(config_.n_layers) + ")");
  }
}

void KvCache::check_kv_head(int kv_head, const char* what) const {
  if (kv_head < 0 || kv_head >= config_.n_kv_heads) {
    fail_cache(StatusCode::kOutOfRange, std::string(what) + ": kv_head " +
                                            std::to_string(kv_head) + " out of range [0, " +
                                            std::to_string(config_.n_kv_heads) + ")");
  }
}

size_t KvCache::table_index(int layer, KvTensor kv, int kv_head) const {
  return (size_t(layer) * 2 + size_t(kv)) * size_t(config_.n_kv_heads) + size_t(kv_head);
}

PagePool& KvCache::pool_of(PageRef ref) {
  return const_cast<PagePool&>(static_cast<const KvCache*>(this)->pool_of(ref));
}

const PagePool& KvCache::pool_of(PageRef ref) const {
  if (ref.storage == raw_class_) return *bf16_pool_;
  if (ref.storage == slot_class_ && ref.pool < slot_pools_.size()) {
    return *slot_pools_[ref.pool];
  }
  fail_cache(StatusCode::kInvalidArgument,
             std::string("no pool ") + std::to_string(ref.pool) + " of storage class " +
                 format::storage_class_name(ref.storage) + " in this cache");
}

void KvCache::retain(PageRef ref) {
  if (!is_pending(ref)) pool_of(ref).retain(ref.page);
}

void KvCache::release(PageRef& ref) {
  if (is_pending(ref)) {
    --n_pending_;
  } else {
    PagePool& pool = pool_of(ref);
    pool.release(ref.page);
    if (lossy_ && ref.storage == slot_class_ && pool.ref_count(ref.page) == 0) release_backing(ref);
  }
  ref = pending_ref();
}

uint64_t KvCache::pages_in_use_all() const {
  uint64_t n = bf16_pool_->pages_in_use();
  for (const auto& pool : slot_pools_) n += pool->pages_in_use();
  return n;
}

SeqId KvCache::create_sequence() {
  Sequence s;
  s.written.assign(size_t(config_.n_layers), 0);
  s.tables.resize(2 * size_t(config_.n_layers) * size_t(config_.n_kv_heads));
  s.value_norm_max.assign(size_t(config_.n_layers) * size_t(config_.n_kv_heads), 0.f);
  const SeqId id = next_id_++;
  sequences_.emplace(id, std::move(s));
  return id;
}

SeqId KvCache::fork_sequence(SeqId parent) { return fork_prefix(parent, length(parent)); }

SeqId KvCache::fork_prefix(SeqId parent, int64_t n_tokens) {
  const Sequence& p = sequence(parent);
  if (p.reserved != p.length) {
    fail_cache(StatusCode::kInvalidArgument,
               "fork of sequence " + std::to_string(parent) + " with an uncommitted reservation (" +
                   std::to_string(p.reserved - p.length) + " tokens); commit first");
  }
  if (n_tokens < 0 || n_tokens > p.length ||
      (n_tokens != p.length && n_tokens % config_.block_tokens != 0)) {
    fail_cache(StatusCode::kInvalidArgument,
               "fork of " + std::to_string(n_tokens) + " tokens of sequence " +
                   std::to_string(parent) + " (length " + std::to_string(p.length) +
                   "): a prefix must be whole blocks of " + std::to_string(config_.block_tokens) +
                   " tokens within the sequence");
  }
  const size_t n_blocks = size_t((n_tokens + config_.block_tokens - 1) / config_.block_tokens);
  Sequence child;
  child.length = n_tokens;
  child.reserved = n_tokens;
  child.written.assign(size_t(config_.n_layers), n_tokens);
  child.tables = p.tables;
  // An upper bound over the parent's positions bounds the prefix's too.
  child.value_norm_max = p.value_norm_max;
  for (auto& table : child.tables) {
    table.resize(std::min(table.size(), n_blocks));
    for (const PageRef& ref : table) retain(ref);
  }
  const SeqId id = next_id_++;
  sequences_.emplace(id, std::move(child));
  return id;
}

void KvCache::release_tables(Sequence& s) {
  for (auto& table : s.tables) {
    for (PageRef& ref : table) release(ref);
    table.clear();
  }
}

void KvCache::free_sequence(SeqId seq) {
  Sequence& s = sequence(seq);
  release_tables(s);
  sequences_.erase(seq);
}

SwappedKv::HostBlock KvCache::put_host_block(int layer, KvTensor kv, int kv_head,
                                             const uint8_t* block,
                                             std::vector<uint8_t>& bytes) const {
  SwappedKv::HostBlock hb;
  hb.offset = bytes.size();
  const size_t raw_bytes = page_bytes();
  if (!slot_bytes_.empty()) {
    // Host memory has no fixed slots: the block is coded with room for every escape and kept
    // coded when that is smaller than the raw block.
    const int bt = config_.block_tokens, d = config_.head_dim;
    const codec::GaacCalibration& cal = *config_.gaac_calibration;
    const codec::GaacBases& bases = cal.bases(layer, int(kv), kv_head);
    bytes.resize(hb.offset + format::gaac_slot_bytes(element_, bt, d, raw_bytes));
    uint8_t* dst = bytes.data() + hb.offset;
    const size_t used =
        element_ == format::GaacElement::kBf16
            ? codec::gaac_encode_page(reinterpret_cast<const uint16_t*>(block), bt, d, bases,
                                      raw_bytes, dst)
            : codec::gaac_encode_page_fp8_ref(element_, block, bt, d, bases, raw_bytes, dst);
    if (used != codec::kGaacDoesNotFit && used < raw_bytes) {
      bytes.resize(hb.offset + used);
      hb.bytes = uint32_t(used);
      hb.gaac = true;
      return hb;
    }
    bytes.resize(hb.offset);
  }
  bytes.insert(bytes.end(), block, block + raw_bytes);
  hb.bytes = uint32_t(raw_bytes);
  return hb;
}

void KvCache::get_host_block(int layer, KvTensor kv, int kv_head, const SwappedKv::HostBlock& hb,
                             const std::vector<uint8_t>& bytes, uint8_t* block) const {
  const uint8_t* src = bytes.data() + hb.offset;
  if (!hb.gaac) {
    std::memcpy(block, src, page_bytes());
    return;
  }
  const int bt = config_.block_tokens, d = config_.head_dim;
  const codec::GaacBases& bases = config_.gaac_calibration->bases(layer, int(kv), kv_head);
  if (element_ == format::GaacElement::kBf16) {
    codec::gaac_decode_page(src, hb.bytes, bt, d, bases, reinterpret_cast<uint16_t*>(block));
  } else {
    codec::gaac_decode_page_fp8_ref(element_, src, hb.bytes, bt, d, bases, block);
  }
}

SwappedKv KvCache::swap_out(SeqId seq) {
  Sequence& s = sequence(seq);
  for (int l = 0; l < config_.n_layers; ++l) {
    if (s.written[size_t(l)] > s.length) {
      fail_cache(StatusCode::kInvalidArgument,
                 "swap out of sequence " + std::to_string(seq) + " during a step: layer " +
                     std::to_string(l) + " is written through position " +
                     std::to_string(s.written[size_t(l)]) + " past its length " +
                     std::to_string(s.length) + "; commit first");
    }
  }
  const int64_t bt = config_.block_tokens;
  const size_t n_blocks = size_t((s.length + bt - 1) / bt);
  const size_t row_bytes = page_bytes() / size_t(bt);
  SwappedKv out;
  out.owner_ = this;
  out.length_ = s.length;
  out.value_norm_max_ = s.value_norm_max;
  out.tables_.resize(s.tables.size());
  std::vector<uint8_t> block(page_bytes());
  std::vector<uint16_t> exact(size_t(bt) * size_t(config_.head_dim));
  for (int layer = 0; layer < config_.n_layers; ++layer)
    for (int kv_i = 0; kv_i < 2; ++kv_i)
      for (int h = 0; h < config_.n_kv_heads; ++h) {
        const KvTensor kv = KvTensor(kv_i);
        const size_t t = table_index(layer, kv, h);
        const std::vector<PageRef>& table = s.tables[t];
        std::vector<SwappedKv::Page>& pages = out.tables_[t];
        pages.reserve(n_blocks);
        for (size_t b = 0; b < n_blocks; ++b) {
          const PageRef ref = table[b];
          if (is_pending(ref)) {
            fail_cache(StatusCode::kInternal, "swap out of sequence " + std::to_string(seq) +
                                                  ": committed block " + std::to_string(b) +
                                                  " has no page");
          }
          SwappedKv::Page page;
          page.ref = ref;
          const PagePool& pool = pool_of(ref);
          if (ref.storage == raw_class_) {
            const int64_t rows = std::min<int64_t>(bt, s.length - int64_t(b) * bt);
            std::memcpy(block.data(), pool.data(ref.page), size_t(rows) * row_bytes);
            std::memset(block.data() + size_t(rows) * row_bytes, 0, size_t(bt - rows) * row_bytes);
            page.data = put_host_block(layer, kv, h, block.data(), out.bytes_);
            if (page.data.gaac) ++out.gaac_coded_pages_;
          } else {
            const size_t bytes = lossy_ ? pool.page_bytes() : slot_bytes_[size_t(layer) * 2 + size_t(kv)];
            // dither8 pages are encoded again for the slot they get at swap_in.
            if (!(lossy_ && lossy_scheme_ == codec::LossyScheme::kDither8)) {
              page.data.offset = out.bytes_.size();
              page.data.bytes = uint32_t(bytes);
              out.bytes_.insert(out.bytes_.end(), pool.data(ref.page), pool.data(ref.page) + bytes);
            }
            if (lossy_) {
              read_backing(ref, layer, kv, h, exact.data());
              page.exact = put_host_block(layer, kv, h, reinterpret_cast<const uint8_t*>(exact.data()),
                                          out.bytes_);
            } else {
              ++out.gaac_coded_pages_;
            }
          }
          out.pool_bytes_ += pool.page_stride_bytes();
          pages.push_back(page);
        }
        out.pages_ += pages.size();
      }
  out.bytes_.shrink_to_fit();
  free_sequence(seq);
  return out;
}

void KvCache::swap_in_page(int layer, KvTensor kv, int kv_head, int64_t block, const SwappedKv& swapped,
                           const SwappedKv::Page& page, PageRef& ref) {
  if (page.ref.storage == raw_class_) {
    const uint32_t p = bf16_pool_->allocate();
    try {
      get_host_block(layer, kv, kv_head, page.data, swapped.bytes_, bf16_pool_->data(p));
    } catch (...) {
      bf16_pool_->release(p);
      throw;
    }
    ref = raw_ref(p);
    return;
  }
  PagePool& pool = *slot_pools_[page.ref.pool];
  const uint32_t p = pool.allocate();
  PageRef coded{};
  coded.page = p;
  coded.storage = slot_class_;
  coded.pool = page.ref.pool;
  try {
    if (lossy_) {
      std::vector<uint16_t> exact(size_t(config_.block_tokens) * size_t(config_.head_dim));
      get_host_block(layer, kv, kv_head, page.exact, swapped.bytes_,
                     reinterpret_cast<uint8_t*>(exact.data()));
      if (lossy_scheme_ == codec::LossyScheme::kDither8) {
        // Keyed by the block's position, the dither comes out as it was before the swap.
        if (!codec::lossy_encode_page(lossy_spec(layer, kv, kv_head), uint32_t(block), exact.data(),
                                          pool.data(p))) {
          fail_cache(StatusCode::kInternal, "swap in: a dither8 block that was encoded once no longer encodes");
        }
      } else {
        std::memcpy(pool.data(p), swapped.bytes_.data() + page.data.offset, page.data.bytes);
      }
      store_backing(layer, kv, kv_head, reinterpret_cast<const uint8_t*>(exact.data()), coded);
    } else {
      std::memcpy(pool.data(p), swapped.bytes_.data() + page.data.offset, page.data.bytes);
    }
  } catch (...) {
    pool.release(p);
    throw;
  }
  ref = coded;
}

SeqId KvCache::swap_in(const SwappedKv& swapped) {
  if (swapped.owner_ != this) {
    fail_cache(StatusCode::kInvalidArgument,
               swapped.owner_ == nullptr ? "swap in of an empty SwappedKv (not made by swap_out)"
                                         : "swap in of a sequence swapped out of another cache");
  }
  const uint64_t committed = pages_in_use_all() + n_pending_;
  const uint64_t available = capacity_pages_ > committed ? capacity_pages_ - committed : 0;
  if (swapped.pages_ > available) {
    fail_cache(StatusCode::kOutOfMemory,
               "swap in of " + std::to_string(swapped.length_) + " tokens needs " +
                   std::to_string(swapped.pages_) + " pages but only " + std::to_string(available) +
                   " of " + std::to_string(capacity_pages_) + " are free");
  }
  Sequence s;
  s.length = swapped.length_;
  s.reserved = swapped.length_;
  s.written.assign(size_t(config_.n_layers), swapped.length_);
  s.value_norm_max = swapped.value_norm_max_;
  s.tables.resize(swapped.tables_.size());
  try {
    for (int layer = 0; layer < config_.n_layers; ++layer)
      for (int kv_i = 0; kv_i < 2; ++kv_i)
        for (int h = 0; h < config_.n_kv_heads; ++h) {
          const size_t t = table_index(layer, KvTensor(kv_i), h);
          s.tables[t].reserve(swapped.tables_[t].size());
          for (size_t b = 0; b < swapped.tables_[t].size(); ++b) {
            PageRef ref{};
            swap_in_page(layer, KvTensor(kv_i), h, int64_t(b), swapped, swapped.tables_[t][b], ref);
            s.tables[t].push_back(ref);
          }
        }
  } catch (...) {
    release_tables(s);
    throw;
  }
  const SeqId id = next_id_++;
  sequences_.emplace(id, std::move(s));
  return id;
}

bool KvCache::has_sequence(SeqId seq) const { return sequences_.count(seq) != 0; }

int64_t KvCache::length(SeqId seq) const { return sequence(seq).length; }

int64_t KvCache::reserved_tokens(SeqId seq) const { return sequence(seq).reserved; }

int64_t KvCache::written_tokens(SeqId seq, int layer) const {
  const Sequence& s = sequence(seq);
  check_layer(layer, "written_tokens");
  return s.written[size_t(layer)];
}

int64_t KvCache::n_blocks(SeqId seq) const {
  return (sequence(seq).reserved + config_.block_tokens - 1) / config_.block_tokens;
}

void KvCache::reserve(SeqId seq, int64_t n) {
  Sequence& s = sequence(seq);
  if (n < 0) fail_cache(StatusCode::kInvalidArgument, "reserve of " + std::to_string(n) + " tokens");
  if (n == 0) return;
  const int64_t bt = config_.block_tokens;
  const int64_t target = std::max(s.reserved, s.length + n);
  const int64_t have_blocks = (s.reserved + bt - 1) / bt;
  const int64_t want_blocks = (target + bt - 1) / bt;
  // Blocks receiving positions [length, length + n) that already exist may be shared (a forked
  // prefix's partial tail): those are copied before anything writes them. A shared block is
  // never pending and never finalized (it is partial), so it is a raw page.
  const int64_t first_write_block = s.length / bt;
  const int64_t last_existing = std::min(have_blocks, (s.length + n + bt - 1) / bt);
  size_t n_copies = 0;
  for (const auto& table : s.tables) {
    for (int64_t b = first_write_block; b < last_existing; ++b) {
      const PageRef& ref = table[size_t(b)];
      if (!is_pending(ref) && pool_of(ref).ref_count(ref.page) > 1) ++n_copies;
    }
  }
  const size_t n_new = size_t(want_blocks - have_blocks) * s.tables.size();
  const size_t n_pages = n_copies + n_new;
  if (n_pages == 0) {
    s.reserved = target;
    return;
  }
  const bool gaac = gaac_ || lossy_;  // coded schemes: new blocks stay pending until written
  const uint64_t committed = pages_in_use_all() + n_pending_;
  const uint64_t available = capacity_pages_ > committed ? capacity_pages_ - committed : 0;
  if (n_pages > available) {
    fail_cache(StatusCode::kOutOfMemory,
               "reserve of " + std::to_string(n) + " tokens for sequence " + std::to_string(seq) +
                   " needs " + std::to_string(n_pages) + " pages but only " +
                   std::to_string(available) + " of " + std::to_string(capacity_pages_) +
                   " are free (config.max_tokens = " + std::to_string(config_.max_tokens) + ")");
  }
  // Take every page first so that a refusal from the system allocator leaves the sequence as it
  // was. The gaac scheme takes only the copies now; new blocks stay pending until written.
  const size_t n_take = gaac ? n_copies : n_pages;
  std::vector<uint32_t> pages;
  pages.reserve(n_take);
  try {
    for (size_t i = 0; i < n_take; ++i) pages.push_back(bf16_pool_->allocate());
    for (auto& table : s.tables) table.reserve(size_t(want_blocks));
  } catch (...) {
    for (uint32_t p : pages) bf16_pool_->release(p);
    throw;
  }
  size_t next = 0;
  const size_t bytes = page_bytes();
  for (auto& table : s.tables) {
    for (int64_t b = first_write_block; b < last_existing; ++b) {
      PageRef& ref = table[size_t(b)];
      if (!is_pending(ref) && pool_of(ref).ref_count(ref.page) > 1) {
        const uint32_t copy = pages[next++];
        std::memcpy(bf16_pool_->data(copy), bf16_pool_->data(ref.page), bytes);
        bf16_pool_->release(ref.page);
        ref = raw_ref(copy);
      }
    }
    for (int64_t b = have_blocks; b < want_blocks; ++b) {
      table.push_back(gaac ? pending_ref() : raw_ref(pages[next++]));
    }
  }
  if (gaac) n_pending_ += n_new;
  s.reserved = target;
}

void KvCache::make_raw(int layer, KvTensor kv, int kv_head, PageRef& ref) {
  if (!is_pending(ref) && ref.storage == raw_class_) return;
  const uint32_t page = bf16_pool_->allocate();
  if (is_pending(ref)) {
    --n_pending_;
  } else {
    const PagePool& pool = pool_of(ref);
    if (lossy_) {
      read_backing(ref, layer, kv, kv_head, reinterpret_cast<uint16_t*>(bf16_pool_->data(page)));
      release(ref);
      ref = raw_ref(page);
      return;
    }
    const size_t slot_bytes = slot_bytes_[size_t(layer) * 2 + size_t(kv)];
    if (element_ == format::GaacElement::kBf16) {
      codec::gaac_decode_page(pool.data(ref.page), slot_bytes, config_.block_tokens,
                              config_.head_dim, gaac_bases(layer, kv, kv_head),
                              reinterpret_cast<uint16_t*>(bf16_pool_->data(page)));
    } else {
      codec::gaac_decode_page_fp8_ref(element_, pool.data(ref.page), slot_bytes,
                                      config_.block_tokens, config_.head_dim,
                                      gaac_bases(layer, kv, kv_head), bf16_pool_->data(page));
    }
    pool_of(ref).release(ref.page);
  }
  ref = raw_ref(page);
}

void KvCache::finalize_block(int layer, KvTensor kv, int kv_head, int64_t block_index, const uint8_t* block,
                             PageRef& ref) {
  if (lossy_) {
    finalize_lossy(layer, kv, kv_head, block_index, block, ref);
    return;
  }
  const size_t pair = size_t(layer) * 2 + size_t(kv);
  const codec::GaacCalibration& cal = *config_.gaac_calibration;
  PagePool& slots = *slot_pools_[slot_pool_of_[pair]];
  const uint32_t slot = slots.allocate();
  size_t used;
  try {
    const size_t capacity = cal.escape_capacity_bytes(layer, int(kv));
    if (element_ == format::GaacElement::kBf16) {
      used = codec::gaac_encode_page(reinterpret_cast<const uint16_t*>(block),
                                     config_.block_tokens, config_.head_dim,
                                     gaac_bases(layer, kv, kv_head), capacity, slots.data(slot));
    } else {
      used = codec::gaac_encode_page_fp8_ref(element_, block, config_.block_tokens,
                                             config_.head_dim, gaac_bases(layer, kv, kv_head),
                                             capacity, slots.data(slot));
    }
  } catch (...) {
    slots.release(slot);
    throw;
  }
  if (used != codec::kGaacDoesNotFit) {
    release(ref);
    ref.page = slot;
    ref.storage = slot_class_;
    ref.pool = slot_pool_of_[pair];
    return;
  }
  slots.release(slot);
  keep_block_raw(block, ref);
}

void KvCache::keep_block_raw(const uint8_t* block, PageRef& ref) {
  // Reuse an owned raw page (the tail being finalized), else take one.
  const bool owned_raw = !is_pending(ref) && ref.storage == raw_class_ &&
                         bf16_pool_->ref_count(ref.page) == 1;
  if (!owned_raw) {
    const uint32_t page = bf16_pool_->allocate();
    release(ref);
    ref = raw_ref(page);
  }
  uint8_t* dst = raw_page_mutable(ref);
  if (dst != block) std::memcpy(dst, block, page_bytes());
}

void KvCache::choose_outliers(int layer, int kv_head, const float* x, int64_t n_rows,
                              size_t row_stride) {
  const size_t i = size_t(layer) * size_t(config_.n_kv_heads) + size_t(kv_head);
  if (outliers_chosen_[i] || n_outlier_pairs_ == 0) return;
  const int d = config_.head_dim;
  std::vector<float> rows(size_t(n_rows) * size_t(d));
  for (int64_t r = 0; r < n_rows; ++r)
    std::memcpy(&rows[size_t(r) * size_t(d)], x + size_t(r) * row_stride, sizeof(float) * size_t(d));
  codec::select_outlier_pairs(rows.data(), int(n_rows), d, config_.rope_pairing, n_outlier_pairs_,
                              outliers_[i].data());
  outliers_chosen_[i] = 1;
}

void KvCache::finalize_lossy(int layer, KvTensor kv, int kv_head, int64_t block_index, const uint8_t* block,
                             PageRef& ref) {
  const uint16_t* rows = reinterpret_cast<const uint16_t*>(block);
  const int bt = config_.block_tokens, d = config_.head_dim;
  if (kv == KvTensor::kKey && n_outlier_pairs_ > 0) {
    std::vector<float> x(size_t(bt) * size_t(d));
    for (size_t e = 0; e < x.size(); ++e) x[e] = format::bf16_to_float(rows[e]);
    choose_outliers(layer, kv_head, x.data(), bt, size_t(d));
  }
  const uint8_t pool_index = uint8_t(kv);
  PagePool& pages = *slot_pools_[pool_index];
  const uint32_t page = pages.allocate();
  bool encoded = false;
  PageRef lossy{};
  lossy.page = page;
  lossy.storage = slot_class_;
  lossy.pool = pool_index;
  try {
    encoded = codec::lossy_encode_page(lossy_spec(layer, kv, kv_head), uint32_t(block_index), rows,
                                           pages.data(page));
    if (encoded) store_backing(layer, kv, kv_head, block, lossy);
  } catch (...) {
    pages.release(page);
    throw;
  }
  if (!encoded) {
    // Not finite, or a scale beyond fp16: the block stays exact and is counted, never certified.
    pages.release(page);
    ++exact_fallback_blocks_;
    keep_block_raw(block, ref);
    return;
  }
  release(ref);
  ref = lossy;
}

void KvCache::store_backing(int layer, KvTensor kv, int kv_head, const uint8_t* block,
                            PageRef lossy) {
  PageRef backing{};
  if (!backing_slot_pools_.empty()) {
    const size_t pair = size_t(layer) * 2 + size_t(kv);
    PagePool& slots = *backing_slot_pools_[slot_pool_of_[pair]];
    const uint32_t slot = slots.allocate();
    size_t used;
    try {
      used = codec::gaac_encode_page(reinterpret_cast<const uint16_t*>(block), config_.block_tokens,
                                     config_.head_dim,
                                     config_.gaac_calibration->bases(layer, int(kv), kv_head),
                                     config_.gaac_calibration->escape_capacity_bytes(layer, int(kv)),
                                     slots.data(slot));
    } catch (...) {
      slots.release(slot);
      throw;
    }
    if (used != codec::kGaacDoesNotFit) {
      backing.page = slot;
      backing.storage = StorageClass::kGaac;
      backing.pool = slot_pool_of_[pair];
    } else {
      slots.release(slot);
    }
  }
  if (backing.storage != StorageClass::kGaac) {
    backing.page = backing_pool_->allocate();
    backing.storage = StorageClass::kBf16;
    std::memcpy(backing_pool_->data(backing.page), block, page_bytes());
  }
  std::vector<PageRef>& backing_of = backing_of_[lossy.pool];
  if (backing_of.size() <= lossy.page) backing_of.resize(size_t(lossy.page) + 1, pending_ref());
  backing_of[lossy.page] = backing;
}

void KvCache::read_backing(PageRef lossy, int layer, KvTensor kv, int kv_head,
                           uint16_t* out) const {
  const PageRef backing = backing_of_[lossy.pool][lossy.page];
  if (backing.storage == StorageClass::kGaac) {
    codec::gaac_decode_page(backing_slot_pools_[backing.pool]->data(backing.page),
                            slot_bytes_[size_t(layer) * 2 + size_t(kv)], config_.block_tokens,
                            config_.head_dim, config_.gaac_calibration->bases(layer, int(kv), kv_head),
                            out);
  } else {
    std::memcpy(out, backing_pool_->data(backing.page), page_bytes());
  }
}

void KvCache::release_backing(PageRef lossy) {
  PageRef& backing = backing_of_[lossy.pool][lossy.page];
  if (is_pending(backing)) return;
  if (backing.storage == StorageClass::kGaac) {
    backing_slot_pools_[backing.pool]->release(backing.page);
  } else {
    backing_pool_->release(backing.page);
  }
  backing = pending_ref();
}

void KvCache::write_coded(Sequence& s, int layer, KvTensor kv, int kv_head, const float* x,
                          int64_t n) {
  const int64_t bt = config_.block_tokens;
  const int d = config_.head_dim;
  const int h_kv = config_.n_kv_heads;
  const size_t row_bytes = page_bytes() / size_t(bt);
  const size_t x_stride = size_t(h_kv) * size_t(d);
  std::vector<PageRef>& table = s.tables[table_index(layer, kv, kv_head)];
  const int64_t begin = s.length, end = s.length + n;
  const int64_t window = lossy_ ? window_tokens_ : 0;
  const float* x_head = x + size_t(kv_head) * size_t(d);
  // dither8 picks the outlier pairs of a (layer, kv_head) from its first write of a whole block
  // or more (else from the first block it finalizes).
  if (lossy_ && kv == KvTensor::kKey && n >= bt) choose_outliers(layer, kv_head, x_head, n, x_stride);
  for (int64_t b = begin / bt; b * bt < end; ++b) {
    const int64_t row0 = std::max(begin, b * bt) - b * bt;
    const int64_t row1 = std::min(end, (b + 1) * bt) - b * bt;
    PageRef& ref = table[size_t(b)];
    const bool leaves_window = (b + 1) * bt <= end - window;
    if (row0 == 0 && row1 == bt && leaves_window) {
      // The whole block comes from this write and is final: encode it straight from the input.
      for (int64_t r = 0; r < bt; ++r)
        store_row(x_head + size_t(b * bt + r - begin) * x_stride, block_scratch_.data() + size_t(r) * row_bytes);
      finalize_block(layer, kv, kv_head, b, block_scratch_.data(), ref);
      continue;
    }
    make_raw(layer, kv, kv_head, ref);
    if (bf16_pool_->ref_count(ref.page) != 1) {
      fail_cache(StatusCode::kInternal, "write into page " + std::to_string(ref.page) +
                                            " shared by " +
                                            std::to_string(bf16_pool_->ref_count(ref.page)) +
                                            " references");
    }
    uint8_t* page = raw_page_mutable(ref);
    for (int64_t r = row0; r < row1; ++r)
      store_row(x_head + size_t(b * bt + r - begin) * x_stride, page + size_t(r) * row_bytes);
  }
  // Blocks whose last position leaves the recent window with this write are finalized now (with
  // no window: the blocks this write completed). Rows before `begin` are committed.
  const int64_t first = std::max<int64_t>(0, (begin - window) / bt);
  for (int64_t b = first; (b + 1) * bt <= end - window; ++b) {
    if ((b + 1) * bt <= begin - window) continue;  // left the window before this write
    if (b * bt >= begin && (b + 1) * bt <= end) continue;  // whole in this write: handled above
    PageRef& ref = table[size_t(b)];
    if (is_pending(ref) || ref.storage != raw_class_) continue;  // encoded straight from the input
    finalize_block(layer, kv, kv_head, b, raw_page_mutable(ref), ref);
  }
}

void KvCache::write(SeqId seq, int layer, const float* k, const float* v, int64_t n) {
  Sequence& s = sequence(seq);
  check_layer(layer, "write");
  if (n < 1) fail_cache(StatusCode::kInvalidArgument, "write of " + std::to_string(n) + " tokens");
  if (s.length + n > s.reserved) {
    fail_cache(StatusCode::kOutOfRange,
               "write of " + std::to_string(n) + " tokens at position " + std::to_string(s.length) +
                   " of sequence " + std::to_string(seq) + " beyond its reservation (" +
                   std::to_string(s.reserved) + " tokens); call reserve first");
  }
  if (k == nullptr || v == nullptr) fail_cache(StatusCode::kInvalidArgument, "write: null k or v");
  const int bt = config_.block_tokens;
  const int d = config_.head_dim;
  const int h_kv = config_.n_kv_heads;
  for (int kvi = 0; kvi < 2; ++kvi) {
    const KvTensor kv = KvTensor(kvi);
    const float* src = kv == KvTensor::kKey ? k : v;
    for (int h = 0; h < h_kv; ++h) {
      if (gaac_ || lossy_) {
        write_coded(s, layer, kv, h, src, n);
        continue;
      }
      const std::vector<PageRef>& table = s.tables[table_index(layer, kv, h)];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = s.length + i;
        const PageRef ref = table[size_t(pos / bt)];
        if (bf16_pool_->ref_count(ref.page) != 1) {
          fail_cache(StatusCode::kInternal, "write into page " + std::to_string(ref.page) +
                                                " shared by " +
                                                std::to_string(bf16_pool_->ref_count(ref.page)) +
                                                " references");
        }
        const size_t row_bytes = page_bytes() / size_t(bt);
        uint8_t* dst = raw_page_mutable(ref) + size_t(pos % bt) * row_bytes;
        store_row(src + (size_t(i) * size_t(h_kv) + size_t(h)) * size_t(d), dst);
      }
    }
  }
  // ||v_t|| of the stored bf16 values, in double, rounded up to float.
  for (int h = 0; h < h_kv; ++h) {
    float& norm_max = s.value_norm_max[size_t(layer) * size_t(h_kv) + size_t(h)];
    for (int64_t i = 0; i < n; ++i) {
      const float* row = v + (size_t(i) * size_t(h_kv) + size_t(h)) * size_t(d);
      double sq = 0;
      for (int c = 0; c < d; ++c) {
        const double x = format::bf16_to_float(format::float_to_bf16(row[c]));
        sq += x * x;
      }
      const float norm = std::nextafter(float(std::sqrt(sq) * (1 + 0x1p-40)), INFINITY);
      if (!(norm <= norm_max)) norm_max = norm;  // NaN sticks: the bound is then unusable
    }
  }
  int64_t& written = s.written[size_t(layer)];
  written = std::max(written, s.length + n);
}

void KvCache::commit(SeqId seq, int64_t n) {
  Sequence& s = sequence(seq);
  if (n < 1) fail_cache(StatusCode::kInvalidArgument, "commit of " + std::to_string(n) + " tokens");
  if (s.length + n > s.reserved) {
    fail_cache(StatusCode::kOutOfRange, "commit of " + std::to_string(n) + " tokens of sequence " +
                                            std::to_string(seq) + " beyond its reservation (" +
                                            std::to_string(s.reserved - s.length) + " tokens)");
  }
  for (int l = 0; l < config_.n_layers; ++l) {
    if (s.written[size_t(l)] < s.length + n) {
      fail_cache(StatusCode::kInvalidArgument,
                 "commit of " + std::to_string(n) + " tokens of sequence " + std::to_string(seq) +
                     ": layer " + std::to_string(l) + " was written only through position " +
                     std::to_string(s.written[size_t(l)]));
    }
  }
  s.length += n;
}

const PageRef* KvCache::block_table(SeqId seq, int layer, KvTensor kv, int kv_head) const {
  const Sequence& s = sequence(seq);
  check_layer(layer, "block_table");
  check_kv_head(kv_head, "block_table");
  return s.tables[table_index(layer, kv, kv_head)].data();
}

const uint16_t* KvCache::page_bf16(PageRef ref) const {
  if (ref.storage != StorageClass::kBf16) {
    fail_cache(StatusCode::kUnsupported,
               std::string("page_bf16 of a page of storage class ") +
                   format::storage_class_name(ref.storage));
  }
  return reinterpret_cast<const uint16_t*>(page_bytes_of(ref));
}

const uint8_t* KvCache::page_bytes_of(PageRef ref) const {
  const PagePool& pool = pool_of(ref);
  if (pool.ref_count(ref.page) == 0) {
    fail_cache(StatusCode::kInvalidArgument,
               "page " + std::to_string(ref.page) + " of class " +
                   format::storage_class_name(ref.storage) +
                   " is not in use (a stale or pending block table entry?)");
  }
  return pool.data(ref.page);
}

uint16_t* KvCache::page_bf16_mutable(PageRef ref) {
  return const_cast<uint16_t*>(page_bf16(ref));
}

const uint8_t* KvCache::page_fp8(PageRef ref) const {
  if (ref.storage != StorageClass::kFp8) {
    fail_cache(StatusCode::kUnsupported,
               std::string("page_fp8 of a page of storage class ") +
                   format::storage_class_name(ref.storage));
  }
  return page_bytes_of(ref);
}

uint8_t* KvCache::raw_page_mutable(PageRef ref) {
  if (ref.storage != raw_class_) {
    fail_cache(StatusCode::kInternal, std::string("write into a page of storage class ") +
                                          format::storage_class_name(ref.storage));
  }
  return const_cast<uint8_t*>(page_bytes_of(ref));
}

const codec::GaacBases& KvCache::gaac_bases(int layer, KvTensor kv, int kv_head) const {
  if (!gaac_) {
    fail_cache(StatusCode::kInvalidArgument, "gaac_bases of a cache of scheme " +
                                                 std::string(kv_scheme_name(config_.scheme)));
  }
  return config_.gaac_calibration->bases(layer, int(kv), kv_head);
}

size_t KvCache::gaac_slot_bytes(int layer, KvTensor kv) const {
  if (!gaac_) {
    fail_cache(StatusCode::kInvalidArgument, "gaac_slot_bytes of a cache of scheme " +
                                                 std::string(kv_scheme_name(config_.scheme)));
  }
  check_layer(layer, "gaac_slot_bytes");
  return slot_bytes_[size_t(layer) * 2 + size_t(kv)];
}

void KvCache::read_token_range_ref(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                                   int64_t end, float* out) const {
  read_token_range(seq, layer, kv, kv_head, begin, end, false, out);
}

void KvCache::read_token_range_exact(SeqId seq, int layer, KvTensor kv, int kv_head,
                                     int64_t begin, int64_t end, float* out) const {
  read_token_range(seq, layer, kv, kv_head, begin, end, true, out);
}

void KvCache::read_token_range(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                               int64_t end, bool exact, float* out) const {
  const Sequence& s = sequence(seq);
  check_layer(layer, "read_token_range");
  check_kv_head(kv_head, "read_token_range");
  const int64_t written = s.written[size_t(layer)];
  if (begin < 0 || begin > end || end > written) {
    fail_cache(StatusCode::kOutOfRange,
               "read of " + std::string(kv_name(kv)) + " positions [" + std::to_string(begin) +
                   ", " + std::to_string(end) + ") of sequence " + std::to_string(seq) +
                   " layer " + std::to_string(layer) + ": only [0, " + std::to_string(written) +
                   ") are written");
  }
  const std::vector<PageRef>& table = s.tables[table_index(layer, kv, kv_head)];
  const int bt = config_.block_tokens;
  const int d = config_.head_dim;
  std::vector<uint16_t> decoded;
  std::vector<uint8_t> decoded_fp8;
  std::vector<float> decoded_lossy;
  int64_t decoded_block = -1;
  const int exponent_bits = element_ == format::GaacElement::kFp8E4M3 ? 4 : 5;
  const int mantissa_bits = element_ == format::GaacElement::kFp8E4M3 ? 3 : 2;
  for (int64_t pos = begin; pos < end; ++pos) {
    const int64_t b = pos / bt;
    const PageRef ref = table[size_t(b)];
    float* dst = out + size_t(pos - begin) * size_t(d);
    const size_t row = size_t(pos % bt) * size_t(d);
    if (lossy_ && ref.storage == slot_class_) {
      if (exact) {
        if (decoded_block != b) {
          decoded.resize(size_t(bt) * size_t(d));
          read_backing(ref, layer, kv, kv_head, decoded.data());
          decoded_block = b;
        }
        for (int c = 0; c < d; ++c) dst[c] = format::bf16_to_float(decoded[row + c]);
        continue;
      }
      if (decoded_block != b) {
        decoded_lossy.resize(size_t(bt) * size_t(d));
        codec::lossy_decode_page_ref(lossy_spec(layer, kv, kv_head), uint32_t(b),
                                     page_bytes_of(ref), decoded_lossy.data());
        decoded_block = b;
      }
      std::memcpy(dst, &decoded_lossy[row], sizeof(float) * size_t(d));
      continue;
    }
    if (ref.storage == StorageClass::kFp8 || ref.storage == StorageClass::kGaacFp8) {
      const uint8_t* block;
      if (ref.storage == StorageClass::kGaacFp8) {
        if (decoded_block != b) {
          decoded_fp8.resize(size_t(bt) * size_t(d));
          codec::gaac_decode_page_fp8_ref(element_, page_bytes_of(ref),
                                          gaac_slot_bytes(layer, kv), bt, d,
                                          gaac_bases(layer, kv, kv_head), decoded_fp8.data());
          decoded_block = b;
        }
        block = decoded_fp8.data();
      } else {
        block = page_fp8(ref);
      }
      for (int c = 0; c < d; ++c) dst[c] = format::fp8_to_float(block[row + c], exponent_bits, mantissa_bits);
      continue;
    }
    const uint16_t* block;
    if (ref.storage == StorageClass::kGaac) {
      if (decoded_block != b) {
        decoded.resize(size_t(bt) * size_t(d));
        codec::gaac_decode_page_ref(page_bytes_of(ref), gaac_slot_bytes(layer, kv), bt, d,
                                    gaac_bases(layer, kv, kv_head), decoded.data());
        decoded_block = b;
      }
      block = decoded.data();
    } else {
      block = page_bf16(ref);
    }
    for (int c = 0; c < d; ++c) dst[c] = format::bf16_to_float(block[row + c]);
  }
}

void KvCache::read_exact_page(PageRef ref, int layer, KvTensor kv, int kv_head, uint16_t* out) const {
  check_layer(layer, "read_exact_page");
  check_kv_head(kv_head, "read_exact_page");
  if (!lossy_ || ref.storage != slot_class_ || ref.pool != uint8_t(kv) || is_pending(ref) ||
      pool_of(ref).ref_count(ref.page) == 0) {
    fail_cache(StatusCode::kInvalidArgument,
               std::string("read_exact_page: page ") + std::to_string(ref.page) + " of class " +
                   format::storage_class_name(ref.storage) + " is not a lossy " + kv_name(kv) +
                   " page in use");
  }
  read_backing(ref, layer, kv, kv_head, out);
}

codec::LossyPageSpec KvCache::lossy_spec(int layer, KvTensor kv, int kv_head) const {
  if (!lossy_) {
    fail_cache(StatusCode::kInvalidArgument, "lossy_spec of a cache of scheme " +
                                                 std::string(kv_scheme_name(config_.scheme)));
  }
  check_layer(layer, "lossy_spec");
  check_kv_head(kv_head, "lossy_spec");
  codec::LossyPageSpec spec;
  spec.scheme = lossy_scheme_;
  spec.key = kv == KvTensor::kKey;
  spec.block_tokens = config_.block_tokens;
  spec.head_dim = config_.head_dim;
  spec.pairing = config_.rope_pairing;
  spec.witness = config_.witness;
  spec.dither_key = codec::dither8_key(config_.first_model_layer + layer, spec.key, kv_head);
  if (spec.key && n_outlier_pairs_ > 0) {
    const auto& pairs = outliers_[size_t(layer) * size_t(config_.n_kv_heads) + size_t(kv_head)];
    spec.n_outlier_pairs = n_outlier_pairs_;
    spec.outlier_pairs = pairs.data();
  }
  return spec;
}

uint64_t KvCache::repair_block(SeqId seq, int layer, int kv_head, int64_t block) {
  Sequence& s = sequence(seq);
  check_layer(layer, "repair_block");
  check_kv_head(kv_head, "repair_block");
  const int64_t n_blocks = (s.reserved + config_.block_tokens - 1) / config_.block_tokens;
  if (block < 0 || block >= n_blocks) {
    fail_cache(StatusCode::kOutOfRange, "repair_block: block " + std::to_string(block) +
                                            " out of range [0, " + std::to_string(n_blocks) + ")");
  }
  if (!lossy_) return 0;
  PageRef* refs[2] = {&s.tables[table_index(layer, KvTensor::kKey, kv_head)][size_t(block)],
                      &s.tables[table_index(layer, KvTensor::kValue, kv_head)][size_t(block)]};
  uint32_t raw[2] = {format::kNoPage, format::kNoPage};
  try {
    for (int i = 0; i < 2; ++i)
      if (!is_pending(*refs[i]) && refs[i]->storage == slot_class_) raw[i] = bf16_pool_->allocate();
  } catch (...) {
    for (uint32_t p : raw)
      if (p != format::kNoPage) bf16_pool_->release(p);
    throw;
  }
  uint64_t bytes = 0;
  for (int i = 0; i < 2; ++i) {
    if (raw[i] == format::kNoPage) continue;
    PageRef& ref = *refs[i];
    read_backing(ref, layer, i == 0 ? KvTensor::kKey : KvTensor::kValue, kv_head,
                 reinterpret_cast<uint16_t*>(bf16_pool_->data(raw[i])));
    bytes += page_bytes();
    release(ref);
    ref = raw_ref(raw[i]);
  }
  return bytes;
}

float KvCache::value_norm_max(SeqId seq, int layer, int kv_head) const {
  const Sequence& s = sequence(seq);
  check_layer(layer, "value_norm_max");
  check_kv_head(kv_head, "value_norm_max");
  return s.value_norm_max[size_t(layer) * size_t(config_.n_kv_heads) + size_t(kv_head)];
}

uint32_t KvCache::ref_count(PageRef ref) const {
  if (is_pending(ref)) return 0;
  if (ref.storage == raw_class_) return bf16_pool_->ref_count(ref.page);
  if (ref.storage == slot_class_ && ref.pool < slot_pools_.size()) {
    return slot_pools_[ref.pool]->ref_count(ref.page);
  }
  return 0;
}

MemoryStats KvCache::memory_stats() const {
  MemoryStats stats{};
  for (const auto& [id, s] : sequences_) {
    for (const auto& table : s.tables) stats.block_table_bytes += table.size() * sizeof(PageRef);
  }
  auto add_pool = [](StorageClassStats& c, const PagePool& pool) {
    c.bytes_reserved_from_allocator += pool.bytes_from_allocator();
    c.pages_in_use += pool.pages_in_use();
    c.pages_free += pool.pages_free();
    c.page_bytes_in_use += uint64_t(pool.pages_in_use()) * pool.page_stride_bytes();
    ++c.n_pools;
  };
  StorageClassStats raw{};
  raw.storage = raw_class_;
  add_pool(raw, *bf16_pool_);
  stats.by_class.push_back(raw);
  if (gaac_ || lossy_) {
    StorageClassStats gaac{};
    gaac.storage = slot_class_;
    for (const auto& pool : slot_pools_) add_pool(gaac, *pool);
    stats.by_class.push_back(gaac);
  }
  for (const StorageClassStats& c : stats.by_class) {
    stats.bytes_reserved_from_allocator += c.bytes_reserved_from_allocator;
    stats.bytes_in_use += c.page_bytes_in_use;
    stats.pages_in_use += c.pages_in_use;
    stats.pages_free += c.pages_free;
  }
  stats.bytes_in_use += stats.block_table_bytes;
  if (backing_pool_) {
    stats.backing_bytes_reserved_from_allocator = backing_pool_->bytes_from_allocator();
    stats.backing_pages_in_use = backing_pool_->pages_in_use();
    for (const auto& pool : backing_slot_pools_) {
      stats.backing_bytes_reserved_from_allocator += pool->bytes_from_allocator();
      stats.backing_pages_in_use += pool->pages_in_use();
    }
  }
  stats.exact_fallback_blocks = exact_fallback_blocks_;
  return stats;
}

std::vector<ClassBytes> KvCache::sequence_bytes(SeqId seq) const {
  const Sequence& s = sequence(seq);
  std::vector<ClassBytes> out{{raw_class_, 0}};
  if (gaac_ || lossy_) out.push_back({slot_class_, 0});
  for (const auto& table : s.tables)
    for (const PageRef& ref : table) {
      if (is_pending(ref)) continue;
      out[ref.storage == raw_class_ ? 0 : 1].bytes += pool_of(ref).page_stride_bytes();
    }
  return out;
}

uint64_t KvCache::pages_referenced(std::span<const SeqId> seqs) const {
  // One mark per page obtained, per pool: the raw pool, then each slot pool (pool_of's order).
  std::vector<std::vector<bool>> marked(1 + slot_pools_.size());
  marked[0].assign(bf16_pool_->pages_obtained(), false);
  for (size_t i = 0; i < slot_pools_.size(); ++i) marked[1 + i].assign(slot_pools_[i]->pages_obtained(), false);
  uint64_t n = 0;
  for (SeqId seq : seqs)
    for (const auto& table : sequence(seq).tables)
      for (const PageRef& ref : table) {
        if (is_pending(ref)) continue;
        pool_of(ref);  // checks the class and pool
        std::vector<bool>& m = marked[ref.storage == raw_class_ ? 0 : 1 + size_t(ref.pool)];
        if (!m[ref.page]) {
          m[ref.page] = true;
          ++n;
        }
      }
  return n;
}

uint64_t KvCache::kv_bytes_bf16(int64_t n_tokens) const {
  return 2ull * uint64_t(config_.n_layers) * uint64_t(config_.n_kv_heads) *
         uint64_t(config_.head_dim) * sizeof(uint16_t) * uint64_t(std::max<int64_t>(n_tokens, 0));
}

const PagePool& KvCache::pool(StorageClass storage) const {
  if (storage != raw_class_) {
    fail_cache(StatusCode::kUnsupported, std::string("no single pool for storage class ") +
                                             format::storage_class_name(storage) +
                                             " (see slot_pool)");
  }
  return *bf16_pool_;
}

const PagePool& KvCache::slot_pool(size_t i) const {
  if (i >= slot_pools_.size()) {
    fail_cache(StatusCode::kOutOfRange, "slot pool " + std::to_string(i) + " of " +
                                            std::to_string(slot_pools_.size()));
  }
  return *slot_pools_[i];
}

}  // namespace certkv::cache
