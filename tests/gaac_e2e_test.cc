// `--kv gaac` end to end on the embedded default (SmolLM2-135M-Instruct): greedy generation over
// a GAAC-compressed KV cache gives the logits of a BF16 cache bit for bit, and the same text, on
// a 512- and a 4,096-token prompt; the calibration comes from the KV of another book. Bad KV
// configurations through the C API are clear errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "certkv/certkv.hpp"
#include "codec/gaac.h"
#include "gaac_e2e_support.h"
#include "test_paths.h"

namespace {

using certkv::testing::book_tokens;
using certkv::testing::save_book_calibration;
using certkv::testing::test_data_path;
using certkv::testing::temp_path;
using certkv::testing::smollm2_gguf;

// Tokens of the KV the calibration is made from (Moby-Dick; the prompts come from Pride and
// Prejudice). As long as the longest prompt: keys calibrated on shorter prefixes drift out of
// their windows with position (RoPE) and overflow their slots (measured: 39% raw blocks at 4,096
// tokens with a 1,024-token calibration, 1.2% with this one).
constexpr int kCalibrationTokens = 4096;

class GaacEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(smollm2_gguf()).good()) return;
    model_ = std::make_unique<certkv::Model>(smollm2_gguf());
    calibration_path_ = temp_path("gaac_e2e_calibration.safetensors");
    save_book_calibration(*model_, "melville-moby-dick.txt", kCalibrationTokens, certkv::format::GaacElement::kBf16,
                          calibration_path_);
  }

  static void TearDownTestSuite() {
    model_.reset();
    if (!calibration_path_.empty()) std::remove(calibration_path_.c_str());
  }

  void SetUp() override {
    if (!model_) GTEST_FAIL() << smollm2_gguf() << " is missing: run scripts/fetch_models.sh";
  }

  static std::vector<int32_t> prompt(size_t n_tokens) {
    return book_tokens(*model_, "austen-pride-and-prejudice.txt", n_tokens);
  }

  // Prefills `prompt` in a bf16 and a gaac session and decodes n_new tokens greedily from each;
  // the logits of every step must be the same bits, and so must the generated text.
  static void expect_identical_generation(const std::vector<int32_t>& prompt, int n_new) {
    const int32_t n_vocab = model_->info().n_vocab;
    certkv_session_params bf16_params = certkv_session_default_params();
    bf16_params.context_tokens = int64_t(prompt.size()) + n_new;
    certkv_session_params gaac_params = bf16_params;
    gaac_params.kv = "gaac";
    gaac_params.gaac_calibration = calibration_path_.c_str();
    certkv::Session bf16(*model_, bf16_params);
    certkv::Session gaac(*model_, gaac_params);
    std::vector<float> want(static_cast<size_t>(n_vocab)), got(static_cast<size_t>(n_vocab));
    bf16.prefill(prompt, want.data());
    gaac.prefill(prompt, got.data());
    std::string want_text, got_text;
    for (int step = 0;; ++step) {
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
          << "logits differ at step " << step << " after a " << prompt.size() << "-token prompt";
      int32_t want_token = 0, got_token = 0;
      for (int32_t t = 1; t < n_vocab; ++t) {
        if (want[size_t(t)] > want[size_t(want_token)]) want_token = t;
        if (got[size_t(t)] > got[size_t(got_token)]) got_token = t;
      }
      want_text += model_->piece(want_token);
      got_text += model_->piece(got_token);
      if (step + 1 == n_new) break;
      bf16.decode(want_token, want.data());
      gaac.decode(got_token, got.data());
    }
    EXPECT_EQ(got_text, want_text);
    EXPECT_FALSE(want_text.empty());

    // Most blocks sit in slots (the raw pages are the 180 tails and the fallbacks), and the
    // measured bytes are below the bf16 cache's.
    const certkv_kv_stats g = gaac.kv_stats(), b = bf16.kv_stats();
    EXPECT_EQ(g.n_tokens, int64_t(prompt.size()) + n_new - 1);
    ASSERT_EQ(g.n_classes, 2);
    EXPECT_STREQ(g.by_class[0].storage, "bf16");
    EXPECT_STREQ(g.by_class[1].storage, "gaac");
    EXPECT_GT(g.by_class[1].pages_in_use, 10 * g.by_class[0].pages_in_use);
    EXPECT_LT(g.kv_bytes_in_use, b.kv_bytes_in_use);
    EXPECT_EQ(g.kv_bytes_bf16, b.kv_bytes_bf16);
    std::printf("[ gaac e2e ] %zu-token prompt: \"%s\"; kv_bytes gaac %llu (in use %llu), bf16 %llu "
                "(in use %llu); pages: %llu gaac, %llu raw\n",
                prompt.size(), want_text.c_str(), (unsigned long long)g.kv_bytes,
                (unsigned long long)g.kv_bytes_in_use, (unsigned long long)b.kv_bytes,
                (unsigned long long)b.kv_bytes_in_use,
                (unsigned long long)g.by_class[1].pages_in_use,
                (unsigned long long)g.by_class[0].pages_in_use);
  }

  static std::unique_ptr<certkv::Model> model_;
  static std::string calibration_path_;
};

std::unique_ptr<certkv::Model> GaacEndToEnd::model_;
std::string GaacEndToEnd::calibration_path_;

TEST_F(GaacEndToEnd, Prompt512GivesTheBf16LogitsBitForBit) {
  expect_identical_generation(prompt(512), 40);
}

TEST_F(GaacEndToEnd, Prompt4096GivesTheBf16LogitsBitForBit) {
  expect_identical_generation(prompt(4096), 20);
}

// Creating a session must fail with `status` and a message containing every needle.
void expect_session_error(const certkv::Model& model, const certkv_session_params& params,
                          certkv_status status, const std::vector<std::string>& needles) {
  certkv_session* session = reinterpret_cast<certkv_session*>(0x1);
  EXPECT_EQ(certkv_session_create(model.get(), &params, &session), status) << certkv_last_error();
  EXPECT_EQ(session, nullptr);
  const std::string message = certkv_last_error();
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' not in: " << message;
  }
}

TEST_F(GaacEndToEnd, BadKvConfigurationsAreClearErrors) {
  certkv_session_params params = certkv_session_default_params();
  params.context_tokens = 64;
  params.kv = "zstd";
  expect_session_error(*model_, params, CERTKV_ERR_INVALID_ARGUMENT, {"'zstd'", "bf16, gaac"});

  // Without a file the model calibrates itself (CApi.GaacCalibratesItselfAndCachesTheCalibration);
  // a file that is not there is an error naming it.
  params.kv = "gaac";
  params.gaac_calibration = "/nonexistent/calibration.safetensors";
  expect_session_error(*model_, params, CERTKV_ERR_NOT_FOUND, {"/nonexistent/calibration.safetensors"});

  // A calibration of another model (5 layers, 2 KV heads): a shape mismatch naming the file.
  certkv::codec::GaacShape other;
  other.n_layers = 5;
  other.n_kv_heads = 2;
  other.head_dim = 64;
  other.block_tokens = 16;
  const std::string other_path = temp_path("gaac_e2e_other_model.safetensors");
  certkv::codec::GaacCalibration(other).save(other_path);
  params.gaac_calibration = other_path.c_str();
  expect_session_error(*model_, params, CERTKV_ERR_INVALID_ARGUMENT, {other_path, "5"});

  // The right file with another block size.
  params.gaac_calibration = calibration_path_.c_str();
  params.block_tokens = 32;
  expect_session_error(*model_, params, CERTKV_ERR_INVALID_ARGUMENT, {"block_tokens"});
  std::remove(other_path.c_str());

  // Not a calibration at all: corrupt, naming the file.
  const std::string not_calibration = test_data_path("README.md");
  params.gaac_calibration = not_calibration.c_str();
  params.block_tokens = 16;
  certkv_session* session = nullptr;
  EXPECT_NE(certkv_session_create(model_->get(), &params, &session), CERTKV_OK);
  EXPECT_EQ(session, nullptr);
  EXPECT_NE(std::string(certkv_last_error()).find("README.md"), std::string::npos) << certkv_last_error();
}

}  // namespace
