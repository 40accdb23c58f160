// The split kernel over fragment-major pages (fragment_decode_cuda.h). One CTA per (split, KV
// head, sequence), 4 warps; a warp takes the split's blocks first, first + 4, ... Each warp owns
// a ring of page pairs (K page then V page) in shared memory, filled by cp.async.bulk copies that
// complete on one mbarrier per stage; lane 0 issues the next page once a stage is free. A page
// class is a policy (Bf16Pages, Fp8Pages, Dither8Pages): its bytes, what a lane loads, how the
// loads become mma operands, and dither8's own scores and values. The scores and output products
// run on tensor cores (mma.m16n8k16, fp32 accumulation) in the layout of tile_mma.cuh (tokens as
// the 16 rows, the group's query heads as the 8 columns), the A operands read from the ring with
// one 16-byte load per lane and step. The last page of a sequence masks its scores past the
// length and zeroes its values' operands there (a device page past the length may hold anything,
// NaN too). A corrupt table entry reads as a zero page and counts in the error word. Exact pages
// (the raw pools: bf16, fragment-major): GAAC's go through the ring in their place, their values
// scaled into the coded pages' units (a raw page and its coded form give the same bits, and GAAC
// pages the bits of bf16 pages); the lossy classes' are attended after the others, read straight
// from their pools. After the
// warps' merge (write_split_partials) each CTA counts itself done on its row group's counter; the
// last one merges the group's splits into the outputs and leaves the counter at zero.
#include "attention/cuda/fragment_decode_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "attention/cuda/fragment_layout.h"
#include "format/dither8_generator.h"
#include "attention/cuda/tile_mma.cuh"

namespace certkv::attention::cuda {

namespace {

using namespace tile;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockTokens = fragment::kPageTokens;
constexpr int kMaxGroup = 8;
constexpr float kLog2e = 1.4426950408889634f;
// GAAC V window bases (biased exponents b) for which the kernel keeps the output in the built
// units, o 2^(kGaacBuilt - b) (fragment_split_kernel, built_units): the scale and its inverse are
// normal floats and bf16, and an output o keeps every bit there while 2^(b - 254) <= |o| < 2^b
// (in value units: from 2^-190 to 2^64 at the ends of the range, any output of real KV).
constexpr int kGaacBuiltUnitsLow = 64, kGaacBuiltUnitsHigh = 192;
// 1 / x for x = 2^e with -126 <= e <= 126 (the V scales of built units: e = b - kGaacBuilt, b in
// [kGaacBuiltUnitsLow, kGaacBuiltUnitsHigh]): 2^-e exactly, from the exponent field, where a float
// division takes a dozen instructions and a branch. x / 2^e and x 2^-e round the same real number.
__device__ inline float inverse_power_of_two(float x) { return __int_as_float(0x7f000000 - __float_as_int(x)); }

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
// One arrival on the barrier once this thread's earlier cp.async copies have landed (the barrier's
// expected count includes it: .noinc).
__device__ inline void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
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
// time, from shared or global memory alike) and how the loads become its mma A operands. Flags:
// kRowMajor, token-major pages copied a row at a time and read by ldmatrix (load_rows);
// kExactInRing, exact pages copied into the ring and attended in their place (a stage holds a raw
// page).

// A raw bf16 page of 16 tokens x D (either order).
template <int D>
__host__ __device__ constexpr uint32_t raw_page_bytes() {
  return kBlockTokens * D * 2;
}

// What a page class is when it says nothing else: bf16 elements, every table entry a page of the
// class (a raw entry is corrupt), no dither, no per-channel scaling, fragment-major, two stages per
// warp, one CTA a multiprocessor in the split plan. Each class below states what differs.
struct PageTraits {
  static constexpr bool kHalf = false;        // the mma element (and the query's rounding)
  static constexpr bool kExactPages = false;  // raw entries are corrupt
  static constexpr bool kDither = false;      // dither8's bytes: its own scores and values (below)
  static constexpr bool kScaled = false;      // GAAC: operands built, query and values scaled per channel
  static constexpr bool kRowMajor = false;
  static constexpr bool kExactInRing = false;
  static constexpr int kStages = 2;           // pages of each warp's ring (see with_kernel)
  static constexpr int kPlannedCtasPerSm = 1; // the split plan's wave (fragment_planned_ctas_per_sm)
};

// bf16, fragment-major: a lane's four registers of step s are its 16 bytes of the step.
struct Bf16Pages : PageTraits {
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return raw_page_bytes<D>(); }  // a stage's room
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return raw_page_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr uint32_t k_copy_bytes(int) { return k_bytes<D>(); }  // what a page holds
  template <int D>
  __host__ __device__ static constexpr uint32_t v_copy_bytes() { return v_bytes<D>(); }
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

// bf16, token-major: the bf16 scheme's pages (the sparse kernel reads their rows too). The lanes
// copy a page by 16-byte cp.async into a padded tile (rows of D + 8 elements, so that the 8 rows of
// an ldmatrix phase fall in 8 distinct bank groups; see issue in fragment_split_kernel); ldmatrix
// (K) and ldmatrix.trans (V) read the operands Bf16Pages loads from a fragment-major page, register
// for register.
struct Bf16RowPages : PageTraits {
  static constexpr bool kRowMajor = true;
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return PaddedTile<D>::kElements * 2; }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return PaddedTile<D>::kElements * 2; }
  template <int D>
  __host__ __device__ static constexpr uint32_t k_copy_bytes(int) { return raw_page_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_copy_bytes() { return raw_page_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr int loads() { return D / 16; }
  // The operands of every step of the K page (kKey) or the V page in a stage, as Bf16Pages::load
  // gives them from a fragment-major page. K (A = K): matrices (tokens 0-7, 8-15) x (channels
  // 16 s + 0-7, + 8-15); V (A = V^T): the transposes of (tokens 0-7) x (channels 0-7, 8-15), then
  // of tokens 8-15.
  template <int D, bool kKey>
  __device__ static void load_rows(const unsigned char* stage, int lane, uint4 (&x)[D / 16]) {
    const uint16_t* tile = reinterpret_cast<const uint16_t*>(stage);
    const int token = kKey ? ((lane >> 3) & 1) * 8 + (lane & 7) : (lane >> 4) * 8 + (lane & 7);
    const int base = PaddedTile<D>::offset(token, kKey ? lane >> 4 : (lane >> 3) & 1);
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      uint32_t r[4];
      if constexpr (kKey) ldsm_x4(r, tile + PaddedTile<D>::at(base, 2 * s));
      else ldsm_x4_trans(r, tile + PaddedTile<D>::at(base, 2 * s));
      x[s] = make_uint4(r[0], r[1], r[2], r[3]);
    }
  }
  template <int D>
  __device__ static void operands(const uint4 (&x)[D / 16], uint32_t (&a)[D / 16][4]) {
    Bf16Pages::operands<D>(x, a);
  }
};

// E4M3 codes, fragment-major (two steps per 16 bytes), converted exactly to fp16 pairs; V pages
// end with rho [16] fp16. Exact pages (entries < 0) are bf16 pages of Bf16Pages's layout.
struct Fp8Pages : PageTraits {
  static constexpr bool kHalf = true;
  static constexpr bool kExactPages = true;
  static constexpr int kPlannedCtasPerSm = 3;
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return kBlockTokens * D; }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return kBlockTokens * D + kBlockTokens * 2; }
  template <int D>
  __host__ __device__ static constexpr uint32_t k_copy_bytes(int) { return k_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_copy_bytes() { return v_bytes<D>(); }
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


// dither8 (docs/format/dither8.md), its codes fragment-major: K by generator words
// (fragment::word_key_byte), V as 8-bit codes; after the codes the scales [T][G] fp16 and (K) the
// outlier pairs' exact values [T][2 m] bf16. A page's scores and values read its scales, outliers
// and the generator (dither8_scores, dither8_values), so the stage is held until they are done.
struct Dither8Pages : PageTraits {
  static constexpr bool kHalf = true;
  static constexpr bool kExactPages = true;
  static constexpr bool kDither = true;
  static constexpr bool kSubtractDither = true;  // the generator's dither subtracted (Int8Pages: not)
  static constexpr int kStages = 3;  // a stage is held while its page is attended
  static constexpr int kPlannedCtasPerSm = 3;
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() {
    return kBlockTokens * (D + 2 * (D / kQuantGroupChannels) + 4 * kMaxDeviceOutlierPairs);
  }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return kBlockTokens * (D + 2 * (D / kQuantGroupChannels)); }
  template <int D>
  __host__ __device__ static constexpr uint32_t k_copy_bytes(int outlier_pairs) {
    return kBlockTokens * (D + 2 * (D / kQuantGroupChannels) + 4 * outlier_pairs);
  }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_copy_bytes() { return v_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr int loads() { return D / 32; }
  template <int D>
  __device__ static void load(const unsigned char* page, int lane, uint4 (&x)[D / 32]) {
    Fp8Pages::load<D>(page, lane, x);
  }
};

// dither8's bytes read as plain int8 (PageFormat::kInt8Fragments): K^ = s q with no dither
// subtracted and no meter, the same bytes and loop otherwise. The yardstick of what dither8's
// generator and certificate cost (docs/cuda.md); no scheme serves it.
struct Int8Pages : Dither8Pages {
  static constexpr bool kSubtractDither = false;
};

// GAAC pages in the device layout (format/fragment_layout.h): a lane's low bytes of two steps per
// 16-byte load, its code and sign words of four steps per load, and the page's exceptions (the
// same bytes for every lane). The operands are the built bf16 (exponent kGaacBuilt + code, that is
// k 2^(kGaacBuilt - b)): two PRMT lookups and four byte interleaves per eight elements, then the
// exceptions patched in (at most the page's capacity of them). The kernel folds 2^(b -
// kGaacBuilt) into the query (K) and keeps the output in the V channels' built units (scaled back
// once): the products and sums are the bf16 pages'. Exact pages (entries < 0): bf16,
// fragment-major, attended in their place in the ring, their values scaled into the built units.
struct GaacPages : PageTraits {
  static constexpr bool kExactPages = true;
  static constexpr bool kScaled = true;
  static constexpr bool kExactInRing = true;
  // Measured on an H100 (32 / 8, 128K, docs/bench/h100_gaac_fragments_splits_78cdb80.jsonl): three
  // CTAs a multiprocessor 1-2.5% faster than two at batch 1 and 8, one 1.3-1.4x slower.
  static constexpr int kPlannedCtasPerSm = 3;
  // A stage holds a coded page or a raw one.
  template <int D>
  __host__ __device__ static constexpr uint32_t k_bytes() { return raw_page_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_bytes() { return raw_page_bytes<D>(); }
  template <int D>
  __host__ __device__ static constexpr uint32_t k_copy_bytes(int) { return fragment::gaac_page_bytes(D); }
  template <int D>
  __host__ __device__ static constexpr uint32_t v_copy_bytes() { return fragment::gaac_page_bytes(D); }
  template <int D>
  __host__ __device__ static constexpr int low_loads() { return D / 32; }
  template <int D>
  __host__ __device__ static constexpr int word_loads() { return D / 64; }
  template <int D>
  __host__ __device__ static constexpr int loads() { return D / 32 + 2 * (D / 64); }
  template <int D>
  __device__ static void load(const unsigned char* page, int lane, uint4 (&x)[loads<D>()]) {
    const uint4* low = reinterpret_cast<const uint4*>(page);
    const uint4* words = reinterpret_cast<const uint4*>(page + fragment::gaac_low_bytes(D));
    const uint4* exceptions = reinterpret_cast<const uint4*>(page + fragment::gaac_low_bytes(D) + fragment::gaac_word_bytes(D));
#pragma unroll
    for (int i = 0; i < low_loads<D>(); ++i) x[i] = low[32 * i + lane];
#pragma unroll
    for (int i = 0; i < word_loads<D>(); ++i) x[low_loads<D>() + i] = words[32 * i + lane];
#pragma unroll
    for (int i = 0; i < D / 64; ++i) x[low_loads<D>() + word_loads<D>() + i] = exceptions[i];
  }
  __device__ static uint32_t component(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
  template <int D>
  __device__ static void operands(const uint4 (&x)[loads<D>()], uint32_t (&a)[D / 16][4]) {
    auto perm = [](uint32_t lo, uint32_t hi, uint32_t sel) { return __byte_perm(lo, hi, sel); };
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const uint4& low = x[s / 2];
      fragment::gaac_step_operands(s % 2 ? low.z : low.x, s % 2 ? low.w : low.y,
                                   component(x[low_loads<D>() + s / 4], s % 4), perm, a[s]);
    }
    constexpr int E = low_loads<D>() + word_loads<D>();
    constexpr int kCapacity = fragment::gaac_exception_capacity(D);
    const uint32_t count = x[E].x;
    if (count != 0) {
      const int lane = int(threadIdx.x & 31);
      const uint32_t n = min(count, uint32_t(kCapacity));
#pragma unroll
      for (int i = 0; i < kCapacity; ++i)
        if (uint32_t(i) < n) fragment::gaac_patch<D / 16>(component(x[E + (i + 1) / 4], (i + 1) % 4), lane, a);
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
  // bf16 bits, for exact pages. A row is padded by 16 bytes: scores_exact's loads take rows tq =
  // 0..7 at one column each, which a 256-byte row stride would put in one bank (8 ways).
  uint16_t q_exact[Page::kExactPages ? kMaxGroup : 1][D + 8];
  float q_term[kMaxGroup];              // 2^-10 sum_i |q_i| rounded up (the bound's second term)
  // dither8: the outlier channels (-1: corrupt) and whether none is, the query's elements there
  // per head (0 for a corrupt one), the Tier B weights per (head, group) nudged up, the scores'
  // starting values per (head, group) (dither8_scores)
  int32_t outlier_channels[2 * kMaxDeviceOutlierPairs];
  int outliers_valid;
  alignas(8) float outlier_q[kMaxGroup][2 * kMaxDeviceOutlierPairs];
  float weight[kMaxGroup][D / kQuantGroupChannels], abs_weight[kMaxGroup][D / kQuantGroupChannels];
  float score_init[kMaxGroup][D / kQuantGroupChannels];
  float row_max[kMaxGroup], row_l[kMaxGroup];
  float value_scale[Page::kScaled ? D : 1];  // GAAC: 2^(b - kGaacBuilt) of each V channel
  int built_units;                            // GAAC: the output in the V channels' built units
  int last;
};
static_assert(sizeof(FragmentShared<128, Bf16Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<128, Fp8Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<64, Fp8Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<128, Dither8Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<64, Dither8Pages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<128, GaacPages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<64, GaacPages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<128, Bf16RowPages, 2>::Stage) % 16 == 0 &&
                  sizeof(FragmentShared<64, Bf16RowPages, 2>::Stage) % 16 == 0,
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

// ---------------------------------------------------------------------------------------------
// dither8 pages' scores and values (Dither8Pages), from a lane's code loads and the page's side
// data (in its stage, or in its pool for the blocks attended after the others).

// S^T = K^ Q^T with K^ = s (q - xi) per token and group of 32 channels: in step kk the lane's A
// operand is its rows' generator word 4 kk + hq (channels 16 kk + 4 hq .. + 3, the query's B
// operand permuted alike). Two mma per step into one accumulator per group: the codes q (fp16
// 1024 + (q + 128) by PRMT, minus 1152: exact) and the dither as -(4 + u/256), one PRMT with
// 0xc4 as the high byte (fp16 0xc4xx is -(4 + xx/256), exact). With the group's starting value
// 4.5 sum_c q_c - (1/512) sum_{c not outlier} q_c (Shared::score_init) the accumulator is
// sum_c q_c (q_c - xi_c), since q - xi = q + 1/2 - u/256 - 1/512; then the token's scale, in fp32.
// Outlier channels: code 0 and dither byte 128 (-4.5, which the start cancels), so the sum leaves
// them out; their exact values are added after. kSubtract false (Int8Pages): the codes alone,
// from 0, and no generator.
// c (kMeter): the Tier B bound sqrt(sum_g w_g s_g^2) + sum_g w'_g s_g of each cell.
template <int D, bool kMeter, bool kSubtract, class Shared>
__device__ inline void dither8_scores(const Shared& sh, const uint4 (&kx)[D / 32], const unsigned char* page,
                                      int outlier_pairs, uint64_t key, int64_t blk, int tq, int hq,
                                      const uint32_t (&qb)[D / 16][2], const uint32_t (&keep)[D / 16], float (&s)[4],
                                      float (&c)[4]) {
  constexpr int G = D / kQuantGroupChannels;
  const __half2 k1152 = __float2half2_rn(1152.f);
  const uint64_t counter = uint64_t(blk) * kBlockTokens + uint64_t(tq);  // the token's position
  uint32_t seeds[2] = {0u, 0u};
  if constexpr (kSubtract) seeds[0] = format::dither8_row_seed(key, counter), seeds[1] = format::dither8_row_seed(key, counter + 8);
  float sc[2][G];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const __half* scales = reinterpret_cast<const __half*>(page + kBlockTokens * D) + (tq + 8 * r) * G;
#pragma unroll
    for (int g = 0; g < G; ++g) sc[r][g] = __half2float(scales[g]);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float o0 = kSubtract ? sh.score_init[2 * hq][g] : 0.f, o1 = kSubtract ? sh.score_init[2 * hq + 1][g] : 0.f;
    float acc[4] = {o0, o1, o0, o1};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int kk = 2 * g + half;
      const uint32_t words[2] = {half ? kx[g].z : kx[g].x, half ? kx[g].w : kx[g].y};
      uint32_t codes[4], dither[4];  // [r]: channels 0, 1 of row r's word; [r + 2]: channels 2, 3
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t biased = words[r] ^ 0x80808080u;  // code + 128
        uint32_t u = 0;
        if constexpr (kSubtract) {
          const uint32_t word = format::dither8_word(seeds[r], 4 * kk + hq);
          u = (word & keep[kk]) | (0x80808080u & ~keep[kk]);
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          uint32_t c2 = bytes_to_1024_plus(biased, 2 * k);
          const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&c2), k1152);
          codes[r + 2 * k] = *reinterpret_cast<const uint32_t*>(&q);
          if constexpr (kSubtract) dither[r + 2 * k] = bytes_to_minus_4_plus(u, 2 * k);
        }
      }
      mma16816<true>(acc, codes, qb[kk][0], qb[kk][1]);
      if constexpr (kSubtract) mma16816<true>(acc, dither, qb[kk][0], qb[kk][1]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = fmaf(sc[k >> 1][g], acc[k], s[k]);
  }
  // The outlier pairs' exact values (bf16, a pair's two channels in one 32-bit load, the lower
  // channel in the low half) times the query's elements there (Shared::outlier_q), channel after
  // channel into each cell as before.
  const uint32_t* exact = reinterpret_cast<const uint32_t*>(page + kBlockTokens * (D + 2 * G));
  if (sh.outliers_valid) {
#pragma unroll 1
    for (int o = 0; o < outlier_pairs; ++o) {
      const uint32_t x[2] = {exact[tq * outlier_pairs + o], exact[(tq + 8) * outlier_pairs + o]};
      const float2 qh[2] = {*reinterpret_cast<const float2*>(&sh.outlier_q[2 * hq][2 * o]),
                            *reinterpret_cast<const float2*>(&sh.outlier_q[2 * hq + 1][2 * o])};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s[k] = fmaf(qh[k & 1].x, __uint_as_float(x[k >> 1] << 16), s[k]);
        s[k] = fmaf(qh[k & 1].y, __uint_as_float(x[k >> 1] & 0xffff0000u), s[k]);
      }
    }
  } else {  // a corrupt channel (counted) is left out, whatever its exact values hold
    const uint16_t* exact16 = reinterpret_cast<const uint16_t*>(exact);
#pragma unroll 1
    for (int o = 0; o < 2 * outlier_pairs; ++o) {
      if (sh.outlier_channels[o] < 0) continue;
      const float xo[2] = {__bfloat162float(__ushort_as_bfloat16(exact16[tq * 2 * outlier_pairs + o])),
                           __bfloat162float(__ushort_as_bfloat16(exact16[(tq + 8) * 2 * outlier_pairs + o]))};
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = fmaf(sh.outlier_q[2 * hq + (k & 1)][o], xo[k >> 1], s[k]);
    }
  }
  if constexpr (kMeter) tier_b_bounds<G>(sh.weight, sh.abs_weight, sc, hq, c);
}

// A dither8 V page's scales of the lane's tokens tq, tq + 8 (0 from token n on: a tail's rows past
// the length hold anything) and, kMeter, their rho_t = kDither8ValueRho sqrt(sum_g 32 s_{t,g}^2),
// the CPU's float steps in its order but for the square root, sqrt_upper's (at least the root).
template <int D, bool kMeter>
__device__ inline void dither8_value_scales(const unsigned char* page, int tq, int64_t n, float (&sv)[2][D / 32],
                                            float (&rho)[2]) {
  constexpr int G = D / kQuantGroupChannels;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const __half* scales = reinterpret_cast<const __half*>(page + kBlockTokens * D) + (tq + 8 * r) * G;
    float sum_sq = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sv[r][g] = tq + 8 * r < n ? __half2float(scales[g]) : 0.f;
      sum_sq += float(kQuantGroupChannels) * sv[r][g] * sv[r][g];
    }
    if constexpr (kMeter) rho[r] = kDither8ValueRho * sqrt_upper(sum_sq);
  }
}

// O^T += V^T P'^T over a dither8 V page: the codes as fp16 operands (exact integers), and the
// token's scale of each group folded into the probabilities: P'_t = p_t s_{t,g}, one pair of B
// operands per group. A tail's tokens past the length need no masks: every code byte is a finite
// operand, and their P' is 0 (p 0, and a scale of 0 from dither8_value_scales).
template <int D>
__device__ inline void dither8_values(const uint4 (&vx)[D / 32], const float (&sv)[2][D / 32], const float (&prob)[4],
                                      float (&o)[D / 16][4]) {
  constexpr int G = D / kQuantGroupChannels;
  const __half2 k1152 = __float2half2_rn(1152.f);
  auto pair = [&](uint32_t word, int byte) {
    uint32_t c2 = bytes_to_1024_plus(word ^ 0x80808080u, byte);
    const __half2 q = __hsub2(*reinterpret_cast<__half2*>(&c2), k1152);
    return *reinterpret_cast<const uint32_t*>(&q);
  };
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const uint32_t pb0 = transpose8x8(pack2<true>(prob[0] * sv[0][g], prob[1] * sv[0][g]));
    const uint32_t pb1 = transpose8x8(pack2<true>(prob[2] * sv[1][g], prob[3] * sv[1][g]));
    const uint32_t w[2][2] = {{vx[g].x, vx[g].y}, {vx[g].z, vx[g].w}};  // steps 2 g, 2 g + 1
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t a[4] = {pair(w[half][0], 0), pair(w[half][0], 2), pair(w[half][1], 0), pair(w[half][1], 2)};
      mma16816<true>(o[2 * g + half], a, pb0, pb1);
    }
  }
}

// A page's loads from its stage: a token-major tile's operands (Page::kRowMajor), an exact page's
// 16-byte loads (bf16, fragment-major: the first D / 16 registers; Page::kExactInRing), or the
// class's; and their operands.
template <int D, class Page, bool kKey>
__device__ inline void load_stage(const unsigned char* stage, int lane, bool raw, uint4 (&x)[Page::template loads<D>()]) {
  if constexpr (Page::kRowMajor) {
    Page::template load_rows<D, kKey>(stage, lane, x);
  } else if constexpr (Page::kExactInRing) {
    if (raw) Bf16Pages::load<D>(stage, lane, reinterpret_cast<uint4(&)[D / 16]>(x));
    else Page::template load<D>(stage, lane, x);
  } else {
    Page::template load<D>(stage, lane, x);
  }
}
template <int D, class Page>
__device__ inline void stage_operands(const uint4 (&x)[Page::template loads<D>()], bool raw, uint32_t (&a)[D / 16][4]) {
  if (Page::kExactInRing && raw) Bf16Pages::operands<D>(reinterpret_cast<const uint4(&)[D / 16]>(x), a);
  else Page::template operands<D>(x, a);
}

template <int D, class Page, bool kMeter, int kStages>
__global__ void __launch_bounds__(kThreads) fragment_split_kernel(FragmentSplitArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Shared = FragmentShared<D, Page, kStages>;
  Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
  const PagedDecodeParams& p = a.p;
  constexpr bool kHalf = Page::kHalf;
  constexpr int kLoads = Page::template loads<D>();
  constexpr int G = D / kQuantGroupChannels;
  const uint32_t bytes_k = Page::template k_copy_bytes<D>(p.n_outlier_pairs);
  constexpr uint32_t kBytesV = Page::template v_copy_bytes<D>();
  static_assert(!Page::kExactInRing || (!kHalf && kLoads >= D / 16 && Page::kScaled),
                "exact pages in the ring: bf16 operands in the class's load registers, scaled to the built units");

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.n_q_heads / p.n_kv_heads;
  const RowExtent extent = row_extent(p, b, a.error_word);
  const int64_t len = extent.len, table_block = extent.table_block;
  const int64_t n_blocks = (len + kBlockTokens - 1) / kBlockTokens;
  const int64_t block_begin = int64_t(split) * a.per_split;
  const int64_t block_end = min(n_blocks, block_begin + a.per_split);

  // The query rounded to the pages' element (and to bf16 for exact pages); the zero-byte bound's
  // second term per head, in double, rounded up; dither8's outlier channels.
  const float* q_row = p.q + (int64_t(b) * p.n_q_heads + int64_t(kv_head) * group) * D;
  for (int i = threadIdx.x; i < kMaxGroup * D; i += kThreads) {
    const int g = i / D, c = i % D;
    const float x = g < group ? q_row[int64_t(g) * D + c] : 0.f;
    sh.q[g][c] = element_bits<kHalf>(x);
    if constexpr (Page::kExactPages) sh.q_exact[g][c] = element_bits<false>(x);
    if constexpr (Page::kScaled) {  // q 2^(b - kGaacBuilt), b the channel's K window: exact
      const int base = p.gaac_bases[(int64_t(kv_head) * 2 + 1) * D + c];
      sh.q[g][c] = element_bits<false>(ldexpf(element_value<false>(sh.q[g][c]), base - fragment::kGaacBuilt));
    }
  }
  [[maybe_unused]] bool safe_bases = true;
  if constexpr (Page::kScaled) {
    for (int c = threadIdx.x; c < D; c += kThreads) {
      const int base = p.gaac_bases[((int64_t(p.n_kv_heads) + kv_head) * 2 + 1) * D + c];
      sh.value_scale[c] = ldexpf(1.f, base - fragment::kGaacBuilt);
      safe_bases = safe_bases && base >= kGaacBuiltUnitsLow && base <= kGaacBuiltUnitsHigh;
    }
  }
  if constexpr (kMeter && !Page::kDither) {
    if (threadIdx.x < kMaxGroup) {
      const int g = threadIdx.x;
      double sum = 0;
      for (int c = 0; c < D && g < group; ++c) sum += fabs(double(element_value<kHalf>(element_bits<kHalf>(q_row[int64_t(g) * D + c]))));
      sh.q_term[g] = __double2float_ru(sum * (1.0 / 1024.0));
    }
  }
  if constexpr (Page::kDither) {
    load_outlier_channels(p, kv_head, a.error_word, sh.outlier_channels);
  }
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) barrier_init(&sh.full[warp][st], Page::kRowMajor ? 32 : 1);  // see issue
    barrier_init_fence();
  }
  if constexpr (Page::kScaled) {
    const bool built_units = __syncthreads_and(safe_bases);
    if (threadIdx.x == 0) sh.built_units = built_units;
  }
  __syncthreads();
  if constexpr (Page::kDither) {
    // One thread per (row, group): the Tier B weights (nudged up by 2^-16 like the CPU path) and
    // the scores' starting values, 4.5 sum_c q_c - (1/2)/256 sum_{c not outlier} q_c (exact in
    // double, rounded once), which the scores need with the meter or without. Then one thread per
    // (row, outlier channel): the query's element there.
    const int g = threadIdx.x / G, j = threadIdx.x % G;
    if (g < kMaxGroup && kMeter) {
      const TierBWeights tb =
          tier_b_weights<D, kHalf>(sh.q[g], j, sh.outlier_channels, 2 * p.n_outlier_pairs, p.sm_scale, len, p.delta_loc);
      sh.weight[g][j] = float(tb.w) * (1.0f + 1.0f / 65536.0f);
      sh.abs_weight[g][j] = float(tb.w_abs) * (1.0f + 1.0f / 65536.0f);
    }
    if (g < kMaxGroup && Page::kSubtractDither) {
      double all = 0, kept = 0;
      for (int c = j * kQuantGroupChannels; c < (j + 1) * kQuantGroupChannels; ++c) {
        const double qc = element_value<kHalf>(sh.q[g][c]);
        bool outlier = false;
        for (int o = 0; o < 2 * p.n_outlier_pairs; ++o) outlier |= sh.outlier_channels[o] == c;
        all += qc;
        kept += outlier ? 0.0 : qc;
      }
      sh.score_init[g][j] = float(4.5 * all - kept / 512.0);
    }
    const int n_outliers = 2 * p.n_outlier_pairs;
    if (threadIdx.x < kMaxGroup * n_outliers) {
      const int row = threadIdx.x / n_outliers, o = threadIdx.x % n_outliers, oc = sh.outlier_channels[o];
      sh.outlier_q[row][o] = oc < 0 ? 0.f : element_value<kHalf>(sh.q[row][oc]);
    }
    if (threadIdx.x == 0) {
      bool valid = true;
      for (int o = 0; o < n_outliers; ++o) valid = valid && sh.outlier_channels[o] >= 0;
      sh.outliers_valid = valid;
    }
    __syncthreads();
  }

  const int tq = lane >> 2, hq = lane & 3;
  // Q^T as the B operand: channels 2 hq, 2 hq + 1 (+ 8) of head tq; dither8: channels 4 hq + 0, 1
  // (+ 2, 3), its K operands' words.
  uint32_t qb[D / 16][2];
  query_operands<D, Page::kDither>(sh.q, tq, hq, qb);
  [[maybe_unused]] uint32_t keep[D / 16];
  [[maybe_unused]] uint64_t dither_key = 0;
  if constexpr (Page::kDither) {
    if constexpr (Page::kSubtractDither) {
      outlier_keep_masks<D>(sh.outlier_channels, 2 * p.n_outlier_pairs, hq, keep);
      dither_key = p.dither_keys[kv_head];
    }
  }

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, d_run[2] = {0.f, 0.f}, r_run[2] = {0.f, 0.f};
  float o_acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  const float log2_scale = p.sm_scale * kLog2e;
  unsigned int corrupt = 0;

  // The three steps of a page pair. Scores: exact pages (bf16 operands, the bf16 query, bound 0),
  // lossy bf16 / fp8 pages (operands, and fp8's zero-byte bound), dither8 pages (dither8_scores).
  // Then softmax: the tail's masks (scores past the length -inf; the values' operand masks for
  // tokens past it), the online softmax and the meter's sums. Then the values' product.
  auto scores_exact = [&](const uint32_t (&ka)[D / 16][4], float (&s)[4]) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&sh.q_exact[tq][16 * kk + 2 * hq]);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&sh.q_exact[tq][16 * kk + 2 * hq + 8]);
      mma16816<false>(s, ka[kk], b0, b1);
    }
  };
  auto scores_operands = [&](const uint32_t (&ka)[D / 16][4], float (&s)[4], float (&c)[4]) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) mma16816<kHalf>(s, ka[kk], qb[kk][0], qb[kk][1]);
    if constexpr (kMeter) {
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
  };
  struct Masks {
    bool tail;
    uint32_t keep01, keep23;
    int64_t n;  // tokens of the page within the length
  };
  auto softmax = [&](float (&s)[4], const float (&c)[4], const float (&rho)[2], int64_t blk, float (&prob)[4]) {
    const int64_t t0 = blk * kBlockTokens;
    Masks mk{t0 + kBlockTokens > len, 0xffffffffu, 0xffffffffu, min(int64_t(kBlockTokens), len - t0)};
    if (mk.tail) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] = t0 + tq + 8 * (k >> 1) < len ? s[k] * log2_scale : -INFINITY;
      // The values' columns are tokens: registers 0, 1 hold tokens 2 hq, 2 hq + 1; 2, 3 those + 8.
      mk.keep01 = (2 * hq < mk.n ? 0xffffu : 0u) | (2 * hq + 1 < mk.n ? 0xffff0000u : 0u);
      mk.keep23 = (2 * hq + 8 < mk.n ? 0xffffu : 0u) | (2 * hq + 9 < mk.n ? 0xffff0000u : 0u);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] *= log2_scale;
    }
    float rescale[2], m_new[2];
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
    // The output's rescale only when some row's maximum moved (a factor of exactly 1 is skipped:
    // x * 1 is x for every float), decided for the warp: after a split's first pages most pages
    // leave both maxima where they are.
    if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) rescale_output<D>(rescale, o_acc);
    return mk;
  };
  auto values_operands = [&](auto half_t, uint32_t (&va)[D / 16][4], const float (&prob)[4], const Masks& mk,
                             float (&acc)[D / 16][4]) {
    constexpr bool kHalfV = decltype(half_t)::value;
    if (mk.tail) {
#pragma unroll
      for (int pp = 0; pp < D / 16; ++pp) {
        va[pp][0] &= mk.keep01;
        va[pp][1] &= mk.keep01;
        va[pp][2] &= mk.keep23;
        va[pp][3] &= mk.keep23;
      }
    }
    uint32_t pb0, pb1;
    probability_operands<kHalfV>(prob, pb0, pb1);
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) mma16816<kHalfV>(acc[pp], va[pp], pb0, pb1);
  };
  // GAAC. The output is kept in the built units of the V channels (o 2^(kGaacBuilt - b), rows
  // 16 pp + tq (+ 8)) when every V window base of the KV head is in [kGaacBuiltUnitsLow, kGaacBuiltUnitsHigh]
  // (sh.built_units; real calibrations are): a coded page's values are built, and the products'
  // sums scale exactly by a power of two, so it holds the bf16 pages' output to the bit, scaled;
  // it is scaled back once, at the end. An exact V page's operands are scaled into the built units
  // too (raw_values_in_built_units: x 2^(kGaacBuilt - b) per channel, exact, checked by the round
  // trip). A page whose values cannot go straight into the output (an exact page with a value that
  // has no exact built form: its exponent past the window's reach, a NaN; any page of a KV head
  // whose bases are out of range) is summed from zero and added times m per channel (add_page):
  // exact scaling, one rounding more.
  const bool built_units = !Page::kScaled || sh.built_units;
  [[maybe_unused]] auto add_page = [&](uint32_t (&va)[D / 16][4], const float (&prob)[4], const Masks& mk, bool raw) {
    float page[D / 16][4];
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp) page[pp][0] = page[pp][1] = page[pp][2] = page[pp][3] = 0.f;
    values_operands(std::false_type{}, va, prob, mk, page);
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // a raw page into built units: times 2^(kGaacBuilt - b); a coded page into value units:
        // times 2^(b - kGaacBuilt)
        const float scale = sh.value_scale[16 * pp + tq + 8 * (k >> 1)];
        o_acc[pp][k] += raw ? (built_units ? page[pp][k] * inverse_power_of_two(scale) : page[pp][k]) : page[pp][k] * scale;
      }
  };
  [[maybe_unused]] auto raw_values_in_built_units = [&](uint32_t (&va)[D / 16][4], const Masks& mk) {
    if (mk.tail) {  // the tokens past the length first zeroed (a raw tail page holds anything there)
#pragma unroll
      for (int pp = 0; pp < D / 16; ++pp) {
        va[pp][0] &= mk.keep01;
        va[pp][1] &= mk.keep01;
        va[pp][2] &= mk.keep23;
        va[pp][3] &= mk.keep23;
      }
    }
    bool exact = true;
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp)
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // registers 0, 2: channel 16 pp + tq; 1, 3: + 8
        const float scale = sh.value_scale[16 * pp + tq + 8 * (r & 1)], up = inverse_power_of_two(scale);
        const __nv_bfloat162 s2 = __floats2bfloat162_rn(up, up), back2 = __floats2bfloat162_rn(scale, scale);
        const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&va[pp][r]);
        const __nv_bfloat162 y = __hmul2(x, s2);
        const __nv_bfloat162 z = __hmul2(y, back2);
        exact = exact && *reinterpret_cast<const uint32_t*>(&z) == va[pp][r];
        va[pp][r] = *reinterpret_cast<const uint32_t*>(&y);
      }
    return __all_sync(0xffffffffu, exact);
  };
  [[maybe_unused]] auto to_value_units = [&] {
#pragma unroll
    for (int pp = 0; pp < D / 16; ++pp)
#pragma unroll
      for (int k = 0; k < 4; ++k) o_acc[pp][k] *= sh.value_scale[16 * pp + tq + 8 * (k >> 1)];
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
  // nothing unless the class attends exact pages in the ring (Page::kExactInRing: the raw page is
  // copied); else it is attended after the others. Token-major pages (Page::kRowMajor) go by 16-byte
  // cp.async copies of every lane into the padded tiles (zero-filled for a corrupt entry), each lane
  // arriving on the stage's barrier once its copies have landed (16 bulk copies of a row per page
  // were 1.3x slower: docs/bench/cuda_history.md). The entries are read one page ahead (entry_of).
  auto issue = [&](int j, int32_t ke, int32_t ve) {
    const int st = j % kStages;
    const bool deferred = Page::kExactPages && !Page::kExactInRing && (ke < 0 || ve < 0);
    // A page's source and bytes: its pool's page, the raw pool's (in the ring), or none (corrupt).
    auto source = [&](bool key, int32_t e, uint32_t& bytes) -> const unsigned char* {
      if (e >= 0) {
        bytes = key ? bytes_k : kBytesV;
        return e < (key ? p.n_k_pages : p.n_v_pages) ? (key ? p.k_pages : p.v_pages) + int64_t(e) * (key ? p.k_page_stride : p.v_page_stride)
                                                     : nullptr;
      }
      bytes = raw_page_bytes<D>();
      if (!Page::kExactInRing) return nullptr;
      const int64_t r = -int64_t(e) - 1;
      const uint8_t* raw = key ? p.k_raw_pages : p.v_raw_pages;
      return raw != nullptr && r < (key ? p.n_k_raw_pages : p.n_v_raw_pages) ? raw + r * p.raw_page_stride : nullptr;
    };
    uint32_t k_copy = 0, v_copy = 0;
    const unsigned char* k_src = source(true, ke, k_copy);
    const unsigned char* v_src = source(false, ve, v_copy);
    const bool k_ok = k_src != nullptr, v_ok = v_src != nullptr;
    unsigned char* k_stage = sh.u.ring[warp][st].k;
    unsigned char* v_stage = sh.u.ring[warp][st].v;
    if constexpr (Page::kRowMajor) {
      constexpr int kChunks = kBlockTokens * D / 8;  // 16-byte chunks of a page
#pragma unroll
      for (int c = lane; c < kChunks; c += 32) {
        const int row = c / (D / 8), chunk = c % (D / 8);
        const int to = PaddedTile<D>::offset(row, chunk) * 2, from = c * 16;
        cp_async16_zfill(k_stage + to, k_ok ? k_src + from : reinterpret_cast<const unsigned char*>(p.q), k_ok);
        cp_async16_zfill(v_stage + to, v_ok ? v_src + from : reinterpret_cast<const unsigned char*>(p.q), v_ok);
      }
      cp_async_arrive_noinc(&sh.full[warp][st]);
      corrupt += lane == 0 ? unsigned(!k_ok) + unsigned(!v_ok) : 0u;
      return;
    }
    if (!deferred && (!k_ok || !v_ok)) {
      for (uint32_t c = lane; c < k_copy / 16 || c < v_copy / 16; c += 32) {
        if (!k_ok && c < k_copy / 16) reinterpret_cast<uint4*>(k_stage)[c] = make_uint4(0, 0, 0, 0);
        if (!v_ok && c < v_copy / 16) reinterpret_cast<uint4*>(v_stage)[c] = make_uint4(0, 0, 0, 0);
      }
      corrupt += lane == 0 ? unsigned(!k_ok) + unsigned(!v_ok) : 0u;
      __syncwarp();
    }
    const bool copy_k = !deferred && k_ok, copy_v = !deferred && v_ok;
    if (lane == 0) {
      if constexpr (Page::kExactPages) {
        sh.entries[warp][st][0] = ke;
        sh.entries[warp][st][1] = ve;
      }
      fence_async_proxy();
      barrier_arrive_expect(&sh.full[warp][st], (copy_k ? k_copy : 0u) + (copy_v ? v_copy : 0u));
      if (copy_k) bulk_copy(k_stage, k_src, k_copy, &sh.full[warp][st]);
      if (copy_v) bulk_copy(v_stage, v_src, v_copy, &sh.full[warp][st]);
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
    // Exact pages: in the ring (Page::kExactInRing), or deferred past the others.
    [[maybe_unused]] bool k_raw = false, v_raw = false;
    if constexpr (Page::kExactPages) {
      k_raw = sh.entries[warp][st][0] < 0;
      v_raw = sh.entries[warp][st][1] < 0;
      if (!Page::kExactInRing && (k_raw || v_raw)) {
        ++n_deferred;
        __syncwarp();
        issue_next(i);
        continue;
      }
    }
    const unsigned char* k_stage = sh.u.ring[warp][st].k;
    const unsigned char* v_stage = sh.u.ring[warp][st].v;
    uint4 kx[kLoads], vx[kLoads];
    load_stage<D, Page, true>(k_stage, lane, k_raw, kx);
    load_stage<D, Page, false>(v_stage, lane, v_raw, vx);
    if constexpr (Page::kDither) {  // its scales and outliers are read from the stage: held until done
      float s[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f}, rho[2] = {0.f, 0.f}, prob[4], sv[2][G];
      dither8_scores<D, kMeter, Page::kSubtractDither>(sh, kx, k_stage, p.n_outlier_pairs, dither_key, blk, tq, hq, qb, keep, s, c);
      dither8_value_scales<D, kMeter>(v_stage, tq, min(int64_t(kBlockTokens), len - blk * kBlockTokens), sv, rho);
      const Masks mk = softmax(s, c, rho, blk, prob);
      dither8_values<D>(vx, sv, prob, o_acc);
      __syncwarp();
      issue_next(i);
    } else {
      // The stage is released once its loads are in registers (fp8's rho too).
      float rho_side[2] = {0.f, 0.f};
      if constexpr (kMeter) {
        const __half* side = reinterpret_cast<const __half*>(v_stage + kBlockTokens * D);
        rho_side[0] = __half2float(side[tq]);
        rho_side[1] = __half2float(side[tq + 8]);
      }
      __syncwarp();
      issue_next(i);
      uint32_t ka[D / 16][4], va[D / 16][4];
      stage_operands<D, Page>(kx, k_raw, ka);
      stage_operands<D, Page>(vx, v_raw, va);
      float s[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f}, prob[4];
      if (Page::kExactInRing && k_raw) scores_exact(ka, s);
      else scores_operands(ka, s, c);
      const Masks mk = softmax(s, c, rho_side, blk, prob);
      if constexpr (Page::kExactInRing) {
        if (v_raw) {
          uint32_t built[D / 16][4];
#pragma unroll
          for (int pp = 0; pp < D / 16; ++pp)
#pragma unroll
            for (int r = 0; r < 4; ++r) built[pp][r] = va[pp][r];
          if (built_units && raw_values_in_built_units(built, mk)) values_operands(std::false_type{}, built, prob, mk, o_acc);
          else add_page(va, prob, mk, true);  // cold
        } else if (built_units) {
          values_operands(std::integral_constant<bool, kHalf>{}, va, prob, mk, o_acc);
        } else {
          add_page(va, prob, mk, false);  // cold: bases out of range
        }
      } else {
        values_operands(std::integral_constant<bool, kHalf>{}, va, prob, mk, o_acc);
      }
    }
  }

  if constexpr (Page::kScaled)
    if (built_units) to_value_units();
  if constexpr (Page::kExactPages && !Page::kExactInRing) {
    static_assert(!Page::kScaled, "deferred pages add in the values' own units");
    if (n_deferred > 0) {
      for (int i = 0; i < n_mine; ++i) {
        const int32_t ke = entry_of(p.k_table, i), ve = entry_of(p.v_table, i);
        if (ke >= 0 && ve >= 0) continue;
        const int64_t blk = first + int64_t(i) * kWarps;
        // A page's pool address, or null (counted) for an entry outside its pool.
        auto page_of = [&](bool key, int32_t e) -> const unsigned char* {
          const unsigned char* at = nullptr;
          if (e < 0) {
            const int64_t r = -int64_t(e) - 1;
            const uint8_t* raw = key ? p.k_raw_pages : p.v_raw_pages;
            if (raw != nullptr && r < (key ? p.n_k_raw_pages : p.n_v_raw_pages)) at = raw + r * p.raw_page_stride;
          } else if (e < (key ? p.n_k_pages : p.n_v_pages)) {
            at = (key ? p.k_pages : p.v_pages) + int64_t(e) * (key ? p.k_page_stride : p.v_page_stride);
          }
          corrupt += at == nullptr && lane == 0;
          return at;
        };
        const unsigned char* k_page = page_of(true, ke);
        const unsigned char* v_page = page_of(false, ve);
        float s[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f}, rho[2] = {0.f, 0.f}, prob[4];
        uint4 vx[kLoads];
        [[maybe_unused]] float sv[2][G];
        // K: an exact page's scores on the bf16 path; a lossy one's through the class (a corrupt
        // page reads as zeros).
        // An exact page's bf16 operands (zeros for a corrupt one).
        auto exact_operands = [&](const unsigned char* page, uint32_t (&ops)[D / 16][4]) {
          uint4 x[D / 16];
#pragma unroll
          for (int k = 0; k < D / 16; ++k) x[k] = make_uint4(0, 0, 0, 0);
          if (page != nullptr) Bf16Pages::load<D>(page, lane, x);
          Bf16Pages::operands<D>(x, ops);
        };
        if (ke < 0) {
          uint32_t ka[D / 16][4];
          exact_operands(k_page, ka);
          scores_exact(ka, s);
        } else if (k_page != nullptr) {
          uint4 kx[kLoads];
          Page::template load<D>(k_page, lane, kx);
          if constexpr (Page::kDither) {
            dither8_scores<D, kMeter, Page::kSubtractDither>(sh, kx, k_page, p.n_outlier_pairs, dither_key, blk, tq, hq, qb, keep, s, c);
          } else {
            uint32_t ka[D / 16][4];
            Page::template operands<D>(kx, ka);
            scores_operands(ka, s, c);
          }
        }
        if (ve >= 0 && v_page != nullptr) {
          Page::template load<D>(v_page, lane, vx);
          if constexpr (Page::kDither) {
            dither8_value_scales<D, kMeter>(v_page, tq, min(int64_t(kBlockTokens), len - blk * kBlockTokens), sv, rho);
          } else if constexpr (kMeter) {
            const __half* side = reinterpret_cast<const __half*>(v_page + kBlockTokens * D);
            rho[0] = __half2float(side[tq]);
            rho[1] = __half2float(side[tq + 8]);
          }
        } else {
#pragma unroll
          for (int k = 0; k < kLoads; ++k) vx[k] = make_uint4(0, 0, 0, 0);
          if constexpr (Page::kDither) {
#pragma unroll
            for (int g = 0; g < G; ++g) sv[0][g] = sv[1][g] = 0.f;
          }
        }
        const Masks mk = softmax(s, c, rho, blk, prob);
        if (ve < 0) {
          uint32_t va[D / 16][4];
          exact_operands(v_page, va);
          values_operands(std::false_type{}, va, prob, mk, o_acc);
        } else if constexpr (Page::kDither) {
          dither8_values<D>(vx, sv, prob, o_acc);
        } else {
          uint32_t va[D / 16][4];
          Page::template operands<D>(vx, va);
          values_operands(std::integral_constant<bool, kHalf>{}, va, prob, mk, o_acc);
        }
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

// Stages of each warp's ring (Page::kStages). Measured on an H100 (32 / 8 heads, 64K and 128K,
// batch 1 and 8): with the stage released once its loads are in registers, 3 and 4 stages were
// 1-8% slower than 2, for bf16 pages at one CTA per multiprocessor as at three, and for fp8
// (docs/bench/h100_fragment_pages_2b54244.jsonl, h100_fragment_stages_1cf7d1d.jsonl). dither8
// holds its stage while the page is attended (its scales and outliers are read there): 3.

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
  auto by_stages = [&](auto d, auto page, auto meter) {
    return f(d, page, meter, std::integral_constant<int, decltype(page)::kStages>{});
  };
  auto by_format = [&](auto d) {
    if (p.format == PageFormat::kFp8Fragments) {
      if (meter_on(p)) return by_stages(d, Fp8Pages{}, std::true_type{});
      return by_stages(d, Fp8Pages{}, std::false_type{});
    }
    if (p.format == PageFormat::kDither8Fragments) {
      if (meter_on(p)) return by_stages(d, Dither8Pages{}, std::true_type{});
      return by_stages(d, Dither8Pages{}, std::false_type{});
    }
    if (p.format == PageFormat::kInt8Fragments) return by_stages(d, Int8Pages{}, std::false_type{});
    if (p.format == PageFormat::kGaacFragments) return by_stages(d, GaacPages{}, std::false_type{});
    if (p.format == PageFormat::kBf16) return by_stages(d, Bf16RowPages{}, std::false_type{});
    return by_stages(d, Bf16Pages{}, std::false_type{});
  };
  if (p.head_dim == 64) return by_format(std::integral_constant<int, 64>{});
  return by_format(std::integral_constant<int, 128>{});
}

// check_sqrt_upper's pass: thread i of the grid takes the bit patterns i, i + stride, ...
__global__ void sqrt_upper_kernel(unsigned long long* counts) {
  constexpr uint32_t kFiniteEnd = 0x7f800000u;
  unsigned long long checked = 0, below = 0, loose = 0;
  for (uint32_t bits = blockIdx.x * blockDim.x + threadIdx.x; bits < kFiniteEnd; bits += gridDim.x * blockDim.x) {
    const float v = __uint_as_float(bits);
    const double b = double(sqrt_upper(v));
    ++checked;
    below += __dmul_rn(b, b) < double(v) ? 1 : 0;  // b^2 is exact: 24-bit significands
    loose += v >= 0x1p-126f && b > __dsqrt_rn(double(v)) * (1.0 + 0x1p-17) ? 1 : 0;
  }
  atomicAdd(&counts[0], checked);
  atomicAdd(&counts[1], below);
  atomicAdd(&counts[2], loose);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    counts[3] = __float_as_uint(sqrt_upper(0.f));
    counts[4] = __float_as_uint(sqrt_upper(__uint_as_float(0x7f800000u)));
    counts[5] = __float_as_uint(sqrt_upper(__uint_as_float(0x7fc00000u)));
  }
}

}  // namespace

CudaStatus check_sqrt_upper(SqrtUpperCheck* out) {
  unsigned long long* counts = nullptr;
  if (cudaMalloc(&counts, 6 * sizeof(unsigned long long)) != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, "check_sqrt_upper: cannot allocate its counters"};
  cudaError_t e = cudaMemset(counts, 0, 6 * sizeof(unsigned long long));
  if (e == cudaSuccess) {
    sqrt_upper_kernel<<<1024, 256>>>(counts);
    e = cudaGetLastError();
  }
  unsigned long long host[6] = {};
  if (e == cudaSuccess) e = cudaMemcpy(host, counts, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(counts);
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("check_sqrt_upper: ") + cudaGetErrorString(e)};
  out->checked = host[0];
  out->below = host[1];
  out->loose = host[2];
  const auto as_float = [](unsigned long long x) {
    const uint32_t bits = uint32_t(x);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  out->at_zero = as_float(host[3]);
  out->at_inf = as_float(host[4]);
  out->at_nan = as_float(host[5]);
  return {};
}

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

int fragment_planned_ctas_per_sm(const PagedDecodeParams& p) {
  return with_kernel(p, [&](auto d, auto page, auto meter, auto st) {
    return std::min(decltype(page)::kPlannedCtasPerSm,
                    resident<decltype(d)::value, decltype(page), decltype(meter)::value, decltype(st)::value>());
  });
}

}  // namespace certkv::attention::cuda
