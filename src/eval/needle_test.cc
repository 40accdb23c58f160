#include "eval/needle.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::eval {
namespace {

// Prefixes of the corpus books (tests/data/README.md).
const std::string kCorpusDir = std::string(CERTKV_TEST_DATA_DIR) + "/corpus/";

// Fake tokenizers: whitespace-separated words, and one token per 4 bytes.
int64_t count_words(std::string_view text) {
  int64_t n = 0;
  bool in_word = false;
  for (const char c : text) {
    const bool space = c == ' ' || c == '\n' || c == '\t';
    n += !space && !in_word;
    in_word = !space;
  }
  return n;
}
int64_t count_quarter_bytes(std::string_view text) { return int64_t((text.size() + 3) / 4); }

std::vector<std::string> small_corpus() {
  return {kCorpusDir + "carroll-alice-in-wonderland.txt", kCorpusDir + "conrad-heart-of-darkness.txt"};
}

NeedleParams params_for(NeedleVariant variant, NeedleHaystack haystack, int64_t target, uint64_t seed) {
  NeedleParams p;
  p.variant = variant;
  p.haystack = haystack;
  if (haystack == NeedleHaystack::kCorpus) p.corpus_paths = small_corpus();
  p.target_tokens = target;
  p.seed = seed;
  return p;
}

std::string needle_of(const std::string& key, const std::string& number) {
  return "One of the special magic numbers for " + key + " is: " + number + ".";
}

size_t occurrences(std::string_view text, std::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string_view::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The key a single-answer question asks about.
std::string asked_key(const NeedleTask& task) {
  const std::string lead = "What is the special magic number for ";
  const size_t end = task.question.find(" mentioned");
  EXPECT_TRUE(task.question.starts_with(lead)) << task.question;
  return task.question.substr(lead.size(), end - lead.size());
}

void expect_error(const std::function<void()>& f, StatusCode code, const std::string& named) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << named;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
  }
}

TEST(NeedleTask, SameSeedSameTask) {
  for (NeedleHaystack haystack : {NeedleHaystack::kNoise, NeedleHaystack::kCorpus}) {
    const NeedleParams p = params_for(NeedleVariant::kMultiKey, haystack, 1000, 1234);
    const NeedleTask a = generate_needle_task(p, count_words);
    const NeedleTask b = generate_needle_task(p, count_words);
    EXPECT_EQ(a.context, b.context);
    EXPECT_EQ(a.question, b.question);
    EXPECT_EQ(a.answer_prefix, b.answer_prefix);
    EXPECT_EQ(a.answers, b.answers);
    EXPECT_EQ(a.depth, b.depth);
    EXPECT_EQ(a.needle_depths, b.needle_depths);
    EXPECT_EQ(a.prompt_tokens, b.prompt_tokens);

    NeedleParams other = p;
    other.seed = 1235;
    const NeedleTask c = generate_needle_task(other, count_words);
    EXPECT_NE(a.answers, c.answers);
    EXPECT_NE(a.context, c.context);
  }
}

TEST(NeedleTask, LengthFitsTheTokenizer) {
  for (auto count : {CountTokens(count_words), CountTokens(count_quarter_bytes)}) {
    for (NeedleVariant variant : {NeedleVariant::kSingle, NeedleVariant::kMultiQuery}) {
      for (int64_t target : {129, 501, 3771, 16384}) {
        for (NeedleHaystack haystack : {NeedleHaystack::kNoise, NeedleHaystack::kCorpus}) {
          const NeedleParams p = params_for(variant, haystack, target, uint64_t(target));
          const NeedleTask t = generate_needle_task(p, count);
          EXPECT_LE(t.prompt_tokens, target);
          EXPECT_GE(t.prompt_tokens * 10, 9 * target) << "target " << target << " got " << t.prompt_tokens;
          EXPECT_EQ(t.prompt_tokens, count(needle_prompt(t)));
        }
      }
    }
  }
}

TEST(NeedleTask, PromptLayout) {
  const NeedleTask t = generate_needle_task(params_for(NeedleVariant::kSingle, NeedleHaystack::kNoise, 300, 5),
                                            count_words);
  EXPECT_EQ(needle_prompt(t), t.context + "\n\n" + t.question + "\n\n" + t.answer_prefix);
  const std::string key = asked_key(t);
  EXPECT_EQ(t.question, "What is the special magic number for " + key + " mentioned in the provided text?");
  EXPECT_EQ(t.answer_prefix, "The special magic number for " + key + " mentioned in the provided text is");
  EXPECT_NE(t.context.find("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."),
            std::string::npos);
}

TEST(NeedleTask, NeedleSitsAtTheRequestedDepth) {
  for (NeedleHaystack haystack : {NeedleHaystack::kNoise, NeedleHaystack::kCorpus}) {
    for (double depth : {0.0, 0.25, 0.5, 0.75, 1.0}) {
      NeedleParams p = params_for(NeedleVariant::kSingle, haystack, 2000, 77);
      p.depth = depth;
      const NeedleTask t = generate_needle_task(p, count_quarter_bytes);
      ASSERT_EQ(t.answers.size(), 1u);
      const std::string needle = needle_of(asked_key(t), t.answers[0]);
      const size_t at = t.context.find(needle);
      ASSERT_NE(at, std::string::npos);
      EXPECT_EQ(occurrences(t.context, needle), 1u);
      if (depth == 0.0) {
        EXPECT_TRUE(t.context.starts_with(needle + " "));
      }
      if (depth == 1.0) {
        EXPECT_TRUE(t.context.ends_with(" " + needle));
      }
      // Position in the haystack (the context without the needle): off the requested byte
      // fraction by at most half a sentence and its separator. The longest noise sentence has
      // 21 bytes; the longest sentence of the two books 919.
      const double haystack_bytes = double(t.context.size() - needle.size());
      const double fraction = double(at) / haystack_bytes;
      const double half_sentence_bytes = haystack == NeedleHaystack::kNoise ? 11.0 : 460.0;
      const double slack = half_sentence_bytes / haystack_bytes;
      EXPECT_NEAR(fraction, depth, slack) << "haystack " << int(haystack);
      EXPECT_NEAR(t.depth, depth, slack);
      EXPECT_NEAR(t.depth, fraction, 2.0 / haystack_bytes);
      EXPECT_EQ(t.needle_depths, std::vector<double>{t.depth});
    }
  }
}

TEST(NeedleTask, DepthFromTheSeedWhenUnset) {
  std::set<double> depths;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    const NeedleTask t = generate_needle_task(params_for(NeedleVariant::kSingle, NeedleHaystack::kNoise, 1000, seed),
                                              count_words);
    EXPECT_GE(t.depth, 0.0);
    EXPECT_LE(t.depth, 1.0);
    depths.insert(t.depth);
  }
  EXPECT_GE(depths.size(), 6u);
}

TEST(NeedleTask, EveryVariant) {
  for (NeedleHaystack haystack : {NeedleHaystack::kNoise, NeedleHaystack::kCorpus}) {
    // single: one needle, asked.
    NeedleTask t = generate_needle_task(params_for(NeedleVariant::kSingle, haystack, 800, 3), count_words);
    EXPECT_EQ(occurrences(t.context, "One of the special magic numbers for "), 1u);
    ASSERT_EQ(t.answers.size(), 1u);
    EXPECT_EQ(t.answers[0].size(), 7u);
    EXPECT_EQ(occurrences(t.context, needle_of(asked_key(t), t.answers[0])), 1u);

    // multi-key: five needles with distinct keys and numbers, the first one asked.
    NeedleParams p = params_for(NeedleVariant::kMultiKey, haystack, 800, 3);
    p.n_needles = 5;
    t = generate_needle_task(p, count_words);
    EXPECT_EQ(occurrences(t.context, "One of the special magic numbers for "), 5u);
    ASSERT_EQ(t.answers.size(), 1u);
    EXPECT_EQ(occurrences(t.context, needle_of(asked_key(t), t.answers[0])), 1u);
    EXPECT_EQ(occurrences(t.context, "numbers for " + asked_key(t) + " is"), 1u);
    EXPECT_EQ(t.needle_depths.size(), 5u);

    // multi-value: three needles with one key, every number asked.
    p = params_for(NeedleVariant::kMultiValue, haystack, 800, 4);
    p.n_needles = 3;
    t = generate_needle_task(p, count_words);
    ASSERT_EQ(t.answers.size(), 3u);
    EXPECT_EQ(std::set<std::string>(t.answers.begin(), t.answers.end()).size(), 3u);
    const std::string lead = "What are all the special magic numbers for ";
    ASSERT_TRUE(t.question.starts_with(lead)) << t.question;
    const std::string key = t.question.substr(lead.size(), t.question.find(" mentioned") - lead.size());
    EXPECT_EQ(key.find(' '), std::string::npos) << key;
    for (const std::string& number : t.answers) EXPECT_EQ(occurrences(t.context, needle_of(key, number)), 1u);
    EXPECT_TRUE(t.answer_prefix.ends_with(" are"));

    // multi-query: four needles with distinct keys, all asked ("a, b, c and d").
    p = params_for(NeedleVariant::kMultiQuery, haystack, 800, 5);
    p.n_needles = 4;
    t = generate_needle_task(p, count_words);
    ASSERT_EQ(t.answers.size(), 4u);
    EXPECT_EQ(occurrences(t.context, "One of the special magic numbers for "), 4u);
    EXPECT_EQ(occurrences(t.question, ", "), 2u);
    EXPECT_EQ(occurrences(t.question, " and "), 1u);
    for (const std::string& number : t.answers) EXPECT_EQ(occurrences(t.context, " is: " + number + "."), 1u);
  }
}

TEST(NeedleTask, VariantNames) {
  for (NeedleVariant v : {NeedleVariant::kSingle, NeedleVariant::kMultiKey, NeedleVariant::kMultiValue,
                          NeedleVariant::kMultiQuery})
    EXPECT_EQ(parse_needle_variant(needle_variant_name(v)), v);
  EXPECT_STREQ(needle_variant_name(NeedleVariant::kMultiValue), "multi-value");
  expect_error([] { parse_needle_variant("multikey"); }, StatusCode::kInvalidArgument, "multikey");
}

TEST(NeedleScoring, ExactMatch) {
  NeedleTask t;
  t.answers = {"4821957"};
  EXPECT_TRUE(needle_exact_match(t, "4821957"));
  EXPECT_TRUE(needle_exact_match(t, " The special magic number is: 4821957. I hope this helps!"));
  EXPECT_TRUE(needle_exact_match(t, "(4821957)"));
  EXPECT_TRUE(needle_exact_match(t, "48219570 no, 4821957"));  // a later whole occurrence counts
  EXPECT_FALSE(needle_exact_match(t, "482195"));                // a digit missing
  EXPECT_FALSE(needle_exact_match(t, "4821958"));
  EXPECT_FALSE(needle_exact_match(t, "48219571"));              // inside a longer number
  EXPECT_FALSE(needle_exact_match(t, "14821957"));
  EXPECT_FALSE(needle_exact_match(t, "4 821 957"));
  EXPECT_FALSE(needle_exact_match(t, ""));

  t.answers = {"1000000", "9999999", "5555555"};
  EXPECT_TRUE(needle_exact_match(t, "5555555, 1000000 and 9999999"));
  EXPECT_FALSE(needle_exact_match(t, "5555555, 1000000 and 999999"));
  EXPECT_DOUBLE_EQ(needle_recall(t, "5555555, 1000000 and 999999"), 2.0 / 3.0);
  EXPECT_EQ(needle_recall(t, "nothing"), 0.0);
  EXPECT_EQ(needle_recall(t, "9999999 1000000 5555555"), 1.0);

  NeedleTask empty;
  EXPECT_THROW(needle_exact_match(empty, "1234567"), Error);
  EXPECT_THROW(needle_recall(empty, "1234567"), Error);
}

TEST(NeedleScoring, GeneratedTaskScoresItsOwnAnswers) {
  NeedleParams p = params_for(NeedleVariant::kMultiValue, NeedleHaystack::kNoise, 500, 8);
  const NeedleTask t = generate_needle_task(p, count_words);
  std::string reply = t.answer_prefix;
  for (const std::string& a : t.answers) reply += " " + a + ",";
  EXPECT_TRUE(needle_exact_match(t, reply));
  EXPECT_FALSE(needle_exact_match(t, t.answer_prefix + " " + t.answers[0]));
}

TEST(NeedleCorpus, SentencesOfTheBooks) {
  // The first 12-50 KB of each book, with its front matter ("Produced by" credits, a
  // transcriber's note, a URL): 614 sentences.
  const std::vector<std::string> sentences = load_corpus_sentences(
      {kCorpusDir + "austen-pride-and-prejudice.txt", kCorpusDir + "stoker-dracula.txt",
       kCorpusDir + "melville-moby-dick.txt", kCorpusDir + "doyle-adventures-of-sherlock-holmes.txt"});
  EXPECT_GT(sentences.size(), 550u);
  EXPECT_EQ(sentences.front(),
            "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife.");
  size_t titles = 0;
  for (const std::string& s : sentences) {
    ASSERT_FALSE(s.empty());
    for (const char* banned : {"Gutenberg", "Produced by", "http", "www.", "e-text", "Transcriber"})
      EXPECT_EQ(s.find(banned), std::string::npos) << s;
    EXPECT_FALSE(s.ends_with(" Mr.") || s.ends_with(" Mrs.") || s.ends_with(" Dr.")) << s;
    EXPECT_FALSE(s.starts_with(" ") || s.ends_with(" ")) << s;
    titles += s.find("Mr. Bennet") != std::string::npos;
  }
  EXPECT_GT(titles, 10u);  // "Mr. Bennet" is on 16 lines of the first 24 KB of the book (14 sentences)
}

TEST(NeedleCorpus, SplitsAndSkipsBoilerplate) {
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "certkv_eval_needle_corpus";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "book.txt").string();
  {
    std::ofstream out(path, std::ios::binary);
    out << "The Project Gutenberg EBook of A Test, by Nobody\r\n"
           "\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK A TEST ***\r\n"
           "\r\n"
           "Produced by Somebody Kind and the Online Team.\r\n"
           "\r\n"
           "CHAPTER IV. The Beginning Of It All.\r\n"
           "\r\n"
           "Mr. Smith met   H. G. Wells at noon. They talked\r\n"
           "for an hour! Was it long? \xE2\x80\x9CYes. Very long,\xE2\x80\x9D said he.\r\n"
           "\r\n"
           "\"Stop. Now,\" she cried. It stopped.\r\n"
           "\r\n"
           "THE END OF ALL THINGS.\r\n"
           "\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK A TEST ***\r\n"
           "\r\n"
           "This file should be named test.txt. More text here about it.\r\n";
  }
  const std::vector<std::string> sentences = load_corpus_sentences({path});
  const std::vector<std::string> expected = {
      "Mr. Smith met H. G. Wells at noon.", "They talked for an hour!", "Was it long?",
      "\xE2\x80\x9CYes. Very long,\xE2\x80\x9D said he.", "\"Stop. Now,\" she cried.", "It stopped."};
  EXPECT_EQ(sentences, expected);

  // The haystack is made of these sentences only (cycled), with the needle between them.
  NeedleParams p;
  p.haystack = NeedleHaystack::kCorpus;
  p.corpus_paths = {path};
  p.target_tokens = 400;
  const NeedleTask t = generate_needle_task(p, count_words);
  EXPECT_EQ(t.context.find("Gutenberg"), std::string::npos);
  EXPECT_EQ(t.context.find("CHAPTER"), std::string::npos);
  EXPECT_NE(t.context.find("They talked for an hour!"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(NeedleTask, RejectsBadInput) {
  NeedleParams p = params_for(NeedleVariant::kSingle, NeedleHaystack::kNoise, 20, 1);
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "target_tokens 20");
  p.target_tokens = 0;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "target_tokens");
  p.target_tokens = kMaxNeedleTargetTokens + 1;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "target_tokens");
  // Four needles and a four-key question do not fit in 60 words.
  p = params_for(NeedleVariant::kMultiQuery, NeedleHaystack::kNoise, 60, 1);
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "target_tokens 60");

  p = params_for(NeedleVariant::kSingle, NeedleHaystack::kNoise, 500, 1);
  p.depth = 1.5;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "depth");
  p.depth = -0.1;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "depth");

  p = params_for(NeedleVariant::kMultiKey, NeedleHaystack::kNoise, 500, 1);
  p.n_needles = 1;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "n_needles");
  p.n_needles = kMaxNeedles + 1;
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "n_needles");

  p = params_for(NeedleVariant::kSingle, NeedleHaystack::kNoise, 500, 1);
  expect_error([&] { generate_needle_task(p, CountTokens()); }, StatusCode::kInvalidArgument, "count_tokens");
  expect_error([&] { generate_needle_task(p, [](std::string_view) { return int64_t(-1); }); },
               StatusCode::kInvalidArgument, "count_tokens");
  // A tokenizer that never grows cannot reach 90% of the target.
  expect_error([&] { generate_needle_task(p, [](std::string_view) { return int64_t(10); }); },
               StatusCode::kInvalidArgument, "90%");

  p.corpus_paths = small_corpus();
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "corpus_paths");
  p.haystack = NeedleHaystack::kCorpus;
  p.corpus_paths.clear();
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kInvalidArgument, "corpus_paths");

  const std::string missing = kCorpusDir + "no-such-book.txt";
  p.corpus_paths = {kCorpusDir + "wells-time-machine.txt", missing};
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kNotFound, missing);
  p.corpus_paths = {kCorpusDir};
  expect_error([&] { generate_needle_task(p, count_words); }, StatusCode::kIo, kCorpusDir);
}

TEST(NeedleTask, LongSentencesAreNeverCut) {
  // One corpus "sentence" of 300 words and short ones: the fit skips the long one rather than
  // cutting it, and still reaches 90% of the target.
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "certkv_eval_needle_long";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "long.txt").string();
  std::string long_sentence = "It";
  for (int i = 0; i < 300; ++i) long_sentence += " went";
  long_sentence += " on.";
  {
    std::ofstream out(path);
    out << "A short one here. " << long_sentence << " Then a short one. And another short one.\n";
  }
  for (uint64_t seed = 0; seed < 4; ++seed) {
    NeedleParams p;
    p.haystack = NeedleHaystack::kCorpus;
    p.corpus_paths = {path};
    p.target_tokens = 200;
    p.seed = seed;
    const NeedleTask t = generate_needle_task(p, count_words);
    EXPECT_LE(t.prompt_tokens, 200);
    EXPECT_GE(t.prompt_tokens, 180);
    EXPECT_EQ(t.context.find(" went"), std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace certkv::eval
