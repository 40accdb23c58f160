#include "model/matmul_float.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/dequant.h"
#include "model/ggml_type.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace certkv::model {

namespace {

constexpr int64_t kTokenTile = 4;  // token rows multiplied per pass over a dequantized weight row

// sum_i a[i] * b[i] in fp32 with 16 independent lanes.
inline float dot_f32(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  float s = 0;
  for (int l = 0; l < 8; ++l) s += lanes[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#endif
}

void check(const WeightMatrix& w, int64_t n_tokens) {
  if (!matmul_supports(w.type))
    fail(StatusCode::kUnsupported, std::string("matmul_float: weight type ") + ggml_type_name(w.type) +
                                       " is not supported");
  if (w.n_in <= 0 || w.n_out <= 0 || n_tokens < 0 || w.row_bytes < ggml_row_bytes(w.type, w.n_in))
    fail(StatusCode::kInvalidArgument, "matmul_float: bad shape");
}

}  // namespace

const char* activation_format_name(ActivationFormat f) {
  return f == ActivationFormat::kInt8 ? "int8" : "f32";
}

void matmul_float(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool) {
  check(w, n_tokens);
  if (n_tokens == 0) return;
  const int64_t n_in = w.n_in, n_out = w.n_out;
  std::vector<std::vector<float>> rows(size_t(pool.n_threads()), std::vector<float>(size_t(n_in)));
  pool.parallel_for(n_out, 16, [&](int64_t begin, int64_t end, int thread) {
    float* row = rows[size_t(thread)].data();
    for (int64_t o = begin; o < end; ++o) {
      dequantize_row(w.type, w.data + size_t(o) * w.row_bytes, row, n_in);
      for (int64_t t0 = 0; t0 < n_tokens; t0 += kTokenTile) {
        const int64_t t1 = std::min(n_tokens, t0 + kTokenTile);
        for (int64_t t = t0; t < t1; ++t) y[t * n_out + o] = dot_f32(row, x + t * n_in, n_in);
      }
    }
  });
}

void matmul(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool,
            ActivationFormat format) {
  if (format == ActivationFormat::kFloat32)
    matmul_float(w, x, n_tokens, y, pool);
  else
    matmul(w, x, n_tokens, y, pool);
}

void matmul(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
            std::span<float* const> y, ThreadPool& pool, ActivationFormat format) {
  if (format == ActivationFormat::kInt8) return matmul(w, x, n_tokens, y, pool);
  if (w.size() != y.size()) fail(StatusCode::kInvalidArgument, "matmul: matrices and outputs differ in number");
  for (size_t m = 0; m < w.size(); ++m) matmul_float(w[m], x, n_tokens, y[m], pool);
}

}  // namespace certkv::model
