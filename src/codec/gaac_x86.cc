// SIMD paths of the BF16 GAAC coder for x86-64, compiled with function target attributes so the
// build needs no -march flag; gaac.cc calls them only when __builtin_cpu_supports says the CPU
// has the instructions (the AVX-512 path needs F, BW and VBMI). Vector code splits elements into sign+mantissa and exponent bytes, forms
// the offsets from b3 and b4 and tests the windows for 2 (AVX2) or 4 (AVX-512) groups at once;
// BMI2 pext/pdep pack and unpack the 3-bit codes and escape bits of a group (one 64-bit word
// holds a group's 8 byte-sized codes). Output is bit-identical to gaac_encode_page_ref and
// gaac_decode_rows_ref. The row decoders write BF16 bits or floats (the BF16 bits shifted up by
// 16, so the floats equal those of the raw page); both share one decode loop, templated on the
// output element.
#include <algorithm>
#include <bit>
#include <cstring>

#include "codec/gaac_page.h"
#include "core/status.h"
#include "core/x86_simd.h"

namespace certkv::codec::detail {

#if defined(__x86_64__)

namespace {

constexpr uint64_t kLow3Bits = 0x0707070707070707ull;   // bits 0-2 of each byte
constexpr uint64_t kBit3 = 0x0808080808080808ull;       // bit 3 of each byte
constexpr uint64_t kHigh5Bits = 0xf8f8f8f8f8f8f8f8ull;  // bits 3-7 of each byte

inline uint64_t load_u64(const void* p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

// Where an encoder writes; escape_used is the running escape byte count of the page.
struct EncodeState {
  const PageGeometry* g;
  uint8_t* escapes;
  size_t escape_capacity_bytes;
  size_t escape_used;
};

// Writes one group from its 8 sign+mantissa bytes, its 8-byte offset words from b3 and b4 and
// exponents, and whether its exponents fit the 3- and 4-bit windows. False when its escapes
// overflow the slot.
__attribute__((target("bmi2"))) inline bool emit_group(EncodeState& s, uint8_t* tile_start,
                                                        size_t group, uint64_t sign_mantissa,
                                                        uint64_t d3, uint64_t d4,
                                                        uint64_t exponents, bool fits3,
                                                        bool fits4) {
  const PageGeometry& g = *s.g;
  const unsigned mode = fits3 ? format::kGaacMode3Bit
                        : fits4 ? format::kGaacMode4Bit
                                : format::kGaacModeRaw;
  const uint64_t code = fits3 ? d3 : fits4 ? d4 : exponents;
  memcpy(tile_start + group * 8, &sign_mantissa, 8);
  const uint32_t low = static_cast<uint32_t>(_pext_u64(code, kLow3Bits));
  memcpy(tile_start + g.code_offset + group * 3, &low, 3);
  tile_start[g.tag_offset + group / 4] |= static_cast<uint8_t>(mode << (2 * (group % 4)));
  if (mode == format::kGaacMode3Bit) return true;
  const size_t n_escape = mode == format::kGaacMode4Bit ? 1 : 5;
  if (s.escape_used + n_escape > s.escape_capacity_bytes) return false;
  const uint64_t high = _pext_u64(code, mode == format::kGaacMode4Bit ? kBit3 : kHigh5Bits);
  memcpy(s.escapes + s.escape_used, &high, n_escape);
  s.escape_used += n_escape;
  return true;
}

// One group with 128-bit vectors (the odd group of a token row).
__attribute__((target("avx2,bmi2"))) bool encode_group_sse(EncodeState& s, uint8_t* tile_start,
                                                            size_t group, const uint16_t* src,
                                                            const uint8_t* b3,
                                                            const uint8_t* b4) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i e = _mm_and_si128(_mm_srli_epi16(h, 7), _mm_set1_epi16(0xff));
  const __m128i sm = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h, 8), _mm_set1_epi16(0x80)),
                                  _mm_and_si128(h, _mm_set1_epi16(0x7f)));
  const __m128i d3 = _mm_sub_epi16(e, _mm_cvtepu8_epi16(_mm_loadl_epi64(
                                          reinterpret_cast<const __m128i*>(b3))));
  const __m128i d4 = _mm_sub_epi16(e, _mm_cvtepu8_epi16(_mm_loadl_epi64(
                                          reinterpret_cast<const __m128i*>(b4))));
  const __m128i zero = _mm_setzero_si128();
  const int ok3 = _mm_movemask_epi8(
      _mm_cmpeq_epi16(_mm_and_si128(d3, _mm_set1_epi16(int16_t(0xfff8))), zero));
  const int ok4 = _mm_movemask_epi8(
      _mm_cmpeq_epi16(_mm_and_si128(d4, _mm_set1_epi16(int16_t(0xfff0))), zero));
  const __m128i sm_d3 = _mm_packus_epi16(sm, d3);
  const __m128i d4_e = _mm_packus_epi16(d4, e);
  return emit_group(s, tile_start, group, uint64_t(_mm_cvtsi128_si64(sm_d3)),
                    uint64_t(_mm_extract_epi64(sm_d3, 1)), uint64_t(_mm_cvtsi128_si64(d4_e)),
                    uint64_t(_mm_extract_epi64(d4_e, 1)), ok3 == 0xffff, ok4 == 0xffff);
}

// Decodes one group into its exponent word and sign+mantissa word; false when its escapes run
// past the slot (the caller reports it).
struct DecodeState {
  const PageGeometry* g;
  const uint8_t* escapes;
  size_t area_bytes;
  size_t escape_pos;
};

__attribute__((target("bmi2"))) inline void decode_group(DecodeState& s, const uint8_t* tile_start,
                                                          int tile, size_t group,
                                                          const uint8_t* b3, const uint8_t* b4,
                                                          uint64_t& exponents) {
  const PageGeometry& g = *s.g;
  const unsigned mode = tag_of_group(tile_start + g.tag_offset, group);
  // A 4-byte load of the group's 3 code bytes: the tags follow the code stream inside the tile,
  // so the fourth byte is inside the slot (its fixed part was checked).
  uint32_t low;
  memcpy(&low, tile_start + g.code_offset + group * 3, 4);
  uint64_t code = _pdep_u64(low & 0xffffffu, kLow3Bits);
  uint64_t base = 0;
  if (mode == format::kGaacMode3Bit) {
    base = load_u64(b3);
  } else {
    if (mode == format::kGaacModeInvalid) {
      escape_bytes_of_tags(g, tile_start, tile, group, group + 1);  // throws kCorrupt
    }
    const size_t n_escape = mode == format::kGaacMode4Bit ? 1 : 5;
    if (s.escape_pos + n_escape > s.area_bytes) {
      fail_escape_overrun(tile, group, s.escape_pos + n_escape, s.area_bytes);
    }
    uint64_t high = 0;
    memcpy(&high, s.escapes + s.escape_pos, n_escape);
    s.escape_pos += n_escape;
    if (mode == format::kGaacMode4Bit) {
      code |= _pdep_u64(high, kBit3);
      base = load_u64(b4);
    } else {
      code |= _pdep_u64(high, kHigh5Bits);
    }
  }
  // Bytewise base + offset: every byte sum stays below 256 (the windows lie inside the exponent
  // range), so no carry crosses bytes.
  exponents = code + base;
}

// BF16 from sign+mantissa bytes and exponent bytes widened to 16 bits.
__attribute__((target("avx2"))) inline __m256i join_bf16_avx2(__m256i sm, __m256i e) {
  return _mm256_or_si256(
      _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(sm, _mm256_set1_epi16(0x80)), 8),
                      _mm256_slli_epi16(e, 7)),
      _mm256_and_si256(sm, _mm256_set1_epi16(0x7f)));
}

__attribute__((target("avx2"))) inline __m128i join_bf16_sse(__m128i sm, __m128i e) {
  return _mm_or_si128(
      _mm_or_si128(_mm_slli_epi16(_mm_and_si128(sm, _mm_set1_epi16(0x80)), 8),
                   _mm_slli_epi16(e, 7)),
      _mm_and_si128(sm, _mm_set1_epi16(0x7f)));
}

// Stores of 8, 16 and 32 BF16 values as BF16 bits or as floats (bits << 16).
__attribute__((target("avx2"))) inline void store_bf16x8(__m128i h, uint16_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
}
__attribute__((target("avx2"))) inline void store_bf16x8(__m128i h, float* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2"))) inline void store_bf16x16(__m256i h, uint16_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}
__attribute__((target("avx2"))) inline void store_bf16x16(__m256i h, float* dst) {
  store_bf16x8(_mm256_castsi256_si128(h), dst);
  store_bf16x8(_mm256_extracti128_si256(h, 1), dst + 8);
}
__attribute__((target("avx512f,avx512bw,avx2"))) inline void store_bf16x32(__m512i h,
                                                                           uint16_t* dst) {
  _mm512_storeu_si512(dst, h);
}
__attribute__((target("avx512f,avx512bw,avx2"))) inline void store_bf16x32(__m512i h,
                                                                           float* dst) {
  _mm512_storeu_si512(dst, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  _mm512_storeu_si512(dst + 16,
                      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
}

template <class Out>
__attribute__((target("avx2,bmi2"))) void decode_group_sse(DecodeState& s,
                                                            const uint8_t* tile_start, int tile,
                                                            size_t group, const uint8_t* b3,
                                                            const uint8_t* b4, Out* dst) {
  uint64_t e;
  decode_group(s, tile_start, tile, group, b3, b4, e);
  const __m128i sm = _mm_cvtepu8_epi16(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile_start + group * 8)));
  const __m128i ew = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(e)));
  store_bf16x8(join_bf16_sse(sm, ew), dst);
}

// The escapes of the groups before the first decoded one must lie inside the slot, as the
// plain decoder checks at every decoded group.
inline void check_escape_start(const DecodeState& s, int tile, size_t group, bool decodes_rows) {
  if (decodes_rows && s.escape_pos > s.area_bytes) {
    fail_escape_overrun(tile, group, s.escape_pos, s.area_bytes);
  }
}

// The escape position of group `group_begin` of `tile`, given the escape bytes of all earlier
// tiles.
size_t escape_start(const PageGeometry& g, const uint8_t* tile_start, int tile,
                    size_t earlier_tiles_bytes, size_t group_begin) {
  return earlier_tiles_bytes + escape_bytes_of_tags(g, tile_start, tile, 0, group_begin);
}

// Byte permutation and bit offsets that unpack the 3-bit codes of 8 groups (24 bytes, element i
// of the row at bits [3i, 3i + 3)) into one byte per element: 64-bit lane k receives code bytes
// 3k .. 3k + 2 (group k) and byte j of the lane takes bits [3j, 3j + 8) of it.
// widen[r]: the byte permutation (of lo, then hi) that makes floats 16r .. 16r + 15 of 64
// elements from their BF16 byte planes: float i takes bytes (0, 0, lo[16r + i], hi[16r + i]).
struct alignas(64) CodeUnpackTables {
  uint8_t gather[64];
  uint8_t shifts[64];
  uint8_t widen[4][64];
};
constexpr CodeUnpackTables make_code_unpack_tables() {
  CodeUnpackTables t{};
  for (int i = 0; i < 64; ++i) {
    const int lane = i / 8, j = i % 8;
    t.gather[i] = uint8_t(3 * lane + (j < 3 ? j : 0));
    t.shifts[i] = uint8_t(3 * j);
  }
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 16; ++i) {
      t.widen[r][4 * i] = t.widen[r][4 * i + 1] = 0;
      t.widen[r][4 * i + 2] = uint8_t(16 * r + i);
      t.widen[r][4 * i + 3] = uint8_t(64 + 16 * r + i);
    }
  }
  return t;
}
constexpr CodeUnpackTables kCodeUnpack = make_code_unpack_tables();

// The tables in registers, loaded once per decode call.
struct VbmiTables {
  __m512i gather, shifts, widen[4];
};
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) inline VbmiTables load_vbmi_tables() {
  return VbmiTables{_mm512_load_si512(kCodeUnpack.gather),
                    _mm512_load_si512(kCodeUnpack.shifts),
                    {_mm512_load_si512(kCodeUnpack.widen[0]),
                     _mm512_load_si512(kCodeUnpack.widen[1]),
                     _mm512_load_si512(kCodeUnpack.widen[2]),
                     _mm512_load_si512(kCodeUnpack.widen[3])}};
}

// 64 elements from their sign+mantissa bytes and exponent bytes.
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) inline void store_64(
    const VbmiTables&, __m512i sm, __m512i e, uint16_t* dst) {
  const __m512i mask_sign = _mm512_set1_epi16(0x80);
  const __m512i mask_mantissa = _mm512_set1_epi16(0x7f);
  for (int half = 0; half < 2; ++half) {
    const __m512i smw = _mm512_cvtepu8_epi16(half ? _mm512_extracti64x4_epi64(sm, 1)
                                                  : _mm512_castsi512_si256(sm));
    const __m512i ew = _mm512_cvtepu8_epi16(half ? _mm512_extracti64x4_epi64(e, 1)
                                                 : _mm512_castsi512_si256(e));
    const __m512i h = _mm512_or_si512(
        _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(smw, mask_sign), 8),
                        _mm512_slli_epi16(ew, 7)),
        _mm512_and_si512(smw, mask_mantissa));
    _mm512_storeu_si512(dst + 32 * half, h);
  }
}
// As floats: the BF16 as two byte planes, lo = (e & 1) << 7 | mantissa and hi = sign | e >> 1,
// interleaved under two zero bytes by one two-source byte permute per 16 floats.
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) inline void store_64(
    const VbmiTables& tables, __m512i sm, __m512i e, float* dst) {
  const __m512i low7 = _mm512_set1_epi8(0x7f);
  const __m512i lo = _mm512_ternarylogic_epi32(sm, _mm512_slli_epi16(e, 7), low7, 0xe4);
  const __m512i hi = _mm512_ternarylogic_epi32(sm, _mm512_srli_epi16(e, 1), low7, 0xd8);
  for (int r = 0; r < 4; ++r) {
    _mm512_storeu_si512(dst + 16 * r,
                        _mm512_maskz_permutex2var_epi8(0xccccccccccccccccull, lo,
                                                       tables.widen[r], hi));
  }
}

// Decodes 8 consecutive groups (64 elements) of one token row with AVX-512 VBMI: one permute and
// one multishift unpack all 3-bit codes; only 4-bit and raw groups take scalar work (their
// escape bits, placed with pdep).
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,bmi2"))) inline void decode_8_groups_vbmi(
    DecodeState& s, const VbmiTables& tables, const uint8_t* tile_start, int tile, size_t group0,
    const uint8_t* b3, const uint8_t* b4, Out* dst) {
  const PageGeometry& g = *s.g;
  const uint8_t* tags = tile_start + g.tag_offset;
  uint32_t tags16;
  if (group0 % 4 == 0) {
    uint16_t two_bytes;
    memcpy(&two_bytes, tags + group0 / 4, 2);
    tags16 = two_bytes;
  } else {
    uint32_t tag_word = 0;
    for (size_t i = group0 / 4; i <= (group0 + 7) / 4; ++i) {
      tag_word |= uint32_t(tags[i]) << (8 * (i - group0 / 4));
    }
    tags16 = (tag_word >> (2 * (group0 % 4))) & 0xffffu;
  }
  const __m512i codes =
      _mm512_maskz_loadu_epi8(0xffffffull, tile_start + g.code_offset + group0 * 3);
  const __m512i gathered = _mm512_permutexvar_epi8(tables.gather, codes);
  __m512i e = _mm512_and_si512(_mm512_multishift_epi64_epi8(tables.shifts, gathered),
                               _mm512_set1_epi8(7));
  __m512i base = _mm512_loadu_si512(b3);
  const uint32_t four_bit_only = (tags16 & 0xaaaau) == 0 ? _pext_u32(tags16, 0x5555u) : 0;
  const size_t n_four_bit = size_t(std::popcount(four_bit_only));
  if (four_bit_only != 0 && s.escape_pos + n_four_bit <= s.area_bytes) {
    // 3- and 4-bit groups only (bit k of four_bit_only: group k): their escape bytes are
    // consecutive, one per 4-bit group in group order, bit j of it bit 3 of element j (one mask
    // bit per byte lane).
    const uint64_t lanes = _pdep_u64(four_bit_only, 0x0101010101010101ull) * 0xffu;
    // Built in a register (a byte-wise memcpy into memory and a wide reload would stall store
    // forwarding).
    const uint8_t* escape = s.escapes + s.escape_pos;
    uint64_t high_bytes = 0;
    if (s.escape_pos + 8 <= s.area_bytes) {
      high_bytes = _bzhi_u64(load_u64(escape), unsigned(8 * n_four_bit));
    } else {
      for (size_t i = 0; i < n_four_bit; ++i) high_bytes |= uint64_t(escape[i]) << (8 * i);
    }
    s.escape_pos += n_four_bit;
    e = _mm512_mask_add_epi8(e, _pdep_u64(high_bytes, lanes), e, _mm512_set1_epi8(8));
    base = _mm512_mask_blend_epi8(lanes, base, _mm512_loadu_si512(b4));
  } else if (tags16 != 0) {
    const uint32_t low_bits = tags16 & 0x5555u;
    const uint32_t high_bits = (tags16 >> 1) & 0x5555u;
    const uint32_t four_bit_groups = _pext_u32(low_bits & ~high_bits, 0x5555u);  // bit k: group k
    const uint32_t raw_groups = _pext_u32(high_bits & ~low_bits, 0x5555u);
    const size_t n_escape = size_t(std::popcount(four_bit_groups)) +
                            5 * size_t(std::popcount(raw_groups));
    alignas(64) uint64_t high[8];
    if ((low_bits & high_bits) == 0 && s.escape_pos + n_escape + 8 <= s.area_bytes) {
      // Branch-free: each group loads 8 escape bytes (all inside the slot), keeps its own
      // 0, 1 or 5 and places them with pdep.
      constexpr uint64_t kDeposit[3] = {0, kBit3, kHigh5Bits};
      constexpr uint32_t kBytes[3] = {0, 1, 5};
      size_t pos = s.escape_pos;
      for (int k = 0; k < 8; ++k) {
        const unsigned mode = (tags16 >> (2 * k)) & 3u;
        const uint64_t bits = load_u64(s.escapes + pos) & ((uint64_t(1) << (8 * kBytes[mode])) - 1);
        high[k] = _pdep_u64(bits, kDeposit[mode]);
        pos += kBytes[mode];
      }
      s.escape_pos = pos;
    } else {
      // Near the end of the slot, or an invalid tag: one group at a time, checked.
      for (int k = 0; k < 8; ++k) {
        const unsigned mode = (tags16 >> (2 * k)) & 3u;
        high[k] = 0;
        if (mode == format::kGaacMode3Bit) continue;
        const size_t group = group0 + size_t(k);
        if (mode == format::kGaacModeInvalid) {
          escape_bytes_of_tags(g, tile_start, tile, group, group + 1);  // throws kCorrupt
        }
        const size_t n = mode == format::kGaacMode4Bit ? 1 : 5;
        if (s.escape_pos + n > s.area_bytes) {
          fail_escape_overrun(tile, group, s.escape_pos + n, s.area_bytes);
        }
        uint64_t bits = 0;
        memcpy(&bits, s.escapes + s.escape_pos, n);
        s.escape_pos += n;
        high[k] = _pdep_u64(bits, mode == format::kGaacMode4Bit ? kBit3 : kHigh5Bits);
      }
    }
    const __mmask64 four_bit = _pdep_u64(four_bit_groups, 0x0101010101010101ull) * 0xffu;
    const __mmask64 raw = _pdep_u64(raw_groups, 0x0101010101010101ull) * 0xffu;
    e = _mm512_or_si512(e, _mm512_load_si512(high));
    base = _mm512_mask_blend_epi8(four_bit, base, _mm512_loadu_si512(b4));
    base = _mm512_maskz_mov_epi8(~raw, base);
  }
  e = _mm512_add_epi8(e, base);  // bytewise base + offset, no carries (windows in range)
  store_64(tables, _mm512_loadu_si512(tile_start + group0 * 8), e, dst);
}

// Escape bytes of groups [0, group_end) of a tile, counted from its tags a word at a time, and
// whether a tag of 3, or a raw tag, is among them. REQUIRES: group_end % 4 == 0.
struct TagCount {
  size_t escape_bytes;
  bool invalid;
  bool raw;
};
__attribute__((target("popcnt"))) inline TagCount count_tags(const uint8_t* tags, size_t group_end) {
  constexpr uint64_t kLowBits = 0x5555555555555555ull;
  const size_t n_bytes = group_end / 4;
  size_t four_bit = 0, raw = 0;
  uint64_t invalid = 0;
  for (size_t i = 0; i < n_bytes; i += 8) {
    const uint64_t w = i + 8 <= n_bytes ? load_u64(tags + i) : load_le(tags + i, int(n_bytes - i));
    const uint64_t low = w & kLowBits, high = (w >> 1) & kLowBits;
    four_bit += size_t(std::popcount(low & ~high));
    raw += size_t(std::popcount(high & ~low));
    invalid |= low & high;
  }
  return TagCount{four_bit + 5 * raw, invalid != 0, raw != 0};
}

// One run of 8 groups (64 elements) of a row, its 3-bit codes from the code stream and its modes
// as two 64-bit lane masks: four_bit (the bytes of its 4-bit groups) and bit3 (bit 3 of each
// element's code, from the escape bytes).
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) inline void decode_run(
    const VbmiTables& tables, const uint8_t* tile_start, const PageGeometry& g, size_t group0, const uint8_t* b3,
    const uint8_t* b4, __mmask64 four_bit, __mmask64 bit3, Out* dst) {
  const __m512i codes = _mm512_maskz_loadu_epi8(0xffffffull, tile_start + g.code_offset + group0 * 3);
  __m512i e = _mm512_and_si512(
      _mm512_multishift_epi64_epi8(tables.shifts, _mm512_permutexvar_epi8(tables.gather, codes)),
      _mm512_set1_epi8(7));
  e = _mm512_mask_add_epi8(e, bit3, e, _mm512_set1_epi8(8));
  const __m512i base = _mm512_mask_blend_epi8(four_bit, _mm512_loadu_si512(b3), _mm512_loadu_si512(b4));
  // Bytewise base + offset, no carries (the windows lie inside the exponent range).
  store_64(tables, _mm512_loadu_si512(tile_start + group0 * 8), _mm512_add_epi8(e, base), dst);
}

// The tag counts of decode_rows_counted: each tile's escape position at its first decoded group
// (the whole of the earlier tiles, then its groups before the rows), false where a tag of 3 is
// among the groups the checked loop reads or the decoded rows' escapes end past the slot.
constexpr int kCountedMaxTiles = 4;
inline bool count_page_tags(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g, size_t group_begin,
                            size_t group_end, size_t* start, bool* raw) {
  size_t earlier = 0, end = 0;
  *raw = false;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tags = slot + size_t(tile) * g.tile_fixed_bytes + g.tag_offset;
    const TagCount before = count_tags(tags, group_begin);
    const TagCount through = count_tags(tags, group_end);
    if (through.invalid) return false;
    *raw = *raw || through.raw;
    start[tile] = earlier + before.escape_bytes;
    end = earlier + through.escape_bytes;
    if (tile + 1 < g.n_tiles) {
      const TagCount whole = count_tags(tags, g.tile_groups);
      if (whole.invalid) return false;
      earlier += whole.escape_bytes;
    }
  }
  return end <= slot_bytes - g.page_fixed_bytes;
}

// decode_rows_counted for pages whose decoded rows have no raw group, with AVX-512 VBMI2: the
// lane masks of every run come from whole vectors of tags, 64 groups at a time (vpmovm2b of the
// 4-bit groups' bits, and vpexpandb of their escape bytes, one per 4-bit group in group order,
// into the bytes of those groups). false where the rows are too many for its buffers.
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx2,bmi2,popcnt"))) bool decode_rows_expanded(
    const uint8_t* slot, const PageGeometry& g, const GaacBases& bases, const VbmiTables& tables,
    const size_t* start, int token_begin, int token_end, Out* out) {
  constexpr size_t kMaxRuns = 64;
  const size_t runs_per_token = size_t(g.groups_per_token) / 8;
  const size_t n_runs = size_t(token_end - token_begin) * runs_per_token;
  if (n_runs > kMaxRuns) return false;
  alignas(64) uint64_t four_bit[kMaxRuns + 8], bit3[kMaxRuns + 8];
  const uint8_t* escapes = slot + g.page_fixed_bytes;
  const size_t group_begin = size_t(token_begin) * size_t(g.groups_per_token);
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const uint8_t* tags = tile_start + g.tag_offset;
    size_t pos = start[tile];
    // 64 groups (8 runs, 16 tag bytes) at a time; a last part of fewer masked.
    for (size_t run = 0; run < n_runs; run += 8) {
      const size_t tag_bytes = std::min<size_t>(16, 2 * (n_runs - run));
      const __m128i t = _mm_maskz_loadu_epi8(__mmask16((1u << tag_bytes) - 1u), tags + group_begin / 4 + 2 * run);
      // 4-bit tags are 01 (no raw tag or tag of 3 here): their low bits, one per group.
      const uint64_t m = _pext_u64(uint64_t(_mm_cvtsi128_si64(t)), 0x5555555555555555ull) |
                         _pext_u64(uint64_t(_mm_extract_epi64(t, 1)), 0x5555555555555555ull) << 32;
      _mm512_store_si512(four_bit + run, _mm512_movm_epi8(m));
      _mm512_store_si512(bit3 + run, _mm512_maskz_expandloadu_epi8(m, escapes + pos));
      pos += size_t(std::popcount(m));
    }
    const int tile_channel0 = tile * g.tile_channels;
    size_t run = 0;
    for (int token = token_begin; token < token_end; ++token) {
      Out* dst = out + size_t(token - token_begin) * size_t(g.head_dim) + size_t(tile_channel0);
      for (size_t q = 0; q < runs_per_token; ++q, ++run) {
        const size_t c = size_t(tile_channel0) + 64 * q;
        decode_run(tables, tile_start, g, size_t(token) * size_t(g.groups_per_token) + 8 * q, &bases.b3[c],
                   &bases.b4[c], _cvtu64_mask64(four_bit[run]), _cvtu64_mask64(bit3[run]), dst + 64 * q);
      }
    }
  }
  return true;
}

bool cpu_has_vbmi2() {
  static const bool has = __builtin_cpu_supports("avx512vbmi2");
  return has;
}

// Rows [token_begin, token_end) of a page whose rows are whole runs of 8 groups, with every
// escape position known before the first row: the tags are counted first (no tag of 3, the
// decoded rows' escapes inside the slot), so a run of 3- and 4-bit groups needs no check and no
// branch on its modes: its escape bytes, one per 4-bit group, are one masked load placed with
// pdep (or, with no raw group in the rows, decode_rows_expanded); a run with a raw group takes
// decode_8_groups_vbmi. false, with nothing written, where the counting finds a tag of 3 or an
// overrun, or the shape does not qualify: the checked loop then decodes the page and reports
// what it finds.
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,bmi2,popcnt"), noinline)) void decode_rows_by_runs(
    const uint8_t* slot, size_t slot_bytes, const PageGeometry& g, const GaacBases& bases,
    const VbmiTables& tables, const size_t* start, int token_begin, int token_end, Out* out) {
  const int gpt = g.groups_per_token;
  const size_t area_bytes = slot_bytes - g.page_fixed_bytes;
  const uint8_t* escapes = slot + g.page_fixed_bytes;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const uint8_t* tags = tile_start + g.tag_offset;
    const int tile_channel0 = tile * g.tile_channels;
    size_t pos = start[tile];
    for (int token = token_begin; token < token_end; ++token) {
      Out* dst = out + size_t(token - token_begin) * size_t(g.head_dim) + size_t(tile_channel0);
      for (int q = 0; q < gpt; q += 8) {
        const size_t group0 = size_t(token) * size_t(gpt) + size_t(q);
        const size_t c = size_t(tile_channel0 + 8 * q);
        const uint32_t tags16 = uint32_t(tags[group0 / 4]) | uint32_t(tags[group0 / 4 + 1]) << 8;
        if ((tags16 & 0xaaaau) != 0) {
          DecodeState s{&g, escapes, area_bytes, pos};
          decode_8_groups_vbmi(s, tables, tile_start, tile, group0, &bases.b3[c], &bases.b4[c], dst + 8 * q);
          pos = s.escape_pos;
          continue;
        }
        const uint32_t four_bit = _pext_u32(tags16, 0x5555u);
        const unsigned n_four_bit = unsigned(std::popcount(four_bit));
        const uint64_t lanes = _pdep_u64(four_bit, 0x0101010101010101ull) * 0xffu;
        const uint64_t escape_bytes = uint64_t(
            _mm_cvtsi128_si64(_mm_maskz_loadu_epi8(__mmask16((1u << n_four_bit) - 1u), escapes + pos)));
        pos += n_four_bit;
        decode_run(tables, tile_start, g, group0, &bases.b3[c], &bases.b4[c], lanes, _pdep_u64(escape_bytes, lanes),
                   dst + 8 * q);
      }
    }
  }
}

template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,bmi2,popcnt"))) bool decode_rows_counted(
    const uint8_t* slot, size_t slot_bytes, const PageGeometry& g, const GaacBases& bases,
    const VbmiTables& tables, int token_begin, int token_end, Out* out) {
  const int gpt = g.groups_per_token;
  if (gpt % 8 != 0 || g.n_tiles > kCountedMaxTiles || token_begin >= token_end) return false;
  size_t start[kCountedMaxTiles];
  bool raw = false;
  if (!count_page_tags(slot, slot_bytes, g, size_t(token_begin) * size_t(gpt), size_t(token_end) * size_t(gpt),
                       start, &raw)) {
    return false;
  }
  if (raw || !cpu_has_vbmi2() || !decode_rows_expanded(slot, g, bases, tables, start, token_begin, token_end, out))
    decode_rows_by_runs(slot, slot_bytes, g, bases, tables, start, token_begin, token_end, out);
  return true;
}

}  // namespace

__attribute__((target("avx2,bmi2"))) size_t encode_page_bf16_avx2(const uint16_t* bf16,
                                                                   const PageGeometry& g,
                                                                   const GaacBases& bases,
                                                                   size_t escape_capacity_bytes,
                                                                   uint8_t* out) {
  EncodeState s{&g, out + g.page_fixed_bytes, escape_capacity_bytes, 0};
  const __m256i zero = _mm256_setzero_si256();
  const __m256i mask_not3 = _mm256_set1_epi16(int16_t(0xfff8));
  const __m256i mask_not4 = _mm256_set1_epi16(int16_t(0xfff0));
  const int gpt = g.groups_per_token;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    uint8_t* tile_start = out + size_t(tile) * g.tile_fixed_bytes;
    memset(tile_start + g.tag_offset, 0, g.tag_bytes);
    const int tile_channel0 = tile * g.tile_channels;
    for (int token = 0; token < g.block_tokens; ++token) {
      const uint16_t* row = bf16 + size_t(token) * size_t(g.head_dim) + size_t(tile_channel0);
      const size_t group0 = size_t(token) * size_t(gpt);
      int q = 0;
      for (; q + 2 <= gpt; q += 2) {
        const int c = tile_channel0 + 8 * q;
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8 * q));
        const __m256i e = _mm256_and_si256(_mm256_srli_epi16(h, 7), _mm256_set1_epi16(0xff));
        const __m256i sm =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(h, 8), _mm256_set1_epi16(0x80)),
                            _mm256_and_si256(h, _mm256_set1_epi16(0x7f)));
        const __m256i d3 = _mm256_sub_epi16(
            e, _mm256_cvtepu8_epi16(
                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(&bases.b3[size_t(c)]))));
        const __m256i d4 = _mm256_sub_epi16(
            e, _mm256_cvtepu8_epi16(
                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(&bases.b4[size_t(c)]))));
        const uint32_t ok3 = uint32_t(
            _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_and_si256(d3, mask_not3), zero)));
        const uint32_t ok4 = uint32_t(
            _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_and_si256(d4, mask_not4), zero)));
        // packus works per 128-bit half: 64-bit words [sm g0, d3 g0, sm g1, d3 g1].
        alignas(32) uint64_t sm_d3[4];
        alignas(32) uint64_t d4_e[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sm_d3), _mm256_packus_epi16(sm, d3));
        _mm256_store_si256(reinterpret_cast<__m256i*>(d4_e), _mm256_packus_epi16(d4, e));
        for (int k = 0; k < 2; ++k) {
          const bool fits3 = ((ok3 >> (16 * k)) & 0xffffu) == 0xffffu;
          const bool fits4 = ((ok4 >> (16 * k)) & 0xffffu) == 0xffffu;
          if (!emit_group(s, tile_start, group0 + size_t(q + k), sm_d3[2 * k], sm_d3[2 * k + 1],
                          d4_e[2 * k], d4_e[2 * k + 1], fits3, fits4)) {
            return kGaacDoesNotFit;
          }
        }
      }
      if (q < gpt) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        if (!encode_group_sse(s, tile_start, group0 + size_t(q), row + 8 * q, &bases.b3[c],
                              &bases.b4[c])) {
          return kGaacDoesNotFit;
        }
      }
    }
  }
  return g.page_fixed_bytes + s.escape_used;
}

template <class Out>
__attribute__((target("avx2,bmi2"))) void decode_rows_avx2(const uint8_t* slot, size_t slot_bytes,
                                                            const PageGeometry& g,
                                                            const GaacBases& bases,
                                                            int token_begin, int token_end,
                                                            Out* out) {
  if (slot_bytes < g.page_fixed_bytes) fail_truncated_slot(g, slot_bytes);
  DecodeState s{&g, slot + g.page_fixed_bytes, slot_bytes - g.page_fixed_bytes, 0};
  const int gpt = g.groups_per_token;
  size_t earlier_tiles_bytes = 0;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const int tile_channel0 = tile * g.tile_channels;
    s.escape_pos = escape_start(g, tile_start, tile, earlier_tiles_bytes,
                                size_t(token_begin) * size_t(gpt));
    check_escape_start(s, tile, size_t(token_begin) * size_t(gpt), token_begin < token_end);
    for (int token = token_begin; token < token_end; ++token) {
      Out* dst = out + size_t(token - token_begin) * size_t(g.head_dim) + size_t(tile_channel0);
      const size_t group0 = size_t(token) * size_t(gpt);
      int q = 0;
      for (; q + 2 <= gpt; q += 2) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        uint64_t e0, e1;
        decode_group(s, tile_start, tile, group0 + size_t(q), &bases.b3[c], &bases.b4[c], e0);
        decode_group(s, tile_start, tile, group0 + size_t(q + 1), &bases.b3[c + 8],
                     &bases.b4[c + 8], e1);
        const __m256i sm = _mm256_cvtepu8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(tile_start + (group0 + size_t(q)) * 8)));
        const __m256i ew = _mm256_cvtepu8_epi16(_mm_set_epi64x(int64_t(e1), int64_t(e0)));
        store_bf16x16(join_bf16_avx2(sm, ew), dst + 8 * q);
      }
      if (q < gpt) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        decode_group_sse(s, tile_start, tile, group0 + size_t(q), &bases.b3[c], &bases.b4[c],
                         dst + 8 * q);
      }
    }
    if (tile + 1 < g.n_tiles) {
      earlier_tiles_bytes += escape_bytes_of_tags(g, tile_start, tile, 0, g.tile_groups);
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx2,bmi2"))) size_t encode_page_bf16_avx512(
    const uint16_t* bf16, const PageGeometry& g, const GaacBases& bases,
    size_t escape_capacity_bytes, uint8_t* out) {
  EncodeState s{&g, out + g.page_fixed_bytes, escape_capacity_bytes, 0};
  const __m512i eight = _mm512_set1_epi16(8);
  const __m512i sixteen = _mm512_set1_epi16(16);
  const int gpt = g.groups_per_token;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    uint8_t* tile_start = out + size_t(tile) * g.tile_fixed_bytes;
    memset(tile_start + g.tag_offset, 0, g.tag_bytes);
    const int tile_channel0 = tile * g.tile_channels;
    for (int token = 0; token < g.block_tokens; ++token) {
      const uint16_t* row = bf16 + size_t(token) * size_t(g.head_dim) + size_t(tile_channel0);
      const size_t group0 = size_t(token) * size_t(gpt);
      int q = 0;
      for (; q + 4 <= gpt; q += 4) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        const __m512i h = _mm512_loadu_si512(row + 8 * q);
        const __m512i e = _mm512_and_si512(_mm512_srli_epi16(h, 7), _mm512_set1_epi16(0xff));
        const __m512i sm =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(h, 8), _mm512_set1_epi16(0x80)),
                            _mm512_and_si512(h, _mm512_set1_epi16(0x7f)));
        const __m512i d3 = _mm512_sub_epi16(
            e, _mm512_cvtepu8_epi16(
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&bases.b3[c]))));
        const __m512i d4 = _mm512_sub_epi16(
            e, _mm512_cvtepu8_epi16(
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&bases.b4[c]))));
        const uint32_t ok3 = _mm512_cmplt_epu16_mask(d3, eight);
        const uint32_t ok4 = _mm512_cmplt_epu16_mask(d4, sixteen);
        alignas(32) uint64_t w_sm[4];
        alignas(32) uint64_t w_d3[4];
        alignas(32) uint64_t w_d4[4];
        alignas(32) uint64_t w_e[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(w_sm), _mm512_cvtepi16_epi8(sm));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w_d3), _mm512_cvtepi16_epi8(d3));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w_d4), _mm512_cvtepi16_epi8(d4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w_e), _mm512_cvtepi16_epi8(e));
        for (int k = 0; k < 4; ++k) {
          const bool fits3 = ((ok3 >> (8 * k)) & 0xffu) == 0xffu;
          const bool fits4 = ((ok4 >> (8 * k)) & 0xffu) == 0xffu;
          if (!emit_group(s, tile_start, group0 + size_t(q + k), w_sm[k], w_d3[k], w_d4[k],
                          w_e[k], fits3, fits4)) {
            return kGaacDoesNotFit;
          }
        }
      }
      for (; q < gpt; ++q) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        if (!encode_group_sse(s, tile_start, group0 + size_t(q), row + 8 * q, &bases.b3[c],
                              &bases.b4[c])) {
          return kGaacDoesNotFit;
        }
      }
    }
  }
  return g.page_fixed_bytes + s.escape_used;
}

template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,bmi2"), noinline)) void decode_rows_checked_avx512(
    const uint8_t* slot, size_t slot_bytes, const PageGeometry& g, const GaacBases& bases,
    const VbmiTables& tables, int token_begin, int token_end, Out* out) {
  DecodeState s{&g, slot + g.page_fixed_bytes, slot_bytes - g.page_fixed_bytes, 0};
  const int gpt = g.groups_per_token;
  const __m512i mask_sign = _mm512_set1_epi16(0x80);
  const __m512i mask_mantissa = _mm512_set1_epi16(0x7f);
  size_t earlier_tiles_bytes = 0;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const int tile_channel0 = tile * g.tile_channels;
    s.escape_pos = escape_start(g, tile_start, tile, earlier_tiles_bytes,
                                size_t(token_begin) * size_t(gpt));
    check_escape_start(s, tile, size_t(token_begin) * size_t(gpt), token_begin < token_end);
    for (int token = token_begin; token < token_end; ++token) {
      Out* dst = out + size_t(token - token_begin) * size_t(g.head_dim) + size_t(tile_channel0);
      const size_t group0 = size_t(token) * size_t(gpt);
      int q = 0;
      for (; q + 8 <= gpt; q += 8) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        decode_8_groups_vbmi(s, tables, tile_start, tile, group0 + size_t(q), &bases.b3[c],
                             &bases.b4[c], dst + 8 * q);
      }
      for (; q + 4 <= gpt; q += 4) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        uint64_t e[4];
        for (int k = 0; k < 4; ++k) {
          decode_group(s, tile_start, tile, group0 + size_t(q + k), &bases.b3[c + 8 * size_t(k)],
                       &bases.b4[c + 8 * size_t(k)], e[k]);
        }
        const __m512i sm = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(tile_start + (group0 + size_t(q)) * 8)));
        const __m512i ew = _mm512_cvtepu8_epi16(
            _mm256_set_epi64x(int64_t(e[3]), int64_t(e[2]), int64_t(e[1]), int64_t(e[0])));
        const __m512i h = _mm512_or_si512(
            _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(sm, mask_sign), 8),
                            _mm512_slli_epi16(ew, 7)),
            _mm512_and_si512(sm, mask_mantissa));
        store_bf16x32(h, dst + 8 * q);
      }
      for (; q < gpt; ++q) {
        const size_t c = size_t(tile_channel0 + 8 * q);
        decode_group_sse(s, tile_start, tile, group0 + size_t(q), &bases.b3[c], &bases.b4[c],
                         dst + 8 * q);
      }
    }
    if (tile + 1 < g.n_tiles) {
      earlier_tiles_bytes += escape_bytes_of_tags(g, tile_start, tile, 0, g.tile_groups);
    }
  }
}

// The rows through decode_rows_counted where it takes them, else through the checked loop.
template <class Out>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,bmi2"))) void decode_rows_avx512(
    const uint8_t* slot, size_t slot_bytes, const PageGeometry& g, const GaacBases& bases,
    int token_begin, int token_end, Out* out) {
  if (slot_bytes < g.page_fixed_bytes) fail_truncated_slot(g, slot_bytes);
  const VbmiTables tables = load_vbmi_tables();
  if (decode_rows_counted(slot, slot_bytes, g, bases, tables, token_begin, token_end, out)) return;
  decode_rows_checked_avx512(slot, slot_bytes, g, bases, tables, token_begin, token_end, out);
}

void decode_rows_bf16_avx2(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                           const GaacBases& bases, int token_begin, int token_end, uint16_t* out) {
  decode_rows_avx2(slot, slot_bytes, g, bases, token_begin, token_end, out);
}
void decode_rows_float_avx2(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                            const GaacBases& bases, int token_begin, int token_end, float* out) {
  decode_rows_avx2(slot, slot_bytes, g, bases, token_begin, token_end, out);
}
void decode_rows_bf16_avx512(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                             const GaacBases& bases, int token_begin, int token_end,
                             uint16_t* out) {
  decode_rows_avx512(slot, slot_bytes, g, bases, token_begin, token_end, out);
}
void decode_rows_float_avx512(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                              const GaacBases& bases, int token_begin, int token_end, float* out) {
  decode_rows_avx512(slot, slot_bytes, g, bases, token_begin, token_end, out);
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
}

bool cpu_has_avx512() {
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
}

#else  // not x86-64: only the plain coder exists

[[noreturn]] static void fail_no_simd() {
  fail(StatusCode::kUnsupported, "GAAC: no SIMD kernel on this architecture");
}
size_t encode_page_bf16_avx2(const uint16_t*, const PageGeometry&, const GaacBases&, size_t,
                             uint8_t*) {
  fail_no_simd();
}
void decode_rows_bf16_avx2(const uint8_t*, size_t, const PageGeometry&, const GaacBases&, int,
                           int, uint16_t*) {
  fail_no_simd();
}
size_t encode_page_bf16_avx512(const uint16_t*, const PageGeometry&, const GaacBases&, size_t,
                               uint8_t*) {
  fail_no_simd();
}
void decode_rows_bf16_avx512(const uint8_t*, size_t, const PageGeometry&, const GaacBases&, int,
                             int, uint16_t*) {
  fail_no_simd();
}
void decode_rows_float_avx2(const uint8_t*, size_t, const PageGeometry&, const GaacBases&, int,
                            int, float*) {
  fail_no_simd();
}
void decode_rows_float_avx512(const uint8_t*, size_t, const PageGeometry&, const GaacBases&, int,
                              int, float*) {
  fail_no_simd();
}
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }

#endif

}  // namespace certkv::codec::detail
