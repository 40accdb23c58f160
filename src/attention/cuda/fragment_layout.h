// The host builders of fragment-major device pages from the codecs' pages (the maps themselves,
// shared with the device cache and the codec's device encoder, are format/fragment_layout.h; they
// are this namespace's too). No CUDA headers: the host tests (fragment_layout_test.cc) check them.
#pragma once

#include <cstdint>
#include <vector>

#include "codec/lossy_page.h"
#include "format/fragment_layout.h"
#include "format/numeric.h"

namespace certkv::attention::cuda::fragment {

using namespace format::fragment;

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
