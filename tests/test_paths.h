// Paths of the data the end-to-end tests read.
#pragma once

#include <string>

namespace certkv::testing {

inline std::string shared_path(const std::string& rel) { return std::string(CERTKV_SHARED_DIR) + "/" + rel; }
inline std::string models_path(const std::string& rel) { return std::string(CERTKV_MODELS_DIR) + "/" + rel; }
inline std::string source_path(const std::string& rel) { return std::string(CERTKV_SOURCE_DIR) + "/" + rel; }

inline std::string stories_checkpoint() { return shared_path("data/models/stories260K.bin"); }
inline std::string stories_tokenizer() { return shared_path("data/models/tok512.bin"); }
inline std::string smollm2_gguf() { return models_path("SmolLM2-135M-Instruct.Q4_1.gguf"); }

}  // namespace certkv::testing
