// certkv C++ API: RAII owners over the C API of certkv.h. Failures throw certkv::ApiError with
// the status and the message of certkv_last_error().
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "certkv/certkv.h"

namespace certkv {

class ApiError : public std::runtime_error {
 public:
  ApiError(certkv_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  certkv_status status() const { return status_; }

 private:
  certkv_status status_;
};

inline void check(certkv_status status) {
  if (status != CERTKV_OK) throw ApiError(status, certkv_last_error());
}

class Model {
 public:
  explicit Model(const std::string& path) { check(certkv_model_load(path.c_str(), &model_)); }
  Model(const std::string& checkpoint, const std::string& tokenizer) {
    check(certkv_model_load_llama2c(checkpoint.c_str(), tokenizer.c_str(), &model_));
  }
  ~Model() { certkv_model_free(model_); }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const certkv_model* get() const { return model_; }
  certkv_model_info info() const {
    certkv_model_info i;
    check(certkv_model_get_info(model_, &i));
    return i;
  }
  std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const {
    std::vector<int32_t> ids(text.size() + 8);
    int32_t n = 0;
    certkv_status s = certkv_tokenize(model_, text.data(), text.size(), add_special, parse_special,
                                      ids.data(), int32_t(ids.size()), &n);
    if (s == CERTKV_ERR_OUT_OF_RANGE && n > int32_t(ids.size())) {
      ids.resize(size_t(n));
      s = certkv_tokenize(model_, text.data(), text.size(), add_special, parse_special, ids.data(),
                          int32_t(ids.size()), &n);
    }
    check(s);
    ids.resize(size_t(n));
    return ids;
  }
  std::string piece(int32_t token) const {
    std::string out(64, '\0');
    size_t n = 0;
    certkv_status s = certkv_token_to_piece(model_, token, out.data(), out.size(), &n);
    if (s == CERTKV_ERR_OUT_OF_RANGE && n > out.size()) {
      out.resize(n);
      s = certkv_token_to_piece(model_, token, out.data(), out.size(), &n);
    }
    check(s);
    out.resize(n);
    return out;
  }
  // certkv_detokenize: the text tokenize read, special tokens' text only when render_special.
  std::string detokenize(const std::vector<int32_t>& tokens, bool render_special = false) const {
    std::string out(tokens.size() * 8 + 16, '\0');
    size_t n = 0;
    certkv_status s = certkv_detokenize(model_, tokens.data(), tokens.size(), render_special, out.data(), out.size(), &n);
    if (s == CERTKV_ERR_OUT_OF_RANGE && n > out.size()) {
      out.resize(n);
      s = certkv_detokenize(model_, tokens.data(), tokens.size(), render_special, out.data(), out.size(), &n);
    }
    check(s);
    out.resize(n);
    return out;
  }
  bool is_end(int32_t token) const { return certkv_token_is_end(model_, token) != 0; }
  // certkv_tokenize_chat: the template's special tokens parsed, the messages' text as text.
  std::vector<int32_t> chat_tokens(const std::vector<certkv_chat_message>& messages, bool add_generation_prompt) const {
    std::vector<int32_t> ids(256);
    int32_t n = 0;
    certkv_status s = certkv_tokenize_chat(model_, messages.data(), messages.size(), add_generation_prompt,
                                           ids.data(), int32_t(ids.size()), &n);
    if (s == CERTKV_ERR_OUT_OF_RANGE && n > int32_t(ids.size())) {
      ids.resize(size_t(n));
      s = certkv_tokenize_chat(model_, messages.data(), messages.size(), add_generation_prompt, ids.data(),
                               int32_t(ids.size()), &n);
    }
    check(s);
    ids.resize(size_t(n));
    return ids;
  }
  std::string chat(const std::vector<certkv_chat_message>& messages, bool add_generation_prompt) const {
    size_t n = 0;
    std::string out(256, '\0');
    certkv_status s = certkv_apply_chat_template(model_, messages.data(), messages.size(),
                                                 add_generation_prompt, out.data(), out.size(), &n);
    if (s == CERTKV_ERR_OUT_OF_RANGE && n + 1 > out.size()) {
      out.resize(n + 1);
      s = certkv_apply_chat_template(model_, messages.data(), messages.size(),
                                     add_generation_prompt, out.data(), out.size(), &n);
    }
    check(s);
    out.resize(n);
    return out;
  }

 private:
  certkv_model* model_ = nullptr;
};

class Session {
 public:
  Session(const Model& model, const certkv_session_params& params) {
    check(certkv_session_create(model.get(), &params, &session_));
  }
  ~Session() { certkv_session_free(session_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  certkv_meter_stats meter_stats() const {
    certkv_meter_stats m;
    check(certkv_session_meter_stats(session_, &m));
    return m;
  }
  certkv_audit_stats audit_stats() const {
    certkv_audit_stats a;
    check(certkv_session_audit_stats(session_, &a));
    return a;
  }
  certkv_device_stats device_stats() const {
    certkv_device_stats s;
    check(certkv_session_device_stats(session_, &s));
    return s;
  }
  certkv_sparse_stats sparse_stats() const {
    certkv_sparse_stats s;
    check(certkv_session_sparse_stats(session_, &s));
    return s;
  }
  certkv_sparse_audit_stats sparse_audit_stats() const {
    certkv_sparse_audit_stats a;
    check(certkv_session_sparse_audit_stats(session_, &a));
    return a;
  }
  certkv_session* get() { return session_; }
  const certkv_session* get() const { return session_; }
  int64_t n_past() const { return certkv_session_n_past(session_); }
  // logits: [n_vocab] or null; all_logits: [tokens.size()][n_vocab] or null.
  void prefill(const std::vector<int32_t>& tokens, float* logits, float* all_logits = nullptr,
               certkv_progress_fn progress = nullptr, void* user = nullptr) {
    check(certkv_session_prefill(session_, tokens.data(), int32_t(tokens.size()), logits,
                                 all_logits, progress, user));
  }
  void decode(int32_t token, float* logits) { check(certkv_session_decode(session_, token, logits)); }
  void reset() { check(certkv_session_reset(session_)); }
  certkv_kv_stats kv_stats() const {
    certkv_kv_stats s;
    check(certkv_session_kv_stats(session_, &s));
    return s;
  }

 private:
  certkv_session* session_ = nullptr;
};

}  // namespace certkv
