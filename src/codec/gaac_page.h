// Internal to the codec layer: the geometry of a GAAC page and the pieces shared by the plain
// (gaac.cc) and SIMD (gaac_x86.cc) coders. Not for use outside src/codec/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "codec/gaac.h"
#include "format/gaac_layout.h"

namespace certkv::codec::detail {

using PageGeometry = GaacPageGeometry;

// kInvalidArgument naming the value when block_tokens < 1 or head_dim has no tiling.
PageGeometry page_geometry(GaacElement element, int block_tokens, int head_dim);
// kInvalidArgument when the bases are not head_dim long or a window leaves the exponent range.
void check_bases(const PageGeometry& geometry, const GaacBases& bases);

// Escape bytes of a group in `mode` (the mode must be valid for the element).
inline int escape_bytes_of_mode(const PageGeometry& g, unsigned mode) {
  return format::gaac_mode_escape_bytes(g.element, static_cast<uint8_t>(mode));
}

inline unsigned tag_of_group(const uint8_t* tags, size_t group) {
  return (tags[group / 4] >> (2 * (group % 4))) & 3u;
}

// Escape bytes of groups [group_begin, group_end) of tile `tile`, from their tags; kCorrupt naming
// the first group whose tag is not valid for the element.
size_t escape_bytes_of_tags(const PageGeometry& g, const uint8_t* tile_start, int tile,
                            size_t group_begin, size_t group_end);

// kCorrupt: group `group` of tile `tile` has a mode tag not valid for the element.
[[noreturn]] void fail_bad_tag(int tile, size_t group, unsigned tag, GaacElement element);
// kCorrupt: the slot is shorter than the fixed part.
[[noreturn]] void fail_truncated_slot(const PageGeometry& g, size_t slot_bytes);
// kCorrupt: group `group` of tile `tile` needs escape bytes [escape_begin, escape_end) but the
// slot's escape area holds only `area_bytes`.
[[noreturn]] void fail_escape_overrun(int tile, size_t group, size_t escape_end,
                                      size_t area_bytes);

// Little-endian loads and stores of n <= 8 bytes.
inline uint64_t load_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}
inline void store_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// SIMD paths (gaac_x86.cc); same contracts as the public functions, on a checked geometry.
size_t encode_page_bf16_avx2(const uint16_t* bf16, const PageGeometry& g, const GaacBases& bases,
                             size_t escape_capacity_bytes, uint8_t* out);
void decode_rows_bf16_avx2(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                           const GaacBases& bases, int token_begin, int token_end, uint16_t* out);
void decode_rows_float_avx2(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                            const GaacBases& bases, int token_begin, int token_end, float* out);
size_t encode_page_bf16_avx512(const uint16_t* bf16, const PageGeometry& g,
                               const GaacBases& bases, size_t escape_capacity_bytes,
                               uint8_t* out);
void decode_rows_bf16_avx512(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                             const GaacBases& bases, int token_begin, int token_end,
                             uint16_t* out);
void decode_rows_float_avx512(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                              const GaacBases& bases, int token_begin, int token_end, float* out);
bool cpu_has_avx2();
bool cpu_has_avx512();

}  // namespace certkv::codec::detail
