// The C API (and the C++ wrapper over it): statuses and messages for bad input, buffer-size
// protocol, generation through certkv_generate, KV statistics measured from the allocator.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "certkv/certkv.hpp"
#include "codec/gaac.h"
#include "test_paths.h"

namespace {

using certkv::testing::stories_checkpoint;
using certkv::testing::stories_tokenizer;
using certkv::testing::test_data_path;

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
  const std::string path = test_data_path("README.md");
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

// certkv_detokenize: the text tokenize read (a SentencePiece vocabulary's prepended space dropped),
// BOS's text only when asked, the buffer protocol, and bad ids named by index.
TEST(CApi, DetokenizeGivesBackTheTokenizedText) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  const std::string text = "Once upon a time there was a cat.";
  const std::vector<int32_t> ids = model.tokenize(text, true, false);
  ASSERT_EQ(ids[0], 1);  // BOS, a control token
  EXPECT_EQ(model.detokenize(ids), text);
  const std::string rendered = model.detokenize(ids, true);
  EXPECT_EQ(rendered, "<s>" + text);
  EXPECT_EQ(model.detokenize({}), "");
  size_t nb = 0;
  char small[4];
  EXPECT_EQ(certkv_detokenize(model.get(), ids.data(), ids.size(), 0, small, sizeof small, &nb), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(nb, text.size());
  std::string out(nb, '\0');
  ASSERT_EQ(certkv_detokenize(model.get(), ids.data(), ids.size(), 0, out.data(), out.size(), &nb), CERTKV_OK);
  EXPECT_EQ(out, text);
  const int32_t bad[] = {ids[1], -1};
  EXPECT_EQ(certkv_detokenize(model.get(), bad, 2, 0, small, sizeof small, &nb), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("tokens[1]"), std::string::npos) << certkv_last_error();
  EXPECT_EQ(certkv_detokenize(model.get(), nullptr, 1, 0, small, sizeof small, &nb), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_detokenize(nullptr, ids.data(), ids.size(), 0, small, sizeof small, &nb), CERTKV_ERR_INVALID_ARGUMENT);
}

// certkv_tokenize_chat: the buffer protocol, null arguments, and the tokens of the plain
// template (the llama2.c model has none) equal to tokenizing its text.
TEST(CApi, ChatTokensFollowTheBufferProtocol) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  const certkv_chat_message messages[] = {{"user", "Tell me a story."}};
  int32_t n = 0;
  EXPECT_EQ(certkv_tokenize_chat(model.get(), messages, 1, 1, nullptr, 0, &n), CERTKV_ERR_OUT_OF_RANGE);
  ASSERT_GT(n, 3);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  int32_t n2 = 0;
  ASSERT_EQ(certkv_tokenize_chat(model.get(), messages, 1, 1, ids.data(), n, &n2), CERTKV_OK);
  EXPECT_EQ(n, n2);
  EXPECT_EQ(ids, model.tokenize(model.chat({messages[0]}, true), true, true));
  EXPECT_EQ(model.chat_tokens({messages[0]}, true), ids);
  EXPECT_EQ(certkv_tokenize_chat(nullptr, messages, 1, 1, ids.data(), n, &n2), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_chat_message no_content[] = {{"user", nullptr}};
  EXPECT_EQ(certkv_tokenize_chat(model.get(), no_content, 1, 1, ids.data(), n, &n2), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_tokenize_chat(model.get(), messages, 1, 1, ids.data(), -1, &n2), CERTKV_ERR_INVALID_ARGUMENT);
}

TEST(CApi, BadSessionAndSamplerParameters) {
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  certkv_session_params sp = certkv_session_default_params();
  sp.kv = "zstd";
  certkv_session* s = nullptr;
  EXPECT_EQ(certkv_session_create(model.get(), &sp, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("zstd"), std::string::npos);
  sp.kv = "gaac";
  sp.gaac_calibration = "/nonexistent/cal.safetensors";
  EXPECT_NE(certkv_session_create(model.get(), &sp, &s), CERTKV_OK);
  EXPECT_NE(std::string(certkv_last_error()).find("/nonexistent/cal.safetensors"), std::string::npos)
      << certkv_last_error();
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

namespace certkv {
namespace {

using certkv::testing::stories_checkpoint;
using certkv::testing::stories_tokenizer;

// --kv gaac without a calibration file: the model calibrates itself on the built-in text, the
// result is cached (a second session reads the file; a corrupt file is replaced), and the
// logits are those of bf16 pages bit for bit (GAAC is lossless).
TEST(CApi, GaacCalibratesItselfAndCachesTheCalibration) {
  const std::string dir = ::testing::TempDir() + "/certkv_selfcal_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  setenv("CERTKV_CACHE_DIR", dir.c_str(), 1);
  certkv::Model model(stories_checkpoint(), stories_tokenizer());
  const int32_t n_vocab = model.info().n_vocab;
  auto greedy_logits = [&](const char* kv) {
    certkv_session_params sp = certkv_session_default_params();
    sp.context_tokens = 256;
    sp.kv = kv;
    certkv::Session session(model, sp);
    std::vector<int32_t> prompt(40);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(1 + (i * 37) % 500);
    std::vector<float> logits(static_cast<size_t>(n_vocab)), all;
    session.prefill(prompt, logits.data());
    for (int step = 0; step < 30; ++step) {
      all.insert(all.end(), logits.begin(), logits.end());
      const int32_t t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      certkv::check(certkv_session_decode(session.get(), t, logits.data()));
    }
    certkv_kv_stats st;
    certkv::check(certkv_session_kv_stats(session.get(), &st));
    uint64_t gaac_pages = 0;
    for (int32_t i = 0; i < st.n_classes; ++i)
      if (std::string(st.by_class[i].storage) == "gaac") gaac_pages = st.by_class[i].pages_in_use;
    return std::make_pair(all, gaac_pages);
  };
  const auto bf16 = greedy_logits("bf16");
  const auto gaac = greedy_logits("gaac");
  EXPECT_EQ(gaac.first, bf16.first) << "GAAC pages must give the bf16 logits bit for bit";
  EXPECT_GT(gaac.second, 0u) << "no block went to a GAAC slot";
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u) << "one cached calibration";
  EXPECT_NE(files[0].filename().string().find(".gaac-bf16-b16.safetensors"), std::string::npos)
      << files[0];
  // Another model object (no in-memory copy) reads the cache: the file is not rewritten.
  const auto written = std::filesystem::last_write_time(files[0]);
  {
    certkv::Model again(stories_checkpoint(), stories_tokenizer());
    certkv_session_params sp = certkv_session_default_params();
    sp.context_tokens = 64;
    sp.kv = "gaac";
    certkv::Session session(again, sp);
  }
  EXPECT_EQ(std::filesystem::last_write_time(files[0]), written);
  // A corrupt cache file is replaced by a fresh calibration, not trusted.
  {
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(std::filesystem::file_size(files[0]) / 2));
    f.put('\x5a');
  }
  certkv::Model third(stories_checkpoint(), stories_tokenizer());
  certkv_session_params sp = certkv_session_default_params();
  sp.context_tokens = 64;
  sp.kv = "gaac";
  EXPECT_NO_THROW(certkv::Session(third, sp));
  const auto recal = certkv::codec::GaacCalibration::load(
      files[0].string(), [&] {
        certkv::codec::GaacShape shape;
        const certkv_model_info info = third.info();
        shape.n_layers = info.n_layers;
        shape.n_kv_heads = info.n_kv_heads;
        shape.head_dim = info.head_dim;
        return shape;
      }());
  EXPECT_EQ(recal.shape().n_layers, third.info().n_layers);
  EXPECT_EQ(recal.windows(), certkv::codec::GaacCalibration::kWindows);
  // A cache made by an earlier window rule (its file names another, or none) is replaced too.
  {
    certkv::codec::GaacCalibration earlier = recal;
    earlier.set_windows("");
    earlier.save(files[0].string());
  }
  {
    certkv::Model fourth(stories_checkpoint(), stories_tokenizer());
    EXPECT_NO_THROW(certkv::Session(fourth, sp));
  }
  EXPECT_EQ(certkv::codec::GaacCalibration::load(files[0].string(), recal.shape()).windows(),
            certkv::codec::GaacCalibration::kWindows);
  unsetenv("CERTKV_CACHE_DIR");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace certkv
