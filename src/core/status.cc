#include "core/status.h"

namespace certkv {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kCorrupt: return "corrupt data";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfMemory: return "out of memory";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kIo: return "i/o error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown status";
}

void fail(StatusCode code, const std::string& message) { throw Error(code, message); }

}  // namespace certkv
