// The x86 kernels of the lossy page decoders (lossy_page_kernels.h): the decoders of
// lossy_page_kernels.inc compiled twice, for AVX2 (with FMA and F16C; 8 float lanes) and for
// AVX-512 (F, BW, VL, DQ; 16 lanes), each under its own `#pragma GCC target`, so that the build
// needs no -march flag; LossyPageDecoder picks one at run time (__builtin_cpu_supports). FP8 codes
// become fp16 bit patterns (E5M2 is the top byte of an fp16; E4M3's seven exponent and mantissa
// bits move down one place and the result is scaled by 2^8, exact for normals and subnormals)
// and the hardware converts them; 2- and 4-bit codes come out of one broadcast word by
// per-lane shifts. On CPUs with AVX-512 VBMI the AVX-512 kernel first offers a page to row loops
// written for head_dim a multiple of 64 (namespace avx512_vbmi): dither8 K rows from one byte
// permute of codes and generator bytes per 16 channels, dither8 V, rtn8, rtn4 and kivi2 rows with a
// row's scales in one load and one conversion and 2- and 4-bit codes of 64 channels in one byte
// permute and one multishift; any other page goes to the AVX-512 decoders of the .inc.
#include <cstring>
#include <type_traits>

#include "codec/lossy_page_kernels.h"
#include "core/x86_simd.h"
#include "format/dither8_generator.h"
#include "format/numeric.h"

namespace certkv::codec::detail {

#if defined(__x86_64__)

namespace {
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace avx2 {

struct Isa {
  static constexpr int W = 8;
  static __m256i load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static __m256i load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static __m256 cvt(__m256i x) { return _mm256_cvtepi32_ps(x); }
  static __m256 set1(float x) { return _mm256_set1_ps(x); }
  static __m256i set1i(int32_t x) { return _mm256_set1_epi32(x); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 add_f(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store_i(uint32_t* p, __m256i x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static void store(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
  static __m256i add(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
  static __m256i sub(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
  static __m256i mullo(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
  static __m256i xor_(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
  static __m256i slli(__m256i a, int n) { return _mm256_slli_epi32(a, n); }
  static __m256i srli(__m256i a, int n) { return _mm256_srli_epi32(a, n); }
  static __m256i iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  // One fp16 as float: the F16C conversion, and format::fp16_to_float's bits for Inf/NaN.
  static float half1(uint16_t h) { return (h & 0x7c00) == 0x7c00 ? format::fp16_to_float(h) : _cvtsh_ss(h); }
  // Lane j: byte j % 4 of word 2 k + j / 4 of h (the dither bytes of channels 8 k .. 8 k + 7 of
  // the words' 32 channels).
  static __m256i word_bytes(__m256i h, int k) {
    const __m256i w = _mm256_permutevar8x32_epi32(h, _mm256_add_epi32(_mm256_set1_epi32(2 * k), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
    return _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24)), _mm256_set1_epi32(0xff));
  }
  // Eight E4M3 codes: fp16 bits (sign, then the seven bits one place down) times 2^8; 0x7f and
  // 0xff are NaN (format/fp8.h's sign | 0x7fc00000).
  static __m256 e4m3(const uint8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)),
                                   _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(int16_t(0x8000))));
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    const __m128i nan16 = _mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
    const __m256 nan = _mm256_or_ps(_mm256_and_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)))),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    return _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16)));
  }
  // Thirty-two E4M3 codes to out[0, 32).
  static void e4m3_x32(const uint8_t* p, float* out) {
    for (int k = 0; k < 32; k += 8) _mm256_storeu_ps(out + k, e4m3(p + k));
  }
  // Eight E5M2 codes (the top byte of an fp16); NaN keeps format/fp8.h's payload (the hardware
  // would set the quiet bit).
  static __m256 e5m2(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256 f = _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
    return _mm256_blendv_ps(f, _mm256_castsi256_ps(special_bits(b, 8, 0x7c, 21)),
                            _mm256_castsi256_ps(is_special(b, 0x7c)));
  }
  // For codes x in 32-bit lanes with sign bit `sign_bit`, exponent mask `e_mask` and mantissa
  // below it: the reference's Inf/NaN bits sign | 0x7f800000 | mantissa << shift, and which lanes
  // have an all-ones exponent.
  static __m256i special_bits(__m256i x, int sign_bit, int e_mask, int shift) {
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(x, sign_bit - 1), 31);
    const __m256i mant = _mm256_and_si256(x, _mm256_set1_epi32(~(e_mask | (1 << (sign_bit - 1))) & ((1 << sign_bit) - 1)));
    return _mm256_or_si256(_mm256_or_si256(sign, _mm256_set1_epi32(0x7f800000)), _mm256_slli_epi32(mant, shift));
  }
  static __m256i is_special(__m256i x, int e_mask) {
    const __m256i m = _mm256_set1_epi32(e_mask);
    return _mm256_cmpeq_epi32(_mm256_and_si256(x, m), m);
  }
  // Eight 4-bit fields, channel c at bits [4c, 4c + 4) of the little-endian bytes.
  static __m256i nibbles(const uint8_t* p) {
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int32_t(load_u32(p))),
                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                            _mm256_set1_epi32(0xf));
  }
  // Eight 2-bit fields, channel c at bits [2c, 2c + 2).
  static __m256i crumbs(const uint8_t* p) {
    const int32_t bits = int32_t(p[0] | (p[1] << 8));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(bits), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                            _mm256_set1_epi32(3));
  }
  // Eight (first, second) fp16 pairs as floats.
  static void fp16_pairs(const uint8_t* p, float* first, float* second) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xffff)), hi = _mm256_srli_epi32(v, 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_ps(first, fix_fp16_nan(_mm256_cvtph_ps(_mm256_castsi256_si128(packed)), lo));
    _mm256_storeu_ps(second, fix_fp16_nan(_mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1)), hi));
  }
  // f = fp16 h (32-bit lanes) converted by the hardware; Inf/NaN lanes get format::fp16_to_float's
  // bits (no quiet bit added).
  static __m256 fix_fp16_nan(__m256 f, __m256i h) {
    return _mm256_blendv_ps(f, _mm256_castsi256_ps(special_bits(h, 16, 0x7c00, 13)),
                            _mm256_castsi256_ps(is_special(h, 0x7c00)));
  }
};

#include "codec/lossy_page_kernels.inc"

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace avx512 {

struct Isa {
  static constexpr int W = 16;
  static __m512i load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m512i load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m512 cvt(__m512i x) { return _mm512_cvtepi32_ps(x); }
  static __m512 set1(float x) { return _mm512_set1_ps(x); }
  static __m512i set1i(int32_t x) { return _mm512_set1_epi32(x); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 add_f(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store_i(uint32_t* p, __m512i x) { _mm512_storeu_si512(p, x); }
  static void store(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
  static __m512i add(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
  static __m512i sub(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
  static __m512i mullo(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
  static __m512i xor_(__m512i a, __m512i b) { return _mm512_xor_si512(a, b); }
  static __m512i slli(__m512i a, int n) { return _mm512_slli_epi32(a, unsigned(n)); }
  static __m512i srli(__m512i a, int n) { return _mm512_srli_epi32(a, unsigned(n)); }
  static __m512i iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  // One fp16 as float: the F16C conversion, and format::fp16_to_float's bits for Inf/NaN.
  static float half1(uint16_t h) { return (h & 0x7c00) == 0x7c00 ? format::fp16_to_float(h) : _cvtsh_ss(h); }
  // Lane j: byte j % 4 of word 4 k + j / 4 of h.
  static __m512i word_bytes(__m512i h, int k) {
    const __m512i w = _mm512_permutexvar_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(4 * k), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)), h);
    return _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24)),
                            _mm512_set1_epi32(0xff));
  }
  static __m512 e4m3(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80)),
                                      _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(int16_t(0x8000))));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    const __mmask16 is_nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
    const __m512i nan = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(int32_t(0x80000000u))),
                                        _mm512_set1_epi32(0x7fc00000));
    return _mm512_mask_mov_ps(f, is_nan, _mm512_castsi512_ps(nan));
  }
  // Thirty-two E4M3 codes to out[0, 32): e4m3's floats, the fp16 bits made in 16-bit lanes. A
  // sign-extended code shifted up 7 is the sign at bit 15 (the extension's ones), the seven
  // exponent and mantissa bits at 7..13, and the sign again at bit 14, which the mask clears.
  static void e4m3_x32(const uint8_t* p, float* out) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(int16_t(0xbfff)));
    // 0x7f and 0xff: fp16's quiet NaN with the code's sign, which converts and scales to e4m3's.
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, _mm512_set1_epi16(0x7fff)), _mm512_set1_epi16(0x3f80));
    if (nan != 0)
      h = _mm512_mask_mov_epi16(h, nan, _mm512_or_si512(_mm512_and_si512(h, _mm512_set1_epi16(int16_t(0x8000))),
                                                        _mm512_set1_epi16(0x7e00)));
    const __m512 scale = _mm512_set1_ps(256.f);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), scale));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), scale));
  }
  static __m512 e5m2(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m512 f = _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
    const __m512i b = _mm512_cvtepu8_epi32(raw);
    return _mm512_mask_mov_ps(f, is_special(b, 0x7c), _mm512_castsi512_ps(special_bits(b, 8, 0x7c, 21)));
  }
  static __m512i special_bits(__m512i x, int sign_bit, int e_mask, int shift) {
    const __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(x, unsigned(sign_bit - 1)), 31);
    const __m512i mant = _mm512_and_si512(x, _mm512_set1_epi32(~(e_mask | (1 << (sign_bit - 1))) & ((1 << sign_bit) - 1)));
    return _mm512_or_si512(_mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)), _mm512_slli_epi32(mant, unsigned(shift)));
  }
  static __mmask16 is_special(__m512i x, int e_mask) {
    const __m512i m = _mm512_set1_epi32(e_mask);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, m), m);
  }
  static __m512 fix_fp16_nan(__m512 f, __m512i h) {
    return _mm512_mask_mov_ps(f, is_special(h, 0x7c00), _mm512_castsi512_ps(special_bits(h, 16, 0x7c00, 13)));
  }
  static __m512i nibbles(const uint8_t* p) {
    const __m512i both = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                  _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return _mm512_and_si512(_mm512_srlv_epi32(both, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28)),
                            _mm512_set1_epi32(0xf));
  }
  static __m512i crumbs(const uint8_t* p) {
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(int32_t(load_u32(p))),
                                              _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)),
                            _mm512_set1_epi32(3));
  }
  static void fp16_pairs(const uint8_t* p, float* first, float* second) {
    const __m512i v = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0xffff)), hi = _mm512_srli_epi32(v, 16);
    _mm512_storeu_ps(first, fix_fp16_nan(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(lo)), lo));
    _mm512_storeu_ps(second, fix_fp16_nan(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi)), hi));
  }
};

#include "codec/lossy_page_kernels.inc"

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c,bmi2")
namespace avx512_vbmi {

using avx512::Isa;

// The byte permute's indices per 16 channels k of 64: 255 - u of channel 16 k + j (first source)
// into byte 2 of dword j, its code (second source) into byte 3.
struct alignas(64) Dither8CodeIndex {
  uint8_t bytes[4][64];
};
constexpr Dither8CodeIndex make_dither8_code_index() {
  Dither8CodeIndex t{};
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 16; ++j) {
      t.bytes[k][4 * j + 2] = uint8_t(16 * k + j);
      t.bytes[k][4 * j + 3] = uint8_t(64 + 16 * k + j);
    }
  return t;
}
constexpr Dither8CodeIndex kDither8CodeIndex = make_dither8_code_index();

// dither8 K rows with AVX-512 VBMI, head_dim = 64 kBlocks, at most 32 outlier channels. The
// floats are decode_dither8's, (s 2^-9)(512 q + 255 - 2 u) with q the int8 code and u the dither
// byte. With m = 256 q + (255 - u), 512 q + 255 - 2 u = 2 m - 255, and m 2^16 is one two-source
// byte permute of the codes and of the complemented generator bytes (q into byte 3, 255 - u into
// byte 2, zeros below), 16 channels at a time. For a row whose scales are finite and nonzero
//   (s 2^-9)(2 m - 255) = (s 2^-24)(m 2^16) - s 2^-8 127.5,
// one fused multiply-add of exact operands (m 2^16 an int32 of 16 significant bits, s 2^-24 and
// s 2^-8 127.5 exact for an fp16 s), rounded once to the same float; a row with a scale 0, Inf or
// NaN takes the product itself, (s 2^-9)((m 2^16 >> 15) - 255). The outlier channels take their
// bf16 values through a word permute.
template <int kBlocks, bool kOutliers>
void dither8_key_rows(const LossyDecodeArgs& a, uint32_t block, const uint8_t* page, int n_rows, float* out,
                      float* scales, size_t scales_stride) {
  constexpr int d = 64 * kBlocks, kGroups = 2 * kBlocks, kChunks = 4 * kBlocks;
  __m512i index[4];
  for (int k = 0; k < 4; ++k) index[k] = _mm512_load_si512(kDither8CodeIndex.bytes[k]);
  // Per chunk of 16 channels: its outlier lanes, and the words of their values (value i of channel
  // 16 k + j into the high word of dword j).
  __mmask16 outlier_lanes[kChunks];
  __m512i outlier_at[kChunks];
  for (int k = 0; k < kChunks; ++k) {
    outlier_lanes[k] = a.outlier_lanes[k];
    outlier_at[k] = _mm512_slli_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.outlier_index + 16 * k))), 16);
  }
  const __mmask32 outlier_words =
      a.n_outlier_channels >= 32 ? ~__mmask32(0) : (__mmask32(1) << a.n_outlier_channels) - 1;
  // The generator's word w of a row is fmix32(seed + w 0x9e3779b9): the products per block.
  __m512i golden_words[kBlocks];
  for (int b = 0; b < kBlocks; ++b)
    golden_words[b] = _mm512_mullo_epi32(_mm512_add_epi32(Isa::iota(), _mm512_set1_epi32(16 * b)),
                                         _mm512_set1_epi32(int32_t(0x9e3779b9u)));
  const __mmask64 high_bytes = 0xccccccccccccccccull;
  const __mmask8 groups = __mmask8((1u << kGroups) - 1u);
  const __m512i all_ones = _mm512_set1_epi32(-1);
  const uint64_t counter0 = uint64_t(block) * uint64_t(a.block_tokens);
  const bool seeds_in_vectors = uint32_t(counter0) <= 0xffffffffu - uint32_t(a.block_tokens);
  alignas(64) uint32_t seeds[16];
  for (int t = 0; t < n_rows; ++t) {
    if (seeds_in_vectors && t % 16 == 0) {
      const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(int32_t(uint32_t(counter0))),
                                          _mm512_add_epi32(Isa::iota(), _mm512_set1_epi32(t)));
      const __m512i r = avx512::fmix32(_mm512_xor_si512(lo, _mm512_set1_epi32(int32_t(uint32_t(a.dither_key >> 32)))));
      _mm512_store_si512(seeds, avx512::fmix32(_mm512_xor_si512(
                                    r, _mm512_set1_epi32(int32_t(uint32_t(counter0 >> 32) ^ uint32_t(a.dither_key))))));
    }
    const uint32_t seed =
        seeds_in_vectors ? seeds[t % 16] : format::dither8_row_seed(a.dither_key, counter0 + uint64_t(t));
    const uint8_t* rec = page + size_t(t) * a.record_bytes;
    // The row's scales in one load and one conversion, and their factors.
    const __m128i h = _mm_maskz_loadu_epi16(groups, rec + d);
    const __m128i magnitude = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    const bool fused = (_mm_mask_cmpge_epu16_mask(groups, magnitude, _mm_set1_epi16(0x7c00)) |
                        _mm_mask_cmpeq_epi16_mask(groups, magnitude, _mm_setzero_si128())) == 0;
    alignas(32) float s[8], s_low[8], s_offset[8];
    if (fused) {
      const __m256 sv = _mm256_cvtph_ps(h);
      _mm256_store_ps(s, sv);
      _mm256_store_ps(s_low, _mm256_mul_ps(sv, _mm256_set1_ps(1.f / 16777216.f)));
      _mm256_store_ps(s_offset, _mm256_mul_ps(sv, _mm256_set1_ps(127.5f / 256.f)));
    } else {
      for (int g = 0; g < kGroups; ++g) {
        s[g] = format::fp16_to_float(avx512::load_u16(rec + d + 2 * g));
        s_low[g] = s[g] * (1.f / 512.f);  // the product's factor
      }
    }
    if (scales != nullptr)
      for (int g = 0; g < kGroups; ++g) scales[size_t(g) * scales_stride + size_t(t)] = s[g];
    const __m512i outliers = kOutliers ? _mm512_maskz_loadu_epi16(outlier_words, rec + d + 2 * kGroups) : __m512i{};
    float* row = out + size_t(t) * size_t(d);
    for (int b = 0; b < kBlocks; ++b) {
      // Byte i of the block's 16 generator words is u of channel 64 b + i.
      const __m512i not_u =
          _mm512_xor_si512(avx512::fmix32(_mm512_add_epi32(_mm512_set1_epi32(int32_t(seed)), golden_words[b])), all_ones);
      const __m512i q = _mm512_loadu_si512(rec + 64 * b);
      __m512 v[4];
      if (fused) {
        for (int k = 0; k < 4; ++k) {
          const int g = 2 * b + k / 2;
          const __m512i m = _mm512_maskz_permutex2var_epi8(high_bytes, not_u, index[k], q);  // m 2^16
          v[k] = _mm512_fmsub_ps(_mm512_set1_ps(s_low[g]), _mm512_cvtepi32_ps(m), _mm512_set1_ps(s_offset[g]));
        }
      } else {
        for (int k = 0; k < 4; ++k) {
          const int g = 2 * b + k / 2;
          const __m512i m = _mm512_maskz_permutex2var_epi8(high_bytes, not_u, index[k], q);
          v[k] = _mm512_mul_ps(_mm512_set1_ps(s_low[g]),
                               _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srai_epi32(m, 15), _mm512_set1_epi32(255))));
        }
      }
      for (int k = 0; k < 4; ++k) {
        const int chunk = 4 * b + k;
        if constexpr (kOutliers)
          v[k] = _mm512_mask_mov_ps(v[k], outlier_lanes[chunk],
                                    _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, outlier_at[chunk], outliers)));
        _mm512_storeu_ps(row + 16 * chunk, v[k]);
      }
    }
  }
}

bool decode_dither8_key(const LossyDecodeArgs& a, uint32_t block, const uint8_t* page, int n_rows, float* out,
                        float* scales, size_t scales_stride) {
  if (a.n_outlier_channels > 32) return false;
  const bool outliers = a.n_outlier_channels > 0;
  switch (a.head_dim % 64 == 0 ? a.head_dim / 64 : 0) {
    case 1:
      (outliers ? dither8_key_rows<1, true> : dither8_key_rows<1, false>)(a, block, page, n_rows, out, scales, scales_stride);
      return true;
    case 2:
      (outliers ? dither8_key_rows<2, true> : dither8_key_rows<2, false>)(a, block, page, n_rows, out, scales, scales_stride);
      return true;
    case 3:
      (outliers ? dither8_key_rows<3, true> : dither8_key_rows<3, false>)(a, block, page, n_rows, out, scales, scales_stride);
      return true;
    case 4:
      (outliers ? dither8_key_rows<4, true> : dither8_key_rows<4, false>)(a, block, page, n_rows, out, scales, scales_stride);
      return true;
    default:
      return false;
  }
}

// dither8 V rows (not dithered: s q, one product of exact operands), head_dim = 64 kBlocks: a
// row's scales in one load and one conversion (format::fp16_to_float's bits where one is Inf or
// NaN), its values sixteen at a time. Needs no VBMI; it lives beside the K rows, which do.
template <int kBlocks>
void dither8_value_rows(const LossyDecodeArgs& a, const uint8_t* page, int n_rows, float* out, float* scales,
                        size_t scales_stride) {
  constexpr int d = 64 * kBlocks, kGroups = 2 * kBlocks;
  const __mmask8 groups = __mmask8((1u << kGroups) - 1u);
  for (int t = 0; t < n_rows; ++t) {
    const uint8_t* rec = page + size_t(t) * a.record_bytes;
    const __m128i h = _mm_maskz_loadu_epi16(groups, rec + d);
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_cvtph_ps(h));
    if (_mm_mask_cmpeq_epi16_mask(groups, _mm_and_si128(h, _mm_set1_epi16(0x7c00)), _mm_set1_epi16(0x7c00)) != 0)
      for (int g = 0; g < kGroups; ++g) s[g] = format::fp16_to_float(avx512::load_u16(rec + d + 2 * g));
    if (scales != nullptr)
      for (int g = 0; g < kGroups; ++g) scales[size_t(g) * scales_stride + size_t(t)] = s[g];
    float* row = out + size_t(t) * size_t(d);
    for (int k = 0; k < 4 * kBlocks; ++k) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * k)));
      _mm512_storeu_ps(row + 16 * k, _mm512_mul_ps(_mm512_set1_ps(s[k / 2]), _mm512_cvtepi32_ps(q)));
    }
  }
}

bool decode_dither8_value(const LossyDecodeArgs& a, const uint8_t* page, int n_rows, float* out, float* scales,
                          size_t scales_stride) {
  switch (a.key ? 0 : a.head_dim % 64 == 0 ? a.head_dim / 64 : 0) {
    case 1: dither8_value_rows<1>(a, page, n_rows, out, scales, scales_stride); return true;
    case 2: dither8_value_rows<2>(a, page, n_rows, out, scales, scales_stride); return true;
    case 3: dither8_value_rows<3>(a, page, n_rows, out, scales, scales_stride); return true;
    case 4: dither8_value_rows<4>(a, page, n_rows, out, scales, scales_stride); return true;
    default: return false;
  }
}

// The byte permute and bit offsets that unpack fields of w bits (w = 2 or 4; channel c at bits
// [w c, w c + w) of the little-endian code bytes) 64 channels at a time: qword lane l gathers the
// code bytes of channels 8 l .. 8 l + 7, and byte j of the lane takes bits [w j, w j + 8) of it.
struct alignas(64) FieldUnpack {
  uint8_t gather[64];
  uint8_t shifts[64];
};
constexpr FieldUnpack make_field_unpack(int w) {
  FieldUnpack t{};
  for (int i = 0; i < 64; ++i) {
    const int lane = i / 8, j = i % 8;
    t.gather[i] = uint8_t(w * lane + (j < w ? j : w - 1));
    t.shifts[i] = uint8_t(w * j);
  }
  return t;
}
constexpr FieldUnpack kNibbles = make_field_unpack(4);
constexpr FieldUnpack kCrumbs = make_field_unpack(2);

// The fields of 64 channels, one byte each: codes holds 8 w bytes.
template <int kBits>
inline __m512i unpack_fields(const uint8_t* codes) {
  const FieldUnpack& t = kBits == 4 ? kNibbles : kCrumbs;
  const __m512i bytes = _mm512_maskz_loadu_epi8(kBits == 4 ? 0xffffffffull : 0xffffull, codes);
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(t.shifts),
                                                       _mm512_permutexvar_epi8(_mm512_load_si512(t.gather), bytes)),
                          _mm512_set1_epi8(char((1 << kBits) - 1)));
}

// Bytes 16 k .. 16 k + 15 of x as 16 int32 (signed or not); k < 4 (the extract takes an
// immediate: one case each, folded where k is known).
template <bool kSigned>
inline __m512i widen_bytes(__m512i x, int k) {
  __m128i part;
  switch (k) {
    case 0: part = _mm512_castsi512_si128(x); break;
    case 1: part = _mm512_extracti32x4_epi32(x, 1); break;
    case 2: part = _mm512_extracti32x4_epi32(x, 2); break;
    default: part = _mm512_extracti32x4_epi32(x, 3); break;
  }
  return kSigned ? _mm512_cvtepi8_epi32(part) : _mm512_cvtepu8_epi32(part);
}

// rtn8 and rtn4 rows (K and V alike), head_dim = 64 kBlocks: s q, q the int8 code or the nibble
// less 8, one product of exact operands as decode_rtn; a row's scales in one load and one
// conversion (an Inf or NaN scale converts to the NaN or Inf the product makes of
// format::fp16_to_float's), rtn4's nibbles of 64 channels in one byte permute and one multishift.
template <int kBlocks, int kBits>
void rtn_rows(const LossyDecodeArgs& a, const uint8_t* page, int n_rows, float* out) {
  constexpr int d = 64 * kBlocks, kGroups = 2 * kBlocks;
  constexpr size_t code_bytes = size_t(d) * kBits / 8;
  for (int t = 0; t < n_rows; ++t) {
    const uint8_t* rec = page + size_t(t) * a.record_bytes;
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << kGroups) - 1u), rec + code_bytes)));
    float* row = out + size_t(t) * size_t(d);
    for (int b = 0; b < kBlocks; ++b) {
      const __m512i q = kBits == 8 ? _mm512_loadu_si512(rec + 64 * b)
                                   : _mm512_sub_epi8(unpack_fields<4>(rec + 32 * b), _mm512_set1_epi8(8));
      for (int k = 0; k < 4; ++k)
        _mm512_storeu_ps(row + 64 * b + 16 * k,
                         _mm512_mul_ps(_mm512_set1_ps(s[2 * b + k / 2]), _mm512_cvtepi32_ps(widen_bytes<true>(q, k))));
    }
  }
}

// kivi2 rows, head_dim = 64 kBlocks: min + step q (a product, then a sum, as decode_kivi2), the
// 2-bit codes of 64 channels in one byte permute and one multishift. K pages: one (min, step) per
// channel for the page; V pages: per token and group, a row's in one load and one conversion.
template <int kBlocks, bool kKey>
void kivi2_rows(const LossyDecodeArgs& a, const uint8_t* page, int n_rows, float* out) {
  constexpr int d = 64 * kBlocks, kGroups = 2 * kBlocks;
  const uint8_t* params = page + size_t(a.block_tokens) * size_t(d) / 4;
  alignas(64) float mins[kKey ? d : 1], steps[kKey ? d : 1];
  if constexpr (kKey)
    for (int c = 0; c < d; c += 16) Isa::fp16_pairs(params + 4 * size_t(c), mins + c, steps + c);
  for (int t = 0; t < n_rows; ++t) {
    const uint8_t* row_codes = page + size_t(t) * size_t(d) / 4;
    float* row = out + size_t(t) * size_t(d);
    // V: (min, step) of each group; the whole vector is stored (16 floats), 2 kGroups are used.
    static_assert(2 * kGroups <= 16, "a row's (min, step) pairs fit one vector");
    alignas(64) float pairs[16];
    if constexpr (!kKey)
      _mm512_store_ps(pairs, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << (2 * kGroups)) - 1u),
                                                                      params + 4 * size_t(t) * size_t(kGroups))));
    for (int b = 0; b < kBlocks; ++b) {
      const __m512i q = unpack_fields<2>(row_codes + 16 * b);
      for (int k = 0; k < 4; ++k) {
        const int c = 64 * b + 16 * k, g = c / kQuantGroup;
        const __m512 mn = kKey ? _mm512_load_ps(mins + c) : _mm512_set1_ps(pairs[2 * g]);
        const __m512 step = kKey ? _mm512_load_ps(steps + c) : _mm512_set1_ps(pairs[2 * g + 1]);
        _mm512_storeu_ps(row + c, _mm512_add_ps(mn, _mm512_mul_ps(step, _mm512_cvtepi32_ps(widen_bytes<false>(q, k)))));
      }
    }
  }
}

// The rows of rtn8, rtn4 and kivi2 pages whose head_dim is a multiple of 64 (false otherwise).
bool decode_codes(const LossyDecodeArgs& a, const uint8_t* page, int n_rows, float* out) {
  const int blocks = a.head_dim % 64 == 0 ? a.head_dim / 64 : 0;
  if (blocks == 0) return false;
  const auto by_blocks = [&](auto rows_of) {
    switch (blocks) {
      case 1: rows_of(std::integral_constant<int, 1>{}); return true;
      case 2: rows_of(std::integral_constant<int, 2>{}); return true;
      case 3: rows_of(std::integral_constant<int, 3>{}); return true;
      case 4: rows_of(std::integral_constant<int, 4>{}); return true;
      default: return false;
    }
  };
  switch (a.scheme) {
    case LossyScheme::kRtn8:
      return by_blocks([&](auto b) { rtn_rows<decltype(b)::value, 8>(a, page, n_rows, out); });
    case LossyScheme::kRtn4:
      return by_blocks([&](auto b) { rtn_rows<decltype(b)::value, 4>(a, page, n_rows, out); });
    case LossyScheme::kKivi2:
      return a.key ? by_blocks([&](auto b) { kivi2_rows<decltype(b)::value, true>(a, page, n_rows, out); })
                   : by_blocks([&](auto b) { kivi2_rows<decltype(b)::value, false>(a, page, n_rows, out); });
    default:
      return false;
  }
}

void decode_page(const LossyDecodeArgs& a, uint32_t block, const uint8_t* page, int n_rows, float* out, float* scales,
                 size_t scales_stride) {
  if (a.scheme == LossyScheme::kDither8 &&
      (a.key ? decode_dither8_key(a, block, page, n_rows, out, scales, scales_stride)
             : decode_dither8_value(a, page, n_rows, out, scales, scales_stride)))
    return;
  if (decode_codes(a, page, n_rows, out)) return;
  avx512::decode_page(a, block, page, n_rows, out, scales, scales_stride);
}

}  // namespace avx512_vbmi
#pragma GCC pop_options

LossyDecodeKernel lossy_decode_kernel_avx2() { return &avx2::decode_page; }
LossyDecodeKernel lossy_decode_kernel_avx512() {
  return __builtin_cpu_supports("avx512vbmi") ? &avx512_vbmi::decode_page : &avx512::decode_page;
}
bool cpu_runs_lossy_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_runs_lossy_avx512() {
  return cpu_runs_lossy_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

#else  // not x86-64: the portable decoder only

LossyDecodeKernel lossy_decode_kernel_avx2() { return nullptr; }
LossyDecodeKernel lossy_decode_kernel_avx512() { return nullptr; }
bool cpu_runs_lossy_avx2() { return false; }
bool cpu_runs_lossy_avx512() { return false; }

#endif

}  // namespace certkv::codec::detail
