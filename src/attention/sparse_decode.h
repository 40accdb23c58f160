// Sparse decode attention (DESIGN.md section 5, seed 002): per query head, the tokens of the
// indexed prefix [0, n_indexed) are scored by the RaBitQ estimator of the cache's KeyIndex, the
// smallest set holding estimated softmax mass p is selected (index/top_p.h), and exact attention
// runs over the selected tokens plus every token of the local window [n_indexed, n_ctx).
//
//   l~_t = scale * est<q, k_t>          (t < n_indexed; index/rabitq.h, Eq. 6)
//   S    = top_p(l~, p) U [n_indexed, n_ctx)
//   out  = sum_{t in S} softmax_S(scale <q, k_t>) v_t
//
// Selected tokens are read from their pages whatever the class: a raw bf16 row directly, any
// other page (gaac, fp8, lossy, dither8) reconstructed once per block for every query head of
// the group that selected a row of it. On a lossy cache the meter (decode_attention.h) bounds
// the total variation between attention over S with exact and with stored keys: the attended
// set is what the certificate covers; the mass left outside S is measured by the audit's recall.
//
// Thread safety: as decode_attention.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "core/thread_pool.h"

namespace certkv::attention {

struct SparseDecodeOptions {
  double p = 0.9;               // Top-p mass, in (0, 1]
  // Widening by the estimator's deviation (index::top_p_widen): a token the Top-p threshold left
  // out is also selected when its estimated logit plus `deviations` times its sigma_t
  // (index::rabitq_logit_deviation_scale) reaches the threshold. 0: the Top-p set alone.
  double deviations = 0;
  uint64_t rounding_seed = 0;   // the query's randomized rounding; head h draws from seed + h
  // Lossy caches: the meter of every query head over what it attended. meters: [n_q_heads].
  HeadMeter* meters = nullptr;
  MeterOptions meter;
  // Audit outputs, per query head, when not null: the attended indices (selected, then the
  // window; ascending) and the estimated logits of the indexed prefix. [n_q_heads] vectors each.
  std::vector<std::vector<int32_t>>* attended = nullptr;
  std::vector<std::vector<float>>* estimated_logits = nullptr;
  // [n_q_heads]: each head's ||q - c_q|| as the quantized query holds it (the argument of
  // index::rabitq_logit_deviation_scale), for audits that widen other rules the same way.
  std::vector<float>* query_norms = nullptr;
};

// A decode step's SparseDecodeOptions::rounding_seed in the backends: the sparse config's seed
// mixed with the query's position and layer (every backend draws the same roundings).
inline uint64_t sparse_step_rounding_seed(uint64_t seed, int64_t position, int n_layers, int layer) {
  return seed ^ ((uint64_t(position) * uint64_t(n_layers) + uint64_t(layer)) * 0xd1b54a32d192ed03ull);
}

// The query rounding seed of query head `head` for a step whose SparseDecodeOptions::rounding_seed
// is `seed` (what every path quantizes the head's query with).
inline uint64_t sparse_head_rounding_seed(uint64_t seed, int head) {
  return seed + uint64_t(head) * 0x9e3779b97f4a7c15ull;
}

struct SparseHeadStats {
  int64_t n_indexed = 0;    // tokens scored by the index
  int64_t n_selected = 0;   // of them, selected by Top-p and its widening
  int64_t n_widened = 0;    // of n_selected, added by the widening
  int64_t n_attended = 0;   // selected + window
  double estimated_mass = 0;  // the estimated softmax mass of the Top-p set before widening (>= p)
  int64_t boundary_tokens = 0;  // tokens of top_p_select's threshold bucket
  float norm_q_centered = 0;    // ||q - c_q|| of the quantized query
};

// Throws certkv::Error as decode_attention, and kInvalidArgument for p outside (0, 1], deviations
// negative or not finite, an index
// of another shape than the cache, or kv heads of one layer indexed to different lengths, or an
// indexed prefix that is not whole blocks or exceeds n_ctx.
// q: [n_q_heads][head_dim]; out: [n_q_heads][head_dim]; stats: [n_q_heads] or null.
void sparse_decode_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                             const AttentionShape& shape, const float* q, int64_t n_ctx,
                             const cache::KeyIndex& index, const SparseDecodeOptions& options,
                             float* out, SparseHeadStats* stats = nullptr,
                             ThreadPool* pool = nullptr);

// Double-precision reference: the same estimated scores (KeyIndex::estimate_scores), the
// sorting selection top_p_select_ref, then a two-pass softmax in double over the attended set
// read through read_token_range_ref. out: [n_q_heads][head_dim] double; attended, when not null,
// gets the attended indices per head.
void sparse_decode_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                                 const AttentionShape& shape, const float* q, int64_t n_ctx,
                                 const cache::KeyIndex& index, const SparseDecodeOptions& options,
                                 double* out,
                                 std::vector<std::vector<int32_t>>* attended = nullptr);

}  // namespace certkv::attention
