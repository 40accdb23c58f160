// `--kv gaac-e5m2` end to end on the embedded default (SmolLM2-135M-Instruct): GAAC coding of the
// FP8 pages is lossless, so a 512-token prompt and greedy decoding give the logits of
// `--kv fp8-e5m2` bit for bit; the calibration comes from the KV of another book, cast to FP8.
// A calibration of another element is a clear error.
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
#include "format/fp8.h"
#include "gaac_e2e_support.h"
#include "test_paths.h"

namespace {

using certkv::testing::book_tokens;
using certkv::testing::save_book_calibration;
using certkv::testing::temp_path;
using certkv::testing::smollm2_gguf;

// Tokens of the KV the calibration is made from (Moby-Dick; the prompt comes from Pride and
// Prejudice): twice the prompt, so that keys at the prompt's positions are covered.
constexpr int kCalibrationTokens = 1024;
constexpr int kPromptTokens = 512;

class Fp8EndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(smollm2_gguf()).good()) return;
    model_ = std::make_unique<certkv::Model>(smollm2_gguf());
    calibration_path_ = temp_path("fp8_e2e_calibration.safetensors");
    save_book_calibration(*model_, "melville-moby-dick.txt", kCalibrationTokens,
                          certkv::format::GaacElement::kFp8E5M2, calibration_path_);
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

  static std::unique_ptr<certkv::Model> model_;
  static std::string calibration_path_;
};

std::unique_ptr<certkv::Model> Fp8EndToEnd::model_;
std::string Fp8EndToEnd::calibration_path_;

int32_t argmax(const std::vector<float>& x) {
  int32_t best = 0;
  for (size_t t = 1; t < x.size(); ++t) {
    if (x[t] > x[size_t(best)]) best = int32_t(t);
  }
  return best;
}

TEST_F(Fp8EndToEnd, GaacE5m2GivesTheFp8E5m2LogitsBitForBit) {
  const std::vector<int32_t> tokens = prompt(kPromptTokens);
  constexpr int kNew = 12;
  const size_t n_vocab = size_t(model_->info().n_vocab);
  certkv_session_params fp8_params = certkv_session_default_params();
  fp8_params.context_tokens = kPromptTokens + kNew;
  fp8_params.kv = "fp8-e5m2-pages";
  certkv_session_params gaac_params = fp8_params;
  gaac_params.kv = "gaac-e5m2";
  gaac_params.gaac_calibration = calibration_path_.c_str();
  certkv_session_params bf16_params = fp8_params;
  bf16_params.kv = "bf16";
  certkv::Session fp8(*model_, fp8_params);
  certkv::Session gaac(*model_, gaac_params);
  certkv::Session bf16(*model_, bf16_params);
  std::vector<float> want(n_vocab), got(n_vocab), bf16_logits(n_vocab);
  fp8.prefill(tokens, want.data());
  gaac.prefill(tokens, got.data());
  bf16.prefill(tokens, bf16_logits.data());
  // FP8 is lossy: the logits move away from the bf16 cache's.
  EXPECT_NE(std::memcmp(want.data(), bf16_logits.data(), n_vocab * sizeof(float)), 0);
  std::string text;
  for (int step = 0;; ++step) {
    ASSERT_EQ(std::memcmp(got.data(), want.data(), n_vocab * sizeof(float)), 0)
        << "logits differ at step " << step;
    const int32_t token = argmax(want);
    text += model_->piece(token);
    if (step + 1 == kNew) break;
    fp8.decode(token, want.data());
    gaac.decode(token, got.data());
  }
  EXPECT_FALSE(text.empty());

  const certkv_kv_stats g = gaac.kv_stats(), f = fp8.kv_stats(), b = bf16.kv_stats();
  ASSERT_EQ(f.n_classes, 1);
  EXPECT_STREQ(f.by_class[0].storage, "fp8");
  ASSERT_EQ(g.n_classes, 2);
  EXPECT_STREQ(g.by_class[0].storage, "fp8");
  EXPECT_STREQ(g.by_class[1].storage, "gaac-fp8");
  // Measured: 4,925 slots, 1,015 raw pages (180 tails, the rest fallbacks).
  EXPECT_GT(g.by_class[1].pages_in_use, 4 * g.by_class[0].pages_in_use);
  EXPECT_LT(g.kv_bytes_in_use, f.kv_bytes_in_use);
  EXPECT_LT(f.kv_bytes_in_use, b.kv_bytes_in_use);
  std::printf("[ fp8 e2e ] %d-token prompt: \"%s\"; kv_bytes_in_use gaac-e5m2 %llu, fp8-e5m2 %llu, "
              "bf16 %llu; pages: %llu gaac-fp8, %llu fp8\n",
              kPromptTokens, text.c_str(), (unsigned long long)g.kv_bytes_in_use,
              (unsigned long long)f.kv_bytes_in_use, (unsigned long long)b.kv_bytes_in_use,
              (unsigned long long)g.by_class[1].pages_in_use,
              (unsigned long long)g.by_class[0].pages_in_use);
}

TEST_F(Fp8EndToEnd, CalibrationOfAnotherElementIsAClearError) {
  certkv_session_params params = certkv_session_default_params();
  params.context_tokens = 64;
  params.kv = "gaac-e4m3";
  params.gaac_calibration = "/nonexistent/e4m3.safetensors";
  certkv_session* session = reinterpret_cast<certkv_session*>(0x1);
  EXPECT_NE(certkv_session_create(model_->get(), &params, &session), CERTKV_OK);
  EXPECT_EQ(session, nullptr);
  EXPECT_NE(std::string(certkv_last_error()).find("/nonexistent/e4m3.safetensors"), std::string::npos)
      << certkv_last_error();

  params.gaac_calibration = calibration_path_.c_str();
  for (const char* kv : {"gaac-e4m3", "gaac"}) {
    session = reinterpret_cast<certkv_session*>(0x1);
    params.kv = kv;
    EXPECT_EQ(certkv_session_create(model_->get(), &params, &session), CERTKV_ERR_INVALID_ARGUMENT) << kv;
    EXPECT_EQ(session, nullptr);
    const std::string message = certkv_last_error();
    EXPECT_NE(message.find("e5m2"), std::string::npos) << message;
    EXPECT_NE(message.find(calibration_path_), std::string::npos) << message;
  }
  // fp8 schemes need no calibration.
  params.kv = "fp8-e4m3-pages";
  params.gaac_calibration = nullptr;
  certkv::Session fp8(*model_, params);
  EXPECT_STREQ(fp8.kv_stats().by_class[0].storage, "fp8");
}

}  // namespace
