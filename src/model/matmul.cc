#include "model/matmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/cpu_features.h"
#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/matmul_internal.h"
#include "model/matmul_tiles.h"
#include "model/quantized_dot.h"

namespace certkv::model {

namespace detail {

int64_t row_grain(int64_t n_in, int64_t n_rows, int64_t n_tokens, int n_threads) {
  constexpr int64_t kMinMacsPerThread = int64_t(1) << 17;
  const int64_t macs = std::max<int64_t>(1, n_in * n_tokens) * n_rows;
  const int64_t n_chunks = std::clamp<int64_t>(macs / kMinMacsPerThread, 1, n_threads);
  const int64_t rows = (n_rows + n_chunks - 1) / n_chunks;
  return std::max<int64_t>(16, (rows + 15) / 16 * 16);
}

uint8_t* thread_scratch(size_t bytes) {
  struct Scratch {
    struct Free {
      void operator()(uint8_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, Free> buffer;
    size_t capacity = 0;
  };
  thread_local Scratch scratch;
  if (bytes > scratch.capacity) {
    const size_t capacity = (bytes + 63) / 64 * 64;
    scratch.buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, capacity)));
    scratch.capacity = scratch.buffer ? capacity : 0;
    if (!scratch.buffer) fail(StatusCode::kOutOfMemory, "matmul: cannot allocate activation scratch");
  }
  return scratch.buffer.get();
}

}  // namespace detail

namespace {

using detail::is_float_type;
using detail::row_grain;
using format::GgmlType;

void check_args(const WeightMatrix& w, int64_t n_tokens, const char* caller) {
  if (!matmul_supports(w.type)) {
    fail(StatusCode::kUnsupported, std::string(caller) + ": weight type " + ggml_type_name(w.type) +
                                       " (id " + std::to_string(static_cast<uint32_t>(w.type)) +
                                       ") is not supported");
  }
  const int64_t block = ggml_block_elements(w.type);
  if (w.n_in < 0 || w.n_out < 0 || n_tokens < 0 || w.n_in % block != 0) {
    fail(StatusCode::kInvalidArgument,
         std::string(caller) + ": bad shape: " + std::to_string(n_tokens) + " tokens x " +
             std::to_string(w.n_in) + " inputs -> " + std::to_string(w.n_out) + " outputs of " +
             ggml_type_name(w.type) + " (inputs must be a multiple of " + std::to_string(block) +
             ")");
  }
  if (w.row_bytes < ggml_row_bytes(w.type, w.n_in)) {
    fail(StatusCode::kInvalidArgument,
         std::string(caller) + ": row_bytes " + std::to_string(w.row_bytes) + " is less than the " +
             std::to_string(ggml_row_bytes(w.type, w.n_in)) + " bytes of a row of " +
             std::to_string(w.n_in) + " " + ggml_type_name(w.type) + " elements");
  }
  if (w.data == nullptr && w.n_out > 0 && w.n_in > 0) {
    fail(StatusCode::kInvalidArgument, std::string(caller) + ": weight data is null");
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: the reference algorithm, rows spread over the pool.

void matmul_portable(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y,
                     ThreadPool& pool) {
  if (is_float_type(w.type)) {
    pool.parallel_for(
        w.n_out, row_grain(w.n_in, w.n_out, n_tokens, pool.n_threads()), [&](int64_t r0, int64_t r1, int) {
          std::vector<float> row(size_t(w.n_in));
          for (int64_t r = r0; r < r1; ++r) {
            dequantize_row_ref(w.type, w.data + size_t(r) * w.row_bytes, row.data(), w.n_in);
            for (int64_t t = 0; t < n_tokens; ++t) {
              const float* xt = x + t * w.n_in;
              float sum = 0;
              for (int64_t i = 0; i < w.n_in; ++i) sum += row[size_t(i)] * xt[i];
              y[t * w.n_out + r] = sum;
            }
          }
        });
    return;
  }
  const int64_t block = activation_block_elements(w.type);
  std::vector<QuantizedActivation> acts(static_cast<size_t>(n_tokens));
  for (int64_t t = 0; t < n_tokens; ++t)
    acts[size_t(t)] = quantize_activation_ref(x + t * w.n_in, w.n_in, block);
  pool.parallel_for(
      w.n_out, row_grain(w.n_in, w.n_out, n_tokens, pool.n_threads()), [&](int64_t r0, int64_t r1, int) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t t = 0; t < n_tokens; ++t)
            y[t * w.n_out + r] =
                vec_dot_quantized_ref(w.type, w.data + size_t(r) * w.row_bytes, acts[size_t(t)]);
      });
}

}  // namespace

const char* matmul_kernel_name(MatmulKernel kernel) {
  switch (kernel) {
    case MatmulKernel::kAvx512:
      return "avx512";
    case MatmulKernel::kAvx2:
      return "avx2";
    case MatmulKernel::kPortable:
      break;
  }
  return "portable";
}

MatmulKernel matmul_kernel() {
  static const MatmulKernel kernel = [] {
    MatmulKernel cap = MatmulKernel::kAvx512;
    if (const char* env = std::getenv("CERTKV_MATMUL_KERNEL"))
      for (MatmulKernel k : {MatmulKernel::kPortable, MatmulKernel::kAvx2, MatmulKernel::kAvx512})
        if (std::string_view(env) == matmul_kernel_name(k)) cap = k;
#if defined(__x86_64__)
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    if (avx512 && cap >= MatmulKernel::kAvx512) return MatmulKernel::kAvx512;
    if (avx2 && cap >= MatmulKernel::kAvx2) return MatmulKernel::kAvx2;
#endif
    return MatmulKernel::kPortable;
  }();
  return kernel;
}

bool matmul_supports(GgmlType type) { return dequantize_supports(type); }

WeightMatrix weight_matrix(GgmlType type, const uint8_t* data, int64_t n_in, int64_t n_out) {
  WeightMatrix w;
  w.type = type;
  w.data = data;
  w.n_in = n_in;
  w.n_out = n_out;
  w.row_bytes = ggml_row_bytes(type, n_in);
  return w;
}

void matmul(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool) {
  matmul(std::span<const WeightMatrix>(&w, 1), x, n_tokens, std::span<float* const>(&y, 1), pool);
}

void matmul(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
            std::span<float* const> y, ThreadPool& pool) {
  if (w.size() != y.size())
    fail(StatusCode::kInvalidArgument, "matmul: " + std::to_string(w.size()) + " matrices but " +
                                           std::to_string(y.size()) + " outputs");
  for (const WeightMatrix& wm : w) {
    check_args(wm, n_tokens, "matmul");
    if (wm.n_in != w[0].n_in)
      fail(StatusCode::kInvalidArgument,
           "matmul: matrices sharing one input have " + std::to_string(w[0].n_in) + " and " +
               std::to_string(wm.n_in) + " inputs");
  }
  if (n_tokens == 0 || std::all_of(w.begin(), w.end(), [](const WeightMatrix& m) { return m.n_out == 0; }))
    return;
  // Matrices with tiles take the tile path (model/matmul_tiles.h) whatever the number of tokens;
  // the others the path below.
  auto tiled = [](const WeightMatrix& m) { return m.tiles != nullptr && m.n_out > 0; };
  if (std::any_of(w.begin(), w.end(), tiled) && matmul_tiles_available()) {
    std::vector<WeightMatrix> with, without;
    std::vector<float*> y_with, y_without;
    for (size_t m = 0; m < w.size(); ++m) {
      (tiled(w[m]) ? with : without).push_back(w[m]);
      (tiled(w[m]) ? y_with : y_without).push_back(y[m]);
    }
    matmul_tiled(with, x, n_tokens, y_with, pool);
    if (without.empty()) return;
    return matmul(without, x, n_tokens, y_without, pool);
  }
  switch (matmul_kernel()) {
    case MatmulKernel::kAvx512:
      return detail::avx512::matmul_simd(w, x, n_tokens, y, pool);
    case MatmulKernel::kAvx2:
      return detail::avx2::matmul_simd(w, x, n_tokens, y, pool);
    case MatmulKernel::kPortable:
      break;
  }
  for (size_t m = 0; m < w.size(); ++m)
    if (w[m].n_out > 0) matmul_portable(w[m], x, n_tokens, y[m], pool);
}

void matmul_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y) {
  check_args(w, n_tokens, "matmul_ref");
  std::vector<float> row(size_t(w.n_in));
  for (int64_t o = 0; o < w.n_out; ++o) {
    dequantize_row_ref(w.type, w.data + size_t(o) * w.row_bytes, row.data(), w.n_in);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * w.n_in;
      double sum = 0;
      for (int64_t i = 0; i < w.n_in; ++i) sum += double(row[size_t(i)]) * double(xt[i]);
      y[t * w.n_out + o] = float(sum);
    }
  }
}

void matmul_quantized_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y) {
  check_args(w, n_tokens, "matmul_quantized_ref");
  if (w.n_out == 0 || n_tokens == 0) return;
  ThreadPool single(1);
  matmul_portable(w, x, n_tokens, y, single);
}

}  // namespace certkv::model
