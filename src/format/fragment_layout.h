// Fragment-major device pages: a page's 16 tokens x D elements stored in the order in which the
// lanes of a warp hold them as mma.m16n8k16 A operands, so that a lane's four operand registers
// of one 16-wide step are 16 contiguous bytes and a warp's operands of one step are 512
// contiguous bytes. A kernel loads them with one 16-byte shared-memory load per lane and step
// (conflict-free: each quarter warp reads 128 contiguous bytes) and feeds the mma from there; no
// tile is written, no ldmatrix reads one back. Device pages are written by the device (append,
// block finalize), so their byte order is free; the CPU's page formats stay row-major and a device
// page is their transcoding (the host forms below: what the device writes).
//
// The A operand of m16n8k16 (16 x 16, 16-bit elements): lane l, register r (0..3), half h (0, 1)
// holds element (row g + 8 (r & 1), column 2 t + h + 8 (r >> 1)) with g = l / 4, t = l % 4.
// Pages use it two ways (docs/cuda.md, "Fragment-major pages"):
//   K: S^T = K Q^T, A = K: rows are the page's tokens, columns channels 16 s .. 16 s + 15 of step s;
//   V: O^T = V^T P^T, A = V^T: rows are channels 16 s .. 16 s + 15 of step s, columns the tokens.
// Element (lane l, register r, half h) of step s lives at s * 256 + l * 8 + 2 r + h.
// Pages of 8-bit codes (fp8) put two steps in a lane's 16 bytes: code (l, r, h) of step s at byte
// (s / 2) * 512 + l * 16 + (s % 2) * 8 + 2 r + h, so that one 16-byte load gives a lane both
// steps' codes, a register's pair of halves from one 16-bit pair of codes.
//
// These are bit layouts shared by every layer that writes or reads device pages: the device KV
// cache's append (bf16 raw pages), the codec's device encoder at block finalize (dither8 pages),
// and the attention kernels (attention/cuda/fragment_layout.h adds the host builders of device
// pages from the codecs' pages). No CUDA headers: the host tests check these maps
// (attention/cuda/fragment_layout_test.cc).
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::format::fragment {

inline constexpr int kPageTokens = 16;
inline constexpr int kStepElements = 256;  // 16 x 16: a warp's A operand of one step
inline constexpr int kLaneElements = 8;    // a lane's four 32-bit registers

// Where the A-operand element (row, column) of a 16 x 16 step lives within the step: lane
// 4 (row % 8) + (column % 8) / 2, register (row / 8) + 2 (column / 8), half column % 2.
CERTKV_HD constexpr int operand_index(int row, int column) {
  const int lane = 4 * (row % 8) + (column % 8) / 2;
  const int reg = row / 8 + 2 * (column / 8);
  return lane * kLaneElements + 2 * reg + column % 2;
}

// The element of token `token`, channel `channel` in a fragment-major K page of head_dim D.
template <int D>
CERTKV_HD constexpr int key_index(int token, int channel) {
  return (channel / 16) * kStepElements + operand_index(token, channel % 16);
}
// ... and in a fragment-major V page.
template <int D>
CERTKV_HD constexpr int value_index(int token, int channel) {
  return (channel / 16) * kStepElements + operand_index(channel % 16, token);
}
// Either, for a head_dim known at run time only (the maps do not depend on it): what the device
// cache's append and the device encoder index 16-bit elements with.
CERTKV_HD constexpr int element_index(bool key, int token, int channel) {
  return (channel / 16) * kStepElements + (key ? operand_index(token, channel % 16) : operand_index(channel % 16, token));
}

// The inverse: the token and the channel of element index i of a K page (key) or a V page.
CERTKV_HD constexpr int element_row(int i) {  // the A operand's row within the step
  const int lane = (i % kStepElements) / kLaneElements, e = i % kLaneElements;
  return lane / 4 + 8 * ((e / 2) & 1);
}
CERTKV_HD constexpr int element_column(int i) {
  const int lane = (i % kStepElements) / kLaneElements, e = i % kLaneElements;
  return 2 * (lane % 4) + (e & 1) + 8 * (e / 4);
}
CERTKV_HD constexpr int element_token(bool key, int i) { return key ? element_row(i) : element_column(i); }
CERTKV_HD constexpr int element_channel(bool key, int i) {
  return 16 * (i / kStepElements) + (key ? element_column(i) : element_row(i));
}

// dither8 K pages take a step's channels a 32-bit word (4 channels, one generator word) per token:
// lane l holds tokens l / 4 and l / 4 + 8, channels 16 s + 4 (l % 4) .. + 3 of step s, as the A
// operand of an mma whose k indices 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (t = l % 4) stand for channels
// 16 s + 4 t + 0, 1, 2, 3 (the query's B operand permuted alike). Its 8 bytes of step s: the word
// of token l / 4, then that of token l / 4 + 8; two steps per 16 bytes as for other codes.
// Registers: 0 = bytes 0, 1; 1 = bytes 4, 5; 2 = bytes 2, 3; 3 = bytes 6, 7.
CERTKV_HD constexpr int word_key_byte(int token, int channel) {
  const int step = channel / 16, lane = 4 * (token % 8) + (channel % 16) / 4;
  return (step / 2) * 2 * kStepElements + lane * 16 + (step % 2) * kLaneElements + (token / 8) * 4 + channel % 4;
}

// The byte of an 8-bit code at element index e of the 16-bit maps above.
CERTKV_HD constexpr int code_byte(int e) {
  const int step = e / kStepElements, within = e % kStepElements;
  return (step / 2) * 2 * kStepElements + (within / kLaneElements) * 16 + (step % 2) * kLaneElements +
         within % kLaneElements;
}

// Where token t, channel c of a K page (`key`) or a V page of head_dim D lives: the element index
// for 16-bit elements, the byte for 8-bit codes.
template <int D, class Element>
CERTKV_HD constexpr int fragment_position(bool key, int token, int channel) {
  const int e = key ? key_index<D>(token, channel) : value_index<D>(token, channel);
  return sizeof(Element) == 1 ? code_byte(e) : e;
}

// A row-major page [kPageTokens][D] (16-bit elements or 8-bit codes) transcoded to fragment-major
// order; `key` chooses the K map, else the V map. rows and out are distinct, kPageTokens * D
// elements each.
template <int D, class Element>
inline void fragment_page_from_rows(const Element* rows, bool key, Element* out) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < D; ++c) out[fragment_position<D, Element>(key, t, c)] = rows[t * D + c];
}
// The inverse: fragment-major back to row-major.
template <int D, class Element>
inline void rows_from_fragment_page(const Element* page, bool key, Element* rows) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < D; ++c) rows[t * D + c] = page[fragment_position<D, Element>(key, t, c)];
}

// ---- dither8 pages (PageFormat::kDither8Fragments) ----------------------------------------------
// The codec's page (docs/format/dither8.md) is kPageTokens token-major records of D int8 codes,
// G = D / 32 fp16 scales and, on K pages, the 2 m bf16 values of the m outlier pairs. The device
// page holds the same bytes moved: the codes fragment-major (K by words, word_key_byte; V as 8-bit
// codes, code_byte of the V map), then the scales [T][G], then (K) the outliers [T][2 m].

// The byte of code (token, channel).
CERTKV_HD constexpr int dither8_code_byte(bool key, int token, int channel) {
  return key ? word_key_byte(token, channel) : code_byte(element_index(false, token, channel));
}
// The first byte of the fp16 scale of (token, group) (G groups of a head_dim D).
CERTKV_HD constexpr int dither8_scale_byte(int head_dim, int groups, int token, int group) {
  return kPageTokens * head_dim + token * 2 * groups + 2 * group;
}
// The first byte of the bf16 outlier value `value` (pair value / 2, channel a then b) of token,
// on a K page with m outlier pairs.
CERTKV_HD constexpr int dither8_outlier_byte(int head_dim, int groups, int m, int token, int value) {
  return kPageTokens * (head_dim + 2 * groups) + token * 4 * m + 2 * value;
}

// ---- fp8-e4m3 pages with the exponent witness (PageFormat::kFp8Fragments) ------------------------
// The codec's page (docs/format/lossy_pages.md) with WitnessCode::kExponent: on K pages the codes
// [T][D] alone (the codes bound their own rounding), on V pages the codes then rho [T] fp16. The
// device page holds the same bytes moved: the codes fragment-major (code_byte of the K or V map),
// then (V) rho where the codec has it, at byte kPageTokens * head_dim.

// The byte of code (token, channel).
CERTKV_HD constexpr int fp8_code_byte(bool key, int token, int channel) {
  return code_byte(element_index(key, token, channel));
}
// Bytes of such a page: K kPageTokens * head_dim, V 2 more per token.
CERTKV_HD constexpr int fp8_page_bytes(bool key, int head_dim) {
  return kPageTokens * head_dim + (key ? 0 : 2 * kPageTokens);
}

// ---- GAAC pages in a device layout (PageFormat::kGaacFragments, docs/format/gaac_fragments.md) --
// Lossless: each bf16 element keeps its sign, its 7 mantissa bits and its exponent as a 4-bit code
// against its channel's 16-wide window [b, b + 16) (the GAAC calibration's b4), 12 bits in all;
// an element outside its window (or a zero, subnormal, inf or NaN) is an exception of the page,
// stored whole after the codes. The kernel decodes an element as the bf16 of exponent kGaacBuilt +
// code, that is k 2^(kGaacBuilt - b), and folds 2^(b - kGaacBuilt) into the query (K pages) or the
// output (V pages) once: exact, a power of two. A lane's 8 elements of step s (the fragment maps'
// element order e = 2 r + h) are
//   8 low bytes: the low byte of the built bf16, (code & 1) << 7 | mantissa, at code_byte() as for
//     8-bit codes (two steps per lane's 16 bytes);
//   one 32-bit word X: the code's high 3 bits of e = 0..3 at bits 4 e, of e = 4..7 at bits
//     16 + 4 (e - 4); the sign of e = 0..3 at bit 8 e + 7, of e = 4..7 at bit 8 (e - 4) + 3. So
//     PRMT(table, X & 0x7777) | (X & 0x80808080) gives the high bytes of e = 0..3 and
//     PRMT(table, (X >> 16) & 0x7777) | ((X << 4) & 0x80808080) those of e = 4..7.
// The words of steps 4 j .. 4 j + 3 of a lane are its 16 bytes of chunk j after the low bytes; then
// the exceptions: a u32 count and up to gaac_exception_capacity(D) u32 entries (element index |
// built bf16 bits << 16), D / 4 bytes in all. A page with more exceptions, or one whose built value
// k 2^(kGaacBuilt - b) is not exactly a bf16, is kept exact (a raw bf16 page).

inline constexpr int kGaacBuilt = 128;  // the built exponent of code 0 (a multiple of 16)
// The high bytes of the built bf16 of codes 2 i and 2 i + 1 (positive), i = 0..7, as PRMT's table.
inline constexpr uint32_t kGaacHighLow = 0x43424140u, kGaacHighHigh = 0x47464544u;

CERTKV_HD constexpr int gaac_low_bytes(int head_dim) { return kPageTokens * head_dim; }
CERTKV_HD constexpr int gaac_word_bytes(int head_dim) { return kPageTokens * head_dim / 2; }
CERTKV_HD constexpr int gaac_exception_bytes(int head_dim) { return head_dim / 4; }
CERTKV_HD constexpr int gaac_exception_capacity(int head_dim) { return head_dim / 16 - 1; }
CERTKV_HD constexpr int gaac_page_bytes(int head_dim) {
  return gaac_low_bytes(head_dim) + gaac_word_bytes(head_dim) + gaac_exception_bytes(head_dim);
}
// The byte of lane `lane`'s word X of step s.
CERTKV_HD constexpr int gaac_word_byte(int head_dim, int step, int lane) {
  return gaac_low_bytes(head_dim) + (step / 4) * 512 + lane * 16 + (step % 4) * 4;
}
// Where element e (0..7) of a lane's step keeps the high 3 bits of its code and its sign in X.
CERTKV_HD constexpr int gaac_code_bit(int e) { return e < 4 ? 4 * e : 16 + 4 * (e - 4); }
CERTKV_HD constexpr int gaac_sign_bit(int e) { return e < 4 ? 8 * e + 7 : 8 * (e - 4) + 3; }

// Whether bf16 x sits in the window [base, base + 16): a normal number of such an exponent.
CERTKV_HD constexpr bool gaac_in_window(uint16_t x, int base) {
  const int e = (x >> 7) & 0xff;
  return e >= 1 && e <= 254 && e >= base && e < base + 16;
}
// The built value of an exception, x 2^(kGaacBuilt - base), by exponent arithmetic: zeros,
// infinities and NaNs as they are, normals and subnormals when the result is a normal bf16;
// false otherwise (the page is kept exact). The device encoder's form; the `_ref` encoder
// computes it in double (codec::gaac_built_bits), and the tests compare the two on every bf16.
CERTKV_HD inline bool gaac_built(uint16_t x, int base, uint16_t* built) {
  const int e = (x >> 7) & 0xff, k = kGaacBuilt - base;
  if (e == 0xff || (x & 0x7fff) == 0) {
    *built = x;
    return true;
  }
  int exponent = e + k;
  uint32_t mantissa = x & 0x7fu;
  if (e == 0) {  // subnormal m 2^-133, m = 2^p (1 + f): normal with exponent field p - 6 + k
    int p = 6;
    while (!(mantissa & (1u << p))) --p;
    exponent = p - 6 + k;
    mantissa = (mantissa << (7 - p)) & 0x7fu;
  }
  if (exponent < 1 || exponent > 254) return false;
  *built = uint16_t((x & 0x8000u) | (uint32_t(exponent) << 7) | mantissa);
  return true;
}

// The four operand registers (bf16 pairs of elements 0, 1 | 2, 3 | 4, 5 | 6, 7) of a lane's step of
// a GAAC page, built (exponent kGaacBuilt + code), from its low bytes (lo0: elements 0..3, lo1:
// 4..7) and its word x. perm is PRMT in its default mode with selectors of 3-bit indices: the
// device's __byte_perm, the host emulation's byte_perm. An exception's element is patched after.
template <class Perm>
CERTKV_HD inline void gaac_step_operands(uint32_t lo0, uint32_t lo1, uint32_t x, Perm perm, uint32_t (&a)[4]) {
  const uint32_t high_a = perm(kGaacHighLow, kGaacHighHigh, x & 0x7777u) | (x & 0x80808080u);
  const uint32_t high_b = perm(kGaacHighLow, kGaacHighHigh, (x >> 16) & 0x7777u) | ((x << 4) & 0x80808080u);
  a[0] = perm(lo0, high_a, 0x5140u);
  a[1] = perm(lo0, high_a, 0x7362u);
  a[2] = perm(lo1, high_b, 0x5140u);
  a[3] = perm(lo1, high_b, 0x7362u);
}
// An exception entry: the element index (the fragment maps' element_index) in the low 16 bits,
// the built bf16 in the high 16.
CERTKV_HD constexpr uint32_t gaac_exception(int element, uint16_t built) { return uint32_t(element) | (uint32_t(built) << 16); }

// Writes exception `entry` into a lane's operands a[steps][4] (the built bf16 pairs of
// gaac_step_operands, step by step) when its element is the lane's; an element past the page
// matches no lane's step. The kept half and the written half are made once; each register then
// takes one compare, one logic operation and one select (every index a constant after
// unrolling: no local memory).
template <int kSteps>
CERTKV_HD inline void gaac_patch(uint32_t entry, int lane, uint32_t (&a)[kSteps][4]) {
  const int element = int(entry & 0xffffu);
  const int index = ((element >> 3) & 31) == lane ? (element >> 8) * 4 + ((element >> 1) & 3) : -1;
  const uint32_t keep = (element & 1) ? 0x0000ffffu : 0xffff0000u;
  const uint32_t put = (element & 1) ? (entry & 0xffff0000u) : (entry >> 16);
  CERTKV_UNROLL
  for (int s = 0; s < kSteps; ++s)
    CERTKV_UNROLL
    for (int r = 0; r < 4; ++r)
      if (index == 4 * s + r) a[s][r] = (a[s][r] & keep) | put;
}

// Host forms for a head_dim known at run time (the device cache's uploads and reads). D a
// multiple of 16; pages of kPageTokens tokens.
// bf16 rows [T][D] <-> a fragment-major bf16 page (K or V map).
inline void bf16_page_to_fragments(bool key, int head_dim, const uint16_t* rows, uint16_t* out) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < head_dim; ++c) out[element_index(key, t, c)] = rows[t * head_dim + c];
}
inline void bf16_page_from_fragments(bool key, int head_dim, const uint16_t* page, uint16_t* rows) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < head_dim; ++c) rows[t * head_dim + c] = page[element_index(key, t, c)];
}
// The codec's dither8 page (records) <-> the device page; groups = head_dim / 32, m the K page's
// outlier pairs (0 for V). The two buffers are distinct, kPageTokens (head_dim + 2 groups + 4 m)
// bytes each.
inline void dither8_page_to_fragments(bool key, int head_dim, int groups, int m, const uint8_t* records,
                                      uint8_t* out) {
  const int record = head_dim + 2 * groups + 4 * m;
  for (int t = 0; t < kPageTokens; ++t) {
    const uint8_t* rec = records + t * record;
    for (int c = 0; c < head_dim; ++c) out[dither8_code_byte(key, t, c)] = rec[c];
    for (int g = 0; g < groups; ++g)
      for (int b = 0; b < 2; ++b) out[dither8_scale_byte(head_dim, groups, t, g) + b] = rec[head_dim + 2 * g + b];
    for (int v = 0; v < 2 * m; ++v)
      for (int b = 0; b < 2; ++b)
        out[dither8_outlier_byte(head_dim, groups, m, t, v) + b] = rec[head_dim + 2 * groups + 2 * v + b];
  }
}
inline void dither8_page_from_fragments(bool key, int head_dim, int groups, int m, const uint8_t* page,
                                        uint8_t* records) {
  const int record = head_dim + 2 * groups + 4 * m;
  for (int t = 0; t < kPageTokens; ++t) {
    uint8_t* rec = records + t * record;
    for (int c = 0; c < head_dim; ++c) rec[c] = page[dither8_code_byte(key, t, c)];
    for (int g = 0; g < groups; ++g)
      for (int b = 0; b < 2; ++b) rec[head_dim + 2 * g + b] = page[dither8_scale_byte(head_dim, groups, t, g) + b];
    for (int v = 0; v < 2 * m; ++v)
      for (int b = 0; b < 2; ++b)
        rec[head_dim + 2 * groups + 2 * v + b] = page[dither8_outlier_byte(head_dim, groups, m, t, v) + b];
  }
}

// The codec's fp8-e4m3 page (exponent witness) <-> the device page; the two buffers are
// distinct, fp8_page_bytes(key, head_dim) bytes each.
inline void fp8_page_to_fragments(bool key, int head_dim, const uint8_t* codec_page, uint8_t* out) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < head_dim; ++c) out[fp8_code_byte(key, t, c)] = codec_page[t * head_dim + c];
  for (int i = kPageTokens * head_dim; i < fp8_page_bytes(key, head_dim); ++i) out[i] = codec_page[i];
}
inline void fp8_page_from_fragments(bool key, int head_dim, const uint8_t* page, uint8_t* codec_page) {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < head_dim; ++c) codec_page[t * head_dim + c] = page[fp8_code_byte(key, t, c)];
  for (int i = kPageTokens * head_dim; i < fp8_page_bytes(key, head_dim); ++i) codec_page[i] = page[i];
}

}  // namespace certkv::format::fragment
