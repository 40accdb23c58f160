// The sparse tier's key index on the device (DESIGN.md section 5; docs/cuda.md, "The CUDA backend
// of the engine"): what the host's index/rabitq.h computes, computed where the keys are.
//
// - set_key_centroids: c_k of a (sequence, KV head) = the mean of its keys [0, n) as they are
//   stored (bf16 pages), summed in double in token order and rounded once, as the CPU backend
//   computes it from its cache.
// - build_key_records: one index::RabitqRecord per key of a token range, read from the bf16 pages
//   through the block tables; the bytes of index::rabitq_encode_keys over the same keys and
//   centroids (every floating-point step the reference's, one IEEE operation at a time, no fused
//   multiply-add).
// - add_query_sums: a prefill's queries added to the sums behind the query centroid, several
//   sequences a launch; the bits of index::rabitq_add_query_sums (the same additions in double, in
//   the same order).
// - quantize_queries: each query head's centering, normalization, rotation and 4-bit randomized
//   rounding, into the DeviceRabitqQuery that sparse_decode reads; the fields of
//   device_rabitq_query(head, index::rabitq_quantize_query(head, q, seed), margin) bit for bit.
//
// Layouts, per table row r (a sequence slot) and KV head h:
//   centroids: [n_table_rows][n_kv_heads][2][head_dim] floats, c_q then c_k;
//   records:   records + (r * n_kv_heads + h) * record_stride + t, index::RabitqRecord<head_dim>
//              (sparse_decode's layout with SparseDecodeParams::table_rows).
// Bad values on the device (a key or query that is not finite, a table row or page outside the
// pools, a widening margin past the float range) are counted in the error word and their outputs
// left unwritten; the caller reads the word (it is a failure of the step, never silently used).
// Thread safety: launches on params.stream; the caller owns every buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/cuda/sparse_decode_cuda.h"
#include "core/cuda_status.h"
#include "index/rotation.h"

namespace certkv::attention::cuda {

// What index::Rotation::rotate applies (Rotation::p_transpose or Rotation::signs, on the device).
struct DeviceRotation {
  index::RotationKind kind = index::RotationKind::kHaar;
  const float* p_transpose = nullptr;  // kHaar: [head_dim][head_dim], row-major
  const float* signs = nullptr;        // kRandomizedHadamard: [3][head_dim] of +-1
};

// Tokens [first, end) of table row `table_row`, every KV head.
struct KeyIndexRange {
  int32_t table_row = 0;
  int32_t first = 0;
  int32_t end = 0;
};

struct KeyIndexBuildParams {
  int n_kv_heads = 0, head_dim = 0;  // head_dim 64 or 128
  int block_tokens = 16;
  // bf16 K pages and their tables, as PagedDecodeParams with table rows: row r's table of head h
  // at k_table + r * table_row_stride + h * table_stride.
  const uint8_t* k_pages = nullptr;
  int64_t k_page_stride = 0, n_k_pages = 0;
  const int32_t* k_table = nullptr;
  int64_t table_stride = 0, table_row_stride = 0, n_table_rows = 0;

  const KeyIndexRange* ranges = nullptr;  // [n_ranges], device memory
  int n_ranges = 0;
  int64_t max_range_tokens = 0;  // >= every end - first (the grid); a range past it is counted

  // set_key_centroids writes each range's row (REQUIRES: first == 0, 1 <= end <= the tables'
  // context, table_stride * block_tokens; the records are not read): c_q copied from
  // query_centroids ([n_ranges][n_kv_heads][head_dim], the caller's mean of the queries), c_k the
  // mean of the keys [0, end). build_key_records reads both.
  float* centroids = nullptr;
  const float* query_centroids = nullptr;
  DeviceRotation rotation;
  void* records = nullptr;
  int64_t record_stride = 0;  // records per (row, head), >= every record range's end
  uint32_t* error_word = nullptr;  // incremented per bad range, page or key
  void* stream = nullptr;          // cudaStream_t
};

CudaStatus check(const KeyIndexBuildParams& params);
CudaStatus set_key_centroids(const KeyIndexBuildParams& params);
CudaStatus build_key_records(const KeyIndexBuildParams& params);

struct QuerySumParams {
  int n_seqs = 0, n_q_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim in [1, 1024]
  // Rows [row_ranges[2 b], row_ranges[2 b + 1]) of q are sequence b's queries, [n_q_heads][head_dim]
  // floats each; their sums go onto sums [n_seqs][n_kv_heads][head_dim] (doubles, added to).
  const float* q = nullptr;
  const int64_t* row_ranges = nullptr;  // [n_seqs][2]
  double* sums = nullptr;
  void* stream = nullptr;
};

CudaStatus add_query_sums(const QuerySumParams& params);

struct QueryQuantizeParams {
  int batch = 0, n_q_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim 64 or 128
  const float* q = nullptr;  // [batch][n_q_heads][head_dim]
  // Row b's centroids are those of table row table_rows[b] (null: row b).
  const int32_t* table_rows = nullptr;
  int64_t n_table_rows = 0;
  const float* centroids = nullptr;  // as KeyIndexBuildParams::centroids
  DeviceRotation rotation;
  // [batch][n_q_heads]: each head's rounding seed (the CPU's sparse_head_rounding_seed of its
  // step's seed).
  const uint64_t* rounding_seeds = nullptr;
  // margin_scale = index::rabitq_logit_deviation_scale(deviations, sm_scale, ||q - c_q||, D);
  // REQUIRES: deviations finite and >= 0.
  double deviations = 0;
  float sm_scale = 0.f;
  DeviceRabitqQuery* queries = nullptr;  // out: [batch][n_q_heads]
  uint32_t* error_word = nullptr;
  void* stream = nullptr;
};

CudaStatus check(const QueryQuantizeParams& params);
CudaStatus quantize_queries(const QueryQuantizeParams& params);

}  // namespace certkv::attention::cuda
