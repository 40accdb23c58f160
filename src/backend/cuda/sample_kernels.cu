// Sampling on the device (backend/cuda/sample_kernels.h): argmax per greedy row; for rows with a
// temperature, keys written, a stable segmented radix sort (CUB), then one block per row walking
// the sorted candidates in chunks.
#include "backend/cuda/sample_kernels.h"

#include <cub/cub.cuh>
#include <cuda_runtime.h>

#include <string>

namespace certkv::backend::cuda {

namespace {

constexpr int kArgmaxThreads = 256;
constexpr int kSelectThreads = 256;
constexpr int kSelectItems = 8;  // candidates per thread and chunk
constexpr int kKeyThreads = 256;

CudaStatus launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return {};
  return cuda_error(StatusCode::kInternal, std::string(what) + ": launch failed: " + cudaGetErrorString(e));
}

CudaStatus refuse(const char* what, const std::string& why) {
  return cuda_error(StatusCode::kInvalidArgument, std::string(what) + ": " + why);
}

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// (value, index) with NaN absent: the larger value wins, then the lower index.
struct Best {
  float v;
  int i;  // -1: none
};

__device__ Best better(Best a, Best b) {
  if (a.i < 0) return b;
  if (b.i < 0) return a;
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

// out[j] = model::argmax of logits row rows[j].logit_row (row j when rows is null).
__global__ void argmax_kernel(const float* logits, int n, const SampleRow* rows, int32_t* out) {
  __shared__ float values[kArgmaxThreads / 32];
  __shared__ int indices[kArgmaxThreads / 32];
  const int64_t row = rows ? rows[blockIdx.x].logit_row : blockIdx.x;
  const float* l = logits + row * n;
  Best best{0.f, -1};
  for (int i = threadIdx.x; i < n; i += kArgmaxThreads)
    if (!isnan(l[i])) best = better(best, Best{l[i], i});
  for (int offset = 16; offset > 0; offset /= 2)
    best = better(best, Best{__shfl_xor_sync(0xffffffffu, best.v, offset), __shfl_xor_sync(0xffffffffu, best.i, offset)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    values[warp] = best.v;
    indices[warp] = best.i;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kArgmaxThreads / 32 ? Best{values[lane], indices[lane]} : Best{0.f, -1};
    for (int offset = 16; offset > 0; offset /= 2)
      best = better(best, Best{__shfl_xor_sync(0xffffffffu, best.v, offset), __shfl_xor_sync(0xffffffffu, best.i, offset)});
    // model::argmax scans from index 0: a NaN there is never beaten; nothing else present gives 0.
    if (lane == 0) out[blockIdx.x] = isnan(l[0]) || best.i < 0 ? 0 : best.i;
  }
}

// model::sample_key.
__device__ float sample_key(float logit, float temperature) {
  float x = __fdiv_rn(logit, temperature);
  if (x == 0.f) x = 0.f;
  return isnan(x) ? -INFINITY : x;
}

// keys[j][i], ids[j][i] of sampled row j (rows[j]), and the segments' offsets [m + 1].
__global__ void keys_kernel(const float* logits, int n, const SampleRow* rows, int m, float* keys, int32_t* ids,
                            int* offsets) {
  const int j = blockIdx.y;
  const SampleRow r = rows[j];
  const float* l = logits + int64_t(r.logit_row) * n;
  for (int i = blockIdx.x * kKeyThreads + threadIdx.x; i < n; i += gridDim.x * kKeyThreads) {
    keys[int64_t(j) * n + i] = sample_key(l[i], r.temperature);
    ids[int64_t(j) * n + i] = i;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    offsets[j] = j * n;
    if (j == m - 1) offsets[m] = m * n;
  }
}

using Scan = cub::BlockScan<double, kSelectThreads>;

struct WalkShared {
  Scan::TempStorage scan;
  int first;
  double prefix;
};

// What a walk found: the first candidate tested true and its running prefix, or index -1.
struct Found {
  int index;
  double prefix;
};

// One chunk [base, base + kSelectThreads * kSelectItems) of the walk over the candidates i < n
// with w_i = exp(double(key_i - key_0)), in order: thread t takes kSelectItems consecutive ones;
// the running prefix P_i = (carry + the sums of the threads before t) + the w's of t up to i is
// tested by want(P_i) where w_i > 0 (a candidate of weight 0 adds nothing: on the host it never
// ends a walk). Adds the chunk's sum (the scan's aggregate) to *carry.
template <typename Want>
__device__ Found walk_chunk(const float* keys, int n, int64_t base, float key0, double* carry, Want want,
                            WalkShared& shared) {
  double w[kSelectItems];
  double sum = 0;
  const int64_t at = base + int64_t(threadIdx.x) * kSelectItems;
  for (int k = 0; k < kSelectItems; ++k) {
    w[k] = at + k < n ? exp(double(keys[at + k] - key0)) : 0.0;
    sum += w[k];
  }
  double before = 0, aggregate = 0;
  Scan(shared.scan).ExclusiveSum(sum, before, aggregate);
  if (threadIdx.x == 0) shared.first = INT_MAX;
  __syncthreads();
  double running = *carry + before;
  int mine = INT_MAX;
  for (int k = 0; k < kSelectItems && at + k < n; ++k) {
    running += w[k];
    if (w[k] > 0.0 && want(running)) {  // the running sums of two threads meet only to rounding
      mine = int(at + k);
      atomicMin(&shared.first, mine);
      break;
    }
  }
  __syncthreads();
  if (mine != INT_MAX && mine == shared.first) shared.prefix = running;
  __syncthreads();
  const Found found{shared.first == INT_MAX ? -1 : shared.first, shared.prefix};
  __syncthreads();
  *carry += aggregate;
  return found;
}

// The first candidate (of n) tested true by want over a whole walk, or index -1; *total: the sum
// of every w.
template <typename Want>
__device__ Found walk(const float* keys, int n, float key0, Want want, WalkShared& shared, double* total) {
  const int64_t chunk = int64_t(kSelectThreads) * kSelectItems;
  double carry = 0;
  for (int64_t base = 0; base < n; base += chunk) {
    const Found f = walk_chunk(keys, n, base, key0, &carry, want, shared);
    if (f.index >= 0) return f;
  }
  if (total) *total = carry;
  return Found{-1, 0};
}

struct Never {
  __device__ bool operator()(double) const { return false; }
};
struct ReachesMass {
  double total, p;
  __device__ bool operator()(double prefix) const { return prefix / total >= p; }
};
struct Exceeds {
  double r;
  __device__ bool operator()(double prefix) const { return prefix > r; }
};

// tokens[j] of sampled row j from its keys and ids sorted (descending keys, lower id first on
// equal keys): model::sample_token's cut and draw.
__global__ void select_kernel(const float* keys_sorted, const int32_t* ids_sorted, int n_vocab, const SampleRow* rows,
                              int32_t* tokens) {
  __shared__ WalkShared shared;
  const int j = blockIdx.x;
  const SampleRow r = rows[j];
  const float* keys = keys_sorted + int64_t(j) * n_vocab;
  const int32_t* ids = ids_sorted + int64_t(j) * n_vocab;
  const int n = r.top_k > 0 && r.top_k < n_vocab ? r.top_k : n_vocab;
  const float key0 = keys[0];
  double total = 0;
  walk(keys, n, key0, Never{}, shared, &total);
  int keep = n;
  double kept = total;
  if (r.top_p < 1.f) {
    const Found cut = walk(keys, n, key0, ReachesMass{total, double(r.top_p)}, shared, nullptr);
    if (cut.index >= 0) {
      keep = cut.index + 1;
      kept = cut.prefix;
    }
  }
  const Found pick = walk(keys, keep, key0, Exceeds{r.u * kept}, shared, nullptr);
  if (threadIdx.x != 0) return;
  if (pick.index >= 0) {
    tokens[j] = ids[pick.index];
    return;
  }
  // No cumulative weight exceeded r (rounding): the last kept candidate of positive weight, found
  // by bisection (w falls along the sorted keys), else the first.
  int lo = 0, hi = keep;  // the answer lies in [lo - 1, hi): w positive before lo, not from hi on
  if (!(exp(double(keys[0] - key0)) > 0.0)) {
    tokens[j] = ids[0];
    return;
  }
  lo = 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (exp(double(keys[mid] - key0)) > 0.0) lo = mid + 1;
    else hi = mid;
  }
  tokens[j] = ids[lo - 1];
}

struct Workspace {
  float* keys;
  int32_t* ids;
  float* keys_sorted;
  int32_t* ids_sorted;
  int* offsets;
  void* sort;
  size_t sort_bytes;
};

size_t sort_bytes(int n_sampled, int32_t n_vocab) {
  size_t bytes = 0;
  cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, static_cast<const float*>(nullptr),
                                                     static_cast<float*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), n_sampled * n_vocab, n_sampled,
                                                     static_cast<const int*>(nullptr), static_cast<const int*>(nullptr));
  return bytes;
}

// The workspace's parts at `base` (null: only the size, in *bytes).
Workspace carve(void* base, int n_sampled, int32_t n_vocab, size_t* bytes) {
  const size_t cells = size_t(n_sampled) * size_t(n_vocab);
  Workspace w{};
  size_t at = 0;
  auto take = [&](size_t b) {
    void* p = base ? static_cast<char*>(base) + at : nullptr;
    at += aligned(b);
    return p;
  };
  w.keys = static_cast<float*>(take(cells * sizeof(float)));
  w.ids = static_cast<int32_t*>(take(cells * sizeof(int32_t)));
  w.keys_sorted = static_cast<float*>(take(cells * sizeof(float)));
  w.ids_sorted = static_cast<int32_t*>(take(cells * sizeof(int32_t)));
  w.offsets = static_cast<int*>(take(size_t(n_sampled + 1) * sizeof(int)));
  w.sort_bytes = sort_bytes(n_sampled, n_vocab);
  w.sort = take(w.sort_bytes);
  *bytes = at;
  return w;
}

}  // namespace

size_t sample_rows_workspace_bytes(int n_sampled, int32_t n_vocab) {
  if (n_sampled <= 0 || n_vocab < 1) return 0;
  size_t bytes = 0;
  carve(nullptr, n_sampled, n_vocab, &bytes);
  return bytes;
}

CudaStatus argmax_rows(const float* logits, int64_t rows, int n, int32_t* out, void* stream) {
  if (rows < 0 || n < 1) return refuse("argmax_rows", "needs rows >= 0 and n >= 1");
  if (!logits || !out) return refuse("argmax_rows", "null logits or output");
  if (rows == 0) return {};
  argmax_kernel<<<unsigned(rows), kArgmaxThreads, 0, static_cast<cudaStream_t>(stream)>>>(logits, n, nullptr, out);
  return launched("argmax_rows");
}

CudaStatus sample_rows(const float* logits, int32_t n_vocab, const SampleRow* rows, int m, int n_greedy,
                       int32_t* tokens, void* workspace, size_t workspace_bytes, void* stream) {
  if (n_vocab < 1 || m < 0 || n_greedy < 0 || n_greedy > m)
    return refuse("sample_rows", "needs n_vocab >= 1 and 0 <= n_greedy <= m");
  if (int64_t(m - n_greedy) * n_vocab > INT32_MAX)
    return refuse("sample_rows", "too many sampled rows for one sort (" + std::to_string(m - n_greedy) + " x " +
                                     std::to_string(n_vocab) + " keys)");
  if (m == 0) return {};
  if (!logits || !rows || !tokens) return refuse("sample_rows", "null logits, rows or tokens");
  const int n_sampled = m - n_greedy;
  size_t need = 0;
  const Workspace w = n_sampled > 0 ? carve(workspace, n_sampled, n_vocab, &need) : Workspace{};
  if (n_sampled > 0 && (!workspace || workspace_bytes < need))
    return refuse("sample_rows", "the workspace holds " + std::to_string(workspace_bytes) + " bytes, " +
                                     std::to_string(need) + " needed");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (n_greedy > 0) {
    argmax_kernel<<<unsigned(n_greedy), kArgmaxThreads, 0, s>>>(logits, n_vocab, rows, tokens);
    if (CudaStatus st = launched("sample_rows (argmax)"); !st.ok) return st;
  }
  if (n_sampled == 0) return {};
  const SampleRow* sampled = rows + n_greedy;
  const dim3 key_grid(unsigned((n_vocab + kKeyThreads * 8 - 1) / (kKeyThreads * 8)), unsigned(n_sampled));
  keys_kernel<<<key_grid, kKeyThreads, 0, s>>>(logits, n_vocab, sampled, n_sampled, w.keys, w.ids, w.offsets);
  if (CudaStatus st = launched("sample_rows (keys)"); !st.ok) return st;
  size_t sort_bytes = w.sort_bytes;
  const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      w.sort, sort_bytes, w.keys, w.keys_sorted, w.ids, w.ids_sorted, n_sampled * n_vocab, n_sampled, w.offsets,
      w.offsets + 1, 0, 32, s);
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("sample_rows (sort): ") + cudaGetErrorString(e));
  select_kernel<<<unsigned(n_sampled), kSelectThreads, 0, s>>>(w.keys_sorted, w.ids_sorted, n_vocab, sampled,
                                                                tokens + n_greedy);
  return launched("sample_rows (select)");
}

}  // namespace certkv::backend::cuda
