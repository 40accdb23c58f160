// Whether the client of a request is still connected, for handlers that wait on the engine.
//
// Debian's cpp-httplib (0.11) gives a handler no way to learn that its client hung up
// (Request::is_connection_closed came later), and a non-streaming handler writes nothing until
// the answer is ready. The connection's socket is found by its addresses instead: the one socket
// of this process whose peer is the request's remote address and port and whose local port is
// the request's. It stays open while the handler runs, so the descriptor cannot be reused under
// it.
#pragma once

#include <string>

namespace certkv::server {

class ClientConnection {
 public:
  // Finds the socket; a connection not found (not Linux, no /proc) reads as connected.
  ClientConnection(const std::string& remote_addr, int remote_port, int local_port);
  // True once the peer has closed its side or the connection failed (checked without blocking).
  bool closed() const;

 private:
  int socket_ = -1;
};

}  // namespace certkv::server
