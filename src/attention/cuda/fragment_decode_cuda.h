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

}  // namespace certkv::attention::cuda
