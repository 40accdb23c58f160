// page_rows.h: the reference arithmetic of a page's row update, the meter lanes, and the choice
// of kernel. Compiled with -ffp-contract=off (src/attention/CMakeLists.txt), so that every
// product and sum below rounds as written, as the AVX-512 kernel's intrinsics do.
#include "attention/page_rows.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "attention/online_softmax.h"
#include "codec/lossy_page.h"

namespace certkv::attention::detail {

namespace {

float tree_sum_ref(const float x[16]) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  const float t2[2] = {t4[0] + t4[2], t4[1] + t4[3]};
  return t2[0] + t2[1];
}

// simd::exp_range_reduced8 in one lane.
float exp_range_reduced_ref(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.f / 5040.f;
  p = std::fma(p, r, 1.f / 720.f);
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

// exp_nonpositive8 in one lane (max(x, lower) as the vector max: lower when x is NaN).
float exp_nonpositive_ref(float x) {
  const float lower = -87.3f;
  if (x < lower) return 0.f;
  return exp_range_reduced_ref(x > lower ? x : lower);
}

}  // namespace

float expm1_upper_ref(float c) {
  const float a = std::fma(c, 0.5f, 1.f);
  const float b = std::fma(c, 1.f / 24.f, 1.f / 6.f);
  const float e = std::fma(c, kExpm1RemainderCoefficient, 1.f / 120.f);
  const float c2 = c * c;
  const float c4 = c2 * c2;
  if (c < 0.5f) return std::fma(c4, e, std::fma(c2, b, a)) * c;
  return exp_range_reduced_ref(c) - 1.f;
}

namespace {

// P(x): 2^E of x as the float of its exponent bits (0 for zero and float subnormals).
float exponent_power_ref(float x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0x7f800000u); }

// logit_bounds16's c of key j (four chains of bands).
float logit_bound_ref(const QueryBoundWeights& w, bool tier_b, const float* bounds, size_t stride, int j) {
  float l[4] = {}, q[4] = {};
  for (int g = 0; g < w.width; ++g) {
    const float a = bounds[size_t(g) * stride + size_t(j)];
    l[g % 4] = std::fma(tier_b ? w.abs_weight[g] : w.weight[g], a, l[g % 4]);
    if (tier_b) q[g % 4] = std::fma(w.weight[g] * a, a, q[g % 4]);
  }
  const float sum = (l[0] + l[1]) + (l[2] + l[3]);
  return tier_b ? std::sqrt((q[0] + q[1]) + (q[2] + q[3])) + sum : sum;
}

}  // namespace

float fma_upward_ref(float a, float b, float c) {
  // a b is exact in double (two 24-bit significands); s + e = a b + c exactly (Knuth's TwoSum).
  const double p = double(a) * double(b);
  const double s = p + double(c);
  if (!std::isfinite(s)) return std::fma(a, b, c);
  const double bv = s - p;
  const double e = (p - (s - bv)) + (double(c) - bv);
  // float(s) is the float nearest s; the exact value s + e lies on the same side of it as s, or
  // equals it when s does and e is 0 (an exact value that is a float is s itself).
  float f = float(s);
  if (double(f) < s || (double(f) == s && e > 0)) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

float exponent_bound_ref(const QueryBoundWeights& w, const float* q, const float* k, int d) {
  float lane[16];
  for (int i = 0; i < 16; ++i) {
    lane[i] = 0.f;
    for (int c = i; c < d; c += 16) lane[i] = fma_upward_ref(std::fabs(q[c]), exponent_power_ref(k[c]), lane[i]);
  }
  // tree_sum_ref's order, each sum rounded up (a + b = fma_up(a, 1, b)).
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = fma_upward_ref(lane[i], 1.f, lane[i + 8]);
  for (int i = 0; i < 4; ++i) t4[i] = fma_upward_ref(t8[i], 1.f, t8[i + 4]);
  const float t2[2] = {fma_upward_ref(t4[0], 1.f, t4[2]), fma_upward_ref(t4[1], 1.f, t4[3])};
  const float sum = fma_upward_ref(t2[0], 1.f, t2[1]);
  return fma_upward_ref(fma_upward_ref(sum, 0.0625f, w.q_term), w.abs_scale, 0.f);
}

void clear_meter_lanes(MeterLanes* lanes) {
  std::fill(lanes->d, lanes->d + 16, 0.f);
  std::fill(lanes->rho, lanes->rho + 16, 0.f);
  lanes->large = 0;
  lanes->roundings = 0;
}

void meter_row_from_lanes(const MeterLanes& lanes, MeterRow* out) {
  double d = 0, rho = 0;
  for (int i = 0; i < 16; ++i) {
    d += double(lanes.d[i]);
    rho += double(lanes.rho[i]);
  }
  // A sum of non-negative terms through k float roundings is at least (1 - 2^-24)^k of the exact
  // one; the same for l's in the denominator. 2^-23 per rounding is twice that, rounding up.
  const double lift = 1.0 + std::ldexp(double(lanes.roundings + 8), -23);
  out->d = (d + lanes.large) * lift;
  const double r = rho * lift;
  float f = float(r);
  if (double(f) < r) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  out->rho = f;
}

void page_rows_update_ref(const PageRows& rows, const PageTiles& page, int metered) {
  const int n = page.n_keys, d = rows.d;
  const int n_vec = (n + 15) / 16;
  const size_t stride = page_rows_stride(n);
  std::vector<float> alpha(size_t(rows.n_rows));
  for (int r = 0; r < rows.n_rows; ++r) {
    const float* q = rows.q + size_t(r) * size_t(d);
    float* p = rows.p + size_t(r) * stride;
    float tile_max = kMinusInfinity;
    for (int j = 0; j < n_vec * 16; ++j) {
      if (j >= n) {
        p[j] = kMinusInfinity;
        continue;
      }
      float lane[16];
      for (int i = 0; i < 16; ++i) {
        lane[i] = 0.f;
        for (int c = i; c < d; c += 16) lane[i] = std::fma(q[c], page.k[size_t(j) * size_t(d) + size_t(c)], lane[i]);
      }
      p[j] = tree_sum_ref(lane) * rows.scale;
      tile_max = std::max(tile_max, p[j]);
    }
    RowState& st = rows.st[r];
    const float m_new = tile_max > st.m ? tile_max : st.m;
    const float a = m_new == st.m ? 1.f : std::exp(st.m - m_new);
    alpha[size_t(r)] = a;
    float lsum[16] = {};
    MeterLanes* lanes = metered != 0 ? &rows.lanes[r] : nullptr;
    double large = 0;
    if (lanes != nullptr) {
      for (int i = 0; i < 16; ++i) {
        lanes->d[i] = lanes->d[i] * a;
        lanes->rho[i] = lanes->rho[i] * a;
      }
    }
    for (int j = 0; j < n_vec * 16; ++j) {
      const float s = p[j];
      const float pj = exp_nonpositive_ref(s - m_new);
      p[j] = pj;
      const int i = j % 16;
      lsum[i] = lsum[i] + pj;
      if (lanes == nullptr) continue;
      const bool valid = j < n;
      float c = 0.f;
      if (valid && metered == 3) {
        c = page.bounds[j] > 0 ? exponent_bound_ref(rows.w[r], q, page.k + size_t(j) * size_t(d), d) : 0.f;
      } else if (valid) {
        c = logit_bound_ref(rows.w[r], metered == 2, page.bounds, page.bounds_stride, j);
      }
      const bool below = valid && c < kLargeLogitBound;
      if (valid && !below) large += std::exp(double(s) - double(m_new) + double(c));
      if (below) lanes->d[i] = std::fma(pj, expm1_upper_ref(c), lanes->d[i]);
      lanes->rho[i] = std::fma(pj, valid ? page.rho[j] : 0.f, lanes->rho[i]);
    }
    st.l = std::fma(st.l, a, tree_sum_ref(lsum));
    st.m = m_new;
    if (lanes != nullptr) {
      lanes->large = (lanes->large != 0 ? lanes->large * double(a) : 0.0) + large;
      lanes->roundings += 2 * n_vec + 6;
    }
  }
  for (int r = 0; r < rows.n_rows; ++r) {
    const float* p = rows.p + size_t(r) * stride;
    float* acc = rows.acc + size_t(r) * size_t(d);
    for (int c = 0; c < d; ++c) {
      float x = acc[c] * alpha[size_t(r)];
      for (int j = 0; j < n; ++j) x = std::fma(p[j], page.v[size_t(j) * size_t(d) + size_t(c)], x);
      acc[c] = x;
    }
  }
}

const PageRowsKernels* page_rows_kernels(int d) {
  static const PageRowsKernels* const avx512 =
      codec::lossy_best_kernel() == codec::LossyKernel::kAvx512 ? page_rows_kernels_avx512() : nullptr;
  return avx512 != nullptr && d >= 16 && d % 16 == 0 && d <= 128 ? avx512 : nullptr;
}

}  // namespace certkv::attention::detail
