#include "model/chat_template.h"

#include <cctype>
#include <string_view>
#include <utility>

namespace certkv::model {

namespace {

bool contains(const std::string& text, const char* needle) {
  return text.find(needle) != std::string::npos;
}

std::string trim(const std::string& s) {
  size_t begin = 0;
  size_t end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

// Reads the Jinja string literal that opens at text[pos] (a quote); returns its value with the
// usual backslash escapes undone and moves pos past the closing quote.
std::string read_string_literal(const std::string& text, size_t& pos) {
  const char quote = text[pos++];
  std::string value;
  while (pos < text.size() && text[pos] != quote) {
    char c = text[pos++];
    if (c == '\\' && pos < text.size()) {
      const char e = text[pos++];
      switch (e) {
        case 'n':
          c = '\n';
          break;
        case 't':
          c = '\t';
          break;
        case 'r':
          c = '\r';
          break;
        default:
          c = e;  // \\ \' \" and anything else stand for the character itself
          break;
      }
    }
    value.push_back(c);
  }
  ++pos;  // closing quote
  return value;
}

// The pieces of constant text a template can output: the raw text between tags and the string
// literals inside {{ }} and {% %} tags.
std::vector<std::string> constant_texts(const std::string& tmpl) {
  std::vector<std::string> texts;
  size_t pos = 0;
  while (pos < tmpl.size()) {
    const size_t open = tmpl.find('{', pos);
    const bool is_tag = open != std::string::npos && open + 1 < tmpl.size() &&
                        (tmpl[open + 1] == '{' || tmpl[open + 1] == '%' || tmpl[open + 1] == '#');
    if (open == std::string::npos) {
      texts.push_back(tmpl.substr(pos));
      break;
    }
    if (!is_tag) {
      texts.push_back(tmpl.substr(pos, open + 1 - pos));
      pos = open + 1;
      continue;
    }
    if (open > pos) texts.push_back(tmpl.substr(pos, open - pos));
    const char kind = tmpl[open + 1];
    const std::string close = kind == '{' ? "}}" : (kind == '%' ? "%}" : "#}");
    pos = open + 2;
    while (pos < tmpl.size() && tmpl.compare(pos, close.size(), close) != 0) {
      if (kind != '#' && (tmpl[pos] == '\'' || tmpl[pos] == '"')) {
        texts.push_back(read_string_literal(tmpl, pos));
      } else {
        ++pos;
      }
    }
    pos += close.size();
  }
  return texts;
}

// The default system message of a ChatML template: the content of the first constant text of
// the form "<|im_start|>system\n<content><|im_end|>".
std::string chatml_default_system(const std::string& tmpl) {
  static const std::string kHeader = "<|im_start|>system\n";
  static const std::string kEnd = "<|im_end|>";
  for (const std::string& text : constant_texts(tmpl)) {
    const size_t header = text.find(kHeader);
    if (header == std::string::npos) continue;
    const size_t begin = header + kHeader.size();
    const size_t end = text.find(kEnd, begin);
    if (end == std::string::npos || end == begin) continue;
    const std::string content = text.substr(begin, end - begin);
    if (content.find("<|im_start|>") != std::string::npos) continue;
    return content;
  }
  return "";
}

// The prompt being written: template text with operator<<, the messages' own text (roles and
// contents) with given(), whose byte ranges it records (ChatPrompt::given_spans).
class ChatText {
 public:
  ChatText& operator<<(std::string_view template_text) {
    text_.append(template_text);
    return *this;
  }
  ChatText& given(std::string_view text) {
    if (!text.empty()) spans_.push_back({text_.size(), text.size()});
    text_.append(text);
    return *this;
  }
  std::string& text() { return text_; }
  std::vector<TextSpan>& spans() { return spans_; }

 private:
  std::string text_;
  std::vector<TextSpan> spans_;
};

void format_chatml(const ChatTemplateStyle& style, const std::vector<ChatMessage>& messages,
                   bool add_generation_prompt, ChatText& ss) {
  if (!messages.empty() && messages.front().role != "system" && !style.default_system.empty()) {
    ss << "<|im_start|>system\n" << style.default_system << "<|im_end|>\n";
  }
  for (const ChatMessage& m : messages) {
    (ss << "<|im_start|>").given(m.role) << "\n";
    ss.given(m.content) << "<|im_end|>\n";
  }
  if (add_generation_prompt) ss << "<|im_start|>assistant\n";
}

// llama.cpp's llm_chat_apply_template for its LLAMA_2 variants.
void format_llama2(const ChatTemplateStyle& style, const std::vector<ChatMessage>& messages,
                   ChatText& ss) {
  bool inside_turn = true;  // the first [INST] follows BOS, which the tokenizer adds
  ss << "[INST] ";
  for (const ChatMessage& m : messages) {
    const std::string content = style.llama2_strip ? trim(m.content) : m.content;
    if (!inside_turn) {
      inside_turn = true;
      ss << (style.llama2_bos_in_history ? "<s>[INST] " : "[INST] ");
    }
    if (m.role == "system") {
      if (style.llama2_system_block) {
        (ss << "<<SYS>>\n").given(content) << "\n<</SYS>>\n\n";
      } else {
        ss.given(content) << "\n";
      }
    } else if (m.role == "user") {
      ss.given(content) << " [/INST]";
    } else {
      ss.given(content) << "</s>";
      inside_turn = false;
    }
  }
}

void format_llama3(const std::vector<ChatMessage>& messages, bool add_generation_prompt, ChatText& ss) {
  for (const ChatMessage& m : messages) {
    (ss << "<|start_header_id|>").given(m.role) << "<|end_header_id|>\n\n";
    ss.given(trim(m.content)) << "<|eot_id|>";
  }
  if (add_generation_prompt) ss << "<|start_header_id|>assistant<|end_header_id|>\n\n";
}

void format_gemma(const std::vector<ChatMessage>& messages, bool add_generation_prompt, ChatText& ss) {
  std::string system;
  for (const ChatMessage& m : messages) {
    if (m.role == "system") {
      system += trim(m.content);
      continue;
    }
    const std::string role = m.role == "assistant" ? "model" : m.role;
    (ss << "<start_of_turn>").given(role) << "\n";
    if (!system.empty() && role != "model") {
      ss.given(system) << "\n\n";
      system.clear();
    }
    ss.given(trim(m.content)) << "<end_of_turn>\n";
  }
  if (add_generation_prompt) ss << "<start_of_turn>model\n";
}

void format_plain(const std::vector<ChatMessage>& messages, bool add_generation_prompt, ChatText& ss) {
  for (const ChatMessage& m : messages) {
    ss.given(m.role) << ": ";
    ss.given(m.content) << "\n";
  }
  if (add_generation_prompt) ss << "assistant:";
}

}  // namespace

const char* chat_template_family_name(ChatTemplateFamily family) {
  switch (family) {
    case ChatTemplateFamily::kChatMl:
      return "chatml";
    case ChatTemplateFamily::kLlama2:
      return "llama2";
    case ChatTemplateFamily::kLlama3:
      return "llama3";
    case ChatTemplateFamily::kGemma:
      return "gemma";
    case ChatTemplateFamily::kPlain:
      return "plain";
  }
  return "plain";
}

// Marker tests in the order llama.cpp's llm_chat_detect_template makes them, for the families
// supported here; ChatML look-alikes with other separators (Phi 4, SmolVLM) fall back to plain.
ChatTemplateStyle detect_chat_template(const std::string& t) {
  ChatTemplateStyle style;
  const auto found = [&](ChatTemplateFamily family) {
    style.family = family;
    style.is_fallback = false;
  };
  if (contains(t, "<|im_start|>")) {
    if (!contains(t, "<|im_sep|>") && !contains(t, "<end_of_utterance>")) {
      found(ChatTemplateFamily::kChatMl);
      style.default_system = chatml_default_system(t);
    }
  } else if (contains(t, "[INST]")) {
    found(ChatTemplateFamily::kLlama2);
    // llama.cpp's variants, in its precedence: strip, then BOS in history, then <<SYS>>.
    const bool bos_in_history = contains(t, "bos_token + '[INST]");
    style.llama2_strip = contains(t, "content.strip()");
    style.llama2_bos_in_history = !style.llama2_strip && bos_in_history;
    style.llama2_system_block =
        style.llama2_strip || bos_in_history || contains(t, "<<SYS>>");
  } else if (contains(t, "<start_of_turn>")) {
    found(ChatTemplateFamily::kGemma);
  } else if (contains(t, "<|start_header_id|>") && contains(t, "<|end_header_id|>")) {
    found(ChatTemplateFamily::kLlama3);
  }
  return style;
}

ChatPrompt format_chat(const VocabSpec& spec, const std::vector<ChatMessage>& messages,
                       bool add_generation_prompt) {
  ChatPrompt prompt;
  prompt.style = detect_chat_template(spec.chat_template);
  ChatText ss;
  switch (prompt.style.family) {
    case ChatTemplateFamily::kChatMl:
      format_chatml(prompt.style, messages, add_generation_prompt, ss);
      break;
    case ChatTemplateFamily::kLlama2:
      format_llama2(prompt.style, messages, ss);
      break;
    case ChatTemplateFamily::kLlama3:
      format_llama3(messages, add_generation_prompt, ss);
      break;
    case ChatTemplateFamily::kGemma:
      format_gemma(messages, add_generation_prompt, ss);
      break;
    case ChatTemplateFamily::kPlain:
      format_plain(messages, add_generation_prompt, ss);
      break;
  }
  prompt.text = std::move(ss.text());
  prompt.given_spans = std::move(ss.spans());
  return prompt;
}

std::vector<int32_t> tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                                   bool add_generation_prompt) {
  const ChatPrompt prompt = format_chat(tokenizer.spec(), messages, add_generation_prompt);
  return tokenizer.encode(prompt.text, tokenizer.spec().add_bos, true, prompt.given_spans);
}

std::string apply_chat_template(const VocabSpec& spec, const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) {
  return format_chat(spec, messages, add_generation_prompt).text;
}

}  // namespace certkv::model
