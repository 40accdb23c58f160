#include "cache/cuda/place_encoded_cuda.h"

#include <cuda_runtime.h>

#include <string>

#include "codec/cuda/gaac_encode_cuda.h"
#include "codec/cuda/lossy_encode_cuda.h"

namespace certkv::cache::cuda {
namespace {

__global__ void place_encoded_kernel(PlaceEncodedArgs a) {
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= a.n) return;
  const TablePlacement p = a.placements[i];
  if (p.entry < 0 || p.entry >= a.n_entries) return;  // never write outside the tables
  bool encoded = true;
  if (a.kind != EncodeResult::kAlways) {
    if (p.result < 0 || p.result >= a.n_results) return;  // no result: the raw page stays
    if (a.kind == EncodeResult::kGaacUsedBytes) {
      const uint32_t used = reinterpret_cast<const uint32_t*>(a.results)[p.result];
      encoded = used != codec::cuda::kGaacDeviceDoesNotFit;
    } else {
      encoded = a.results[p.result] == codec::cuda::kLossyEncoded;
    }
  }
  if (encoded) a.tables[p.entry] = p.value;
}

__global__ void copy_table_rows_kernel(CopyTableRowsArgs a) {
  const int j = int(blockIdx.y);
  const int64_t row = a.rows[j];
  if (row < 0 || row >= a.n_table_rows) return;
  const int32_t* src = a.tables + row * a.row_entries;
  int32_t* dst = a.dst + int64_t(j) * a.row_entries;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < a.row_entries; e += int64_t(gridDim.x) * blockDim.x)
    dst[e] = src[e];
}

}  // namespace

CudaStatus check_place_encoded_pages(const PlaceEncodedArgs& a) {
  const auto bad = [](const std::string& what) {
    return cuda_error(StatusCode::kInvalidArgument, "place_encoded_pages: " + what);
  };
  if (a.n < 0) return bad("a negative count of placements");
  if (a.kind != EncodeResult::kGaacUsedBytes && a.kind != EncodeResult::kLossyStatus && a.kind != EncodeResult::kAlways)
    return bad("an unknown kind of result " + std::to_string(int(a.kind)));
  if (a.n > 0 && (a.tables == nullptr || a.placements == nullptr ||
                  (a.kind != EncodeResult::kAlways && a.results == nullptr)))
    return bad("a device array is null");
  return {};
}

CudaStatus place_encoded_pages(const PlaceEncodedArgs& args, void* stream) {
  if (CudaStatus s = check_place_encoded_pages(args); !s.ok) return s;
  if (args.n == 0) return {};
  const int threads = 128;
  place_encoded_kernel<<<(args.n + threads - 1) / threads, threads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("place_encoded_pages launch failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus copy_table_rows(const CopyTableRowsArgs& a, void* stream) {
  if (a.n < 0 || a.row_entries < 0 ||
      (a.n > 0 && a.row_entries > 0 && (a.tables == nullptr || a.rows == nullptr || a.dst == nullptr)))
    return cuda_error(StatusCode::kInvalidArgument, "copy_table_rows: a negative count or a null device array");
  if (a.n == 0 || a.row_entries == 0) return {};
  if (a.n > 65535) return cuda_error(StatusCode::kInvalidArgument, "copy_table_rows: more than 65535 rows in one launch");
  const int threads = 256;
  const int64_t blocks_x = (a.row_entries + threads - 1) / threads;
  const dim3 grid(unsigned(blocks_x < 64 ? blocks_x : 64), unsigned(a.n));
  copy_table_rows_kernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("copy_table_rows launch failed: ") + cudaGetErrorString(e));
  return {};
}

}  // namespace certkv::cache::cuda
