// Command-line flag parsing shared by the certkv subcommands.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace certkv::tools {

// Thrown for a usage mistake: printed as one line, exit status 2.
struct UsageError {
  std::string message;
};

// Parses "--name value", "--name=value" and value-less "--name" flags of one subcommand.
// -h / --help prints `usage` to stdout and exits 0. Every mistake (unknown flag, missing value,
// flag given twice, value out of range) throws UsageError naming the flag.
class Flags {
 public:
  // spec: flag name -> whether it takes a value. usage: borrowed, must outlive the Flags.
  Flags(std::string command, std::map<std::string, bool> spec, const char* usage)
      : command_(std::move(command)), spec_(std::move(spec)), usage_(usage) {}

  // Parses argv[first..argc).
  void parse(int argc, char** argv, int first);

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string str(const std::string& name, const std::string& fallback = "") const;
  int64_t integer(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const;
  double real(const std::string& name, double fallback, double lo, double hi) const;

 private:
  std::string command_;
  std::map<std::string, bool> spec_;  // name -> takes a value
  const char* usage_;
  std::map<std::string, std::string> values_;
};

// The whole file at `path`; a UsageError naming --flag when it cannot be read.
std::string read_text_file(const std::string& path, const char* flag);

// --model, else $CERTKV_MODEL, else the embedded default (models/SmolLM2-135M-Instruct.Q4_1.gguf).
std::string model_path(const Flags& flags);

}  // namespace certkv::tools
