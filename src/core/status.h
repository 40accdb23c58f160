// Errors inside certkv: C++ code throws certkv::Error; the C API turns it into a status code and a
// message (certkv_last_error). Every message names the thing at fault (a file, a flag, a tensor).
#pragma once

#include <stdexcept>
#include <string>

namespace certkv {

// Values match certkv_status in include/certkv/certkv.h.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kNotFound = 2,
  kCorrupt = 3,
  kUnsupported = 4,
  kOutOfMemory = 5,
  kOutOfRange = 6,
  kIo = 7,
  kInternal = 8,
};

const char* status_code_name(StatusCode code);

class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

[[noreturn]] void fail(StatusCode code, const std::string& message);

}  // namespace certkv
