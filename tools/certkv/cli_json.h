// A minimal JSON writer for the CLI's --json output: one object, keys in insertion order.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace certkv::tools {

class JsonObject {
 public:
  JsonObject& add(std::string_view key, std::string_view value);
  JsonObject& add(std::string_view key, const char* value) { return add(key, std::string_view(value)); }
  JsonObject& add(std::string_view key, int64_t value);
  JsonObject& add(std::string_view key, uint64_t value);
  JsonObject& add(std::string_view key, int value) { return add(key, int64_t(value)); }
  JsonObject& add(std::string_view key, double value);
  JsonObject& add(std::string_view key, bool value);
  // value must already be valid JSON.
  JsonObject& add_raw(std::string_view key, std::string_view json);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(std::string_view k);
  std::string body_;
};

}  // namespace certkv::tools
