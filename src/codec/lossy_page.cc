// The plain reference coders of the lossy page schemes (codec/lossy_page.h): fp8 casts, scaled
// fp8, rtn8, rtn4, kivi2 with their Tier A side data, and dither8 with its counter-based dither;
// and the encoder the cache runs at block finalize, lossy_encode_page, which writes the
// reference's bytes by the same arithmetic (one body, encode_page<kRef>, with tables, one
// rounding instruction and one dither word per four channels where the reference calls the
// plain functions; the side data's norms are lossy_norms.cc's). Byte layouts:
// docs/format/lossy_pages.md and docs/format/dither8.md.
#include "codec/lossy_page.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "codec/lossy_norms.h"
#include "codec/lossy_page_kernels.h"
#include "core/status.h"
#include "core/x86_simd.h"
#include "format/dither8_generator.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::codec {

static_assert(
    std::endian::native == std::endian::little,
    "pages store fp16 little-endian and lossy_witness / lossy_value_rho read them in place");

namespace {

using format::bf16_to_float;
using format::fp16_to_float;

constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockTokens = 4096;
constexpr uint16_t kFp16Inf = 0x7c00;
constexpr uint16_t kFp16NegInf = 0xfc00;
// Top levels the scales divide amax by.
constexpr double kE4M3Max = 448.0;
constexpr double kRtn8Top = 127.0;
constexpr double kRtn4Top = 7.0;
constexpr double kKivi2Steps = 3.0;    // levels 0..3
constexpr double kDither8Top = 126.5;  // Q - 1/2 with Q = 127: no clipping after the dither
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

const char* const kWitnessCodeNames[kNumWitnessCodes] = {"fp16", "u8", "exponent"};
const char* const kRopePairingNames[2] = {"interleaved", "half-split"};
// kPageScaled8: codes c in [0, 255], bound w_max (c + 1) / kWitnessSteps.
constexpr double kWitnessSteps = 256.0;

const char* const kSchemeNames[kNumLossySchemes] = {
    "fp8-e4m3", "fp8-e5m2", "fp8-e4m3-scaled", "rtn8", "rtn4", "kivi2", "dither8"};

// The splitmix64 output function (Steele, Lea and Flood 2014): a bijection of 64-bit words.
uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
void store_u16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}

bool bf16_is_finite(uint16_t h) { return (h & 0x7f80u) != 0x7f80u; }

// Nearest integer, ties to even, whatever the floating-point environment.
double round_half_even(double v) {
  const double r = std::round(v);  // ties away from zero; r - v is exact
  if (std::fabs(r - v) == 0.5) return 2.0 * std::round(v / 2.0);
  return r;
}

// round_half_even in one instruction where SSE4.1 is there (the rounding mode is the
// instruction's, not the environment's); what the production encoder rounds with.
double nearest_even(double v) {
#if defined(__SSE4_1__)
  return _mm_cvtsd_f64(_mm_round_sd(_mm_setzero_pd(), _mm_set_sd(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return round_half_even(v);
#endif
}

// The production encoder's codes of one group of kQuantGroup values: q[c] = the nearest integer
// (ties to even) to x_c / s + xi_c (xi null: + 0), clamped to [-top, top]; each step the
// reference's double operation, with AVX-512 eight at a time. REQUIRES s > 0 and finite x.
void group_codes(const uint16_t* x, double s, const float* xi, double top, int* q) {
  int c = 0;
#if defined(__AVX512F__)
  const __m512d sv = _mm512_set1_pd(s), hi = _mm512_set1_pd(top), lo = _mm512_set1_pd(-top);
  for (; c + 8 <= kQuantGroup; c += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c)));
    __m512d v = _mm512_div_pd(_mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16))), sv);
    if (xi != nullptr) v = _mm512_add_pd(v, _mm512_cvtps_pd(_mm256_loadu_ps(xi + c)));
    v = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c), _mm512_cvtpd_epi32(v));  // integers: exact
  }
#endif
  for (; c < kQuantGroup; ++c) {
    const double v = double(bf16_to_float(x[c])) / s + (xi != nullptr ? double(xi[c]) : 0.0);
    q[c] = int(std::clamp(nearest_even(v), -top, top));
  }
}

// The rounding of each path: the reference's plain one, or the production encoder's.
template <bool kRef>
double round_to_even(double v) {
  if constexpr (kRef) return round_half_even(v);
  return nearest_even(v);
}

// The smallest fp16 >= v (+inf above 65504). Rounding up to float first loses nothing: every
// fp16 value is a float.
uint16_t fp16_upward(double v) { return format::float_to_fp16_upward(format::float_upward(v)); }

// fp16_upward of v[0..n), stored little-endian at out: the production encoder's. With AVX-512
// eight at a time, double -> float and float -> fp16 each rounded toward +inf by the instruction
// (the reference's two steps; non-negative finite or +inf inputs, as the side data's norms are).
// A v in (0, 2^-24) is first raised to 2^-24, where the reference lands it (the smallest fp16):
// no step then has a float subnormal result, which a process running with flush-to-zero would
// turn into a witness of 0 (an unsound bound).
void fp16_upward_n(const double* v, size_t n, uint8_t* out) {
  size_t i = 0;
#if defined(__AVX512F__)
  const __m512d smallest = _mm512_set1_pd(0x1p-24), zero = _mm512_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    __m512d x = _mm512_loadu_pd(v + i);
    const __mmask8 tiny = _mm512_cmp_pd_mask(x, zero, _CMP_GT_OQ) & _mm512_cmp_pd_mask(x, smallest, _CMP_LT_OQ);
    x = _mm512_mask_mov_pd(x, tiny, smallest);
    const __m256 f = _mm512_cvt_roundpd_ps(x, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), _mm256_cvtps_ph(f, _MM_FROUND_TO_POS_INF));
  }
#endif
  for (; i < n; ++i) store_u16(out + 2 * i, fp16_upward(v[i]));
}

// The largest fp16 <= f (-inf below -65504).
uint16_t fp16_downward(float f) { return uint16_t(format::float_to_fp16_upward(-f) ^ 0x8000u); }

struct Geometry {
  int bt = 0;      // block_tokens
  int d = 0;       // head_dim
  int groups = 0;  // d / kQuantGroup
  int m = 0;       // outlier pairs
  size_t payload_bytes = 0;
};

size_t payload_bytes_of(const LossyPageSpec& spec) {
  const size_t bt = size_t(spec.block_tokens), d = size_t(spec.head_dim);
  const size_t groups = d / kQuantGroup;
  switch (spec.scheme) {
    case LossyScheme::kFp8E4M3:
    case LossyScheme::kFp8E5M2:
      return bt * d;
    case LossyScheme::kFp8E4M3Scaled:
      return bt * (d + 2);
    case LossyScheme::kRtn8:
      return bt * (d + 2 * groups);
    case LossyScheme::kRtn4:
      return bt * (d / 2 + 2 * groups);
    case LossyScheme::kKivi2:
      return bt * d / 4 + 4 * (spec.key ? d : bt * groups);
    case LossyScheme::kDither8:
      return bt * (d + 2 * groups + 4 * size_t(spec.n_outlier_pairs));
  }
  return 0;
}

size_t side_bytes_of(const LossyPageSpec& spec) {
  if (lossy_scheme_is_tier_b(spec.scheme)) return 0;
  const size_t bt = size_t(spec.block_tokens);
  if (!spec.key) return bt * 2;
  if (spec.witness == WitnessCode::kExponent) return 0;  // the codes are the witness
  const size_t cells = bt * size_t(witness_bands(spec.head_dim));
  return spec.witness == WitnessCode::kPageScaled8 ? cells + 2 : cells * 2;
}

Geometry geometry_of(const LossyPageSpec& spec) {
  validate_lossy_page_spec(spec);
  Geometry g;
  g.bt = spec.block_tokens;
  g.d = spec.head_dim;
  g.groups = spec.head_dim / kQuantGroup;
  g.m = spec.n_outlier_pairs;
  g.payload_bytes = payload_bytes_of(spec);
  return g;
}

// ---- fp8 casts ----------------------------------------------------------------------------

void encode_fp8_cast(const Geometry& g, int exponent_bits, int mantissa_bits, const uint16_t* x,
                     uint8_t* page) {
  for (size_t i = 0; i < size_t(g.bt) * size_t(g.d); ++i) {
    page[i] = format::float_to_fp8_ref(bf16_to_float(x[i]), exponent_bits, mantissa_bits);
  }
}

void decode_fp8_cast(const Geometry& g, int exponent_bits, int mantissa_bits, const uint8_t* page,
                     float* out) {
  for (size_t i = 0; i < size_t(g.bt) * size_t(g.d); ++i) {
    out[i] = format::fp8_to_float(page[i], exponent_bits, mantissa_bits);
  }
}

// Per token [d E4M3 codes][fp16 s], s = amax / 448 rounded up, codes of x / s with the stored s.
// x / s is rounded to float before the E4M3 rounding; that cannot move a code: a quotient of a
// bf16 by an fp16 is either an E4M3 tie or at least 2^-19 (relative) from one.
bool encode_fp8_e4m3_scaled(const Geometry& g, const uint16_t* x, uint8_t* page) {
  const size_t record = size_t(g.d) + 2;
  for (int t = 0; t < g.bt; ++t) {
    const uint16_t* row = x + size_t(t) * g.d;
    uint8_t* rec = page + size_t(t) * record;
    float amax = 0.0f;
    for (int c = 0; c < g.d; ++c) amax = std::max(amax, std::fabs(bf16_to_float(row[c])));
    const uint16_t s16 = fp16_upward(double(amax) / kE4M3Max);
    if (s16 == kFp16Inf) return false;
    const float s = fp16_to_float(s16);
    for (int c = 0; c < g.d; ++c) {
      rec[c] = s == 0.0f ? uint8_t(0) : format::float_to_fp8_ref(bf16_to_float(row[c]) / s, 4, 3);
    }
    store_u16(rec + g.d, s16);
  }
  return true;
}

void decode_fp8_e4m3_scaled(const Geometry& g, const uint8_t* page, float* out) {
  const size_t record = size_t(g.d) + 2;
  for (int t = 0; t < g.bt; ++t) {
    const uint8_t* rec = page + size_t(t) * record;
    const float s = fp16_to_float(load_u16(rec + g.d));
    if (std::isnan(s)) {  // the whole row the scale's NaN, quieted (detail::scaled_row_nan)
      std::fill_n(out + size_t(t) * g.d, g.d, detail::scaled_row_nan(s));
      continue;
    }
    for (int c = 0; c < g.d; ++c) out[size_t(t) * g.d + c] = s * format::fp8_e4m3_to_float(rec[c]);
  }
}

// ---- rtn8 / rtn4 ----------------------------------------------------------------------------

// Per token [codes][d / 32 fp16 scales]; codes are int8 (rtn8) or q + 8 in a nibble, the even
// channel in the low nibble (rtn4).
size_t rtn_code_bytes(const Geometry& g, int bits) {
  return bits == 8 ? size_t(g.d) : size_t(g.d) / 2;
}

template <bool kRef>
bool encode_rtn(const Geometry& g, int bits, const uint16_t* x, uint8_t* page) {
  const double top = bits == 8 ? kRtn8Top : kRtn4Top;
  const size_t code_bytes = rtn_code_bytes(g, bits);
  const size_t record = code_bytes + 2 * size_t(g.groups);
  int q[kMaxHeadDim];
  for (int t = 0; t < g.bt; ++t) {
    const uint16_t* row = x + size_t(t) * g.d;
    uint8_t* rec = page + size_t(t) * record;
    for (int grp = 0; grp < g.groups; ++grp) {
      const int c0 = grp * kQuantGroup;
      float amax = 0.0f;
      for (int c = c0; c < c0 + kQuantGroup; ++c)
        amax = std::max(amax, std::fabs(bf16_to_float(row[c])));
      const uint16_t s16 = fp16_upward(double(amax) / top);
      if (s16 == kFp16Inf) return false;
      const double s = fp16_to_float(s16);
      if (!kRef && s != 0.0) {
        group_codes(row + c0, s, nullptr, top, q + c0);
      } else {
        for (int c = c0; c < c0 + kQuantGroup; ++c) {
          // x / s in double rounds to the same integer as the exact quotient
          // (docs/format/lossy_pages.md).
          q[c] = s == 0.0
                     ? 0
                     : int(std::clamp(round_to_even<kRef>(double(bf16_to_float(row[c])) / s), -top, top));
        }
      }
      store_u16(rec + code_bytes + 2 * size_t(grp), s16);
    }
    if (bits == 8) {
      for (int c = 0; c < g.d; ++c) rec[c] = uint8_t(int8_t(q[c]));
    } else {
      for (int c = 0; c < g.d; c += 2) rec[c / 2] = uint8_t((q[c] + 8) | ((q[c + 1] + 8) << 4));
    }
  }
  return true;
}

void decode_rtn(const Geometry& g, int bits, const uint8_t* page, float* out) {
  const size_t code_bytes = rtn_code_bytes(g, bits);
  const size_t record = code_bytes + 2 * size_t(g.groups);
  for (int t = 0; t < g.bt; ++t) {
    const uint8_t* rec = page + size_t(t) * record;
    for (int c = 0; c < g.d; ++c) {
      const float s = fp16_to_float(load_u16(rec + code_bytes + 2 * size_t(c / kQuantGroup)));
      const int q = bits == 8 ? int(int8_t(rec[c])) : int((rec[c / 2] >> (4 * (c & 1))) & 0xf) - 8;
      out[size_t(t) * g.d + c] = s * float(q);
    }
  }
}

// ---- kivi2 ----------------------------------------------------------------------------------

// KIVI's asymmetric 2-bit rule on one set of values with minimum mn and maximum mx: min rounded
// down and step rounded up to fp16, so every value lies in [min, min + 3 step].
bool kivi2_params(float mn, float mx, uint16_t* min16, uint16_t* step16) {
  *min16 = fp16_downward(mn);
  if (*min16 == kFp16NegInf) return false;
  *step16 = fp16_upward((double(mx) - double(fp16_to_float(*min16))) / kKivi2Steps);
  return *step16 != kFp16Inf;
}

template <bool kRef>
int kivi2_code(float x, float min, float step) {
  if (step == 0.0f) return 0;  // every value of the set equals min
  const double q = round_to_even<kRef>((double(x) - double(min)) / double(step));
  return int(std::clamp(q, 0.0, kKivi2Steps));
}

float kivi2_recon(float min, float step, int q) { return min + step * float(q); }

// Codes [bt][d / 4] bytes (channel 4i + k in bits 2k..2k+1 of byte i), then fp16 (min, step)
// pairs: K pages one per channel [d], V pages one per token and group [bt][d / 32].
size_t kivi2_param_offset(const Geometry& g, bool key, int t, int c) {
  const size_t base = size_t(g.bt) * size_t(g.d) / 4;
  const size_t pair = key ? size_t(c) : size_t(t) * g.groups + size_t(c / kQuantGroup);
  return base + 4 * pair;
}

template <bool kRef>
bool encode_kivi2(const Geometry& g, bool key, const uint16_t* x, uint8_t* page) {
  const size_t code_bytes = size_t(g.bt) * size_t(g.d) / 4;
  std::memset(page, 0, code_bytes);
  // One parameter set per K channel (over the block's tokens) or per V token group; f(t, c) on
  // each of its members in order.
  const int n_sets = key ? g.d : g.bt * g.groups;
  const auto for_members = [&](int set, auto&& f) {
    if (key) {
      for (int t = 0; t < g.bt; ++t) f(t, set);
    } else {
      const int t = set / g.groups, c0 = (set % g.groups) * kQuantGroup;
      for (int c = c0; c < c0 + kQuantGroup; ++c) f(t, c);
    }
  };
  for (int set = 0; set < n_sets; ++set) {
    float mn = std::numeric_limits<float>::infinity(), mx = -mn;
    for_members(set, [&](int t, int c) {
      const float v = bf16_to_float(x[size_t(t) * g.d + c]);
      mn = std::min(mn, v);
      mx = std::max(mx, v);
    });
    uint16_t min16, step16;
    if (!kivi2_params(mn, mx, &min16, &step16)) return false;
    const float min = fp16_to_float(min16), step = fp16_to_float(step16);
    for_members(set, [&](int t, int c) {
      const int q = kivi2_code<kRef>(bf16_to_float(x[size_t(t) * g.d + c]), min, step);
      page[(size_t(t) * g.d + c) / 4] |= uint8_t(q << (2 * (c & 3)));
    });
    const int t0 = key ? 0 : set / g.groups, c0 = key ? set : (set % g.groups) * kQuantGroup;
    uint8_t* params = page + kivi2_param_offset(g, key, t0, c0);
    store_u16(params, min16);
    store_u16(params + 2, step16);
  }
  return true;
}

void decode_kivi2(const Geometry& g, bool key, const uint8_t* page, float* out) {
  for (int t = 0; t < g.bt; ++t) {
    for (int c = 0; c < g.d; ++c) {
      const uint8_t* params = page + kivi2_param_offset(g, key, t, c);
      const size_t i = size_t(t) * g.d + c;
      const int q = (page[i / 4] >> (2 * (c & 3))) & 3;
      out[i] = kivi2_recon(fp16_to_float(load_u16(params)), fp16_to_float(load_u16(params + 2)), q);
    }
  }
}

// ---- dither8 --------------------------------------------------------------------------------

// Per token [d int8 codes][d / 32 fp16 scales][2 m bf16 outliers, channel a then b of each pair].
size_t dither8_record_bytes(const Geometry& g) {
  return size_t(g.d) + 2 * size_t(g.groups) + 4 * size_t(g.m);
}

// 1 for both channels of every outlier pair of the spec.
std::vector<uint8_t> outlier_channels(const LossyPageSpec& spec) {
  std::vector<uint8_t> mask(size_t(spec.head_dim), 0);
  for (int i = 0; i < spec.n_outlier_pairs; ++i) {
    for (int which = 0; which < 2; ++which) {
      mask[size_t(rope_pair_channel(spec.pairing, spec.head_dim, spec.outlier_pairs[i], which))] =
          1;
    }
  }
  return mask;
}

// The dither of index u: (u + 1/2) / 256 - 1/2, an odd multiple of 2^-9 (dither8_xi's value).
float dither8_xi_of_u(uint32_t u) { return (float(u) + 0.5f) / 256.0f - 0.5f; }

// xi of channels [0, d) of one K row at `counter`, dither8_xi's values with the generator
// unrolled: the row seed once and one 32-bit word per four channels, u of channel c being byte c
// of the little-endian words (dither8_u). The word loop and the xi loop are separate so that both
// vectorize.
inline void dither8_row_xi(uint64_t key, uint64_t counter, int d, float* xi) {
  uint32_t words[kMaxHeadDim / 4];
  uint8_t u[kMaxHeadDim];
  const uint32_t row_seed = format::dither8_row_seed(key, counter);
  for (int w = 0; w < d / 4; ++w) words[w] = format::dither8_word(row_seed, w);
  std::memcpy(u, words, size_t(d));
  for (int c = 0; c < d; ++c) xi[c] = dither8_xi_of_u(u[c]);
}

uint64_t dither8_counter(const Geometry& g, uint32_t block, int row) {
  return uint64_t(block) * uint64_t(g.bt) + uint64_t(row);
}

// x^ = s (round(x / s + xi) - xi) with s = amax / 126.5 stored fp16 (DESIGN.md section 4, Tier B).
// Every operand of x / s + xi is exact in double and the double result rounds to the same
// integer as the exact value (docs/format/dither8.md), so q is round(x / s16 + xi) exactly.
// V pages are not dithered (xi = 0): the certificate's value side is the deterministic rho.
// kRef: xi from dither8_xi per element; else from the row's seed, one word per four channels
// (format/dither8_generator.h, the same values).
template <bool kRef>
bool encode_dither8(const LossyPageSpec& spec, const Geometry& g, uint32_t block,
                    const uint16_t* x, uint8_t* page) {
  const std::vector<uint8_t> outlier = outlier_channels(spec);
  const size_t record = dither8_record_bytes(g);
  float row_xi[kMaxHeadDim];
  for (int t = 0; t < g.bt; ++t) {
    const uint16_t* row = x + size_t(t) * g.d;
    uint8_t* rec = page + size_t(t) * record;
    const uint64_t counter = dither8_counter(g, block, t);
    if (!kRef && spec.key) dither8_row_xi(spec.dither_key, counter, g.d, row_xi);
    for (int grp = 0; grp < g.groups; ++grp) {
      const int c0 = grp * kQuantGroup;
      float amax = 0.0f;
      for (int c = c0; c < c0 + kQuantGroup; ++c) {
        if (!outlier[c]) amax = std::max(amax, std::fabs(bf16_to_float(row[c])));
      }
      const uint16_t s16 = fp16_upward(double(amax) / kDither8Top);
      if (s16 == kFp16Inf) return false;
      const double s = fp16_to_float(s16);
      if (!kRef && s != 0.0) {
        // |x / s + xi| <= 126.5 + 1/2 off the outliers, so the clamp at 128 changes nothing there
        // and keeps an outlier's quotient (replaced by 0) an int.
        int q[kQuantGroup];
        group_codes(row + c0, s, spec.key ? row_xi + c0 : nullptr, 128.0, q);
        for (int c = c0; c < c0 + kQuantGroup; ++c) rec[c] = uint8_t(int8_t(outlier[c] ? 0 : q[c - c0]));
        store_u16(rec + g.d + 2 * size_t(grp), s16);
        continue;
      }
      for (int c = c0; c < c0 + kQuantGroup; ++c) {
        int q = 0;
        if (!outlier[c] && s != 0.0) {
          const double xi = !spec.key ? 0.0 : kRef ? dither8_xi(spec.dither_key, counter, c) : row_xi[c];
          q = int(round_to_even<kRef>(double(bf16_to_float(row[c])) / s + xi));
        }
        rec[c] = uint8_t(int8_t(q));
      }
      store_u16(rec + g.d + 2 * size_t(grp), s16);
    }
    uint8_t* outliers = rec + g.d + 2 * size_t(g.groups);
    for (int i = 0; i < g.m; ++i) {
      for (int which = 0; which < 2; ++which) {
        const int c = rope_pair_channel(spec.pairing, g.d, spec.outlier_pairs[i], which);
        store_u16(outliers + 2 * size_t(2 * i + which), row[c]);
      }
    }
  }
  return true;
}

void decode_dither8(const LossyPageSpec& spec, const Geometry& g, uint32_t block,
                    const uint8_t* page, float* out) {
  const size_t record = dither8_record_bytes(g);
  for (int t = 0; t < g.bt; ++t) {
    const uint8_t* rec = page + size_t(t) * record;
    float* row = out + size_t(t) * g.d;
    const uint64_t counter = dither8_counter(g, block, t);
    for (int c = 0; c < g.d; ++c) {
      const float s = fp16_to_float(load_u16(rec + g.d + 2 * size_t(c / kQuantGroup)));
      // q - xi is exact in float (a multiple of 2^-9 below 127.5 in magnitude); V: xi = 0.
      const float xi = spec.key ? dither8_xi(spec.dither_key, counter, c) : 0.0f;
      row[c] = s * (float(int8_t(rec[c])) - xi);
    }
    const uint8_t* outliers = rec + g.d + 2 * size_t(g.groups);
    for (int i = 0; i < g.m; ++i) {
      for (int which = 0; which < 2; ++which) {
        const int c = rope_pair_channel(spec.pairing, g.d, spec.outlier_pairs[i], which);
        row[c] = bf16_to_float(load_u16(outliers + 2 * size_t(2 * i + which)));
      }
    }
  }
}

// ---- Tier A side data -----------------------------------------------------------------------

// K: w_{t,b} = ||r_{t,b}|| over the channels of band b's RoPE pairs; V: rho_t = ||r_t||; with
// r = x^ - x, each an upper bound (DESIGN.md section 4, Tier A): fp16 rounded up, or for a
// WitnessCode::kPageScaled8 K page a code against the page's largest bound.
template <bool kRef>
void write_tier_a_side_data(const LossyPageSpec& spec, const Geometry& g, const uint16_t* x,
                            const float* recon, uint8_t* side) {
  if (spec.key && spec.witness == WitnessCode::kExponent) return;  // no bytes: the codes bound themselves
  const int n_bands = spec.key ? witness_bands(g.d) : 1;
  // The norms' upper bounds, band-major [n_bands][bt] (lossy_norms.cc).
  thread_local std::vector<double> bound;
  bound.resize(size_t(n_bands) * size_t(g.bt));
  if constexpr (kRef) {
    detail::tier_a_norm_bounds_ref(spec, x, recon, bound.data());
  } else {
    detail::tier_a_norm_bounds(spec, x, recon, bound.data());
  }
  if (!spec.key || spec.witness == WitnessCode::kFp16) {
    // Band-major: the bounds of one band for every token of the block are contiguous, so that
    // attention reads them as a vector per band.
    if constexpr (kRef) {
      for (size_t i = 0; i < bound.size(); ++i) store_u16(side + 2 * i, fp16_upward(bound[i]));
    } else {
      fp16_upward_n(bound.data(), bound.size(), side);
    }
    return;
  }
  // kPageScaled8: w_max = the largest bound rounded up to fp16; c = ceil(256 w / w_max) - 1, raised
  // while w_max (c + 1) / 256 (exact in double) is below the bound.
  const uint16_t top_bits = fp16_upward(*std::max_element(bound.begin(), bound.end()));
  const double top = fp16_to_float(top_bits);
  for (size_t i = 0; i < bound.size(); ++i) {
    int c = 0;
    if (top > 0) {
      c = std::clamp(int(std::ceil(bound[i] * kWitnessSteps / top)) - 1, 0, int(kWitnessSteps) - 1);
      while (c < int(kWitnessSteps) - 1 && top * double(c + 1) / kWitnessSteps < bound[i]) ++c;
    }
    side[i] = uint8_t(c);
  }
  store_u16(side + bound.size(), top_bits);
}

// The name of enumerator `value` in a table of names, "unknown" past it; and the enumerator a
// name stands for (false, `out` untouched, for a name not in the table).
template <typename Enum, size_t N>
const char* name_in(const char* const (&names)[N], Enum value) {
  const size_t i = static_cast<size_t>(value);
  return i < N ? names[i] : "unknown";
}
template <typename Enum, size_t N>
bool parse_name_in(const char* const (&names)[N], std::string_view name, Enum* out) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) {
      *out = static_cast<Enum>(i);
      return true;
    }
  }
  return false;
}

}  // namespace

const char* witness_code_name(WitnessCode code) { return name_in(kWitnessCodeNames, code); }
bool parse_witness_code(std::string_view name, WitnessCode* code) { return parse_name_in(kWitnessCodeNames, name, code); }

bool lossy_witness_supported(LossyScheme scheme, WitnessCode code) {
  if (lossy_scheme_is_tier_b(scheme)) return false;
  switch (code) {
    case WitnessCode::kFp16:
    case WitnessCode::kPageScaled8:
      return true;
    case WitnessCode::kExponent:
      return scheme == LossyScheme::kFp8E4M3;
  }
  return false;
}
bool parse_rope_pairing(std::string_view name, RopePairing* pairing) { return parse_name_in(kRopePairingNames, name, pairing); }

const char* lossy_scheme_name(LossyScheme scheme) { return name_in(kSchemeNames, scheme); }
bool parse_lossy_scheme(std::string_view name, LossyScheme* scheme) { return parse_name_in(kSchemeNames, name, scheme); }

void fail_witness_bands(int head_dim) {
  fail(StatusCode::kInvalidArgument, "witness bands: head_dim must be at least 2, got " + std::to_string(head_dim));
}

void fail_witness_pair(int pair, int n_pairs) {
  fail(StatusCode::kInvalidArgument,
       "witness band: RoPE pair " + std::to_string(pair) + " is outside [0, " + std::to_string(n_pairs) + ")");
}

void validate_lossy_page_spec(const LossyPageSpec& spec) {
  static const std::string where = "lossy page spec: ";
  if (static_cast<int>(spec.scheme) >= kNumLossySchemes) {
    fail(StatusCode::kInvalidArgument,
         where + "scheme " + std::to_string(static_cast<int>(spec.scheme)) + " is unknown");
  }
  if (spec.pairing != RopePairing::kInterleaved && spec.pairing != RopePairing::kHalfSplit) {
    fail(StatusCode::kInvalidArgument,
         where + "pairing " + std::to_string(static_cast<int>(spec.pairing)) + " is unknown");
  }
  if (static_cast<int>(spec.witness) >= kNumWitnessCodes) {
    fail(StatusCode::kInvalidArgument,
         where + "witness code " + std::to_string(static_cast<int>(spec.witness)) + " is unknown");
  }
  if (spec.witness == WitnessCode::kExponent && !lossy_witness_supported(spec.scheme, spec.witness)) {
    fail(StatusCode::kInvalidArgument,
         where + "witness exponent is not sound for " + lossy_scheme_name(spec.scheme) +
             " pages (only the raw fp8-e4m3 cast's codes bound their own error)");
  }
  if (spec.head_dim <= 0 || spec.head_dim % kQuantGroup != 0) {
    fail(StatusCode::kInvalidArgument, where + "head_dim must be a positive multiple of " +
                                           std::to_string(kQuantGroup) + ", got " +
                                           std::to_string(spec.head_dim));
  }
  if (spec.head_dim > kMaxHeadDim) {
    fail(StatusCode::kUnsupported, where + "head_dim " + std::to_string(spec.head_dim) +
                                       " is above the supported " + std::to_string(kMaxHeadDim));
  }
  if (spec.block_tokens < 1 || spec.block_tokens > kMaxBlockTokens) {
    fail(StatusCode::kInvalidArgument, where + "block_tokens must be in [1, " +
                                           std::to_string(kMaxBlockTokens) + "], got " +
                                           std::to_string(spec.block_tokens));
  }
  const int m = spec.n_outlier_pairs;
  if (m < 0) {
    fail(StatusCode::kInvalidArgument, where + "n_outlier_pairs is negative: " + std::to_string(m));
  }
  if (m == 0) return;
  if (spec.scheme != LossyScheme::kDither8) {
    fail(StatusCode::kInvalidArgument, where + "n_outlier_pairs " + std::to_string(m) + " on a " +
                                           lossy_scheme_name(spec.scheme) +
                                           " page; only dither8 keeps outlier pairs");
  }
  if (!spec.key) {
    fail(StatusCode::kInvalidArgument, where + "n_outlier_pairs " + std::to_string(m) +
                                           " on a V page; only K pages keep outlier pairs");
  }
  const int n_pairs = spec.head_dim / 2;
  const int max_pairs = std::min(kMaxOutlierPairs, n_pairs);
  if (m > max_pairs) {
    fail(StatusCode::kInvalidArgument,
         where + "n_outlier_pairs " + std::to_string(m) +
             " is above min(kMaxOutlierPairs, head_dim / 2) = " + std::to_string(max_pairs));
  }
  if (spec.outlier_pairs == nullptr) {
    fail(StatusCode::kInvalidArgument,
         where + "outlier_pairs is null with n_outlier_pairs " + std::to_string(m));
  }
  for (int i = 0; i < m; ++i) {
    const int pair = spec.outlier_pairs[i];
    if (pair >= n_pairs) {
      fail(StatusCode::kInvalidArgument, where + "outlier_pairs[" + std::to_string(i) +
                                             "] = " + std::to_string(pair) + " is outside [0, " +
                                             std::to_string(n_pairs) + ")");
    }
    if (i > 0 && pair <= spec.outlier_pairs[i - 1]) {
      fail(StatusCode::kInvalidArgument,
           where + "outlier_pairs[" + std::to_string(i) + "] = " + std::to_string(pair) +
               (pair == spec.outlier_pairs[i - 1] ? " repeats the previous pair"
                                                  : " is below the previous pair (must increase)"));
    }
  }
}

size_t lossy_payload_bytes(const LossyPageSpec& spec) {
  validate_lossy_page_spec(spec);
  return payload_bytes_of(spec);
}

size_t lossy_page_bytes(const LossyPageSpec& spec) {
  validate_lossy_page_spec(spec);
  return payload_bytes_of(spec) + side_bytes_of(spec);
}

namespace {

// The E4M3 and E5M2 codes of every bf16 bit pattern, float_to_fp8_ref's (a bf16's float is
// exact, so the code is a function of the 16 bits): 128 KiB, made at the first lossy encode.
struct Bf16Fp8Codes {
  uint8_t e4m3[1 << 16];
  uint8_t e5m2[1 << 16];
  Bf16Fp8Codes() {
    for (uint32_t h = 0; h < (1u << 16); ++h) {
      e4m3[h] = format::float_to_fp8_ref(bf16_to_float(uint16_t(h)), 4, 3);
      e5m2[h] = format::float_to_fp8_ref(bf16_to_float(uint16_t(h)), 5, 2);
    }
  }
};

void encode_fp8_cast_table(const Geometry& g, const uint8_t* codes, const uint16_t* x, uint8_t* page) {
  for (size_t i = 0; i < size_t(g.bt) * size_t(g.d); ++i) page[i] = codes[x[i]];
}

// lossy_encode_page_ref (kRef) and lossy_encode_page: one body, the reference's plain functions
// or the production encoder's equivalents (the file's comment).
template <bool kRef>
bool encode_page(const LossyPageSpec& spec, uint32_t block, const uint16_t* x, uint8_t* page) {
  const Geometry g = geometry_of(spec);
  const size_t n = size_t(g.bt) * size_t(g.d);
  for (size_t i = 0; i < n; ++i) {
    if (!bf16_is_finite(x[i])) return false;
  }
  // The exponent witness bounds a code's error by half its step, which a saturated cast (448 for
  // anything above 464) breaks: such a K page stays exact (the device's rule).
  if (spec.key && spec.witness == WitnessCode::kExponent) {
    for (size_t i = 0; i < n; ++i)
      if (!(std::fabs(bf16_to_float(x[i])) <= kExponentWitnessLimit)) return false;
  }
  bool encoded = false;
  switch (spec.scheme) {
    case LossyScheme::kFp8E4M3:
    case LossyScheme::kFp8E5M2: {
      const bool e4m3 = spec.scheme == LossyScheme::kFp8E4M3;
      if constexpr (kRef) {
        encode_fp8_cast(g, e4m3 ? 4 : 5, e4m3 ? 3 : 2, x, page);
      } else {
        static const Bf16Fp8Codes codes;
        encode_fp8_cast_table(g, e4m3 ? codes.e4m3 : codes.e5m2, x, page);
      }
      encoded = true;
      break;
    }
    case LossyScheme::kFp8E4M3Scaled:
      encoded = encode_fp8_e4m3_scaled(g, x, page);
      break;
    case LossyScheme::kRtn8:
      encoded = encode_rtn<kRef>(g, 8, x, page);
      break;
    case LossyScheme::kRtn4:
      encoded = encode_rtn<kRef>(g, 4, x, page);
      break;
    case LossyScheme::kKivi2:
      encoded = encode_kivi2<kRef>(g, spec.key, x, page);
      break;
    case LossyScheme::kDither8:
      encoded = encode_dither8<kRef>(spec, g, block, x, page);
      break;
  }
  if (!encoded) return false;
  // The side data describes exactly what attention will read: the decoded page. A reconstruction
  // that is not finite (E5M2 overflows to Inf above 57344) is refused like a non-finite input.
  thread_local std::vector<float> recon;
  recon.resize(n);
  if constexpr (kRef) {
    lossy_decode_page_ref(spec, block, page, recon.data());
  } else {
    lossy_decode_page(spec, block, page, recon.data());
  }
  for (float v : recon) {
    if (!std::isfinite(v)) return false;
  }
  if (!lossy_scheme_is_tier_b(spec.scheme)) {
    write_tier_a_side_data<kRef>(spec, g, x, recon.data(), page + g.payload_bytes);
  }
  return true;
}

}  // namespace

bool lossy_encode_page_ref(const LossyPageSpec& spec, uint32_t block, const uint16_t* x,
                           uint8_t* page) {
  return encode_page<true>(spec, block, x, page);
}

bool lossy_encode_page(const LossyPageSpec& spec, uint32_t block, const uint16_t* x, uint8_t* page) {
  return encode_page<false>(spec, block, x, page);
}

void lossy_decode_page_ref(const LossyPageSpec& spec, uint32_t block, const uint8_t* page,
                           float* out) {
  const Geometry g = geometry_of(spec);
  switch (spec.scheme) {
    case LossyScheme::kFp8E4M3:
      decode_fp8_cast(g, 4, 3, page, out);
      break;
    case LossyScheme::kFp8E5M2:
      decode_fp8_cast(g, 5, 2, page, out);
      break;
    case LossyScheme::kFp8E4M3Scaled:
      decode_fp8_e4m3_scaled(g, page, out);
      break;
    case LossyScheme::kRtn8:
      decode_rtn(g, 8, page, out);
      break;
    case LossyScheme::kRtn4:
      decode_rtn(g, 4, page, out);
      break;
    case LossyScheme::kKivi2:
      decode_kivi2(g, spec.key, page, out);
      break;
    case LossyScheme::kDither8:
      decode_dither8(spec, g, block, page, out);
      break;
  }
}

namespace {

// The FP8 values of every byte, once: fp8_to_float is exact, so a table gives the same floats.
struct Fp8Tables {
  float e4m3[256];
  float e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = format::fp8_to_float(uint8_t(i), 4, 3);
      e5m2[i] = format::fp8_to_float(uint8_t(i), 5, 2);
    }
  }
};

const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

// row[c] = s * q_c for the 32 codes of one group; q: int8 codes.
inline void scale_int8_group(const int8_t* q, float s, float* row) {
#if defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  for (int c = 0; c < kQuantGroup; c += 8) {
    const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c)));
    _mm256_storeu_ps(row + c, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(qi)));
  }
#else
  for (int c = 0; c < kQuantGroup; ++c) row[c] = s * float(q[c]);
#endif
}

void decode_rtn_rows(const detail::LossyDecodeArgs& a, int n_rows, const uint8_t* page, float* out) {
  const int bits = a.scheme == LossyScheme::kRtn8 ? 8 : 4;
  const size_t code_bytes = bits == 8 ? size_t(a.head_dim) : size_t(a.head_dim) / 2;
  int8_t q[kMaxHeadDim];
  for (int t = 0; t < n_rows; ++t) {
    const uint8_t* rec = page + size_t(t) * a.record_bytes;
    float* row = out + size_t(t) * a.head_dim;
    if (bits == 8) {
      std::memcpy(q, rec, size_t(a.head_dim));
    } else {
      for (int c = 0; c < a.head_dim; c += 2) {
        q[c] = int8_t(int(rec[c / 2] & 0xf) - 8);
        q[c + 1] = int8_t(int(rec[c / 2] >> 4) - 8);
      }
    }
    for (int grp = 0; grp < a.groups; ++grp)
      scale_int8_group(q + grp * kQuantGroup, fp16_to_float(load_u16(rec + code_bytes + 2 * size_t(grp))),
                       row + grp * kQuantGroup);
  }
}

// The portable kernel (detail::LossyDecodeKernel): plain loops, AVX2 intrinsics where the build
// targets them; the same floats as lossy_decode_page_ref.
void decode_page_portable(const detail::LossyDecodeArgs& a, uint32_t block, const uint8_t* page,
                          int n_rows, float* out, float* scales, size_t scales_stride) {
  const size_t n = size_t(n_rows) * size_t(a.head_dim);
  const int d = a.head_dim;
  switch (a.scheme) {
    case LossyScheme::kFp8E4M3:
    case LossyScheme::kFp8E5M2: {
      const float* table = a.scheme == LossyScheme::kFp8E4M3 ? fp8_tables().e4m3 : fp8_tables().e5m2;
      for (size_t i = 0; i < n; ++i) out[i] = table[page[i]];
      return;
    }
    case LossyScheme::kFp8E4M3Scaled: {
      for (int t = 0; t < n_rows; ++t) {
        const uint8_t* rec = page + size_t(t) * a.record_bytes;
        const float s = fp16_to_float(load_u16(rec + d));
        if (std::isnan(s)) {
          std::fill_n(out + size_t(t) * d, d, detail::scaled_row_nan(s));
          continue;
        }
        for (int c = 0; c < d; ++c) out[size_t(t) * d + c] = s * fp8_tables().e4m3[rec[c]];
      }
      return;
    }
    case LossyScheme::kRtn8:
    case LossyScheme::kRtn4:
      decode_rtn_rows(a, n_rows, page, out);
      return;
    case LossyScheme::kKivi2: {
      const uint8_t* params = page + size_t(a.block_tokens) * size_t(d) / 4;
      for (int t = 0; t < n_rows; ++t) {
        for (int c = 0; c < d; ++c) {
          const size_t pair = a.key ? size_t(c) : size_t(t) * a.groups + size_t(c / kQuantGroup);
          const int q = (page[(size_t(t) * d + c) / 4] >> (2 * (c & 3))) & 3;
          out[size_t(t) * d + c] = kivi2_recon(fp16_to_float(load_u16(params + 4 * pair)),
                                               fp16_to_float(load_u16(params + 4 * pair + 2)), q);
        }
      }
      return;
    }
    case LossyScheme::kDither8:
      break;
  }
  // decode_dither8 with the generator unrolled (dither8_row_xi; dither8_xi recomputes the seed and
  // the word for every channel), one scale per group; the same floats.
  float xi[kMaxHeadDim];
  for (int t = 0; t < n_rows; ++t) {
    const uint8_t* rec = page + size_t(t) * a.record_bytes;
    float* row = out + size_t(t) * d;
    if (a.key) {
      dither8_row_xi(a.dither_key, uint64_t(block) * uint64_t(a.block_tokens) + uint64_t(t), d, xi);
    } else {
      std::fill(xi, xi + d, 0.0f);  // V pages are not dithered
    }
    for (int grp = 0; grp < a.groups; ++grp) {
      const float s = fp16_to_float(load_u16(rec + d + 2 * size_t(grp)));
      if (scales != nullptr) scales[size_t(grp) * scales_stride + size_t(t)] = s;
      const int c0 = grp * kQuantGroup;
#if defined(__AVX2__)
      const __m256 sv = _mm256_set1_ps(s);
      for (int c = c0; c < c0 + kQuantGroup; c += 8) {
        const __m256 q = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + c))));
        _mm256_storeu_ps(row + c, _mm256_mul_ps(sv, _mm256_sub_ps(q, _mm256_loadu_ps(xi + c))));
      }
#else
      for (int c = c0; c < c0 + kQuantGroup; ++c) row[c] = s * (float(int8_t(rec[c])) - xi[c]);
#endif
    }
    const uint8_t* outliers = rec + d + 2 * size_t(a.groups);
    for (int i = 0; i < a.n_outlier_channels; ++i)
      row[a.outlier_channels[i]] = bf16_to_float(load_u16(outliers + 2 * size_t(i)));
  }
}

detail::LossyDecodeKernel kernel_function(LossyKernel kernel) {
  switch (kernel) {
    case LossyKernel::kAvx2:
      return detail::lossy_decode_kernel_avx2();
    case LossyKernel::kAvx512:
      return detail::lossy_decode_kernel_avx512();
    case LossyKernel::kPortable:
      break;
  }
  return &decode_page_portable;
}

}  // namespace

const char* lossy_kernel_name(LossyKernel kernel) {
  switch (kernel) {
    case LossyKernel::kAvx2:
      return "avx2";
    case LossyKernel::kAvx512:
      return "avx512";
    case LossyKernel::kPortable:
      break;
  }
  return "portable";
}

bool lossy_kernel_supported(LossyKernel kernel) {
  switch (kernel) {
    case LossyKernel::kAvx2:
      return detail::cpu_runs_lossy_avx2();
    case LossyKernel::kAvx512:
      return detail::cpu_runs_lossy_avx512();
    case LossyKernel::kPortable:
      break;
  }
  return true;
}

LossyKernel lossy_best_kernel() {
  static const LossyKernel best = [] {
    LossyKernel cap = LossyKernel::kAvx512;
    if (const char* env = std::getenv("CERTKV_LOSSY_KERNEL")) {
      for (LossyKernel k : {LossyKernel::kPortable, LossyKernel::kAvx2, LossyKernel::kAvx512})
        if (std::string_view(env) == lossy_kernel_name(k)) cap = k;
    }
    for (LossyKernel k : {LossyKernel::kAvx512, LossyKernel::kAvx2})
      if (uint8_t(k) <= uint8_t(cap) && lossy_kernel_supported(k)) return k;
    return LossyKernel::kPortable;
  }();
  return best;
}

LossyPageDecoder::LossyPageDecoder(const LossyPageSpec& spec, LossyKernel kernel) : kernel_(kernel) {
  const Geometry g = geometry_of(spec);
  if (!lossy_kernel_supported(kernel)) {
    fail(StatusCode::kUnsupported, std::string("LossyPageDecoder: kernel ") + lossy_kernel_name(kernel) +
                                       " does not run on this CPU");
  }
  args_.scheme = spec.scheme;
  args_.key = spec.key;
  args_.block_tokens = g.bt;
  args_.head_dim = g.d;
  args_.groups = g.groups;
  switch (spec.scheme) {
    case LossyScheme::kFp8E4M3:
    case LossyScheme::kFp8E5M2:
      args_.record_bytes = size_t(g.d);
      break;
    case LossyScheme::kFp8E4M3Scaled:
      args_.record_bytes = size_t(g.d) + 2;
      break;
    case LossyScheme::kRtn8:
    case LossyScheme::kRtn4: {
      const int bits = spec.scheme == LossyScheme::kRtn8 ? 8 : 4;
      args_.record_bytes = rtn_code_bytes(g, bits) + 2 * size_t(g.groups);
      break;
    }
    case LossyScheme::kKivi2:
      args_.record_bytes = 0;
      break;
    case LossyScheme::kDither8:
      args_.record_bytes = dither8_record_bytes(g);
      break;
  }
  args_.dither_key = spec.dither_key;
  args_.n_outlier_channels = 2 * spec.n_outlier_pairs;
  for (int i = 0; i < spec.n_outlier_pairs; ++i)
    for (int which = 0; which < 2; ++which)
      args_.outlier_channels[2 * i + which] =
          uint8_t(rope_pair_channel(spec.pairing, g.d, spec.outlier_pairs[i], which));
  std::fill(std::begin(args_.outlier_lanes), std::end(args_.outlier_lanes), uint16_t(0));
  std::fill(std::begin(args_.outlier_index), std::end(args_.outlier_index), uint8_t(0));
  for (int i = 0; i < args_.n_outlier_channels; ++i) {
    const int c = args_.outlier_channels[i];
    args_.outlier_lanes[c / 16] = uint16_t(args_.outlier_lanes[c / 16] | 1u << (c % 16));
    args_.outlier_index[c] = uint8_t(i);
  }
  decode_ = kernel_function(kernel);
}

void LossyPageDecoder::decode(uint32_t block, const uint8_t* page, int n_rows, float* out,
                              float* scales, size_t scales_stride) const {
  decode_(args_, block, page, n_rows, out, scales, scales_stride);
}

void lossy_decode_page(const LossyPageSpec& spec, uint32_t block, const uint8_t* page,
                       float* out) {
  const LossyPageDecoder decoder(spec);
  decoder.decode(block, page, spec.block_tokens, out);
}

const uint16_t* lossy_witness(const LossyPageSpec& spec, const uint8_t* page) {
  const Geometry g = geometry_of(spec);
  if (lossy_scheme_is_tier_b(spec.scheme) || !spec.key) {
    fail(StatusCode::kInvalidArgument,
         std::string("lossy_witness: a ") + lossy_scheme_name(spec.scheme) +
             (spec.key ? " K" : " V") + " page carries no witness (Tier A K pages only)");
  }
  if (spec.witness != WitnessCode::kFp16) {
    fail(StatusCode::kInvalidArgument, std::string("lossy_witness: the page's witness is coded (") +
                                           witness_code_name(spec.witness) +
                                           "), not fp16; read it with lossy_witness_bounds");
  }
  return reinterpret_cast<const uint16_t*>(page + g.payload_bytes);
}

namespace {
// A stored bound or scale below 0, or NaN, is a corrupt page: it bounds nothing (-0 is 0).
float stored_bound(uint16_t bits) {
  const float v = fp16_to_float(bits);
  return v >= 0.f ? v : std::numeric_limits<float>::infinity();
}
}  // namespace

void page_scaled_witness_bounds(const uint8_t* side, int n_bands, int block_tokens, int n_tokens, float* out,
                                size_t out_stride) {
  const size_t cells = size_t(n_bands) * size_t(block_tokens);
  // top (c + 1) / 256: an fp16 times an integer up to 256, then a power of two: exact in float.
  const float step = stored_bound(load_u16(side + cells)) * (1.0f / 256.0f);
  for (int b = 0; b < n_bands; ++b) {
    const uint8_t* codes = side + size_t(b) * size_t(block_tokens);
    float* row = out + size_t(b) * out_stride;
    int t = 0;
#if defined(__AVX2__)
    // Eight codes at a time, the same exact products (the meter reads every page of every step).
    const __m256 step8 = _mm256_set1_ps(step);
    const __m256i one = _mm256_set1_epi32(1);
    for (; t + 8 <= n_tokens; t += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t)));
      _mm256_storeu_ps(row + t, _mm256_mul_ps(step8, _mm256_cvtepi32_ps(_mm256_add_epi32(c, one))));
    }
#endif
    for (; t < n_tokens; ++t) row[t] = step * float(int(codes[t]) + 1);
  }
}

namespace {
// u of each E4M3 code: 2^(E - 4) + 2^-10 with E the exponent of the code's value as a float (its
// bits & 0x7f800000), 2^-10 for the zero codes, +inf for the NaN codes. Both terms are powers of
// two with E in [-9, 8], so the sum is exact in float.
struct ExponentBoundTable {
  float u[256];
  ExponentBoundTable() {
    for (int code = 0; code < 256; ++code) {
      const float v = std::fabs(format::fp8_to_float(uint8_t(code), 4, 3));
      if (std::isnan(v)) {
        u[code] = std::numeric_limits<float>::infinity();
      } else if (v == 0.f) {
        u[code] = 0x1p-10f;
      } else {
        u[code] = std::ldexp(1.0f, std::ilogb(v) - 4) + 0x1p-10f;
      }
    }
  }
};
const ExponentBoundTable& exponent_bound_table() {
  static const ExponentBoundTable table;
  return table;
}
}  // namespace

float exponent_witness_bound_of_code(uint8_t code) { return exponent_bound_table().u[code]; }

void exponent_witness_bounds(const uint8_t* codes, int head_dim, int n_tokens, float* out, size_t out_stride) {
  const float* u = exponent_bound_table().u;
  for (int t = 0; t < n_tokens; ++t)
    for (int c = 0; c < head_dim; ++c) out[size_t(c) * out_stride + size_t(t)] = u[codes[size_t(t) * size_t(head_dim) + size_t(c)]];
}

int witness_width(const LossyPageSpec& spec) {
  return spec.witness == WitnessCode::kExponent ? spec.head_dim : witness_bands(spec.head_dim);
}

void lossy_witness_bounds(const LossyPageSpec& spec, const uint8_t* page, float* out) {
  const Geometry g = geometry_of(spec);
  if (lossy_scheme_is_tier_b(spec.scheme) || !spec.key) {
    fail(StatusCode::kInvalidArgument,
         std::string("lossy_witness_bounds: a ") + lossy_scheme_name(spec.scheme) +
             (spec.key ? " K" : " V") + " page carries no witness (Tier A K pages only)");
  }
  if (spec.witness == WitnessCode::kExponent) {
    exponent_witness_bounds(page, g.d, g.bt, out, size_t(g.bt));
    return;
  }
  const uint8_t* side = page + g.payload_bytes;
  if (spec.witness == WitnessCode::kFp16) {
    const size_t cells = size_t(witness_bands(g.d)) * size_t(g.bt);
    for (size_t i = 0; i < cells; ++i) out[i] = stored_bound(load_u16(side + 2 * i));
    return;
  }
  page_scaled_witness_bounds(side, witness_bands(g.d), g.bt, g.bt, out, size_t(g.bt));
}

const uint16_t* lossy_value_rho(const LossyPageSpec& spec, const uint8_t* page) {
  const Geometry g = geometry_of(spec);
  if (lossy_scheme_is_tier_b(spec.scheme) || spec.key) {
    fail(StatusCode::kInvalidArgument,
         std::string("lossy_value_rho: a ") + lossy_scheme_name(spec.scheme) +
             (spec.key ? " K" : " V") + " page carries no rho (Tier A V pages only)");
  }
  return reinterpret_cast<const uint16_t*>(page + g.payload_bytes);
}

void dither8_scales(const LossyPageSpec& spec, const uint8_t* page, float* scales) {
  const Geometry g = geometry_of(spec);
  if (spec.scheme != LossyScheme::kDither8) {
    fail(StatusCode::kInvalidArgument, std::string("dither8_scales: the page is ") +
                                           lossy_scheme_name(spec.scheme) + ", not dither8");
  }
  const size_t record = dither8_record_bytes(g);
  for (int t = 0; t < g.bt; ++t) {
    for (int grp = 0; grp < g.groups; ++grp) {
      scales[size_t(t) * g.groups + grp] =
          fp16_to_float(load_u16(page + size_t(t) * record + g.d + 2 * size_t(grp)));
    }
  }
}

void dither8_value_rho(const LossyPageSpec& spec, const uint8_t* page, float* rho) {
  const Geometry g = geometry_of(spec);
  if (spec.scheme != LossyScheme::kDither8) {
    fail(StatusCode::kInvalidArgument, std::string("dither8_value_rho: the page is ") +
                                           lossy_scheme_name(spec.scheme) + ", not dither8");
  }
  // Per group, the channels that are not outliers (outliers are stored exactly).
  int quantized[kMaxHeadDim / kQuantGroup];
  for (int grp = 0; grp < g.groups; ++grp) quantized[grp] = kQuantGroup;
  for (int i = 0; i < spec.n_outlier_pairs; ++i)
    for (int which = 0; which < 2; ++which)
      --quantized[rope_pair_channel(spec.pairing, g.d, spec.outlier_pairs[i], which) / kQuantGroup];
  const size_t record = dither8_record_bytes(g);
  const double r_per_scale = 0.5 + double(kDither8Slack);  // |r_c| <= s_c (1/2 + slack)
  for (int t = 0; t < g.bt; ++t) {
    double sum_sq = 0.0;
    for (int grp = 0; grp < g.groups; ++grp) {
      const double r_max =
          double(fp16_to_float(load_u16(page + size_t(t) * record + g.d + 2 * size_t(grp)))) * r_per_scale;
      sum_sq += double(quantized[grp]) * r_max * r_max;
    }
    // The double sum of at most 8 terms is off by far less than kNormSafety's 2^-40.
    rho[t] = format::float_upward(std::sqrt(sum_sq) * detail::kNormSafety);
  }
}

float dither8_xi(uint64_t key, uint64_t counter, int channel) {
  if (channel < 0 || channel >= kMaxHeadDim) {
    fail(StatusCode::kInvalidArgument, "dither8_xi: channel " + std::to_string(channel) +
                                           " is outside [0, " + std::to_string(kMaxHeadDim) + ")");
  }
  // One seed per row, one 32-bit word per four channels, 8 bits per channel
  // (format/dither8_generator.h).
  const uint32_t word = format::dither8_word(format::dither8_row_seed(key, counter), channel / 4);
  return dither8_xi_of_u(format::dither8_u(word, channel));
}

uint64_t dither8_key(int layer, bool key_tensor, int kv_head) {
  if (layer < 0 || kv_head < 0) {
    fail(StatusCode::kInvalidArgument, "dither8_key: layer " + std::to_string(layer) +
                                           " and kv_head " + std::to_string(kv_head) +
                                           " must be non-negative");
  }
  const uint64_t word =
      (uint64_t(layer) << 32) | (uint64_t(kv_head) << 1) | uint64_t(key_tensor ? 1 : 0);
  return splitmix64_mix(word + kGolden);
}

void select_outlier_pairs(const float* x, int n_rows, int head_dim, RopePairing pairing, int m,
                          uint16_t* out) {
  if (head_dim < 2 || head_dim % 2 != 0 || n_rows < 0) {
    fail(StatusCode::kInvalidArgument, "select_outlier_pairs: head_dim " +
                                           std::to_string(head_dim) +
                                           " (must be even and >= 2) or n_rows " +
                                           std::to_string(n_rows) + " (must be >= 0) is invalid");
  }
  const int n_pairs = head_dim / 2;
  if (m < 0 || m > n_pairs) {
    fail(StatusCode::kInvalidArgument,
         "select_outlier_pairs: m " + std::to_string(m) +
             " is outside [0, head_dim / 2 = " + std::to_string(n_pairs) + "]");
  }
  // peak_j = max over rows of |x| on either channel of pair j (NaN never wins).
  std::vector<float> peak(size_t(n_pairs), 0.0f);
  for (int r = 0; r < n_rows; ++r) {
    for (int pair = 0; pair < n_pairs; ++pair) {
      for (int which = 0; which < 2; ++which) {
        const float v =
            std::fabs(x[size_t(r) * head_dim + rope_pair_channel(pairing, head_dim, pair, which)]);
        if (v > peak[size_t(pair)]) peak[size_t(pair)] = v;
      }
    }
  }
  std::vector<int> order(static_cast<size_t>(n_pairs));
  std::iota(order.begin(), order.end(), 0);
  // Largest peaks first; equal peaks in pair order.
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return peak[size_t(a)] > peak[size_t(b)]; });
  std::sort(order.begin(), order.begin() + m);
  for (int i = 0; i < m; ++i) out[i] = uint16_t(order[size_t(i)]);
}

}  // namespace certkv::codec
