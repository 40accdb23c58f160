#include "codec/cuda/lossy_encode_cuda.h"

#include <cuda_runtime.h>

#include <array>
#include <cfloat>
#include <numeric>
#include <string>

#include "core/status.h"
#include "format/dither8_generator.h"
#include "format/fp8.h"
#include "format/fragment_layout.h"
#include "format/numeric.h"

namespace certkv::codec::cuda {

namespace {

using format::bf16_to_float;
using format::bits_to_float;
using format::float_to_bits;
using format::fp16_to_float;

constexpr int kWarpsPerCta = 4;
constexpr int kThreads = 32 * kWarpsPerCta;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr int kMaxHeadDim = 256;
constexpr uint16_t kFp16Inf = 0x7c00;
// The constants of codec/lossy_page.cc, with the same values.
constexpr double kDither8Top = 126.5;          // Q - 1/2 with Q = 127
constexpr double kNormSafety = 1.0 + 0x1p-40;  // covers the double norm's relative error
constexpr double kWitnessSteps = 256.0;        // WitnessCode::kPageScaled8: bound w_max (c + 1) / 256

// One launch's page shape, evaluated on the host. Byte counts fit in 32 bits: a page is at most
// 4096 x (256 + 16 + 256) bytes.
struct Geometry {
  RopePairing pairing;
  int block_tokens;     // T
  int head_dim;         // D
  int groups;           // D / kQuantGroup
  int n_outlier_pairs;  // m (dither8 K pages)
  bool dithered;        // dither8: K pages (V pages are not dithered)
  int n_bands;          // fp8 side data: witness_bands(D) for K pages, 1 (rho) for V pages
  bool page_scaled;     // fp8 K pages: the witness as u8 codes against the page's largest bound
  bool exponent_witness;  // fp8-e4m3 K pages: no side data, the codes bound themselves (saturation refused)
  int exponent_bits;    // fp8: 4 (E4M3) or 5 (E5M2)
  int mantissa_bits;    // fp8: 3 or 2
  uint32_t payload_bytes;
  uint32_t record_bytes;  // dither8: D + 2 G + 4 m
  bool key;               // a K page (the fragment maps differ for K and V)
  bool fragments;         // LossyDeviceLayout::kFragments (dither8; fp8-e4m3 with the exponent witness)
};

// Where element (t, c) of the exact block is in src.
__device__ int64_t src_index(const Geometry& g, int t, int c) {
  return g.fragments ? int64_t(format::fragment::element_index(g.key, t, c)) : int64_t(t) * g.head_dim + c;
}
// Where an fp8 page's code of element (t, c) goes in dst.
__device__ int64_t fp8_code_index(const Geometry& g, int t, int c) {
  return g.fragments ? int64_t(format::fragment::fp8_code_byte(g.key, t, c)) : int64_t(t) * g.head_dim + c;
}

// rope_pair_channel (codec/lossy_page.h) on the device.
__device__ int pair_channel(const Geometry& g, int pair, int which) {
  return g.pairing == RopePairing::kInterleaved ? 2 * pair + which
                                                : pair + which * (g.head_dim / 2);
}

__device__ bool bf16_is_finite(uint16_t h) { return (h & 0x7f80u) != 0x7f80u; }
__device__ bool float_is_finite(float f) { return (float_to_bits(f) & 0x7f800000u) != 0x7f800000u; }

__device__ void store_u16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}

// Float subnormals are values here (a bf16 subnormal's magnitude, amax / 126.5 of tiny groups):
// this file is compiled without flush-to-zero (no -ftz=true, no --use_fast_math), like the host.

// The smallest fp16 >= v (+inf above 65504), through the smallest float >= v as on the host.
__device__ uint16_t fp16_upward(double v) { return format::float_to_fp16_upward(format::float_upward(v)); }

// ---- fp8 casts with their Tier A side data ----------------------------------------------------

// What lossy_decode_page_ref reads back for an element: the FP8 value of its code.
// float_to_fp8_ref's one product (the subnormal quanta count) scales by a power of two and is
// exact, so a contraction of its `quanta - float(q)` into an FMA cannot change the code.
__device__ float fp8_reconstruction(const Geometry& g, uint16_t x) {
  const uint8_t code = format::float_to_fp8_ref(bf16_to_float(x), g.exponent_bits, g.mantissa_bits);
  return format::fp8_to_float(code, g.exponent_bits, g.mantissa_bits);
}

// The upper bound of ||r_{t,b}|| of side-data item b T + t (K: band b of token t; V: rho of token
// t, one band): the squares of r = x^ - x over the band's pairs summed in increasing order,
// channel a before channel b, in double without contraction, as the reference's loop does, its
// square root lifted by kNormSafety.
__device__ double band_bound(const Geometry& g, const uint16_t* src, int item) {
  const int n_pairs = g.head_dim / 2;
  const int b = item / g.block_tokens, t = item % g.block_tokens;
  double sum_sq = 0.0;
  for (int pair = b * n_pairs / g.n_bands; pair < (b + 1) * n_pairs / g.n_bands; ++pair) {
    for (int which = 0; which < 2; ++which) {
      const uint16_t x = src[src_index(g, t, pair_channel(g, pair, which))];
      const double r = __dsub_rn(double(fp8_reconstruction(g, x)), double(bf16_to_float(x)));
      sum_sq = __dadd_rn(sum_sq, __dmul_rn(r, r));
    }
  }
  return __dmul_rn(__dsqrt_rn(sum_sq), kNormSafety);
}

// The u8 code of a bound against the page's w_max (`top`, an fp16 value): c = ceil(256 w / top) - 1
// in [0, 255], raised while top (c + 1) / 256 (exact in double) is below w; 0 when top is 0.
__device__ uint8_t witness_code(double w, double top) {
  int c = 0;
  if (top > 0) {
    c = int(ceil(__ddiv_rn(__dmul_rn(w, kWitnessSteps), top))) - 1;
    c = c < 0 ? 0 : c > 255 ? 255 : c;
    while (c < 255 && __dmul_rn(top, double(c + 1)) / kWitnessSteps < w) ++c;
  }
  return uint8_t(c);
}

// One CTA per task. Codes: a thread per element (element (t, c) at src_index, its code at
// fp8_code_index). Side data (write_tier_a_side_data): a thread per (band, token), item b T + t,
// its bound from band_bound; stored as fp16 rounded up, or (a K page with the u8 witness) as a
// code against the page's largest bound (witness_code); none on a K page with the exponent
// witness, which is refused where a value is past kExponentWitnessLimit (its cast saturates).
__global__ void __launch_bounds__(kThreads)
    fp8_cast_kernel(Geometry g, const LossyEncodeTask* tasks, uint8_t* encoded) {
  const LossyEncodeTask task = tasks[blockIdx.x];
  const int n = g.block_tokens * g.head_dim;
  bool refused = false;
  for (int i = int(threadIdx.x); i < n; i += kThreads) {
    const int t = i / g.head_dim, c = i % g.head_dim;
    const uint16_t x = task.src[src_index(g, t, c)];
    if (!bf16_is_finite(x) || (g.exponent_witness && !(fabsf(bf16_to_float(x)) <= kExponentWitnessLimit))) {
      refused = true;
      continue;
    }
    const uint8_t code =
        format::float_to_fp8_ref(bf16_to_float(x), g.exponent_bits, g.mantissa_bits);
    task.dst[fp8_code_index(g, t, c)] = code;
    // E5M2 does not saturate: an overflow reads back as Inf and the page is refused.
    if (!float_is_finite(format::fp8_to_float(code, g.exponent_bits, g.mantissa_bits))) {
      refused = true;
    }
  }
  if (__syncthreads_or(refused)) {
    if (threadIdx.x == 0) encoded[blockIdx.x] = kLossyRefused;
    return;
  }
  if (g.exponent_witness) {
    if (threadIdx.x == 0) encoded[blockIdx.x] = kLossyEncoded;
    return;
  }
  // Band b covers the RoPE pairs [b P / n_bands, (b + 1) P / n_bands) (witness_band_of_pair).
  uint8_t* side = task.dst + g.payload_bytes;
  const int cells = g.n_bands * g.block_tokens;
  if (!g.page_scaled) {
    // Band-major: w[b][t], or rho[t] for V pages.
    for (int item = int(threadIdx.x); item < cells; item += kThreads)
      store_u16(side + 2 * size_t(item), fp16_upward(band_bound(g, task.src, item)));
  } else {
    // WitnessCode::kPageScaled8: w_max = the largest bound rounded up to fp16 (the upward rounding
    // is monotone: the largest of the rounded bounds), then each code against it, the bounds
    // computed again rather than kept (a page may have 4096 tokens).
    __shared__ unsigned top_bits;
    if (threadIdx.x == 0) top_bits = 0;
    __syncthreads();
    for (int item = int(threadIdx.x); item < cells; item += kThreads)
      atomicMax(&top_bits, unsigned(fp16_upward(band_bound(g, task.src, item))));
    __syncthreads();
    const double top = double(fp16_to_float(uint16_t(top_bits)));
    for (int item = int(threadIdx.x); item < cells; item += kThreads)
      side[item] = witness_code(band_bound(g, task.src, item), top);
    if (threadIdx.x == 0) store_u16(side + cells, uint16_t(top_bits));
  }
  if (threadIdx.x == 0) encoded[blockIdx.x] = kLossyEncoded;
}

// ---- dither8 ------------------------------------------------------------------------------------

// dither8_xi (codec/lossy_page.cc) from the row's seed: (u + 1/2) / 256 - 1/2, every step exact.
__device__ float dither8_xi(uint32_t row_seed, int c) {
  const uint32_t u = format::dither8_u(format::dither8_word(row_seed, c / 4), c);
  return __fsub_rn(__fdiv_rn(__fadd_rn(float(u), 0.5f), 256.0f), 0.5f);
}

// One CTA per task; a warp per (token, group), a lane per channel (encode_dither8):
//   amax = max |x_c| over the group's non-outlier channels (a warp max of the bits: non-negative
//          floats order as their bit patterns; outliers count as 0, the reference's start)
//   s    = fp16 up(amax / 126.5), in double; +inf refuses the page
//   q_c  = round(fl(fl(x_c / s) + xi_c)), ties to even (__double2int_rn is the reference's
//          round_half_even; |q| <= 127), in double with the stored s; xi_c = 0 on V pages
// then the outlier pairs' exact bf16 values, a thread per (token, value).
__global__ void __launch_bounds__(kThreads)
    dither8_kernel(Geometry g, const LossyEncodeTask* tasks, uint8_t* encoded) {
  __shared__ uint8_t outlier[kMaxHeadDim];
  const LossyEncodeTask task = tasks[blockIdx.x];
  const int m = g.n_outlier_pairs;
  const int n_pairs = g.head_dim / 2;
  // The same for every thread: the list is read only when present.
  const bool list_missing = m > 0 && task.outlier_pairs == nullptr;
  for (int c = int(threadIdx.x); c < g.head_dim; c += kThreads) outlier[c] = 0;
  __syncthreads();
  bool refused = list_missing;
  for (int i = int(threadIdx.x); i < m && !list_missing; i += kThreads) {
    const int pair = task.outlier_pairs[i];
    if (pair >= n_pairs || (i > 0 && pair <= int(task.outlier_pairs[i - 1]))) {
      refused = true;
      continue;
    }
    outlier[pair_channel(g, pair, 0)] = 1;
    outlier[pair_channel(g, pair, 1)] = 1;
  }
  const int n = g.block_tokens * g.head_dim;
  for (int i = int(threadIdx.x); i < n; i += kThreads) {
    if (!bf16_is_finite(task.src[i])) refused = true;
  }
  if (__syncthreads_or(refused)) {
    if (threadIdx.x == 0) encoded[blockIdx.x] = kLossyRefused;
    return;
  }

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  bool scale_refused = false;
  for (int item = warp; item < g.block_tokens * g.groups; item += kWarpsPerCta) {
    const int t = item / g.groups, grp = item % g.groups;
    const int c = grp * kQuantGroup + lane;
    const float x = bf16_to_float(task.src[src_index(g, t, c)]);
    const bool quantized = outlier[c] == 0;
    const float magnitude = quantized ? fabsf(x) : 0.0f;
    const float amax = bits_to_float(__reduce_max_sync(kFullWarp, float_to_bits(magnitude)));
    const uint16_t s16 = fp16_upward(__ddiv_rn(double(amax), kDither8Top));
    if (s16 == kFp16Inf) {  // the whole warp
      scale_refused = true;
      continue;
    }
    const double s = double(fp16_to_float(s16));
    int q = 0;
    if (quantized && s != 0.0) {
      const uint64_t counter = uint64_t(task.block) * uint64_t(g.block_tokens) + uint64_t(t);
      const double xi = g.dithered ? double(dither8_xi(format::dither8_row_seed(task.dither_key, counter), c)) : 0.0;
      q = __double2int_rn(__dadd_rn(__ddiv_rn(double(x), s), xi));
    }
    if (g.fragments) {
      task.dst[format::fragment::dither8_code_byte(g.key, t, c)] = uint8_t(int8_t(q));
      if (lane == 0) store_u16(task.dst + format::fragment::dither8_scale_byte(g.head_dim, g.groups, t, grp), s16);
    } else {
      uint8_t* rec = task.dst + size_t(t) * g.record_bytes;
      rec[c] = uint8_t(int8_t(q));
      if (lane == 0) store_u16(rec + g.head_dim + 2 * grp, s16);
    }
  }
  // Outliers: per token, pair i's channel a then channel b at value 2 i + which.
  for (int item = int(threadIdx.x); item < g.block_tokens * 2 * m; item += kThreads) {
    const int t = item / (2 * m), value = item % (2 * m);
    const int c = pair_channel(g, task.outlier_pairs[value / 2], value % 2);
    uint8_t* at = g.fragments ? task.dst + format::fragment::dither8_outlier_byte(g.head_dim, g.groups, m, t, value)
                              : task.dst + size_t(t) * g.record_bytes + g.head_dim + 2 * g.groups + 2 * value;
    store_u16(at, task.src[src_index(g, t, c)]);
  }
  const bool page_refused = __syncthreads_or(scale_refused);
  if (threadIdx.x == 0) encoded[blockIdx.x] = page_refused ? kLossyRefused : kLossyEncoded;
}

// ---- host ---------------------------------------------------------------------------------------

constexpr char kWhere[] = "lossy device encode: ";

// The spec as validate_lossy_page_spec and lossy_payload_bytes read it: the outlier lists are the
// tasks', on the device, so pairs 0 .. m - 1 stand in for spec.outlier_pairs (m itself is still
// checked; the list is read only when m is within the limits).
LossyPageSpec with_placeholder_outliers(const LossyPageSpec& spec) {
  static const std::array<uint16_t, kMaxOutlierPairs> kPairs = [] {
    std::array<uint16_t, kMaxOutlierPairs> pairs{};
    std::iota(pairs.begin(), pairs.end(), uint16_t(0));
    return pairs;
  }();
  LossyPageSpec s = spec;
  s.outlier_pairs = kPairs.data();
  return s;
}

bool has_device_encoder(LossyScheme scheme) {
  return scheme == LossyScheme::kFp8E4M3 || scheme == LossyScheme::kFp8E5M2 ||
         scheme == LossyScheme::kDither8;
}

Geometry geometry_of(const LossyPageSpec& spec, LossyDeviceLayout layout) {
  Geometry g{};
  g.key = spec.key;
  g.fragments = layout == LossyDeviceLayout::kFragments;
  g.pairing = spec.pairing;
  g.block_tokens = spec.block_tokens;
  g.head_dim = spec.head_dim;
  g.groups = spec.head_dim / kQuantGroup;
  g.n_outlier_pairs = spec.n_outlier_pairs;
  g.dithered = spec.key;
  g.n_bands = spec.key ? witness_bands(spec.head_dim) : 1;
  g.page_scaled = spec.key && spec.witness == WitnessCode::kPageScaled8;
  g.exponent_witness = spec.key && spec.witness == WitnessCode::kExponent;
  g.exponent_bits = spec.scheme == LossyScheme::kFp8E5M2 ? 5 : 4;
  g.mantissa_bits = spec.scheme == LossyScheme::kFp8E5M2 ? 2 : 3;
  g.payload_bytes = uint32_t(lossy_payload_bytes(with_placeholder_outliers(spec)));
  g.record_bytes = uint32_t(spec.head_dim + 2 * g.groups + 4 * spec.n_outlier_pairs);
  return g;
}

CudaStatus invalid(const std::string& message) {
  return cuda_error(StatusCode::kInvalidArgument, std::string(kWhere) + message);
}

}  // namespace

CudaStatus check_lossy_encode(const LossyPageSpec& spec, int n_tasks, const void* tasks,
                              const void* encoded, LossyDeviceLayout layout) {
  try {
    validate_lossy_page_spec(with_placeholder_outliers(spec));
  } catch (const Error& e) {
    return cuda_error(e.code(), std::string(kWhere) + e.what());
  }
  if (!has_device_encoder(spec.scheme)) {
    return cuda_error(StatusCode::kUnsupported,
                      std::string(kWhere) + "scheme " + lossy_scheme_name(spec.scheme) +
                          " has no device encoder (fp8-e4m3, fp8-e5m2 and dither8 have)");
  }
  if (layout != LossyDeviceLayout::kCodec && layout != LossyDeviceLayout::kFragments)
    return invalid("device page layout " + std::to_string(int(layout)) + " is unknown (codec or fragments)");
  if (layout == LossyDeviceLayout::kFragments) {
    // fp8-e4m3: the fragment kernel's pages carry no witness (the codes bound themselves), so a K
    // page is made with the exponent witness only.
    const bool fp8_exponent = spec.scheme == LossyScheme::kFp8E4M3 && (!spec.key || spec.witness == WitnessCode::kExponent);
    if (spec.scheme != LossyScheme::kDither8 && !fp8_exponent)
      return cuda_error(StatusCode::kUnsupported, std::string(kWhere) + "fragment-major device pages of scheme " +
                                                      lossy_scheme_name(spec.scheme) +
                                                      (spec.scheme == LossyScheme::kFp8E4M3 ? " with witness " + std::string(witness_code_name(spec.witness)) : std::string()) +
                                                      " are not made (dither8's are, and fp8-e4m3's with the exponent witness)");
    if (spec.block_tokens != format::fragment::kPageTokens || spec.head_dim % 16 != 0)
      return cuda_error(StatusCode::kUnsupported,
                        std::string(kWhere) + "fragment-major pages hold " +
                            std::to_string(format::fragment::kPageTokens) +
                            " tokens of a head_dim that is a multiple of 16, not " +
                            std::to_string(spec.block_tokens) + " x " + std::to_string(spec.head_dim));
  }
  if (n_tasks < 0) return invalid("n_tasks must not be negative, got " + std::to_string(n_tasks));
  if (n_tasks > 0 && tasks == nullptr) {
    return invalid("tasks is null for " + std::to_string(n_tasks) + " tasks");
  }
  if (n_tasks > 0 && encoded == nullptr) {
    return invalid("encoded is null for " + std::to_string(n_tasks) + " tasks");
  }
  return {};
}

CudaStatus lossy_encode_pages(const LossyPageSpec& spec, const LossyEncodeTask* tasks, int n_tasks,
                              uint8_t* encoded, void* stream, LossyDeviceLayout layout) {
  const CudaStatus checked = check_lossy_encode(spec, n_tasks, tasks, encoded, layout);
  if (!checked.ok || n_tasks == 0) return checked;
  const Geometry g = geometry_of(spec, layout);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (spec.scheme == LossyScheme::kDither8) {
    dither8_kernel<<<unsigned(n_tasks), kThreads, 0, s>>>(g, tasks, encoded);
  } else {
    fp8_cast_kernel<<<unsigned(n_tasks), kThreads, 0, s>>>(g, tasks, encoded);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    const std::string reason = cudaGetErrorString(e);
    return cuda_error(StatusCode::kInternal,
                      std::string(kWhere) + "kernel launch failed: " + reason);
  }
  return {};
}

}  // namespace certkv::codec::cuda
