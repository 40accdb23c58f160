#include "attention/cuda/key_index_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstring>
#include <string>

#include "index/counter_random.h"
#include "index/rabitq.h"

namespace certkv::attention::cuda {

namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kTokenThreads = 32 * kWarpsPerCta;

// A key row: the bf16 K page of (row, head, block) through the table; null when the range, the
// row or the page lies outside the pools.
__device__ inline const uint16_t* key_row(const KeyIndexBuildParams& p, int64_t row, int head, int64_t t) {
  if (row < 0 || row >= p.n_table_rows || t < 0 || t >= p.table_stride * p.block_tokens) return nullptr;
  const int32_t page = p.k_table[row * p.table_row_stride + int64_t(head) * p.table_stride + t / p.block_tokens];
  if (page < 0 || page >= p.n_k_pages) return nullptr;
  return reinterpret_cast<const uint16_t*>(p.k_pages + int64_t(page) * p.k_page_stride) +
         (t % p.block_tokens) * p.head_dim;
}

__device__ inline float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// y = P^T x for one warp (index::Rotation::rotate): x, y in shared memory, [D] each, distinct.
// Haar: y_j = sum_i P^T[j][i] x_i in float, i = 0, 1, ... one rounding per product and sum.
// Randomized Hadamard: three butterflies of index/rotation.cc's walsh_hadamard, each output a
// single a + b or a - b of the previous stage's values, so any lane order gives the same bits.
template <int D>
__device__ void rotate_warp(const DeviceRotation& r, const float* x, float* y, int lane) {
  if (r.kind == index::RotationKind::kHaar) {
    for (int j = lane; j < D; j += 32) {
      const float* row = r.p_transpose + int64_t(j) * D;
      float acc = 0.f;
      for (int i = 0; i < D; ++i) acc = __fadd_rn(acc, __fmul_rn(__ldg(row + i), x[i]));
      y[j] = acc;
    }
    __syncwarp();
    return;
  }
  for (int i = lane; i < D; i += 32) y[i] = x[i];
  __syncwarp();
  for (int stage = 0; stage < 3; ++stage) {
    for (int half = 1; half < D; half *= 2) {
      for (int pair = lane; pair < D / 2; pair += 32) {
        const int i = (pair / half) * 2 * half + pair % half;
        const float a = y[i], b = y[i + half];  // pairs are disjoint: no lane reads another's
        y[i] = __fadd_rn(a, b);
        y[i + half] = __fsub_rn(a, b);
      }
      __syncwarp();
    }
    const float* s = r.signs + stage * D;
    if (stage < 2) {
      for (int i = lane; i < D; i += 32) y[i] = __fmul_rn(y[i], s[i]);
    } else {
      // rotate(): y[i] *= s3[i] * scale, scale = float(1 / (D sqrt(D))) in double.
      const float scale = __double2float_rn(__drcp_rn(__dmul_rn(double(D), __dsqrt_rn(double(D)))));
      for (int i = lane; i < D; i += 32) y[i] = __fmul_rn(y[i], __fmul_rn(s[i], scale));
    }
    __syncwarp();
  }
}

// sum_i a_i b_i in double, i in order (index/rabitq.cc's dot: each float product is exact in
// double, one rounding per sum).
template <int D>
__device__ double dot_in_order(const float* a, const float* b) {
  double s = 0.0;
  for (int i = 0; i < D; ++i) s = __dadd_rn(s, __dmul_rn(double(a[i]), double(b[i])));
  return s;
}

// ---------------------------------------------------------------------------------------------
// c_k: one thread per (channel, head, range), the keys of tokens [0, end) in order.
template <int D>
__global__ void centroid_kernel(KeyIndexBuildParams p) {
  const int i = threadIdx.x, head = blockIdx.x;
  const KeyIndexRange range = p.ranges[blockIdx.y];
  const int64_t n = range.end;
  if (range.first != 0 || n < 1 || n > p.max_range_tokens || n > p.table_stride * p.block_tokens) {
    if (i == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* k = key_row(p, range.table_row, head, t);
    if (k == nullptr) {
      if (i == 0) atomicAdd(p.error_word, 1u);
      return;
    }
    sum = __dadd_rn(sum, double(bf16_bits_to_float(k[i])));
  }
  float* c = p.centroids + (int64_t(range.table_row) * p.n_kv_heads + head) * 2 * D;
  c[i] = p.query_centroids[(int64_t(blockIdx.y) * p.n_kv_heads + head) * D + i];
  c[D + i] = __double2float_rn(__ddiv_rn(sum, double(n)));
}

// ---------------------------------------------------------------------------------------------
// Records: one warp per (token, head); index::rabitq_encode_keys step by step.
template <int D>
__global__ void __launch_bounds__(kTokenThreads) records_kernel(KeyIndexBuildParams p) {
  __shared__ float key[kWarpsPerCta][D], centered[kWarpsPerCta][D], rotated[kWarpsPerCta][D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const KeyIndexRange range = p.ranges[blockIdx.z];
  const int64_t t = int64_t(range.first) + int64_t(blockIdx.x) * kWarpsPerCta + warp;
  if (range.first < 0 || range.end < range.first || range.end - range.first > p.max_range_tokens ||
      range.end > p.record_stride || range.table_row < 0 || range.table_row >= p.n_table_rows) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  if (t >= range.end) return;
  const uint16_t* k = key_row(p, range.table_row, head, t);
  if (k == nullptr) {
    if (lane == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  float* x = key[warp];
  for (int i = lane; i < D; i += 32) x[i] = bf16_bits_to_float(k[i]);
  __syncwarp();
  const float* c = p.centroids + (int64_t(range.table_row) * p.n_kv_heads + head) * 2 * D;
  const float* c_q = c;
  const float* c_k = c + D;
  bool finite = true;
  for (int i = lane; i < D; i += 32) finite &= isfinite(x[i]);
  if (!__all_sync(0xffffffffu, finite)) {
    if (lane == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  // ||k - c_k|| in double, in order (every lane computes it: no broadcast needed).
  double norm2 = 0.0;
  for (int i = 0; i < D; ++i) {
    const double d = __dsub_rn(double(x[i]), double(c_k[i]));
    norm2 = __dadd_rn(norm2, __dmul_rn(d, d));
  }
  const double norm = __dsqrt_rn(norm2);
  index::RabitqRecord<D> r;
  for (int w = 0; w < index::RabitqRecord<D>::kWords; ++w) r.code[w] = 0;
  r.norm_k_centered = __double2float_rn(norm);
  r.cq_dot_k = __double2float_rn(dot_in_order<D>(c_q, x));
  r.alpha = 1.f;
  r.code_popcount = 0;
  if (r.norm_k_centered != 0.f) {
    float* k_c = centered[warp];
    for (int i = lane; i < D; i += 32)
      k_c[i] = __double2float_rn(__ddiv_rn(__dsub_rn(double(x[i]), double(c_k[i])), norm));
    __syncwarp();
    float* y = rotated[warp];
    rotate_warp<D>(p.rotation, k_c, y, lane);
    int popcount = 0;
    for (int m = 0; m < D / 32; ++m) {
      const uint32_t bits = __ballot_sync(0xffffffffu, y[32 * m + lane] >= 0.f);
      r.code[m / 2] |= uint64_t(bits) << (32 * (m % 2));
      popcount += __popc(bits);
    }
    double abs_sum = 0.0;
    for (int i = 0; i < D; ++i) abs_sum = __dadd_rn(abs_sum, fabs(double(y[i])));
    r.alpha = __double2float_rn(__ddiv_rn(abs_sum, __dsqrt_rn(double(D))));
    r.code_popcount = popcount;
  }
  if (lane == 0) {
    auto* out = static_cast<index::RabitqRecord<D>*>(p.records) +
                (int64_t(range.table_row) * p.n_kv_heads + head) * p.record_stride + t;
    *out = r;
  }
}

// ---------------------------------------------------------------------------------------------
// Queries: one warp per (row, query head); index::rabitq_quantize_query step by step, then the
// fields of device_rabitq_query.
template <int D>
__global__ void __launch_bounds__(kTokenThreads) quantize_kernel(QueryQuantizeParams p) {
  __shared__ float centered[kWarpsPerCta][D], rotated[kWarpsPerCta][D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t cell = int64_t(blockIdx.x) * kWarpsPerCta + warp;  // b * n_q_heads + hq
  if (cell >= int64_t(p.batch) * p.n_q_heads) return;
  const int b = int(cell / p.n_q_heads), hq = int(cell % p.n_q_heads);
  const int group = p.n_q_heads / p.n_kv_heads;
  const int64_t row = p.table_rows != nullptr ? int64_t(p.table_rows[b]) : int64_t(b);
  if (row < 0 || row >= p.n_table_rows) {
    if (lane == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  const float* q = p.q + cell * D;
  const float* c = p.centroids + (row * p.n_kv_heads + hq / group) * 2 * D;
  const float* c_q = c;
  const float* c_k = c + D;
  bool finite = true;
  for (int i = lane; i < D; i += 32) finite &= isfinite(q[i]);
  if (!__all_sync(0xffffffffu, finite)) {
    if (lane == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  double norm2 = 0.0;
  for (int i = 0; i < D; ++i) {
    const double d = __dsub_rn(double(q[i]), double(c_q[i]));
    norm2 = __dadd_rn(norm2, __dmul_rn(d, d));
  }
  const double norm = __dsqrt_rn(norm2);
  DeviceRabitqQuery out;
  for (int bit = 0; bit < index::kRabitqQueryBits; ++bit) out.planes[bit][0] = out.planes[bit][1] = 0;
  out.sum_q_u = 0;
  out.delta = 0.f;
  out.q_l = 0.f;
  out.norm_q_centered = __double2float_rn(norm);
  out.q_dot_ck = __double2float_rn(dot_in_order<D>(q, c_k));
  out.cq_dot_ck = __double2float_rn(dot_in_order<D>(c_q, c_k));
  // index::rabitq_logit_deviation_scale: deviations * scale * ||q - c_q|| / sqrt(D - 1) in double.
  const double factor = __ddiv_rn(__dmul_rn(__dmul_rn(p.deviations, double(p.sm_scale)), double(out.norm_q_centered)),
                                  __dsqrt_rn(double(D - 1)));
  if (!(factor <= double(FLT_MAX))) {
    if (lane == 0) atomicAdd(p.error_word, 1u);
    return;
  }
  out.margin_scale = __double2float_rn(factor);
  if (out.norm_q_centered != 0.f) {
    float* q_c = centered[warp];
    for (int i = lane; i < D; i += 32) q_c[i] = __double2float_rn(__ddiv_rn(__dsub_rn(double(q[i]), double(c_q[i])), norm));
    __syncwarp();
    float* y = rotated[warp];
    rotate_warp<D>(p.rotation, q_c, y, lane);
    // q_l, q_r: std::min_element / std::max_element, the first of equal values (a -0 and a +0
    // compare equal; the first one's sign is kept).
    float lo = y[lane], hi = y[lane];
    int lo_at = lane, hi_at = lane;
    for (int i = lane + 32; i < D; i += 32) {
      if (y[i] < lo) lo = y[i], lo_at = i;
      if (y[i] > hi) hi = y[i], hi_at = i;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float o_lo = __shfl_xor_sync(0xffffffffu, lo, offset), o_hi = __shfl_xor_sync(0xffffffffu, hi, offset);
      const int o_lo_at = __shfl_xor_sync(0xffffffffu, lo_at, offset), o_hi_at = __shfl_xor_sync(0xffffffffu, hi_at, offset);
      if (o_lo < lo || (!(lo < o_lo) && o_lo_at < lo_at)) lo = o_lo, lo_at = o_lo_at;
      if (o_hi > hi || (!(hi > o_hi) && o_hi_at < hi_at)) hi = o_hi, hi_at = o_hi_at;
    }
    const float q_l = lo;
    const float delta = __fdiv_rn(__fsub_rn(hi, q_l), float(index::kRabitqQueryLevels));
    out.q_l = q_l;
    out.delta = delta;
    const uint64_t seed = p.rounding_seeds[cell];
    int sum = 0;
    for (int m = 0; m < D / 32; ++m) {
      const int i = 32 * m + lane;
      int level = 0;
      if (delta > 0.f) {
        // floor(x + u), u ~ U(0, 1) the reference's counter_uniform(seed, i).
        const double x = __ddiv_rn(__dsub_rn(double(y[i]), double(q_l)), double(delta));
        level = int(floor(__dadd_rn(x, index::counter_uniform(seed, uint64_t(i)))));
        level = min(max(level, 0), index::kRabitqQueryLevels);
      }
      sum += level;
      for (int bit = 0; bit < index::kRabitqQueryBits; ++bit) {
        const uint32_t bits = __ballot_sync(0xffffffffu, (level >> bit) & 1);
        out.planes[bit][m / 2] |= uint64_t(bits) << (32 * (m % 2));
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    out.sum_q_u = sum;
  }
  if (lane == 0) p.queries[cell] = out;
}

CudaStatus error(const std::string& message) {
  return CudaStatus{false, StatusCode::kInvalidArgument, "cuda key index: " + message};
}
CudaStatus unsupported(const std::string& message) {
  return CudaStatus{false, StatusCode::kUnsupported, "cuda key index: " + message};
}
CudaStatus launch_status() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return CudaStatus{false, StatusCode::kInternal, std::string("cuda key index: launch failed: ") + cudaGetErrorString(e)};
  return {};
}

CudaStatus check_rotation(const DeviceRotation& r) {
  if (r.kind == index::RotationKind::kHaar ? r.p_transpose == nullptr : r.signs == nullptr)
    return error("the rotation's parameters are null");
  if (r.kind != index::RotationKind::kHaar && r.kind != index::RotationKind::kRandomizedHadamard)
    return error("unknown rotation kind " + std::to_string(int(r.kind)));
  return {};
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

CudaStatus check(const KeyIndexBuildParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128)
    return unsupported("head_dim " + std::to_string(p.head_dim) + " is unsupported (64 or 128)");
  if (p.block_tokens != 16) return unsupported("block_tokens " + std::to_string(p.block_tokens) + " is unsupported (16)");
  if (p.n_kv_heads < 1 || p.n_kv_heads > 65535) return error("n_kv_heads must be in [1, 65535]");
  if (p.n_ranges < 0 || p.n_ranges > 65535) return error("n_ranges must be in [0, 65535]");
  if (p.max_range_tokens < 0 || p.max_range_tokens > (int64_t(1) << 24))
    return error("max_range_tokens must be in [0, 2^24]");
  if (p.n_ranges == 0) return {};
  if (!p.k_pages || !p.k_table || !p.ranges || !p.centroids || !p.records || !p.error_word)
    return error("a device pointer is null");
  if (p.k_page_stride < int64_t(p.block_tokens) * p.head_dim * 2 || p.n_k_pages < 0)
    return error("page stride too small for bf16 pages");
  if (p.table_stride < 1 || p.n_table_rows < 1 || p.table_row_stride < int64_t(p.n_kv_heads) * p.table_stride)
    return error("the block tables' shape is inconsistent (table_stride, table_row_stride, n_table_rows)");
  if (p.record_stride < 1) return error("record_stride must be >= 1");
  return check_rotation(p.rotation);
}

CudaStatus set_key_centroids(const KeyIndexBuildParams& p) {
  const CudaStatus s = check(p);
  if (!s.ok || p.n_ranges == 0) return s;
  if (p.query_centroids == nullptr) return error("set_key_centroids needs the query centroids");
  const dim3 grid(unsigned(p.n_kv_heads), unsigned(p.n_ranges));
  if (p.head_dim == 64)
    centroid_kernel<64><<<grid, 64, 0, as_stream(p.stream)>>>(p);
  else
    centroid_kernel<128><<<grid, 128, 0, as_stream(p.stream)>>>(p);
  return launch_status();
}

CudaStatus build_key_records(const KeyIndexBuildParams& p) {
  const CudaStatus s = check(p);
  if (!s.ok || p.n_ranges == 0 || p.max_range_tokens == 0) return s;
  const dim3 grid(unsigned((p.max_range_tokens + kWarpsPerCta - 1) / kWarpsPerCta), unsigned(p.n_kv_heads),
                  unsigned(p.n_ranges));
  if (p.head_dim == 64)
    records_kernel<64><<<grid, kTokenThreads, 0, as_stream(p.stream)>>>(p);
  else
    records_kernel<128><<<grid, kTokenThreads, 0, as_stream(p.stream)>>>(p);
  return launch_status();
}

// ---------------------------------------------------------------------------------------------
// Query sums: one thread per (channel, KV head, sequence), the sequence's rows in order and, in a
// row, the group's heads in order (index::rabitq_add_query_sums).
__global__ void query_sum_kernel(QuerySumParams p) {
  const int i = threadIdx.x, g = blockIdx.x, b = blockIdx.y;
  const int group = p.n_q_heads / p.n_kv_heads;
  double* s = p.sums + (int64_t(b) * p.n_kv_heads + g) * p.head_dim + i;
  double sum = *s;
  const int64_t row_floats = int64_t(p.n_q_heads) * p.head_dim;
  const int64_t end = p.row_ranges[2 * b + 1];
  for (int64_t t = p.row_ranges[2 * b]; t < end; ++t) {
    const float* x = p.q + t * row_floats + int64_t(g) * group * p.head_dim + i;
    for (int h = 0; h < group; ++h) sum = __dadd_rn(sum, double(__ldg(x + int64_t(h) * p.head_dim)));
  }
  *s = sum;
}

CudaStatus add_query_sums(const QuerySumParams& p) {
  if (p.n_seqs < 0 || p.n_seqs > 65535) return error("n_seqs must be in [0, 65535]");
  if (p.n_kv_heads < 1 || p.n_kv_heads > 65535 || p.n_q_heads < p.n_kv_heads || p.n_q_heads % p.n_kv_heads != 0)
    return error("n_q_heads must be a multiple of n_kv_heads, n_kv_heads in [1, 65535]");
  if (p.head_dim < 1 || p.head_dim > 1024) return error("head_dim must be in [1, 1024]");
  if (p.n_seqs == 0) return {};
  if (!p.q || !p.row_ranges || !p.sums) return error("a device pointer is null");
  query_sum_kernel<<<dim3(unsigned(p.n_kv_heads), unsigned(p.n_seqs)), unsigned(p.head_dim), 0, as_stream(p.stream)>>>(p);
  return launch_status();
}

CudaStatus check(const QueryQuantizeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128)
    return unsupported("head_dim " + std::to_string(p.head_dim) + " is unsupported (64 or 128)");
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0 || p.n_q_heads % p.n_kv_heads != 0)
    return error("GQA ratio " + std::to_string(p.n_q_heads) + "/" + std::to_string(p.n_kv_heads) + " is not integral");
  if (p.batch < 0 || int64_t(p.batch) * p.n_q_heads > int64_t(kWarpsPerCta) * INT32_MAX)
    return error("batch x n_q_heads is out of range");
  if (!(p.deviations >= 0) || !std::isfinite(p.deviations)) return error("deviations must be finite and >= 0");
  if (!(p.sm_scale > 0.f) || !std::isfinite(p.sm_scale)) return error("sm_scale must be positive and finite");
  if (p.batch == 0) return {};
  if (!p.q || !p.centroids || !p.rounding_seeds || !p.queries || !p.error_word) return error("a device pointer is null");
  if (p.n_table_rows < 1) return error("n_table_rows must be >= 1");
  return check_rotation(p.rotation);
}

CudaStatus quantize_queries(const QueryQuantizeParams& p) {
  const CudaStatus s = check(p);
  if (!s.ok || p.batch == 0) return s;
  const int64_t cells = int64_t(p.batch) * p.n_q_heads;
  const unsigned ctas = unsigned((cells + kWarpsPerCta - 1) / kWarpsPerCta);
  if (p.head_dim == 64)
    quantize_kernel<64><<<ctas, kTokenThreads, 0, as_stream(p.stream)>>>(p);
  else
    quantize_kernel<128><<<ctas, kTokenThreads, 0, as_stream(p.stream)>>>(p);
  return launch_status();
}

}  // namespace certkv::attention::cuda
