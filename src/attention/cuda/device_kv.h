// One layer's KV for a batch of sequences, encoded in a device page format and placed in device
// page pools with block tables: what paged_decode reads. Pages are encoded on the host with the
// codecs (the `_ref` encoders: the same bytes the CPU cache writes), then uploaded; the kernels
// never see the exact values of a lossy page.
//
// Every sequence's blocks get slots in one shuffled order of the pool (so a table walk is never
// a contiguous read by accident); a partial last block is encoded padded with zeros and masked by
// the sequence length. GAAC pages whose escapes do not fit their slot go to the raw pool; so do
// the pages a lossy batch keeps exact (DeviceKvOptions::exact_*), as bf16.
// Thread safety: build is internally parallel; a built DeviceKv is read-only.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "attention/cuda/paged_decode_cuda.h"
#include "cache/cuda/device_pool.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"

namespace certkv::attention::cuda {

struct HostLayerKv {
  int batch = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  std::vector<int64_t> lens;  // [batch], each >= 1
  // Exact values, bf16 bits, per sequence: [n_kv_heads][len][head_dim].
  std::vector<std::vector<uint16_t>> k, v;
  // > 0: the caller promises that block j of every sequence holds the same values as block
  // j % period_blocks of sequence 0 (tiled benchmark KV), so slot-independent formats encode
  // each distinct block once. Never used for dither8 (its pages depend on their slot).
  int64_t period_blocks = 0;
};

struct DeviceKvOptions {
  PageFormat format = PageFormat::kBf16;
  // GAAC formats: the calibration (its element must match the format; kv heads 0 .. n_kv_heads - 1
  // of it are used) and the layer it describes.
  const codec::GaacCalibration* gaac = nullptr;
  int layer = 0;
  // dither8: outlier RoPE pairs per KV head, chosen from sequence 0's keys; the generator keys
  // come from (layer, K/V, kv_head).
  int n_outlier_pairs = 0;
  codec::RopePairing pairing = codec::RopePairing::kInterleaved;
  codec::WitnessCode witness = codec::WitnessCode::kFp16;  // fp8 K pages' Tier A witness
  uint32_t seed = 1;                 // slot shuffle
  // Slots in table order instead (a sequence's pages contiguous in the pool, K and V alike): what
  // the benchmark compares the shuffled pools against, to see what scattered pages cost.
  bool contiguous_slots = false;
  bool keep_reconstruction = false;  // keep host copies of what attention reads (tests)
  // Lossy formats: pages kept exact, as bf16 pages of the raw pools (what a lossy session does
  // with its incomplete tail block and with blocks it cannot encode). The K page of block j of
  // (sequence b, kv head h) is exact when exact_k_every > 0 and (j + b + h) % exact_k_every == 0,
  // the V page when exact_v_every > 0 and (j + 2 b + h + 1) % exact_v_every == 0 (so K and V
  // differ: some blocks have an exact K page and a lossy V page, some the reverse; 1: every
  // page); exact_tail: both pages of a partial last block.
  int exact_k_every = 0;
  int exact_v_every = 0;
  bool exact_tail = false;
};

class DeviceKv {
 public:
  // kInvalidArgument for inconsistent shapes or a missing / mismatched calibration,
  // kOutOfMemory when the pools do not fit the device.
  static CudaStatus build(const HostLayerKv& kv, const DeviceKvOptions& options, DeviceKv* out);

  // Fills the page, table, length and codec fields of params (format, batch, n_kv_heads,
  // head_dim, block_tokens too); the caller sets the query heads, scale, q, out, meter, workspace.
  void describe(PagedDecodeParams* params) const;

  // What attention reads (keep_reconstruction): per sequence [n_kv_heads][len][head_dim].
  const std::vector<std::vector<float>>& k_read() const { return k_read_; }
  const std::vector<std::vector<float>>& v_read() const { return v_read_; }
  // Per-token bound data of K (keep_reconstruction, lossy formats): Tier A witness
  // [n_kv_heads][len][16], Tier B scales [n_kv_heads][len][head_dim / 32]; zeros on exact pages.
  const std::vector<std::vector<float>>& k_bounds() const { return k_bounds_; }
  // Per-token rho_t >= ||v^_t - v_t|| of V (keep_reconstruction, lossy formats), [n_kv_heads][len]:
  // Tier A the page's stored fp16 rho, dither8 (1/2 + 2^-8) sqrt(sum_g 32 s_{t,g}^2) in double
  // (the bound before the kernel's float lift); 0 on exact pages.
  const std::vector<std::vector<double>>& v_rho() const { return v_rho_; }
  // Lossy formats: whether the K (key) or V page of block j of (sequence b, kv_head) is kept exact
  // (DeviceKvOptions::exact_*, and kFp8Fragments's K pages where the cast saturated).
  bool exact_page(bool key, int b, int kv_head, int64_t block) const;
  // dither8: the outlier pairs of kv_head (increasing pair order).
  const std::vector<uint16_t>& outlier_pairs(int kv_head) const { return outlier_pairs_[size_t(kv_head)]; }
  codec::LossyPageSpec lossy_spec(bool key, int kv_head) const;

  // Bytes one decode step reads from the page pools over all sequences (each referenced page's
  // bytes as the kernel reads them: a GAAC slot whole, fixed part and escape capacity).
  int64_t bytes_read() const { return bytes_read_; }
  // Of those, the fp8 pages' side data that only the meter reads (the K pages' Tier A witness, the
  // V pages' rho): a launch without the meter reads bytes_read() - meter_side_bytes().
  int64_t meter_side_bytes() const { return meter_side_bytes_; }
  int64_t raw_pages() const { return raw_pages_; }
  // GAAC slots encoded: groups by mode (3-bit, 4-bit, raw), and pages with no 4-bit or raw group.
  const std::array<int64_t, 3>& gaac_group_modes() const { return gaac_group_modes_; }
  int64_t gaac_pages_without_escapes() const { return gaac_pages_without_escapes_; }
  int64_t pages() const { return n_pages_; }

 private:
  HostLayerKv shape_;
  DeviceKvOptions options_;
  cache::cuda::DevicePagePool k_pool_, v_pool_, k_raw_, v_raw_;
  cache::cuda::DeviceBuffer tables_, lens_, bases_, keys_, outliers_;
  int64_t table_stride_ = 0, max_len_ = 0, n_pages_ = 0, raw_pages_ = 0, bytes_read_ = 0, meter_side_bytes_ = 0;
  std::array<int64_t, 3> gaac_group_modes_{};
  int64_t gaac_pages_without_escapes_ = 0;
  size_t k_capacity_ = 0, v_capacity_ = 0;
  std::vector<std::vector<uint16_t>> outlier_pairs_;
  std::vector<std::vector<float>> k_read_, v_read_, k_bounds_;
  std::vector<std::vector<double>> v_rho_;
  std::vector<int64_t> first_page_;            // [batch]: the page id of each sequence's head 0, block 0
  std::vector<uint8_t> exact_k_, exact_v_;     // [page id]: lossy formats' pages kept exact
  bool exact_by_option(bool key, int b, int kv_head, int64_t block) const;
};

}  // namespace certkv::attention::cuda
