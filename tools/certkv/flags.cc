#include "flags.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace certkv::tools {

void Flags::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      fputs(usage_, stdout);
      exit(0);
    }
    if (a.rfind("--", 0) != 0) throw UsageError{"unexpected argument '" + a + "'"};
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) value = name.substr(eq + 1), name = name.substr(0, eq);
    auto it = spec_.find(name);
    if (it == spec_.end()) throw UsageError{"unknown flag --" + name};
    if (it->second) {
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError{"flag --" + name + " needs a value"};
        value = argv[++i];
      }
    } else if (inline_value) {
      throw UsageError{"flag --" + name + " takes no value"};
    }
    if (values_.count(name)) throw UsageError{"flag --" + name + " given twice"};
    values_[name] = value;
  }
}

std::string Flags::str(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

int64_t Flags::integer(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  if (!has(name)) return fallback;
  const std::string& v = values_.at(name);
  char* end = nullptr;
  errno = 0;
  const long long x = strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
    throw UsageError{"flag --" + name + " expects an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + v + "'"};
  return x;
}

double Flags::real(const std::string& name, double fallback, double lo, double hi) const {
  if (!has(name)) return fallback;
  const std::string& v = values_.at(name);
  char* end = nullptr;
  const double x = strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x >= lo && x <= hi))
    throw UsageError{"flag --" + name + " expects a number in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + v + "'"};
  return x;
}

std::string read_text_file(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError{std::string("flag --") + flag + ": cannot read file '" + path + "'"};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string model_path(const Flags& flags) {
  if (flags.has("model")) return flags.str("model");
  if (const char* env = getenv("CERTKV_MODEL")) return env;
  return CERTKV_DEFAULT_MODEL;
}

}  // namespace certkv::tools
