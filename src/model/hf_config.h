// The fields of a Hugging Face config.json that a Llama-family forward pass needs.
// Absent optional fields take the defaults of transformers' LlamaConfig; every error is a
// certkv::Error naming the file and the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace certkv::model {

// config.json "rope_scaling" (for example Llama 3.1: rope_type "llama3", factor 8,
// low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192).
struct HfRopeScaling {
  std::string rope_type;  // "rope_type", or the older key "type"
  double factor = 1.0;
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;
  std::optional<int64_t> original_max_position_embeddings;
};

struct HfConfig {
  std::vector<std::string> architectures;  // e.g. {"LlamaForCausalLM"}; may be empty
  int64_t hidden_size = 0;                 // required
  int64_t intermediate_size = 0;           // required
  int64_t num_hidden_layers = 0;           // required
  int64_t num_attention_heads = 0;         // required
  int64_t num_key_value_heads = 0;         // default: num_attention_heads
  int64_t head_dim = 0;                    // default: hidden_size / num_attention_heads
  int64_t vocab_size = 0;                  // required
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool rope_theta_declared = false;  // the file states rope_theta
  bool tie_word_embeddings = false;
  std::optional<HfRopeScaling> rope_scaling;  // nullopt when absent or null
};

// Parses config.json text; `source_name` is used in errors (kCorrupt for malformed JSON, a
// missing required field, a field of the wrong type or an inconsistent value such as
// num_attention_heads not a multiple of num_key_value_heads).
HfConfig parse_hf_config(std::string_view json_text, const std::string& source_name);

// Reads and parses the file at `path`: kNotFound when it does not exist, kIo when unreadable.
HfConfig read_hf_config(const std::string& path);

}  // namespace certkv::model
