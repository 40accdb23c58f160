// <immintrin.h> for the SIMD kernels, and the vector math they share. GCC 12 reports its own
// intrinsics' deliberately undefined operands (GCC bug 105593) under -Wall; the warnings are
// silenced for this header only.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__AVX2__) && defined(__FMA__)
namespace certkv::simd {

// e^x for |x| <= 87.3, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts, Cody &
// Waite 1980), e^r by its Taylor polynomial of degree 7 (truncation error below 6e-9 relative),
// 2^n built in the exponent field.
inline __m256 exp_range_reduced8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace certkv::simd
#endif
