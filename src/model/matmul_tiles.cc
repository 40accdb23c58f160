#include "model/matmul_tiles.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"

// The tile path is compiled on every x86-64 build, in a target region of its own (AMX-TILE,
// AMX-INT8, AVX-512 with VNNI), and runs where matmul_tiles_available() finds the tiles at run
// time, so a build without -march flags has it too. What runs before that check is compiled for
// the build's own target.
#if defined(__x86_64__)
#define CERTKV_MATMUL_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

#include "core/cpu_features.h"
#include "core/target_region.h"
#include "core/x86_simd.h"
#endif

namespace certkv::model {
namespace {

using format::GgmlType;

constexpr int kRows = 16;  // output rows per record (the tile's columns)

constexpr bool has_min(GgmlType type) { return type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1; }
constexpr bool fifth_bit(GgmlType type) { return type == GgmlType::kQ5_0 || type == GgmlType::kQ5_1; }
constexpr bool k_quant(GgmlType type) { return type == GgmlType::kQ4_K || type == GgmlType::kQ5_K; }
// Elements of one record's block: 32, or a K-quant super-block of 256.
constexpr int64_t block_elements(GgmlType type) { return k_quant(type) ? 256 : 32; }
// A K-quant record (one super-block of the 16 rows): 4 x 512 bytes of nibbles, sub-blocks 2p and
// 2p + 1 in pair p (byte 64 r + 4 n + j = byte 32 p + 4 r + j of row n's codes); Q5_K then 8 x 64
// bytes of fifth bits (sub-block j's B tile bytes); then the sub-blocks' 6-bit scales sc [8][16]
// and mins m [8][16] as bytes, d and dmin of the 16 rows as floats.
constexpr size_t k_scales_at(GgmlType type) { return 2048 + (type == GgmlType::kQ5_K ? 512 : 0); }
// What the ggml codes have taken away to be the signed c of quantized_dot.h: Q4_0 8, Q5_0 16.
constexpr int code_offset(GgmlType type) {
  return type == GgmlType::kQ4_0 ? 8 : type == GgmlType::kQ5_0 ? 16 : 0;
}
// Bytes of one record: codes (Q5: then the fifth bits), then d (and m) of the 16 rows as floats.
constexpr size_t code_bytes(GgmlType type) {
  return type == GgmlType::kQ8_0 ? 512 : fifth_bit(type) ? 256 + 64 : 256;
}
constexpr size_t record_bytes(GgmlType type) {
  return k_quant(type) ? k_scales_at(type) + 256 + 128 : code_bytes(type) + 64 * (has_min(type) ? 2 : 1);
}

void check_tileable(const WeightMatrix& w) {
  if (!matmul_tiles_support(w.type))
    fail(StatusCode::kUnsupported, std::string("matmul tiles: no tile layout for ") + ggml_type_name(w.type));
  const int64_t be = block_elements(w.type);
  if (w.n_in <= 0 || w.n_in % be != 0 || w.n_out < 0)
    fail(StatusCode::kInvalidArgument, "matmul tiles: " + std::to_string(w.n_out) + " rows of " +
                                           std::to_string(w.n_in) + " inputs (need a multiple of " +
                                           std::to_string(be) + ")");
}

float fp16_field(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return format::fp16_to_float(bits);
}

}  // namespace

bool matmul_tiles_support(GgmlType type) {
  return type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1 || type == GgmlType::kQ5_0 ||
         type == GgmlType::kQ5_1 || type == GgmlType::kQ8_0 || k_quant(type);
}

bool matmul_tiles_fit(const WeightMatrix& w) {
  return matmul_tiles_support(w.type) && w.n_in > 0 && w.n_in % block_elements(w.type) == 0 && w.n_out > 0;
}

size_t matmul_tiles_bytes(const WeightMatrix& w) {
  check_tileable(w);
  return size_t((w.n_out + kRows - 1) / kRows) * size_t(w.n_in / block_elements(w.type)) * record_bytes(w.type);
}

namespace {

// tile_weights for Q4_K and Q5_K (the layout at k_scales_at).
void tile_k_quant(const WeightMatrix& w, uint8_t* out) {
  const int64_t nsb = w.n_in / 256;
  const size_t block_bytes = ggml_block_bytes(w.type), record = record_bytes(w.type);
  const bool q5 = w.type == GgmlType::kQ5_K;
  const size_t scales_at = k_scales_at(w.type);
  for (int64_t o = 0; o < w.n_out; ++o) {
    const int64_t g = o / kRows, n = o % kRows;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* block = w.data + size_t(o) * w.row_bytes + size_t(sb) * block_bytes;
      uint8_t* rec = out + (size_t(g) * size_t(nsb) + size_t(sb)) * record;
      const uint8_t* qh = block + 16;
      const uint8_t* qs = block + (q5 ? 48 : 16);
      for (int p = 0; p < 4; ++p)
        for (int r = 0; r < 8; ++r) std::memcpy(rec + 512 * p + 64 * r + 4 * n, qs + 32 * p + 4 * r, 4);
      if (q5) {
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) {
            if (((qh[l] >> j) & 1) == 0) continue;
            const int byte = 64 * (l / 4) + 4 * int(n) + l % 4;
            rec[2048 + 64 * j + byte / 8] |= uint8_t(1u << (byte % 8));
          }
      }
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        k_quant_scale_min(j, block + 4, &sc, &m);
        rec[scales_at + 16 * j + n] = sc;
        rec[scales_at + 128 + 16 * j + n] = m;
      }
      const float d = fp16_field(block), dmin = fp16_field(block + 2);
      std::memcpy(rec + scales_at + 256 + 4 * n, &d, 4);
      std::memcpy(rec + scales_at + 320 + 4 * n, &dmin, 4);
    }
  }
}

}  // namespace

void tile_weights(const WeightMatrix& w, uint8_t* out) {
  const size_t bytes = matmul_tiles_bytes(w);
  std::memset(out, 0, bytes);
  if (k_quant(w.type)) return tile_k_quant(w, out);
  const int64_t nb = w.n_in / 32;
  const size_t block_bytes = ggml_block_bytes(w.type);
  const bool q8 = w.type == GgmlType::kQ8_0, min = has_min(w.type), q5 = fifth_bit(w.type);
  const size_t qh_at = min ? 4 : 2;           // after d (and m), fp16 each
  const size_t qs_at = qh_at + (q5 ? 4 : 0);  // Q5: after the 32 fifth bits
  const size_t codes = code_bytes(w.type);
  for (int64_t o = 0; o < w.n_out; ++o) {
    const int64_t g = o / kRows, n = o % kRows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = w.data + size_t(o) * w.row_bytes + size_t(b) * block_bytes;
      uint8_t* rec = out + (size_t(g) * size_t(nb) + size_t(b)) * record_bytes(w.type);
      const int dwords = q8 ? 8 : 4;  // Q8_0: 32 codes; Q4, Q5: 16 bytes of nibble pairs
      for (int r = 0; r < dwords; ++r) std::memcpy(rec + 64 * r + 4 * n, block + qs_at + 4 * r, 4);
      if (q5) {
        // Bit p of the 512 after the nibbles: the fifth bit of byte p of the B tile (row p / 64,
        // row n = p % 64 / 4, element 4 (p / 64) + p % 4).
        const uint32_t qh = uint32_t(block[qh_at]) | uint32_t(block[qh_at + 1]) << 8 |
                            uint32_t(block[qh_at + 2]) << 16 | uint32_t(block[qh_at + 3]) << 24;
        for (int k = 0; k < 32; ++k) {
          if (((qh >> k) & 1u) == 0) continue;
          const int p = 64 * (k / 4) + 4 * int(n) + k % 4;
          rec[256 + p / 8] |= uint8_t(1u << (p % 8));
        }
      }
      const float d = fp16_field(block);
      std::memcpy(rec + codes + 4 * n, &d, 4);
      if (min) {
        const float m = fp16_field(block + 2);
        std::memcpy(rec + codes + 64 + 4 * n, &m, 4);
      }
    }
  }
}

#if defined(CERTKV_MATMUL_TILES)

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // the tile data

// __builtin_cpu_supports of the ISA names detect_tiles asks for (the builtin takes literals only).
bool cpu_supports(std::string_view isa) {
  if (isa == "avx512f") return __builtin_cpu_supports("avx512f");
  if (isa == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (isa == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (isa == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (isa == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (isa == "avx2") return __builtin_cpu_supports("avx2");
  if (isa == "fma") return __builtin_cpu_supports("fma");
  return false;
}

bool detect_tiles() {
  const char* env = std::getenv("CERTKV_MATMUL_TILES");
  if (env && std::strcmp(env, "0") == 0) return false;
  // Every instruction set the tile region enables.
  if (!cpu_has_amx_int8() || !cpu_has_f16c()) return false;
  for (const char* isa : {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma"})
    if (!cpu_supports(isa)) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool matmul_tiles_available() {
  static const bool available = detect_tiles();
  return available;
}

}  // namespace certkv::model

CERTKV_TARGET_PUSH("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define CERTKV_ACTIVATION_BLOCKS_AVX512 1
#include "model/activation_blocks_x86.h"

namespace certkv::model {
namespace {

// The tile configuration of palette 1 (64 bytes, as ldtilecfg reads it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 and 3 the int32 sums (C) of an even and an odd block, 1 and 4 their activations (A, M
// token rows of 32 codes), 2 and 5 their weights (B, 8 rows of 16 x 4 codes). Loaded once per
// thread and number of tokens M.
void configure_tiles(int m) {
  thread_local int configured = 0;
  if (configured == m) return;
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = uint8_t(m), c.colsb[t] = 64;
  for (int t : {1, 4}) c.rows[t] = uint8_t(m), c.colsb[t] = 32;
  for (int t : {2, 5}) c.rows[t] = 8, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  configured = m;
}

// The quantized activations of one call for one block length: codes [n_tokens][n_in], and per
// token its blocks' d and s = d * sum(q) ([n_tokens][nb] each; s for blocks of 32 only), exactly
// as quantize_activation_ref makes them.
struct TiledInput {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  const int32_t* sum = nullptr;  // [n_tokens][n_in / 32]: sum(q) of each 32 codes, exact
  int64_t n_in = 0, nb = 0;      // nb: blocks of 32 (or super-blocks of 256) a row
};

using detail::all_finite;
using detail::quantize_16;
using detail::quantize_block32;

// quantize_activation_ref's step for a K-quant super-block of 256: one d, the codes, and the
// exact sum of each 32 codes (a block with an Inf or NaN: d NaN, codes and sums 0).
inline void quantize_block256(const float* x, int8_t* q, float* d, int32_t* sum32) {
  __m512 v[16];
  bool finite = true;
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < 16; ++i) {
    v[i] = _mm512_loadu_ps(x + 16 * i);
    finite = finite && all_finite(v[i]);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  if (!finite) {
    std::memset(q, 0, 256);
    *d = __builtin_nanf("");
    for (int j = 0; j < 8; ++j) sum32[j] = 0;
    return;
  }
  *d = _mm512_reduce_max_ps(amax) / 127.f;
  const float id = *d != 0.f ? 1.f / *d : 0.f;
  for (int j = 0; j < 8; ++j) {
    const __m512i q0 = quantize_16(v[2 * j], id), q1 = quantize_16(v[2 * j + 1], id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j + 16), _mm512_cvtepi32_epi8(q1));
    sum32[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// The unsigned codes of a 4- or 5-bit record in B tile order: nibbles masked (low: rows 0-3, high:
// rows 4-7), Q5's fifth bits set from their bit mask.
template <GgmlType T>
inline void unpack_codes(const uint8_t* rec, __m512i* c) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    const __m512i v = _mm512_loadu_si512(rec + 64 * r);
    c[r] = _mm512_and_si512(v, low);
    c[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (fifth_bit(T)) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int r = 0; r < 8; ++r) {
      __mmask64 bits;
      std::memcpy(&bits, rec + 256 + 8 * r, 8);
      c[r] = _mm512_mask_add_epi8(c[r], bits, c[r], sixteen);
    }
  }
}

// The B tile of one record at `rec` into buf (512 bytes, 64-aligned): the signed codes c of
// quantized_dot.h (Q4_0's 8 and Q5_0's 16 removed); Q8_0 records are already in tile order.
template <GgmlType T>
inline const uint8_t* weight_tile(const uint8_t* rec, uint8_t* buf) {
  if constexpr (T == GgmlType::kQ8_0) {
    return rec;
  } else {
    __m512i c[8];
    unpack_codes<T>(rec, c);
    for (int r = 0; r < 8; ++r) {
      if constexpr (code_offset(T) != 0) c[r] = _mm512_sub_epi8(c[r], _mm512_set1_epi8(char(code_offset(T))));
      _mm512_store_si512(buf + 64 * r, c[r]);
    }
    return buf;
  }
}

// The 16 rows' block sums of one token by VNNI: record rows c[r] (16 x 4 unsigned codes) against
// the token's codes 4r..4r+3 (a: 8 dwords), two chains of four.
inline __m512i rows_dot_vnni(const __m512i* c, const int32_t* a) {
  __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_set1_epi32(a[0]));
  __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[1], _mm512_set1_epi32(a[1]));
  for (int r = 2; r < 8; r += 2) {
    i0 = _mm512_dpbusd_epi32(i0, c[r], _mm512_set1_epi32(a[r]));
    i1 = _mm512_dpbusd_epi32(i1, c[r + 1], _mm512_set1_epi32(a[r + 1]));
  }
  return _mm512_add_epi32(i0, i1);
}

// y[t * y_stride + n] = acc[t] lane n, for the n_valid rows of a group.
template <int M>
inline void store_rows(const __m512* acc, float* y, int64_t y_stride, int n_valid) {
  const __mmask16 valid = __mmask16((1u << n_valid) - 1);
  for (int t = 0; t < M; ++t) _mm512_mask_storeu_ps(y + t * y_stride, valid, acc[t]);
}

// Ask early for the record 4 KiB ahead, every cache line of it: the weights stream from memory
// once per call.
template <GgmlType T>
inline void prefetch_record(const uint8_t* rec) {
  for (size_t line = 0; line < record_bytes(T); line += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + 4096 + line), _MM_HINT_T0);
}

// acc += the terms of one block for one token: its int32 sums isum (16 rows), in the
// reference's expression and order: ((d_w * d) * isum) (+ (m_w * s)).
template <GgmlType T>
inline __m512 add_block(__m512 acc, const uint8_t* rec, __m512i isum, float d, float s) {
  const __m512 dw = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + code_bytes(T)));
  __m512 term = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d)), _mm512_cvtepi32_ps(isum));
  if constexpr (has_min(T)) {
    const __m512 mw = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + code_bytes(T) + 64));
    term = _mm512_add_ps(term, _mm512_mul_ps(mw, _mm512_set1_ps(s)));
  }
  return _mm512_add_ps(acc, term);
}

// Two independent tile products, A0 B0 and A1 B1, their int32 sums stored to sums0 and sums1
// (16 rows of 64 bytes each): A the activation codes (rows of a_stride bytes), B a record's tile
// (rows of 64 bytes). Tiles 1, 2 -> 0 and 4, 5 -> 3, so the two run side by side.
inline void tile_pair_sums(const void* a0, const void* a1, size_t a_stride, const void* b0, const void* b1,
                           int32_t* sums0, int32_t* sums1) {
  _tile_loadd(2, b0, 64);
  _tile_loadd(5, b1, 64);
  _tile_loadd(1, a0, a_stride);
  _tile_loadd(4, a1, a_stride);
  _tile_zero(0);
  _tile_zero(3);
  _tile_dpbssd(0, 1, 2);
  _tile_dpbssd(3, 4, 5);
  _tile_stored(0, sums0, 64);
  _tile_stored(3, sums1, 64);
}

// The tile's sums (row t at 16 t) added into acc[t], t < M.
template <GgmlType T, int M>
inline void add_tile_block(__m512* acc, const uint8_t* rec, const int32_t* sums, const float* d,
                           const float* s, int64_t nb) {
  for (int t = 0; t < M; ++t)
    acc[t] = add_block<T>(acc[t], rec, _mm512_load_si512(sums + 16 * t), d[t * nb], s[t * nb]);
}

// y[t * y_stride + n] for tokens t < M (from the input's token t0) and the n_valid rows of the
// group whose first record is `recs`, blocks two at a time so that one pair's tile products run
// while the other's sums are scaled.
template <GgmlType T, int M>
[[gnu::noinline]] void group_product(const uint8_t* recs, const TiledInput& in, int64_t t0, float* y,
                                     int64_t y_stride, int n_valid) {
  constexpr size_t kRecord = record_bytes(T);
  alignas(64) uint8_t bbuf[2][512];
  alignas(64) int32_t sums[2][16 * M];
  const int64_t nb = in.nb;
  const int8_t* q = in.q + t0 * in.n_in;
  const float* d = in.d + t0 * nb;
  const float* s = in.s + t0 * nb;
  __m512 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* r0 = recs + size_t(b) * kRecord;
    const uint8_t* r1 = r0 + kRecord;
    prefetch_record<T>(r0);
    prefetch_record<T>(r1);
    tile_pair_sums(q + 32 * b, q + 32 * (b + 1), size_t(in.n_in), weight_tile<T>(r0, bbuf[0]),
                   weight_tile<T>(r1, bbuf[1]), sums[0], sums[1]);
    add_tile_block<T, M>(acc, r0, sums[0], d + b, s + b, nb);
    add_tile_block<T, M>(acc, r1, sums[1], d + b + 1, s + b + 1, nb);
  }
  if (b < nb) {
    const uint8_t* r0 = recs + size_t(b) * kRecord;
    _tile_loadd(2, weight_tile<T>(r0, bbuf[0]), 64);
    _tile_loadd(1, q + 32 * b, in.n_in);
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, sums[0], 64);
    add_tile_block<T, M>(acc, r0, sums[0], d + b, s + b, nb);
  }
  store_rows<M>(acc, y, y_stride, n_valid);
}

// The same products for a few tokens with AVX-512 VNNI instead of tiles: a record's rows r of
// 16 x 4 codes against each token's 4 codes 4r..4r+3 broadcast, vpdpbusd into the 16 rows' block
// sums. vpdpbusd takes unsigned weight bytes, so Q4_0's codes go in as stored (0..15) and Q8_0's
// with 128 added; both remove the offset times the block's exact sum(q). The sums are the
// integers the tiles make, and the scaling is add_block's: the same bits.
template <GgmlType T, int M>
[[gnu::noinline]] void group_product_vnni(const uint8_t* recs, const TiledInput& in, int64_t t0, float* y,
                                          int64_t y_stride, int n_valid) {
  constexpr size_t kRecord = record_bytes(T);
  const int64_t nb = in.nb;
  const int8_t* q = in.q + t0 * in.n_in;
  const float* d = in.d + t0 * nb;
  const float* s = in.s + t0 * nb;
  const int32_t* sum = in.sum + t0 * nb;
  __m512 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = recs + size_t(b) * kRecord;
    prefetch_record<T>(rec);
    __m512i c[8];
    if constexpr (T == GgmlType::kQ8_0) {
      for (int r = 0; r < 8; ++r) c[r] = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * r), _mm512_set1_epi8(char(0x80)));
    } else {
      unpack_codes<T>(rec, c);
    }
    for (int t = 0; t < M; ++t) {
      __m512i isum = rows_dot_vnni(c, reinterpret_cast<const int32_t*>(q + t * in.n_in + 32 * b));
      if constexpr (code_offset(T) != 0)
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(code_offset(T) * sum[t * nb + b]));
      if constexpr (T == GgmlType::kQ8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * sum[t * nb + b]));
      acc[t] = add_block<T>(acc[t], rec, isum, d[t * nb + b], s[t * nb + b]);
    }
  }
  store_rows<M>(acc, y, y_stride, n_valid);
}

// Q4_K and Q5_K. Per super-block and token: each sub-block's exact int32 sum (a tile product,
// or VNNI for 1-3 tokens), isum = sum_j sc_j sum_j and msum = sum_j m_j sum32_j in int32, then
// the reference's ((d * d_x) * isum - (dmin * d_x) * msum) added to the row's fp32 sum.

// The unsigned codes of sub-blocks 2p (lo) and 2p + 1 (hi) of a K-quant record, B tile order.
template <GgmlType T>
inline void unpack_k_pair(const uint8_t* rec, int p, __m512i* lo, __m512i* hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 8; ++r) {
    const __m512i v = _mm512_loadu_si512(rec + 512 * p + 64 * r);
    lo[r] = _mm512_and_si512(v, low);
    hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (T == GgmlType::kQ5_K) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int r = 0; r < 8; ++r) {
      __mmask64 bits_lo, bits_hi;
      std::memcpy(&bits_lo, rec + 2048 + 64 * (2 * p) + 8 * r, 8);
      std::memcpy(&bits_hi, rec + 2048 + 64 * (2 * p + 1) + 8 * r, 8);
      lo[r] = _mm512_mask_add_epi8(lo[r], bits_lo, lo[r], sixteen);
      hi[r] = _mm512_mask_add_epi8(hi[r], bits_hi, hi[r], sixteen);
    }
  }
}

// The 16 rows' byte `field` [8][16] of sub-block j as int32 lanes.
inline __m512i k_field(const uint8_t* field, int j) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(field + 16 * j)));
}

// acc += the super-block's terms for one token (isum: its sum_j sc_j sum_j), in the reference's
// expression: (d * d_x) * isum - (dmin * d_x) * msum, msum = sum_j m_j sum32_j.
template <GgmlType T>
inline __m512 add_super_block(__m512 acc, const uint8_t* rec, __m512i isum, float dx, const int32_t* sum32) {
  const uint8_t* mins = rec + k_scales_at(T) + 128;
  __m512i msum = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(k_field(mins, j), _mm512_set1_epi32(sum32[j])));
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + k_scales_at(T) + 256));
  const __m512 dmin = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + k_scales_at(T) + 320));
  const __m512 x = _mm512_set1_ps(dx);
  const __m512 a = _mm512_mul_ps(_mm512_mul_ps(d, x), _mm512_cvtepi32_ps(isum));
  const __m512 b = _mm512_mul_ps(_mm512_mul_ps(dmin, x), _mm512_cvtepi32_ps(msum));
  return _mm512_add_ps(acc, _mm512_sub_ps(a, b));
}

// Each sub-block pair's sums by a tile product of up to 16 tokens (kTiles), or by VNNI.
template <GgmlType T, int M, bool kTiles>
[[gnu::noinline]] void group_product_k(const uint8_t* recs, const TiledInput& in, int64_t t0, float* y,
                                       int64_t y_stride, int n_valid) {
  constexpr size_t kRecord = record_bytes(T);
  alignas(64) uint8_t buf[2][512];
  alignas(64) int32_t sums[2][16 * M];
  const int64_t nsb = in.nb, stride = in.n_in, n_sum = in.n_in / 32;
  const int8_t* q = in.q + t0 * in.n_in;
  __m512 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* rec = recs + size_t(sb) * kRecord;
    prefetch_record<T>(rec);
    const uint8_t* scales = rec + k_scales_at(T);
    __m512i isum[M];
    for (int t = 0; t < M; ++t) isum[t] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      __m512i c[2][8];
      unpack_k_pair<T>(rec, p, c[0], c[1]);
      const __m512i sc[2] = {k_field(scales, 2 * p), k_field(scales, 2 * p + 1)};
      if constexpr (kTiles) {
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < 8; ++r) _mm512_store_si512(buf[h] + 64 * r, c[h][r]);
        tile_pair_sums(q + 256 * sb + 64 * p, q + 256 * sb + 64 * p + 32, size_t(stride), buf[0], buf[1], sums[0],
                       sums[1]);
        for (int t = 0; t < M; ++t)
          for (int h = 0; h < 2; ++h)
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sc[h], _mm512_load_si512(sums[h] + 16 * t)));
      } else {
        for (int t = 0; t < M; ++t)
          for (int h = 0; h < 2; ++h) {
            const int8_t* a = q + t * in.n_in + 256 * sb + 32 * (2 * p + h);
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sc[h], rows_dot_vnni(c[h], reinterpret_cast<const int32_t*>(a))));
          }
      }
    }
    for (int t = 0; t < M; ++t)
      acc[t] = add_super_block<T>(acc[t], rec, isum[t], in.d[(t0 + t) * nsb + sb], in.sum + (t0 + t) * n_sum + 8 * sb);
  }
  store_rows<M>(acc, y, y_stride, n_valid);
}

// Tokens up to this many take the VNNI form; more take the tiles.
constexpr int kMaxVnniTokens = 3;

template <GgmlType T>
void group_product_any(int m, const uint8_t* recs, const TiledInput& in, int64_t t0, float* y,
                       int64_t y_stride, int n_valid) {
  switch (m) {
#define CERTKV_TILE_CASE(k)                                                      \
  case k:                                                                        \
    if constexpr (k_quant(T))                                                    \
      return group_product_k<T, k, (k > kMaxVnniTokens)>(recs, in, t0, y, y_stride, n_valid); \
    else if constexpr (k <= kMaxVnniTokens)                                      \
      return group_product_vnni<T, k>(recs, in, t0, y, y_stride, n_valid);       \
    else                                                                         \
      return group_product<T, k>(recs, in, t0, y, y_stride, n_valid);
    CERTKV_TILE_CASE(1) CERTKV_TILE_CASE(2) CERTKV_TILE_CASE(3) CERTKV_TILE_CASE(4)
    CERTKV_TILE_CASE(5) CERTKV_TILE_CASE(6) CERTKV_TILE_CASE(7) CERTKV_TILE_CASE(8)
    CERTKV_TILE_CASE(9) CERTKV_TILE_CASE(10) CERTKV_TILE_CASE(11) CERTKV_TILE_CASE(12)
    CERTKV_TILE_CASE(13) CERTKV_TILE_CASE(14) CERTKV_TILE_CASE(15) CERTKV_TILE_CASE(16)
#undef CERTKV_TILE_CASE
    default:
      fail(StatusCode::kInternal, "matmul tiles: a tile of " + std::to_string(m) + " tokens");
  }
}

void group_product_of(GgmlType type, int m, const uint8_t* recs, const TiledInput& in, int64_t t0,
                      float* y, int64_t y_stride, int n_valid) {
  switch (type) {
    case GgmlType::kQ4_0:
      return group_product_any<GgmlType::kQ4_0>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ4_1:
      return group_product_any<GgmlType::kQ4_1>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ5_0:
      return group_product_any<GgmlType::kQ5_0>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ5_1:
      return group_product_any<GgmlType::kQ5_1>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ4_K:
      return group_product_any<GgmlType::kQ4_K>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ5_K:
      return group_product_any<GgmlType::kQ5_K>(m, recs, in, t0, y, y_stride, n_valid);
    case GgmlType::kQ8_0:
      return group_product_any<GgmlType::kQ8_0>(m, recs, in, t0, y, y_stride, n_valid);
    default:
      fail(StatusCode::kInternal, "matmul tiles: type list and dispatch disagree");
  }
}

// Per-thread buffer for the quantized activations (it only grows).
uint8_t* activation_scratch(size_t bytes) {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, Free> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    capacity = (bytes + 63) / 64 * 64;
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, capacity)));
    if (!buffer) fail(StatusCode::kOutOfMemory, "matmul tiles: cannot allocate activation scratch");
  }
  return buffer.get();
}

constexpr int64_t kTileTokens = 16;
// Tokens whose activations a thread passes over its groups before the next ones: their codes
// stay in L2 (64 x 1,536 bytes for the widest SmolLM2 input), and each group's records are read
// once per chunk.
constexpr int64_t kChunkTokens = 64;

// matmul_tiled once the tiles are known to be there.
void tiled_products(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens, std::span<float* const> y,
                    ThreadPool& pool) {
  const int64_t n_in = w[0].n_in, nb = n_in / 32;
  // The activations in each block length that a matrix of the call needs ([0] blocks of 32, [1]
  // super-blocks of 256): the codes, d, s and the exact sums of each 32 codes, per token.
  bool need[2] = {false, false};
  for (const WeightMatrix& m : w) need[k_quant(m.type)] = true;
  const size_t q_bytes = (size_t(n_tokens) * size_t(n_in) + 63) / 64 * 64;
  const size_t f_bytes = (size_t(n_tokens) * size_t(nb) * sizeof(float) + 63) / 64 * 64;
  const size_t per_length = q_bytes + 3 * f_bytes;
  uint8_t* scratch = activation_scratch(size_t(need[0] + need[1]) * per_length);
  int8_t* q[2];
  float *d[2], *s[2];
  int32_t* sum[2];
  TiledInput in[2];
  for (int k = 0; k < 2; ++k) {
    uint8_t* base = scratch + (k == 1 && need[0] ? per_length : 0);
    q[k] = reinterpret_cast<int8_t*>(base);
    d[k] = reinterpret_cast<float*>(base + q_bytes);
    s[k] = reinterpret_cast<float*>(base + q_bytes + f_bytes);
    sum[k] = reinterpret_cast<int32_t*>(base + q_bytes + 2 * f_bytes);
    in[k] = {q[k], d[k], s[k], sum[k], n_in, k == 0 ? nb : n_in / 256};
  }
  auto quantize_row = [&](int64_t t) {
    const float* xt = x + t * n_in;
    if (need[0])
      for (int64_t b = 0; b < nb; ++b)
        quantize_block32(xt + 32 * b, q[0] + t * n_in + 32 * b, d[0] + t * nb + b, s[0] + t * nb + b,
                         sum[0] + t * nb + b);
    if (need[1])
      for (int64_t b = 0; b < n_in / 256; ++b)
        quantize_block256(xt + 256 * b, q[1] + t * n_in + 256 * b, d[1] + t * (n_in / 256) + b, sum[1] + t * nb + 8 * b);
  };
  if (n_tokens < 32) {
    for (int64_t t = 0; t < n_tokens; ++t) quantize_row(t);
  } else {
    pool.parallel_for(n_tokens, 16, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) quantize_row(t);
    });
  }
  // Work units: the groups of 16 rows of every matrix, numbered one matrix after the other.
  std::vector<int64_t> first_group(w.size() + 1, 0);
  for (size_t m = 0; m < w.size(); ++m) first_group[m + 1] = first_group[m] + (w[m].n_out + kRows - 1) / kRows;
  const int64_t n_groups = first_group.back();
  // As many threads as have at least 2^17 multiply-adds each (a hand-off costs a few microseconds).
  const int64_t macs = std::max<int64_t>(1, n_in * n_tokens) * n_groups * kRows;
  const int64_t n_chunks = std::clamp<int64_t>(macs >> 17, 1, pool.n_threads());
  const int64_t grain = std::max<int64_t>(1, (n_groups + n_chunks - 1) / n_chunks);
  pool.parallel_for(n_groups, grain, [&](int64_t g0, int64_t g1, int) {
    for (int64_t tc = 0; tc < n_tokens; tc += kChunkTokens) {
      const int64_t te = std::min(n_tokens, tc + kChunkTokens);
      size_t m = 0;
      for (int64_t g = g0; g < g1; ++g) {
        while (g >= first_group[m + 1]) ++m;
        const WeightMatrix& wm = w[m];
        const int64_t local = g - first_group[m];
        const int n_valid = int(std::min<int64_t>(kRows, wm.n_out - local * kRows));
        const TiledInput& win = in[k_quant(wm.type)];
        const uint8_t* recs = wm.tiles + size_t(local) * size_t(win.nb) * record_bytes(wm.type);
        for (int64_t t0 = tc; t0 < te; t0 += kTileTokens) {
          const int mt = int(std::min(kTileTokens, te - t0));
          if (mt > kMaxVnniTokens) configure_tiles(mt);
          group_product_of(wm.type, mt, recs, win, t0, y[m] + t0 * wm.n_out + local * kRows, wm.n_out,
                           n_valid);
        }
      }
    }
  });
}

}  // namespace
}  // namespace certkv::model
CERTKV_TARGET_POP()

namespace certkv::model {

void matmul_tiled(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
                  std::span<float* const> y, ThreadPool& pool) {
  if (!matmul_tiles_available())
    fail(StatusCode::kUnsupported, "matmul tiles: this CPU or kernel offers no AMX tiles");
  tiled_products(w, x, n_tokens, y, pool);
}

#else  // no tile path in this build

bool matmul_tiles_available() { return false; }

void matmul_tiled(std::span<const WeightMatrix>, const float*, int64_t, std::span<float* const>, ThreadPool&) {
  fail(StatusCode::kUnsupported, "matmul tiles: this build has no AMX tile path");
}

#endif

}  // namespace certkv::model
