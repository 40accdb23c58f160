// GAAC (Group-Adaptive Additive Codec, seed 003; DESIGN.md section 3): lossless coding of the
// exponents of a KV page. Sign and mantissa are kept, each group of 8 elements codes its
// exponents as 3-bit offsets from a calibrated base b3, 4-bit offsets from b4, or raw exponents;
// the byte layout is format/gaac_layout.h (prose: docs/format/gaac.md).
//
// Pages: one block of block_tokens tokens x head_dim channels of one (layer, K/V, kv_head),
// token-major: element (t, c) at index t * head_dim + c. A page is encoded into a slot of
// gaac_slot_bytes(element, block_tokens, head_dim, escape_capacity) bytes; when its escape bytes
// exceed escape_capacity it does not fit and the caller keeps it raw.
//
// Decoders validate everything the format can detect (a mode tag of 3 or one not valid for the
// element, escape bytes past the slot) and throw certkv::Error kCorrupt; they never read past
// slot_bytes. The format has no checksum: a flipped sign/mantissa or code bit decodes to another
// value.
//
// Thread safety: all functions are pure on their arguments; GaacCalibrator is not thread-safe,
// a finished GaacCalibration is immutable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "format/gaac_layout.h"

namespace certkv::codec {

using format::GaacElement;

// K or V, as stored in the calibration (the cache's KvTensor values).
inline constexpr int kGaacKey = 0;
inline constexpr int kGaacValue = 1;

// Calibrated exponent window bases of the channels of one (layer, K/V, kv_head).
// b3[c]: window [b3, b3 + 8); b4[c]: window [b4, b4 + 16). Both have head_dim entries.
// REQUIRES (checked by the codec entry points, kInvalidArgument): b3[c] + 8 and b4[c] + 16 do
// not exceed 2^exponent_bits.
struct GaacBases {
  std::vector<uint8_t> b3, b4;
};

// The model shape a calibration belongs to.
struct GaacShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  GaacElement element = GaacElement::kBf16;
  bool operator==(const GaacShape&) const = default;
};

// "bf16", "e4m3", "e5m2".
const char* gaac_element_name(GaacElement element);

// The result of calibration: bases per (layer, K/V, kv_head) and the slot escape capacity per
// (layer, K/V).
class GaacCalibration {
 public:
  // The metadata "format" value of a calibration file.
  static constexpr const char* kFormat = "certkv-gaac-calibration/1";
  // The rule GaacCalibrator picks windows by (metadata "windows"; docs/format/gaac.md): a file
  // made by an earlier rule has none, or another.
  static constexpr const char* kWindows = "weight 4 at an exponent, 1 at the one above";

  GaacCalibration() = default;
  // REQUIRES: a valid shape (kInvalidArgument otherwise); bases all 0, capacities the maximum.
  explicit GaacCalibration(const GaacShape& shape);

  const GaacShape& shape() const { return shape_; }
  // REQUIRES: 0 <= layer < n_layers, kv in {kGaacKey, kGaacValue}, 0 <= kv_head < n_kv_heads
  // (kOutOfRange otherwise).
  const GaacBases& bases(int layer, int kv, int kv_head) const;
  GaacBases& bases(int layer, int kv, int kv_head);
  size_t escape_capacity_bytes(int layer, int kv) const;
  void set_escape_capacity_bytes(int layer, int kv, size_t bytes);
  size_t slot_bytes(int layer, int kv) const;
  // The window rule that made the bases: kWindows from GaacCalibrator, what a loaded file says
  // ("" when it says nothing), "" for a calibration made by hand.
  const std::string& windows() const { return windows_; }
  void set_windows(std::string windows) { windows_ = std::move(windows); }

  // Writes a safetensors file: U8 tensors "layerL.{k,v}.b3" / ".b4" of shape
  // [n_kv_heads, head_dim], U64 tensor "escape_capacity_bytes" of shape [n_layers, 2], metadata
  // format, element, n_layers, n_kv_heads, head_dim, block_tokens, data_fnv1a64 (a checksum of
  // the tensor data; docs/format/gaac.md) and windows when known. kIo naming the path on failure.
  void save(const std::string& path) const;
  // Reads and checks a file written by save(): kNotFound / kIo for a missing or unreadable file,
  // kCorrupt for a wrong format version, a missing or malformed tensor, a base or capacity out of
  // range or a checksum mismatch,
  // kInvalidArgument when its shape differs from `expected` (the message names the file and
  // both values).
  static GaacCalibration load(const std::string& path, const GaacShape& expected);

 private:
  size_t index(int layer, int kv, int kv_head) const;
  GaacShape shape_;
  std::vector<GaacBases> bases_;                 // [n_layers][2][n_kv_heads]
  std::vector<size_t> escape_capacity_bytes_;   // [n_layers][2]
  std::string windows_;
};

// Accumulates exponent histograms per (layer, K/V, kv_head, channel) and the exponents of every
// complete page, then picks the bases and the escape capacities.
class GaacCalibrator {
 public:
  explicit GaacCalibrator(const GaacShape& shape);

  // rows: [n_tokens][head_dim] BF16 bit patterns of one (layer, K/V, kv_head), in token order.
  // Every call is its own sequence: its complete blocks of block_tokens rows are pages for the
  // capacity simulation, a partial last block only feeds the histograms.
  // REQUIRES: shape().element == kBf16 (kInvalidArgument), indices in range (kOutOfRange).
  void add_bf16(int layer, int kv, int kv_head, const uint16_t* rows, int n_tokens);
  // The same for FP8 bytes. REQUIRES: shape().element is an FP8 element.
  void add_fp8(int layer, int kv, int kv_head, const uint8_t* rows, int n_tokens);

  // Bases: per channel, the 8- and 16-wide exponent windows of the most weight, a sample weighing
  // 4 at its exponent and 1 at the exponent above (headroom over the largest exponent seen; ties:
  // the lowest base). Escape capacity per (layer, K/V): the one that minimises the stored bytes
  // over the calibration pages, where a page costs a full slot when its escapes fit and its raw
  // size when they do not (ties: the smaller capacity). With no samples a channel's bases are 0;
  // with no complete page a capacity is 0.
  GaacCalibration finish() const;

  const GaacShape& shape() const { return shape_; }

 private:
  void add_exponents(int layer, int kv, int kv_head, const std::vector<uint8_t>& exponents,
                     int n_tokens);
  GaacShape shape_;
  std::vector<uint64_t> histograms_;                 // [n_layers][2][n_kv_heads][head_dim][256]
  std::vector<std::vector<uint8_t>> page_exponents_;  // [n_layers][2][n_kv_heads]: pages' exponents
};

// Sizes and offsets of one page shape (format/gaac_layout.h evaluated once).
struct GaacPageGeometry {
  GaacElement element = GaacElement::kBf16;
  int exponent_bits = 0;       // E
  int sign_mantissa_bits = 0;  // S
  int block_tokens = 0;
  int head_dim = 0;
  int tile_channels = 0;
  int n_tiles = 0;
  int groups_per_token = 0;  // per tile
  size_t tile_groups = 0;
  size_t code_offset = 0;  // from the tile start
  size_t tag_offset = 0;
  size_t tag_bytes = 0;
  size_t tile_fixed_bytes = 0;
  size_t page_fixed_bytes = 0;
};
// kInvalidArgument naming the value when block_tokens < 1 or head_dim has no tiling.
GaacPageGeometry gaac_page_geometry(GaacElement element, int block_tokens, int head_dim);
// kInvalidArgument naming the channel when a base's window leaves the element's exponent range
// (b3 + 8 or b4 + 16 past 2^exponent_bits), or the bases are not head_dim long; the geometry's
// refusals as gaac_page_geometry's. The encoders check this themselves; the device encoder
// (codec/cuda/gaac_encode_cuda.h) does not, so its callers do.
void validate_gaac_bases(GaacElement element, int block_tokens, int head_dim, const GaacBases& bases);

// Returned by the encoders when the page's escapes exceed the capacity (keep the page raw).
inline constexpr size_t kGaacDoesNotFit = SIZE_MAX;

// The code paths: plain, AVX2 + BMI2, AVX-512 (F, BW, VBMI) + BMI2. A SIMD path runs only where
// the CPU supports it (kUnsupported otherwise).
enum class GaacKernel { kRef, kAvx2, kAvx512 };
const char* gaac_kernel_name(GaacKernel kernel);
bool gaac_kernel_supported(GaacKernel kernel);
// The widest supported SIMD path (checked once with __builtin_cpu_supports), else kRef.
GaacKernel gaac_best_kernel();

// Escape bytes the page would need with these bases (no output written).
// bf16: [block_tokens][head_dim].
size_t gaac_escape_bytes_needed(const uint16_t* bf16, int block_tokens, int head_dim,
                                const GaacBases& bases);

// Encodes a BF16 page into `out`. Returns the bytes used (fixed part + escape bytes written) or
// kGaacDoesNotFit. Slot bytes past the returned count are not written; on kGaacDoesNotFit the
// slot's contents are unspecified.
// bf16: [block_tokens][head_dim]; out: gaac_slot_bytes(kBf16, block_tokens, head_dim,
// escape_capacity_bytes) bytes.
// REQUIRES: block_tokens >= 1, gaac_tile_channels(head_dim) != 0, bases sized head_dim and in
// range (kInvalidArgument otherwise).
size_t gaac_encode_page_ref(const uint16_t* bf16, int block_tokens, int head_dim,
                            const GaacBases& bases, size_t escape_capacity_bytes, uint8_t* out);
size_t gaac_encode_page(const uint16_t* bf16, int block_tokens, int head_dim,
                        const GaacBases& bases, size_t escape_capacity_bytes, uint8_t* out,
                        GaacKernel kernel = gaac_best_kernel());

// Decodes a whole page. slot: slot_bytes readable bytes; out: [block_tokens][head_dim].
// kCorrupt (naming the group) for an invalid tag or escapes past the slot, or when slot_bytes is
// smaller than the fixed part.
void gaac_decode_page_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                          const GaacBases& bases, uint16_t* out);
void gaac_decode_page(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, uint16_t* out, GaacKernel kernel = gaac_best_kernel());

// Decodes token rows [token_begin, token_end) of a page into out: [token_end - token_begin]
// [head_dim], as BF16 bits or as floats. The rows' escape position is found from the tags of
// the groups before them. REQUIRES: 0 <= token_begin <= token_end <= block_tokens.
void gaac_decode_rows_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                          const GaacBases& bases, int token_begin, int token_end, uint16_t* out);
void gaac_decode_rows(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, int token_begin, int token_end, uint16_t* out,
                      GaacKernel kernel = gaac_best_kernel());
void gaac_decode_rows(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                      const GaacBases& bases, int token_begin, int token_end, float* out,
                      GaacKernel kernel = gaac_best_kernel());

// BF16 row decoding bound to one page shape, one set of bases and one kernel, with the
// arguments checked once at construction (as gaac_decode_rows checks them), so the calls of an
// attention loop pay only for decoding: build one per (page shape, bases) outside the loop over
// pages. The float rows are the BF16 bit patterns shifted up by 16 (the floats of the raw page),
// written by the same one-pass kernels as the BF16 rows (kAvx512 forms floats from the BF16 byte
// planes with byte permutes). The bases are borrowed and must outlive the decoder.
// Thread safety: const methods may run concurrently.
class GaacRowDecoder {
 public:
  GaacRowDecoder(int block_tokens, int head_dim, const GaacBases& bases,
                 GaacKernel kernel = gaac_best_kernel());
  // Same contract as gaac_decode_rows (kCorrupt for a bad slot, kOutOfRange for bad rows).
  void decode_rows(const uint8_t* slot, size_t slot_bytes, int token_begin, int token_end,
                   uint16_t* out) const;
  void decode_rows(const uint8_t* slot, size_t slot_bytes, int token_begin, int token_end,
                   float* out) const;
  const GaacPageGeometry& geometry() const { return geometry_; }

 private:
  GaacPageGeometry geometry_;
  const GaacBases* bases_;
  GaacKernel kernel_;
};

// Mode mix of an encoded page, read from its tags (validated like the decoders do).
struct GaacModeCounts {
  size_t groups[3] = {0, 0, 0};  // indexed by kGaacMode3Bit, kGaacMode4Bit, kGaacModeRaw
  size_t escape_bytes = 0;
};
GaacModeCounts gaac_count_modes(GaacElement element, const uint8_t* slot, size_t slot_bytes,
                                int block_tokens, int head_dim);

// FP8 pages (element kFp8E4M3 or kFp8E5M2): the same coding on the FP8 exponent; fp8 and out are
// [block_tokens][head_dim] bytes. Same contracts as the BF16 functions.
size_t gaac_encode_page_fp8_ref(GaacElement element, const uint8_t* fp8, int block_tokens,
                                int head_dim, const GaacBases& bases,
                                size_t escape_capacity_bytes, uint8_t* out);
void gaac_decode_page_fp8_ref(GaacElement element, const uint8_t* slot, size_t slot_bytes,
                              int block_tokens, int head_dim, const GaacBases& bases,
                              uint8_t* out);
size_t gaac_escape_bytes_needed_fp8(GaacElement element, const uint8_t* fp8, int block_tokens,
                                    int head_dim, const GaacBases& bases);

}  // namespace certkv::codec
