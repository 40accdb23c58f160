// One page's softmax update of a KV head's query rows for AVX-512 (page_rows.h): sixteen keys to a
// vector, the arithmetic page_rows_update_ref writes out lane by lane. Compiled under
// `#pragma GCC target` and with -ffp-contract=off (src/attention/CMakeLists.txt: a product and a
// sum stay two roundings unless written as one fused multiply-add, as in the reference), chosen
// at run time by page_rows_kernels.
#include "attention/page_rows.h"

#include <cmath>

#include "attention/online_softmax.h"
#include "core/x86_simd.h"

namespace certkv::attention::detail {

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
namespace {

#include "attention/avx512_math.h"

constexpr int kRowBlock = 8;  // rows whose probabilities a page keeps at once

// The reduction below leaves the sum of slot m's vector in lane kSlotKey[m]; the map is its own
// inverse, so slot m holds key kSlotKey[m] and lane j ends with key j.
constexpr int kSlotKey[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// Rounding toward +inf (the exponent witness's arithmetic, page_rows.h), and a sum of either kind.
constexpr int kUpward = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
template <bool kUp>
inline __m512 add16(__m512 x, __m512 y) {
  if constexpr (kUp) return _mm512_add_round_ps(x, y, kUpward);
  return _mm512_add_ps(x, y);
}

// Lane j of the result = the tree sum (page_rows.h) of the lanes of a[m] with kSlotKey[m] = j;
// kUp: every sum rounded toward +inf.
template <bool kUp = false>
inline __m512 tree_sums16(const __m512 a[16]) {
  __m512 b[8], c[4], e[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)  // t8: lanes i and i + 8 of each vector
    b[k] = add16<kUp>(_mm512_shuffle_f32x4(a[k], a[k + 8], 0x44), _mm512_shuffle_f32x4(a[k], a[k + 8], 0xEE));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)  // t4: lanes i and i + 4
    c[k] = add16<kUp>(_mm512_shuffle_f32x4(b[k], b[k + 4], 0x88), _mm512_shuffle_f32x4(b[k], b[k + 4], 0xDD));
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k)  // t2: lanes i and i + 2 of each 128-bit quarter
    e[k] = add16<kUp>(_mm512_shuffle_ps(c[k], c[k + 2], 0x44), _mm512_shuffle_ps(c[k], c[k + 2], 0xEE));
  return add16<kUp>(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));  // t1
}

// The tree sum of one vector's lanes.
inline float tree_sum(__m512 x) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

// e^x for x <= 0, 0 below -87.3 (online_softmax.h's exp_nonpositive8).
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 lower = _mm512_set1_ps(-87.3f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lower, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(__mmask16(~underflow), exp_range_reduced16(_mm512_max_ps(x, lower)));
}

template <int kChunks>
inline __m512 dot16(const __m512 q[kChunks], const float* k) {
  __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int ch = 0; ch < kChunks; ++ch) a = _mm512_fmadd_ps(q[ch], _mm512_loadu_ps(k + 16 * ch), a);
  return a;
}

// dot16 and, from the same loads, the exponent witness's lanes: e = fma_up(|q|, k & 0x7f800000, e)
// (one AND and one FMA per 16 channels beside the score's FMA).
template <int kChunks>
inline void dot16_exponent(const __m512 q[kChunks], const __m512 q_abs[kChunks], const float* k, __m512& a,
                           __m512& e) {
  const __m512 exponent_bits = _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000));
  a = _mm512_setzero_ps();
  e = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int ch = 0; ch < kChunks; ++ch) {
    const __m512 kv = _mm512_loadu_ps(k + 16 * ch);
    a = _mm512_fmadd_ps(q[ch], kv, a);
    e = _mm512_fmadd_round_ps(q_abs[ch], _mm512_and_ps(kv, exponent_bits), e, kUpward);
  }
}

// c of sixteen keys of R rows at once (each band's vector loaded once for the R rows): per row the
// bands in four chains (b mod 4), added as (0 + 1) + (2 + 3); a row's floats do not depend on R.
template <bool kTierB, int R>
inline void logit_bounds16(const QueryBoundWeights* w, const float* bounds, size_t stride, int j0, __mmask16 valid,
                           __m512 c[R]) {
  __m512 l[R][4], q[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) l[r][i] = q[r][i] = _mm512_setzero_ps();
  const int width = w[0].width;
  // Band g into chain g mod 4 of every row.
  const auto band = [&](int g, int chain) {
    const __m512 a = _mm512_maskz_loadu_ps(valid, bounds + size_t(g) * stride + size_t(j0));
    for (int r = 0; r < R; ++r) {
      l[r][chain] = _mm512_fmadd_ps(_mm512_set1_ps(kTierB ? w[r].abs_weight[g] : w[r].weight[g]), a, l[r][chain]);
      if constexpr (kTierB)
        q[r][chain] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w[r].weight[g]), a), a, q[r][chain]);
    }
  };
  int g = 0;
  for (; g + 4 <= width; g += 4) {
    band(g, 0);
    band(g + 1, 1);
    band(g + 2, 2);
    band(g + 3, 3);
  }
  for (int chain = 0; g < width; ++g, ++chain) band(g, chain);
  for (int r = 0; r < R; ++r) {
    c[r] = _mm512_add_ps(_mm512_add_ps(l[r][0], l[r][1]), _mm512_add_ps(l[r][2], l[r][3]));
    if constexpr (kTierB)
      c[r] = _mm512_add_ps(
          _mm512_sqrt_ps(_mm512_add_ps(_mm512_add_ps(q[r][0], q[r][1]), _mm512_add_ps(q[r][2], q[r][3]))), c[r]);
  }
}

// An upper bound of e^c - 1 for c >= 0 (page_rows.h): below 1/2, c Q(c) with Q in Estrin's form;
// above, e^c - 1 as expm1_nonnegative16.
inline __m512 expm1_upper16(__m512 c) {
  const __m512 a = _mm512_fmadd_ps(c, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.f));
  const __m512 b = _mm512_fmadd_ps(c, _mm512_set1_ps(1.f / 24.f), _mm512_set1_ps(1.f / 6.f));
  const __m512 e = _mm512_fmadd_ps(c, _mm512_set1_ps(kExpm1RemainderCoefficient), _mm512_set1_ps(1.f / 120.f));
  const __m512 c2 = _mm512_mul_ps(c, c);
  const __m512 c4 = _mm512_mul_ps(c2, c2);
  const __m512 small = _mm512_mul_ps(_mm512_fmadd_ps(c4, e, _mm512_fmadd_ps(c2, b, a)), c);
  const __mmask16 is_small = _mm512_cmp_ps_mask(c, _mm512_set1_ps(0.5f), _CMP_LT_OQ);
  if (is_small == 0xffff) return small;
  const __m512 large = _mm512_sub_ps(exp_range_reduced16(c), _mm512_set1_ps(1.f));
  return _mm512_mask_mov_ps(large, is_small, small);
}

// Row r's scores, softmax state and (metered) meter lanes for the page; p gets its p_j, and
// returns alpha. kMeter: 0 none, 1 Tier A, 2 Tier B, 3 the exponent witness.
// meter_c, meter_e (metered): the row's c and E(c) of every key of the page (meter_terms); with the
// exponent witness, c is made here (into meter_c) and E(c) in the softmax's pass.
template <int kChunks, int kMeter>
float softmax_row(const PageRows& rows, const PageTiles& page, int r, float* meter_c, const float* meter_e) {
  constexpr int d = 16 * kChunks;
  const int n = page.n_keys;
  const int n_vec = (n + 15) / 16;
  // Unrolled, so that q stays in registers (a loop left the array in memory, written in halves
  // and read whole: a store-forwarding stall per row and page).
  constexpr bool kExponent = kMeter == 3;
  __m512 q[kChunks], q_abs[kExponent ? kChunks : 1];
#pragma GCC unroll 8
  for (int ch = 0; ch < kChunks; ++ch) {
    q[ch] = _mm512_loadu_ps(rows.q + size_t(r) * d + 16 * ch);
    if constexpr (kExponent) q_abs[ch] = _mm512_abs_ps(q[ch]);
  }
  float* p = rows.p + size_t(r) * page_rows_stride(n);
  const __m512 scale = _mm512_set1_ps(rows.scale);
  const __m512 minus_inf = _mm512_set1_ps(kMinusInfinity);
  __m512 vmax = minus_inf;
  for (int v = 0; v < n_vec; ++v) {
    const int j0 = 16 * v;
    __m512 a[16], e[kExponent ? 16 : 1];
    if constexpr (kExponent) {
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) {
        if (j0 + kSlotKey[m] < n) {
          dot16_exponent<kChunks>(q, q_abs, page.k + size_t(j0 + kSlotKey[m]) * d, a[m], e[m]);
        } else {
          a[m] = e[m] = _mm512_setzero_ps();
        }
      }
    } else if (n - j0 >= 16) {
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) a[m] = dot16<kChunks>(q, page.k + size_t(j0 + kSlotKey[m]) * d);
    } else {
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m)
        a[m] = j0 + kSlotKey[m] < n ? dot16<kChunks>(q, page.k + size_t(j0 + kSlotKey[m]) * d) : _mm512_setzero_ps();
    }
    const __mmask16 valid = lanes_below(n - j0);
    const __m512 s = _mm512_mask_mov_ps(minus_inf, valid, _mm512_mul_ps(tree_sums16(a), scale));
    _mm512_storeu_ps(p + j0, s);
    vmax = _mm512_max_ps(vmax, s);
    if constexpr (kExponent) {
      // c = mul_up(fma_up(S, 2^-4, q_term), |scale|) on a lossy page's keys, 0 elsewhere.
      const QueryBoundWeights& w = rows.w[r];
      const __m512 c = _mm512_mul_round_ps(
          _mm512_fmadd_round_ps(tree_sums16<true>(e), _mm512_set1_ps(0.0625f), _mm512_set1_ps(w.q_term), kUpward),
          _mm512_set1_ps(w.abs_scale), kUpward);
      const __mmask16 lossy =
          _mm512_mask_cmp_ps_mask(valid, _mm512_maskz_loadu_ps(valid, page.bounds + j0), _mm512_setzero_ps(), _CMP_GT_OQ);
      _mm512_storeu_ps(meter_c + j0, _mm512_maskz_mov_ps(lossy, c));
    }
  }
  RowState& st = rows.st[r];
  const float tile_max = _mm512_reduce_max_ps(vmax);
  const float m_new = tile_max > st.m ? tile_max : st.m;
  const float alpha = m_new == st.m ? 1.f : std::exp(st.m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 lsum = _mm512_setzero_ps();
  __m512 dl = _mm512_setzero_ps(), rl = dl;
  double large = 0;
  MeterLanes* lanes = kMeter != 0 ? &rows.lanes[r] : nullptr;
  if constexpr (kMeter != 0) {
    const __m512 av = _mm512_set1_ps(alpha);
    dl = _mm512_mul_ps(_mm512_loadu_ps(lanes->d), av);
    rl = _mm512_mul_ps(_mm512_loadu_ps(lanes->rho), av);
  }
  for (int v = 0; v < n_vec; ++v) {
    const int j0 = 16 * v;
    const __m512 s = _mm512_loadu_ps(p + j0);
    const __m512 pv = exp_nonpositive16(_mm512_sub_ps(s, mv));
    _mm512_storeu_ps(p + j0, pv);
    lsum = _mm512_add_ps(lsum, pv);
    if constexpr (kMeter != 0) {
      const __mmask16 valid = lanes_below(n - j0);
      const __m512 c = _mm512_loadu_ps(meter_c + j0);
      const __mmask16 below = _mm512_mask_cmp_ps_mask(valid, c, _mm512_set1_ps(kLargeLogitBound), _CMP_LT_OQ);
      if (__mmask16 over = valid & __mmask16(~below); over != 0) {
        alignas(64) float s_lanes[16], c_lanes[16];
        _mm512_store_ps(s_lanes, s);
        _mm512_store_ps(c_lanes, c);
        for (int i = 0; i < 16; ++i)
          if (over >> i & 1) large += std::exp(double(s_lanes[i]) - double(m_new) + double(c_lanes[i]));
      }
      const __m512 e = kMeter == 3 ? expm1_upper16(_mm512_maskz_mov_ps(below, c)) : _mm512_loadu_ps(meter_e + j0);
      dl = _mm512_mask3_fmadd_ps(pv, e, dl, below);
      rl = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(valid, page.rho + j0), rl);
    }
  }
  st.l = std::fma(st.l, alpha, tree_sum(lsum));
  st.m = m_new;
  if constexpr (kMeter != 0) {
    _mm512_storeu_ps(lanes->d, dl);
    _mm512_storeu_ps(lanes->rho, rl);
    lanes->large = (lanes->large != 0 ? lanes->large * double(alpha) : 0.0) + large;
    lanes->roundings += 2 * n_vec + 6;
  }
  return alpha;
}

// c and E(c) (c below kLargeLogitBound, else 0) of rows [0, n_rows) of a page: terms[2 i stride + j]
// and terms[(2 i + 1) stride + j], the rows in fours.
template <bool kTierB, int R>
void meter_terms_rows(const QueryBoundWeights* w, const PageTiles& page, size_t stride, float* terms) {
  for (int j0 = 0; j0 < page.n_keys; j0 += 16) {
    const __mmask16 valid = lanes_below(page.n_keys - j0);
    __m512 c[R];
    logit_bounds16<kTierB, R>(w, page.bounds, page.bounds_stride, j0, valid, c);
    for (int r = 0; r < R; ++r) {
      const __mmask16 below = _mm512_mask_cmp_ps_mask(valid, c[r], _mm512_set1_ps(kLargeLogitBound), _CMP_LT_OQ);
      _mm512_storeu_ps(terms + 2 * size_t(r) * stride + size_t(j0), c[r]);
      _mm512_storeu_ps(terms + (2 * size_t(r) + 1) * stride + size_t(j0),
                       expm1_upper16(_mm512_maskz_mov_ps(below, c[r])));
    }
  }
}

template <bool kTierB>
void meter_terms(const QueryBoundWeights* w, int n_rows, const PageTiles& page, size_t stride, float* terms) {
  int r = 0;
  for (; r + 4 <= n_rows; r += 4) meter_terms_rows<kTierB, 4>(w + r, page, stride, terms + 2 * size_t(r) * stride);
  float* at = terms + 2 * size_t(r) * stride;
  switch (n_rows - r) {
    case 3: meter_terms_rows<kTierB, 3>(w + r, page, stride, at); break;
    case 2: meter_terms_rows<kTierB, 2>(w + r, page, stride, at); break;
    case 1: meter_terms_rows<kTierB, 1>(w + r, page, stride, at); break;
    default: break;
  }
}

// acc of R rows, chunks [c0, c0 + C) of 16 channels: acc alpha, then fma(p_j, v_j, acc) for j
// ascending; v read once for the R rows.
template <int R, int C>
void values_block(const float* const* p, const float* alpha, float* const* acc, const float* v, int n, int d, int c0) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * (c0 + c)), _mm512_set1_ps(alpha[r]));
  for (int j = 0; j < n; ++j) {
    __m512 vj[C];
    for (int c = 0; c < C; ++c) vj[c] = _mm512_loadu_ps(v + size_t(j) * size_t(d) + 16 * (c0 + c));
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pj, vj[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[r] + 16 * (c0 + c), a[r][c]);
}

template <int R>
void values_rows(const float* const* p, const float* alpha, float* const* acc, const float* v, int n, int d) {
  const int chunks = d / 16;
  int c0 = 0;
  for (; c0 + 4 <= chunks; c0 += 4) values_block<R, 4>(p, alpha, acc, v, n, d, c0);
  switch (chunks - c0) {
    case 3: values_block<R, 3>(p, alpha, acc, v, n, d, c0); break;
    case 2: values_block<R, 2>(p, alpha, acc, v, n, d, c0); break;
    case 1: values_block<R, 1>(p, alpha, acc, v, n, d, c0); break;
    default: break;
  }
}

template <int kChunks, int kMeter>
void update_rows(const PageRows& rows, const PageTiles& page) {
  const size_t stride = page_rows_stride(page.n_keys);
  for (int r0 = 0; r0 < rows.n_rows; r0 += kRowBlock) {
    const int rb = rows.n_rows - r0 < kRowBlock ? rows.n_rows - r0 : kRowBlock;
    float alpha[kRowBlock];
    const float* p[kRowBlock];
    float* acc[kRowBlock];
    // Metered: c and E(c) of the block's rows, [row][stride] each, c then E(c).
    float* terms = rows.meter_terms;
    if constexpr (kMeter == 1 || kMeter == 2) meter_terms<kMeter == 2>(rows.w + r0, rb, page, stride, terms);
    for (int i = 0; i < rb; ++i) {
      alpha[i] = softmax_row<kChunks, kMeter>(rows, page, r0 + i, terms + 2 * size_t(i) * stride,
                                              terms + (2 * size_t(i) + 1) * stride);
      p[i] = rows.p + size_t(r0 + i) * stride;
      acc[i] = rows.acc + size_t(r0 + i) * size_t(16 * kChunks);
    }
    int i = 0;
    for (; i + 4 <= rb; i += 4) values_rows<4>(p + i, alpha + i, acc + i, page.v, page.n_keys, 16 * kChunks);
    switch (rb - i) {
      case 3: values_rows<3>(p + i, alpha + i, acc + i, page.v, page.n_keys, 16 * kChunks); break;
      case 2: values_rows<2>(p + i, alpha + i, acc + i, page.v, page.n_keys, 16 * kChunks); break;
      case 1: values_rows<1>(p + i, alpha + i, acc + i, page.v, page.n_keys, 16 * kChunks); break;
      default: break;
    }
  }
}

template <int kMeter>
void update_any(const PageRows& rows, const PageTiles& page) {
  switch (rows.d / 16) {
    case 1: update_rows<1, kMeter>(rows, page); break;
    case 2: update_rows<2, kMeter>(rows, page); break;
    case 3: update_rows<3, kMeter>(rows, page); break;
    case 4: update_rows<4, kMeter>(rows, page); break;
    case 5: update_rows<5, kMeter>(rows, page); break;
    case 6: update_rows<6, kMeter>(rows, page); break;
    case 7: update_rows<7, kMeter>(rows, page); break;
    case 8: update_rows<8, kMeter>(rows, page); break;
    default: break;  // page_rows_kernels refuses other head_dims
  }
}

}  // namespace
#pragma GCC pop_options

const PageRowsKernels* page_rows_kernels_avx512() {
  static const PageRowsKernels kernels{&update_any<0>, &update_any<1>, &update_any<2>, &update_any<3>};
  return &kernels;
}

#else

const PageRowsKernels* page_rows_kernels_avx512() { return nullptr; }

#endif

}  // namespace certkv::attention::detail
