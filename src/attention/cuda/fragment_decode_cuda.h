// The split kernel over fragment-major pages (fragment_layout.h), which paged_decode launches for
// PageFormat::kBf16Fragments: the skeleton the page classes move onto (docs/cuda.md, "Fragment-major
// pages"). Per warp a ring of page pairs filled by the bulk copy engine (cp.async.bulk completing
// on an mbarrier, lane 0 issuing the next page while the others compute), the tensor cores fed
// straight from 16-byte shared-memory loads of the pages' operand registers, and the splits of a
// row merged by the last of its CTAs to finish (a counter per (sequence, KV head)), with no merge
// launch after it. Internal to the attention layer's CUDA half.
#pragma once

#include <cstdint>

#include "attention/cuda/paged_decode_cuda.h"

namespace certkv::attention::cuda {

struct FragmentSplitArgs {
  PagedDecodeParams p;
  int n_splits = 0;
  int64_t per_split = 0;                    // blocks of one split
  float* part_mldr = nullptr;               // [batch][n_q][n_splits][4]: m, l, d, r
  float* part_o = nullptr;                  // [batch][n_q][n_splits][D]
  unsigned int* split_counters = nullptr;   // [batch][n_kv_heads], zero between launches
  unsigned int* error_word = nullptr;
};

// Launches the kernel on a.p.stream (head_dim 64 or 128, checked by the caller).
CudaStatus launch_fragment_split(const FragmentSplitArgs& a);
// CTAs of the kernel one multiprocessor holds at once (for p's format, head_dim and meter).
int fragment_resident_ctas(const PagedDecodeParams& p);
// CTAs per multiprocessor the split plan fills (at most the resident ones), per page class:
// measured on an H100 (32 / 8 heads, 64K and 128K): bf16 pages 1 (batch 1 2-4% faster than a
// full wave of 3, batch 8 the same), fp8 and dither8 3 (at 1, 1.4-2x slower at batch 8: too few
// warps for their arithmetic; fp8 at 4 CTAs, 66 splits, 5-9% slower at batch 1 than at 33-49).
int fragment_planned_ctas_per_sm(const PagedDecodeParams& p);

// sqrt_upper (tile_mma.cuh, the square roots of dither8's certificate) over every finite float
// v >= 0, bit patterns 0 .. 0x7f7fffff: `below` counts the v whose bound b is below sqrt(v) (b^2 < v,
// exact in double), `loose` those from 2^-126 up whose bound exceeds sqrt(v) by more than 2^-17
// relative; and the bound of 0, +inf and a NaN. For its test (paged_decode_cuda_test).
struct SqrtUpperCheck {
  unsigned long long checked = 0, below = 0, loose = 0;
  float at_zero = 0.f, at_inf = 0.f, at_nan = 0.f;
};
CudaStatus check_sqrt_upper(SqrtUpperCheck* out);

}  // namespace certkv::attention::cuda
