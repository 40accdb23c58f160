#include "format/json.h"
#include "format/utf8.h"

#include <charconv>
#include <set>

#include "core/status.h"

namespace certkv::format {
namespace {

class Parser {
 public:
  Parser(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  JsonValue parse_document() {
    skip_whitespace();
    JsonValue v = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) error("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    fail(StatusCode::kCorrupt, "JSON in '" + source_ + "': " + what + " at byte " +
                                   std::to_string(pos_));
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) {
      ++pos_;
    }
  }

  void expect_literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) error("invalid literal");
    pos_ += word.size();
  }

  JsonValue parse_value(int depth) {
    if (at_end()) error("unexpected end of input");
    switch (peek()) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"': return JsonValue::string(parse_string());
      case 't': expect_literal("true"); return JsonValue::boolean(true);
      case 'f': expect_literal("false"); return JsonValue::boolean(false);
      case 'n': expect_literal("null"); return JsonValue();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return parse_number();
        error(std::string("unexpected character '") + peek() + "'");
    }
  }

  JsonValue parse_object(int depth) {
    if (depth > kJsonMaxDepth) error("nesting deeper than " + std::to_string(kJsonMaxDepth));
    ++pos_;  // '{'
    std::vector<JsonValue::Member> members;
    std::set<std::string, std::less<>> keys;
    skip_whitespace();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return JsonValue::object(std::move(members));
    }
    while (true) {
      skip_whitespace();
      if (at_end() || peek() != '"') error("expected a string key");
      std::string key = parse_string();
      if (!keys.insert(key).second) error("duplicate key \"" + key + "\"");
      skip_whitespace();
      if (at_end() || peek() != ':') error("expected ':'");
      ++pos_;
      skip_whitespace();
      JsonValue value = parse_value(depth);
      members.emplace_back(std::move(key), std::move(value));
      skip_whitespace();
      if (at_end()) error("unterminated object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return JsonValue::object(std::move(members));
      }
      error("expected ',' or '}'");
    }
  }

  JsonValue parse_array(int depth) {
    if (depth > kJsonMaxDepth) error("nesting deeper than " + std::to_string(kJsonMaxDepth));
    ++pos_;  // '['
    std::vector<JsonValue> items;
    skip_whitespace();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return JsonValue::array(std::move(items));
    }
    while (true) {
      skip_whitespace();
      items.push_back(parse_value(depth));
      skip_whitespace();
      if (at_end()) error("unterminated array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return JsonValue::array(std::move(items));
      }
      error("expected ',' or ']'");
    }
  }

  // number = [ minus ] int [ frac ] [ exp ]; int = zero / ( digit1-9 *DIGIT ) (RFC 8259 §6).
  JsonValue parse_number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      return pos_ - from;
    };
    if (peek() == '-') ++pos_;
    if (at_end()) error("incomplete number");
    if (peek() == '0') {
      ++pos_;
      if (!at_end() && peek() >= '0' && peek() <= '9') error("number with a leading zero");
    } else if (digits() == 0) {
      error("incomplete number");
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      ++pos_;
      integral = false;
      if (digits() == 0) error("number without digits after '.'");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      integral = false;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) error("number without digits in its exponent");
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    if (integral) {
      int64_t i = 0;
      const auto [end, ec] = std::from_chars(first, last, i);
      if (ec == std::errc() && end == last) return JsonValue::integer(i);
    }
    double d = 0.0;
    const auto [end, ec] = std::from_chars(first, last, d);
    if (ec == std::errc::result_out_of_range) error("number out of the range of double");
    if (ec != std::errc() || end != last) error("malformed number");
    return JsonValue::number(d);
  }

  unsigned parse_hex4() {
    if (text_.size() - pos_ < 4) error("incomplete \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f') v |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= unsigned(c - 'A' + 10);
      else error("invalid hex digit in \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  // Copies one UTF-8 sequence starting at pos_ (whose first byte is >= 0x80), rejecting overlong
  // forms, surrogates and code points above U+10FFFF (RFC 3629 §4).
  void copy_utf8_sequence(std::string& out) {
    const auto byte = [&](size_t i) { return static_cast<uint8_t>(text_[pos_ + i]); };
    const uint8_t b0 = byte(0);
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 3;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {
      error("invalid UTF-8 in string");
    }
    if (text_.size() - pos_ < n) error("truncated UTF-8 sequence in string");
    if (byte(1) < lo || byte(1) > hi) error("invalid UTF-8 in string");
    for (size_t i = 2; i < n; ++i) {
      if (byte(i) < 0x80 || byte(i) > 0xBF) error("invalid UTF-8 in string");
    }
    out.append(text_.data() + pos_, n);
    pos_ += n;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (at_end()) error("unterminated string");
      const auto c = static_cast<uint8_t>(peek());
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) error("control character in string");
      if (c >= 0x80) {
        copy_utf8_sequence(out);
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += char(c);
        continue;
      }
      if (at_end()) error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) error("lone low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") error("high surrogate without a low surrogate");
            pos_ += 2;
            const uint32_t low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) error("high surrogate without a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: error(std::string("invalid escape '\\") + e + "'");
      }
    }
  }

  std::string_view text_;
  const std::string& source_;
  size_t pos_ = 0;
};

[[noreturn]] void wrong_kind(JsonValue::Kind have, const char* want) {
  fail(StatusCode::kInvalidArgument,
       std::string("JSON value is ") + json_kind_name(have) + ", not " + want);
}

}  // namespace

JsonValue JsonValue::boolean(bool b) {
  JsonValue v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}

JsonValue JsonValue::integer(int64_t i) {
  JsonValue v;
  v.kind_ = Kind::kNumber;
  v.is_integer_ = true;
  v.int_ = i;
  v.double_ = static_cast<double>(i);
  return v;
}

JsonValue JsonValue::number(double d) {
  JsonValue v;
  v.kind_ = Kind::kNumber;
  v.double_ = d;
  return v;
}

JsonValue JsonValue::string(std::string s) {
  JsonValue v;
  v.kind_ = Kind::kString;
  v.string_ = std::move(s);
  return v;
}

JsonValue JsonValue::array(std::vector<JsonValue> items) {
  JsonValue v;
  v.kind_ = Kind::kArray;
  v.array_ = std::move(items);
  return v;
}

JsonValue JsonValue::object(std::vector<Member> members) {
  JsonValue v;
  v.kind_ = Kind::kObject;
  v.object_ = std::move(members);
  return v;
}

bool JsonValue::as_bool() const {
  if (kind_ != Kind::kBool) wrong_kind(kind_, "a bool");
  return bool_;
}

int64_t JsonValue::as_int() const {
  if (!is_integer()) wrong_kind(kind_, "an integer");
  return int_;
}

double JsonValue::as_double() const {
  if (kind_ != Kind::kNumber) wrong_kind(kind_, "a number");
  return double_;
}

const std::string& JsonValue::as_string() const {
  if (kind_ != Kind::kString) wrong_kind(kind_, "a string");
  return string_;
}

const std::vector<JsonValue>& JsonValue::as_array() const {
  if (kind_ != Kind::kArray) wrong_kind(kind_, "an array");
  return array_;
}

const std::vector<JsonValue::Member>& JsonValue::as_object() const {
  if (kind_ != Kind::kObject) wrong_kind(kind_, "an object");
  return object_;
}

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const Member& m : object_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

const char* json_kind_name(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull: return "null";
    case JsonValue::Kind::kBool: return "bool";
    case JsonValue::Kind::kNumber: return "number";
    case JsonValue::Kind::kString: return "string";
    case JsonValue::Kind::kArray: return "array";
    case JsonValue::Kind::kObject: return "object";
  }
  return "unknown";
}

JsonValue parse_json(std::string_view text, const std::string& source_name) {
  return Parser(text, source_name).parse_document();
}

std::string json_quote(std::string_view text) {
  static const char kHex[] = "0123456789abcdef";
  const std::string utf8 = valid_utf8(text);
  std::string out = "\"";
  for (const char ch : utf8) {
    const auto c = static_cast<uint8_t>(ch);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += ch;
    }
  }
  out += '"';
  return out;
}

}  // namespace certkv::format
