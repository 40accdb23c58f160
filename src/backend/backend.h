// The backend interface (DESIGN.md section 1): what the engine asks of the machine that runs the
// model. A backend owns the page pool of every sequence it serves and runs one batched forward
// step at a time over any mix of sequences, each adding one token (decode) or a chunk of its
// prompt (prefill); the engine never asks which backend it talks to.
//
// Contract of forward(): every sequence's rows are computed as if it ran alone. A weight product
// reads the weights once for all rows of the step, and each row's result depends on that row only;
// attention reads one sequence's pages. So a sequence's logits do not depend on which other
// sequences share its steps or where it sits in the batch (batch invariance), and, for the
// lossless schemes, not on how its prompt was cut into chunks either.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "gate/telemetry.h"
#include "gate/recent_step_meters.h"
#include "index/rotation.h"
#include "model/model.h"
#include "model/device_decode.h"
#include "model/matmul_float.h"
#include "model/sampler.h"

namespace certkv::backend {

// The meter and the gate (DESIGN.md section 4) on the decode steps of a lossy kv_scheme: every
// step (a forward of one token) computes the meter of each (layer, query head) in the attention
// pass and records it in its sequence's telemetry. Prefill chunks of several tokens are not
// metered; run a text with prefill_chunk_tokens = 1 to meter every position.
struct MeterConfig {
  bool enabled = true;
  // Request-level failure budget of the Tier B certificate (dither8), split evenly over
  // layers x query heads x planned_steps: delta_loc = delta_req / (L H T). REQUIRES: in (0, 1).
  double delta_req = 1e-2;
  int64_t planned_steps = 0;  // T; 0: the context length
  // Coverage threshold of the telemetry and the gate's threshold: tau < 1 certifies; tau >= 1
  // ranks risk (a meter above 1 is never reported, so only raw scores could exceed it).
  // REQUIRES: tau > 0.
  double tau = 0.2;
  // Repair when the meter of a (layer, head) exceeds tau: exact blocks are paged in from the
  // backing store in decreasing order of their share of A - 1 until the meter is at most tau.
  bool gate = false;
  int64_t sample_every = 1;  // telemetry records every k-th cell
  // The last recent_steps forward steps that metered a decode row are kept, per (layer, query
  // head) the largest meter over the step's sequences (gate/recent_step_meters.h; live views).
  // REQUIRES: 0 <= recent_steps <= kMaxRecentMeterSteps; 0: none kept.
  int recent_steps = 0;
};
inline constexpr int kMaxRecentMeterSteps = 4096;

// Called after the attention of every metered step and layer (for audits): q: [n_heads][head_dim]
// post-RoPE queries; meters: [n_heads] as reported before any repair; n_ctx tokens attended.
struct MeterObservation {
  int layer;
  int64_t step;  // position of the query token
  const float* q;
  int64_t n_ctx;
  const attention::HeadMeter* meters;
};
using MeterObserver = std::function<void(const MeterObservation&)>;

// The sparse tier (DESIGN.md section 5): decode steps of layers >= dense_layers attend the Top-p
// selection of the key index plus the local window (attention/sparse_decode.h). Each sequence has
// its own index: the end of its first prefill sets each (layer, kv_head)'s centroids (the mean of
// its keys and of its group's queries) and indexes every whole block before the window;
// afterwards, once whole blocks amounting to at least the window lie before it, they are indexed
// in one batch (lazy update), so between window_tokens and about twice that many newest tokens
// are attended exactly. A sequence that shares a prefix with another builds its own index (the
// records of shared blocks are rebuilt, not shared).
struct SparseConfig {
  bool enabled = false;
  double p = 0.9;           // Top-p mass, in (0, 1]
  // The Top-p set widened by this many estimator deviations per token
  // (attention::SparseDecodeOptions::deviations); finite, >= 0; 0: no widening.
  double deviations = 0;
  // REQUIRES: 0 <= window_tokens <= the context; -1: 128, or the context when it is shorter.
  int window_tokens = -1;
  int dense_layers = 2;     // REQUIRES: 0 <= dense_layers <= n_layers
  index::RotationKind rotation = index::RotationKind::kHaar;
  uint64_t seed = 0x5eed0002;  // of the rotation and of the queries' randomized rounding
};

// Sparse decode counters of one sequence. A cell is one (layer, query head, step) of a sparse
// layer; budget = attended / context tokens.
struct SparseStats {
  int64_t steps = 0;            // decode steps with at least one sparse layer
  int64_t cells = 0;
  double sum_budget = 0;        // over sparse cells
  // Cells that scored indexed tokens, and the sum over them of the estimated softmax mass of
  // the Top-p selection within the indexed tokens (attention::SparseHeadStats::estimated_mass).
  int64_t indexed_cells = 0;
  double sum_estimated_mass = 0;
  int64_t attended_tokens = 0;  // over sparse cells
  int64_t widened_tokens = 0;   // of them, added by the widening (SparseConfig::deviations)
  int64_t context_tokens = 0;   // over sparse cells
  int64_t dense_cells = 0;      // cells of the dense layers (budget 1) in the same steps
  std::vector<int64_t> layer_cells;      // [n_layers]
  std::vector<double> layer_sum_budget;  // [n_layers]
  double index_build_seconds = 0;  // centroids and records, prefill and lazy updates
  int64_t index_appended_tokens = 0;  // token x (layer, kv_head) records written, / heads
};

// Called after the attention of every sparse (step, layer), for audits: per query head the
// attended indices and the estimated logits of the indexed prefix [0, n_indexed).
struct SparseObservation {
  int layer;
  int64_t step;
  const float* q;  // [n_heads][head_dim], post-RoPE
  int64_t n_ctx;
  int64_t n_indexed;
  const std::vector<std::vector<int32_t>>* attended;
  const std::vector<std::vector<float>>* estimated_logits;
  const std::vector<float>* query_norms;  // [n_heads]: ||q - c_q|| of each quantized query
};
using SparseObserver = std::function<void(const SparseObservation&)>;

struct BackendConfig {
  int64_t context_tokens = 0;  // the most tokens of one sequence; 0: the model's context length
  // Capacity of the page pool shared by every sequence, in tokens of every (layer, K/V, kv_head)
  // table (a sequence's partial tail block takes a whole page); 0: context_tokens.
  // REQUIRES: 0, or at least context_tokens (one sequence must fit).
  int64_t pool_tokens = 0;
  // Capacity of the page pool in bytes of pages, each class at its own page size (the CUDA
  // backend): a sequence is charged what its tables will hold, its whole blocks at the scheme's
  // coded page bytes and a partial tail block at the raw page bytes, so that a compressed scheme
  // holds more tokens in the same memory (the equal-memory comparison). The pages in use are
  // counted as they are on the device (a block a GAAC slot could not hold stays raw, and costs
  // so). 0: pool_tokens bounds the pool. REQUIRES: 0 or, with pool_tokens 0, at least one
  // sequence of the context; the CPU backend takes 0 only.
  uint64_t pool_bytes = 0;
  int n_threads = 2;
  int block_tokens = 16;       // tokens per KV page
  int prefill_chunk_tokens = 512;  // a session's prefill runs in chunks of this many tokens
  bool capture_queries = false;    // keep the post-RoPE queries of each sequence's last position
  // The CPU backend's weight products (the cuda backend's are fp32-accurate whatever this says:
  // backend/cuda/device_matmul.h).
  model::ActivationFormat activations = model::ActivationFormat::kInt8;
  cache::KvScheme kv_scheme = cache::KvScheme::kBf16;  // how the KV cache stores full blocks
  // REQUIRED for the GAAC kv_schemes (kGaac, kGaacE4M3, kGaacE5M2): the model's calibration
  // (codec::GaacCalibration::load) of the scheme's element, shared by every sequence of the
  // model; its shape must match the model and block_tokens.
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  // Lossy kv_schemes: dither8's outlier RoPE pairs per (layer, kv_head) and the full-precision
  // recent window (-1: the scheme's defaults, cache::KvCacheConfig).
  int outlier_pairs = -1;
  int recent_window_tokens = -1;
  // dither8: the outlier pairs fixed for the model ([n_layers][n_kv_heads][m] pair indices,
  // cache::KvCacheConfig::fixed_outlier_pairs), so that a page depends on its block alone and
  // dither8 is batch invariant; the engine fixes them from the built-in calibration text
  // (engine/outlier_pair_calibration.h). Null: chosen from the first rows the pool holds.
  std::shared_ptr<const std::vector<uint16_t>> outlier_pair_table;
  // Tier A lossy kv_schemes: how K pages store the meter's witness (cache::KvCacheConfig).
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  MeterConfig meter;
  SparseConfig sparse;
  // kCuda: attention runs on a CUDA device. make_backend gives the CUDA backend
  // (backend/cuda/cuda_backend.h: many sequences over one device page pool); a CpuBackend (and so
  // a Session) given kCuda keeps the one-sequence device route of model/device_decode.h, which
  // also serves sparse decode and the gate on the device.
  model::Device device = model::Device::kCpu;
  // The CUDA backend, GAAC and lossy schemes: the encode results of the blocks a step completes
  // come back once, after the step's wait (cache::cuda::DeviceKvCacheConfig::defer_encode_results);
  // false: a wait in every layer whose write completes a block (0.80-0.88x the step time on an
  // H100 when the sequences complete blocks on different steps, docs/cuda.md). Ignored elsewhere.
  bool defer_encode_results = true;
};

// One sequence's part of a forward step: tokens[0, n) at positions [length, length + n).
struct BatchItem {
  cache::SeqId seq = 0;
  const int32_t* tokens = nullptr;  // [n]
  int64_t n = 0;
  float* last_logits = nullptr;     // [n_vocab] of the last token, or null
  float* all_logits = nullptr;      // [n][n_vocab], or null
  // The last chunk of a prefill, or a decode step: the sparse tier's key index is updated after
  // it (the first one builds the index from the whole prefill).
  bool end_of_input = true;
  // Sampling in the step: with `token` set, the backend draws the next token from the last row's
  // logits, model::sample_token(logits, sampling, sample_uniform(sampling.seed, draw)), and writes
  // it there, whether or not last_logits is set (the CUDA backend samples on the device and
  // brings back only the token).
  int32_t* token = nullptr;
  model::SamplerParams sampling{};  // checked (model::check_sampler_params) when token is set
  uint64_t draw = 0;
};

// What one sequence's attention measured since it began: the meter over its decode steps, the
// gate's repairs and sparse decode's budget.
struct SequenceReport {
  bool metered = false;
  double meter_max = 0;
  double meter_p99 = 0;
  double coverage = 0;       // fraction of cells with meter <= tau (1 with no cell)
  int64_t meter_cells = 0;
  int64_t gate_repairs = 0;  // pages paged in
  bool sparse = false;
  double sparse_budget = 1;  // mean over sparse cells (1 with none)
  // Mean over sparse cells that scored indexed tokens of the estimated mass of their Top-p
  // selection (>= p; 0 with no such cell), and those cells (report_sparse).
  double sparse_estimated_mass = 0;
  int64_t sparse_indexed_cells = 0;
  // Metered: the same, per layer (every sample_every-th cell of the layer).
  struct LayerMeter {
    double meter_max = 0;
    double meter_p99 = 0;
    double coverage = 1;
    int64_t cells = 0;
    int64_t gate_repairs = 0;
  };
  std::vector<LayerMeter> layers;
};

// A sequence swapped out of a backend to host memory (Backend::swap_out): its pages
// (cache::SwappedKv, GAAC-coded where the cache can) and the backend's per-sequence state (the
// sparse tier's key index, telemetry, the last queries, observers), to be swapped back into the
// same backend bit for bit. Owned by the caller.
class SwappedSequence {
 public:
  virtual ~SwappedSequence() = default;
  virtual const cache::SwappedKv& kv() const = 0;
  // Host bytes of the per-sequence state beside the pages (the key index's records).
  virtual uint64_t state_bytes() const = 0;
};

// Host wall-clock seconds of a backend's forward steps so far, by phase: where a step's time goes
// when it is short (a backend that does not keep them leaves every field zero).
struct StepTimes {
  int64_t steps = 0;              // forward() calls that ran rows
  double plan_seconds = 0;        // checks, reservations, row groups, the step's host staging
  double enqueue_seconds = 0;     // the forward pass's launches (graph replays, eager kernels), attention's excluded
  double attention_seconds = 0;   // the host side of every layer's K/V writes and attention launches
  double wait_seconds = 0;        // waiting for the device at the step's end
  double read_back_seconds = 0;   // after the wait: logits, tokens, meters, index updates
  // The meters' bookkeeping into each sequence's telemetry: the cuda backend does it for a step
  // while the next step's launches run on the device (inside enqueue_seconds then), or when a
  // report needs it first.
  double meter_seconds = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual const BackendConfig& config() const = 0;
  virtual int64_t context_tokens() const = 0;

  // Sequences. Every function taking a SeqId throws certkv::Error kNotFound for one not live.
  virtual cache::SeqId create_sequence() = 0;
  // A new sequence holding the parent's first n_tokens positions (whole blocks), shared.
  virtual cache::SeqId fork_prefix(cache::SeqId parent, int64_t n_tokens) = 0;
  virtual void free_sequence(cache::SeqId seq) = 0;
  virtual int64_t length(cache::SeqId seq) const = 0;
  // Takes the pages for n more tokens of the sequence; false, with nothing changed, when the pool
  // cannot supply them. Calling again before the step that writes them is a no-op.
  virtual bool reserve(cache::SeqId seq, int64_t n) = 0;
  // Swap to host memory: the sequence's committed pages and its state leave the backend (seq is
  // no longer live; pages it shared with other sequences stay theirs). kUnsupported where the
  // backend cannot (the device route).
  virtual std::unique_ptr<SwappedSequence> swap_out(cache::SeqId seq) = 0;
  // A new live sequence continuing exactly where the swapped one stopped; *swapped is consumed
  // (null) on success. Throws kOutOfMemory, with nothing changed, when the pool cannot supply
  // (*swapped)->kv().pages() pages; kInvalidArgument for one swapped out of another backend.
  virtual cache::SeqId swap_in(std::unique_ptr<SwappedSequence>& swapped) = 0;
  // Whether swap_out and swap_in work here (where not, the engine preempts by recompute).
  virtual bool can_swap() const = 0;
  // Pages of the pool in use and its capacity, over every table (all classes).
  virtual uint64_t pool_pages_in_use() const = 0;
  virtual uint64_t pool_capacity_pages() const = 0;
  // Pages of pool_pages_in_use() that these live sequences hold: every page their tables
  // reference, a page shared among them counted once (and pages reserved for tokens not written
  // yet where pool_pages_in_use counts those). The rest of pool_pages_in_use is held by other
  // sequences alone.
  virtual uint64_t pages_referenced(std::span<const cache::SeqId> seqs) const = 0;

  // One batched step. REQUIRES: distinct live sequences, 1 <= n, tokens inside the vocabulary,
  // length + n <= context_tokens (certkv::Error kInvalidArgument / kOutOfRange, nothing changed);
  // kOutOfMemory, nothing changed, when a reservation cannot be made (reserve first).
  virtual void forward(std::span<const BatchItem> items) = 0;

  virtual SequenceReport report(cache::SeqId seq) const = 0;
  // The sparse tier's counters of the sequence (all zero without sparse decode).
  virtual const SparseStats& sparse_stats(cache::SeqId seq) const = 0;
  // Bytes of the pages the sequence's tables reference, by class (shared pages in full).
  virtual std::vector<cache::ClassBytes> sequence_bytes(cache::SeqId seq) const = 0;
  virtual cache::MemoryStats memory_stats() const = 0;
  // The meter of the recent metered decode steps over every sequence (MeterConfig::recent_steps;
  // empty when not metered). Every forward() that runs rows begins a step of it.
  virtual const gate::RecentStepMeters& recent_meters() const = 0;
  // Where the steps' host time went (StepTimes); zero where the backend does not keep it.
  virtual StepTimes step_times() const { return {}; }
};

// The meter part of a SequenceReport (metered, cells, max, p99, coverage, gate repairs and the
// same per layer) from a sequence's telemetry, over all its cells and per layer.
void report_meter(const gate::SequenceTelemetry& telemetry, SequenceReport& report);

// The sparse part of a SequenceReport (mean budget, indexed cells, mean estimated mass) from a
// sequence's sparse counters; `enabled` is the backend's SparseConfig::enabled.
void report_sparse(bool enabled, const SparseStats& stats, SequenceReport& report);

// What every backend checks of its configuration before it takes any memory, and what follows
// from it. Throws certkv::Error kInvalidArgument naming the field: a negative context, a pool
// that cannot hold one sequence of the context, threads outside [1, 256], block_tokens outside
// [1, 4096], a prefill chunk below 1, a gaac scheme without a calibration, outlier pairs past
// head_dim / 2, meter parameters out of range, the gate without a lossy scheme or the meter; with
// sparse decode, p outside (0, 1], deviations negative or not finite (or without sparse decode),
// a window outside [0, the context], dense layers outside [0, n_layers] (kInvalidArgument), a
// model that does not state its RoPE, a head_dim the key index does not cover, the gate
// (kUnsupported).
struct CheckedConfig {
  int64_t context_tokens = 0;  // config.context_tokens, or the model's context length
  bool metered = false;        // a lossy scheme with meter.enabled
  double delta_loc = 0;        // the Tier B failure probability of one (layer, head, step) cell
  int sparse_window_tokens = 0;  // sparse.window_tokens with -1 resolved (sparse decode)
};
CheckedConfig check_backend_config(const model::Model& model, const BackendConfig& config);

// The backend for config.device: the CPU backend, or the CUDA backend. Throws certkv::Error
// kUnsupported naming the scheme (or feature) and the backend for what that backend does not
// serve (the scheme table's cuda_route), and for the CUDA backend in a build without CUDA or on a
// machine without a device.
std::unique_ptr<Backend> make_backend(const model::Model& model, const BackendConfig& config);

}  // namespace certkv::backend
