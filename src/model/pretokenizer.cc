#include "model/pretokenizer.h"

#include <algorithm>
#include <array>

#include "core/status.h"
#include "model/unicode.h"

namespace certkv::model {

std::optional<PreTokenizerChoice> find_pre_tokenizer(const std::string& pre) {
  struct Entry {
    const char* name;
    PreTokenizer kind;
    bool ignore_merges;
  };
  // Groups follow llama.cpp's llama_vocab::impl::load (tokenizer_pre -> pre_type, ignore_merges).
  static constexpr std::array<Entry, 21> kEntries = {{
      {"default", PreTokenizer::kDefault, false},
      {"gpt-2", PreTokenizer::kGpt2, false},
      {"phi-2", PreTokenizer::kGpt2, false},
      {"mpt", PreTokenizer::kGpt2, false},
      {"olmo", PreTokenizer::kGpt2, false},
      {"smollm", PreTokenizer::kGpt2SingleDigits, false},
      {"starcoder", PreTokenizer::kGpt2SingleDigits, false},
      {"refact", PreTokenizer::kGpt2SingleDigits, false},
      {"command-r", PreTokenizer::kGpt2SingleDigits, false},
      {"codeshell", PreTokenizer::kGpt2SingleDigits, false},
      {"llama3", PreTokenizer::kLlama3, true},
      {"llama-v3", PreTokenizer::kLlama3, true},
      {"llama-bpe", PreTokenizer::kLlama3, true},
      {"falcon3", PreTokenizer::kLlama3, true},
      {"pixtral", PreTokenizer::kLlama3, true},
      {"dbrx", PreTokenizer::kLlama3, false},
      {"smaug-bpe", PreTokenizer::kLlama3, false},
      {"qwen2", PreTokenizer::kQwen2, false},
      {"deepseek-r1-qwen", PreTokenizer::kQwen2, false},
      {"stablelm2", PreTokenizer::kQwen2, false},
      {"megrez", PreTokenizer::kQwen2, false},
  }};
  const std::string name = pre.empty() ? "default" : pre;
  for (const Entry& e : kEntries) {
    if (name == e.name) return PreTokenizerChoice{e.kind, e.ignore_merges};
  }
  return std::nullopt;
}

PreTokenizerChoice pre_tokenizer_from_name(const std::string& pre) {
  if (const auto choice = find_pre_tokenizer(pre)) return *choice;
  fail(StatusCode::kUnsupported,
       "tokenizer: pre-tokenizer '" + pre + "' (tokenizer.ggml.pre) is not supported");
}

namespace {

// A view of one span of code points; positions are absolute indices into cps. Positions outside
// [begin, end) read as "absent", which no class test matches (the regex cannot look past the
// end of the span it is applied to).
class SpanCursor {
 public:
  SpanCursor(const std::vector<uint32_t>& cps, const std::vector<uint8_t>& classes, WordSpan span,
             std::vector<WordSpan>& out)
      : cps_(cps), classes_(classes), end_(span.end), word_begin_(span.begin), out_(out) {}

  bool inside(size_t pos) const { return pos < end_; }
  uint32_t cp(size_t pos) const { return inside(pos) ? cps_[pos] : kAbsent; }
  uint8_t classes(size_t pos) const { return inside(pos) ? classes_[pos] : 0; }
  bool letter(size_t pos) const { return classes(pos) & kClassLetter; }
  bool number(size_t pos) const { return classes(pos) & kClassNumber; }
  bool whitespace(size_t pos) const { return classes(pos) & kClassWhitespace; }
  // [^\s\p{L}\p{N}]: any code point present that is neither whitespace, letter nor number.
  bool other(size_t pos) const {
    return inside(pos) && !(classes(pos) & (kClassLetter | kClassNumber | kClassWhitespace));
  }
  // Ends the current word at `end` (a no-op for an empty word); returns its length.
  size_t emit(size_t end) {
    const size_t n = end - word_begin_;
    if (n > 0) out_.push_back({word_begin_, end});
    word_begin_ = end;
    return n;
  }

  static constexpr uint32_t kAbsent = 0xFFFFFFFF;

 private:
  const std::vector<uint32_t>& cps_;
  const std::vector<uint8_t>& classes_;  // codepoint_classes of each code point
  size_t end_;
  size_t word_begin_;
  std::vector<WordSpan>& out_;
};

uint32_t ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + ('a' - 'A') : c; }

// Length of a contraction ('s 't 'm 'd 're 've 'll) starting at pos, or 0.
size_t contraction_length(const SpanCursor& s, size_t pos, bool ignore_case) {
  if (s.cp(pos) != '\'' || !s.inside(pos + 1)) return 0;
  const auto lower = [&](size_t p) { return ignore_case ? ascii_lower(s.cp(p)) : s.cp(p); };
  const uint32_t c1 = lower(pos + 1);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (!s.inside(pos + 2)) return 0;
  const uint32_t c2 = lower(pos + 2);
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

void split_gpt2(const std::vector<uint32_t>& cps, const std::vector<uint8_t>& classes,
                WordSpan span, std::vector<WordSpan>& out) {
  SpanCursor s(cps, classes, span, out);
  size_t pos = span.begin;
  while (pos < span.end) {
    if (const size_t n = contraction_length(s, pos, false); n > 0) {
      pos += s.emit(pos + n);
      continue;
    }
    // ` ?X+` alternatives: an optional leading space, then a run of one class.
    const bool space = s.cp(pos) == ' ';
    const size_t first = pos + (space ? 1 : 0);
    if (s.letter(first)) {
      pos = first;
      while (s.letter(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    if (s.number(first)) {
      pos = first;
      while (s.number(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    if (s.other(first)) {
      pos = first;
      while (s.other(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    size_t n_space = 0;
    while (s.whitespace(pos + n_space)) ++n_space;
    if (n_space > 1 && s.inside(pos + n_space)) {
      // \s+(?!\S): leave the last space to lead the next word.
      pos += n_space - 1;
      s.emit(pos);
    } else if (n_space > 0) {
      pos += n_space;
      s.emit(pos);
    } else {
      s.emit(++pos);
    }
  }
}

// The Llama 3 regex; digit_group is 3 for \p{N}{1,3} and 1 for \p{N}.
void split_llama3(const std::vector<uint32_t>& cps, const std::vector<uint8_t>& classes,
                  WordSpan span, size_t digit_group, std::vector<WordSpan>& out) {
  SpanCursor s(cps, classes, span, out);
  size_t pos = span.begin;
  while (pos < span.end) {
    if (const size_t n = contraction_length(s, pos, true); n > 0) {
      pos += s.emit(pos + n);
      continue;
    }
    const uint32_t c = s.cp(pos);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (c != '\r' && c != '\n' && !s.number(pos) && (s.letter(pos) || s.letter(pos + 1))) {
      ++pos;
      while (s.letter(pos)) ++pos;
      s.emit(pos);
      continue;
    }
    // \p{N}{1,digit_group}
    if (s.number(pos)) {
      size_t group_begin = pos;
      while (s.number(pos)) {
        if (++pos - group_begin >= digit_group) {
          s.emit(pos);
          group_begin = pos;
        }
      }
      s.emit(pos);
      continue;
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    const size_t first = pos + (c == ' ' ? 1 : 0);
    if (s.other(first) || (c == ' ' && !s.inside(first))) {
      pos = first;
      while (s.other(pos)) ++pos;
      while (s.cp(pos) == '\r' || s.cp(pos) == '\n') ++pos;
      s.emit(pos);
      continue;
    }
    size_t n_space = 0;
    size_t after_last_newline = 0;
    while (s.whitespace(pos + n_space)) {
      const uint32_t w = s.cp(pos + n_space);
      if (w == '\r' || w == '\n') after_last_newline = pos + n_space + 1;
      ++n_space;
    }
    if (after_last_newline > 0) {
      // \s*[\r\n]+
      pos = after_last_newline;
      s.emit(pos);
    } else if (n_space > 1 && s.inside(pos + n_space)) {
      // \s+(?!\S)
      pos += n_space - 1;
      s.emit(pos);
    } else if (n_space > 0) {
      pos += n_space;
      s.emit(pos);
    } else {
      s.emit(++pos);
    }
  }
}

// A regex that is a plain character class, applied the way llama.cpp applies a regex split:
// every match becomes a word and so does every stretch between matches. With `runs` a match is a
// maximal run of class members ([...]+), otherwise a single member.
template <typename Member>
void split_class(const std::vector<uint32_t>& cps, WordSpan span, Member member, bool runs,
                 std::vector<WordSpan>& out) {
  size_t gap_begin = span.begin;
  size_t pos = span.begin;
  while (pos < span.end) {
    if (!member(cps[pos])) {
      ++pos;
      continue;
    }
    if (pos > gap_begin) out.push_back({gap_begin, pos});
    const size_t match_begin = pos++;
    if (runs) {
      while (pos < span.end && member(cps[pos])) ++pos;
    }
    out.push_back({match_begin, pos});
    gap_begin = pos;
  }
  if (span.end > gap_begin) out.push_back({gap_begin, span.end});
}

// [0-9][0-9][0-9]: non-overlapping groups of three ASCII digits, found left to right.
void split_ascii_digit_triples(const std::vector<uint32_t>& cps, WordSpan span,
                               std::vector<WordSpan>& out) {
  const auto digit = [&](size_t p) { return p < span.end && cps[p] >= '0' && cps[p] <= '9'; };
  size_t gap_begin = span.begin;
  size_t pos = span.begin;
  while (pos < span.end) {
    if (!(digit(pos) && digit(pos + 1) && digit(pos + 2))) {
      ++pos;
      continue;
    }
    if (pos > gap_begin) out.push_back({gap_begin, pos});
    out.push_back({pos, pos + 3});
    pos += 3;
    gap_begin = pos;
  }
  if (span.end > gap_begin) out.push_back({gap_begin, span.end});
}

bool is_number_cp(uint32_t c) { return codepoint_classes(c) & kClassNumber; }

// [\p{P}\$\+<=>\^~\|]
bool is_default_punctuation(uint32_t c) {
  if (codepoint_classes(c) & kClassPunctuation) return true;
  return c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' ||
         c == '|';
}

// Applies one stage to every span of `in`.
template <typename Stage>
std::vector<WordSpan> refine(const std::vector<WordSpan>& in, Stage stage) {
  std::vector<WordSpan> out;
  out.reserve(in.size() * 2);
  for (const WordSpan& span : in) stage(span, out);
  return out;
}

}  // namespace

std::vector<WordSpan> split_words(PreTokenizer kind, const std::vector<uint32_t>& cps) {
  std::vector<WordSpan> words;
  if (cps.empty()) return words;
  words.push_back({0, cps.size()});
  std::vector<uint8_t> classes(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) classes[i] = codepoint_classes(cps[i]);
  const auto gpt2 = [&](WordSpan span, std::vector<WordSpan>& out) {
    split_gpt2(cps, classes, span, out);
  };
  switch (kind) {
    case PreTokenizer::kGpt2:
      return refine(words, gpt2);
    case PreTokenizer::kGpt2SingleDigits:
      words = refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_class(cps, span, is_number_cp, false, out);
      });
      return refine(words, gpt2);
    case PreTokenizer::kLlama3:
      return refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_llama3(cps, classes, span, 3, out);
      });
    case PreTokenizer::kQwen2:
      return refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_llama3(cps, classes, span, 1, out);
      });
    case PreTokenizer::kDefault:
      words = refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_class(cps, span, is_default_punctuation, true, out);
      });
      words = refine(words, gpt2);
      words = refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_class(cps, span, is_number_cp, true, out);
      });
      return refine(words, [&](WordSpan span, std::vector<WordSpan>& out) {
        split_ascii_digit_triples(cps, span, out);
      });
  }
  return words;
}

}  // namespace certkv::model
