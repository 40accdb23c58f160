#include "model/model.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/status.h"
#include "format/safetensors.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/gguf.h"
#include "model/hf_loader.h"
#include "model/model_builder.h"

namespace certkv::model {

const char* rope_layout_name(RopeLayout layout) {
  return layout == RopeLayout::kInterleaved ? "interleaved" : "half-split";
}

float ModelConfig::attention_scale() const { return 1.0f / std::sqrt(float(head_dim)); }

Model::~Model() = default;

std::string Model::weight_type_summary() const {
  std::map<std::string, int> count;
  for (const auto& l : layers_)
    for (const WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      ++count[ggml_type_name(w->type)];
  std::string best;
  int best_n = -1;
  for (const auto& [name, n] : count)
    if (n > best_n) best = name, best_n = n;
  return best;
}

uint64_t Model::weight_bytes() const {
  auto bytes = [](const WeightMatrix& w) { return uint64_t(w.row_bytes) * uint64_t(w.n_out); };
  uint64_t total = bytes(token_embd_);
  if (output_.data != token_embd_.data) total += bytes(output_);
  for (const auto& l : layers_) {
    for (const WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      total += bytes(*w);
    total += 4 * (l.attn_norm.size() + l.ffn_norm.size() + l.bq.size() + l.bk.size() +
                  l.bv.size() + l.q_norm.size() + l.k_norm.size());
  }
  return total + 4 * output_norm_.size();
}

const TensorNames kGgufTensorNames = {
    "token_embd.weight",        "output_norm.weight",       "output.weight",
    "blk.{}.attn_norm.weight",  "blk.{}.ffn_norm.weight",   "blk.{}.attn_q.weight",
    "blk.{}.attn_k.weight",     "blk.{}.attn_v.weight",     "blk.{}.attn_output.weight",
    "blk.{}.ffn_gate.weight",   "blk.{}.ffn_up.weight",     "blk.{}.ffn_down.weight",
    "blk.{}.attn_q.bias",       "blk.{}.attn_k.bias",       "blk.{}.attn_v.bias",
    "blk.{}.attn_q_norm.weight", "blk.{}.attn_k_norm.weight",
};

const TensorNames kHfTensorNames = {
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "model.layers.{}.input_layernorm.weight",
    "model.layers.{}.post_attention_layernorm.weight",
    "model.layers.{}.self_attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight",
    "model.layers.{}.mlp.gate_proj.weight",
    "model.layers.{}.mlp.up_proj.weight",
    "model.layers.{}.mlp.down_proj.weight",
    "model.layers.{}.self_attn.q_proj.bias",
    "model.layers.{}.self_attn.k_proj.bias",
    "model.layers.{}.self_attn.v_proj.bias",
    "model.layers.{}.self_attn.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight",
};

namespace {

std::string layer_name(const char* pattern, int layer) {
  std::string s = pattern;
  const size_t at = s.find("{}");
  if (at != std::string::npos) s.replace(at, 2, std::to_string(layer));
  return s;
}

}  // namespace

void ModelBuilder::load_weights(const TensorSource& source, const TensorNames& names) {
  const ModelConfig& c = model_->config_;
  const std::string& file = source.source_name();
  auto tensor = [&](const std::string& name) {
    std::optional<TensorView> t = source.find(name);
    if (!t) fail(StatusCode::kCorrupt, file + ": missing tensor " + name);
    return *t;
  };
  auto matrix = [&](const std::string& name, int64_t n_in, int64_t n_out) {
    const TensorView t = tensor(name);
    if (t.dims.size() != 2 || t.dims[0] != n_in || t.dims[1] != n_out)
      fail(StatusCode::kCorrupt, file + ": tensor " + name + " has the wrong shape (expected " +
                                     std::to_string(n_out) + " rows of " + std::to_string(n_in) + ")");
    if (!matmul_supports(t.type))
      fail(StatusCode::kUnsupported, file + ": tensor " + name + " has type " + ggml_type_name(t.type) +
                                         ", which certkv cannot multiply yet");
    return weight_matrix(t.type, t.data, n_in, n_out);
  };
  auto vector = [&](const std::string& name, int64_t n) {
    const TensorView t = tensor(name);
    int64_t elements = 1;
    for (int64_t d : t.dims) elements *= d;
    if (elements != n)
      fail(StatusCode::kCorrupt, file + ": tensor " + name + " has " + std::to_string(elements) +
                                     " elements, expected " + std::to_string(n));
    std::vector<float> out(static_cast<size_t>(n));
    dequantize_row_ref(t.type, t.data, out.data(), n);
    return out;
  };

  model_->token_embd_ = matrix(names.token_embd, c.dim, c.n_vocab);
  model_->output_norm_ = vector(names.output_norm, c.dim);
  const bool has_output = source.find(names.output).has_value();
  model_->config_.tied_embeddings = !has_output;
  model_->output_ = has_output ? matrix(names.output, c.dim, c.n_vocab) : model_->token_embd_;

  const int64_t q_dim = int64_t(c.n_heads) * c.head_dim;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  model_->layers_.resize(size_t(c.n_layers));
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = model_->layers_[size_t(i)];
    l.attn_norm = vector(layer_name(names.attn_norm, i), c.dim);
    l.ffn_norm = vector(layer_name(names.ffn_norm, i), c.dim);
    l.wq = matrix(layer_name(names.wq, i), c.dim, q_dim);
    l.wk = matrix(layer_name(names.wk, i), c.dim, kv_dim);
    l.wv = matrix(layer_name(names.wv, i), c.dim, kv_dim);
    l.wo = matrix(layer_name(names.wo, i), q_dim, c.dim);
    l.w_gate = matrix(layer_name(names.w_gate, i), c.dim, c.ffn_dim);
    l.w_up = matrix(layer_name(names.w_up, i), c.dim, c.ffn_dim);
    l.w_down = matrix(layer_name(names.w_down, i), c.ffn_dim, c.dim);
    if (c.qkv_bias) {
      l.bq = vector(layer_name(names.bq, i), q_dim);
      l.bk = vector(layer_name(names.bk, i), kv_dim);
      l.bv = vector(layer_name(names.bv, i), kv_dim);
    }
    if (c.qk_norm) {
      l.q_norm = vector(layer_name(names.q_norm, i), c.head_dim);
      l.k_norm = vector(layer_name(names.k_norm, i), c.head_dim);
    }
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// GGUF

class GgufLoader : public TensorSource {
 public:
  GgufLoader(ModelBuilder& b, const GgufFile& f) : b_(b), f_(f) {}

  const std::string& source_name() const override { return f_.name(); }
  std::optional<TensorView> find(const std::string& name) const override {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) return std::nullopt;
    return TensorView{t->type, t->dims, t->data};
  }

  void load() {
    ModelConfig& c = b_.config();
    const std::string arch = f_.get_string("general.architecture").value_or("");
    if (arch.empty()) fail(StatusCode::kCorrupt, f_.name() + ": no general.architecture");
    if (arch != "llama" && arch != "qwen2" && arch != "qwen3")
      fail(StatusCode::kUnsupported,
           f_.name() + ": architecture '" + arch +
               "' is not supported (supported: llama, qwen2, qwen3)");
    c.architecture = arch;
    c.name = f_.get_string("general.name").value_or(arch);
    c.n_layers = int(required_int(arch + ".block_count"));
    c.dim = int(required_int(arch + ".embedding_length"));
    c.ffn_dim = int(required_int(arch + ".feed_forward_length"));
    c.n_heads = int(required_int(arch + ".attention.head_count"));
    c.n_kv_heads = int(f_.get_int(arch + ".attention.head_count_kv").value_or(c.n_heads));
    c.context_length = f_.get_int(arch + ".context_length").value_or(2048);
    c.rms_eps = float(f_.get_float(arch + ".attention.layer_norm_rms_epsilon").value_or(1e-5));
    const std::optional<double> freq_base = f_.get_float(arch + ".rope.freq_base");
    c.rope_theta = float(freq_base.value_or(10000.0));
    c.rope_declared = freq_base.has_value();
    if (c.n_heads <= 0) fail(StatusCode::kCorrupt, f_.name() + ": head_count must be positive");
    c.head_dim = int(f_.get_int(arch + ".attention.key_length").value_or(c.dim / c.n_heads));
    const int64_t rope_dims = f_.get_int(arch + ".rope.dimension_count").value_or(c.head_dim);
    if (rope_dims != c.head_dim)
      fail(StatusCode::kUnsupported, f_.name() + ": partial RoPE (" + std::to_string(rope_dims) +
                                         " of " + std::to_string(c.head_dim) +
                                         " dims) is not supported");
    // ggml's llama conversion permutes q/k rows so RoPE rotates (2j, 2j+1); Qwen files keep the
    // Hugging Face order, rotated as (j, j + d/2) (llama.cpp's NEOX mode).
    c.rope_layout = arch == "llama" ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
    const std::string scaling = f_.get_string(arch + ".rope.scaling.type").value_or("none");
    if (scaling == "linear") {
      c.rope_scaling.type = RopeScalingType::kLinear;
      c.rope_scaling.factor = float(f_.get_float(arch + ".rope.scaling.factor").value_or(1.0));
      if (!(c.rope_scaling.factor > 0.f))
        fail(StatusCode::kCorrupt, f_.name() + ": rope.scaling.factor must be positive");
    } else if (scaling != "none" && !scaling.empty()) {
      fail(StatusCode::kUnsupported, f_.name() + ": RoPE scaling '" + scaling + "' is not supported");
    }
    c.qkv_bias = arch == "qwen2";
    c.qk_norm = arch == "qwen3";

    const GgufTensorInfo& embd = tensor("token_embd.weight");
    if (embd.dims.size() != 2 || embd.dims[0] != c.dim)
      fail(StatusCode::kCorrupt, f_.name() + ": token_embd.weight has the wrong shape");
    c.n_vocab = int(embd.dims[1]);
    b_.check_config();

    b_.load_weights(*this, kGgufTensorNames);
    if (f_.find_tensor("rope_freqs.weight")) {
      std::vector<float> freqs = vector("rope_freqs.weight", c.head_dim / 2);
      for (float v : freqs)
        if (!(v > 0.f)) fail(StatusCode::kCorrupt, f_.name() + ": rope_freqs.weight must be positive");
      b_.compute_rope_frequencies(&freqs);
    }
    b_.set_tokenizer(std::make_unique<Tokenizer>(vocab_from_gguf(f_)));
  }

 private:
  int64_t required_int(const std::string& key) {
    auto v = f_.get_int(key);
    if (!v) fail(StatusCode::kCorrupt, f_.name() + ": missing metadata key " + key);
    return *v;
  }

  const GgufTensorInfo& tensor(const std::string& name) {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) fail(StatusCode::kCorrupt, f_.name() + ": missing tensor " + name);
    return *t;
  }

  std::vector<float> vector(const std::string& name, int64_t n) {
    const GgufTensorInfo& t = tensor(name);
    if (t.n_elements() != n)
      fail(StatusCode::kCorrupt, f_.name() + ": tensor " + name + " has " +
                                     std::to_string(t.n_elements()) + " elements, expected " +
                                     std::to_string(n));
    std::vector<float> out(n);
    dequantize_row_ref(t.type, t.data, out.data(), n);
    return out;
  }

  ModelBuilder& b_;
  const GgufFile& f_;
};

// ---------------------------------------------------------------------------------------------
// llama2.c legacy checkpoint

std::vector<uint8_t> read_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(StatusCode::kNotFound, path + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(StatusCode::kIo, path + ": cannot open");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

// Converts llama2.c's tokenizer.bin (per token: float score, int32 length, bytes; spaces stand
// for SentencePiece's U+2581) into a SentencePiece vocabulary.
VocabSpec vocab_from_llama2c(const std::string& path, int n_vocab) {
  const std::vector<uint8_t> bytes = read_file(path);
  size_t pos = 0;
  auto take = [&](void* dst, size_t n) {
    if (n > bytes.size() - pos) fail(StatusCode::kCorrupt, path + ": truncated tokenizer file");
    memcpy(dst, bytes.data() + pos, n);
    pos += n;
  };
  int32_t max_len = 0;
  take(&max_len, 4);
  VocabSpec v;
  v.model = "llama";
  v.pre = "default";
  for (int i = 0; i < n_vocab; ++i) {
    float score;
    int32_t len;
    take(&score, 4);
    take(&len, 4);
    if (len < 0 || len > max_len) fail(StatusCode::kCorrupt, path + ": bad token length");
    std::string piece(size_t(len), '\0');
    take(piece.data(), size_t(len));
    int32_t type = 1;
    if (i == 0) {
      piece = "<unk>", type = 2;
    } else if (i == 1) {
      piece = "<s>", type = 3;
    } else if (i == 2) {
      piece = "</s>", type = 3;
    } else if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece[5] == '>') {
      type = 6;
    } else {
      std::string spm;
      for (char ch : piece) spm += ch == ' ' ? std::string("\xe2\x96\x81") : std::string(1, ch);
      piece = spm;
    }
    v.tokens.push_back(piece);
    v.scores.push_back(score);
    v.token_types.push_back(type);
  }
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  v.add_bos = true;
  v.add_space_prefix = true;
  return v;
}

}  // namespace

std::unique_ptr<Model> load_llama2c(const std::string& checkpoint_path,
                                    const std::string& tokenizer_path) {
  ModelBuilder b(checkpoint_path);
  std::vector<uint8_t>& raw = b.own_buffer(0);
  raw = read_file(checkpoint_path);
  if (raw.size() < 28) fail(StatusCode::kCorrupt, checkpoint_path + ": too short for a header");
  int32_t h[7];
  memcpy(h, raw.data(), sizeof h);
  ModelConfig& c = b.config();
  c.architecture = "llama";
  c.name = std::filesystem::path(checkpoint_path).stem().string();
  c.dim = h[0];
  c.ffn_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.tied_embeddings = h[5] > 0;
  c.n_vocab = h[5] > 0 ? h[5] : -h[5];
  c.context_length = h[6];
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.rope_layout = RopeLayout::kInterleaved;
  c.rope_theta = 10000.f;
  c.rms_eps = 1e-5f;
  b.check_config();

  const int64_t L = c.n_layers, D = c.dim, F = c.ffn_dim, V = c.n_vocab;
  const int64_t kv_dim = int64_t(c.n_kv_heads) * c.head_dim;
  const int64_t floats_needed = V * D + L * D + L * D * D + 2 * L * kv_dim * D + L * D * D +
                                L * D + 3 * L * F * D + D +
                                int64_t(c.context_length) * c.head_dim +
                                (c.tied_embeddings ? 0 : V * D);
  if (uint64_t(raw.size() - 28) < uint64_t(floats_needed) * 4)
    fail(StatusCode::kCorrupt, checkpoint_path + ": file is shorter than its header implies");
  const uint8_t* p = raw.data() + 28;
  auto take_matrix = [&](int64_t n_in, int64_t n_out) {
    WeightMatrix w;
    w.type = format::GgmlType::kF32;
    w.data = p;
    w.n_in = n_in;
    w.n_out = n_out;
    w.row_bytes = size_t(n_in) * 4;
    p += n_in * n_out * 4;
    return w;
  };
  auto take_vector = [&](int64_t n) {
    std::vector<float> v(n);
    memcpy(v.data(), p, n * 4);
    p += n * 4;
    return v;
  };
  b.token_embd() = take_matrix(D, V);
  std::vector<LayerWeights>& layers = b.layers();
  layers.resize(L);
  for (auto& l : layers) l.attn_norm = take_vector(D);
  for (auto& l : layers) l.wq = take_matrix(D, D);
  for (auto& l : layers) l.wk = take_matrix(D, kv_dim);
  for (auto& l : layers) l.wv = take_matrix(D, kv_dim);
  for (auto& l : layers) l.wo = take_matrix(D, D);
  for (auto& l : layers) l.ffn_norm = take_vector(D);
  for (auto& l : layers) l.w_gate = take_matrix(D, F);
  for (auto& l : layers) l.w_down = take_matrix(F, D);
  for (auto& l : layers) l.w_up = take_matrix(D, F);
  b.output_norm() = take_vector(D);
  p += int64_t(c.context_length) * c.head_dim * 4;  // the two RoPE tables, recomputed instead
  b.output() = c.tied_embeddings ? b.token_embd() : take_matrix(D, V);
  b.set_tokenizer(std::make_unique<Tokenizer>(vocab_from_llama2c(tokenizer_path, c.n_vocab)));
  return b.finish();
}

std::unique_ptr<Model> load_model(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(StatusCode::kNotFound, path + ": no such file");
  if (std::filesystem::is_directory(path, ec)) {
    ModelBuilder b(path);
    load_hf_folder(b, path);
    return b.finish();
  }
  ModelBuilder b(path);
  std::unique_ptr<GgufFile> f = GgufFile::open(path);
  GgufLoader(b, *f).load();
  b.own_gguf(std::move(f));
  return b.finish();
}

}  // namespace certkv::model
