// Decode attention over paged BF16 KV on a CUDA device (the device half of the attention
// layer). Kernels take raw device pointers and a plain parameter struct; every entry point
// returns a status and never launches with arguments it has not checked.
//
// Layout on the device:
//   pages:        [n_pages][block_tokens][head_dim] bf16 (one pool, K and V pages alike)
//   k_table,
//   v_table:      [n_kv_heads][n_blocks] int32 page indices into `pages`
//   q:            [n_q_heads][head_dim] float
//   out:          [n_q_heads][head_dim] float
//   workspace:    workspace_bytes(params) bytes (split partials, merged by LSE weights)
// Query head h reads kv_head h / (n_q_heads / n_kv_heads).
// Thread safety: launches go to `stream`; the caller orders them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace certkv::attention::cuda {

struct PagedDecodeParams {
  const uint16_t* pages = nullptr;
  int64_t n_pages = 0;
  const int32_t* k_table = nullptr;
  const int32_t* v_table = nullptr;
  int64_t n_blocks = 0;  // entries per kv_head in each table
  int block_tokens = 16;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t n_ctx = 0;     // attend over positions [0, n_ctx)
  float scale = 0.f;
  int n_splits = 1;      // key/value splits, each of whole blocks
  const float* q = nullptr;
  float* out = nullptr;
  void* workspace = nullptr;
  void* stream = nullptr;  // cudaStream_t; null: the default stream
};

struct CudaStatus {
  bool ok = true;
  std::string message;
};

// Whether the kernel handles this shape (head_dim a multiple of 32 up to 256, GQA ratio
// integral, n_ctx within the tables); the message says what is not supported.
CudaStatus supports(const PagedDecodeParams& params);
size_t workspace_bytes(const PagedDecodeParams& params);
// Checks (supports, pointers, workspace), then launches. Asynchronous on params.stream.
CudaStatus paged_decode_attention_bf16(const PagedDecodeParams& params);

// Number of CUDA devices visible (0 when no driver or device).
int device_count();

}  // namespace certkv::attention::cuda
