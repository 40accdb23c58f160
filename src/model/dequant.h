// Dequantization of ggml weight rows to float (CPU).
// Block semantics follow ggml (ggml-quants.c, dequantize_row_*); block structs are in
// format/ggml_blocks.h. Thread safety: the functions are pure (they only read src, write dst).
#pragma once

#include <cstdint>

#include "format/ggml_blocks.h"

namespace certkv::model {

// True for the types dequantize_row_ref and dequantize_row accept: F32, F16, BF16, Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
bool dequantize_supports(format::GgmlType type);

// dst[0..n) = the n elements stored at src, in plain scalar code.
// src: ggml_row_bytes(type, n) bytes (any alignment); dst: n floats.
// REQUIRES: n >= 0 and a multiple of ggml_block_elements(type).
// Throws certkv::Error: kUnsupported naming the type when !dequantize_supports(type),
// kInvalidArgument when n is not a whole number of blocks.
void dequantize_row_ref(format::GgmlType type, const void* src, float* dst, int64_t n);

// Same contract and the same floats as dequantize_row_ref (bit for bit); vectorized for F16, BF16,
// Q4_0, Q4_1 and Q8_0 when the build targets AVX-512, the reference otherwise.
void dequantize_row(format::GgmlType type, const void* src, float* dst, int64_t n);

// The 6-bit scale *sc and min *m of sub-block j (0..7) of a Q4_K / Q5_K super-block, unpacked
// from its 12 `scales` bytes: bytes 0-3 hold the low 6 bits of scales 0-3, bytes 4-7 those of
// mins 0-3, bytes 8-11 the low 4 bits of scales / mins 4-7, whose top 2 bits sit in the top bits
// of bytes 0-7 (ggml's get_scale_min_k4).
inline void k_quant_scale_min(int j, const uint8_t* scales, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = uint8_t((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
    *m = uint8_t((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

}  // namespace certkv::model
