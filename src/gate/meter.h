// The meter (DESIGN.md section 4; WitCert, seed 000): a sound upper bound on the total variation
// between the exact attention distribution p and the compressed one p~ of one (layer, query head,
// step), from per-token bounds c_t >= |eps_t| on the logit errors eps_t = s~_t - s_t.
//
//   Theorem 1:  A = sum_t p~_t e^{c_t};  TV(p, p~) <= (A^2 - 1) / 2;  meter = min(1, (A^2 - 1) / 2).
//   Proposition 1 (optional two-sided form): A- = sum_t p~_t e^{-c_t};
//               TV <= (A / A- - A- / A) / 2.
//   Tier A (Theorem 2, Lemma 1): c_t = sm_scale * sum_b ||q_b|| w_{t,b}, w the band-norm witness.
//   Tier B (Lemma 2, subtractive dither): u_t = sqrt(2 sigma_t^2 log(2 S / delta_loc)),
//               sigma_t^2 = sm_scale^2 sum_c q_c^2 s_{c,t}^2 / 12, delta_loc = delta_req / (L H T).
//   Value side: ||y - y^|| <= 2 TV max_t ||v_t|| + sum_t p~_t rho_t.
//
// Everything is evaluated in the log domain: A is carried as log A = LSE_t(s~_t + c_t) -
// LSE_t(s~_t); an overflow of A gives meter 1, and c is never truncated. Like the attention
// output, A is a softmax-weighted average, so per-split partial values merge under the same LSE
// weights (MeterState::merge).
// Thread safety: pure functions and plain values.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace certkv::gate {

// Theorem 1 from log A (log A >= 0 up to rounding): min(1, (e^{2 log A} - 1) / 2), evaluated
// without overflow (log A = +inf gives 1). A negative log A (rounding) gives 0.
double meter_from_log_a(double log_a);
// The same function of A, from A - 1 (what decode attention accumulates): (A^2 - 1) / 2 =
// (A - 1)(A + 1) / 2 without a logarithm or an exponential; NaN gives 1, A - 1 <= 0 gives 0.
double meter_from_a_minus_1(double a_minus_1);

// Proposition 1 from log A and log A-: min(1, (A / A- - A- / A) / 2).
double meter_two_sided_from_logs(double log_a, double log_a_minus);

// Softmax-weighted log-domain accumulator of one query row over a set of tokens:
//   m, l:   running max and sum of e^{s~_t - m}          (the softmax normaliser)
//   mc, lc: running max and sum of e^{s~_t + c_t - mc}   (the numerator of A)
//   rho:    sum_t e^{s~_t - m} rho_t                      (value-side numerator, scaled like l)
//   v_norm_max: max_t ||v_t|| (an upper bound on it)
// log A = (mc + log lc) - (m + log l). Merging two states of disjoint token sets is exact.
struct MeterState {
  double m = -std::numeric_limits<double>::infinity();
  double l = 0;
  double mc = -std::numeric_limits<double>::infinity();
  double lc = 0;
  double rho = 0;
  double v_norm_max = 0;

  // Adds one token with compressed logit s, logit bound c >= 0 and value error bound rho_t.
  void add(double s, double c, double rho_t, double v_norm);
  // Adds the tokens of another state (another split of the same row).
  void merge(const MeterState& other);
  double log_a() const;        // +inf when c overflowed; 0 for an empty state
  double meter() const { return meter_from_log_a(log_a()); }
  // sum_t p~_t rho_t
  double value_rho() const;
  // Value-side output bound 2 meter max ||v|| + sum p~ rho.
  double output_error_bound() const;
};

// Exact total variation (1/2) sum |p_t - q_t| between the softmax of two logit vectors, computed
// in double. s, s_tilde: [n].
double softmax_tv(const double* s, const double* s_tilde, int64_t n);

// Tier A: c_t = sm_scale * sum_b q_band_norm[b] * witness[b]. witness as float.
double tier_a_bound(const double* q_band_norm, const float* witness, int n_bands, double sm_scale);

// Tier B radius u_t = sqrt(2 sigma2 log(2 S / delta_loc)); sigma2 = sigma_t^2 as above.
double tier_b_radius(double sigma2, int64_t n_tokens, double delta_loc);

// delta_loc = delta_req / (n_layers * n_heads * n_steps). REQUIRES: 0 < delta_req < 1, counts >= 1.
double local_delta(double delta_req, int n_layers, int n_heads, int64_t n_steps);

}  // namespace certkv::gate
