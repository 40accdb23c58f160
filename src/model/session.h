// One generation stream over a loaded Model: the forward pass of the Llama family on the CPU,
// reading and writing a paged KV cache.
//
// Forward pass per token (Touvron et al. 2023): x = embed(token); per layer
//   h = x + W_o attn(rope(W_q n(x)), rope(W_k n(x)), W_v n(x));  x = h + W_down(silu(W_gate n(h)) * W_up n(h))
// with n = RMSNorm; logits = W_out n(x). Qwen2 adds q/k/v biases, Qwen3 RMS-normalizes each head
// of q and k before RoPE.
// Thread safety: a Session is used by one thread at a time; it owns its thread pool and cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/thread_pool.h"
#include "model/matmul_float.h"
#include "model/model.h"

namespace certkv::model {

struct SessionConfig {
  int64_t context_tokens = 0;  // 0: the model's context length
  int n_threads = 2;
  int block_tokens = 16;       // tokens per KV page
  int prefill_chunk_tokens = 512;  // prefill runs in chunks of this many tokens
  bool capture_queries = false;    // keep the post-RoPE queries of the last position per layer
  ActivationFormat activations = ActivationFormat::kInt8;  // arithmetic of the weight products
  cache::KvScheme kv_scheme = cache::KvScheme::kBf16;      // how the KV cache stores full blocks
  // REQUIRED for the GAAC kv_schemes (kGaac, kGaacE4M3, kGaacE5M2): the model's calibration
  // (codec::GaacCalibration::load) of the scheme's element, shared by every session of the model;
  // its shape must match the model and block_tokens.
  std::shared_ptr<const codec::GaacCalibration> gaac_calibration;
};

// progress(done_tokens, total_tokens), called after each prefill chunk.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

class Session {
 public:
  // REQUIRES: model outlives the session. Throws certkv::Error for a bad configuration (a gaac
  // scheme without a calibration, or with one of another model: kInvalidArgument).
  Session(const Model& model, const SessionConfig& config);
  ~Session();

  const Model& model() const { return model_; }
  const SessionConfig& config() const { return config_; }
  int64_t context_tokens() const { return context_tokens_; }
  // Tokens already in the KV cache.
  int64_t n_past() const;

  // Appends `tokens` to the sequence. last_logits: [n_vocab] of the last token, or null;
  // all_logits: [n][n_vocab], or null.
  // Throws certkv::Error kOutOfRange (nothing appended) when n_past + n exceeds the context, and
  // kInvalidArgument for a token id outside the vocabulary.
  void prefill(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits = nullptr,
               const ProgressFn& progress = {});
  // One token. logits: [n_vocab].
  void decode(int32_t token, float* logits);
  // Drops all tokens.
  void reset();

  const cache::KvCache& kv_cache() const { return *cache_; }
  cache::SeqId sequence() const { return seq_; }
  // Post-RoPE queries of the last processed position: [n_heads][head_dim].
  // REQUIRES: config.capture_queries and at least one token processed.
  const std::vector<float>& last_queries(int layer) const;

 private:
  void forward_chunk(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits);
  void ensure_buffers(int64_t n);

  const Model& model_;
  SessionConfig config_;
  int64_t context_tokens_ = 0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<cache::KvCache> cache_;
  cache::SeqId seq_ = 0;
  int64_t buffer_tokens_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, cos_, sin_;
  std::vector<std::vector<float>> last_queries_;
};

}  // namespace certkv::model
