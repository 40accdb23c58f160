// Shared by the end-to-end tests of the GAAC KV schemes: a GAAC calibration of the embedded
// default made from the KV of a prefill of another book (through the C API), and prompt tokens.
#pragma once

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "certkv/certkv.hpp"
#include "codec/gaac.h"
#include "format/fp8.h"
#include "test_paths.h"

namespace certkv::testing {

// A file in the test temp folder, unique to this process (test binaries may run concurrently).
inline std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/certkv_" + std::to_string(getpid()) + "_" + name;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The first n_tokens tokens of a corpus book (fails if the stored prefix of the book is shorter).
inline std::vector<int32_t> book_tokens(const certkv::Model& model, const std::string& book, size_t n_tokens) {
  std::vector<int32_t> tokens = model.tokenize(read_text(corpus_path(book)), true, false);
  EXPECT_GE(tokens.size(), n_tokens) << corpus_path(book) << ": too short for the test";
  tokens.resize(n_tokens);
  return tokens;
}

// Prefills n_tokens of `book`, feeds every (layer, K/V, kv_head) row set to a calibrator for
// `element` (BF16 rows as stored, or cast to FP8 as the fp8 schemes store them) and saves the
// calibration at `path`.
inline void save_book_calibration(const certkv::Model& model, const std::string& book, int n_tokens,
                                  format::GaacElement element, const std::string& path) {
  const certkv_model_info info = model.info();
  const std::vector<int32_t> tokens = book_tokens(model, book, size_t(n_tokens));
  certkv_session_params params = certkv_session_default_params();
  params.context_tokens = n_tokens;
  certkv::Session session(model, params);
  session.prefill(tokens, nullptr);
  codec::GaacShape shape;
  shape.n_layers = info.n_layers;
  shape.n_kv_heads = info.n_kv_heads;
  shape.head_dim = info.head_dim;
  shape.block_tokens = params.block_tokens;
  shape.element = element;
  codec::GaacCalibrator calibrator(shape);
  std::vector<uint16_t> rows(size_t(n_tokens) * size_t(info.head_dim));
  std::vector<uint8_t> fp8(rows.size());
  for (int layer = 0; layer < info.n_layers; ++layer)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < info.n_kv_heads; ++h) {
        certkv::check(certkv_session_read_kv(session.get(), layer, kv, h, 0, n_tokens, rows.data()));
        if (element == format::GaacElement::kBf16) {
          calibrator.add_bf16(layer, kv, h, rows.data(), n_tokens);
        } else {
          for (size_t i = 0; i < rows.size(); ++i)
            fp8[i] = element == format::GaacElement::kFp8E5M2 ? format::bf16_to_fp8_e5m2_ref(rows[i])
                                                               : format::bf16_to_fp8_e4m3_ref(rows[i]);
          calibrator.add_fp8(layer, kv, h, fp8.data(), n_tokens);
        }
      }
  calibrator.finish().save(path);
}

}  // namespace certkv::testing
