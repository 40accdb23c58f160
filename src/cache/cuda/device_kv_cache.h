// The KV cache of one sequence on a CUDA device, filled then finalized as the host cache is
// (cache/kv_cache.h; DESIGN.md section 2): rows arrive as floats from the forward pass, are
// rounded on the device exactly as KvCache::write rounds them (bf16, then the scheme's FP8 for
// gaac-e5m2) into the raw tail page of their (layer, K/V, kv_head), and the write that completes
// a block encodes it on the device (codec/cuda/gaac_encode_cuda.h) into a GAAC slot when its
// escapes fit, its raw page then returning to the free list; a block that does not fit stays
// raw. The decode kernels read the pools through block tables (DeviceLayerView).
//
// Schemes: bf16 (every page raw), gaac (GAAC slots over bf16), gaac-e5m2 (GAAC slots over FP8
// E5M2, values rounded to bf16 then E5M2 at write). Pools grow by doubling (a device-to-device
// copy); tables have a fixed width of ceil(max_tokens / block_tokens) blocks.
//
// Table entries (int32, per (layer, K/V, kv_head), block order): for bf16 the raw page index;
// for the GAAC schemes a slot index s >= 0 of the (layer, K/V) slot pool, or -r - 1 for raw
// page r of the layer's raw pool (tails and blocks that did not fit).
//
// Thread safety: one owner, one CUDA device (the current one at create(); calls from a thread
// whose current device is another are not supported). Calls are ordered on the cache's stream;
// write() returns after the blocks it completes are placed (it waits for their encode results).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/cuda/device_pool.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"

namespace certkv::cache::cuda {

struct DeviceKvCacheConfig {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  int64_t max_tokens = 0;  // the sequence's capacity
  KvScheme scheme = KvScheme::kBf16;  // kBf16, kGaac or kGaacE5M2
  // GAAC schemes: the model's calibration of the scheme's element (shape as the model's).
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  void* stream = nullptr;  // cudaStream_t for every call; null: the default stream
};

// What the decode kernels read of one layer; device pointers, valid until the next write().
struct DeviceLayerView {
  const uint8_t* k_pages = nullptr;  // bf16: the raw pool; GAAC: the K slot pool
  const uint8_t* v_pages = nullptr;
  int64_t k_page_stride = 0, v_page_stride = 0;
  int64_t n_k_pages = 0, n_v_pages = 0;
  const uint8_t* raw_pages = nullptr;  // GAAC: tails and blocks that did not fit (K and V)
  int64_t raw_page_stride = 0, n_raw_pages = 0;
  const int32_t* k_table = nullptr;  // [n_kv_heads][table_stride]
  const int32_t* v_table = nullptr;
  int64_t table_stride = 0;
  const int32_t* length = nullptr;  // [1]: tokens written to this layer
  int64_t host_length = 0;          // the same, on the host
  const uint8_t* gaac_bases = nullptr;  // [2 (K, V)][n_kv_heads][2 (b3, b4)][head_dim]
  int64_t k_escape_capacity = 0, v_escape_capacity = 0;
};

// One page as stored (tests, diagnostics).
struct DevicePageBytes {
  bool gaac_slot = false;      // a GAAC slot (else a raw page)
  std::vector<uint8_t> bytes;  // the slot's used bytes (fixed part + escapes) or the raw page
};

struct DeviceKvStats {
  int64_t slots_in_use = 0;       // GAAC slots holding a block
  int64_t raw_pages_in_use = 0;   // tails, bf16 pages and blocks that did not fit
  int64_t blocks_not_fitting = 0; // GAAC blocks kept raw since the last reset
  uint64_t bytes_in_use = 0;      // pages in use times their stride, plus the tables
  uint64_t bytes_reserved = 0;    // device memory held by pools, tables and staging
};

class DeviceKvCache {
 public:
  // kUnsupported for a scheme other than bf16 / gaac / gaac-e5m2 or a shape the GAAC codec
  // cannot tile; kInvalidArgument for a missing or mismatched calibration; kOutOfMemory.
  static CudaStatus create(const DeviceKvCacheConfig& config, std::unique_ptr<DeviceKvCache>* out);
  ~DeviceKvCache();

  // Appends positions [written(layer), written(layer) + n) of `layer`: k, v host floats
  // [n][n_kv_heads][head_dim]. kOutOfRange (nothing written) for a layer outside the model or
  // past max_tokens. Any other failure (out of device memory, a failed copy or launch) leaves
  // the cache refusing every write with kInternal until reset().
  CudaStatus write(int layer, const float* k, const float* v, int64_t n);
  // Drops every token of every layer (pages back to the free lists; pools keep their memory) and
  // clears a failed state. Synchronizes the stream.
  CudaStatus reset();

  int64_t written(int layer) const { return written_[size_t(layer)]; }
  DeviceLayerView view(int layer) const;
  const DeviceKvCacheConfig& config() const { return config_; }
  DeviceKvStats stats() const;
  // The page of (layer, K/V, kv_head, block) as stored; synchronizes the stream.
  CudaStatus read_page(int layer, KvTensor kv, int kv_head, int64_t block, DevicePageBytes* out) const;

 private:
  struct Layer;
  DeviceKvCache() = default;
  CudaStatus append(int layer_index, int64_t first, const float* k, const float* v, int64_t n);
  CudaStatus finalize(int layer_index, int64_t block_begin, int64_t block_end);
  CudaStatus upload_tables(const Layer& layer);

  DeviceKvCacheConfig config_;
  int64_t table_stride_ = 0;
  size_t raw_bytes_ = 0;  // bytes of a raw page
  std::vector<int64_t> written_;
  std::vector<std::unique_ptr<Layer>> layers_;
  DeviceBuffer staging_;        // rows of one write
  DeviceBuffer encode_buffer_;  // encode tasks and their results
  DeviceBuffer lengths_;  // [n_layers] int32
  int64_t blocks_not_fitting_ = 0;
  bool broken_ = false;  // a write or reset failed halfway
  std::string broken_reason_;
};

}  // namespace certkv::cache::cuda
