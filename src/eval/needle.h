// Needle-in-a-haystack retrieval tasks (DESIGN.md section 6), generated offline in the style of
// RULER's NIAH tasks: a haystack of filler sentences (a fixed cycle of noise sentences, or prose
// from public-domain books) with needle sentences
//   "One of the special magic numbers for <key> is: <7-digit number>."
// inserted between sentences, a question naming the key(s), and exact-match scoring. Variants:
//   kSingle      one needle, asked;
//   kMultiKey    n_needles needles with distinct keys, one of them asked (the others distract);
//   kMultiValue  n_needles needles with one key and distinct numbers, all asked;
//   kMultiQuery  n_needles needles with distinct keys, all asked.
// Everything random (keys, numbers, depths, where the corpus text starts) comes from the seed, so
// a seed names a task. Prompt length is fitted to the caller's tokenizer: the haystack grows whole
// sentences at a time until the prompt is as long as it can be without passing target_tokens, and
// it must reach at least 0.9 target_tokens.
// Thread safety: all functions are reentrant (count_tokens is called from the calling thread).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace certkv::eval {

enum class NeedleVariant { kSingle, kMultiKey, kMultiValue, kMultiQuery };
enum class NeedleHaystack { kNoise, kCorpus };

// "single", "multi-key", "multi-value", "multi-query".
const char* needle_variant_name(NeedleVariant variant);
// The inverse of needle_variant_name; throws kInvalidArgument naming the text otherwise.
NeedleVariant parse_needle_variant(std::string_view name);

// The number of tokens of a text under the model's tokenizer (the caller binds it). If the model
// wraps the prompt in a chat template, the callback should add the template's tokens too.
using CountTokens = std::function<int64_t(std::string_view)>;

struct NeedleParams {
  NeedleVariant variant = NeedleVariant::kSingle;
  NeedleHaystack haystack = NeedleHaystack::kNoise;
  std::vector<std::string> corpus_paths;  // kCorpus only: text files read in order (see below)
  int64_t target_tokens = 4096;           // the prompt has at most this many tokens, >= 90% of it
  std::optional<double> depth;            // of the first asked needle, in [0, 1]; unset: from the seed
  int n_needles = 4;                      // multi variants only: needle sentences, 2..kMaxNeedles
  uint64_t seed = 0;
};

inline constexpr int kMaxNeedles = 64;
inline constexpr int64_t kMaxNeedleTargetTokens = int64_t(1) << 24;

struct NeedleTask {
  std::string context;                // the haystack with the needle sentences in it
  std::string question;               // "What is the special magic number for <key> ...?"
  std::string answer_prefix;          // "The special magic number for <key> ... is"
  std::vector<std::string> answers;   // the 7-digit numbers asked for; all are expected
  double depth = 0;                   // realized depth of the first asked needle (see below)
  std::vector<double> needle_depths;  // realized depth of every needle; the asked ones first
  int64_t prompt_tokens = 0;          // count_tokens(needle_prompt(task))
};

// The text whose length was fitted: context, a blank line, question, a blank line, answer prefix.
// A chat caller puts context and question in the user turn and starts the reply with the prefix.
std::string needle_prompt(const NeedleTask& task);

// Generates one task. Needles sit between haystack sentences (a sentence is never cut); the slot
// chosen for a needle at depth d is the sentence boundary nearest to d times the haystack's length
// in bytes, and the realized depth is the haystack bytes before it over all haystack bytes (0 when
// the haystack is empty). Needles in the same slot keep their order (the asked ones first), so at
// depth 0 the first asked needle opens the context. The haystack is a stream of sentences: the
// noise cycle, or the corpus sentences from a position drawn from the seed, wrapping around at
// the end of the corpus.
// Throws certkv::Error:
//   kInvalidArgument  target_tokens too small to hold the needles, question and answer prefix
//                     (the message names target_tokens and the tokens they need) or above
//                     kMaxNeedleTargetTokens, a target that
//                     cannot be filled to 90% with whole sentences, depth outside [0, 1],
//                     n_needles outside [2, kMaxNeedles] for a multi variant, an empty
//                     count_tokens or one that returns a negative count, corpus_paths empty for
//                     kCorpus or not empty for kNoise;
//   kNotFound / kIo   a corpus file that does not exist / cannot be read (the message names it).
NeedleTask generate_needle_task(const NeedleParams& params, const CountTokens& count_tokens);

// The prose sentences of text files, in file order. Lines are grouped into paragraphs at blank
// lines, and a paragraph is kept only if it is prose: at least 3 words, ending with '.', '!' or
// '?' (closing quotes or brackets may follow), not mostly capitals, not a "CHAPTER IV"-style
// heading. Project Gutenberg boilerplate is skipped: everything outside "*** START OF" / "*** END
// OF" markers when present, the "Produced by" credit, paragraphs naming Project Gutenberg or a URL,
// and a transcriber's note (a paragraph naming it and the prose paragraphs right after it).
// Paragraphs split into sentences after '.', '!' or '?' followed by a space and a capital or an
// opening quote, never after a title such as "Mr." or an initial, and not inside double quotes
// that close within the paragraph (a quote left open runs on into the next paragraph) until the
// quoted sentence reaches 400 bytes, so that a long speech still splits.
// Throws kNotFound / kIo naming a path, kInvalidArgument when no path or no sentence is found.
std::vector<std::string> load_corpus_sentences(const std::vector<std::string>& paths);

// True when every answer of the task appears in `generated` as a whole number: not preceded or
// followed by another digit. Other text around it is fine. Throws kInvalidArgument for a task
// without answers.
bool needle_exact_match(const NeedleTask& task, std::string_view generated);

// The fraction of the task's answers that appear in `generated` as whole numbers (RULER's
// score for the multi-value and multi-query variants). Throws kInvalidArgument without answers.
double needle_recall(const NeedleTask& task, std::string_view generated);

}  // namespace certkv::eval
