// Top-p token selection for sparse decode (seed 002, Section 4.1, Algorithm 3; DESIGN.md section
// 5): per decode step and head, the smallest set of tokens whose softmax mass reaches p.
//
// The selected set is always a threshold set {t : logits[t] >= theta} where theta is one of the
// logits: theta is the largest logit v with G(v) >= p, G(v) the softmax mass of {t : logits[t] >= v}.
// Tokens tied with theta are all selected, so the set may hold more than the strictly smallest
// number of tokens when the boundary is a tie; dropping the whole lowest tie group (the tokens
// equal to theta) always brings the mass below p.
//
// Masses are fixed point so that every summation order gives the same sums (a SIMD or CUDA port
// selects exactly the tokens the reference selects). With l_max the largest logit, each token's
// gap below it is quantized down to 1/64 of a logit,
//   a_t = min(kTopPGapCap, floor(64 (l_max - l_t)))        (float subtraction and product)
// and with s = 63 - ceil(log2(n)) fraction bits the token weighs
//   W_t = max(1, ceil(2^s * exp(-a_t / 64)))               (exp in double; 1 at the cap)
// so the largest token weighs exactly 2^s, every token weighs at least one unit, and the total
// Z = sum_t W_t <= 2^63. The mass of a set is sum W_t / Z, and "mass >= p" is decided exactly in
// integers: sum W_t >= ceil(p * Z). Quantizing the gap overstates a token's weight relative to
// the largest by less than e^(1/64) - 1 = 1.6% (far below the error of the estimated logits the
// selection runs on, docs/sparse.md); rounding up by one unit changes a set's mass by at most
// n * 2^-s. In exchange a token is never weightless, so p = 1 selects every token and sparse
// attention at p = 1 equals dense attention, and the weights come from a table of
// kTopPGapCap + 1 entries per s instead of one exponential per token.
//
// Thread safety: both functions are pure on their arguments (they allocate O(n) scratch).
#pragma once

#include <cstdint>
#include <vector>

namespace certkv::index {

// Gaps of at least 44 logits weigh one unit for every s <= 63 (2^63 e^-44 < 1).
inline constexpr int kTopPGapStepsPerLogit = 64;
inline constexpr int kTopPGapCap = 44 * kTopPGapStepsPerLogit;

struct TopPSelection {
  float threshold = 0.0f;   // theta: selected tokens are exactly those with logits[t] >= theta
  int64_t n_selected = 0;   // number of tokens with mask[t] == 1
  double mass = 0.0;        // softmax mass of the selected set (fixed point, see above); >= p
  // top_p_select only: tokens of the boundary gap bucket, the only ones ordered individually.
  int64_t n_boundary = 0;
};

// Reference: weights as above, tokens sorted by logit (descending), shortest prefix with
// mass >= p, extended by every token equal to the last one taken. O(n log n).
// logits: [n]; mask: [n] (written: 1 selected, 0 not).
// REQUIRES: n >= 1; logits and mask non-null; every logit finite; 0 < p <= 1.
// Violations throw certkv::Error kInvalidArgument naming the argument.
TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask);

// Linear-time threshold search (the threshold search of Algorithm 3 of seed 002, with one
// kTopPGapCap + 1 -way partition instead of repeated three-way ones): one pass sums the weight of
// every gap bucket a (all tokens of a bucket weigh the same W(a), and a bucket's logits all lie
// below those of any bucket with a smaller gap), a scan of the buckets from the top finds the
// bucket where the cumulative weight reaches ceil(p Z), and within it the m-th largest logit
// (m the number of its tokens still needed, by selection, not sorting) is theta. Passes over the
// n scores: the maximum, the buckets, the boundary bucket's tokens, the mask. Returns exactly the
// set (and theta, mass) of top_p_select_ref on every input.
// logits: [n]; mask: [n]. REQUIRES: as top_p_select_ref.
TopPSelection top_p_select(const float* logits, int64_t n, double p, uint8_t* mask);

// The Top-p set widened by a per-token margin (docs/sparse.md, "Widening by the estimator's
// deviation"): a token the threshold left out is added when its logit plus its margin reaches
// theta,
//   margin_t = fl(margin_scale * norm_t),   selected_t = mask[t] or fl(logits[t] + margin_t) >= theta
// in float, each operation rounded once (the index layer is compiled without contraction, and the
// CUDA selection uses the same two rounded operations, so both add the same tokens). For the
// sparse tier, norm_t = ||k_t - c_k|| and margin_scale = rabitq_logit_deviation_scale(z, ...), so
// the margin is z estimator deviations. margin_scale 0 adds nothing.
// logits: [n]; norms: norm_t at norms[t * norm_stride] (a stride in floats, so the norms may be a
// field of an array of records); mask: [n], 1 for the Top-p set on entry, the widened set on exit.
// Returns the tokens added. REQUIRES: n >= 0; finite margin_scale >= 0; non-null pointers when
// n > 0; norm_stride >= 1 (else certkv::Error kInvalidArgument naming the argument).
int64_t top_p_widen(const float* logits, int64_t n, float theta, float margin_scale, const float* norms,
                    int64_t norm_stride, uint8_t* mask);

// The weights W(a), a in [0, kTopPGapCap], for n tokens (the table both selections use; a port
// to another device takes it from here so that its selection is the same set).
// REQUIRES: n >= 1 (else certkv::Error kInvalidArgument).
const std::vector<uint64_t>& top_p_weight_table(int64_t n);

// ceil(p Z) exactly, the unit target of the selections. REQUIRES: 0 < p <= 1.
uint64_t top_p_target_units(double p, uint64_t Z);

}  // namespace certkv::index
