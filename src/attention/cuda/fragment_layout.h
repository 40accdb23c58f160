// Fragment-major device pages: a page's 16 tokens x D elements stored in the order in which the
// lanes of a warp hold them as mma.m16n8k16 A operands, so that a lane's four operand registers
// of one 16-wide step are 16 contiguous bytes and a warp's operands of one step are 512
// contiguous bytes. A kernel loads them with one 16-byte shared-memory load per lane and step
// (conflict-free: each quarter warp reads 128 contiguous bytes) and feeds the mma from there; no
// tile is written, no ldmatrix reads one back. Device pages are written by the device (append,
// block finalize), so their byte order is free; the CPU's page formats stay row-major and a device
// page is their transcoding (fragment_page_from_rows, the host form of what the device writes).
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
// No CUDA headers: the host tests (fragment_layout_test.cc) check these maps.
#pragma once

#include <cstdint>
#include <vector>

#include "codec/lossy_page.h"
#include "format/numeric.h"

namespace certkv::attention::cuda::fragment {

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

// Device pages of the lossy classes from the codec's pages (the `_ref` encoders' bytes, whose
// layouts docs/format/lossy_pages.md and dither8.md give), as the fragment formats store them
// (paged_decode_cuda.h). Rows from n on are poisoned (NaN codes, scales, rho and outliers; dither8
// codes -128): a reader that does not mask them fails its tests.
//
// fp8 E4M3, the raw cast: the codes fragment-major, then (V) the page's rho [T] fp16. cpu_page:
// a page of spec (kFp8E4M3), out: kPageTokens * D bytes, V 32 more.
template <int D>
inline void fp8_fragment_page(const codec::LossyPageSpec& spec, const uint8_t* cpu_page, int64_t n, uint8_t* out) {
  uint8_t codes[kPageTokens * D];
  for (int i = 0; i < kPageTokens * D; ++i) codes[i] = i < n * D ? cpu_page[i] : 0x7f;
  fragment_page_from_rows<D, uint8_t>(codes, spec.key, out);
  if (!spec.key) {
    const uint16_t* rho = codec::lossy_value_rho(spec, cpu_page);
    for (int t = 0; t < kPageTokens; ++t) {
      const uint16_t x = t < n ? rho[t] : uint16_t(0x7e00);
      out[kPageTokens * D + 2 * t] = uint8_t(x & 0xff);
      out[kPageTokens * D + 2 * t + 1] = uint8_t(x >> 8);
    }
  }
}

// dither8: token-major records (D codes, G fp16 scales, 2 m bf16 outlier values) moved: the codes
// fragment-major (K by words, V as 8-bit codes), then the scales [T][G], then (K) the outliers
// [T][2 m]. out may be cpu_page (the records are copied first).
template <int D>
inline void dither8_fragment_page(const codec::LossyPageSpec& spec, const uint8_t* cpu_page, int64_t n, uint8_t* out) {
  constexpr int G = D / codec::kQuantGroup;
  const int m = spec.key ? spec.n_outlier_pairs : 0;
  const size_t record = size_t(D) + 2 * G + 4 * size_t(m);
  const std::vector<uint8_t> records(cpu_page, cpu_page + kPageTokens * record);
  for (int t = 0; t < kPageTokens; ++t) {
    const uint8_t* rec = records.data() + size_t(t) * record;
    const bool live = t < n;
    for (int c = 0; c < D; ++c)
      out[spec.key ? word_key_byte(t, c) : fragment_position<D, uint8_t>(false, t, c)] = live ? rec[c] : 0x80;
    for (int i = 0; i < 2 * G; ++i) out[kPageTokens * D + t * 2 * G + i] = live ? rec[D + i] : (i % 2 ? 0x7e : 0x00);
    for (int i = 0; i < 4 * m; ++i)
      out[kPageTokens * (D + 2 * G) + t * 4 * m + i] = live ? rec[D + 2 * G + i] : (i % 2 ? 0x7f : 0xc0);
  }
}

}  // namespace certkv::attention::cuda::fragment
