// Sparse decode attention on the GPU (DESIGN.md section 5; docs/sparse.md, docs/cuda.md): per
// decode step and query head, the RaBitQ index scan (binary key codes x the 4-bit query by
// popcounts, Eq. 20 and Eq. 6), Top-p over those estimated logits quantized to 16-bit fixed point
// (index/top_p.h: the same buckets, threshold bucket, threshold and set as index::top_p_select on
// the same logits, through the shared arithmetic of index/top_p_buckets.h), and
// attention over the selected tokens of the indexed prefix plus every token of the local window,
// gathered row by row from bf16 pages onto the tensor-core tiles of the paged kernel.
//
// Launches (one stream): memset -> estimate -> bucket histogram -> Top-p threshold -> selection
// lists (the Top-p set, widened per token as index::top_p_widen when the query's margin_scale is
// positive) -> attention splits -> merge. The query's rotation and 4-bit quantization are the caller's (index::rabitq_quantize_query
// on the host; device_rabitq_query converts it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/cuda/paged_decode_cuda.h"
#include "index/rabitq.h"

namespace certkv::attention::cuda {

// One query head's RaBitQ state as the estimate reads it: index::RabitqQuery without its levels,
// and the KV head's <c_q, c_k>. Words past the head dim are 0. margin_scale widens the head's
// Top-p set as index::top_p_widen does (0: no widening).
struct DeviceRabitqQuery {
  uint64_t planes[index::kRabitqQueryBits][2];
  int32_t sum_q_u = 0;
  float delta = 0, q_l = 0, norm_q_centered = 0, q_dot_ck = 0, cq_dot_ck = 0;
  float margin_scale = 0;
};

// margin_scale: index::rabitq_logit_deviation_scale(deviations, sm_scale, query.norm_q_centered, D)
// for a set widened by that many deviations (the CPU path's SparseDecodeOptions::deviations).
template <int D>
DeviceRabitqQuery device_rabitq_query(const index::RabitqHead& head, const index::RabitqQuery<D>& query,
                                      float margin_scale = 0.f);

// Tokens of the selection lists per chunk of the indexed prefix.
inline constexpr int kSparseChunkTokens = 1024;

// The kernel that computes the estimate's integer term <c_b, q_u> (Eq. 20). Every form computes
// the same integers, so the logits are the same bit for bit (the CPU's); they differ in speed.
enum class EstimateForm : uint8_t {
  kChosen = 0,  // kBitMma from 4 query heads per KV head, kPopcount below
  kPopcount,    // one thread per token, carry-save popcounts (index::code_dot_planes)
  kByteMma,     // tensor cores, m16n8k32 u8: code bits as 0 / 1 bytes times q_u as bytes
  kBitMma,      // tensor cores, m16n8k128 .b1 AND-POPC: code words times the query's bit planes
};

struct SparseDecodeParams {
  int batch = 0, n_q_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim 64 or 128
  int block_tokens = 16;
  float sm_scale = 0.f;
  double p = 0.9;  // Top-p mass, in (0, 1]

  // bf16 KV pages and block tables, as in PagedDecodeParams (format kBf16).
  const uint8_t* k_pages = nullptr;
  const uint8_t* v_pages = nullptr;
  int64_t k_page_stride = 0, v_page_stride = 0, n_k_pages = 0, n_v_pages = 0;
  const int32_t* k_table = nullptr;  // [batch][n_kv_heads][table_stride]
  const int32_t* v_table = nullptr;
  int64_t table_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  int64_t max_seq_len = 0;
  // Which tables and records a batch row reads (as PagedDecodeParams::table_rows): row b reads the
  // tables at k_table + table_rows[b] * table_row_stride + kv_head * table_stride and the records
  // of row table_rows[b]. table_rows null: row b; table_row_stride 0: n_kv_heads * table_stride.
  // A row outside [0, n_table_rows) reads nothing (its output is not defined).
  const int32_t* table_rows = nullptr;  // [batch]
  int64_t n_table_rows = 0;
  int64_t table_row_stride = 0;

  // The index: tokens [0, n_indexed[b]) of sequence b have records
  // records[(r * n_kv_heads + kv_head) * record_stride + t], r = b or table_rows[b] (index::RabitqRecord<head_dim>; the
  // base 16-byte aligned, and every list too: an even record_stride at head_dim 64);
  // tokens [n_indexed[b], seq_lens[b]) are the window, attended exactly.
  const void* records = nullptr;
  int64_t record_stride = 0;
  const int32_t* n_indexed = nullptr;  // [batch], multiples of block_tokens
  int64_t max_indexed = 0;             // >= every n_indexed[b]
  int64_t max_window = 0;              // >= every seq_lens[b] - n_indexed[b]
  const DeviceRabitqQuery* queries = nullptr;  // [batch][n_q_heads]
  // [2][index::kTopPBuckets]: index::top_p_bucket_weights(), one table for every row (uploaded
  // once; each row shifts it to its n_indexed).
  const uint64_t* topp_weights = nullptr;

  const float* q = nullptr;  // [batch][n_q_heads][head_dim]
  float* out = nullptr;      // [batch][n_q_heads][head_dim]
  // Optional, per (sequence, query head): theta (the Top-p set: estimated logit >= theta; +inf
  // when nothing is indexed), tokens selected from the indexed prefix (the widened set), of them
  // the tokens the widening added, the estimated mass of the Top-p set before widening.
  float* threshold = nullptr;
  int64_t* n_selected = nullptr;
  int64_t* n_widened = nullptr;
  double* mass = nullptr;

  int n_splits = 0;  // 0: split_chunks, or chosen (choose_splits: 4 chunks per split)
  // > 0: every split takes this many chunks of its own row, the row's indexed chunks then its
  // window's, so that a row's output depends on its own lengths only, never on the batch beside
  // it (the engine's batch invariance). 0: the chunks of the batch's longest index and window,
  // split evenly. Not with n_splits.
  int64_t split_chunks = 0;
  // Tokens per CTA of the Top-p histogram pass, a multiple of 16 up to 2^24; 0: chosen
  // (4096 doubled up to 32768 while the passes keep 1024 CTAs).
  int64_t pass_tokens = 0;
  EstimateForm estimate_form = EstimateForm::kChosen;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Copies the bf16 page fields (pools, strides, block tables, lengths; batch, KV heads, head dim,
// block tokens) of a paged description (DeviceKv::describe, format kBf16) into params.
void describe_pages(const PagedDecodeParams& pages, SparseDecodeParams* params);

// Refuses bad shapes and buffers with a status and a message before any launch.
CudaStatus check(const SparseDecodeParams& params);
// The form the estimate runs in: params.estimate_form as it is, or when that is kChosen the one
// for the group size (kBitMma from 4 query heads per KV head, kPopcount below or without KV heads).
EstimateForm estimate_form_of(const SparseDecodeParams& params);
// "chosen", "popcount", "bytes", "bits"; parse_estimate_form returns false on any other name.
const char* estimate_form_name(EstimateForm form);
bool parse_estimate_form(const char* name, EstimateForm* form);
int choose_splits(const SparseDecodeParams& params);
size_t workspace_bytes(const SparseDecodeParams& params);
CudaStatus sparse_decode(const SparseDecodeParams& params);
// After sparse_decode (stream order): the estimated logits in the workspace,
// [batch][n_q_heads][max_indexed] (scores times sm_scale), and the selection lists
// ([batch][n_kv_heads][chunks][kSparseChunkTokens] entries token | heads << 24, counts
// [batch][n_kv_heads][chunks]) for tests and telemetry.
const float* estimated_logits(const SparseDecodeParams& params);
const uint32_t* selection_entries(const SparseDecodeParams& params);
const int32_t* selection_counts(const SparseDecodeParams& params);
int64_t selection_chunks(const SparseDecodeParams& params);

// The Top-p stage of sparse_decode alone, on logits the caller chooses (tests of bucket edges,
// ties and the cap bucket against index::top_p_select): per row the largest logit, the bucket
// histogram and the threshold, with sparse_decode's kernels. Row r holds n[r] logits at
// logits + r * stride. Outputs per row as sparse_decode's: theta (+inf when n[r] == 0), the
// selected count, the mass.
struct TopPRowsParams {
  int rows = 0;
  const float* logits = nullptr;  // [rows][stride], 16-byte aligned; finite where read
  int64_t stride = 0;             // a multiple of 16
  const int32_t* n = nullptr;     // [rows], each in [0, stride]
  double p = 0.9;                 // in (0, 1]
  const uint64_t* topp_weights = nullptr;  // index::top_p_bucket_weights()
  int64_t pass_tokens = 0;        // as SparseDecodeParams::pass_tokens
  float* threshold = nullptr;     // [rows]
  int64_t* n_selected = nullptr;  // [rows]
  double* mass = nullptr;         // [rows]
  void* workspace = nullptr;
  size_t workspace_size = 0;
  void* stream = nullptr;  // cudaStream_t
};
size_t top_p_rows_workspace_bytes(const TopPRowsParams& params);
// Refuses bad shapes and null or misaligned buffers with a status before any launch.
CudaStatus top_p_rows(const TopPRowsParams& params);

}  // namespace certkv::attention::cuda
