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
// selects exactly the tokens the reference selects). With l_max the largest logit and
// s = 63 - ceil(log2(n)) fraction bits, token t weighs
//   W_t = max(1, ceil(2^s * exp(logits[t] - l_max)))     (exp in double)
// so the largest token weighs exactly 2^s, every token weighs at least one unit, and the total
// Z = sum_t W_t <= 2^63. The mass of a set is sum W_t / Z, and "mass >= p" is decided exactly in
// integers: sum W_t >= ceil(p * Z). Rounding weights up by at most one unit (2^-s of the largest
// token's weight) changes a set's mass by at most n * 2^-s <= 2^-(63 - 2 ceil(log2 n)) relative,
// e.g. below 2^-29 for n = 10^5; in exchange a token is never weightless, so p = 1 selects every
// token and sparse attention at p = 1 equals dense attention.
//
// Thread safety: both functions are pure on their arguments (they allocate O(n) scratch).
#pragma once

#include <cstdint>

namespace certkv::index {

struct TopPSelection {
  float threshold = 0.0f;   // theta: selected tokens are exactly those with logits[t] >= theta
  int64_t n_selected = 0;   // number of tokens with mask[t] == 1
  double mass = 0.0;        // softmax mass of the selected set (fixed point, see above); >= p
  int n_search_passes = 0;  // top_p_select only: ternary-search passes over the n scores (<= 21)
};

// Upper bound on TopPSelection::n_search_passes of top_p_select: each pass shrinks the candidate
// interval of float keys (a range of at most 2^32 - 1 < 3^21) to at most a third.
inline constexpr int kTopPMaxSearchPasses = 21;

// Reference: softmax weights as above, tokens sorted by logit (descending), shortest prefix with
// mass >= p, extended by every token equal to the last one taken. O(n log n).
// logits: [n]; mask: [n] (written: 1 selected, 0 not).
// REQUIRES: n >= 1; logits and mask non-null; every logit finite; 0 < p <= 1.
// Violations throw certkv::Error kInvalidArgument naming the argument.
TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask);

// Linear-time threshold search (Algorithm 3 of seed 002, made exact and terminating): a ternary
// partition of the candidate range of thresholds, where each pass sums the mass above two pivots
// and snaps the range to existing scores (the data bounds v_min / v_max). The range is searched
// on the order-preserving integer image of the float scores, so pivots are exact integers and
// every pass shrinks the range to at most a third: at most kTopPMaxSearchPasses passes, plus
// two setup passes and one mask pass, each O(n). Returns exactly the set (and theta, mass) of
// top_p_select_ref on every input.
// logits: [n]; mask: [n]. REQUIRES: as top_p_select_ref.
TopPSelection top_p_select(const float* logits, int64_t n, double p, uint8_t* mask);

}  // namespace certkv::index
