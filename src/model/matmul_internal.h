// Internal to the model layer: what matmul.cc shares with its SIMD kernels (matmul_x86.cc, which
// compiles matmul_kernels.inc once per instruction set), and the kernels' entry points.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/thread_pool.h"
#include "format/ggml_blocks.h"
#include "model/matmul.h"

namespace certkv::model::detail {

inline bool is_float_type(format::GgmlType type) {
  return type == format::GgmlType::kF32 || type == format::GgmlType::kF16 || type == format::GgmlType::kBF16;
}

// Rows per parallel_for grain for n_rows rows of n_in inputs against n_tokens tokens: the rows
// split evenly over as many threads as have at least 2^17 multiply-adds each (a hand-off costs the
// pool a few microseconds of spinning), in multiples of 16 rows.
int64_t row_grain(int64_t n_in, int64_t n_rows, int64_t n_tokens, int n_threads);

// This thread's scratch for quantized activations, kept between calls: at least `bytes`, 64-byte
// aligned. Throws kOutOfMemory when it cannot grow.
uint8_t* thread_scratch(size_t bytes);

// The SIMD products of matmul_kernels.inc: the matrices of one call (all n_in equal, checked by
// matmul), float and quantized alike. Each runs only where the CPU has its instructions
// (matmul.cc's choice).
namespace avx2 {
void matmul_simd(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                 ThreadPool& pool);
}
namespace avx512 {
void matmul_simd(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                 ThreadPool& pool);
}

}  // namespace certkv::model::detail
