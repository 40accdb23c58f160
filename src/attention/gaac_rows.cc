#include "attention/gaac_rows.h"

#include <cstring>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define CERTKV_GAAC_ROWS_X86 1
#endif

namespace certkv::attention {

namespace {

using format::GaacElement;

// The page shape, from format/gaac_layout.h (BF16 elements: 8 sign+mantissa bits per element).
struct Geometry {
  int head_dim;
  int tile_channels;
  int n_tiles;
  int groups_per_token;  // per tile
  size_t tile_groups;
  size_t code_offset;  // from the tile start
  size_t tag_offset;
  size_t tile_fixed_bytes;
  size_t page_fixed_bytes;
};

Geometry checked_geometry(int block_tokens, int head_dim, const codec::GaacBases& bases,
                          int n_rows) {
  const int channels = format::gaac_tile_channels(head_dim);
  if (block_tokens < 1 || channels == 0) {
    fail(StatusCode::kInvalidArgument, "gaac_rows_to_float: block_tokens " +
                                           std::to_string(block_tokens) + ", head_dim " +
                                           std::to_string(head_dim) + " is not a GAAC page shape");
  }
  if (n_rows < 0 || n_rows > block_tokens) {
    fail(StatusCode::kInvalidArgument, "gaac_rows_to_float: n_rows " + std::to_string(n_rows) +
                                           " outside [0, " + std::to_string(block_tokens) + "]");
  }
  if (bases.b3.size() != size_t(head_dim) || bases.b4.size() != size_t(head_dim)) {
    fail(StatusCode::kInvalidArgument, "gaac_rows_to_float: bases hold " +
                                           std::to_string(bases.b3.size()) + " / " +
                                           std::to_string(bases.b4.size()) + " channels, not " +
                                           std::to_string(head_dim));
  }
  Geometry g;
  g.head_dim = head_dim;
  g.tile_channels = channels;
  g.n_tiles = format::gaac_n_tiles(head_dim);
  g.groups_per_token = int(format::gaac_groups_per_token(channels));
  g.tile_groups = format::gaac_tile_groups(block_tokens, channels);
  g.code_offset = format::gaac_tile_code_offset(GaacElement::kBf16, block_tokens, channels);
  g.tag_offset = format::gaac_tile_tag_offset(GaacElement::kBf16, block_tokens, channels);
  g.tile_fixed_bytes = format::gaac_tile_fixed_bytes(GaacElement::kBf16, block_tokens, channels);
  g.page_fixed_bytes = format::gaac_page_fixed_bytes(GaacElement::kBf16, block_tokens, head_dim);
  return g;
}

[[noreturn]] void fail_corrupt(const std::string& what) {
  fail(StatusCode::kCorrupt, "GAAC slot: " + what);
}

// The slot's escape area, read in page group order.
struct Escapes {
  const uint8_t* area;
  size_t size;
  size_t pos;

  const uint8_t* take(size_t n, int tile, size_t group) {
    if (pos + n > size) {
      fail_corrupt("tile " + std::to_string(tile) + " group " + std::to_string(group) +
                   " needs escape bytes up to " + std::to_string(pos + n) + " but the slot has " +
                   std::to_string(size));
    }
    const uint8_t* p = area + pos;
    pos += n;
    return p;
  }
};

inline unsigned tag_of(const uint8_t* tags, size_t group) {
  return (tags[group / 4] >> (2 * (group % 4))) & 3u;
}

inline uint32_t load_le24(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16;
}

// The float of the bf16 with this sign+mantissa byte and exponent: bits (bf16 << 16).
inline float float_of(uint8_t sign_mantissa, unsigned exponent) {
  const uint32_t bits = uint32_t(sign_mantissa & 0x80u) << 24 | uint32_t(exponent & 0xffu) << 23 |
                        uint32_t(sign_mantissa & 0x7fu) << 16;
  return format::bits_to_float(bits);
}

// Group `group` of a tile (its 8 channels' bases b3, b4) into out[0, 8).
inline void decode_group(const Geometry& g, const uint8_t* tile_start, int tile, size_t group,
                         const uint8_t* b3, const uint8_t* b4, Escapes& escapes, float* out) {
  const unsigned mode = tag_of(tile_start + g.tag_offset, group);
  const uint32_t codes = load_le24(tile_start + g.code_offset + 3 * group);
  const uint8_t* sign_mantissa = tile_start + 8 * group;
  unsigned e[8];
  if (mode == format::kGaacMode3Bit) {
    for (int j = 0; j < 8; ++j) e[j] = b3[j] + ((codes >> (3 * j)) & 7u);
  } else if (mode == format::kGaacMode4Bit) {
    const uint8_t high = *escapes.take(1, tile, group);
    for (int j = 0; j < 8; ++j) e[j] = b4[j] + (((codes >> (3 * j)) & 7u) | ((high >> j) & 1u) << 3);
  } else if (mode == format::kGaacModeRaw) {
    const uint8_t* p = escapes.take(5, tile, group);
    uint64_t high = 0;
    for (int i = 0; i < 5; ++i) high |= uint64_t(p[i]) << (8 * i);
    for (int j = 0; j < 8; ++j) {
      e[j] = ((codes >> (3 * j)) & 7u) | unsigned((high >> (5 * j)) & 31u) << 3;
    }
  } else {
    fail_corrupt("tile " + std::to_string(tile) + " group " + std::to_string(group) +
                 " has the invalid mode tag 3");
  }
  for (int j = 0; j < 8; ++j) out[j] = float_of(sign_mantissa[j], e[j]);
}

// Escape bytes of groups [begin, end) of a tile, from their tags.
size_t escape_bytes_of_groups(const Geometry& g, const uint8_t* tile_start, int tile, size_t begin,
                              size_t end) {
  size_t bytes = 0;
  for (size_t group = begin; group < end; ++group) {
    const unsigned mode = tag_of(tile_start + g.tag_offset, group);
    if (mode == format::kGaacModeInvalid) {
      fail_corrupt("tile " + std::to_string(tile) + " group " + std::to_string(group) +
                   " has the invalid mode tag 3");
    }
    bytes += size_t(format::gaac_mode_escape_bytes(GaacElement::kBf16, uint8_t(mode)));
  }
  return bytes;
}

// The rows of the groups [first_group, end_group) of one token of a tile, one group at a time.
inline void decode_groups(const Geometry& g, const uint8_t* tile_start, int tile, size_t group0,
                          int first, int end, const codec::GaacBases& bases, int channel0,
                          Escapes& escapes, float* row) {
  for (int q = first; q < end; ++q) {
    const size_t c = size_t(channel0) + 8 * size_t(q);
    decode_group(g, tile_start, tile, group0 + size_t(q), &bases.b3[c], &bases.b4[c], escapes,
                 row + c);
  }
}

#if CERTKV_GAAC_ROWS_X86
// Tags of 8 groups from `group` as 16 bits (group k at bits 2k).
inline unsigned tags_of_8(const uint8_t* tags, size_t group) {
  if (group % 4 == 0) return unsigned(tags[group / 4]) | unsigned(tags[group / 4 + 1]) << 8;
  unsigned t = 0;
  for (size_t k = 0; k < 8; ++k) t |= tag_of(tags, group + k) << (2 * k);
  return t;
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi2"))) void rows_avx512_vbmi(
    const Geometry& g, const uint8_t* slot, const codec::GaacBases& bases, int n_rows,
    Escapes& escapes, float* out) {
  // Lane k (64 bits) of the gathered codes holds code bytes 3k, 3k + 1, 3k + 2: the 8 codes of
  // group k; multishift then puts code j of the lane (bits 3j..3j+2) into byte j.
  alignas(64) uint8_t gather[64], shifts[64];
  for (int i = 0; i < 64; ++i) {
    gather[i] = uint8_t(3 * (i / 8) + (i % 8 < 3 ? i % 8 : 0));
    shifts[i] = uint8_t(3 * (i % 8));
  }
  const __m512i gather_idx = _mm512_load_si512(gather);
  const __m512i shift_ctrl = _mm512_load_si512(shifts);
  // widen[r]: bytes 4i + 2 and 4i + 3 of output vector r take lo[16r + i] and hi[16r + i].
  alignas(64) uint8_t widen_idx[4][64];
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 16; ++i) {
      widen_idx[r][4 * i] = widen_idx[r][4 * i + 1] = 0;
      widen_idx[r][4 * i + 2] = uint8_t(16 * r + i);
      widen_idx[r][4 * i + 3] = uint8_t(64 + 16 * r + i);
    }
  }
  const __m512i widen[4] = {_mm512_load_si512(widen_idx[0]), _mm512_load_si512(widen_idx[1]),
                            _mm512_load_si512(widen_idx[2]), _mm512_load_si512(widen_idx[3])};
  const __m512i seven = _mm512_set1_epi8(7);
  const __m512i low7 = _mm512_set1_epi8(0x7f);
  const int gpt = g.groups_per_token;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const uint8_t* tags = tile_start + g.tag_offset;
    const int channel0 = tile * g.tile_channels;
    for (int t = 0; t < n_rows; ++t) {
      float* row = out + size_t(t) * size_t(g.head_dim);
      const size_t group0 = size_t(t) * size_t(gpt);
      int q = 0;
      for (; q + 8 <= gpt; q += 8) {
        const size_t group = group0 + size_t(q);
        const unsigned tags8 = tags_of_8(tags, group);
        if ((tags8 & 0xaaaau) != 0) {  // a raw group (or an invalid tag): one group at a time
          decode_groups(g, tile_start, tile, group0, q, q + 8, bases, channel0, escapes, row);
          continue;
        }
        const size_t c = size_t(channel0) + 8 * size_t(q);
        const __m512i code_bytes =
            _mm512_maskz_loadu_epi8(0xffffffull, tile_start + g.code_offset + 3 * group);
        // (The zero-masked forms with a full mask: GCC 12's plain forms warn about an undefined
        // pass-through operand.)
        const __m512i gathered = _mm512_maskz_permutexvar_epi8(~0ull, gather_idx, code_bytes);
        const __m512i codes =
            _mm512_and_si512(_mm512_maskz_multishift_epi64_epi8(~0ull, shift_ctrl, gathered), seven);
        const __m512i b3 = _mm512_loadu_si512(&bases.b3[c]);
        __m512i e;
        if (tags8 == 0) {
          e = _mm512_add_epi8(codes, b3);
        } else {
          // 4-bit groups (bit 0 of their tag): the byte lanes of those groups take b4 and, from
          // their escape byte (taken in group order), bit 3 of the code.
          const uint64_t four_bit_groups = _pext_u32(tags8, 0x5555u);
          const uint64_t lanes = _pdep_u64(four_bit_groups, 0x0101010101010101ull) * 0xffu;
          const int n_escapes = __builtin_popcountll(four_bit_groups);
          const uint8_t* high = escapes.take(size_t(n_escapes), tile, group);
          uint64_t high_bytes = 0;
          for (int i = 0; i < n_escapes; ++i) high_bytes |= uint64_t(high[i]) << (8 * i);
          const __mmask64 bit3 = _pdep_u64(high_bytes, lanes);
          e = _mm512_add_epi8(codes, _mm512_mask_blend_epi8(lanes, b3, _mm512_loadu_si512(&bases.b4[c])));
          e = _mm512_mask_add_epi8(e, bit3, e, _mm512_set1_epi8(8));
        }
        // bf16 = sign << 15 | e << 7 | mantissa as two byte planes: lo = (e & 1) << 7 | mantissa,
        // hi = sign | e >> 1; float r of the output = bytes (0, 0, lo_r, hi_r).
        const __m512i sm = _mm512_loadu_si512(tile_start + 8 * group);
        const __m512i lo = _mm512_ternarylogic_epi32(sm, _mm512_slli_epi16(e, 7), low7, 0xe4);
        const __m512i hi = _mm512_ternarylogic_epi32(sm, _mm512_srli_epi16(e, 1), low7, 0xd8);
        for (int r = 0; r < 4; ++r) {
          _mm512_storeu_si512(row + c + 16 * size_t(r),
                              _mm512_maskz_permutex2var_epi8(0xccccccccccccccccull, lo, widen[r], hi));
        }
      }
      decode_groups(g, tile_start, tile, group0, q, gpt, bases, channel0, escapes, row);
    }
    if (tile + 1 < g.n_tiles) {
      escapes.pos += escape_bytes_of_groups(g, tile_start, tile, size_t(n_rows) * size_t(gpt),
                                            g.tile_groups);
    }
  }
}

bool cpu_has_avx512_vbmi() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi2");
}
#endif

void rows_portable(const Geometry& g, const uint8_t* slot, const codec::GaacBases& bases,
                   int n_rows, Escapes& escapes, float* out) {
  const int gpt = g.groups_per_token;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const int channel0 = tile * g.tile_channels;
    for (int t = 0; t < n_rows; ++t) {
      decode_groups(g, tile_start, tile, size_t(t) * size_t(gpt), 0, gpt, bases, channel0,
                    escapes, out + size_t(t) * size_t(g.head_dim));
    }
    if (tile + 1 < g.n_tiles) {
      escapes.pos += escape_bytes_of_groups(g, tile_start, tile, size_t(n_rows) * size_t(gpt),
                                            g.tile_groups);
    }
  }
}

}  // namespace

bool gaac_rows_kernel_supported(GaacRowsKernel kernel) {
  if (kernel == GaacRowsKernel::kPortable) return true;
#if CERTKV_GAAC_ROWS_X86
  static const bool vbmi = cpu_has_avx512_vbmi();
  return vbmi;
#else
  return false;
#endif
}

GaacRowsKernel gaac_rows_best_kernel() {
  static const GaacRowsKernel best = gaac_rows_kernel_supported(GaacRowsKernel::kAvx512Vbmi)
                                         ? GaacRowsKernel::kAvx512Vbmi
                                         : GaacRowsKernel::kPortable;
  return best;
}

void gaac_rows_to_float(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                        const codec::GaacBases& bases, int n_rows, float* out,
                        GaacRowsKernel kernel) {
  const Geometry g = checked_geometry(block_tokens, head_dim, bases, n_rows);
  if (!gaac_rows_kernel_supported(kernel)) {
    fail(StatusCode::kUnsupported, "gaac_rows_to_float: the AVX-512 VBMI kernel is not supported "
                                   "by this CPU");
  }
  if (slot_bytes < g.page_fixed_bytes) {
    fail_corrupt("slot of " + std::to_string(slot_bytes) + " bytes is shorter than its fixed part (" +
                 std::to_string(g.page_fixed_bytes) + " bytes)");
  }
  Escapes escapes{slot + g.page_fixed_bytes, slot_bytes - g.page_fixed_bytes, 0};
#if CERTKV_GAAC_ROWS_X86
  if (kernel == GaacRowsKernel::kAvx512Vbmi) {
    rows_avx512_vbmi(g, slot, bases, n_rows, escapes, out);
    return;
  }
#endif
  rows_portable(g, slot, bases, n_rows, escapes, out);
}

void gaac_rows_to_float_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens,
                            int head_dim, const codec::GaacBases& bases, int n_rows, float* out) {
  std::vector<uint16_t> bits(size_t(n_rows) * size_t(head_dim));
  codec::gaac_decode_rows_ref(slot, slot_bytes, block_tokens, head_dim, bases, 0, n_rows,
                              bits.data());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = format::bf16_to_float(bits[i]);
}

}  // namespace certkv::attention
