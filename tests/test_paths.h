// Paths of the data the end-to-end tests read: the repository's test data (tests/data: tiny
// model fixtures and corpus book prefixes, see its README.md), the models the set-up fetches
// (models/) and the source tree.
#pragma once

#include <string>

namespace certkv::testing {

inline std::string test_data_path(const std::string& rel) { return std::string(CERTKV_TEST_DATA_DIR) + "/" + rel; }
inline std::string models_path(const std::string& rel) { return std::string(CERTKV_MODELS_DIR) + "/" + rel; }
inline std::string source_path(const std::string& rel) { return std::string(CERTKV_SOURCE_DIR) + "/" + rel; }

inline std::string stories_checkpoint() { return test_data_path("models/stories260K.bin"); }
inline std::string stories_tokenizer() { return test_data_path("models/tok512.bin"); }
// A corpus book (a prefix of it: tests/data/README.md says how long).
inline std::string corpus_path(const std::string& book) { return test_data_path("corpus/" + book); }
inline std::string smollm2_gguf() { return models_path("SmolLM2-135M-Instruct.Q4_1.gguf"); }

}  // namespace certkv::testing
