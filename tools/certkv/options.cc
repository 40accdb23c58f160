#include "options.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "cpu_cores.h"
#include "kv_flags.h"

namespace certkv::tools {
namespace {

constexpr uint32_t kEval = kEvalTeacherForced | kEvalNeedle;
constexpr uint32_t kGenerate = kRun | kBatch;
constexpr uint32_t kKvCommands = kRun | kBatch | kEval | kAudit;  // the KV-scheme and meter flags
constexpr uint32_t kModelCommands = kRun | kBatch | kDumpKv | kInfo | kEval | kAudit;

using V = ValueType;

std::vector<Option> make_option_table() {
  const std::string cores = std::to_string(physical_cores());
  return {
      // Model and input.
      {"model", 'm', V::kPath, "PATH", "", kModelCommands,
       "GGUF file or Hugging Face folder (default: $CERTKV_MODEL, else the embedded SmolLM2-135M-Instruct)"},
      {"prompt", 'p', V::kText, "TEXT", "Write a short poem about the sea.", kRun, "the prompt"},
      {"prompt-file", 'f', V::kPath, "FILE", "", kRun, "read the prompt from FILE (instead of --prompt)"},
      {"system", '\0', V::kText, "TEXT", "", kRun, "a system message before the prompt (chat template)"},
      {"raw", '\0', V::kSwitch, "", "", kGenerate, "feed the prompt as is, without the model's chat template"},
      {"prompts-file", '\0', V::kPath, "F.jsonl", "", kBatch,
       "the requests, one JSON object per line (required)"},
      {"text-file", '\0', V::kPath, "FILE", "", kDumpKv | kEvalTeacherForced | kAudit,
       "the text whose first --tokens tokens are run (required)"},
      // Lengths.
      {"n", 'n', V::kInteger, "N", "128", kRun, "tokens to generate"},
      {"n", 'n', V::kInteger, "N", "128", kBatch, "max_tokens of the lines without one"},
      {"ctx", 'c', V::kInteger, "N", "", kRun,
       "context tokens (default: the prompt plus --n, at most the model's context)"},
      {"ctx", 'c', V::kInteger, "N", "", kBatch,
       "tokens of one sequence (default: the longest prompt plus its max_tokens)"},
      {"tokens", '\0', V::kInteger, "N", "", kDumpKv, "tokens of --text-file to prefill (required)"},
      {"tokens", '\0', V::kInteger, "N", "1024", kEvalTeacherForced, "tokens of --text-file to evaluate"},
      {"tokens", '\0', V::kInteger, "N", "2048", kAudit, "tokens of --text-file to run"},
      {"steps", '\0', V::kInteger, "K", "0", kEvalTeacherForced,
       "the last K positions run as metered decode steps"},
      {"steps", '\0', V::kInteger, "K", "", kAudit,
       "the last K positions are audited decode steps (default: 64, at most --tokens - 1)"},
      // Compute.
      {"threads", 't', V::kInteger, "N", cores, kModelCommands & ~kInfo,
       "threads (default: the physical cores, " + cores + ")"},
      {"block-tokens", '\0', V::kInteger, "N", "16", kGenerate | kEval | kAudit | kCodec, "tokens per KV page"},
      {"activations", '\0', V::kText, "int8|f32", "int8", kGenerate,
       "weight-product arithmetic: int8 activations per 32-block (as llama.cpp) or exact f32"},
      {"device", '\0', V::kText, "cpu|cuda", "cpu", kRun | kBatch,
       "where attention runs (cuda: the schemes marked [cuda] below; batch: the KV pool on the GPU too)"},
      // Sampling.
      {"temp", '\0', V::kNumber, "T", "0", kGenerate, "sampling temperature (below 1e-6, 0 included: greedy)"},
      {"top-k", '\0', V::kInteger, "K", "0", kGenerate, "sample from the K most likely tokens (0: off)"},
      {"top-p", '\0', V::kNumber, "P", "1", kGenerate, "sample from the smallest set holding mass P"},
      {"seed", 's', V::kInteger, "S", "0", kGenerate, "sampling seed"},
      {"seed", 's', V::kInteger, "S", "1", kEvalNeedle, "seed of the generated tasks"},
      {"seed", 's', V::kInteger, "S", "1", kAudit, "seed of the sampled cells (--dump)"},
      // The engine.
      {"parallel", '\0', V::kInteger, "N", "8", kBatch, "sequences decoding at once"},
      {"pool-bytes", '\0', V::kInteger, "B", "", kBatch,
       "KV pool in bytes: of raw pages on the CPU, of each class's own pages with --device cuda (default: --parallel whole contexts)"},
      {"step-tokens", '\0', V::kInteger, "N", "512", kBatch, "the most tokens one step runs (prefill chunking)"},
      {"no-prefix-sharing", '\0', V::kSwitch, "", "", kBatch, "compute every prompt in full"},
      {"preemption", '\0', V::kText, "swap|recompute", "swap", kBatch,
       "when the pool runs out, the newest request's KV goes to host memory (swap) or is freed and "
       "computed again (recompute)"},
      // KV scheme, meter, gate, sparse decode.
      {"kv", '\0', V::kText, "SCHEME", "bf16", kGenerate, "KV cache scheme (SCHEME below)"},
      {"kv", '\0', V::kText, "SCHEME", "", kEval, "the KV cache scheme evaluated (required; SCHEME below)"},
      {"kv", '\0', V::kText, "SCHEME", "", kAudit,
       "the KV cache scheme audited (required without --sparse, else bf16; SCHEME below)"},
      {"gaac-calib", '\0', V::kPath, "CAL", "", kKvCommands,
       "GAAC calibration (default for gaac schemes: calibrated on a built-in text, cached)"},
      {"outlier-pairs", '\0', V::kInteger, "M", "", kKvCommands,
       "dither8: RoPE pairs per (layer, kv_head) kept exact (default 4)"},
      {"window", '\0', V::kInteger, "N", "", kKvCommands,
       "lossy schemes: newest tokens kept bf16 (default: kivi2 128, others 0)"},
      {"witness", '\0', V::kText, "fp16|u8|exponent", "", kKvCommands,
       "Tier A schemes: how K pages store the meter's witness (default fp16; exponent: no bytes, fp8-e4m3 only)"},
      {"delta", '\0', V::kNumber, "D", "0.01", kKvCommands, "failure budget of the Tier B certificate, in (0, 1)"},
      {"tau", '\0', V::kNumber, "T", "0.2", kKvCommands, "meter threshold of coverage and the gate, > 0"},
      {"gate", '\0', V::kSwitch, "", "", kKvCommands, "repair from exact KV when a meter exceeds --tau"},
      {"no-meter", '\0', V::kSwitch, "", "", kKvCommands, "lossy schemes: no meter"},
      {"sparse", '\0', V::kText, "p=P[,...]", "", kKvCommands,
       "sparse decode: p=P[,deviations=Z][,window=N][,dense=L][,rotation=haar|hadamard]"},
      {"rules", '\0', V::kText, "P[zZ],...", "", kAudit,
       "with --sparse: also audit these Top-p rules on the same cells (p P widened by Z deviations)"},
      // Output.
      {"json", '\0', V::kSwitch, "", "", kRun | kInfo | kEval | kAudit | kCodec, "print one JSON object"},
      {"json", '\0', V::kSwitch, "", "", kBatch, "accepted: the output is always JSON lines"},
      {"per-position", '\0', V::kSwitch, "", "", kEvalTeacherForced,
       "with --json: KL, top-1 and top-5 of every position"},
      // dump-kv.
      {"out", '\0', V::kPath, "FILE.safetensors", "", kDumpKv, "where to write the dump (required)"},
      {"layers", '\0', V::kList, "LIST", "all", kDumpKv, "layers to dump: all, or indices and ranges (0,5,10-12)"},
      // eval needle.
      {"lengths", '\0', V::kList, "L1,L2,...", "1024,2048", kEvalNeedle, "prompt lengths in tokens"},
      {"samples", '\0', V::kInteger, "N", "8", kEvalNeedle, "tasks per length"},
      {"variant", '\0', V::kText, "NAME", "single", kEvalNeedle, "single, multi-key, multi-value or multi-query"},
      {"haystack", '\0', V::kText, "noise|corpus", "noise", kEvalNeedle,
       "filler text: noise sentences or public-domain books"},
      {"corpus", '\0', V::kPath, "DIR", "", kEvalNeedle,
       "with --haystack corpus: the folder of dickens-tale-of-two-cities.txt, melville-moby-dick.txt and "
       "austen-emma.txt (default: shared/data/corpus beside the source tree it was built from)"},
      {"max-new", '\0', V::kInteger, "N", "16", kEvalNeedle, "tokens generated per answer"},
      // audit.
      {"dump", '\0', V::kPath, "FILE.safetensors", "", kAudit, "write sampled cells there"},
      {"dump-cells", '\0', V::kInteger, "C", "16", kAudit, "cells --dump keeps"},
      // codec.
      {"codec", '\0', V::kText, "NAME", "", kCodec, "gaac, gaac-e4m3 or gaac-e5m2 (required)"},
      {"calib", '\0', V::kList, "CAL[,CAL2...]", "", kCodec,
       "KV dumps to calibrate from, or one saved calibration file (required)"},
      {"in", '\0', V::kPath, "KV.safetensors", "", kCodec,
       "the KV dump to encode, decode and compare bit for bit (without it: only calibrate)"},
      {"verify", '\0', V::kSwitch, "", "", kCodec,
       "also run the plain _ref encoder and decoder on every page and require the same bytes"},
      {"save-calibration", '\0', V::kPath, "OUT", "", kCodec, "write the calibration there"},
      {"passes", '\0', V::kInteger, "N", "3", kCodec, "timed encode/decode passes (one core); the fastest counts"},
      {"segment-tokens", '\0', V::kInteger, "N", "1024", kCodec, "position segment of the drift breakdown"},
  };
}

constexpr const char* kRunDescription =
    "Generates text from a prompt (greedy by default) and prints it with a summary line, or one\n"
    "JSON object with --json.\n"
    "--sparse: decode attends, per layer and head, the fewest indexed tokens holding estimated\n"
    "attention mass P (a 1-bit RaBitQ key index) plus the newest N tokens (default 128); the first\n"
    "L layers (default 2) stay dense. Combines with any --kv scheme.\n"
    "--device cuda: decode attention on a CUDA device over its own copy of the KV cache, encoded\n"
    "there (the schemes marked [cuda] below, lossy ones with the meter computed there; --sparse\n"
    "with --kv bf16; no --gate); the forward pass and prefill stay on the CPU.\n";

constexpr const char* kBatchDescription =
    "Runs every request of F (one JSON object per line: \"prompt\" or \"messages\", optional\n"
    "\"max_tokens\", \"temperature\", \"top_p\", \"top_k\", \"seed\", \"stop\", \"ignore_eos\", \"id\") through\n"
    "the engine: up to N sequences decode together over one KV pool, prompts are prefilled in\n"
    "chunks between their steps, and whole prompt blocks are shared between requests that begin alike.\n"
    "Prints one JSON line per request (id, text, tokens, ttft_ms, the certificate) in input\n"
    "order, then a summary line with \"summary\": true.\n";

constexpr const char* kTeacherForcedDescription =
    "KL(bf16 || SCHEME), top-1 and top-5 agreement per position of the first N tokens of F,\n"
    "against the bf16-KV run of the same model; the last K positions run as metered decode steps\n"
    "and their meter telemetry is reported.\n";

constexpr const char* kNeedleDescription =
    "Needle retrieval: a haystack with \"One of the special magic numbers for <key> is: <number>.\"\n"
    "inside it at a random depth, a question asking for it, exact-match scoring.\n";

constexpr const char* kAuditDescription =
    "Runs the first N tokens of F through a compressed cache whose exact blocks are kept beside\n"
    "it; the last K positions are decode steps whose every (layer, head) cell checks meter >= the\n"
    "true total variation of attention. Prints cells, violations, coverage at tau and the\n"
    "tightness (meter / TV) quantiles; --dump writes sampled cells.\n"
    "With --sparse: sparse decode beside exact attention on the last K positions: per layer the\n"
    "budget (fraction of tokens attended) and recall (exact attention mass of the attended set),\n"
    "the key estimator's error, and fixed top-k and Quest page selection at the same mean budget;\n"
    "--rules: budget and recall of other Top-p rules selecting on the same cells (the decode\n"
    "follows --sparse).\n";

constexpr const char* kCodecDescription =
    "GAAC on real KV dumps: calibrates on some dumps (or loads a saved calibration), encodes every\n"
    "(layer, K/V, kv_head) page of --in, decodes it, compares it bit for bit and reports the\n"
    "stored size, the mode mix and the codec speed. gaac codes BF16 exponents; gaac-e4m3 /\n"
    "gaac-e5m2 first cast the KV to FP8 (round to nearest even, saturating) and code the FP8\n"
    "exponents. --calib files are told apart by their metadata \"format\".\n";

std::string flag_text(const Option& o) {
  std::string s = o.short_name ? std::string("-") + o.short_name + ", " : "    ";
  s += "--" + o.name;
  if (o.type != ValueType::kSwitch) s += " " + o.value_name;
  return s;
}

// Levenshtein distance, for the suggestion after an unknown flag.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The commands (by name) whose rows include `name`.
std::string commands_taking(const std::string& name) {
  std::string out;
  for (const CommandInfo& c : command_table())
    for (const Option& o : option_table())
      if (o.name == name && (o.commands & c.id)) {
        out += (out.empty() ? "" : ", ") + std::string("certkv ") + c.name;
        break;
      }
  return out;
}

}  // namespace

const std::vector<Option>& option_table() {
  static const std::vector<Option> table = make_option_table();
  return table;
}

const std::vector<CommandInfo>& command_table() {
  static const std::vector<CommandInfo> table = {
      {kRun, "run", "generate text from a prompt", "[flags]", kRunDescription, true},
      {kBatch, "batch", "many prompts at once through the engine (JSON lines in, JSON lines out)",
       "--prompts-file F.jsonl [flags]", kBatchDescription, true},
      {kDumpKv, "dump-kv", "write a prefill's post-RoPE K/V and last queries to safetensors",
       "--text-file F --tokens N --out FILE.safetensors [flags]", "", false},
      {kInfo, "info", "print a model's configuration", "[flags]", "", false},
      {kEvalTeacherForced, "eval teacher-forced", "KL and top-k agreement of a KV scheme against bf16",
       "--kv SCHEME --text-file F [flags]", kTeacherForcedDescription, true},
      {kEvalNeedle, "eval needle", "needle-in-a-haystack retrieval through a KV scheme",
       "--kv SCHEME [flags]", kNeedleDescription, true},
      {kAudit, "audit", "check the meter against the true attention error, or audit sparse decode",
       "--kv SCHEME | --sparse p=P  --text-file F [flags]", kAuditDescription, true},
      {kCodec, "codec", "GAAC on a KV dump: calibrate, encode, verify, measure",
       "--codec NAME --calib CAL[,CAL2...] [--in KV.safetensors] [flags]", kCodecDescription, false},
  };
  return table;
}

const CommandInfo& command_info(Command id) {
  for (const CommandInfo& c : command_table())
    if (c.id == id) return c;
  return command_table().front();
}

std::string overview_help() {
  std::string out =
      "usage: certkv COMMAND [flags]     (certkv COMMAND -h: that command's flags)\n"
      "       certkv --version\n"
      "commands:\n";
  for (const CommandInfo& c : command_table()) {
    std::string name = "  " + std::string(c.name);
    name.resize(std::max<size_t>(name.size() + 2, 24), ' ');
    out += name + c.summary + "\n";
  }
  // `certkv serve` parses its own flags (server/server_options.h): certkv serve -h lists them.
  out += "  serve                 the OpenAI-compatible HTTP server, the meter in every response\n";
  out += "With no --model, the embedded default SmolLM2-135M-Instruct (models/, fetched by\n"
         "scripts/fetch_models.sh) is used.\n";
  return out;
}

std::string command_help(Command id) {
  const CommandInfo& c = command_info(id);
  std::string out = "usage: certkv " + std::string(c.name) + " " + c.synopsis + "\n" + c.description + "flags:\n";
  for (const Option& o : option_table()) {
    if (!(o.commands & id)) continue;
    std::string line = "  " + flag_text(o);
    line.resize(std::max<size_t>(line.size() + 2, 30), ' ');
    line += o.help;
    const bool default_in_help = o.help.find("default") != std::string::npos;
    if (!o.default_value.empty() && !default_in_help)
      line += o.default_value.find(' ') == std::string::npos ? " (default " + o.default_value + ")"
                                                             : " (default \"" + o.default_value + "\")";
    out += line + "\n";
  }
  out += "  -h, --help                  this help\n";
  if (c.kv_schemes) out += kv_scheme_help();
  return out;
}

const Option& Flags::row(const std::string& name) const {
  for (const Option& o : option_table())
    if (o.name == name && (o.commands & command_)) return o;
  // A flag the command's code reads must be in its table rows: a programming error.
  throw std::logic_error("flag --" + name + " is not in the option table of certkv " +
                         command_info(command_).name);
}

void Flags::parse(int argc, char** argv, int first) {
  const std::string command = command_info(command_).name;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      fputs(command_help(command_).c_str(), stdout);
      exit(0);
    }
    const Option* option = nullptr;
    std::string value, shown;
    bool inline_value = false;
    if (a.size() == 2 && a[0] == '-' && a[1] != '-') {
      for (const Option& o : option_table())
        if (o.short_name == a[1] && (o.commands & command_)) option = &o;
      if (option == nullptr) throw UsageError{"unknown flag " + a + " (certkv " + command + " -h lists its flags)"};
      shown = a;
    } else if (a.rfind("--", 0) == 0 && a.size() > 2) {
      std::string name = a.substr(2);
      const size_t eq = name.find('=');
      inline_value = eq != std::string::npos;
      if (inline_value) value = name.substr(eq + 1), name = name.substr(0, eq);
      shown = "--" + name;
      for (const Option& o : option_table())
        if (o.name == name && (o.commands & command_)) option = &o;
      if (option == nullptr) {
        const std::string elsewhere = commands_taking(name);
        if (!elsewhere.empty())
          throw UsageError{"flag " + shown + " is not a flag of certkv " + command + " (" + elsewhere +
                           (elsewhere.find(',') == std::string::npos ? " takes" : " take") + " it; certkv " +
                           command + " -h lists its flags)"};
        std::string nearest;  // a near miss: at most 2 edits away, else a flag it begins
        size_t best = 3;
        for (const Option& o : option_table()) {
          if (!(o.commands & command_)) continue;
          const size_t d = edit_distance(name, o.name);
          if (d < best) best = d, nearest = o.name;
        }
        if (nearest.empty() && name.size() >= 3)
          for (const Option& o : option_table())
            if ((o.commands & command_) && o.name.rfind(name, 0) == 0) {
              nearest = o.name;
              break;
            }
        throw UsageError{"unknown flag " + shown +
                         (nearest.empty() ? std::string() : " (did you mean --" + nearest + "?)") +
                         "; certkv " + command + " -h lists its flags"};
      }
    } else {
      throw UsageError{"unexpected argument '" + a + "' (flags start with --; certkv " + command +
                       " -h lists them)"};
    }
    const std::string& name = option->name;
    if (option->type != ValueType::kSwitch) {
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError{"flag " + shown + " needs a value (" + option->value_name + ")"};
        value = argv[++i];
      }
    } else if (inline_value) {
      throw UsageError{"flag " + shown + " takes no value"};
    }
    if (values_.count(name)) throw UsageError{"flag --" + name + " given twice"};
    values_[name] = value;
  }
}

std::string Flags::value_or_default(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() ? it->second : row(name).default_value;
}

std::string Flags::str(const std::string& name) const { return value_or_default(name); }

int64_t Flags::integer(const std::string& name, int64_t lo, int64_t hi) const {
  const std::string v = value_or_default(name);
  char* end = nullptr;
  errno = 0;
  const long long x = strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
    throw UsageError{"flag --" + name + " expects an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got '" + v + "'"};
  return x;
}

double Flags::real(const std::string& name, double lo, double hi) const {
  const std::string v = value_or_default(name);
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
