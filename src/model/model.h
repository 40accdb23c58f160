// A loaded Llama-family model: hyper-parameters, weight matrices (pointing into the mapped file
// where the format allows), and its vocabulary.
//
// Sources:
//   GGUF (llama, qwen2, qwen3 architectures)          load_model("x.gguf")
//   Hugging Face folder (config.json + *.safetensors  load_model("dir/"), tokenizer from the
//     with tokenizer.json)                              folder's tokenizer.json
//   llama2.c legacy checkpoint (+ its tokenizer .bin)  load_llama2c(checkpoint, tokenizer)
// Errors are certkv::Error naming the file and the problem (missing tensor, wrong shape,
// unsupported architecture or tensor type).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/matmul.h"
#include "model/tokenizer.h"

namespace certkv::format {
class SafetensorsFile;
}

namespace certkv::model {

class GgufFile;

// Which coordinates RoPE rotates together: (2j, 2j+1) as in the original Llama and ggml's
// "normal" mode, or (j, j + d/2) as in GPT-NeoX and Hugging Face's rotate_half.
enum class RopeLayout { kInterleaved, kHalfSplit };

const char* rope_layout_name(RopeLayout layout);

enum class RopeScalingType { kNone, kLinear, kLlama3 };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  float factor = 1.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int64_t original_context = 8192;
};

struct ModelConfig {
  std::string architecture;  // "llama", "qwen2", "qwen3"
  std::string name;
  int n_layers = 0;
  int dim = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int ffn_dim = 0;
  int n_vocab = 0;
  int64_t context_length = 0;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.f;
  // Whether the file states the RoPE base (GGUF rope.freq_base, config.json rope_theta); false for
  // llama2.c checkpoints, whose RoPE is implied by the format.
  bool rope_declared = false;
  RopeLayout rope_layout = RopeLayout::kInterleaved;
  RopeScaling rope_scaling;
  bool tied_embeddings = false;
  bool qkv_bias = false;  // Qwen2
  bool qk_norm = false;   // Qwen3: RMSNorm over each head of q and k before RoPE

  // Softmax scale of attention: 1 / sqrt(head_dim).
  float attention_scale() const;
};

struct LayerWeights {
  WeightMatrix wq, wk, wv, wo;
  WeightMatrix w_gate, w_up, w_down;
  std::vector<float> attn_norm, ffn_norm;   // [dim]
  std::vector<float> bq, bk, bv;            // [n_heads * head_dim], [n_kv_heads * head_dim] x2
  std::vector<float> q_norm, k_norm;        // [head_dim]
};

class Model {
 public:
  ~Model();
  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const std::string& path() const { return path_; }
  // "Q4_1", "F32", ...: the type of most weight matrices.
  std::string weight_type_summary() const;
  // Bytes of all weights as stored.
  uint64_t weight_bytes() const;

  const WeightMatrix& token_embedding() const { return token_embd_; }
  const WeightMatrix& output() const { return output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const LayerWeights& layer(int i) const { return layers_[i]; }
  // Inverse RoPE frequencies after scaling: [head_dim / 2].
  const std::vector<float>& rope_inv_freq() const { return rope_inv_freq_; }

 private:
  friend std::unique_ptr<Model> load_model(const std::string& path);
  friend std::unique_ptr<Model> load_llama2c(const std::string&, const std::string&);
  friend class ModelBuilder;
  Model() = default;

  std::string path_;
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<std::unique_ptr<format::SafetensorsFile>> safetensors_;
  std::vector<std::vector<uint8_t>> owned_;  // weights converted at load time
  WeightMatrix token_embd_{};
  WeightMatrix output_{};
  std::vector<float> output_norm_;
  std::vector<LayerWeights> layers_;
  std::vector<float> rope_inv_freq_;
};

// Loads a GGUF file or a Hugging Face model folder (by what the path is).
std::unique_ptr<Model> load_model(const std::string& path);

// llama2.c legacy checkpoint (float32) and its tokenizer file (tokenizer.bin format).
std::unique_ptr<Model> load_llama2c(const std::string& checkpoint_path,
                                    const std::string& tokenizer_path);

}  // namespace certkv::model
