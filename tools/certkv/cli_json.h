// The CLI's --json output: one object, keys in insertion order, written by nlohmann-json. Text
// that is not valid UTF-8 (a generation cut inside a multi-byte character) is written with U+FFFD
// in place of the bad bytes, so the output is always valid JSON.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace certkv::tools {

using Json = nlohmann::ordered_json;

// A builder over Json: o.add("a", 1).add("b", "x").add("c", nested).
class JsonObject {
 public:
  template <typename T>
  JsonObject& add(std::string_view key, const T& value) {
    json_[std::string(key)] = value;
    return *this;
  }
  JsonObject& add(std::string_view key, const JsonObject& value) { return add(key, value.json()); }
  // A non-finite number is written as null.
  JsonObject& add(std::string_view key, double value);
  const Json& json() const { return json_; }
  std::string str() const { return dump_json(json_); }

  static std::string dump_json(const Json& j);

 private:
  Json json_ = Json::object();
};

}  // namespace certkv::tools
