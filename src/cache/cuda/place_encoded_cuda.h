// The device step of a deferred block finalize (DeviceKvCacheConfig::defer_encode_results): after
// an encode launch, each encoded block's table entries are pointed at its encoded page, on the
// device, while a block the encoder refused keeps the raw page its entry already names; launches
// later in the same step read the right tables before the host has seen a result
// (DeviceKvCache::reconcile_encodes brings the host's copy of the tables up to date after the
// step). The same launch writes entries unconditionally (EncodeResult::kAlways) for tables the
// host patches without a result (DeviceKvCache::copy_exact_block_tables).
#pragma once

#include <cstdint>

#include "core/cuda_status.h"

namespace certkv::cache::cuda {

// How an encode launch reports task i's outcome (results + i * the result's bytes).
enum class EncodeResult : int32_t {
  kGaacUsedBytes = 0,  // uint32: bytes used, codec::cuda::kGaacDeviceDoesNotFit: the page stays raw
  kLossyStatus = 1,    // uint8: codec::cuda::kLossyEncoded when the lossy page was written
  kAlways = 2,         // no result read: the entry is written
};

// One table entry a launch may write.
struct TablePlacement {
  int64_t entry = 0;   // index of the entry in the tables (int32 entries)
  int32_t value = 0;   // what the entry becomes (the encoded page's index in its pool)
  int32_t result = 0;  // index of the task's result (not read for kAlways)
};
static_assert(sizeof(TablePlacement) == 16, "TablePlacement is uploaded as bytes");

struct PlaceEncodedArgs {
  int32_t* tables = nullptr;                   // device: the tables the placements index
  int64_t n_entries = 0;                       // entries of tables: one past them is never written
  const TablePlacement* placements = nullptr;  // device: [n]
  int n = 0;
  EncodeResult kind = EncodeResult::kAlways;
  const uint8_t* results = nullptr;  // device: the encode launch's results (kAlways: unread, may be null)
  int64_t n_results = 0;             // results: a placement naming one past them leaves its entry as it is
};

// The checks of place_encoded_pages alone (no launch): kInvalidArgument for n < 0, a kind
// outside EncodeResult, or a null array that n > 0 needs.
CudaStatus check_place_encoded_pages(const PlaceEncodedArgs& args);
// Asynchronous on `stream` (a cudaStream_t; null: the default stream), ordered after the encode
// launch that wrote the results when enqueued after it on the same stream. n = 0 launches
// nothing. kInternal when the launch fails.
CudaStatus place_encoded_pages(const PlaceEncodedArgs& args, void* stream);

// Table rows gathered: dst[j * row_entries + e] = tables[rows[j] * row_entries + e] for every
// e < row_entries; a row outside [0, n_table_rows) leaves its dst row as it is.
struct CopyTableRowsArgs {
  const int32_t* tables = nullptr;  // device: [n_table_rows][row_entries]
  int64_t n_table_rows = 0;
  int64_t row_entries = 0;
  const int32_t* rows = nullptr;    // device: [n]
  int n = 0;
  int32_t* dst = nullptr;           // device: [n][row_entries]
};
// kInvalidArgument (no launch) for n < 0, row_entries < 0 or a null array n > 0 needs; n = 0
// launches nothing; asynchronous on `stream`; kInternal when the launch fails.
CudaStatus copy_table_rows(const CopyTableRowsArgs& args, void* stream);

}  // namespace certkv::cache::cuda
