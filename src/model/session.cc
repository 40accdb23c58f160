#include "model/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention/decode_attention.h"
#include "core/status.h"
#include "model/dequant.h"

namespace certkv::model {

namespace {

// y = x / sqrt(mean(x^2) + eps) * w  (Zhang & Sennrich 2019).
void rms_norm(const float* x, const float* w, int n, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float inv = float(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// Rotates each head of x by the angles of its position (Su et al. 2021, RoFormer eq. 34).
// x: [n_heads][head_dim]; cos, sin: [head_dim / 2].
void apply_rope(float* x, int n_heads, int head_dim, RopeLayout layout, const float* cos,
                const float* sin) {
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + int64_t(h) * head_dim;
    for (int j = 0; j < half; ++j) {
      const int a = layout == RopeLayout::kInterleaved ? 2 * j : j;
      const int b = layout == RopeLayout::kInterleaved ? 2 * j + 1 : j + half;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * cos[j] - x1 * sin[j];
      v[b] = x0 * sin[j] + x1 * cos[j];
    }
  }
}

void add_bias(float* x, const std::vector<float>& b, int64_t n) {
  const int64_t d = int64_t(b.size());
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) x[t * d + i] += b[i];
}

}  // namespace

Session::Session(const Model& model, const SessionConfig& config) : model_(model), config_(config) {
  const ModelConfig& c = model.config();
  context_tokens_ = config.context_tokens > 0 ? config.context_tokens : c.context_length;
  if (config.context_tokens < 0)
    fail(StatusCode::kInvalidArgument, "context size must be positive");
  if (config.n_threads < 1 || config.n_threads > 256)
    fail(StatusCode::kInvalidArgument, "thread count must be in [1, 256]");
  if (config.block_tokens < 1 || config.block_tokens > 4096)
    fail(StatusCode::kInvalidArgument, "block_tokens must be in [1, 4096]");
  if (config.prefill_chunk_tokens < 1)
    fail(StatusCode::kInvalidArgument, "prefill chunk must be positive");
  if (cache::kv_scheme_is_gaac(config.kv_scheme) && !config.gaac_calibration)
    fail(StatusCode::kInvalidArgument,
         std::string("KV scheme ") + cache::kv_scheme_name(config.kv_scheme) +
             " needs a GAAC calibration of this model (SessionConfig.gaac_calibration)");
  pool_ = std::make_unique<ThreadPool>(config.n_threads);
  cache::KvCacheConfig kv;
  kv.n_layers = c.n_layers;
  kv.n_kv_heads = c.n_kv_heads;
  kv.head_dim = c.head_dim;
  kv.block_tokens = config.block_tokens;
  kv.max_tokens = context_tokens_;
  kv.scheme = config.kv_scheme;
  kv.gaac_calibration = config.gaac_calibration;
  cache_ = std::make_unique<cache::KvCache>(kv);
  seq_ = cache_->create_sequence();
  if (config.capture_queries) last_queries_.assign(c.n_layers, {});
}

Session::~Session() = default;

int64_t Session::n_past() const { return cache_->length(seq_); }

void Session::reset() {
  cache_->free_sequence(seq_);
  seq_ = cache_->create_sequence();
}

const std::vector<float>& Session::last_queries(int layer) const {
  if (!config_.capture_queries || layer < 0 || layer >= int(last_queries_.size()) ||
      last_queries_[layer].empty())
    fail(StatusCode::kInvalidArgument, "queries were not captured for layer " + std::to_string(layer));
  return last_queries_[layer];
}

void Session::ensure_buffers(int64_t n) {
  if (n <= buffer_tokens_) return;
  const ModelConfig& c = model_.config();
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  x_.resize(n * c.dim);
  xn_.resize(n * std::max<int64_t>(c.dim, q_dim));
  q_.resize(n * q_dim);
  k_.resize(n * kv_dim);
  v_.resize(n * kv_dim);
  attn_.resize(n * q_dim);
  gate_.resize(n * c.ffn_dim);
  up_.resize(n * c.ffn_dim);
  cos_.resize(n * c.head_dim / 2);
  sin_.resize(n * c.head_dim / 2);
  buffer_tokens_ = n;
}

void Session::prefill(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits,
                      const ProgressFn& progress) {
  const ModelConfig& c = model_.config();
  if (n < 1) fail(StatusCode::kInvalidArgument, "prefill needs at least one token");
  if (n_past() + n > context_tokens_)
    fail(StatusCode::kOutOfRange, "the prompt (" + std::to_string(n) + " tokens, " +
                                      std::to_string(n_past()) + " already in the cache) is longer than the context (" +
                                      std::to_string(context_tokens_) + " tokens)");
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.n_vocab)
      fail(StatusCode::kInvalidArgument, "token id " + std::to_string(tokens[i]) +
                                             " is outside the vocabulary (" +
                                             std::to_string(c.n_vocab) + ")");
  const int64_t chunk = config_.prefill_chunk_tokens;
  for (int64_t done = 0; done < n; done += chunk) {
    const int64_t m = std::min(chunk, n - done);
    const bool last = done + m == n;
    forward_chunk(tokens + done, m, last ? last_logits : nullptr,
                  all_logits ? all_logits + done * c.n_vocab : nullptr);
    if (progress) progress(done + m, n);
  }
}

void Session::decode(int32_t token, float* logits) { prefill(&token, 1, logits); }

void Session::forward_chunk(const int32_t* tokens, int64_t n, float* last_logits,
                            float* all_logits) {
  const ModelConfig& c = model_.config();
  const int64_t pos0 = n_past();
  const int dim = c.dim;
  const int hd = c.head_dim;
  const int64_t q_dim = int64_t(c.n_heads) * hd;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * hd;
  ensure_buffers(n);
  cache_->reserve(seq_, n);

  const WeightMatrix& embd = model_.token_embedding();
  for (int64_t t = 0; t < n; ++t)
    dequantize_row(embd.type, embd.data + size_t(tokens[t]) * embd.row_bytes, &x_[t * dim], dim);

  const std::vector<float>& inv_freq = model_.rope_inv_freq();
  const int half = hd / 2;
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < half; ++j) {
      const double angle = double(pos0 + t) * inv_freq[j];
      cos_[t * half + j] = float(std::cos(angle));
      sin_[t * half + j] = float(std::sin(angle));
    }

  attention::AttentionShape shape;
  shape.n_q_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = hd;
  shape.scale = c.attention_scale();

  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& w = model_.layer(layer);
    for (int64_t t = 0; t < n; ++t)
      rms_norm(&x_[t * dim], w.attn_norm.data(), dim, c.rms_eps, &xn_[t * dim]);
    matmul(w.wq, xn_.data(), n, q_.data(), *pool_, config_.activations);
    matmul(w.wk, xn_.data(), n, k_.data(), *pool_, config_.activations);
    matmul(w.wv, xn_.data(), n, v_.data(), *pool_, config_.activations);
    if (c.qkv_bias) {
      add_bias(q_.data(), w.bq, n);
      add_bias(k_.data(), w.bk, n);
      add_bias(v_.data(), w.bv, n);
    }
    for (int64_t t = 0; t < n; ++t) {
      float* qt = &q_[t * q_dim];
      float* kt = &k_[t * kv_dim];
      if (c.qk_norm) {
        for (int h = 0; h < c.n_heads; ++h) rms_norm(qt + h * hd, w.q_norm.data(), hd, c.rms_eps, qt + h * hd);
        for (int h = 0; h < c.n_kv_heads; ++h) rms_norm(kt + h * hd, w.k_norm.data(), hd, c.rms_eps, kt + h * hd);
      }
      apply_rope(qt, c.n_heads, hd, c.rope_layout, &cos_[t * half], &sin_[t * half]);
      apply_rope(kt, c.n_kv_heads, hd, c.rope_layout, &cos_[t * half], &sin_[t * half]);
    }
    if (config_.capture_queries)
      last_queries_[layer].assign(q_.begin() + (n - 1) * q_dim, q_.begin() + n * q_dim);
    cache_->write(seq_, layer, k_.data(), v_.data(), n);
    if (n == 1)
      attention::decode_attention(*cache_, seq_, layer, shape, q_.data(), pos0 + 1, attn_.data(),
                                  pool_.get());
    else
      attention::prefill_attention(*cache_, seq_, layer, shape, q_.data(), pos0, n, attn_.data(),
                                   pool_.get());
    matmul(w.wo, attn_.data(), n, xn_.data(), *pool_, config_.activations);
    for (int64_t i = 0; i < n * dim; ++i) x_[i] += xn_[i];

    for (int64_t t = 0; t < n; ++t)
      rms_norm(&x_[t * dim], w.ffn_norm.data(), dim, c.rms_eps, &xn_[t * dim]);
    matmul(w.w_gate, xn_.data(), n, gate_.data(), *pool_, config_.activations);
    matmul(w.w_up, xn_.data(), n, up_.data(), *pool_, config_.activations);
    for (int64_t i = 0; i < n * c.ffn_dim; ++i) {
      const float g = gate_[i];
      gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];  // SwiGLU (Shazeer 2020)
    }
    matmul(w.w_down, gate_.data(), n, xn_.data(), *pool_, config_.activations);
    for (int64_t i = 0; i < n * dim; ++i) x_[i] += xn_[i];
  }
  cache_->commit(seq_, n);

  if (all_logits) {
    for (int64_t t = 0; t < n; ++t)
      rms_norm(&x_[t * dim], model_.output_norm().data(), dim, c.rms_eps, &xn_[t * dim]);
    matmul(model_.output(), xn_.data(), n, all_logits, *pool_, config_.activations);
    if (last_logits) memcpy(last_logits, all_logits + (n - 1) * c.n_vocab, sizeof(float) * c.n_vocab);
  } else if (last_logits) {
    rms_norm(&x_[(n - 1) * dim], model_.output_norm().data(), dim, c.rms_eps, xn_.data());
    matmul(model_.output(), xn_.data(), 1, last_logits, *pool_, config_.activations);
  }
}

}  // namespace certkv::model
