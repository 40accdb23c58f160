// The forward pass of the Llama family on a CUDA device, batched over the rows of several
// sequences: HostForward's steps (backend/host_forward.h) with every weight and activation on the
// device. The weights go up once, at create: each GGUF matrix dequantized and kept as two bf16
// terms (backend/cuda/device_matmul.h), the norms and biases as floats; the embedding rows are
// the sum of the table's two terms. A step uploads its tokens and
// the rows' RoPE angles (computed on the host in double, as HostForward computes them), runs
//   embed -> per layer: RMSNorm -> q, k, v product (+ bias, q/k norms) -> RoPE -> attention
//   -> W_o -> residual -> RMSNorm -> gate, up product -> SwiGLU -> W_down -> residual
// (the products that share an input are one product over their stacked weights)
// and ends with the logits of the rows the items ask for, downloaded into their buffers.
// Attention is the caller's: each layer hands it device pointers to the post-RoPE queries, keys
// and values of the step's rows and takes back the attention output rows.
//
// Numerics: the weight products are fp32-accurate (two-term bf16 products on the tensor cores,
// DeviceMatmul); norms, RoPE, SwiGLU and residuals run in float (backend/cuda/forward_kernels.h). Every kernel computes a row from that row alone and cuBLAS's
// products of one row do not depend on the row count (DeviceMatmul's test), so a sequence's
// logits do not depend on the batch beside it.
// Launches: the forward's own stream, ordered with the null (legacy default) stream, where the
// attention and the cache work, in both directions. A step's layers run as segments between
// attentions (the end of one layer and the start of the next: norms, products, RoPE, residuals);
// for steps of up to kMaxGraphRows rows each segment is a CUDA graph, captured once per row
// count and replayed (a decode step at batch 8 launches 31 graphs instead of ~700 kernels). The
// graphs run the same kernels on the same buffers: the logits are the same bits with or without
// them (DeviceForward's test).
// Thread safety: one owner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "backend/cuda/device_matmul.h"
#include "backend/host_forward.h"
#include "cache/cuda/device_pool.h"
#include "model/model.h"

namespace certkv::backend::cuda {

// One layer's attention on the device: q [n_rows][n_heads][head_dim] (post-RoPE; the callee may
// overwrite it), k, v [n_rows][n_kv_heads][head_dim], out [n_rows][n_heads][head_dim]; rows in
// step order (StepRows). The callee enqueues its work on the null (legacy default) stream, which
// the forward's stream is ordered with both ways.
using DeviceLayerAttention = std::function<void(int layer, float* q, const float* k, const float* v, float* out)>;

// Bytes the device needs for the model's weights as DeviceForward holds them.
uint64_t device_weight_bytes(const model::Model& model);

class DeviceForward {
 public:
  // Uploads the model's weights. Throws certkv::Error: kUnsupported for a weight type the
  // dequantizer does not read; kOutOfMemory, before any upload, when the device's free memory
  // cannot hold device_weight_bytes(model) (both sizes named).
  // fused: the fused kernels where they apply (forward_kernels.h; steps of at most
  // kPinnedProductRows rows on the pinned products); false runs the unfused kernels everywhere,
  // what the fused must equal bit for bit (DeviceForward's test).
  static std::unique_ptr<DeviceForward> create(const model::Model& model, bool graphs = true, bool fused = true);
  ~DeviceForward();
  DeviceForward(const DeviceForward&) = delete;
  DeviceForward& operator=(const DeviceForward&) = delete;

  // Runs every layer over the step's rows (tokens checked already: plan_step), calling attention
  // once per layer, then writes the logits the items ask for (BatchItem::last_logits,
  // all_logits) and the tokens they draw (BatchItem::token, sampled on the device:
  // backend/cuda/sample_kernels.h). Returns after the logits and tokens are on the host. Throws certkv::Error for a failed
  // launch or copy. host_work (when set) runs once every launch of the step is enqueued, before
  // the wait for the device: host work that overlaps the device's.
  void run(const StepRows& rows, const DeviceLayerAttention& attention, const std::function<void()>& host_work = {});

  uint64_t weight_bytes() const { return weight_bytes_; }
  // Host seconds the last run() spent waiting for the device at its end.
  double last_wait_seconds() const { return last_wait_seconds_; }
  // Steps of at most this many rows replay captured segments.
  static constexpr int64_t kMaxGraphRows = 64;

 private:
  struct Layer {
    DeviceMatrix wqkv, wo, w_gate_up, w_down;  // q, k, v stacked; gate, up stacked
    cache::cuda::DeviceBuffer attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm;
  };
  DeviceForward(const model::Model& model, bool graphs, bool fused) : model_(model), use_graphs_(graphs), fused_(fused) {}
  void ensure_buffers(int64_t rows, int64_t logit_rows);
  // Enqueues segment l of a step of n rows: the end of layer l - 1 (W_o, residual, the FFN) when
  // l > 0, the start of layer l (RMSNorm, q k v, RoPE) when l < n_layers.
  void segment(int l, int64_t n);
  // segment() through the fused kernels and DeviceMatmul::products (the pinned kernel, n within
  // one chunk).
  void fused_segment(int l, int64_t n);
  // The captured segments of steps of n rows (captured now if missing or stale).
  const std::vector<void*>& graphs_of(int64_t n);
  void drop_graphs();
  void multiply(const DeviceMatrix& w, const float* x, int64_t rows, float* y);
  // Enqueues the draws of the items with a token from logits_ (an item's last row at
  // last_logit_row[i]) and their copy into sample_host_tokens; returns the drawing items in the
  // order of those tokens.
  std::vector<size_t> draw_tokens(std::span<const BatchItem> items, const std::vector<int32_t>& last_logit_row);
  int32_t* sample_host_tokens(size_t m) const;

  const model::Model& model_;
  bool use_graphs_ = true;
  bool fused_ = true;
  void* stream_ = nullptr;  // cudaStream_t, owned
  std::vector<std::pair<int64_t, std::vector<void*>>> graphs_;  // per row count: cudaGraphExec_t per segment
  uint64_t graph_generation_ = 0;  // DeviceMatmul::scratch_generation() when captured
  std::unique_ptr<DeviceMatmul> matmul_;
  std::vector<Layer> layers_;
  DeviceMatrix output_, embedding_;  // embedding_: when the model does not tie it to the output
  cache::cuda::DeviceBuffer output_norm_;
  uint64_t weight_bytes_ = 0;
  double last_wait_seconds_ = 0;
  // Step buffers, grown to the largest step: token ids and angles (page-locked staging and their
  // device copies), the residual stream, the products' float inputs and outputs, logits.
  int64_t buffer_rows_ = 0, buffer_logit_rows_ = 0;
  cache::cuda::PinnedBuffer staging_, logits_host_;
  cache::cuda::DeviceBuffer tokens_, angles_, x_, xn_, qkv_, q_, k_, v_, attn_, proj_, gate_up_, act_, logit_index_,
      logit_x_, logits_;
  // Sampling: the rows (page-locked, then the drawn tokens after them) and their device copies,
  // the drawn tokens, the sort's workspace.
  cache::cuda::PinnedBuffer sample_host_;
  cache::cuda::DeviceBuffer sample_rows_, sampled_, sample_workspace_;
};

}  // namespace certkv::backend::cuda
