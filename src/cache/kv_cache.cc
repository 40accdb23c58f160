#include "cache/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/status.h"
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

PageRef bf16_ref(uint32_t page) {
  PageRef ref{};
  ref.page = page;
  ref.storage = StorageClass::kBf16;
  return ref;
}

const char* kv_name(KvTensor kv) { return kv == KvTensor::kKey ? "K" : "V"; }

}  // namespace

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  check_positive(config.n_layers, "n_layers");
  check_positive(config.n_kv_heads, "n_kv_heads");
  check_positive(config.head_dim, "head_dim");
  check_positive(config.block_tokens, "block_tokens");
  check_positive(config.max_tokens, "max_tokens");
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
  uint64_t pages_per_chunk = config.pages_per_chunk != 0 ? config.pages_per_chunk : 4 * n_tables;
  pages_per_chunk = std::min<uint64_t>(pages_per_chunk, std::max<uint64_t>(capacity_pages, 1));
  bf16_pool_ = std::make_unique<PagePool>(StorageClass::kBf16, page_bytes(),
                                          uint32_t(capacity_pages), uint32_t(pages_per_chunk));
}

KvCache::~KvCache() = default;

size_t KvCache::page_bytes() const {
  return size_t(config_.block_tokens) * size_t(config_.head_dim) * sizeof(uint16_t);
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

SeqId KvCache::create_sequence() {
  Sequence s;
  s.written.assign(size_t(config_.n_layers), 0);
  s.tables.resize(2 * size_t(config_.n_layers) * size_t(config_.n_kv_heads));
  const SeqId id = next_id_++;
  sequences_.emplace(id, std::move(s));
  return id;
}

SeqId KvCache::fork_sequence(SeqId parent) {
  const Sequence& p = sequence(parent);
  if (p.reserved != p.length) {
    fail_cache(StatusCode::kInvalidArgument,
               "fork of sequence " + std::to_string(parent) + " with an uncommitted reservation (" +
                   std::to_string(p.reserved - p.length) + " tokens); commit first");
  }
  Sequence child;
  child.length = p.length;
  child.reserved = p.length;
  child.written.assign(size_t(config_.n_layers), p.length);
  child.tables = p.tables;
  for (const auto& table : child.tables) {
    for (const PageRef& ref : table) bf16_pool_->retain(ref.page);
  }
  const SeqId id = next_id_++;
  sequences_.emplace(id, std::move(child));
  return id;
}

void KvCache::release_tables(Sequence& s) {
  for (auto& table : s.tables) {
    for (const PageRef& ref : table) bf16_pool_->release(ref.page);
    table.clear();
  }
}

void KvCache::free_sequence(SeqId seq) {
  Sequence& s = sequence(seq);
  release_tables(s);
  sequences_.erase(seq);
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
  // prefix's partial tail): those are copied before anything writes them.
  const int64_t first_write_block = s.length / bt;
  const int64_t last_existing = std::min(have_blocks, (s.length + n + bt - 1) / bt);
  size_t n_copies = 0;
  for (const auto& table : s.tables) {
    for (int64_t b = first_write_block; b < last_existing; ++b) {
      if (bf16_pool_->ref_count(table[size_t(b)].page) > 1) ++n_copies;
    }
  }
  const size_t n_new = size_t(want_blocks - have_blocks) * s.tables.size();
  const size_t n_pages = n_copies + n_new;
  if (n_pages == 0) {
    s.reserved = target;
    return;
  }
  const uint64_t available = uint64_t(bf16_pool_->capacity_pages()) - bf16_pool_->pages_in_use();
  if (n_pages > available) {
    fail_cache(StatusCode::kOutOfMemory,
               "reserve of " + std::to_string(n) + " tokens for sequence " + std::to_string(seq) +
                   " needs " + std::to_string(n_pages) + " pages but only " +
                   std::to_string(available) + " of " +
                   std::to_string(bf16_pool_->capacity_pages()) +
                   " are free (config.max_tokens = " + std::to_string(config_.max_tokens) + ")");
  }
  // Take every page first so that a refusal from the system allocator leaves the sequence as it was.
  std::vector<uint32_t> pages;
  pages.reserve(n_pages);
  try {
    for (size_t i = 0; i < n_pages; ++i) pages.push_back(bf16_pool_->allocate());
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
      if (bf16_pool_->ref_count(ref.page) > 1) {
        const uint32_t copy = pages[next++];
        std::memcpy(bf16_pool_->data(copy), bf16_pool_->data(ref.page), bytes);
        bf16_pool_->release(ref.page);
        ref = bf16_ref(copy);
      }
    }
    for (int64_t b = have_blocks; b < want_blocks; ++b) table.push_back(bf16_ref(pages[next++]));
  }
  s.reserved = target;
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
        uint16_t* dst = page_bf16_mutable(ref) + size_t(pos % bt) * size_t(d);
        const float* x = src + (size_t(i) * size_t(h_kv) + size_t(h)) * size_t(d);
        for (int c = 0; c < d; ++c) dst[c] = format::float_to_bf16(x[c]);
      }
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
  if (bf16_pool_->ref_count(ref.page) == 0) {
    fail_cache(StatusCode::kInvalidArgument,
               "page " + std::to_string(ref.page) + " is not in use (a stale block table entry?)");
  }
  return reinterpret_cast<const uint16_t*>(bf16_pool_->data(ref.page));
}

uint16_t* KvCache::page_bf16_mutable(PageRef ref) {
  return const_cast<uint16_t*>(page_bf16(ref));
}

void KvCache::read_token_range_ref(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                                   int64_t end, float* out) const {
  const Sequence& s = sequence(seq);
  check_layer(layer, "read_token_range_ref");
  check_kv_head(kv_head, "read_token_range_ref");
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
  for (int64_t pos = begin; pos < end; ++pos) {
    const uint16_t* row = page_bf16(table[size_t(pos / bt)]) + size_t(pos % bt) * size_t(d);
    float* dst = out + size_t(pos - begin) * size_t(d);
    for (int c = 0; c < d; ++c) dst[c] = format::bf16_to_float(row[c]);
  }
}

uint32_t KvCache::ref_count(PageRef ref) const {
  if (ref.storage != StorageClass::kBf16) return 0;
  return bf16_pool_->ref_count(ref.page);
}

MemoryStats KvCache::memory_stats() const {
  MemoryStats stats{};
  for (const auto& [id, s] : sequences_) {
    for (const auto& table : s.tables) stats.block_table_bytes += table.size() * sizeof(PageRef);
  }
  StorageClassStats bf16{};
  bf16.storage = StorageClass::kBf16;
  bf16.bytes_reserved_from_allocator = bf16_pool_->bytes_from_allocator();
  bf16.pages_in_use = bf16_pool_->pages_in_use();
  bf16.pages_free = bf16_pool_->pages_free();
  bf16.page_bytes_in_use = bf16.pages_in_use * bf16_pool_->page_stride_bytes();
  stats.by_class.push_back(bf16);
  for (const StorageClassStats& c : stats.by_class) {
    stats.bytes_reserved_from_allocator += c.bytes_reserved_from_allocator;
    stats.bytes_in_use += c.page_bytes_in_use;
    stats.pages_in_use += c.pages_in_use;
    stats.pages_free += c.pages_free;
  }
  stats.bytes_in_use += stats.block_table_bytes;
  return stats;
}

uint64_t KvCache::kv_bytes_bf16(int64_t n_tokens) const {
  return 2ull * uint64_t(config_.n_layers) * uint64_t(config_.n_kv_heads) *
         uint64_t(config_.head_dim) * sizeof(uint16_t) * uint64_t(std::max<int64_t>(n_tokens, 0));
}

const PagePool& KvCache::pool(StorageClass storage) const {
  if (storage != StorageClass::kBf16) {
    fail_cache(StatusCode::kUnsupported, std::string("no pool for storage class ") +
                                             format::storage_class_name(storage));
  }
  return *bf16_pool_;
}

}  // namespace certkv::cache
