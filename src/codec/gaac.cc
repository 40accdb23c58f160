// The plain GAAC coder (one element at a time, any element format) and the run-time dispatch to
// the SIMD paths of gaac_x86.cc.
#include "codec/gaac.h"

#include <bit>
#include <string>

#include "codec/gaac_page.h"
#include "core/status.h"

namespace certkv::codec {

namespace detail {

PageGeometry page_geometry(GaacElement element, int block_tokens, int head_dim) {
  if (block_tokens < 1) {
    fail(StatusCode::kInvalidArgument,
         "GAAC page: block_tokens must be at least 1, got " + std::to_string(block_tokens));
  }
  const int channels = format::gaac_tile_channels(head_dim);
  if (channels == 0) {
    fail(StatusCode::kInvalidArgument,
         "GAAC page: head_dim " + std::to_string(head_dim) +
             " does not split into equal tiles of at most 128 channels, multiples of 8");
  }
  if (element != GaacElement::kBf16 && element != GaacElement::kFp8E4M3 &&
      element != GaacElement::kFp8E5M2) {
    fail(StatusCode::kInvalidArgument, "GAAC page: unknown element format " +
                                           std::to_string(static_cast<int>(element)));
  }
  PageGeometry g;
  g.element = element;
  g.exponent_bits = format::gaac_exponent_bits(element);
  g.sign_mantissa_bits = format::gaac_sign_mantissa_bits(element);
  g.block_tokens = block_tokens;
  g.head_dim = head_dim;
  g.tile_channels = channels;
  g.n_tiles = format::gaac_n_tiles(head_dim);
  g.groups_per_token = static_cast<int>(format::gaac_groups_per_token(channels));
  g.tile_groups = format::gaac_tile_groups(block_tokens, channels);
  g.code_offset = format::gaac_tile_code_offset(element, block_tokens, channels);
  g.tag_offset = format::gaac_tile_tag_offset(element, block_tokens, channels);
  g.tag_bytes = format::gaac_tile_tag_bytes(block_tokens, channels);
  g.tile_fixed_bytes = format::gaac_tile_fixed_bytes(element, block_tokens, channels);
  g.page_fixed_bytes = format::gaac_page_fixed_bytes(element, block_tokens, head_dim);
  return g;
}

void check_bases(const PageGeometry& g, const GaacBases& bases) {
  if (bases.b3.size() != size_t(g.head_dim) || bases.b4.size() != size_t(g.head_dim)) {
    fail(StatusCode::kInvalidArgument,
         "GAAC bases: expected " + std::to_string(g.head_dim) + " b3 and b4 entries, got " +
             std::to_string(bases.b3.size()) + " and " + std::to_string(bases.b4.size()));
  }
  const int n_exponents = 1 << g.exponent_bits;
  for (int c = 0; c < g.head_dim; ++c) {
    if (bases.b3[c] + 8 > n_exponents || bases.b4[c] + 16 > n_exponents) {
      fail(StatusCode::kInvalidArgument,
           "GAAC bases: channel " + std::to_string(c) + " has b3 " + std::to_string(bases.b3[c]) +
               ", b4 " + std::to_string(bases.b4[c]) + ": windows leave the " +
               std::to_string(g.exponent_bits) + "-bit exponent range");
    }
  }
}

[[noreturn]] void fail_bad_tag(int tile, size_t group, unsigned tag, GaacElement element) {
  fail(StatusCode::kCorrupt, "GAAC page: tile " + std::to_string(tile) + " group " +
                                 std::to_string(group) + " has mode tag " + std::to_string(tag) +
                                 ", invalid for " + gaac_element_name(element));
}

size_t escape_bytes_of_tags(const PageGeometry& g, const uint8_t* tile_start, int tile,
                            size_t group_begin, size_t group_end) {
  const uint8_t* tags = tile_start + g.tag_offset;
  const size_t raw_bytes = size_t(escape_bytes_of_mode(g, format::kGaacModeRaw));
  size_t total = 0;
  size_t group = group_begin;
  // Whole tag bytes: count 4-bit (01) and raw (10) tags with popcounts; 11 (and 01 for E4M3) is
  // invalid.
  const bool four_bit_valid = format::gaac_mode_valid(g.element, format::kGaacMode4Bit);
  while (group < group_end && group % 4 != 0) {
    const unsigned tag = tag_of_group(tags, group);
    if (!format::gaac_mode_valid(g.element, static_cast<uint8_t>(tag))) {
      fail_bad_tag(tile, group, tag, g.element);
    }
    total += size_t(escape_bytes_of_mode(g, tag));
    ++group;
  }
  while (group + 4 <= group_end) {
    const unsigned byte = tags[group / 4];
    const unsigned low = byte & 0x55u;
    const unsigned high = (byte >> 1) & 0x55u;
    if ((low & high) != 0 || (!four_bit_valid && (low & ~high) != 0)) {
      for (size_t k = 0; k < 4; ++k) {
        const unsigned tag = tag_of_group(tags, group + k);
        if (!format::gaac_mode_valid(g.element, static_cast<uint8_t>(tag))) {
          fail_bad_tag(tile, group + k, tag, g.element);
        }
      }
    }
    total += size_t(std::popcount(low & ~high)) + raw_bytes * size_t(std::popcount(high & ~low));
    group += 4;
  }
  while (group < group_end) {
    const unsigned tag = tag_of_group(tags, group);
    if (!format::gaac_mode_valid(g.element, static_cast<uint8_t>(tag))) {
      fail_bad_tag(tile, group, tag, g.element);
    }
    total += size_t(escape_bytes_of_mode(g, tag));
    ++group;
  }
  return total;
}

void fail_truncated_slot(const PageGeometry& g, size_t slot_bytes) {
  fail(StatusCode::kCorrupt, "GAAC page: slot of " + std::to_string(slot_bytes) +
                                 " bytes is shorter than its fixed part of " +
                                 std::to_string(g.page_fixed_bytes) + " bytes");
}

void fail_escape_overrun(int tile, size_t group, size_t escape_end, size_t area_bytes) {
  fail(StatusCode::kCorrupt, "GAAC page: tile " + std::to_string(tile) + " group " +
                                 std::to_string(group) + " needs escape bytes up to " +
                                 std::to_string(escape_end) + " but the slot holds " +
                                 std::to_string(area_bytes) + " escape bytes");
}

}  // namespace detail

namespace {

using detail::PageGeometry;

// The mode of one group: the narrowest whose window holds all 8 exponents (seed 003, "the
// exponent width of group g").
unsigned choose_mode(const PageGeometry& g, const uint32_t* e, const uint8_t* b3,
                     const uint8_t* b4) {
  bool fits3 = true;
  bool fits4 = format::gaac_mode_valid(g.element, format::kGaacMode4Bit);
  for (int j = 0; j < 8; ++j) {
    const int d3 = int(e[j]) - int(b3[j]);
    const int d4 = int(e[j]) - int(b4[j]);
    fits3 = fits3 && d3 >= 0 && d3 < 8;
    fits4 = fits4 && d4 >= 0 && d4 < 16;
  }
  return fits3 ? format::kGaacMode3Bit : fits4 ? format::kGaacMode4Bit : format::kGaacModeRaw;
}

// Packs 8 fields of w bits (format/gaac_layout.h's rule) into w bytes.
void put_fields(uint8_t* dst, const uint32_t* values, int w) {
  uint64_t acc = 0;
  const uint64_t mask = (uint64_t(1) << w) - 1;
  for (int j = 0; j < 8; ++j) acc |= (uint64_t(values[j]) & mask) << (w * j);
  detail::store_le(dst, acc, w);
}

void get_fields(const uint8_t* src, int w, uint32_t* values) {
  const uint64_t acc = detail::load_le(src, w);
  const uint64_t mask = (uint64_t(1) << w) - 1;
  for (int j = 0; j < 8; ++j) values[j] = uint32_t((acc >> (w * j)) & mask);
}

// Splits an element's bits into sign+mantissa and exponent, and joins them back.
struct ElementBits {
  int mantissa_bits;
  int exponent_bits;
  uint32_t sign_mantissa(uint32_t v) const {
    return ((v >> (exponent_bits + mantissa_bits)) << mantissa_bits) |
           (v & ((1u << mantissa_bits) - 1));
  }
  uint32_t exponent(uint32_t v) const { return (v >> mantissa_bits) & ((1u << exponent_bits) - 1); }
  uint32_t join(uint32_t sm, uint32_t e) const {
    return ((sm >> mantissa_bits) << (exponent_bits + mantissa_bits)) | (e << mantissa_bits) |
           (sm & ((1u << mantissa_bits) - 1));
  }
};

ElementBits element_bits(const PageGeometry& g) {
  return ElementBits{g.sign_mantissa_bits - 1, g.exponent_bits};
}

// Visits each group in page order with its elements' exponents; used by the encoder and the
// escape counter. Load(i) returns the bits of element i of the page.
template <class Load, class Visit>
void for_each_group(const PageGeometry& g, const Load& load, const Visit& visit) {
  const ElementBits bits = element_bits(g);
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    for (size_t group = 0; group < g.tile_groups; ++group) {
      const size_t token = group / size_t(g.groups_per_token);
      const int channel0 = tile * g.tile_channels + 8 * int(group % size_t(g.groups_per_token));
      uint32_t sm[8];
      uint32_t e[8];
      for (int j = 0; j < 8; ++j) {
        const uint32_t v = load(token * size_t(g.head_dim) + size_t(channel0 + j));
        sm[j] = bits.sign_mantissa(v);
        e[j] = bits.exponent(v);
      }
      visit(tile, group, channel0, sm, e);
    }
  }
}

template <class Load>
size_t escape_bytes_needed_ref(const PageGeometry& g, const Load& load, const GaacBases& bases) {
  size_t total = 0;
  for_each_group(g, load, [&](int, size_t, int channel0, const uint32_t*, const uint32_t* e) {
    const unsigned mode = choose_mode(g, e, &bases.b3[channel0], &bases.b4[channel0]);
    total += size_t(detail::escape_bytes_of_mode(g, mode));
  });
  return total;
}

template <class Load>
size_t encode_ref(const PageGeometry& g, const Load& load, const GaacBases& bases,
                  size_t escape_capacity_bytes, uint8_t* out) {
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    memset(out + size_t(tile) * g.tile_fixed_bytes + g.tag_offset, 0, g.tag_bytes);
  }
  uint8_t* escapes = out + g.page_fixed_bytes;
  size_t escape_used = 0;
  bool fits = true;
  for_each_group(g, load, [&](int tile, size_t group, int channel0, const uint32_t* sm,
                              const uint32_t* e) {
    if (!fits) return;
    uint8_t* tile_start = out + size_t(tile) * g.tile_fixed_bytes;
    const unsigned mode = choose_mode(g, e, &bases.b3[channel0], &bases.b4[channel0]);
    uint32_t code[8];
    uint32_t low[8];
    uint32_t high[8];
    for (int j = 0; j < 8; ++j) {
      code[j] = mode == format::kGaacMode3Bit   ? e[j] - bases.b3[channel0 + j]
                : mode == format::kGaacMode4Bit ? e[j] - bases.b4[channel0 + j]
                                                : e[j];
      low[j] = code[j] & 7u;
      high[j] = code[j] >> 3;
    }
    put_fields(tile_start + group * size_t(g.sign_mantissa_bits), sm, g.sign_mantissa_bits);
    put_fields(tile_start + g.code_offset + group * 3, low, 3);
    tile_start[g.tag_offset + group / 4] |= static_cast<uint8_t>(mode << (2 * (group % 4)));
    const int n_escape = detail::escape_bytes_of_mode(g, mode);
    if (escape_used + size_t(n_escape) > escape_capacity_bytes) {
      fits = false;
      return;
    }
    if (n_escape > 0) put_fields(escapes + escape_used, high, n_escape);
    escape_used += size_t(n_escape);
  });
  return fits ? g.page_fixed_bytes + escape_used : kGaacDoesNotFit;
}

// Decodes token rows [token_begin, token_end); Store(token, channel, bits) writes one element.
template <class Store>
void decode_rows_ref(const uint8_t* slot, size_t slot_bytes, const PageGeometry& g,
                     const GaacBases& bases, int token_begin, int token_end, const Store& store) {
  if (slot_bytes < g.page_fixed_bytes) detail::fail_truncated_slot(g, slot_bytes);
  const size_t area_bytes = slot_bytes - g.page_fixed_bytes;
  const uint8_t* escapes = slot + g.page_fixed_bytes;
  const ElementBits bits = element_bits(g);
  const size_t group_begin = size_t(token_begin) * size_t(g.groups_per_token);
  const size_t group_end = size_t(token_end) * size_t(g.groups_per_token);
  size_t escape_pos = 0;  // escape bytes of all groups before the current one, in page order
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tile_start = slot + size_t(tile) * g.tile_fixed_bytes;
    const size_t scan_end = tile + 1 == g.n_tiles ? group_end : g.tile_groups;
    for (size_t group = 0; group < scan_end; ++group) {
      const unsigned mode = detail::tag_of_group(tile_start + g.tag_offset, group);
      if (!format::gaac_mode_valid(g.element, static_cast<uint8_t>(mode))) {
        detail::fail_bad_tag(tile, group, mode, g.element);
      }
      const int n_escape = detail::escape_bytes_of_mode(g, mode);
      if (group >= group_begin && group < group_end) {
        if (escape_pos + size_t(n_escape) > area_bytes) {
          detail::fail_escape_overrun(tile, group, escape_pos + size_t(n_escape), area_bytes);
        }
        uint32_t sm[8];
        uint32_t low[8];
        uint32_t high[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        get_fields(tile_start + group * size_t(g.sign_mantissa_bits), g.sign_mantissa_bits, sm);
        get_fields(tile_start + g.code_offset + group * 3, 3, low);
        if (n_escape > 0) get_fields(escapes + escape_pos, n_escape, high);
        const size_t token = group / size_t(g.groups_per_token);
        const int channel0 = tile * g.tile_channels + 8 * int(group % size_t(g.groups_per_token));
        for (int j = 0; j < 8; ++j) {
          const uint32_t code = low[j] | (high[j] << 3);
          const uint32_t base = mode == format::kGaacMode3Bit   ? bases.b3[channel0 + j]
                                : mode == format::kGaacMode4Bit ? bases.b4[channel0 + j]
                                                                : 0u;
          store(int(token), channel0 + j, bits.join(sm[j], base + code));
        }
      }
      escape_pos += size_t(n_escape);
    }
  }
}

void check_rows(const PageGeometry& g, int token_begin, int token_end) {
  if (token_begin < 0 || token_begin > token_end || token_end > g.block_tokens) {
    fail(StatusCode::kOutOfRange, "GAAC decode: token rows [" + std::to_string(token_begin) +
                                      ", " + std::to_string(token_end) +
                                      ") outside a block of " + std::to_string(g.block_tokens));
  }
}

void check_fp8(GaacElement element) {
  if (element != GaacElement::kFp8E4M3 && element != GaacElement::kFp8E5M2) {
    fail(StatusCode::kInvalidArgument,
         std::string("GAAC FP8 page: element must be e4m3 or e5m2, got ") +
             gaac_element_name(element));
  }
}

PageGeometry checked_geometry(GaacElement element, int block_tokens, int head_dim,
                              const GaacBases& bases) {
  PageGeometry g = detail::page_geometry(element, block_tokens, head_dim);
  detail::check_bases(g, bases);
  return g;
}

void check_kernel(GaacKernel kernel) {
  if (!gaac_kernel_supported(kernel)) {
    fail(StatusCode::kUnsupported,
         std::string("GAAC: kernel ") + gaac_kernel_name(kernel) + " is not supported by this CPU");
  }
}

}  // namespace

const char* gaac_element_name(GaacElement element) {
  switch (element) {
    case GaacElement::kBf16: return "bf16";
    case GaacElement::kFp8E4M3: return "e4m3";
    case GaacElement::kFp8E5M2: return "e5m2";
  }
  return "unknown";
}

const char* gaac_kernel_name(GaacKernel kernel) {
  switch (kernel) {
    case GaacKernel::kRef: return "ref";
    case GaacKernel::kAvx2: return "avx2";
    case GaacKernel::kAvx512: return "avx512";
  }
  return "unknown";
}

bool gaac_kernel_supported(GaacKernel kernel) {
  switch (kernel) {
    case GaacKernel::kRef: return true;
    case GaacKernel::kAvx2: return detail::cpu_has_avx2();
    case GaacKernel::kAvx512: return detail::cpu_has_avx512();
  }
  return false;
}

GaacKernel gaac_best_kernel() {
  static const GaacKernel best = detail::cpu_has_avx512() ? GaacKernel::kAvx512
                                 : detail::cpu_has_avx2() ? GaacKernel::kAvx2
                                                          : GaacKernel::kRef;
  return best;
}

size_t gaac_escape_bytes_needed(const uint16_t* bf16, int block_tokens, int head_dim,
                                const GaacBases& bases) {
  const PageGeometry g = checked_geometry(GaacElement::kBf16, block_tokens, head_dim, bases);
  return escape_bytes_needed_ref(g, [bf16](size_t i) { return uint32_t(bf16[i]); }, bases);
}

size_t gaac_encode_page_ref(const uint16_t* bf16, int block_tokens, int head_dim,
                            const GaacBases& bases, size_t escape_capacity_bytes, uint8_t* out) {
  const PageGeometry g = checked_geometry(GaacElement::kBf16, block_tokens, head_dim, bases);
  return encode_ref(g, [bf16](size_t i) { return uint32_t(bf16[i]); }, bases,
                    escape_capacity_bytes, out);
}

size_t gaac_encode_page(const uint16_t* bf16, int block_tokens, int head_dim,
                        const GaacBases& bases, size_t escape_capacity_bytes, uint8_t* out,
                        GaacKernel kernel) {
  check_kernel(kernel);
  const PageGeometry g = checked_geometry(GaacElement::kBf16, block_tokens, head_dim, bases);
  switch (kernel) {
    case GaacKernel::kAvx512:
      return detail::encode_page_bf16_avx512(bf16, g, bases, escape_capacity_bytes, out);
    case GaacKernel::kAvx2:
      return detail::encode_page_bf16_avx2(bf16, g, bases, escape_capacity_bytes, out);
    case GaacKernel::kRef: break;
  }
  return encode_ref(g, [bf16](size_t i) { return uint32_t(bf16[i]); }, bases,
                    escape_capacity_bytes, out);
}

void gaac_decode_rows_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                          const GaacBases& bases, int token_begin, int token_end, uint16_t* out) {
  const PageGeometry g = checked_geometry(GaacElement::kBf16, block_tokens, head_dim, bases);
  check_rows(g, token_begin, token_end);
  decode_rows_ref(slot, slot_bytes, g, bases, token_begin, token_end,
                  [&](int token, int channel, uint32_t v) {
                    out[size_t(token - token_begin) * size_t(head_dim) + size_t(channel)] =
                        static_cast<uint16_t>(v);
                  });
}

void gaac_decode_page_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                          const GaacBases& bases, uint16_t* out) {
  gaac_decode_rows_ref(slot, slot_bytes, block_tokens, head_dim, bases, 0, block_tokens, out);
}

GaacPageGeometry gaac_page_geometry(GaacElement element, int block_tokens, int head_dim) {
  return detail::page_geometry(element, block_tokens, head_dim);
}

void validate_gaac_bases(GaacElement element, int block_tokens, int head_dim, const GaacBases& bases) {
  checked_geometry(element, block_tokens, head_dim, bases);
}

GaacRowDecoder::GaacRowDecoder(int block_tokens, int head_dim, const GaacBases& bases,
                               GaacKernel kernel)
    : geometry_(checked_geometry(GaacElement::kBf16, block_tokens, head_dim, bases)),
      bases_(&bases),
      kernel_(kernel) {
  check_kernel(kernel);
}

void GaacRowDecoder::decode_rows(const uint8_t* slot, size_t slot_bytes, int token_begin,
                                 int token_end, uint16_t* out) const {
  const PageGeometry& g = geometry_;
  check_rows(g, token_begin, token_end);
  switch (kernel_) {
    case GaacKernel::kAvx512:
      detail::decode_rows_bf16_avx512(slot, slot_bytes, g, *bases_, token_begin, token_end, out);
      return;
    case GaacKernel::kAvx2:
      detail::decode_rows_bf16_avx2(slot, slot_bytes, g, *bases_, token_begin, token_end, out);
      return;
    case GaacKernel::kRef: break;
  }
  decode_rows_ref(slot, slot_bytes, g, *bases_, token_begin, token_end,
                  [&](int token, int channel, uint32_t v) {
                    out[size_t(token - token_begin) * size_t(g.head_dim) + size_t(channel)] =
                        static_cast<uint16_t>(v);
                  });
}

void GaacRowDecoder::decode_rows(const uint8_t* slot, size_t slot_bytes, int token_begin,
                                 int token_end, float* out) const {
  const PageGeometry& g = geometry_;
  check_rows(g, token_begin, token_end);
  switch (kernel_) {
    case GaacKernel::kAvx512:
      detail::decode_rows_float_avx512(slot, slot_bytes, g, *bases_, token_begin, token_end, out);
      return;
    case GaacKernel::kAvx2:
      detail::decode_rows_float_avx2(slot, slot_bytes, g, *bases_, token_begin, token_end, out);
      return;
    case GaacKernel::kRef: break;
  }
  decode_rows_ref(slot, slot_bytes, g, *bases_, token_begin, token_end,
                  [&](int token, int channel, uint32_t v) {
                    out[size_t(token - token_begin) * size_t(g.head_dim) + size_t(channel)] =
                        format::bf16_to_float(static_cast<uint16_t>(v));
                  });
}

void gaac_decode_rows(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, int token_begin, int token_end, uint16_t* out,
                      GaacKernel kernel) {
  GaacRowDecoder(block_tokens, head_dim, bases, kernel)
      .decode_rows(slot, slot_bytes, token_begin, token_end, out);
}

void gaac_decode_rows(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, int token_begin, int token_end, float* out,
                      GaacKernel kernel) {
  GaacRowDecoder(block_tokens, head_dim, bases, kernel)
      .decode_rows(slot, slot_bytes, token_begin, token_end, out);
}

void gaac_decode_page(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, uint16_t* out, GaacKernel kernel) {
  gaac_decode_rows(slot, slot_bytes, block_tokens, head_dim, bases, 0, block_tokens, out, kernel);
}

GaacModeCounts gaac_count_modes(GaacElement element, const uint8_t* slot, size_t slot_bytes,
                                int block_tokens, int head_dim) {
  const PageGeometry g = detail::page_geometry(element, block_tokens, head_dim);
  if (slot_bytes < g.page_fixed_bytes) detail::fail_truncated_slot(g, slot_bytes);
  GaacModeCounts counts;
  for (int tile = 0; tile < g.n_tiles; ++tile) {
    const uint8_t* tags = slot + size_t(tile) * g.tile_fixed_bytes + g.tag_offset;
    for (size_t group = 0; group < g.tile_groups; ++group) {
      const unsigned mode = detail::tag_of_group(tags, group);
      if (!format::gaac_mode_valid(element, static_cast<uint8_t>(mode))) {
        detail::fail_bad_tag(tile, group, mode, element);
      }
      ++counts.groups[mode];
      counts.escape_bytes += size_t(detail::escape_bytes_of_mode(g, mode));
    }
  }
  return counts;
}

size_t gaac_escape_bytes_needed_fp8(GaacElement element, const uint8_t* fp8, int block_tokens,
                                    int head_dim, const GaacBases& bases) {
  check_fp8(element);
  const PageGeometry g = checked_geometry(element, block_tokens, head_dim, bases);
  return escape_bytes_needed_ref(g, [fp8](size_t i) { return uint32_t(fp8[i]); }, bases);
}

size_t gaac_encode_page_fp8_ref(GaacElement element, const uint8_t* fp8, int block_tokens,
                                int head_dim, const GaacBases& bases,
                                size_t escape_capacity_bytes, uint8_t* out) {
  check_fp8(element);
  const PageGeometry g = checked_geometry(element, block_tokens, head_dim, bases);
  return encode_ref(g, [fp8](size_t i) { return uint32_t(fp8[i]); }, bases,
                    escape_capacity_bytes, out);
}

void gaac_decode_page_fp8_ref(GaacElement element, const uint8_t* slot, size_t slot_bytes,
                              int block_tokens, int head_dim, const GaacBases& bases,
                              uint8_t* out) {
  check_fp8(element);
  const PageGeometry g = checked_geometry(element, block_tokens, head_dim, bases);
  decode_rows_ref(slot, slot_bytes, g, bases, 0, block_tokens,
                  [&](int token, int channel, uint32_t v) {
                    out[size_t(token) * size_t(head_dim) + size_t(channel)] =
                        static_cast<uint8_t>(v);
                  });
}

}  // namespace certkv::codec
