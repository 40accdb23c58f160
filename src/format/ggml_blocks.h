// Quantized weight blocks in the layout of ggml (llama.cpp), as stored in GGUF files.
// Compiles under C++ and NVCC; sizes are locked so a reader can trust the byte offsets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace certkv::format {

// GGML tensor type ids as written in GGUF tensor infos.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

inline constexpr int kQK4_0 = 32;
inline constexpr int kQK4_1 = 32;
inline constexpr int kQK8_0 = 32;
inline constexpr int kQK_K = 256;      // super-block of the k-quants
inline constexpr int kKScaleSize = 12;  // packed 6-bit scales and mins of Q4_K / Q5_K

// Scales are IEEE fp16 bit patterns (format/numeric.h converts them).
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK4_0 / 2];  // low nibble: element j, high nibble: element j + 16
};
static_assert(sizeof(BlockQ4_0) == 18);

struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[kQK4_1 / 2];
};
static_assert(sizeof(BlockQ4_1) == 20);

struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34);

// Activation block for Q4_1-style dot products: s = d * sum(qs).
struct BlockQ8_1 {
  uint16_t d;
  uint16_t s;
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_1) == 36);

struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleSize];  // 8 sub-blocks of 32: 6-bit scale and 6-bit min each
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleSize];
  uint8_t qh[kQK_K / 8];  // fifth bit of each element
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ5_K) == 176);

struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];      // low 4 bits
  uint8_t qh[kQK_K / 4];      // high 2 bits
  int8_t scales[kQK_K / 16];  // 16 sub-blocks of 16, 8-bit scales
  uint16_t d;
};
static_assert(sizeof(BlockQ6_K) == 210);

// Activation block for k-quant dot products.
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};
static_assert(sizeof(BlockQ8_K) == 292);

}  // namespace certkv::format
