// libFuzzer target: GgufFile::parse must either succeed or throw certkv::Error on any input;
// anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>

#include "core/status.h"
#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = certkv::model::GgufFile::parse(data, size, "fuzz.gguf");
    // Touch what a loader would read: every tensor's bytes and every typed getter.
    unsigned sum = 0;
    for (const auto& t : file->tensors()) {
      if (t.n_bytes > 0) sum += t.data[0] + t.data[t.n_bytes - 1];
      sum += static_cast<unsigned>(t.n_elements());
    }
    for (const auto& [key, value] : file->metadata()) {
      try {
        if (value.type == certkv::model::GgufType::kArray) {
          if (file->get_float_array(key)) ++sum;
        } else if (file->get_float(key)) {
          ++sum;
        }
      } catch (const certkv::Error&) {
      }
    }
    volatile unsigned sink = sum;
    (void)sink;
  } catch (const certkv::Error&) {
  }
  return 0;
}
