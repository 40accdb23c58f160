// Lossy KV page codecs (DESIGN.md sections 2 and 4): the registered black-box schemes that write
// back a per-token reconstruction (fp8 casts, scaled fp8, rtn8, rtn4, kivi2), each carrying its
// Tier A witness, and dither8, the certified INT8 class whose Tier B certificate needs only its
// stored scales. Byte layouts: docs/format/lossy_pages.md and docs/format/dither8.md.
//
// A page holds one full block of block_tokens tokens of one (layer, K or V, kv_head):
//   [payload (scheme-specific)][side data]
// Side data: K pages of Tier A schemes: witness w_{t,b} >= ||r_{t,b}|| of the key residual
// r = k^ - k over band b (a contiguous range of RoPE frequency pairs), [n_bands][block_tokens]
// (band-major), as fp16 rounded toward +inf or as u8 codes against the page's fp16 scale
// (WitnessCode), so that it stays an upper bound; fp8-e4m3 K pages may store none
// (WitnessCode::kExponent: the codes bound their own rounding). V pages of Tier A schemes: rho [block_tokens]
// fp16, rho_t >= ||v^_t - v_t|| (rounded toward +inf). dither8 pages carry no side data: their
// error bounds follow from the stored scales.
//
// The exact values are the BF16 inputs; every reconstruction is what attention reads.
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "format/numeric.h"

namespace certkv::codec {

enum class LossyScheme : uint8_t {
  kFp8E4M3 = 0,        // raw cast to FP8 E4M3 (saturating), no scale: the known-broken one
  kFp8E5M2 = 1,        // raw cast to FP8 E5M2, no scale
  kFp8E4M3Scaled = 2,  // per-token fp16 scale s = amax / 448, x / s cast to E4M3
  kRtn8 = 3,           // per token, groups of 32 channels: symmetric 8-bit, fp16 scale amax / 127
  kRtn4 = 4,           // per token, groups of 32 channels: symmetric 4-bit, fp16 scale amax / 7
  kKivi2 = 5,          // 2-bit asymmetric: keys per channel over the block, values per token
                       // in groups of 32 (KIVI, Liu et al. 2024); fp16 min and step
  kDither8 = 6,        // certified INT8: subtractive dither, per-token group-of-32 fp16 scales
                       // s = amax / 126.5, m outlier RoPE pairs kept exact (bf16)
};
inline constexpr int kNumLossySchemes = 7;

// "fp8-e4m3", "fp8-e5m2", "fp8-e4m3-scaled", "rtn8", "rtn4", "kivi2", "dither8".
const char* lossy_scheme_name(LossyScheme scheme);
// Returns false for an unknown name.
bool parse_lossy_scheme(std::string_view name, LossyScheme* scheme);
// Tier B (dither8) or Tier A (every other scheme).
inline bool lossy_scheme_is_tier_b(LossyScheme s) { return s == LossyScheme::kDither8; }

// Which two channels of a head form RoPE frequency pair j (0 <= j < head_dim / 2):
// interleaved (2j, 2j + 1), as GGUF Llama stores it, or half-split (j, j + head_dim / 2), as
// Hugging Face and Qwen do. Taken from the model.
enum class RopePairing : uint8_t { kInterleaved = 0, kHalfSplit = 1 };
inline int rope_pair_channel(RopePairing pairing, int head_dim, int pair, int which) {
  return pairing == RopePairing::kInterleaved ? 2 * pair + which : pair + which * (head_dim / 2);
}
// "interleaved", "half-split" (the names of model_info's rope_layout); false for another name.
bool parse_rope_pairing(std::string_view name, RopePairing* pairing);

inline constexpr int kWitnessBands = 16;  // B of DESIGN.md section 4 (fewer if head_dim / 2 < 16)
inline constexpr int kQuantGroup = 32;    // channels per scale group (rtn*, kivi2 values, dither8)
inline constexpr int kMaxOutlierPairs = 64;

// Bands of a head: min(kWitnessBands, head_dim / 2). Band b covers the RoPE pairs
// [b * P / n_bands, (b + 1) * P / n_bands) with P = head_dim / 2 (integer division).
// (Inline: the meter's weights ask for the band of every pair of every query row.)
[[noreturn]] void fail_witness_bands(int head_dim);
[[noreturn]] void fail_witness_pair(int pair, int n_pairs);
inline int witness_bands(int head_dim) {
  if (head_dim < 2) fail_witness_bands(head_dim);
  return head_dim / 2 < kWitnessBands ? head_dim / 2 : kWitnessBands;
}
// The band of RoPE pair j: the largest b with floor(b * P / n_bands) <= j.
inline int witness_band_of_pair(int head_dim, int pair) {
  const int n_bands = witness_bands(head_dim);
  const int n_pairs = head_dim / 2;
  if (pair < 0 || pair >= n_pairs) fail_witness_pair(pair, n_pairs);
  return ((pair + 1) * n_bands - 1) / n_pairs;
}
// The first RoPE pair of band b, floor(b * P / n_bands) (P for b = n_bands: the pairs' end).
inline int witness_band_first_pair(int head_dim, int band) { return band * (head_dim / 2) / witness_bands(head_dim); }

// How a Tier A K page stores its witness (docs/format/lossy_pages.md, docs/meter.md section 7).
enum class WitnessCode : uint8_t {
  // [n_bands][block_tokens] fp16, each w_{t,b} rounded up (DESIGN.md section 4): 2 bytes per
  // (token, band), 32 per token at 16 bands.
  kFp16 = 0,
  // [n_bands][block_tokens] u8 codes c, then the page's scale w_max (fp16, the page's largest
  // band norm rounded up; 0 when every norm of the page is 0): the bound read back is
  // w_max (c + 1) / 256 >= w_{t,b}, exact in float; c = ceil(256 w / w_max) - 1. 1 byte per
  // (token, band) and 2 per page, 16.125 per token at 16 bands and 16 tokens; c_t about 1% looser
  // on real KV (docs/meter.md section 7).
  kPageScaled8 = 1,
  // No bytes: the codes bound their own rounding (fp8-e4m3 only; docs/meter.md section 7). With no
  // saturation an E4M3 code k^ of a bf16 k is within half its step, |k^ - k| <= 2^(E(k^) - 4)
  // (E the exponent of k^ as a float; 2^E(0) = 0), and within 2^-10 for the zero and subnormal
  // codes, so channel c of token t is bounded by u_{t,c} = 2^(E(k^_{t,c}) - 4) + 2^-10 and
  // c_t = |sm_scale| sum_c |q_c| u_{t,c}, the device's bound (attention/cuda/fragment_decode_cuda.cu).
  // The encoder refuses a K page where the cast saturated (some |k| > 464, the largest code 448
  // plus its half-step): that block stays exact, as the device keeps it.
  kExponent = 2,
};
inline constexpr int kNumWitnessCodes = 3;
// "fp16", "u8", "exponent".
const char* witness_code_name(WitnessCode code);
// Returns false for an unknown name.
bool parse_witness_code(std::string_view name, WitnessCode* code);
// Whether pages of `scheme` can carry witness `code` soundly: kFp16 and kPageScaled8 for every
// Tier A scheme; kExponent for fp8-e4m3 only (the raw cast, whose codes are its reconstruction:
// fp8-e4m3-scaled multiplies them by a scale that is not a power of two, fp8-e5m2's codes have
// another step and are not served, rtn and kivi2 codes say nothing of their error); none for
// dither8 (its bound comes from its scales).
bool lossy_witness_supported(LossyScheme scheme, WitnessCode code);
// The saturation limit of the exponent witness: a raw E4M3 cast of |x| <= 464 is within half a
// step of x; above, it saturates at 448 and its code bounds nothing.
inline constexpr float kExponentWitnessLimit = 464.0f;

// What one page is: the scheme, K or V, the block shape, the witness code (Tier A K pages), and
// for dither8 the generator key and the outlier pairs of its (layer, kv_head).
struct LossyPageSpec {
  LossyScheme scheme = LossyScheme::kRtn8;
  bool key = true;  // K page (witness; dither8 outliers) or V page (rho)
  int block_tokens = 16;
  int head_dim = 0;  // multiple of 32 (kQuantGroup), at most 256
  RopePairing pairing = RopePairing::kInterleaved;
  WitnessCode witness = WitnessCode::kFp16;  // Tier A K pages; ignored by other pages
  // dither8 K pages: the dither of element (row, channel) of the page of block `block` (its
  // position in its sequence / block_tokens) is dither8_xi(dither_key, block * block_tokens + row,
  // channel); the key names (layer, K/V, kv_head) (dither8_key). Never the physical slot: a page's
  // values do not depend on where it is stored (batch invariance, swapping, shared prefixes, which
  // sit at the same positions in every sequence sharing them). V pages are not dithered
  // (the certificate's value side is the deterministic rho): their key is ignored.
  uint64_t dither_key = 0;
  // dither8 K pages: the m RoPE pairs kept exact (bf16) and excluded from the group amax, fixed
  // per (layer, kv_head); n_outlier_pairs <= min(kMaxOutlierPairs, head_dim / 2). V pages: 0.
  int n_outlier_pairs = 0;
  const uint16_t* outlier_pairs = nullptr;  // [n_outlier_pairs] pair indices, increasing
};

// Throws certkv::Error kInvalidArgument / kUnsupported naming the field when the spec is unusable
// (head_dim not a multiple of 32 or above 256, block_tokens outside [1, 4096], too many or
// repeated or out-of-range outlier pairs, outliers on a non-dither8 or V page).
void validate_lossy_page_spec(const LossyPageSpec& spec);

// Bytes of one page: payload + side data.
size_t lossy_page_bytes(const LossyPageSpec& spec);
// Bytes of the payload alone (the side data follows at this offset).
size_t lossy_payload_bytes(const LossyPageSpec& spec);

// Encodes one full block. x: [block_tokens][head_dim] bf16 bit patterns (the exact values).
// Writes lossy_page_bytes(spec) bytes at `page`, including the witness (Tier A K pages) or rho
// (Tier A V pages). Returns false, leaving `page` unspecified, when a value is not finite or a
// scale does not fit fp16 (the caller keeps the block exact and counts the event).
// block: the block's index in its sequence (position / block_tokens; dither8's counter, ignored
// by other schemes).
bool lossy_encode_page_ref(const LossyPageSpec& spec, uint32_t block, const uint16_t* x,
                           uint8_t* page);

// The bytes and the result of lossy_encode_page_ref, faster: what the cache writes at block
// finalize (fp8 casts through a table of every bf16 pattern, rounding in one instruction, one
// dither word per four channels, the reconstruction by lossy_decode_page). Same contract.
bool lossy_encode_page(const LossyPageSpec& spec, uint32_t block, const uint16_t* x, uint8_t* page);

// The reconstruction attention reads. out: [block_tokens][head_dim] float.
void lossy_decode_page_ref(const LossyPageSpec& spec, uint32_t block, const uint8_t* page,
                           float* out);

// The same floats as lossy_decode_page_ref, faster (dither8 derives the row seed once per row and
// one 32-bit word per four channels); what attention reads. out: [block_tokens][head_dim] float.
void lossy_decode_page(const LossyPageSpec& spec, uint32_t block, const uint8_t* page,
                       float* out);

namespace detail {
// What a decoding kernel needs of a spec, derived once (lossy_page_kernels.h).
struct LossyDecodeArgs {
  LossyScheme scheme = LossyScheme::kRtn8;
  bool key = true;
  int block_tokens = 0;
  int head_dim = 0;
  int groups = 0;           // head_dim / kQuantGroup
  size_t record_bytes = 0;  // per token (token-major payloads; 0 for kivi2)
  uint64_t dither_key = 0;  // dither8 K pages
  int n_outlier_channels = 0;                      // dither8 K pages: 2 m
  uint8_t outlier_channels[2 * kMaxOutlierPairs];  // pair i: channels [2 i] (a) and [2 i + 1] (b)
  // The same by channel: outlier_lanes[k] bit j set when channel 16 k + j is an outlier channel,
  // outlier_index[c] its index i (outlier_channels[i] == c); 0 elsewhere.
  uint16_t outlier_lanes[256 / 16];
  uint8_t outlier_index[256];
};
// Rows [0, n_rows) of one page: out [n_rows][head_dim]; dither8 pages: when scales is not null,
// also the group scales band-major, scales[g * scales_stride + t].
using LossyDecodeKernel = void (*)(const LossyDecodeArgs& args, uint32_t block, const uint8_t* page,
                                   int n_rows, float* out, float* scales, size_t scales_stride);
}  // namespace detail

// The instruction sets a LossyPageDecoder can use: kPortable (plain C++, with AVX2 intrinsics where
// the build targets them), kAvx2 (AVX2, FMA, F16C) and kAvx512 (AVX-512 F, BW, VL, DQ), the last two
// compiled for their own targets and chosen at run time.
enum class LossyKernel : uint8_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
// "portable", "avx2", "avx512".
const char* lossy_kernel_name(LossyKernel kernel);
// Whether this CPU (and build) runs the kernel.
bool lossy_kernel_supported(LossyKernel kernel);
// The widest supported kernel, capped by the environment variable CERTKV_LOSSY_KERNEL when it
// names one ("portable", "avx2", "avx512"; read once per process; for tests and for measuring
// one kernel against another). An unknown name is ignored.
LossyKernel lossy_best_kernel();

// Page decoding bound to one spec (validated once, at construction) and one kernel: what decode
// attention calls for every page. Thread safety: const methods may run concurrently. The spec's
// outlier_pairs are copied.
class LossyPageDecoder {
 public:
  // Throws as validate_lossy_page_spec; kUnsupported when the kernel is not supported.
  explicit LossyPageDecoder(const LossyPageSpec& spec, LossyKernel kernel = lossy_best_kernel());
  // Rows [0, n_rows) of a page of block `block`: out [n_rows][head_dim], the floats of
  // lossy_decode_page_ref bit for bit, NaNs of corrupt pages included.
  // dither8 pages: when scales is not null, also the stored scales s_{t,g} (as dither8_scales)
  // band-major, scales[g * scales_stride + t] for g < head_dim / kQuantGroup: the meter's Tier B
  // data from the same pass over the page. REQUIRES: 1 <= n_rows <= block_tokens.
  void decode(uint32_t block, const uint8_t* page, int n_rows, float* out, float* scales = nullptr,
              size_t scales_stride = 0) const;
  LossyKernel kernel() const { return kernel_; }

 private:
  detail::LossyDecodeArgs args_;
  detail::LossyDecodeKernel decode_;
  LossyKernel kernel_;
};

// Tier A K pages of WitnessCode::kFp16: witness [witness_bands(head_dim)][block_tokens] fp16 bits
// (band-major), inside the page (other codes: throws kInvalidArgument; read them with
// lossy_witness_bounds).
// REQUIRES (both accessors): page is 2-byte aligned (pool pages are).
const uint16_t* lossy_witness(const LossyPageSpec& spec, const uint8_t* page);
// Tier A K pages, any witness code: the bounds w_{t,b} as float, band-major:
// out[b * block_tokens + t], b < witness_width(spec). Never below the stored bound: a stored
// bound (fp16) or scale (kPageScaled8) below 0, or NaN, is a corrupt page and reads as +inf,
// which the meter turns into 1. kExponent: each channel is its own band, out[c * block_tokens + t]
// = u_{t,c} of the code (exponent_witness_bounds).
void lossy_witness_bounds(const LossyPageSpec& spec, const uint8_t* page, float* out);
// Bands of a Tier A K page's witness: witness_bands(head_dim), or head_dim for kExponent.
int witness_width(const LossyPageSpec& spec);
// The kExponent bounds of rows [0, n_tokens) of an fp8-e4m3 page's codes ([block_tokens][head_dim]
// bytes) without checking a spec: out[c * out_stride + t] = u_{t,c} = 2^(E(k^) - 4) + 2^-10 for the
// code's value k^ (2^-10 for a zero code; +inf for a NaN code), exact in float.
void exponent_witness_bounds(const uint8_t* codes, int head_dim, int n_tokens, float* out, size_t out_stride);
// u of one E4M3 code, as above (exponent_witness_bounds's table).
float exponent_witness_bound_of_code(uint8_t code);
// The kPageScaled8 bounds of a side-data area (n_bands * block_tokens codes, then the fp16
// scale) without checking a spec: what lossy_witness_bounds does once the spec is valid, for the
// meter's per-page loop (the cache's specs are validated when it is built). Tokens [0, n_tokens)
// of each band b go to out[b * out_stride + t].
void page_scaled_witness_bounds(const uint8_t* side, int n_bands, int block_tokens, int n_tokens, float* out,
                                size_t out_stride);
// Tier A V pages: rho [block_tokens] fp16 bits, inside the page.
const uint16_t* lossy_value_rho(const LossyPageSpec& spec, const uint8_t* page);

// dither8 pages: scales [block_tokens][head_dim / kQuantGroup] as float (exact fp16 values).
void dither8_scales(const LossyPageSpec& spec, const uint8_t* page, float* scales);
// dither8 V pages: per-token upper bound on ||v^_t - v_t||, from the scales alone:
// |r_c| <= s_c (1/2 + kDither8Slack) on every channel. out: [block_tokens].
void dither8_value_rho(const LossyPageSpec& spec, const uint8_t* page, float* rho);

// The dither generator, scalar reference of format/dither8_generator.h: xi in (-1/2, 1/2) on the
// grid of 2^8 cell centres,
//   xi = (u + 1/2) / 2^8 - 1/2,  u = dither8_u(dither8_word(dither8_row_seed(key, counter),
//                                                            channel / 4), channel),
// 8 bits of one 32-bit hash per four channels of a row, so it is an odd multiple of 2^-9, exact
// in float and fp16, and the grid is symmetric with mean zero. See docs/format/dither8.md.
// counter = block * block_tokens + row (below 2^44).
// REQUIRES: 0 <= channel < 256 (certkv::Error otherwise).
float dither8_xi(uint64_t key, uint64_t counter, int channel);
// The generator key of (layer, K or V, kv_head).
uint64_t dither8_key(int layer, bool key_tensor, int kv_head);
// Per channel, the residual of the stored reconstruction is a centred term with the sub-Gaussian
// proxy of the ideal continuous subtractive-dither residual s * e (e uniform on [-1/2, 1/2)) plus
// a deterministic offset (the 256-cell dither's mean, at most 2^-9 s) and float rounding (below
// 2^-17 s), together at most (2^-9 + 2^-17) s <= s * kDither8Slack (a factor ~2 to spare); the
// certificate adds it to its radius (docs/format/dither8.md).
inline constexpr float kDither8Slack = 1.0f / 256.0f;  // 2^-8

// The m pairs with the largest max |x| over the rows (either channel of the pair), returned in
// increasing pair order. x: [n_rows][head_dim] float. out: [m]. REQUIRES: 0 <= m <= head_dim / 2.
void select_outlier_pairs(const float* x, int n_rows, int head_dim, RopePairing pairing, int m,
                          uint16_t* out);

// fp16 of a float rounded toward +inf (an upper bound; +inf when above 65504): format/numeric.h,
// shared with the device encoders.
using format::float_to_fp16_upward;

}  // namespace certkv::codec
