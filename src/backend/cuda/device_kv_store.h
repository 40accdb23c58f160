// A KV store's pages on a CUDA device (the C API's certkv_kv_store with device "cuda"): the K and
// V rows a front end computes itself (a PyTorch model on the GPU) kept in certkv's device pages,
// and certkv's decode attention over them with the meter, without a model.
//
// One cache::cuda::DeviceKvCache per layer (a GAAC scheme without a calibration calibrates each
// layer on its first append, as the host store does: on its first 8,192 rows at most, which come
// to the host),
// its pages keyed as layer l of a whole model (DeviceKvCacheConfig::first_model_layer: dither8's
// dither). Each layer maps the store's sequence i to a slot of its cache (slot i at create; a crop
// or select gives a sequence a new slot). An append of several sequences'
// rows is one write_rows launch; a decode step of several sequences is one paged-decode launch
// (attention/cuda/paged_decode_cuda.h) with the split fixed per sequence (kSplitBlocks), so a
// sequence's output does not depend on the others in the call.
//
// Nothing waits for the device except: a GAAC layer's first append without a calibration (its
// rows come to the host); the reconcile of a layer's deferred encode results, at the layer's next
// append (the copy it waits for was enqueued a whole step earlier); the store's staging ring
// when it wraps; drain(). Each decode step takes one record of a ring of page-locked staging
// (its sequences' lengths and table rows go up, its meters come down) and the same record of a
// device ring; when the ring is full the store waits for the stream once, records the meters
// into the telemetry and starts over.
//
// Every call runs on the CUDA device current at create (made current for the call, the caller's
// restored after) and enqueues on the store's stream; the pointers it is given must be memory of
// that device (kInvalidArgument otherwise, before any launch). Every layer's cache is made at
// create, except a GAAC scheme's without calibrations (each at its layer's first append).
// Block tables: max_tokens / block_tokens entries per (sequence, K/V, KV head) of every layer.
//
// Sparse decode (DeviceKvStoreConfig::sparse; bf16 pages, the schemes the table marks
// cuda_sparse): the layers from sparse.dense_layers on keep a key index per sequence on the device
// beside its pages (DeviceKvCacheConfig::index_record_bytes), by the C API's CPU store's rule
// (api/kv_store_sparse.h): the indexed prefix cache::store_indexed_tokens of the context; the
// centroids set at a sequence's first sparse step, c_k the mean of its keys, c_q the mean of the
// queries noted before (note_queries: a prompt's) over each KV head's group, or of that step's
// query when none were (it comes to the host for it); records built on
// the device (attention/cuda/key_index_cuda.h); a crop keeps the records of the prefix it keeps, a
// select copies them. The record lists of a layer share one stride (the kernels' layout): it
// starts at 512 records and doubles to the longest indexed prefix of the layer, every sequence's
// list reserving that many (a store holding one long sequence among short ones reserves the long
// one's records for each). A step of a sequence with records is one sparse_decode launch
// (attention/cuda/sparse_decode_cuda.h) with the split fixed per sequence (kSplitChunks); a
// sequence without records yet is attended exactly (in the same launch, nothing indexed). An index
// update waits for the stream (once per key_index_batch tokens of a sequence, and at its first
// sparse step) and fails the step (kInvalidArgument) when a key is not finite.
// Thread safety: one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "cache/kv_cache.h"
#include "cache/kv_scheme.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
#include "gate/telemetry.h"

namespace certkv::backend::cuda {

struct DeviceKvStoreConfig {
  // Every layer's cache as the host store describes it (n_layers 1; max_tokens the capacity over
  // the sequences; its gaac_calibration and first_model_layer are set per layer here). REQUIRES:
  // a scheme the table marks cuda_route.
  cache::KvCacheConfig layer;
  int n_layers = 0;
  int n_heads = 0;
  int n_sequences = 1;
  // GAAC schemes: the calibration of each layer (one layer each, as the host store keeps them),
  // or empty: each layer calibrated on its first append through calibrate_layer.
  std::vector<std::shared_ptr<const codec::GaacCalibration>> calibrations;
  float sm_scale = 0.f;
  double delta_loc = 1e-8;  // Tier B failure probability per (layer, head, step)
  // Sparse decode (enabled): REQUIRES a scheme the table marks cuda_sparse, window_tokens >= 0,
  // 0 <= dense_layers <= n_layers, max_tokens below 2^24.
  SparseConfig sparse;
  void* stream = nullptr;   // cudaStream_t; null: the legacy default stream
};

// A layer's calibration from its first append's rows, on the host: k, v [n][n_kv_heads][head_dim].
using LayerCalibrator =
    std::function<std::shared_ptr<const codec::GaacCalibration>(const float* k, const float* v, int64_t n)>;

// What the store's pages take on the device, over every layer.
struct DeviceKvStoreStats {
  int64_t tokens_layer0 = 0;       // positions of layer 0 over the sequences
  uint64_t bytes_reserved = 0;     // pools, tables and staging
  uint64_t bytes_in_use = 0;       // pages in use and tables
  uint64_t raw_bytes_in_use = 0;   // raw pages (bf16; the tails and pages kept exact)
  uint64_t coded_bytes_in_use = 0; // GAAC slots and lossy pages
  int64_t raw_pages_in_use = 0;
  int64_t coded_pages_in_use = 0;
  int64_t pages_kept_exact = 0;    // lossy blocks the encoder refused (stored exact)
  uint64_t kv_bytes_bf16 = 0;      // the same positions as a contiguous bf16 cache
};

// The sparse counters of a store (DeviceKvStore::sparse_stats) and its key indexes.
struct DeviceSparseStats {
  // As the C API's CPU store counts them: steps are (sequence, layer) decode steps of a sparse
  // layer with records; dense_cells the cells of the others (dense layers, no records yet).
  SparseStats counters;
  int64_t indexed_tokens = 0;  // over the (sparse layer, sequence) pairs, per KV head
  uint64_t index_bytes = 0;    // the records of the indexed tokens, the centroids set, the rotation
};

class DeviceKvStore {
 public:
  virtual ~DeviceKvStore() = default;
  // Rows of seqs[i] (distinct, in range): n_tokens[i] >= 1 rows each, concatenated in k and v
  // (device memory, [sum n_tokens][n_kv_heads][head_dim] float). Throws certkv::Error:
  // kOutOfMemory when the layer's capacity would be passed (nothing appended); a failed launch or
  // allocation leaves the layer refusing until the store is freed (kInternal).
  virtual void append(int layer, std::span<const int32_t> seqs, std::span<const int64_t> n_tokens, const float* k,
                      const float* v) = 0;
  // One decode step of seqs (distinct, each holding >= 1 position of the layer): q, out device
  // [n][n_heads][head_dim] float; meters device [n][n_heads] float or null.
  virtual void attend(int layer, std::span<const int32_t> seqs, const float* q, float* out, float* meters) = 0;
  // A prompt's queries, for the query centroid of a sparse layer (the C API's CPU store notes those
  // of the prefills it attends): rows of seqs[i] (distinct, in range), n_tokens[i] >= 1 each,
  // concatenated in q (device memory, [sum n_tokens][n_heads][head_dim] float). Each sequence
  // whose centroids are not set yet adds them to its sums (index::rabitq_add_query_sums, on the
  // device); its first sparse step then takes c_q = sums / rows instead of that step's query.
  // Nothing for a dense layer or a sequence whose centroids are set. Waits for the stream.
  virtual void note_queries(int layer, std::span<const int32_t> seqs, std::span<const int64_t> n_tokens,
                            const float* q) = 0;
  // Planned decode steps, which a stream capture can hold (a CUDA graph of a model's decode step):
  // - plan: the next `steps` positions of each of seqs (distinct, in range, each holding >= 1
  //   position of every layer) get their pages in every layer, and the steps' state goes to the
  //   device (positions, table rows, meter buffers, a workspace for the longest context the plan
  //   reaches, rounded up to an eighth of the power of two above it). Waits for the stream. Returns true when a graph
  //   captured under the previous plan would read memory this plan moved or sized otherwise
  //   (capture again), false when such a graph stays valid.
  // - append_planned: one row of each planned sequence (plan order) for `layer`, k, v device
  //   [n][n_kv_heads][head_dim] float, at the position the device holds for it (advanced there).
  // - attend_planned: decode attention of the planned sequences after that layer's append; q, out
  //   device [n][n_heads][head_dim] float, meters device [n][n_heads] float or null.
  //   Both launch kernels only, on `stream` (null: the store's): no copy from the host, no wait,
  //   no allocation. A row past the planned steps is not written (finish_planned fails).
  // - finish_planned: waits for `stream` and the store's, then takes the rows the steps wrote as
  //   appended (per layer and sequence), encodes the blocks they completed (until then read exact,
  //   from their raw pages, and metered as such), records the meters of every planned step
  //   attended, and gives back the pages no row reached. Throws kOutOfRange when a replay ran past
  //   the plan (after taking what was written).
  // While a plan is open the store refuses append, attend, note_queries, crop and select
  // (kInvalidArgument). kUnsupported for a store with sparse decode.
  virtual bool plan(std::span<const int32_t> seqs, int64_t steps) = 0;
  virtual void append_planned(int layer, const float* k, const float* v, void* stream) = 0;
  virtual void attend_planned(int layer, const float* q, float* out, float* meters, void* stream) = 0;
  virtual void finish_planned(void* stream) = 0;
  virtual bool planned() const = 0;  // a plan is open
  virtual int64_t length(int seq, int layer) const = 0;
  // K (kv 0) or V (kv 1) of (seq, layer) at positions [begin, end) as attention reads them (a
  // lossy page's reconstruction), decoded on the host: out [n_kv_heads][end - begin][head_dim]
  // float. Waits for the stream.
  virtual void read(int seq, int layer, int kv, int64_t begin, int64_t end, float* out) = 0;
  // Keeps the first n_tokens positions of seq in every layer (REQUIRES: at most every layer's
  // length). Throws certkv::Error kUnsupported, the store unchanged, when n_tokens ends inside a
  // block some layer keeps as a lossy page (the device keeps no exact values of it).
  virtual void crop(int seq, int64_t n_tokens) = 0;
  // The store holds src.size() sequences from here on, sequence i what sequence src[i] was
  // (REQUIRES: each in range): whole blocks shared by reference count, a partial last block's
  // raw pages copied on the device. A refusal or an allocation that fails leaves the store as it
  // was; a failed copy or launch leaves that layer's cache refusing (make a new store).
  virtual void select(std::span<const int32_t> src) = 0;
  virtual int n_sequences() const = 0;
  // Waits for the stream; records the meters of the decode steps not yet recorded in the
  // telemetry (lossy schemes) and fails (kCorrupt) when a launch met a corrupt page entry.
  virtual void drain() = 0;
  // Waits for the stream.
  virtual DeviceKvStoreStats stats() = 0;
  // Waits for the stream and records the sparse steps not yet recorded (as drain()).
  virtual DeviceSparseStats sparse_stats() = 0;
};

// The store records the meter of every (sequence, query head) of its decode steps in
// `telemetry` (lossy schemes), which must outlive it. Throws certkv::Error: kUnsupported in a
// build without CUDA, with no CUDA device, or for a scheme or shape the device pages do not serve
// (naming it); kOutOfMemory.
std::unique_ptr<DeviceKvStore> make_device_kv_store(const DeviceKvStoreConfig& config, LayerCalibrator calibrate_layer,
                                                    gate::Telemetry& telemetry);

}  // namespace certkv::backend::cuda
