#include "server_options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string_view>

namespace certkv::server {

const char* const kServeUsage =
    "usage: certkv serve -m MODEL [options]\n"
    "  An OpenAI-compatible HTTP server over the certkv engine: POST /v1/chat/completions,\n"
    "  POST /v1/completions (streaming as server-sent events), GET /v1/models, GET /health,\n"
    "  POST /tokenize, POST /detokenize, GET /metrics (Prometheus). docs/server.md.\n"
    "options:\n"
    "  -m, --model PATH       GGUF file or Hugging Face folder (required)\n"
    "  --host H               address to listen on (default 127.0.0.1)\n"
    "  --port N               port (default 8080; 0: a free port, printed at start)\n"
    "  -np, --parallel N      requests decoding at once (default 4)\n"
    "  -c, --ctx N            tokens of one request, prompt and output (default: the model's)\n"
    "  --step-tokens N        the most tokens one engine step runs: every decode, then prompt\n"
    "                         chunks (default 512; smaller: shorter gaps between tokens, later\n"
    "                         first tokens)\n"
    "  --kv SCHEME            KV scheme: bf16 (default), gaac, fp8-e4m3, rtn8, dither8, ...\n"
    "  --witness W            Tier A schemes: how K pages keep the meter's witness: fp16, u8 or\n"
    "                         (fp8-e4m3) exponent, no bytes (default: the scheme's)\n"
    "  --sparse p=P[,window=N][,dense=N]   sparse decode keeping attention mass P (or --sparse P)\n"
    "  --gate                 repair from exact KV when a meter exceeds tau (lossy schemes)\n"
    "  --tau T                coverage and gate threshold (default 0.2)\n"
    "  --no-meter             lossy schemes: compute no meter (no certificate, no heatmap)\n"
    "  --device cpu|cuda      where decode attention runs (default cpu)\n"
    "  --api-key KEY          require 'Authorization: Bearer KEY' (all but /health)\n"
    "  --pool-bytes B         KV pool in bytes: raw pages on the CPU, each class's own pages on cuda\n"
    "                         (default: N whole contexts)\n"
    "  -t, --threads N        CPU threads of the forward pass (default 2)\n"
    "  --threads-http N       connections served at once, a streaming one holding its thread\n"
    "                         (default max(32, 4 x parallel))\n"
    "  --max-body-bytes B     larger request bodies are refused with 413 (default 1048576)\n"
    "  --request-timeout S    seconds a client has to send a request's line and headers, and again\n"
    "                         per 64 KiB of its body; a connection past it is closed (default 10)\n";

namespace {

int64_t parse_integer(std::string_view flag, const std::string& value, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    throw OptionError("flag " + std::string(flag) + ": expected an integer in [" + std::to_string(lo) +
                      ", " + std::to_string(hi) + "], got '" + value + "'");
  return v;
}

double parse_real(std::string_view flag, const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !std::isfinite(v))
    throw OptionError("flag " + std::string(flag) + ": expected a number, got '" + value + "'");
  return v;
}

// --sparse p=0.9,window=128,dense=2 or a bare p.
void parse_sparse(const std::string& spec, ServerOptions& o) {
  auto bad = [&](const std::string& why) {
    return OptionError("flag --sparse '" + spec + "': " + why + " (expected p=P[,window=N][,dense=N])");
  };
  o.sparse_p = -1;
  size_t begin = 0;
  while (begin <= spec.size()) {
    const size_t comma = spec.find(',', begin);
    const std::string item = spec.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    const size_t eq = item.find('=');
    const std::string key = eq == std::string::npos ? "p" : item.substr(0, eq);
    const std::string value = eq == std::string::npos ? item : item.substr(eq + 1);
    if (key == "p") o.sparse_p = parse_real("--sparse p", value);
    else if (key == "window") o.sparse_window = int32_t(parse_integer("--sparse window", value, 0, 1 << 30));
    else if (key == "dense") o.sparse_dense_layers = int32_t(parse_integer("--sparse dense", value, 0, 1 << 16));
    else throw bad("unknown key '" + key + "'");
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (!(o.sparse_p > 0 && o.sparse_p <= 1)) throw bad("p must be in (0, 1]");
}

}  // namespace

ServerOptions parse_server_options(int argc, const char* const* argv) {
  ServerOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw OptionError("flag " + flag + " needs a value");
      return argv[++i];
    };
    if (flag == "-m" || flag == "--model") o.model_path = value();
    else if (flag == "--host") o.host = value();
    else if (flag == "--port") o.port = int(parse_integer(flag, value(), 0, 65535));
    else if (flag == "-np" || flag == "--parallel") o.parallel = int(parse_integer(flag, value(), 1, 4096));
    else if (flag == "-c" || flag == "--ctx") o.ctx_tokens = parse_integer(flag, value(), 1, int64_t(1) << 31);
    else if (flag == "--step-tokens") o.step_tokens = parse_integer(flag, value(), 1, int64_t(1) << 31);
    else if (flag == "--kv") o.kv = value();
    else if (flag == "--witness") o.witness = value();  // checked with the scheme by the C API
    else if (flag == "--sparse") parse_sparse(value(), o);
    else if (flag == "--gate") o.gate = true;
    else if (flag == "--no-meter") o.meter = false;
    else if (flag == "--tau") {
      o.tau = parse_real(flag, value());
      if (!(o.tau > 0)) throw OptionError("flag --tau: must be positive, got " + std::string(argv[i]));
    } else if (flag == "--device") {
      o.device = value();
      if (o.device != "cpu" && o.device != "cuda")
        throw OptionError("flag --device: expected cpu or cuda, got '" + o.device + "'");
    } else if (flag == "--api-key") {
      o.api_key = value();
      if (o.api_key.empty()) throw OptionError("flag --api-key: the key is empty");
    } else if (flag == "--pool-bytes") o.pool_bytes = uint64_t(parse_integer(flag, value(), 1, INT64_MAX));
    else if (flag == "-t" || flag == "--threads") o.threads = int(parse_integer(flag, value(), 1, 256));
    else if (flag == "--threads-http") o.http_threads = int(parse_integer(flag, value(), 1, 4096));
    else if (flag == "--max-body-bytes") o.max_body_bytes = uint64_t(parse_integer(flag, value(), 1024, INT64_MAX));
    else if (flag == "--request-timeout") {
      o.request_timeout_seconds = parse_real(flag, value());
      request_timeout(o);  // the range
    } else throw OptionError("unknown flag '" + flag + "'");
  }
  if (o.model_path.empty()) throw OptionError("flag -m/--model is required");
  if (o.gate && o.sparse_p > 0) throw OptionError("flags --gate and --sparse do not combine yet (drop --gate)");
  if (o.gate && !o.meter) throw OptionError("flags --gate and --no-meter contradict: the gate repairs by the meter");
  return o;
}

std::chrono::milliseconds request_timeout(const ServerOptions& options) {
  const double s = options.request_timeout_seconds;
  if (!(s >= 0.1 && s <= 3600))
    throw OptionError("flag --request-timeout: expected seconds in [0.1, 3600], got " + std::to_string(s));
  return std::chrono::milliseconds(std::llround(s * 1000));
}

}  // namespace certkv::server
