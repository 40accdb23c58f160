// Lossy page encoding on a CUDA device (the device half of the codec layer): when a block is
// finalized, its exact bf16 rows are encoded where they were written into the lossy pages that
// the device decode kernels read (docs/format/lossy_pages.md, docs/format/dither8.md). Schemes:
// fp8-e4m3 and fp8-e5m2 (raw casts with their Tier A witness, fp16, u8 or (e4m3) the codes
// themselves, or rho) and dither8 (certified INT8 with its outlier RoPE pairs). The output is byte
// for byte that of lossy_encode_page_ref (codec/lossy_page.h), and a page is refused exactly when
// that encoder returns false; dither8 pages and fp8-e4m3 pages with the exponent witness may
// instead be read and written fragment-major (LossyDeviceLayout::kFragments: the device page is
// the codec's page transcoded at finalize, in the same launch).
//
// One CTA encodes one page. fp8: a thread per element for the codes, then a thread per (token,
// band) (K) or per token (V) sums its squared residuals in the reference's order. dither8: a warp
// per (token, group of 32 channels), a lane per channel. Every floating-point step is a named
// IEEE operation (no contraction into FMA), the same operations in the same order as the
// reference.
//
// Thread safety: launches go to `stream`; the caller orders them and keeps the buffers alive.
#pragma once

#include <cstdint>

#include "codec/lossy_page.h"
#include "core/cuda_status.h"

namespace certkv::codec::cuda {

// One page to encode. All pointers are device pointers.
struct LossyEncodeTask {
  // The exact block, [block_tokens][head_dim] bf16 bits (kFragments: the same, fragment-major).
  // 2-byte aligned.
  const uint16_t* src = nullptr;
  // lossy_page_bytes(spec) bytes, any alignment; nothing past them is written.
  uint8_t* dst = nullptr;
  // The block's index in its sequence: lossy_encode_page_ref's block (dither8's counter).
  uint32_t block = 0;
  // dither8: dither8_key(layer, K or V, kv_head) of the page's head. Ignored by the fp8 casts.
  uint64_t dither_key = 0;
  // dither8 K pages with spec.n_outlier_pairs = m > 0: [m] pair indices of the page's head,
  // increasing, each below head_dim / 2 (the LossyPageSpec::outlier_pairs of that head, copied to
  // the device). Not read otherwise.
  const uint16_t* outlier_pairs = nullptr;
};

// encoded[i] after an encode: 1 when task i's page was written, 0 when lossy_encode_page_ref
// refuses the block (a value not finite, a dither8 scale past fp16, an E5M2 code that reads back
// as Inf: the block stays exact; the page's bytes are then unspecified). A dither8 K task whose
// outlier list is null or breaks the rule above is also answered 0, without reading past it.
inline constexpr uint8_t kLossyEncoded = 1;
inline constexpr uint8_t kLossyRefused = 0;

// The byte order of the pages on the device (the task's src and dst).
enum class LossyDeviceLayout : uint8_t {
  // src [block_tokens][head_dim] bf16 rows; dst the codec's page, byte for byte
  // lossy_encode_page_ref's.
  kCodec = 0,
  // 16-token pages of dither8 (PageFormat::kDither8Fragments) or of fp8-e4m3 with the exponent
  // witness on K pages (PageFormat::kFp8Fragments; V pages keep rho), format/fragment_layout.h:
  // src a fragment-major bf16 page (the K or V map, element_index), dst the codec's page
  // transcoded as format::fragment::dither8_page_to_fragments or fp8_page_to_fragments moves it
  // (the codes fragment-major, then the side data). Refused exactly when kCodec refuses.
  kFragments = 1,
};

// Checks the launch: spec.scheme fp8-e4m3, fp8-e5m2 or dither8 (another known scheme is
// kUnsupported), the spec otherwise valid as validate_lossy_page_spec says (its refusal's code and
// message), n_tasks >= 0, non-null arrays when n_tasks > 0 (kInvalidArgument); kFragments: scheme
// dither8, or fp8-e4m3 whose K pages take the exponent witness, and 16-token pages (kUnsupported
// otherwise), a known layout (kInvalidArgument).
// spec.outlier_pairs is not read: each task carries its own list; spec.n_outlier_pairs is the
// length of every list. Never launches.
CudaStatus check_lossy_encode(const LossyPageSpec& spec, int n_tasks, const void* tasks,
                              const void* encoded, LossyDeviceLayout layout = LossyDeviceLayout::kCodec);

// Encodes n_tasks pages that share `spec` (scheme, K or V, block shape, pairing, number of outlier
// pairs; spec.dither_key and spec.outlier_pairs are per task instead), asynchronously on `stream`
// (a cudaStream_t; null = the default stream). tasks: [n_tasks] and encoded: [n_tasks] are device
// arrays.
// REQUIRES (not checked on the host; the device reads what it is given): every task's pointers
// valid for the sizes above, its dst not overlapping another task's src or dst.
// check_lossy_encode's refusals are returned as they are (nothing launched); n_tasks = 0 launches
// nothing and succeeds; a launch failure is kInternal with cudaGetErrorString.
// `layout` names the byte order of every task's src and dst (LossyDeviceLayout).
CudaStatus lossy_encode_pages(const LossyPageSpec& spec, const LossyEncodeTask* tasks, int n_tasks,
                              uint8_t* encoded, void* stream,
                              LossyDeviceLayout layout = LossyDeviceLayout::kCodec);

}  // namespace certkv::codec::cuda
