// GAAC page encoding on a CUDA device (the device half of the codec layer): a block's pages are
// encoded where they were written, when the block is finalized, into the slots of
// docs/format/gaac.md. The output is byte for byte that of gaac_encode_page_ref (bf16) and
// gaac_encode_page_fp8_ref (e4m3, e5m2) in codec/gaac.h, over the bytes that encoder reports as
// used; slot bytes past them are not written.
//
// One warp encodes one page: the page's tag bytes (4 groups each, tile-major) are split into 32
// contiguous runs, one per lane; a lane codes its groups twice, once to count their escape bytes
// (a warp scan of the counts gives each lane its escape position and the page its total, which
// decides the fit) and once to write its fields, codes, tag bytes and escapes.
//
// Thread safety: launches go to `stream`; the caller orders them and keeps the buffers alive.
#pragma once

#include <cstdint>

#include "core/cuda_status.h"
#include "format/gaac_layout.h"

namespace certkv::codec::cuda {

// One page to encode. All pointers are device pointers; none needs any alignment.
struct GaacEncodeTask {
  // [block_tokens][head_dim] elements: bf16 (2 bytes, little-endian bits) or fp8 bytes.
  const uint8_t* src = nullptr;
  // The slot: gaac_slot_bytes(element, block_tokens, head_dim, escape_capacity) bytes.
  uint8_t* dst = nullptr;
  const uint8_t* b3 = nullptr;   // [head_dim] bases of the 3-bit mode
  const uint8_t* b4 = nullptr;   // [head_dim] bases of the 4-bit mode
  uint32_t escape_capacity = 0;  // bytes of the slot's escape area
};

// used_bytes[i] after an encode: fixed part + escape bytes written, or this when the page's
// escapes do not fit (the slot's contents are then unspecified; keep the page raw).
inline constexpr uint32_t kGaacDeviceDoesNotFit = 0xFFFFFFFFu;

// Checks the geometry (element bf16/e4m3/e5m2, block_tokens >= 1, head_dim splits into GAAC
// tiles, n_tasks >= 0, non-null arrays when n_tasks > 0): kInvalidArgument naming what is wrong;
// kUnsupported for a page whose byte counts do not fit in 32 bits. Never launches.
CudaStatus check_gaac_encode(format::GaacElement element, int block_tokens, int head_dim,
                             int n_tasks, const void* tasks, const void* used_bytes);

// Encodes n_tasks pages of one shape, asynchronously on `stream` (a cudaStream_t; null = the
// default stream). tasks: [n_tasks] and used_bytes: [n_tasks] are device arrays.
// REQUIRES (not checked on the host; the device reads what it is given): every task's pointers
// valid for the sizes above, its bases within the windows of gaac.h (b3[c] + 8 and b4[c] + 16 at
// most 2^exponent_bits), its src and dst not overlapping another task's dst.
// check_gaac_encode's refusals are returned as they are (nothing launched); n_tasks = 0 launches
// nothing and succeeds; a launch failure is kInternal with cudaGetErrorString.
CudaStatus gaac_encode_pages(format::GaacElement element, int block_tokens, int head_dim,
                             const GaacEncodeTask* tasks, int n_tasks, uint32_t* used_bytes,
                             void* stream);

// GAAC pages in the device layout (PageFormat::kGaacFragments, codec/gaac_fragments.h), one warp
// a page: byte for byte gaac_fragment_encode_page_ref's page (its exceptions in element order),
// from a raw page stored fragment-major (format::fragment::element_index order of the K map when
// `key`, else the V map) and the window bases b4; b3 and escape_capacity are not read. used_bytes:
// format::fragment::gaac_page_bytes(head_dim), or kGaacDeviceDoesNotFit for a page the encoder
// keeps exact (too many exceptions, or one with no built value; the page's bytes are then
// unspecified). head_dim 64 or 128 (kInvalidArgument otherwise), the rest as gaac_encode_pages.
CudaStatus gaac_fragment_encode_pages(int head_dim, bool key, const GaacEncodeTask* tasks, int n_tasks,
                                      uint32_t* used_bytes, void* stream);

}  // namespace certkv::codec::cuda
