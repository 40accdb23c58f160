#include "model/hf_loader.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "core/status.h"
#include "format/safetensors.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/hf_config.h"

namespace certkv::model {

namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(StatusCode::kIo, path.string() + ": cannot read");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

format::GgmlType dtype_to_ggml(const std::string& dtype, const std::string& tensor) {
  if (dtype == "F32") return format::GgmlType::kF32;
  if (dtype == "F16") return format::GgmlType::kF16;
  if (dtype == "BF16") return format::GgmlType::kBF16;
  fail(StatusCode::kUnsupported, "tensor " + tensor + " has dtype " + dtype +
                                     " (supported for weights: F32, F16, BF16)");
}

class HfLoader : public TensorSource {
 public:
  HfLoader(ModelBuilder& b, const std::string& dir) : b_(b), dir_(dir), dir_name_(dir) {}

  void load() {
    const HfConfig hf = read_hf_config((dir_ / "config.json").string());
    ModelConfig& c = b_.config();
    const std::string arch_class = hf.architectures.empty() ? "LlamaForCausalLM" : hf.architectures[0];
    if (arch_class == "LlamaForCausalLM" || arch_class == "MistralForCausalLM") {
      c.architecture = "llama";
    } else if (arch_class == "Qwen2ForCausalLM") {
      c.architecture = "qwen2";
    } else if (arch_class == "Qwen3ForCausalLM") {
      c.architecture = "qwen3";
    } else {
      fail(StatusCode::kUnsupported, (dir_ / "config.json").string() + ": architecture " +
                                         arch_class + " is not supported");
    }
    c.name = dir_.filename().string();
    if (c.name.empty()) c.name = dir_.parent_path().filename().string();
    c.n_layers = int(hf.num_hidden_layers);
    c.dim = int(hf.hidden_size);
    c.ffn_dim = int(hf.intermediate_size);
    c.n_heads = int(hf.num_attention_heads);
    c.n_kv_heads = int(hf.num_key_value_heads);
    c.head_dim = int(hf.head_dim);
    c.n_vocab = int(hf.vocab_size);
    c.context_length = hf.max_position_embeddings;
    c.rms_eps = float(hf.rms_norm_eps);
    c.rope_theta = float(hf.rope_theta);
    c.rope_declared = hf.rope_theta_declared;
    c.rope_layout = RopeLayout::kHalfSplit;  // transformers' rotate_half
    c.qkv_bias = c.architecture == "qwen2";
    c.qk_norm = c.architecture == "qwen3";
    if (hf.rope_scaling) {
      const HfRopeScaling& s = *hf.rope_scaling;
      if (s.rope_type == "linear") {
        c.rope_scaling.type = RopeScalingType::kLinear;
      } else if (s.rope_type == "llama3") {
        c.rope_scaling.type = RopeScalingType::kLlama3;
        c.rope_scaling.low_freq_factor = float(s.low_freq_factor.value_or(1.0));
        c.rope_scaling.high_freq_factor = float(s.high_freq_factor.value_or(4.0));
        c.rope_scaling.original_context = s.original_max_position_embeddings.value_or(8192);
        if (!(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor))
          fail(StatusCode::kCorrupt, (dir_ / "config.json").string() +
                                         ": rope_scaling high_freq_factor must exceed low_freq_factor");
      } else if (s.rope_type != "default" && !s.rope_type.empty()) {
        fail(StatusCode::kUnsupported, (dir_ / "config.json").string() + ": rope_scaling type '" +
                                           s.rope_type + "' is not supported");
      }
      c.rope_scaling.factor = float(s.factor);
      if (!(c.rope_scaling.factor > 0.f))
        fail(StatusCode::kCorrupt, (dir_ / "config.json").string() + ": rope_scaling factor must be positive");
    }
    b_.check_config();

    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir_))
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    if (files.empty()) fail(StatusCode::kNotFound, dir_.string() + ": no *.safetensors file");
    for (const fs::path& f : files)
      files_.push_back(b_.own_safetensors(format::SafetensorsFile::open(f.string())));

    b_.load_weights(*this, kHfTensorNames);
    if (!hf.tie_word_embeddings && c.tied_embeddings)
      fail(StatusCode::kCorrupt, dir_.string() + ": config.json says tie_word_embeddings false but there is no lm_head.weight");

    const fs::path tok_path = dir_ / "tokenizer.json";
    if (!fs::exists(tok_path)) fail(StatusCode::kNotFound, tok_path.string() + ": no such file");
    const format::JsonValue tok = format::parse_json(read_text(tok_path), tok_path.string());
    const fs::path cfg_path = dir_ / "tokenizer_config.json";
    format::JsonValue cfg;
    const bool has_cfg = fs::exists(cfg_path);
    if (has_cfg) cfg = format::parse_json(read_text(cfg_path), cfg_path.string());
    b_.set_tokenizer(std::make_unique<Tokenizer>(
        vocab_from_tokenizer_json(tok, has_cfg ? &cfg : nullptr, tok_path.string())));
  }

 private:
  const std::string& source_name() const override { return dir_name_; }
  // Safetensors shapes are [out, in]; TensorView dims are in ggml order.
  std::optional<TensorView> find(const std::string& name) const override {
    for (const format::SafetensorsFile* f : files_)
      if (const format::SafetensorsTensor* t = f->find(name)) {
        TensorView v;
        v.type = dtype_to_ggml(t->dtype, name);
        v.dims.assign(t->shape.rbegin(), t->shape.rend());
        v.data = t->data;
        return v;
      }
    return std::nullopt;
  }

  ModelBuilder& b_;
  fs::path dir_;
  std::string dir_name_;
  std::vector<const format::SafetensorsFile*> files_;
};

// A special token given in tokenizer_config.json as a string or as {"content": ...}.
std::string special_token_text(const format::JsonValue* cfg, const char* key) {
  if (!cfg) return "";
  const format::JsonValue* v = cfg->find(key);
  if (!v) return "";
  if (v->is_string()) return v->as_string();
  if (v->is_object())
    if (const format::JsonValue* content = v->find("content"); content && content->is_string())
      return content->as_string();
  return "";
}

// Every Split regex and every component type of a tokenizer.json pre_tokenizer, depth first.
void collect_pre_tokenizer(const format::JsonValue& v, std::vector<std::string>& types,
                           std::vector<std::string>& patterns, bool& individual_digits) {
  if (v.is_array()) {
    for (const format::JsonValue& item : v.as_array())
      collect_pre_tokenizer(item, types, patterns, individual_digits);
    return;
  }
  if (!v.is_object()) return;
  if (const format::JsonValue* t = v.find("type"); t && t->is_string()) types.push_back(t->as_string());
  if (const format::JsonValue* d = v.find("individual_digits"); d && d->is_bool() && d->as_bool())
    individual_digits = true;
  if (const format::JsonValue* pattern = v.find("pattern"))
    if (const format::JsonValue* r = pattern->find("Regex"); r && r->is_string()) patterns.push_back(r->as_string());
  if (const format::JsonValue* list = v.find("pretokenizers")) collect_pre_tokenizer(*list, types, patterns, individual_digits);
}

}  // namespace

// Maps a tokenizer.json pre_tokenizer onto the llama.cpp pre-tokenizer names
// (model/pretokenizer.h): single digits then ByteLevel is SmolLM's; a split regex with
// \p{N}{1,3} is Llama 3's; one with single \p{N} is Qwen2's; ByteLevel alone is GPT-2's.
std::string pre_tokenizer_name(const format::JsonValue* pre_tokenizer) {
  if (!pre_tokenizer) return "gpt-2";
  std::vector<std::string> types, patterns;
  bool individual_digits = false;
  collect_pre_tokenizer(*pre_tokenizer, types, patterns, individual_digits);
  for (const std::string& p : patterns) {
    if (p.find("\\p{N}{1,3}") != std::string::npos) return "llama-bpe";
    if (p.find("\\p{N}") != std::string::npos) return "qwen2";
  }
  if (individual_digits) return "smollm";
  return "gpt-2";
}

VocabSpec vocab_from_tokenizer_json(const format::JsonValue& tokenizer,
                                    const format::JsonValue* tokenizer_config,
                                    const std::string& source_name) {
  const format::JsonValue* model = tokenizer.find("model");
  const format::JsonValue* type = model ? model->find("type") : nullptr;
  if (!type || !type->is_string() || type->as_string() != "BPE")
    fail(StatusCode::kUnsupported, source_name + ": only BPE tokenizers are supported");
  const format::JsonValue* vocab = model->find("vocab");
  const format::JsonValue* merges = model->find("merges");
  if (!vocab || !vocab->is_object() || !merges || !merges->is_array())
    fail(StatusCode::kCorrupt, source_name + ": model.vocab or model.merges is missing");
  const format::JsonValue* byte_fallback = model->find("byte_fallback");
  if (byte_fallback && byte_fallback->is_bool() && byte_fallback->as_bool())
    fail(StatusCode::kUnsupported, source_name + ": byte-fallback (SentencePiece-style) BPE is not supported; use the GGUF file");

  VocabSpec spec;
  spec.model = "gpt2";
  int64_t max_id = -1;
  std::vector<std::pair<int64_t, std::string>> entries;
  for (const auto& [text, id] : vocab->as_object()) {
    if (!id.is_integer() || id.as_int() < 0 || id.as_int() > (1 << 24))
      fail(StatusCode::kCorrupt, source_name + ": bad id for token " + text);
    entries.emplace_back(id.as_int(), text);
    max_id = std::max(max_id, id.as_int());
  }
  std::vector<std::tuple<int64_t, std::string, bool>> added;
  if (const format::JsonValue* at = tokenizer.find("added_tokens"); at && at->is_array())
    for (const format::JsonValue& t : at->as_array()) {
      const format::JsonValue* id = t.find("id");
      const format::JsonValue* content = t.find("content");
      if (!id || !id->is_integer() || !content || !content->is_string() || id->as_int() < 0 ||
          id->as_int() > (1 << 24))
        fail(StatusCode::kCorrupt, source_name + ": malformed added_tokens entry");
      const format::JsonValue* special = t.find("special");
      added.emplace_back(id->as_int(), content->as_string(),
                         special && special->is_bool() && special->as_bool());
      max_id = std::max(max_id, id->as_int());
    }
  spec.tokens.assign(size_t(max_id + 1), "");
  spec.token_types.assign(size_t(max_id + 1), 1);
  std::vector<bool> filled(size_t(max_id + 1), false);
  for (const auto& [id, text] : entries) spec.tokens[id] = text, filled[id] = true;
  for (const auto& [id, text, special] : added) {
    spec.tokens[id] = text;
    spec.token_types[id] = special ? 3 : 4;  // control or user-defined
    filled[id] = true;
  }
  for (size_t i = 0; i < filled.size(); ++i)
    if (!filled[i]) spec.tokens[i] = "[UNUSED_" + std::to_string(i) + "]", spec.token_types[i] = 5;
  for (const format::JsonValue& m : merges->as_array()) {
    if (m.is_string()) {
      spec.merges.push_back(m.as_string());
    } else if (m.is_array() && m.as_array().size() == 2 && m.as_array()[0].is_string() &&
               m.as_array()[1].is_string()) {
      spec.merges.push_back(m.as_array()[0].as_string() + " " + m.as_array()[1].as_string());
    } else {
      fail(StatusCode::kCorrupt, source_name + ": malformed merge entry");
    }
  }
  spec.pre = pre_tokenizer_name(tokenizer.find("pre_tokenizer"));
  auto id_of = [&](const std::string& text) -> int32_t {
    if (text.empty()) return -1;
    for (size_t i = 0; i < spec.tokens.size(); ++i)
      if (spec.tokens[i] == text) return int32_t(i);
    return -1;
  };
  spec.bos = id_of(special_token_text(tokenizer_config, "bos_token"));
  spec.eos = id_of(special_token_text(tokenizer_config, "eos_token"));
  spec.unk = id_of(special_token_text(tokenizer_config, "unk_token"));
  spec.pad = id_of(special_token_text(tokenizer_config, "pad_token"));
  spec.add_bos = false;
  if (tokenizer_config)
    if (const format::JsonValue* v = tokenizer_config->find("add_bos_token"); v && v->is_bool())
      spec.add_bos = v->as_bool() && spec.bos >= 0;
  spec.add_space_prefix = false;
  if (tokenizer_config)
    if (const format::JsonValue* t = tokenizer_config->find("chat_template"); t && t->is_string())
      spec.chat_template = t->as_string();
  return spec;
}

void load_hf_folder(ModelBuilder& builder, const std::string& dir) { HfLoader(builder, dir).load(); }

}  // namespace certkv::model
