// Decode attention on a CUDA device over paged, possibly compressed KV (the device half of the
// attention layer; DESIGN.md sections 2-4). One kernel structure serves every page class through
// a codec policy (how a page becomes a tile in shared memory, and what bounds its logit errors);
// split-KV partials (m, l, the meter's A - 1 and value side, and the output) merge by their
// log-sum-exp weights.
//
// Grid: one CTA per (split, kv_head, sequence); its 4 warps take the split's blocks in turn, and
// every query head of the KV head's group reads each page once (GQA). Scores and the weighted sum
// of values run on tensor cores (mma.m16n8k16, fp32 accumulation) over tiles reconstructed in
// shared memory, never in global memory.
//
// Layouts on the device (all pointers are device pointers):
//   k_pages, v_pages:  page p at k_pages + p * k_page_stride (bytes; a multiple of 16, base
//                      16-byte aligned). Contents per `format`:
//     kBf16           [block_tokens][head_dim] bf16
//     kBf16Fragments  [block_tokens x head_dim] bf16 in fragment-major order: K pages by
//                     fragment::key_index, V pages by fragment::value_index (fragment_layout.h)
//     kDither8Fragments  K: [block_tokens x head_dim] int8 codes by fragment::word_key_byte, then
//                     scales [T][D/32] fp16, then the outlier pairs' exact values [T][2 m] bf16;
//                     V: codes by fragment::fragment_position (8-bit), then scales [T][D/32] fp16
//                     (the codes, scales and outliers of the dither8 page, moved)
//     kFp8Fragments   [block_tokens x head_dim] E4M3 codes in fragment-major order
//                     (fragment::fragment_position for 8-bit codes); V pages then rho [T] fp16.
//                     No code of a lossy K page came from a saturating cast (|k| <= 464): each
//                     code k^ bounds its error, |k^ - k| <= 2^(E(k^) - 4) + 2^-10
//     kGaacFragments  a GAAC page in the device layout (format::fragment::gaac_page_bytes: low
//                     bytes, code and sign words, exceptions), K and V by the fragment maps; the
//                     windows are the b4 bases of gaac_bases (each at most 240)
//     kGaacBf16       a GAAC slot (docs/format/gaac.md, element bf16)
//     kGaacE5M2       a GAAC slot over FP8 E5M2 (element e5m2)
//     kFp8E4M3/E5M2   the lossy raw-cast page (docs/format/lossy_pages.md): [T][D] fp8, then on
//                     K pages the Tier A witness (`witness`: [bands][T] fp16 bounds, band-major,
//                     or [bands][T] u8 codes and the page's fp16 w_max; the stride then covers
//                     the side data's last 16-byte chunk), on V pages rho [T] fp16
//     kDither8        the dither8 page (docs/format/dither8.md): records of D + 2 D/32 + 4 m bytes
//   k_raw_pages, v_raw_pages: raw pages, stride raw_page_stride (a multiple of 16, at least the
//                      raw page; each pool 16-byte aligned, null when it has no pages); a table
//                      entry e < 0 names raw page -e - 1 (of n_k_raw_pages / n_v_raw_pages;
//                      beyond them the entry is corrupt). Contents per `format`:
//     kGaacBf16       a GAAC page that did not fit its slot: [T][D] bf16
//     kGaacE5M2       likewise: [T][D] e5m2 bytes
//     kFp8E4M3/E5M2,  an exact page (a block kept exact: the incomplete tail block, a block that
//     kDither8        could not be encoded): [T][D] bf16, the exact values. Read on the bf16
//                     path (query rounded to bf16, bf16 probabilities in P V); its logit bound
//                     is 0 and its rho 0. K and V pages of a block are raw or not independently.
//     kFp8Fragments,  an exact page: bf16 in fragment-major order (kGaacFragments: a page the
//     kDither8Fragments, encoder could not take, its exceptions too many or not built exactly;
//     kGaacFragments  attended in its place among the coded pages, adding the bits its coded form
//                     would)
//     kBf16, kBf16Fragments  unused (their pages are bf16 already)
//   k_table, v_table:  [batch][n_kv_heads][table_stride] int32
//   seq_lens:          [batch] int32, each in [1, table_stride * block_tokens]
//   gaac_bases:        [2 (K, V)][n_kv_heads][2 (b3, b4)][head_dim] uint8
//   dither_keys:       [2 (K, V)][n_kv_heads] uint64 (codec::dither8_key(layer, K/V, kv_head))
//   outlier_channels:  [n_kv_heads][2 m] int32: the channels of the m exact RoPE pairs of K
//                      pages, in record order (pair j: channel a then channel b)
//   q:                 [batch][n_q_heads][head_dim] float; rounded on the device to the tiles'
//                      element type (bf16 for kBf16 / kGaacBf16, fp16 otherwise; bf16 for the
//                      exact raw pages of the lossy formats), and every score, meter and reference
//                      is defined with the query so rounded for each page
//   out:               [batch][n_q_heads][head_dim] float
//   meter, a_minus_1:  [batch][n_q_heads] float (lossy formats): A - 1 = sum_t p_t (e^{c_t} - 1)
//                      lifted by 2^-12, meter = min(1, (A - 1) + (A - 1)^2 / 2)
//   value_rho:         [batch][n_q_heads] float: the meter's value side sum_t p_t rho_t, rho_t >=
//                      ||v^_t - v_t|| of a lossy V page (fp8: the page's stored fp16 rho;
//                      dither8: (1/2 + 2^-8)(1 + 2^-20) sqrt(sum_g 32 s_{t,g}^2) from its scales),
//                      0 on exact pages; p the kernel's softmax; lifted by 2^-12 (0 for the
//                      formats without a meter). All three null: the same kernel runs without
//                      the meter (what its cost is measured against); any one set turns it on
// Query head h reads KV head h / (n_q_heads / n_kv_heads).
// Thread safety: launches go to `stream`; the caller orders them and keeps the buffers alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cache/cuda/device_pool.h"
#include "codec/lossy_page.h"

namespace certkv::cache {
enum class KvScheme : int;  // cache/kv_scheme.h
}

namespace certkv::attention::cuda {

using cache::cuda::CudaStatus;

enum class PageFormat : uint8_t {
  kBf16 = 0,
  kGaacBf16 = 1,
  kGaacE5M2 = 2,
  kFp8E4M3 = 3,  // lossy raw cast, Tier A meter
  kFp8E5M2 = 4,  // lossy raw cast, Tier A meter
  kDither8 = 5,  // certified INT8, Tier B meter
  // bf16 pages in fragment-major order (fragment_layout.h), read by the bulk-copy kernel
  // (fragment_decode_cuda.h): the skeleton the other classes move onto (docs/cuda.md)
  kBf16Fragments = 6,
  // fp8 E4M3 codes in fragment-major order on the same kernel, metered with the zero-byte Tier A
  // bound (each code bounds its own rounding, docs/cuda.md): no witness bytes
  kFp8Fragments = 7,
  // dither8 pages in fragment-major order on the same kernel (K codes a generator word per
  // token and step, V codes as fp8 codes), their scales and outliers token-major after them
  kDither8Fragments = 8,
  // GAAC pages in a device layout on the same kernel (format/fragment_layout.h,
  // docs/format/gaac_fragments.md): lossless, 12 bits per element plus a page's exceptions
  kGaacFragments = 9,
  // kDither8Fragments' bytes read as plain int8 (K^ = s q, no dither subtracted, no meter): the
  // yardstick of what dither8's generator and certificate cost; the benchmark's, no scheme's
  kInt8Fragments = 10,
};

// "bf16", "gaac", "gaac-e5m2", "fp8-e4m3", "fp8-e5m2", "dither8", "bf16-fragments",
// "fp8-e4m3-fragments", "dither8-fragments", "gaac-fragments", "int8-fragments".
const char* page_format_name(PageFormat format);
// The page format of a KV scheme the device serves (the scheme table's cuda_route) whose K pages
// keep `witness` (read for the Tier A schemes); kBf16 for the others, which no device cache
// stores. A scheme the device stores fragment-major (cache::kv_scheme_device_fragment_pages) gets
// its fragment format (dither8: kDither8Fragments, gaac: kGaacFragments, fp8-e4m3 with the exponent
// witness: kFp8Fragments), the one the device KV cache writes for it.
// (Defined in device_kv.cc: the scheme table is C++20, the kernels' translation units C++17.)
PageFormat page_format_of(cache::KvScheme scheme, codec::WitnessCode witness = codec::WitnessCode::kFp16);
// Whether pages of this format carry a meter (the lossy ones).
inline bool page_format_metered(PageFormat f) {
  return f == PageFormat::kFp8E4M3 || f == PageFormat::kFp8E5M2 || f == PageFormat::kDither8 ||
         f == PageFormat::kFp8Fragments || f == PageFormat::kDither8Fragments;
}

// The formats of dither8's bytes (codes, per-token group scales, outlier pairs): the dither8 ones,
// and int8-fragments, which reads them without the dither.
inline bool page_format_dither8_bytes(PageFormat f) {
  return f == PageFormat::kDither8 || f == PageFormat::kDither8Fragments || f == PageFormat::kInt8Fragments;
}

// The fragment-major formats (fragment_layout.h).
inline bool page_format_fragments(PageFormat f) {
  return f == PageFormat::kBf16Fragments || f == PageFormat::kFp8Fragments || f == PageFormat::kDither8Fragments ||
         f == PageFormat::kGaacFragments || f == PageFormat::kInt8Fragments;
}
// The formats the bulk-copy kernel reads (fragment_decode_cuda.h): the fragment-major ones and
// kBf16 (its token-major rows, each copied into a padded tile). Its last CTA of a row group merges
// the group's splits, counting on split counters in the workspace: a workspace whose layout
// changes between launches (another batch or split count) needs reset_error_word before the first
// launch of the new layout; launches of one layout leave them zero.
inline bool page_format_bulk_copied(PageFormat f) { return page_format_fragments(f) || f == PageFormat::kBf16; }

struct PagedDecodeParams {
  PageFormat format = PageFormat::kBf16;
  int batch = 1;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;       // 64 or 128
  int block_tokens = 16;  // 16
  float sm_scale = 0.f;   // the logit scale (1/sqrt(head_dim) for Llama)

  const uint8_t* k_pages = nullptr;
  const uint8_t* v_pages = nullptr;
  int64_t k_page_stride = 0;
  int64_t v_page_stride = 0;
  int64_t n_k_pages = 0;  // entries beyond these are corrupt: flagged, never read
  int64_t n_v_pages = 0;
  const uint8_t* k_raw_pages = nullptr;
  const uint8_t* v_raw_pages = nullptr;
  int64_t raw_page_stride = 0;
  int64_t n_k_raw_pages = 0;
  int64_t n_v_raw_pages = 0;

  const int32_t* k_table = nullptr;
  const int32_t* v_table = nullptr;
  int64_t table_stride = 0;
  // Which tables a batch row reads: row b reads the K tables at k_table + table_rows[b] *
  // table_row_stride + kv_head * table_stride (the V tables likewise), so that rows of one
  // sequence (a prefill chunk's positions, each with its own length) share its tables, and a pool
  // of many sequences keeps one table block per sequence. table_rows null: row b reads table row b.
  // table_row_stride 0: n_kv_heads * table_stride. An entry outside [0, n_table_rows) is corrupt:
  // counted in the error word, the row reads nothing.
  const int32_t* table_rows = nullptr;  // [batch]
  int64_t n_table_rows = 0;
  int64_t table_row_stride = 0;
  const int32_t* seq_lens = nullptr;
  int64_t max_seq_len = 0;  // an upper bound of seq_lens, known on the host (plans the splits)

  // GAAC
  const uint8_t* gaac_bases = nullptr;
  int64_t k_escape_capacity = 0;  // bytes of each slot's escape area
  int64_t v_escape_capacity = 0;
  // dither8
  const uint64_t* dither_keys = nullptr;
  int n_outlier_pairs = 0;  // m, at most kMaxDeviceOutlierPairs
  const int32_t* outlier_channels = nullptr;
  // Tier A bands pair channels as the model's RoPE does: interleaved (2j, 2j+1) or half-split.
  bool rope_half_split = false;
  // How the fp8 K pages store their Tier A witness (read only by the meter).
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  double delta_loc = 1e-8;  // Tier B failure probability per (layer, head, step)

  const float* q = nullptr;
  float* out = nullptr;
  float* meter = nullptr;
  float* a_minus_1 = nullptr;
  float* value_rho = nullptr;

  int n_splits = 0;  // 0: split_blocks, or chosen from the shape and the device (choose_splits)
  // Blocks per split, fixed (n_splits then covers max_seq_len): a row's result depends on its own
  // length and pages only, never on the batch beside it or the device (batch invariance; the
  // engine's backends run so). 0: the split is planned from the shape. At most one of n_splits and
  // split_blocks may be set.
  int64_t split_blocks = 0;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  void* stream = nullptr;  // cudaStream_t; null: the default stream
  // Where the launch counts corrupt entries (device memory, zeroed by the caller); null: the
  // workspace's error word. A caller that runs many launches before it reads their counts (a
  // step's layers) gives each its own word and zeroes and reads them all at once.
  uint32_t* error_word = nullptr;
};

inline constexpr int kMaxDeviceOutlierPairs = 8;

// Whether the kernels handle this shape and these buffers (head_dim 64 or 128, block_tokens 16,
// GQA ratio integral and at most 8, aligned page pools and raw pools of a sufficient stride, the
// codec parameters a format needs); the message says what is not supported (kUnsupported for
// shapes, kInvalidArgument for buffers). Never launches.
CudaStatus check(const PagedDecodeParams& params);
// The split count used when params.n_splits and split_blocks are 0: enough CTAs to fill the
// device, at least two blocks per warp.
int choose_splits(const PagedDecodeParams& params);
// The split count a launch of params uses: n_splits, else ceil(max_seq_len blocks / split_blocks),
// else choose_splits.
int planned_splits(const PagedDecodeParams& params);
// Workspace bytes for params (with its planned splits).
size_t workspace_bytes(const PagedDecodeParams& params);
// check(), then launches the split and merge kernels on params.stream. Asynchronous; a corrupt
// page entry (outside the pools or the raw pools), GAAC slot (bad tag, escapes past the slot) or
// sequence length is never read past: the page reads as zeros and it counts in the workspace's
// error word (read_error_word).
CudaStatus paged_decode(const PagedDecodeParams& params);
// The error word (params.error_word, else the workspace's) counts corrupt pages, slots and
// lengths over every launch since it was last reset (a launch does not reset it, so that timing
// loops run one kernel pair per call). reset_error_word zeroes it on params.stream
// (asynchronous), and with it the workspace's split counters (page_format_bulk_copied: the last
// CTA of a row group merges its splits; every launch leaves them zero, and a new workspace needs
// this once before its first launch); read_error_word synchronizes params.stream and reads it.
CudaStatus reset_error_word(const PagedDecodeParams& params);
CudaStatus read_error_word(const PagedDecodeParams& params, uint32_t* corrupt);
// The error word's copy to `host` enqueued on params.stream, without waiting: *host holds the
// count once the stream has been synchronized (page-locked host memory: the caller does not block).
CudaStatus copy_error_word_async(const PagedDecodeParams& params, uint32_t* host);

// Number of CUDA devices visible (0 when there is no driver or device).
int device_count();

}  // namespace certkv::attention::cuda
