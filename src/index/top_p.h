// Top-p token selection for sparse decode (seed 002, Section 4.1, Algorithm 3; DESIGN.md section
// 5): per decode step and head, a set of tokens whose softmax mass reaches p, chosen on the
// logits quantized to 16-bit fixed point (docs/sparse.md, "Top-p on quantized logits"). The
// CPU functions here and the CUDA selection share the arithmetic of top_p_buckets.h and select
// the same set.
//
// Buckets. With l_max the largest logit, each token's gap below it is rounded down to 1/256 logit,
//   a_t = min(kTopPGapCap, floor(256 fl(l_max - l_t)))                    (top_p_gap_bucket)
// so bucket a < kTopPGapCap holds the logits whose float gap lies in [a / 256, (a + 1) / 256), and
// the last bucket every gap of 44 logits or more.
//
// Weights. With n tokens and s = 63 - ceil(log2 n) fraction bits, a token's exact weight in units
// of 2^-s, w_t = 2^s exp(-(l_max - l_t)) (the real gap), lies between two integer weights of its
// bucket:
//   L(a) = floor(2^s exp(-(a + 1) (1 + 2^-23) / 256) (1 - 2^-50)),  L(kTopPGapCap) = 0,
//   U(a) = ceil (2^s exp(-a (1 - 2^-23) / 256) (1 + 2^-50))          (U(kTopPGapCap) = 1)
// (1 -+ 2^-23 covers the float subtraction's rounding, a relative 2^-24 of the gap; 1 -+ 2^-50
// covers exp in double). They come from the s = 63 tables of top_p_bucket_weights shifted right
// by 63 - s (rounding up for U, down for L), which equals the formulas evaluated at s.
//
// Selection. The threshold bucket B is the smallest bucket whose upper set A_B = {t : a_t <= B}
// certainly holds mass p:
//   lower >= ceil(p (lower + upper)),  lower = sum_{t in A_B} L(a_t),  upper = sum_{t not in A_B} U(a_t),
// decided exactly in integers (top_p_reaches). The selected set is A_B: every token of bucket B
// is taken, so tokens tied in the threshold bucket are never split. It is the threshold set
// {t : logits[t] >= theta} for theta the smallest float whose bucket is at most B
// (top_p_bucket_threshold; the widening below compares against it).
//
// Guarantee. lower / (lower + upper) is at most the exact softmax mass of A_B, so the selection
// holds exact mass >= p: it contains the exact Top-p set of the same float logits (the smallest
// threshold set of real softmax mass >= p, ties included); the quantization never drops a token
// that exact Top-p keeps. It stops within one bucket of it: A_B' for the nonempty bucket B' before
// B failed the test, and since U(a) / L(a) ~ e^(1/256), its exact mass m' has
// m' / (1 - m') < e^(1/128) p / (1 - p) (plus at most one unit of 2^-s per token): m' < 0.90070
// at p = 0.9. p = 1 selects every token (U >= 1 everywhere), so sparse attention at p = 1 equals
// dense attention.
//
// Cost: one pass over the tokens for their buckets and a histogram of kTopPBuckets counts, a scan
// of the histogram, a 32-step bisection for theta, one pass for the mask; nothing is sorted or
// ordered within a bucket.
//
// Thread safety: the functions are pure on their arguments (top_p_select keeps thread_local
// scratch).
#pragma once

#include <cstdint>
#include <vector>

#include "index/top_p_buckets.h"

namespace certkv::index {

struct TopPSelection {
  float threshold = 0.0f;   // theta: selected tokens are exactly those with logits[t] >= theta
  int32_t bucket = 0;       // B, the threshold bucket: selected tokens are those with a_t <= B
  int64_t n_selected = 0;   // number of tokens with mask[t] == 1
  // lower / (lower + upper) at B, rounded to the nearest double (top_p_mass): a lower bound on the
  // exact softmax mass of the selected set, and >= p.
  double mass = 0.0;
  int64_t n_boundary = 0;   // tokens of the threshold bucket B
};

// Reference: each token's bucket and weights as above, the tokens sorted by bucket, the buckets
// walked from the top keeping lower and upper, the first that passes is B; the mask from theta.
// O(n log n). logits: [n]; mask: [n] (written: 1 selected, 0 not).
// REQUIRES: n >= 1; logits and mask non-null; every logit finite; 0 < p <= 1.
// Violations throw certkv::Error kInvalidArgument naming the argument.
TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask);

// The threshold search of Algorithm 3 of seed 002 on the histogram of the buckets: one pass counts
// the tokens of every bucket (all tokens of a bucket have the same weights), a scan of the counts
// from the top finds B, and the mask is a_t <= B. Returns exactly top_p_select_ref's selection
// (mask, theta, B, counts, mass) on every input. logits: [n]; mask: [n]. REQUIRES: as
// top_p_select_ref.
TopPSelection top_p_select(const float* logits, int64_t n, double p, uint8_t* mask);

// The Top-p set widened by a per-token margin (docs/sparse.md, "Widening by the estimator's
// deviation"): a token the threshold left out is added when its logit plus its margin reaches
// theta,
//   margin_t = fl(margin_scale * norm_t),   selected_t = mask[t] or fl(logits[t] + margin_t) >= theta
// in float, each operation rounded once (the index layer is compiled without contraction, and the
// CUDA selection uses the same two rounded operations, so both add the same tokens). With theta
// from top_p_select, fl(l + margin) >= theta exactly when fl(l + margin) lies at or above the
// threshold bucket. For the sparse tier, norm_t = ||k_t - c_k|| and margin_scale =
// rabitq_logit_deviation_scale(z, ...), so the margin is z estimator deviations. margin_scale 0
// adds nothing.
// logits: [n]; norms: norm_t at norms[t * norm_stride] (a stride in floats, so the norms may be a
// field of an array of records); mask: [n], 1 for the Top-p set on entry, the widened set on exit.
// Returns the tokens added. REQUIRES: n >= 0; finite margin_scale >= 0; non-null pointers when
// n > 0; norm_stride >= 1 (else certkv::Error kInvalidArgument naming the argument).
int64_t top_p_widen(const float* logits, int64_t n, float theta, float margin_scale, const float* norms,
                    int64_t norm_stride, uint8_t* mask);

// The bucket weights at s = 63, [2][kTopPBuckets]: U(a) for a in [0, kTopPGapCap], then L(a).
// One table for every n (top_p_upper_weight / top_p_lower_weight shift it to s = 63 - ceil(log2 n));
// a device port uploads it once.
const std::vector<uint64_t>& top_p_bucket_weights();

// ceil(p Z) exactly (top_p_target). REQUIRES: 0 < p <= 1 (else certkv::Error kInvalidArgument).
uint64_t top_p_target_units(double p, uint64_t Z);

}  // namespace certkv::index
