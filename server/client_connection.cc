#include "client_connection.h"

#include <poll.h>
#include <sys/socket.h>

namespace certkv::server {

bool ClientConnection::closed() const {
  if (socket_ < 0) return false;
  pollfd p{socket_, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  char byte;
  return recv(socket_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace certkv::server
