#include "model/tokenizer.h"

#include <algorithm>
#include <queue>

#include "core/status.h"
#include "model/gguf.h"
#include "model/unicode.h"

namespace certkv::model {

namespace {

const std::string kSpaceMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// Token texts llama.cpp treats as end of generation (and as control tokens) whatever their type.
bool is_end_of_turn_text(const std::string& t) {
  static const char* const kNames[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>",    "<end_of_turn>",      "<|endoftext|>",
      "<|eom_id|>", "<EOT>",      "_<EOT>",     "<|end_of_text|>",    "<end_of_utterance>",
      "</s>",
  };
  for (const char* name : kNames) {
    if (t == name) return true;
  }
  return false;
}

// GPT-2's byte-to-unicode table (openai/gpt-2 encoder.py, bytes_to_unicode): printable bytes
// stand for themselves, the other 68 bytes take code points 256, 257, ... in byte order.
std::array<uint32_t, 256> gpt2_byte_codepoints() {
  std::array<uint32_t, 256> cps{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cps[b] = printable ? b : next++;
  }
  return cps;
}

// Parses "<0xHH>"; returns -1 when `text` has another form.
int parse_byte_token(const std::string& text) {
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = text[i];
    int digit = 0;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

std::string hex_byte(int b) {
  static const char* const kHex = "0123456789ABCDEF";
  return std::string{'0', 'x', kHex[b >> 4], kHex[b & 15]};
}

// "<0xHH>", SentencePiece's name for byte b.
std::string byte_token_text(int b) {
  std::string text = "<";
  text += hex_byte(b);
  text += '>';
  return text;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

}  // namespace

VocabSpec vocab_from_gguf(const GgufFile& file) {
  VocabSpec spec;
  const auto model = file.get_string("tokenizer.ggml.model");
  if (!model) fail(StatusCode::kNotFound, file.name() + ": no tokenizer.ggml.model key");
  spec.model = *model;
  spec.pre = file.get_string("tokenizer.ggml.pre").value_or("");
  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) fail(StatusCode::kNotFound, file.name() + ": no tokenizer.ggml.tokens key");
  spec.tokens = std::move(*tokens);
  if (const auto scores = file.get_float_array("tokenizer.ggml.scores")) {
    spec.scores.assign(scores->begin(), scores->end());
  }
  if (const auto types = file.get_int_array("tokenizer.ggml.token_type")) {
    spec.token_types.reserve(types->size());
    for (const int64_t t : *types) {
      if (t < kTokenUndefined || t > kTokenByte) {
        fail(StatusCode::kCorrupt, file.name() + ": tokenizer.ggml.token_type holds " +
                                       std::to_string(t) + ", outside 0..6");
      }
      spec.token_types.push_back(static_cast<int32_t>(t));
    }
  }
  if (auto merges = file.get_string_array("tokenizer.ggml.merges")) spec.merges = std::move(*merges);

  const bool sentencepiece = spec.model == "llama";
  if (sentencepiece) {
    spec.bos = 1;
    spec.eos = 2;
    spec.unk = 0;
    spec.add_bos = true;
    spec.add_space_prefix = true;
  } else {
    spec.add_space_prefix = false;
    // llama.cpp turns add_bos on for the Llama 3 pre-tokenizers, the ones that ignore merges.
    const auto pre = find_pre_tokenizer(spec.pre);
    spec.add_bos = pre && pre->ignore_merges;
  }
  const auto read_id = [&](const char* key, int32_t& id) {
    if (const auto v = file.get_int(key)) {
      if (*v < 0 || *v > INT32_MAX) {
        fail(StatusCode::kCorrupt, file.name() + ": " + key + " = " + std::to_string(*v) +
                                       " is not a token id");
      }
      id = static_cast<int32_t>(*v);
    }
  };
  read_id("tokenizer.ggml.bos_token_id", spec.bos);
  read_id("tokenizer.ggml.eos_token_id", spec.eos);
  read_id("tokenizer.ggml.unknown_token_id", spec.unk);
  read_id("tokenizer.ggml.padding_token_id", spec.pad);
  read_id("tokenizer.ggml.eot_token_id", spec.eot);
  spec.add_bos = file.get_bool("tokenizer.ggml.add_bos_token").value_or(spec.add_bos);
  spec.add_eos = file.get_bool("tokenizer.ggml.add_eos_token").value_or(spec.add_eos);
  spec.add_space_prefix =
      file.get_bool("tokenizer.ggml.add_space_prefix").value_or(spec.add_space_prefix);
  spec.chat_template = file.get_string("tokenizer.chat_template").value_or("");
  return spec;
}

Tokenizer::Tokenizer(VocabSpec spec) : spec_(std::move(spec)) {
  const size_t n = spec_.tokens.size();
  if (spec_.model == "gpt2") {
    byte_level_ = true;
    pre_ = pre_tokenizer_from_name(spec_.pre);
  } else if (spec_.model != "llama") {
    fail(StatusCode::kUnsupported, "tokenizer: model '" + spec_.model +
                                       "' (tokenizer.ggml.model) is not supported; "
                                       "expected \"gpt2\" or \"llama\"");
  }
  if (n == 0) fail(StatusCode::kInvalidArgument, "tokenizer: the vocabulary has no tokens");
  if (n > static_cast<size_t>(INT32_MAX)) {
    fail(StatusCode::kInvalidArgument, "tokenizer: " + std::to_string(n) + " tokens is too many");
  }
  if (!spec_.scores.empty() && spec_.scores.size() != n) {
    fail(StatusCode::kInvalidArgument, "tokenizer: " + std::to_string(spec_.scores.size()) +
                                           " scores for " + std::to_string(n) + " tokens");
  }
  if (!spec_.token_types.empty() && spec_.token_types.size() != n) {
    fail(StatusCode::kInvalidArgument, "tokenizer: " + std::to_string(spec_.token_types.size()) +
                                           " token types for " + std::to_string(n) + " tokens");
  }
  check_id(spec_.bos, "bos");
  check_id(spec_.eos, "eos");
  check_id(spec_.unk, "unk");
  check_id(spec_.pad, "pad");
  check_id(spec_.eot, "eot");

  types_.resize(n, kTokenNormal);
  end_of_generation_.assign(n, 0);
  token_ids_.reserve(n);
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = spec_.tokens[id];
    if (!spec_.token_types.empty()) {
      const int32_t t = spec_.token_types[id];
      if (t < kTokenUndefined || t > kTokenByte) {
        fail(StatusCode::kInvalidArgument, "tokenizer: token " + std::to_string(id) +
                                               " has type " + std::to_string(t) + ", outside 0..6");
      }
      types_[id] = static_cast<TokenType>(t);
    }
    if (is_end_of_turn_text(text)) {
      types_[id] = kTokenControl;
      end_of_generation_[id] = 1;
    }
    if (types_[id] == kTokenByte && parse_byte_token(text) < 0) {
      fail(StatusCode::kInvalidArgument, "tokenizer: byte token " + std::to_string(id) + " '" +
                                             text + "' is not of the form <0xHH>");
    }
    token_ids_[text] = static_cast<int32_t>(id);
  }
  for (const int32_t id : {spec_.eos, spec_.eot}) {
    if (id >= 0) end_of_generation_[id] = 1;
  }

  // Special tokens, longest text first so that a longer one wins over a token it contains.
  for (size_t id = 0; id < n; ++id) {
    if (is_special(static_cast<int32_t>(id)) && !spec_.tokens[id].empty()) {
      special_ids_.push_back(static_cast<int32_t>(id));
    }
  }
  std::stable_sort(special_ids_.begin(), special_ids_.end(), [&](int32_t a, int32_t b) {
    return spec_.tokens[a].size() > spec_.tokens[b].size();
  });

  byte_tokens_.fill(-1);
  std::array<int16_t, 324> byte_of_codepoint;  // inverse of the GPT-2 byte alphabet
  byte_of_codepoint.fill(-1);
  if (byte_level_) {
    const auto cps = gpt2_byte_codepoints();
    for (int b = 0; b < 256; ++b) {
      append_utf8(cps[b], byte_chars_[b]);
      byte_of_codepoint[cps[b]] = static_cast<int16_t>(b);
    }
    merge_ranks_.reserve(spec_.merges.size());
    for (size_t rank = 0; rank < spec_.merges.size(); ++rank) {
      const std::string& merge = spec_.merges[rank];
      const size_t space = merge.find(' ', 1);
      if (space == std::string::npos || space + 1 >= merge.size()) {
        fail(StatusCode::kInvalidArgument, "tokenizer: merge " + std::to_string(rank) + " '" +
                                               merge + "' is not two tokens separated by a space");
      }
      merge_ranks_.emplace(merge, static_cast<int32_t>(rank));  // first rank of a duplicate wins
    }
  } else {
    for (int b = 0; b < 256; ++b) {
      int32_t id = find_token(byte_token_text(b));
      if (id < 0) id = find_token(std::string(1, static_cast<char>(b)));
      byte_tokens_[b] = id;
    }
  }

  pieces_.resize(n);
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = spec_.tokens[id];
    std::string& piece = pieces_[id];
    switch (types_[id]) {
      case kTokenNormal:
        if (byte_level_) {
          for (const uint32_t cp : utf8_to_codepoints(text)) {
            if (cp < byte_of_codepoint.size() && byte_of_codepoint[cp] >= 0) {
              piece.push_back(static_cast<char>(byte_of_codepoint[cp]));
            } else {
              append_utf8(cp, piece);
            }
          }
        } else {
          piece = text;
          replace_all(piece, kSpaceMarker, " ");
        }
        break;
      case kTokenByte:
        piece.assign(1, static_cast<char>(parse_byte_token(text)));
        break;
      case kTokenUserDefined:
        piece = text;
        break;
      case kTokenUnknown:
      case kTokenControl:
      case kTokenUnused:
      case kTokenUndefined:
        break;
    }
  }
}

void Tokenizer::check_id(int32_t id, const char* what) const {
  if (id < -1 || id >= n_vocab()) {
    fail(StatusCode::kInvalidArgument, std::string("tokenizer: ") + what + " token id " +
                                           std::to_string(id) + " is outside the vocabulary of " +
                                           std::to_string(n_vocab()) + " tokens");
  }
}

int32_t Tokenizer::find_token(const std::string& text) const {
  const auto it = token_ids_.find(text);
  return it == token_ids_.end() ? -1 : it->second;
}

TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= n_vocab()) {
    fail(StatusCode::kOutOfRange, "tokenizer: token id " + std::to_string(id) +
                                      " is outside the vocabulary of " +
                                      std::to_string(n_vocab()) + " tokens");
  }
  return types_[id];
}

bool Tokenizer::is_special(int32_t id) const {
  const TokenType t = types_[id];
  return t == kTokenControl || t == kTokenUnknown || t == kTokenUserDefined;
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return id >= 0 && id < n_vocab() && end_of_generation_[id] != 0;
}

// Cuts the special tokens out of `text`, one token at a time from the longest, as llama.cpp's
// tokenizer_st_partition does. User-defined tokens are always cut; control and unknown ones only
// with parse_special.
std::vector<Tokenizer::Fragment> Tokenizer::partition_special(std::string_view text, bool parse_special,
                                                              const std::vector<TextSpan>& literal_spans) const {
  // Whether [begin, begin + length) overlaps a literal span.
  auto literal = [&](size_t begin, size_t length) {
    for (const TextSpan& span : literal_spans)
      if (begin < span.offset + span.length && span.offset < begin + length) return true;
    return false;
  };
  std::vector<Fragment> fragments;
  if (text.empty()) return fragments;
  fragments.push_back({false, -1, 0, text.size()});
  std::vector<Fragment> next;
  for (const int32_t id : special_ids_) {
    if (!parse_special && types_[id] != kTokenUserDefined) continue;
    const std::string& special = spec_.tokens[id];
    if (text.find(special) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : fragments) {
      if (f.is_token) {
        next.push_back(f);
        continue;
      }
      const std::string_view body = text.substr(f.offset, f.length);
      size_t pos = 0;
      for (size_t from = pos;;) {
        const size_t hit = body.find(special, from);
        if (hit == std::string_view::npos) break;
        if (literal(f.offset + hit, special.size())) {
          from = hit + 1;  // written by a user: stays text
          continue;
        }
        if (hit > pos) next.push_back({false, -1, f.offset + pos, hit - pos});
        next.push_back({true, id, 0, 0});
        pos = from = hit + special.size();
      }
      if (pos < body.size()) next.push_back({false, -1, f.offset + pos, body.size() - pos});
    }
    fragments.swap(next);
  }
  return fragments;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  return encode(text, add_bos, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special,
                                       const std::vector<TextSpan>& literal_spans) const {
  std::vector<int32_t> out;
  if (add_bos && spec_.add_bos && spec_.bos >= 0) out.push_back(spec_.bos);
  bool previous_special = true;  // SentencePiece: a text fragment at the start gets the prefix
  for (const Fragment& f : partition_special(text, parse_special, literal_spans)) {
    if (f.is_token) {
      out.push_back(f.token);
      previous_special = true;
      continue;
    }
    const std::string_view body = text.substr(f.offset, f.length);
    if (byte_level_) {
      encode_bpe(body, out);
    } else {
      std::string escaped;
      escaped.reserve(body.size() + 4);
      if (spec_.add_space_prefix && previous_special) escaped.push_back(' ');
      escaped.append(body);
      replace_all(escaped, " ", kSpaceMarker);
      encode_spm(escaped, out);
    }
    previous_special = false;
  }
  if (add_bos && spec_.add_eos && spec_.eos >= 0) out.push_back(spec_.eos);
  return out;
}

void Tokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<uint32_t> cps = utf8_to_codepoints(text);
  std::string word;
  std::string scratch;
  for (const WordSpan& span : split_words(pre_.kind, cps)) {
    // The word's UTF-8 bytes, each written as its GPT-2 alphabet character.
    std::string utf8;
    for (size_t i = span.begin; i < span.end; ++i) append_utf8(cps[i], utf8);
    word.clear();
    for (const char c : utf8) word += byte_chars_[static_cast<uint8_t>(c)];
    encode_bpe_word(word, scratch, out);
  }
}

// Merges one byte-level word: repeatedly joins the adjacent pair with the lowest merge rank
// (leftmost first among equal ranks), as llama.cpp's llm_tokenizer_bpe_session does.
void Tokenizer::encode_bpe_word(const std::string& word, std::string& scratch,
                                std::vector<int32_t>& out) const {
  if (pre_.ignore_merges) {
    const int32_t whole = find_token(word);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  struct Symbol {
    size_t begin;
    size_t length;
    int prev;
    int next;
  };
  std::vector<Symbol> symbols;
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = std::min(word.size() - pos, utf8_sequence_length(word[pos]));
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({pos, len, index - 1, pos + len == word.size() ? -1 : index + 1});
    pos += len;
  }
  struct Pair {
    int32_t rank;
    int left;
    int right;
    size_t left_length;
    size_t right_length;
  };
  const auto after = [](const Pair& a, const Pair& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(after)> queue(after);
  const auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[left];
    const Symbol& r = symbols[right];
    scratch.assign(word, l.begin, l.length);
    scratch.push_back(' ');
    scratch.append(word, r.begin, r.length);
    const auto it = merge_ranks_.find(scratch);
    if (it != merge_ranks_.end()) queue.push({it->second, left, right, l.length, r.length});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) consider(i - 1, i);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = symbols[p.left];
    Symbol& r = symbols[p.right];
    // Stale when either side has changed since the pair was queued.
    if (l.length != p.left_length || r.length != p.right_length || l.next != p.right) continue;
    l.length += r.length;
    r.length = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = p.left;
    consider(l.prev, p.left);
    consider(p.left, l.next);
  }
  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    scratch.assign(word, s.begin, s.length);
    const int32_t id = find_token(scratch);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // No token for this symbol (a single character: merges only form vocabulary tokens, and a
    // byte-level vocabulary may lack some bytes, e.g. SmolLM2 has no 0x04). Like llama.cpp, try
    // each UTF-8 byte of it as a token of its own and drop the bytes that have none.
    for (size_t pos = s.begin; pos < s.begin + s.length; ++pos) {
      scratch.assign(1, word[pos]);
      const int32_t byte_id = find_token(scratch);
      if (byte_id >= 0) out.push_back(byte_id);
    }
  }
}

// SentencePiece merging as in llama.cpp's llm_tokenizer_spm_session: start from single UTF-8
// characters, repeatedly join the adjacent pair whose concatenation is the highest-scoring token
// (leftmost first among equal scores); what is left without a token becomes byte tokens.
void Tokenizer::encode_spm(const std::string& text, std::vector<int32_t>& out) const {
  struct Symbol {
    size_t begin;
    size_t length;
    int prev;
    int next;
  };
  std::vector<Symbol> symbols;
  for (size_t pos = 0; pos < text.size();) {
    const size_t len = std::min(text.size() - pos, utf8_sequence_length(text[pos]));
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({pos, len, index - 1, pos + len == text.size() ? -1 : index + 1});
    pos += len;
  }
  struct Pair {
    float score;
    int left;
    int right;
    size_t length;
  };
  const auto before = [](const Pair& a, const Pair& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Pair, std::vector<Pair>, decltype(before)> queue(before);
  std::string scratch;
  const auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t length = symbols[left].length + symbols[right].length;
    scratch.assign(text, symbols[left].begin, length);
    const int32_t id = find_token(scratch);
    if (id < 0) return;
    const float score = spec_.scores.empty() ? 0.0f : spec_.scores[id];
    queue.push({score, left, right, length});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) consider(i - 1, i);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = symbols[p.left];
    Symbol& r = symbols[p.right];
    if (l.length == 0 || r.length == 0 || l.length + r.length != p.length) continue;
    l.length += r.length;
    r.length = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = p.left;
    consider(l.prev, p.left);
    consider(p.left, l.next);
  }
  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    scratch.assign(text, s.begin, s.length);
    const int32_t id = find_token(scratch);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (size_t pos = s.begin; pos < s.begin + s.length; ++pos) {
      const uint8_t b = static_cast<uint8_t>(text[pos]);
      int32_t byte_id = byte_tokens_[b];
      if (byte_id < 0) byte_id = spec_.unk;
      if (byte_id < 0) {
        fail(StatusCode::kNotFound, "tokenizer: no token for byte " + hex_byte(b) +
                                        " and no unknown token to stand for it");
      }
      out.push_back(byte_id);
    }
  }
}

std::string Tokenizer::token_piece(int32_t id, bool render_special) const {
  const TokenType t = token_type(id);
  if (render_special && (t == kTokenControl || t == kTokenUnknown)) return spec_.tokens[id];
  return pieces_[id];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool render_special) const {
  std::string text;
  const bool strip_space = !byte_level_ && spec_.add_space_prefix;
  bool at_fragment_start = true;
  for (const int32_t id : ids) {
    const TokenType t = token_type(id);
    if (is_special(id)) {
      if (render_special || t == kTokenUserDefined) text += token_piece(id, render_special);
      at_fragment_start = true;
      continue;
    }
    const std::string& piece = pieces_[id];
    if (strip_space && at_fragment_start && !piece.empty() && piece[0] == ' ') {
      text.append(piece, 1, std::string::npos);
    } else {
      text += piece;
    }
    at_fragment_start = false;
  }
  return text;
}

}  // namespace certkv::model
