// libFuzzer target: SafetensorsFile::parse must either succeed or throw certkv::Error on any
// input; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>

#include "core/status.h"
#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = certkv::format::SafetensorsFile::parse(data, size, "fuzz.safetensors");
    unsigned sum = 0;
    for (const auto& t : file->tensors()) {
      if (t.n_bytes > 0) sum += t.data[0] + t.data[t.n_bytes - 1];
    }
    volatile unsigned sink = sum;
    (void)sink;
  } catch (const certkv::Error&) {
  }
  return 0;
}
