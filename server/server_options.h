// The options of `certkv serve` (the certkv-serve executable): what the server loads and how it
// listens.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace certkv::server {

struct ServerOptions {
  std::string model_path;          // -m/--model: GGUF file or Hugging Face folder
  std::string host = "127.0.0.1";  // --host
  int port = 8080;                 // --port; 0: a free port chosen by the system
  int parallel = 4;                // -np/--parallel: requests decoding at once
  int64_t step_tokens = 512;       // --step-tokens: the most tokens one engine step runs
  int64_t ctx_tokens = 0;          // -c/--ctx: tokens of one request; 0: the model's context
  std::string kv = "bf16";         // --kv: KV scheme (certkv_session_params.kv)
  std::string witness;             // --witness: Tier A witness (certkv_session_params.witness); "": the scheme's
  double sparse_p = 0;             // --sparse p=P[,window=N][,dense=N]: 0 is dense decode
  int32_t sparse_window = -1;
  int32_t sparse_dense_layers = -1;
  bool gate = false;               // --gate: repair cells whose meter exceeds tau
  bool meter = true;               // --no-meter: lossy schemes compute no meter (no certificate)
  double tau = 0.2;                // --tau
  std::string device = "cpu";      // --device cpu|cuda
  std::string api_key;             // --api-key: required as "Authorization: Bearer KEY"
  uint64_t pool_bytes = 0;         // --pool-bytes: KV pool; 0: parallel whole contexts
  int threads = 2;                 // -t/--threads
  int http_threads = 0;            // --threads-http: connections served at once; 0: max(32, 4 x parallel)
  uint64_t max_body_bytes = 1 << 20;  // --max-body-bytes: larger request bodies get 413
  // --request-timeout: seconds a client has to send a request's line and headers (from connecting,
  // or from the end of the previous response), and its body (once more per 64 KiB received); a
  // connection past it is closed, so slow clients cannot hold the HTTP threads.
  double request_timeout_seconds = 10;
};

// A command line the server cannot run with; what() names the flag and the value.
struct OptionError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// request_timeout_seconds as a duration, rounded to the millisecond. Throws OptionError outside
// [0.1, 3600] (the range --request-timeout accepts).
std::chrono::milliseconds request_timeout(const ServerOptions& options);

extern const char* const kServeUsage;

// argv[0] is the command's name; options follow. Throws OptionError.
ServerOptions parse_server_options(int argc, const char* const* argv);

}  // namespace certkv::server
