// The C API's meter of one attention row (docs/meter.md): the engine's double-precision
// reference (attention::meter_logit_bound_ref, gate::MeterState) applied to keys a front end
// holds, for checking and studying the bounds outside a cache.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "api/api_status.h"
#include "attention/decode_attention.h"
#include "certkv/certkv.h"
#include "codec/lossy_page.h"
#include "gate/meter.h"

using certkv::api::guarded;
using certkv::api::set_error;
using certkv::codec::LossyPageSpec;
using certkv::codec::RopePairing;

namespace {

bool parse_rope_layout(const char* name, RopePairing* pairing) {
  return name != nullptr && certkv::codec::parse_rope_pairing(name, pairing);
}

bool all_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// The checks both tiers share; fails with a message naming the function and the argument.
certkv_status check_row(const char* where, const float* q, const float* k, const float* k_hat,
                        int64_t n_tokens, int32_t head_dim, const char* rope_layout, double sm_scale,
                        certkv_meter_row* out, RopePairing* pairing) {
  const std::string w = where;
  CERTKV_REQUIRE(q && k && k_hat && out, w + ": null argument");
  CERTKV_REQUIRE(n_tokens >= 1, w + ": n_tokens " + std::to_string(n_tokens) + " is below 1");
  CERTKV_REQUIRE(head_dim >= 2 && head_dim % 2 == 0,
                 w + ": head_dim " + std::to_string(head_dim) + " is not a positive even number");
  CERTKV_REQUIRE(parse_rope_layout(rope_layout, pairing),
                 w + ": rope_layout '" + (rope_layout ? rope_layout : "(null)") +
                     "' is not interleaved or half-split");
  CERTKV_REQUIRE(std::isfinite(sm_scale), w + ": sm_scale is not finite");
  const size_t n = size_t(n_tokens) * size_t(head_dim);
  CERTKV_REQUIRE(all_finite(q, size_t(head_dim)), w + ": q has a non-finite value");
  CERTKV_REQUIRE(all_finite(k, n), w + ": k has a non-finite value");
  CERTKV_REQUIRE(all_finite(k_hat, n), w + ": k_hat has a non-finite value");
  return CERTKV_OK;
}

// Theorem 1 over the row, the exact total variation beside it. token_bounds(t) gives the float
// bounds of token t that meter_logit_bound_ref reads.
template <typename TokenBounds>
void meter_row(const LossyPageSpec& spec, const float* q, const float* k, const float* k_hat,
               int64_t n_tokens, double sm_scale, double delta_loc, TokenBounds token_bounds,
               double* bounds, certkv_meter_row* out) {
  const int d = spec.head_dim;
  std::vector<double> s(static_cast<size_t>(n_tokens)), s_hat(static_cast<size_t>(n_tokens));
  certkv::gate::MeterState state;
  double max_bound = 0;
  for (int64_t t = 0; t < n_tokens; ++t) {
    double dot = 0, dot_hat = 0;
    for (int c = 0; c < d; ++c) {
      dot += double(q[c]) * double(k[size_t(t) * size_t(d) + size_t(c)]);
      dot_hat += double(q[c]) * double(k_hat[size_t(t) * size_t(d) + size_t(c)]);
    }
    s[size_t(t)] = sm_scale * dot;
    s_hat[size_t(t)] = sm_scale * dot_hat;
    const double c_t = certkv::attention::meter_logit_bound_ref(spec, q, sm_scale, token_bounds(t),
                                                                n_tokens, delta_loc);
    if (bounds) bounds[t] = c_t;
    max_bound = std::max(max_bound, c_t);
    state.add(s_hat[size_t(t)], c_t, 0.0, 0.0);
  }
  out->meter = state.meter();
  out->log_a = state.log_a();
  out->tv = certkv::gate::softmax_tv(s.data(), s_hat.data(), n_tokens);
  out->max_bound = max_bound;
}

}  // namespace

extern "C" {

certkv_status certkv_meter_tier_a(const float* q, const float* k, const float* k_hat,
                                  int64_t n_tokens, int32_t head_dim, const char* rope_layout,
                                  double sm_scale, double* bounds, certkv_meter_row* out) {
  RopePairing pairing;
  if (const certkv_status s = check_row("certkv_meter_tier_a", q, k, k_hat, n_tokens, head_dim,
                                        rope_layout, sm_scale, out, &pairing);
      s != CERTKV_OK)
    return s;
  return guarded([&] {
    LossyPageSpec spec;
    spec.scheme = certkv::codec::LossyScheme::kRtn8;  // any Tier A scheme: the bound is the same
    spec.head_dim = head_dim;
    spec.pairing = pairing;
    const int d = head_dim;
    const int n_bands = certkv::codec::witness_bands(d);
    std::vector<float> witness(static_cast<size_t>(n_bands));
    // w_{t,b} = ||k_hat_t - k_t|| over band b's RoPE pairs, rounded up to float as a stored
    // witness is rounded up, so that c_t stays a bound.
    auto token_witness = [&](int64_t t) {
      std::vector<double> sum_sq(static_cast<size_t>(n_bands), 0.0);
      for (int pair = 0; pair < d / 2; ++pair)
        for (int which = 0; which < 2; ++which) {
          const size_t i = size_t(t) * size_t(d) +
                           size_t(certkv::codec::rope_pair_channel(pairing, d, pair, which));
          const double r = double(k_hat[i]) - double(k[i]);
          sum_sq[size_t(certkv::codec::witness_band_of_pair(d, pair))] += r * r;
        }
      for (int b = 0; b < n_bands; ++b) {
        const double norm = std::sqrt(sum_sq[size_t(b)]);
        float w = float(norm);
        if (double(w) < norm) w = std::nextafter(w, INFINITY);
        witness[size_t(b)] = w;
      }
      return witness.data();
    };
    meter_row(spec, q, k, k_hat, n_tokens, sm_scale, 0.0, token_witness, bounds, out);
  });
}

certkv_status certkv_meter_tier_b(const float* q, const float* k, const float* k_hat,
                                  const float* scales, int64_t n_tokens, int32_t head_dim,
                                  const char* rope_layout, const uint16_t* outlier_pairs,
                                  int32_t n_outlier_pairs, double sm_scale, double delta_loc,
                                  double* bounds, certkv_meter_row* out) {
  RopePairing pairing;
  if (const certkv_status s = check_row("certkv_meter_tier_b", q, k, k_hat, n_tokens, head_dim,
                                        rope_layout, sm_scale, out, &pairing);
      s != CERTKV_OK)
    return s;
  CERTKV_REQUIRE(scales != nullptr, "certkv_meter_tier_b: null scales");
  CERTKV_REQUIRE(n_outlier_pairs >= 0 && (outlier_pairs != nullptr || n_outlier_pairs == 0),
                 "certkv_meter_tier_b: null outlier_pairs or a negative n_outlier_pairs");
  CERTKV_REQUIRE(delta_loc > 0 && delta_loc < 1, "certkv_meter_tier_b: delta_loc " +
                                                     std::to_string(delta_loc) + " is not in (0, 1)");
  const size_t groups = size_t(head_dim) / certkv::codec::kQuantGroup;
  for (size_t i = 0; i < size_t(n_tokens) * groups; ++i)
    CERTKV_REQUIRE(std::isfinite(scales[i]) && scales[i] >= 0,
                   "certkv_meter_tier_b: scales[" + std::to_string(i) + "] is negative or not finite");
  return guarded([&] {
    LossyPageSpec spec;
    spec.scheme = certkv::codec::LossyScheme::kDither8;
    spec.head_dim = head_dim;
    spec.pairing = pairing;
    spec.n_outlier_pairs = n_outlier_pairs;
    spec.outlier_pairs = outlier_pairs;
    // head_dim a multiple of 32 and at most 256; outlier pairs increasing and in range.
    certkv::codec::validate_lossy_page_spec(spec);
    auto token_scales = [&](int64_t t) { return scales + size_t(t) * groups; };
    meter_row(spec, q, k, k_hat, n_tokens, sm_scale, delta_loc, token_scales, bounds, out);
  });
}

}  // extern "C"
