// The C API (and the C++ wrapper over it): statuses and messages for bad input, buffer-size
// protocol, generation through certkv_generate, KV statistics measured from the allocator.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "certkv/certkv.hpp"
#include "test_paths.h"

namespace {

using certkv::testing::stories_checkpoint;
using certkv::testing::stories_tokenizer;

TEST(CApi, MissingModelFileIsNotFoundAndNamed) {
  certkv_model* m = reinterpret_cast<certkv_model*>(0x1);
  EXPECT_EQ(certkv_model_load("/nonexistent/model.gguf", &m), CERTKV_ERR_NOT_FOUND);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(certkv_last_error()).find("/nonexistent/model.gguf"), std::string::npos);
  EXPECT_STREQ(certkv_status_string(CERTKV_ERR_NOT_FOUND), "not found");
}

TEST(CApi, NullArgumentsAreRejected) {
  EXPECT_EQ(certkv_model_load(nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_session_create(nullptr, nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_session_decode(nullptr, 0, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()), "");
}

TEST(CApi, NotAModelFileIsCorrupt) {
  const std::string path = std::string(CERTKV_SHARED_DIR) + "/data/corpus/README.md";
  certkv_model* m = nullptr;
  const certkv_status s = certkv_model_load(path.c_str(), &m);
  EXPECT_TRUE(s == CERTKV_ERR_CORRUPT || s == CERTKV_ERR_UNSUPPORTED) << certkv_status_string(s);
  EXPECT_NE(std::string(certkv_last_error()).find("README.md"), std::string::npos) << certkv_last_error();
}

TEST(CApi, GeneratesTheKnownStoryGreedily) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  const certkv_model_info info = model.info();
  EXPECT_EQ(info.n_vocab, 512);
  EXPECT_STREQ(info.rope_layout, "interleaved");
  certkv_session_params sp = certkv_session_default_params();
  sp.context_tokens = 256;
  certkv::Session session(model, sp);
  const std::vector<int32_t> prompt = {1};
  certkv_generate_params gp = certkv_generate_default_params();
  gp.max_new_tokens = 30;
  std::string text;
  auto collect = [](void* user, int32_t, const char* piece, size_t n) {
    static_cast<std::string*>(user)->append(piece, n);
    return 0;
  };
  certkv_generate_result r;
  ASSERT_EQ(certkv_generate(session.get(), prompt.data(), 1, &gp, collect, &text, &r), CERTKV_OK)
      << certkv_last_error();
  // Streamed pieces keep SentencePiece's word-initial space on the first token.
  EXPECT_EQ(text.rfind(" Once upon a time, there was a little girl named Lily.", 0), 0u) << text;
  EXPECT_EQ(r.prompt_tokens, 1);
  EXPECT_EQ(r.generated_tokens, 30);
  EXPECT_EQ(r.decode_steps, 29);

  const certkv_kv_stats st = session.kv_stats();
  EXPECT_EQ(st.n_tokens, 30);
  EXPECT_GT(st.kv_bytes, 0u);
  EXPECT_GE(st.kv_bytes, st.kv_bytes_in_use - 0);
  // bf16 pages: 2 (K, V) * layers * kv_heads * head_dim * 2 bytes per token.
  EXPECT_EQ(st.kv_bytes_bf16, uint64_t(30) * 2 * 5 * 4 * 8 * 2);

  std::vector<uint16_t> k(30 * 8);
  ASSERT_EQ(certkv_session_read_kv(session.get(), 0, 0, 0, 0, 30, k.data()), CERTKV_OK) << certkv_last_error();
  int nonzero = 0;
  for (uint16_t v : k) nonzero += v != 0;
  EXPECT_GT(nonzero, 100);
  EXPECT_NE(certkv_session_read_kv(session.get(), 5, 0, 0, 0, 30, k.data()), CERTKV_OK);
  EXPECT_NE(certkv_session_read_kv(session.get(), 0, 2, 0, 0, 30, k.data()), CERTKV_OK);
  std::vector<float> q(64);
  EXPECT_EQ(certkv_session_last_queries(session.get(), 0, q.data()), CERTKV_ERR_INVALID_ARGUMENT);
}

TEST(CApi, TokenBufferProtocol) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  const char* text = "Once upon a time there was a cat.";
  int32_t n = 0;
  EXPECT_EQ(certkv_tokenize(model.get(), text, strlen(text), 1, 0, nullptr, 0, &n), CERTKV_ERR_OUT_OF_RANGE);
  ASSERT_GT(n, 3);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  int32_t n2 = 0;
  ASSERT_EQ(certkv_tokenize(model.get(), text, strlen(text), 1, 0, ids.data(), n, &n2), CERTKV_OK);
  EXPECT_EQ(n, n2);
  EXPECT_EQ(ids[0], 1);  // the llama2.c vocabulary adds BOS
  std::string round;
  for (size_t i = 1; i < ids.size(); ++i) round += model.piece(ids[i]);
  EXPECT_EQ(round, std::string(" ") + text);
  size_t nb = 0;
  char small[1];
  EXPECT_EQ(certkv_token_to_piece(model.get(), 100000, small, 1, &nb), CERTKV_ERR_INVALID_ARGUMENT);
}

TEST(CApi, BadSessionAndSamplerParameters) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  certkv_session_params sp = certkv_session_default_params();
  sp.kv = "zstd";
  certkv_session* s = nullptr;
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("zstd"), std::string::npos);
  sp.kv = "gaac";  // needs a calibration file
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("gaac_calibration"), std::string::npos);
  EXPECT_EQ(s, nullptr);
  sp = certkv_session_default_params();
  sp.n_threads = 0;
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_sampler_params p = certkv_sampler_default_params();
  p.top_p = 1.5f;
  certkv_sampler* sampler = nullptr;
  EXPECT_EQ(certkv_sampler_create(&p, &sampler), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sampler, nullptr);
}

TEST(CApi, SeededSamplingIsReproducible) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  certkv_session_params sp = certkv_session_default_params();
  sp.context_tokens = 128;
  auto run = [&](uint64_t seed) {
    certkv::Session session(model, sp);
    certkv_generate_params gp = certkv_generate_default_params();
    gp.max_new_tokens = 40;
    gp.sampler.temperature = 1.0f;
    gp.sampler.top_k = 40;
    gp.sampler.top_p = 0.9f;
    gp.sampler.seed = seed;
    std::vector<int32_t> out;
    auto collect = [](void* user, int32_t t, const char*, size_t) {
      static_cast<std::vector<int32_t>*>(user)->push_back(t);
      return 0;
    };
    certkv_generate_result r;
    const std::vector<int32_t> prompt = {1};
    EXPECT_EQ(certkv_generate(session.get(), prompt.data(), 1, &gp, collect, &out, &r), CERTKV_OK);
    return out;
  };
  const auto a = run(1), b = run(1), c = run(2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

}  // namespace

namespace {

// The device route's refusals (any machine: stories260K's head_dim of 8 is not served on a GPU
// either, and a machine without one says so).
TEST(CApi, DeviceRouteRefusalsAreClearErrors) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  certkv_session_params sp = certkv_session_default_params();
  sp.context_tokens = 64;
  certkv_session* s = nullptr;
  sp.device = "tpu";
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("'tpu'"), std::string::npos) << certkv_last_error();
  EXPECT_NE(std::string(certkv_last_error()).find("cpu, cuda"), std::string::npos) << certkv_last_error();
  sp.device = "cuda";
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_UNSUPPORTED);
  EXPECT_EQ(std::string(certkv_last_error()).rfind("device cuda: ", 0), 0u) << certkv_last_error();
  sp.kv = "rtn8";
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(certkv_last_error()).find("KV scheme rtn8 is not served on the device"), std::string::npos)
      << certkv_last_error();
  EXPECT_EQ(s, nullptr);
  sp.kv = "bf16";
  sp.device = "cpu";
  certkv::Session cpu(model, sp);
  EXPECT_EQ(cpu.device_stats().on_device, 0);
}

}  // namespace
