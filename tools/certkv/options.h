// The option table of the certkv command-line tool (llama.cpp's style: one table of every flag,
// each row with its long name, short form, value type, default, help and the commands that take
// it), the parser that reads one command's flags against it, and the help generated from it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace certkv::tools {

// Thrown for a usage mistake: printed as one line, exit status 2.
struct UsageError {
  std::string message;
};

// The commands, as bits of Option::commands.
enum Command : uint32_t {
  kRun = 1u << 0,
  kBatch = 1u << 1,
  kDumpKv = 1u << 2,
  kInfo = 1u << 3,
  kEvalTeacherForced = 1u << 4,
  kEvalNeedle = 1u << 5,
  kAudit = 1u << 6,
  kCodec = 1u << 7,
};

enum class ValueType { kSwitch, kInteger, kNumber, kText, kPath, kList };

struct Option {
  std::string name;           // long form, without "--"
  char short_name;            // '\0': none; else "-x" (as llama.cpp: -m -p -f -n -c -t -s)
  ValueType type;
  std::string value_name;     // "N", "PATH", ... (empty for a switch)
  std::string default_value;  // what the command uses when the flag is absent ("" : none, or
                              // one the command works out, said in help)
  uint32_t commands;          // the Command bits that take it
  std::string help;           // one line
};

// Every row; a long name appears once per command (rows of one name have disjoint commands).
const std::vector<Option>& option_table();

struct CommandInfo {
  Command id;
  const char* name;         // "run", "eval needle", ...
  const char* summary;      // one line, for `certkv -h`
  const char* synopsis;     // after "usage: certkv NAME "
  const char* description;  // paragraphs before the flag list (may be "")
  bool kv_schemes;          // the help ends with the scheme table
};

const std::vector<CommandInfo>& command_table();
const CommandInfo& command_info(Command id);

// `certkv -h`: the commands, one line each.
std::string overview_help();
// `certkv COMMAND -h`: its synopsis, description and flags (with their defaults).
std::string command_help(Command id);

// One command's flags, read against the table: "--name value", "--name=value", "-x value" and
// value-less switches. -h / --help prints command_help and exits 0. Every mistake (unknown flag,
// with the nearest name when one is close; a flag of another command; missing value; flag given
// twice; value out of range) throws UsageError naming the flag.
class Flags {
 public:
  explicit Flags(Command command) : command_(command) {}

  // Parses argv[first..argc).
  void parse(int argc, char** argv, int first);

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  // The value, else the table's default (else "").
  std::string str(const std::string& name) const;
  // The value, else the table's default, as an integer / a number in [lo, hi].
  // REQUIRES: the flag is given or its row has a default.
  int64_t integer(const std::string& name, int64_t lo, int64_t hi) const;
  double real(const std::string& name, double lo, double hi) const;

 private:
  const Option& row(const std::string& name) const;
  std::string value_or_default(const std::string& name) const;

  Command command_;
  std::map<std::string, std::string> values_;
};

// The whole file at `path`; a UsageError naming --flag when it cannot be read.
std::string read_text_file(const std::string& path, const char* flag);

// --model, else $CERTKV_MODEL, else the embedded default (models/SmolLM2-135M-Instruct.Q4_1.gguf).
std::string model_path(const Flags& flags);

}  // namespace certkv::tools
