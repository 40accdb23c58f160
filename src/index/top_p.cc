#include "index/top_p.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

// The masses G / Z are reported through long double: G and Z < 2^64 convert exactly, so the
// quotient rounds monotonically and G >= p * Z implies mass >= p.
static_assert(std::numeric_limits<long double>::digits >= 64,
              "top_p needs a long double with a 64-bit significand");

// Checks the REQUIRES of both entry points; returns the largest logit.
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

// s = 63 - ceil(log2(n)) fraction bits: n weights of at most 2^s sum to at most 2^63.
int weight_fraction_bits(int64_t n) {
  int ceil_log2_n = 0;
  while ((int64_t{1} << ceil_log2_n) < n) ++ceil_log2_n;
  return 63 - ceil_log2_n;
}

// a_t = min(kTopPGapCap, floor(64 (l_max - l_t))), the quantized gap of top_p.h.
int gap_of(float l, float l_max) {
  const float g = (l_max - l) * float(kTopPGapStepsPerLogit);
  return g < float(kTopPGapCap) ? static_cast<int>(g) : kTopPGapCap;
}

// W(a) = max(1, ceil(2^s exp(-a / 64))) for a in [0, kTopPGapCap], for every s in [0, 63]:
// tables[s][a], computed once.
const std::vector<uint64_t>& weight_table(int s) {
  static const std::vector<std::vector<uint64_t>> tables = [] {
    std::vector<std::vector<uint64_t>> t(64);
    for (int bits = 0; bits < 64; ++bits) {
      t[size_t(bits)].resize(size_t(kTopPGapCap) + 1);
      for (int a = 0; a <= kTopPGapCap; ++a) {
        const double scaled =
            std::ldexp(std::exp(-double(a) / double(kTopPGapStepsPerLogit)), bits);
        t[size_t(bits)][size_t(a)] =
            a == kTopPGapCap ? 1 : std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(scaled)));
      }
    }
    return t;
  }();
  return tables[size_t(s)];
}

// T = ceil(p * Z), exactly: p = m * 2^-shift with an integer m < 2^53, m * Z < 2^116.
uint64_t target_units(double p, uint64_t Z) {
  int exponent = 0;
  const double mantissa = std::frexp(p, &exponent);  // p = mantissa * 2^exponent
  const auto m = static_cast<uint64_t>(std::ldexp(mantissa, 53));
  const int shift = 53 - exponent;  // >= 53 since p <= 1
  const unsigned __int128 mZ = static_cast<unsigned __int128>(m) * Z;
  if (shift >= 128) return 1;  // 0 < p * Z < 1
  const unsigned __int128 one = 1;
  const unsigned __int128 T = (mZ >> shift) + ((mZ & ((one << shift) - 1)) != 0 ? 1 : 0);
  return static_cast<uint64_t>(T);
}

double mass_of(uint64_t G, uint64_t Z) {
  return static_cast<double>(static_cast<long double>(G) / static_cast<long double>(Z));
}

}  // namespace

const std::vector<uint64_t>& top_p_weight_table(int64_t n) {
  if (n < 1) fail(StatusCode::kInvalidArgument, "top_p_weight_table: n must be >= 1");
  return weight_table(weight_fraction_bits(n));
}

uint64_t top_p_target_units(double p, uint64_t Z) {
  if (!(p > 0.0 && p <= 1.0)) fail(StatusCode::kInvalidArgument, "top_p_target_units: p must be in (0, 1]");
  return target_units(p, Z);
}

TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask) {
  const float l_max = validate_and_max(logits, n, p, mask);
  const std::vector<uint64_t>& weight = weight_table(weight_fraction_bits(n));
  std::vector<uint64_t> W(static_cast<size_t>(n));
  uint64_t Z = 0;
  for (int64_t t = 0; t < n; ++t) Z += W[t] = weight[size_t(gap_of(logits[t], l_max))];
  const uint64_t T = target_units(p, Z);

  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });

  uint64_t G = 0;
  size_t taken = 0;
  while (G < T) G += W[order[taken++]];  // ends: the whole prefix sums to Z >= T
  const float theta = logits[order[taken - 1]];
  while (taken < order.size() && logits[order[taken]] == theta) G += W[order[taken++]];

  for (int64_t t = 0; t < n; ++t) mask[t] = logits[t] >= theta ? 1 : 0;
  TopPSelection selection;
  selection.threshold = theta;
  selection.n_selected = static_cast<int64_t>(taken);
  selection.mass = mass_of(G, Z);
  return selection;
}

TopPSelection top_p_select(const float* logits, int64_t n, double p, uint8_t* mask) {
  const float l_max = validate_and_max(logits, n, p, mask);
  const std::vector<uint64_t>& weight = weight_table(weight_fraction_bits(n));
  // Pass 1: the gap of every token, and tokens per gap bucket (a bucket weighs its count times
  // W(a)).
  thread_local std::vector<int64_t> count;
  thread_local std::vector<uint16_t> gap;
  count.assign(size_t(kTopPGapCap) + 1, 0);
  gap.resize(size_t(n));
  for (int64_t t = 0; t < n; ++t) gap[size_t(t)] = static_cast<uint16_t>(gap_of(logits[t], l_max));
  for (int64_t t = 0; t < n; ++t) ++count[gap[size_t(t)]];
  uint64_t Z = 0;
  for (int a = 0; a <= kTopPGapCap; ++a) Z += uint64_t(count[size_t(a)]) * weight[size_t(a)];
  const uint64_t T = target_units(p, Z);

  // The boundary bucket: buckets above it hold G_above < T, with it >= T.
  uint64_t G_above = 0;
  int boundary = 0;
  while (G_above + uint64_t(count[size_t(boundary)]) * weight[size_t(boundary)] < T) {
    G_above += uint64_t(count[size_t(boundary)]) * weight[size_t(boundary)];
    ++boundary;
  }
  const uint64_t w = weight[size_t(boundary)];
  const int64_t m = int64_t((T - G_above + w - 1) / w);  // tokens of the bucket still needed

  // Pass 2: the bucket's logits; theta is the m-th largest (ties beyond it are taken below).
  thread_local std::vector<float> candidates;
  candidates.clear();
  candidates.reserve(size_t(count[size_t(boundary)]));
  for (int64_t t = 0; t < n; ++t)
    if (gap[size_t(t)] == boundary) candidates.push_back(logits[t]);
  std::nth_element(candidates.begin(), candidates.begin() + (m - 1), candidates.end(),
                   std::greater<float>());
  const float theta = candidates[size_t(m - 1)];
  int64_t in_bucket = 0;
  for (float l : candidates) in_bucket += l >= theta;

  // Pass 3: the mask.
  int64_t n_selected = 0;
  for (int64_t t = 0; t < n; ++t) {
    mask[t] = logits[t] >= theta ? 1 : 0;
    n_selected += mask[t];
  }
  TopPSelection selection;
  selection.threshold = theta;
  selection.n_selected = n_selected;
  selection.mass = mass_of(G_above + uint64_t(in_bucket) * w, Z);
  selection.n_boundary = int64_t(candidates.size());
  return selection;
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
