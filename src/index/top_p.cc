#include "index/top_p.h"

#include <algorithm>
#include <bit>
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
  float l_max = logits[0];
  for (int64_t t = 0; t < n; ++t) {
    if (!std::isfinite(logits[t])) {
      fail(StatusCode::kInvalidArgument,
           "top_p: logits[" + std::to_string(t) + "] is not finite");
    }
    l_max = std::max(l_max, logits[t]);
  }
  return l_max;
}

// s = 63 - ceil(log2(n)) fraction bits: n weights of at most 2^s sum to at most 2^63.
int weight_fraction_bits(int64_t n) {
  int ceil_log2_n = 0;
  while ((int64_t{1} << ceil_log2_n) < n) ++ceil_log2_n;
  return 63 - ceil_log2_n;
}

// W_t = max(1, ceil(2^s * exp(l_t - l_max))), the fixed-point softmax numerator of top_p.h.
uint64_t weight_units(float l, float l_max, int s) {
  const double scaled = std::ldexp(std::exp(double{l} - double{l_max}), s);
  return std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(scaled)));
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

// Order-preserving integer image of a finite float (-0 and +0 share a key).
uint32_t score_key(float l) {
  const auto bits = std::bit_cast<uint32_t>(l + 0.0f);
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

float score_of_key(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
  return std::bit_cast<float>(bits);
}

}  // namespace

TopPSelection top_p_select_ref(const float* logits, int64_t n, double p, uint8_t* mask) {
  const float l_max = validate_and_max(logits, n, p, mask);
  const int s = weight_fraction_bits(n);
  std::vector<uint64_t> W(static_cast<size_t>(n));
  uint64_t Z = 0;
  for (int64_t t = 0; t < n; ++t) Z += W[t] = weight_units(logits[t], l_max, s);
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
  const int s = weight_fraction_bits(n);
  std::vector<uint64_t> W(static_cast<size_t>(n));
  std::vector<uint32_t> key(static_cast<size_t>(n));
  uint64_t Z = 0;
  uint32_t key_min = std::numeric_limits<uint32_t>::max();
  uint32_t key_max = 0;
  for (int64_t t = 0; t < n; ++t) {
    Z += W[t] = weight_units(logits[t], l_max, s);
    key[t] = score_key(logits[t]);
    key_min = std::min(key_min, key[t]);
    key_max = std::max(key_max, key[t]);
  }
  const uint64_t T = target_units(p, Z);

  // Invariant: lo and hi are keys of existing scores, G(lo) = G_lo >= T, and theta (the largest
  // key whose upper set holds mass >= T) lies in [lo, hi]. Each pass splits [lo, hi] at two
  // integer pivots pi0 <= pi1 (lo < pi0, pi1 <= hi), sums the weight G_j of keys >= pi_j, and
  // snaps the kept third to existing keys: a_j = min key >= pi_j (v_min), b_j = max key < pi_j
  // (v_max). With d = hi - lo the kept range has length at most floor(d / 3), so the loop ends
  // after at most kTopPMaxSearchPasses passes, also on ties. (As printed, Algorithm 3 compares
  // against real-valued pivots, which can round onto low or high and stop shrinking the range
  // while two distinct scores remain in it, and its mass test can fail for every pivot when p
  // exceeds the rounded total; integer pivots and exact integer masses rule out both.)
  uint64_t lo = key_min;
  uint64_t hi = key_max;
  uint64_t G_lo = Z;
  int passes = 0;
  while (lo < hi) {
    const uint64_t d = hi - lo;
    const uint64_t pi0 = lo + (d + 2) / 3;
    const uint64_t pi1 = lo + (2 * d + 2) / 3;
    uint64_t G0 = 0, G1 = 0;
    uint64_t a0 = std::numeric_limits<uint64_t>::max(), a1 = a0;
    uint64_t b0 = 0, b1 = 0;
    for (int64_t t = 0; t < n; ++t) {
      const uint64_t k = key[t];
      if (k >= pi0) {
        G0 += W[t];
        a0 = std::min(a0, k);
      } else {
        b0 = std::max(b0, k);
      }
      if (k >= pi1) {
        G1 += W[t];
        a1 = std::min(a1, k);
      } else {
        b1 = std::max(b1, k);
      }
    }
    ++passes;
    if (G1 >= T) {
      lo = a1;  // a1 <= hi: hi is an existing key >= pi1
      G_lo = G1;
    } else if (G0 >= T) {
      lo = a0;  // G0 > G1: some key lies in [pi0, pi1), so a0 <= b1
      G_lo = G0;
      hi = b1;
    } else {
      hi = b0;  // G(lo) >= T > G0 puts lo below pi0, so b0 >= lo
    }
  }

  const auto theta_key = static_cast<uint32_t>(lo);
  int64_t n_selected = 0;
  for (int64_t t = 0; t < n; ++t) {
    mask[t] = key[t] >= theta_key ? 1 : 0;
    n_selected += mask[t];
  }
  TopPSelection selection;
  selection.threshold = score_of_key(theta_key);
  selection.n_selected = n_selected;
  selection.mass = mass_of(G_lo, Z);
  selection.n_search_passes = passes;
  return selection;
}

}  // namespace certkv::index
