#include "cli_json.h"

#include <cmath>

namespace certkv::tools {

JsonObject& JsonObject::add(std::string_view key, double value) {
  if (std::isfinite(value))
    json_[std::string(key)] = value;
  else
    json_[std::string(key)] = nullptr;
  return *this;
}

std::string JsonObject::dump_json(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace certkv::tools
