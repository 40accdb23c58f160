// The device step of DeviceKvCache::write: rows of floats rounded into the raw tail pages that
// the block tables name, exactly as KvCache::write rounds them on the host; the rows of the last
// block after them are zeroed (a recycled page keeps nothing of its former block under a tail's
// masked tokens).
#pragma once

#include <cstdint>

#include "core/cuda_status.h"
#include "format/gaac_layout.h"

namespace certkv::cache::cuda {

struct AppendRowsArgs {
  const float* k_rows = nullptr;   // device: [n][n_kv_heads][head_dim]
  const float* v_rows = nullptr;   // device: [n][n_kv_heads][head_dim]
  int64_t n = 0;                   // tokens
  int64_t first = 0;               // position of the first row
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 0;
  format::GaacElement element = format::GaacElement::kBf16;  // bf16, or E5M2 after bf16
  const int32_t* tables = nullptr;  // device: [2][n_kv_heads][table_stride]; r >= 0 or -r - 1
  int64_t table_stride = 0;
  uint8_t* raw_pages = nullptr;     // device pool of raw pages
  int64_t raw_page_stride = 0;
  int64_t n_raw_pages = 0;          // entries naming a page outside the pool are not written
  int32_t* length = nullptr;        // device: set to first + n
  // The raw pages fragment-major (format/fragment_layout.h: K pages by the K map, V pages by the V
  // map; element_index) instead of [block_tokens][head_dim]: bf16 pages of 16 tokens only.
  bool fragment_major = false;
};

// Asynchronous on `stream`. kInvalidArgument, before any launch, for arguments the kernel would
// index past (a shape below 1, rows past the tables, a raw page stride below a page, an element
// other than bf16 / E5M2, missing arrays, fragment-major pages that are not bf16 pages of 16
// tokens and a head_dim a multiple of 16); kInternal when the launch fails.
CudaStatus append_rows(const AppendRowsArgs& args, void* stream);
// Several writes (distinct sequences' tables) in one launch, at most kMaxAppendBatch of them;
// each is checked as append_rows checks one, all before the launch.
inline constexpr int kMaxAppendBatch = 24;
CudaStatus append_rows_batch(const AppendRowsArgs* args, int count, void* stream);
// The checks of append_rows alone (no launch).
CudaStatus check_append_rows(const AppendRowsArgs& args);

}  // namespace certkv::cache::cuda
