#include "model/hf_config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/status.h"

namespace certkv::model {
namespace {

void expect_error(const std::function<void()>& fn, StatusCode code,
                  std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message '" << e.what() << "' does not mention '" << needle << "'";
    }
  }
}

// Modelled on SmolLM2-135M-Instruct's config.json; fields certkv does not read are kept to show
// that they are ignored.
constexpr const char* kSmolLM2 = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 576,
  "initializer_range": 0.041666666666666664,
  "intermediate_size": 1536,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 9,
  "num_hidden_layers": 30,
  "num_key_value_heads": 3,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 100000,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "vocab_size": 49152
})";

// The Llama 3.1 8B fields that differ: explicit head_dim and llama3 RoPE scaling.
constexpr const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
  "max_position_embeddings": 131072, "tie_word_embeddings": false,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
})";

TEST(HfConfig, SmolLM2) {
  const HfConfig c = parse_hf_config(kSmolLM2, "config.json");
  EXPECT_EQ(c.architectures, std::vector<std::string>{"LlamaForCausalLM"});
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_EQ(c.num_attention_heads, 9);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 100000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.rope_scaling.has_value());
}

TEST(HfConfig, Llama31RopeScaling) {
  const HfConfig c = parse_hf_config(kLlama31, "config.json");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->rope_type, "llama3");
  EXPECT_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_EQ(c.rope_scaling->low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
}

TEST(HfConfig, DefaultsAndLegacyScalingKey) {
  const HfConfig c = parse_hf_config(
      R"({"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5,
          "num_attention_heads": 8, "vocab_size": 512, "head_dim": null,
          "rope_scaling": {"type": "linear", "factor": 2}})",
      "tiny.json");
  EXPECT_TRUE(c.architectures.empty());
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->rope_type, "linear");
  EXPECT_EQ(c.rope_scaling->factor, 2.0);
  EXPECT_FALSE(c.rope_scaling->low_freq_factor.has_value());
}

TEST(HfConfig, Errors) {
  const std::string base =
      R"("intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8, "vocab_size": 512)";
  expect_error([&] { parse_hf_config("{" + base + "}", "c.json"); }, StatusCode::kCorrupt,
               {"c.json", "hidden_size", "missing"});
  expect_error([&] { parse_hf_config(R"({"hidden_size": "64", )" + base + "}", "c.json"); },
               StatusCode::kCorrupt, {"hidden_size", "string"});
  expect_error([&] { parse_hf_config(R"({"hidden_size": 64.5, )" + base + "}", "c.json"); },
               StatusCode::kCorrupt, {"hidden_size", "integer"});
  expect_error([&] { parse_hf_config(R"({"hidden_size": 0, )" + base + "}", "c.json"); },
               StatusCode::kCorrupt, {"hidden_size", "positive"});
  expect_error([&] { parse_hf_config(R"({"hidden_size": 60, )" + base + "}", "c.json"); },
               StatusCode::kCorrupt, {"head_dim", "60"});
  expect_error(
      [&] { parse_hf_config(R"({"hidden_size": 64, "num_key_value_heads": 3, )" + base + "}", "c.json"); },
      StatusCode::kCorrupt, {"num_key_value_heads", "does not divide"});
  expect_error([&] { parse_hf_config(R"({"hidden_size": 64, "rms_norm_eps": -1, )" + base + "}", "c.json"); },
               StatusCode::kCorrupt, {"rms_norm_eps"});
  expect_error(
      [&] { parse_hf_config(R"({"hidden_size": 64, "tie_word_embeddings": 1, )" + base + "}", "c.json"); },
      StatusCode::kCorrupt, {"tie_word_embeddings"});
  expect_error(
      [&] { parse_hf_config(R"({"hidden_size": 64, "architectures": "Llama", )" + base + "}", "c.json"); },
      StatusCode::kCorrupt, {"architectures"});
  expect_error(
      [&] { parse_hf_config(R"({"hidden_size": 64, "rope_scaling": {"factor": 8}, )" + base + "}", "c.json"); },
      StatusCode::kCorrupt, {"rope_scaling.rope_type"});
  expect_error(
      [&] {
        parse_hf_config(R"({"hidden_size": 64, "rope_scaling": {"rope_type": "llama3", "factor": "x"}, )" +
                            base + "}",
                        "c.json");
      },
      StatusCode::kCorrupt, {"rope_scaling.factor"});
  expect_error([&] { parse_hf_config("[]", "c.json"); }, StatusCode::kCorrupt, {"c.json", "object"});
  expect_error([&] { parse_hf_config("{", "c.json"); }, StatusCode::kCorrupt, {"c.json"});
}

TEST(HfConfig, ReadFile) {
  const std::string path = ::testing::TempDir() + "/certkv_config.json";
  {
    std::ofstream out(path);
    out << kSmolLM2;
  }
  EXPECT_EQ(read_hf_config(path).num_hidden_layers, 30);
  std::filesystem::remove(path);
  expect_error([&] { read_hf_config(path); }, StatusCode::kNotFound, {path});
  expect_error([&] { read_hf_config(::testing::TempDir()); }, StatusCode::kIo, {});
}

}  // namespace
}  // namespace certkv::model
