// The CUDA backend: many sequences over one device page pool (cache/cuda/device_kv_cache.h),
// the whole model on the device. The forward pass (backend/cuda/device_forward.h: weights
// uploaded once, fp32-accurate products through cuBLAS, the norms, RoPE, SwiGLU and residuals)
// hands each layer's K/V rows to the device cache, which rounds and stores them (one launch for
// the step's sequences) and encodes a block on the device when it fills (GAAC device pages, GAAC
// slots for gaac-e5m2, lossy pages with their witness). Attention runs on the device for every row of a step, prefill and decode
// alike, in one paged-decode launch per layer and row class (attention/cuda/paged_decode_cuda.h):
// a prefill row is a query over its sequence's tables with its own length, so a chunk's rows
// attend causally. The page format is attention::cuda::page_format_of(kv_scheme), which follows
// the scheme table (dither8 and gaac: fragment-major pages, kDither8Fragments and kGaacFragments;
// these and bf16's token-major pages on the bulk-copy kernel, whose split counters the backend
// zeroes when the workspace layout changes). The decode rows of
// the metered schemes get the meter from the same pass, and their telemetry. A step runs without waiting for the device until its end, where the logits
// the items ask for, the error words, meters and sparse counts come back together. By default
// (BackendConfig::defer_encode_results) the device places the encoded pages of the blocks a write
// completes in its tables, and the encode results come back with the rest, the host's tables
// catching up after the step's wait; without it, a layer whose write completes a block waits for
// the block's encode result.
//
// Batch invariance: the split of the KV is fixed per sequence (kSplitBlocks blocks per split),
// never planned from the batch; a row's result therefore depends on its own length and pages
// only. Prefix sharing: whole blocks are shared, ref-counted, in every page class.
//
// Sparse decode (BackendConfig::sparse, the CPU backend's rule for what is indexed when): each
// slot's key index lives on the device beside its pages (DeviceLayerView::index_records), built
// there from the stored keys (attention/cuda/key_index_cuda.h: the centroids, then the records,
// one launch of each per sparse layer for every sequence that ended an input); the decode rows of
// the sparse sequences are quantized on the device and attend through one sparse_decode launch
// per sparse layer for all of them (a fixed kSplitChunks per split: batch invariant), prefill rows
// stay dense. A forked sequence builds its own index (records depend on its own centroids).
//
// Served: the schemes of the scheme table with cuda_route (bf16, gaac, gaac-e5m2, fp8-e4m3,
// fp8-e5m2, dither8), block_tokens 16, head_dim 64 or 128, at most 8 query heads per KV head;
// sparse decode over the schemes with cuda_sparse (bf16), contexts below 2^24 tokens.
// Not yet: the gate and the lossy schemes' full-precision recent window (a session's
// one-sequence device route serves the gate: CpuBackend with device cuda), swapping.
// Thread safety: used by one thread at a time.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace certkv::backend {

// Blocks per split of the device attention (PagedDecodeParams::split_blocks): 32 blocks of 16
// tokens. Fixed, so that a sequence's logits never depend on the batch beside it.
inline constexpr int64_t kSplitBlocks = 32;
// Chunks of 1,024 tokens per split of sparse decode (SparseDecodeParams::split_chunks), fixed
// for the same reason.
inline constexpr int64_t kSplitChunks = 4;

// Throws certkv::Error: kUnsupported for what the backend does not serve (naming the scheme or
// the feature and the backend), in a build without CUDA, or with no CUDA device; the errors of
// check_backend_config; kOutOfMemory when the device cannot hold the pool.
std::unique_ptr<Backend> make_cuda_backend(const model::Model& model, const BackendConfig& config);

}  // namespace certkv::backend
