// The per-row operations of the Llama family's forward pass on the host: RMSNorm, RoPE, SwiGLU
// and bias. HostForward runs them; they are also the references the device forward kernels
// (backend/cuda/forward_kernels.h) are tested against. Each row's result depends on that row
// alone.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"

namespace certkv::backend {

// gate[t][i] = silu(gate[t][i]) * up[t][i] = g / (1 + e^-g) * u, SwiGLU (Shazeer 2020), for
// t < n_rows, i < width.
void swiglu_rows(float* gate, const float* up, int64_t n_rows, int64_t width);

// y = x / sqrt(mean(x^2) + eps) * w over n values (Zhang & Sennrich 2019); the mean in double.
// y may be x.
void rms_norm(const float* x, const float* w, int n, float eps, float* y);

// Rotates each head of x by the angles of its position (Su et al. 2021, RoFormer eq. 34): the
// pairs (2j, 2j + 1) for kInterleaved, (j, j + head_dim / 2) for kHalfSplit.
// x: [n_heads][head_dim]; cos, sin: [head_dim / 2].
void apply_rope(float* x, int n_heads, int head_dim, model::RopeLayout layout, const float* cos, const float* sin);

// x[t][i] += b[i] for t < n_rows, i < b.size().
void add_bias(float* x, const std::vector<float>& b, int64_t n_rows);

}  // namespace certkv::backend
