// The HTTP front end: one engine (through the C API) driven by a RequestScheduler, OpenAI's
// endpoints, /health, /tokenize, /detokenize and /metrics (docs/server.md).
//
// Life cycle: bind() (the port is open; /health answers 503 "loading"), then listen() on one
// thread and load() on another; stop() cancels every request (a waiting client gets 503) and ends
// listen(). Thread safety: stop() and port() may be called from any thread.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "server_options.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace certkv::server {

class ConnectionServer;
class ServerState;

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds options.host:options.port (port 0: a free one). Returns the port; throws
  // std::runtime_error when the address cannot be bound.
  int bind();
  // Loads the model and creates the engine; /health turns 200. Throws std::runtime_error with
  // the C API's message (the health endpoint then reports it).
  void load();
  // Serves until stop(). REQUIRES: bind() succeeded.
  void listen();
  void stop();
  int port() const { return port_; }

 private:
  void install_routes();

  ServerOptions options_;
  std::unique_ptr<ConnectionServer> http_;
  std::unique_ptr<ServerState> state_;
  int port_ = 0;
};

// The `certkv serve` command: parses the options (argv[0] is the command's name), binds, loads,
// serves until SIGINT or SIGTERM. Returns the process exit status (2: bad options, 1: failure).
int serve_main(int argc, char** argv);

}  // namespace certkv::server
