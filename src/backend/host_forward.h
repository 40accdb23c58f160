// The forward pass of the Llama family on the host, batched over the rows of several sequences:
// embeddings, RMSNorm, the weight products, RoPE, SwiGLU, the residuals and the logits. Attention
// is not here: each layer hands its post-RoPE queries, keys and values to the backend, whose page
// pool it reads (the CPU backend's KvCache, the CUDA backend's device pool).
//
// Per token (Touvron et al. 2023): x = embed(token); per layer
//   h = x + W_o attn(rope(W_q n(x)), rope(W_k n(x)), W_v n(x));  x = h + W_down(silu(W_gate n(h)) * W_up n(h))
// with n = RMSNorm; logits = W_out n(x). Qwen2 adds q/k/v biases, Qwen3 RMS-normalizes each head
// of q and k before RoPE. A step stacks the rows of every sequence, so each weight product reads
// its weights once per step, and every row's result depends on that row alone (batch invariance).
// Thread safety: used by one thread at a time (the backend's).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/thread_pool.h"
#include "model/model.h"

namespace certkv::backend {

// The rows of one step: item i owns rows [row0[i], row0[i] + items[i].n) at positions
// [pos0[i], pos0[i] + items[i].n).
struct StepRows {
  std::span<const BatchItem> items;
  std::vector<int64_t> row0;
  std::vector<int64_t> pos0;
  int64_t n_rows = 0;
};

// Checks a step before anything changes (Backend::forward's contract): distinct sequences, at
// least one token each, tokens inside the vocabulary, length + n within context_tokens.
// length(seq) throws kNotFound for a sequence not live. Returns the step's rows.
StepRows plan_step(std::span<const BatchItem> items, const model::ModelConfig& config, int64_t context_tokens,
                   const std::function<int64_t(cache::SeqId)>& length);

// One layer's attention: q [n_rows][n_heads][head_dim] (post-RoPE; the callee may keep it),
// k, v [n_rows][n_kv_heads][head_dim] (post-RoPE keys), out [n_rows][n_heads][head_dim].
using LayerAttention = std::function<void(int layer, const float* q, const float* k, const float* v, float* out)>;

class HostForward {
 public:
  // REQUIRES: model and pool outlive this.
  HostForward(const model::Model& model, ThreadPool& pool, model::ActivationFormat activations);

  // Runs every layer over the step's rows, calling attention once per layer, then writes the
  // logits the items ask for (BatchItem::last_logits, all_logits) and the tokens they draw
  // (BatchItem::token).
  void run(const StepRows& rows, const LayerAttention& attention);

 private:
  void ensure_buffers(int64_t n);

  const model::Model& model_;
  ThreadPool& pool_;
  model::ActivationFormat activations_;
  int64_t buffer_tokens_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, cos_, sin_, logits_;
  std::vector<std::pair<float, int32_t>> candidates_;  // the sampler's scratch
};

}  // namespace certkv::backend
