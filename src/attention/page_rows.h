// Internal to the attention layer: one page's online softmax update of the query rows that share
// a KV head (a GQA group in decode, a query's group in prefill), chosen at run time. With AVX-512
// (page_rows_x86.cc) a page's keys are taken sixteen to a vector: each row's scores come out of
// a transposed reduction of sixteen dot products, the values are read once for up to four rows,
// and a metered page folds the meter's sums into per-row lanes that stay live across the split's
// pages (no per-page reduction). page_rows_update_ref below is the same arithmetic written
// lane by lane in scalar code: the kernel is tested against it bit for bit.
//
// The arithmetic, per row r (q_r: d floats) and page (n keys, k_j, v_j: d floats each):
//   dot(q, k):  lane i < 16 sums q_c k_c over c = i, i + 16, ... in that order with fused
//               multiply-adds from 0; the 16 lanes are added as a tree, t8[i] = x[i] + x[i + 8],
//               t4[i] = t8[i] + t8[i + 4], t2[i] = t4[i] + t4[i + 2], t1 = t2[0] + t2[1];
//   s_j = t1 * scale;  m' = max(m, max_j s_j);  alpha = 1 if m' = m, else e^{m - m'} (std::exp);
//   p_j = e^{s_j - m'} (exp16: online_softmax.h's polynomial; 0 below -87.3);
//   l' = fma(l, alpha, T) with T the tree of the lanes L[i] = sum of p_j over j = i, i + 16, ...;
//   acc' = acc alpha, then acc' = fma(p_j, v_j, acc') for j ascending (as update_row).
// Metered pages add, per row, with c_j its logit bound (the weights times the page's bounds, the
// bands summed in four chains, b mod 4, then (0 + 1) + (2 + 3); Tier B adds the square root of its
// variance chains so summed) and rho_j its value bound:
//   lanes.d[i] = lanes.d[i] alpha, then += p_j E(c_j) (one fma) for the keys of lane i whose c_j
//   is below kLargeLogitBound; those at or above it (or NaN) add e^{s_j - m' + c_j} in double to
//   lanes.large (itself scaled by alpha, in double); lanes.rho[i] likewise with p_j rho_j.
//   E(c) >= e^c - 1: below 1/2, c Q(c) with Q(c) = (1 + c/2) + c^2 (1/6 + c/24) + c^4 (1/120 + K c),
//   K = kExpm1RemainderCoefficient >= e^{1/2} / 720 (Taylor's remainder after c^5 / 5!, at most
//   c^6 e^c / 6!); above, e^c - 1 through exp16.
// The exponent witness (metered 3, codec::WitnessCode::kExponent) makes c_j in the scores' pass
// from the decoded keys themselves, every operation rounded toward +inf (so on these non-negative
// operands each result is at least its exact value, and c_j at least the exact bound; no lift):
//   lane i < 16: e_i = fma_up(|q_c|, P(k_jc), e_i) over c = i, i + 16, ... from 0, with
//                P(x) = the float of x's bits & 0x7f800000 (2^E of x, exact; 0 for zero, +inf
//                for NaN); the lanes added as the tree above with add_up: S_j;
//   c_j = mul_up(fma_up(S_j, 2^-4, w.q_term), w.abs_scale), or 0 where the page is exact
//   (bounds[j] == 0; 1 on a lossy page): the device's sm_scale (2^-4 sum |q| 2^E + 2^-10 sum |q|).
// For an fp8-e4m3 code, P(k^) is 2^E of k^ for normal and subnormal codes alike (both decode to
// normal floats), so S_j is sum_c |q_c| 2^E(k^_jc) exactly as the witness's u_{t,c} counts it.
// meter_row_from_lanes turns a split's lanes into its MeterRow, lifted for every float rounding
// they and l went through (MeterLanes::roundings): the meter stays an upper bound.
#pragma once

#include <cstddef>
#include <cstdint>

namespace certkv::attention::detail {

struct RowState;

// K of E(c) above: e^{1/2} / 720 = 0.0022898906... rounded up (page_rows_test checks it).
inline constexpr float kExpm1RemainderCoefficient = 0.00228990f;
struct QueryBoundWeights;
struct MeterRow;

// One query row's meter sums over the pages of a split so far.
struct MeterLanes {
  float d[16];
  float rho[16];
  double large;
  // Float roundings of a lane and of l since the split began (the lift's count).
  int64_t roundings;
};

void clear_meter_lanes(MeterLanes* lanes);
// d = sum of lanes.d and lanes.large, rho = sum of lanes.rho, in double, each times
// (1 + 2^-23 (roundings + 8)) (the float roundings of a lane sum of non-negative terms and of l,
// 2 u each at most); rho rounded up to float.
void meter_row_from_lanes(const MeterLanes& lanes, MeterRow* out);

// The rows of one update: q: [n_rows][d], st: [n_rows], acc: [n_rows][d], p: scratch of n_rows x
// page_rows_stride(n_keys) floats. Metered calls: w: [n_rows] (query_bound_weights), lanes: [n_rows].
struct PageRows {
  const float* q = nullptr;
  int n_rows = 0;
  int d = 0;
  float scale = 0.f;
  RowState* st = nullptr;
  float* acc = nullptr;
  float* p = nullptr;
  const QueryBoundWeights* w = nullptr;
  MeterLanes* lanes = nullptr;
  // Metered calls: scratch of 2 min(n_rows, 8) page_rows_stride(n_keys) floats (each row's c and
  // E(c), made for up to eight rows at once).
  float* meter_terms = nullptr;
};

// Floats of p per row for a page of n_keys keys (whole vectors of 16).
inline size_t page_rows_stride(int n_keys) { return (size_t(n_keys) + 15) / 16 * 16; }

// A page: k, v: [n_keys][d] floats; metered: bounds band-major [width][bounds_stride] (Tier A
// witness or Tier B scales, as load_tile_metered writes them; the exponent witness: [n_keys], 1
// for a key of a lossy page, 0 for an exact one), rho: [n_keys].
struct PageTiles {
  const float* k = nullptr;
  const float* v = nullptr;
  int n_keys = 0;
  const float* bounds = nullptr;
  size_t bounds_stride = 0;
  const float* rho = nullptr;
};

struct PageRowsKernels {
  void (*update)(const PageRows& rows, const PageTiles& page);
  void (*update_tier_a)(const PageRows& rows, const PageTiles& page);
  void (*update_tier_b)(const PageRows& rows, const PageTiles& page);
  void (*update_exponent)(const PageRows& rows, const PageTiles& page);
};

// The kernels for head_dim d, or null where the inline paths of online_softmax.h run instead (no
// AVX-512, CERTKV_LOSSY_KERNEL capping the kernels below it, d not a multiple of 16 or above 128).
// Decode and prefill both ask here, so a query gets the same floats on either path.
const PageRowsKernels* page_rows_kernels(int d);

// The arithmetic above in scalar code. metered: 0 none, 1 Tier A, 2 Tier B, 3 the exponent witness.
void page_rows_update_ref(const PageRows& rows, const PageTiles& page, int metered);

// Operations of floats rounded toward +inf, as AVX-512's embedded rounding gives them: the smallest
// float >= a b + c (exact), and a + b, a b. Non-finite operands give what an FMA gives.
float fma_upward_ref(float a, float b, float c);
// The exponent witness's c_j of one key (metered 3 above, a lossy page): k: [d].
float exponent_bound_ref(const QueryBoundWeights& w, const float* q, const float* k, int d);

// E(c) of the arithmetic above in one lane (the kernel's expm1_upper16).
float expm1_upper_ref(float c);

// The AVX-512 kernels, or null where the build has none (page_rows_x86.cc).
const PageRowsKernels* page_rows_kernels_avx512();

}  // namespace certkv::attention::detail
