// A small, strict JSON (RFC 8259) reader for the headers certkv reads: the safetensors header and
// Hugging Face config.json. Anything outside the grammar is an error: trailing commas, comments,
// leading zeros, control characters or invalid UTF-8 in strings, lone surrogates, duplicate
// object keys, nesting deeper than kJsonMaxDepth. Errors are certkv::Error(kCorrupt) naming the
// source and the byte offset.
// Thread safety: values are immutable after parsing; parse_json is reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace certkv::format {

inline constexpr int kJsonMaxDepth = 128;

class JsonValue {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  using Member = std::pair<std::string, JsonValue>;

  JsonValue() = default;  // null
  static JsonValue boolean(bool b);
  static JsonValue integer(int64_t i);
  static JsonValue number(double d);
  static JsonValue string(std::string s);
  static JsonValue array(std::vector<JsonValue> items);
  static JsonValue object(std::vector<Member> members);

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  // A number written without fraction or exponent whose value fits int64.
  bool is_integer() const { return kind_ == Kind::kNumber && is_integer_; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  // Accessors REQUIRE the matching kind (as_int: is_integer()); otherwise they throw
  // certkv::Error(kInvalidArgument). as_double accepts every number.
  bool as_bool() const;
  int64_t as_int() const;
  double as_double() const;
  const std::string& as_string() const;
  const std::vector<JsonValue>& as_array() const;
  // Members in the order they appear in the text.
  const std::vector<Member>& as_object() const;

  // The member named `key`; nullptr when absent or when this value is not an object.
  const JsonValue* find(std::string_view key) const;

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  bool is_integer_ = false;
  int64_t int_ = 0;
  double double_ = 0.0;
  std::string string_;
  std::vector<JsonValue> array_;
  std::vector<Member> object_;
};

// "null", "bool", "number", "string", "array" or "object".
const char* json_kind_name(JsonValue::Kind kind);

// Parses one JSON value surrounded by optional whitespace. `source_name` (a file name) is used in
// error messages.
JsonValue parse_json(std::string_view text, const std::string& source_name);

// `text` as a JSON string literal with its quotes; escapes '"', '\\' and control characters. The
// literal is always valid: malformed UTF-8 in text (a generation cut inside a character) is
// written as U+FFFD (format/utf8.h).
std::string json_quote(std::string_view text);

}  // namespace certkv::format
