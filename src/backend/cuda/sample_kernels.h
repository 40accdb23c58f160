// Sampling on the device: the tokens of logit rows drawn by model::sample_token's definition
// (model/sampler.h), so that the CUDA backend brings back a token per sequence instead of its
// logits. Greedy rows take the argmax (argmax_rows' rule); rows with a temperature sort their keys
// (logit / T, -0 as +0, NaN as -inf) by a stable segmented radix sort (CUB), descending, so that
// equal keys keep the lower id first, then one thread block per row sums exp(x - x_0) in double
// over the kept candidates in chunks, finds the nucleus cut and the draw. The sums are those of
// the host's definition in another order: a draw whose uniform lies within rounding (about 1e-15
// of the row's mass) of a boundary between two candidates may take the neighbour; past the last
// boundary both take the last candidate of positive weight.
// Pointers are device pointers unless said; launches go to `stream` and return at once. Host
// code only includes this header (the kernels' translation unit is C++17).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cuda_status.h"

namespace certkv::backend::cuda {

// One row to sample: its logits are logits[logit_row]; a temperature below model::kGreedyTemperature
// is greedy.
struct SampleRow {
  int32_t logit_row = 0;
  int32_t top_k = 0;         // 0: no limit
  float temperature = 0.f;   // >= 0
  float top_p = 1.f;         // in (0, 1]
  double u = 0;              // the draw's uniform in [0, 1) (model::sample_uniform)
};

// out[r] = the first index of the largest of logits[r][0 .. n), as model::argmax (NaN never wins
// over an earlier value).
CudaStatus argmax_rows(const float* logits, int64_t rows, int n, int32_t* out, void* stream);

// Workspace bytes sample_rows needs for n_sampled rows with a temperature (0 when none).
size_t sample_rows_workspace_bytes(int n_sampled, int32_t n_vocab);

// tokens[j] = the token of rows[j], j < m (tokens and rows device pointers); rows (device) lists the greedy rows first
// (rows[0, n_greedy) are greedy, model::sample_greedy; the rest have a temperature >= model::kGreedyTemperature). logits: [*][n_vocab].
// Refuses (kInvalidArgument) bad counts, null pointers or a workspace smaller than
// sample_rows_workspace_bytes(m - n_greedy, n_vocab), before any launch.
CudaStatus sample_rows(const float* logits, int32_t n_vocab, const SampleRow* rows, int m, int n_greedy,
                       int32_t* tokens, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace certkv::backend::cuda
