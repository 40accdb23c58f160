#include "codec/gaac_fragments.h"

#include <cmath>
#include <cstring>

#include "format/fragment_layout.h"
#include "format/numeric.h"

namespace certkv::codec {

namespace frag = format::fragment;

namespace {

constexpr int kT = frag::kPageTokens;

bool in_window(uint16_t x, int base) { return frag::gaac_in_window(x, base); }

// x 2^k as a bf16 when exact and a zero, normal, infinity or NaN.
bool scaled_bits(uint16_t x, int k, uint16_t* out) {
  const int e = (x >> 7) & 0xff;
  if (e == 0xff || (x & 0x7fff) == 0) {  // inf, NaN, signed zero: scaling leaves them
    *out = x;
    return true;
  }
  const double v = std::ldexp(double(format::bf16_to_float(x)), k);
  const uint16_t y = format::float_to_bf16(float(v));
  const int ey = (y >> 7) & 0xff;
  if (ey == 0 || ey == 0xff || double(format::bf16_to_float(y)) != v) return false;
  *out = y;
  return true;
}

void put32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
uint32_t get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

bool gaac_built_bits(uint16_t x, int base, uint16_t* built) { return scaled_bits(x, frag::kGaacBuilt - base, built); }

bool gaac_unbuilt_bits(uint16_t built, int base, uint16_t* x) {
  const int e = (built >> 7) & 0xff;
  if (e == 0xff || (built & 0x7fff) == 0) {
    *x = built;
    return true;
  }
  if (e == 0) return false;  // the encoder never builds a subnormal
  const double v = std::ldexp(double(format::bf16_to_float(built)), base - frag::kGaacBuilt);
  const uint16_t y = format::float_to_bf16(float(v));
  if (double(format::bf16_to_float(y)) != v) return false;
  *x = y;
  return true;
}

int gaac_fragment_exceptions(const uint16_t* rows, int head_dim, const uint8_t* bases) {
  int n = 0;
  for (int t = 0; t < kT; ++t)
    for (int c = 0; c < head_dim; ++c) n += !in_window(rows[t * head_dim + c], bases[c]);
  return n;
}

bool gaac_fragment_encode_page_ref(const uint16_t* rows, bool key, int head_dim, const uint8_t* bases, uint8_t* out) {
  const int D = head_dim;
  std::memset(out, 0, size_t(frag::gaac_page_bytes(D)));
  uint8_t* exceptions = out + frag::gaac_low_bytes(D) + frag::gaac_word_bytes(D);
  uint32_t n_exceptions = 0;
  for (int element = 0; element < kT * D; ++element) {  // element order: so are the exceptions
    const int t = frag::element_token(key, element), c = frag::element_channel(key, element);
    const uint16_t x = rows[t * D + c];
    if (!in_window(x, bases[c])) {
      uint16_t built;
      if (n_exceptions == uint32_t(frag::gaac_exception_capacity(D)) || !gaac_built_bits(x, bases[c], &built))
        return false;
      put32(exceptions + 4 + 4 * n_exceptions, frag::gaac_exception(element, built));
      ++n_exceptions;
      continue;  // its codes stay 0: the kernel patches the element
    }
    const int code = ((x >> 7) & 0xff) - bases[c];
    const int step = element / frag::kStepElements, lane = (element % frag::kStepElements) / frag::kLaneElements;
    const int e = element % frag::kLaneElements;
    out[frag::code_byte(element)] = uint8_t(((code & 1) << 7) | (x & 0x7f));
    uint8_t* word = out + frag::gaac_word_byte(D, step, lane);
    uint32_t w = get32(word);
    w |= uint32_t(code >> 1) << frag::gaac_code_bit(e);
    w |= uint32_t(x >> 15) << frag::gaac_sign_bit(e);
    put32(word, w);
  }
  put32(exceptions, n_exceptions);
  return true;
}

bool gaac_fragment_decode_page_ref(const uint8_t* page, bool key, int head_dim, const uint8_t* bases, uint16_t* rows) {
  const int D = head_dim;
  bool ok = true;
  for (int t = 0; t < kT; ++t)
    for (int c = 0; c < D; ++c) {
      const int element = frag::element_index(key, t, c);
      const int step = element / frag::kStepElements, lane = (element % frag::kStepElements) / frag::kLaneElements;
      const int e = element % frag::kLaneElements;
      const uint8_t low = page[frag::code_byte(element)];
      const uint32_t w = get32(page + frag::gaac_word_byte(D, step, lane));
      const int code = int(((w >> frag::gaac_code_bit(e)) & 7) << 1) | (low >> 7);
      const uint32_t sign = (w >> frag::gaac_sign_bit(e)) & 1;
      rows[t * D + c] = uint16_t((sign << 15) | (uint32_t((bases[c] + code) & 0xff) << 7) | (low & 0x7f));
    }
  const uint8_t* exceptions = page + frag::gaac_low_bytes(D) + frag::gaac_word_bytes(D);
  const uint32_t count = get32(exceptions);
  if (count > uint32_t(frag::gaac_exception_capacity(D))) return false;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t entry = get32(exceptions + 4 + 4 * i);
    const int element = int(entry & 0xffff);
    if (element >= kT * D) {
      ok = false;
      continue;
    }
    const int t = frag::element_token(key, element), c = frag::element_channel(key, element);
    uint16_t x;
    if (!gaac_unbuilt_bits(uint16_t(entry >> 16), bases[c], &x)) {
      ok = false;
      continue;
    }
    rows[t * D + c] = x;
  }
  return ok;
}

}  // namespace certkv::codec
