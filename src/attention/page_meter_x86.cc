// The meter's per-page arithmetic for AVX-512 (page_meter.h): one 16-token page is one vector, so
// c_t of a query row over B bands is B fused multiply-adds, and its term p~_t (e^{c_t} - 1) a
// handful more. Compiled under `#pragma GCC target`, chosen at run time. The arithmetic is the
// AVX2 path's (online_softmax.h) sixteen lanes wide: the same formulas, the same upward margins;
// only the order of the float sums differs, which the margins cover (each weight is lifted by
// 2^-16 for sums of at most 64 positive terms; the merged A - 1 and value side by 2^-16).
#include "attention/page_meter.h"

#include "attention/online_softmax.h"

#include <cmath>

#include "core/x86_simd.h"

namespace certkv::attention::detail {

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
namespace {

inline __mmask16 lanes_below(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// e^x for |x| <= 87.3, 16 lanes: simd::exp_range_reduced8's reduction and polynomial.
inline __m512 exp_range_reduced16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// e^c - 1 for 0 <= c < 88 (online_softmax.h's expm1_nonnegative8, 16 lanes).
inline __m512 expm1_nonnegative16(__m512 c) {
  __m512 t = _mm512_set1_ps(1.f / 362880.f);
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 40320.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 5040.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 720.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 120.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 24.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f / 6.f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(0.5f));
  t = _mm512_fmadd_ps(t, c, _mm512_set1_ps(1.f));
  const __m512 small = _mm512_mul_ps(t, c);
  const __mmask16 is_small = _mm512_cmp_ps_mask(c, _mm512_set1_ps(0.5f), _CMP_LT_OQ);
  if (is_small == 0xffff) return small;
  const __m512 large = _mm512_sub_ps(exp_range_reduced16(c), _mm512_set1_ps(1.f));
  return _mm512_mask_mov_ps(large, is_small, small);
}

template <bool kTierB>
void logit_bounds_avx512(const QueryBoundWeights& w, const float* bounds_t, size_t tile_keys, int n_keys, float* c) {
  for (int j = 0; j < n_keys; j += 16) {
    const __mmask16 m = lanes_below(n_keys - j);
    // *0 even bands, *1 odd bands: two independent chains.
    __m512 l0 = _mm512_setzero_ps(), l1 = l0, q0 = l0, q1 = l0;
    int g = 0;
    for (; g + 2 <= w.width; g += 2) {
      const __m512 a0 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g) * tile_keys + size_t(j));
      const __m512 a1 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g + 1) * tile_keys + size_t(j));
      l0 = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w.abs_weight[g] : w.weight[g]), a0, l0);
      l1 = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w.abs_weight[g + 1] : w.weight[g + 1]), a1, l1);
      if constexpr (kTierB) {
        q0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w.weight[g]), a0), a0, q0);
        q1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w.weight[g + 1]), a1), a1, q1);
      }
    }
    if (g < w.width) {
      const __m512 a0 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g) * tile_keys + size_t(j));
      l0 = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w.abs_weight[g] : w.weight[g]), a0, l0);
      if constexpr (kTierB) q0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w.weight[g]), a0), a0, q0);
    }
    __m512 sum = _mm512_add_ps(l0, l1);
    if constexpr (kTierB) sum = _mm512_add_ps(_mm512_sqrt_ps(_mm512_add_ps(q0, q1)), sum);
    _mm512_mask_storeu_ps(c + j, m, sum);
  }
}

void logit_bounds_a_avx512(const QueryBoundWeights& w, const float* b, size_t tile_keys, int n_keys, float* c) {
  logit_bounds_avx512<false>(w, b, tile_keys, n_keys, c);
}
void logit_bounds_b_avx512(const QueryBoundWeights& w, const float* b, size_t tile_keys, int n_keys, float* c) {
  logit_bounds_avx512<true>(w, b, tile_keys, n_keys, c);
}

bool any_large_bound_avx512(const float* c, int n_keys) {
  for (int j = 0; j < n_keys; j += 16) {
    const __mmask16 m = lanes_below(n_keys - j);
    // NaN compares "not less than" too (an overflow: the meter is 1).
    if (_mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, c + j), _mm512_set1_ps(kLargeLogitBound), _CMP_NLT_UQ) != 0)
      return true;
  }
  return false;
}

void meter_sums_avx512(const float* p, const float* c, const float* rho, int n_keys, float* d_sum, float* rho_sum) {
  __m512 d_acc = _mm512_setzero_ps(), r_acc = d_acc;
  const __m512 limit = _mm512_set1_ps(kLargeLogitBound);
  for (int j = 0; j < n_keys; j += 16) {
    const __mmask16 m = lanes_below(n_keys - j);
    const __m512 cj = _mm512_maskz_loadu_ps(m, c + j);
    const __m512 pj = _mm512_maskz_loadu_ps(m, p + j);
    const __mmask16 below = _mm512_mask_cmp_ps_mask(m, cj, limit, _CMP_LT_OQ);  // not NaN, not large
    const __m512 e = expm1_nonnegative16(_mm512_maskz_mov_ps(below, cj));
    d_acc = _mm512_mask3_fmadd_ps(pj, e, d_acc, below);
    r_acc = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m, rho + j), r_acc);
  }
  *d_sum = _mm512_reduce_add_ps(d_acc);
  *rho_sum = _mm512_reduce_add_ps(r_acc);
}

}  // namespace
#pragma GCC pop_options

const MeterKernels* meter_kernels_avx512() {
  static const MeterKernels kernels{&logit_bounds_a_avx512, &logit_bounds_b_avx512, &any_large_bound_avx512,
                                    &meter_sums_avx512};
  return &kernels;
}

#else

const MeterKernels* meter_kernels_avx512() { return nullptr; }

#endif

}  // namespace certkv::attention::detail
