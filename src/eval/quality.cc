#include "eval/quality.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/status.h"

namespace certkv::eval {
namespace {

constexpr int kTopK = 5;
// A KL below zero by less than this is double rounding of a zero divergence.
constexpr double kKlRoundingFloor = 1e-12;

void check_finite(const float* logits, int n_vocab, const char* name) {
  if (logits == nullptr) fail(StatusCode::kInvalidArgument, std::string(name) + " logits are null");
  for (int i = 0; i < n_vocab; ++i)
    if (!std::isfinite(logits[i]))
      fail(StatusCode::kInvalidArgument,
           std::string(name) + " logit " + std::to_string(i) + " is not finite (" + std::to_string(logits[i]) + ")");
}

// Indices of the k largest logits, by decreasing logit, ties to the lowest index.
std::vector<int> top_k(const float* logits, int n_vocab, int k) {
  std::vector<int> index(static_cast<size_t>(n_vocab));
  std::iota(index.begin(), index.end(), 0);
  std::partial_sort(index.begin(), index.begin() + k, index.end(), [logits](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  index.resize(size_t(k));
  return index;
}

// log sum_i e^{x_i - max}, and the max.
struct ShiftedLse {
  double max;
  double log_z;
};

ShiftedLse shifted_lse(const float* x, int n) {
  double max = x[0];
  for (int i = 1; i < n; ++i) max = std::max(max, double(x[i]));
  double z = 0;
  for (int i = 0; i < n; ++i) z += std::exp(double(x[i]) - max);
  return {max, std::log(z)};
}

}  // namespace

PositionQuality compare_logits(const float* ref, const float* test, int n_vocab) {
  if (n_vocab < 1) fail(StatusCode::kInvalidArgument, "n_vocab must be >= 1, got " + std::to_string(n_vocab));
  check_finite(ref, n_vocab, "ref");
  check_finite(test, n_vocab, "test");

  // KL(p || q) = sum_i p_i (log p_i - log q_i), log p_i = r_i - max r - log Z_r.
  const ShiftedLse lr = shifted_lse(ref, n_vocab);
  const ShiftedLse lt = shifted_lse(test, n_vocab);
  double kl = 0;
  for (int i = 0; i < n_vocab; ++i) {
    const double log_p = double(ref[i]) - lr.max - lr.log_z;
    const double log_q = double(test[i]) - lt.max - lt.log_z;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  if (kl < 0 && kl > -kKlRoundingFloor) kl = 0;

  const int k = std::min(kTopK, n_vocab);
  const std::vector<int> top_ref = top_k(ref, n_vocab, k);
  const std::vector<int> top_test = top_k(test, n_vocab, k);
  int shared = 0;
  for (int i : top_ref) shared += int(std::find(top_test.begin(), top_test.end(), i) != top_test.end());

  PositionQuality q;
  q.kl = kl;
  q.top1_agree = top_ref[0] == top_test[0];
  q.top5_overlap = double(shared) / double(k);
  return q;
}

double sorted_quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) fail(StatusCode::kInvalidArgument, "quantile of an empty set");
  if (!(q >= 0 && q <= 1)) fail(StatusCode::kInvalidArgument, "quantile level must be in [0, 1], got " + std::to_string(q));
  const double h = double(sorted.size() - 1) * q;
  const size_t lo = size_t(std::floor(h));
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (h - double(lo)) * (sorted[lo + 1] - sorted[lo]);
}

void QualityAccumulator::add(const PositionQuality& q) {
  if (!(std::isfinite(q.kl) && q.kl >= 0))
    fail(StatusCode::kInvalidArgument, "PositionQuality.kl must be finite and >= 0, got " + std::to_string(q.kl));
  if (!(q.top5_overlap >= 0 && q.top5_overlap <= 1))
    fail(StatusCode::kInvalidArgument,
         "PositionQuality.top5_overlap must be in [0, 1], got " + std::to_string(q.top5_overlap));
  positions_.push_back(q);
}

QualitySummary QualityAccumulator::summary() const {
  QualitySummary s;
  s.n_positions = int64_t(positions_.size());
  if (positions_.empty()) return s;
  std::vector<double> kl;
  kl.reserve(positions_.size());
  double kl_sum = 0, top1_sum = 0, top5_sum = 0;
  for (const PositionQuality& q : positions_) {
    kl.push_back(q.kl);
    kl_sum += q.kl;
    top1_sum += q.top1_agree ? 1.0 : 0.0;
    top5_sum += q.top5_overlap;
  }
  std::sort(kl.begin(), kl.end());
  const double n = double(positions_.size());
  s.mean_kl = kl_sum / n;
  s.max_kl = kl.back();
  s.p99_kl = sorted_quantile(kl, 0.99);
  s.top1 = top1_sum / n;
  s.top5 = top5_sum / n;
  return s;
}

}  // namespace certkv::eval
