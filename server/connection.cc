#include "connection.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace certkv::server {

namespace {

thread_local Connection* t_connection = nullptr;

// How often the keep-alive wait looks whether the server is stopping.
constexpr std::chrono::milliseconds kStopCheck{100};

// The numeric address and port of a socket's own (local) or peer's end; "" and -1 on failure.
void address_of(socket_t sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  ip.clear();
  port = -1;
  if ((peer ? getpeername(sock, reinterpret_cast<sockaddr*>(&a), &len)
            : getsockname(sock, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
    return;
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, serv, sizeof serv,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return;
  ip = host;
  port = std::atoi(serv);
}

}  // namespace

Connection* current_connection() { return t_connection; }

Connection::Connection(socket_t sock, std::chrono::microseconds read_timeout, std::chrono::microseconds write_timeout)
    : sock_(sock), read_timeout_(read_timeout), write_timeout_(write_timeout) {}

void Connection::set_deadline(Clock::time_point deadline) {
  deadline_ = deadline;
  body_start_.reset();
}

void Connection::expect_body(std::chrono::milliseconds per_chunk) {
  body_start_ = Clock::now();
  body_bytes_ = 0;
  body_per_chunk_ = per_chunk;
  deadline_ = *body_start_ + per_chunk;
}

void Connection::clear_deadline() {
  deadline_.reset();
  body_start_.reset();
}

void Connection::count_body_bytes(size_t n) {
  if (!body_start_) return;
  body_bytes_ += n;
  // In double seconds, capped at a day: a huge body cannot overflow the clock's nanoseconds.
  const double chunks = 1.0 + double(body_bytes_ / kBodyChunkBytes);
  const double seconds = std::min(86400.0, chunks * std::chrono::duration<double>(body_per_chunk_).count());
  deadline_ = *body_start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

bool Connection::wait(short events, std::chrono::microseconds timeout) const {
  const Clock::time_point start = Clock::now();
  for (;;) {
    std::chrono::microseconds left = timeout - std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    bool at_deadline = false;
    if ((events & POLLIN) && deadline_) {
      const auto to_deadline = std::chrono::duration_cast<std::chrono::microseconds>(*deadline_ - Clock::now());
      if (to_deadline <= left) {
        left = to_deadline;
        at_deadline = true;
      }
    }
    pollfd p{sock_, events, 0};
    // At or past a limit: one look without waiting (what is already there counts).
    const int n = poll(&p, 1, left.count() <= 0 ? 0 : int((left.count() + 999) / 1000));
    if (n > 0) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    const bool deadline_passed = at_deadline && Clock::now() >= *deadline_;
    const bool timeout_passed = Clock::now() - start >= timeout;
    if (deadline_passed) missed_deadline_ = true;
    if (deadline_passed || timeout_passed) return false;
  }
}

Connection::WaitResult Connection::wait_for_request(std::chrono::milliseconds wait) {
  if (end_ > begin_) return WaitResult::kReady;
  if (!this->wait(POLLIN, wait)) return missed_deadline_ ? WaitResult::kClosed : WaitResult::kIdle;
  char byte;
  const ssize_t n = recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 ? WaitResult::kReady : (n < 0 && (errno == EAGAIN || errno == EINTR)) ? WaitResult::kIdle : WaitResult::kClosed;
}

bool Connection::next_request() {
  const bool usable = routed_ && !read_failed_ && !close_after_response_;
  routed_ = false;
  return usable;
}

bool Connection::is_readable() const { return end_ > begin_ || wait(POLLIN, read_timeout_); }

bool Connection::is_writable() const {
  if (!wait(POLLOUT, write_timeout_)) return false;
  // Writable, and the peer has not closed its side (httplib's is_socket_alive).
  pollfd p{sock_, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return true;
  char byte;
  const ssize_t n = recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR));
}

ssize_t Connection::read(char* ptr, size_t size) {
  if (end_ == begin_) {
    if (!is_readable()) {
      read_failed_ = true;
      return -1;
    }
    ssize_t n;
    do {
      n = size >= buffer_.size() ? recv(sock_, ptr, size, 0) : recv(sock_, buffer_.data(), buffer_.size(), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      read_failed_ = true;
      return n;
    }
    if (size >= buffer_.size()) {
      count_body_bytes(size_t(n));
      return n;
    }
    begin_ = 0;
    end_ = size_t(n);
  }
  const size_t n = std::min(size, end_ - begin_);
  std::memcpy(ptr, buffer_.data() + begin_, n);
  begin_ += n;
  count_body_bytes(n);
  return ssize_t(n);
}

ssize_t Connection::write(const char* ptr, size_t size) {
  if (!is_writable()) return -1;
  ssize_t n;
  do {
    n = send(sock_, ptr, size, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n;
}

void Connection::get_remote_ip_and_port(std::string& ip, int& port) const { address_of(sock_, true, ip, port); }

void Connection::get_local_ip_and_port(std::string& ip, int& port) const { address_of(sock_, false, ip, port); }

bool ConnectionServer::process_and_close_socket(socket_t sock) {
  Connection connection(sock, std::chrono::seconds(read_timeout_sec_) + std::chrono::microseconds(read_timeout_usec_),
                        std::chrono::seconds(write_timeout_sec_) + std::chrono::microseconds(write_timeout_usec_));
  struct Serving {  // the thread's connection, until the socket is closed (an exception included)
    Connection& c;
    socket_t sock;
    explicit Serving(Connection& connection, socket_t s) : c(connection), sock(s) { t_connection = &c; }
    ~Serving() {
      t_connection = nullptr;
      shutdown(sock, SHUT_RDWR);
      close(sock);
    }
  } serving(connection, sock);
  connection.set_deadline(Connection::Clock::now() + head_);
  bool served = false;
  // As httplib's own loop: up to keep_alive_max_count_ requests, each waited for up to
  // keep_alive_timeout_sec_ (and within its head's deadline), while the server runs.
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    const Connection::Clock::time_point until = Connection::Clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
    Connection::WaitResult next = Connection::WaitResult::kIdle;
    while (next == Connection::WaitResult::kIdle && svr_sock_ != INVALID_SOCKET) {
      const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - Connection::Clock::now());
      if (left_ms.count() <= 0) break;
      next = connection.wait_for_request(std::min(left_ms, kStopCheck));
    }
    if (next != Connection::WaitResult::kReady) break;
    bool connection_closed = false;
    served = process_request(connection, left == 1, connection_closed, nullptr);
    // A failed read (the deadline, the read timeout), a request the routes never saw (httplib
    // answered it from its headers) or one that asked to close: its connection closes, so a body
    // left unread is never taken as the next request.
    if (!served || connection_closed || !connection.next_request()) break;
    connection.set_deadline(Connection::Clock::now() + head_);  // the next request's head
  }
  if (connection.missed_deadline()) ++timed_out_;
  return served;
}

}  // namespace certkv::server
