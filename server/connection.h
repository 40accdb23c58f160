// The server's side of one client connection, served by certkv's own loop over cpp-httplib's
// request processing, with a deadline on what the client must send.
//
// Debian's cpp-httplib (0.11) serves each connection in its own loop, where a client that sends a
// header line now and then, every read within the read timeout, holds a thread for as long as it
// likes (a "slowloris": a few dozen such clients hold every thread of the server). ConnectionServer
// serves connections itself (httplib's process_request for each request, as its TLS server does):
// each connection has at most one deadline, for a request's head (its line and headers, from the
// connection's start or the end of the previous response), then for its body (paced: more time
// as more of it comes). A read past the deadline fails, and a connection whose read failed is
// closed. The server's own time has none: a handler computing a completion, a stream being
// written. The routes set the deadline of the connection their thread serves (current_connection).
// A request httplib answers before the routes see it (a malformed Range, an overlong line) closes
// its connection too: its body was never read.
#pragma once

#include <httplib.h>

#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>

namespace certkv::server {

class Connection final : public httplib::Stream {
 public:
  using Clock = std::chrono::steady_clock;

  // sock: a connected socket, closed by the caller. Each read and write waits at most its timeout.
  Connection(socket_t sock, std::chrono::microseconds read_timeout, std::chrono::microseconds write_timeout);

  // The time by which the client must have sent what is being read (a request's head).
  void set_deadline(Clock::time_point deadline);
  // A body is read next: the client has `per_chunk` from now, and `per_chunk` more for each
  // kBodyChunkBytes it sends (at most a day in all).
  void expect_body(std::chrono::milliseconds per_chunk);
  // No deadline: the server's own time (a handler computing, a response being written).
  void clear_deadline();
  static constexpr uint64_t kBodyChunkBytes = 64 << 10;

  // Whether a read failed at the deadline (next_request also ends the connection after a read
  // failed for any reason: what the peer sends later must not be taken as a request).
  bool missed_deadline() const { return missed_deadline_; }
  // Marks the current request as seen by the routes (its headers passed httplib's own checks).
  void note_routed() { routed_ = true; }
  // Closes the connection once the current response is written (whatever it is, a HEAD's too).
  void close_after_response() { close_after_response_ = true; }

  // Waits up to `wait` for a byte of the next request (bytes already buffered count): kReady,
  // kIdle at the end of the wait, kClosed at the deadline, the peer's end of stream or an error.
  enum class WaitResult { kReady, kIdle, kClosed };
  WaitResult wait_for_request(std::chrono::milliseconds wait);
  // Starts the next request: whether the previous one leaves the connection usable (it was
  // routed, no read failed, nothing asked to close), then clears the per-request marks.
  bool next_request();

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return sock_; }

 private:
  // Waits for `events` up to the timeout, or the deadline when reading and it comes first (data
  // already there at the deadline counts as on time).
  bool wait(short events, std::chrono::microseconds timeout) const;
  void count_body_bytes(size_t n);

  socket_t sock_;
  std::chrono::microseconds read_timeout_, write_timeout_;
  std::optional<Clock::time_point> deadline_;
  // While a body is read: when it began, its bytes so far, the time per chunk.
  std::optional<Clock::time_point> body_start_;
  uint64_t body_bytes_ = 0;
  std::chrono::milliseconds body_per_chunk_{0};
  mutable bool missed_deadline_ = false;
  bool read_failed_ = false;
  bool routed_ = false;
  bool close_after_response_ = false;
  // Bytes received and not yet read (httplib reads a request's head a byte at a time).
  std::array<char, 4096> buffer_{};
  size_t begin_ = 0, end_ = 0;
};

// The connection the calling thread serves, or null (a thread not serving one).
Connection* current_connection();

// httplib's server with connections served by Connection. head: the time a client has for a
// request's line and headers, from connecting or from the end of the previous response.
class ConnectionServer final : public httplib::Server {
 public:
  explicit ConnectionServer(std::chrono::milliseconds head) : head_(head) {}
  // Connections closed for a missed deadline since the start.
  uint64_t timed_out() const { return timed_out_.load(); }

 private:
  bool process_and_close_socket(socket_t sock) override;

  const std::chrono::milliseconds head_;
  std::atomic<uint64_t> timed_out_{0};
};

}  // namespace certkv::server
