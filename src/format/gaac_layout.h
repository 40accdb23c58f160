// Byte layout of a GAAC-encoded KV page (DESIGN.md section 3, seed 003; prose and tables in
// docs/format/gaac.md). Shared by the host codec (src/codec/gaac.h) and device kernels: only
// constexpr arithmetic on sizes, no allocation, no exceptions.
//
// A page is one block of block_tokens tokens x head_dim channels of one (layer, K or V, kv_head),
// token-major. Its head_dim channels are split into n_tiles tiles of tile_channels channels each
// (tile_channels <= 128). Inside a tile, group g (8 elements) covers token
// t = g / (tile_channels / 8), channels 8 * (g % (tile_channels / 8)) ... + 7 of that tile.
//
// Page = tile 0 fixed part | tile 1 fixed part | ... | escape area (escape_capacity bytes).
// Tile fixed part = sign+mantissa stream | 3-bit code stream | 2-bit mode tags.
// Every per-group field of w bits per element is packed little-endian into w bytes: element j of
// the group owns bits [w*j, w*j + w) of the group's w-byte little-endian bit string.
// Escapes are written in page group order (tile 0 group 0 first); a group's escape position is
// the sum of the escape sizes of the groups before it, so it follows from the tags alone.
#pragma once

#include <cstddef>
#include <cstdint>

#include "format/numeric.h"

namespace certkv::format {

// The element whose exponent is coded.
enum class GaacElement : uint8_t {
  kBf16 = 0,     // sign 1, exponent 8, mantissa 7
  kFp8E4M3 = 1,  // sign 1, exponent 4, mantissa 3 (OCP FP8 E4M3)
  kFp8E5M2 = 2,  // sign 1, exponent 5, mantissa 2 (OCP FP8 E5M2)
};

inline constexpr int kGaacGroupElements = 8;
inline constexpr int kGaacMaxTileChannels = 128;
inline constexpr int kGaacCodeBits = 3;  // the common low-bit stream: 3 bits per element
inline constexpr int kGaacTagBits = 2;
inline constexpr int kGaacGroupsPerTagByte = 8 / kGaacTagBits;

// Mode tag values (2 bits per group).
inline constexpr uint8_t kGaacMode3Bit = 0;    // exponent = b3 + code, code in [0, 8)
inline constexpr uint8_t kGaacMode4Bit = 1;    // exponent = b4 + code, code in [0, 16)
inline constexpr uint8_t kGaacModeRaw = 2;     // exponent = code (base 0), all exponent bits
inline constexpr uint8_t kGaacModeInvalid = 3; // never written; a decoder rejects it

CERTKV_HD constexpr int gaac_exponent_bits(GaacElement e) {
  return e == GaacElement::kBf16 ? 8 : e == GaacElement::kFp8E4M3 ? 4 : 5;
}
// Sign and mantissa kept together: sign << mantissa_bits | mantissa.
CERTKV_HD constexpr int gaac_sign_mantissa_bits(GaacElement e) {
  return 1 + (e == GaacElement::kBf16 ? 7 : e == GaacElement::kFp8E4M3 ? 3 : 2);
}
CERTKV_HD constexpr int gaac_element_bytes(GaacElement e) { return e == GaacElement::kBf16 ? 2 : 1; }

// Whether a mode tag may appear in a page of element e. The 4-bit mode of a 4-bit exponent
// (E4M3) would be the raw mode with a base, so E4M3 pages use only the 3-bit and raw modes.
CERTKV_HD constexpr bool gaac_mode_valid(GaacElement e, uint8_t mode) {
  return mode == kGaacMode3Bit || mode == kGaacModeRaw ||
         (mode == kGaacMode4Bit && gaac_exponent_bits(e) > 4);
}

// Escape bytes of one group in a mode: the exponent bits above the 3 in the code stream,
// 8 elements each. BF16: 3-bit 0, 4-bit 1, raw 5. E5M2: 0, 1, 2. E4M3: 0, -, 1.
CERTKV_HD constexpr int gaac_mode_escape_bytes(GaacElement e, uint8_t mode) {
  return mode == kGaacMode4Bit ? 1 : mode == kGaacModeRaw ? gaac_exponent_bits(e) - kGaacCodeBits : 0;
}

// Channels per tile: head_dim split into ceil(head_dim / 128) equal tiles. 0 when head_dim is
// not positive, not a multiple of 8, or does not split into equal multiples of 8.
CERTKV_HD constexpr int gaac_tile_channels(int head_dim) {
  if (head_dim <= 0 || head_dim % kGaacGroupElements != 0) return 0;
  const int n_tiles = (head_dim + kGaacMaxTileChannels - 1) / kGaacMaxTileChannels;
  if (head_dim % n_tiles != 0) return 0;
  const int channels = head_dim / n_tiles;
  return channels % kGaacGroupElements == 0 ? channels : 0;
}
CERTKV_HD constexpr int gaac_n_tiles(int head_dim) {
  const int c = gaac_tile_channels(head_dim);
  return c == 0 ? 0 : head_dim / c;
}

CERTKV_HD constexpr size_t gaac_tile_groups(int block_tokens, int tile_channels) {
  return size_t(block_tokens) * size_t(tile_channels) / kGaacGroupElements;
}
CERTKV_HD constexpr size_t gaac_groups_per_token(int tile_channels) {
  return size_t(tile_channels) / kGaacGroupElements;
}

// Offsets inside one tile's fixed part, from the tile start.
CERTKV_HD constexpr size_t gaac_tile_sign_mantissa_offset() { return 0; }
CERTKV_HD constexpr size_t gaac_tile_code_offset(GaacElement e, int block_tokens, int tile_channels) {
  return gaac_tile_groups(block_tokens, tile_channels) * size_t(gaac_sign_mantissa_bits(e));
}
CERTKV_HD constexpr size_t gaac_tile_tag_offset(GaacElement e, int block_tokens, int tile_channels) {
  return gaac_tile_code_offset(e, block_tokens, tile_channels) +
         gaac_tile_groups(block_tokens, tile_channels) * size_t(kGaacCodeBits);
}
CERTKV_HD constexpr size_t gaac_tile_tag_bytes(int block_tokens, int tile_channels) {
  return (gaac_tile_groups(block_tokens, tile_channels) + kGaacGroupsPerTagByte - 1) /
         kGaacGroupsPerTagByte;
}
CERTKV_HD constexpr size_t gaac_tile_fixed_bytes(GaacElement e, int block_tokens, int tile_channels) {
  return gaac_tile_tag_offset(e, block_tokens, tile_channels) +
         gaac_tile_tag_bytes(block_tokens, tile_channels);
}

// Offsets inside a page, from the slot start. REQUIRES: gaac_tile_channels(head_dim) != 0.
CERTKV_HD constexpr size_t gaac_page_tile_offset(GaacElement e, int block_tokens, int head_dim,
                                                 int tile) {
  return size_t(tile) * gaac_tile_fixed_bytes(e, block_tokens, gaac_tile_channels(head_dim));
}
CERTKV_HD constexpr size_t gaac_page_fixed_bytes(GaacElement e, int block_tokens, int head_dim) {
  return gaac_page_tile_offset(e, block_tokens, head_dim, gaac_n_tiles(head_dim));
}
CERTKV_HD constexpr size_t gaac_page_escape_offset(GaacElement e, int block_tokens, int head_dim) {
  return gaac_page_fixed_bytes(e, block_tokens, head_dim);
}
// Bytes of a slot: the fixed parts plus the calibrated escape capacity.
CERTKV_HD constexpr size_t gaac_slot_bytes(GaacElement e, int block_tokens, int head_dim,
                                           size_t escape_capacity_bytes) {
  return gaac_page_fixed_bytes(e, block_tokens, head_dim) + escape_capacity_bytes;
}
// The same block stored raw (BF16 or FP8 bytes, token-major).
CERTKV_HD constexpr size_t gaac_page_raw_bytes(GaacElement e, int block_tokens, int head_dim) {
  return size_t(block_tokens) * size_t(head_dim) * size_t(gaac_element_bytes(e));
}
// Escape bytes when every group is raw: no page needs a larger escape capacity.
CERTKV_HD constexpr size_t gaac_page_max_escape_bytes(GaacElement e, int block_tokens, int head_dim) {
  return size_t(gaac_n_tiles(head_dim)) *
         gaac_tile_groups(block_tokens, gaac_tile_channels(head_dim)) *
         size_t(gaac_mode_escape_bytes(e, kGaacModeRaw));
}

// Locked sizes. SmolLM2 (head_dim 64, 16-token blocks): one 64-channel tile of 1440 bytes.
static_assert(gaac_tile_channels(64) == 64 && gaac_n_tiles(64) == 1);
static_assert(gaac_tile_code_offset(GaacElement::kBf16, 16, 64) == 1024);
static_assert(gaac_tile_tag_offset(GaacElement::kBf16, 16, 64) == 1024 + 384);
static_assert(gaac_page_fixed_bytes(GaacElement::kBf16, 16, 64) == 1024 + 384 + 32);
// The seed's Table 9: head_dim 256 as two 128-channel tiles of 2048 + 768 + 64 bytes.
static_assert(gaac_tile_channels(256) == 128 && gaac_n_tiles(256) == 2);
static_assert(gaac_tile_fixed_bytes(GaacElement::kBf16, 16, 128) == 2048 + 768 + 64);
static_assert(gaac_page_fixed_bytes(GaacElement::kBf16, 16, 256) == 2 * 2880);
static_assert(gaac_page_max_escape_bytes(GaacElement::kBf16, 16, 64) == 128 * 5);
static_assert(gaac_tile_channels(96) == 96 && gaac_tile_channels(192) == 96 &&
              gaac_tile_channels(200) == 0 && gaac_tile_channels(12) == 0);
// FP8: E4M3 keeps 4 sign+mantissa bits (2 per byte), E5M2 3 bits (8 elements in 3 bytes).
static_assert(gaac_page_fixed_bytes(GaacElement::kFp8E4M3, 16, 64) == 512 + 384 + 32);
static_assert(gaac_page_fixed_bytes(GaacElement::kFp8E5M2, 16, 64) == 384 + 384 + 32);
static_assert(gaac_mode_escape_bytes(GaacElement::kFp8E4M3, kGaacModeRaw) == 1);
static_assert(gaac_mode_escape_bytes(GaacElement::kFp8E5M2, kGaacModeRaw) == 2);
static_assert(!gaac_mode_valid(GaacElement::kFp8E4M3, kGaacMode4Bit));
static_assert(!gaac_mode_valid(GaacElement::kBf16, kGaacModeInvalid));

}  // namespace certkv::format
