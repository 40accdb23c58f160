#include "index/rabitq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "core/status.h"

namespace certkv::index {
namespace {

template <int D>
void check_head(const RabitqHead& head, const char* where) {
  if (head.dim() != D) {
    fail(StatusCode::kInvalidArgument, std::string(where) + ": head dim " +
                                           std::to_string(head.dim()) + " != template D " +
                                           std::to_string(D));
  }
}

void check_tokens(int64_t n_tokens, const void* in, const void* out, const char* where) {
  if (n_tokens < 0) {
    fail(StatusCode::kInvalidArgument,
         std::string(where) + ": n_tokens must be >= 0, got " + std::to_string(n_tokens));
  }
  if (n_tokens > 0 && (in == nullptr || out == nullptr)) {
    fail(StatusCode::kInvalidArgument, std::string(where) + ": null input or output buffer");
  }
}

double dot(const float* a, const float* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Eq. 6: <q, k> = ||q - c_q|| ||k - c_k|| <q_c, k_c> + <q, c_k> + <c_q, k> - <c_q, c_k>.
template <int D>
float eq6_score(const RabitqHead& head, const RabitqQuery<D>& query, const RabitqRecord<D>& record,
                float est_qc_dot_kc) {
  return query.norm_q_centered * record.norm_k_centered * est_qc_dot_kc + query.q_dot_ck +
         record.cq_dot_k - head.cq_dot_ck();
}

}  // namespace

RabitqHead::RabitqHead(std::vector<float> c_q, std::vector<float> c_k, Rotation rotation)
    : c_q_(std::move(c_q)), c_k_(std::move(c_k)), rotation_(std::move(rotation)) {
  const size_t d = static_cast<size_t>(rotation_.dim());
  if (c_q_.size() != d) {
    fail(StatusCode::kInvalidArgument, "RabitqHead: c_q has " + std::to_string(c_q_.size()) +
                                           " values, rotation dim is " + std::to_string(d));
  }
  if (c_k_.size() != d) {
    fail(StatusCode::kInvalidArgument, "RabitqHead: c_k has " + std::to_string(c_k_.size()) +
                                           " values, rotation dim is " + std::to_string(d));
  }
  for (size_t i = 0; i < d; ++i) {
    if (!std::isfinite(c_q_[i])) fail(StatusCode::kInvalidArgument, "RabitqHead: c_q is not finite");
    if (!std::isfinite(c_k_[i])) fail(StatusCode::kInvalidArgument, "RabitqHead: c_k is not finite");
  }
  cq_dot_ck_ = static_cast<float>(dot(c_q_.data(), c_k_.data(), rotation_.dim()));
}

void rabitq_add_query_sums(const float* q, int64_t n, int n_heads, int n_kv_heads, int dim, double* sums) {
  const int group = n_heads / n_kv_heads;
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < n_heads; ++h)
      for (int i = 0; i < dim; ++i)
        sums[size_t(h / group) * size_t(dim) + size_t(i)] += q[(size_t(t) * size_t(n_heads) + size_t(h)) * size_t(dim) + size_t(i)];
}

template <int D>
void rabitq_encode_keys(const RabitqHead& head, const float* k, int64_t n_tokens,
                        RabitqRecord<D>* records) {
  check_head<D>(head, "rabitq_encode_keys");
  check_tokens(n_tokens, k, records, "rabitq_encode_keys");
  const float* c_k = head.c_k().data();
  const float* c_q = head.c_q().data();
  float k_c[D];
  float rotated[D];  // P^T k_c
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* k_t = k + t * D;
    RabitqRecord<D>& r = records[t];
    double norm2 = 0.0;
    for (int i = 0; i < D; ++i) {
      if (!std::isfinite(k_t[i])) {
        fail(StatusCode::kInvalidArgument,
             "rabitq_encode_keys: key of token " + std::to_string(t) + " is not finite");
      }
      const double centered = static_cast<double>(k_t[i]) - c_k[i];
      norm2 += centered * centered;
    }
    const double norm = std::sqrt(norm2);
    std::memset(r.code, 0, sizeof(r.code));
    r.norm_k_centered = static_cast<float>(norm);
    r.cq_dot_k = static_cast<float>(dot(c_q, k_t, D));
    if (r.norm_k_centered == 0.0f) {
      r.alpha = 1.0f;
      r.code_popcount = 0;
      continue;
    }
    for (int i = 0; i < D; ++i) {
      k_c[i] = static_cast<float>((static_cast<double>(k_t[i]) - c_k[i]) / norm);
    }
    head.rotation().rotate(k_c, rotated);
    // alpha = <c_bar, P^T k_c> = sum_i |(P^T k_c)_i| / sqrt(D) >= 1/sqrt(D) for a unit k_c.
    double abs_sum = 0.0;
    int popcount = 0;
    for (int i = 0; i < D; ++i) {
      if (rotated[i] >= 0.0f) {
        r.code[i / 64] |= uint64_t{1} << (i % 64);
        ++popcount;
      }
      abs_sum += std::abs(static_cast<double>(rotated[i]));
    }
    r.alpha = static_cast<float>(abs_sum / std::sqrt(static_cast<double>(D)));
    r.code_popcount = popcount;
  }
}

template <int D>
RabitqQuery<D> rabitq_quantize_query(const RabitqHead& head, const float* q, uint64_t rounding_seed) {
  check_head<D>(head, "rabitq_quantize_query");
  if (q == nullptr) fail(StatusCode::kInvalidArgument, "rabitq_quantize_query: null q");
  const float* c_q = head.c_q().data();
  RabitqQuery<D> query;
  std::memset(&query, 0, sizeof(query));
  double norm2 = 0.0;
  for (int i = 0; i < D; ++i) {
    if (!std::isfinite(q[i])) {
      fail(StatusCode::kInvalidArgument, "rabitq_quantize_query: q is not finite");
    }
    const double centered = static_cast<double>(q[i]) - c_q[i];
    norm2 += centered * centered;
  }
  const double norm = std::sqrt(norm2);
  query.norm_q_centered = static_cast<float>(norm);
  query.q_dot_ck = static_cast<float>(dot(q, head.c_k().data(), D));
  if (query.norm_q_centered == 0.0f) return query;

  float q_c[D];
  float q_prime[D];  // q' = P^T q_c
  for (int i = 0; i < D; ++i) q_c[i] = static_cast<float>((static_cast<double>(q[i]) - c_q[i]) / norm);
  head.rotation().rotate(q_c, q_prime);
  const float q_l = *std::min_element(q_prime, q_prime + D);
  const float q_r = *std::max_element(q_prime, q_prime + D);
  const float delta = (q_r - q_l) / static_cast<float>(kRabitqQueryLevels);
  query.q_l = q_l;
  query.delta = delta;
  int32_t sum_q_u = 0;
  for (int i = 0; i < D; ++i) {
    int level = 0;
    if (delta > 0.0f) {
      // Randomized rounding: floor(x + u), u ~ U(0, 1), so E[q_u] = (q' - q_l) / delta.
      const double x = (static_cast<double>(q_prime[i]) - q_l) / delta;
      level = static_cast<int>(std::floor(x + counter_uniform(rounding_seed, i)));
      level = std::clamp(level, 0, kRabitqQueryLevels);
    }
    query.q_u[i] = static_cast<uint8_t>(level);
    sum_q_u += level;
    for (int b = 0; b < kRabitqQueryBits; ++b) {
      if ((level >> b) & 1) query.bit_planes[b][i / 64] |= uint64_t{1} << (i % 64);
    }
  }
  query.sum_q_u = sum_q_u;
  return query;
}

template <int D>
void rabitq_estimate_scores_ref(const RabitqHead& head, const RabitqQuery<D>& query,
                                const RabitqRecord<D>* records, int64_t n_tokens, float* scores) {
  check_head<D>(head, "rabitq_estimate_scores_ref");
  check_tokens(n_tokens, records, scores, "rabitq_estimate_scores_ref");
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  float q_bar[D];
  for (int i = 0; i < D; ++i) q_bar[i] = query.delta * query.q_u[i] + query.q_l;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const RabitqRecord<D>& r = records[t];
    float c_bar_dot_q_bar = 0.0f;
    for (int i = 0; i < D; ++i) {
      const bool bit = (r.code[i / 64] >> (i % 64)) & 1;
      c_bar_dot_q_bar += (bit ? inv_sqrt_d : -inv_sqrt_d) * q_bar[i];
    }
    scores[t] = eq6_score(head, query, r, c_bar_dot_q_bar / r.alpha);
  }
}

template <int D>
void rabitq_estimate_scores_popcount(const RabitqHead& head, const RabitqQuery<D>& query,
                                     const RabitqRecord<D>* records, int64_t n_tokens,
                                     float* scores) {
  check_head<D>(head, "rabitq_estimate_scores_popcount");
  check_tokens(n_tokens, records, scores, "rabitq_estimate_scores_popcount");
  constexpr int kWords = RabitqRecord<D>::kWords;
  const float sqrt_d = std::sqrt(static_cast<float>(D));
  // Per-query constants of Eq. 20: -delta sum_i q_u[i] - D q_l.
  const float query_term = -query.delta * static_cast<float>(query.sum_q_u) -
                           static_cast<float>(D) * query.q_l;
  // Eq. 6 with the per-query terms hoisted: score = a_t * <c', q_bar> + b + <c_q, k>, with
  // a_t = ||q - c_q|| ||k - c_k|| / (sqrt(D) alpha) and b = <q, c_k> - <c_q, c_k>.
  const float b = query.q_dot_ck - head.cq_dot_ck();
  const float two_delta = 2.0f * query.delta;
  const float two_q_l = 2.0f * query.q_l;
  const float norm_over_sqrt_d = query.norm_q_centered / sqrt_d;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const RabitqRecord<D>& r = records[t];
    int32_t cb_dot_qu = 0;  // <c_b, q_u> over the bit planes of q_u
    for (int bit = 0; bit < kRabitqQueryBits; ++bit) {
      int32_t plane_count = 0;
      for (int w = 0; w < kWords; ++w) {
        plane_count += __builtin_popcountll(r.code[w] & query.bit_planes[bit][w]);
      }
      cb_dot_qu += plane_count << bit;
    }
    // Eq. 20: <c', q_bar> = 2 delta <c_b, q_u> + 2 q_l sum c_b - delta sum q_u - D q_l,
    // c' = sqrt(D) c_bar, so <c_bar, q_bar> / alpha = <c', q_bar> / (sqrt(D) alpha).
    const float c_prime_dot_q_bar = two_delta * static_cast<float>(cb_dot_qu) +
                                    two_q_l * static_cast<float>(r.code_popcount) + query_term;
    scores[t] = norm_over_sqrt_d * r.norm_k_centered * c_prime_dot_q_bar / r.alpha + b + r.cq_dot_k;
  }
}

#define CERTKV_INSTANTIATE_RABITQ(D)                                                            \
  template void rabitq_encode_keys<D>(const RabitqHead&, const float*, int64_t,                 \
                                      RabitqRecord<D>*);                                        \
  template RabitqQuery<D> rabitq_quantize_query<D>(const RabitqHead&, const float*, uint64_t);  \
  template void rabitq_estimate_scores_ref<D>(const RabitqHead&, const RabitqQuery<D>&,         \
                                              const RabitqRecord<D>*, int64_t, float*);         \
  template void rabitq_estimate_scores_popcount<D>(const RabitqHead&, const RabitqQuery<D>&,    \
                                                   const RabitqRecord<D>*, int64_t, float*);

CERTKV_INSTANTIATE_RABITQ(32)
CERTKV_INSTANTIATE_RABITQ(64)
CERTKV_INSTANTIATE_RABITQ(96)
CERTKV_INSTANTIATE_RABITQ(128)
CERTKV_INSTANTIATE_RABITQ(256)

#undef CERTKV_INSTANTIATE_RABITQ

float rabitq_logit_deviation_scale(double deviations, float scale, float norm_q_centered, int head_dim) {
  if (head_dim < 2)
    fail(StatusCode::kInvalidArgument, "rabitq_logit_deviation_scale: head_dim must be >= 2, got " +
                                           std::to_string(head_dim));
  if (!(deviations >= 0) || !std::isfinite(deviations))
    fail(StatusCode::kInvalidArgument, "rabitq_logit_deviation_scale: deviations must be finite and >= 0, got " +
                                           std::to_string(deviations));
  const double factor = deviations * double(scale) * double(norm_q_centered) / std::sqrt(double(head_dim - 1));
  if (!(factor <= double(std::numeric_limits<float>::max())))
    fail(StatusCode::kInvalidArgument, "rabitq_logit_deviation_scale: deviations " + std::to_string(deviations) +
                                           " give a margin past the float range");
  return float(factor);
}

}  // namespace certkv::index
