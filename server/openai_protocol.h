// OpenAI's request and response shapes for /v1/completions and /v1/chat/completions, and its
// error object. Parsing is separate from the engine: a parsed request still needs its prompt
// formatted (chat template) and tokenized.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "request_scheduler.h"

namespace certkv::server {

using nlohmann::json;

// An error answered in OpenAI's shape:
// {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct OpenAiError : std::runtime_error {
  OpenAiError(int http_status, std::string type, std::string code, std::string param, const std::string& message)
      : std::runtime_error(message),
        http_status(http_status),
        type(std::move(type)),
        code(std::move(code)),
        param(std::move(param)) {}
  int http_status;
  std::string type;   // "invalid_request_error", "authentication_error", "server_error", ...
  std::string code;   // "" for null
  std::string param;  // the field at fault; "" for null
};

// 400 naming the field.
OpenAiError invalid_field(const std::string& param, const std::string& message);
json error_body(const OpenAiError& e);

struct ChatMessage {
  std::string role;
  std::string content;
};

struct CompletionRequest {
  bool chat = false;
  std::string model;                     // "" when the client sent none
  std::vector<ChatMessage> messages;     // chat
  std::string prompt;                    // completions: text
  std::vector<int32_t> prompt_tokens;    // completions: a prompt given as token ids
  std::optional<int32_t> max_tokens;     // none: the rest of the context (chat) or 16
  certkv_sampler_params sampler{};
  std::vector<std::string> stop;
  bool ignore_eos = false;               // vLLM's and llama-server's extension: generate past
                                         // end-of-generation tokens, to max_tokens
  bool stream = false;
  bool include_usage = false;            // stream_options.include_usage
  bool per_layer = false;                // certkv.per_layer: the certificate per layer too
  // Log-probabilities: -1 none, else the alternatives per token (completions: logprobs N; chat:
  // logprobs true with top_logprobs N). echo (completions): the prompt precedes the text, and
  // with logprobs its tokens' log-probabilities precede the generated ones'.
  int32_t logprobs = -1;
  bool echo = false;
  bool max_tokens_zero = false;          // max_tokens 0 with echo: the prompt alone
};

// Throws OpenAiError (400) naming the field for anything malformed or unsupported.
CompletionRequest parse_completion_request(const json& body, bool chat);

// The scheme-level facts every certificate repeats.
struct CertificateContext {
  std::string scheme;
  std::string meter_tier;  // "none", "A", "B"
  double tau = 0;
  bool gate = false;
  bool sparse = false;
};

// usage: prompt/completion/total tokens and the certkv extension object.
json usage_json(const GenerationResult& r, const CertificateContext& c);
// "stop" for stop strings and end tokens, "length" at max_tokens.
std::string openai_finish_reason(const std::string& engine_reason);

// The bytes a token stands for (its piece), for log-probabilities.
using TokenText = std::function<std::string(int32_t)>;

// The non-streaming response. prompt: the request's tokens and text (echo); token_text for
// log-probabilities.
json completion_response(const CompletionRequest& req, const std::string& id, int64_t created,
                         const std::string& model, const GenerationResult& r, const CertificateContext& c,
                         const std::vector<int32_t>& prompt = {}, const std::string& prompt_text = "",
                         const TokenText& token_text = {});
// One streamed chunk: text (may be empty), finish_reason ("" for null), usage (null: none).
// logprobs: the chunk's choices[0].logprobs (null: none; stream_logprobs makes it).
json completion_chunk(const CompletionRequest& req, const std::string& id, int64_t created,
                      const std::string& model, const std::string& text, bool first,
                      const std::string& finish_reason, const json& usage, const json& logprobs = nullptr);
// A streamed chunk's logprobs for its tokens, in the request's shape (chat's content list, or
// completions' lists with text offsets from *text_offset, which it advances).
json stream_logprobs(const CompletionRequest& req, const std::vector<certkv_token_logprob>& tokens,
                     const TokenText& token_text, size_t* text_offset);
// The usage chunk of stream_options.include_usage: no choices.
json usage_chunk(const CompletionRequest& req, const std::string& id, int64_t created,
                 const std::string& model, const json& usage);

}  // namespace certkv::server
