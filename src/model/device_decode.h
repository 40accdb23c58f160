// Decode attention on a CUDA device for a session (the device route of DESIGN.md section 1's
// "attention/ ... CUDA"): the session's forward pass runs on the host; each layer's new K/V rows
// also go to a device KV cache (cache/cuda/device_kv_cache.h: filled, then finalized into GAAC
// slots or lossy pages by the device encoders), and a decode step's attention for a layer runs
// there (attention/cuda/paged_decode_cuda.h), its output, and for the lossy schemes the meter of
// every query head computed in the same pass, copied back into the forward pass.
//
// Built with CUDA (CERTKV_CUDA) the route needs a CUDA device at run time; without either,
// make_device_decoder throws kUnsupported saying which is missing.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/sparse_decode.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"

namespace certkv::model {

enum class Device { kCpu = 0, kCuda = 1 };
// "cpu", "cuda".
const char* device_name(Device device);
// Throws certkv::Error kInvalidArgument naming the unknown device and the known ones.
Device parse_device(std::string_view name);
// Whether the device route serves sessions of this KV scheme (bf16, gaac, gaac-e5m2; the lossy
// fp8-e4m3, fp8-e5m2 and dither8 with their meters).
bool device_route_serves(cache::KvScheme scheme);

struct DeviceDecoderConfig {
  int n_layers = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  int64_t max_tokens = 0;
  float scale = 0.f;  // logit scale
  cache::KvScheme scheme = cache::KvScheme::kBf16;  // one device_route_serves
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
  // Lossy schemes: the model's RoPE pairing, dither8's outlier pairs per head (-1: the default),
  // the Tier B failure probability of one (layer, head, step) cell (gate::local_delta).
  codec::RopePairing rope_pairing = codec::RopePairing::kInterleaved;
  int outlier_pairs = -1;
  std::shared_ptr<const std::vector<uint16_t>> fixed_outlier_pairs;  // dither8 (KvCacheConfig's)
  double delta_loc = 1e-8;
  // fp8 schemes: the K pages' Tier A witness code (fp16 bounds or u8 codes).
  codec::WitnessCode witness = codec::WitnessCode::kFp16;
  // Sparse decode on the device (attend_sparse): the scheme must be bf16 (the sparse kernels read
  // bf16 pages) and max_tokens below 2^24.
  bool sparse = false;
  // Lossy schemes: compute the meter in the attention pass (off: the same kernels without it).
  bool meter = true;
};

// Throws kUnsupported, saying why, for a configuration the route does not serve whatever the
// machine: a scheme device_route_serves refuses (naming the served ones), the exponent witness
// (the device cache writes fp16 or u8 witnesses), sparse decode with another scheme than bf16 or a
// context of 2^24 tokens or more.
void refuse_unserved(const DeviceDecoderConfig& config);

struct DeviceDecodeStats {
  int64_t attention_calls = 0;       // (step, layer) attentions run on the device
  int64_t sparse_calls = 0;          // of them, sparse decode
  double attention_seconds = 0;      // their wall time on the host (copies and launches included)
  double write_seconds = 0;          // appending rows and encoding finalized blocks
  int64_t slots_in_use = 0;          // GAAC slots on the device
  int64_t raw_pages_in_use = 0;      // raw pages (bf16 pages, tails, blocks that did not fit)
  int64_t blocks_not_fitting = 0;
  int64_t lossy_pages_in_use = 0;    // lossy pages on the device
  int64_t pages_kept_exact = 0;      // lossy pages the encoder refused (kept raw bf16)
  uint64_t kv_bytes_in_use = 0;      // device pages in use and block tables
  uint64_t kv_bytes_reserved = 0;    // device memory held for the KV cache
};

// One device page as stored (tests).
struct DevicePage {
  bool gaac_slot = false;
  bool lossy_page = false;
  int32_t slot = -1;           // a slot's or lossy page's index in its pool
  std::vector<uint8_t> bytes;  // a slot's used bytes, a lossy page, or a raw page
};

class DeviceDecoder {
 public:
  virtual ~DeviceDecoder() = default;
  // Writes positions [pos, pos + n) of `layer`: k, v [n][n_kv_heads][head_dim] floats
  // (post-RoPE). Throws kInternal when the device cache does not hold exactly pos tokens of the
  // layer (an earlier step failed halfway: reset the session) or refuses after a failure.
  virtual void write(int layer, int64_t pos, const float* k, const float* v, int64_t n) = 0;
  // Attention of the newest position over every token written to `layer`: q [n_q_heads]
  // [head_dim], out [n_q_heads][head_dim]. Lossy schemes: meters [n_q_heads] (or null) receive
  // each head's log_a, meter and value_rho from the same pass (v_norm_max and output_bound are
  // the caller's: the host cache keeps max ||v||). Throws kCorrupt if the kernels flagged a bad
  // page.
  virtual void attend(int layer, const float* q, float* out, attention::HeadMeter* meters) = 0;
  // Sparse decode of the newest position (attention/cuda/sparse_decode_cuda.h), the selection of
  // attention::sparse_decode_attention: the indexed prefix of `index` (whose new records are
  // copied to the device), every query head's query quantized on the host with
  // sparse_head_rounding_seed(rounding_seed, head) as the CPU path does, Top-p mass p widened by
  // `deviations` estimator deviations per token (SparseDecodeOptions::deviations), the window
  // after the prefix attended exactly. stats: [n_q_heads] or null (boundary_tokens is not
  // counted here). REQUIRES: a session configured with `sparse`; every kv head of the layer
  // indexed to the same whole-block length, at least one block, at most the tokens written.
  virtual void attend_sparse(int layer, const float* q, float* out, const cache::KeyIndex& index, double p,
                             double deviations, uint64_t rounding_seed, attention::SparseHeadStats* stats) = 0;
  // The gate's repair of a lossy block: the K and V pages of (layer, kv_head, block) that are lossy
  // on the device become exact raw pages holding k_rows, v_rows ([block_tokens][head_dim] bf16,
  // from the host cache's backing store). Returns the bytes uploaded (0 when neither was lossy).
  virtual uint64_t repair_block(int layer, int kv_head, int64_t block, const uint16_t* k_rows,
                                const uint16_t* v_rows) = 0;
  virtual void reset() = 0;
  virtual DeviceDecodeStats stats() const = 0;
  virtual DevicePage read_page(int layer, cache::KvTensor kv, int kv_head, int64_t block) const = 0;
};

// Throws certkv::Error: kUnsupported (a scheme device_route_serves refuses, a build without CUDA,
// no CUDA device, a shape the kernels do not serve), kInvalidArgument, kOutOfMemory.
std::unique_ptr<DeviceDecoder> make_device_decoder(const DeviceDecoderConfig& config);

}  // namespace certkv::model
