// Internal to the attention layer: the meter's per-page arithmetic of decode attention, chosen at
// run time. With AVX-512 (page_meter_x86.cc) a 16-token page is one vector; otherwise the
// inline paths of online_softmax.h. Both evaluate the same formulas with the same upward margins
// (docs/attention.md, docs/meter.md).
#pragma once

#include <cstddef>

namespace certkv::attention::detail {

struct QueryBoundWeights;

// Bounds at or above this use double exponentials (e^{c} would leave float's range).
inline constexpr float kLargeLogitBound = 60.f;

struct MeterKernels {
  // c[j] for the keys of a tile, Tier A and Tier B (logit_bounds<false> / <true>).
  void (*logit_bounds_a)(const QueryBoundWeights& w, const float* bounds_t, size_t tile_keys, int n_keys, float* c);
  void (*logit_bounds_b)(const QueryBoundWeights& w, const float* bounds_t, size_t tile_keys, int n_keys, float* c);
  // Whether some c[j] is at or above kLargeLogitBound, or NaN.
  bool (*any_large_bound)(const float* c, int n_keys);
  // d = sum_j p[j] (e^{c[j]} - 1) over the keys whose bound is below kLargeLogitBound, and
  // r = sum_j p[j] rho[j].
  void (*sums)(const float* p, const float* c, const float* rho, int n_keys, float* d, float* r);
};

// The AVX-512 kernels, or null where the build has none.
const MeterKernels* meter_kernels_avx512();

}  // namespace certkv::attention::detail
