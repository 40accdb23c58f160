// Internal to the attention layer: the meter's per-page arithmetic of decode attention, chosen at
// run time. With AVX-512 (page_meter_x86.cc) a 16-token page is one vector; otherwise the
// inline paths of online_softmax.h. Both evaluate the same formulas with the same upward margins
// (docs/attention.md, docs/meter.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace certkv::attention::detail {

struct QueryBoundWeights;

// Bounds at or above this use double exponentials (e^{c} would leave float's range).
inline constexpr float kLargeLogitBound = 60.f;

struct MeterKernels {
  // Whether some c[j] is at or above kLargeLogitBound, or NaN.
  bool (*any_large_bound)(const float* c, int n_keys);
  // d = sum_j p[j] (e^{c[j]} - 1) over the keys whose bound is below kLargeLogitBound, and
  // r = sum_j p[j] rho[j].
  void (*sums)(const float* p, const float* c, const float* rho, int n_keys, float* d, float* r);
  // For the query rows of a group at once (decode attention: one call per page, the page's
  // bounds read once for every row), each row's floats those it gets alone (group 1):
  //   group_bounds_*: c[g * tile_keys + j] = the Tier A / Tier B bounds of row g (w[g];
  //                   logit_bounds<false> / <true>), and large[g] = 1 when any_large_bound of
  //                   them, else 0;
  //   group_sums:     d[g], r[g] = sums of p + g * tile_keys and c + g * tile_keys.
  void (*group_bounds_a)(const QueryBoundWeights* w, int group, const float* bounds_t, size_t tile_keys, int n_keys,
                         float* c, uint8_t* large);
  void (*group_bounds_b)(const QueryBoundWeights* w, int group, const float* bounds_t, size_t tile_keys, int n_keys,
                         float* c, uint8_t* large);
  void (*group_sums)(const float* p, const float* c, const float* rho, size_t tile_keys, int group, int n_keys,
                     float* d, float* r);
  // dst[i * dst_stride + j] = the fp16 src[i * src_stride + j] as float, i < rows, j < n (exact), for
  // side data that are upper bounds (a witness, rho): a value below 0 or NaN is a corrupt page and
  // reads as +inf, never as a smaller bound (codec::lossy_witness_bounds's rule).
  void (*bounds_from_fp16)(const uint16_t* src, size_t src_stride, int rows, int n, float* dst, size_t dst_stride);
};

// The AVX-512 kernels, or null where the build has none.
const MeterKernels* meter_kernels_avx512();

}  // namespace certkv::attention::detail
