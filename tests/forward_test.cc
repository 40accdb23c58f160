// The forward pass end to end: a real tiny model with a published greedy output, consistency of
// prefill chunking against token-by-token decoding, the Hugging Face loading path against the
// same weights in llama2.c form, and agreement with llama.cpp on SmolLM2 (golden logits).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "core/status.h"
#include "format/safetensors.h"
#include "model/model.h"
#include "model/sampler.h"
#include "backend/session.h"
#include "test_paths.h"

namespace certkv::model {
namespace {

using backend::BackendConfig;
using backend::Session;

using certkv::testing::smollm2_gguf;
using certkv::testing::stories_checkpoint;
using certkv::testing::stories_tokenizer;

std::unique_ptr<Model> load_stories() { return load_llama2c(stories_checkpoint(), stories_tokenizer()); }

std::string greedy(const Model& model, Session& session, std::vector<int32_t> prompt, int n) {
  std::vector<float> logits(model.config().n_vocab);
  session.prefill(prompt.data(), int64_t(prompt.size()), logits.data());
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t t = argmax(logits.data(), model.config().n_vocab);
    out.push_back(t);
    session.decode(t, logits.data());
  }
  return model.tokenizer().decode(out);
}

TEST(Stories260K, GreedyOutputMatchesThePublishedOne) {
  auto model = load_stories();
  EXPECT_EQ(model->config().n_layers, 5);
  EXPECT_EQ(model->config().n_heads, 8);
  EXPECT_EQ(model->config().n_kv_heads, 4);
  EXPECT_EQ(model->config().head_dim, 8);
  BackendConfig sc;
  sc.context_tokens = 512;
  Session session(*model, sc);
  const std::string text = greedy(*model, session, {1}, 40);
  EXPECT_EQ(text.rfind("Once upon a time, there was a little girl named Lily. She loved to play outside", 0), 0u)
      << text;
}

// Prefill in ragged chunks and token-by-token decoding give the logits of one whole prefill bit
// for bit. Every weight product treats each token on its own, and prefill and decode attention
// update the softmax once per page in page order, so the only thing a chunking may change is the
// split of a long decode over threads (its LSE merge rounds differently): decoding runs on one
// thread here. A tolerance would not do: a last-bit difference in a key can round its BF16 to
// the next value, and on random tokens that step grows to several percent of the logits.
TEST(Stories260K, ChunkedPrefillEqualsTokenByTokenDecode) {
  auto model = load_stories();
  const int V = model->config().n_vocab;
  std::mt19937 rng(7);
  std::vector<int32_t> tokens(301);
  for (auto& t : tokens) t = int32_t(rng() % V);
  tokens[0] = 1;
  const int64_t n = int64_t(tokens.size());

  for (const int block_tokens : {16, 7}) {
    SCOPED_TRACE("block_tokens " + std::to_string(block_tokens));
    BackendConfig whole_cfg;
    whole_cfg.context_tokens = 512;
    whole_cfg.prefill_chunk_tokens = 4096;
    whole_cfg.block_tokens = block_tokens;
    Session whole(*model, whole_cfg);
    std::vector<float> all(size_t(n) * V);
    whole.prefill(tokens.data(), n, nullptr, all.data());
    double max_abs = 0;
    for (float v : all) max_abs = std::max(max_abs, double(std::fabs(v)));
    ASSERT_GT(max_abs, 1.0);  // real logits, not zeros

    BackendConfig chunk_cfg = whole_cfg;
    chunk_cfg.prefill_chunk_tokens = 37;
    chunk_cfg.n_threads = 1;
    Session chunked(*model, chunk_cfg);
    std::vector<float> all_chunked(size_t(n) * V);
    chunked.prefill(tokens.data(), n, nullptr, all_chunked.data());
    EXPECT_EQ(all_chunked, all);

    BackendConfig step_cfg = whole_cfg;
    step_cfg.n_threads = 1;
    Session stepwise(*model, step_cfg);
    std::vector<float> logits(V);
    for (int64_t i = 0; i < n; ++i) {
      stepwise.prefill(&tokens[i], 1, logits.data());
      ASSERT_EQ(0, std::memcmp(logits.data(), &all[size_t(i) * V], sizeof(float) * V)) << "position " << i;
    }
    EXPECT_EQ(whole.n_past(), n);
    EXPECT_EQ(chunked.n_past(), n);
  }
}

TEST(Stories260K, PromptLongerThanContextIsRefused) {
  auto model = load_stories();
  BackendConfig sc;
  sc.context_tokens = 16;
  Session session(*model, sc);
  std::vector<int32_t> tokens(17, 5);
  try {
    session.prefill(tokens.data(), 17, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("longer than the context"), std::string::npos) << e.what();
  }
  EXPECT_EQ(session.n_past(), 0);
  int32_t bad = 100000;
  EXPECT_THROW(session.prefill(&bad, 1, nullptr), Error);
}

// Writes stories260K as a Hugging Face folder: q/k rows permuted from the interleaved RoPE order
// to transformers' half-split order, a byte-level BPE tokenizer.json of the same size.
void write_hf_copy(const Model& m, const std::string& dir) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const ModelConfig& c = m.config();
  std::vector<std::vector<float>> keep;
  std::vector<format::SafetensorsTensorView> views;
  auto add = [&](const std::string& name, std::vector<float> data, std::vector<int64_t> shape) {
    keep.push_back(std::move(data));
    views.push_back({name, "F32", shape, keep.back().data(), keep.back().size() * 4});
  };
  auto rows = [](const WeightMatrix& w) {
    const float* p = reinterpret_cast<const float*>(w.data);
    return std::vector<float>(p, p + w.n_in * w.n_out);
  };
  auto to_half_split = [&](const WeightMatrix& w, int n_heads) {
    std::vector<float> src = rows(w), dst(src.size());
    const int d = c.head_dim;
    for (int h = 0; h < n_heads; ++h)
      for (int j = 0; j < d / 2; ++j)
        for (int64_t i = 0; i < w.n_in; ++i) {
          dst[(int64_t(h) * d + j) * w.n_in + i] = src[(int64_t(h) * d + 2 * j) * w.n_in + i];
          dst[(int64_t(h) * d + d / 2 + j) * w.n_in + i] = src[(int64_t(h) * d + 2 * j + 1) * w.n_in + i];
        }
    return dst;
  };
  keep.reserve(8 + 9 * c.n_layers);
  add("model.embed_tokens.weight", rows(m.token_embedding()), {c.n_vocab, c.dim});
  add("model.norm.weight", m.output_norm(), {c.dim});
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layer(l);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", w.attn_norm, {c.dim});
    add(p + "post_attention_layernorm.weight", w.ffn_norm, {c.dim});
    add(p + "self_attn.q_proj.weight", to_half_split(w.wq, c.n_heads), {w.wq.n_out, w.wq.n_in});
    add(p + "self_attn.k_proj.weight", to_half_split(w.wk, c.n_kv_heads), {w.wk.n_out, w.wk.n_in});
    add(p + "self_attn.v_proj.weight", rows(w.wv), {w.wv.n_out, w.wv.n_in});
    add(p + "self_attn.o_proj.weight", rows(w.wo), {w.wo.n_out, w.wo.n_in});
    add(p + "mlp.gate_proj.weight", rows(w.w_gate), {w.w_gate.n_out, w.w_gate.n_in});
    add(p + "mlp.up_proj.weight", rows(w.w_up), {w.w_up.n_out, w.w_up.n_in});
    add(p + "mlp.down_proj.weight", rows(w.w_down), {w.w_down.n_out, w.w_down.n_in});
  }
  format::write_safetensors(dir + "/model.safetensors", views, {{"format", "pt"}});
  std::ofstream(dir + "/config.json")
      << "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": " << c.dim
      << ", \"intermediate_size\": " << c.ffn_dim << ", \"num_hidden_layers\": " << c.n_layers
      << ", \"num_attention_heads\": " << c.n_heads << ", \"num_key_value_heads\": " << c.n_kv_heads
      << ", \"vocab_size\": " << c.n_vocab << ", \"max_position_embeddings\": " << c.context_length
      << ", \"rms_norm_eps\": 1e-05, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}";
  // Byte-level vocabulary: the 256 GPT-2 byte symbols, then two-letter merges.
  std::string vocab = "{", merges = "[";
  int id = 0;
  auto byte_symbol = [](int b) {
    int cp = b;
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    if (!printable) {
      int n = 0;
      for (int x = 0; x < b; ++x)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
      cp = 256 + n;
    }
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xc0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3f));
    }
    return s;
  };
  auto quote = [](const std::string& s) {
    std::string q = "\"";
    for (char ch : s) {
      if (ch == '"' || ch == '\\') q += '\\';
      q += ch;
    }
    return q + "\"";
  };
  for (int b = 0; b < 256; ++b) vocab += (b ? ", " : "") + quote(byte_symbol(b)) + ": " + std::to_string(id++);
  for (int i = 0; id < c.n_vocab; ++i) {
    const std::string a(1, char('a' + i % 26)), b(1, char('a' + (i / 26) % 26));
    vocab += ", " + quote(a + b) + ": " + std::to_string(id++);
    merges += std::string(i ? ", " : "") + quote(a + " " + b);
  }
  std::ofstream(dir + "/tokenizer.json")
      << "{\"model\": {\"type\": \"BPE\", \"vocab\": " << vocab << "}, \"merges\": " << merges
      << "]}, \"added_tokens\": []}";
}

TEST(HuggingFaceFolder, SameLogitsAsTheLlama2cCheckpoint) {
  auto reference = load_stories();
  const std::string dir = ::testing::TempDir() + "/certkv_hf_stories";
  write_hf_copy(*reference, dir);
  auto hf = load_model(dir);
  EXPECT_EQ(hf->config().rope_layout, RopeLayout::kHalfSplit);
  EXPECT_EQ(reference->config().rope_layout, RopeLayout::kInterleaved);
  ASSERT_EQ(hf->config().n_vocab, reference->config().n_vocab);
  const int V = hf->config().n_vocab;
  std::vector<int32_t> tokens = {1, 403, 407, 261, 378, 13, 400, 275, 260, 300, 42, 77, 150, 333, 9, 22, 499};
  BackendConfig sc;
  sc.context_tokens = 64;
  Session a(*reference, sc), b(*hf, sc);
  std::vector<float> la(tokens.size() * V), lb(tokens.size() * V);
  a.prefill(tokens.data(), int64_t(tokens.size()), nullptr, la.data());
  b.prefill(tokens.data(), int64_t(tokens.size()), nullptr, lb.data());
  double max_abs = 0, max_diff = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    max_abs = std::max(max_abs, double(std::fabs(la[i])));
    max_diff = std::max(max_diff, double(std::fabs(la[i] - lb[i])));
  }
  ASSERT_GT(max_abs, 1.0);
  EXPECT_LT(max_diff, 1e-4 * max_abs);
}

TEST(HuggingFaceFolder, MissingPiecesGiveClearErrors) {
  auto reference = load_stories();
  const std::string dir = ::testing::TempDir() + "/certkv_hf_broken";
  write_hf_copy(*reference, dir);
  std::filesystem::remove(dir + "/tokenizer.json");
  try {
    load_model(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
  std::ofstream(dir + "/config.json") << "{\"architectures\": [\"GPT2LMHeadModel\"], \"hidden_size\": 64}";
  EXPECT_THROW(load_model(dir), Error);
}

}  // namespace
}  // namespace certkv::model
