// The double-precision meter and true-TV references of decode_attention.h.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/online_softmax.h"
#include "core/status.h"
#include "gate/meter.h"

namespace certkv::attention {

namespace {

using cache::KvTensor;

// Scores scale * <q, k_t> in double. k: [n][d].
void scores_ref(const float* q, const float* k, int64_t n, int d, double scale, double* s) {
  for (int64_t t = 0; t < n; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double(q[c]) * double(k[size_t(t) * size_t(d) + c]);
    s[t] = scale * dot;
  }
}

}  // namespace

double meter_logit_bound_ref(const codec::LossyPageSpec& spec, const float* q, double scale,
                             const float* bounds, int64_t n_ctx, double delta_loc) {
  const int d = spec.head_dim;
  if (codec::lossy_scheme_is_tier_b(spec.scheme)) {
    std::vector<bool> outlier(size_t(d), false);
    for (int i = 0; i < spec.n_outlier_pairs; ++i)
      for (int which = 0; which < 2; ++which)
        outlier[size_t(codec::rope_pair_channel(spec.pairing, d, spec.outlier_pairs[i], which))] = true;
    double sigma2 = 0, slack = 0;
    for (int c = 0; c < d; ++c) {
      if (outlier[size_t(c)]) continue;
      const double s_c = bounds[c / codec::kQuantGroup];
      sigma2 += scale * scale * double(q[c]) * q[c] * s_c * s_c / 12.0;
      slack += std::fabs(scale) * std::fabs(double(q[c])) * s_c * codec::kDither8Slack;
    }
    return gate::tier_b_radius(sigma2, n_ctx, delta_loc) + slack;
  }
  if (spec.witness == codec::WitnessCode::kExponent) {
    // A band per channel: c_t = |scale| sum_c |q_c| u_{t,c} (codec::WitnessCode::kExponent).
    std::vector<double> q_abs(static_cast<size_t>(d));
    for (int c = 0; c < d; ++c) q_abs[size_t(c)] = std::fabs(double(q[c]));
    return gate::tier_a_bound(q_abs.data(), bounds, d, std::fabs(scale));
  }
  const int n_bands = codec::witness_bands(d);
  std::vector<double> q_band(size_t(n_bands), 0.0);
  for (int j = 0; j < d / 2; ++j)
    for (int which = 0; which < 2; ++which) {
      const double x = q[codec::rope_pair_channel(spec.pairing, d, j, which)];
      q_band[size_t(codec::witness_band_of_pair(d, j))] += x * x;
    }
  for (double& b : q_band) b = std::sqrt(b);
  return gate::tier_a_bound(q_band.data(), bounds, n_bands, std::fabs(scale));
}

void decode_meter_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                      const AttentionShape& shape, const float* q, int64_t n_ctx,
                      const MeterOptions& options, HeadMeter* meters,
                      std::vector<double>* block_contributions) {
  validate_decode("decode_meter_ref", cache, seq, layer, shape, q, n_ctx, meters);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int bt = cache.block_tokens();
  const int64_t n_blocks = (n_ctx + bt - 1) / bt;
  if (block_contributions) block_contributions->assign(size_t(shape.n_q_heads) * size_t(n_blocks), 0.0);
  const bool lossy = cache::kv_scheme_is_lossy(cache.scheme());
  if (!lossy) {
    for (int h = 0; h < shape.n_q_heads; ++h) meters[h] = HeadMeter{};
    return;
  }
  std::vector<float> k(size_t(n_ctx) * size_t(d)), v(size_t(n_ctx) * size_t(d));
  std::vector<double> s(static_cast<size_t>(n_ctx)), c(static_cast<size_t>(n_ctx));
  std::vector<float> rho(static_cast<size_t>(n_ctx));
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    const detail::TableReader k_table = detail::table_reader(cache, seq, layer, KvTensor::kKey, kv_head);
    const detail::TableReader v_table = detail::table_reader(cache, seq, layer, KvTensor::kValue, kv_head);
    const codec::LossyPageSpec& spec = *k_table.lossy;
    const int width = detail::key_bound_width(spec);
    std::vector<float> bounds(size_t(n_ctx) * size_t(width));
    detail::load_error_data(k_table, 0, n_ctx, bounds.data(), size_t(n_ctx));  // [width][n_ctx]
    detail::load_error_data(v_table, 0, n_ctx, rho.data(), size_t(n_ctx));
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kValue, kv_head, 0, n_ctx, v.data());
    // max_t ||v_t|| over the exact values (the backing store for lossy pages).
    std::vector<float> v_exact(v.size());
    cache.read_token_range_exact(seq, layer, KvTensor::kValue, kv_head, 0, n_ctx, v_exact.data());
    double v_norm_max = 0;
    for (int64_t t = 0; t < n_ctx; ++t) {
      double sq = 0;
      for (int e = 0; e < d; ++e) sq += double(v_exact[size_t(t) * size_t(d) + e]) * v_exact[size_t(t) * size_t(d) + e];
      v_norm_max = std::max(v_norm_max, std::sqrt(sq));
    }
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const float* qh = q + size_t(h) * size_t(d);
      scores_ref(qh, k.data(), n_ctx, d, double(shape.scale), s.data());
      gate::MeterState state;
      std::vector<float> token_bounds(static_cast<size_t>(width));
      for (int64_t t = 0; t < n_ctx; ++t) {
        for (int b = 0; b < width; ++b) token_bounds[size_t(b)] = bounds[size_t(b) * size_t(n_ctx) + size_t(t)];
        c[size_t(t)] = meter_logit_bound_ref(spec, qh, double(shape.scale), token_bounds.data(), n_ctx,
                                       options.delta_loc);
        const double vn = 0;  // max ||v|| is taken over all tokens below
        state.add(s[size_t(t)], c[size_t(t)], double(rho[size_t(t)]), vn);
      }
      state.v_norm_max = v_norm_max;
      HeadMeter& hm = meters[h];
      hm.log_a = state.log_a();
      hm.meter = state.meter();
      hm.value_rho = state.value_rho();
      hm.v_norm_max = v_norm_max;
      hm.output_bound = state.output_error_bound();
      if (block_contributions) {
        const double s_max = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (int64_t t = 0; t < n_ctx; ++t) z += std::exp(s[size_t(t)] - s_max);
        double* out = &(*block_contributions)[size_t(h) * size_t(n_blocks)];
        for (int64_t t = 0; t < n_ctx; ++t)
          out[t / bt] += std::exp(s[size_t(t)] - s_max) / z * std::expm1(c[size_t(t)]);
      }
    }
  }
}

void decode_true_tv_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                        const AttentionShape& shape, const float* q, int64_t n_ctx, double* tv) {
  validate_decode("decode_true_tv_ref", cache, seq, layer, shape, q, n_ctx, tv);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  std::vector<float> k(size_t(n_ctx) * size_t(d)), k_hat(size_t(n_ctx) * size_t(d));
  std::vector<double> s(static_cast<size_t>(n_ctx)), s_hat(static_cast<size_t>(n_ctx));
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    cache.read_token_range_exact(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k_hat.data());
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const float* qh = q + size_t(h) * size_t(d);
      scores_ref(qh, k.data(), n_ctx, d, double(shape.scale), s.data());
      scores_ref(qh, k_hat.data(), n_ctx, d, double(shape.scale), s_hat.data());
      tv[h] = gate::softmax_tv(s.data(), s_hat.data(), n_ctx);
    }
  }
}

}  // namespace certkv::attention
