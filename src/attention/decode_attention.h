// Attention of query heads over one sequence's K and V pages, read through the block table.
//
// Softmax attention (Vaswani et al. 2017, eq. 1) for one query head h with grouped-query sharing
// (Ainslie et al. 2023): kv_head = h / (n_q_heads / n_kv_heads),
//   s_t = scale * <q_h, k_t>,  p_t = exp(s_t - max_u s_u) / sum_u exp(s_u - max_u s_u),
//   out_h = sum_t p_t v_t.
//
// Entry points validate their arguments and throw certkv::Error (kInvalidArgument, kOutOfRange,
// kNotFound, kUnsupported) naming the problem: n_q_heads % n_kv_heads != 0, a shape that does not
// match the cache, head_dim not a multiple of 8 or above 256, a layer out of range, n_ctx < 1 or
// beyond the cache's written_tokens(seq, layer).
//
// Thread safety: the functions only read the cache; they may run concurrently with each other
// on the same cache while nothing mutates it. A ThreadPool runs one call at a time.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cache/kv_cache.h"
#include "core/thread_pool.h"

namespace certkv::attention {

struct AttentionShape {
  int n_q_heads = 0;
  int n_kv_heads = 0;  // must equal the cache's n_kv_heads
  int head_dim = 0;    // must equal the cache's head_dim; multiple of 8, at most 256
  float scale = 0.f;   // softmax scale, 1/sqrt(head_dim) for Llama
};

// Throws certkv::Error if the shape is unusable with this cache at this layer.
void validate_shape(const cache::KvCache& cache, int layer, const AttentionShape& shape);
// validate_shape, and q, out not null and 1 <= n_ctx <= written_tokens(seq, layer); the error
// names `entry`.
void validate_decode(const char* entry, const cache::KvCache& cache, cache::SeqId seq, int layer,
                     const AttentionShape& shape, const void* q, int64_t n_ctx, const void* out);

// The meter of one (layer, query head, step) (DESIGN.md section 4, gate/meter.h): with
// p~ the compressed attention and c_t >= |logit error of t| (Tier A witness bound for the
// registered lossy schemes, Tier B dither radius for dither8, 0 for exact pages),
//   A = sum_t p~_t e^{c_t},  meter = min(1, (A^2 - 1) / 2) >= TV(p, p~)   (Theorem 1),
//   value side: ||y - y~|| <= 2 TV max_t ||v_t|| + sum_t p~_t rho_t.
struct HeadMeter {
  double log_a = 0;         // log A (+inf when a bound overflowed)
  double meter = 0;         // min(1, (A^2 - 1) / 2)
  double value_rho = 0;     // sum_t p~_t rho_t
  double v_norm_max = 0;    // an upper bound of max_t ||v_t||
  double output_bound = 0;  // 2 meter v_norm_max + value_rho
};

struct MeterOptions {
  // Tier B (dither8): the failure probability of one (layer, head, step) cell,
  // delta_loc = delta_req / (L H T) (gate::local_delta). REQUIRES: in (0, 1) for dither8 caches.
  double delta_loc = 1e-8;
};

struct DecodeOptions {
  // Number of key/value splits (whole blocks each) computed independently and merged by their
  // log-sum-exp weights; 0 picks from n_ctx and the pool's thread count. Clamped to [1, n_blocks].
  int n_splits = 0;
  // When set (with `meter`), decode_attention computes the meter of every query head in the same
  // pass over the pages: meters: [n_q_heads]. Caches of non-lossy schemes give meter 0.
  HeadMeter* meters = nullptr;
  MeterOptions meter;
};

// Double-precision reference: plain two-pass softmax over t in [0, n_ctx), reading the cache
// through read_token_range_ref (GAAC slots through the codec's _ref decoder).
// q: [n_q_heads][head_dim] float; out: [n_q_heads][head_dim] double.
void decode_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                          const AttentionShape& shape, const float* q, int64_t n_ctx,
                          double* out);

// Production float path: per (kv_head, split) one pass over the pages with an online softmax
// (running max m, running sum l, accumulator); each page is converted to float once (a raw page
// from bf16, a GAAC slot reconstructed by the codec into a per-thread one-page buffer; never a
// decompressed copy of the cache) and used by every query head of its group; raw pages, slots
// and the tail feed the same softmax in the same order, so a GAAC cache gives the same floats as
// a BF16 cache of the same tokens. Splits merge by LSE weights and run on `pool` when given.
// q: [n_q_heads][head_dim] float; out: [n_q_heads][head_dim] float.
void decode_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                      const AttentionShape& shape, const float* q, int64_t n_ctx, float* out,
                      ThreadPool* pool = nullptr, const DecodeOptions& options = {});

// One sequence's query of a batched decode step.
struct DecodeQuery {
  cache::SeqId seq = 0;
  const float* q = nullptr;  // [n_q_heads][head_dim]
  int64_t n_ctx = 0;
  float* out = nullptr;      // [n_q_heads][head_dim]
  DecodeOptions options;
};

// decode_attention of several sequences of one layer in one pass over the pool: every
// (sequence, kv_head, split) unit of the step is shared out at once (one wake-up of the pool,
// not one per sequence). Each sequence gets the floats decode_attention gives it alone with the
// same pool: its split count is chosen from its own n_ctx and the pool's thread count.
// REQUIRES: as decode_attention, for every query.
void decode_attention_batch(const cache::KvCache& cache, int layer, const AttentionShape& shape,
                            std::span<const DecodeQuery> queries, ThreadPool* pool = nullptr);

// Double-precision reference of the meter: reads the reconstruction (read_token_range_ref) and
// the pages' error data, evaluates c_t, A and the value side in double (gate::MeterState).
// meters: [n_q_heads]. block_contributions, when not null, gets [n_q_heads][n_blocks] the share
// of block j in A - 1: sum_{t in j} p~_t (e^{c_t} - 1) (the gate repairs in decreasing order).
void decode_meter_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                      const AttentionShape& shape, const float* q, int64_t n_ctx,
                      const MeterOptions& options, HeadMeter* meters,
                      std::vector<double>* block_contributions = nullptr);

// c_t >= |s~_t - s_t| of one token, in double, from its page's error data. Tier A (Theorem 2):
// bounds = the token's witness w_{t,b}, [codec::witness_width(spec)] (the exponent witness: a
// band per channel, u_{t,c} of the token's codes, so c_t = |scale| sum_c |q_c| u_{t,c}). Tier B (Lemma 2, a
// dither8 spec with its outlier pairs): bounds = the token's group scales, [head_dim /
// codec::kQuantGroup], over n_ctx tokens at failure probability delta_loc, plus the dither
// grid's slack. q: [head_dim]; scale: the softmax scale (its magnitude counts).
double meter_logit_bound_ref(const codec::LossyPageSpec& spec, const float* q, double scale,
                             const float* bounds, int64_t n_ctx, double delta_loc);

// The true total variation between the exact attention distribution (keys from the backing
// store, read_token_range_exact) and the compressed one (read_token_range_ref), per query head,
// in double. tv: [n_q_heads].
void decode_true_tv_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                        const AttentionShape& shape, const float* q, int64_t n_ctx, double* tv);

// The split count decode_attention uses for DecodeOptions::n_splits == 0.
int choose_decode_splits(int64_t n_ctx, int block_tokens, int n_kv_heads, int n_threads);

// Causal attention for n new query tokens at positions [pos0, pos0 + n): query i attends to
// positions [0, pos0 + i]. Lossy caches: query i reads what a decode step at its position reads
// (the cache holding pos0 + i + 1 tokens): the blocks ending after pos0 + i + 1 -
// recent_window_tokens() exactly, from the backing store (its incomplete block and the recent
// window), earlier blocks as stored; so a prompt's logits do not depend on how it is cut into
// chunks (the meter and the gate act on decode steps). Tiles a block of queries against each
// tile of pages (each page converted or reconstructed once per query block into a per-thread
// tile buffer), online softmax, parallel over (kv_head, query block) on `pool`. Same floats for
// GAAC and BF16 caches. The softmax is updated once per page, in page order, as
// decode_attention does it with one split: for a query at position p the output is bit for bit
// decode_attention's with n_ctx = p + 1 and n_splits = 1 over the same values, and does not
// depend on n, pos0 or the thread count.
// q: [n][n_q_heads][head_dim] float; out: [n][n_q_heads][head_dim] float.
// REQUIRES: pos0 >= 0, n >= 1, pos0 + n <= written_tokens(seq, layer).
void prefill_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                       const AttentionShape& shape, const float* q, int64_t pos0, int64_t n,
                       float* out, ThreadPool* pool = nullptr);

// Double-precision reference of prefill_attention: decode_attention_ref per query token.
// q: [n][n_q_heads][head_dim] float; out: [n][n_q_heads][head_dim] double.
void prefill_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                           const AttentionShape& shape, const float* q, int64_t pos0, int64_t n,
                           double* out);

}  // namespace certkv::attention
