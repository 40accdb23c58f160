// The meter's per-page arithmetic for AVX-512 (page_meter.h): one 16-token page is one vector, so
// c_t of a query row over B bands is B fused multiply-adds, and its term p~_t (e^{c_t} - 1) a
// handful more. Compiled under `#pragma GCC target`, chosen at run time. The arithmetic is the
// AVX2 path's (online_softmax.h) sixteen lanes wide: the same formulas, the same upward margins;
// only the order of the float sums differs, which the margins cover (each weight is lifted by
// 2^-16 for sums of at most 64 positive terms; the merged A - 1 and value side by 2^-16).
#include "attention/page_meter.h"

#include "attention/online_softmax.h"

#include <cmath>
#include <limits>

#include "core/x86_simd.h"

namespace certkv::attention::detail {

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
namespace {

#include "attention/avx512_math.h"

// c[j] of R query rows (w[r], c + r * c_stride), j < n_keys, the bands of each 16 keys loaded once
// for the R rows; large[r]: whether some c of row r is at or above kLargeLogitBound, or NaN (NaN
// compares "not less than" too: an overflow, the meter is 1). Each row's arithmetic is the one-row
// path's (two chains, even and odd bands), so its floats do not depend on R.
template <bool kTierB, int R>
void logit_bounds_rows(const QueryBoundWeights* w, const float* bounds_t, size_t tile_keys, int n_keys, float* c,
                       size_t c_stride, uint8_t* large) {
  const __m512 limit = _mm512_set1_ps(kLargeLogitBound);
  const int width = w[0].width;
  __mmask16 over[R] = {};
  for (int j = 0; j < n_keys; j += 16) {
    const __mmask16 m = lanes_below(n_keys - j);
    __m512 l0[R], l1[R], q0[R], q1[R];
    for (int r = 0; r < R; ++r) l0[r] = l1[r] = q0[r] = q1[r] = _mm512_setzero_ps();
    int g = 0;
    for (; g + 2 <= width; g += 2) {
      const __m512 a0 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g) * tile_keys + size_t(j));
      const __m512 a1 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g + 1) * tile_keys + size_t(j));
      for (int r = 0; r < R; ++r) {
        l0[r] = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w[r].abs_weight[g] : w[r].weight[g]), a0, l0[r]);
        l1[r] = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w[r].abs_weight[g + 1] : w[r].weight[g + 1]), a1, l1[r]);
        if constexpr (kTierB) {
          q0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w[r].weight[g]), a0), a0, q0[r]);
          q1[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w[r].weight[g + 1]), a1), a1, q1[r]);
        }
      }
    }
    if (g < width) {
      const __m512 a0 = _mm512_maskz_loadu_ps(m, bounds_t + size_t(g) * tile_keys + size_t(j));
      for (int r = 0; r < R; ++r) {
        l0[r] = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w[r].abs_weight[g] : w[r].weight[g]), a0, l0[r]);
        if constexpr (kTierB) q0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w[r].weight[g]), a0), a0, q0[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_add_ps(l0[r], l1[r]);
      if constexpr (kTierB) sum = _mm512_add_ps(_mm512_sqrt_ps(_mm512_add_ps(q0[r], q1[r])), sum);
      _mm512_mask_storeu_ps(c + size_t(r) * c_stride + size_t(j), m, sum);
      over[r] |= _mm512_mask_cmp_ps_mask(m, sum, limit, _CMP_NLT_UQ);
    }
  }
  for (int r = 0; r < R; ++r) large[r] = over[r] != 0 ? 1 : 0;
}

// Rows in fours, then the rest (GQA groups are 1 to 8 rows).
template <bool kTierB>
void group_bounds_avx512(const QueryBoundWeights* w, int group, const float* b, size_t tile_keys, int n_keys,
                         float* c, uint8_t* large) {
  int g = 0;
  for (; g + 4 <= group; g += 4)
    logit_bounds_rows<kTierB, 4>(w + g, b, tile_keys, n_keys, c + size_t(g) * tile_keys, tile_keys, large + g);
  switch (group - g) {
    case 3: logit_bounds_rows<kTierB, 3>(w + g, b, tile_keys, n_keys, c + size_t(g) * tile_keys, tile_keys, large + g); break;
    case 2: logit_bounds_rows<kTierB, 2>(w + g, b, tile_keys, n_keys, c + size_t(g) * tile_keys, tile_keys, large + g); break;
    case 1: logit_bounds_rows<kTierB, 1>(w + g, b, tile_keys, n_keys, c + size_t(g) * tile_keys, tile_keys, large + g); break;
    default: break;
  }
}
void group_bounds_a_avx512(const QueryBoundWeights* w, int group, const float* b, size_t tile_keys, int n_keys,
                           float* c, uint8_t* large) {
  group_bounds_avx512<false>(w, group, b, tile_keys, n_keys, c, large);
}
void group_bounds_b_avx512(const QueryBoundWeights* w, int group, const float* b, size_t tile_keys, int n_keys,
                           float* c, uint8_t* large) {
  group_bounds_avx512<true>(w, group, b, tile_keys, n_keys, c, large);
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


// meter_sums_row of R rows (p + r * tile_keys, c + r * tile_keys), interleaved.
template <int R>
void meter_sums_rows(const float* p, const float* c, const float* rho, size_t tile_keys, int n_keys, float* d_sum,
                     float* rho_sum) {
  __m512 d_acc[R], r_acc[R];
  for (int r = 0; r < R; ++r) d_acc[r] = r_acc[r] = _mm512_setzero_ps();
  const __m512 limit = _mm512_set1_ps(kLargeLogitBound);
  for (int j = 0; j < n_keys; j += 16) {
    const __mmask16 m = lanes_below(n_keys - j);
    const __m512 rho_j = _mm512_maskz_loadu_ps(m, rho + j);
    for (int r = 0; r < R; ++r) {
      const __m512 cj = _mm512_maskz_loadu_ps(m, c + size_t(r) * tile_keys + size_t(j));
      const __m512 pj = _mm512_maskz_loadu_ps(m, p + size_t(r) * tile_keys + size_t(j));
      const __mmask16 below = _mm512_mask_cmp_ps_mask(m, cj, limit, _CMP_LT_OQ);  // not NaN, not large
      const __m512 e = expm1_nonnegative16(_mm512_maskz_mov_ps(below, cj));
      d_acc[r] = _mm512_mask3_fmadd_ps(pj, e, d_acc[r], below);
      r_acc[r] = _mm512_fmadd_ps(pj, rho_j, r_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    d_sum[r] = _mm512_reduce_add_ps(d_acc[r]);
    rho_sum[r] = _mm512_reduce_add_ps(r_acc[r]);
  }
}

void meter_sums_avx512(const float* p, const float* c, const float* rho, int n_keys, float* d_sum, float* rho_sum) {
  meter_sums_rows<1>(p, c, rho, 0, n_keys, d_sum, rho_sum);
}

void group_sums_avx512(const float* p, const float* c, const float* rho, size_t tile_keys, int group, int n_keys,
                       float* d, float* r) {
  int g = 0;
  for (; g + 4 <= group; g += 4)
    meter_sums_rows<4>(p + size_t(g) * tile_keys, c + size_t(g) * tile_keys, rho, tile_keys, n_keys, d + g, r + g);
  const float* pg = p + size_t(g) * tile_keys;
  const float* cg = c + size_t(g) * tile_keys;
  switch (group - g) {
    case 3: meter_sums_rows<3>(pg, cg, rho, tile_keys, n_keys, d + g, r + g); break;
    case 2: meter_sums_rows<2>(pg, cg, rho, tile_keys, n_keys, d + g, r + g); break;
    case 1: meter_sums_rows<1>(pg, cg, rho, tile_keys, n_keys, d + g, r + g); break;
    default: break;
  }
}

void bounds_from_fp16_avx512(const uint16_t* src, size_t src_stride, int rows, int n, float* dst, size_t dst_stride) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
  for (int i = 0; i < rows; ++i) {
    const uint16_t* from = src + size_t(i) * src_stride;
    float* to = dst + size_t(i) * dst_stride;
    for (int j = 0; j < n; j += 16) {
      const __mmask16 m = lanes_below(n - j);
      const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, from + j));
      // Below 0 or NaN ("not greater or equal", unordered): +inf.
      _mm512_mask_storeu_ps(to + j, m, _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_NGE_UQ), inf));
    }
  }
}

}  // namespace
#pragma GCC pop_options

const MeterKernels* meter_kernels_avx512() {
  static const MeterKernels kernels{&any_large_bound_avx512, &meter_sums_avx512,  &group_bounds_a_avx512,
                                    &group_bounds_b_avx512,  &group_sums_avx512,  &bounds_from_fp16_avx512};
  return &kernels;
}

#else

const MeterKernels* meter_kernels_avx512() { return nullptr; }

#endif

}  // namespace certkv::attention::detail
