#include "model/matmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/matmul_tiles.h"
#include "model/quantized_dot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define CERTKV_MATMUL_AVX512 1
#include "core/x86_simd.h"
#include "model/activation_blocks_x86.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CERTKV_MATMUL_AVX2 1
#include "core/x86_simd.h"
#endif

namespace certkv::model {
namespace {

using format::GgmlType;

bool is_float_type(GgmlType type) {
  return type == GgmlType::kF32 || type == GgmlType::kF16 || type == GgmlType::kBF16;
}

void check_args(const WeightMatrix& w, int64_t n_tokens, const char* caller) {
  if (!matmul_supports(w.type)) {
    fail(StatusCode::kUnsupported, std::string(caller) + ": weight type " + ggml_type_name(w.type) +
                                       " (id " + std::to_string(static_cast<uint32_t>(w.type)) +
                                       ") is not supported");
  }
  const int64_t block = ggml_block_elements(w.type);
  if (w.n_in < 0 || w.n_out < 0 || n_tokens < 0 || w.n_in % block != 0) {
    fail(StatusCode::kInvalidArgument,
         std::string(caller) + ": bad shape: " + std::to_string(n_tokens) + " tokens x " +
             std::to_string(w.n_in) + " inputs -> " + std::to_string(w.n_out) + " outputs of " +
             ggml_type_name(w.type) + " (inputs must be a multiple of " + std::to_string(block) +
             ")");
  }
  if (w.row_bytes < ggml_row_bytes(w.type, w.n_in)) {
    fail(StatusCode::kInvalidArgument,
         std::string(caller) + ": row_bytes " + std::to_string(w.row_bytes) + " is less than the " +
             std::to_string(ggml_row_bytes(w.type, w.n_in)) + " bytes of a row of " +
             std::to_string(w.n_in) + " " + ggml_type_name(w.type) + " elements");
  }
  if (w.data == nullptr && w.n_out > 0 && w.n_in > 0) {
    fail(StatusCode::kInvalidArgument, std::string(caller) + ": weight data is null");
  }
}

// Rows per parallel_for grain for n_rows rows of n_in inputs against n_tokens tokens: the rows
// split evenly over as many threads as have at least kMinMacsPerThread multiply-adds each (a
// hand-off costs the pool a few microseconds of spinning), in multiples of 16 rows.
int64_t row_grain(int64_t n_in, int64_t n_rows, int64_t n_tokens, int n_threads) {
  constexpr int64_t kMinMacsPerThread = int64_t(1) << 17;
  const int64_t macs = std::max<int64_t>(1, n_in * n_tokens) * n_rows;
  const int64_t n_chunks = std::clamp<int64_t>(macs / kMinMacsPerThread, 1, n_threads);
  const int64_t rows = (n_rows + n_chunks - 1) / n_chunks;
  return std::max<int64_t>(16, (rows + 15) / 16 * 16);
}

// Per-thread scratch that survives between calls (the quantized activations), 64-byte aligned.
class Scratch {
 public:
  uint8_t* get(size_t bytes) {
    if (bytes > capacity_) {
      capacity_ = (bytes + 63) / 64 * 64;
      buffer_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, capacity_)));
      if (!buffer_) fail(StatusCode::kOutOfMemory, "matmul: cannot allocate activation scratch");
    }
    return buffer_.get();
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> buffer_;
  size_t capacity_ = 0;
};

[[maybe_unused]] Scratch& thread_scratch() {  // unused by the portable path
  thread_local Scratch scratch;
  return scratch;
}

// ---------------------------------------------------------------------------------------------
// Portable path: the reference algorithm, rows spread over the pool.

void matmul_portable(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y,
                     ThreadPool& pool) {
  if (is_float_type(w.type)) {
    pool.parallel_for(
        w.n_out, row_grain(w.n_in, w.n_out, n_tokens, pool.n_threads()), [&](int64_t r0, int64_t r1, int) {
          std::vector<float> row(size_t(w.n_in));
          for (int64_t r = r0; r < r1; ++r) {
            dequantize_row_ref(w.type, w.data + size_t(r) * w.row_bytes, row.data(), w.n_in);
            for (int64_t t = 0; t < n_tokens; ++t) {
              const float* xt = x + t * w.n_in;
              float sum = 0;
              for (int64_t i = 0; i < w.n_in; ++i) sum += row[size_t(i)] * xt[i];
              y[t * w.n_out + r] = sum;
            }
          }
        });
    return;
  }
  const int64_t block = activation_block_elements(w.type);
  std::vector<QuantizedActivation> acts(static_cast<size_t>(n_tokens));
  for (int64_t t = 0; t < n_tokens; ++t)
    acts[size_t(t)] = quantize_activation_ref(x + t * w.n_in, w.n_in, block);
  pool.parallel_for(
      w.n_out, row_grain(w.n_in, w.n_out, n_tokens, pool.n_threads()), [&](int64_t r0, int64_t r1, int) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t t = 0; t < n_tokens; ++t)
            y[t * w.n_out + r] =
                vec_dot_quantized_ref(w.type, w.data + size_t(r) * w.row_bytes, acts[size_t(t)]);
      });
}

#if defined(CERTKV_MATMUL_AVX512) || defined(CERTKV_MATMUL_AVX2)
// The fp16 value at p (a block's scale or min), converted by F16C where present: the same value
// as format::fp16_to_float, in one instruction instead of a branchy decode.
inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return format::fp16_to_float(bits);
#endif
}

// Where the fields of a 32-element block type sit. The AVX-512 path reads a group of 4 blocks
// (kGroupBytes) with 64-byte loads at offsets 0 and kSecond (for Q8_0 also 8 and 72, for the hi
// codes), all inside the group, and picks the fields out of those loads with byte / word
// permutes; the AVX2 path reads one block at a time.
struct Block32Fields {
  int block_bytes;
  int m_offset;     // fp16 min (Q4_1, Q5_1), or -1
  int qh_offset;    // 32 fifth bits (Q5_0, Q5_1), or -1
  int qs_offset;    // codes
  int code_offset;  // subtracted from the unsigned codes: w = d * (q - code_offset) (+ m)
};

constexpr Block32Fields fields_of(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return {18, -1, -1, 2, 8};
    case GgmlType::kQ4_1:
      return {20, 2, -1, 4, 0};
    case GgmlType::kQ5_0:
      return {22, -1, 2, 6, 16};
    case GgmlType::kQ5_1:
      return {24, 2, 4, 8, 0};
    default:
      return {34, -1, -1, 2, 128};  // Q8_0: codes are int8, unpacked as q + 128
  }
}

// Bytes of one 256-element super-block of Q4_K, Q5_K, Q6_K.
constexpr size_t k_quant_block_bytes(GgmlType type) {
  return type == GgmlType::kQ4_K ? 144 : type == GgmlType::kQ5_K ? 176 : 210;
}

// The six-bit codes (0..63) of half h of a Q6_K super-block (ql: 128 bytes of low nibbles, qh:
// 64 bytes of high bit pairs), 32 per vector: code[quarter] holds elements
// 128 h + 32 quarter + l, l < 32 (quantized_dot.cc gives the element layout).
inline void q6_k_codes(const uint8_t* ql, const uint8_t* qh, int h, __m256i code[4]) {
  const __m256i nibble = _mm256_set1_epi8(0xF);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
  const __m256i low[4] = {_mm256_and_si256(l0, nibble), _mm256_and_si256(l1, nibble),
                          _mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                          _mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble)};
  for (int quarter = 0; quarter < 4; ++quarter) {
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * quarter), _mm256_set1_epi8(3));
    code[quarter] = _mm256_or_si256(low[quarter], _mm256_slli_epi16(high, 4));
  }
}
#endif

#if defined(CERTKV_MATMUL_AVX512)

// ---------------------------------------------------------------------------------------------
// AVX-512 path, 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
//
// Four consecutive blocks A, B, C, D form a group. The integer codes of a group are unpacked into
// two vectors of 64 bytes, `lo` (elements 0-15 of each block) and `hi` (elements 16-31), in slot
// order: 32-bit slot s (0..15) holds 4 consecutive elements 4j..4j+3 (j = s / 4) of block s % 4.
// So after _mm512_dpbusd_epi32 slot s holds a partial integer dot product of block s % 4, and
// the per-block scales form a 4-float pattern [dA dB dC dD] repeated 4 times. The quantized
// activations are stored in the same slot order, so one load feeds each dpbusd.

constexpr int slot_element(int p) { return 4 * ((p / 4) / 4) + p % 4; }  // element of byte p, 0..15
constexpr int slot_block(int p) { return (p / 4) % 4; }                  // block of byte p, 0..3

// Layout of the quantized activations of one token row for 32-element blocks, when the weights
// are read in n_sets leading sets of 16 blocks (the set layout below) and then in groups of 4:
//   [n_sets x 8 x 64 bytes: vector j of a set, lane k = elements 4j..4j+3 of its block k]
//   [n_groups x (64 bytes lo codes, 64 bytes hi codes)]
//   [d: 16 floats per set (one per block), then 16 per group (its 4 blocks' d, 4 times over)]
//   [s = d * sum(q) per block, padded to a multiple of 16 floats];
// everything past the end of the row is zero.
struct Act32Layout {
  int64_t n_sets, n_groups;
  size_t groups_offset, d_offset, d_groups_offset, s_offset, stride;
  Act32Layout(int64_t n_in, bool sets) {
    const int64_t nb = n_in / 32;
    n_sets = sets ? nb / 16 : 0;
    n_groups = (nb - 16 * n_sets + 3) / 4;
    groups_offset = size_t(n_sets) * 512;
    d_offset = groups_offset + size_t(n_groups) * 128;
    d_groups_offset = d_offset + size_t(n_sets) * 64;
    s_offset = d_groups_offset + size_t(n_groups) * 64;
    stride = s_offset + size_t((nb + 15) / 16) * 64;
  }
};

using detail::all_finite;
using detail::quantize_16;
using detail::quantize_block32;

// Byte tables that move the natural-order codes of four blocks (128 bytes: A0..31 B0..31 ...)
// into the lo / hi slot order.
struct Act32Tables {
  alignas(64) uint8_t lo[64];
  alignas(64) uint8_t hi[64];
  constexpr Act32Tables() {
    for (int p = 0; p < 64; ++p) {
      lo[p] = uint8_t(32 * slot_block(p) + slot_element(p));
      hi[p] = uint8_t(32 * slot_block(p) + 16 + slot_element(p));
    }
  }
};

void quantize_act32_row(const float* x, int64_t n_in, uint8_t* out, const Act32Layout& L) {
  static constexpr Act32Tables tables;
  const int64_t nb = n_in / 32;
  auto* d_out = reinterpret_cast<float*>(out + L.d_offset);
  auto* d_groups = reinterpret_cast<float*>(out + L.d_groups_offset);
  auto* s_out = reinterpret_cast<float*>(out + L.s_offset);
  for (int64_t b = 0; b < 16 * L.n_sets; ++b) {
    alignas(16) int8_t q[32];
    quantize_block32(x + 32 * b, q, d_out + b, s_out + b);
    uint8_t* set = out + 512 * (b / 16) + 4 * (b % 16);
    for (int j = 0; j < 8; ++j) std::memcpy(set + 64 * j, q + 4 * j, 4);
  }
  for (int64_t g = 0; g < L.n_groups; ++g) {
    alignas(64) int8_t codes[128] = {};
    for (int k = 0; k < 4; ++k) {
      const int64_t b = 16 * L.n_sets + 4 * g + k;
      float d = 0;
      if (b < nb) quantize_block32(x + 32 * b, codes + 32 * k, &d, s_out + b);
      for (int r = 0; r < 4; ++r) d_groups[16 * g + 4 * r + k] = d;
    }
    const __m512i c0 = _mm512_load_si512(codes), c1 = _mm512_load_si512(codes + 64);
    const __m512i lo = _mm512_permutex2var_epi8(c0, _mm512_load_si512(tables.lo), c1);
    const __m512i hi = _mm512_permutex2var_epi8(c0, _mm512_load_si512(tables.hi), c1);
    _mm512_store_si512(out + L.groups_offset + 128 * g, lo);
    _mm512_store_si512(out + L.groups_offset + 128 * g + 64, hi);
  }
  for (int64_t b = nb; b % 16 != 0; ++b) s_out[b] = 0.f;
}

// Index of byte `offset` of a group in the 128-byte table formed by the loads at 0 and `second`.
constexpr int table_index(int offset, int second) {
  return offset < 64 ? offset : 64 + offset - second;
}

template <GgmlType T>
struct Group32Tables {
  static constexpr Block32Fields F = fields_of(T);
  static constexpr bool kQ8 = T == GgmlType::kQ8_0;
  static constexpr int kGroupBytes = 4 * F.block_bytes;
  static constexpr int kSecond = kQ8 ? 64 : kGroupBytes - 64;
  alignas(64) uint8_t qs_lo[64];  // the lo codes (nibble types: the byte holding lo and hi)
  alignas(64) uint8_t qs_hi[64];  // Q8_0 only: the hi codes, in the table of the loads at 8, 72
  alignas(64) uint8_t qh_lo[64];  // Q5: the qh byte of each lo / hi element ...
  alignas(64) uint8_t qh_hi[64];
  alignas(64) uint8_t qh_bit[64];  // ... and its bit
  alignas(64) uint16_t dm[32];     // words 0-3: d of blocks A-D, 4-7: their m (or d again)
  constexpr Group32Tables() {
    for (int p = 0; p < 64; ++p) {
      const int k = slot_block(p), e = slot_element(p), base = k * F.block_bytes;
      qs_lo[p] = uint8_t(table_index(base + F.qs_offset + e, kSecond));
      const int hi_offset = base + F.qs_offset + 16 + e;
      qs_hi[p] = uint8_t(!kQ8 ? 0 : hi_offset < 72 ? hi_offset - 8 : 64 + hi_offset - 72);
      if (F.qh_offset >= 0) {
        qh_lo[p] = uint8_t(table_index(base + F.qh_offset + e / 8, kSecond));
        qh_hi[p] = uint8_t(table_index(base + F.qh_offset + (16 + e) / 8, kSecond));
      } else {
        qh_lo[p] = qh_hi[p] = 0;
      }
      qh_bit[p] = uint8_t(1u << (e % 8));
    }
    for (int w = 0; w < 32; ++w) {
      const int k = w % 4, base = k * F.block_bytes;
      const int field = (w % 8 >= 4 && F.m_offset >= 0) ? base + F.m_offset : base;
      dm[w] = uint16_t(table_index(field, kSecond) / 2);
    }
  }
};

// The sum of the 16 lanes of v in the order store_lane_sums<8> adds them: halves added, then
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) over the eight lanes left.
inline float lane_sum_tree(__m512 acc) {
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

// y[t * y_stride] = the sum of the 16 lanes of acc[t], t < kT. Eight accumulators are reduced
// together (halves added, then a horizontal-add tree), which costs a third of eight separate
// reductions; rows of 576 inputs spend a quarter of their time here otherwise. Smaller tiles add
// in the same order, so a token's result does not depend on the tile it was computed in (batch
// invariance: backend/backend.h).
template <int kT>
inline void store_lane_sums(const __m512* acc, float* y, int64_t y_stride) {
  if constexpr (kT == 8) {
    __m256 v[8];
    for (int t = 0; t < 8; ++t)
      v[t] = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1));
    // hadd(a, b) = [a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 a6+a7 b4+b5 b6+b7].
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                      _mm256_permute2f128_ps(h0123, h4567, 0x31));
    alignas(32) float out[8];
    _mm256_store_ps(out, sums);
    for (int t = 0; t < 8; ++t) y[t * y_stride] = out[t];
  } else {
    for (int t = 0; t < kT; ++t) y[t * y_stride] = lane_sum_tree(acc[t]);
  }
}

// One unpacked group: unsigned codes in slot order; in lanes 0-3 of `dm` the scales d of blocks
// A-D, in lanes 4-7 their fp16 mins (Q4_1, Q5_1) or their d again (the constant term is then
// -code_offset * d).
struct Group32 {
  __m512i lo, hi;
  __m512 dm;
};

// Byte masks of the four 64-byte loads of a group (offsets 0, second, and for Q8_0 8 and 72):
// all ones for a whole group; for the last, partial group of a row only the bytes of its blocks,
// so that the missing blocks read as zero (codes 0, d = m = 0: they add nothing).
struct GroupLoadMasks {
  __mmask64 load[4];
};

inline __mmask64 bytes_below(int64_t n) {
  return n >= 64 ? ~__mmask64(0) : n <= 0 ? __mmask64(0) : (__mmask64(1) << n) - 1;
}

template <GgmlType T>
GroupLoadMasks partial_group_masks(int64_t n_blocks) {
  const int64_t bytes = n_blocks * fields_of(T).block_bytes;
  const int offsets[4] = {0, Group32Tables<T>::kSecond, 8, 72};
  GroupLoadMasks m;
  for (int i = 0; i < 4; ++i) m.load[i] = bytes_below(bytes - offsets[i]);
  return m;
}

// The load masks of the last group of a row of nb blocks (for the drivers below).
template <GgmlType T>
GroupLoadMasks q32_row_tail(int64_t nb) {
  return partial_group_masks<T>(nb % 4);
}

template <GgmlType T, bool kPartial>
inline __m512i load_group_bytes(const uint8_t* g, int offset, const GroupLoadMasks& masks, int i) {
  if constexpr (kPartial) return _mm512_maskz_loadu_epi8(masks.load[i], g + offset);
  return _mm512_loadu_si512(g + offset);
}

template <GgmlType T, bool kPartial>
inline Group32 unpack_group32(const uint8_t* g, const GroupLoadMasks& masks) {
  static constexpr Group32Tables<T> tab;
  constexpr Block32Fields F = Group32Tables<T>::F;
  constexpr int kSecond = Group32Tables<T>::kSecond;
  const __m512i a = load_group_bytes<T, kPartial>(g, 0, masks, 0);
  const __m512i b = load_group_bytes<T, kPartial>(g, kSecond, masks, 1);
  Group32 u;
  if constexpr (T == GgmlType::kQ8_0) {
    const __m512i a8 = load_group_bytes<T, kPartial>(g, 8, masks, 2);
    const __m512i b8 = load_group_bytes<T, kPartial>(g, 72, masks, 3);
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    u.lo = _mm512_xor_si512(_mm512_permutex2var_epi8(a, _mm512_load_si512(tab.qs_lo), b), flip);
    u.hi = _mm512_xor_si512(_mm512_permutex2var_epi8(a8, _mm512_load_si512(tab.qs_hi), b8), flip);
  } else {
    const __m512i q = _mm512_permutex2var_epi8(a, _mm512_load_si512(tab.qs_lo), b);
    const __m512i nibble = _mm512_set1_epi8(0xF);
    u.lo = _mm512_and_si512(q, nibble);
    u.hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
    if constexpr (F.qh_offset >= 0) {
      const __m512i bit = _mm512_load_si512(tab.qh_bit);
      const __m512i sixteen = _mm512_set1_epi8(16);
      const __mmask64 h_lo =
          _mm512_test_epi8_mask(_mm512_permutex2var_epi8(a, _mm512_load_si512(tab.qh_lo), b), bit);
      const __mmask64 h_hi =
          _mm512_test_epi8_mask(_mm512_permutex2var_epi8(a, _mm512_load_si512(tab.qh_hi), b), bit);
      u.lo = _mm512_mask_add_epi8(u.lo, h_lo, u.lo, sixteen);
      u.hi = _mm512_mask_add_epi8(u.hi, h_hi, u.hi, sixteen);
    }
  }
  // Lanes 0-7: dA dB dC dD, then mA mB mC mD (or the d again); lanes 8-15 repeat them.
  u.dm = _mm512_cvtph_ps(
      _mm512_castsi512_si256(_mm512_permutex2var_epi16(a, _mm512_load_si512(tab.dm), b)));
  return u;
}

// Sets of 16 blocks. Sixteen consecutive blocks form a set, unpacked into eight vectors c_0..c_7
// of 64 unsigned codes: 32-bit lane k of c_j holds elements 4j..4j+3 of block k of the set. The
// activations of a set are stored in the same order (Act32Layout), so eight chained dpbusd leave
// the whole integer dot product of block k in lane k, and one conversion, one scale product and
// two multiply-adds per token finish 16 blocks, where groups of 4 blocks need four times as many.
// Unpacking a set costs more than unpacking its four groups (its bytes are picked out of 128-byte
// windows with byte permutes), which the tile's tokens share. Q8_0 rows stay in groups: their
// 34-byte blocks need five windows a vector, and sets measured slower for them (the output head:
// 1.5x at one token, 1.1x at eight).
constexpr bool block_sets(GgmlType type) { return type != GgmlType::kQ8_0; }
template <GgmlType T>
constexpr bool kBlockSets = block_sets(T);

// Where the bytes of a set's vectors come from. The set is read by 64-byte loads at 64 i
// (i < 2 kWindows); window w is the 128-byte table of loads 2w, 2w + 1. For byte p of a vector,
// its window supplies it where bit p of the window's mask is set, from index table[w][p].
template <GgmlType T>
struct SetTables {
  static_assert(kBlockSets<T>);
  static constexpr Block32Fields F = fields_of(T);
  static constexpr int kSetBytes = 16 * F.block_bytes;
  static constexpr int kWindows = (kSetBytes + 127) / 128;
  // The packed codes: bytes 4v..4v+3 of the qs of each block (v < 4), whose low nibbles are c_v
  // and high nibbles c_{v+4}.
  alignas(64) uint8_t qs[4][kWindows][64];
  uint64_t qs_mask[4][kWindows];
  alignas(64) uint8_t qh[kWindows][64];  // Q5: lane k = the 4 bytes of fifth bits of block k
  uint64_t qh_mask[kWindows];
  alignas(64) uint8_t qh_byte[8][64];  // c_j, byte p: the byte of lane p / 4 holding its fifth bit
  alignas(64) uint8_t qh_bit[8][64];   // ... and the bit
  alignas(64) uint16_t dm[kWindows][32];  // words 0-15: d of blocks 0-15; 16-31: their m (or d)
  uint32_t dm_mask[kWindows];

  static constexpr void place(int offset, int p, uint8_t (*table)[64], uint64_t* mask) {
    table[offset / 128][p] = uint8_t(offset % 128);
    mask[offset / 128] |= uint64_t(1) << p;
  }
  constexpr SetTables() : qs{}, qs_mask{}, qh{}, qh_mask{}, qh_byte{}, qh_bit{}, dm{}, dm_mask{} {
    for (int p = 0; p < 64; ++p) {
      const int k = p / 4, base = k * F.block_bytes;
      for (int v = 0; v < 4; ++v) place(base + F.qs_offset + 4 * v + p % 4, p, qs[v], qs_mask[v]);
      if (F.qh_offset >= 0) place(base + F.qh_offset + p % 4, p, qh, qh_mask);
      for (int j = 0; j < 8; ++j) {
        const int e = 4 * j + p % 4;  // element of byte p of c_j
        qh_byte[j][p] = uint8_t(4 * (k % 4) + e / 8);  // within the byte's 128-bit lane
        qh_bit[j][p] = uint8_t(1u << (e % 8));
      }
    }
    for (int q = 0; q < 32; ++q) {
      const int base = (q % 16) * F.block_bytes;
      const int offset = q >= 16 && F.m_offset >= 0 ? base + F.m_offset : base;
      dm[offset / 128][q] = uint16_t((offset % 128) / 2);
      dm_mask[offset / 128] |= uint32_t(1) << q;
    }
  }
};

struct SetCodes {
  __m512i c[8];
  __m512 d, m;  // per block: the scale, and the min (Q4_1, Q5_1) or -code_offset * d
};

// One vector of a set, picked out of its loads: from each window, the bytes its mask marks.
template <int kWindows>
inline __m512i pick_bytes(const __m512i* loads, const uint8_t (*table)[64], const uint64_t* mask) {
  __m512i r = _mm512_maskz_permutex2var_epi8(mask[0], loads[0], _mm512_load_si512(table[0]), loads[1]);
  for (int w = 1; w < kWindows; ++w)
    r = _mm512_mask_blend_epi8(mask[w], r,
                               _mm512_permutex2var_epi8(loads[2 * w], _mm512_load_si512(table[w]),
                                                        loads[2 * w + 1]));
  return r;
}

// The set of 16 blocks at p (the loads stay inside it).
template <GgmlType T>
inline void unpack_set(const uint8_t* p, SetCodes* u) {
  static constexpr SetTables<T> tab;
  using Tab = SetTables<T>;
  constexpr int W = Tab::kWindows;
  __m512i loads[2 * W];
  for (int i = 0; i < 2 * W; ++i)
    loads[i] = Tab::kSetBytes >= 64 * (i + 1) ? _mm512_loadu_si512(p + 64 * i)
                                               : _mm512_maskz_loadu_epi8(bytes_below(Tab::kSetBytes - 64 * i), p + 64 * i);
  const __m512i nibble = _mm512_set1_epi8(0xF);
  for (int v = 0; v < 4; ++v) {
    const __m512i q = pick_bytes<W>(loads, tab.qs[v], tab.qs_mask[v]);
    u->c[v] = _mm512_and_si512(q, nibble);
    u->c[v + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
  }
  if constexpr (Tab::F.qh_offset >= 0) {
    const __m512i qh = pick_bytes<W>(loads, tab.qh, tab.qh_mask);
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int j = 0; j < 8; ++j) {
      const __m512i bits = _mm512_shuffle_epi8(qh, _mm512_load_si512(tab.qh_byte[j]));
      const __mmask64 high = _mm512_test_epi8_mask(bits, _mm512_load_si512(tab.qh_bit[j]));
      u->c[j] = _mm512_mask_add_epi8(u->c[j], high, u->c[j], sixteen);
    }
  }
  __m512i dm = _mm512_maskz_permutex2var_epi16(tab.dm_mask[0], loads[0], _mm512_load_si512(tab.dm[0]), loads[1]);
  for (int w = 1; w < W; ++w)
    dm = _mm512_mask_blend_epi16(tab.dm_mask[w], dm,
                                 _mm512_permutex2var_epi16(loads[2 * w], _mm512_load_si512(tab.dm[w]),
                                                           loads[2 * w + 1]));
  u->d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  if constexpr (Tab::F.m_offset >= 0)
    u->m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
  else
    u->m = _mm512_mul_ps(u->d, _mm512_set1_ps(-float(Tab::F.code_offset)));
}

// Decode streams each weight once from memory: ask early for the kBytes that lie 4 KiB past p,
// every cache line of them (with one request per group or set, only part of the lines came
// early and the 8-token tile waited on memory for most of the rest).
template <int kBytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int offset = 0; offset < kBytes; offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + offset), _MM_HINT_T0);
}

// y[t * y_stride] = dot(row, activation t) for kT consecutive tokens: the row's first
// L.n_sets sets of 16 blocks, then its other blocks in groups of 4. `tail` holds the load
// masks of the row's last group when nb is not a multiple of 4.
// In the groups, the constant terms sum_b m_b s_b are gathered 16 blocks (4 groups) at a time:
// the m of each group go to lanes 4 (g % 4) .. 4 (g % 4) + 3 of `m16`, which then meets 16
// consecutive s values.
template <GgmlType T, int kT>
[[gnu::always_inline]] inline void row_dot_q32(const uint8_t* row, int64_t nb, const GroupLoadMasks& tail, const uint8_t* act,
                 const Act32Layout& L, float* y, int64_t y_stride) {
  constexpr Block32Fields F = Group32Tables<T>::F;
  constexpr int kGroupBytes = Group32Tables<T>::kGroupBytes;
  __m512 acc[kT];
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_setzero_ps();
  if constexpr (kBlockSets<T>) {
    for (int64_t set = 0; set < L.n_sets; ++set) {
      prefetch_ahead<4 * kGroupBytes>(row + set * 4 * kGroupBytes);
      SetCodes u;
      unpack_set<T>(row + set * 4 * kGroupBytes, &u);
      for (int t = 0; t < kT; ++t) {
        const uint8_t* a = act + size_t(t) * L.stride;
        const auto* xq = reinterpret_cast<const __m512i*>(a + 512 * set);
        // Two chains of four, so that a token's products do not wait on one long dependency.
        __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.c[0], _mm512_load_si512(xq));
        __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.c[1], _mm512_load_si512(xq + 1));
        for (int j = 2; j < 8; j += 2) {
          i0 = _mm512_dpbusd_epi32(i0, u.c[j], _mm512_load_si512(xq + j));
          i1 = _mm512_dpbusd_epi32(i1, u.c[j + 1], _mm512_load_si512(xq + j + 1));
        }
        const float* dx = reinterpret_cast<const float*>(a + L.d_offset) + 16 * set;
        const float* sx = reinterpret_cast<const float*>(a + L.s_offset) + 16 * set;
        const __m512 scale = _mm512_mul_ps(u.d, _mm512_load_ps(dx));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), scale, acc[t]);
        acc[t] = _mm512_fmadd_ps(u.m, _mm512_load_ps(sx), acc[t]);
      }
    }
  }
  // The groups after the sets: block 16 n_sets onwards.
  const uint8_t* groups = row + L.n_sets * 4 * kGroupBytes;
  const int64_t nb_groups = nb - 16 * L.n_sets;
  const size_t s0 = size_t(16 * L.n_sets) * sizeof(float);  // the groups' first s
  __m512 m16 = _mm512_setzero_ps();
  for (int64_t g = 0; g < L.n_groups; ++g) {
    prefetch_ahead<kGroupBytes>(groups + g * kGroupBytes);
    const Group32 u = g < nb_groups / 4 ? unpack_group32<T, false>(groups + g * kGroupBytes, tail)
                                        : unpack_group32<T, true>(groups + g * kGroupBytes, tail);
    const __m512 dw = _mm512_shuffle_f32x4(u.dm, u.dm, 0x00);  // [dA dB dC dD] 4 times
    for (int t = 0; t < kT; ++t) {
      const uint8_t* a = act + size_t(t) * L.stride;
      const uint8_t* codes = a + L.groups_offset + 128 * g;
      __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.lo, _mm512_load_si512(codes));
      i = _mm512_dpbusd_epi32(i, u.hi, _mm512_load_si512(codes + 64));
      const __m512 dx = _mm512_load_ps(reinterpret_cast<const float*>(a + L.d_groups_offset) + 16 * g);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, dx), acc[t]);
    }
    m16 = _mm512_mask_shuffle_f32x4(m16, __mmask16(0xF << (4 * (g % 4))), u.dm, u.dm, 0x55);
    if (g % 4 == 3 || g == L.n_groups - 1) {
      if constexpr (F.m_offset < 0) m16 = _mm512_mul_ps(m16, _mm512_set1_ps(-float(F.code_offset)));
      for (int t = 0; t < kT; ++t) {
        const float* s = reinterpret_cast<const float*>(act + size_t(t) * L.stride + L.s_offset + s0);
        acc[t] = _mm512_fmadd_ps(m16, _mm512_load_ps(s + 4 * (g & ~int64_t(3))), acc[t]);
      }
      m16 = _mm512_setzero_ps();
    }
  }
  store_lane_sums<kT>(acc, y, y_stride);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path, k-quants (Q4_K, Q5_K, Q6_K): each 256-element super-block is unpacked into eight
// vectors of 32 int16 products sc_j * code (Q6_K: sc_j * (code - 32)) in element order, and
// multiplied with int16 activation codes by _mm512_dpwssd_epi32; the integer sum of a
// super-block stays exact in int32 (|sum| < 256 * 63 * 31 * 127 for Q4_K/Q5_K, 256 * 128 * 32 *
// 127 for Q6_K, both below 2^31).

// Per token row: [nsb x 256 int16 codes] [nsb floats d] [nsb x 8 int16 sums over 32 elements].
struct ActKLayout {
  int64_t n_super;
  size_t d_offset, sum_offset, stride;
  explicit ActKLayout(int64_t n_in) {
    n_super = n_in / 256;
    d_offset = size_t(n_super) * 512;
    sum_offset = (d_offset + size_t(n_super) * 4 + 15) / 16 * 16;
    stride = (sum_offset + size_t(n_super) * 16 + 63) / 64 * 64;
  }
};

void quantize_act_k_row(const float* x, int64_t n_in, uint8_t* out, const ActKLayout& L) {
  auto* d_out = reinterpret_cast<float*>(out + L.d_offset);
  auto* sums_out = reinterpret_cast<int16_t*>(out + L.sum_offset);
  for (int64_t b = 0; b < L.n_super; ++b) {
    const float* xb = x + 256 * b;
    auto* q_out = reinterpret_cast<int16_t*>(out + 512 * b);
    __m512 amax = _mm512_setzero_ps();
    bool finite = true;
    for (int i = 0; i < 256; i += 16) {
      const __m512 v = _mm512_loadu_ps(xb + i);
      finite = finite && all_finite(v);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    if (!finite) {
      d_out[b] = __builtin_nanf("");
      std::memset(q_out, 0, 512);
      std::memset(sums_out + 8 * b, 0, 16);
      continue;
    }
    const float d = _mm512_reduce_max_ps(amax) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 8; ++j) {
      const __m512i q0 = quantize_16(_mm512_loadu_ps(xb + 32 * j), id);
      const __m512i q1 = quantize_16(_mm512_loadu_ps(xb + 32 * j + 16), id);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q_out + 32 * j), _mm512_cvtepi32_epi16(q0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q_out + 32 * j + 16),
                         _mm512_cvtepi32_epi16(q1));
      sums_out[8 * b + j] = int16_t(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
    d_out[b] = d;
  }
}

struct SuperBlock {
  __m512i w[8];  // int16 sc * code, elements 32z .. 32z + 31 in w[z]
  __m128i mins;  // Q4_K / Q5_K: the 8 sub-block mins as int16
  float d, dmin;
};

template <GgmlType T>
inline void unpack_super_block(const uint8_t* p, SuperBlock* s) {
  const __m256i nibble = _mm256_set1_epi8(0xF);
  if constexpr (T == GgmlType::kQ6_K) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(p + 192);
    s->d = fp16_at(p + 208);
    s->dmin = 0;
    s->mins = _mm_setzero_si128();
    const __m512i thirty_two = _mm512_set1_epi16(32);
    for (int h = 0; h < 2; ++h) {
      __m256i code[4];
      q6_k_codes(ql, qh, h, code);
      for (int quarter = 0; quarter < 4; ++quarter) {
        const int z = 4 * h + quarter;
        const __m512i sc = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(scales[2 * z]),
                                                   _mm512_set1_epi16(scales[2 * z + 1]));
        s->w[z] = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(code[quarter]), thirty_two), sc);
      }
    }
  } else {
    constexpr bool kFifthBit = T == GgmlType::kQ5_K;
    s->d = fp16_at(p);
    s->dmin = fp16_at(p + 2);
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    alignas(16) int16_t mins[8];
    uint8_t sc[8];
    for (int j = 0; j < 8; ++j) {
      uint8_t m;
      k_quant_scale_min(j, p + 4, &sc[j], &m);
      mins[j] = m;
    }
    s->mins = _mm_load_si128(reinterpret_cast<const __m128i*>(mins));
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        __m256i code = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, nibble);
        if constexpr (kFifthBit) {
          const __mmask32 high = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << j)));
          code = _mm256_mask_add_epi8(code, high, code, _mm256_set1_epi8(16));
        }
        s->w[j] = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(code), _mm512_set1_epi16(sc[j]));
      }
    }
  }
}

template <GgmlType T, int kT>
[[gnu::always_inline]] inline void row_dot_k(const uint8_t* row, int64_t n_super, const uint8_t* act, const ActKLayout& L,
               float* y, int64_t y_stride) {
  constexpr size_t kBlockBytes = k_quant_block_bytes(T);
  __m512 acc[kT];
  __m128 acc_min[kT];
  for (int t = 0; t < kT; ++t) {
    acc[t] = _mm512_setzero_ps();
    acc_min[t] = _mm_setzero_ps();
  }
  SuperBlock s;
  for (int64_t b = 0; b < n_super; ++b) {
    unpack_super_block<T>(row + b * kBlockBytes, &s);
    for (int t = 0; t < kT; ++t) {
      const uint8_t* a = act + size_t(t) * L.stride;
      const auto* xq = reinterpret_cast<const __m512i*>(a + 512 * b);
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int z = 0; z < 8; z += 2) {
        i0 = _mm512_dpwssd_epi32(i0, s.w[z], _mm512_load_si512(xq + z));
        i1 = _mm512_dpwssd_epi32(i1, s.w[z + 1], _mm512_load_si512(xq + z + 1));
      }
      const float dx = reinterpret_cast<const float*>(a + L.d_offset)[b];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)),
                               _mm512_set1_ps(s.d * dx), acc[t]);
      if constexpr (T != GgmlType::kQ6_K) {
        const __m128i sums = _mm_load_si128(reinterpret_cast<const __m128i*>(a + L.sum_offset) + b);
        acc_min[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(s.mins, sums)),
                                  _mm_set1_ps(s.dmin * dx), acc_min[t]);
      }
    }
  }
  for (int t = 0; t < kT; ++t) acc[t] = _mm512_sub_ps(acc[t], _mm512_zextps128_ps512(acc_min[t]));
  store_lane_sums<kT>(acc, y, y_stride);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path, float weights: fp32 fused multiply-adds over 16 lanes, kR rows x kT tokens.

template <GgmlType T>
inline __m512 load_weights_16(const uint8_t* row, int64_t i, __mmask16 mask) {
  if constexpr (T == GgmlType::kF32) {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == GgmlType::kF16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, row + 2 * i));
  } else {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, row + 2 * i)), 16));
  }
}

template <GgmlType T, int kR, int kT>
void rows_dot_float(const uint8_t* rows, size_t row_bytes, int64_t n, const float* x, float* y,
                    int64_t y_stride) {
  __m512 acc[kR][kT];
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < kT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    __m512 wv[kR];
    for (int r = 0; r < kR; ++r) wv[r] = load_weights_16<T>(rows + r * row_bytes, i, mask);
    for (int t = 0; t < kT; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + t * n + i);
      for (int r = 0; r < kR; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < kT; ++t) y[t * y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#elif defined(CERTKV_MATMUL_AVX2)

// ---------------------------------------------------------------------------------------------
// AVX2 path (with FMA and F16C). Integer dot products of 32 codes at a time in llama.cpp's way:
// _mm256_maddubs_epi16 multiplies unsigned weight bytes with signed activation bytes into int16
// pairs (|pair| <= 2 * 128 * 127 < 2^15, so it never saturates), _mm256_madd_epi16 widens them to
// eight int32 lanes; signed weight codes go in as |c| against sign(x, c). The integer sum of a
// block is exact; its eight lanes are scaled and added in fp32, like the AVX-512 path's lanes.
// Activations are quantized exactly as quantize_activation_ref does, in element order.

inline __m256i ones_epi16() { return _mm256_set1_epi16(1); }

// Sum of the eight lanes.
inline float lane_sum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// y[t * y_stride] = the lane sum of acc[t] plus extra[t], t < kT.
template <int kT>
inline void store_lane_sums(const __m256* acc, const float* extra, float* y, int64_t y_stride) {
  for (int t = 0; t < kT; ++t) y[t * y_stride] = lane_sum(acc[t]) + extra[t];
}

// The products of 32 signed weight codes c with 32 signed activation codes, as eight int32 lanes.
inline __m256i dot32_signed(__m256i c, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c)),
                           ones_epi16());
}

// One block of activations, n = 32 or 256 elements, as quantize_activation_ref computes it:
// codes q, scale d, and the sums of q over each 32 elements (sum32); a block holding an Inf or
// NaN gets d = NaN and zero codes. Returns d.
inline float quantize_block(const float* x, int n, int8_t* q, int32_t* sum32) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    // v - v is 0 for finite v and NaN for Inf or NaN.
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
  }
  if (_mm256_movemask_ps(finite) != 0xFF) {
    std::memset(q, 0, size_t(n));
    for (int j = 0; j < n / 32; ++j) sum32[j] = 0;
    return __builtin_nanf("");
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int j = 0; j < n / 32; ++j) {
    const float* xj = x + 32 * j;
    // cvtps rounds to nearest even, as std::nearbyint does in the default rounding mode.
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj), id));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 8), id));
    const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 16), id));
    const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 24), id));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    sum32[j] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    // packs interleaves the 128-bit lanes; the permute puts the elements back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * j),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  return d;
}

// The AVX2 path reads every row block by block.
constexpr bool block_sets(GgmlType) { return false; }
template <GgmlType T>
constexpr bool kBlockSets = false;

// Layout of the quantized activations of one token row for 32-element blocks:
// [nb x 32 int8 codes] [nb floats d] [nb floats s = d * sum(q)], 32-byte aligned parts.
struct Act32Layout {
  int64_t n_blocks;
  size_t d_offset, s_offset, stride;
  Act32Layout(int64_t n_in, bool /*sets: none on this path*/) {
    n_blocks = n_in / 32;
    d_offset = size_t(n_blocks) * 32;
    s_offset = d_offset + (size_t(n_blocks) * 4 + 31) / 32 * 32;
    stride = s_offset + (size_t(n_blocks) * 4 + 31) / 32 * 32;
  }
};

void quantize_act32_row(const float* x, int64_t n_in, uint8_t* out, const Act32Layout& L) {
  (void)n_in;
  auto* q = reinterpret_cast<int8_t*>(out);
  auto* d = reinterpret_cast<float*>(out + L.d_offset);
  auto* s = reinterpret_cast<float*>(out + L.s_offset);
  for (int64_t b = 0; b < L.n_blocks; ++b) {
    int32_t sum = 0;
    d[b] = quantize_block(x + 32 * b, 32, q + 32 * b, &sum);
    s[b] = d[b] * float(sum);
  }
}

// Nothing to mask: every load of the AVX2 path stays inside its block.
struct Q32RowTail {};
template <GgmlType T>
Q32RowTail q32_row_tail(int64_t) {
  return {};
}

// The 16 bytes at p as 32 nibbles: low nibbles in bytes 0-15, high nibbles in bytes 16-31.
inline __m256i nibbles_32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
}

// 16 in byte i where bit i of the 32-bit little-endian word at p is set, else 0.
inline __m256i fifth_bits_32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// The 32 codes of one block with the type's offset removed (w_i = d c_i + m), in element order.
// Q4_1 and Q5_1 codes are >= 0 (kUnsignedCodes) and multiply the activations as unsigned bytes.
template <GgmlType T>
inline __m256i block32_codes(const uint8_t* p) {
  if constexpr (T == GgmlType::kQ4_0) {
    return _mm256_sub_epi8(nibbles_32(p + 2), _mm256_set1_epi8(8));
  } else if constexpr (T == GgmlType::kQ4_1) {
    return nibbles_32(p + 4);
  } else if constexpr (T == GgmlType::kQ5_0) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles_32(p + 6), fifth_bits_32(p + 2)),
                           _mm256_set1_epi8(16));
  } else if constexpr (T == GgmlType::kQ5_1) {
    return _mm256_or_si256(nibbles_32(p + 8), fifth_bits_32(p + 4));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  }
}

template <GgmlType T>
constexpr bool kUnsignedCodes = T == GgmlType::kQ4_1 || T == GgmlType::kQ5_1;

// y[t * y_stride] = dot(row, activation t) for kT consecutive tokens.
template <GgmlType T, int kT>
[[gnu::always_inline]] inline void row_dot_q32(const uint8_t* row, int64_t nb, const Q32RowTail&, const uint8_t* act,
                 const Act32Layout& L, float* y, int64_t y_stride) {
  constexpr size_t kBlockBytes = size_t(fields_of(T).block_bytes);
  __m256 acc[kT];
  float constant[kT];
  for (int t = 0; t < kT; ++t) {
    acc[t] = _mm256_setzero_ps();
    constant[t] = 0;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * kBlockBytes;
    // One request per block (blocks are under 64 bytes): every weight line is asked for early.
    _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
    const __m256i c = block32_codes<T>(p);
    const float dw = fp16_at(p);
    for (int t = 0; t < kT; ++t) {
      const uint8_t* a = act + size_t(t) * L.stride;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * b));
      const __m256i i = kUnsignedCodes<T>
                            ? _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones_epi16())
                            : dot32_signed(c, x);
      const float dx = reinterpret_cast<const float*>(a + L.d_offset)[b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(dw * dx), acc[t]);
      if constexpr (kUnsignedCodes<T>)
        constant[t] += fp16_at(p + 2) * reinterpret_cast<const float*>(a + L.s_offset)[b];
    }
  }
  store_lane_sums<kT>(acc, constant, y, y_stride);
}

// k-quants (Q4_K, Q5_K, Q6_K). Per token row: [nsb x 256 int8 codes] [nsb floats d]
// [nsb x 8 int32 sums over 32 elements].
struct ActKLayout {
  int64_t n_super;
  size_t d_offset, sum_offset, stride;
  explicit ActKLayout(int64_t n_in) {
    n_super = n_in / 256;
    d_offset = size_t(n_super) * 256;
    sum_offset = d_offset + (size_t(n_super) * 4 + 31) / 32 * 32;
    stride = sum_offset + size_t(n_super) * 32;
  }
};

void quantize_act_k_row(const float* x, int64_t n_in, uint8_t* out, const ActKLayout& L) {
  (void)n_in;
  auto* q = reinterpret_cast<int8_t*>(out);
  auto* d = reinterpret_cast<float*>(out + L.d_offset);
  auto* sums = reinterpret_cast<int32_t*>(out + L.sum_offset);
  for (int64_t b = 0; b < L.n_super; ++b)
    d[b] = quantize_block(x + 256 * b, 256, q + 256 * b, sums + 8 * b);
}

// One unpacked super-block: 256 codes in element order (Q4_K, Q5_K: unsigned; Q6_K: code - 32,
// signed), the sub-block scales as int16 multipliers of the eight int16 pairs of each 32
// elements (Q6_K: two scales of 16 elements each), and the mins.
struct SuperBlock {
  alignas(32) int8_t codes[256];
  __m256i scales[8];
  int32_t mins[8];
  float d, dmin;
};

template <GgmlType T>
inline void unpack_super_block(const uint8_t* p, SuperBlock* s) {
  const __m256i nibble = _mm256_set1_epi8(0xF);
  auto* codes = reinterpret_cast<__m256i*>(s->codes);
  if constexpr (T == GgmlType::kQ6_K) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(p + 192);
    s->d = fp16_at(p + 208);
    s->dmin = 0;
    for (int h = 0; h < 2; ++h) {
      __m256i code[4];
      q6_k_codes(ql, qh, h, code);
      for (int quarter = 0; quarter < 4; ++quarter) {
        const int z = 4 * h + quarter;
        _mm256_store_si256(codes + z, _mm256_sub_epi8(code[quarter], _mm256_set1_epi8(32)));
        s->scales[z] = _mm256_set_m128i(_mm_set1_epi16(scales[2 * z + 1]), _mm_set1_epi16(scales[2 * z]));
      }
    }
  } else {
    constexpr bool kFifthBit = T == GgmlType::kQ5_K;
    s->d = fp16_at(p);
    s->dmin = fp16_at(p + 2);
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        uint8_t sc, m;
        k_quant_scale_min(j, p + 4, &sc, &m);
        s->mins[j] = m;
        s->scales[j] = _mm256_set1_epi16(sc);
        __m256i code = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, nibble);
        if constexpr (kFifthBit) {
          const __m256i bit = _mm256_set1_epi8(char(1 << j));
          code = _mm256_or_si256(code, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                        _mm256_set1_epi8(16)));
        }
        _mm256_store_si256(codes + j, code);
      }
    }
  }
}

template <GgmlType T, int kT>
[[gnu::always_inline]] inline void row_dot_k(const uint8_t* row, int64_t n_super, const uint8_t* act, const ActKLayout& L,
               float* y, int64_t y_stride) {
  constexpr size_t kBlockBytes = k_quant_block_bytes(T);
  __m256 acc[kT];
  float mins[kT];
  for (int t = 0; t < kT; ++t) {
    acc[t] = _mm256_setzero_ps();
    mins[t] = 0;
  }
  SuperBlock s;
  const auto* codes = reinterpret_cast<const __m256i*>(s.codes);
  for (int64_t b = 0; b < n_super; ++b) {
    unpack_super_block<T>(row + b * kBlockBytes, &s);
    for (int t = 0; t < kT; ++t) {
      const uint8_t* a = act + size_t(t) * L.stride;
      const auto* xq = reinterpret_cast<const __m256i*>(a + 256 * b);
      __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
      for (int z = 0; z < 8; z += 2) {
        const __m256i c0 = _mm256_load_si256(codes + z), c1 = _mm256_load_si256(codes + z + 1);
        const __m256i x0 = _mm256_loadu_si256(xq + z), x1 = _mm256_loadu_si256(xq + z + 1);
        __m256i p0, p1;
        if constexpr (T == GgmlType::kQ6_K) {
          p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(c0), _mm256_sign_epi8(x0, c0));
          p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(c1), _mm256_sign_epi8(x1, c1));
        } else {
          p0 = _mm256_maddubs_epi16(c0, x0);
          p1 = _mm256_maddubs_epi16(c1, x1);
        }
        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(p0, s.scales[z]));
        i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(p1, s.scales[z + 1]));
      }
      const float dx = reinterpret_cast<const float*>(a + L.d_offset)[b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), _mm256_set1_ps(s.d * dx),
                               acc[t]);
      if constexpr (T != GgmlType::kQ6_K) {
        const int32_t* sums = reinterpret_cast<const int32_t*>(a + L.sum_offset) + 8 * b;
        int32_t msum = 0;
        for (int j = 0; j < 8; ++j) msum += s.mins[j] * sums[j];
        mins[t] -= (s.dmin * dx) * float(msum);
      }
    }
  }
  store_lane_sums<kT>(acc, mins, y, y_stride);
}

// Float weights: fp32 fused multiply-adds over 8 lanes, kR rows x kT tokens; the last n % 8
// elements go through a zero-padded copy.
template <GgmlType T>
inline __m256 load_weights_8(const uint8_t* row, int64_t i) {
  if constexpr (T == GgmlType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == GgmlType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i))), 16));
  }
}

template <GgmlType T>
inline __m256 load_weights_tail(const uint8_t* row, int64_t i, int64_t n) {
  constexpr size_t kElementBytes = T == GgmlType::kF32 ? 4 : 2;
  alignas(32) uint8_t padded[32] = {};
  std::memcpy(padded, row + kElementBytes * size_t(i), kElementBytes * size_t(n - i));
  return load_weights_8<T>(padded, 0);
}

inline __m256 load_floats_tail(const float* x, int64_t n) {
  alignas(32) float padded[8] = {};
  std::memcpy(padded, x, sizeof(float) * size_t(n));
  return _mm256_load_ps(padded);
}

template <GgmlType T, int kR, int kT>
void rows_dot_float(const uint8_t* rows, size_t row_bytes, int64_t n, const float* x, float* y,
                    int64_t y_stride) {
  __m256 acc[kR][kT];
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < kT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wv[kR];
    for (int r = 0; r < kR; ++r) wv[r] = load_weights_8<T>(rows + r * row_bytes, i);
    for (int t = 0; t < kT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * n + i);
      for (int r = 0; r < kR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (i < n) {
    __m256 wv[kR];
    for (int r = 0; r < kR; ++r) wv[r] = load_weights_tail<T>(rows + r * row_bytes, i, n);
    for (int t = 0; t < kT; ++t) {
      const __m256 xv = load_floats_tail(x + t * n + i, n - i);
      for (int r = 0; r < kR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < kT; ++t) y[t * y_stride + r] = lane_sum(acc[r][t]);
}

#endif  // CERTKV_MATMUL_AVX512, CERTKV_MATMUL_AVX2

#if defined(CERTKV_MATMUL_AVX512) || defined(CERTKV_MATMUL_AVX2)

// ---------------------------------------------------------------------------------------------
// Drivers. The rows of the matrices of one call are numbered one after the other and each thread
// takes a range of them. Tokens go in chunks whose activations stay in L2 (about
// kTokenChunkBytes); within a chunk, rows go in blocks of about kRowBlockBytes of weights (also
// kept in L2), and tiles of up to kTileTokens tokens (activations in L1) pass over the rows of a
// block.

constexpr int kTileTokens = 8;
constexpr size_t kRowBlockBytes = 48 * 1024;
constexpr size_t kTokenChunkBytes = 512 * 1024;

// kernel(m, row_begin, row_end, token_begin, n_tile_tokens) over rows of w[m];
// act_bytes_per_token: the size of one token's activations (quantized, or float).
// REQUIRES: all w[m].n_in equal.
template <typename RowKernel>
void for_row_tiles(std::span<const WeightMatrix> w, int64_t n_tokens, size_t act_bytes_per_token,
                   ThreadPool& pool, RowKernel kernel) {
  int64_t n_rows = 0;
  for (const WeightMatrix& wm : w) n_rows += wm.n_out;
  const int64_t chunk_tokens = std::max<int64_t>(
      kTileTokens, int64_t(kTokenChunkBytes / std::max<size_t>(1, act_bytes_per_token)) /
                       kTileTokens * kTileTokens);
  const int64_t grain = row_grain(w[0].n_in, n_rows, n_tokens, pool.n_threads());
  pool.parallel_for(n_rows, grain, [&](int64_t r0, int64_t r1, int) {
    for (int64_t tc = 0; tc < n_tokens; tc += chunk_tokens) {
      const int64_t te = std::min(n_tokens, tc + chunk_tokens);
      int64_t first = 0;  // number of w[m]'s first row in the call
      for (size_t m = 0; m < w.size(); first += w[m].n_out, ++m) {
        const int64_t begin = std::max(r0, first) - first;
        const int64_t end = std::min(r1, first + w[m].n_out) - first;
        const int64_t rows_per_block =
            std::max<int64_t>(4, int64_t(kRowBlockBytes / std::max<size_t>(1, w[m].row_bytes)));
        for (int64_t rb = begin; rb < end; rb += rows_per_block) {
          const int64_t re = std::min(end, rb + rows_per_block);
          for (int64_t t0 = tc; t0 < te; t0 += kTileTokens)
            kernel(m, rb, re, t0, int(std::min<int64_t>(kTileTokens, te - t0)));
        }
      }
    }
  });
}

// Calls f.template operator()<k>() for k = n in 1..8 (a run-time tile size to a template one).
template <typename F>
void with_tile(int n, F&& f) {
  switch (n) {
    case 1:
      f.template operator()<1>();
      break;
    case 2:
      f.template operator()<2>();
      break;
    case 3:
      f.template operator()<3>();
      break;
    case 4:
      f.template operator()<4>();
      break;
    case 5:
      f.template operator()<5>();
      break;
    case 6:
      f.template operator()<6>();
      break;
    case 7:
      f.template operator()<7>();
      break;
    default:
      f.template operator()<8>();
      break;
  }
}

// Calls quantize_row(t) for every token t, in parallel when there are many.
template <typename QuantizeRow>
void quantize_rows(int64_t n_tokens, ThreadPool& pool, QuantizeRow quantize_row) {
  const int64_t grain = 16;
  if (n_tokens < 2 * grain) {
    for (int64_t t = 0; t < n_tokens; ++t) quantize_row(t);
    return;
  }
  pool.parallel_for(n_tokens, grain, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(t);
  });
}

// The quantized activations of one call, one row of each layout per token: for 32-element blocks
// read in groups (act32[0]) or in sets then groups (act32[1], kBlockSets), and for k-quant
// super-blocks (act_k); null where no matrix of the call needs it.
struct QuantizedInput {
  Act32Layout l32[2];
  ActKLayout l_k;
  const uint8_t* act32[2] = {nullptr, nullptr};
  const uint8_t* act_k = nullptr;
  explicit QuantizedInput(int64_t n_in) : l32{{n_in, false}, {n_in, true}}, l_k(n_in) {}
};

// y[t * w.n_out + r] for rows r in [rb, re) of w and tokens t0 .. t0 + kT - 1 (y points at token
// t0's outputs). The row kernel is inlined here, so that its tables, masks and constants are
// loaded once per range of rows rather than once per row; this function is not inlined into the
// dispatch over types and tile sizes (64 kernels in one function measured 30% slower).
template <GgmlType T, int kT>
[[gnu::noinline]] void rows_q32(const WeightMatrix& w, int64_t rb, int64_t re, const QuantizedInput& in, int64_t t0,
              float* y) {
  const int64_t nb = w.n_in / 32;
  const auto tail = q32_row_tail<T>(nb);
  const Act32Layout& L = in.l32[kBlockSets<T>];
  const uint8_t* act = in.act32[kBlockSets<T>] + size_t(t0) * L.stride;
  for (int64_t r = rb; r < re; ++r)
    row_dot_q32<T, kT>(w.data + size_t(r) * w.row_bytes, nb, tail, act, L, y + r, w.n_out);
}

template <GgmlType T, int kT>
[[gnu::noinline]] void rows_k(const WeightMatrix& w, int64_t rb, int64_t re, const QuantizedInput& in, int64_t t0,
            float* y) {
  const uint8_t* act = in.act_k + size_t(t0) * in.l_k.stride;
  for (int64_t r = rb; r < re; ++r)
    row_dot_k<T, kT>(w.data + size_t(r) * w.row_bytes, in.l_k.n_super, act, in.l_k, y + r,
                     w.n_out);
}

template <int kT>
void rows_quantized(const WeightMatrix& w, int64_t rb, int64_t re, const QuantizedInput& in,
                    int64_t t0, float* y) {
  switch (w.type) {
    case GgmlType::kQ4_0:
      return rows_q32<GgmlType::kQ4_0, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ4_1:
      return rows_q32<GgmlType::kQ4_1, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ5_0:
      return rows_q32<GgmlType::kQ5_0, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ5_1:
      return rows_q32<GgmlType::kQ5_1, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ8_0:
      return rows_q32<GgmlType::kQ8_0, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ4_K:
      return rows_k<GgmlType::kQ4_K, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ5_K:
      return rows_k<GgmlType::kQ5_K, kT>(w, rb, re, in, t0, y);
    case GgmlType::kQ6_K:
      return rows_k<GgmlType::kQ6_K, kT>(w, rb, re, in, t0, y);
    default:
      fail(StatusCode::kInternal, "matmul: type list and dispatch disagree");
  }
}

// Quantized weights only: x quantized once per layout that some w[m] needs, then every row of
// every matrix in one parallel section.
void matmul_quantized(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
                      std::span<float* const> y, ThreadPool& pool) {
  const int64_t n_in = w[0].n_in;
  QuantizedInput in(n_in);
  bool need32[2] = {false, false}, need_k = false;
  for (const WeightMatrix& wm : w) {
    if (activation_block_elements(wm.type) == 32) need32[block_sets(wm.type)] = true;
    need_k = need_k || activation_block_elements(wm.type) == 256;
  }
  const size_t bytes[3] = {need32[0] ? in.l32[0].stride : 0, need32[1] ? in.l32[1].stride : 0,
                           need_k ? in.l_k.stride : 0};
  const size_t bytes_per_token = bytes[0] + bytes[1] + bytes[2];
  uint8_t* act = thread_scratch().get(bytes_per_token * size_t(n_tokens));
  uint8_t* act32[2] = {act, act + bytes[0] * size_t(n_tokens)};
  uint8_t* act_k = act32[1] + bytes[1] * size_t(n_tokens);
  quantize_rows(n_tokens, pool, [&](int64_t t) {
    for (int sets = 0; sets < 2; ++sets)
      if (need32[sets])
        quantize_act32_row(x + t * n_in, n_in, act32[sets] + size_t(t) * bytes[sets], in.l32[sets]);
    if (need_k) quantize_act_k_row(x + t * n_in, n_in, act_k + size_t(t) * bytes[2], in.l_k);
  });
  for (int sets = 0; sets < 2; ++sets) in.act32[sets] = need32[sets] ? act32[sets] : nullptr;
  in.act_k = need_k ? act_k : nullptr;
  for_row_tiles(w, n_tokens, bytes_per_token, pool,
                [&](size_t m, int64_t rb, int64_t re, int64_t t0, int kt) {
                  float* ym = y[m] + t0 * w[m].n_out;
                  with_tile(kt, [&]<int kT>() { rows_quantized<kT>(w[m], rb, re, in, t0, ym); });
                });
}

template <GgmlType T>
void matmul_float(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y,
                  ThreadPool& pool) {
  constexpr int kRows = 4, kTokens = 4;
  for_row_tiles(std::span<const WeightMatrix>(&w, 1), n_tokens, size_t(w.n_in) * sizeof(float), pool,
                [&](size_t, int64_t rb, int64_t re, int64_t t0, int kt) {
                  for (int64_t t = t0; t < t0 + kt; t += kTokens) {
                    const int nt = int(std::min<int64_t>(kTokens, t0 + kt - t));
                    const float* xt = x + t * w.n_in;
                    float* yt = y + t * w.n_out;
                    auto run = [&]<int kR, int kT>(int64_t r) {
                      rows_dot_float<T, kR, kT>(w.data + size_t(r) * w.row_bytes, w.row_bytes,
                                                w.n_in, xt, yt + r, w.n_out);
                    };
                    int64_t r = rb;
                    for (; r + kRows <= re; r += kRows) {
                      switch (nt) {
                        case 1:
                          run.template operator()<kRows, 1>(r);
                          break;
                        case 2:
                          run.template operator()<kRows, 2>(r);
                          break;
                        case 3:
                          run.template operator()<kRows, 3>(r);
                          break;
                        default:
                          run.template operator()<kRows, 4>(r);
                          break;
                      }
                    }
                    for (; r < re; ++r) {
                      switch (nt) {
                        case 1:
                          run.template operator()<1, 1>(r);
                          break;
                        case 2:
                          run.template operator()<1, 2>(r);
                          break;
                        case 3:
                          run.template operator()<1, 3>(r);
                          break;
                        default:
                          run.template operator()<1, 4>(r);
                          break;
                      }
                    }
                  }
                });
}

// Float matrices take a section each (they read x as floats); the quantized ones share one.
void matmul_simd(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
                 std::span<float* const> y, ThreadPool& pool) {
  if (std::none_of(w.begin(), w.end(), [](const WeightMatrix& m) { return is_float_type(m.type); }))
    return matmul_quantized(w, x, n_tokens, y, pool);
  std::vector<WeightMatrix> quantized;
  std::vector<float*> quantized_y;
  for (size_t m = 0; m < w.size(); ++m) {
    switch (w[m].type) {
      case GgmlType::kF32:
        matmul_float<GgmlType::kF32>(w[m], x, n_tokens, y[m], pool);
        break;
      case GgmlType::kF16:
        matmul_float<GgmlType::kF16>(w[m], x, n_tokens, y[m], pool);
        break;
      case GgmlType::kBF16:
        matmul_float<GgmlType::kBF16>(w[m], x, n_tokens, y[m], pool);
        break;
      default:
        quantized.push_back(w[m]);
        quantized_y.push_back(y[m]);
        break;
    }
  }
  if (!quantized.empty()) matmul_quantized(quantized, x, n_tokens, quantized_y, pool);
}

#endif  // CERTKV_MATMUL_AVX512 || CERTKV_MATMUL_AVX2

}  // namespace

bool matmul_supports(GgmlType type) { return dequantize_supports(type); }

WeightMatrix weight_matrix(GgmlType type, const uint8_t* data, int64_t n_in, int64_t n_out) {
  WeightMatrix w;
  w.type = type;
  w.data = data;
  w.n_in = n_in;
  w.n_out = n_out;
  w.row_bytes = ggml_row_bytes(type, n_in);
  return w;
}

void matmul(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool) {
  matmul(std::span<const WeightMatrix>(&w, 1), x, n_tokens, std::span<float* const>(&y, 1), pool);
}

void matmul(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
            std::span<float* const> y, ThreadPool& pool) {
  if (w.size() != y.size())
    fail(StatusCode::kInvalidArgument, "matmul: " + std::to_string(w.size()) + " matrices but " +
                                           std::to_string(y.size()) + " outputs");
  for (const WeightMatrix& wm : w) {
    check_args(wm, n_tokens, "matmul");
    if (wm.n_in != w[0].n_in)
      fail(StatusCode::kInvalidArgument,
           "matmul: matrices sharing one input have " + std::to_string(w[0].n_in) + " and " +
               std::to_string(wm.n_in) + " inputs");
  }
  if (n_tokens == 0 || std::all_of(w.begin(), w.end(), [](const WeightMatrix& m) { return m.n_out == 0; }))
    return;
  // Matrices with tiles take the tile path (model/matmul_tiles.h) whatever the number of tokens;
  // the others the path below.
  auto tiled = [](const WeightMatrix& m) { return m.tiles != nullptr && m.n_out > 0; };
  if (std::any_of(w.begin(), w.end(), tiled) && matmul_tiles_available()) {
    std::vector<WeightMatrix> with, without;
    std::vector<float*> y_with, y_without;
    for (size_t m = 0; m < w.size(); ++m) {
      (tiled(w[m]) ? with : without).push_back(w[m]);
      (tiled(w[m]) ? y_with : y_without).push_back(y[m]);
    }
    matmul_tiled(with, x, n_tokens, y_with, pool);
    if (without.empty()) return;
    return matmul(without, x, n_tokens, y_without, pool);
  }
#if defined(CERTKV_MATMUL_AVX512) || defined(CERTKV_MATMUL_AVX2)
  matmul_simd(w, x, n_tokens, y, pool);
#else
  for (size_t m = 0; m < w.size(); ++m)
    if (w[m].n_out > 0) matmul_portable(w[m], x, n_tokens, y[m], pool);
#endif
}

void matmul_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y) {
  check_args(w, n_tokens, "matmul_ref");
  std::vector<float> row(size_t(w.n_in));
  for (int64_t o = 0; o < w.n_out; ++o) {
    dequantize_row_ref(w.type, w.data + size_t(o) * w.row_bytes, row.data(), w.n_in);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * w.n_in;
      double sum = 0;
      for (int64_t i = 0; i < w.n_in; ++i) sum += double(row[size_t(i)]) * double(xt[i]);
      y[t * w.n_out + o] = float(sum);
    }
  }
}

void matmul_quantized_ref(const WeightMatrix& w, const float* x, int64_t n_tokens, float* y) {
  check_args(w, n_tokens, "matmul_quantized_ref");
  if (w.n_out == 0 || n_tokens == 0) return;
  ThreadPool single(1);
  matmul_portable(w, x, n_tokens, y, single);
}

}  // namespace certkv::model
