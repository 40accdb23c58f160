#include "attention/cuda/sparse_decode_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <iterator>
#include <string>

#include "attention/cuda/bit_mma_layout.h"
#include "attention/cuda/tile_mma.cuh"
#include "index/code_dot.h"
#include "index/top_p_buckets.h"

namespace certkv::attention::cuda {

namespace {

using namespace tile;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kEstimateThreads = 128;
constexpr int kEstimateTokens = 1024;  // tokens per CTA of the estimate
constexpr int kTopPThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;

// A sequence's indexed tokens and length as the kernels use them: device values outside what the
// host planned (negative, past max_indexed, past the block tables) are clamped, never read past.
// A row whose table row lies outside the tables has nothing (no index, no window).
__device__ inline int64_t table_row_of(const SparseDecodeParams& p, int b) {
  return p.table_rows != nullptr ? int64_t(p.table_rows[b]) : int64_t(b);
}
__device__ inline bool row_readable(const SparseDecodeParams& p, int b) {
  const int64_t r = table_row_of(p, b);
  return p.table_rows == nullptr || (r >= 0 && r < p.n_table_rows);
}
__device__ inline int64_t indexed_of(const SparseDecodeParams& p, int b) {
  if (!row_readable(p, b)) return 0;
  return min(max(int64_t(p.n_indexed[b]), int64_t(0)), p.max_indexed);
}
__device__ inline int64_t length_of(const SparseDecodeParams& p, int b) {
  if (!row_readable(p, b)) return 0;
  const int64_t n = indexed_of(p, b);
  return max(n, min(min(int64_t(p.seq_lens[b]), n + p.max_window), min(p.max_seq_len, p.table_stride * kTileTokens)));
}
// The records of (row b, kv_head) and the first entry of its block tables.
template <typename Record>
__device__ inline const Record* records_of(const SparseDecodeParams& p, int b, int kv_head) {
  const int64_t r = row_readable(p, b) ? table_row_of(p, b) : 0;
  return static_cast<const Record*>(p.records) + (r * p.n_kv_heads + kv_head) * p.record_stride;
}
__device__ inline int64_t table_start_of(const SparseDecodeParams& p, int b, int kv_head) {
  const int64_t r = row_readable(p, b) ? table_row_of(p, b) : 0;
  const int64_t row_stride = p.table_row_stride > 0 ? p.table_row_stride : int64_t(p.n_kv_heads) * p.table_stride;
  return r * row_stride + int64_t(kv_head) * p.table_stride;
}

// ---------------------------------------------------------------------------------------------
// 1. The estimate: tiles of 16 indexed tokens per warp, every query head of their KV head.

// Order-preserving map of floats to unsigned integers (larger float, larger key; -inf > 0).
__device__ inline uint32_t ordered_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ inline float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The per-query constants of Eq. 20 and Eq. 6 (index::rabitq_estimate_scores_popcount).
struct QueryTerms {
  float two_delta, two_q_l, query_term, norm_over_sqrt_d, bias;
};

template <int D>
__device__ inline QueryTerms query_terms(const DeviceRabitqQuery& q) {
  QueryTerms t;
  t.two_delta = 2.f * q.delta;
  t.two_q_l = 2.f * q.q_l;
  t.query_term = __fsub_rn(-q.delta * float(q.sum_q_u), float(D) * q.q_l);
  t.norm_over_sqrt_d = q.norm_q_centered / sqrtf(float(D));
  t.bias = q.q_dot_ck - q.cq_dot_ck;
  return t;
}

// The float steps of index::rabitq_estimate_scores_popcount, in its order and unfused: Eq. 20,
// <c', q_bar> = 2 delta <c_b, q_u> + 2 q_l sum c_b - delta sum q_u - D q_l; Eq. 6; times sm_scale.
__device__ inline float estimated_logit(const QueryTerms& q, int32_t cb_dot_qu, float popcount, float norm_k,
                                        float alpha, float cq_dot_k, float sm_scale) {
  const float c_prime =
      __fadd_rn(__fadd_rn(__fmul_rn(q.two_delta, float(cb_dot_qu)), __fmul_rn(q.two_q_l, popcount)), q.query_term);
  const float product = __fdiv_rn(__fmul_rn(__fmul_rn(q.norm_over_sqrt_d, norm_k), c_prime), alpha);
  return __fmul_rn(__fadd_rn(__fadd_rn(product, q.bias), cq_dot_k), sm_scale);
}

// Whether a head of the group widens its set (a positive margin): the estimate then writes each
// token's key norm beside the logits for the selection, which reads it only then.
__device__ inline bool group_widens(const DeviceRabitqQuery* group_queries, int group) {
  bool widening = false;
  for (int g = 0; g < group; ++g) widening |= group_queries[g].margin_scale > 0.f;
  return widening;
}

// A token's record; 32-byte records (D = 128) as two 16-byte loads (the list's base is 16-byte
// aligned: check() requires it of the records, and every record starts on a multiple of 32).
template <int D>
__device__ inline index::RabitqRecord<D> load_record(const index::RabitqRecord<D>* at) {
  index::RabitqRecord<D> rec;
  if constexpr (sizeof(rec) % 16 == 0) {
    uint4 words[sizeof(rec) / 16];
#pragma unroll
    for (int i = 0; i < int(sizeof(rec) / 16); ++i) words[i] = reinterpret_cast<const uint4*>(at)[i];
    memcpy(&rec, words, sizeof(rec));
  } else {
    rec = *at;
  }
  return rec;
}

// head_max: each row's largest logit (ordered_key); norms: each token's key norm
// ([list][max_indexed]), written when the group widens, for the selection's widening margins.
//
// With at most 4 query heads per KV head: one thread per token, <c_b, q_u> =
// sum_b 2^b popcount(c_b & plane_b) in carry-save form (index::code_dot_planes: 6 POPC per
// (token, head) at D = 128 where counting plane by plane took 16), two records loaded
// before either token's logits are stored (the stores would otherwise order the next load behind
// them). With more heads the tensor-core form below is faster; with 4 it was slower (docs/bench/cuda_history.md).
template <int D>
__global__ void __launch_bounds__(kEstimateThreads) estimate_by_popcount_kernel(SparseDecodeParams p, float* logits,
                                                                                 uint32_t* head_max, float* norms) {
  static_assert(D % 32 == 0 && D <= 128, "two 64-bit code words at most");
  static_assert(index::kRabitqQueryBits == 4, "index::code_dot_planes adds 4 planes");
  constexpr int kWords = D / 32;  // 32-bit words of a code and of a plane
  __shared__ QueryTerms terms[kTileHeads];
  __shared__ uint32_t planes[kTileHeads][index::kRabitqQueryBits][kWords];
  __shared__ uint32_t cta_max[kTileHeads];
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.n_q_heads / p.n_kv_heads;
  const DeviceRabitqQuery* queries = p.queries + int64_t(b) * p.n_q_heads + kv_head * group;
  if (threadIdx.x < group) {
    terms[threadIdx.x] = query_terms<D>(queries[threadIdx.x]);
    for (int bit = 0; bit < index::kRabitqQueryBits; ++bit)
      for (int w = 0; w < kWords; ++w)
        planes[threadIdx.x][bit][w] = bit_mma_word(queries[threadIdx.x].planes[bit], w, kWords);
    cta_max[threadIdx.x] = 0;
  }
  __syncthreads();
  const bool widening = group_widens(queries, group);
  const int64_t n = indexed_of(p, b);
  const int64_t list = int64_t(b) * p.n_kv_heads + kv_head;
  const auto* records = records_of<index::RabitqRecord<D>>(p, b, kv_head);
  float* row_logits = logits + (int64_t(b) * p.n_q_heads + kv_head * group) * p.max_indexed;
  uint32_t key_max[kTileHeads] = {};
  auto estimate = [&](const index::RabitqRecord<D>& rec, int64_t t) {
    if (widening) norms[list * p.max_indexed + t] = rec.norm_k_centered;
    uint32_t code[kWords];
#pragma unroll
    for (int w = 0; w < kWords; ++w) code[w] = bit_mma_word(rec.code, w, kWords);
#pragma unroll
    for (int g = 0; g < kTileHeads; ++g) {
      if (g >= group) break;
      const int32_t cb_dot_qu = index::code_dot_planes<kWords>(code, planes[g]);  // exact
      const float logit = estimated_logit(terms[g], cb_dot_qu, float(rec.code_popcount), rec.norm_k_centered,
                                          rec.alpha, rec.cq_dot_k, p.sm_scale);
      row_logits[int64_t(g) * p.max_indexed + t] = logit;
      key_max[g] = max(key_max[g], ordered_key(logit));
    }
  };
  const int64_t end = min(n, int64_t(blockIdx.x + 1) * kEstimateTokens);
  for (int64_t t = int64_t(blockIdx.x) * kEstimateTokens + threadIdx.x; t < end; t += 2 * kEstimateThreads) {
    const int64_t u = t + kEstimateThreads;
    const index::RabitqRecord<D> first = load_record(records + t);
    index::RabitqRecord<D> second{};
    if (u < end) second = load_record(records + u);
    estimate(first, t);
    if (u < end) estimate(second, u);
  }
  // The rows' largest logits (for the Top-p gaps): warp maxima, the CTA's in shared memory, one
  // atomic per row and CTA.
#pragma unroll
  for (int g = 0; g < kTileHeads; ++g) {
    uint32_t k = key_max[g];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
    if ((threadIdx.x & 31) == 0 && g < group && k != 0) atomicMax(&cta_max[g], k);
  }
  __syncthreads();
  if (threadIdx.x < group && cta_max[threadIdx.x] != 0)
    atomicMax(&head_max[int64_t(b) * p.n_q_heads + kv_head * group + threadIdx.x], cta_max[threadIdx.x]);
}

// mma.sync m16n8k32, u8 x u8 -> s32, accumulating into d: A 16 x 32 (rows), B 32 x 8 (columns).
__device__ inline void mma_u8(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// mma.sync m16n8k128 .b1 AND-POPC, accumulating into d: A 16 x 128 bits (rows), B 128 x 8 bits
// (columns), d[r][n] += popcount(row r & column n); the fragments are in bit_mma_layout.h.
__device__ inline void mma_b1(int32_t (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b));
}

// Bits 0..3 of x as bytes 0..3, each 0 or 1 (the four shifted copies x, x << 7, x << 14, x << 21
// do not overlap, so the product carries nothing).
__device__ inline uint32_t nibble_bytes(uint32_t x) { return ((x & 0xfu) * 0x00204081u) & 0x01010101u; }

// 32-bit word w of a record's code (bit j of word w is coordinate 32 w + j).
template <int D>
__device__ inline uint32_t code_word(const index::RabitqRecord<D>& rec, int w) {
  return bit_mma_word(rec.code, w, D / 32);
}

// Tokens of a warp's stage of records in shared memory (4 tiles of 16).
constexpr int kEstimateStageTokens = 64;

// The tensor-core forms, for tiles of 16 tokens and the group's (up to 8) query heads at once.
// Each warp copies stages of 64 records into shared memory (cp.async, one stage in flight while
// the other is used) and takes their tiles of 16 tokens; a lane holds tokens row and row + 8 of
// a tile and two heads (its slots) of the group, and computes the float steps of those cells.
// The sums are exact in s32 (at most 15 D), the same integers as the CPU's
// sum_b 2^b popcount(c_b & plane_b).
// - kByteMma: <c_b, q_u> = sum_i c_b[i] q_u[i], the tokens' code bits as 0 / 1 bytes (rows of A,
//   a lane expanding two nibbles of each 32-bit word of its two tokens), each head's q_u in
//   [0, 15] as bytes (columns of B, built once per CTA in shared memory), k = 32 dimensions per
//   m16n8k32 u8 mma; a lane's slots are heads 2 quad and 2 quad + 1. The popcount form took 16
//   POPC per (token, head), which bound the kernel (16 per clock and SM); but at 4 heads half the
//   lanes idle in the float steps (a fold of the second token onto them still left the kernel
//   slower than the popcount form: 195 against 171 us, docs/bench/cuda_history.md).
// - kBitMma: the code words themselves as the rows of A and the query's bit planes as the columns
//   of B, one m16n8k128 .b1 AND-POPC per 8 (head, plane) columns: two for a group of up to 4,
//   four up to 8, no expansion of the codes; a lane's slots are heads quad and quad + 4, so a
//   group of 4 keeps every lane busy in the float steps (bit_mma_layout.h). Not yet timed on the
//   device.
template <int D, EstimateForm F>
__global__ void __launch_bounds__(kEstimateThreads) estimate_by_mma_kernel(SparseDecodeParams p, float* logits,
                                                                            uint32_t* head_max, float* norms) {
  static_assert(D % 32 == 0 && D <= 128, "k-blocks of 32 dimensions, two code words at most");
  static_assert(F == EstimateForm::kByteMma || F == EstimateForm::kBitMma, "a tensor-core form");
  constexpr bool kBits = F == EstimateForm::kBitMma;
  using Record = index::RabitqRecord<D>;
  constexpr int kBlocks = D / 32;  // k-blocks of the byte form; 32-bit code words
  constexpr int kWarpsPerCta = kEstimateThreads / 32;
  constexpr int kStageBytes = kEstimateStageTokens * int(sizeof(Record));
  static_assert(kStageBytes % 16 == 0, "a stage is whole 16-byte pieces");
  static_assert(kBlocks <= kBitMmaWords, "a code fits one 128-bit row");
  __shared__ QueryTerms terms[kTileHeads];
  __shared__ alignas(16) uint8_t q_u[kBits ? 1 : kTileHeads][D];  // bytes: 0 for the heads past the group
  __shared__ uint32_t planes[kBits ? kTileHeads : 1][index::kRabitqQueryBits][kBitMmaWords];  // bits: likewise
  __shared__ alignas(16) Record stage[kWarpsPerCta][2][kEstimateStageTokens];
  __shared__ uint32_t cta_max[kTileHeads];
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = lane >> 2, quad = lane & 3;
  const int64_t n = indexed_of(p, b);
  const int64_t first = int64_t(blockIdx.x) * kEstimateTokens, end = min(n, first + kEstimateTokens);
  const Record* records = records_of<Record>(p, b, kv_head);
  // Stage j of this warp: tokens first + 64 (warp + 4 j) onward, the bytes past `end` zero.
  auto stage_first = [&](int j) { return first + int64_t(kEstimateStageTokens) * (warp + kWarpsPerCta * j); };
  auto copy_stage = [&](int j) {
    const int64_t t0 = stage_first(j);
    const int64_t valid = max(int64_t(0), min(end - t0, int64_t(kEstimateStageTokens))) * int64_t(sizeof(Record));
    const char* src = reinterpret_cast<const char*>(records + t0);
    char* dst = reinterpret_cast<char*>(stage[warp][j % 2]);
    for (int c = lane; c < kStageBytes / 16; c += 32) {
      const int bytes = int(max(int64_t(0), min(valid - 16 * c, int64_t(16))));
      cp_async16_bytes(dst + 16 * c, bytes > 0 ? src + 16 * c : reinterpret_cast<const char*>(records), bytes);
    }
    cp_async_commit();
  };
  copy_stage(0);  // in flight while the CTA builds the query side
  const DeviceRabitqQuery* queries = p.queries + int64_t(b) * p.n_q_heads + kv_head * group;
  if (threadIdx.x < kTileHeads) {
    terms[threadIdx.x] = threadIdx.x < group ? query_terms<D>(queries[threadIdx.x]) : QueryTerms{};
    cta_max[threadIdx.x] = 0;
  }
  if constexpr (kBits) {
    // Plane `bit` of head h as 32-bit words, 0 past the group and past the head dim.
    for (int i = threadIdx.x; i < kTileHeads * index::kRabitqQueryBits * kBitMmaWords; i += kEstimateThreads) {
      const int h = i / (index::kRabitqQueryBits * kBitMmaWords), bit = i / kBitMmaWords % index::kRabitqQueryBits,
                w = i % kBitMmaWords;
      planes[h][bit][w] = h < group ? bit_mma_word(queries[h].planes[bit], w, kBlocks) : 0u;
    }
  } else {
    // q_u by 8 dimensions per thread: one byte of each plane, bit e of it the bit of dimension d + e.
    for (int i = threadIdx.x; i < kTileHeads * D / 8; i += kEstimateThreads) {
      const int h = i / (D / 8), d = 8 * (i % (D / 8));
      uint64_t levels = 0;  // byte e: q_u[d + e]
      if (h < group)
        for (int bit = 0; bit < index::kRabitqQueryBits; ++bit) {
          const uint32_t plane = uint32_t(queries[h].planes[bit][d / 64] >> (d % 64)) & 0xffu;
          for (int e = 0; e < 8; ++e) levels |= uint64_t((plane >> e) & 1u) << (8 * e + bit);
        }
      *reinterpret_cast<uint64_t*>(&q_u[h][d]) = levels;
    }
  }
  __syncthreads();
  // B. Bytes: head `row`'s q_u at dimensions 32 k + 4 quad .. + 3 and 16 more. Bits: word `quad`
  // of column `row` of each tile.
  uint32_t bq[kBits ? kBitMmaTiles : kBlocks][2];
#pragma unroll
  for (int k = 0; k < (kBits ? kBitMmaTiles : kBlocks); ++k) {
    if constexpr (kBits) {
      bq[k][0] = bit_mma_b_register(planes, k, row, quad);
      bq[k][1] = 0;
    } else {
      bq[k][0] = *reinterpret_cast<const uint32_t*>(&q_u[row][32 * k + 4 * quad]);
      bq[k][1] = *reinterpret_cast<const uint32_t*>(&q_u[row][32 * k + 16 + 4 * quad]);
    }
  }
  // The head of the lane's slot s (0 or 1). The bit form keeps its slots' terms in registers (59
  // registers at D = 128, 8 CTAs per multiprocessor; its rows' logit pointers too would take 70,
  // 7 CTAs); the byte form reads them from shared memory (in registers: 58 -> 68, 7 CTAs).
  auto slot_head = [&](int s) { return kBits ? bit_mma_lane_head(quad, s) : 2 * quad + s; };
  [[maybe_unused]] const QueryTerms slot_terms[2] = {terms[slot_head(0)], terms[slot_head(1)]};
  float* row_logits = logits + (int64_t(b) * p.n_q_heads + kv_head * group) * p.max_indexed;
  float* list_norms = norms + (int64_t(b) * p.n_kv_heads + kv_head) * p.max_indexed;
  const bool widening = group_widens(queries, group);
  uint32_t key_max[2] = {0, 0};
  for (int j = 0; stage_first(j) < end; ++j) {
    if (stage_first(j + 1) < end) {
      copy_stage(j + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const Record* staged = stage[warp][j % 2];
#pragma unroll 1
    for (int tile = 0; tile < kEstimateStageTokens / 16; ++tile) {
      const int64_t base = stage_first(j) + 16 * tile;
      if (base >= end) break;
      const Record tok[2] = {staged[16 * tile + row], staged[16 * tile + row + 8]};
      int32_t dot[4];  // <c_b, q_u> of the cells (row, slot 0), (row, slot 1), (row + 8, slot 0), (row + 8, slot 1)
      if constexpr (kBits) {
        // A: word `quad` of the codes of tokens row and row + 8 (0 past the head dim), read from
        // the staged records in shared memory.
        const uint32_t a[2] = {bit_mma_word(staged[16 * tile + bit_mma_a_token(row, 0)].code, quad, kBlocks),
                               bit_mma_word(staged[16 * tile + bit_mma_a_token(row, 1)].code, quad, kBlocks)};
        int32_t acc[kBitMmaTiles][4] = {};
        mma_b1(acc[0], a, bq[0][0]);
        mma_b1(acc[1], a, bq[1][0]);
        if (bit_mma_tiles(group) == 4) {  // uniform over the CTA
          mma_b1(acc[2], a, bq[2][0]);
          mma_b1(acc[3], a, bq[3][0]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) dot[i] = bit_mma_cell_dot(acc, i);
      } else {
        int32_t acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k < kBlocks; ++k) {
          const uint32_t w0 = code_word(tok[0], k), w1 = code_word(tok[1], k);
          const uint32_t a[4] = {nibble_bytes(w0 >> (4 * quad)), nibble_bytes(w1 >> (4 * quad)),
                                 nibble_bytes(w0 >> (16 + 4 * quad)), nibble_bytes(w1 >> (16 + 4 * quad))};
          mma_u8(acc, a, bq[k]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) dot[i] = acc[i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = slot_head(i & 1);
        const int token = i >> 1;  // 0: row, 1: row + 8
        const int64_t t = base + row + 8 * token;
        if (t >= end) continue;
        // The token's fields by selects (indexing tok[] by a run-time value would put it in local memory).
        const float norm_k = token ? tok[1].norm_k_centered : tok[0].norm_k_centered;
        const float alpha = token ? tok[1].alpha : tok[0].alpha;
        const float cq_dot_k = token ? tok[1].cq_dot_k : tok[0].cq_dot_k;
        const float popcount = float(token ? tok[1].code_popcount : tok[0].code_popcount);
        if ((i & 1) == 0 && widening && quad == 0) list_norms[t] = norm_k;  // one lane per token
        if (h >= group) continue;
        const float logit = estimated_logit(kBits ? slot_terms[i & 1] : terms[h], dot[i], popcount, norm_k, alpha,
                                            cq_dot_k, p.sm_scale);
        row_logits[int64_t(h) * p.max_indexed + t] = logit;
        key_max[i & 1] = max(key_max[i & 1], ordered_key(logit));
      }
    }
    __syncwarp();  // every lane is done with this buffer before the next copy into it
  }
  cp_async_wait<0>();  // a warp past `end` from the start still has its (empty) first stage
  // The rows' largest logits (for the Top-p gaps): over the lanes of a quad position (the same
  // heads), then the CTA's in shared memory, one atomic per row and CTA.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    uint32_t k = key_max[j];
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
    if (row == 0 && k != 0) atomicMax(&cta_max[slot_head(j)], k);
  }
  __syncthreads();
  if (threadIdx.x < group && cta_max[threadIdx.x] != 0)
    atomicMax(&head_max[int64_t(b) * p.n_q_heads + kv_head * group + threadIdx.x], cta_max[threadIdx.x]);
}

// ---------------------------------------------------------------------------------------------
// 2. The Top-p threshold: index::top_p_select on the device (index/top_p.h, the arithmetic of
// index/top_p_buckets.h): a histogram of each row's logits in 16-bit fixed point (1/256 logit
// below the row's largest), then one CTA per (sequence, query head) finds the first bucket B
// whose upper set certainly holds mass p, and theta, the lowest float of B. Every token of B is
// selected (select_kernel compares with theta).

template <typename T, typename Op>
__device__ inline T block_reduce(T v, Op op, T* scratch) {  // scratch: 32 entries
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = op(r, scratch[w]);
  return r;
}

// The sum of v over the CTA's threads before this one (in thread order), and the total.
// scratch: 33 entries.
__device__ inline unsigned long long block_exclusive_sum(unsigned long long v, unsigned long long* total,
                                                         unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long w = lane < int(blockDim.x >> 5) ? scratch[lane] : 0;
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += y;
    }
    scratch[lane] = wi - w;  // the warps before this one
    if (lane == 31) scratch[32] = wi;
  }
  __syncthreads();
  *total = scratch[32];
  return scratch[warp] + incl - v;
}

// The histogram and threshold passes: a CTA of kPassThreads takes pass_tokens(p) tokens of one row
// (a multiple of 16, so every span starts on a 16-byte boundary of the row).
constexpr int kPassQuantum = 4096;
constexpr int kPassThreads = 256;

// Calls f(x, t, valid) for the logits x = row[t] of [t0, t1), read as 16-byte vectors, two per
// thread and iteration issued before either is used; valid is false for the vectors' tail past
// t1 and for the lanes past the span. Every lane of a warp runs the same iterations (the trip
// count is the warp's).
template <typename F>
__device__ inline void for_each_logit(const float* row, int64_t t0, int64_t t1, F&& f) {
  const float4* v = reinterpret_cast<const float4*>(row);
  const int64_t v1 = (t1 + 3) / 4;
  const int lane = threadIdx.x & 31;
  for (int64_t w = t0 / 4 + (threadIdx.x - lane); w < v1; w += 2 * kPassThreads) {
    const int64_t i = w + lane, j = i + kPassThreads;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 a = i < v1 ? v[i] : zero;
    const float4 c = j < v1 ? v[j] : zero;
    const float xs[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t t = 4 * (k < 4 ? i : j) + (k & 3);
      f(xs[k], t, t < t1);
    }
  }
}

__device__ inline float row_max(const uint32_t* head_max, int64_t row) { return key_to_float(head_max[row]); }

// Bucket histogram: each CTA counts `span` tokens of one row in shared memory (kTopPBuckets
// counters, 45,060 bytes), then adds its nonzero buckets to the row's global histogram.
__global__ void __launch_bounds__(kPassThreads) hist_kernel(SparseDecodeParams p, const float* logits,
                                                            const uint32_t* head_max, uint32_t* hist,
                                                            int64_t span) {
  __shared__ uint32_t local[index::kTopPBuckets];
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t row = int64_t(b) * p.n_q_heads + h;
  const int64_t n = indexed_of(p, b), t0 = int64_t(blockIdx.x) * span;
  if (t0 >= n) return;
  for (int a = threadIdx.x; a < index::kTopPBuckets; a += kPassThreads) local[a] = 0;
  __syncthreads();
  const float l_max = row_max(head_max, row);
  for_each_logit(logits + row * p.max_indexed, t0, min(n, t0 + span), [&](float x, int64_t, bool valid) {
    if (valid) atomicAdd(&local[index::top_p_gap_bucket(x, l_max)], 1u);
  });
  __syncthreads();
  for (int a = threadIdx.x; a < index::kTopPBuckets; a += kPassThreads)
    if (local[a] != 0) atomicAdd(&hist[row * index::kTopPBuckets + a], local[a]);
}

// The largest logit of each row as an ordered key (what the estimate kernels leave in head_max),
// for top_p_rows: one CTA per span of a row.
__global__ void __launch_bounds__(kPassThreads) row_max_kernel(SparseDecodeParams p, const float* logits,
                                                               uint32_t* head_max, int64_t span) {
  __shared__ uint32_t cta_max;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t row = int64_t(b) * p.n_q_heads + h;
  const int64_t n = indexed_of(p, b), t0 = int64_t(blockIdx.x) * span;
  if (t0 >= n) return;
  if (threadIdx.x == 0) cta_max = 0;
  __syncthreads();
  uint32_t k = 0;
  for_each_logit(logits + row * p.max_indexed, t0, min(n, t0 + span), [&](float x, int64_t, bool valid) {
    if (valid) k = max(k, ordered_key(x));
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
  if ((threadIdx.x & 31) == 0) atomicMax(&cta_max, k);
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&head_max[row], cta_max);
}

// The threshold of each row from its histogram: thread i owns buckets [kPer i, kPer (i + 1)); the
// upper and lower weights of every bucket (index::top_p_upper_weight / top_p_lower_weight of the
// table in p.topp_weights at the row's shift) summed in bucket order by two exclusive scans; each
// thread tests its nonempty buckets with index::top_p_reaches and the smallest passing bucket is
// B (the test is monotone in the bucket, so that is the CPU's first passing bucket). Then theta
// (index::top_p_bucket_threshold), the selected count and the mass (index::top_p_mass).
__global__ void __launch_bounds__(kTopPThreads) plan_kernel(SparseDecodeParams p, const uint32_t* head_max,
                                                            const uint32_t* hist_all, float* theta_out) {
  __shared__ unsigned long long scratch[33];
  __shared__ int first;
  __shared__ unsigned long long first_lower, first_upper_rest;
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t row = int64_t(b) * p.n_q_heads + h;
  const int64_t n = indexed_of(p, b);
  if (n == 0) {
    if (threadIdx.x == 0) {
      theta_out[row] = INFINITY;
      if (p.threshold) p.threshold[row] = INFINITY;
      if (p.n_selected) p.n_selected[row] = 0;
      if (p.n_widened) p.n_widened[row] = 0;
      if (p.mass) p.mass[row] = 0.0;
    }
    return;
  }
  if (threadIdx.x == 0) first = index::kTopPBuckets;
  const uint32_t* hist = hist_all + row * index::kTopPBuckets;
  const uint64_t* upper63 = p.topp_weights;
  const uint64_t* lower63 = p.topp_weights + index::kTopPBuckets;
  const int k = index::top_p_weight_shift(n);
  constexpr int kPer = (index::kTopPBuckets + kTopPThreads - 1) / kTopPThreads;
  const int a0 = kPer * int(threadIdx.x);
  uint32_t count[kPer];
  unsigned long long mine_upper = 0, mine_lower = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int a = a0 + j;
    count[j] = a < index::kTopPBuckets ? hist[a] : 0u;
    if (count[j] != 0) {
      mine_upper += (unsigned long long)count[j] * index::top_p_upper_weight(upper63[a], k);
      mine_lower += (unsigned long long)count[j] * index::top_p_lower_weight(lower63[a], k);
    }
  }
  unsigned long long total_upper = 0, total_lower = 0;
  const unsigned long long upper_before = block_exclusive_sum(mine_upper, &total_upper, scratch);
  const unsigned long long lower_before = block_exclusive_sum(mine_lower, &total_lower, scratch);
  unsigned long long upper_in = upper_before, lower_in = lower_before;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (count[j] == 0) continue;
    const int a = a0 + j;
    upper_in += (unsigned long long)count[j] * index::top_p_upper_weight(upper63[a], k);
    lower_in += (unsigned long long)count[j] * index::top_p_lower_weight(lower63[a], k);
    if (index::top_p_reaches(lower_in, total_upper - upper_in, p.p)) {
      atomicMin(&first, a);
      break;
    }
  }
  __syncthreads();
  const int B = first;  // every row has a passing bucket: its last nonempty one
  if (B >= a0 && B < a0 + kPer) {  // the owner of B: the sums at B
    upper_in = upper_before;
    lower_in = lower_before;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (a0 + j > B) break;
      upper_in += (unsigned long long)count[j] * index::top_p_upper_weight(upper63[a0 + j], k);
      lower_in += (unsigned long long)count[j] * index::top_p_lower_weight(lower63[a0 + j], k);
    }
    first_lower = lower_in;
    first_upper_rest = total_upper - upper_in;
  }
  unsigned long long taken = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j)
    if (a0 + j <= B) taken += count[j];
  taken = block_reduce(taken, [](unsigned long long x, unsigned long long y) { return x + y; }, scratch);
  if (threadIdx.x == 0) {
    const float theta = index::top_p_bucket_threshold(row_max(head_max, row), B);
    theta_out[row] = theta;
    if (p.threshold) p.threshold[row] = theta;
    if (p.n_selected) p.n_selected[row] = int64_t(taken);
    if (p.n_widened) p.n_widened[row] = 0;  // select_kernel adds the widening's tokens to both
    if (p.mass) p.mass[row] = index::top_p_mass(first_lower, first_lower + first_upper_rest);
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Selection lists: per (sequence, KV head) and chunk of 1024 indexed tokens, in token order,
// the tokens any head of the group selected, with the heads as bits 24..31. A head selects the
// tokens of its Top-p set (logit >= theta) and, when its margin_scale m is positive, those with
// fl(logit + fl(m ||k_t - c_k||)) >= theta (index::top_p_widen's two rounded operations), with the
// norms of a thread's 4 tokens (the estimate's copy beside the logits) in one 16-byte load. A
// group with no positive margin takes the plain comparisons; thresholds and margins are read once
// per CTA.
// A thread takes 4 consecutive tokens (one 16-byte load per head), so a CTA of 256 threads takes
// a chunk; with one token per thread (CTAs of 1024) the loads of two CTAs per multiprocessor
// could not cover the latency (101 us at batch 8, 128K, 32 / 8, for 134 MB of logits). The norms
// come from the estimate's 4-byte copy; until d5118ae they were read from the tokens' 32-byte
// records, a sector per token.

constexpr int kSelectThreads = kSparseChunkTokens / 4;

template <int D>
__global__ void __launch_bounds__(kSelectThreads) select_kernel(SparseDecodeParams p, const float* logits,
                                                                const float* theta, const float* norms, uint32_t* entries,
                                                                int32_t* counts, int64_t n_chunks) {
  constexpr int kWarpsPerCta = kSelectThreads / 32;
  __shared__ int32_t warp_offsets[kWarpsPerCta + 1];
  __shared__ float head_theta[kTileHeads], head_margin[kTileHeads];
  const int chunk = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int64_t t0 = int64_t(chunk) * kSparseChunkTokens + 4 * threadIdx.x;
  const int64_t list_of_head = int64_t(b) * p.n_kv_heads + kv_head;
  const int64_t row0 = int64_t(b) * p.n_q_heads + int64_t(kv_head) * group;  // the group's first row
  if (threadIdx.x < group) {
    head_theta[threadIdx.x] = theta[row0 + threadIdx.x];
    head_margin[threadIdx.x] = p.queries[row0 + threadIdx.x].margin_scale;
  }
  __syncthreads();
  bool widening = false;  // the same in every thread: a head of the group has a positive margin
  for (int g = 0; g < group; ++g) widening |= head_margin[g] > 0.f;
  uint32_t heads[4] = {0, 0, 0, 0}, widened[4] = {0, 0, 0, 0};
  const int64_t n = indexed_of(p, b);
  if (t0 < n) {
    // The group's logits of the 4 tokens (t0 + 3 < max_indexed: both are multiples of 4 and
    // t0 < n <= max_indexed), all loads issued before the first comparison.
    float4 l[kTileHeads];
#pragma unroll
    for (int g = 0; g < kTileHeads; ++g)
      if (g < group) l[g] = *reinterpret_cast<const float4*>(logits + (row0 + g) * p.max_indexed + t0);
    // Widening: the 4 tokens' key norms (the estimate's copy) in one 16-byte load, and every
    // (token, head) cell tested without branches, fl(l + fl(m ||k_t - c_k||)) >= theta where the
    // head's margin m is positive. With a branch per cell that skipped the norm's load unless the
    // list's largest norm could lift the token past theta, the widened selection issued about 12
    // instructions per cell and its BSSY / BSYNC pairs (ncu source view, run 6 of 2026-12-01, third
    // session); that filter changes no cell's answer (rounding is monotone), only which cells load.
    float4 nv = make_float4(0.f, 0.f, 0.f, 0.f);
    if (widening) nv = *reinterpret_cast<const float4*>(norms + list_of_head * p.max_indexed + t0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (t0 + e >= n) break;
      const float norm = e == 0 ? nv.x : e == 1 ? nv.y : e == 2 ? nv.z : nv.w;
#pragma unroll
      for (int g = 0; g < kTileHeads; ++g) {
        if (g >= group) break;
        const float x = e == 0 ? l[g].x : e == 1 ? l[g].y : e == 2 ? l[g].z : l[g].w;
        const float th = head_theta[g];
        const bool plain = x >= th;
        bool take = plain;
        if (widening) {  // the same in every thread
          const float m = head_margin[g];
          const bool wide = m > 0.f && __fadd_rn(x, __fmul_rn(m, norm)) >= th;
          widened[e] |= uint32_t(wide && !plain) << g;
          take = plain || wide;
        }
        heads[e] |= uint32_t(take) << g;
      }
    }
  }
  // Offsets in token order: an exclusive scan of the threads' counts (0 to 4).
  const int mine = int(heads[0] != 0) + int(heads[1] != 0) + int(heads[2] != 0) + int(heads[3] != 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_offsets[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int w = 0; w < kWarpsPerCta; ++w) {
      const int c = warp_offsets[w];
      warp_offsets[w] = sum;
      sum += c;
    }
    warp_offsets[kWarpsPerCta] = sum;
  }
  __syncthreads();
  const int64_t list = list_of_head * n_chunks + chunk;
  uint32_t* out = entries + list * kSparseChunkTokens + warp_offsets[warp] + incl - mine;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (heads[e] != 0) *out++ = uint32_t(t0 + e) | (heads[e] << 24);
  if (threadIdx.x == 0) counts[list] = warp_offsets[kWarpsPerCta];
  // The widening's tokens per head, added to the counts plan_kernel wrote.
  const uint32_t any_widened = widened[0] | widened[1] | widened[2] | widened[3];
  if (__ballot_sync(0xffffffffu, any_widened != 0) != 0 && (p.n_selected || p.n_widened)) {
    for (int g = 0; g < group; ++g) {
      const unsigned mine_g = ((widened[0] >> g) & 1u) + ((widened[1] >> g) & 1u) + ((widened[2] >> g) & 1u) +
                              ((widened[3] >> g) & 1u);
      const unsigned w = __reduce_add_sync(0xffffffffu, mine_g);
      if (lane == 0 && w != 0) {
        const int64_t row = row0 + g;
        if (p.n_selected) atomicAdd(reinterpret_cast<unsigned long long*>(&p.n_selected[row]), (unsigned long long)w);
        if (p.n_widened) atomicAdd(reinterpret_cast<unsigned long long*>(&p.n_widened[row]), (unsigned long long)w);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Attention over the lists and the window: each warp takes tiles of 16 entries, gathers their
// K and V rows (cp.async, 16-byte pieces) into the tiles of tile_mma.cuh, masks (token, head)
// pairs the head did not select, and runs the paged kernel's tile steps.

template <int D>
struct SparseShared {
  union {
    struct {
      alignas(16) uint16_t k[2][PaddedTile<D>::kElements];  // whole rows copied in: the padded layout
      alignas(16) uint16_t v[2][PaddedTile<D>::kElements];
    } tiles[kWarps];
    WarpMerge<D, kWarps> merge;
  } u;
  int32_t tile_start[kWarps + 1];
};

struct AttendArgs {
  SparseDecodeParams p;
  const uint32_t* entries;
  const int32_t* counts;
  int64_t n_chunks;       // indexed chunks per list
  int64_t window_chunks;  // chunks of the window after them
  int n_splits;
  int64_t split_chunks;   // > 0: chunks per split, over the row's own chunks (SparseDecodeParams)
  float* part_mld;
  float* part_o;
};

template <int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(AttendArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SparseShared<D>& sh = *reinterpret_cast<SparseShared<D>*>(smem_raw);
  const SparseDecodeParams& p = a.p;
  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  const int64_t n_indexed = indexed_of(p, b);
  const int64_t len = length_of(p, b);
  const int64_t list = int64_t(b) * p.n_kv_heads + kv_head;
  // The chunks split: the batch's (indexed chunks of the longest index, then the window's), or
  // with split_chunks the row's own (its indexed chunks, then its window's).
  const int64_t own_chunks = (n_indexed + kSparseChunkTokens - 1) / kSparseChunkTokens;
  const int64_t indexed_chunks = a.split_chunks > 0 ? own_chunks : a.n_chunks;
  const int64_t all_chunks =
      a.split_chunks > 0 ? own_chunks + (len - n_indexed + kSparseChunkTokens - 1) / kSparseChunkTokens
                         : a.n_chunks + a.window_chunks;
  const int64_t per_split = a.split_chunks > 0 ? a.split_chunks : (all_chunks + a.n_splits - 1) / a.n_splits;
  const int64_t c_begin = int64_t(split) * per_split, c_end = min(all_chunks, c_begin + per_split);

  // Entries of chunk c: the list's count, or the window's tokens past n_indexed.
  auto chunk_count = [&](int64_t c) -> int32_t {
    if (c < indexed_chunks) return a.counts[list * a.n_chunks + c];
    const int64_t first = n_indexed + (c - indexed_chunks) * kSparseChunkTokens;
    const int64_t left = len - first;
    return int32_t(left <= 0 ? 0 : left < kSparseChunkTokens ? left : kSparseChunkTokens);
  };
  auto entry_of = [&](int64_t c, int32_t i) -> uint32_t {
    if (c < indexed_chunks) return a.entries[(list * a.n_chunks + c) * kSparseChunkTokens + i];
    return uint32_t(n_indexed + (c - indexed_chunks) * kSparseChunkTokens + i) | (0xffu << 24);
  };

  // Query fragments (Q^T as B operands) of the group's heads, rounded to bf16.
  const int tq = lane >> 2, hq = lane & 3;
  const float* qrow = p.q + (int64_t(b) * p.n_q_heads + int64_t(kv_head) * group + tq) * D;
  uint32_t qb[D / 16][2];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const bool live = tq < group;
    qb[kk][0] = pack2<false>(live ? qrow[16 * kk + 2 * hq] : 0.f, live ? qrow[16 * kk + 2 * hq + 1] : 0.f);
    qb[kk][1] = pack2<false>(live ? qrow[16 * kk + 2 * hq + 8] : 0.f, live ? qrow[16 * kk + 2 * hq + 9] : 0.f);
  }

  // No meter here: the partials d and r stay zero.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, d_run[2] = {0.f, 0.f}, r_run[2] = {0.f, 0.f};
  float o_acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  const float log2_scale = p.sm_scale * kLog2e;
  const int64_t table_row = table_start_of(p, b, kv_head);

  // The warp's tiles: tile j of the split's concatenated chunks (tiles of 16 entries, a chunk's
  // last tile partial), j = warp, warp + 4, ...; a cursor walks the chunks forward, the next
  // chunk's count loaded when the cursor enters a chunk (read when it leaves it).
  auto& tiles = sh.u.tiles[warp];
  int64_t cur_chunk = c_begin;
  int32_t cur_tiles_before = 0, cur_count = c_begin < c_end ? chunk_count(c_begin) : 0;
  int32_t next_count = c_begin + 1 < c_end ? chunk_count(c_begin + 1) : 0;
  // Locates tile j (increasing calls): its chunk and its first entry; false past the split.
  auto locate = [&](int32_t j, int64_t* c, int32_t* first, int32_t* n) -> bool {
    while (cur_chunk < c_end) {
      const int32_t nt = (cur_count + kTileTokens - 1) / kTileTokens;
      if (j < cur_tiles_before + nt) {
        *c = cur_chunk;
        *first = (j - cur_tiles_before) * kTileTokens;
        *n = min(kTileTokens, cur_count - *first);
        return true;
      }
      cur_tiles_before += nt;
      ++cur_chunk;
      cur_count = next_count;
      next_count = cur_chunk + 1 < c_end ? chunk_count(cur_chunk + 1) : 0;
    }
    return false;
  };
  // A tile's rows pass three steps, each issued one loop iteration before the next needs its
  // result, so that no load's latency stalls the warp behind another (a chain of entry, block
  // table and row loads per tile kept the gathered rows at 1.2 TB/s, ncu):
  //   1. the list entry of each row (lane l holds row l / 2's);
  //   2. the row's K and V page from the block tables;
  //   3. the rows' copies into a tile buffer (cp.async, zero fill for padding rows).
  // A Pending tile is one between the steps; padding rows have n <= row.
  struct Pending {
    bool have = false;
    int32_t n = 0;
    uint32_t e = 0;
    int32_t kpage = 0, vpage = 0;
  };
  const int row = lane >> 1;
  auto fetch_entry = [&](int32_t tile) -> Pending {  // step 1 (locate calls are in tile order)
    Pending t;
    int64_t c = 0;
    int32_t first = 0;
    t.have = locate(tile, &c, &first, &t.n);
    if (t.have && row < t.n) t.e = entry_of(c, first + row);
    return t;
  };
  auto fetch_pages = [&](Pending& t) {  // step 2
    const int64_t tok = int64_t(t.e & 0xffffffu);
    if (t.have && row < t.n) {
      t.kpage = p.k_table[table_row + (tok >> 4)];
      t.vpage = p.v_table[table_row + (tok >> 4)];
    }
  };
  // Step 3 into buffer st; returns this lane's row's head bits (0 for padding rows). Lanes 2 r and
  // 2 r + 1 hold row r's entry and pages; the copies take whole rows in row-major order
  // (tile_layout.h's gather_row / gather_chunk: D / 8 lanes per row, whole 128-byte lines per
  // instruction), each lane fetching the byte offsets of the row it copies from the row's lane 2 r.
  // With a lane per row half (chunks 2 i + half), every instruction asked L2 for 16 single sectors.
  auto copy_rows = [&](const Pending& t, int st) -> uint32_t {
    if (!t.have) return 0u;  // the same for the whole warp (locate is)
    const int64_t tok = int64_t(t.e & 0xffffffu);
    const bool ok = row < t.n && t.kpage >= 0 && t.kpage < p.n_k_pages && t.vpage >= 0 && t.vpage < p.n_v_pages;
    // This lane's row in its pools, bytes; -1 for a padding row or a page out of range (zero fill).
    const int64_t krow = ok ? int64_t(t.kpage) * p.k_page_stride + (tok & 15) * D * 2 : -1;
    const int64_t vrow = ok ? int64_t(t.vpage) * p.v_page_stride + (tok & 15) * D * 2 : -1;
    const int chunk = gather_chunk<D>(lane);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const int r = gather_row<D>(i, lane);
      const int64_t kr = __shfl_sync(0xffffffffu, krow, 2 * r), vr = __shfl_sync(0xffffffffu, vrow, 2 * r);
      const int offset = PaddedTile<D>::offset(r, chunk);
      cp_async16_zfill(&tiles.k[st][offset], p.k_pages + (kr < 0 ? 0 : kr) + 16 * chunk, kr >= 0);
      cp_async16_zfill(&tiles.v[st][offset], p.v_pages + (vr < 0 ? 0 : vr) + 16 * chunk, vr >= 0);
    }
    return ok ? (t.e >> 24) : 0u;
  };

  // Tiles j (in buffer 0), j + kWarps (buffer 1) in flight; j + 2 kWarps with its pages;
  // j + 3 kWarps with its entries.
  Pending t0 = fetch_entry(warp);
  fetch_pages(t0);
  uint32_t heads0 = copy_rows(t0, 0);
  cp_async_commit();
  Pending t1 = fetch_entry(warp + kWarps);
  fetch_pages(t1);
  uint32_t heads1 = copy_rows(t1, 1);
  cp_async_commit();
  Pending t2 = fetch_entry(warp + 2 * kWarps);
  fetch_pages(t2);
  Pending t3 = fetch_entry(warp + 3 * kWarps);
  bool have0 = t0.have, have1 = t1.have;
  int32_t j = warp;
  for (int i = 0; have0; ++i, j += kWarps) {
    const int st = i & 1;
    cp_async_wait<1>();
    __syncwarp();
    // Head bits of rows tq and tq + 8 (the lanes 2 tq, 2 (tq + 8) staged them).
    const uint32_t heads_lo = __shfl_sync(0xffffffffu, heads0, 2 * tq);
    const uint32_t heads_hi = __shfl_sync(0xffffffffu, heads0, 2 * tq + 16);
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    tile_scores<D, false, PaddedTile<D>>(tiles.k[st], qb, lane, s);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t hb = k < 2 ? heads_lo : heads_hi;
      s[k] = (hb >> (2 * hq + (k & 1))) & 1u ? s[k] * log2_scale : -INFINITY;
    }
    float prob[4], rescale[2], m_new[2];
    tile_softmax(s, m_run, l_run, prob, rescale, m_new);
    tile_pv<D, false, PaddedTile<D>>(tiles.v[st], prob, rescale, lane, o_acc);
    __syncwarp();
    // Tile j + 2 kWarps into this buffer (its pages were fetched an iteration ago), the pages of
    // j + 3 kWarps, the entries of j + 4 kWarps.
    const uint32_t heads2 = copy_rows(t2, st);
    cp_async_commit();
    fetch_pages(t3);
    Pending t4 = t3.have ? fetch_entry(j + 4 * kWarps) : Pending{};
    have0 = have1;
    heads0 = heads1;
    have1 = t2.have;
    heads1 = heads2;
    t2 = t3;
    t3 = t4;
  }
  cp_async_wait<0>();
  __syncthreads();  // the tiles are reused as the merge area
  write_split_partials<D, kWarps>(sh.u.merge, warp, lane, m_run, l_run, d_run, r_run, o_acc, group,
                                  int64_t(b) * p.n_q_heads + int64_t(kv_head) * group, a.n_splits, split, a.part_mld,
                                  a.part_o);
}

// ---------------------------------------------------------------------------------------------
// Host side.

CudaStatus error(const std::string& message) {
  return CudaStatus{false, StatusCode::kInvalidArgument, "cuda sparse decode: " + message};
}
CudaStatus unsupported(const std::string& message) {
  return CudaStatus{false, StatusCode::kUnsupported, "cuda sparse decode: " + message};
}

struct Layout {
  // zeroed before every call: head_max .. hist (one memset)
  size_t head_max = 0, hist = 0, zeroed_end = 0;
  size_t logits = 0, norms = 0, theta = 0, entries = 0, counts = 0, mld = 0, o = 0, total = 0;
  int64_t n_chunks = 0, window_chunks = 0;
  int splits = 1;
};

size_t round256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout_of(const SparseDecodeParams& p, int splits) {
  Layout l;
  l.n_chunks = (p.max_indexed + kSparseChunkTokens - 1) / kSparseChunkTokens;
  l.window_chunks = (p.max_window + kSparseChunkTokens - 1) / kSparseChunkTokens;
  l.splits = splits;
  const size_t rows = size_t(p.batch) * size_t(p.n_q_heads);
  const size_t lists = size_t(p.batch) * size_t(p.n_kv_heads);
  const size_t per_row = size_t(std::max<int64_t>(p.max_indexed, 1));
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += round256(bytes);
    return here;
  };
  l.head_max = take(rows * 4);
  l.hist = take(rows * index::kTopPBuckets * 4);  // 45,060 bytes per row
  l.zeroed_end = at;
  l.logits = take(rows * per_row * 4);
  l.norms = take(lists * per_row * 4);
  l.theta = take(rows * 4);
  l.entries = take(lists * size_t(std::max<int64_t>(l.n_chunks, 1)) * kSparseChunkTokens * 4);
  l.counts = take(lists * size_t(std::max<int64_t>(l.n_chunks, 1)) * 4);
  l.mld = take(rows * size_t(splits) * kSplitPartials * 4);
  l.o = take(rows * size_t(splits) * size_t(p.head_dim) * 4);
  l.total = at;
  return l;
}

// Tokens per CTA of the histogram pass: kPassQuantum doubled while the grid keeps at
// least kPassCtas CTAs, up to 8 quanta. A CTA zeroes and flushes all kTopPBuckets buckets whatever
// its span, so at batch 8 and 128K the 4096-token spans spent as long on the buckets (and on 8
// million global atomics of the flushes) as on the logits.
constexpr int64_t kPassCtas = 1024;
int64_t pass_tokens(const SparseDecodeParams& p) {
  if (p.pass_tokens > 0) return p.pass_tokens;
  const int64_t rows = int64_t(p.batch) * p.n_q_heads;
  int64_t span = kPassQuantum;
  while (span < 8 * kPassQuantum && (p.max_indexed + 2 * span - 1) / (2 * span) * rows >= kPassCtas) span *= 2;
  return span;
}

// Allows the attention kernel its dynamic shared memory (once per head dim); a failure shows as
// the launch's error.
template <int D>
void allow_attend_shared_memory() {
  static const bool done = [] {
    cudaFuncSetAttribute(attend_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(SparseShared<D>)));
    return true;
  }();
  (void)done;
}

template <int D>
CudaStatus launch(const SparseDecodeParams& p, int splits) {
  const Layout l = layout_of(p, splits);
  char* base = static_cast<char*>(p.workspace);
  auto at = [&](size_t offset) { return static_cast<void*>(base + offset); };
  float* logits = static_cast<float*>(at(l.logits));
  float* norms = static_cast<float*>(at(l.norms));
  uint32_t* head_max = static_cast<uint32_t*>(at(l.head_max));
  uint32_t* hist = static_cast<uint32_t*>(at(l.hist));
  float* theta = static_cast<float*>(at(l.theta));
  uint32_t* entries = static_cast<uint32_t*>(at(l.entries));
  int32_t* counts = static_cast<int32_t*>(at(l.counts));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  cudaError_t e = cudaMemsetAsync(base + l.head_max, 0, l.zeroed_end - l.head_max, stream);
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda sparse decode: ") + cudaGetErrorString(e)};
  if (p.max_indexed > 0) {
    const unsigned B = unsigned(p.batch), Hq = unsigned(p.n_q_heads), Hkv = unsigned(p.n_kv_heads);
    const int64_t span = pass_tokens(p);
    const unsigned passes = unsigned((p.max_indexed + span - 1) / span);
    const dim3 grid(unsigned((p.max_indexed + kEstimateTokens - 1) / kEstimateTokens), Hkv, B);
    switch (estimate_form_of(p)) {
      case EstimateForm::kBitMma:
        estimate_by_mma_kernel<D, EstimateForm::kBitMma>
            <<<grid, kEstimateThreads, 0, stream>>>(p, logits, head_max, norms);
        break;
      case EstimateForm::kByteMma:
        estimate_by_mma_kernel<D, EstimateForm::kByteMma>
            <<<grid, kEstimateThreads, 0, stream>>>(p, logits, head_max, norms);
        break;
      default:
        estimate_by_popcount_kernel<D><<<grid, kEstimateThreads, 0, stream>>>(p, logits, head_max, norms);
    }
    hist_kernel<<<dim3(passes, Hq, B), kPassThreads, 0, stream>>>(p, logits, head_max, hist, span);
  }
  plan_kernel<<<dim3(unsigned(p.n_q_heads), unsigned(p.batch)), kTopPThreads, 0, stream>>>(p, head_max, hist, theta);
  if (l.n_chunks > 0)
    select_kernel<D><<<dim3(unsigned(l.n_chunks), unsigned(p.n_kv_heads), unsigned(p.batch)), kSelectThreads, 0,
                       stream>>>(p, logits, theta, norms, entries, counts, l.n_chunks);
  AttendArgs a{p, entries, counts, l.n_chunks, l.window_chunks, splits, p.split_chunks,
               static_cast<float*>(at(l.mld)), static_cast<float*>(at(l.o))};
  const size_t smem = sizeof(SparseShared<D>);
  allow_attend_shared_memory<D>();
  attend_kernel<D><<<dim3(unsigned(splits), unsigned(p.n_kv_heads), unsigned(p.batch)), kThreads, smem, stream>>>(a);
  merge_splits_kernel<D><<<p.batch * p.n_q_heads, kMergeThreads, 0, stream>>>(p.out, nullptr, nullptr, nullptr, splits,
                                                                   a.part_mld, a.part_o);
  e = cudaGetLastError();
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda sparse decode: launch failed: ") + cudaGetErrorString(e)};
  return {};
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The chunks of the batch's longest index plus its longest window: every row's own chunks fit.
int64_t batch_chunks(const SparseDecodeParams& p) {
  return (p.max_indexed + kSparseChunkTokens - 1) / kSparseChunkTokens +
         (p.max_window + kSparseChunkTokens - 1) / kSparseChunkTokens;
}

int splits_of(const SparseDecodeParams& p) {
  if (p.n_splits > 0) return p.n_splits;
  if (p.split_chunks > 0)
    return int(std::min<int64_t>(std::max<int64_t>(1, (batch_chunks(p) + p.split_chunks - 1) / p.split_chunks), INT32_MAX));
  return choose_splits(p);
}

}  // namespace

template <int D>
DeviceRabitqQuery device_rabitq_query(const index::RabitqHead& head, const index::RabitqQuery<D>& query,
                                      float margin_scale) {
  static_assert(D <= 128, "two code words at most");
  DeviceRabitqQuery q;
  for (int b = 0; b < index::kRabitqQueryBits; ++b)
    for (int w = 0; w < 2; ++w) q.planes[b][w] = w < index::RabitqQuery<D>::kWords ? query.bit_planes[b][w] : 0;
  q.sum_q_u = query.sum_q_u;
  q.delta = query.delta;
  q.q_l = query.q_l;
  q.norm_q_centered = query.norm_q_centered;
  q.q_dot_ck = query.q_dot_ck;
  q.cq_dot_ck = head.cq_dot_ck();
  q.margin_scale = margin_scale;
  return q;
}
template DeviceRabitqQuery device_rabitq_query<64>(const index::RabitqHead&, const index::RabitqQuery<64>&, float);
template DeviceRabitqQuery device_rabitq_query<128>(const index::RabitqHead&, const index::RabitqQuery<128>&, float);

namespace {
constexpr const char* kEstimateFormNames[] = {"chosen", "popcount", "bytes", "bits"};
}  // namespace

// The bit form from 4 query heads per KV head, the popcount form below. On the H200 at 128K
// (docs/bench/cuda_runs.md, the fifth session of 2026-12-01) the bit form beat the popcount form at 4
// heads and the byte form at 7 (batches 1 and 8), and lost to the popcount form at 1, 2 and 3
// heads (batch 8: 1.31x, 1.17x, 1.05x its time), whose work falls with the heads while the bit
// form's does not. 5, 6 and 8 heads are not timed.
EstimateForm estimate_form_of(const SparseDecodeParams& p) {
  if (p.estimate_form != EstimateForm::kChosen) return p.estimate_form;
  const int group = p.n_kv_heads > 0 ? p.n_q_heads / p.n_kv_heads : 0;  // check() refuses 0 heads
  return group >= 4 ? EstimateForm::kBitMma : EstimateForm::kPopcount;
}

const char* estimate_form_name(EstimateForm form) {
  const auto i = size_t(form);
  return i < std::size(kEstimateFormNames) ? kEstimateFormNames[i] : "unknown";
}

bool parse_estimate_form(const char* name, EstimateForm* form) {
  for (size_t i = 0; i < std::size(kEstimateFormNames); ++i)
    if (name != nullptr && std::string(name) == kEstimateFormNames[i]) {
      *form = EstimateForm(i);
      return true;
    }
  return false;
}

void describe_pages(const PagedDecodeParams& pages, SparseDecodeParams* p) {
  p->batch = pages.batch;
  p->n_kv_heads = pages.n_kv_heads;
  p->head_dim = pages.head_dim;
  p->block_tokens = pages.block_tokens;
  p->k_pages = pages.k_pages;
  p->v_pages = pages.v_pages;
  p->k_page_stride = pages.k_page_stride;
  p->v_page_stride = pages.v_page_stride;
  p->n_k_pages = pages.n_k_pages;
  p->n_v_pages = pages.n_v_pages;
  p->k_table = pages.k_table;
  p->v_table = pages.v_table;
  p->table_stride = pages.table_stride;
  p->seq_lens = pages.seq_lens;
  p->max_seq_len = pages.max_seq_len;
}

CudaStatus check(const SparseDecodeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128)
    return unsupported("head_dim " + std::to_string(p.head_dim) + " is unsupported (64 or 128)");
  if (p.block_tokens != kTileTokens)
    return unsupported("block_tokens " + std::to_string(p.block_tokens) + " is unsupported (16)");
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0 || p.n_q_heads % p.n_kv_heads != 0)
    return error("GQA ratio " + std::to_string(p.n_q_heads) + "/" + std::to_string(p.n_kv_heads) + " is not integral");
  if (p.n_q_heads / p.n_kv_heads > kTileHeads)
    return unsupported("GQA ratio " + std::to_string(p.n_q_heads / p.n_kv_heads) +
                       " is unsupported (at most 8 query heads per KV head)");
  if (p.batch < 1 || p.batch > 65535 || p.n_kv_heads > 65535 || p.n_q_heads > 65535)
    return error("batch and head counts must be in [1, 65535]");
  if (int64_t(p.batch) * p.n_q_heads > INT32_MAX)  // the merge kernel's grid, one CTA per row
    return unsupported("batch x n_q_heads " + std::to_string(int64_t(p.batch) * p.n_q_heads) + " is past 2^31 - 1");
  if (!(p.sm_scale > 0.f) || !std::isfinite(p.sm_scale)) return error("sm_scale must be positive and finite");
  if (!(p.p > 0.0 && p.p <= 1.0)) return error("p must be in (0, 1]");
  if (p.table_stride < 1 || p.max_seq_len < 1 || p.max_seq_len > p.table_stride * kTileTokens)
    return error("max_seq_len " + std::to_string(p.max_seq_len) + " is outside the block tables");
  if (p.max_seq_len >= (int64_t(1) << 24)) return unsupported("contexts of 2^24 tokens or more");
  if (p.max_indexed < 0 || p.max_indexed > p.max_seq_len || p.max_indexed % kTileTokens != 0)
    return error("max_indexed must be a multiple of 16 in [0, max_seq_len]");
  if (p.max_window < 0 || p.max_window > p.max_seq_len) return error("max_window must be in [0, max_seq_len]");
  if (p.pass_tokens < 0 || p.pass_tokens % 16 != 0 || p.pass_tokens > (int64_t(1) << 24))
    return error("pass_tokens must be a multiple of 16 in [0, 2^24]");
  if (uint8_t(p.estimate_form) > uint8_t(EstimateForm::kBitMma))
    return error("estimate_form " + std::to_string(int(p.estimate_form)) + " is not an EstimateForm");
  if (p.n_splits < 0 || p.split_chunks < 0) return error("n_splits and split_chunks must be >= 0");
  if (p.n_splits > 0 && p.split_chunks > 0) return error("set n_splits or split_chunks, not both");
  if (splits_of(p) > 65535) return error("split_chunks cuts the chunks into more than 65535 splits");
  if (p.table_rows != nullptr && p.n_table_rows < 1) return error("table_rows needs n_table_rows >= 1");
  if (p.table_row_stride < 0 || (p.table_row_stride > 0 && p.table_row_stride < int64_t(p.n_kv_heads) * p.table_stride))
    return error("table_row_stride must be 0 or at least n_kv_heads x table_stride");
  // Every list starts on 16 bytes (the estimate stages a list's records by 16-byte cp.async): at
  // head_dim 64 (24-byte records) the stride must be even.
  const int64_t record_bytes = p.head_dim == 64 ? int64_t(sizeof(index::RabitqRecord<64>))
                                                : int64_t(sizeof(index::RabitqRecord<128>));
  if (p.max_indexed > 0 && (p.record_stride < p.max_indexed || !p.records || !aligned16(p.records) ||
                            (p.record_stride * record_bytes) % 16 != 0))
    return error("the index needs 16-byte-aligned records with a stride of at least max_indexed, and lists "
                 "starting on 16 bytes (an even stride at head_dim 64)");
  if (!p.k_pages || !p.v_pages || !p.k_table || !p.v_table || !p.seq_lens || !p.n_indexed || !p.queries ||
      !p.topp_weights || !p.q || !p.out)
    return error("a device pointer is null");
  if (!aligned16(p.k_pages) || !aligned16(p.v_pages) || p.k_page_stride % 16 != 0 || p.v_page_stride % 16 != 0)
    return error("the page pool is misaligned (base and page stride must be multiples of 16 bytes)");
  const int64_t page = int64_t(kTileTokens) * p.head_dim * 2;
  if (p.k_page_stride < page || p.v_page_stride < page)
    return error("page stride too small for bf16 pages (" + std::to_string(page) + " bytes)");
  if (!p.workspace || p.workspace_size < workspace_bytes(p) || !aligned16(p.workspace))
    return error("workspace too small or misaligned (needs " + std::to_string(workspace_bytes(p)) + " bytes)");
  return {};
}

int choose_splits(const SparseDecodeParams& p) {
  const int64_t chunks = batch_chunks(p);
  // 4 chunks per split (a chunk's selected tokens fill a few tiles, so fewer chunks would leave
  // the CTA's warps idle), however many waves that makes. The KV heads select very different
  // numbers of rows (a list is the union over its group's heads), so one split per resident slot
  // (the rule until this stop) left the multiprocessors idle half of the attention's time waiting
  // for the heavy lists (Nsight Compute, 32 / 8 at batch 8, 128K: SM active 51% of the cycles);
  // smaller splits over several waves let the block scheduler even them out (docs/bench/cuda_runs.md: p 0.9
  // + 1.5 deviations 905 -> 802 us there; batch 1 already had 4 chunks per split).
  const int64_t splits = std::max<int64_t>(1, (chunks + 3) / 4);
  return int(std::min<int64_t>(splits, 65535));
}

size_t workspace_bytes(const SparseDecodeParams& p) { return layout_of(p, splits_of(p)).total; }

namespace {

// top_p_rows as a sparse decode of rows sequences with one query head and nothing but an index.
SparseDecodeParams top_p_rows_as_sparse(const TopPRowsParams& t) {
  SparseDecodeParams p;
  p.batch = t.rows;
  p.n_q_heads = p.n_kv_heads = 1;
  p.p = t.p;
  p.n_indexed = t.n;
  p.max_indexed = t.stride;
  p.topp_weights = t.topp_weights;
  p.threshold = t.threshold;
  p.n_selected = t.n_selected;
  p.mass = t.mass;
  p.pass_tokens = t.pass_tokens;
  return p;
}

// head_max [rows], hist [rows][kTopPBuckets] (zeroed), theta [rows].
size_t top_p_rows_bytes(int rows, size_t* hist, size_t* theta) {
  *hist = round256(size_t(rows) * 4);
  *theta = *hist + round256(size_t(rows) * index::kTopPBuckets * 4);
  return *theta + round256(size_t(rows) * 4);
}

}  // namespace

size_t top_p_rows_workspace_bytes(const TopPRowsParams& t) {
  size_t hist = 0, theta = 0;
  return top_p_rows_bytes(std::max(t.rows, 0), &hist, &theta);
}

CudaStatus top_p_rows(const TopPRowsParams& t) {
  if (t.rows < 0 || t.rows > 65535) return error("top_p_rows: rows must be in [0, 65535]");
  if (!(t.p > 0.0 && t.p <= 1.0)) return error("top_p_rows: p must be in (0, 1]");
  if (t.stride < 0 || t.stride % 16 != 0 || t.stride >= (int64_t(1) << 24))
    return error("top_p_rows: stride must be a multiple of 16 below 2^24");
  if (t.pass_tokens < 0 || t.pass_tokens % 16 != 0 || t.pass_tokens > (int64_t(1) << 24))
    return error("top_p_rows: pass_tokens must be a multiple of 16 in [0, 2^24]");
  if (t.rows == 0) return {};
  if (!t.logits || !aligned16(t.logits) || !t.n || !t.topp_weights || !t.threshold || !t.n_selected || !t.mass)
    return error("top_p_rows: a device pointer is null or the logits misaligned");
  size_t hist_at = 0, theta_at = 0;
  const size_t need = top_p_rows_bytes(t.rows, &hist_at, &theta_at);
  if (!t.workspace || t.workspace_size < need || !aligned16(t.workspace))
    return error("top_p_rows: workspace too small or misaligned (needs " + std::to_string(need) + " bytes)");
  const SparseDecodeParams p = top_p_rows_as_sparse(t);
  char* base = static_cast<char*>(t.workspace);
  uint32_t* head_max = reinterpret_cast<uint32_t*>(base);
  uint32_t* hist = reinterpret_cast<uint32_t*>(base + hist_at);
  float* theta = reinterpret_cast<float*>(base + theta_at);
  cudaStream_t stream = static_cast<cudaStream_t>(t.stream);
  cudaError_t e = cudaMemsetAsync(base, 0, theta_at, stream);
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda top_p_rows: ") + cudaGetErrorString(e)};
  if (t.stride > 0) {
    const int64_t span = pass_tokens(p);
    const dim3 grid(unsigned((t.stride + span - 1) / span), 1, unsigned(t.rows));
    row_max_kernel<<<grid, kPassThreads, 0, stream>>>(p, t.logits, head_max, span);
    hist_kernel<<<grid, kPassThreads, 0, stream>>>(p, t.logits, head_max, hist, span);
  }
  plan_kernel<<<dim3(1, unsigned(t.rows)), kTopPThreads, 0, stream>>>(p, head_max, hist, theta);
  e = cudaGetLastError();
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda top_p_rows: launch failed: ") + cudaGetErrorString(e)};
  return {};
}

CudaStatus sparse_decode(const SparseDecodeParams& p) {
  const CudaStatus s = check(p);
  if (!s.ok) return s;
  const int splits = splits_of(p);
  return p.head_dim == 64 ? launch<64>(p, splits) : launch<128>(p, splits);
}

const float* estimated_logits(const SparseDecodeParams& p) {
  return reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + layout_of(p, splits_of(p)).logits);
}
const uint32_t* selection_entries(const SparseDecodeParams& p) {
  return reinterpret_cast<const uint32_t*>(static_cast<const char*>(p.workspace) + layout_of(p, splits_of(p)).entries);
}
const int32_t* selection_counts(const SparseDecodeParams& p) {
  return reinterpret_cast<const int32_t*>(static_cast<const char*>(p.workspace) + layout_of(p, splits_of(p)).counts);
}
int64_t selection_chunks(const SparseDecodeParams& p) { return layout_of(p, splits_of(p)).n_chunks; }

}  // namespace certkv::attention::cuda
