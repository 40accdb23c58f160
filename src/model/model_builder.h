// Internal to the model layer: assembles a Model from any weight source (GGUF, Hugging Face
// folder, llama2.c checkpoint), checking the configuration before weights are attached.
#pragma once

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/safetensors.h"
#include "model/gguf.h"
#include "model/matmul_tiles.h"
#include "model/model.h"

namespace certkv::model {

// One tensor as a weight source holds it. dims in ggml order: dims[0] is the contiguous one
// (a Hugging Face [out, in] matrix is dims {in, out}).
struct TensorView {
  format::GgmlType type = format::GgmlType::kF32;
  std::vector<int64_t> dims;
  const uint8_t* data = nullptr;
};

// Tensors of one file, looked up by name.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // Used in error messages.
  virtual const std::string& source_name() const = 0;
  // nullopt when absent; an Error for a tensor whose type cannot be used as a weight.
  virtual std::optional<TensorView> find(const std::string& name) const = 0;
};

// Tensor names of one file convention; "{}" stands for the layer index.
struct TensorNames {
  const char* token_embd;
  const char* output_norm;
  const char* output;
  const char* attn_norm;
  const char* ffn_norm;
  const char* wq;
  const char* wk;
  const char* wv;
  const char* wo;
  const char* w_gate;
  const char* w_up;
  const char* w_down;
  const char* bq;
  const char* bk;
  const char* bv;
  const char* q_norm;
  const char* k_norm;
};

extern const TensorNames kGgufTensorNames;
extern const TensorNames kHfTensorNames;

// Fills a Model from any source; checks shapes against the config as weights arrive.
class ModelBuilder {
 public:
  explicit ModelBuilder(std::string path) : model_(new Model()) { model_->path_ = std::move(path); }

  Model& model() { return *model_; }
  ModelConfig& config() { return model_->config_; }

  std::unique_ptr<Model> finish() {
    ModelConfig& c = model_->config_;
    if (!model_->tokenizer_) fail(StatusCode::kCorrupt, model_->path_ + ": no tokenizer");
    if (model_->tokenizer_->n_vocab() < c.n_vocab)
      fail(StatusCode::kCorrupt, model_->path_ + ": tokenizer has " +
                                     std::to_string(model_->tokenizer_->n_vocab()) +
                                     " tokens but the embedding has " + std::to_string(c.n_vocab));
    compute_rope_frequencies(nullptr);
    attach_matmul_tiles();
    return std::move(model_);
  }

  // With the AMX tile path (model/matmul_tiles.h): each matrix of a type it takes is repacked
  // once, the copy owned by the model, so that every product of it runs on tiles.
  void attach_matmul_tiles() {
    if (!matmul_tiles_available()) return;
    auto attach = [&](WeightMatrix& w) {
      if (!matmul_tiles_fit(w)) return;
      std::vector<uint8_t>& tiles = model_->owned_.emplace_back(matmul_tiles_bytes(w));
      tile_weights(w, tiles.data());
      w.tiles = tiles.data();
    };
    for (LayerWeights& l : model_->layers_)
      for (WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) attach(*w);
    attach(model_->output_);
  }

  void check_config() {
    const ModelConfig& c = model_->config_;
    const std::string& p = model_->path_;
    auto positive = [&](int64_t v, const char* what) {
      if (v <= 0 || v > (int64_t(1) << 24))
        fail(StatusCode::kCorrupt, p + ": " + what + " = " + std::to_string(v) + " is not valid");
    };
    positive(c.n_layers, "n_layers");
    positive(c.dim, "embedding dim");
    positive(c.n_heads, "n_heads");
    positive(c.n_kv_heads, "n_kv_heads");
    positive(c.head_dim, "head_dim");
    positive(c.ffn_dim, "ffn dim");
    positive(c.n_vocab, "vocab size");
    if (c.n_heads % c.n_kv_heads != 0)
      fail(StatusCode::kUnsupported, p + ": n_heads " + std::to_string(c.n_heads) +
                                         " is not a multiple of n_kv_heads " +
                                         std::to_string(c.n_kv_heads));
    if (c.head_dim % 2 != 0 || c.head_dim % 8 != 0 || c.head_dim > 256)
      fail(StatusCode::kUnsupported,
           p + ": head_dim " + std::to_string(c.head_dim) + " is unsupported (multiple of 8, <= 256)");
    if (!(c.rope_theta > 0.f)) fail(StatusCode::kCorrupt, p + ": RoPE theta must be positive");
    if (!(c.rms_eps > 0.f)) fail(StatusCode::kCorrupt, p + ": RMS norm epsilon must be positive");
  }

  // rope_freqs: optional per-frequency divisors (GGUF's rope_freqs.weight, Llama 3 scaling).
  void compute_rope_frequencies(const std::vector<float>* rope_freqs) {
    ModelConfig& c = model_->config_;
    if (rope_freqs == nullptr && !model_->rope_inv_freq_.empty()) return;
    const int half = c.head_dim / 2;
    std::vector<float> inv(half);
    for (int j = 0; j < half; ++j) {
      double f = std::pow(double(c.rope_theta), -2.0 * j / double(c.head_dim));
      const RopeScaling& s = c.rope_scaling;
      if (s.type == RopeScalingType::kLinear) {
        f /= s.factor;
      } else if (s.type == RopeScalingType::kLlama3) {
        // Llama 3.1 frequency-dependent scaling: long wavelengths are slowed by `factor`, short
        // ones kept, a smooth ramp in between.
        const double wavelen = 2 * M_PI / f;
        const double low_wavelen = double(s.original_context) / s.low_freq_factor;
        const double high_wavelen = double(s.original_context) / s.high_freq_factor;
        if (wavelen > low_wavelen) {
          f /= s.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (double(s.original_context) / wavelen - s.low_freq_factor) /
                                (s.high_freq_factor - s.low_freq_factor);
          f = (1 - smooth) * f / s.factor + smooth * f;
        }
      }
      if (rope_freqs) f /= (*rope_freqs)[j];
      inv[j] = float(f);
    }
    model_->rope_inv_freq_ = std::move(inv);
  }

  // Attaches every weight of the Llama-family block from `source`, checking shapes and types
  // against the configuration (already set, with n_vocab). The output matrix is tied to the
  // embedding when `source` has none.
  void load_weights(const TensorSource& source, const TensorNames& names);

  void set_tokenizer(std::unique_ptr<Tokenizer> t) { model_->tokenizer_ = std::move(t); }
  void own_gguf(std::unique_ptr<GgufFile> f) { model_->gguf_ = std::move(f); }
  const format::SafetensorsFile* own_safetensors(std::unique_ptr<format::SafetensorsFile> f) {
    model_->safetensors_.push_back(std::move(f));
    return model_->safetensors_.back().get();
  }
  std::vector<uint8_t>& own_buffer(size_t bytes) {
    model_->owned_.emplace_back(bytes);
    return model_->owned_.back();
  }
  WeightMatrix& token_embd() { return model_->token_embd_; }
  WeightMatrix& output() { return model_->output_; }
  std::vector<float>& output_norm() { return model_->output_norm_; }
  std::vector<LayerWeights>& layers() { return model_->layers_; }

 private:
  std::unique_ptr<Model> model_;
};

}  // namespace certkv::model
