#include "gate/meter.h"

#include <algorithm>

#include "core/status.h"

namespace certkv::gate {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// max(a, b), NaN when either is NaN (so that a NaN input never certifies).
double max_keeping_nan(double a, double b) { return (a >= b || std::isnan(a)) ? a : b; }

}  // namespace

double meter_from_log_a(double log_a) {
  if (std::isnan(log_a)) return 1;  // never certify NaN
  if (log_a <= 0) return 0;
  // Theorem 1: (A^2 - 1) / 2 = expm1(2 log A) / 2, which reaches 1 at A^2 = 3.
  const double two_log_a = 2 * log_a;
  if (two_log_a >= std::log(3.0)) return 1;
  return std::min(1.0, 0.5 * std::expm1(two_log_a));
}

double meter_from_a_minus_1(double a_minus_1) {
  if (std::isnan(a_minus_1)) return 1;  // never certify NaN
  if (a_minus_1 <= 0) return 0;
  // (A^2 - 1) / 2 = (A - 1)(A + 1) / 2 = a (2 + a) / 2, which reaches 1 at A^2 = 3.
  return std::min(1.0, 0.5 * a_minus_1 * (2.0 + a_minus_1));
}

double meter_two_sided_from_logs(double log_a, double log_a_minus) {
  // Proposition 1: (A / A- - A- / A) / 2 = sinh(D) with D = log A - log A-.
  const double d = log_a - log_a_minus;
  if (std::isnan(d)) return 1;
  if (d <= 0) return 0;
  if (d >= std::asinh(1.0)) return 1;
  return std::min(1.0, std::sinh(d));
}

void MeterState::add(double s, double c, double rho_t, double v_norm) {
  if (c < 0) fail(StatusCode::kInvalidArgument, "MeterState::add: logit bound c is negative");
  v_norm_max = max_keeping_nan(v_norm_max, v_norm);
  if (s == -kInfinity) return;  // a masked token has no softmax weight

  // Normaliser and value numerator: online softmax in the (m, l) form.
  if (s > m) {
    const double rescale = std::exp(m - s);
    l = l * rescale + 1;
    rho = rho * rescale + rho_t;
    m = s;
  } else {
    const double w = std::exp(s - m);
    l += w;
    rho += w * rho_t;
  }

  // Numerator of A: the same update on s + c. Once s + c overflows, A = +inf and stays so.
  if (mc == kInfinity) return;
  const double x = s + c;
  if (x == kInfinity) {
    mc = kInfinity;
    lc = 1;
  } else if (x > mc) {
    lc = lc * std::exp(mc - x) + 1;
    mc = x;
  } else {
    lc += std::exp(x - mc);
  }
}

void MeterState::merge(const MeterState& other) {
  v_norm_max = max_keeping_nan(v_norm_max, other.v_norm_max);

  // Both sums rescale to the larger running max (LSE merge); an empty side (l == 0) adds nothing.
  if (l == 0) {
    m = other.m;
    l = other.l;
    rho = other.rho;
  } else if (other.l != 0) {
    const double m_new = std::max(m, other.m);
    const double a = std::exp(m - m_new);
    const double b = std::exp(other.m - m_new);
    l = l * a + other.l * b;
    rho = rho * a + other.rho * b;
    m = m_new;
  }

  if (mc == kInfinity) return;
  if (other.mc == kInfinity) {
    mc = kInfinity;
    lc = 1;
  } else if (lc == 0) {
    mc = other.mc;
    lc = other.lc;
  } else if (other.lc != 0) {
    const double mc_new = std::max(mc, other.mc);
    lc = lc * std::exp(mc - mc_new) + other.lc * std::exp(other.mc - mc_new);
    mc = mc_new;
  }
}

double MeterState::log_a() const {
  if (mc == kInfinity) return kInfinity;
  if (l == 0) return 0;
  // log A = (mc + log lc) - (m + log l), grouped so that large logits cancel before rounding.
  return (mc - m) + std::log(lc / l);
}

double MeterState::value_rho() const { return l == 0 ? 0 : rho / l; }

double MeterState::output_error_bound() const {
  const double bound = 2 * meter() * v_norm_max + value_rho();
  return std::isnan(bound) ? kInfinity : bound;
}

double softmax_tv(const double* s, const double* s_tilde, int64_t n) {
  if (n < 0) fail(StatusCode::kInvalidArgument, "softmax_tv: n is negative");
  if (n == 0) return 0;
  if (s == nullptr || s_tilde == nullptr)
    fail(StatusCode::kInvalidArgument, "softmax_tv: s or s_tilde is null");
  double m = -kInfinity, m_tilde = -kInfinity;
  for (int64_t t = 0; t < n; ++t) {
    m = std::max(m, s[t]);
    m_tilde = std::max(m_tilde, s_tilde[t]);
  }
  if (m == -kInfinity || m_tilde == -kInfinity)
    fail(StatusCode::kInvalidArgument, "softmax_tv: every logit of s or s_tilde is -inf");
  double z = 0, z_tilde = 0;
  for (int64_t t = 0; t < n; ++t) {
    z += std::exp(s[t] - m);
    z_tilde += std::exp(s_tilde[t] - m_tilde);
  }
  double sum_abs = 0;
  for (int64_t t = 0; t < n; ++t)
    sum_abs += std::abs(std::exp(s[t] - m) / z - std::exp(s_tilde[t] - m_tilde) / z_tilde);
  return 0.5 * sum_abs;
}

double tier_a_bound(const double* q_band_norm, const float* witness, int n_bands, double sm_scale) {
  if (n_bands < 1) fail(StatusCode::kInvalidArgument, "tier_a_bound: n_bands must be >= 1");
  // Theorem 2 with Lemma 1: Cauchy-Schwarz within each RoPE band.
  double sum = 0;
  for (int b = 0; b < n_bands; ++b) sum += q_band_norm[b] * double(witness[b]);
  return sm_scale * sum;
}

double tier_b_radius(double sigma2, int64_t n_tokens, double delta_loc) {
  if (sigma2 < 0) fail(StatusCode::kInvalidArgument, "tier_b_radius: sigma2 is negative");
  if (n_tokens < 1) fail(StatusCode::kInvalidArgument, "tier_b_radius: n_tokens must be >= 1");
  if (!(delta_loc > 0 && delta_loc < 1))
    fail(StatusCode::kInvalidArgument, "tier_b_radius: delta_loc must lie in (0, 1)");
  // Lemma 2 and a union bound over the S tokens: P(some |eps_t| > u_t) <= delta_loc.
  return std::sqrt(2 * sigma2 * std::log(2 * double(n_tokens) / delta_loc));
}

double local_delta(double delta_req, int n_layers, int n_heads, int64_t n_steps) {
  if (!(delta_req > 0 && delta_req < 1))
    fail(StatusCode::kInvalidArgument, "local_delta: delta_req must lie in (0, 1)");
  if (n_layers < 1) fail(StatusCode::kInvalidArgument, "local_delta: n_layers must be >= 1");
  if (n_heads < 1) fail(StatusCode::kInvalidArgument, "local_delta: n_heads must be >= 1");
  if (n_steps < 1) fail(StatusCode::kInvalidArgument, "local_delta: n_steps must be >= 1");
  return delta_req / (double(n_layers) * double(n_heads) * double(n_steps));
}

}  // namespace certkv::gate
