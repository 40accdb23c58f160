#include "index/rabitq.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

// Rows of Gaussian values: [n][dim] with entry (t, i) = scale * N(0, 1) + offset[i].
std::vector<float> gaussian_rows(int64_t n, int dim, uint64_t seed, float scale,
                                 const std::vector<float>& offset) {
  std::vector<float> x(static_cast<size_t>(n) * dim);
  for (int64_t t = 0; t < n; ++t) {
    for (int i = 0; i < dim; ++i) {
      x[t * dim + i] =
          scale * static_cast<float>(counter_standard_normal(seed, t * dim + i)) + offset[i];
    }
  }
  return x;
}

std::vector<float> centroid(int dim, uint64_t seed, float scale) {
  return gaussian_rows(1, dim, seed, scale, std::vector<float>(dim, 0.0f));
}

double dot(const float* a, const float* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// True <q_c, k_c> in double. REQUIRES: q != c_q, k != c_k.
double centered_cosine(const float* q, const float* k, const RabitqHead& head) {
  const int d = head.dim();
  double qq = 0.0, kk = 0.0, qk = 0.0;
  for (int i = 0; i < d; ++i) {
    const double a = static_cast<double>(q[i]) - head.c_q()[i];
    const double b = static_cast<double>(k[i]) - head.c_k()[i];
    qq += a * a;
    kk += b * b;
    qk += a * b;
  }
  return qk / std::sqrt(qq * kk);
}

// Encodes keys and scores one query with both paths; returns the popcount scores and checks that
// the _ref scores agree to float summation rounding (gamma_D on the normalized part).
template <int D>
std::vector<float> score_both_paths(const RabitqHead& head, const std::vector<float>& keys,
                                    const float* q, uint64_t rounding_seed) {
  const int64_t n = static_cast<int64_t>(keys.size()) / D;
  std::vector<RabitqRecord<D>> records(n);
  rabitq_encode_keys<D>(head, keys.data(), n, records.data());
  const RabitqQuery<D> query = rabitq_quantize_query<D>(head, q, rounding_seed);
  std::vector<float> ref(n), pop(n);
  rabitq_estimate_scores_ref<D>(head, query, records.data(), n, ref.data());
  rabitq_estimate_scores_popcount<D>(head, query, records.data(), n, pop.data());
  float q_bar_max = 0.0f;
  for (int i = 0; i < D; ++i) {
    q_bar_max = std::max(q_bar_max, std::abs(query.delta * query.q_u[i] + query.q_l));
  }
  for (int64_t t = 0; t < n; ++t) {
    // Both sum D terms of size <= q_bar_max / sqrt(D) before dividing by alpha.
    const double scale = query.norm_q_centered * records[t].norm_k_centered * q_bar_max *
                         std::sqrt(static_cast<double>(D)) / records[t].alpha;
    const double offsets = std::abs(query.q_dot_ck) + std::abs(records[t].cq_dot_k) +
                           std::abs(head.cq_dot_ck());
    EXPECT_NEAR(ref[t], pop[t], 2.0 * D * FLT_EPSILON * scale + 4.0 * FLT_EPSILON * offsets)
        << "D " << D << " token " << t << " of " << n;
  }
  return pop;
}

template <int D>
void check_ref_matches_popcount(RotationKind kind) {
  for (int64_t n : {1, 3, 17, 129, 501}) {
    const RabitqHead head(centroid(D, 11, 0.5f), centroid(D, 12, 2.0f), Rotation(kind, D, 3));
    const std::vector<float> keys = gaussian_rows(n, D, 100 + n, 1.0f, head.c_k());
    const std::vector<float> q = gaussian_rows(1, D, 200 + n, 1.5f, head.c_q());
    score_both_paths<D>(head, keys, q.data(), n);
  }
}

TEST(Rabitq, RefAndPopcountAgreeOnRaggedTokenCounts) {
  check_ref_matches_popcount<32>(RotationKind::kHaar);
  check_ref_matches_popcount<64>(RotationKind::kHaar);
  check_ref_matches_popcount<96>(RotationKind::kHaar);
  check_ref_matches_popcount<128>(RotationKind::kHaar);
  check_ref_matches_popcount<256>(RotationKind::kHaar);
  check_ref_matches_popcount<32>(RotationKind::kRandomizedHadamard);
  check_ref_matches_popcount<64>(RotationKind::kRandomizedHadamard);
  check_ref_matches_popcount<128>(RotationKind::kRandomizedHadamard);
  check_ref_matches_popcount<256>(RotationKind::kRandomizedHadamard);
}

template <int D>
void check_record_matches_definition(RotationKind kind) {
  const RabitqHead head(centroid(D, 21, 1.0f), centroid(D, 22, 1.0f), Rotation(kind, D, 8));
  const int64_t n = 17;
  const std::vector<float> keys = gaussian_rows(n, D, 23, 3.0f, head.c_k());
  std::vector<RabitqRecord<D>> records(n);
  rabitq_encode_keys<D>(head, keys.data(), n, records.data());
  for (int64_t t = 0; t < n; ++t) {
    const float* k = &keys[t * D];
    double norm2 = 0.0;
    for (int i = 0; i < D; ++i) norm2 += (k[i] - head.c_k()[i]) * (k[i] - head.c_k()[i]);
    std::vector<float> k_c(D), rotated(D);
    for (int i = 0; i < D; ++i) k_c[i] = static_cast<float>((k[i] - head.c_k()[i]) / std::sqrt(norm2));
    head.rotation().rotate(k_c.data(), rotated.data());
    double alpha = 0.0;
    int ones = 0;
    for (int i = 0; i < D; ++i) {
      const bool bit = (records[t].code[i / 64] >> (i % 64)) & 1;
      EXPECT_EQ(bit, rotated[i] >= 0.0f) << "D " << D << " token " << t << " coordinate " << i;
      alpha += (bit ? 1.0 : -1.0) * rotated[i] / std::sqrt(static_cast<double>(D));
      ones += bit;
    }
    for (int i = D; i < 64 * RabitqRecord<D>::kWords; ++i) {
      EXPECT_EQ((records[t].code[i / 64] >> (i % 64)) & 1, 0u) << "padding bit " << i;
    }
    EXPECT_EQ(records[t].code_popcount, ones);
    EXPECT_NEAR(records[t].alpha, alpha, 1e-6);
    EXPECT_GE(records[t].alpha, 1.0 / std::sqrt(static_cast<double>(D)) - 1e-6);
    EXPECT_LE(records[t].alpha, 1.0 + 1e-6);
    EXPECT_NEAR(records[t].norm_k_centered, std::sqrt(norm2), 1e-5 * std::sqrt(norm2));
    EXPECT_NEAR(records[t].cq_dot_k, dot(head.c_q().data(), k, D), 1e-4);
  }
}

TEST(Rabitq, RecordMatchesDefinition) {
  check_record_matches_definition<32>(RotationKind::kHaar);
  check_record_matches_definition<96>(RotationKind::kHaar);
  check_record_matches_definition<128>(RotationKind::kRandomizedHadamard);
  check_record_matches_definition<256>(RotationKind::kHaar);
}

TEST(Rabitq, QueryQuantizationMatchesDefinitionAndIsUnbiased) {
  constexpr int D = 64;
  const RabitqHead head(centroid(D, 31, 1.0f), centroid(D, 32, 1.0f),
                        Rotation(RotationKind::kHaar, D, 9));
  const std::vector<float> q = gaussian_rows(1, D, 33, 2.0f, head.c_q());
  std::vector<float> q_c(D), q_prime(D);
  double norm2 = 0.0;
  for (int i = 0; i < D; ++i) norm2 += (q[i] - head.c_q()[i]) * (q[i] - head.c_q()[i]);
  for (int i = 0; i < D; ++i) q_c[i] = static_cast<float>((q[i] - head.c_q()[i]) / std::sqrt(norm2));
  head.rotation().rotate(q_c.data(), q_prime.data());

  const int n_seeds = 4000;
  std::vector<double> mean_q_bar(D, 0.0);
  float delta = 0.0f;
  for (int s = 0; s < n_seeds; ++s) {
    const RabitqQuery<D> query = rabitq_quantize_query<D>(head, q.data(), s);
    delta = query.delta;
    int32_t sum = 0;
    for (int i = 0; i < D; ++i) {
      const double x = (q_prime[i] - query.q_l) / query.delta;
      ASSERT_GE(query.q_u[i], std::floor(x - 1e-4));
      ASSERT_LE(query.q_u[i], std::ceil(x + 1e-4));
      ASSERT_LE(query.q_u[i], kRabitqQueryLevels);
      int from_planes = 0;
      for (int b = 0; b < kRabitqQueryBits; ++b) {
        from_planes |= static_cast<int>((query.bit_planes[b][i / 64] >> (i % 64)) & 1) << b;
      }
      ASSERT_EQ(from_planes, query.q_u[i]);
      sum += query.q_u[i];
      mean_q_bar[i] += (query.delta * query.q_u[i] + query.q_l) / n_seeds;
    }
    ASSERT_EQ(sum, query.sum_q_u);
  }
  // Randomized rounding: per coordinate the rounding error is in [-delta, delta] with variance
  // <= delta^2 / 4, so the mean over n seeds is within 5 * (delta / 2) / sqrt(n) of q'.
  int off = 0;
  for (int i = 0; i < D; ++i) off += std::abs(mean_q_bar[i] - q_prime[i]) > 2.5 * delta / std::sqrt(n_seeds);
  EXPECT_EQ(off, 0);
}

// Unbiasedness over the rotation (Theorem A.1) and the rounding. Per draw, the error of
// est<q_c, k_c> has variance sigma^2 <= [(pi/2 - 1)(1 - rho^2) + pi R^2 / (8 * 15^2)] / (D - 1):
// the first term from <k_bar, e_1> / <k_bar, k_c> with <k_bar, k_c> ~ sqrt(2/pi) and
// Var<k_bar, e_1> = (1 - <k_bar, k_c>^2)/(D - 1); the second from randomized rounding
// (Var <= delta^2 / 4, delta = range / 15, range of q' <= R / sqrt(D) with R = 6, divided by
// alpha^2 ~ 2/pi). With R = 6 the bracket is <= 0.634, so sigma <= C / sqrt(D - 1), C = 0.80, and
// the mean over n rotations lies within 5 C / sqrt((D - 1) n) of the truth.
template <int D>
void check_unbiased(int n_rotations) {
  constexpr double kC = 0.80;
  // q and k unit and uncentered (c_q = c_k = 0), so each score is est<q_c, k_c> itself.
  std::vector<float> q(D, 0.0f), k(D, 0.0f);
  const std::vector<float> g = gaussian_rows(2, D, 41, 1.0f, std::vector<float>(D, 0.0f));
  double gq = std::sqrt(dot(g.data(), g.data(), D));
  for (int i = 0; i < D; ++i) q[i] = static_cast<float>(g[i] / gq);
  // k = rho q + sqrt(1 - rho^2) u, u the unit part of g[1] orthogonal to q.
  const double rho = 0.6;
  std::vector<double> u(D);
  const double proj = dot(&g[D], q.data(), D);
  for (int i = 0; i < D; ++i) u[i] = g[D + i] - proj * q[i];
  double un = 0.0;
  for (double v : u) un += v * v;
  for (int i = 0; i < D; ++i) k[i] = static_cast<float>(rho * q[i] + std::sqrt(1 - rho * rho) * u[i] / std::sqrt(un));

  double sum = 0.0, sum2 = 0.0, sum_uncorrected = 0.0;
  double truth = 0.0;
  for (int s = 0; s < n_rotations; ++s) {
    const RabitqHead head(std::vector<float>(D, 0.0f), std::vector<float>(D, 0.0f),
                          Rotation(RotationKind::kHaar, D, 70000 + s));
    truth = centered_cosine(q.data(), k.data(), head);
    RabitqRecord<D> record;
    rabitq_encode_keys<D>(head, k.data(), 1, &record);
    const RabitqQuery<D> query = rabitq_quantize_query<D>(head, q.data(), 90000 + s);
    float est = 0.0f;
    rabitq_estimate_scores_popcount<D>(head, query, &record, 1, &est);
    sum += est;
    sum2 += static_cast<double>(est) * est;
    sum_uncorrected += est * record.alpha;  // <c_bar, q_bar> without the division by alpha
  }
  const double mean = sum / n_rotations;
  const double sd = std::sqrt(sum2 / n_rotations - mean * mean);
  const double tolerance = 5.0 * kC / std::sqrt((D - 1.0) * n_rotations);
  std::printf("[unbiased] D=%d n=%d truth=%.4f mean=%.5f |bias|=%.5f tol=%.5f sd*sqrt(D-1)=%.3f "
              "uncorrected mean=%.4f\n",
              D, n_rotations, truth, mean, std::abs(mean - truth), tolerance,
              sd * std::sqrt(D - 1.0), sum_uncorrected / n_rotations);
  EXPECT_NEAR(mean, truth, tolerance) << "D " << D;
  EXPECT_LE(sd, kC / std::sqrt(D - 1.0)) << "D " << D;
  EXPECT_GE(sd, 0.9 * std::sqrt((M_PI / 2 - 1) * (1 - rho * rho) / (D - 1.0))) << "D " << D;
  // The estimator without the alpha correction is biased (mean ~ sqrt(2/pi) rho): the same
  // tolerance must reject it, so this test can fail.
  EXPECT_GT(std::abs(sum_uncorrected / n_rotations - truth), tolerance) << "D " << D;
}

TEST(Rabitq, UnbiasedOverRotations) {
  check_unbiased<32>(4000);
  check_unbiased<64>(4000);
}

struct ErrorStats {
  double rms = 0.0;
  double max_abs = 0.0;
  double mean = 0.0;
};

// Error of est<q_c, k_c> (the score error divided by ||q - c_q|| ||k - c_k||) over all tokens and
// queries. keys: [n][D], queries: [m][D].
template <int D>
ErrorStats measure_error(const RabitqHead& head, const std::vector<float>& keys,
                         const std::vector<float>& queries) {
  const int64_t n = static_cast<int64_t>(keys.size()) / D;
  const int64_t m = static_cast<int64_t>(queries.size()) / D;
  ErrorStats stats;
  double sum = 0.0, sum2 = 0.0;
  for (int64_t j = 0; j < m; ++j) {
    const float* q = &queries[j * D];
    const std::vector<float> scores = score_both_paths<D>(head, keys, q, 500 + j);
    for (int64_t t = 0; t < n; ++t) {
      const float* k = &keys[t * D];
      double qn = 0.0, kn = 0.0;
      for (int i = 0; i < D; ++i) {
        qn += (q[i] - head.c_q()[i]) * (q[i] - static_cast<double>(head.c_q()[i]));
        kn += (k[i] - head.c_k()[i]) * (k[i] - static_cast<double>(head.c_k()[i]));
      }
      const double e = (scores[t] - dot(q, k, D)) / std::sqrt(qn * kn);
      sum += e;
      sum2 += e * e;
      stats.max_abs = std::max(stats.max_abs, std::abs(e));
    }
  }
  stats.mean = sum / (n * m);
  stats.rms = std::sqrt(sum2 / (n * m));
  return stats;
}

enum class Shape { kGaussian, kOutlierChannels, kSparseInteger };

const char* shape_name(Shape s) {
  switch (s) {
    case Shape::kGaussian:
      return "gaussian";
    case Shape::kOutlierChannels:
      return "outlier-channels";
    case Shape::kSparseInteger:
      return "sparse-integer";
  }
  return "?";
}

// Keys [n][D] and queries [m][D] around nonzero centroids.
template <int D>
void make_vectors(Shape shape, const RabitqHead& head, int64_t n, int64_t m, std::vector<float>* keys,
                  std::vector<float>* queries) {
  *keys = gaussian_rows(n, D, 601, 1.0f, head.c_k());
  *queries = gaussian_rows(m, D, 602, 1.0f, head.c_q());
  if (shape == Shape::kOutlierChannels) {
    // A few channels 20x larger than the rest, as in RoPE'd LLM keys.
    for (int64_t t = 0; t < n; ++t) {
      for (int i : {1, 5, D / 2 + 3}) (*keys)[t * D + i] = 20.0f * ((*keys)[t * D + i] - head.c_k()[i]) + head.c_k()[i];
    }
  } else if (shape == Shape::kSparseInteger) {
    // Integer-valued keys with three nonzero centered coordinates each.
    for (int64_t t = 0; t < n; ++t) {
      for (int i = 0; i < D; ++i) (*keys)[t * D + i] = head.c_k()[i];
      const uint64_t r = counter_random_u64(603, t);
      for (int j = 0; j < 3; ++j) {
        (*keys)[t * D + static_cast<int>((r >> (16 * j)) % D)] += static_cast<float>(1 + j);
      }
    }
  }
}

template <int D>
ErrorStats error_for(Shape shape, RotationKind kind) {
  const RabitqHead head(centroid(D, 51, 1.0f), centroid(D, 52, 1.0f), Rotation(kind, D, 53));
  std::vector<float> keys, queries;
  make_vectors<D>(shape, head, 1000, 8, &keys, &queries);
  const ErrorStats s = measure_error<D>(head, keys, queries);
  std::printf("[error] %-19s %-16s D=%3d rms=%.4f rms*sqrt(D)=%.3f max=%.4f mean=%+.5f\n",
              rotation_kind_name(kind), shape_name(shape), D, s.rms,
              s.rms * std::sqrt(static_cast<double>(D)), s.max_abs, s.mean);
  return s;
}

// Theorem A.1's O(1/sqrt(D)): rms * sqrt(D) stays near sqrt(pi/2 - 1) ~ 0.76 (rho ~ 0 here) for
// every D, shape and rotation, so the rms halves from D = 64 to D = 256.
TEST(Rabitq, ErrorScalesAsInverseSqrtD) {
  for (RotationKind kind : {RotationKind::kHaar, RotationKind::kRandomizedHadamard}) {
    for (Shape shape : {Shape::kGaussian, Shape::kOutlierChannels, Shape::kSparseInteger}) {
      const ErrorStats e64 = error_for<64>(shape, kind);
      const ErrorStats e128 = error_for<128>(shape, kind);
      const ErrorStats e256 = error_for<256>(shape, kind);
      for (const auto& [d, s] : {std::pair{64, e64}, std::pair{128, e128}, std::pair{256, e256}}) {
        const double scaled = s.rms * std::sqrt(static_cast<double>(d));
        EXPECT_GT(scaled, 0.6) << shape_name(shape) << " D " << d;
        EXPECT_LT(scaled, 0.9) << shape_name(shape) << " D " << d;
        EXPECT_LT(s.max_abs, 6.0 * 0.8 / std::sqrt(d - 1.0)) << shape_name(shape) << " D " << d;
      }
      EXPECT_NEAR(e64.rms / e256.rms, 2.0, 0.3) << shape_name(shape);
    }
  }
}

// rabitq_logit_deviation_scale's sigma_t = ||q - c_q|| ||k - c_k|| / sqrt(D - 1) (scale 1) is at
// least the spread of the estimate: over a Haar rotation's tokens and queries the errors beyond
// 1.5 and 2 sigma_t are no more frequent than a normal distribution's of standard deviation
// sigma_t (13.4% and 4.6%) would make them.
template <int D>
void check_deviation_covers_error() {
  const RabitqHead head(centroid(D, 71, 1.0f), centroid(D, 72, 1.0f), Rotation(RotationKind::kHaar, D, 73));
  const int64_t n = 1000, m = 8;
  const std::vector<float> keys = gaussian_rows(n, D, 74, 1.0f, head.c_k());
  const std::vector<float> queries = gaussian_rows(m, D, 75, 1.0f, head.c_q());
  std::vector<RabitqRecord<D>> records(n);
  rabitq_encode_keys<D>(head, keys.data(), n, records.data());
  int64_t beyond_15 = 0, beyond_2 = 0;
  for (int64_t j = 0; j < m; ++j) {
    const float* q = &queries[j * D];
    const RabitqQuery<D> query = rabitq_quantize_query<D>(head, q, 900 + j);
    std::vector<float> scores(n);
    rabitq_estimate_scores_popcount<D>(head, query, records.data(), n, scores.data());
    const float per_norm = rabitq_logit_deviation_scale(1.0, 1.0f, query.norm_q_centered, D);
    for (int64_t t = 0; t < n; ++t) {
      const double sigma = double(per_norm) * records[t].norm_k_centered;
      const double e = std::abs(scores[t] - dot(q, &keys[t * D], D));
      beyond_15 += e > 1.5 * sigma;
      beyond_2 += e > 2.0 * sigma;
    }
  }
  const double f15 = double(beyond_15) / double(n * m), f2 = double(beyond_2) / double(n * m);
  std::printf("[deviation] D=%d errors beyond 1.5 sigma_t %.4f, beyond 2 sigma_t %.4f\n", D, f15, f2);
  EXPECT_LT(f15, 0.134) << "D " << D;
  EXPECT_LT(f2, 0.046) << "D " << D;
}

TEST(Rabitq, DeviationScaleCoversTheEstimatorError) {
  check_deviation_covers_error<64>();
  check_deviation_covers_error<128>();
  // The value: z * scale * ||q - c_q|| / sqrt(D - 1), in double, rounded once.
  EXPECT_EQ(rabitq_logit_deviation_scale(1.5, 0.125f, 2.0f, 128), float(1.5 * 0.125 * 2.0 / std::sqrt(127.0)));
  EXPECT_EQ(rabitq_logit_deviation_scale(0.0, 0.125f, 2.0f, 128), 0.0f);
  EXPECT_EQ(rabitq_logit_deviation_scale(2.0, 0.125f, 0.0f, 64), 0.0f);  // q at its centroid
  for (double z : {-1.0, double(NAN), double(INFINITY)})
    EXPECT_THROW(rabitq_logit_deviation_scale(z, 0.125f, 2.0f, 128), Error) << z;
  EXPECT_THROW(rabitq_logit_deviation_scale(1.0, 0.125f, 2.0f, 1), Error);
  EXPECT_THROW(rabitq_logit_deviation_scale(1e41, 0.125f, 2.0f, 128), Error);  // past the float range
}

// The popcount estimate is the unfused float sequence the CUDA estimate computes
// (attention/cuda/sparse_decode_cuda.cu, __fmul_rn / __fadd_rn in this order), bit for bit: a
// fused multiply-add on either side would move theta and the selected sets apart. Each step here
// goes through a volatile so that this file's compiler cannot fuse it either.
template <int D>
void check_estimate_is_unfused() {
  const RabitqHead head(centroid(D, 81, 1.0f), centroid(D, 82, 1.0f), Rotation(RotationKind::kHaar, D, 83));
  const int64_t n = 777;
  const std::vector<float> keys = gaussian_rows(n, D, 84, 1.0f, head.c_k());
  const std::vector<float> q = gaussian_rows(1, D, 85, 1.5f, head.c_q());
  std::vector<RabitqRecord<D>> records(n);
  rabitq_encode_keys<D>(head, keys.data(), n, records.data());
  const RabitqQuery<D> query = rabitq_quantize_query<D>(head, q.data(), 86);
  std::vector<float> scores(n);
  rabitq_estimate_scores_popcount<D>(head, query, records.data(), n, scores.data());
  volatile float neg_delta_sum = -query.delta * float(query.sum_q_u);
  volatile float d_q_l = float(D) * query.q_l;
  const float query_term = neg_delta_sum - d_q_l;
  const float two_delta = 2.0f * query.delta, two_q_l = 2.0f * query.q_l;
  const float norm_over_sqrt_d = query.norm_q_centered / std::sqrt(float(D));
  const float bias = query.q_dot_ck - head.cq_dot_ck();
  for (int64_t t = 0; t < n; ++t) {
    const RabitqRecord<D>& r = records[t];
    int32_t cb_dot_qu = 0;
    for (int bit = 0; bit < kRabitqQueryBits; ++bit) {
      int32_t count = 0;
      for (int w = 0; w < RabitqRecord<D>::kWords; ++w) count += __builtin_popcountll(r.code[w] & query.bit_planes[bit][w]);
      cb_dot_qu += count << bit;
    }
    volatile float a = two_delta * float(cb_dot_qu);
    volatile float c = two_q_l * float(r.code_popcount);
    volatile float ac = a + c;
    volatile float c_prime = ac + query_term;
    volatile float na = norm_over_sqrt_d * r.norm_k_centered;
    volatile float nac = na * c_prime;
    volatile float product = nac / r.alpha;
    volatile float with_bias = product + bias;
    const float want = with_bias + r.cq_dot_k;
    ASSERT_EQ(std::memcmp(&scores[t], &want, sizeof(float)), 0)
        << "D " << D << " token " << t << ": " << scores[t] << " against " << want;
  }
}

TEST(Rabitq, PopcountEstimateIsTheUnfusedFloatSequence) {
  check_estimate_is_unfused<64>();
  check_estimate_is_unfused<128>();
}

TEST(Rabitq, RecordsDoNotDependOnBatch) {
  constexpr int D = 128;
  const RabitqHead head(centroid(D, 61, 1.0f), centroid(D, 62, 1.0f),
                        Rotation(RotationKind::kRandomizedHadamard, D, 63));
  const int64_t n = 501;
  const std::vector<float> keys = gaussian_rows(n, D, 64, 1.0f, head.c_k());
  std::vector<RabitqRecord<D>> all(n);
  rabitq_encode_keys<D>(head, keys.data(), n, all.data());
  for (int64_t t : {0, 1, 2, 16, 128, 500}) {
    RabitqRecord<D> one;
    rabitq_encode_keys<D>(head, &keys[t * D], 1, &one);
    EXPECT_EQ(std::memcmp(&one, &all[t], sizeof(one)), 0) << "token " << t;
  }
}

TEST(Rabitq, KeyAtCentroidScoresExactly) {
  constexpr int D = 64;
  const RabitqHead head(centroid(D, 71, 1.0f), centroid(D, 72, 1.0f),
                        Rotation(RotationKind::kHaar, D, 73));
  std::vector<float> keys = gaussian_rows(3, D, 74, 1.0f, head.c_k());
  for (int i = 0; i < D; ++i) keys[D + i] = head.c_k()[i];  // token 1: k == c_k
  std::vector<RabitqRecord<D>> records(3);
  rabitq_encode_keys<D>(head, keys.data(), 3, records.data());
  EXPECT_EQ(records[1].norm_k_centered, 0.0f);
  EXPECT_EQ(records[1].alpha, 1.0f);
  EXPECT_EQ(records[1].code_popcount, 0);
  const std::vector<float> q = gaussian_rows(1, D, 75, 2.0f, head.c_q());
  const std::vector<float> scores = score_both_paths<D>(head, keys, q.data(), 1);
  const double truth = dot(q.data(), &keys[D], D);
  EXPECT_NEAR(scores[1], truth, 1e-5 * (1.0 + std::abs(truth)));
  EXPECT_TRUE(std::isfinite(scores[0]) && std::isfinite(scores[2]));
}

TEST(Rabitq, QueryAtCentroidAndZeroQuery) {
  constexpr int D = 96;
  const RabitqHead head(centroid(D, 81, 1.0f), centroid(D, 82, 1.0f),
                        Rotation(RotationKind::kHaar, D, 83));
  const int64_t n = 17;
  const std::vector<float> keys = gaussian_rows(n, D, 84, 1.0f, head.c_k());
  // q == c_q: the product term vanishes and Eq. 6 is exact.
  const std::vector<float> scores = score_both_paths<D>(head, keys, head.c_q().data(), 2);
  for (int64_t t = 0; t < n; ++t) {
    const double truth = dot(head.c_q().data(), &keys[t * D], D);
    EXPECT_NEAR(scores[t], truth, 1e-5 * (1.0 + std::abs(truth))) << "token " << t;
  }
  // q = 0 with c_q = 0 scores every token 0.
  const RabitqHead zero_head(std::vector<float>(D, 0.0f), head.c_k(), head.rotation());
  const std::vector<float> zero_q(D, 0.0f);
  for (float s : score_both_paths<D>(zero_head, keys, zero_q.data(), 3)) EXPECT_EQ(s, 0.0f);
  // q = 0 with c_q != 0 is an ordinary query: its error stays within the sigma bound.
  const std::vector<float> zero_scores = score_both_paths<D>(head, keys, zero_q.data(), 4);
  for (int64_t t = 0; t < n; ++t) {
    const double truth = 0.0;
    double qn = 0.0, kn = 0.0;
    for (int i = 0; i < D; ++i) {
      qn += head.c_q()[i] * static_cast<double>(head.c_q()[i]);
      kn += (keys[t * D + i] - head.c_k()[i]) * static_cast<double>(keys[t * D + i] - head.c_k()[i]);
    }
    EXPECT_LT(std::abs(zero_scores[t] - truth) / std::sqrt(qn * kn), 6.0 * 0.8 / std::sqrt(D - 1.0));
  }
}

TEST(Rabitq, BadInputIsAnError) {
  constexpr int D = 64;
  const Rotation rot(RotationKind::kHaar, D, 1);
  const std::vector<float> c(D, 0.0f);
  EXPECT_THROW(RabitqHead(std::vector<float>(D - 1, 0.0f), c, rot), Error);
  EXPECT_THROW(RabitqHead(c, std::vector<float>(D + 1, 0.0f), rot), Error);
  std::vector<float> bad = c;
  bad[5] = NAN;
  EXPECT_THROW(RabitqHead(bad, c, rot), Error);
  EXPECT_THROW(RabitqHead(c, bad, rot), Error);

  const RabitqHead head(c, c, rot);
  const std::vector<float> keys = gaussian_rows(3, D, 91, 1.0f, c);
  std::vector<RabitqRecord<D>> records(3);
  std::vector<RabitqRecord<128>> wrong_dim(3);
  EXPECT_THROW(rabitq_encode_keys<128>(head, keys.data(), 1, wrong_dim.data()), Error);
  EXPECT_THROW(rabitq_encode_keys<D>(head, keys.data(), -1, records.data()), Error);
  EXPECT_THROW(rabitq_encode_keys<D>(head, nullptr, 3, records.data()), Error);
  EXPECT_THROW(rabitq_encode_keys<D>(head, keys.data(), 3, nullptr), Error);
  EXPECT_NO_THROW(rabitq_encode_keys<D>(head, nullptr, 0, nullptr));
  std::vector<float> nan_keys = keys;
  nan_keys[D + 7] = INFINITY;
  try {
    rabitq_encode_keys<D>(head, nan_keys.data(), 3, records.data());
    FAIL() << "expected certkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("token 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rabitq_quantize_query<D>(head, nullptr, 0), Error);
  EXPECT_THROW(rabitq_quantize_query<D>(head, bad.data(), 0), Error);
  EXPECT_THROW(rabitq_quantize_query<128>(head, keys.data(), 0), Error);
  rabitq_encode_keys<D>(head, keys.data(), 3, records.data());
  const RabitqQuery<D> query = rabitq_quantize_query<D>(head, keys.data(), 0);
  std::vector<float> scores(3);
  EXPECT_THROW(rabitq_estimate_scores_ref<D>(head, query, records.data(), -2, scores.data()), Error);
  EXPECT_THROW(rabitq_estimate_scores_popcount<D>(head, query, nullptr, 3, scores.data()), Error);
  EXPECT_THROW(rabitq_estimate_scores_popcount<D>(head, query, records.data(), 3, nullptr), Error);
}

TEST(Rabitq, BytesPerToken) {
  EXPECT_EQ(rabitq_bytes_per_token<64>(), 64u / 8 + 16);
  EXPECT_EQ(rabitq_bytes_per_token<128>(), 128u / 8 + 16);
  EXPECT_EQ(rabitq_bytes_per_token<256>(), 256u / 8 + 16);
}

}  // namespace
}  // namespace certkv::index
