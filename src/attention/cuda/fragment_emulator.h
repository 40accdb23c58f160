// A host emulation of the fragment kernel's page decoders (fragment_decode_cuda.cu): the value of
// every mma A-operand element a lane holds for a fragment-major page, computed from the page's
// bytes with the device instructions' semantics written out (PRMT's byte permutation, the exact
// E4M3 -> fp16 conversion, the fp16 subtractions of the dither8 codes and the fp16 dither operands
// a PRMT makes, each checked to be exact), and placed by the PTX ISA's operand layout of
// mma.m16n8k16. The
// tests (fragment_emulator_test.cc) check it bit for bit against the codecs' `_ref` decoders on
// real KV and adversarial bytes. No CUDA headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "attention/cuda/fragment_layout.h"
#include "codec/lossy_page.h"
#include "format/dither8_generator.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::attention::cuda::emulate {

// PRMT (default mode): byte i of the result is byte ((s >> 4 i) & 7) of the 8 bytes {y, x} (x the
// low four).
inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t both = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

// tile_mma.cuh's bytes_to_1024_plus: fp16 pairs {1024 + byte i, 1024 + byte i + 1}.
inline uint32_t bytes_to_1024_plus(uint32_t word, int byte) {
  return byte_perm(word, 0x64646464u, 0x4040u | uint32_t(byte) | (uint32_t(byte + 1) << 8));
}

// tile_mma.cuh's bytes_to_minus_4_plus: fp16 pairs {-(4 + byte i / 256), -(4 + byte i + 1 / 256)}.
inline uint32_t bytes_to_minus_4_plus(uint32_t word, int byte) {
  return byte_perm(word, 0xc4c4c4c4u, 0x4040u | uint32_t(byte) | (uint32_t(byte + 1) << 8));
}

inline double half_value(uint16_t bits) { return double(format::fp16_to_float(bits)); }

// The fp16 result of an operation whose exact value is x: the test's premise is that the device's
// fp16 arithmetic on these operands is exact, so x must be an fp16 value.
inline double exact_half(double x) {
  if (double(format::fp16_to_float(format::float_to_fp16(float(x)))) != x)
    throw std::logic_error("an fp16 operation of the decoder is not exact");
  return x;
}

// cvt.rn.f16x2.e4m3x2 of one code: exact (every finite E4M3 value is an fp16 value); NaN codes
// stay NaN.
inline double e4m3_as_half(uint8_t code) {
  const float v = format::fp8_e4m3_to_float(code);
  if (std::isnan(v)) return NAN;
  return exact_half(double(v));
}

// The PTX ISA's A operand of mma.m16n8k16 (16-bit elements): lane l's element i (register i / 2,
// half i % 2) is (row, column) of the 16 x 16 step.
inline int a_row(int lane, int i) { return lane / 4 + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0); }
inline int a_col(int lane, int i) { return 2 * (lane % 4) + (i & 1) + (i >= 4 ? 8 : 0); }

// The page classes of the fragment formats.
enum class PageClass { kBf16, kFp8, kDither8 };

// out[token * D + channel]: the value the kernel's operands give that element of a K (key) or V
// page (dither8 K: s (q - xi) through the codes and the dither's operands and the group's offset
// term; its outlier channels from their exact values, added after the products; dither8 V: the
// code times the token's scale, which the kernel folds into the probabilities). spec and block:
// dither8's generator key and outlier pairs, and the page's block in its sequence.
template <int D>
void operand_values(PageClass cls, bool key, const uint8_t* page, const codec::LossyPageSpec& spec, uint32_t block,
                    double* out) {
  constexpr int T = fragment::kPageTokens, G = D / codec::kQuantGroup;
  const bool words = cls == PageClass::kDither8 && key;
  for (int s = 0; s < D / 16; ++s)
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 8; ++i) {
        const int row = a_row(lane, i), col = a_col(lane, i);
        double v = 0;
        int token, channel;
        if (cls == PageClass::kBf16) {
          uint16_t bits;
          std::memcpy(&bits, page + 2 * (s * fragment::kStepElements + lane * fragment::kLaneElements + i), 2);
          v = double(format::bf16_to_float(bits));
        } else if (!words) {
          const uint8_t code = page[(s / 2) * 512 + lane * 16 + (s % 2) * 8 + i];
          if (cls == PageClass::kFp8) {
            v = e4m3_as_half(code);
          } else {  // dither8 V: the code as fp16 1024 + (code + 128) minus 1152, then its scale
            uint32_t word = 0;
            std::memcpy(&word, page + (s / 2) * 512 + lane * 16 + (s % 2) * 8 + (i / 4) * 4, 4);
            const uint32_t pair = bytes_to_1024_plus(word ^ 0x80808080u, ((i / 2) % 2) * 2);
            const double q = exact_half(half_value(uint16_t(pair >> (16 * (i % 2)))) - 1152.0);
            uint16_t sbits;  // the scale of token col, group (16 s + row) / 32
            std::memcpy(&sbits, page + T * D + 2 * (col * G + (16 * s + row) / codec::kQuantGroup), 2);
            v = q * half_value(sbits);
          }
        }
        if (!words) {  // K: rows are tokens, columns channels; V (V^T): the reverse
          token = key ? row : col;
          channel = 16 * s + (key ? col : row);
          out[token * D + channel] = v;
          continue;
        }
        // dither8 K: register r = i / 2 holds row (token) lane / 4 + 8 (r % 2), channels 4 t + 2
        // (r / 2) + (i % 2) of the step (t = lane % 4): bytes {0, 1} (r 0), {4, 5} (r 1), {2, 3}
        // (r 2), {6, 7} (r 3) of the lane's 8 bytes of the step.
        const int r = i / 2, t = lane % 4;
        token = lane / 4 + 8 * (r % 2);
        channel = 16 * s + 4 * t + 2 * (r / 2) + (i % 2);
        uint32_t word = 0;
        std::memcpy(&word, page + (s / 2) * 512 + lane * 16 + (s % 2) * 8 + 4 * (r % 2), 4);
        const int byte = 2 * (r / 2);
        const uint32_t code_pair = bytes_to_1024_plus(word ^ 0x80808080u, byte);
        const double q = exact_half(half_value(uint16_t(code_pair >> (16 * (i % 2)))) - 1152.0);
        bool outlier = false;
        for (int o = 0; o < spec.n_outlier_pairs; ++o)
          for (int which = 0; which < 2; ++which)
            outlier |= codec::rope_pair_channel(spec.pairing, D, spec.outlier_pairs[o], which) == channel;
        const uint64_t counter = uint64_t(block) * T + uint64_t(token);
        uint32_t u_word = format::dither8_word(format::dither8_row_seed(spec.dither_key, counter), 4 * s + t);
        if (outlier) u_word = (u_word & ~(0xffu << (8 * (channel % 4)))) | (0x80u << (8 * (channel % 4)));
        // The dither operand, -(4 + u/256) (PRMT with 0xc4 as the high byte); the group's starting
        // value in the accumulator (dither8_scores) adds 4.5 q_c for every channel, so the
        // products see q_c (1/2 - u/256).
        const uint32_t u_pair = bytes_to_minus_4_plus(u_word, byte);
        const double u_operand = half_value(uint16_t(u_pair >> (16 * (i % 2))));
        if (u_operand != -(4.0 + double((u_word >> (8 * (channel % 4))) & 0xffu) / 256.0))
          throw std::logic_error("the dither operand is not -(4 + u/256)");
        const double d = u_operand + 4.5;
        uint16_t sbits;
        std::memcpy(&sbits, page + T * D + 2 * (token * G + channel / codec::kQuantGroup), 2);
        const double scale = half_value(sbits);
        if (outlier) {
          // The products see the stored code (0) and dither byte 128 (d = 0 with the start's
          // 4.5 q_c), and no -1/512 term (the start leaves outliers out of it); the exact value is
          // added after them.
          const int m = spec.n_outlier_pairs;
          int index = -1;
          for (int o = 0; o < m; ++o)
            for (int which = 0; which < 2; ++which)
              if (codec::rope_pair_channel(spec.pairing, D, spec.outlier_pairs[o], which) == channel) index = 2 * o + which;
          uint16_t xbits;
          std::memcpy(&xbits, page + T * (D + 2 * G) + 2 * (token * 2 * m + index), 2);
          const double x = double(format::bf16_to_float(xbits));
          v = q + d == 0 ? x : scale * (q + d) + x;  // (live rows: 0, and x keeps its sign)
        } else {
          // The start's term -(1/2)/256 sum q_c is -1/512 per channel: s (q + d - 1/512).
          v = scale * (q + d - 1.0 / 512.0);
        }
        out[token * D + channel] = v;
      }
}

// GAAC pages (PageFormat::kGaacFragments): a lane's operands of every step built by
// format::fragment::gaac_step_operands with PRMT written out (byte_perm), the page's exceptions
// patched as the kernel does (at most the capacity of them, gaac_patch); out[token * D + channel]
// is the operand's value times 2^(b - kGaacBuilt), b the channel's base: what the kernel's scaled
// query (K) or scaled output (V) makes of it.
template <int D>
void gaac_operand_values(bool key, const uint8_t* page, const uint8_t* bases, double* out) {
  auto word = [&](size_t at) {
    uint32_t w;
    std::memcpy(&w, page + at, 4);
    return w;
  };
  const size_t exceptions = size_t(fragment::gaac_low_bytes(D) + fragment::gaac_word_bytes(D));
  const uint32_t count = word(exceptions);
  const uint32_t n = count < uint32_t(fragment::gaac_exception_capacity(D)) ? count : uint32_t(fragment::gaac_exception_capacity(D));
  for (int lane = 0; lane < 32; ++lane) {
    uint32_t a[D / 16][4];
    for (int s = 0; s < D / 16; ++s) {
      const size_t low = size_t((s / 2) * 512 + lane * 16 + (s % 2) * 8);
      fragment::gaac_step_operands(word(low), word(low + 4), word(size_t(fragment::gaac_word_byte(D, s, lane))), byte_perm,
                                   a[s]);
    }
    for (uint32_t i = 0; i < n; ++i) fragment::gaac_patch<D / 16>(word(exceptions + 4 + 4 * i), lane, a);
    for (int s = 0; s < D / 16; ++s)
      for (int i = 0; i < 8; ++i) {
        const uint16_t bits = uint16_t(a[s][i / 2] >> (16 * (i % 2)));
        const int token = key ? a_row(lane, i) : a_col(lane, i), channel = 16 * s + (key ? a_col(lane, i) : a_row(lane, i));
        out[token * D + channel] = std::ldexp(double(format::bf16_to_float(bits)), int(bases[channel]) - fragment::kGaacBuilt);
      }
  }
}

}  // namespace certkv::attention::cuda::emulate
