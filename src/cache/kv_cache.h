// Paged KV cache: BF16 pages in a ref-counted pool, one block table per (sequence, layer, K or V,
// kv_head), prefix sharing between forked sequences with copy-on-write of a shared tail block.
//
// A page holds one block of block_tokens tokens of one (layer, K or V, kv_head):
//   page: [block_tokens][head_dim] bf16, token-major; token position p lives in logical block
//   p / block_tokens at row p % block_tokens.
//
// Writing protocol for one forward step of n new tokens of a sequence:
//   reserve(seq, n);                           // blocks for positions [length, length + n)
//   for each layer: write(seq, layer, k, v, n);  // stores positions [length, length + n)
//   commit(seq, n);                            // length += n
// Attention during the step reads up to written_tokens(seq, layer), which may exceed length.
//
// Thread safety: not thread-safe for mutation. The const readers (block_table, page_bf16,
// read_token_range_ref, length, ...) may run concurrently with each other while nothing mutates.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "cache/page_pool.h"
#include "format/page.h"

namespace certkv::cache {

using SeqId = int64_t;

enum class KvTensor : int { kKey = 0, kValue = 1 };

struct KvCacheConfig {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  // Capacity over all sequences, in tokens; every (layer, K/V, kv_head) may hold
  // ceil(max_tokens / block_tokens) pages. A sequence's partial tail block takes a whole page.
  int64_t max_tokens = 0;
  // Pages per allocator chunk; 0 picks 4 blocks of every (layer, K/V, kv_head).
  uint32_t pages_per_chunk = 0;
};

struct StorageClassStats {
  format::StorageClass storage;
  uint64_t bytes_reserved_from_allocator;  // sum of chunk sizes obtained from the system
  uint64_t page_bytes_in_use;              // pages_in_use * page stride
  uint64_t pages_in_use;
  uint64_t pages_free;                     // obtained from the system, on the free list
};

struct MemoryStats {
  uint64_t bytes_reserved_from_allocator;  // all classes
  uint64_t bytes_in_use;                   // page bytes in use + block_table_bytes
  uint64_t block_table_bytes;              // PageRef entries of every live sequence
  uint64_t pages_in_use;
  uint64_t pages_free;
  std::vector<StorageClassStats> by_class;  // one entry per storage class with a pool
};

class KvCache {
 public:
  // Throws certkv::Error naming the field: kInvalidArgument for a non-positive dimension or a
  // capacity above 2^32 - 2 pages, kUnsupported for a head_dim not a multiple of 8 or above 256.
  explicit KvCache(const KvCacheConfig& config);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheConfig& config() const { return config_; }
  int block_tokens() const { return config_.block_tokens; }
  int head_dim() const { return config_.head_dim; }
  // Bytes of one page's data: block_tokens * head_dim * 2.
  size_t page_bytes() const;

  // Sequences. Ids are never reused. Every function taking a SeqId throws certkv::Error
  // kNotFound for an id that is not live.
  SeqId create_sequence();
  // A new sequence holding the parent's committed tokens: every block covering [0, length) is
  // shared by ref count (a shared partial tail is copied by the first reserve() that writes it).
  // REQUIRES: the parent has no uncommitted reservation (reserve without commit), else
  // certkv::Error kInvalidArgument.
  SeqId fork_sequence(SeqId parent);
  // Releases the sequence's pages (and any uncommitted reservation).
  void free_sequence(SeqId seq);
  bool has_sequence(SeqId seq) const;
  size_t n_sequences() const { return sequences_.size(); }

  // Committed tokens.
  int64_t length(SeqId seq) const;
  // length + the current reservation: positions that have pages.
  int64_t reserved_tokens(SeqId seq) const;
  // Positions [0, written_tokens) of this layer hold data (committed or written in this step).
  int64_t written_tokens(SeqId seq, int layer) const;
  // Logical blocks in every block table of the sequence: ceil(reserved_tokens / block_tokens).
  int64_t n_blocks(SeqId seq) const;

  // Makes pages exist for positions [length, length + n) in every (layer, K/V, kv_head); a tail
  // block shared with another sequence is first copied. Calling again before commit extends the
  // reservation to length + n if that is larger.
  // REQUIRES: n >= 0. Throws kOutOfMemory, leaving the sequence unchanged, when the pool cannot
  // supply every page needed.
  void reserve(SeqId seq, int64_t n);
  // k, v: [n][n_kv_heads][head_dim] float. Stores bf16 (round to nearest even) at positions
  // [length, length + n) of this layer.
  // REQUIRES: 0 <= layer < n_layers; 1 <= n; length + n <= reserved_tokens.
  void write(SeqId seq, int layer, const float* k, const float* v, int64_t n);
  // length += n. REQUIRES: length + n <= reserved_tokens, and every layer written through
  // length + n.
  void commit(SeqId seq, int64_t n);

  // Block table of (seq, layer, kv, kv_head): n_blocks(seq) entries. The pointer is valid until
  // the next reserve/fork/free touching this sequence.
  const format::PageRef* block_table(SeqId seq, int layer, KvTensor kv, int kv_head) const;
  // page: [block_tokens][head_dim] bf16. REQUIRES: ref.storage == kBf16 and a page of this
  // cache's pool (checked, certkv::Error).
  const uint16_t* page_bf16(format::PageRef ref) const;
  // out: [end - begin][head_dim] float, decoded from bf16.
  // REQUIRES: 0 <= begin <= end <= written_tokens(seq, layer).
  void read_token_range_ref(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                            int64_t end, float* out) const;

  // References held on the page (1 = owned by one sequence). For tests and accounting.
  uint32_t ref_count(format::PageRef ref) const;

  MemoryStats memory_stats() const;
  // Bytes a plain contiguous BF16 cache takes for n_tokens: K and V, 2 bytes per element.
  uint64_t kv_bytes_bf16(int64_t n_tokens) const;

  const PagePool& pool(format::StorageClass storage) const;

 private:
  struct Sequence {
    int64_t length = 0;
    int64_t reserved = 0;              // positions with pages: length + reservation
    std::vector<int64_t> written;      // per layer
    std::vector<std::vector<format::PageRef>> tables;  // [(layer * 2 + kv) * n_kv_heads + head]
  };

  Sequence& sequence(SeqId seq);
  const Sequence& sequence(SeqId seq) const;
  void check_layer(int layer, const char* what) const;
  void check_kv_head(int kv_head, const char* what) const;
  size_t table_index(int layer, KvTensor kv, int kv_head) const;
  uint16_t* page_bf16_mutable(format::PageRef ref);
  void release_tables(Sequence& s);

  KvCacheConfig config_;
  std::unique_ptr<PagePool> bf16_pool_;
  std::unordered_map<SeqId, Sequence> sequences_;
  SeqId next_id_ = 1;
};

}  // namespace certkv::cache
