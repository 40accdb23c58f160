#include "attention/cuda/decode_attention_cuda.h"

#include <cuda_runtime.h>

#include <cfloat>

namespace certkv::attention::cuda {

namespace {

constexpr int kThreads = 128;      // tokens scored per chunk: one per thread
constexpr int kMaxHeadDim = 256;

__device__ inline float bf16_bits_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ inline float block_reduce_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();
  return r;
}

__device__ inline float block_reduce_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

__device__ inline const uint16_t* token_row(const PagedDecodeParams& p, const int32_t* table,
                                            int kv_head, int64_t t) {
  const int64_t block = t / p.block_tokens;
  const int32_t page = table[int64_t(kv_head) * p.n_blocks + block];
  return p.pages + (int64_t(page) * p.block_tokens + t % p.block_tokens) * p.head_dim;
}

// One block per (query head, split): online softmax (Milakov & Gimelshein 2018) over chunks of
// kThreads tokens. Each thread scores one token of the chunk; then threads own output dims and
// accumulate sum_t e^{s_t - m} v_t. Writes the split's m, l and unnormalized acc.
__global__ void paged_decode_split_kernel(PagedDecodeParams p, float* part_m, float* part_l,
                                          float* part_acc) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float p_s[kThreads];
  __shared__ float scratch[kThreads / 32];
  const int h = blockIdx.x;
  const int split = blockIdx.y;
  const int kv_head = h / (p.n_q_heads / p.n_kv_heads);
  const int hd = p.head_dim;
  const int64_t ctx_blocks = (p.n_ctx + p.block_tokens - 1) / p.block_tokens;
  const int64_t blocks_per_split = (ctx_blocks + p.n_splits - 1) / p.n_splits;
  const int64_t t_begin = min(p.n_ctx, int64_t(split) * blocks_per_split * p.block_tokens);
  const int64_t t_end = min(p.n_ctx, int64_t(split + 1) * blocks_per_split * p.block_tokens);

  for (int d = threadIdx.x; d < hd; d += kThreads) q_s[d] = p.q[int64_t(h) * hd + d];
  __syncthreads();

  float m = -FLT_MAX, l = 0.f;
  float acc0 = 0.f, acc1 = 0.f;  // dims threadIdx.x and threadIdx.x + kThreads
  for (int64_t c0 = t_begin; c0 < t_end; c0 += kThreads) {
    const int64_t t = c0 + threadIdx.x;
    float s = -FLT_MAX;
    if (t < t_end) {
      const uint16_t* k = token_row(p, p.k_table, kv_head, t);
      float dot = 0.f;
      for (int d = 0; d < hd; ++d) dot += q_s[d] * bf16_bits_to_float(k[d]);
      s = dot * p.scale;
    }
    const float chunk_max = block_reduce_max(s, scratch);
    const float m_new = fmaxf(m, chunk_max);
    const float e = t < t_end ? __expf(s - m_new) : 0.f;
    p_s[threadIdx.x] = e;
    const float chunk_sum = block_reduce_sum(e, scratch);
    const float rescale = __expf(m - m_new);
    l = l * rescale + chunk_sum;
    acc0 *= rescale;
    acc1 *= rescale;
    m = m_new;
    const int n = int(min(int64_t(kThreads), t_end - c0));
    for (int j = 0; j < n; ++j) {
      const uint16_t* v = token_row(p, p.v_table, kv_head, c0 + j);
      const float pj = p_s[j];
      if (threadIdx.x < hd) acc0 += pj * bf16_bits_to_float(v[threadIdx.x]);
      if (threadIdx.x + kThreads < hd) acc1 += pj * bf16_bits_to_float(v[threadIdx.x + kThreads]);
    }
    __syncthreads();
  }
  const int64_t part = int64_t(h) * p.n_splits + split;
  if (threadIdx.x == 0) {
    part_m[part] = m;
    part_l[part] = l;
  }
  if (threadIdx.x < hd) part_acc[part * hd + threadIdx.x] = acc0;
  if (threadIdx.x + kThreads < hd) part_acc[part * hd + threadIdx.x + kThreads] = acc1;
}

// Merges the splits of each head by their log-sum-exp weights: out = sum_s e^{m_s - M} acc_s /
// sum_s e^{m_s - M} l_s. One block per head, threads over dims.
__global__ void merge_splits_kernel(PagedDecodeParams p, const float* part_m, const float* part_l,
                                    const float* part_acc) {
  const int h = blockIdx.x;
  const int hd = p.head_dim;
  float big_m = -FLT_MAX;
  for (int s = 0; s < p.n_splits; ++s) big_m = fmaxf(big_m, part_m[int64_t(h) * p.n_splits + s]);
  float denom = 0.f;
  for (int s = 0; s < p.n_splits; ++s) {
    const int64_t part = int64_t(h) * p.n_splits + s;
    if (part_l[part] > 0.f) denom += __expf(part_m[part] - big_m) * part_l[part];
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float num = 0.f;
    for (int s = 0; s < p.n_splits; ++s) {
      const int64_t part = int64_t(h) * p.n_splits + s;
      if (part_l[part] > 0.f) num += __expf(part_m[part] - big_m) * part_acc[part * hd + d];
    }
    p.out[int64_t(h) * hd + d] = num / denom;
  }
}

CudaStatus error(const std::string& message) { return CudaStatus{false, message}; }

}  // namespace

CudaStatus supports(const PagedDecodeParams& p) {
  if (p.head_dim <= 0 || p.head_dim % 32 != 0 || p.head_dim > kMaxHeadDim)
    return error("head_dim " + std::to_string(p.head_dim) + " is unsupported (multiple of 32, at most 256)");
  if (p.n_q_heads <= 0 || p.n_kv_heads <= 0 || p.n_q_heads % p.n_kv_heads != 0)
    return error("GQA ratio " + std::to_string(p.n_q_heads) + "/" + std::to_string(p.n_kv_heads) +
                 " is not integral");
  if (p.block_tokens <= 0) return error("block_tokens must be positive");
  if (p.n_ctx < 1 || p.n_ctx > p.n_blocks * int64_t(p.block_tokens))
    return error("n_ctx " + std::to_string(p.n_ctx) + " is outside the block tables (" +
                 std::to_string(p.n_blocks * int64_t(p.block_tokens)) + " tokens)");
  const int64_t ctx_blocks = (p.n_ctx + p.block_tokens - 1) / p.block_tokens;
  if (p.n_splits < 1 || p.n_splits > ctx_blocks)
    return error("n_splits must be in [1, " + std::to_string(ctx_blocks) + "]");
  return {};
}

size_t workspace_bytes(const PagedDecodeParams& p) {
  const size_t parts = size_t(p.n_q_heads) * size_t(p.n_splits > 0 ? p.n_splits : 1);
  return parts * (2 + size_t(p.head_dim > 0 ? p.head_dim : 0)) * sizeof(float);
}

CudaStatus paged_decode_attention_bf16(const PagedDecodeParams& p) {
  CudaStatus s = supports(p);
  if (!s.ok) return s;
  if (!p.pages || !p.k_table || !p.v_table || !p.q || !p.out || !p.workspace)
    return error("a device pointer is null");
  if (reinterpret_cast<uintptr_t>(p.pages) % 16 != 0) return error("the page pool is not 16-byte aligned");
  const size_t parts = size_t(p.n_q_heads) * size_t(p.n_splits);
  float* part_m = static_cast<float*>(p.workspace);
  float* part_l = part_m + parts;
  float* part_acc = part_l + parts;
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  paged_decode_split_kernel<<<dim3(p.n_q_heads, p.n_splits), kThreads, 0, stream>>>(p, part_m, part_l, part_acc);
  merge_splits_kernel<<<p.n_q_heads, 128, 0, stream>>>(p, part_m, part_l, part_acc);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return error(std::string("kernel launch failed: ") + cudaGetErrorString(e));
  return {};
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace certkv::attention::cuda
