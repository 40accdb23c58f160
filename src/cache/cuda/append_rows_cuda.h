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

// Planned decode steps, which a CUDA graph replays (DeviceKvCache::reserve_rows): one row for
// each of `batch` sequences, row b at the position positions[b] holds on the device, which the
// launch then advances by one, so a captured launch writes each replay's rows where their
// sequences have got to. The rows after it in its block are zeroed, as append_rows zeroes them.
// A row at or past limits[b] (past the pages reserved for it) is not written, its position not
// advanced, counted in *overruns and flagged in overran[b] (cleared by a row that is written).
struct PlannedRowsArgs {
  const float* k_rows = nullptr;  // device: [batch][n_kv_heads][head_dim]
  const float* v_rows = nullptr;
  int batch = 0;
  int32_t* positions = nullptr;         // device: [batch]
  const int32_t* limits = nullptr;      // device: [batch]
  const int32_t* table_rows = nullptr;  // device: [batch], the slot whose tables row b reads
  // Slot s's tables: tables + s * table_row_stride, [2][n_kv_heads][table_stride] (r >= 0 or -r - 1).
  const int32_t* tables = nullptr;
  int64_t table_row_stride = 0, table_stride = 0;
  int n_kv_heads = 0, head_dim = 0, block_tokens = 0;
  format::GaacElement element = format::GaacElement::kBf16;
  uint8_t* raw_pages = nullptr;
  int64_t raw_page_stride = 0, n_raw_pages = 0;
  bool fragment_major = false;
  uint32_t* overruns = nullptr;  // device
  int32_t* overran = nullptr;    // device [batch]
};

// kInvalidArgument, before any launch, for what append_rows refuses and for missing arrays or a
// batch outside [0, 65535]; kInternal when the launch fails. No host copy and no wait: a stream
// capture may hold it.
CudaStatus append_planned_rows(const PlannedRowsArgs& args, void* stream);

// Per-step values of planned steps (a decode step's meters): values [batch][width] of the step
// each row has reached go to out[step][b][width], step = positions[b] - starts[b] - 1 (the
// position after that step's row); rows whose step is outside [0, steps), and rows flagged in
// skip (an append past the plan: no step of theirs ran), write nothing. No host copy and no wait.
struct PlannedStepValues {
  const float* values = nullptr;
  const int32_t* positions = nullptr;  // device [batch]
  const int32_t* starts = nullptr;     // device [batch]
  const int32_t* skip = nullptr;       // device [batch]
  float* out = nullptr;                // device [steps][batch][width]
  int batch = 0, width = 0;
  int64_t steps = 0;
};
CudaStatus store_planned_step_values(const PlannedStepValues& args, void* stream);

}  // namespace certkv::cache::cuda
