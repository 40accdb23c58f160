// certkv-serve: the server's executable until `certkv serve` dispatches to serve_main.
#include "http_server.h"

int main(int argc, char** argv) { return certkv::server::serve_main(argc, argv); }
