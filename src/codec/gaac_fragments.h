// GAAC pages in the device layout (PageFormat::kGaacFragments; the bit layout is
// format/fragment_layout.h, docs/format/gaac_fragments.md): the `_ref` encoder and decoder. Each
// bf16 element keeps sign, mantissa and a 4-bit exponent code against its channel's 16-wide
// window [b, b + 16) (the GAAC calibration's b4, at most 240); what falls outside is an exception
// stored whole, as its built value k 2^(kGaacBuilt - b). Lossless: decode(encode(rows)) == rows,
// bit for bit, for every page the encoder accepts.
#pragma once

#include <cstdint>

namespace certkv::codec {

// The built bf16 of x, x 2^(kGaacBuilt - base), when that is exactly a bf16 that is zero, a
// normal number, an infinity or a NaN (NaN payloads kept); false otherwise.
bool gaac_built_bits(uint16_t x, int base, uint16_t* built);
// The inverse: the bf16 whose built value is `built`; false when there is none (a corrupt entry).
bool gaac_unbuilt_bits(uint16_t built, int base, uint16_t* x);

// Encodes a page of 16 tokens, rows [16][head_dim] bf16 bits, as a K page (key) or a V page,
// with bases [head_dim] (each <= 240) into out (format::fragment::gaac_page_bytes(head_dim)
// bytes). false: the page has more exceptions than the page holds or an exception whose built
// value is not a bf16 (keep it exact). head_dim: 64 or 128.
bool gaac_fragment_encode_page_ref(const uint16_t* rows, bool key, int head_dim, const uint8_t* bases, uint8_t* out);
// Decodes a page back to rows [16][head_dim]. false for a corrupt page (an exception count over
// the capacity, an entry's index outside the page or a built value with no bf16 behind it); rows
// then hold what could be read.
bool gaac_fragment_decode_page_ref(const uint8_t* page, bool key, int head_dim, const uint8_t* bases, uint16_t* rows);
// How many exceptions a page of these rows has (what encode would store; may exceed the capacity).
int gaac_fragment_exceptions(const uint16_t* rows, int head_dim, const uint8_t* bases);

}  // namespace certkv::codec
