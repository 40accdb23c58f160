// Pre-tokenizers of byte-level BPE vocabularies: they cut text into words before BPE merging, by
// the regexes llama.cpp applies for each `tokenizer.ggml.pre` name (llama-vocab.cpp,
// llm_tokenizer_bpe), evaluated by hand over code points instead of by a regex engine.
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace certkv::model {

enum class PreTokenizer {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // \p{N} (every digit a word of its own), then kGpt2: smollm, starcoder, refact, command-r, ...
  kGpt2SingleDigits,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+   (llama-bpe, llama3, dbrx, ...)
  kLlama3,
  // kLlama3 with \p{N} in place of \p{N}{1,3}  (qwen2, deepseek-r1-qwen, stablelm2)
  kQwen2,
  // llama.cpp's fallback for "default": [\p{P}\$\+<=>\^~\|]+, then kGpt2, then \p{N}+, then
  // [0-9][0-9][0-9]; each regex isolates its matches and keeps the text between them.
  kDefault,
};

struct PreTokenizerChoice {
  PreTokenizer kind = PreTokenizer::kGpt2;
  // llama.cpp's ignore_merges: a word that is itself a vocabulary token is emitted whole.
  bool ignore_merges = false;
};

// Maps a tokenizer.ggml.pre name to its pre-tokenizer; an empty name means "default".
// nullopt for names not supported.
std::optional<PreTokenizerChoice> find_pre_tokenizer(const std::string& pre);
// As find_pre_tokenizer, but an unsupported name throws certkv::Error (kUnsupported).
PreTokenizerChoice pre_tokenizer_from_name(const std::string& pre);

// A word: code points [begin, end).
struct WordSpan {
  size_t begin = 0;
  size_t end = 0;
};

// Splits cps into words that cover it exactly, in order, none empty.
std::vector<WordSpan> split_words(PreTokenizer kind, const std::vector<uint32_t>& cps);

}  // namespace certkv::model
