// The SIMD weight products (matmul_internal.h): matmul_kernels.inc compiled twice, for AVX2 (with
// FMA and F16C) and for AVX-512 (F, BW, VL, DQ, VNNI, VBMI), each in a target region of its own
// (core/target_region.h) and in its own namespace, so that the build needs no
// -march flag; matmul.cc picks one at run time (matmul_kernel). The headers are included before
// the pragmas, so what they define is compiled for the build's own target and stays one
// definition; only the kernels' own functions (internal to their namespace) take the wider
// instructions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/status.h"
#include "core/target_region.h"
#include "core/x86_simd.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/matmul_internal.h"
#include "model/quantized_dot.h"

#if defined(__x86_64__)

CERTKV_TARGET_PUSH("avx2,fma,f16c")
namespace certkv::model::detail::avx2 {
namespace {
#define CERTKV_MATMUL_AVX2 1
#include "model/matmul_kernels.inc"
#undef CERTKV_MATMUL_AVX2
}  // namespace

void matmul_simd(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                 ThreadPool& pool) {
  simd_products(w, x, n_tokens, y, pool);
}

}  // namespace certkv::model::detail::avx2
CERTKV_TARGET_POP()

CERTKV_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")
#define CERTKV_ACTIVATION_BLOCKS_AVX512 1
#include "model/activation_blocks_x86.h"
namespace certkv::model::detail::avx512 {
namespace {
#define CERTKV_MATMUL_AVX512 1
#include "model/matmul_kernels.inc"
#undef CERTKV_MATMUL_AVX512
}  // namespace

void matmul_simd(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                 ThreadPool& pool) {
  simd_products(w, x, n_tokens, y, pool);
}

}  // namespace certkv::model::detail::avx512
CERTKV_TARGET_POP()

#else

namespace certkv::model::detail {
// matmul_kernel() never picks these off x86.
void avx2::matmul_simd(std::span<const WeightMatrix>, const float*, int64_t, std::span<float* const>, ThreadPool&) {
  fail(StatusCode::kUnsupported, "matmul: the AVX2 kernels need an x86-64 CPU");
}
void avx512::matmul_simd(std::span<const WeightMatrix>, const float*, int64_t, std::span<float* const>, ThreadPool&) {
  fail(StatusCode::kUnsupported, "matmul: the AVX-512 kernels need an x86-64 CPU");
}
}  // namespace certkv::model::detail

#endif
