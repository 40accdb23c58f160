// Whether the client of a request is still connected, for handlers that wait on the engine.
//
// Debian's cpp-httplib (0.11) gives a handler no way to learn that its client hung up
// (Request::is_connection_closed came later), and a non-streaming handler writes nothing until
// the answer is ready. The handler's thread serves the request's connection (connection.h), whose
// socket stays open while the handler runs and its response is written.
#pragma once

namespace certkv::server {

class ClientConnection {
 public:
  // socket: the connection's; -1 reads as connected.
  explicit ClientConnection(int socket) : socket_(socket) {}
  // True once the peer has closed its side or the connection failed (checked without blocking).
  bool closed() const;

 private:
  int socket_ = -1;
};

}  // namespace certkv::server
