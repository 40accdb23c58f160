// Chat prompt formatting. There is no Jinja interpreter: the template family is recognised from
// marker strings in tokenizer.chat_template (as llama.cpp's llm_chat_detect_template does) and
// the family's format is written out directly.
//   ChatML  <|im_start|>role\ncontent<|im_end|>\n ... (SmolLM2, Qwen). When the first message is
//           not a system message, the default system message that the template itself inserts
//           (a literal '<|im_start|>system\n...<|im_end|>' in the template text) is inserted too.
//   Llama 2 [INST] ... [/INST] with <<SYS>> system blocks; variants by template markers.
//   Llama 3 <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
//   Gemma   <start_of_turn>role\ncontent<end_of_turn>\n, "assistant" written as "model", system
//           text merged into the next user turn.
//   Plain   the fallback for an empty or unrecognised template: "role: content\n" lines and
//           "assistant:" as generation prompt.
// BOS is not written: Tokenizer::encode adds it when the model asks for it.
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "model/tokenizer.h"

namespace certkv::model {

struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatTemplateFamily { kChatMl, kLlama2, kLlama3, kGemma, kPlain };

const char* chat_template_family_name(ChatTemplateFamily family);

// What detection found in a template text.
struct ChatTemplateStyle {
  ChatTemplateFamily family = ChatTemplateFamily::kPlain;
  bool is_fallback = true;  // true when the text was empty or no family matched
  // ChatML: the template's default system message ("" when it has none).
  std::string default_system;
  // Llama 2 variants: <<SYS>> blocks supported; "<s>" before each later [INST]; contents trimmed.
  bool llama2_system_block = false;
  bool llama2_bos_in_history = false;
  bool llama2_strip = false;
};

ChatTemplateStyle detect_chat_template(const std::string& template_text);

struct ChatPrompt {
  std::string text;
  ChatTemplateStyle style;
  // Where the messages' own text (roles and contents) sits in `text`, in order: tokenize with
  // Tokenizer::encode(text, add_bos, true, given_spans) so that a special token's text inside a
  // message stays text (a user cannot write the template's turn markers).
  std::vector<TextSpan> given_spans;
};

// Formats `messages` in the family of spec.chat_template; add_generation_prompt appends the
// assistant header (no effect for Llama 2, whose prompt ends with [/INST]).
ChatPrompt format_chat(const VocabSpec& spec, const std::vector<ChatMessage>& messages,
                       bool add_generation_prompt);

// The tokens of format_chat(spec, messages, add_generation_prompt): the template's special
// tokens parsed, the messages' text as text; BOS when the model asks for it.
std::vector<int32_t> tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                                   bool add_generation_prompt);

// format_chat(...).text; use format_chat to learn whether the plain fallback was used.
std::string apply_chat_template(const VocabSpec& spec, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt);

}  // namespace certkv::model
