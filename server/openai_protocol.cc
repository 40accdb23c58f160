#include "openai_protocol.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace certkv::server {

OpenAiError invalid_field(const std::string& param, const std::string& message) {
  return OpenAiError(400, "invalid_request_error", "", param, param + ": " + message);
}

json error_body(const OpenAiError& e) {
  json err;
  err["message"] = e.what();
  err["type"] = e.type;
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return json{{"error", err}};
}

namespace {

double number_field(const json& body, const char* name, double lo, double hi) {
  const json& v = body.at(name);
  if (!v.is_number()) throw invalid_field(name, "expected a number, got " + v.dump());
  const double x = v.get<double>();
  if (!(x >= lo && x <= hi))
    throw invalid_field(name, "must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " + v.dump());
  return x;
}

int64_t integer_field(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json& v = body.at(name);
  if (!v.is_number_integer()) throw invalid_field(name, "expected an integer, got " + v.dump());
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  if (x < lo || x > hi)
    throw invalid_field(name, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
  return x;
}

bool bool_field(const json& body, const char* name) {
  const json& v = body.at(name);
  if (!v.is_boolean()) throw invalid_field(name, "expected true or false, got " + v.dump());
  return v.get<bool>();
}

bool present(const json& body, const char* name) { return body.contains(name) && !body.at(name).is_null(); }

// Message content: a string, or an array of parts of which the "text" ones are joined.
std::string message_content(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw invalid_field(param, "expected a string or an array of text parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string p = param + "[" + std::to_string(i) + "]";
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
        !part["text"].is_string())
      throw invalid_field(p, "only {\"type\": \"text\", \"text\": \"...\"} parts are supported");
    text += part["text"].get<std::string>();
  }
  return text;
}

// The text of a field, which the engine takes as a C string: a NUL inside it would cut it there.
std::string text_without_nul(std::string text, const std::string& param) {
  if (text.find('\0') != std::string::npos) throw invalid_field(param, "contains a NUL character (U+0000)");
  return text;
}

// Fields of OpenAI's request that would change the answer and that certkv does not implement:
// refused by name unless they hold their neutral value (what OpenAI does without them).
void refuse_unsupported_fields(const json& body) {
  auto number_is = [&](const char* name, double neutral) {
    return body[name].is_number() && body[name].get<double>() == neutral;
  };
  const struct {
    const char* name;
    bool neutral;
  } fields[] = {
      {"frequency_penalty", present(body, "frequency_penalty") && number_is("frequency_penalty", 0)},
      {"presence_penalty", present(body, "presence_penalty") && number_is("presence_penalty", 0)},
      {"repetition_penalty", present(body, "repetition_penalty") && number_is("repetition_penalty", 1)},
      {"min_p", present(body, "min_p") && number_is("min_p", 0)},
      {"best_of", present(body, "best_of") && number_is("best_of", 1)},
      {"logit_bias", present(body, "logit_bias") && body["logit_bias"].is_object() && body["logit_bias"].empty()},
      {"response_format", present(body, "response_format") && body["response_format"].is_object() &&
                              body["response_format"].value("type", json()) == "text"},
      {"tools", present(body, "tools") && body["tools"].is_array() && body["tools"].empty()},
      {"tool_choice", present(body, "tool_choice") && body["tool_choice"] == "none"},
  };
  for (const auto& f : fields)
    if (present(body, f.name) && !f.neutral)
      throw invalid_field(f.name, "is not supported (only its neutral value is accepted)");
}

}  // namespace

CompletionRequest parse_completion_request(const json& body, bool chat) {
  if (!body.is_object()) throw OpenAiError(400, "invalid_request_error", "", "", "the body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  r.sampler = certkv_sampler_default_params();
  r.sampler.temperature = 1.0f;  // OpenAI's default
  r.sampler.top_p = 1.0f;
  if (present(body, "model")) {
    if (!body["model"].is_string()) throw invalid_field("model", "expected a string");
    r.model = body["model"].get<std::string>();
  }
  if (chat) {
    if (!body.contains("messages")) throw invalid_field("messages", "is required");
    const json& messages = body["messages"];
    if (!messages.is_array() || messages.empty()) throw invalid_field("messages", "expected a non-empty array");
    for (size_t i = 0; i < messages.size(); ++i) {
      const std::string p = "messages[" + std::to_string(i) + "]";
      const json& m = messages[i];
      if (!m.is_object()) throw invalid_field(p, "expected an object");
      if (!m.contains("role") || !m["role"].is_string()) throw invalid_field(p + ".role", "expected a string");
      const std::string role = m["role"].get<std::string>();
      if (role != "system" && role != "user" && role != "assistant" && role != "developer")
        throw invalid_field(p + ".role", "expected system, developer, user or assistant, got '" + role + "'");
      if (!m.contains("content")) throw invalid_field(p + ".content", "is required");
      r.messages.push_back({role == "developer" ? "system" : role,
                            text_without_nul(message_content(m["content"], p + ".content"), p + ".content")});
    }
  } else {
    if (!body.contains("prompt")) throw invalid_field("prompt", "is required");
    const json& prompt = body["prompt"];
    if (prompt.is_string()) {
      r.prompt = text_without_nul(prompt.get<std::string>(), "prompt");
    } else if (prompt.is_array() && !prompt.empty() &&
               (prompt[0].is_number_integer() || (prompt.size() == 1 && prompt[0].is_array()))) {
      // Token ids, or a list of one list of them (what lm-evaluation-harness sends).
      const json& ids = prompt[0].is_array() ? prompt[0] : prompt;
      if (ids.empty()) throw invalid_field("prompt", "the token list is empty");
      for (const json& t : ids) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
          throw invalid_field("prompt", "a token list must hold non-negative integers");
        r.prompt_tokens.push_back(t.get<int32_t>());
      }
    } else if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_string()) {
      r.prompt = text_without_nul(prompt[0].get<std::string>(), "prompt");
    } else {
      throw invalid_field("prompt", "expected a string, a list of one string, a list of token ids, or a list "
                                    "of one such list (send several prompts as several requests)");
    }
  }
  // max_tokens 0 is taken with echo alone (the prompt and its log-probabilities, nothing generated).
  const bool echo = !chat && present(body, "echo") && body["echo"].is_boolean() && body["echo"].get<bool>();
  if (present(body, "max_tokens")) {
    r.max_tokens = int32_t(integer_field(body, "max_tokens", echo ? 0 : 1, INT32_MAX));
    if (*r.max_tokens == 0) {
      r.max_tokens_zero = true;
      r.max_tokens = 1;  // the engine computes one token, which the response leaves out
    }
  }
  if (chat && present(body, "max_completion_tokens"))
    r.max_tokens = int32_t(integer_field(body, "max_completion_tokens", 1, INT32_MAX));
  if (present(body, "temperature")) r.sampler.temperature = float(number_field(body, "temperature", 0, 2));
  if (present(body, "top_p")) {
    r.sampler.top_p = float(number_field(body, "top_p", 0, 1));
    if (!(r.sampler.top_p > 0)) throw invalid_field("top_p", "must be in (0, 1], got 0");
  }
  if (present(body, "top_k")) r.sampler.top_k = int32_t(integer_field(body, "top_k", 0, INT32_MAX));
  if (present(body, "seed")) {
    // Any 64-bit integer, as OpenAI's schema allows: negative ones and those above 2^63 - 1 are
    // read as their two's-complement bits (each a stream of its own).
    const json& seed = body["seed"];
    if (!seed.is_number_integer()) throw invalid_field("seed", "expected an integer, got " + seed.dump());
    r.sampler.seed = seed.is_number_unsigned() ? seed.get<uint64_t>() : uint64_t(seed.get<int64_t>());
  }
  if (present(body, "n") && integer_field(body, "n", 1, INT32_MAX) != 1)
    throw invalid_field("n", "only 1 choice per request is supported");
  if (present(body, "stop")) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      r.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= 4) {
      for (const json& s : stop) {
        if (!s.is_string()) throw invalid_field("stop", "expected a string or up to 4 strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      throw invalid_field("stop", "expected a string or up to 4 strings");
    }
    for (const std::string& s : r.stop) {
      if (s.empty()) throw invalid_field("stop", "a stop string is empty");
      text_without_nul(s, "stop");
    }
  }
  if (present(body, "ignore_eos")) r.ignore_eos = bool_field(body, "ignore_eos");
  if (present(body, "stream")) r.stream = bool_field(body, "stream");
  if (present(body, "stream_options")) {
    const json& so = body["stream_options"];
    if (!so.is_object()) throw invalid_field("stream_options", "expected an object");
    if (!r.stream) throw invalid_field("stream_options", "is only allowed with stream: true");
    if (present(so, "include_usage")) {
      if (!so["include_usage"].is_boolean())
        throw invalid_field("stream_options.include_usage", "expected true or false");
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  if (present(body, "certkv")) {
    const json& c = body["certkv"];
    if (!c.is_object()) throw invalid_field("certkv", "expected an object");
    if (present(c, "per_layer")) {
      if (!c["per_layer"].is_boolean()) throw invalid_field("certkv.per_layer", "expected true or false");
      r.per_layer = c["per_layer"].get<bool>();
    }
  }
  if (!chat && present(body, "echo")) {
    if (!body["echo"].is_boolean()) throw invalid_field("echo", "expected true or false");
    r.echo = body["echo"].get<bool>();
  }
  if (!chat && present(body, "suffix")) throw invalid_field("suffix", "insertion with a suffix is not supported");
  const std::string top_range = "[0, " + std::to_string(CERTKV_MAX_TOP_LOGPROBS) + "]";
  if (chat) {  // logprobs: true, top_logprobs: N
    if (present(body, "logprobs")) {
      if (!body["logprobs"].is_boolean()) throw invalid_field("logprobs", "expected true or false");
      if (body["logprobs"].get<bool>()) r.logprobs = 0;
    }
    if (present(body, "top_logprobs")) {
      const int32_t top = int32_t(integer_field(body, "top_logprobs", 0, CERTKV_MAX_TOP_LOGPROBS));
      if (r.logprobs < 0 && top > 0) throw invalid_field("top_logprobs", "needs logprobs: true");
      if (r.logprobs >= 0) r.logprobs = top;
    }
  } else {
    if (present(body, "logprobs") && !(body["logprobs"].is_boolean() && !body["logprobs"].get<bool>())) {  // logprobs: N
      if (!body["logprobs"].is_number_integer())
        throw invalid_field("logprobs", "expected an integer in " + top_range + " (alternatives per token)");
      r.logprobs = int32_t(integer_field(body, "logprobs", 0, CERTKV_MAX_TOP_LOGPROBS));
    }
    if (present(body, "top_logprobs"))
      throw invalid_field("top_logprobs", "is chat's: completions take logprobs N");
  }
  if (r.stream && r.echo) throw invalid_field("echo", "is not supported with stream: true (send the request without it)");
  refuse_unsupported_fields(body);
  return r;
}

std::string openai_finish_reason(const std::string& engine_reason) {
  if (engine_reason == "end" || engine_reason == "stop") return "stop";
  return engine_reason;
}

json usage_json(const GenerationResult& r, const CertificateContext& c) {
  json cert;
  cert["scheme"] = c.scheme;
  cert["meter_tier"] = c.meter_tier;
  cert["metered"] = r.metered;
  if (r.metered) {
    cert["tau"] = c.tau;
    cert["certified"] = c.tau < 1;  // tau >= 1 ranks risk instead of certifying
    cert["meter_cells"] = r.meter_cells;
    cert["meter_max"] = r.meter_max;
    cert["meter_p99"] = r.meter_p99;
    cert["coverage"] = r.coverage;
    cert["gate"] = c.gate;
    cert["gate_repairs"] = r.gate_repairs;
    if (!r.layers.empty()) {
      json layers = json::array();
      for (size_t i = 0; i < r.layers.size(); ++i) {
        const certkv_layer_meter& l = r.layers[i];
        layers.push_back({{"layer", i},
                          {"meter_max", l.meter_max},
                          {"meter_p99", l.meter_p99},
                          {"coverage", l.coverage},
                          {"meter_cells", l.cells},
                          {"gate_repairs", l.gate_repairs}});
      }
      cert["per_layer"] = layers;
    }
  }
  if (c.sparse) {
    cert["sparse_budget"] = r.sparse_budget;
    if (r.sparse_indexed_cells > 0) cert["sparse_estimated_mass"] = r.sparse_estimated_mass;
  }
  json bytes = json::object();
  for (const auto& [storage, n] : r.kv_bytes) bytes[storage] = n;
  cert["kv_bytes"] = bytes;
  cert["prefix_cache_tokens"] = r.shared_prompt_tokens;
  cert["preemptions"] = r.preemptions;
  return json{{"prompt_tokens", r.prompt_tokens},
              {"completion_tokens", r.generated_tokens},
              {"total_tokens", r.prompt_tokens + r.generated_tokens},
              {"certkv", cert}};
}

namespace {

// A token's text as a JSON string: its bytes when they are UTF-8, else "bytes:" and their escapes
// ("bytes:\\xe2\\x80"), as vLLM writes a piece that cuts a character (so two such pieces never
// become the same replaced string, or the same key of an object).
std::string token_string(const std::string& bytes) {
  try {
    (void)json(bytes).dump();
    return bytes;
  } catch (const json::exception&) {
    std::string out = "bytes:";
    char hex[8];
    for (unsigned char b : bytes) {
      std::snprintf(hex, sizeof hex, "\\x%02x", b);
      out += hex;
    }
    return out;
  }
}

json byte_list(const std::string& bytes) {
  json out = json::array();
  for (unsigned char b : bytes) out.push_back(int(b));
  return out;
}

// A log-probability as JSON: -inf (a token the model gives no mass) has no JSON number; -9999
// stands for it, as in OpenAI's and vLLM's answers.
json logprob_number(float x) { return std::isfinite(x) ? json(double(x)) : json(-9999.0); }

// Chat's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
json chat_logprobs(const std::vector<certkv_token_logprob>& generated, const TokenText& text) {
  json content = json::array();
  for (const certkv_token_logprob& e : generated) {
    json top = json::array();
    for (int32_t k = 0; k < e.n_top; ++k) {
      const std::string t = text(e.top_tokens[k]);
      top.push_back({{"token", token_string(t)}, {"logprob", logprob_number(e.top_logprobs[k])}, {"bytes", byte_list(t)}});
    }
    const std::string t = text(e.token);
    content.push_back(
        {{"token", token_string(t)}, {"logprob", logprob_number(e.logprob)}, {"bytes", byte_list(t)}, {"top_logprobs", top}});
  }
  return json{{"content", content}, {"refusal", nullptr}};
}

// Completions' logprobs: {tokens, token_logprobs, top_logprobs, text_offset}; with echo the
// prompt's tokens first (the first without a log-probability: null).
json completion_logprobs(const std::vector<int32_t>& prompt, const std::vector<certkv_token_logprob>* prompt_lp,
                         const std::vector<certkv_token_logprob>& generated, const TokenText& text,
                         size_t* text_offset = nullptr) {
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  size_t offset = text_offset ? *text_offset : 0;
  auto add = [&](int32_t token, const certkv_token_logprob* e) {
    const std::string t = text(token);
    tokens.push_back(token_string(t));
    offsets.push_back(offset);
    offset += t.size();
    if (!e) {
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      return;
    }
    token_logprobs.push_back(logprob_number(e->logprob));
    json top = json::object();
    for (int32_t k = 0; k < e->n_top; ++k) {
      const std::string alt = token_string(text(e->top_tokens[k]));
      if (!top.contains(alt)) top[alt] = logprob_number(e->top_logprobs[k]);  // pieces of equal text: the likelier
    }
    top_logprobs.push_back(top);
  };
  if (prompt_lp)
    for (size_t i = 0; i < prompt.size(); ++i) add(prompt[i], i == 0 || i - 1 >= prompt_lp->size() ? nullptr : &(*prompt_lp)[i - 1]);
  for (const certkv_token_logprob& e : generated) add(e.token, &e);
  if (text_offset) *text_offset = offset;
  return json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs}, {"text_offset", offsets}};
}

}  // namespace

json completion_response(const CompletionRequest& req, const std::string& id, int64_t created,
                         const std::string& model, const GenerationResult& r, const CertificateContext& c,
                         const std::vector<int32_t>& prompt, const std::string& prompt_text, const TokenText& token_text) {
  json choice{{"index", 0}, {"finish_reason", openai_finish_reason(r.finish_reason)}, {"logprobs", nullptr}};
  // max_tokens 0 (echo): the one token the engine computed is not part of the answer.
  static const std::vector<certkv_token_logprob> kNone;
  const std::vector<certkv_token_logprob>& generated = req.max_tokens_zero ? kNone : r.logprobs;
  const std::string text = req.max_tokens_zero ? std::string() : r.text;
  if (req.chat) {
    choice["message"] = json{{"role", "assistant"}, {"content", text}};
    if (req.logprobs >= 0 && token_text) choice["logprobs"] = chat_logprobs(generated, token_text);
  } else {
    // With log-probabilities the echoed prompt is its tokens' texts, so that text_offset indexes
    // the text returned (a BOS, a SentencePiece piece's space); without, the prompt as given.
    std::string echoed = prompt_text;
    if (req.echo && req.logprobs >= 0 && token_text) {
      echoed.clear();
      for (int32_t t : prompt) echoed += token_text(t);
    }
    choice["text"] = req.echo ? echoed + text : text;
    if (req.max_tokens_zero) choice["finish_reason"] = "length";
    if (req.logprobs >= 0 && token_text)
      choice["logprobs"] = completion_logprobs(prompt, req.echo ? &r.prompt_logprobs : nullptr, generated, token_text);
  }
  json usage = usage_json(r, c);
  if (req.max_tokens_zero) {
    usage["completion_tokens"] = 0;
    usage["total_tokens"] = r.prompt_tokens;
  }
  return json{{"id", id},
              {"object", req.chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array({choice})},
              {"usage", usage}};
}

json stream_logprobs(const CompletionRequest& req, const std::vector<certkv_token_logprob>& tokens,
                     const TokenText& token_text, size_t* text_offset) {
  return req.chat ? chat_logprobs(tokens, token_text) : completion_logprobs({}, nullptr, tokens, token_text, text_offset);
}

json completion_chunk(const CompletionRequest& req, const std::string& id, int64_t created,
                      const std::string& model, const std::string& text, bool first,
                      const std::string& finish_reason, const json& usage, const json& logprobs) {
  json choice{{"index", 0},
              {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)},
              {"logprobs", logprobs}};
  if (req.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  json chunk{{"id", id},
             {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
             {"created", created},
             {"model", model},
             {"choices", json::array({choice})}};
  if (!usage.is_null()) chunk["usage"] = usage;
  return chunk;
}

json usage_chunk(const CompletionRequest& req, const std::string& id, int64_t created,
                 const std::string& model, const json& usage) {
  return json{{"id", id},
              {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array()},
              {"usage", usage}};
}

}  // namespace certkv::server
