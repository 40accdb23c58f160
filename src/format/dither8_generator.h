// The dither8 generator (docs/format/dither8.md, "Generator"): the 8-bit subtractive dither of
// every element of a dither8 page, regenerated on read. Shared by the host codec
// (src/codec/lossy_page.h, whose dither8_xi is the scalar reference) and device kernels: only
// constexpr integer arithmetic, no allocation, no exceptions.
//
// One 32-bit seed per page row, then one 32-bit word per four channels, 8 bits each:
//   row_seed = dither8_row_seed(key, counter)      key = dither8_key(layer, K/V, kv_head)
//                                                  counter = block * block_tokens + row
//   word_w   = dither8_word(row_seed, w)           serves channels 4w .. 4w + 3 (w < 64)
//   u_c      = dither8_u(word_{c / 4}, c)          byte c % 4 of the word
//   xi_c     = (u_c + 1/2) / 256 - 1/2             an odd multiple of 2^-9 in (-1/2, 1/2),
//                                                  exact in float and in fp16
// Since byte c % 4 of word c / 4 is byte c of the row's words stored little-endian, a kernel may
// also read u from those words as a byte array.
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::format {

// The 32-bit finalizer of MurmurHash3: a bijection of 32-bit words.
CERTKV_HD constexpr uint32_t dither8_fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The seed of one page row. Every bit of the 64-bit key and of the 64-bit counter enters it
// (the counter is below 2^44: block < 2^32, block_tokens <= 4096).
CERTKV_HD constexpr uint32_t dither8_row_seed(uint64_t key, uint64_t counter) {
  const uint32_t r = dither8_fmix32(uint32_t(counter) ^ uint32_t(key >> 32));
  return dither8_fmix32(r ^ uint32_t(counter >> 32) ^ uint32_t(key));
}

// The word serving channels 4w .. 4w + 3 of the row. REQUIRES: 0 <= w < 64. The inputs
// row_seed + w * 0x9e3779b9 (an odd multiplier) are distinct mod 2^32 for distinct w, and the
// finalizer is a bijection, so the 64 words of one row are distinct.
CERTKV_HD constexpr uint32_t dither8_word(uint32_t row_seed, int w) {
  return dither8_fmix32(row_seed + uint32_t(w) * 0x9e3779b9u);
}

// The 8-bit dither index u of channel c: byte c % 4 of word c / 4. REQUIRES: 0 <= c < 256.
CERTKV_HD constexpr uint32_t dither8_u(uint32_t word, int c) {
  return (word >> (8 * (c % 4))) & 0xffu;
}

}  // namespace certkv::format
