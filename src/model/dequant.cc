// Multiplications and additions are rounded separately (no fused multiply-add), so the floats
// equal those of ggml's dequantize_row_* and of the Python gguf package bit for bit.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "model/dequant.h"

#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "core/x86_simd.h"
#endif

#include "core/status.h"
#include "format/numeric.h"
#include "model/ggml_type.h"

namespace certkv::model {
namespace {

using format::GgmlType;

// Blocks are read with memcpy: GGUF rows carry no alignment promise beyond one byte.
template <typename Block>
Block load_block(const uint8_t* p) {
  Block b;
  std::memcpy(&b, p, sizeof b);
  return b;
}

// Number of blocks in n elements; throws unless the type is supported and n is whole blocks.
int64_t checked_blocks(GgmlType type, int64_t n, const char* caller) {
  if (!dequantize_supports(type)) {
    fail(StatusCode::kUnsupported, std::string(caller) + ": cannot dequantize ggml type " +
                                       ggml_type_name(type) + " (id " +
                                       std::to_string(static_cast<uint32_t>(type)) + ")");
  }
  const int64_t block = ggml_block_elements(type);
  if (n < 0 || n % block != 0) {
    fail(StatusCode::kInvalidArgument,
         std::string(caller) + ": " + std::to_string(n) + " elements of " + ggml_type_name(type) +
             " is not a whole number of blocks of " + std::to_string(block));
  }
  return n / block;
}

void dequantize_q4_0_ref(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += format::kQK4_0) {
    const auto b = load_block<format::BlockQ4_0>(src + i * sizeof(format::BlockQ4_0));
    const float d = format::fp16_to_float(b.d);
    for (int j = 0; j < format::kQK4_0 / 2; ++j) {
      y[j] = d * float((b.qs[j] & 0xF) - 8);
      y[j + 16] = d * float((b.qs[j] >> 4) - 8);
    }
  }
}

void dequantize_q4_1_ref(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += format::kQK4_1) {
    const auto b = load_block<format::BlockQ4_1>(src + i * sizeof(format::BlockQ4_1));
    const float d = format::fp16_to_float(b.d);
    const float m = format::fp16_to_float(b.m);
    for (int j = 0; j < format::kQK4_1 / 2; ++j) {
      y[j] = d * float(b.qs[j] & 0xF) + m;
      y[j + 16] = d * float(b.qs[j] >> 4) + m;
    }
  }
}

// Q5_0 (22 bytes): fp16 d, uint32 qh (bit j = fifth bit of element j), 16 nibble bytes;
// x = d * (q - 16). Q5_1 (24 bytes) adds an fp16 m after d; x = d * q + m.
void dequantize_q5_ref(const uint8_t* src, float* y, int64_t nb, bool has_min) {
  const size_t block_bytes = has_min ? 24 : 22;
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = src + i * block_bytes;
    uint16_t d_bits, m_bits = 0;
    std::memcpy(&d_bits, p, 2);
    if (has_min) std::memcpy(&m_bits, p + 2, 2);
    const uint8_t* qh_bytes = p + (has_min ? 4 : 2);
    const uint32_t qh = uint32_t(qh_bytes[0]) | uint32_t(qh_bytes[1]) << 8 |
                        uint32_t(qh_bytes[2]) << 16 | uint32_t(qh_bytes[3]) << 24;
    const uint8_t* qs = qh_bytes + 4;
    const float d = format::fp16_to_float(d_bits);
    const float m = format::fp16_to_float(m_bits);
    for (int j = 0; j < 16; ++j) {
      const int q0 = (qs[j] & 0xF) | int((qh >> j) & 1u) << 4;
      const int q1 = (qs[j] >> 4) | int((qh >> (j + 16)) & 1u) << 4;
      if (has_min) {
        y[j] = d * float(q0) + m;
        y[j + 16] = d * float(q1) + m;
      } else {
        y[j] = d * float(q0 - 16);
        y[j + 16] = d * float(q1 - 16);
      }
    }
  }
}

void dequantize_q8_0_ref(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += format::kQK8_0) {
    const auto b = load_block<format::BlockQ8_0>(src + i * sizeof(format::BlockQ8_0));
    const float d = format::fp16_to_float(b.d);
    for (int j = 0; j < format::kQK8_0; ++j) y[j] = d * float(b.qs[j]);
  }
}

// Q4_K / Q5_K: each 64-element chunk c uses qs[32c .. 32c+31]: low nibbles are sub-block 2c,
// high nibbles sub-block 2c+1; Q5_K's fifth bit of element 32*s + l is bit s of qh[l].
// x = (d * sc_s) * q - (dmin * m_s).
template <typename Block, bool kFifthBit>
void dequantize_q45_k_ref(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<Block>(src + i * sizeof(Block));
    const float d = format::fp16_to_float(b.d);
    const float dmin = format::fp16_to_float(b.dmin);
    for (int s = 0; s < 8; ++s, y += 32) {
      uint8_t sc, m;
      k_quant_scale_min(s, b.scales, &sc, &m);
      const float d_s = d * float(sc);
      const float m_s = dmin * float(m);
      const uint8_t* qs = b.qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) {
        int q = (qs[l] >> shift) & 0xF;
        if constexpr (kFifthBit) q |= ((b.qh[l] >> s) & 1) << 4;
        y[l] = d_s * float(q) - m_s;
      }
    }
  }
}

// Q6_K: two halves of 128; in half h, for l in 0..31 the four elements l, l+32, l+64, l+96 take
// their low 4 bits from ql[64h + l] (low nibble), ql[64h + l + 32] (low), ql[64h + l] (high),
// ql[64h + l + 32] (high), and their top 2 bits from bits 0-1, 2-3, 4-5, 6-7 of qh[32h + l].
// Element e uses scale scales[e / 16]; x = (d * sc) * (q - 32).
void dequantize_q6_k_ref(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<format::BlockQ6_K>(src + i * sizeof(format::BlockQ6_K));
    const float d = format::fp16_to_float(b.d);
    for (int e = 0; e < format::kQK_K; ++e) {
      const int h = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
      const uint8_t ql = b.ql[64 * h + l + 32 * (quarter % 2)];
      const int low = quarter < 2 ? (ql & 0xF) : (ql >> 4);
      const int high = (b.qh[32 * h + l] >> (2 * quarter)) & 3;
      const float d_s = d * float(b.scales[e / 16]);
      y[e] = d_s * float((low | high << 4) - 32);
    }
    y += format::kQK_K;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)

// 16 nibble bytes -> 32 unsigned bytes in element order (low nibbles, then high nibbles).
inline __m256i nibbles_in_order(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

void dequantize_q4_avx512(const uint8_t* src, float* y, int64_t nb, bool has_min) {
  const size_t block_bytes = has_min ? sizeof(format::BlockQ4_1) : sizeof(format::BlockQ4_0);
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = src + i * block_bytes;
    uint16_t d_bits, m_bits = 0;
    std::memcpy(&d_bits, p, 2);
    if (has_min) std::memcpy(&m_bits, p + 2, 2);
    const __m256i q = nibbles_in_order(p + (has_min ? 4 : 2));
    const __m512 d = _mm512_set1_ps(format::fp16_to_float(d_bits));
    for (int half = 0; half < 2; ++half) {
      const __m128i q16 = half ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
      __m512i qi = _mm512_cvtepu8_epi32(q16);
      if (!has_min) qi = _mm512_sub_epi32(qi, _mm512_set1_epi32(8));
      __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(qi));
      if (has_min) v = _mm512_add_ps(v, _mm512_set1_ps(format::fp16_to_float(m_bits)));
      _mm512_storeu_ps(y + 16 * half, v);
    }
  }
}

void dequantize_q8_0_avx512(const uint8_t* src, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += 32) {
    const uint8_t* p = src + i * sizeof(format::BlockQ8_0);
    uint16_t d_bits;
    std::memcpy(&d_bits, p, 2);
    const __m512 d = _mm512_set1_ps(format::fp16_to_float(d_bits));
    for (int half = 0; half < 2; ++half) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 + 16 * half));
      _mm512_storeu_ps(y + 16 * half,
                       _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
    }
  }
}

void dequantize_half_avx512(const uint8_t* src, float* y, int64_t n, bool bf16) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
    const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                          : _mm512_cvtph_ps(h);
    _mm512_storeu_ps(y + i, v);
  }
  for (; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    y[i] = bf16 ? format::bf16_to_float(bits) : format::fp16_to_float(bits);
  }
}

#endif  // __AVX512F__ && __AVX512BW__

}  // namespace

bool dequantize_supports(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

void dequantize_row_ref(GgmlType type, const void* src_void, float* dst, int64_t n) {
  const int64_t nb = checked_blocks(type, n, "dequantize_row_ref");
  const auto* src = static_cast<const uint8_t*>(src_void);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, size_t(n) * sizeof(float));
      return;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        dst[i] = type == GgmlType::kF16 ? format::fp16_to_float(bits) : format::bf16_to_float(bits);
      }
      return;
    case GgmlType::kQ4_0:
      dequantize_q4_0_ref(src, dst, nb);
      return;
    case GgmlType::kQ4_1:
      dequantize_q4_1_ref(src, dst, nb);
      return;
    case GgmlType::kQ5_0:
      dequantize_q5_ref(src, dst, nb, false);
      return;
    case GgmlType::kQ5_1:
      dequantize_q5_ref(src, dst, nb, true);
      return;
    case GgmlType::kQ8_0:
      dequantize_q8_0_ref(src, dst, nb);
      return;
    case GgmlType::kQ4_K:
      dequantize_q45_k_ref<format::BlockQ4_K, false>(src, dst, nb);
      return;
    case GgmlType::kQ5_K:
      dequantize_q45_k_ref<format::BlockQ5_K, true>(src, dst, nb);
      return;
    case GgmlType::kQ6_K:
      dequantize_q6_k_ref(src, dst, nb);
      return;
    default:
      break;
  }
  fail(StatusCode::kInternal, "dequantize_row_ref: type list and dispatch disagree");
}

void dequantize_row(GgmlType type, const void* src_void, float* dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const int64_t nb = checked_blocks(type, n, "dequantize_row");
  const auto* src = static_cast<const uint8_t*>(src_void);
  switch (type) {
    case GgmlType::kF16:
      dequantize_half_avx512(src, dst, n, false);
      return;
    case GgmlType::kBF16:
      dequantize_half_avx512(src, dst, n, true);
      return;
    case GgmlType::kQ4_0:
      dequantize_q4_avx512(src, dst, nb, false);
      return;
    case GgmlType::kQ4_1:
      dequantize_q4_avx512(src, dst, nb, true);
      return;
    case GgmlType::kQ8_0:
      dequantize_q8_0_avx512(src, dst, nb);
      return;
    default:
      break;
  }
#endif
  dequantize_row_ref(type, src_void, dst, n);
}

}  // namespace certkv::model
