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

bool Connection::wait(short events, std::chrono::microseconds timeout) const {
  const Clock::time_point start = Clock::now();
  for (;;) {
    std::chrono::microseconds left = timeout - std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    if ((events & POLLIN) && deadline_) {
      const auto to_deadline = std::chrono::duration_cast<std::chrono::microseconds>(*deadline_ - Clock::now());
      if (to_deadline.count() <= 0) {
        missed_deadline_ = true;
        return false;
      }
      left = std::min(left, to_deadline);
    }
    if (left.count() <= 0) return false;
    pollfd p{sock_, events, 0};
    const int n = poll(&p, 1, int((left.count() + 999) / 1000));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
    // A timeout (or a signal): the loop sees which limit came.
  }
}

Connection::WaitResult Connection::wait_for_request(std::chrono::milliseconds wait) {
  if (end_ > begin_) return WaitResult::kReady;
  if (!this->wait(POLLIN, wait)) return missed_deadline_ ? WaitResult::kClosed : WaitResult::kIdle;
  char byte;
  const ssize_t n = recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 ? WaitResult::kReady : (n < 0 && (errno == EAGAIN || errno == EINTR)) ? WaitResult::kIdle : WaitResult::kClosed;
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
    if (!is_readable()) return -1;
    ssize_t n;
    do {
      n = size >= buffer_.size() ? recv(sock_, ptr, size, 0) : recv(sock_, buffer_.data(), buffer_.size(), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0 || size >= buffer_.size()) return n;
    begin_ = 0;
    end_ = size_t(n);
  }
  const size_t n = std::min(size, end_ - begin_);
  std::memcpy(ptr, buffer_.data() + begin_, n);
  begin_ += n;
  return ssize_t(n);
}

ssize_t Connection::write(const char* ptr, size_t size) {
  if (!wait(POLLOUT, write_timeout_)) return -1;
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
  t_connection = &connection;
  connection.set_deadline(Connection::Clock::now() + head_);
  bool served = false;
  // As httplib's own loop: up to keep_alive_max_count_ requests, each waited for up to
  // keep_alive_timeout_sec_ (the first within the head's deadline too), while the server runs.
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    const Connection::Clock::time_point until = Connection::Clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
    Connection::WaitResult next = Connection::WaitResult::kIdle;
    while (next == Connection::WaitResult::kIdle && svr_sock_ != INVALID_SOCKET) {
      const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - Connection::Clock::now());
      if (left_ms.count() <= 0) break;
      next = connection.wait_for_request(std::min(left_ms, kStopCheck));
    }
    if (next != Connection::WaitResult::kReady) break;
    if (!connection.deadline()) connection.set_deadline(Connection::Clock::now() + head_);
    bool connection_closed = false;
    served = process_request(connection, left == 1, connection_closed, nullptr);
    // A request whose body missed the deadline is answered (httplib's 400) and its connection
    // closed: the rest of the body, arriving later, must not be read as a request.
    if (!served || connection_closed || connection.missed_deadline() || connection.closing()) break;
    connection.set_deadline(std::nullopt);  // the keep-alive wait is bounded by its own timeout
  }
  if (connection.missed_deadline()) ++timed_out_;
  t_connection = nullptr;
  shutdown(sock, SHUT_RDWR);
  close(sock);
  return served;
}

}  // namespace certkv::server
