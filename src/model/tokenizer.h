// Text <-> token ids for the two vocabulary kinds GGUF files carry, matching llama.cpp:
//   "gpt2"  byte-level BPE: text is cut into words by the pre-tokenizer named by
//           tokenizer.ggml.pre (model/pretokenizer.h), each word's bytes are mapped to GPT-2's
//           printable byte alphabet and merged pairwise by merge rank.
//   "llama" SentencePiece: a space is prepended (add_space_prefix), spaces become U+2581, and
//           adjacent pieces are merged highest score first; characters with no piece fall back to
//           the <0xNN> byte tokens.
// Control, unknown and user-defined tokens are "special": their text is cut out of the input
// before either algorithm runs (user-defined always, control and unknown only when parse_special).
//
// Thread safety: a Tokenizer is immutable after construction; every const method may be called
// from many threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/pretokenizer.h"

namespace certkv::model {

class GgufFile;

// Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type).
enum TokenType : int32_t {
  kTokenUndefined = 0,
  kTokenNormal = 1,
  kTokenUnknown = 2,
  kTokenControl = 3,
  kTokenUserDefined = 4,
  kTokenUnused = 5,
  kTokenByte = 6,
};

struct VocabSpec {
  std::string model;                 // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
  std::string pre;                   // tokenizer.ggml.pre: "smollm", "qwen2", "llama-bpe", "default", ...
  std::vector<std::string> tokens;
  std::vector<float> scores;         // may be empty (BPE); SentencePiece merge priorities
  std::vector<int32_t> token_types;  // TokenType values; empty means all normal
  std::vector<std::string> merges;   // "a b" pairs in rank order (BPE)
  int32_t bos = -1, eos = -1, unk = -1, pad = -1, eot = -1;
  // add_bos/add_eos: whether the model wants BOS/EOS around a prompt (see Tokenizer::encode).
  // add_space_prefix: SentencePiece only; byte-level BPE never prepends a space.
  bool add_bos = false, add_eos = false, add_space_prefix = true;
  std::string chat_template;         // tokenizer.chat_template (may be empty)
};

// Reads the tokenizer.* keys of a GGUF file. Absent optional keys take llama.cpp's defaults:
// "llama" vocabularies bos 1, eos 2, unk 0, add_bos and add_space_prefix true; "gpt2" ones
// add_bos true only for the Llama 3 pre-tokenizers. Throws certkv::Error naming the file when
// tokenizer.ggml.model or tokenizer.ggml.tokens is missing or a key has the wrong type.
VocabSpec vocab_from_gguf(const GgufFile& file);

// A byte range of a text.
struct TextSpan {
  size_t offset = 0;
  size_t length = 0;
};

class Tokenizer {
 public:
  // Validates the spec: known model and pre-tokenizer, scores/token_types sizes equal to tokens,
  // special ids in range, well-formed merges, byte tokens spelled <0xHH>. Throws certkv::Error
  // naming the field at fault.
  explicit Tokenizer(VocabSpec spec);

  int32_t n_vocab() const { return static_cast<int32_t>(spec_.tokens.size()); }

  // add_bos: add the markers the model asks for (llama.cpp's add_special): BOS first when
  // spec.add_bos, EOS last when spec.add_eos. With add_bos false neither is added.
  // parse_special: control and unknown token texts (e.g. "<|im_start|>") in `text` become those
  // tokens; otherwise they are tokenized as ordinary characters. Invalid UTF-8 bytes are
  // tokenized as U+FFFD by byte-level BPE and as byte tokens by SentencePiece. A byte-level
  // vocabulary may lack tokens for a few bytes (SmolLM2: controls such as 0x04, and the lead
  // bytes of code points from U+40000); such bytes are dropped, as llama.cpp drops them.
  // SentencePiece uses the unk token for a byte without a <0xHH> token, and throws
  // certkv::Error (kNotFound) when there is none.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const;
  // As above, but a special token's text (control, unknown or user-defined) that overlaps a
  // literal span is tokenized as ordinary characters: the spans a chat prompt's messages fill
  // (chat_template.h's tokenize_chat), so that text a user wrote cannot become the template's
  // turn markers or any other special token (Qwen's <tool_call> is user-defined).
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special,
                              const std::vector<TextSpan>& literal_spans) const;

  // The bytes token `id` stands for: a byte token's byte, a normal token's text (byte-level
  // alphabet or U+2581 undone), a user-defined token's text; control and unknown tokens give ""
  // unless render_special. Throws certkv::Error (kOutOfRange) for an id outside [0, n_vocab).
  std::string token_piece(int32_t id, bool render_special = false) const;

  // Concatenates token pieces. For SentencePiece with add_space_prefix it drops the one space
  // that encode prepends: the leading space of the piece at the start and after every special
  // token. decode(encode(x, b, s), s) == x for valid UTF-8 x whose bytes all have tokens.
  std::string decode(const std::vector<int32_t>& ids, bool render_special = false) const;

  // eos, eot, and tokens named like end-of-turn markers (<|im_end|>, <|endoftext|>, <|eot_id|>,
  // <end_of_turn>, ...: llama.cpp's list). False for ids out of range.
  bool is_end_of_generation(int32_t id) const;

  const VocabSpec& spec() const { return spec_; }
  // The type used for a token: spec.token_types, except that end-of-turn markers count as
  // control tokens whatever their declared type (as in llama.cpp).
  TokenType token_type(int32_t id) const;

 private:
  struct Fragment {
    bool is_token = false;
    int32_t token = -1;
    size_t offset = 0;  // text fragments: byte range in the input
    size_t length = 0;
  };
  bool is_special(int32_t id) const;
  std::vector<Fragment> partition_special(std::string_view text, bool parse_special,
                                          const std::vector<TextSpan>& literal_spans) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe_word(const std::string& word, std::string& scratch,
                       std::vector<int32_t>& out) const;
  void encode_spm(const std::string& escaped, std::vector<int32_t>& out) const;
  int32_t find_token(const std::string& text) const;
  void check_id(int32_t id, const char* what) const;

  VocabSpec spec_;
  bool byte_level_ = false;  // "gpt2" vs "llama"
  PreTokenizerChoice pre_;
  std::vector<TokenType> types_;
  std::vector<uint8_t> end_of_generation_;
  std::unordered_map<std::string, int32_t> token_ids_;    // text -> id (last duplicate wins)
  std::unordered_map<std::string, int32_t> merge_ranks_;  // "left right" -> rank
  std::vector<int32_t> special_ids_;                      // longest text first
  std::array<int32_t, 256> byte_tokens_{};                // SentencePiece <0xHH>; -1 if absent
  std::array<std::string, 256> byte_chars_;               // byte-level BPE: GPT-2 alphabet
  std::vector<std::string> pieces_;                       // token_piece(id, false) per id
};

}  // namespace certkv::model
