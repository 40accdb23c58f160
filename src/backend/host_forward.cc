#include "backend/host_forward.h"

#include <cmath>
#include <cstring>
#include <string>

#include "backend/forward_ops.h"
#include "core/status.h"
#include "model/dequant.h"
#include "model/matmul.h"

namespace certkv::backend {

using model::LayerWeights;
using model::ModelConfig;
using model::RopeLayout;
using model::WeightMatrix;

StepRows plan_step(std::span<const BatchItem> items, const model::ModelConfig& c, int64_t context_tokens,
                   const std::function<int64_t(cache::SeqId)>& length) {
  StepRows rows;
  rows.items = items;
  rows.row0.resize(items.size());
  rows.pos0.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchItem& it = items[i];
    const int64_t past = length(it.seq);
    for (size_t j = 0; j < i; ++j)
      if (items[j].seq == it.seq)
        fail(StatusCode::kInvalidArgument,
             "sequence " + std::to_string(it.seq) + " appears twice in one forward step");
    if (it.n < 1 || !it.tokens) fail(StatusCode::kInvalidArgument, "a forward item needs at least one token");
    if (past + it.n > context_tokens)
      fail(StatusCode::kOutOfRange, "the input (" + std::to_string(it.n) + " tokens, " + std::to_string(past) +
                                        " already in the cache) is longer than the context (" +
                                        std::to_string(context_tokens) + " tokens)");
    for (int64_t t = 0; t < it.n; ++t)
      if (it.tokens[t] < 0 || it.tokens[t] >= c.n_vocab)
        fail(StatusCode::kInvalidArgument, "token id " + std::to_string(it.tokens[t]) +
                                               " is outside the vocabulary (" + std::to_string(c.n_vocab) + ")");
    if (it.token) model::check_sampler_params(it.sampling);
    rows.row0[i] = rows.n_rows;
    rows.pos0[i] = past;
    rows.n_rows += it.n;
  }
  return rows;
}

HostForward::HostForward(const model::Model& model, ThreadPool& pool, model::ActivationFormat activations)
    : model_(model), pool_(pool), activations_(activations) {}

void HostForward::ensure_buffers(int64_t n) {
  if (n <= buffer_tokens_) return;
  const ModelConfig& c = model_.config();
  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  x_.resize(size_t(n * c.dim));
  xn_.resize(size_t(n * std::max<int64_t>(c.dim, q_dim)));
  q_.resize(size_t(n * q_dim));
  k_.resize(size_t(n * kv_dim));
  v_.resize(size_t(n * kv_dim));
  attn_.resize(size_t(n * q_dim));
  gate_.resize(size_t(n * c.ffn_dim));
  up_.resize(size_t(n * c.ffn_dim));
  cos_.resize(size_t(n * c.head_dim / 2));
  sin_.resize(size_t(n * c.head_dim / 2));
  buffer_tokens_ = n;
}

void HostForward::run(const StepRows& rows, const LayerAttention& attention) {
  const ModelConfig& c = model_.config();
  const std::span<const BatchItem> items = rows.items;
  const int64_t n_rows = rows.n_rows;
  if (n_rows == 0) return;
  ensure_buffers(n_rows);
  const int dim = c.dim;
  const int hd = c.head_dim;
  const int half = hd / 2;
  const int64_t q_dim = int64_t(c.n_heads) * hd;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * hd;

  const WeightMatrix& embd = model_.token_embedding();
  const std::vector<float>& inv_freq = model_.rope_inv_freq();
  for (size_t i = 0; i < items.size(); ++i)
    for (int64_t t = 0; t < items[i].n; ++t) {
      const int64_t r = rows.row0[i] + t;
      model::dequantize_row(embd.type, embd.data + size_t(items[i].tokens[t]) * embd.row_bytes,
                            &x_[size_t(r * dim)], dim);
      for (int j = 0; j < half; ++j) {
        const double angle = double(rows.pos0[i] + t) * inv_freq[size_t(j)];
        cos_[size_t(r * half + j)] = float(std::cos(angle));
        sin_[size_t(r * half + j)] = float(std::sin(angle));
      }
    }

  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& w = model_.layer(layer);
    for (int64_t t = 0; t < n_rows; ++t)
      rms_norm(&x_[size_t(t * dim)], w.attn_norm.data(), dim, c.rms_eps, &xn_[size_t(t * dim)]);
    const WeightMatrix qkv[3] = {w.wq, w.wk, w.wv};
    float* const qkv_out[3] = {q_.data(), k_.data(), v_.data()};
    model::matmul(qkv, xn_.data(), n_rows, qkv_out, pool_, activations_);
    if (c.qkv_bias) {
      add_bias(q_.data(), w.bq, n_rows);
      add_bias(k_.data(), w.bk, n_rows);
      add_bias(v_.data(), w.bv, n_rows);
    }
    for (int64_t t = 0; t < n_rows; ++t) {
      float* qt = &q_[size_t(t * q_dim)];
      float* kt = &k_[size_t(t * kv_dim)];
      if (c.qk_norm) {
        for (int h = 0; h < c.n_heads; ++h) rms_norm(qt + h * hd, w.q_norm.data(), hd, c.rms_eps, qt + h * hd);
        for (int h = 0; h < c.n_kv_heads; ++h) rms_norm(kt + h * hd, w.k_norm.data(), hd, c.rms_eps, kt + h * hd);
      }
      apply_rope(qt, c.n_heads, hd, c.rope_layout, &cos_[size_t(t * half)], &sin_[size_t(t * half)]);
      apply_rope(kt, c.n_kv_heads, hd, c.rope_layout, &cos_[size_t(t * half)], &sin_[size_t(t * half)]);
    }
    attention(layer, q_.data(), k_.data(), v_.data(), attn_.data());
    model::matmul(w.wo, attn_.data(), n_rows, xn_.data(), pool_, activations_);
    for (int64_t i = 0; i < n_rows * dim; ++i) x_[size_t(i)] += xn_[size_t(i)];

    for (int64_t t = 0; t < n_rows; ++t)
      rms_norm(&x_[size_t(t * dim)], w.ffn_norm.data(), dim, c.rms_eps, &xn_[size_t(t * dim)]);
    const WeightMatrix gate_up[2] = {w.w_gate, w.w_up};
    float* const gate_up_out[2] = {gate_.data(), up_.data()};
    model::matmul(gate_up, xn_.data(), n_rows, gate_up_out, pool_, activations_);
    swiglu_rows(gate_.data(), up_.data(), n_rows, c.ffn_dim);
    model::matmul(w.w_down, gate_.data(), n_rows, xn_.data(), pool_, activations_);
    for (int64_t i = 0; i < n_rows * dim; ++i) x_[size_t(i)] += xn_[size_t(i)];
  }

  // Logits: the items that want every row get their own product (straight into their buffer);
  // the last rows of the others share one. Then the tokens the items draw.
  const float* out_norm = model_.output_norm().data();
  std::vector<size_t> last_only;
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchItem& it = items[i];
    if (it.all_logits) {
      for (int64_t t = 0; t < it.n; ++t)
        rms_norm(&x_[size_t((rows.row0[i] + t) * dim)], out_norm, dim, c.rms_eps, &xn_[size_t(t * dim)]);
      model::matmul(model_.output(), xn_.data(), it.n, it.all_logits, pool_, activations_);
      if (it.last_logits)
        std::memcpy(it.last_logits, it.all_logits + (it.n - 1) * c.n_vocab, sizeof(float) * size_t(c.n_vocab));
    } else if (it.last_logits || it.token) {
      last_only.push_back(i);
    }
  }
  const auto last_row_logits = [&](size_t i, size_t j) -> const float* {
    if (items[i].all_logits) return items[i].all_logits + (items[i].n - 1) * c.n_vocab;
    return &logits_[j * size_t(c.n_vocab)];
  };
  if (!last_only.empty()) {
    const int64_t m = int64_t(last_only.size());
    for (int64_t j = 0; j < m; ++j) {
      const size_t i = last_only[size_t(j)];
      rms_norm(&x_[size_t((rows.row0[i] + items[i].n - 1) * dim)], out_norm, dim, c.rms_eps, &xn_[size_t(j * dim)]);
    }
    logits_.resize(size_t(m) * size_t(c.n_vocab));
    model::matmul(model_.output(), xn_.data(), m, logits_.data(), pool_, activations_);
    for (int64_t j = 0; j < m; ++j)
      if (float* dst = items[last_only[size_t(j)]].last_logits)
        std::memcpy(dst, &logits_[size_t(j) * size_t(c.n_vocab)], sizeof(float) * size_t(c.n_vocab));
  }
  size_t j = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchItem& it = items[i];
    const bool in_last_only = j < last_only.size() && last_only[j] == i;
    if (it.token)
      *it.token = model::sample_token(last_row_logits(i, j), c.n_vocab, it.sampling,
                                      model::sample_uniform(it.sampling.seed, it.draw), &candidates_);
    if (in_last_only) ++j;
  }
}

}  // namespace certkv::backend
