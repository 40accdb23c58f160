// Tensor-core tiles of decode attention, shared by the paged kernel (paged_decode_cuda.cu) and the
// sparse kernel (sparse_decode_cuda.cu): the mma / ldmatrix / movmatrix / cp.async primitives, the
// three steps of attending one 16-token tile (scores, online softmax, P V) in the layout where the
// tile's tokens are the 16 rows of mma.m16n8k16 and the query heads of one KV head its 8 columns,
// the merge of a CTA's warps into per-split partials, and the kernel that merges the splits.
// Per (split, query head) the partials are m, l, d, r: the running maximum (base 2), the sum of p,
// the meter's sum of p (e^c - 1) and its value side sum of p rho (0 where a kernel has no meter).
//
// Lane l of a warp holds tokens tq = l / 4 and tq + 8 of the tile and heads 2 hq, 2 hq + 1
// (hq = l % 4): scores s[0], s[1] (token tq), s[2], s[3] (token tq + 8); output accumulators
// o[pp][0..1] (channel 16 pp + tq), o[pp][2..3] (channel 16 pp + tq + 8), heads 2 hq + e.
//
// A tile in shared memory is 16 rows (tokens) of D 16-bit elements in one of two layouts (the
// steps below take the layout L as a template parameter): PaddedTile, rows of D + 8 elements
// (the 8 rows of an ldmatrix phase fall in 8 distinct bank groups), for tiles filled by copies of
// whole rows; SwizzledTile, rows of D elements with their 16-byte chunks permuted (tile_index),
// for tiles the page decoders write 16 bytes per lane with a quarter warp covering 4 tokens x 2 row
// halves, which in the padded layout is a 2-way bank conflict on every store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/cuda/tile_layout.h"

namespace certkv::attention::cuda::tile {

inline constexpr int kTileHeads = 8;  // query heads of one KV head: the 8 columns

template <bool kHalf>
__device__ inline void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kHalf) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The transpose of an 8 x 8 matrix of 16-bit elements held in the accumulator layout (lane l:
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1).
__device__ inline uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ inline void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

__device__ inline void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

template <bool kHalf>
__device__ inline uint32_t pack2(float lo, float hi) {
  if constexpr (kHalf) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// x rounded to the tile element (fp16 or bf16), as its bits; element_value reads them back.
template <bool kHalf>
__device__ inline uint16_t element_bits(float x) {
  if constexpr (kHalf) return __half_as_ushort(__float2half_rn(x));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <bool kHalf>
__device__ inline float element_value(uint16_t bits) {
  if constexpr (kHalf) return __half2float(__ushort_as_half(bits));
  else return __bfloat162float(__ushort_as_bfloat16(bits));
}

__device__ inline float fp16_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(uint16_t(bits)));
}

__device__ inline void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(uint32_t(__cvta_generic_to_shared(smem))), "l"(gmem)
               : "memory");
}
// 16 bytes, or 16 zero bytes when !copy (nothing is read from gmem then).
__device__ inline void cp_async16_zfill(void* smem, const void* gmem, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(uint32_t(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(copy ? 16 : 0)
               : "memory");
}
// The first `bytes` (0 to 16) of 16 bytes, the rest zero; nothing past them is read.
__device__ inline void cp_async16_bytes(void* smem, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(uint32_t(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(bytes)
               : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// fp16 pairs from bytes: {1024 + byte i, 1024 + byte i+1} (0x64 is the high byte of 1024.0).
__device__ inline uint32_t bytes_to_1024_plus(uint32_t word, int byte) {
  return __byte_perm(word, 0x64646464u, 0x4040 | byte | ((byte + 1) << 8));
}
// fp16 pairs from bytes: {-(4 + byte i / 256), -(4 + byte i+1 / 256)} (fp16 0xc4xx: sign set,
// exponent 2, the byte the low eight bits of the mantissa, whose step there is 1/256).
__device__ inline uint32_t bytes_to_minus_4_plus(uint32_t word, int byte) {
  return __byte_perm(word, 0xc4c4c4c4u, 0x4040 | byte | ((byte + 1) << 8));
}

// dither8 (docs/format/dither8.md). The deterministic remainder per channel, in steps
// (codec::kDither8Slack, 2^-8). V pages: rho_t = kDither8ValueRho sqrt(32 sum_g s_{t,g}^2) >=
// ||v^_t - v_t||, the CPU's float constant (online_softmax.h, load_error_data): (1/2 + slack),
// lifted by 2^-20 for the float sum, square root and product.
inline constexpr double kDither8Slack = 1.0 / 256.0;
inline constexpr float kDither8ValueRho = (0.5f + float(kDither8Slack)) * (1.0f + 1.0f / 1048576.0f);
inline constexpr int kQuantGroupChannels = 32;

// The Tier B weights of one query row over quantization group j (DESIGN.md section 4), in double
// like the CPU path (online_softmax.h): w = sm^2 sum q_c^2 / 12 * 2 ln(2 len / delta) and w_abs =
// |sm| 2^-8 sum |q_c| over the group's channels that are not outliers (the caller nudges both up),
// and the dither's offset (1/2)/256 sum q_c. q: the row's element bits (fp16 when kHalf);
// outliers: n channel indices (-1: none).
struct TierBWeights {
  double w, w_abs;
  float offset;
};
template <int D, bool kHalf>
__device__ inline TierBWeights tier_b_weights(const uint16_t* q, int j, const int32_t* outliers, int n, float sm_scale,
                                              int64_t len, double delta_loc) {
  double sq = 0, sa = 0, offset = 0;
  for (int c = j * kQuantGroupChannels; c < (j + 1) * kQuantGroupChannels; ++c) {
    bool outlier = false;
    for (int o = 0; o < n; ++o) outlier |= outliers[o] == c;
    if (outlier) continue;
    const double qc = element_value<kHalf>(q[c]);
    sq += qc * qc;
    sa += fabs(qc);
    offset += qc;
  }
  const double sm = double(sm_scale);
  const double log_term = 2.0 * log(2.0 * double(len) / delta_loc);
  return {sm * sm * sq / 12.0 * log_term, fabs(sm) * kDither8Slack * sa, float(offset * (0.5 / 256.0))};
}

// A batch row's length and its tables' row, checked (PagedDecodeParams' fields): a length outside
// [1, min(max_seq_len, table_stride * 16)] is corrupt, counted once (by thread 0 of the row's
// first split) and clamped; a table row outside [0, n_table_rows) is corrupt, counted, and the
// row reads nothing (length 0).
struct RowExtent {
  int64_t len, table_block;
};
template <class Params>
__device__ inline RowExtent row_extent(const Params& p, int b, unsigned int* error_word) {
  const bool counts = threadIdx.x == 0 && blockIdx.x == 0;
  int64_t len = p.seq_lens[b];
  const int64_t len_limit = min(p.max_seq_len, p.table_stride * int64_t(16));
  if (len < 1 || len > len_limit) {  // a sequence holds at least one token
    if (counts) atomicAdd(error_word, 1u);
    len = len < 1 ? 0 : len_limit;
  }
  int64_t table_block = b;
  if (p.table_rows != nullptr) {
    table_block = p.table_rows[b];
    if (table_block < 0 || table_block >= p.n_table_rows) {
      if (counts) atomicAdd(error_word, 1u);
      table_block = 0;
      len = 0;
    }
  }
  return {len, table_block};
}

// An upper bound of sqrt(v) for v >= 0, from the approximate reciprocal square root (MUFU.RSQ,
// whose relative error PTX bounds by 2^-22.9) and two products rounded toward +inf, the second by
// 1 + 2^-18 (about 30 times that error): fl(v r) >= v r >= sqrt(v) (1 - 2^-22.9), and
// (1 - 2^-22.9)(1 + 2^-18) > 1. v is taken at least 2^-126 (the approximation flushes subnormals,
// and 0 would give 0 * inf), which adds at most 2^-63 to the bound; a NaN stays NaN (max.NaN), and
// +inf gives +inf * 0, NaN: a bound of NaN is a meter of 1. About four instructions where sqrtf's
// correctly rounded root takes a refinement and a slow path; the bound exceeds the root by at most
// 2^-17 relative (paged_decode_cuda_test checks both sides on every finite float).
__device__ inline float sqrt_upper(float v) {
  float x, r;
  asm("max.NaN.f32 %0, %1, 0f00800000;" : "=f"(x) : "f"(v));  // 0x00800000: 2^-126
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return __fmul_ru(__fmul_ru(x, r), 1.f + 0x1p-18f);
}

// dither8's Tier B logit bounds of a lane's four (token, head) cells: c = sqrt(sum_g w_g s_g^2) +
// sum_g w'_g s_g with the weights of heads 2 hq + e (weight, abs_weight: [8][G]) and the scales of
// the lane's tokens tq, tq + 8 (scales[r][g]); a weight row holds kRow >= G entries. Each token's
// s_g^2 is made once for its two heads; the square root is sqrt_upper's.
template <int G, int kRow>
__device__ inline void tier_b_bounds(const float (*weight)[kRow], const float (*abs_weight)[kRow],
                                     const float (&scales)[2][G], int hq, float (&c)[4]) {
  static_assert(kRow >= G, "a weight per group");
  float squares[2][G];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int g = 0; g < G; ++g) squares[r][g] = scales[r][g] * scales[r][g];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int head = 2 * hq + (k & 1);
    float var = 0.f, sum = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      var = fmaf(weight[head][g], squares[k >> 1][g], var);
      sum = fmaf(abs_weight[head][g], scales[k >> 1][g], sum);
    }
    c[k] = sqrt_upper(var) + sum;
  }
}

// Q^T as the B operand of the scores, from the query rows in shared memory (element bits, 8 rows
// of D): channels 2 hq, 2 hq + 1 (+ 8) of head tq per 16-channel step; with word channels (dither8,
// whose K operands are a generator word of 4 channels per token and step) channels 4 hq + 0, 1
// (+ 2, 3).
template <int D, bool kWordChannels>
__device__ inline void query_operands(const uint16_t (*q)[D], int tq, int hq, uint32_t (&qb)[D / 16][2]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kWordChannels ? 16 * kk + 4 * hq : 16 * kk + 2 * hq;
    qb[kk][0] = *reinterpret_cast<const uint32_t*>(&q[tq][c]);
    qb[kk][1] = *reinterpret_cast<const uint32_t*>(&q[tq][c + (kWordChannels ? 2 : 8)]);
  }
}

// dither8: the KV head's outlier channels into shared memory, one thread each; a channel outside
// the head is corrupt: counted, and left out of the scores (-1).
template <class Params>
__device__ inline void load_outlier_channels(const Params& p, int kv_head, unsigned int* error_word, int32_t* out) {
  if (threadIdx.x < 2 * p.n_outlier_pairs) {
    int32_t c = p.outlier_channels[int64_t(kv_head) * 2 * p.n_outlier_pairs + threadIdx.x];
    if (c < 0 || c >= p.head_dim) {
      atomicAdd(error_word, 1u);
      c = -1;
    }
    out[threadIdx.x] = c;
  }
}

// dither8: keep[kk] byte j is 0 when channel 16 kk + 4 hq + j is one of the n outlier channels
// (their codes and dither leave the products: their exact values are added after).
template <int D>
__device__ inline void outlier_keep_masks(const int32_t* outliers, int n, int hq, uint32_t (&keep)[D / 16]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) keep[kk] = 0xffffffffu;
  for (int o = 0; o < n; ++o) {
    const int c = outliers[o];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int j = c - (16 * kk + 4 * hq);
      if (j >= 0 && j < 4) keep[kk] &= ~(0xffu << (8 * j));
    }
  }
}

// Scores S^T = K Q^T of one tile (fp32, unscaled). tile_k: a tile of layout L; qb: Q^T as B
// operands (channels 2 hq, 2 hq + 1 (+ 8) of head tq, per 16-channel step).
template <int D, bool kHalf, class L>
__device__ inline void tile_scores(const uint16_t* tile_k, const uint32_t (&qb)[D / 16][2], int lane, float (&s)[4]) {
  const int ld_token = ((lane >> 3) & 1) * 8 + (lane & 7);  // ldmatrix row address of this lane
  const int ld = L::offset(ld_token, lane >> 4);              // chunk 2 kk + (lane >> 4)
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t r[4];
    ldsm_x4(r, tile_k + L::at(ld, 2 * kk));
    mma16816<kHalf>(s, r, qb[kk][0], qb[kk][1]);
  }
}

// Scores S^T = K Q^T of one tile, Q^T read from shared memory by ldmatrix instead of held in
// registers (for a page class that is rare in its kernel, whose registers hold the Q^T of another
// element type). q_rows: [8][D] elements, head-major, each row's 16-byte chunks swizzled (chunk c
// of row r stored at chunk c ^ r) so that the 8 rows of an ldmatrix phase hit distinct banks.
template <int D, bool kHalf, class L>
__device__ inline void tile_scores_shared_q(const uint16_t* tile_k, const uint16_t (*q_rows)[D], int lane,
                                            float (&s)[4]) {
  const int ld_token = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int ld = L::offset(ld_token, lane >> 4);
  const int q_row = lane & 7, q_chunk = lane >> 3;  // matrix j of ldsm_x4: channels 32 kp + 8 j
#pragma unroll
  for (int kp = 0; kp < D / 32; ++kp) {
    uint32_t qb[4];  // B operands of steps 2 kp (qb[0], qb[1]) and 2 kp + 1 (qb[2], qb[3])
    ldsm_x4(qb, &q_rows[q_row][8 * ((4 * kp + q_chunk) ^ q_row)]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t r[4];
      ldsm_x4(r, tile_k + L::at(ld, 2 * (2 * kp + j)));
      mma16816<kHalf>(s, r, qb[2 * j], qb[2 * j + 1]);
    }
  }
}

// Where channel c of head row g lives in a q_rows tile of tile_scores_shared_q.
template <int D>
__host__ __device__ constexpr int shared_q_index(int g, int c) {
  return g * D + 8 * ((c / 8) ^ (g % 8)) + c % 8;
}

// Online softmax (base 2) over one tile, per head 2 hq + e: s are logits in log2 units, -inf where
// masked. Updates the running max and this lane's partial sum, returns the probabilities, the
// rescale of the earlier state, and the new max (per head).
__device__ inline void tile_softmax(const float (&s)[4], float (&m_run)[2], float (&l_run)[2], float (&prob)[4],
                                    float (&rescale)[2], float (&m_new)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mx = fmaxf(s[e], s[2 + e]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    m_new[e] = fmaxf(m_run[e], mx);
    rescale[e] = m_run[e] == -INFINITY ? 0.f : exp2f(m_run[e] - m_new[e]);
    float l_add = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int k = 2 * j + e;
      prob[k] = s[k] == -INFINITY ? 0.f : exp2f(s[k] - m_new[e]);
      l_add += prob[k];
    }
    l_run[e] = l_run[e] * rescale[e] + l_add;
    m_run[e] = m_new[e];
  }
}

// The meter's term p (e^c - 1) of one (head, token), c >= 0, never below the exact value by more
// than the 2^-12 lift of A - 1 covers (docs/cuda.md). Below c = 1/4 a degree-5 upper bound:
// e^c - 1 - sum_{k=1..4} c^k / k! = c^5 sum_j c^j / (j + 5)! <= c^5 e^c / 120 <= 0.0107003 c^5 (the
// coefficients rounded up, all terms positive, relative rounding error below 2^-20; it exceeds
// e^c - 1 by at most 10^-5 relative); then one exponential: e^c - 1 >= 0.28, so the subtraction
// loses at most a factor 4.6 of its relative error; from c = 8 as one exponential of
// log2 p + c log2 e (p e^c alone would overflow float long before the product does).
// Without branches: the lanes of a warp hold cells of every range, and the divergent version ran
// every path anyway plus its branch overhead. The values are those of the three-way branch to the
// bit: one exponential serves both upper ranges, its argument c log2 e rounded once, plus log2 p
// rounded once more above 8 (explicit roundings, so that no FMA contraction merges the two).
__device__ inline float meter_term(float p, float c, float log2_p) {
  const float small = p * (c * (1.f + c * (0.5f + c * (1.f / 6.f + c * (1.f / 24.f + c * 0.0107003f)))));
  const bool mid = c < 8.f;
  const float ck = __fmul_rn(c, 1.4426950408889634f);  // log2 e
  const float e = exp2f(mid ? ck : __fadd_rn(log2_p, ck));
  const float large = mid ? p * (e - 1.f) : e - p;
  return c < 0.25f ? small : large;
}

// O^T *= rescale (per head 2 hq + e): the earlier tiles' output under the new maximum.
template <int D>
__device__ inline void rescale_output(const float (&rescale)[2], float (&o)[D / 16][4]) {
#pragma unroll
  for (int pp = 0; pp < D / 16; ++pp) {
    o[pp][0] *= rescale[0];
    o[pp][1] *= rescale[1];
    o[pp][2] *= rescale[0];
    o[pp][3] *= rescale[1];
  }
}

// P^T as the B operand of O^T = V^T P^T: the two 8 x 8 halves of the probability tile (tokens
// 0..7 and 8..15), transposed by movmatrix from the accumulator layout of the scores.
template <bool kHalf>
__device__ inline void probability_operands(const float (&prob)[4], uint32_t& pb0, uint32_t& pb1) {
  pb0 = transpose8x8(pack2<kHalf>(prob[0], prob[1]));
  pb1 = transpose8x8(pack2<kHalf>(prob[2], prob[3]));
}

// O^T = rescale O^T + V^T P^T over one tile: P^T as the B operand from the two 8 x 8 halves of
// the probability tile (movmatrix), V^T by ldmatrix.trans. tile_v: a tile of layout L.
template <int D, bool kHalf, class L>
__device__ inline void tile_pv(const uint16_t* tile_v, const float (&prob)[4], const float (&rescale)[2], int lane,
                               float (&o)[D / 16][4]) {
  rescale_output<D>(rescale, o);
  uint32_t pb0, pb1;
  probability_operands<kHalf>(prob, pb0, pb1);
  const int vt_token = (lane >> 4) * 8 + (lane & 7);
  const int vt = L::offset(vt_token, (lane >> 3) & 1);  // chunk 2 pp + ((lane >> 3) & 1)
#pragma unroll
  for (int pp = 0; pp < D / 16; ++pp) {
    uint32_t r[4];
    ldsm_x4_trans(r, tile_v + L::at(vt, 2 * pp));
    mma16816<kHalf>(o[pp], r, pb0, pb1);
  }
}

// Partials per (split, query head) in the workspace: m, l, d, r.
inline constexpr int kSplitPartials = 4;

// The partial state of the CTA's warps, merged in shared memory.
template <int D, int kWarps>
struct WarpMerge {
  float m[kWarps][kTileHeads], l[kWarps][kTileHeads], d[kWarps][kTileHeads], r[kWarps][kTileHeads];
  float o[kWarps][kTileHeads][D];
};

// Reduces each lane's partial sums over the 8 lanes of its heads, merges the CTA's warps in mg
// (callers synchronize the CTA before: mg usually aliases the tiles), and writes rows
// part_row0 + g (g < group) of the split partials: part_mldr[row][split][kSplitPartials] (m, l, d,
// r), part_o[row][split][D]. d_run, r_run: the meter's running sums (zeros without a meter).
template <int D, int kWarps>
__device__ inline void write_split_partials(WarpMerge<D, kWarps>& mg, int warp, int lane, float (&m_run)[2],
                                            float (&l_run)[2], float (&d_run)[2], float (&r_run)[2],
                                            const float (&o)[D / 16][4], int group, int64_t part_row0, int n_splits,
                                            int split, float* part_mldr, float* part_o) {
  const int tq = lane >> 2, hq = lane & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], x);
      d_run[e] += __shfl_xor_sync(0xffffffffu, d_run[e], x);
      r_run[e] += __shfl_xor_sync(0xffffffffu, r_run[e], x);
    }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int head = 2 * hq + e;
    if (tq == 0) {
      mg.m[warp][head] = m_run[e];
      mg.l[warp][head] = l_run[e];
      mg.d[warp][head] = d_run[e];
      mg.r[warp][head] = r_run[e];
    }
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) {
      mg.o[warp][head][16 * pp + tq] = o[pp][e];
      mg.o[warp][head][16 * pp + tq + 8] = o[pp][2 + e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int g = i / D, c = i % D;
    float big = -INFINITY;
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, mg.m[w][g]);
    float acc = 0.f, l = 0.f, d = 0.f, r = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      if (mg.m[w][g] == -INFINITY) continue;
      const float f = exp2f(mg.m[w][g] - big);
      acc += f * mg.o[w][g][c];
      l += f * mg.l[w][g];
      d += f * mg.d[w][g];
      r += f * mg.r[w][g];
    }
    const int64_t part = (part_row0 + g) * n_splits + split;
    part_o[part * D + c] = acc;
    if (c == 0)
      *reinterpret_cast<float4*>(part_mldr + part * kSplitPartials) = make_float4(big, l, d, r);
  }
}

// A merged row's meter from its sums over every split: A - 1 = d / l and the value side r / l,
// each lifted by 2^-12 relative for the float sums over the tokens, warps and splits
// (docs/cuda.md); the meter min(1, (A^2 - 1) / 2) = min(1, (A - 1) + (A - 1)^2 / 2). Each output
// may be null.
__device__ inline void write_row_meter(int64_t row, float l, float d, float r, float* meter, float* a_minus_1,
                                       float* value_rho) {
  constexpr double kLift = 1.0 + 1.0 / 4096.0;
  if (meter != nullptr || a_minus_1 != nullptr) {
    // A warp's d overflows float when a token's p (e^c - 1) does relative to that warp's
    // maximum (c >= ln FLT_MAX); scaled by a split weight that underflows, it becomes NaN. Either
    // way A - 1 is reported as +inf and the meter as 1 (sound).
    const double am1 = double(d) / double(l) * kLift;
    const bool finite = isfinite(am1);
    const double bound = finite ? fmin(1.0, am1 + 0.5 * am1 * am1) : 1.0;
    if (a_minus_1 != nullptr) a_minus_1[row] = finite ? float(am1) : INFINITY;
    if (meter != nullptr) meter[row] = float(bound);
  }
  if (value_rho != nullptr) value_rho[row] = float(double(r) / double(l) * kLift);
}

// Merges the splits of each (sequence, query head) by their log-sum-exp weights (base 2):
// out = sum_s 2^{m_s - M} o_s / sum_s 2^{m_s - M} l_s, and likewise A - 1 = sum 2^{..} d_s / L and
// the value side sum_t p_t rho_t = sum 2^{..} r_s / L. One CTA of kMergeThreads per row: the
// split weights are reduced across the CTA and staged in shared memory (kMergeWeights at a time),
// then each warp sums the partial outputs of every kMergeWarps-th split, a lane D / 32 channels
// of each (one vector load), and the warps' sums are added in a fixed order. (One thread per
// channel walking every split took 14-18 us at batch 1, 49-66 splits: H200 run 8.)
// part_mldr: [rows][n_splits][kSplitPartials] (m, l, d, r: base-2 running max, sum of p, sum of
// p (e^c - 1), sum of p rho); part_o: [rows][n_splits][D]; out: [rows][D]; meter, a_minus_1,
// value_rho: [rows] or null. Launch with kMergeThreads threads.
inline constexpr int kMergeThreads = 256;
inline constexpr int kMergeWarps = kMergeThreads / 32;
inline constexpr int kMergeWeights = 1024;

// N = 2 or 4 floats from a 4N-byte aligned address, as one vector load.
template <int N>
__device__ inline void load_floats(const float* src, float (&dst)[N]) {
  if constexpr (N == 4) {
    const float4 x = *reinterpret_cast<const float4*>(src);
    dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
  } else {
    static_assert(N == 2, "2 or 4 floats");
    const float2 x = *reinterpret_cast<const float2*>(src);
    dst[0] = x.x, dst[1] = x.y;
  }
}

// No __launch_bounds__: with one, ptxas held the kernel to 32 registers and spilled.
template <int D>
__global__ void merge_splits_kernel(float* out, float* meter, float* a_minus_1, float* value_rho, int n_splits,
                                    const float* part_mldr, const float* part_o) {
  static_assert(D == 64 || D == 128, "D / 32 channels per lane as one vector");
  constexpr int V = D / 32;
  __shared__ float red[4][kMergeWarps];
  __shared__ float weight[kMergeWeights];
  __shared__ float warp_sum[kMergeWarps][D];
  const int64_t row = blockIdx.x;  // b * n_q_heads + h
  const float* mldr = part_mldr + row * n_splits * kSplitPartials;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float big = -INFINITY;
  for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) big = fmaxf(big, mldr[kSplitPartials * s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
  if (lane == 0) red[0][warp] = big;
  __syncthreads();
  big = red[0][0];
  for (int w = 1; w < kMergeWarps; ++w) big = fmaxf(big, red[0][w]);
  float l = 0.f, d = 0.f, r = 0.f;
  for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) {
    const float4 x = *reinterpret_cast<const float4*>(mldr + kSplitPartials * s);
    if (x.x == -INFINITY) continue;
    const float f = exp2f(x.x - big);
    l += f * x.y;
    d += f * x.z;
    r += f * x.w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    l += __shfl_xor_sync(0xffffffffu, l, o);
    d += __shfl_xor_sync(0xffffffffu, d, o);
    r += __shfl_xor_sync(0xffffffffu, r, o);
  }
  __syncthreads();
  if (lane == 0) {
    red[1][warp] = l;
    red[2][warp] = d;
    red[3][warp] = r;
  }
  __syncthreads();
  l = 0.f;
  d = 0.f;
  r = 0.f;
  for (int w = 0; w < kMergeWarps; ++w) {  // the same order in every thread
    l += red[1][w];
    d += red[2][w];
    r += red[3][w];
  }
  const float* po = part_o + row * int64_t(n_splits) * D + lane * V;
  float o[V];
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = 0.f;
  for (int first = 0; first < n_splits; first += kMergeWeights) {
    const int n = min(kMergeWeights, n_splits - first);
    __syncthreads();  // the previous weights are used
    for (int s = threadIdx.x; s < n; s += kMergeThreads) {
      const float m = mldr[kSplitPartials * (first + s)];
      weight[s] = m == -INFINITY ? 0.f : exp2f(m - big);
    }
    __syncthreads();
#pragma unroll 4
    for (int s = warp; s < n; s += kMergeWarps) {
      const float f = weight[s];
      float x[V];
      load_floats<V>(po + int64_t(first + s) * D, x);
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] += f * x[i];
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) warp_sum[warp][lane * V + i] = o[i];
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += kMergeThreads) {
    float acc = 0.f;
    for (int w = 0; w < kMergeWarps; ++w) acc += warp_sum[w][c];
    out[row * D + c] = l > 0.f ? acc / l : 0.f;  // l = 0 only when every token was masked (a corrupt length)
  }
  if (threadIdx.x == 0) write_row_meter(row, l, d, r, meter, a_minus_1, value_rho);
}

}  // namespace certkv::attention::cuda::tile
