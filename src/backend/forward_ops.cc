#include "backend/forward_ops.h"

#include <cmath>

#include "core/x86_simd.h"

namespace certkv::backend {

using model::RopeLayout;

// gate[t][i] = silu(gate[t][i]) * up[t][i] = g / (1 + e^-g) * u, SwiGLU (Shazeer 2020), row by
// row so that a token's values do not depend on the rows beside it.
void swiglu_rows(float* gate, const float* up, int64_t n_rows, int64_t width) {
  for (int64_t t = 0; t < n_rows; ++t) {
    float* g = gate + t * width;
    const float* u = up + t * width;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // e^-g with -g clamped to +-87.3 (float's range): beyond it silu(g) is g or 0 to within
    // e^-87 relative.
    const __m256 limit = _mm256_set1_ps(87.3f), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= width; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 neg = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv),
                                                     _mm256_sub_ps(_mm256_setzero_ps(), limit)),
                                       limit);
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, simd::exp_range_reduced8(neg)));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < width; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// y = x / sqrt(mean(x^2) + eps) * w  (Zhang & Sennrich 2019).
void rms_norm(const float* x, const float* w, int n, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float inv = float(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// Rotates each head of x by the angles of its position (Su et al. 2021, RoFormer eq. 34).
// x: [n_heads][head_dim]; cos, sin: [head_dim / 2].
void apply_rope(float* x, int n_heads, int head_dim, RopeLayout layout, const float* cos, const float* sin) {
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + int64_t(h) * head_dim;
    for (int j = 0; j < half; ++j) {
      const int a = layout == RopeLayout::kInterleaved ? 2 * j : j;
      const int b = layout == RopeLayout::kInterleaved ? 2 * j + 1 : j + half;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * cos[j] - x1 * sin[j];
      v[b] = x0 * sin[j] + x1 * cos[j];
    }
  }
}

void add_bias(float* x, const std::vector<float>& b, int64_t n_rows) {
  const int64_t d = int64_t(b.size());
  for (int64_t t = 0; t < n_rows; ++t)
    for (int64_t i = 0; i < d; ++i) x[t * d + i] += b[i];
}

}  // namespace certkv::backend
