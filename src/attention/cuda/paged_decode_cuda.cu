#include "attention/cuda/paged_decode_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <cfloat>
#include <cmath>

#include "attention/cuda/fragment_decode_cuda.h"
#include "attention/cuda/tile_mma.cuh"
#include "format/dither8_generator.h"
#include "format/fragment_layout.h"
#include "format/gaac_layout.h"

namespace certkv::attention::cuda {

namespace {

using namespace tile;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockTokens = 16;
constexpr int kMaxGroup = 8;  // query heads of one KV head: rows 0..7 of the m16 tile
constexpr int kBands = 16;    // Tier A witness bands (codec::kWitnessBands)
constexpr int kQuantGroup = 32;
// GAAC bases are kept in shared memory shifted to the exponent field of the tile element: bf16
// (bits 7..14) and fp16 holding an E5M2 value (bits 10..14).
constexpr int kGaacBf16BaseShift = 7;
constexpr int kGaacE5M2BaseShift = 10;
constexpr float kLog2e = 1.4426950408889634f;

template <PageFormat F>
struct FormatTraits {
  static constexpr bool kHalf = F != PageFormat::kGaacBf16;
  static constexpr bool kTierA = F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2;
  static constexpr bool kTierB = F == PageFormat::kDither8;
  static constexpr bool kGaac = F == PageFormat::kGaacBf16 || F == PageFormat::kGaacE5M2;
  // The V page is decoded after the scores, into a tile the scores are done with (dither8: the
  // dither tile; GAAC bf16: the K tile, which saves a tile per warp: 4 CTAs per multiprocessor).
  static constexpr bool kValuesLate = F == PageFormat::kDither8 || F == PageFormat::kGaacBf16;
  // Lossy pages beside exact raw bf16 pages (table entries < 0), read on the bf16 path.
  static constexpr bool kLossy = kTierA || kTierB;
};

// ---------------------------------------------------------------------------------------------
// Shared memory of one CTA.

// Bytes of a page staged in shared memory before it is decoded (the most a page can need): a GAAC
// slot (fixed part and escape area), an fp8 page with its witness (K) or rho (V), a dither8 page
// with up to kMaxDeviceOutlierPairs outlier pairs. Raw pages are read from the pool when decoded.
// (bf16 pages are read by the bulk-copy kernel: fragment_decode_cuda.h.)
template <int D, PageFormat F>
__host__ __device__ constexpr int stage_bytes(bool key) {
  int n = 0;
  if (F == PageFormat::kGaacBf16)
    n = int(format::gaac_page_fixed_bytes(format::GaacElement::kBf16, kBlockTokens, D) +
            format::gaac_page_max_escape_bytes(format::GaacElement::kBf16, kBlockTokens, D));
  if (F == PageFormat::kGaacE5M2)
    n = int(format::gaac_page_fixed_bytes(format::GaacElement::kFp8E5M2, kBlockTokens, D) +
            format::gaac_page_max_escape_bytes(format::GaacElement::kFp8E5M2, kBlockTokens, D));
  if (F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2) n = kBlockTokens * D + (key ? kBands : 1) * kBlockTokens * 2;
  if (F == PageFormat::kDither8)
    n = kBlockTokens * (D + 2 * (D / kQuantGroup) + (key ? 4 * kMaxDeviceOutlierPairs : 0));
  return (n + 15) / 16 * 16;
}

// Where 16-byte chunk c of a page lands in its stage. An fp8 page's codes and a GAAC bf16 slot's
// sign-mantissa bytes are permuted inside each 128-byte row (chunk c at c ^ (c / 8 mod 4)), so that
// the decoders' 16-byte reads hit 8 distinct bank groups per quarter warp (fp8: 4 tokens x 2 row
// halves; GAAC: 8 lanes' runs of 64 bytes, which unpermuted fall in 2 groups); the rest of a page
// stays in place. Both regions are whole 128-byte rows.
template <int D, PageFormat F>
__host__ __device__ constexpr int stage_chunk_region() {  // chunks [0, this) are permuted
  return F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2 ? kBlockTokens * D / 16
         : F == PageFormat::kGaacBf16 ? int(format::gaac_tile_code_offset(format::GaacElement::kBf16, kBlockTokens, D)) / 16
                                      : 0;
}
template <int D, PageFormat F>
__host__ __device__ constexpr int stage_chunk(int c) {
  static_assert(stage_chunk_region<D, F>() % 32 == 0, "whole 128-byte rows, whole steps of 32 chunks");
  return c < stage_chunk_region<D, F>() ? permuted_chunk(c) : c;
}
// In the permuted regions stage_chunk(c ^ i) == stage_chunk(c) ^ i for i < 8 (the row c / 8 is
// unchanged): a decoder reads its run at one XOR per chunk.

// The layout of a format's tiles (tile_mma.cuh): pages are decoded into swizzled tiles.
template <int D, PageFormat F>
using TileLayout = SwizzledTile<D>;

// Where a warp's stages and tiles start: on 128-byte rows for fp8 and GAAC bf16, whose quarter
// warps' 16-byte copies then fill whole rows (5-9% and 2-3% faster, run 13); on 16 bytes for
// GAAC-E5M2 and dither8, where the padding cost GAAC-E5M2 its fourth CTA per multiprocessor (4-18%
// slower) and gained dither8 nothing.
template <PageFormat F>
inline constexpr int kTileAlign =
    F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2 || F == PageFormat::kGaacBf16 ? 128 : 16;

// One warp's shared memory: one stage (the page pair in flight) and the decoded tiles; the copies
// of page i + 1 land while page i is used, and the other warps of the multiprocessor hide the rest.
template <int D, PageFormat F>
struct Tiles {
  alignas(kTileAlign<F>) uint8_t stage_k[1][stage_bytes<D, F>(true)];
  alignas(kTileAlign<F>) uint8_t stage_v[1][stage_bytes<D, F>(false)];
  alignas(kTileAlign<F>) uint16_t k[kBlockTokens * D];
  alignas(kTileAlign<F>) uint16_t v[kBlockTokens * D];
  // An fp8 page's side data (the K page's witness, the V page's rho) is read from the stage
  // before the stage is refilled (attend_block): no copy of it here.
};

template <int D>
struct Tiles<D, PageFormat::kGaacBf16> {  // one tile: the K page's rows, then the V page's
  alignas(kTileAlign<PageFormat::kGaacBf16>) uint8_t stage_k[1][stage_bytes<D, PageFormat::kGaacBf16>(true)];
  alignas(kTileAlign<PageFormat::kGaacBf16>) uint8_t stage_v[1][stage_bytes<D, PageFormat::kGaacBf16>(false)];
  alignas(kTileAlign<PageFormat::kGaacBf16>) uint16_t k[kBlockTokens * D];
};

template <int D>
struct Tiles<D, PageFormat::kDither8> {  // the K page's scores read its stage: one tile, for the values
  alignas(16) uint8_t stage_k[1][stage_bytes<D, PageFormat::kDither8>(true)];
  alignas(16) uint8_t stage_v[1][stage_bytes<D, PageFormat::kDither8>(false)];
  // The values s q (fp16; V pages are not dithered), decoded once the scores are done; an exact
  // (raw bf16) K page's rows before them.
  alignas(16) uint16_t w[kBlockTokens * D];
  float rho[kBlockTokens];  // the V page's rho_t (metered launches)
};

// Lossy formats: the query rounded to bf16 for their exact (raw bf16) K pages, Q^T read by
// tile_scores_shared_q (16-byte chunks swizzled). Nothing for the other formats.
template <int D, bool kLossy>
struct ExactPageQuery {};

template <int D>
struct ExactPageQuery<D, true> {
  alignas(16) uint16_t q_bf16[kMaxGroup][D];
};

// GAAC formats: the bases and the escape-bit table. Nothing for the other formats (2 KiB that
// would cost the bf16 kernel at D = 128 its third CTA per multiprocessor).
template <int D, bool kGaac>
struct GaacTables {};

template <int D>
struct GaacTables<D, true> {
  alignas(16) uint16_t base7[2][base_row_elements<D>()];  // (b3, b4) << the element's exponent shift, K and V (base_index)
  uint32_t nibble_bit3[256];  // nibble_bit3_of(e)
};

// dither8: the certificate's second weights, the dither offsets of the scores and the outlier
// channels. Nothing for the other formats.
template <int D, bool kTierB>
struct Dither8Tables {};

template <int D>
struct Dither8Tables<D, true> {
  float abs_weight[kMaxGroup][kBands];              // |sm| slack sum |q_c|
  float dither_offset[kMaxGroup][D / kQuantGroup];  // (1/2)/256 sum_{c in g} q_c
  int32_t outlier_channels[2 * kMaxDeviceOutlierPairs];
};

template <int D, PageFormat F>
struct CtaShared : ExactPageQuery<D, FormatTraits<F>::kLossy>, GaacTables<D, FormatTraits<F>::kGaac>,
                   Dither8Tables<D, FormatTraits<F>::kTierB> {
  // The queries rounded to the tile element (fp16 or bf16 bits; element_value reads one).
  alignas(16) uint16_t q[kMaxGroup][D];
  float weight[kMaxGroup][kBands];  // Tier A: |sm| ||q_b||; Tier B: sm^2 sum q^2/12 * 2 log(2S/delta)
  union {
    Tiles<D, F> tiles[kWarps];
    WarpMerge<D, kWarps> merge;
  } u;
};

// Shared memory per CTA at D = 128 within what 3 CTAs per multiprocessor may use on the H200
// (233,472 bytes less 1,024 reserved per CTA).
static_assert(sizeof(CtaShared<128, PageFormat::kGaacBf16>) <= 76800 &&
                  sizeof(CtaShared<128, PageFormat::kGaacE5M2>) <= 76800 &&
                  sizeof(CtaShared<128, PageFormat::kFp8E4M3>) <= 76800 &&
                  sizeof(CtaShared<128, PageFormat::kDither8>) <= 76800,
              "3 CTAs per multiprocessor at D = 128");
// fp8 at D = 128: 4 CTAs (233,472 / 4 bytes less 1,024 reserved per CTA), which the meter's side
// data read from the stage and the 16-bit queries made room for.
static_assert(sizeof(CtaShared<128, PageFormat::kFp8E4M3>) <= 57344 && sizeof(CtaShared<128, PageFormat::kFp8E5M2>) <= 57344,
              "4 CTAs per multiprocessor for fp8 at D = 128");
static_assert(sizeof(CtaShared<128, PageFormat::kGaacBf16>) <= 57344,
              "4 CTAs per multiprocessor for GAAC bf16 at D = 128 (one tile per warp)");

// The bf16 query rows of a lossy format's exact pages (null for the other formats).
template <int D, PageFormat F>
__device__ inline const uint16_t (*exact_page_query(const CtaShared<D, F>& sh))[D] {
  if constexpr (FormatTraits<F>::kLossy) return sh.q_bf16;
  else return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Page decoders: lane l of a warp writes token l / 2, channels [h D/2, (h + 1) D/2) with h = l % 2,
// of the tile (chunks h D/16 ... of row l / 2). Each returns false when the page is corrupt (the
// tile is then zero).

struct PageRef {
  const uint8_t* bytes;  // null: corrupt entry
  bool raw;              // a raw page: a GAAC page stored raw, or an exact bf16 page of a lossy format
  int32_t slot;          // the table entry
};

__device__ inline PageRef page_ref(const uint8_t* pages, int64_t stride, int64_t n_pages,
                                   const uint8_t* raw_pages, int64_t raw_stride, int64_t n_raw,
                                   int32_t entry) {
  if (entry >= 0) {
    if (entry < n_pages) return {pages + int64_t(entry) * stride, false, entry};
    return {nullptr, false, entry};
  }
  const int64_t r = -int64_t(entry) - 1;
  if (raw_pages != nullptr && r < n_raw) return {raw_pages + r * raw_stride, true, entry};
  return {nullptr, true, entry};
}

// Chunk i of the half h of row t of a tile of layout L (swizzled unless said).
template <int D, class L = SwizzledTile<D>>
__device__ inline uint4* tile_chunk(uint16_t* tile, int t, int h, int i) {
  return reinterpret_cast<uint4*>(tile + L::at(L::offset(t, h * (D / 16)), i));
}

template <int D, class L = SwizzledTile<D>>
__device__ inline void zero_row(uint16_t* tile, int t, int h) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) *tile_chunk<D, L>(tile, t, h, i) = make_uint4(0, 0, 0, 0);
}

// Raw bf16 (or a raw GAAC bf16 page, from the pool): copy.
template <int D>
__device__ inline void decode_bf16_row(const uint8_t* page, int t, int h, uint16_t* tile) {
  const uint4* src = reinterpret_cast<const uint4*>(page + (size_t(t) * D + size_t(h) * (D / 2)) * 2);
  uint4 x[D / 16];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) x[i] = src[i];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) *tile_chunk<D>(tile, t, h, i) = x[i];
}

// FP8 bytes to fp16 pairs: E5M2 is the top byte of fp16; E4M3 converts exactly.
template <bool kE4M3>
__device__ inline uint32_t fp8x2_to_half2(uint32_t word, int byte) {
  if constexpr (kE4M3) {
    const __nv_fp8x2_storage_t pair = __nv_fp8x2_storage_t((word >> (8 * byte)) & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    return __byte_perm(word, 0, 0x0404 | (byte << 4) | ((byte + 1) << 12));
  }
}

// kF: the format whose stage permutation the page is read through (stage_chunk); kBf16 for a
// page read from the pool.
template <int D, bool kE4M3, PageFormat kF>
__device__ inline void decode_fp8_row(const uint8_t* page, int t, int h, uint16_t* tile) {
  uint4 x[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i)
    x[i] = *reinterpret_cast<const uint4*>(page + 16 * (stage_chunk<D, kF>(t * (D / 16) + h * (D / 32)) ^ i));
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const uint32_t w[4] = {x[i].x, x[i].y, x[i].z, x[i].w};
    uint32_t o[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] = fp8x2_to_half2<kE4M3>(w[k], 0);
      o[2 * k + 1] = fp8x2_to_half2<kE4M3>(w[k], 2);
    }
    *tile_chunk<D>(tile, t, h, 2 * i) = make_uint4(o[0], o[1], o[2], o[3]);
    *tile_chunk<D>(tile, t, h, 2 * i + 1) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// 24 bits starting at bit `bit` of a little-endian word array (compile-time bit positions).
template <int N>
__device__ inline uint32_t bits24(const uint32_t (&w)[N], int bit) {
  const int i = bit / 32, s = bit % 32;
  const uint32_t hi = i + 1 < N ? w[i + 1] : 0u;
  return __funnelshift_r(w[i], hi, s) & 0xffffffu;
}

// Eight 3-bit codes (bits 3i .. 3i + 2) to the low 3 bits of eight nibbles (bits 4i ..): three
// steps that each move the upper part of every field up (x + (x & mask) (2^s - 1) adds the moved
// copy and removes the original, with no carries since the fields never overlap).
__device__ inline uint32_t spread_codes_to_nibbles(uint32_t x) {
  x += (x & 0x00fff000u) * 15u;    // codes 4..7 up 4 bits: 12-bit halves at bits 0 and 16
  x += (x & 0x0fc00fc0u) * 3u;     // codes 2, 3 (and 6, 7) up 2 bits: 6-bit quarters at 0, 8, 16, 24
  x += (x & 0x38383838u);          // odd codes up 1 bit
  return x;
}

// nibble_bit3[e]: bit i of the byte e moved to bit 4i + 3 (the escape bit of a 4-bit GAAC group
// above each element's 3-bit code).
__host__ __device__ constexpr uint32_t nibble_bit3_of(uint32_t e) {
  uint32_t x = 0;
  for (int i = 0; i < 8; ++i) x |= ((e >> i) & 1u) << (4 * i + 3);
  return x;
}

// Words [0, N) of a lane's run in shared memory, as 8-byte loads when the run allows them (an even
// count at an 8-byte aligned address: half the instructions, and runs of 24 bytes per lane then
// take one wavefront per half warp instead of two per warp).
template <int N>
__device__ inline void load_words(const uint8_t* p, uint32_t (&w)[N]) {
  if constexpr (N % 2 == 0) {
    if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const uint2 x = reinterpret_cast<const uint2*>(p)[i];
        w[2 * i] = x.x;
        w[2 * i + 1] = x.y;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
}

// A GAAC slot (one tile: D <= 128), staged (stage_chunk). Lane l owns the D/16 consecutive groups
// l * D/16 ... of the page, which are exactly its token-half. kElement: bf16 or e5m2 (written as
// fp16). slot: the slot's fixed part; escape_slot: the slot whose escape area the 4-bit and raw
// groups read (both the staged copy in shared memory).
template <int D, format::GaacElement kElement>
__device__ inline bool decode_gaac_row(const uint8_t* slot, const uint8_t* escape_slot, int64_t escape_capacity,
                                       int lane, const uint16_t* base7, const uint32_t* nibble_bit3, uint16_t* tile) {
  constexpr PageFormat kF = kElement == format::GaacElement::kBf16 ? PageFormat::kGaacBf16 : PageFormat::kGaacE5M2;
  const int t = lane >> 1, h = lane & 1;
  using namespace format;
  constexpr int NG = D / 16;  // groups per lane
  constexpr int kGroups = kBlockTokens * D / 8;
  constexpr int S = gaac_sign_mantissa_bits(kElement);
  constexpr size_t kCodeOffset = gaac_tile_code_offset(kElement, kBlockTokens, D);
  constexpr size_t kTagOffset = gaac_tile_tag_offset(kElement, kBlockTokens, D);
  constexpr size_t kEscapeOffset = gaac_page_escape_offset(kElement, kBlockTokens, D);
  constexpr int kRawEscape = gaac_mode_escape_bytes(kElement, kGaacModeRaw);
  static_assert(kGroups / 32 == NG, "one token-half per lane");

  // Tags of the lane's groups: NG * 2 bits. A page whose groups are all 3-bit (the common case)
  // needs no escape offsets; otherwise the escape bytes before each lane are scanned.
  const uint8_t* tag_ptr = slot + kTagOffset + size_t(lane) * (NG / 4);
  const uint32_t tags = NG == 8 ? uint32_t(*reinterpret_cast<const uint16_t*>(tag_ptr)) : uint32_t(*tag_ptr);
  const bool any_escape = __any_sync(0xffffffffu, tags != 0);
  int before = 0;
  if (any_escape) {
    int esc = 0;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const uint32_t mode = (tags >> (2 * j)) & 3u;
      bad |= !gaac_mode_valid(kElement, uint8_t(mode));
      esc += mode == kGaacMode4Bit ? 1 : mode == kGaacModeRaw ? kRawEscape : 0;
    }
    before = esc;  // inclusive scan of escape bytes over lanes (page group order)
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += y;
    }
    const int total = __shfl_sync(0xffffffffu, before, 31);
    before -= esc;
    if (__any_sync(0xffffffffu, bad) || total > escape_capacity) return false;
  }
  const uint8_t* escapes = escape_slot + kEscapeOffset + before;

  constexpr int kCodeWords = NG * 3 / 4;
  uint32_t codes[kCodeWords];
  load_words(slot + kCodeOffset + size_t(lane) * NG * 3, codes);

  if constexpr (kElement == GaacElement::kBf16) {
    uint4 sm[NG / 2];  // the lane's NG * 8 sign+mantissa bytes: chunks lane NG / 2 + i
#pragma unroll
    for (int i = 0; i < NG / 2; ++i) sm[i] = *reinterpret_cast<const uint4*>(slot + 16 * (stage_chunk<D, kF>(lane * (NG / 2)) ^ i));
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const uint32_t mode = (tags >> (2 * j)) & 3u;
      const uint32_t sm_lo = (j & 1) ? sm[j / 2].z : sm[j / 2].x;
      const uint32_t sm_hi = (j & 1) ? sm[j / 2].w : sm[j / 2].y;
      const int c0 = h * (D / 2) + 8 * j;  // first channel of the group
      // 3-bit and 4-bit groups on one path: each element's 4-bit offset (its 3-bit code, and the
      // escape bit of a 4-bit group as bit 3) in a nibble of one word, the base b3 or b4 by mode.
      const bool four = mode == kGaacMode4Bit;
      const uint32_t escape_bits = four ? uint32_t(escapes[0]) : 0u;
      const uint32_t nibbles = spread_codes_to_nibbles(bits24(codes, 24 * j)) | nibble_bit3[escape_bits];
      const uint4 base = *reinterpret_cast<const uint4*>(base7 + base_index<D>(four ? 1 : 0, c0));
      const uint32_t bw[4] = {base.x, base.y, base.z, base.w};
      uint32_t out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // Elements 2k, 2k + 1 in the halves of one word: the sign+mantissa byte s m7 with its sign
        // replicated into the byte above (PRMT), masked to s << 15 | m7; the offsets of the pair
        // (byte k of the nibbles) times 2^7 + 2^19 land at bits 7..10 and 23..26 (the two shifted
        // copies do not overlap); plus the base << 7: s | (base + offset) << 7 | m7.
        const uint32_t word = k < 2 ? sm_lo : sm_hi;
        const uint32_t byte = 2 * (k & 1);
        const uint32_t sm2 = __byte_perm(word, 0, byte | ((byte | 8u) << 4) | ((byte + 1) << 8) | (((byte + 1) | 8u) << 12));
        const uint32_t pair = __byte_perm(nibbles, 0, 0x4440u | uint32_t(k));
        const uint32_t offsets = (pair * 0x00080080u) & 0x07800780u;
        out[k] = ((sm2 & 0x807f807fu) | offsets) + bw[k];
      }
      if (mode == kGaacModeRaw) {  // rare: 5 escape bits above each code, no base
        uint32_t ex_lo = uint32_t(escapes[0]) | (uint32_t(escapes[1]) << 8) | (uint32_t(escapes[2]) << 16) |
                         (uint32_t(escapes[3]) << 24);
        const uint32_t ex_hi = escapes[4];
        const uint32_t c24 = bits24(codes, 24 * j);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t word = k < 2 ? sm_lo : sm_hi;
          const int byte = 2 * (k & 1);
          const uint32_t sm2 = __byte_perm(word, 0, 0x4040 | (byte << 0) | ((byte + 1) << 8));
          const uint32_t signed_mant = (sm2 & 0x00800080u) * 255u + sm2;
          const uint32_t high = __funnelshift_r(ex_lo, ex_hi, 10u * uint32_t(k));
          const uint32_t code2 = ((c24 >> (6 * k)) & 7u) | (((c24 >> (6 * k + 3)) & 7u) << 16) |
                                 ((high & 31u) << 3) | (((high >> 5) & 31u) << 19);
          out[k] = signed_mant + (code2 << 7);
        }
      }
      escapes += four ? 1 : mode == kGaacModeRaw ? kRawEscape : 0;
      *tile_chunk<D>(tile, t, h, j) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  } else {
    // E5M2: 3 sign+mantissa bits per element (3 bytes per group, like the codes); the fp8 byte
    // s e5 m2 is the top byte of the fp16 value.
    uint32_t smw[kCodeWords];
    load_words(slot + size_t(lane) * NG * 3, smw);
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const uint32_t mode = (tags >> (2 * j)) & 3u;
      const uint32_t c24 = bits24(codes, 24 * j);
      const uint32_t s24 = bits24(smw, 24 * j);
      const int c0 = h * (D / 2) + 8 * j;
      // 3-bit and 4-bit groups on one path (as for bf16: 4-bit offsets in nibbles, base by mode),
      // two elements per 32-bit word (fp16 s e5 m2 0000 0000 in each half): the 6 sign+mantissa
      // bits of the pair times 2^8 + 2^21 put the mantissas at bits 8..9 and 24..25, times
      // 2^13 + 2^26 the signs at bits 15 and 31; the pair's offsets (byte k of the nibbles)
      // times 2^10 + 2^22 land at bits 10..13 and 26..29 (no two shifted copies overlap, so no
      // carries); masks keep those bits, and the base << 10 completes the exponent.
      const bool four = mode == kGaacMode4Bit;
      const uint32_t escape_bits = four ? uint32_t(escapes[0]) : 0u;
      const uint32_t nibbles = spread_codes_to_nibbles(c24) | nibble_bit3[escape_bits];
      const uint4 base = *reinterpret_cast<const uint4*>(base7 + base_index<D>(four ? 1 : 0, c0));
      const uint32_t bw[4] = {base.x, base.y, base.z, base.w};
      uint32_t out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t s6 = (s24 >> (6 * k)) & 0x3fu;
        const uint32_t mant = (s6 * 0x00200100u) & 0x03000300u;
        const uint32_t sign = (s6 * 0x04002000u) & 0x80008000u;
        const uint32_t pair = __byte_perm(nibbles, 0, 0x4440u | uint32_t(k));
        const uint32_t offsets = (pair * 0x00400400u) & 0x3c003c00u;
        out[k] = (mant | sign | offsets) + bw[k];
      }
      if (mode == kGaacModeRaw) {  // rare: 2 escape bits above each code, no base
        const uint32_t extra = uint32_t(escapes[0]) | (uint32_t(escapes[1]) << 8);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t halves[2];
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            const int i = 2 * k + s;
            const uint32_t sm3 = (s24 >> (3 * i)) & 7u;
            const uint32_t exponent = ((c24 >> (3 * i)) & 7u) | (((extra >> (2 * i)) & 3u) << 3);
            const uint32_t fp8 = ((sm3 & 4u) << 5) | (exponent << 2) | (sm3 & 3u);
            halves[s] = fp8 << 8;
          }
          out[k] = halves[0] | (halves[1] << 16);
        }
      }
      escapes += four ? 1 : mode == kGaacModeRaw ? kRawEscape : 0;
      *tile_chunk<D>(tile, t, h, j) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
  return true;
}


// dither8 V record of token t = lane / 2 (int8 codes [D], fp16 scales [D/32]; V pages are not
// dithered) into the value tile: s q rounded once to fp16, channels [h D/2, (h + 1) D/2) with
// h = lane % 2. A code byte becomes fp16 1024 + 128 + q exactly (bytes_to_1024_plus of the code
// biased by 128), minus 1152 is q exactly, times s rounds once (s q is exact in float: 11 by 8
// significant bits, so this is the CPU's float value rounded to fp16).
template <int D>
__device__ inline void decode_dither8_values(const uint8_t* page, int lane, Tiles<D, PageFormat::kDither8>& tiles) {
  constexpr int G = D / kQuantGroup;
  const int t = lane >> 1, h = lane & 1;
  const uint8_t* rec = page + size_t(t) * (D + 2 * G);
  uint32_t code_words[D / 8];
  load_words(rec + h * (D / 2), code_words);  // 8-byte loads where the record allows: 2-way conflicts otherwise
  __half2 scale2[G / 2];
  const uint16_t* scale_ptr = reinterpret_cast<const uint16_t*>(rec + D) + h * (G / 2);
#pragma unroll
  for (int g = 0; g < G / 2; ++g) scale2[g] = __half2half2(__ushort_as_half(scale_ptr[g]));
  const __half2 k1152 = __float2half2_rn(1152.f);
#pragma unroll
  for (int i = 0; i < D / 8; i += 2) {  // eight channels (two code words) per 16-byte tile chunk
    uint32_t out[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t biased = code_words[i + half] ^ 0x80808080u;  // code + 128
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t c2 = bytes_to_1024_plus(biased, 2 * k);
        const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&c2), k1152);  // exact
        const __half2 x = __hmul2(q, scale2[(4 * i) / kQuantGroup]);
        out[2 * half + k] = *reinterpret_cast<const uint32_t*>(&x);
      }
    }
    *tile_chunk<D>(tiles.w, t, h, i / 2) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// The scores of a dither8 K page straight from its stage, without a tile: S^T = K^ Q^T, where
// K^ = s (q - xi) per token and group of 32 channels. Lane (tq, hq) builds the A fragments of its
// rows tq and tq + 8 itself: in 16-channel step kk the mma's k indices 2 hq, 2 hq + 1, 2 hq + 8,
// 2 hq + 9 stand for channels 16 kk + 4 hq + 0..3 (the queries' B fragments, qb, are permuted
// the same way), which are one 32-bit word of the row's codes and exactly generator word
// 4 kk + hq of the row (format/dither8_generator.h). Per group g (steps 2 g, 2 g + 1 at
// D = 128; a step never straddles two groups) one accumulator starts at -o_g (o_g =
// (1/2)/256 sum_{c in g} q_c, neg_offset) and takes two mma per step, the codes q and the
// dither's 1/2 - u/256 (both exact in fp16: q - xi = q + (1/2 - u/256) - 1/512), then the token's
// scale multiplies it in fp32. Outlier channels: code 0 (stored) and dither byte 128 (`keep`
// clears it), so neither mma sees them; their exact values are added after.
// rows: the stage's rows tq and tq + 8; seeds: their generator row seeds; keep[kk]: byte j is 0xff
// unless channel 16 kk + 4 hq + j is an outlier; sc: the rows' scales (out).
template <int D>
__device__ inline void dither8_key_scores(const uint8_t* const (&rows)[2], const uint32_t (&seeds)[2], int hq,
                                          const uint32_t (&qb)[D / 16][2], const uint32_t (&keep)[D / 16],
                                          const float (&neg_offset)[D / kQuantGroup][2],
                                          float (&sc)[2][D / kQuantGroup], float (&s)[4]) {
  constexpr int G = D / kQuantGroup;
  constexpr int kSteps = kQuantGroup / 16;  // mma steps per group
  const __half2 k1152 = __float2half2_rn(1152.f);
  const __half2 minus_inv256 = __float2half2_rn(-1.f / 256.f), k4_5 = __float2half2_rn(4.5f);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int j = 0; j < G / 2; ++j) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(rows[r] + D + 4 * j);
      sc[r][2 * j] = fp16_bits_to_float(w & 0xffffu);
      sc[r][2 * j + 1] = fp16_bits_to_float(w >> 16);
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float acc[4] = {neg_offset[g][0], neg_offset[g][1], neg_offset[g][0], neg_offset[g][1]};
#pragma unroll
    for (int kk = kSteps * g; kk < kSteps * (g + 1); ++kk) {
      uint32_t codes[4], dither[4];  // A fragments: [r] channels 0, 1 of the word, [r + 2] channels 2, 3
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t biased = *reinterpret_cast<const uint32_t*>(rows[r] + 16 * kk + 4 * hq) ^ 0x80808080u;
        const uint32_t word = format::dither8_word(seeds[r], 4 * kk + hq);
        const uint32_t u = (word & keep[kk]) | (0x80808080u & ~keep[kk]);  // outliers: u = 128, 1/2 - u/256 = 0
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          uint32_t c2 = bytes_to_1024_plus(biased, 2 * k), u2 = bytes_to_1024_plus(u, 2 * k);
          const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&c2), k1152);               // exact
          const __half2 d = __hfma2(*reinterpret_cast<__half2*>(&u2), minus_inv256, k4_5);  // 1/2 - u/256, exact
          codes[r + 2 * k] = *reinterpret_cast<const uint32_t*>(&q);
          dither[r + 2 * k] = *reinterpret_cast<const uint32_t*>(&d);
        }
      }
      mma16816<true>(acc, codes, qb[kk][0], qb[kk][1]);
      mma16816<true>(acc, dither, qb[kk][0], qb[kk][1]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = fmaf(sc[k >> 1][g], acc[k], s[k]);
  }
}

// dither8 V page (staged): rho_t = kDither8ValueRho sqrt(sum_g 32 s_{t,g}^2) of token t = lane / 2
// into tiles.rho, the CPU's float steps in its order (32 s^2 is exact; the sum, square root and
// product round correctly), so the bound is the CPU's to the bit.
template <int D>
__device__ inline void dither8_value_rho_row(const uint8_t* page, int lane, Tiles<D, PageFormat::kDither8>& tiles) {
  constexpr int G = D / kQuantGroup;
  const int t = lane >> 1;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(page + size_t(t) * (D + 2 * G) + D);
  float sum_sq = 0.f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float sg = fp16_bits_to_float(scales[g]);
    sum_sq += float(kQuantGroup) * sg * sg;
  }
  if ((lane & 1) == 0) tiles.rho[t] = kDither8ValueRho * sqrtf(sum_sq);
}

// ---------------------------------------------------------------------------------------------
// The split kernel.

struct SplitArgs {
  PagedDecodeParams p;
  int n_splits;
  int64_t per_split;  // blocks of one split
  float* part_mldr;  // [batch][n_q][n_splits][kSplitPartials]: m, l, d, r
  float* part_o;     // [batch][n_q][n_splits][D]
  unsigned int* error_word;
};

// Whether every lane's chunks lane + 32 j of the permuted region land at stage_chunk(lane) + 32 j
// (the copies add 32 j to one permuted offset per lane).
template <int D, PageFormat F>
__host__ __device__ constexpr bool stage_rounds_hold() {
  for (int c = 0; c < stage_chunk_region<D, F>(); ++c)
    if (stage_chunk<D, F>(c) != stage_chunk<D, F>(c % 32) + 32 * (c / 32)) return false;
  return true;
}

// Issues the asynchronous copies of one page into stage `st` (stage_chunk). Corrupt entries copy
// nothing; raw pages are decoded from the pool. fp8: the side data only with the meter (the K page's witness, the V
// page's rho), which alone reads it; kCoded: the K page's witness is u8 codes and their scale.
template <int D, PageFormat F, bool kMeter, bool kCoded>
__device__ inline void stage_page(const SplitArgs& a, bool key, const PageRef& ref, int st, int lane,
                                  Tiles<D, F>& tiles) {
  if (ref.bytes == nullptr || ref.raw) return;
  if constexpr (F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2) {
    // Whole rounds of 32 lanes, no loop: the codes (permuted, stage_chunk), then the witness (one
    // round of 16-byte chunks) or the rho (two chunks). A loop over the V page's 130 chunks with
    // the rho cost the metered kernel a peeled, branching copy in its hot loop (cuobjdump: about
    // 90 instructions at each of its two sites, against 4 copies without the meter).
    constexpr int kCodeChunks = kBlockTokens * D / 16;
    constexpr int kWitnessChunks = kBands * kBlockTokens * 2 / 16;
    constexpr int kCodedWitnessChunks = (kBands * kBlockTokens + 2 + 15) / 16;  // codes, then w_max
    constexpr int kRhoChunks = kBlockTokens * 2 / 16;
    static_assert(kCodeChunks % 32 == 0 && kCodeChunks == stage_chunk_region<D, F>(), "whole rounds of codes");
    static_assert(kWitnessChunks == 32 && kCodedWitnessChunks <= 32, "the witness is one round");
    static_assert(stage_rounds_hold<D, F>(), "stage_chunk(lane + 32 j) == stage_chunk(lane) + 32 j over the codes");
    static_assert(16 * (kCodeChunks + kWitnessChunks) <= stage_bytes<D, F>(true) &&
                      16 * (kCodeChunks + kRhoChunks) <= stage_bytes<D, F>(false),
                  "the stages hold the side data");
    uint8_t* stage = key ? tiles.stage_k[st] : tiles.stage_v[st];
    // stage_chunk(lane + 32 j) == stage_chunk(lane) + 32 j over the codes (c / 8 mod 4 is the lane's).
    const int permuted = stage_chunk<D, F>(lane) - lane;
#pragma unroll
    for (int j = 0; j < kCodeChunks / 32; ++j)
      cp_async16(stage + 16 * (lane + 32 * j + permuted), ref.bytes + size_t(lane + 32 * j) * 16);
    if constexpr (kMeter) {
      const int c = kCodeChunks + lane;
      if (key ? !kCoded || lane < kCodedWitnessChunks : lane < kRhoChunks) cp_async16(stage + 16 * c, ref.bytes + size_t(c) * 16);
    }
  } else if constexpr (F == PageFormat::kDither8) {
    // Whole rounds of 32 lanes, unrolled (the runtime-bounded loop cost the hot loop about 130
    // instructions with its remainder handling: cuobjdump): a page is kBlockTokens records of
    // D + 2 G + 4 m bytes, so D + 2 G + 4 m chunks of 16 bytes (m = 0 on V pages).
    constexpr int kRounds = (stage_bytes<D, F>(true) / 16 + 31) / 32;
    static_assert(kBlockTokens == 16, "a record per chunk");
    uint8_t* stage = key ? tiles.stage_k[st] : tiles.stage_v[st];
    const int chunks = D + 2 * (D / kQuantGroup) + (key ? 4 * a.p.n_outlier_pairs : 0);
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const int c = lane + 32 * j;
      if (c < chunks) cp_async16(stage + 16 * c, ref.bytes + size_t(c) * 16);
    }
  } else {
    uint8_t* stage = key ? tiles.stage_k[st] : tiles.stage_v[st];
    int bytes = stage_bytes<D, F>(key);
    if constexpr (F == PageFormat::kGaacBf16 || F == PageFormat::kGaacE5M2) {
      constexpr format::GaacElement E =
          F == PageFormat::kGaacBf16 ? format::GaacElement::kBf16 : format::GaacElement::kFp8E5M2;
      bytes = int(format::gaac_slot_bytes(E, kBlockTokens, D, size_t(key ? a.p.k_escape_capacity : a.p.v_escape_capacity)) + 15) / 16 * 16;
    }
    // stage_chunk(lane + 32 j) == stage_chunk(lane) + 32 j in the permuted region (c / 8 mod 4 is
    // the lane's), lane + 32 j after it.
    const int permuted = stage_chunk<D, F>(lane) - lane;  // the lane's XOR, as a difference
    for (int c = lane; c < bytes / 16; c += 32)
      cp_async16(stage + 16 * (c < stage_chunk_region<D, F>() ? c + permuted : c), ref.bytes + size_t(c) * 16);
  }
}

// The tile the values are decoded into (dither8: its one tile, GAAC bf16: the K tile, each free
// once the scores are done).
template <int D, PageFormat F>
__device__ inline uint16_t* value_rows(Tiles<D, F>& tiles) {
  if constexpr (F == PageFormat::kDither8) return tiles.w;
  else if constexpr (F == PageFormat::kGaacBf16) return tiles.k;
  else return tiles.v;
}
// The tile a K page is decoded into (dither8: only an exact page, whose scores are done before
// the values take the tile).
template <int D, PageFormat F>
__device__ inline uint16_t* key_rows(Tiles<D, F>& tiles) {
  if constexpr (F == PageFormat::kDither8) return tiles.w;
  else return tiles.k;
}

// An fp8 page's side data in its stage, after the codes: the K page's Tier A witness (fp16,
// band-major: [band][token]) or the V page's rho (fp16 per token; metered launches).
template <int D>
__device__ inline const uint16_t* fp8_side(const uint8_t* stage) {
  return reinterpret_cast<const uint16_t*>(stage + size_t(kBlockTokens) * D);
}

// A logit bound from the bound factor's product: at least 0 (the hi and lo products may sum to a
// rounding below 0 where every witness is 0), and a NaN (a NaN witness, or +inf times a zero
// weight) stays NaN, which makes A - 1 NaN and the meter 1 (PTX max.NaN, sm_80 on: one
// instruction, as fmaxf, which would have turned it into 0).
__device__ inline float witness_bound(float c) {
  float bound;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(bound) : "f"(c));
  return bound;
}

// Two fp16 witness bounds (a half2 of the fp16 witness): one that reads as below 0 or NaN (a
// corrupt page: its bits above 0x7c00, which is +inf, but for -0, which is 0) becomes +inf, as the
// CPU reads it (codec::lossy_witness_bounds), so that it can neither vanish nor lower the sum.
__device__ inline uint32_t witness_pair_or_inf(uint32_t w) {
  const uint32_t bad = __vcmpgtu2(w, 0x7c007c00u) & ~__vcmpeq2(w, 0x80008000u);
  return (w & ~bad) | (0x7c007c00u & bad);
}

// The Tier A logit bounds of a K page with the u8 witness (codec::WitnessCode::kPageScaled8:
// codes c[band][token], then the page's fp16 w_max; bound w_max (c + 1) / 256) for this lane's
// four (token, head) cells: the A fragment of (c + 1) (tokens tq, tq + 8; bands 2 hq, 2 hq + 1,
// + 8) built from the codes as exact fp16 integers (1024 + c exactly, minus 1023), times the band
// weights (wb_hi + wb_lo >= the prescaled weight) on tensor cores, then the factor that undoes the
// prescale and w_max / 256, rounded up. A w_max that reads as NaN or below 0 (a corrupt page)
// bounds nothing: +inf, as the CPU reads it (codec::lossy_witness_bounds); a NaN product stays
// NaN (witness_bound), which gives meter 1.
template <int D>
__device__ inline void coded_witness_bounds(const uint8_t* stage, int tq, int hq, const uint32_t (&wb_hi)[2],
                                            const uint32_t (&wb_lo)[2], float bound_factor, float (&c)[4]) {
  const uint8_t* codes = stage + size_t(kBlockTokens) * D;
  const __half2 k1023 = __float2half2_rn(1023.f);
  uint32_t r[4];  // r[k]: token tq + 8 (k & 1), bands 2 hq + 8 (k >> 1) and the next
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int t = tq + 8 * (k & 1), band = 2 * hq + 8 * (k >> 1);
    uint32_t w = 0x64006400u | uint32_t(codes[band * kBlockTokens + t]) | (uint32_t(codes[(band + 1) * kBlockTokens + t]) << 16);
    const __half2 v = __hsub2(*reinterpret_cast<__half2*>(&w), k1023);
    r[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
  mma16816<true>(c, r, wb_hi[0], wb_hi[1]);
  mma16816<true>(c, r, wb_lo[0], wb_lo[1]);
  const float w_max = fp16_bits_to_float(*reinterpret_cast<const uint16_t*>(codes + kBands * kBlockTokens));
  const float step = w_max >= 0.f ? w_max * (1.f / 256.f) : INFINITY;  // exact (a power of two)
#pragma unroll
  for (int k = 0; k < 4; ++k) c[k] = witness_bound(__fmul_ru(__fmul_ru(c[k], bound_factor), step));
}

// Decodes the staged page (stage st) into the tiles. False (and zero rows) for a corrupt page.
// A lossy format's raw page is the exact bf16 values, copied from the pool into the K tile or the
// value tile (the scores read it on the bf16 path); kMixed says whether the page may be one (the
// hot loop's pages never are). A dither8 K page is decoded only when raw (its scores read its
// stage: dither8_key_scores). kMeter: a dither8 V page's rho goes to tiles.rho (an fp8 page's side
// data stays in its stage).
template <int D, PageFormat F, bool kMeter, bool kMixed>
__device__ inline bool decode_page(const SplitArgs& a, bool key, const PageRef& ref, int st, int lane, int kv_head,
                                   const CtaShared<D, F>& sh, Tiles<D, F>& tiles) {
  const int t = lane >> 1, h = lane & 1;
  uint16_t* tile = key ? key_rows(tiles) : value_rows(tiles);
  const uint8_t* staged = key ? tiles.stage_k[st] : tiles.stage_v[st];
  if (ref.bytes == nullptr) {
    zero_row<D>(tile, t, h);
    return false;
  }
  if constexpr (F == PageFormat::kGaacBf16 || F == PageFormat::kGaacE5M2) {
    if (ref.raw) {
      if constexpr (F == PageFormat::kGaacBf16) decode_bf16_row<D>(ref.bytes, t, h, tile);
      else decode_fp8_row<D, false, PageFormat::kBf16>(ref.bytes, t, h, tile);
    } else {
      constexpr format::GaacElement E =
          F == PageFormat::kGaacBf16 ? format::GaacElement::kBf16 : format::GaacElement::kFp8E5M2;
      const bool ok = decode_gaac_row<D, E>(staged, staged, key ? a.p.k_escape_capacity : a.p.v_escape_capacity,
                                            lane, sh.base7[key ? 0 : 1], sh.nibble_bit3, tile);
      if (!ok) {
        zero_row<D>(tile, t, h);
        return false;
      }
    }
  } else if (kMixed && ref.raw) {
    decode_bf16_row<D>(ref.bytes, t, h, tile);
  } else if constexpr (F == PageFormat::kFp8E4M3 || F == PageFormat::kFp8E5M2) {
    decode_fp8_row<D, F == PageFormat::kFp8E4M3, F>(staged, t, h, tile);
  } else {
    if (!key) {  // (a lossy dither8 K page is never decoded: its scores read the stage)
      decode_dither8_values<D>(staged, lane, tiles);
      if constexpr (kMeter) dither8_value_rho_row<D>(staged, lane, tiles);
    }
  }
  return true;
}

// The CTAs per multiprocessor the lossy kernels are held to (__launch_bounds__: ptxas keeps their
// registers within it): at D = 128 4 for fp8 (128 registers; ptxas spills 48-80 bytes, all in the
// deferred exact-page pass and the epilogue, none in the hot loop: cuobjdump) and 3 for dither8
// (what its shared memory allows; it needs 167-168 registers, at the edge), at D = 64 5 for fp8 (held to 6, 80 registers, the kernel without the
// meter spilled 8-20 bytes once the decoders wrote swizzled tiles; with the meter 96 registers,
// no spills (ptxas, CUDA 13.0, 2026-12-01)), 4 for dither8. Unconstrained
// without the bound, ptxas's register count moved by up to 12 with small changes to the code. 0:
// no minimum (the other formats: ptxas's own choice).
template <int D, PageFormat F, bool kWithMeter>
constexpr int min_ctas_per_sm() {
  if constexpr (F == PageFormat::kGaacBf16) return D == 128 ? 4 : 0;
  else if constexpr (!FormatTraits<F>::kLossy) return 0;
  else if constexpr (D == 128) return FormatTraits<F>::kTierA ? 4 : 3;
  else if constexpr (F == PageFormat::kDither8) return 4;
  else return 5;
}

// kWithMeter: lossy formats compute the meter in the same pass (off: the same kernel without it).
// kCodedWitness: the fp8 K pages' Tier A witness is u8 codes against the page's largest bound
// (codec::WitnessCode::kPageScaled8) rather than fp16 bounds.
template <int D, PageFormat F, bool kWithMeter, bool kCodedWitness>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm<D, F, kWithMeter>()) split_kernel(SplitArgs a) {
  using Traits = FormatTraits<F>;
  constexpr bool kHalf = Traits::kHalf;
  constexpr bool kMeter = kWithMeter && (Traits::kTierA || Traits::kTierB);
  constexpr bool kCoded = kCodedWitness && kMeter && Traits::kTierA;
  constexpr int G = D / kQuantGroup;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Shared = CtaShared<D, F>;
  Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
  const PagedDecodeParams& p = a.p;

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  // A length outside the tables (or above the planned maximum) is corrupt: counted, clamped.
  const RowExtent extent = row_extent(p, b, a.error_word);
  const int64_t len = extent.len, table_block = extent.table_block;
  const int64_t n_blocks = (len + kBlockTokens - 1) / kBlockTokens;
  const int64_t per_split = a.per_split;
  const int64_t block_begin = int64_t(split) * per_split;
  const int64_t block_end = min(n_blocks, block_begin + per_split);

  // Queries (rounded to the tile element; lossy formats also to bf16 for their exact pages), codec
  // parameters, meter weights.
  for (int i = threadIdx.x; i < kMaxGroup * D; i += kThreads) {
    const int g = i / D, c = i % D;
    const float x = g < group ? p.q[(int64_t(b) * p.n_q_heads + kv_head * group + g) * D + c] : 0.f;
    sh.q[g][c] = element_bits<kHalf>(x);
    if constexpr (Traits::kLossy) (&sh.q_bf16[0][0])[shared_q_index<D>(g, c)] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  if constexpr (Traits::kGaac) {
    for (int e = threadIdx.x; e < 256; e += kThreads) sh.nibble_bit3[e] = nibble_bit3_of(uint32_t(e));
    for (int i = threadIdx.x; i < 2 * 2 * D; i += kThreads) {
      const int kv = i / (2 * D), which = (i / D) % 2, c = i % D;
      sh.base7[kv][base_index<D>(which, c)] = uint16_t(p.gaac_bases[((int64_t(kv) * p.n_kv_heads + kv_head) * 2 + which) * D + c])
                               << (F == PageFormat::kGaacE5M2 ? kGaacE5M2BaseShift : kGaacBf16BaseShift);
    }
  }
  if constexpr (Traits::kTierB) {
    load_outlier_channels(p, kv_head, a.error_word, sh.outlier_channels);
  }
  __syncthreads();
  if constexpr (kMeter || Traits::kTierB) {
    // One thread per (row, band or group): the weights of the query bounds (DESIGN.md section 4)
    // in double, nudged up by 2^-16 relative like the CPU path (online_softmax.h).
    const int g = threadIdx.x / kBands, j = threadIdx.x % kBands;
    if (g < kMaxGroup) {
      double w = 0, w_abs = 0;
      const double sm = double(p.sm_scale);
      if constexpr (Traits::kTierA) {
        const int pairs = D / 2;
        for (int pair = j * pairs / kBands; pair < (j + 1) * pairs / kBands; ++pair) {
          for (int which = 0; which < 2; ++which) {
            const int c = p.rope_half_split ? pair + which * (D / 2) : 2 * pair + which;
            const double qc = element_value<kHalf>(sh.q[g][c]);
            w += qc * qc;
          }
        }
        w = fabs(sm) * sqrt(w);
      } else if (j < G) {
        const TierBWeights tb = tier_b_weights<D, kHalf>(sh.q[g], j, sh.outlier_channels, 2 * p.n_outlier_pairs,
                                                         p.sm_scale, len, p.delta_loc);
        w = tb.w;
        w_abs = tb.w_abs;
        sh.dither_offset[g][j] = tb.offset;
      }
      sh.weight[g][j] = float(w) * (1.0f + 1.0f / 65536.0f);
      if constexpr (Traits::kTierB) sh.abs_weight[g][j] = float(w_abs) * (1.0f + 1.0f / 65536.0f);
    }
    __syncthreads();
  }

  // Fragment roles (m16n8k16 with the tokens of a page as the 16 rows and the query heads of the
  // group as the 8 columns): lane l holds tokens tq = l / 4 and tq + 8, heads 2 hq and 2 hq + 1.
  // Scores S^T = K Q^T; the output O^T = V^T P^T (rows: 16 channels at a time).
  const int tq = lane >> 2, hq = lane & 3;
  // Q^T as the B operand: channels 2 hq, 2 hq + 1 (+ 8) of head tq; dither8 (whose K fragments
  // are built in registers, dither8_key_scores): channels 4 hq + 0, 1 (+ 2, 3).
  uint32_t qb[D / 16][2];
  query_operands<D, Traits::kTierB>(sh.q, tq, hq, qb);
  // Tier A: the band weights of head tq as B operands (fp16, hi + lo >= the weight, prescaled by
  // a power of two so that the largest fits fp16), and the factor that undoes the prescale and
  // covers the float accumulation of the 16 nonnegative band products (2^-16 relative).
  uint32_t wb_hi[2] = {0, 0}, wb_lo[2] = {0, 0};
  float bound_factor = 0.f;
  if constexpr (kMeter && Traits::kTierA) {
    float big = 0.f;
    for (int i = 0; i < kMaxGroup * kBands; ++i) big = fmaxf(big, (&sh.weight[0][0])[i]);
    int e = 0;
    if (big > 0.f && isfinite(big)) frexpf(big, &e);
    const float down = ldexpf(1.f, 15 - e);
    bound_factor = ldexpf(1.f, e - 15) * (1.0f + 1.0f / 65536.0f);
    uint16_t hi[4], lo[4];
    const int bands[4] = {2 * hq, 2 * hq + 1, 2 * hq + 8, 2 * hq + 9};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float w = sh.weight[tq][bands[k]] * down;  // exact (a power of two)
      const __half h = __float2half_rn(w);
      hi[k] = __half_as_ushort(h);
      lo[k] = __half_as_ushort(__float2half_ru(w - __half2float(h)));  // w - h is exact in float
      if (!isfinite(w)) hi[k] = lo[k] = 0x7c00u;  // +inf: the meter saturates
    }
    wb_hi[0] = hi[0] | (uint32_t(hi[1]) << 16);
    wb_hi[1] = hi[2] | (uint32_t(hi[3]) << 16);
    wb_lo[0] = lo[0] | (uint32_t(lo[1]) << 16);
    wb_lo[1] = lo[2] | (uint32_t(lo[3]) << 16);
  }
  // dither8 K (dither8_key_scores): keep[kk] byte j is 0 when channel 16 kk + 4 hq + j is an
  // outlier; the dither offsets of heads 2 hq, 2 hq + 1, negated; the rows tq, tq + 8 of a staged
  // page and the generator key.
  [[maybe_unused]] uint32_t keep[D / 16];
  [[maybe_unused]] float neg_offset[G][2];
  [[maybe_unused]] int key_rows_at[2] = {0, 0};
  [[maybe_unused]] uint64_t k_dither_key = 0;
  if constexpr (Traits::kTierB) {
    outlier_keep_masks<D>(sh.outlier_channels, 2 * p.n_outlier_pairs, hq, keep);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      neg_offset[g][0] = -sh.dither_offset[2 * hq][g];
      neg_offset[g][1] = -sh.dither_offset[2 * hq + 1][g];
    }
    const int record = D + 2 * G + 4 * p.n_outlier_pairs;
    key_rows_at[0] = tq * record;
    key_rows_at[1] = (tq + 8) * record;
    k_dither_key = p.dither_keys[kv_head];
  }

  auto& tiles = sh.u.tiles[warp];
  // Running softmax state of heads 2 hq + e (e = 0, 1); l, d (the meter's sum of p (e^c - 1)) and
  // r (its value side, the sum of p rho) are this lane's partial sums (its tokens), reduced over
  // the 8 lanes of a head at the end.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, d_run[2] = {0.f, 0.f}, r_run[2] = {0.f, 0.f};
  float o_acc[D / 16][4];  // channels 16 pp + tq (+ 8), heads 2 hq, 2 hq + 1
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  const float log2_scale = p.sm_scale * kLog2e;
  unsigned int corrupt = 0;

  // This warp's blocks: first, first + kWarps, ... below block_end. A format stages page i + 1
  // once page i is decoded (dither8: its values once the scores are done, since they
  // are decoded into the dither tile). Table entries are read one page ahead of their copies.
  // A lossy format's raw pages (exact bf16: the tail, blocks that could not be encoded) are read
  // from the pool when decoded and computed on the bf16 path: scores with the bf16 query from
  // shared memory, P V with bf16 probabilities, no logit bound (c = 0) and no rho. The page
  // classes of K and V are independent. Blocks with an exact page are attended after the others,
  // so the hot loop carries none of those branches (their cost was 5-12% of the lossy kernels'
  // time when they sat in it: docs/bench/cuda_history.md).
  constexpr bool kValuesLate = Traits::kValuesLate;
  const int64_t first = block_begin + warp;
  const int n_mine = first < block_end ? int((block_end - 1 - first) / kWarps + 1) : 0;
  const int64_t table_row =
      table_block * (p.table_row_stride > 0 ? p.table_row_stride : int64_t(p.n_kv_heads) * p.table_stride) +
      int64_t(kv_head) * p.table_stride;
  auto entry_of = [&](const int32_t* table, int i) { return i < n_mine ? table[table_row + first + int64_t(i) * kWarps] : 0; };
  auto kref_of = [&](int32_t e) {
    return page_ref(p.k_pages, p.k_page_stride, p.n_k_pages, p.k_raw_pages, p.raw_page_stride, p.n_k_raw_pages, e);
  };
  auto vref_of = [&](int32_t e) {
    return page_ref(p.v_pages, p.v_page_stride, p.n_v_pages, p.v_raw_pages, p.raw_page_stride, p.n_v_raw_pages, e);
  };
  // kcur / vcur: page i; knext / vnext: page i + 1.
  PageRef kcur = kref_of(entry_of(p.k_table, 0)), vcur = vref_of(entry_of(p.v_table, 0));
  PageRef knext = kref_of(entry_of(p.k_table, 1)), vnext = vref_of(entry_of(p.v_table, 1));
  if (n_mine > 0) {
    stage_page<D, F, kMeter, kCoded>(a, true, kcur, 0, lane, tiles);
    stage_page<D, F, kMeter, kCoded>(a, false, vcur, 0, lane, tiles);
  }
  cp_async_commit();

  // One block: decode, scores, logit bounds, online softmax, the meter's sums, P V. kMixed: the
  // block may hold a lossy format's exact page (K or V), computed on the bf16 path; the hot loop
  // below instantiates it without those branches. stage_next issues the copies of the warp's next
  // block once the stage is free (after the decode; dither8: after its values).
  auto attend_block = [&](auto mixed, const PageRef& kref, const PageRef& vref, int64_t blk, int st,
                          auto&& stage_next) {
    constexpr bool kMixed = decltype(mixed)::value;
    const bool k_exact = kMixed && kref.raw, v_exact = kMixed && vref.raw;
    if constexpr (Traits::kTierB) {  // only an exact K page is decoded; a lossy one is read from its stage
      const bool k_ok = k_exact ? decode_page<D, F, kMeter, kMixed>(a, true, kref, st, lane, kv_head, sh, tiles)
                                : kref.bytes != nullptr;
      if (!k_ok) corrupt += lane == 0;
    } else if (!decode_page<D, F, kMeter, kMixed>(a, true, kref, st, lane, kv_head, sh, tiles)) {
      corrupt += lane == 0;
    }
    if constexpr (!kValuesLate)
      if (!decode_page<D, F, kMeter, kMixed>(a, false, vref, st, lane, kv_head, sh, tiles)) corrupt += lane == 0;
    // The logit bounds c of this lane's four (token, head) cells and rho of its tokens tq, tq + 8
    // (meter formats; 0 on exact and corrupt pages). fp8: from the pages' side data in the stages,
    // before they are refilled; c is the witness^T (tokens x bands) times the band weights.
    [[maybe_unused]] float c_bound[4] = {0.f, 0.f, 0.f, 0.f};
    [[maybe_unused]] float key_scale[2][G];  // dither8: the K page's scales of tokens tq, tq + 8
    [[maybe_unused]] float rho[2] = {0.f, 0.f};
    if constexpr (kMeter && Traits::kTierA) {
      if (kref.bytes != nullptr && !k_exact) {
        if constexpr (kCoded) {
          coded_witness_bounds<D>(tiles.stage_k[st], tq, hq, wb_hi, wb_lo, bound_factor, c_bound);
        } else {
          uint32_t r[4];
          ldsm_x4_trans(r, fp8_side<D>(tiles.stage_k[st]) + ((lane >> 4) * 8 + (lane & 7)) * kBlockTokens + ((lane >> 3) & 1) * 8);
          // A bound below 0 (a corrupt page; its sign bit, rare: -0 too) would lower the sum: then
          // the warp's bounds go through witness_pair_or_inf (a NaN propagates to the meter).
          if (__any_sync(0xffffffffu, ((r[0] | r[1] | r[2] | r[3]) & 0x80008000u) != 0)) {
#pragma unroll
            for (int k = 0; k < 4; ++k) r[k] = witness_pair_or_inf(r[k]);
          }
          mma16816<true>(c_bound, r, wb_hi[0], wb_hi[1]);
          mma16816<true>(c_bound, r, wb_lo[0], wb_lo[1]);
#pragma unroll
          for (int k = 0; k < 4; ++k) c_bound[k] = witness_bound(c_bound[k] * bound_factor);
        }
      }
      if (vref.bytes != nullptr && !v_exact) {
        const uint16_t* side = fp8_side<D>(tiles.stage_v[st]);
        rho[0] = fp16_bits_to_float(side[tq]);
        rho[1] = fp16_bits_to_float(side[tq + 8]);
      }
    }
    __syncwarp();
    if constexpr (!kValuesLate) stage_next();
    const uint16_t* tile_k = key_rows(tiles);
    const uint16_t* tile_v = value_rows(tiles);

    // Scores S^T[token tq (+ 8)][head 2 hq + e]: s[0], s[1] token tq; s[2], s[3] token tq + 8.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if (k_exact) {
      if constexpr (kMixed) tile_scores_shared_q<D, false, TileLayout<D, F>>(tile_k, exact_page_query(sh), lane, s);
    } else if constexpr (Traits::kTierB) {
      if (kref.bytes != nullptr) {  // corrupt: scores 0, scales 0 (c = 0)
        const uint8_t* const rows[2] = {tiles.stage_k[st] + key_rows_at[0], tiles.stage_k[st] + key_rows_at[1]};
        const uint64_t counter = uint64_t(blk) * kBlockTokens + uint64_t(tq);  // the block's position
        const uint32_t seeds[2] = {format::dither8_row_seed(k_dither_key, counter),
                                   format::dither8_row_seed(k_dither_key, counter + 8)};
        dither8_key_scores<D>(rows, seeds, hq, qb, keep, neg_offset, key_scale, s);
        for (int o = 0; o < 2 * p.n_outlier_pairs; ++o) {
          const int oc = sh.outlier_channels[o];
          if (oc < 0) continue;  // corrupt (counted)
          const float qo[2] = {element_value<kHalf>(sh.q[2 * hq][oc]), element_value<kHalf>(sh.q[2 * hq + 1][oc])};
          float xo[2];
#pragma unroll
          for (int r = 0; r < 2; ++r)
            xo[r] = __bfloat162float(__ushort_as_bfloat16(reinterpret_cast<const uint16_t*>(rows[r] + D + 2 * G)[o]));
#pragma unroll
          for (int k = 0; k < 4; ++k) s[k] += qo[k & 1] * xo[k >> 1];
        }
      } else {
#pragma unroll
        for (int g = 0; g < G; ++g) key_scale[0][g] = key_scale[1][g] = 0.f;
      }
    } else {
      tile_scores<D, kHalf, TileLayout<D, F>>(tile_k, qb, lane, s);
    }

    // dither8's logit bounds c, from the K page's scales.
    if constexpr (kMeter && Traits::kTierB) {
      if (!k_exact) tier_b_bounds<G>(sh.weight, sh.abs_weight, key_scale, hq, c_bound);  // exact page: c = 0
    }

    if constexpr (kValuesLate) {  // the values' tile is free: the values, then the next copies
      __syncwarp();
      if (!decode_page<D, F, kMeter, kMixed>(a, false, vref, st, lane, kv_head, sh, tiles)) corrupt += lane == 0;
      __syncwarp();
      stage_next();
    }

    // Online softmax (base 2) over the block, per head; tokens past the sequence are masked.
    const int64_t t0 = blk * kBlockTokens;
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = t0 + tq + 8 * (k >> 1) < len ? s[k] * log2_scale : -INFINITY;
    float prob[4], rescale[2], m_new[2];
    tile_softmax(s, m_run, l_run, prob, rescale, m_new);
    if constexpr (kMeter) {
      if constexpr (Traits::kTierB) {  // dither8's rho, from the V page decoded above
        if (vref.bytes != nullptr && !v_exact) {
          rho[0] = tiles.rho[tq];
          rho[1] = tiles.rho[tq + 8];
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float d_add = 0.f, r_add = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = 2 * j + e;
          // Every unmasked token, also one whose p underflows float: p (e^c - 1) may still be
          // large (meter_term takes log2 p for large c). A masked token's bound and rho may be
          // anything (rows past the end): selected away, not branched around.
          const bool live = s[k] != -INFINITY;
          const float term = meter_term(prob[k], c_bound[k], s[k] - m_new[e]);
          d_add += live ? term : 0.f;
          r_add = live ? fmaf(prob[k], rho[j], r_add) : r_add;  // one rounding, as before the select
        }
        d_run[e] = d_run[e] * rescale[e] + d_add;
        r_run[e] = r_run[e] * rescale[e] + r_add;
      }
    }
    if (v_exact) {
      if constexpr (kMixed) tile_pv<D, false, TileLayout<D, F>>(tile_v, prob, rescale, lane, o_acc);
    } else {
      tile_pv<D, kHalf, TileLayout<D, F>>(tile_v, prob, rescale, lane, o_acc);
    }
    __syncwarp();
  };

  // The hot loop: every block whose pages are of the format's class (and, for GAAC, its raw
  // fallbacks). A lossy format's block with an exact page is left for the pass after it.
  int n_deferred = 0;
  for (int i = 0; i < n_mine; ++i) {
    const int st = 0;
    const int64_t blk = first + int64_t(i) * kWarps;
    const int32_t next_k = entry_of(p.k_table, i + 2), next_v = entry_of(p.v_table, i + 2);
    cp_async_wait<0>();
    __syncwarp();
    const PageRef kref = kcur, vref = vcur;
    kcur = knext;
    vcur = vnext;
    knext = kref_of(next_k);
    vnext = vref_of(next_v);
    auto stage_next = [&] {  // page i + 1 into the free stage
      if (i + 1 < n_mine) {
        stage_page<D, F, kMeter, kCoded>(a, true, kcur, 0, lane, tiles);
        stage_page<D, F, kMeter, kCoded>(a, false, vcur, 0, lane, tiles);
      }
      cp_async_commit();
    };
    if constexpr (Traits::kLossy) {
      if (kref.raw || vref.raw) {
        ++n_deferred;
        __syncwarp();
        stage_next();
        continue;
      }
    }
    attend_block(std::false_type{}, kref, vref, blk, st, stage_next);
  }
  // The blocks with an exact page (the tail, blocks the encoder refused): rare, so each is staged
  // and used in turn, off the hot loop's code.
  if constexpr (Traits::kLossy) {
    if (n_deferred > 0) {
      cp_async_wait<0>();
      __syncwarp();
      for (int i = 0; i < n_mine; ++i) {
        const PageRef kref = kref_of(entry_of(p.k_table, i)), vref = vref_of(entry_of(p.v_table, i));
        if (!kref.raw && !vref.raw) continue;
        stage_page<D, F, kMeter, kCoded>(a, true, kref, 0, lane, tiles);
        stage_page<D, F, kMeter, kCoded>(a, false, vref, 0, lane, tiles);
        cp_async_commit();
        cp_async_wait<0>();
        __syncwarp();
        attend_block(std::true_type{}, kref, vref, first + int64_t(i) * kWarps, 0, [] {});
      }
    }
  }
  cp_async_wait<0>();
  if (corrupt != 0 && lane == 0) atomicAdd(a.error_word, corrupt);

  __syncthreads();  // the tiles are reused as the merge area
  write_split_partials<D, kWarps>(sh.u.merge, warp, lane, m_run, l_run, d_run, r_run, o_acc, group,
                                  int64_t(b) * p.n_q_heads + int64_t(kv_head) * group, a.n_splits, split, a.part_mldr,
                                  a.part_o);
}

CudaStatus error(const std::string& message) {
  return CudaStatus{false, StatusCode::kInvalidArgument, "cuda decode: " + message};
}
CudaStatus internal(const std::string& message) {
  return CudaStatus{false, StatusCode::kInternal, "cuda decode: " + message};
}
CudaStatus unsupported(const std::string& message) {
  return CudaStatus{false, StatusCode::kUnsupported, "cuda decode: " + message};
}

// The workspace: the split partials (m, l, d, r per row and split), the partial outputs, the
// error word, the split counters of the fragment kernel (one per sequence and KV head).
struct WorkspaceLayout {
  size_t mldr = 0, o = 0, error_word = 0, counters = 0, total = 0;
};

WorkspaceLayout layout_of(const PagedDecodeParams& p, int n_splits) {
  WorkspaceLayout w;
  const size_t parts = size_t(p.batch) * size_t(p.n_q_heads) * size_t(n_splits);
  w.mldr = 0;
  w.o = (parts * kSplitPartials * sizeof(float) + 255) / 256 * 256;
  w.error_word = w.o + (parts * size_t(p.head_dim) * sizeof(float) + 255) / 256 * 256;
  w.counters = w.error_word + 256;
  w.total = w.counters + (size_t(std::max(p.batch, 0)) * size_t(std::max(p.n_kv_heads, 0)) * sizeof(uint32_t) + 255) / 256 * 256;
  return w;
}

// The word a launch counts corrupt entries in: the caller's, else the workspace's.
unsigned int* error_word_of(const PagedDecodeParams& p, const WorkspaceLayout& w) {
  return p.error_word != nullptr ? reinterpret_cast<unsigned int*>(p.error_word)
                                 : reinterpret_cast<unsigned int*>(static_cast<char*>(p.workspace) + w.error_word);
}

template <int D, PageFormat F, bool kWithMeter, bool kCodedWitness = false>
CudaStatus launch(const PagedDecodeParams& p, int n_splits) {
  const WorkspaceLayout w = layout_of(p, n_splits);
  char* base = static_cast<char*>(p.workspace);
  const int64_t max_blocks = (p.max_seq_len + kBlockTokens - 1) / kBlockTokens;
  const int64_t per_split = p.split_blocks > 0 ? p.split_blocks : (max_blocks + n_splits - 1) / n_splits;
  SplitArgs a{p, n_splits, per_split, reinterpret_cast<float*>(base + w.mldr), reinterpret_cast<float*>(base + w.o),
              error_word_of(p, w)};
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const size_t smem = sizeof(CtaShared<D, F>);
  static bool configured = false;  // per instantiation
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(split_kernel<D, F, kWithMeter, kCodedWitness>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess)
      return CudaStatus{false, StatusCode::kInternal, std::string("cuda decode: cannot set the shared memory size: ") + cudaGetErrorString(e)};
    configured = true;
  }
  split_kernel<D, F, kWithMeter, kCodedWitness><<<dim3(n_splits, p.n_kv_heads, p.batch), kThreads, smem, stream>>>(a);
  tile::merge_splits_kernel<D><<<p.batch * p.n_q_heads, tile::kMergeThreads, 0, stream>>>(p.out, p.meter, p.a_minus_1, p.value_rho,
                                                                          n_splits, a.part_mldr, a.part_o);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return internal(std::string("kernel launch failed: ") + cudaGetErrorString(e));
  return {};
}

// The meter is on when any of its outputs is asked for.
bool meter_on(const PagedDecodeParams& p) {
  return p.meter != nullptr || p.a_minus_1 != nullptr || p.value_rho != nullptr;
}

// Whether the launch reads the fp8 K pages' u8 witness (only the meter reads a witness).
bool coded_witness(const PagedDecodeParams& p) {
  return meter_on(p) && p.witness == codec::WitnessCode::kPageScaled8 &&
         (p.format == PageFormat::kFp8E4M3 || p.format == PageFormat::kFp8E5M2);
}

template <int D, PageFormat F>
CudaStatus launch_metered(const PagedDecodeParams& p, int n_splits) {
  if constexpr (FormatTraits<F>::kTierA)
    if (coded_witness(p)) return launch<D, F, true, true>(p, n_splits);
  if (meter_on(p)) return launch<D, F, true>(p, n_splits);
  return launch<D, F, false>(p, n_splits);
}

CudaStatus launch_fragments(const PagedDecodeParams& p, int n_splits) {
  const WorkspaceLayout w = layout_of(p, n_splits);
  char* base = static_cast<char*>(p.workspace);
  const int64_t max_blocks = (p.max_seq_len + kBlockTokens - 1) / kBlockTokens;
  FragmentSplitArgs a;
  a.p = p;
  a.n_splits = n_splits;
  a.per_split = p.split_blocks > 0 ? p.split_blocks : (max_blocks + n_splits - 1) / n_splits;
  a.part_mldr = reinterpret_cast<float*>(base + w.mldr);
  a.part_o = reinterpret_cast<float*>(base + w.o);
  a.split_counters = reinterpret_cast<unsigned int*>(base + w.counters);
  a.error_word = error_word_of(p, w);
  return launch_fragment_split(a);
}

template <int D>
CudaStatus launch_format(const PagedDecodeParams& p, int n_splits) {
  switch (p.format) {
    case PageFormat::kBf16Fragments:
    case PageFormat::kFp8Fragments:
    case PageFormat::kDither8Fragments:
    case PageFormat::kInt8Fragments:
    case PageFormat::kGaacFragments:
    case PageFormat::kBf16: return launch_fragments(p, n_splits);
    case PageFormat::kGaacBf16: return launch<D, PageFormat::kGaacBf16, false>(p, n_splits);
    case PageFormat::kGaacE5M2: return launch<D, PageFormat::kGaacE5M2, false>(p, n_splits);
    case PageFormat::kFp8E4M3: return launch_metered<D, PageFormat::kFp8E4M3>(p, n_splits);
    case PageFormat::kFp8E5M2: return launch_metered<D, PageFormat::kFp8E5M2>(p, n_splits);
    case PageFormat::kDither8: return launch_metered<D, PageFormat::kDither8>(p, n_splits);
  }
  return error("unknown page format");
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

const char* page_format_name(PageFormat f) {
  switch (f) {
    case PageFormat::kBf16: return "bf16";
    case PageFormat::kBf16Fragments: return "bf16-fragments";
    case PageFormat::kFp8Fragments: return "fp8-e4m3-fragments";
    case PageFormat::kDither8Fragments: return "dither8-fragments";
    case PageFormat::kGaacFragments: return "gaac-fragments";
    case PageFormat::kInt8Fragments: return "int8-fragments";
    case PageFormat::kGaacBf16: return "gaac";
    case PageFormat::kGaacE5M2: return "gaac-e5m2";
    case PageFormat::kFp8E4M3: return "fp8-e4m3";
    case PageFormat::kFp8E5M2: return "fp8-e5m2";
    case PageFormat::kDither8: return "dither8";
  }
  return "unknown";
}

namespace {

// The split plan and the workspace it needs: what check() ends with, and all that
// reset_error_word and read_error_word rely on (n_splits 0 means choose_splits).
CudaStatus check_workspace(const PagedDecodeParams& p) {
  if (p.n_splits < 0 || p.n_splits > 65535) return error("n_splits must be in [0, 65535]");
  if (p.split_blocks < 0) return error("split_blocks must be >= 0");
  if (p.n_splits > 0 && p.split_blocks > 0) return error("set n_splits or split_blocks, not both");
  if (p.split_blocks > 0 && planned_splits(p) > 65535)
    return error("split_blocks " + std::to_string(p.split_blocks) + " cuts max_seq_len into more than 65535 splits");
  const int splits = planned_splits(p);
  if (!p.workspace || p.workspace_size < layout_of(p, splits).total)
    return error("workspace too small (" + std::to_string(p.workspace_size) + " bytes, needs " +
                 std::to_string(layout_of(p, splits).total) + ")");
  if (!aligned16(p.workspace)) return error("the workspace is misaligned");
  return {};
}

}  // namespace

CudaStatus check(const PagedDecodeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128)
    return unsupported("head_dim " + std::to_string(p.head_dim) + " is unsupported (64 or 128)");
  if (p.block_tokens != kBlockTokens)
    return unsupported("block_tokens " + std::to_string(p.block_tokens) + " is unsupported (16)");
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0 || p.n_q_heads % p.n_kv_heads != 0)
    return error("GQA ratio " + std::to_string(p.n_q_heads) + "/" + std::to_string(p.n_kv_heads) + " is not integral");
  if (p.n_q_heads / p.n_kv_heads > kMaxGroup)
    return unsupported("GQA ratio " + std::to_string(p.n_q_heads / p.n_kv_heads) + " is unsupported (at most 8 query heads per KV head)");
  if (p.batch < 1 || p.batch > 65535) return error("batch must be in [1, 65535]");
  if (p.n_kv_heads > 65535) return error("n_kv_heads must be at most 65535");
  if (int64_t(p.batch) * p.n_q_heads > INT32_MAX)  // the merge kernel's grid, one CTA per row
    return unsupported("batch x n_q_heads " + std::to_string(int64_t(p.batch) * p.n_q_heads) + " is past 2^31 - 1");
  if (!(p.sm_scale > 0.f) || !std::isfinite(p.sm_scale)) return error("sm_scale must be positive and finite");
  if (p.table_stride > INT32_MAX)  // block indices; table_stride * 16 must not overflow either
    return error("table_stride " + std::to_string(p.table_stride) + " is past 2^31 - 1 blocks");
  if (p.table_stride < 1 || p.max_seq_len < 1 || p.max_seq_len > p.table_stride * kBlockTokens)
    return error("max_seq_len " + std::to_string(p.max_seq_len) + " is outside the block tables (" +
                 std::to_string(p.table_stride * kBlockTokens) + " tokens)");
  // A pool may be absent while it has no pages (a GAAC or lossy cache before its first block is
  // finalized: every table entry then names a raw page, and any other counts as corrupt).
  if ((!p.k_pages && p.n_k_pages > 0) || (!p.v_pages && p.n_v_pages > 0) || !p.k_table || !p.v_table ||
      !p.seq_lens || !p.q || !p.out)
    return error("a device pointer is null");
  if (p.n_k_pages < 0 || p.n_v_pages < 0) return error("negative page count");
  if (p.table_row_stride < 0) return error("table_row_stride must be >= 0");
  if (p.table_rows != nullptr && p.n_table_rows < 1) return error("table_rows needs n_table_rows >= 1");
  if (!aligned16(p.k_pages) || !aligned16(p.v_pages) || p.k_page_stride % 16 != 0 || p.v_page_stride % 16 != 0)
    return error("the page pool is misaligned (base and page stride must be multiples of 16 bytes)");
  const bool gaac = p.format == PageFormat::kGaacBf16 || p.format == PageFormat::kGaacE5M2;
  size_t need_k = 0, need_v = 0;
  const int D = p.head_dim, T = kBlockTokens;
  if (gaac) {
    // A slot is staged whole into shared memory sized for the largest escape area a page can
    // need (every group raw): a capacity past it would overrun the stage.
    const int64_t most = int64_t(format::gaac_page_max_escape_bytes(
        p.format == PageFormat::kGaacBf16 ? format::GaacElement::kBf16 : format::GaacElement::kFp8E5M2, T, D));
    if (p.k_escape_capacity < 0 || p.v_escape_capacity < 0) return error("negative escape capacity");
    if (p.k_escape_capacity > most || p.v_escape_capacity > most)
      return error("escape capacity " + std::to_string(std::max(p.k_escape_capacity, p.v_escape_capacity)) +
                   " bytes is more than a " + page_format_name(p.format) + " page can use (" + std::to_string(most) +
                   " at head_dim " + std::to_string(D) + ")");
  }
  switch (p.format) {
    case PageFormat::kBf16:
    case PageFormat::kBf16Fragments: need_k = need_v = size_t(T) * D * 2; break;
    case PageFormat::kGaacFragments: need_k = need_v = size_t(format::fragment::gaac_page_bytes(D)); break;
    case PageFormat::kFp8Fragments:
      need_k = size_t(T) * D;
      need_v = size_t(T) * D + size_t(T) * 2;
      break;
    case PageFormat::kGaacBf16:
      need_k = format::gaac_slot_bytes(format::GaacElement::kBf16, T, D, size_t(p.k_escape_capacity));
      need_v = format::gaac_slot_bytes(format::GaacElement::kBf16, T, D, size_t(p.v_escape_capacity));
      break;
    case PageFormat::kGaacE5M2:
      need_k = format::gaac_slot_bytes(format::GaacElement::kFp8E5M2, T, D, size_t(p.k_escape_capacity));
      need_v = format::gaac_slot_bytes(format::GaacElement::kFp8E5M2, T, D, size_t(p.v_escape_capacity));
      break;
    case PageFormat::kFp8E4M3:
    case PageFormat::kFp8E5M2:
      // The u8 witness: codes and w_max, staged as whole 16-byte chunks (what the kernel reads).
      need_k = size_t(T) * D + (p.witness == codec::WitnessCode::kPageScaled8 ? (size_t(kBands) * T + 2 + 15) / 16 * 16
                                                                              : size_t(kBands) * T * 2);
      need_v = size_t(T) * D + size_t(T) * 2;
      break;
    case PageFormat::kDither8:
    case PageFormat::kDither8Fragments:  // the same bytes, moved
    case PageFormat::kInt8Fragments:     // dither8-fragments' bytes
      need_k = size_t(T) * (D + 2 * (D / kQuantGroup) + 4 * p.n_outlier_pairs);
      need_v = size_t(T) * (D + 2 * (D / kQuantGroup));
      break;
    default: return error("unknown page format");
  }
  if (p.k_page_stride < int64_t(need_k) || p.v_page_stride < int64_t(need_v))  // signed: a negative stride too
    return error(std::string("page stride too small for ") + page_format_name(p.format) + " pages (K needs " +
                 std::to_string(need_k) + " bytes, V " + std::to_string(need_v) + ")");
  const bool gaac_fragments = p.format == PageFormat::kGaacFragments;
  if ((gaac || gaac_fragments) && !p.gaac_bases) return error("GAAC pages need their bases");
  if (gaac || gaac_fragments || page_format_metered(p.format) || p.format == PageFormat::kInt8Fragments) {
    // Raw pages: GAAC pages that did not fit their slot ([T][D] of the element), a lossy format's
    // exact pages ([T][D] bf16). A pool with pages must be there and aligned.
    const size_t raw = size_t(T) * D * (p.format == PageFormat::kGaacE5M2 ? 1 : 2);
    if (p.n_k_raw_pages < 0 || p.n_v_raw_pages < 0) return error("negative raw page count");
    if ((p.n_k_raw_pages > 0 && (!p.k_raw_pages || !aligned16(p.k_raw_pages))) ||
        (p.n_v_raw_pages > 0 && (!p.v_raw_pages || !aligned16(p.v_raw_pages))) ||
        ((p.n_k_raw_pages > 0 || p.n_v_raw_pages > 0) &&
         (p.raw_page_stride % 16 != 0 || p.raw_page_stride < int64_t(raw))))
      return error(std::string("raw ") + page_format_name(p.format) +
                   " pages need 16-byte-aligned pools with a stride of at least " + std::to_string(raw) +
                   " bytes, a multiple of 16");
  }
  // The exponent witness is no bytes: the bound is made from the codes of fp8-e4m3 fragment-major
  // pages (kFp8Fragments, whose kernel reads no witness code at all); another format has nothing
  // to make it from.
  if (p.witness == codec::WitnessCode::kExponent && p.format != PageFormat::kFp8Fragments)
    return error(std::string("the exponent witness is made from the codes of ") +
                 page_format_name(PageFormat::kFp8Fragments) + " pages, not " + page_format_name(p.format));
  if (p.witness != codec::WitnessCode::kFp16 && p.witness != codec::WitnessCode::kPageScaled8 &&
      p.witness != codec::WitnessCode::kExponent)
    return error("witness code " + std::to_string(int(p.witness)) + " is unknown (fp16, u8 or exponent)");
  if (p.format == PageFormat::kInt8Fragments && meter_on(p))
    return error(std::string(page_format_name(p.format)) + " pages carry no certificate: a launch with a meter is refused");
  if (page_format_dither8_bytes(p.format)) {
    const bool dithered = p.format != PageFormat::kInt8Fragments;
    if (dithered && !p.dither_keys) return error("dither8 pages need their generator keys");
    if (p.n_outlier_pairs < 0 || p.n_outlier_pairs > kMaxDeviceOutlierPairs)
      return unsupported("n_outlier_pairs " + std::to_string(p.n_outlier_pairs) + " is unsupported (at most " +
                   std::to_string(kMaxDeviceOutlierPairs) + ")");
    if (p.n_outlier_pairs > 0 && !p.outlier_channels) return error("outlier channels are missing");
    if (dithered && !(p.delta_loc > 0 && p.delta_loc < 1)) return error("delta_loc must be in (0, 1)");
  }
  return check_workspace(p);
}

namespace {

template <int D, PageFormat F, bool kWithMeter, bool kCodedWitness = false>
int resident_ctas() {
  // Asked once per kernel instantiation: every launch plans its splits with it.
  static const int resident = [] {
    int n = 0;
    const size_t smem = sizeof(CtaShared<D, F>);
    if (cudaFuncSetAttribute(split_kernel<D, F, kWithMeter, kCodedWitness>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, split_kernel<D, F, kWithMeter, kCodedWitness>, kThreads, smem) !=
            cudaSuccess) {
      cudaGetLastError();
      return 2;
    }
    return std::max(1, n);
  }();
  return resident;
}

template <int D>
int resident_ctas_of(const PagedDecodeParams& p) {
  const bool meter = meter_on(p);
  switch (p.format) {
    case PageFormat::kBf16Fragments:
    case PageFormat::kFp8Fragments:
    case PageFormat::kDither8Fragments:
    case PageFormat::kInt8Fragments:
    case PageFormat::kGaacFragments:
    case PageFormat::kBf16: return fragment_resident_ctas(p);
    case PageFormat::kGaacBf16: return resident_ctas<D, PageFormat::kGaacBf16, false>();
    case PageFormat::kGaacE5M2: return resident_ctas<D, PageFormat::kGaacE5M2, false>();
    case PageFormat::kFp8E4M3:
      if (coded_witness(p)) return resident_ctas<D, PageFormat::kFp8E4M3, true, true>();
      return meter ? resident_ctas<D, PageFormat::kFp8E4M3, true>() : resident_ctas<D, PageFormat::kFp8E4M3, false>();
    case PageFormat::kFp8E5M2:
      if (coded_witness(p)) return resident_ctas<D, PageFormat::kFp8E5M2, true, true>();
      return meter ? resident_ctas<D, PageFormat::kFp8E5M2, true>() : resident_ctas<D, PageFormat::kFp8E5M2, false>();
    case PageFormat::kDither8:
      return meter ? resident_ctas<D, PageFormat::kDither8, true>() : resident_ctas<D, PageFormat::kDither8, false>();
  }
  return 2;
}

// CTAs of the split kernel one multiprocessor holds at once (registers, shared memory).
int resident_ctas_per_sm(const PagedDecodeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) return 2;
  return p.head_dim == 64 ? resident_ctas_of<64>(p) : resident_ctas_of<128>(p);
}

}  // namespace

int choose_splits(const PagedDecodeParams& p) {
  int sms = 132;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks = (p.max_seq_len + kBlockTokens - 1) / kBlockTokens;
  const int64_t ctas_per_split = int64_t(std::max(1, p.batch)) * std::max(1, p.n_kv_heads);
  // One full wave of resident CTAs (a second, partial wave would leave multiprocessors idle); the
  // fragment kernel's wave per page class (fragment_planned_ctas_per_sm).
  const int64_t resident =
      int64_t(sms) * (page_format_bulk_copied(p.format) ? fragment_planned_ctas_per_sm(p) : resident_ctas_per_sm(p));
  int64_t splits = std::max<int64_t>(1, resident / ctas_per_split);
  if (ctas_per_split >= resident) splits = 1;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, blocks / (2 * kWarps)));
  return int(std::max<int64_t>(1, std::min<int64_t>(splits, 65535)));
}

int planned_splits(const PagedDecodeParams& p) {
  if (p.n_splits > 0) return p.n_splits;
  if (p.split_blocks > 0) {
    const int64_t blocks = (std::max<int64_t>(p.max_seq_len, 1) + kBlockTokens - 1) / kBlockTokens;
    return int(std::min<int64_t>((blocks + p.split_blocks - 1) / p.split_blocks, INT32_MAX));
  }
  return choose_splits(p);
}

size_t workspace_bytes(const PagedDecodeParams& p) {
  return layout_of(p, planned_splits(p)).total;
}

CudaStatus paged_decode(const PagedDecodeParams& p) {
  const CudaStatus s = check(p);
  if (!s.ok) return s;
  const int splits = planned_splits(p);
  return p.head_dim == 64 ? launch_format<64>(p, splits) : launch_format<128>(p, splits);
}

CudaStatus reset_error_word(const PagedDecodeParams& p) {
  if (CudaStatus s = check_workspace(p); !s.ok) return s;
  const int splits = planned_splits(p);
  const WorkspaceLayout w = layout_of(p, splits);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  cudaError_t e = cudaMemsetAsync(error_word_of(p, w), 0, sizeof(uint32_t), stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(static_cast<char*>(p.workspace) + w.counters, 0, w.total - w.counters, stream);
  if (e != cudaSuccess) return internal(std::string("resetting the error word failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus read_error_word(const PagedDecodeParams& p, uint32_t* corrupt) {
  if (corrupt == nullptr) return error("read_error_word needs a place for the count");
  if (CudaStatus s = check_workspace(p); !s.ok) return s;
  const int splits = planned_splits(p);
  const WorkspaceLayout w = layout_of(p, splits);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  cudaError_t e = cudaMemcpyAsync(corrupt, error_word_of(p, w), sizeof(uint32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return internal(std::string("reading the error word failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus copy_error_word_async(const PagedDecodeParams& p, uint32_t* host) {
  if (host == nullptr) return error("copy_error_word_async needs a place for the count");
  if (CudaStatus s = check_workspace(p); !s.ok) return s;
  const int splits = planned_splits(p);
  const WorkspaceLayout w = layout_of(p, splits);
  const cudaError_t e = cudaMemcpyAsync(host, error_word_of(p, w), sizeof(uint32_t), cudaMemcpyDeviceToHost,
                                        static_cast<cudaStream_t>(p.stream));
  if (e != cudaSuccess) return internal(std::string("copying the error word failed: ") + cudaGetErrorString(e));
  return {};
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace certkv::attention::cuda
