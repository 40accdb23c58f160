#include "index/top_p.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

// Checks the REQUIRES of both selections; returns the largest logit.
float validate_and_max(const float* logits, int64_t n, double p, const uint8_t* mask) {
  if (n < 1) fail(StatusCode::kInvalidArgument, "top_p: n must be >= 1, got " + std::to_string(n));
  if (logits == nullptr) fail(StatusCode::kInvalidArgument, "top_p: logits is null");
  if (mask == nullptr) fail(StatusCode::kInvalidArgument, "top_p: mask is null");
  if (!(p > 0.0 && p <= 1.0)) {
    fail(StatusCode::kInvalidArgument, "top_p: p must be in (0, 1], got " + std::to_string(p));
  }
  // One branch-free pass (it vectorizes); the first non-finite logit is looked up only on error.
  float l_max = logits[0];
  bool finite = true;
  for (int64_t t = 0; t < n; ++t) {
    finite &= std::fabs(logits[t]) <= std::numeric_limits<float>::max();
    l_max = std::max(l_max, logits[t]);
  }
  if (!finite) {
    for (int64_t t = 0; t < n; ++t)
      if (!std::isfinite(logits[t]))
        fail(StatusCode::kInvalidArgument, "top_p: logits[" + std::to_string(t) + "] is not finite");
  }
  return l_max;
}

// U(a) and L(a) of top_p.h at s = 63, computed once.
std::vector<uint64_t> make_bucket_weights() {
  std::vector<uint64_t> w(2 * size_t(kTopPBuckets));
  const double steps = kTopPGapStepsPerLogit;
  const double gap_low = 1.0 - std::ldexp(1.0, -23), gap_high = 1.0 + std::ldexp(1.0, -23);
  const double exp_low = 1.0 - std::ldexp(1.0, -50), exp_high = 1.0 + std::ldexp(1.0, -50);
  for (int a = 0; a <= kTopPGapCap; ++a) {
    // a (1 -+ 2^-23) / 256 and (a + 1) (1 -+ 2^-23) / 256 are exact in double (at most 38 bits).
    const double upper = std::ldexp(std::exp(-double(a) * gap_low / steps) * exp_high, 63);
    w[size_t(a)] = static_cast<uint64_t>(std::ceil(upper));
    const double lower = std::ldexp(std::exp(-double(a + 1) * gap_high / steps) * exp_low, 63);
    w[size_t(kTopPBuckets + a)] = a == kTopPGapCap ? 0 : static_cast<uint64_t>(std::floor(lower));
  }
  return w;
}

const std::vector<uint64_t>& bucket_weights() {
  static const std::vector<uint64_t> w = make_bucket_weights();
  return w;
}

TopPSelection finish(float l_max, int bucket, uint64_t lower, uint64_t upper, int64_t n_selected,
                     int64_t n_boundary) {
  TopPSelection s;
  s.threshold = top_p_bucket_threshold(l_max, bucket);
  s.bucket = bucket;
  s.n_selected = n_selected;
  s.mass = top_p_mass(lower, lower + upper);
  s.n_boundary = n_boundary;
  return s;
}

}  // namespace

const std::vector<uint64_t>& top_p_bucket_weights() { return bucket_weights(); }

uint64_t top_p_target_units(double p, uint64_t Z) {
  if (!(p > 0.0 && p <= 1.0)) fail(StatusCode::kInvalidArgument, "top_p_target_units: p must be in (0, 1]");
  return top_p_target(p, Z);
}

TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask) {
  const float l_max = validate_and_max(logits, n, p, mask);
  const std::vector<uint64_t>& w = bucket_weights();
  const int k = top_p_weight_shift(n);
  std::vector<int> a(static_cast<size_t>(n));
  uint64_t upper = 0;  // the weight of the tokens not yet taken, from above
  for (int64_t t = 0; t < n; ++t) {
    a[size_t(t)] = top_p_gap_bucket(logits[t], l_max);
    upper += top_p_upper_weight(w[size_t(a[size_t(t)])], k);
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a[size_t(x)] < a[size_t(y)]; });

  // Whole buckets from the top until the taken ones certainly hold mass p (the last bucket
  // always passes: nothing is left above zero).
  uint64_t lower = 0;
  size_t taken = 0;
  int bucket = 0;
  int64_t in_bucket = 0;
  while (true) {
    bucket = a[size_t(order[taken])];
    in_bucket = 0;
    for (; taken < order.size() && a[size_t(order[taken])] == bucket; ++taken, ++in_bucket) {
      lower += top_p_lower_weight(w[size_t(kTopPBuckets + bucket)], k);
      upper -= top_p_upper_weight(w[size_t(bucket)], k);
    }
    if (top_p_reaches(lower, upper, p)) break;
  }
  const TopPSelection s = finish(l_max, bucket, lower, upper, int64_t(taken), in_bucket);
  for (int64_t t = 0; t < n; ++t) mask[t] = logits[t] >= s.threshold ? 1 : 0;
  return s;
}

TopPSelection top_p_select(const float* logits, int64_t n, double p, uint8_t* mask) {
  const float l_max = validate_and_max(logits, n, p, mask);
  const std::vector<uint64_t>& w = bucket_weights();
  const int k = top_p_weight_shift(n);
  // Pass 1: each token's bucket, and the histogram.
  thread_local std::vector<int64_t> count;
  thread_local std::vector<uint16_t> gap;
  count.assign(size_t(kTopPBuckets), 0);
  gap.resize(size_t(n));
  for (int64_t t = 0; t < n; ++t) gap[size_t(t)] = static_cast<uint16_t>(top_p_gap_bucket(logits[t], l_max));
  int last = 0;
  for (int64_t t = 0; t < n; ++t) {
    ++count[gap[size_t(t)]];
    last = std::max<int>(last, gap[size_t(t)]);
  }
  // The scan: the upper weight of every token, then buckets taken from the top.
  uint64_t upper = 0;
  for (int a = 0; a <= last; ++a) upper += uint64_t(count[size_t(a)]) * top_p_upper_weight(w[size_t(a)], k);
  uint64_t lower = 0;
  int64_t n_selected = 0;
  int bucket = 0;
  for (;; ++bucket) {
    const uint64_t c = uint64_t(count[size_t(bucket)]);
    if (c == 0) continue;  // bucket 0 holds l_max, and `last` always passes
    lower += c * top_p_lower_weight(w[size_t(kTopPBuckets + bucket)], k);
    upper -= c * top_p_upper_weight(w[size_t(bucket)], k);
    n_selected += int64_t(c);
    if (top_p_reaches(lower, upper, p)) break;
  }
  // Pass 2: the mask.
  for (int64_t t = 0; t < n; ++t) mask[t] = gap[size_t(t)] <= bucket ? 1 : 0;
  return finish(l_max, bucket, lower, upper, n_selected, count[size_t(bucket)]);
}

int64_t top_p_widen(const float* logits, int64_t n, float theta, float margin_scale, const float* norms,
                    int64_t norm_stride, uint8_t* mask) {
  if (n < 0) fail(StatusCode::kInvalidArgument, "top_p_widen: n must be >= 0, got " + std::to_string(n));
  if (!(margin_scale >= 0.0f) || !std::isfinite(margin_scale))
    fail(StatusCode::kInvalidArgument,
         "top_p_widen: margin_scale must be finite and >= 0, got " + std::to_string(margin_scale));
  if (norm_stride < 1)
    fail(StatusCode::kInvalidArgument, "top_p_widen: norm_stride must be >= 1, got " + std::to_string(norm_stride));
  if (n == 0 || margin_scale == 0.0f) return 0;
  if (logits == nullptr || norms == nullptr || mask == nullptr)
    fail(StatusCode::kInvalidArgument, "top_p_widen: logits, norms and mask must be non-null");
  int64_t added = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (mask[t]) continue;
    const float margin = margin_scale * norms[t * norm_stride];
    if (logits[t] + margin >= theta) {
      mask[t] = 1;
      ++added;
    }
  }
  return added;
}

}  // namespace certkv::index
