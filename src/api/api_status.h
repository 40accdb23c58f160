// The C API's error reporting, shared by its source files: certkv_last_error() reads a per-thread
// message that set_error records; guarded() maps every exception escaping a call to a status.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

#include "certkv/certkv.h"
#include "core/status.h"

namespace certkv::api {

// Records `message` as this thread's last error; returns `status`.
certkv_status set_error(certkv_status status, const std::string& message);
void clear_error();
// This thread's last message ("" if none).
const char* last_error();

// Runs fn; maps exceptions to status codes and records their message.
template <typename Fn>
certkv_status guarded(Fn&& fn) {
  try {
    clear_error();
    fn();
    return CERTKV_OK;
  } catch (const certkv::Error& e) {
    return set_error(static_cast<certkv_status>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(CERTKV_ERR_OUT_OF_MEMORY, "out of host memory");
  } catch (const std::exception& e) {
    return set_error(CERTKV_ERR_INTERNAL, e.what());
  }
}

}  // namespace certkv::api

// In a function returning certkv_status: fails with INVALID_ARGUMENT and `message` unless cond.
#define CERTKV_REQUIRE(cond, message)                                                  \
  do {                                                                                 \
    if (!(cond)) return ::certkv::api::set_error(CERTKV_ERR_INVALID_ARGUMENT, (message)); \
  } while (0)
