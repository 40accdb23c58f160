// The KV cache of one sequence on a CUDA device, filled then finalized as the host cache is
// (cache/kv_cache.h; DESIGN.md section 2): rows arrive as floats from the forward pass, are
// rounded on the device exactly as KvCache::write rounds them (bf16, then the scheme's FP8 for
// gaac-e5m2) into the raw tail page of their (layer, K/V, kv_head), and the write that completes
// a block encodes it on the device (codec/cuda/gaac_encode_cuda.h) into a GAAC slot when its
// escapes fit, its raw page then returning to the free list; a block that does not fit stays
// raw. The decode kernels read the pools through block tables (DeviceLayerView).
//
// Schemes: bf16 (every page raw), gaac (GAAC slots over bf16), gaac-e5m2 (GAAC slots over FP8
// E5M2, values rounded to bf16 then E5M2 at write), and the lossy schemes the device kernels
// read, fp8-e4m3, fp8-e5m2 (raw casts with their Tier A witness or rho) and dither8 (with its
// outlier RoPE pairs): bf16 tails, complete blocks encoded on the device
// (codec/cuda/lossy_encode_cuda.h) into the lossy page pool of their (layer, K/V); a page the
// encoder refuses (a value not finite, a scale past fp16) stays an exact raw bf16 page, as on
// the host. dither8's outlier pairs of each (layer, kv_head) are chosen on the host exactly as
// KvCache chooses them (the float rows of the first write of at least one block, else the bf16
// rows of the first block). The device keeps no exact copy of a lossy page (the host cache's
// backing store does): the gate's repairs bring the exact block (store_exact_block). Pools grow by a quarter (a
// device-to-device copy); tables have a fixed width of ceil(max_tokens / block_tokens) blocks.
//
// Byte order. A scheme stored fragment-major (cache::kv_scheme_device_fragment_pages: dither8,
// gaac, and fp8-e4m3 with the exponent witness) is stored in the order the fragment kernel reads
// (format/fragment_layout.h): its raw bf16 pages (tails, pages kept exact, repaired blocks, the
// held exact pages) fragment-major from append on. dither8 and fp8-e4m3 (PageFormat::
// kDither8Fragments, kFp8Fragments): a complete block's pages encoded from them straight into the
// fragment-major page (codec::cuda::LossyDeviceLayout::kFragments: the codec's page transcoded in
// the encode launch, the same bytes moved, so the pools' page sizes are the codec's).
// read_page gives the codec's order back (and the stored bytes beside it); store_exact_block
// transcodes its rows. gaac: GAAC device pages (codec/gaac_fragments.h, PageFormat::kGaacFragments),
// encoded at finalize from the fragment-major raw pages (codec::cuda::gaac_fragment_encode_pages);
// they are their codec's pages, so read_page gives them as stored. bf16 pages stay token-major.
//
// Table entries (int32, per (layer, K/V, kv_head), block order): for bf16 the raw page index;
// for the GAAC and lossy schemes a slot index s >= 0 of the (layer, K/V) slot pool (GAAC slots,
// lossy pages), or -r - 1 for raw page r of the layer's raw pool (tails, blocks that did not
// fit, pages kept exact).
//
// Encode results (DeviceKvCacheConfig::defer_encode_results). By default write() returns after
// the blocks it completes are placed: it waits for their encode results (one round trip per call
// that completes a block). Deferred: the encode launch is followed by a placement launch
// (cache/cuda/place_encoded_cuda.h) that points each encoded block's device table entries at its
// page, a refused block keeping its raw page, so that launches enqueued after write() read the
// right tables; write() returns without waiting, and the host's copy of the tables, the free lists
// and the counters catch up in reconcile_encodes() (once a forward step, after the step's own
// wait: backend/cuda/cuda_backend.cc). Until then a completed block holds both its raw page and
// its encoded page.
//
// Thread safety: one owner, one CUDA device (the current one at create(); calls from a thread
// whose current device is another are not supported). Calls are ordered on the cache's stream.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cache/cuda/append_rows_cuda.h"
#include "cache/cuda/device_pool.h"
#include "cache/cuda/place_encoded_cuda.h"
#include "cache/kv_cache.h"
#include "codec/cuda/lossy_encode_cuda.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"

namespace certkv::cache::cuda {

struct DeviceKvCacheConfig {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  int64_t max_tokens = 0;  // the sequence's capacity
  KvScheme scheme = KvScheme::kBf16;  // kBf16, kGaac, kGaacE5M2, kFp8E4M3, kFp8E5M2, kDither8
  // GAAC schemes: the model's calibration of the scheme's element (shape as the model's).
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  // Lossy schemes: the model's RoPE pairing (witness bands, outlier pairs), and dither8's outlier
  // pairs per (layer, kv_head): -1 picks kDefaultOutlierPairs; at most kMaxOutlierPairsOnDevice.
  codec::RopePairing rope_pairing = codec::RopePairing::kInterleaved;
  int outlier_pairs = -1;
  // fp8 schemes: how the K pages store their Tier A witness (fp16 bounds or u8 codes).
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  // dither8: the outlier pairs fixed for the model (KvCacheConfig::fixed_outlier_pairs, the same
  // layout); null: chosen from the first rows written, as KvCache does.
  std::shared_ptr<const std::vector<uint16_t>> fixed_outlier_pairs;
  // Lossy schemes: the exact raw page of each block a write completes stays held, out of the
  // free list, after the block's table entries name its lossy page, until
  // release_completed_exact(layer): prefill rows of that write read their own block exactly from
  // it, as a decode step at their position would (backend/cuda/cuda_backend.h).
  bool hold_completed_exact = false;
  // GAAC and lossy schemes: write() returns before the encode results of the blocks it completes
  // reach the host; the device tables are placed on the device and reconcile_encodes() brings the
  // host up to date (see the top of this file). false: write() waits for the results.
  bool defer_encode_results = false;
  void* stream = nullptr;  // cudaStream_t for every call; null: the default stream
  // Sequences live at create (slots 0 .. sequences - 1); more come from create_sequence.
  int sequences = 1;
  // The model layer of this cache's layer 0: dither8's dither is keyed by the model's layer
  // (codec::dither8_key), so a cache of one layer of a model (the device KV store keeps one per
  // layer) dithers its pages as a cache of the whole model does. REQUIRES: >= 0.
  int first_model_layer = 0;
  // The sparse tier's key index beside the pages (DeviceLayerView::index_records): bytes of one
  // record (sizeof index::RabitqRecord of head_dim, a multiple of 8); 0: no index. Every slot of
  // every layer holds a record per position of the context and its centroids; the records of a
  // slot are its sequence's own (built from its own centroids), never shared by a fork.
  size_t index_record_bytes = 0;
  // Records reserved per (slot, kv head) at first, rounded up to whole blocks (the rest of the
  // context comes from reserve_index_records); 0: the whole context (max_tokens).
  int64_t index_record_tokens = 0;
};

// The most dither8 outlier pairs per head the device serves (the decode kernels' limit).
inline constexpr int kMaxOutlierPairsOnDevice = 8;

// Whether DeviceKvCache stores this scheme.
bool device_kv_serves(KvScheme scheme);

// What the decode kernels read of one layer; device pointers, valid until the next write().
struct DeviceLayerView {
  const uint8_t* k_pages = nullptr;  // bf16: the raw pool; GAAC, lossy: the K slot pool
  const uint8_t* v_pages = nullptr;
  int64_t k_page_stride = 0, v_page_stride = 0;
  int64_t n_k_pages = 0, n_v_pages = 0;
  const uint8_t* raw_pages = nullptr;  // GAAC, lossy: tails, blocks that did not fit or stay exact
  int64_t raw_page_stride = 0, n_raw_pages = 0;
  // Slot s's K tables: k_table + s * table_row_stride, [n_kv_heads][table_stride]; V likewise.
  const int32_t* k_table = nullptr;
  const int32_t* v_table = nullptr;
  int64_t table_stride = 0;
  int64_t table_row_stride = 0;      // 2 * n_kv_heads * table_stride
  int64_t n_table_rows = 0;          // slots the tables hold (live or not)
  const int32_t* length = nullptr;  // [1]: tokens of slot 0 written to this layer
  int64_t host_length = 0;          // the same, on the host
  const uint8_t* gaac_bases = nullptr;  // [2 (K, V)][n_kv_heads][2 (b3, b4)][head_dim]
  int64_t k_escape_capacity = 0, v_escape_capacity = 0;
  // The key index (index_record_bytes > 0), written by the index builder
  // (attention/cuda/key_index_cuda.h): slot s, kv head h, token t at
  // index_records + ((s * n_kv_heads + h) * index_record_stride + t) * index_record_bytes; the
  // centroids [slot][n_kv_heads][2 (c_q, c_k)][head_dim] floats. Null without an index.
  uint8_t* index_records = nullptr;
  int64_t index_record_stride = 0;  // records per (slot, kv head) reserved (whole blocks)
  float* index_centroids = nullptr;
  const uint64_t* dither_keys = nullptr;       // dither8: [2 (K, V)][n_kv_heads]
  const int32_t* outlier_channels = nullptr;   // dither8: [n_kv_heads][2 m] (pair j: a, then b)
  int n_outlier_pairs = 0;                     // dither8: m
};

// One page as stored (tests, diagnostics).
struct DevicePageBytes {
  bool gaac_slot = false;      // a GAAC slot
  bool lossy_page = false;     // a lossy page (neither: a raw page)
  int32_t slot = -1;           // the slot's index in its pool
  std::vector<uint8_t> bytes;  // the slot's used bytes (fixed part + escapes), the lossy page, or
                               // the raw page, in the codec's byte order (as the host cache holds it)
  std::vector<uint8_t> stored;  // the same bytes as the device holds them: fragment-major where
                                // kv_scheme_device_fragment_pages says so, else equal to bytes
};

struct DeviceKvStats {
  int64_t slots_in_use = 0;       // GAAC slots holding a block
  int64_t raw_pages_in_use = 0;   // tails, bf16 pages and blocks that did not fit
  int64_t blocks_not_fitting = 0; // GAAC blocks kept raw since the last reset
  int64_t lossy_pages_in_use = 0; // lossy pages holding a block
  int64_t pages_kept_exact = 0;   // lossy pages the encoder refused since the last reset
  uint64_t bytes_in_use = 0;      // pages in use times their stride, plus the tables
  uint64_t bytes_reserved = 0;    // device memory held by pools, tables and staging
  uint64_t raw_bytes_in_use = 0;    // raw pages in use times their stride
  uint64_t coded_bytes_in_use = 0;  // GAAC slots and lossy pages in use times their stride
  int64_t sequences = 0;          // live slots
};

// The exact raw page of a block a write completed and encoded into a lossy page, held until
// release_completed_exact (DeviceKvCacheConfig::hold_completed_exact).
struct CompletedExactPage {
  int slot = 0;
  int kv = 0;  // 0: K, 1: V
  int kv_head = 0;
  int64_t block = 0;
  int32_t raw_page = 0;  // index in the layer's raw pool (DeviceLayerView::raw_pages)
};

// Page bytes one sequence's tables reference (a page shared with other sequences in full).
struct DeviceSequenceBytes {
  uint64_t raw = 0;    // raw pages: bf16 (E5M2 bytes for gaac-e5m2): tails, blocks kept raw
  uint64_t coded = 0;  // GAAC slots or lossy pages
};

class DeviceKvCache {
 public:
  // kUnsupported for a scheme device_kv_serves refuses, a shape the GAAC or lossy codec cannot
  // page, or more outlier pairs than kMaxOutlierPairsOnDevice; kInvalidArgument for a missing or
  // mismatched calibration; kOutOfMemory.
  static CudaStatus create(const DeviceKvCacheConfig& config, std::unique_ptr<DeviceKvCache>* out);
  ~DeviceKvCache();

  // Sequences. A sequence lives in a slot: its tables are row `slot` of every layer's tables, its
  // pages come from the layer's pools, which every sequence shares. Pages are ref-counted: a
  // forked prefix shares its parent's whole blocks, and a page returns to its free list when the
  // last table naming it lets go. The functions without a slot act on slot 0.
  // create_sequence takes a free slot (the tables grow by doubling when none is free);
  // free_sequence gives back every page of the slot (kInvalidArgument for a slot not live).
  CudaStatus create_sequence(int* slot);
  CudaStatus free_sequence(int slot);
  // A new sequence holding the parent's first n_tokens positions of every layer, shared.
  // kInvalidArgument unless n_tokens is a multiple of block_tokens and at most what the parent
  // has written to every layer.
  CudaStatus fork_prefix(int parent, int64_t n_tokens, int* child);
  // A new sequence holding the parent's first n_tokens positions of every layer, any count (a
  // crop, or a whole copy for a store's select): the whole blocks shared as fork_prefix shares
  // them; the rows of a partial last block copied into the child's own raw pages, on the device
  // when the parent's pages of that block are raw, else decoded (read_rows) and written again.
  // kInvalidArgument past what the parent has written to some layer; kUnsupported, before any
  // change, when that block's pages are lossy in some layer (a crop inside a block the device
  // keeps only lossy: its exact values are gone). Any failure leaves no child (*child -1) and the
  // parent as it was; only a failed copy or launch leaves the cache refusing until reset().
  CudaStatus fork_sequence(int parent, int64_t n_tokens, int* child);
  // The key index: at least `tokens` records per (slot, kv head) (REQUIRES: at most the context);
  // a larger reservation keeps every slot's records (one strided copy on the stream, then a wait
  // for it). Views taken before are stale after a growth.
  CudaStatus reserve_index_records(int64_t tokens);
  bool live(int slot) const { return slot >= 0 && size_t(slot) < live_.size() && live_[size_t(slot)] != 0; }

  // Appends positions [written(slot, layer), written(slot, layer) + n) of `layer`: k, v floats
  // [n][n_kv_heads][head_dim], on the host or on the device (enqueued on the cache's stream after
  // the work that writes them). kOutOfRange (nothing written) for a layer outside the model or
  // past max_tokens; kInvalidArgument for a slot not live. Any other failure (out of device
  // memory, a failed copy or launch) leaves the cache refusing every write with kInternal until
  // reset().
  CudaStatus write(int slot, int layer, const float* k, const float* v, int64_t n);
  CudaStatus write(int layer, const float* k, const float* v, int64_t n) { return write(0, layer, k, v, n); }
  // Several sequences' writes to one layer (a forward step's), their rows stored by one launch
  // per kMaxAppendBatch writes. Each is write()'s, checked as write() checks it, all before any
  // change; kInvalidArgument for a slot named twice.
  // Where a write's k and v are: kAsk asks the driver (cudaPointerGetAttributes, twice a write);
  // a caller whose rows are device memory says so, and a step's writes of every layer ask nothing.
  enum class RowsMemory : uint8_t { kAsk, kDevice, kHost };
  struct SlotRows {
    int slot = 0;
    const float* k = nullptr;
    const float* v = nullptr;
    int64_t n = 0;
    RowsMemory memory = RowsMemory::kAsk;
  };
  CudaStatus write_rows(int layer, const SlotRows* writes, size_t count);
  // Planned decode steps (a CUDA graph replays them; backend/cuda/device_kv_store.h):
  // reserve_rows gives (slot, layer) the raw pages of positions [written, written + n) at once,
  // so that kernels write those rows later without the host (append_rows_cuda.h's
  // append_planned_rows, reading the tables); the slot's length does not move. commit_rows then
  // takes the first n_done of the n reserved as written: the blocks they complete are encoded as a
  // write's are (read exact from their raw pages until then), and the pages of blocks past them go
  // back. Until the commit, nothing else may change the slot. kOutOfRange past max_tokens,
  // kInvalidArgument for a slot not live or n_done > n, kUnsupported while dither8's outlier pairs
  // of the layer are being chosen (a write holding a whole block chooses them). Other failures
  // leave the cache refusing until reset(), as write().
  CudaStatus reserve_rows(int slot, int layer, int64_t n);
  CudaStatus commit_rows(int slot, int layer, int64_t n_done, int64_t n);
  // The tables and the raw pool append_planned_rows writes `layer`'s rows through (the rows, the
  // batch, positions, limits, table rows and the overrun count are the caller's). Valid until the
  // next call that takes pages.
  PlannedRowsArgs planned_rows_args(int layer) const;
  // Lossy schemes, the gate's repair: the K and V pages of (layer, kv_head, block) that are lossy
  // become raw bf16 pages holding k_rows, v_rows ([block_tokens][head_dim] bf16, the exact block
  // from the host's backing store); their lossy pages return to the free lists. *bytes gets the
  // bytes uploaded (0 when neither page was lossy). kInvalidArgument for another scheme or a block
  // not written in whole; a failure halfway leaves the cache refusing until reset, as write().
  // A page shared with other sequences is not changed: this sequence gets its own exact page.
  CudaStatus store_exact_block(int slot, int layer, int kv_head, int64_t block, const uint16_t* k_rows,
                               const uint16_t* v_rows, uint64_t* bytes);
  CudaStatus store_exact_block(int layer, int kv_head, int64_t block, const uint16_t* k_rows, const uint16_t* v_rows,
                               uint64_t* bytes) {
    return store_exact_block(0, layer, kv_head, block, k_rows, v_rows, bytes);
  }
  // Drops every token of every live sequence (pages back to the free lists; pools keep their
  // memory; the sequences stay live, empty) and clears a failed state; pending encode results are
  // dropped with them. Synchronizes the stream.
  CudaStatus reset();

  // defer_encode_results: the encodes enqueued since the last reconcile_encodes.
  //  - pending_encodes(): the blocks (one per (K/V, kv_head) page) whose results the host has not
  //    read yet.
  //  - download_encode_results(): enqueues one copy of every pending result to page-locked host
  //    memory, on the cache's stream; no wait. Call it after the last write of a step, before the
  //    step's wait, so that the wait covers the copy.
  //  - reconcile_encodes(): waits for that copy (enqueuing it first when the pending encodes are
  //    not all in it: then it waits for the encodes too), then per pending block: encoded, its
  //    host entries name the encoded page and the raw page goes back to its free list (the hold of
  //    hold_completed_exact ends with it: call this after the launches that read the held pages);
  //    refused, the encoded page goes back and blocks_not_fitting / pages_kept_exact count it.
  //    Nothing to do without pending encodes (the default mode never has any). A failure leaves
  //    the cache refusing until reset(), as write().
  // Every call that reads or uploads the host tables (free_sequence, fork_prefix,
  // create_sequence when the tables grow, store_exact_block) reconciles first. The const readers
  // (stats, sequence_bytes, pages_referenced, host_table_row, completed_exact) describe the cache
  // as of the last reconcile: a pending block counts both of its pages and its host entries name
  // its raw page; read_page refuses while encodes are pending.
  size_t pending_encodes() const { return pending_.size(); }
  // dither8: whether some KV head of `layer` has not chosen its outlier pairs yet (they are
  // chosen from the first write holding a whole block, or from the first block once complete).
  bool choosing_outliers(int layer) const;
  CudaStatus download_encode_results();
  CudaStatus reconcile_encodes();

  int64_t written(int slot, int layer) const {
    return live(slot) ? written_[size_t(slot) * size_t(config_.n_layers) + size_t(layer)] : 0;
  }
  int64_t written(int layer) const { return written(0, layer); }
  DeviceLayerView view(int layer) const;
  // One slot's tables of a layer as the host holds them: [2 (K, V)][n_kv_heads][table_stride]
  // entries (DeviceLayerView's encoding; entries past the written blocks are unwritten).
  const int32_t* host_table_row(int slot, int layer) const;
  // hold_completed_exact: the exact pages of the blocks the writes to `layer` completed since its
  // last release, and their release (back to the free list; reset() releases every one too).
  // defer_encode_results: every block completed since the last reconcile is listed (whether its
  // encode succeeds is not known yet); release_completed_exact only empties the list, and the raw
  // pages of the blocks encoded go back to the free list at reconcile_encodes().
  const std::vector<CompletedExactPage>& completed_exact(int layer) const;
  void release_completed_exact(int layer);
  // The tables of `layer` for rows that read their own block exact (hold_completed_exact): for
  // each (slot, block) pair j, the slot's [2][n_kv_heads][table_stride] entries as the device
  // holds them once the work enqueued so far has run (deferred placements included), with the
  // entries of block j naming the block's exact raw page, written to dst + j * 2 * n_kv_heads *
  // table_stride (device memory of dst_entries int32 entries), on the cache's stream.
  // kInvalidArgument for a slot not live, a block the slot has not written in whole, a block
  // whose pages are encoded and not held, or too small a dst.
  CudaStatus copy_exact_block_tables(int layer, std::span<const std::pair<int, int64_t>> blocks, int32_t* dst,
                                     size_t dst_entries);
  const DeviceKvCacheConfig& config() const { return config_; }
  DeviceKvStats stats() const;
  DeviceSequenceBytes sequence_bytes(int slot) const;
  // Pages the tables of these live slots reference, a page shared among them counted once.
  uint64_t pages_referenced(std::span<const int> slots) const;
  // Positions [begin, end) of (slot, layer, K/V, kv_head) as attention reads them (a lossy page's
  // reconstruction), decoded on the host from read_page's bytes by the codecs' _ref decoders:
  // out [end - begin][head_dim] float. Synchronizes the stream. kOutOfRange past what the slot
  // has written; kInvalidArgument while encodes are pending; kCorrupt for a GAAC device page
  // that does not decode.
  CudaStatus read_rows(int slot, int layer, KvTensor kv, int kv_head, int64_t begin, int64_t end, float* out) const;
  // The page of (slot, layer, K/V, kv_head, block) as stored; synchronizes the stream.
  // kInvalidArgument while encodes are pending (reconcile_encodes first).
  CudaStatus read_page(int slot, int layer, KvTensor kv, int kv_head, int64_t block, DevicePageBytes* out) const;
  CudaStatus read_page(int layer, KvTensor kv, int kv_head, int64_t block, DevicePageBytes* out) const {
    return read_page(0, layer, kv, kv_head, block, out);
  }

 private:
  struct Layer;
  DeviceKvCache() = default;
  CudaStatus append(int layer_index, const SlotRows* writes, size_t count);
  // kInternal after a failure (until reset()), kOutOfRange for a layer outside the model.
  CudaStatus check_writable(int layer_index) const;
  CudaStatus finalize(int slot, int layer_index, int64_t block_begin, int64_t block_end);
  CudaStatus finalize_lossy(int slot, int layer_index, int64_t block_begin, int64_t block_end);
  // Index of (slot, K/V, kv_head, block) in a layer's host tables.
  size_t entry_index(int slot, int kv, int kv_head, int64_t block) const {
    return ((size_t(slot) * 2 + size_t(kv)) * size_t(config_.n_kv_heads) + size_t(kv_head)) * size_t(table_stride_) +
           size_t(block);
  }
  // Gives back the page a table entry names (nothing for an unwritten entry).
  void release_entry(Layer& layer, int kv, int32_t entry);
  // Gives back the pages of blocks [block_begin, block_end) of every (K/V, kv_head) table of the
  // slot and marks those entries unwritten, on the host (the caller uploads the tables).
  void release_blocks(Layer& layer, int slot, int64_t block_begin, int64_t block_end);
  // Tables and lengths for at least `slots` slots.
  CudaStatus grow_slots(int64_t slots);
  CudaStatus upload_slot_lengths(int slot);
  // An encode launch's tasks uploaded to encode_buffer_ (grown when short), *results pointing at
  // result_bytes after them; then its results read back (synchronizes the stream).
  CudaStatus stage_encode_tasks(const void* tasks, size_t task_bytes, size_t result_bytes, uint8_t** results);
  CudaStatus read_encode_results(const uint8_t* results, void* host, size_t bytes);
  // defer_encode_results. A block finalized and not yet reconciled: its pages and where its result is.
  struct PendingEncode {
    int layer = 0;
    int slot = 0;
    int kv = 0;
    int kv_head = 0;
    int64_t block = 0;
    int32_t coded_page = 0;    // the GAAC slot or lossy page taken for it
    int32_t raw_page = 0;      // its raw page (what its entries name until reconciled)
    size_t result_offset = 0;  // bytes into encode_results_ / host_encode_results_
  };
  // One finalize's deferred encode: its tasks and placements on the device, where its results go,
  // and its blocks, pending once its launches are enqueued (place_deferred).
  struct DeferredEncode {
    const uint8_t* tasks = nullptr;               // device: the encode tasks
    uint8_t* results = nullptr;                   // device: their results
    const TablePlacement* placements = nullptr;   // device: [n], result i for placement i
    int n = 0;
    std::vector<PendingEncode> blocks;            // [n], finalize's task order
  };
  // The tasks (task_bytes) of blocks [block_begin, block_end) of every (K/V, kv_head) of the slot,
  // in finalize's task order (coded_pages: the page taken for each), and their placements go up
  // in one copy to encode_tasks_; their results (result_bytes each) are appended to
  // encode_results_.
  CudaStatus stage_deferred_encode(int slot, int layer_index, int64_t block_begin, int64_t block_end,
                                   const std::vector<int32_t>& coded_pages, const void* tasks, size_t task_bytes,
                                   size_t result_bytes, DeferredEncode* out);
  // The placement launch after d's encode launches; then d's blocks are pending.
  CudaStatus place_deferred(int layer_index, const DeferredEncode& d, EncodeResult kind);
  // Marks the cache refusing every call but reset() (a call failed halfway).
  CudaStatus mark_broken(const CudaStatus& s);
  // dither8: notes the rows of a write for the choice of outlier pairs (KvCache's rule).
  CudaStatus note_outlier_rows(int layer_index, int slot, int64_t first, const float* k, int64_t n);
  CudaStatus choose_outliers(int layer_index, int kv_head, const float* rows, int n_rows, size_t row_stride);
  // Uploads the m pairs of (layer, kv_head) (and the kernels' channels) and marks them chosen.
  CudaStatus set_outliers(int layer_index, int kv_head, const uint16_t* pairs);
  // The pair list and the kernels' channels of one head to the device (set_outliers marks the
  // head chosen; the constructor uploads the placeholder pairs before any is).
  CudaStatus upload_outliers(Layer& layer, int kv_head, const uint16_t* pairs);
  codec::LossyPageSpec lossy_spec(bool key) const;
  CudaStatus upload_tables(const Layer& layer);
  CudaStatus upload_table_blocks(const Layer& layer, int slot, int64_t block_begin, int64_t block_end);

  DeviceKvCacheConfig config_;
  int64_t table_stride_ = 0;
  int64_t index_record_stride_ = 0;  // records reserved per (slot, kv head)
  size_t raw_bytes_ = 0;  // bytes of a raw page
  int64_t slot_capacity_ = 0;
  std::vector<int64_t> written_;  // [slot][layer]
  std::vector<uint8_t> live_;     // [slot]
  std::vector<int> free_slots_;
  std::vector<std::unique_ptr<Layer>> layers_;
  DeviceBuffer staging_;        // rows of one write
  DeviceBuffer encode_buffer_;  // encode tasks and their results (write() waits for them)
  std::vector<PendingEncode> pending_;  // defer_encode_results: every block not reconciled yet
  // Buffer lifetimes (all on the cache's stream):
  //  - encode_tasks_: one finalize's tasks, then its placements; every finalize writes it from
  //    offset 0 again. The upload is stream-ordered after the launches of the previous finalize
  //    that read it, so no launch sees the next one's tasks. Grown only after a stream sync (a
  //    launch in flight may read the old buffer).
  //  - encode_results_: every pending block's result, appended (encode_results_used_ bytes), so
  //    that one copy brings back the whole step's. Grown by a copy ordered after the launches
  //    that wrote it, then a sync, before the old buffer is freed; offsets stay valid.
  //  - host_encode_results_: the page-locked copy; results_event_ is recorded after the copy into
  //    it; downloaded_pending_ counts the pending blocks that copy covers. Replaced only after
  //    that event has completed.
  DeviceBuffer encode_tasks_;
  DeviceBuffer encode_results_;
  size_t encode_results_used_ = 0;
  PinnedBuffer host_encode_results_;
  void* results_event_ = nullptr;  // cudaEvent_t, made at the first download
  size_t downloaded_pending_ = 0;
  DeviceBuffer exact_table_placements_;  // copy_exact_block_tables' patches (reused as encode_tasks_)
  DeviceBuffer lengths_;  // [slot][n_layers] int32
  int64_t blocks_not_fitting_ = 0;
  int64_t pages_kept_exact_ = 0;
  bool lossy_ = false;
  // kv_scheme_device_fragment_pages: raw pages fragment-major from append on, lossy pages
  // transcoded by the encoder at finalize (read_page and store_exact_block transcode on the host).
  bool fragment_pages_ = false;
  codec::cuda::LossyDeviceLayout encode_layout() const {
    return fragment_pages_ ? codec::cuda::LossyDeviceLayout::kFragments : codec::cuda::LossyDeviceLayout::kCodec;
  }
  codec::LossyScheme lossy_scheme_ = codec::LossyScheme::kFp8E4M3;
  int n_outlier_pairs_ = 0;  // dither8: m
  std::vector<uint16_t> placeholder_pairs_;  // 0 .. m - 1 (lossy_spec)
  bool broken_ = false;  // a write or reset failed halfway
  std::string broken_reason_;
};

}  // namespace certkv::cache::cuda
