#include "model/hf_config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/status.h"
#include "format/json.h"

namespace certkv::model {
namespace {

using format::JsonValue;

class ConfigReader {
 public:
  ConfigReader(const JsonValue& object, const std::string& source, std::string prefix = "")
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  [[noreturn]] void error(const std::string& key, const std::string& what) const {
    fail(StatusCode::kCorrupt, "config '" + source_ + "': field '" + prefix_ + key + "' " + what);
  }

  // nullptr when the key is absent or null.
  const JsonValue* get(const std::string& key) const {
    const JsonValue* v = object_.find(key);
    return v == nullptr || v->is_null() ? nullptr : v;
  }

  std::optional<int64_t> optional_int(const std::string& key) const {
    const JsonValue* v = get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_integer()) error(key, std::string("is ") + describe(*v) + ", expected an integer");
    return v->as_int();
  }

  int64_t positive_int(const std::string& key, std::optional<int64_t> fallback) const {
    std::optional<int64_t> v = optional_int(key);
    if (!v) {
      if (!fallback) error(key, "is missing");
      v = fallback;
    }
    if (*v <= 0) error(key, "is " + std::to_string(*v) + ", expected a positive integer");
    return *v;
  }

  std::optional<double> optional_number(const std::string& key) const {
    const JsonValue* v = get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) error(key, std::string("is ") + describe(*v) + ", expected a number");
    return v->as_double();
  }

  double positive_number(const std::string& key, double fallback) const {
    const double v = optional_number(key).value_or(fallback);
    if (!(v > 0.0)) error(key, "is " + std::to_string(v) + ", expected a positive number");
    return v;
  }

  bool boolean(const std::string& key, bool fallback) const {
    const JsonValue* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_bool()) error(key, std::string("is ") + describe(*v) + ", expected true or false");
    return v->as_bool();
  }

  std::optional<std::string> optional_string(const std::string& key) const {
    const JsonValue* v = get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) error(key, std::string("is ") + describe(*v) + ", expected a string");
    return v->as_string();
  }

 private:
  static std::string describe(const JsonValue& v) {
    return std::string("a JSON ") + format::json_kind_name(v.kind());
  }

  const JsonValue& object_;
  const std::string& source_;
  std::string prefix_;
};

}  // namespace

HfConfig parse_hf_config(std::string_view json_text, const std::string& source_name) {
  const JsonValue root = format::parse_json(json_text, source_name);
  if (!root.is_object()) {
    fail(StatusCode::kCorrupt, "config '" + source_name + "' is not a JSON object");
  }
  const ConfigReader r(root, source_name);
  HfConfig c;
  if (const JsonValue* archs = r.get("architectures")) {
    if (!archs->is_array()) r.error("architectures", "is not an array");
    for (const JsonValue& a : archs->as_array()) {
      if (!a.is_string()) r.error("architectures", "holds a value that is not a string");
      c.architectures.push_back(a.as_string());
    }
  }
  c.hidden_size = r.positive_int("hidden_size", std::nullopt);
  c.intermediate_size = r.positive_int("intermediate_size", std::nullopt);
  c.num_hidden_layers = r.positive_int("num_hidden_layers", std::nullopt);
  c.num_attention_heads = r.positive_int("num_attention_heads", std::nullopt);
  c.num_key_value_heads = r.positive_int("num_key_value_heads", c.num_attention_heads);
  c.vocab_size = r.positive_int("vocab_size", std::nullopt);
  c.max_position_embeddings = r.positive_int("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = r.positive_number("rms_norm_eps", c.rms_norm_eps);
  c.rope_theta_declared = r.get("rope_theta") != nullptr;
  c.rope_theta = r.positive_number("rope_theta", c.rope_theta);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", c.tie_word_embeddings);

  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.error("num_key_value_heads", "(" + std::to_string(c.num_key_value_heads) +
                                       ") does not divide num_attention_heads (" +
                                       std::to_string(c.num_attention_heads) + ")");
  }
  if (r.optional_int("head_dim")) {
    c.head_dim = r.positive_int("head_dim", std::nullopt);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.error("head_dim", "is absent and hidden_size (" + std::to_string(c.hidden_size) +
                              ") is not a multiple of num_attention_heads (" +
                              std::to_string(c.num_attention_heads) + ")");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }

  if (const JsonValue* scaling = r.get("rope_scaling")) {
    if (!scaling->is_object()) r.error("rope_scaling", "is not an object");
    const ConfigReader s(*scaling, source_name, "rope_scaling.");
    HfRopeScaling rs;
    std::optional<std::string> type = s.optional_string("rope_type");
    if (!type) type = s.optional_string("type");
    if (!type) s.error("rope_type", "is missing (and so is 'type')");
    rs.rope_type = *type;
    rs.factor = s.positive_number("factor", rs.factor);
    rs.low_freq_factor = s.optional_number("low_freq_factor");
    rs.high_freq_factor = s.optional_number("high_freq_factor");
    rs.original_max_position_embeddings = s.optional_int("original_max_position_embeddings");
    c.rope_scaling = std::move(rs);
  }
  return c;
}

HfConfig read_hf_config(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      fail(StatusCode::kNotFound, "config '" + path + "' not found");
    }
    fail(StatusCode::kIo, "config '" + path + "': cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) fail(StatusCode::kIo, "config '" + path + "' is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(StatusCode::kIo, "config '" + path + "' cannot be opened");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(StatusCode::kIo, "config '" + path + "': read failed");
  return parse_hf_config(text, path);
}

}  // namespace certkv::model
