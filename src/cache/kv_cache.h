// Paged KV cache: pages in ref-counted pools, one block table per (sequence, layer, K or V,
// kv_head), prefix sharing between forked sequences with copy-on-write of a shared tail block.
//
// A page holds one block of block_tokens tokens of one (layer, K or V, kv_head); token position p
// lives in logical block p / block_tokens at row p % block_tokens. Storage classes:
//   bf16: [block_tokens][head_dim] bf16, token-major (raw).
//   gaac: a GAAC slot (docs/format/gaac.md) of gaac_slot_bytes(layer, kv) bytes, lossless.
//   fp8: [block_tokens][head_dim] FP8 bytes (format/fp8.h), token-major (raw).
//   gaac-fp8: a GAAC slot of an FP8 page, lossless on the FP8 bytes.
//
// KV schemes. kBf16: every page is raw. kGaac (DESIGN.md section 2, fill-then-finalize): a block
// that is not yet complete lives in a raw bf16 page (the tail); the write that stores a block's
// last row finalizes it: the block is encoded once with the calibration's bases of its
// (layer, K/V, kv_head) and, when its escape bytes fit the slot capacity of its (layer, K/V), it
// moves to a slot of the gaac class and its raw page returns to the pool; otherwise it stays raw.
// A block written whole by one write (prefill) is encoded straight from the input, without a raw
// page. Finalized blocks are immutable, so they are shared by forks like any page. Every read
// (attention, read_token_range_ref) sees the same bf16 bit patterns whatever the class.
// kFp8E4M3 / kFp8E5M2: every page is raw FP8; write() rounds each value to bf16, then to FP8
// (lossy by design). kGaacE4M3 / kGaacE5M2: the gaac scheme on FP8 pages (raw FP8 pages are the
// tails and fallbacks, slots of class gaac-fp8); every read sees the FP8 values of the raw page.
//
// Writing protocol for one forward step of n new tokens of a sequence:
//   reserve(seq, n);                           // blocks for positions [length, length + n)
//   for each layer: write(seq, layer, k, v, n);  // stores positions [length, length + n)
//   commit(seq, n);                            // length += n
// Attention during the step reads up to written_tokens(seq, layer), which may exceed length.
//
// Thread safety: not thread-safe for mutation. The const readers (block_table, page_bf16,
// page_bytes_of, read_token_range_ref, length, ...) may run concurrently with each other while
// nothing mutates.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cache/kv_scheme.h"
#include "cache/page_pool.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
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
  // Pages per allocator chunk of each pool; 0 picks, for the raw schemes (bf16, fp8-*), 4 blocks
  // of every (layer, K/V, kv_head); for the GAAC schemes, 1 block of every table a slot pool serves, and 2 * n_kv_heads pages
  // (one layer's K and V) for the raw pool, which holds only tails and fallbacks.
  uint32_t pages_per_chunk = 0;
  KvScheme scheme = KvScheme::kBf16;
  // GAAC schemes: bases and escape capacities (shared, immutable). REQUIRES for them: not null,
  // the scheme's element, and a shape equal to (n_layers, n_kv_heads, head_dim, block_tokens).
  // Lossy schemes: optional (bf16 element); when given, the backing store keeps its exact
  // blocks GAAC-coded (a block whose escapes overflow stays a raw bf16 backing page).
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  // Lossy schemes: which channels form RoPE pairs (the witness bands and dither8's outlier pairs
  // follow the model's layout).
  codec::RopePairing rope_pairing = codec::RopePairing::kInterleaved;
  // dither8: RoPE pairs of each (layer, kv_head) kept exact and excluded from the scale, chosen
  // once, from the first rows written (select_outlier_pairs). -1 picks the default (4).
  int outlier_pairs = -1;
  // dither8: the pairs fixed for the model, [n_layers][n_kv_heads][m] pair indices (each head's
  // increasing), m the count above; null: chosen from the first rows written, whichever sequence
  // writes them (then a page depends on which sequence wrote first: not batch invariant).
  std::shared_ptr<const std::vector<uint16_t>> fixed_outlier_pairs;
  // Lossy schemes: a complete block stays raw bf16 while its last position is among the newest
  // recent_window_tokens written (KIVI's full-precision window). -1 picks the scheme's default:
  // 128 for kivi2, 0 for the others.
  int recent_window_tokens = -1;
  // Tier A lossy schemes: how K pages store their witness (codec::WitnessCode; kFp16 is
  // DESIGN.md's, kPageScaled8 half its bytes for a bound about 1% looser). Other schemes: kFp16.
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  // The model layer of this cache's layer 0. dither8's dither is keyed by the model's layer
  // (codec::dither8_key), so a cache holding one layer of a model (certkv_kv_store keeps one
  // cache per layer) dithers that layer's pages as a cache of the whole model does. REQUIRES: >= 0.
  int first_model_layer = 0;
};

inline constexpr int kDefaultOutlierPairs = 4;

struct StorageClassStats {
  format::StorageClass storage;
  uint64_t bytes_reserved_from_allocator;  // sum of chunk sizes obtained from the system
  uint64_t page_bytes_in_use;              // pages_in_use * page stride (summed over its pools)
  uint64_t pages_in_use;
  uint64_t pages_free;                     // obtained from the system, on the free list
  uint64_t n_pools;                        // gaac: one pool per distinct slot stride
};

struct MemoryStats {
  uint64_t bytes_reserved_from_allocator;  // all classes
  uint64_t bytes_in_use;                   // page bytes in use + block_table_bytes
  uint64_t block_table_bytes;              // PageRef entries of every live sequence
  uint64_t pages_in_use;
  uint64_t pages_free;
  std::vector<StorageClassStats> by_class;  // one entry per storage class with a pool
  // Lossy schemes: the exact backing store (bf16 pages of every lossy page, host memory), not
  // part of the totals above.
  uint64_t backing_bytes_reserved_from_allocator;
  uint64_t backing_pages_in_use;
  // Lossy schemes: complete blocks kept exact because a value was not finite or a scale did not
  // fit fp16 (never silently certified).
  uint64_t exact_fallback_blocks;
};

struct ClassBytes {
  format::StorageClass storage;
  uint64_t bytes;
};

class KvCache;

// A sequence swapped out of a cache into host memory (KvCache::swap_out), to be swapped back in
// by the same cache (KvCache::swap_in) bit for bit. What host memory holds per page:
//   - a GAAC slot (gaac, gaac-fp8) or a lossy page: its bytes as they are (a lossy page with
//     the exact block of its backing store, itself coded as a raw block below; dither8 keeps
//     only the exact block and is encoded again at swap_in, into the same bytes: its dither is
//     keyed by the block's position);
//   - a raw page (a tail, a block that stayed raw, every page of the bf16 and fp8 schemes):
//     GAAC-coded with the cache's calibration when the cache has one (the gaac schemes, and the
//     lossy schemes given one for their backing store) and the block fits its slot, else raw.
// Rows past the sequence's length in its partial last block are not kept (zeros come back).
// Owned by the caller; move-only. Thread safety: as any value.
class SwappedKv {
 public:
  SwappedKv() = default;
  SwappedKv(SwappedKv&&) = default;
  SwappedKv& operator=(SwappedKv&&) = default;
  SwappedKv(const SwappedKv&) = delete;
  SwappedKv& operator=(const SwappedKv&) = delete;

  int64_t length() const { return length_; }
  // Pages swap_in takes from the pool (one per block of every (layer, K/V, kv_head) table).
  uint64_t pages() const { return pages_; }
  // Bytes of host memory the pages take here, and the page bytes (strides) they took in the pool.
  uint64_t host_bytes() const { return bytes_.size(); }
  uint64_t pool_bytes() const { return pool_bytes_; }
  // Of the pages, those kept GAAC-coded (slots kept as they are, and raw blocks coded here).
  uint64_t gaac_coded_pages() const { return gaac_coded_pages_; }

 private:
  friend class KvCache;
  // A block in bytes_: [offset, offset + bytes), GAAC-coded (bytes = the encoder's count) or raw.
  struct HostBlock {
    uint64_t offset = 0;
    uint32_t bytes = 0;
    bool gaac = false;
  };
  struct Page {
    format::PageRef ref;  // what it was in the pool: its class and slot pool
    HostBlock data;       // the page's bytes (a raw page: its block, maybe GAAC-coded)
    HostBlock exact;      // a lossy page: its exact block
  };
  const KvCache* owner_ = nullptr;
  int64_t length_ = 0;
  uint64_t pages_ = 0;
  uint64_t pool_bytes_ = 0;
  uint64_t gaac_coded_pages_ = 0;
  std::vector<float> value_norm_max_;
  std::vector<std::vector<Page>> tables_;  // as KvCache::Sequence::tables
  std::vector<uint8_t> bytes_;
};

class KvCache {
 public:
  // Throws certkv::Error naming the field: kInvalidArgument for a non-positive dimension, a
  // capacity above 2^32 - 2 pages, or (gaac) a missing calibration or one of another shape or
  // element; kUnsupported for a head_dim not a multiple of 8 or above 256, or (gaac) one that
  // does not split into GAAC tiles.
  explicit KvCache(const KvCacheConfig& config);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheConfig& config() const { return config_; }
  int block_tokens() const { return config_.block_tokens; }
  int head_dim() const { return config_.head_dim; }
  KvScheme scheme() const { return config_.scheme; }
  // Lossy schemes: the newest tokens whose complete blocks stay raw bf16 (the resolved
  // recent_window_tokens); 0 for the other schemes. With n tokens written, a block is read
  // exactly while it ends after n - recent_window_tokens().
  int recent_window_tokens() const { return lossy_ ? window_tokens_ : 0; }
  // Bytes of one raw page's data: block_tokens * head_dim * (2 for bf16 pages, 1 for FP8).
  size_t page_bytes() const;

  // Sequences. Ids are never reused. Every function taking a SeqId throws certkv::Error
  // kNotFound for an id that is not live.
  SeqId create_sequence();
  // A new sequence holding the parent's committed tokens: every block covering [0, length) is
  // shared by ref count (a shared partial tail is copied by the first reserve() that writes it).
  // REQUIRES: the parent has no uncommitted reservation (reserve without commit), else
  // certkv::Error kInvalidArgument.
  SeqId fork_sequence(SeqId parent);
  // A new sequence holding the parent's first n_tokens positions, every block of them shared by
  // ref count (prefix sharing between sequences that began with the same tokens).
  // REQUIRES: n_tokens a multiple of block_tokens, 0 <= n_tokens <= length(parent), and no
  // uncommitted reservation on the parent (certkv::Error kInvalidArgument otherwise).
  SeqId fork_prefix(SeqId parent, int64_t n_tokens);
  // Releases the sequence's pages (and any uncommitted reservation).
  void free_sequence(SeqId seq);
  bool has_sequence(SeqId seq) const;
  // Swap to host memory: copies the sequence's committed blocks into a SwappedKv and frees the
  // sequence (its own reference of every page: pages shared with other sequences stay theirs,
  // and swap_in gives it its own copies). An uncommitted reservation is dropped.
  // REQUIRES: no layer written past length (a step in progress: kInvalidArgument).
  SwappedKv swap_out(SeqId seq);
  // A new sequence holding the swapped blocks, bit for bit as they were (committed length
  // swapped.length(), no reservation). Throws kOutOfMemory, with nothing changed, when the pool
  // cannot supply swapped.pages() pages; kInvalidArgument for a SwappedKv of another cache.
  SeqId swap_in(const SwappedKv& swapped);

  size_t n_sequences() const { return sequences_.size(); }

  // Committed tokens.
  int64_t length(SeqId seq) const;
  // length + the current reservation: positions that have pages.
  int64_t reserved_tokens(SeqId seq) const;
  // Positions [0, written_tokens) of this layer hold data (committed or written in this step).
  int64_t written_tokens(SeqId seq, int layer) const;
  // Logical blocks in every block table of the sequence: ceil(reserved_tokens / block_tokens).
  int64_t n_blocks(SeqId seq) const;

  // Makes room for positions [length, length + n) in every (layer, K/V, kv_head); a tail block
  // shared with another sequence is first copied. Calling again before commit extends the
  // reservation to length + n if that is larger. Raw schemes take the new blocks' pages now;
  // GAAC schemes count them against the capacity and take each page (slot or raw) when write()
  // knows the block's class.
  // REQUIRES: n >= 0. Throws kOutOfMemory, leaving the sequence unchanged, when the capacity
  // (max_tokens) or the pool cannot supply every page needed.
  void reserve(SeqId seq, int64_t n);
  // k, v: [n][n_kv_heads][head_dim] float. Stores bf16 (round to nearest even; FP8 schemes then
  // round that to FP8, nearest even) at positions [length, length + n) of this layer; GAAC
  // schemes finalize the blocks whose last row it stores.
  // REQUIRES: 0 <= layer < n_layers; 1 <= n; length + n <= reserved_tokens. GAAC schemes may throw
  // kOutOfMemory when the system allocator refuses a pool chunk (the capacity was checked by
  // reserve); the sequence must then be freed.
  void write(SeqId seq, int layer, const float* k, const float* v, int64_t n);
  // length += n. REQUIRES: length + n <= reserved_tokens, and every layer written through
  // length + n.
  void commit(SeqId seq, int64_t n);

  // Block table of (seq, layer, kv, kv_head): n_blocks(seq) entries. The pointer is valid until
  // the next reserve/fork/free touching this sequence; under GAAC schemes, write() replaces entries in
  // place (a finalized block changes class), and entries reserved but not yet written hold
  // page kNoPage.
  const format::PageRef* block_table(SeqId seq, int layer, KvTensor kv, int kv_head) const;
  // page: [block_tokens][head_dim] bf16. REQUIRES: ref.storage == kBf16 and a page in use of
  // this cache's pool (checked, certkv::Error).
  const uint16_t* page_bf16(format::PageRef ref) const;
  // page: [block_tokens][head_dim] FP8 bytes of element kv_scheme_element(scheme()).
  // REQUIRES: ref.storage == kFp8 and a page in use of this cache's pool (checked, certkv::Error).
  const uint8_t* page_fp8(format::PageRef ref) const;
  // The bytes of a page of any class: a raw page or a GAAC slot. REQUIRES: a page in use of this
  // cache (checked, certkv::Error).
  const uint8_t* page_bytes_of(format::PageRef ref) const;
  // GAAC schemes: the bases of one (layer, K/V, kv_head) and the slot bytes of a (layer, K/V).
  // REQUIRES: a GAAC scheme and indices in range (certkv::Error otherwise).
  const codec::GaacBases& gaac_bases(int layer, KvTensor kv, int kv_head) const;
  size_t gaac_slot_bytes(int layer, KvTensor kv) const;
  // out: [end - begin][head_dim] float, decoded from bf16 or FP8 (GAAC pages through the codec's
  // _ref decoders). REQUIRES: 0 <= begin <= end <= written_tokens(seq, layer).
  void read_token_range_ref(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                            int64_t end, float* out) const;

  // The exact values: as read_token_range_ref, but lossy pages are read from the backing store.
  // REQUIRES: as read_token_range_ref.
  void read_token_range_exact(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                              int64_t end, float* out) const;

  // Lossy schemes: the exact block of a lossy page of (layer, K/V, kv_head), from the backing
  // store. out: [block_tokens][head_dim] bf16. REQUIRES: ref is a lossy page in use of that table
  // (certkv::Error otherwise).
  void read_exact_page(format::PageRef ref, int layer, KvTensor kv, int kv_head, uint16_t* out) const;

  // Lossy schemes: what the pages of (layer, K/V, kv_head) are (the outlier pairs point into the
  // cache and are fixed once chosen). REQUIRES: a lossy scheme, indices in range.
  codec::LossyPageSpec lossy_spec(int layer, KvTensor kv, int kv_head) const;
  // Repairs logical block `block` of (seq, layer, kv_head): K and V pages of a lossy class are
  // replaced, in this sequence's tables only, by raw bf16 pages copied from the backing store
  // (repaired blocks read exact values and carry no witness). Returns the bytes paged in (0 when
  // neither page was lossy). REQUIRES: block < n_blocks(seq). Throws kOutOfMemory when no raw
  // page is free (the tables are then unchanged).
  uint64_t repair_block(SeqId seq, int layer, int kv_head, int64_t block);

  // An upper bound of ||v_t|| (the exact bf16 values) over every position of (seq, layer,
  // kv_head) written so far, kept at write time for the meter's value-side bound.
  float value_norm_max(SeqId seq, int layer, int kv_head) const;

  // References held on the page (1 = owned by one sequence). For tests and accounting.
  uint32_t ref_count(format::PageRef ref) const;

  MemoryStats memory_stats() const;
  // Page bytes (pages times their stride) that one sequence's block tables reference, by storage
  // class, in the order of memory_stats().by_class; a page shared with other sequences is counted
  // in full here.
  std::vector<ClassBytes> sequence_bytes(SeqId seq) const;
  // Pages of the pool the block tables of these sequences reference, a page shared among them
  // counted once (a GAAC entry reserved but not yet written holds no page and is not counted).
  uint64_t pages_referenced(std::span<const SeqId> seqs) const;
  // Bytes a plain contiguous BF16 cache takes for n_tokens: K and V, 2 bytes per element.
  uint64_t kv_bytes_bf16(int64_t n_tokens) const;

  // The raw pool (kBf16, or kFp8 for the FP8 schemes). REQUIRES: storage is the raw class of the
  // scheme (certkv::Error otherwise); the GAAC classes have one pool per slot stride, see
  // slot_pool.
  const PagePool& pool(format::StorageClass storage) const;
  size_t n_slot_pools() const { return slot_pools_.size(); }
  // REQUIRES: i < n_slot_pools() (certkv::Error otherwise).
  const PagePool& slot_pool(size_t i) const;

 private:
  struct Sequence {
    int64_t length = 0;
    int64_t reserved = 0;              // positions with pages: length + reservation
    std::vector<int64_t> written;      // per layer
    std::vector<std::vector<format::PageRef>> tables;  // [(layer * 2 + kv) * n_kv_heads + head]
    std::vector<float> value_norm_max;                 // [layer * n_kv_heads + head]
  };

  Sequence& sequence(SeqId seq);
  const Sequence& sequence(SeqId seq) const;
  void check_layer(int layer, const char* what) const;
  void check_kv_head(int kv_head, const char* what) const;
  size_t table_index(int layer, KvTensor kv, int kv_head) const;
  uint16_t* page_bf16_mutable(format::PageRef ref);
  uint8_t* raw_page_mutable(format::PageRef ref);
  format::PageRef raw_ref(uint32_t page) const;
  // Stores one row of head_dim floats into a raw page row (bf16, or bf16 then FP8).
  void store_row(const float* x, uint8_t* dst) const;
  PagePool& pool_of(format::PageRef ref);
  const PagePool& pool_of(format::PageRef ref) const;
  void retain(format::PageRef ref);
  void release(format::PageRef& ref);  // releases and marks the entry kNoPage (a no-op on kNoPage)
  void release_tables(Sequence& s);
  uint64_t pages_in_use_all() const;
  void reserve_pending(Sequence& s, SeqId seq, int64_t n);
  void read_token_range(SeqId seq, int layer, KvTensor kv, int kv_head, int64_t begin,
                        int64_t end, bool exact, float* out) const;
  void write_coded(Sequence& s, int layer, KvTensor kv, int kv_head, const float* x, int64_t n);
  void finalize_lossy(int layer, KvTensor kv, int kv_head, int64_t block_index, const uint8_t* block,
                      format::PageRef& ref);
  // The GAAC slot pools of config_.gaac_calibration (checked against the cache's shape), one per
  // distinct slot stride, with slot_bytes_ and slot_pool_of_ for each (layer, K/V).
  void build_gaac_slot_pools(format::StorageClass storage,
                             std::vector<std::unique_ptr<PagePool>>& pools, uint64_t blocks);
  // The backing store (lossy schemes): the exact block of a lossy page, kept as a GAAC slot when
  // a calibration is given and the block fits, else as a raw bf16 page.
  void store_backing(int layer, KvTensor kv, int kv_head, const uint8_t* block,
                     format::PageRef lossy);
  // out: [block_tokens][head_dim] bf16, the exact block of a lossy page.
  void read_backing(format::PageRef lossy, int layer, KvTensor kv, int kv_head, uint16_t* out) const;
  void release_backing(format::PageRef lossy);
  void choose_outliers(int layer, int kv_head, const float* x, int64_t n_rows, size_t row_stride);
  // Replaces `ref` by the encoded block (a slot when it fits, else a raw page holding `block`;
  // an owned raw `ref` is reused for that). block: one raw page's data; block_index: its index in
  // the sequence (dither8's counter: a page's values never depend on its physical slot).
  void finalize_block(int layer, KvTensor kv, int kv_head, int64_t block_index, const uint8_t* block,
                      format::PageRef& ref);
  // A block that stays raw: `ref` becomes an owned raw page holding `block` (one raw page's data).
  void keep_block_raw(const uint8_t* block, format::PageRef& ref);
  // Swap: a raw block (one raw page's data) into host memory, GAAC-coded when the cache has a
  // calibration and it fits, and back.
  SwappedKv::HostBlock put_host_block(int layer, KvTensor kv, int kv_head, const uint8_t* block,
                                      std::vector<uint8_t>& bytes) const;
  void get_host_block(int layer, KvTensor kv, int kv_head, const SwappedKv::HostBlock& hb,
                      const std::vector<uint8_t>& bytes, uint8_t* block) const;
  // Swap: one page back into the pool (the caller releases `ref` on failure).
  void swap_in_page(int layer, KvTensor kv, int kv_head, int64_t block, const SwappedKv& swapped,
                    const SwappedKv::Page& page, format::PageRef& ref);
  // Makes `ref` an owned raw page holding the same rows (a pending entry gets a fresh page).
  void make_raw(int layer, KvTensor kv, int kv_head, format::PageRef& ref);

  KvCacheConfig config_;
  uint64_t capacity_pages_ = 0;  // per class pool and for all classes together
  std::unique_ptr<PagePool> bf16_pool_;  // the raw pool: bf16 pages, or FP8 pages (class kFp8)
  format::StorageClass raw_class_ = format::StorageClass::kBf16;
  format::StorageClass slot_class_ = format::StorageClass::kGaac;
  format::GaacElement element_ = format::GaacElement::kBf16;
  bool gaac_ = false;
  std::vector<std::unique_ptr<PagePool>> slot_pools_;  // gaac: one per distinct slot stride
  std::vector<uint8_t> slot_pool_of_;                  // gaac: [layer * 2 + kv] -> slot_pools_
  std::vector<size_t> slot_bytes_;                     // gaac: [layer * 2 + kv]
  // gaac: block table entries reserved but not yet holding a page (kNoPage), counted against
  // capacity_pages_.
  uint64_t n_pending_ = 0;
  std::vector<uint8_t> block_scratch_;  // one raw page of data, for write()
  // Lossy schemes: slot_pools_[0] holds K pages, [1] V pages; backing_of_[pool][page] is the
  // backing_pool_ page holding the exact block (kNoPage when none).
  bool lossy_ = false;
  codec::LossyScheme lossy_scheme_ = codec::LossyScheme::kRtn8;
  int window_tokens_ = 0;
  int n_outlier_pairs_ = 0;
  std::unique_ptr<PagePool> backing_pool_;               // raw bf16 backing pages
  std::vector<std::unique_ptr<PagePool>> backing_slot_pools_;  // GAAC-coded backing blocks
  // [pool][page] of a lossy page: its backing block (kBf16 in backing_pool_, or kGaac in
  // backing_slot_pools_[pool]); page kNoPage when none.
  std::vector<std::vector<format::PageRef>> backing_of_;
  // dither8: [layer * n_kv_heads + kv_head] outlier pairs (empty until chosen).
  std::vector<std::vector<uint16_t>> outliers_;
  std::vector<uint8_t> outliers_chosen_;
  uint64_t exact_fallback_blocks_ = 0;
  std::unordered_map<SeqId, Sequence> sequences_;
  SeqId next_id_ = 1;
};

}  // namespace certkv::cache
