#include "cache/cuda/append_rows_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "format/fp8.h"
#include "format/fragment_layout.h"
#include "format/numeric.h"

namespace certkv::cache::cuda {
namespace {

struct AppendBatch {
  AppendRowsArgs items[kMaxAppendBatch];
};
static_assert(sizeof(AppendBatch) <= 4096, "a kernel's parameters by value fit in 4 KiB");

// Where (row, channel) of a K (kv 0) or V page is stored.
__device__ int64_t element_of(const AppendRowsArgs& a, int kv, int row, int c) {
  return a.fragment_major ? int64_t(format::fragment::element_index(kv == 0, row, c)) : int64_t(row) * a.head_dim + c;
}

// One write, by the blocks of one grid row (blockIdx.y picks the write in a batch).
__device__ void append_one(const AppendRowsArgs& a) {
  const int64_t per_tensor = a.n * a.n_kv_heads * a.head_dim;
  const int64_t total = 2 * per_tensor;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int kv = int(i / per_tensor);
    const int64_t rem = i - kv * per_tensor;
    const int64_t t = rem / (int64_t(a.n_kv_heads) * a.head_dim);
    const int h = int(rem / a.head_dim % a.n_kv_heads);
    const int c = int(rem % a.head_dim);
    const int64_t pos = a.first + t;
    const int64_t block = pos / a.block_tokens;
    const int row = int(pos % a.block_tokens);
    const int32_t entry = a.tables[(int64_t(kv) * a.n_kv_heads + h) * a.table_stride + block];
    const int64_t page = entry >= 0 ? entry : -int64_t(entry) - 1;
    if (page >= a.n_raw_pages) continue;  // a table the host never wrote: never write past the pool
    uint8_t* dst = a.raw_pages + page * a.raw_page_stride;
    const uint16_t bf16 = format::float_to_bf16(kv == 0 ? a.k_rows[rem] : a.v_rows[rem]);
    const int64_t element = element_of(a, kv, row, c);
    if (a.element == format::GaacElement::kBf16) {
      reinterpret_cast<uint16_t*>(dst)[element] = bf16;
    } else {
      dst[element] = format::bf16_to_fp8_e5m2_ref(bf16);
    }
  }
  // The rows of the last block past this write: zero, so that a recycled page (one that held
  // another sequence's block, non-finite values included) never puts stale values under the
  // masked tokens of a tail (0 times Inf is NaN in P V).
  const int64_t end = a.first + a.n;
  const int pad_rows = int(end % a.block_tokens) == 0 ? 0 : a.block_tokens - int(end % a.block_tokens);
  const int64_t pad_total = 2 * int64_t(a.n_kv_heads) * pad_rows * a.head_dim;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pad_total; i += stride) {
    const int kv = int(i / (int64_t(a.n_kv_heads) * pad_rows * a.head_dim));
    const int64_t rem = i % (int64_t(a.n_kv_heads) * pad_rows * a.head_dim);
    const int h = int(rem / (int64_t(pad_rows) * a.head_dim));
    const int row = a.block_tokens - pad_rows + int(rem / a.head_dim % pad_rows);
    const int c = int(rem % a.head_dim);
    const int32_t entry = a.tables[(int64_t(kv) * a.n_kv_heads + h) * a.table_stride + end / a.block_tokens];
    const int64_t page = entry >= 0 ? entry : -int64_t(entry) - 1;
    if (page >= a.n_raw_pages) continue;
    uint8_t* dst = a.raw_pages + page * a.raw_page_stride;
    const int64_t element = element_of(a, kv, row, c);
    if (a.element == format::GaacElement::kBf16) reinterpret_cast<uint16_t*>(dst)[element] = 0;
    else dst[element] = 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.length = int32_t(a.first + a.n);
}

__global__ void append_rows_kernel(AppendRowsArgs a) { append_one(a); }

// One block per row: every thread reads the row's position before thread 0 advances it.
__global__ void planned_rows_kernel(PlannedRowsArgs a) {
  const int b = blockIdx.x;
  const int64_t pos = a.positions[b];
  const bool fits = pos >= 0 && pos < a.limits[b];
  __syncthreads();
  if (!fits) {
    if (threadIdx.x == 0) {
      atomicAdd(a.overruns, 1u);
      a.overran[b] = 1;
    }
    return;
  }
  const int32_t* tables = a.tables + int64_t(a.table_rows[b]) * a.table_row_stride;
  const int64_t block = pos / a.block_tokens;
  const int row = int(pos % a.block_tokens);
  const int per_tensor = a.n_kv_heads * a.head_dim;
  const int pad_rows = a.block_tokens - 1 - row;
  // The row, then the rows after it in its block (zero), of every (K/V, kv_head).
  const int total = 2 * per_tensor * (1 + pad_rows);
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int r = i / (2 * per_tensor);  // 0: the row; 1 + j: row + 1 + j, zeroed
    const int rem = i % (2 * per_tensor);
    const int kv = rem / per_tensor;
    const int h = rem % per_tensor / a.head_dim;
    const int c = rem % a.head_dim;
    const int32_t entry = tables[(int64_t(kv) * a.n_kv_heads + h) * a.table_stride + block];
    const int64_t page = entry >= 0 ? entry : -int64_t(entry) - 1;
    if (page >= a.n_raw_pages) continue;  // a table the host never wrote: never write past the pool
    uint8_t* dst = a.raw_pages + page * a.raw_page_stride;
    uint16_t bf16 = 0;
    if (r == 0) {
      const float* src = kv == 0 ? a.k_rows : a.v_rows;
      bf16 = format::float_to_bf16(src[int64_t(b) * per_tensor + rem % per_tensor]);
    }
    const int64_t element = a.fragment_major ? int64_t(format::fragment::element_index(kv == 0, row + r, c))
                                             : int64_t(row + r) * a.head_dim + c;
    if (a.element == format::GaacElement::kBf16) {
      reinterpret_cast<uint16_t*>(dst)[element] = bf16;
    } else {
      dst[element] = r == 0 ? format::bf16_to_fp8_e5m2_ref(bf16) : uint8_t(0);
    }
  }
  if (threadIdx.x == 0) {
    a.positions[b] = int32_t(pos + 1);
    a.overran[b] = 0;
  }
}

__global__ void append_batch_kernel(AppendBatch b) { append_one(b.items[blockIdx.y]); }

__global__ void planned_step_values_kernel(PlannedStepValues a) {
  const int b = blockIdx.x;
  const int64_t step = int64_t(a.positions[b]) - a.starts[b] - 1;
  if (step < 0 || step >= a.steps || a.skip[b] != 0) return;
  float* out = a.out + (step * a.batch + b) * a.width;
  for (int i = threadIdx.x; i < a.width; i += blockDim.x) out[i] = a.values[int64_t(b) * a.width + i];
}

int grid_blocks(int64_t rows_values) {
  return int(std::min<int64_t>((rows_values + 255) / 256, 1024) + (rows_values == 0));
}

}  // namespace

CudaStatus check_append_rows(const AppendRowsArgs& a) {
  auto bad = [](const std::string& what) { return cuda_error(StatusCode::kInvalidArgument, "append_rows: " + what); };
  if (a.n < 0 || a.first < 0) return bad("negative row count or position");
  if (a.n_kv_heads < 1 || a.head_dim < 1 || a.block_tokens < 1) return bad("n_kv_heads, head_dim and block_tokens must be >= 1");
  if (a.element != format::GaacElement::kBf16 && a.element != format::GaacElement::kFp8E5M2)
    return bad("rows are written as bf16 or E5M2 only");
  if (a.fragment_major && (a.element != format::GaacElement::kBf16 || a.block_tokens != format::fragment::kPageTokens ||
                           a.head_dim % 16 != 0))
    return bad("fragment-major raw pages are bf16 pages of " + std::to_string(format::fragment::kPageTokens) +
               " tokens and a head_dim that is a multiple of 16 (block_tokens " + std::to_string(a.block_tokens) +
               ", head_dim " + std::to_string(a.head_dim) + ")");
  if (a.table_stride < 0 || a.n_raw_pages < 0) return bad("negative table stride or raw page count");
  if (a.n > 0 && (a.first + a.n + a.block_tokens - 1) / a.block_tokens > a.table_stride)
    return bad("rows [" + std::to_string(a.first) + ", " + std::to_string(a.first + a.n) + ") are past the tables (" +
               std::to_string(a.table_stride) + " blocks)");
  const int64_t page = int64_t(a.block_tokens) * a.head_dim * (a.element == format::GaacElement::kBf16 ? 2 : 1);
  if (a.n_raw_pages > 0 && (a.raw_pages == nullptr || a.raw_page_stride < page))
    return bad("a raw pool needs pages of at least " + std::to_string(page) + " bytes");
  if (a.length == nullptr || (a.n > 0 && (a.k_rows == nullptr || a.v_rows == nullptr || a.tables == nullptr)))
    return bad("a device array is null");
  return {};
}

CudaStatus append_rows(const AppendRowsArgs& args, void* stream) {
  if (CudaStatus s = check_append_rows(args); !s.ok) return s;
  // Enough threads for the rows written (the zeroed rows after them are fewer than a block's).
  const int64_t total = 2 * args.n * args.n_kv_heads * args.head_dim;
  append_rows_kernel<<<grid_blocks(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("append_rows launch failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus append_rows_batch(const AppendRowsArgs* args, int count, void* stream) {
  if (count < 0 || count > kMaxAppendBatch || (count > 0 && args == nullptr))
    return cuda_error(StatusCode::kInvalidArgument, "append_rows_batch: between 0 and " +
                                                        std::to_string(kMaxAppendBatch) + " writes");
  if (count == 0) return {};
  AppendBatch b;
  int64_t most = 0;
  for (int i = 0; i < count; ++i) {
    if (CudaStatus s = check_append_rows(args[i]); !s.ok) return s;
    b.items[i] = args[i];
    most = std::max(most, 2 * args[i].n * args[i].n_kv_heads * args[i].head_dim);
  }
  append_batch_kernel<<<dim3(unsigned(grid_blocks(most)), unsigned(count)), 256, 0, static_cast<cudaStream_t>(stream)>>>(b);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("append_rows_batch launch failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus append_planned_rows(const PlannedRowsArgs& a, void* stream) {
  auto bad = [](const std::string& what) {
    return cuda_error(StatusCode::kInvalidArgument, "append_planned_rows: " + what);
  };
  if (a.batch < 0 || a.batch > 65535) return bad("batch must be in [0, 65535]");
  if (a.batch == 0) return {};
  // The checks of one write of one row at position 0 (the positions are on the device).
  AppendRowsArgs one;
  one.k_rows = a.k_rows;
  one.v_rows = a.v_rows;
  one.n = 1;
  one.n_kv_heads = a.n_kv_heads;
  one.head_dim = a.head_dim;
  one.block_tokens = a.block_tokens;
  one.element = a.element;
  one.tables = a.tables;
  one.table_stride = a.table_stride;
  one.raw_pages = a.raw_pages;
  one.raw_page_stride = a.raw_page_stride;
  one.n_raw_pages = a.n_raw_pages;
  one.length = a.positions;
  one.fragment_major = a.fragment_major;
  if (CudaStatus s = check_append_rows(one); !s.ok) return s;
  if (!a.limits || !a.table_rows || !a.overruns || !a.overran) return bad("a device array is null");
  if (a.table_row_stride < 2 * int64_t(a.n_kv_heads) * a.table_stride) return bad("table_row_stride too small");
  planned_rows_kernel<<<unsigned(a.batch), 256, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("append_planned_rows launch failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus store_planned_step_values(const PlannedStepValues& a, void* stream) {
  if (a.batch < 0 || a.batch > 65535 || a.width < 0 || a.steps < 0)
    return cuda_error(StatusCode::kInvalidArgument, "store_planned_step_values: batch, width or steps out of range");
  if (a.batch == 0 || a.width == 0) return {};
  if (!a.values || !a.positions || !a.starts || !a.skip || !a.out)
    return cuda_error(StatusCode::kInvalidArgument, "store_planned_step_values: a device array is null");
  planned_step_values_kernel<<<unsigned(a.batch), 128, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal,
                      std::string("store_planned_step_values launch failed: ") + cudaGetErrorString(e));
  return {};
}

}  // namespace certkv::cache::cuda
