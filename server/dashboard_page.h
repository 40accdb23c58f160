// The dashboard served at GET / (docs/server.md): server/dashboard.html, compiled into the binary
// by CMake (dashboard_page.cc.in), so the server needs no file, no CDN and no build step for it.
#pragma once

namespace certkv::server {

// The page, NUL-terminated UTF-8 HTML with its script and style inline.
extern const char kDashboardPage[];

}  // namespace certkv::server
