// The split kernel over fragment-major pages (fragment_decode_cuda.h). One CTA per (split, KV
// head, sequence), 4 warps; a warp takes the split's blocks first, first + 4, ... Each warp owns
// a ring of kStages page pairs (K page then V page, fragment-major) in shared memory, filled by
// cp.async.bulk copies that complete on one mbarrier per stage: lane 0 issues page i + kStages as
// soon as page i's operands are loaded, so kStages - 1 pages stay in flight while a page is used.
// A page pair's scores and output products run on tensor cores (mma.m16n8k16, bf16, fp32
// accumulation) in the layout of tile_mma.cuh (tokens as the 16 rows, the group's query heads as
// the 8 columns), their A operands read from the ring with one 16-byte load per lane and step.
// The last page of a sequence masks its scores past the length and zeroes its values there (a
// device page past the length may hold anything, NaN too). A corrupt table entry (outside the
// pool; a raw entry, which bf16 pages never have) reads as a zero page and counts in the error word.
// After the warps' merge (write_split_partials) each CTA counts itself done on its row group's
// counter; the last one merges the group's splits into the outputs and leaves the counter at zero.
#include "attention/cuda/fragment_decode_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "attention/cuda/fragment_layout.h"
#include "attention/cuda/tile_mma.cuh"

namespace certkv::attention::cuda {

namespace {

using namespace tile;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockTokens = fragment::kPageTokens;
constexpr int kMaxGroup = 8;
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// The bulk copy engine and mbarriers (PTX ISA 8.0, sm_90).

__device__ inline uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ inline void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}
// The barrier inits visible to the copy engine (the async proxy).
__device__ inline void barrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also expects `bytes` of copies to complete on the barrier before its phase ends.
__device__ inline void barrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
// Waits for the phase of parity `parity` to complete.
__device__ inline void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// Orders this thread's earlier shared-memory accesses (the operand loads of the stage) before
// the copy engine's writes that follow.
__device__ inline void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ inline void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// ---------------------------------------------------------------------------------------------

constexpr int kMergeChunk = 256;  // splits whose weights the last CTA stages at once
constexpr int kMergeLoads = 8;    // its partial outputs in flight per thread

// ---------------------------------------------------------------------------------------------
// Page classes: how many bytes a page pair holds, what a lane loads of a page (16 bytes at a
// time, from shared or global memory alike) and how the loads become its mma A operands.

// bf16, fragment-major: a lane's four registers of step s are its 16 bytes of the step.
struct Bf16Pages {
  static constexpr bool kHalf = false;        // the mma element (and the query's rounding)
  static constexpr bool kExactPages = false;  // raw entries are corrupt
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return kBlockTokens * D * 2; }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return kBlockTokens * D * 2; }
  template <int D>
  __host__ __device__ static constexpr int loads() { return D / 16; }
  template <int D>
  __device__ static void load(const unsigned char* page, int lane, uint4 (&x)[D / 16]) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) x[i] = reinterpret_cast<const uint4*>(page)[32 * i + lane];
  }
  template <int D>
  __device__ static void operands(const uint4 (&x)[D / 16], uint32_t (&a)[D / 16][4]) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      a[i][0] = x[i].x;
      a[i][1] = x[i].y;
      a[i][2] = x[i].z;
      a[i][3] = x[i].w;
    }
  }
};

// E4M3 codes, fragment-major (two steps per 16 bytes), converted exactly to fp16 pairs; V pages
// end with rho [16] fp16. Exact pages (entries < 0) are bf16 pages of Bf16Pages's layout.
struct Fp8Pages {
  static constexpr bool kHalf = true;
  static constexpr bool kExactPages = true;
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return kBlockTokens * D; }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return kBlockTokens * D + kBlockTokens * 2; }
  template <int D>
  __host__ __device__ static constexpr int loads() { return D / 32; }
  template <int D>
  __device__ static void load(const unsigned char* page, int lane, uint4 (&x)[D / 32]) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) x[i] = reinterpret_cast<const uint4*>(page)[32 * i + lane];
  }
  __device__ static uint32_t half2_of(uint32_t word, int byte) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((word >> (8 * byte)) & 0xffffu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  }
  template <int D>
  __device__ static void operands(const uint4 (&x)[D / 32], uint32_t (&a)[D / 16][4]) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      a[2 * i][0] = half2_of(x[i].x, 0);
      a[2 * i][1] = half2_of(x[i].x, 2);
      a[2 * i][2] = half2_of(x[i].y, 0);
      a[2 * i][3] = half2_of(x[i].y, 2);
      a[2 * i + 1][0] = half2_of(x[i].z, 0);
      a[2 * i + 1][1] = half2_of(x[i].z, 2);
      a[2 * i + 1][2] = half2_of(x[i].w, 0);
      a[2 * i + 1][3] = half2_of(x[i].w, 2);
    }
  }
};

// The zero-byte Tier A bound of an fp8 K page: |k^_i - k_i| <= 2^(E_i - 4) + 2^-10 for a code k^_i
// of exponent E_i (half its step; 2^-10 covers subnormal and zero codes), so c_t = sm_scale
// (2^-4 sum_i |q_i| 2^E_i + 2^-10 sum_i |q_i|). The first sum is one more tensor-core product per
// step: the codes' fp16 operands with sign and mantissa cleared (a & 0x7c007c00 is 2^E_i exactly,
// +inf for a NaN code) against |q| (the query's operands with the sign cleared); its at most 128
// exact products sum in fp32 within 2^-16 relative, covered by the lift 1 + 2^-15.
constexpr float kCodeBoundScale = 0.0625f * (1.0f + 1.0f / 32768.0f);

template <int D, class Page, int kStages>
struct FragmentShared {
  struct Stage {
    alignas(16) unsigned char k[Page::template k_bytes<D>()];
    alignas(16) unsigned char v[Page::template v_bytes<D>()];
  };
  union {
    Stage ring[kWarps][kStages];
    WarpMerge<D, kWarps> merge;
    float merge_weight[kMaxGroup][kMergeChunk];  // the last CTA's split weights, a chunk at a time
  } u;
  uint64_t full[kWarps][kStages];
  int32_t entries[kWarps][kStages][2];  // the K and V table entries staged (pages with exact ones)
  uint16_t q[kMaxGroup][D];             // the query in the pages' element (bf16 or fp16 bits)
  uint16_t q_exact[Page::kExactPages ? kMaxGroup : 1][D];  // bf16 bits, for exact pages
  float q_term[kMaxGroup];              // 2^-10 sum_i |q_i| rounded up (the bound's second term)
  float row_max[kMaxGroup], row_l[kMaxGroup];
  int last;
};
static_assert(sizeof(FragmentShared<128, Bf16Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<128, Fp8Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<64, Fp8Pages, 2>::Stage) % 16 == 0,
              "stages of whole 16-byte chunks (bulk copies)");

// The splits of rows row0 .. row0 + rows - 1 merged by one CTA (the last of the row group to
// finish): out = sum_s 2^{m_s - M} o_s / sum_s 2^{m_s - M} l_s per row, A - 1 and the value side
// likewise (write_row_meter). The partials are other CTAs' stores: read through L2 (__ldcg). The
// rows go side by side: a warp per row for the maxima and sums, then every thread a few (row,
// 4 channels) items over a chunk of splits at a time, kMergeLoads loads in flight.

template <int D, class Page, int kStages>
__device__ void merge_row_group(FragmentShared<D, Page, kStages>& sh, const FragmentSplitArgs& a, int64_t row0, int rows) {
  const PagedDecodeParams& p = a.p;
  const int n_splits = a.n_splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int g = warp; g < rows; g += kWarps) {
    const float* mldr = a.part_mldr + (row0 + g) * n_splits * kSplitPartials;
    float big = -INFINITY;
    for (int s = lane; s < n_splits; s += 32) big = fmaxf(big, __ldcg(mldr + kSplitPartials * s));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
    float l = 0.f, d = 0.f, r = 0.f;
    for (int s = lane; s < n_splits; s += 32) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(mldr + kSplitPartials * s));
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
    if (lane == 0) {
      sh.row_max[g] = big;
      sh.row_l[g] = l;
      write_row_meter(row0 + g, l, d, r, p.meter, p.a_minus_1, p.value_rho);
    }
  }
  constexpr int kQuads = D / 4;
  constexpr int kItems = kMaxGroup * kQuads / kThreads;  // items per thread at most (8 rows)
  float4 acc[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int first = 0; first < n_splits; first += kMergeChunk) {
    const int n = min(kMergeChunk, n_splits - first);
    __syncthreads();  // row_max is written; the previous chunk's weights are used
    for (int i = threadIdx.x; i < rows * n; i += kThreads) {
      const int g = i / n, s = i % n;
      const float m = __ldcg(a.part_mldr + ((row0 + g) * n_splits + first + s) * kSplitPartials);
      sh.u.merge_weight[g][s] = m == -INFINITY ? 0.f : exp2f(m - sh.row_max[g]);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int item = threadIdx.x + k * kThreads, g = item / kQuads, q = item % kQuads;
      if (g >= rows) break;
      const float4* po = reinterpret_cast<const float4*>(a.part_o + ((row0 + g) * n_splits + first) * D) + q;
      const float* w = sh.u.merge_weight[g];
      int s = 0;
      for (; s + kMergeLoads <= n; s += kMergeLoads) {
        float4 x[kMergeLoads];
#pragma unroll
        for (int j = 0; j < kMergeLoads; ++j) x[j] = __ldcg(po + (s + j) * kQuads);
#pragma unroll
        for (int j = 0; j < kMergeLoads; ++j) {
          const float f = w[s + j];
          acc[k].x += f * x[j].x;
          acc[k].y += f * x[j].y;
          acc[k].z += f * x[j].z;
          acc[k].w += f * x[j].w;
        }
      }
      for (; s < n; ++s) {
        const float4 x = __ldcg(po + s * kQuads);
        const float f = w[s];
        acc[k].x += f * x.x;
        acc[k].y += f * x.y;
        acc[k].z += f * x.z;
        acc[k].w += f * x.w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int item = threadIdx.x + k * kThreads, g = item / kQuads, q = item % kQuads;
    if (g >= rows) break;
    const float l = sh.row_l[g];
    float4 o;
    o.x = l > 0.f ? acc[k].x / l : 0.f;  // l = 0 only when every token was masked (a corrupt length)
    o.y = l > 0.f ? acc[k].y / l : 0.f;
    o.z = l > 0.f ? acc[k].z / l : 0.f;
    o.w = l > 0.f ? acc[k].w / l : 0.f;
    reinterpret_cast<float4*>(p.out + (row0 + g) * D)[q] = o;
  }
}

template <int D, class Page, bool kMeter, int kStages>
__global__ void __launch_bounds__(kThreads) fragment_split_kernel(FragmentSplitArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Shared = FragmentShared<D, Page, kStages>;
  Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
  const PagedDecodeParams& p = a.p;
  constexpr bool kHalf = Page::kHalf;
  constexpr int kLoads = Page::template loads<D>();
  constexpr uint32_t kBytesK = Page::template k_bytes<D>(), kBytesV = Page::template v_bytes<D>();

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  int64_t len = p.seq_lens[b];
  const int64_t len_limit = min(p.max_seq_len, p.table_stride * kBlockTokens);
  if (len < 1 || len > len_limit) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(a.error_word, 1u);
    len = len < 1 ? 0 : len_limit;
  }
  int64_t table_block = b;
  if (p.table_rows != nullptr) {
    table_block = p.table_rows[b];
    if (table_block < 0 || table_block >= p.n_table_rows) {
      if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(a.error_word, 1u);
      table_block = 0;
      len = 0;
    }
  }
  const int64_t n_blocks = (len + kBlockTokens - 1) / kBlockTokens;
  const int64_t block_begin = int64_t(split) * a.per_split;
  const int64_t block_end = min(n_blocks, block_begin + a.per_split);

  // The query rounded to the pages' element (and to bf16 for exact pages); the bound's second
  // term per head, in double, rounded up.
  const float* q_row = p.q + (int64_t(b) * p.n_q_heads + int64_t(kv_head) * group) * D;
  for (int i = threadIdx.x; i < kMaxGroup * D; i += kThreads) {
    const int g = i / D, c = i % D;
    const float x = g < group ? q_row[int64_t(g) * D + c] : 0.f;
    sh.q[g][c] = element_bits<kHalf>(x);
    if constexpr (Page::kExactPages) sh.q_exact[g][c] = element_bits<false>(x);
  }
  if constexpr (kMeter) {
    if (threadIdx.x < kMaxGroup) {
      const int g = threadIdx.x;
      double sum = 0;
      for (int c = 0; c < D && g < group; ++c) sum += fabs(double(element_value<kHalf>(element_bits<kHalf>(q_row[int64_t(g) * D + c]))));
      sh.q_term[g] = __double2float_ru(sum * (1.0 / 1024.0));
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) barrier_init(&sh.full[warp][st], 1);
    barrier_init_fence();
  }
  __syncthreads();

  const int tq = lane >> 2, hq = lane & 3;
  uint32_t qb[D / 16][2];  // Q^T as the B operand: channels 2 hq, 2 hq + 1 (+ 8) of head tq
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qb[kk][0] = *reinterpret_cast<const uint32_t*>(&sh.q[tq][16 * kk + 2 * hq]);
    qb[kk][1] = *reinterpret_cast<const uint32_t*>(&sh.q[tq][16 * kk + 2 * hq + 8]);
  }

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, d_run[2] = {0.f, 0.f}, r_run[2] = {0.f, 0.f};
  float o_acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  const float log2_scale = p.sm_scale * kLog2e;
  unsigned int corrupt = 0;

  // One page pair: scores, the logit bounds of a lossy K page (kMeter), the tail's masks, the
  // online softmax, the meter's sums, P V. The page classes of K and V are compile-time (exact:
  // bf16 operands with the bf16 query and bf16 probabilities, bound 0, rho 0).
  auto attend = [&](auto exact_k, auto exact_v, const uint32_t (&ka)[D / 16][4], uint32_t (&va)[D / 16][4],
                    const float (&rho)[2], int64_t blk) {
    constexpr bool kExactK = decltype(exact_k)::value, kExactV = decltype(exact_v)::value;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if constexpr (kExactK) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sh.q_exact[tq][16 * kk + 2 * hq]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sh.q_exact[tq][16 * kk + 2 * hq + 8]);
        mma16816<false>(s, ka[kk], b0, b1);
      } else {
        mma16816<kHalf>(s, ka[kk], qb[kk][0], qb[kk][1]);
      }
    }
    [[maybe_unused]] float c[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kMeter && !kExactK) {
      float cw[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t e[4] = {ka[kk][0] & 0x7c007c00u, ka[kk][1] & 0x7c007c00u, ka[kk][2] & 0x7c007c00u,
                               ka[kk][3] & 0x7c007c00u};
        mma16816<true>(cw, e, qb[kk][0] & 0x7fff7fffu, qb[kk][1] & 0x7fff7fffu);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) c[k] = __fmul_ru(p.sm_scale, __fmaf_ru(cw[k], kCodeBoundScale, sh.q_term[2 * hq + (k & 1)]));
    }
    const int64_t t0 = blk * kBlockTokens;
    if (t0 + kBlockTokens > len) {  // the sequence's last page, partly past the length
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = t0 + tq + 8 * (k >> 1) < len ? s[k] * log2_scale : -INFINITY;
      // The values' columns are tokens: registers 0, 1 hold tokens 2 hq, 2 hq + 1; 2, 3 those + 8.
      const int64_t n = len - t0;
      const uint32_t keep01 = (2 * hq < n ? 0xffffu : 0u) | (2 * hq + 1 < n ? 0xffff0000u : 0u);
      const uint32_t keep23 = (2 * hq + 8 < n ? 0xffffu : 0u) | (2 * hq + 9 < n ? 0xffff0000u : 0u);
#pragma unroll
      for (int pp = 0; pp < D / 16; ++pp) {
        va[pp][0] &= keep01;
        va[pp][1] &= keep01;
        va[pp][2] &= keep23;
        va[pp][3] &= keep23;
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] *= log2_scale;
    }
    float prob[4], rescale[2], m_new[2];
    tile_softmax(s, m_run, l_run, prob, rescale, m_new);
    if constexpr (kMeter) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float d_add = 0.f, r_add = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = 2 * j + e;
          // Every unmasked token, also one whose p underflows float (meter_term takes log2 p for
          // large c); a masked token's bound and rho may be anything: selected away.
          const bool live = s[k] != -INFINITY;
          const float term = meter_term(prob[k], c[k], s[k] - m_new[e]);
          d_add += live ? term : 0.f;
          r_add = live ? fmaf(prob[k], rho[j], r_add) : r_add;
        }
        d_run[e] = d_run[e] * rescale[e] + d_add;
        r_run[e] = r_run[e] * rescale[e] + r_add;
      }
    }
    rescale_output<D>(rescale, o_acc);
    constexpr bool kHalfV = kExactV ? false : kHalf;
    uint32_t pb0, pb1;
    probability_operands<kHalfV>(prob, pb0, pb1);
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) mma16816<kHalfV>(o_acc[pp], va[pp], pb0, pb1);
  };

  const int64_t first = block_begin + warp;
  const int n_mine = first < block_end ? int((block_end - 1 - first) / kWarps + 1) : 0;
  const int64_t table_row =
      table_block * (p.table_row_stride > 0 ? p.table_row_stride : int64_t(p.n_kv_heads) * p.table_stride) +
      int64_t(kv_head) * p.table_stride;
  auto entry_of = [&](const int32_t* table, int j) { return table[table_row + first + int64_t(j) * kWarps]; };

  // Page j of this warp (table entries ke, ve) into stage j % kStages. A corrupt entry is zeroed
  // in place by the lanes (no copy is issued for it) before lane 0 arrives, so the stage's phase
  // completes either way. A block with an exact page (Page::kExactPages, an entry < 0) copies
  // nothing: it is attended after the others. The entries are read one page ahead (entry_of).
  auto issue = [&](int j, int32_t ke, int32_t ve) {
    const int st = j % kStages;
    const bool deferred = Page::kExactPages && (ke < 0 || ve < 0);
    const bool k_ok = ke >= 0 && ke < p.n_k_pages, v_ok = ve >= 0 && ve < p.n_v_pages;
    unsigned char* k_stage = sh.u.ring[warp][st].k;
    unsigned char* v_stage = sh.u.ring[warp][st].v;
    if (!deferred && (!k_ok || !v_ok)) {
#pragma unroll
      for (uint32_t c = lane; c < kBytesV / 16 || c < kBytesK / 16; c += 32) {
        if (!k_ok && c < kBytesK / 16) reinterpret_cast<uint4*>(k_stage)[c] = make_uint4(0, 0, 0, 0);
        if (!v_ok && c < kBytesV / 16) reinterpret_cast<uint4*>(v_stage)[c] = make_uint4(0, 0, 0, 0);
      }
      corrupt += lane == 0 ? unsigned(!k_ok) + unsigned(!v_ok) : 0u;
      __syncwarp();
    }
    if (lane == 0) {
      if constexpr (Page::kExactPages) {
        sh.entries[warp][st][0] = ke;
        sh.entries[warp][st][1] = ve;
      }
      fence_async_proxy();
      const bool copy_k = !deferred && k_ok, copy_v = !deferred && v_ok;
      barrier_arrive_expect(&sh.full[warp][st], (copy_k ? kBytesK : 0u) + (copy_v ? kBytesV : 0u));
      if (copy_k) bulk_copy(k_stage, p.k_pages + int64_t(ke) * p.k_page_stride, kBytesK, &sh.full[warp][st]);
      if (copy_v) bulk_copy(v_stage, p.v_pages + int64_t(ve) * p.v_page_stride, kBytesV, &sh.full[warp][st]);
    }
  };

  for (int j = 0; j < kStages && j < n_mine; ++j) issue(j, entry_of(p.k_table, j), entry_of(p.v_table, j));
  int32_t k_next = 0, v_next = 0;  // the entries of page i + kStages
  if (kStages < n_mine) {
    k_next = entry_of(p.k_table, kStages);
    v_next = entry_of(p.v_table, kStages);
  }
  auto issue_next = [&](int i) {
    if (i + kStages < n_mine) {
      issue(i + kStages, k_next, v_next);
      if (i + kStages + 1 < n_mine) {
        k_next = entry_of(p.k_table, i + kStages + 1);
        v_next = entry_of(p.v_table, i + kStages + 1);
      }
    }
  };
  int n_deferred = 0;
  for (int i = 0; i < n_mine; ++i) {
    const int st = i % kStages;
    barrier_wait(&sh.full[warp][st], uint32_t(i / kStages) & 1u);
    const int64_t blk = first + int64_t(i) * kWarps;
    if constexpr (Page::kExactPages) {
      if (sh.entries[warp][st][0] < 0 || sh.entries[warp][st][1] < 0) {
        ++n_deferred;
        __syncwarp();
        issue_next(i);
        continue;
      }
    }
    uint4 kx[kLoads], vx[kLoads];
    Page::template load<D>(sh.u.ring[warp][st].k, lane, kx);
    Page::template load<D>(sh.u.ring[warp][st].v, lane, vx);
    float rho[2] = {0.f, 0.f};
    if constexpr (kMeter) {
      const __half* side = reinterpret_cast<const __half*>(sh.u.ring[warp][st].v + kBlockTokens * D);
      rho[0] = __half2float(side[tq]);
      rho[1] = __half2float(side[tq + 8]);
    }
    __syncwarp();
    issue_next(i);
    uint32_t ka[D / 16][4], va[D / 16][4];
    Page::template operands<D>(kx, ka);
    Page::template operands<D>(vx, va);
    attend(std::false_type{}, std::false_type{}, ka, va, rho, blk);
  }

  // The blocks with an exact page, each read straight from its pools.
  if constexpr (Page::kExactPages) {
    if (n_deferred > 0) {
      for (int i = 0; i < n_mine; ++i) {
        const int32_t ke = entry_of(p.k_table, i), ve = entry_of(p.v_table, i);
        if (ke >= 0 && ve >= 0) continue;
        const int64_t blk = first + int64_t(i) * kWarps;
        uint32_t ka[D / 16][4], va[D / 16][4];
        float rho[2] = {0.f, 0.f};
        auto read = [&](bool key, int32_t e, uint32_t (&ops)[D / 16][4]) {
          const uint8_t* raw = key ? p.k_raw_pages : p.v_raw_pages;
          const uint8_t* pool = key ? p.k_pages : p.v_pages;
          if (e < 0) {
            const int64_t r = -int64_t(e) - 1;
            const bool ok = raw != nullptr && r < (key ? p.n_k_raw_pages : p.n_v_raw_pages);
            uint4 x[D / 16];
#pragma unroll
            for (int k = 0; k < D / 16; ++k) x[k] = make_uint4(0, 0, 0, 0);
            if (ok) Bf16Pages::load<D>(raw + r * p.raw_page_stride, lane, x);
            else corrupt += lane == 0;
            Bf16Pages::operands<D>(x, ops);
          } else {
            const bool ok = e < (key ? p.n_k_pages : p.n_v_pages);
            uint4 x[kLoads];
#pragma unroll
            for (int k = 0; k < kLoads; ++k) x[k] = make_uint4(0, 0, 0, 0);
            const uint8_t* page = pool + int64_t(e) * (key ? p.k_page_stride : p.v_page_stride);
            if (ok) Page::template load<D>(page, lane, x);
            else corrupt += lane == 0;
            Page::template operands<D>(x, ops);
            if (kMeter && !key && ok) {
              const __half* side = reinterpret_cast<const __half*>(page + kBlockTokens * D);
              rho[0] = __half2float(side[tq]);
              rho[1] = __half2float(side[tq + 8]);
            }
          }
        };
        read(true, ke, ka);
        read(false, ve, va);
        if (ke < 0 && ve < 0) attend(std::true_type{}, std::true_type{}, ka, va, rho, blk);
        else if (ke < 0) attend(std::true_type{}, std::false_type{}, ka, va, rho, blk);
        else attend(std::false_type{}, std::true_type{}, ka, va, rho, blk);
      }
    }
  }
  if (corrupt != 0 && lane == 0) atomicAdd(a.error_word, corrupt);

  __syncthreads();  // the ring becomes the merge area
  const int64_t row0 = int64_t(b) * p.n_q_heads + int64_t(kv_head) * group;
  write_split_partials<D, kWarps>(sh.u.merge, warp, lane, m_run, l_run, d_run, r_run, o_acc, group, row0, a.n_splits,
                                  split, a.part_mldr, a.part_o);
  // The last CTA of the row group to get here merges its splits.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* counter = a.split_counters + int64_t(b) * p.n_kv_heads + kv_head;
    sh.last = atomicInc(counter, unsigned(a.n_splits - 1)) == unsigned(a.n_splits - 1);  // wraps to 0
  }
  __syncthreads();
  if (!sh.last) return;
  __threadfence();
  merge_row_group<D, Page, kStages>(sh, a, row0, group);
}

template <int D, class Page, bool kMeter, int kStages>
constexpr size_t shared_bytes() {
  return sizeof(FragmentShared<D, Page, kStages>);
}

template <int D, class Page, bool kMeter, int kStages>
cudaError_t configure() {
  static const cudaError_t e = cudaFuncSetAttribute(fragment_split_kernel<D, Page, kMeter, kStages>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    int(shared_bytes<D, Page, kMeter, kStages>()));
  return e;
}

// Stages of each warp's ring. Measured on an H100 (bf16 and fp8 pages, 32 / 8 heads, 64K and
// 128K, batch 1 and 8): 3 and 4 stages were 2-8% slower than 2 (fewer CTAs per multiprocessor
// for bf16, more registers for fp8; docs/bench/h100_fragment_pages_*.jsonl).
constexpr int kRingStages = 2;

template <int D, class Page, bool kMeter, int kStages>
CudaStatus launch(const FragmentSplitArgs& a) {
  if (const cudaError_t e = configure<D, Page, kMeter, kStages>(); e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda decode: cannot set the shared memory size: ") + cudaGetErrorString(e)};
  fragment_split_kernel<D, Page, kMeter, kStages><<<dim3(a.n_splits, a.p.n_kv_heads, a.p.batch), kThreads,
                                                    shared_bytes<D, Page, kMeter, kStages>(),
                                                    static_cast<cudaStream_t>(a.p.stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda decode: kernel launch failed: ") + cudaGetErrorString(e)};
  return {};
}

template <int D, class Page, bool kMeter, int kStages>
int resident() {
  static const int n = [] {
    int r = 0;
    if (configure<D, Page, kMeter, kStages>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, fragment_split_kernel<D, Page, kMeter, kStages>, kThreads,
                                                      shared_bytes<D, Page, kMeter, kStages>()) != cudaSuccess) {
      cudaGetLastError();
      return 2;
    }
    return r < 1 ? 1 : r;
  }();
  return n;
}

bool meter_on(const PagedDecodeParams& p) { return p.meter != nullptr || p.a_minus_1 != nullptr || p.value_rho != nullptr; }

// Calls f with the kernel's template arguments for p (format, head_dim, meter, stages).
template <class F>
auto with_kernel(const PagedDecodeParams& p, F&& f) {
  auto by_stages = [&](auto d, auto page, auto meter) { return f(d, page, meter, std::integral_constant<int, kRingStages>{}); };
  auto by_format = [&](auto d) {
    if (p.format == PageFormat::kFp8Fragments) {
      if (meter_on(p)) return by_stages(d, Fp8Pages{}, std::true_type{});
      return by_stages(d, Fp8Pages{}, std::false_type{});
    }
    return by_stages(d, Bf16Pages{}, std::false_type{});
  };
  if (p.head_dim == 64) return by_format(std::integral_constant<int, 64>{});
  return by_format(std::integral_constant<int, 128>{});
}

}  // namespace

CudaStatus launch_fragment_split(const FragmentSplitArgs& a) {
  return with_kernel(a.p, [&](auto d, auto page, auto meter, auto st) {
    return launch<decltype(d)::value, decltype(page), decltype(meter)::value, decltype(st)::value>(a);
  });
}

int fragment_resident_ctas(const PagedDecodeParams& p) {
  return with_kernel(p, [&](auto d, auto page, auto meter, auto st) {
    return resident<decltype(d)::value, decltype(page), decltype(meter)::value, decltype(st)::value>();
  });
}

}  // namespace certkv::attention::cuda
