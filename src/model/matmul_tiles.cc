#include "model/matmul_tiles.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/status.h"
#include "format/numeric.h"
#include "model/ggml_type.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define CERTKV_MATMUL_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

#include "core/x86_simd.h"
#endif

namespace certkv::model {
namespace {

using format::GgmlType;

constexpr int kRows = 16;  // output rows per record (the tile's columns)

constexpr bool has_min(GgmlType type) { return type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1; }
constexpr bool fifth_bit(GgmlType type) { return type == GgmlType::kQ5_0 || type == GgmlType::kQ5_1; }
// What the ggml codes have taken away to be the signed c of quantized_dot.h: Q4_0 8, Q5_0 16.
constexpr int code_offset(GgmlType type) {
  return type == GgmlType::kQ4_0 ? 8 : type == GgmlType::kQ5_0 ? 16 : 0;
}
// Bytes of one record: codes (Q5: then the fifth bits), then d (and m) of the 16 rows as floats.
constexpr size_t code_bytes(GgmlType type) {
  return type == GgmlType::kQ8_0 ? 512 : fifth_bit(type) ? 256 + 64 : 256;
}
constexpr size_t record_bytes(GgmlType type) { return code_bytes(type) + 64 * (has_min(type) ? 2 : 1); }

void check_tileable(const WeightMatrix& w) {
  if (!matmul_tiles_support(w.type))
    fail(StatusCode::kUnsupported, std::string("matmul tiles: no tile layout for ") + ggml_type_name(w.type));
  if (w.n_in <= 0 || w.n_in % 32 != 0 || w.n_out < 0)
    fail(StatusCode::kInvalidArgument, "matmul tiles: " + std::to_string(w.n_out) + " rows of " +
                                           std::to_string(w.n_in) + " inputs (need a multiple of 32)");
}

float fp16_field(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return format::fp16_to_float(bits);
}

}  // namespace

bool matmul_tiles_support(GgmlType type) {
  return type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1 || type == GgmlType::kQ5_0 ||
         type == GgmlType::kQ5_1 || type == GgmlType::kQ8_0;
}

size_t matmul_tiles_bytes(const WeightMatrix& w) {
  check_tileable(w);
  return size_t((w.n_out + kRows - 1) / kRows) * size_t(w.n_in / 32) * record_bytes(w.type);
}

void tile_weights(const WeightMatrix& w, uint8_t* out) {
  const size_t bytes = matmul_tiles_bytes(w);
  std::memset(out, 0, bytes);
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

bool detect_tiles() {
  const char* env = std::getenv("CERTKV_MATMUL_TILES");
  if (env && std::strcmp(env, "0") == 0) return false;
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

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

// The quantized activations of one call: codes [n_tokens][n_in], and per token its blocks' d and
// s = d * sum(q) ([n_tokens][nb] each), exactly as quantize_activation_ref makes them.
struct TiledInput {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  const int32_t* sum = nullptr;  // [n_tokens][nb]: sum(q) of each block, exact
  int64_t n_in = 0, nb = 0;
};

inline bool all_finite(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x10 | 0x80) == 0;  // QNaN, +Inf, -Inf, SNaN
}

inline __m512i quantize_16(__m512 v, float id) {
  return _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// quantized_dot.h step 1 for one block of 32: amax, d = amax / 127, id = 1 / d, codes rounded
// half to even, s = d * sum(q) (and the integer sum(q)); a block with an Inf or NaN gets zero
// codes and d = s = NaN.
inline void quantize_block(const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  if (!all_finite(v0) || !all_finite(v1)) {
    std::memset(q, 0, 32);
    *d = *s = __builtin_nanf("");
    *sum = 0;
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *d = amax / 127.f;
  const float id = *d != 0.f ? 1.f / *d : 0.f;
  const __m512i q0 = quantize_16(v0, id), q1 = quantize_16(v1, id);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  *s = *d * float(*sum);
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
    _tile_loadd(2, weight_tile<T>(r0, bbuf[0]), 64);
    _tile_loadd(5, weight_tile<T>(r1, bbuf[1]), 64);
    _tile_loadd(1, q + 32 * b, in.n_in);
    _tile_loadd(4, q + 32 * (b + 1), in.n_in);
    _tile_zero(0);
    _tile_zero(3);
    _tile_dpbssd(0, 1, 2);
    _tile_dpbssd(3, 4, 5);
    _tile_stored(0, sums[0], 64);
    _tile_stored(3, sums[1], 64);
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
  const __mmask16 valid = __mmask16((1u << n_valid) - 1);
  for (int t = 0; t < M; ++t) _mm512_mask_storeu_ps(y + t * y_stride, valid, acc[t]);
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
      const int32_t* a = reinterpret_cast<const int32_t*>(q + t * in.n_in + 32 * b);
      __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_set1_epi32(a[0]));
      __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[1], _mm512_set1_epi32(a[1]));
      for (int r = 2; r < 8; r += 2) {
        i0 = _mm512_dpbusd_epi32(i0, c[r], _mm512_set1_epi32(a[r]));
        i1 = _mm512_dpbusd_epi32(i1, c[r + 1], _mm512_set1_epi32(a[r + 1]));
      }
      __m512i isum = _mm512_add_epi32(i0, i1);
      if constexpr (code_offset(T) != 0)
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(code_offset(T) * sum[t * nb + b]));
      if constexpr (T == GgmlType::kQ8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * sum[t * nb + b]));
      acc[t] = add_block<T>(acc[t], rec, isum, d[t * nb + b], s[t * nb + b]);
    }
  }
  const __mmask16 valid = __mmask16((1u << n_valid) - 1);
  for (int t = 0; t < M; ++t) _mm512_mask_storeu_ps(y + t * y_stride, valid, acc[t]);
}

// Tokens up to this many take the VNNI form; more take the tiles.
constexpr int kMaxVnniTokens = 3;

template <GgmlType T>
void group_product_any(int m, const uint8_t* recs, const TiledInput& in, int64_t t0, float* y,
                       int64_t y_stride, int n_valid) {
  switch (m) {
#define CERTKV_TILE_CASE(k)                                                     \
  case k:                                                                       \
    if constexpr (k <= kMaxVnniTokens)                                          \
      return group_product_vnni<T, k>(recs, in, t0, y, y_stride, n_valid);      \
    else                                                                        \
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

}  // namespace

bool matmul_tiles_available() {
  static const bool available = detect_tiles();
  return available;
}

void matmul_tiled(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
                  std::span<float* const> y, ThreadPool& pool) {
  if (!matmul_tiles_available())
    fail(StatusCode::kUnsupported, "matmul tiles: this CPU or kernel offers no AMX tiles");
  const int64_t n_in = w[0].n_in, nb = n_in / 32;
  const size_t q_bytes = (size_t(n_tokens) * size_t(n_in) + 63) / 64 * 64;
  uint8_t* scratch = activation_scratch(q_bytes + 3 * size_t(n_tokens) * size_t(nb) * sizeof(float));
  TiledInput in;
  in.n_in = n_in;
  in.nb = nb;
  in.q = reinterpret_cast<const int8_t*>(scratch);
  float* d = reinterpret_cast<float*>(scratch + q_bytes);
  float* s = d + size_t(n_tokens) * size_t(nb);
  int32_t* sum = reinterpret_cast<int32_t*>(s + size_t(n_tokens) * size_t(nb));
  in.d = d;
  in.s = s;
  in.sum = sum;
  auto quantize_row = [&](int64_t t) {
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + t * n_in + 32 * b, reinterpret_cast<int8_t*>(scratch) + t * n_in + 32 * b,
                     d + t * nb + b, s + t * nb + b, sum + t * nb + b);
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
        const uint8_t* recs = wm.tiles + size_t(local) * size_t(nb) * record_bytes(wm.type);
        for (int64_t t0 = tc; t0 < te; t0 += kTileTokens) {
          const int mt = int(std::min(kTileTokens, te - t0));
          if (mt > kMaxVnniTokens) configure_tiles(mt);
          group_product_of(wm.type, mt, recs, in, t0, y[m] + t0 * wm.n_out + local * kRows, wm.n_out,
                           n_valid);
        }
      }
    }
  });
}

#else  // no tile path in this build

bool matmul_tiles_available() { return false; }

void matmul_tiled(std::span<const WeightMatrix>, const float*, int64_t, std::span<float* const>, ThreadPool&) {
  fail(StatusCode::kUnsupported, "matmul tiles: this build has no AMX tile path");
}

#endif

}  // namespace certkv::model
