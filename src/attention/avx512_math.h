// AVX-512 vector math shared by the attention layer's AVX-512 kernels (page_meter_x86.cc,
// page_rows_x86.cc). Include it inside a `#pragma GCC target("avx512f,...")` region and an anonymous
// namespace of certkv::attention::detail; every function is the AVX2 path's (core/x86_simd.h,
// online_softmax.h) sixteen lanes wide, the same operations in the same order.
#pragma once

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
