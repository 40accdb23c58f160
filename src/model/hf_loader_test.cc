#include "model/hf_loader.h"

#include <gtest/gtest.h>

#include "core/status.h"

namespace certkv::model {
namespace {

format::JsonValue json(const std::string& text) { return format::parse_json(text, "test.json"); }

TEST(HfTokenizerJson, PreTokenizerFamilies) {
  // SmolLM2: single digits, then byte-level.
  auto smollm = json(R"({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true},
                         {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}]})");
  EXPECT_EQ(pre_tokenizer_name(&smollm), "smollm");
  auto llama3 = json(R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex":
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
      "behavior": "Isolated"}, {"type": "ByteLevel", "use_regex": false}]})");
  EXPECT_EQ(pre_tokenizer_name(&llama3), "llama-bpe");
  auto qwen = json(R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex":
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
      {"type": "ByteLevel", "use_regex": false}]})");
  EXPECT_EQ(pre_tokenizer_name(&qwen), "qwen2");
  auto gpt2 = json(R"({"type": "ByteLevel", "add_prefix_space": false})");
  EXPECT_EQ(pre_tokenizer_name(&gpt2), "gpt-2");
  EXPECT_EQ(pre_tokenizer_name(nullptr), "gpt-2");
}

TEST(HfTokenizerJson, VocabularyAddedTokensAndSpecials) {
  auto tok = json(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
      "merges": ["a b"]}, "added_tokens": [{"id": 3, "content": "<|end|>", "special": true},
      {"id": 5, "content": "<tool>", "special": false}]})");
  auto cfg = json(R"({"eos_token": {"content": "<|end|>"}, "bos_token": null, "add_bos_token": false,
      "chat_template": "{{ x }}"})");
  const VocabSpec v = vocab_from_tokenizer_json(tok, &cfg, "tokenizer.json");
  ASSERT_EQ(v.tokens.size(), 6u);
  EXPECT_EQ(v.tokens[2], "ab");
  EXPECT_EQ(v.token_types[3], 3);  // control
  EXPECT_EQ(v.token_types[4], 5);  // hole in the id range: unused
  EXPECT_EQ(v.token_types[5], 4);  // user-defined
  EXPECT_EQ(v.eos, 3);
  EXPECT_EQ(v.bos, -1);
  EXPECT_EQ(v.merges, std::vector<std::string>{"a b"});
  EXPECT_EQ(v.chat_template, "{{ x }}");
  // Merges given as pairs (newer tokenizers) are accepted too.
  auto pairs = json(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}})");
  EXPECT_EQ(vocab_from_tokenizer_json(pairs, nullptr, "t.json").merges, std::vector<std::string>{"a b"});
}

TEST(HfTokenizerJson, UnsupportedAndMalformedAreRefused) {
  auto wordpiece = json(R"({"model": {"type": "WordPiece", "vocab": {}}})");
  EXPECT_THROW(vocab_from_tokenizer_json(wordpiece, nullptr, "t.json"), Error);
  auto fallback = json(R"({"model": {"type": "BPE", "byte_fallback": true, "vocab": {"a": 0}, "merges": []}})");
  EXPECT_THROW(vocab_from_tokenizer_json(fallback, nullptr, "t.json"), Error);
  auto bad_id = json(R"({"model": {"type": "BPE", "vocab": {"a": -4}, "merges": []}})");
  EXPECT_THROW(vocab_from_tokenizer_json(bad_id, nullptr, "t.json"), Error);
  auto bad_merge = json(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [3]}})");
  EXPECT_THROW(vocab_from_tokenizer_json(bad_merge, nullptr, "t.json"), Error);
}

}  // namespace
}  // namespace certkv::model
