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
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

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

template <int D>
constexpr uint32_t kPageBytes = kBlockTokens * D * 2;

template <int D, int kStages>
struct FragmentShared {
  union {
    uint16_t ring[kWarps][kStages][2][kBlockTokens * D];  // [warp][stage][K, V]
    WarpMerge<D, kWarps> merge;
    float merge_weight[kMaxGroup][kMergeChunk];  // the last CTA's split weights, a chunk at a time
  } u;
  float row_max[kMaxGroup], row_l[kMaxGroup];
  uint64_t full[kWarps][kStages];
  uint16_t q[kMaxGroup][D];  // bf16 bits
  int last;
};

// The splits of rows row0 .. row0 + rows - 1 merged by one CTA (the last of the row group to
// finish): out = sum_s 2^{m_s - M} o_s / sum_s 2^{m_s - M} l_s per row, A - 1 and the value side
// likewise (write_row_meter). The partials are other CTAs' stores: read through L2 (__ldcg). The
// rows go side by side: a warp per row for the maxima and sums, then every thread a few (row,
// 4 channels) items over a chunk of splits at a time, kMergeLoads loads in flight.

template <int D, int kStages>
__device__ void merge_row_group(FragmentShared<D, kStages>& sh, const FragmentSplitArgs& a, int64_t row0, int rows) {
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

template <int D, int kStages>
__global__ void __launch_bounds__(kThreads) fragment_split_kernel(FragmentSplitArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Shared = FragmentShared<D, kStages>;
  Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
  const PagedDecodeParams& p = a.p;

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

  for (int i = threadIdx.x; i < kMaxGroup * D; i += kThreads) {
    const int g = i / D, c = i % D;
    const float x = g < group ? p.q[(int64_t(b) * p.n_q_heads + kv_head * group + g) * D + c] : 0.f;
    sh.q[g][c] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
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

  const int64_t first = block_begin + warp;
  const int n_mine = first < block_end ? int((block_end - 1 - first) / kWarps + 1) : 0;
  const int64_t table_row =
      table_block * (p.table_row_stride > 0 ? p.table_row_stride : int64_t(p.n_kv_heads) * p.table_stride) +
      int64_t(kv_head) * p.table_stride;

  // Page j of this warp (table entries ke, ve) into stage j % kStages. A corrupt entry is zeroed
  // in place by the lanes (no copy is issued for it) before lane 0 arrives, so the stage's phase
  // completes either way. The entries are read one page ahead of their issue (entry_of).
  auto entry_of = [&](const int32_t* table, int j) { return table[table_row + first + int64_t(j) * kWarps]; };
  auto issue = [&](int j, int32_t ke, int32_t ve) {
    const int st = j % kStages;
    const bool k_ok = ke >= 0 && ke < p.n_k_pages, v_ok = ve >= 0 && ve < p.n_v_pages;
    uint16_t* k_stage = sh.u.ring[warp][st][0];
    uint16_t* v_stage = sh.u.ring[warp][st][1];
    if (!k_ok || !v_ok) {
      constexpr int kChunks = kPageBytes<D> / 16;
#pragma unroll
      for (int c = lane; c < kChunks; c += 32) {
        if (!k_ok) reinterpret_cast<uint4*>(k_stage)[c] = make_uint4(0, 0, 0, 0);
        if (!v_ok) reinterpret_cast<uint4*>(v_stage)[c] = make_uint4(0, 0, 0, 0);
      }
      corrupt += lane == 0 ? unsigned(!k_ok) + unsigned(!v_ok) : 0u;
      __syncwarp();
    }
    if (lane == 0) {
      fence_async_proxy();
      barrier_arrive_expect(&sh.full[warp][st], (unsigned(k_ok) + unsigned(v_ok)) * kPageBytes<D>);
      if (k_ok) bulk_copy(k_stage, p.k_pages + int64_t(ke) * p.k_page_stride, kPageBytes<D>, &sh.full[warp][st]);
      if (v_ok) bulk_copy(v_stage, p.v_pages + int64_t(ve) * p.v_page_stride, kPageBytes<D>, &sh.full[warp][st]);
    }
  };

  for (int j = 0; j < kStages && j < n_mine; ++j) issue(j, entry_of(p.k_table, j), entry_of(p.v_table, j));
  int32_t k_next = 0, v_next = 0;  // the entries of page i + kStages
  if (kStages < n_mine) {
    k_next = entry_of(p.k_table, kStages);
    v_next = entry_of(p.v_table, kStages);
  }
  for (int i = 0; i < n_mine; ++i) {
    const int st = i % kStages;
    barrier_wait(&sh.full[warp][st], uint32_t(i / kStages) & 1u);
    const int64_t blk = first + int64_t(i) * kWarps;
    const uint4* k_ops = reinterpret_cast<const uint4*>(sh.u.ring[warp][st][0]) + lane;  // step kk: k_ops[32 kk]
    const uint4* v_ops = reinterpret_cast<const uint4*>(sh.u.ring[warp][st][1]) + lane;
    uint4 kf[D / 16], vf[D / 16];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) kf[kk] = k_ops[32 * kk];
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) vf[pp] = v_ops[32 * pp];
    __syncwarp();
    if (i + kStages < n_mine) {
      issue(i + kStages, k_next, v_next);
      if (i + kStages + 1 < n_mine) {
        k_next = entry_of(p.k_table, i + kStages + 1);
        v_next = entry_of(p.v_table, i + kStages + 1);
      }
    }

    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t r[4] = {kf[kk].x, kf[kk].y, kf[kk].z, kf[kk].w};
      mma16816<false>(s, r, qb[kk][0], qb[kk][1]);
    }
    const int64_t t0 = blk * kBlockTokens;
    const bool tail = t0 + kBlockTokens > len;  // the sequence's last page, partly past the length
    if (tail) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = t0 + tq + 8 * (k >> 1) < len ? s[k] * log2_scale : -INFINITY;
      // The values' columns are tokens: registers 0, 1 hold tokens 2 hq, 2 hq + 1; 2, 3 those + 8.
      const int64_t n = len - t0;
      const uint32_t keep01 = (2 * hq < n ? 0xffffu : 0u) | (2 * hq + 1 < n ? 0xffff0000u : 0u);
      const uint32_t keep23 = (2 * hq + 8 < n ? 0xffffu : 0u) | (2 * hq + 9 < n ? 0xffff0000u : 0u);
#pragma unroll
      for (int pp = 0; pp < D / 16; ++pp) {
        vf[pp].x &= keep01;
        vf[pp].y &= keep01;
        vf[pp].z &= keep23;
        vf[pp].w &= keep23;
      }
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] *= log2_scale;
    }
    float prob[4], rescale[2], m_new[2];
    tile_softmax(s, m_run, l_run, prob, rescale, m_new);
    rescale_output<D>(rescale, o_acc);
    uint32_t pb0, pb1;
    probability_operands<false>(prob, pb0, pb1);
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) {
      const uint32_t r[4] = {vf[pp].x, vf[pp].y, vf[pp].z, vf[pp].w};
      mma16816<false>(o_acc[pp], r, pb0, pb1);
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
  merge_row_group<D, kStages>(sh, a, row0, group);
}

template <int D, int kStages>
size_t shared_bytes() {
  return sizeof(FragmentShared<D, kStages>);
}

template <int D, int kStages>
cudaError_t configure() {
  static const cudaError_t e = cudaFuncSetAttribute(fragment_split_kernel<D, kStages>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes<D, kStages>()));
  return e;
}

// Stages of each warp's ring: CERTKV_FRAGMENT_STAGES (2 or 3) for the benchmark's comparisons,
// else 2.
int stages() {
  static const int n = [] {
    const char* s = std::getenv("CERTKV_FRAGMENT_STAGES");
    return s != nullptr && std::string(s) == "3" ? 3 : 2;
  }();
  return n;
}

template <int D, int kStages>
CudaStatus launch(const FragmentSplitArgs& a) {
  if (const cudaError_t e = configure<D, kStages>(); e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda decode: cannot set the shared memory size: ") + cudaGetErrorString(e)};
  fragment_split_kernel<D, kStages><<<dim3(a.n_splits, a.p.n_kv_heads, a.p.batch), kThreads, shared_bytes<D, kStages>(),
                                      static_cast<cudaStream_t>(a.p.stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda decode: kernel launch failed: ") + cudaGetErrorString(e)};
  return {};
}

template <int D, int kStages>
int resident() {
  static const int n = [] {
    int r = 0;
    if (configure<D, kStages>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, fragment_split_kernel<D, kStages>, kThreads,
                                                      shared_bytes<D, kStages>()) != cudaSuccess) {
      cudaGetLastError();
      return 2;
    }
    return r < 1 ? 1 : r;
  }();
  return n;
}

}  // namespace

CudaStatus launch_fragment_split(const FragmentSplitArgs& a) {
  const bool three = stages() == 3;
  if (a.p.head_dim == 64) return three ? launch<64, 3>(a) : launch<64, 2>(a);
  return three ? launch<128, 3>(a) : launch<128, 2>(a);
}

int fragment_resident_ctas(int head_dim) {
  const bool three = stages() == 3;
  if (head_dim == 64) return three ? resident<64, 3>() : resident<64, 2>();
  return three ? resident<128, 3>() : resident<128, 2>();
}

}  // namespace certkv::attention::cuda
