#include "eval/needle.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/status.h"

namespace certkv::eval {
namespace {

// RULER's noise haystack: a fixed cycle of short sentences.
constexpr auto kNoiseSentences = std::to_array<std::string_view>({
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."});

// Keys are "<adjective>-<noun>" pairs.
constexpr auto kKeyAdjectives = std::to_array<std::string_view>({
    "amber", "ancient", "bitter", "bold", "brave", "bright", "calm", "clever", "cold", "crimson", "curious",
    "distant", "eager", "early", "fierce", "gentle", "golden", "hidden", "hollow", "humble", "icy", "jolly",
    "lively", "lonely", "lucky", "mellow", "misty", "noble", "patient", "proud", "quiet", "rapid", "rustic",
    "silent", "silver", "steady", "swift", "tender", "velvet", "wild"});
constexpr auto kKeyNouns = std::to_array<std::string_view>({
    "anchor", "badger", "banjo", "beacon", "blossom", "canyon", "castle", "cedar", "comet", "compass",
    "falcon", "feather", "garden", "glacier", "harbor", "hazel", "island", "kettle", "lantern", "lemon",
    "maple", "meadow", "mirror", "mountain", "orchard", "otter", "pebble", "pepper", "piano", "pillow",
    "planet", "puzzle", "quarry", "raven", "ribbon", "river", "saddle", "sparrow", "spruce", "thistle",
    "thunder", "tiger", "tulip", "valley", "violin", "walnut", "whistle", "willow", "window", "zephyr"});

static_assert(kKeyAdjectives.size() * kKeyNouns.size() >= 16 * kMaxNeedles, "distinct keys by rejection need room");

constexpr uint64_t kNeedleNumberMin = 1000000;  // 7 digits, no leading zero
constexpr uint64_t kNeedleNumberSpan = 9000000;
// Extra sentences tried one by one when the best prefix of the haystack falls short of 90%.
constexpr int kGreedyFillTries = 64;

// Inside a quotation, sentences are kept together up to this length, then split as usual.
constexpr size_t kQuotedSentenceMaxBytes = 400;

// Titles and other words whose '.' does not end a sentence.
constexpr auto kAbbreviations = std::to_array<std::string_view>({
    "Mr", "Mrs", "Ms", "Dr", "St", "Mme", "Mlle", "Messrs", "Capt", "Col", "Gen", "Lt", "Rev", "Sr", "Jr",
    "Esq", "Prof", "Hon", "Gov", "Sgt", "Mt", "Ft"});

// UTF-8 curly quotes.
constexpr std::string_view kOpenDouble = "\xE2\x80\x9C";   // “
constexpr std::string_view kCloseDouble = "\xE2\x80\x9D";  // ”
constexpr std::string_view kOpenSingle = "\xE2\x80\x98";   // ‘
constexpr std::string_view kCloseSingle = "\xE2\x80\x99";  // ’

// Draws from the raw mt19937_64 stream, whose output the standard fixes, so a seed gives the same
// task with every standard library (std distributions are implementation-defined).
class SeededDraws {
 public:
  explicit SeededDraws(uint64_t seed) : rng_(seed) {}
  uint64_t below(uint64_t n) { return rng_() % n; }
  uint64_t raw() { return rng_(); }
  double unit() { return double(rng_() >> 11) * 0x1.0p-53; }  // [0, 1)

 private:
  std::mt19937_64 rng_;
};

struct Needle {
  std::string key;
  std::string number;
  double depth;  // requested
};

std::string needle_sentence(const Needle& n) {
  return "One of the special magic numbers for " + n.key + " is: " + n.number + ".";
}

// "a", "a and b", "a, b and c".
std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += i + 1 == keys.size() ? " and " : ", ";
    out += keys[i];
  }
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool starts_with_ci(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && lower(s.substr(0, prefix.size())) == lower(prefix);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

size_t occurrences(std::string_view text, std::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string_view::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_upper(char c) { return c >= 'A' && c <= 'Z'; }

// ---- corpus text --------------------------------------------------------------------------

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail(StatusCode::kNotFound, path + ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) fail(StatusCode::kIo, path + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(StatusCode::kIo, path + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(StatusCode::kIo, path + ": read error");
  return text.str();
}

// Lines of the body, without Project Gutenberg's header and footer when their markers are there.
std::vector<std::string_view> body_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    if (eol == std::string_view::npos) break;
    text.remove_prefix(eol + 1);
  }
  size_t begin = 0, end = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string_view t = trim(lines[i]);
    if (starts_with_ci(t, "*** START OF") || starts_with_ci(t, "***START OF")) {
      begin = i + 1;
    } else if (starts_with_ci(t, "*** END OF") || starts_with_ci(t, "***END OF") ||
               starts_with_ci(t, "End of the Project Gutenberg") || starts_with_ci(t, "End of Project Gutenberg")) {
      end = i;
      break;
    }
  }
  if (begin > end) begin = end;
  return {lines.begin() + std::ptrdiff_t(begin), lines.begin() + std::ptrdiff_t(end)};
}

// Paragraphs (runs of non-blank lines), each joined with single spaces.
std::vector<std::string> paragraphs_of(const std::vector<std::string_view>& lines) {
  std::vector<std::string> out;
  std::string current;
  for (const std::string_view line : lines) {
    const std::string_view t = trim(line);
    if (t.empty()) {
      if (!current.empty()) out.push_back(std::move(current));
      current.clear();
      continue;
    }
    bool space = !current.empty();
    for (const char c : t) {
      if (c == ' ' || c == '\t') {
        space = true;
        continue;
      }
      if (space) current += ' ';
      space = false;
      current += c;
    }
  }
  if (!current.empty()) out.push_back(std::move(current));
  return out;
}

// Removes closing quotes, brackets and emphasis marks from the end of s.
std::string_view strip_closers(std::string_view s) {
  while (!s.empty()) {
    if (s.ends_with(kCloseDouble) || s.ends_with(kCloseSingle)) {
      s.remove_suffix(3);
    } else if (s.back() == '"' || s.back() == '\'' || s.back() == ')' || s.back() == ']' || s.back() == '_' ||
               s.back() == '*') {
      s.remove_suffix(1);
    } else {
      break;
    }
  }
  return s;
}

bool is_numeral(std::string_view word) {
  while (!word.empty() && (word.back() == '.' || word.back() == ':')) word.remove_suffix(1);
  if (word.empty()) return false;
  const bool digits = std::all_of(word.begin(), word.end(), is_digit);
  const bool roman = std::all_of(word.begin(), word.end(), [](char c) {
    return std::string_view("IVXLCDMivxlcdm").find(c) != std::string_view::npos;
  });
  return digits || roman;
}

bool is_prose(std::string_view p) {
  std::vector<std::string_view> words;
  for (size_t i = 0; i < p.size();) {
    const size_t space = std::min(p.find(' ', i), p.size());
    words.push_back(p.substr(i, space - i));
    i = space + 1;
  }
  if (words.size() < 3) return false;
  const std::string first = lower(words[0]);
  if ((first == "chapter" || first == "book" || first == "volume" || first == "part" || first == "stave") &&
      is_numeral(words[1]))
    return false;
  const std::string_view core = strip_closers(p);
  if (core.empty() || std::string_view(".!?").find(core.back()) == std::string_view::npos) return false;
  int64_t upper = 0, letters = 0;
  for (const char c : p) {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      ++letters;
      upper += is_upper(c);
    }
  }
  return upper * 2 <= letters;
}

// True when the '.' at `dot` follows a title ("Mr.") or an initial ("H.").
bool ends_abbreviation(std::string_view p, size_t dot) {
  size_t b = dot;
  while (b > 0 && std::isalpha(static_cast<unsigned char>(p[b - 1]))) --b;
  const std::string_view word = p.substr(b, dot - b);
  if (word.size() == 1 && is_upper(word[0])) return true;
  return std::find(kAbbreviations.begin(), kAbbreviations.end(), word) != kAbbreviations.end();
}

bool opens_sentence(std::string_view rest) {
  if (rest.empty()) return false;
  const char c = rest[0];
  return is_upper(c) || is_digit(c) || c == '"' || c == '\'' || c == '_' || c == '(' ||
         rest.starts_with(kOpenDouble) || rest.starts_with(kOpenSingle);
}

// Splits one whitespace-normalized paragraph into sentences (see load_corpus_sentences).
void split_sentences(std::string_view p, std::vector<std::string>& out) {
  // Quotes are honoured only when they balance within the paragraph: a speech running on into
  // the next paragraph leaves its quote open, and would otherwise make one huge sentence.
  const bool track_curly = occurrences(p, kOpenDouble) == occurrences(p, kCloseDouble);
  const bool track_straight = std::count(p.begin(), p.end(), '"') % 2 == 0;
  int curly_depth = 0;         // open “ without their ”
  bool straight_open = false;  // inside "..."
  size_t start = 0;
  size_t i = 0;
  while (i < p.size()) {
    if (p.substr(i).starts_with(kOpenDouble)) {
      ++curly_depth;
      i += 3;
      continue;
    }
    if (p.substr(i).starts_with(kCloseDouble)) {
      curly_depth = std::max(0, curly_depth - 1);
      i += 3;
      continue;
    }
    if (p[i] == '"') {
      straight_open = !straight_open;
      ++i;
      continue;
    }
    if (p[i] != '.' && p[i] != '!' && p[i] != '?') {
      ++i;
      continue;
    }
    const size_t terminal = i;
    // The end of the sentence: more terminals, then closing quotes and brackets.
    size_t j = i + 1;
    while (j < p.size()) {
      const std::string_view rest = p.substr(j);
      if (rest.starts_with(kCloseDouble)) {
        curly_depth = std::max(0, curly_depth - 1);
        j += 3;
      } else if (rest.starts_with(kCloseSingle)) {
        j += 3;
      } else if (p[j] == '"') {
        straight_open = false;
        ++j;
      } else if (std::string_view(".!?')]_").find(p[j]) != std::string_view::npos) {
        ++j;
      } else {
        break;
      }
    }
    i = j;
    if (j >= p.size() || p[j] != ' ' || !opens_sentence(p.substr(j + 1))) continue;
    const bool quoted = (track_curly && curly_depth > 0) || (track_straight && straight_open);
    if (quoted && j - start < kQuotedSentenceMaxBytes) continue;
    if (p[terminal] == '.' && j == terminal + 1 && ends_abbreviation(p, terminal)) continue;
    out.emplace_back(p.substr(start, j - start));
    start = j + 1;
  }
  const std::string_view tail = trim(p.substr(std::min(start, p.size())));
  if (!tail.empty()) out.emplace_back(tail);
}

// ---- needles and the prompt ----------------------------------------------------------------

struct Layout {
  std::string context;
  std::vector<double> depths;  // realized, per needle
};

// Joins the haystack sentences with single spaces and puts each needle at the sentence boundary
// nearest its requested depth (by bytes).
Layout assemble(const std::vector<std::string_view>& haystack, const std::vector<Needle>& needles) {
  const size_t n = haystack.size();
  std::vector<size_t> offset(n + 1, 0);  // bytes before sentence k, one separator per sentence
  for (size_t k = 0; k < n; ++k) offset[k + 1] = offset[k] + haystack[k].size() + 1;
  const double total = double(offset[n]);

  Layout layout;
  std::vector<size_t> slot(needles.size());
  for (size_t j = 0; j < needles.size(); ++j) {
    const double target = needles[j].depth * total;
    size_t k = size_t(std::lower_bound(offset.begin(), offset.end(), target,
                                       [](size_t o, double t) { return double(o) < t; }) -
                      offset.begin());
    if (k > n) k = n;
    if (k > 0 && target - double(offset[k - 1]) <= double(offset[k]) - target) --k;
    slot[j] = k;
    layout.depths.push_back(n > 0 ? double(offset[k]) / total : 0.0);
  }

  std::vector<std::string> needle_text;
  for (const Needle& needle : needles) needle_text.push_back(needle_sentence(needle));
  std::string& context = layout.context;
  auto append = [&context](std::string_view piece) {
    if (!context.empty()) context += ' ';
    context += piece;
  };
  for (size_t k = 0; k <= n; ++k) {
    for (size_t j = 0; j < needles.size(); ++j)
      if (slot[j] == k) append(needle_text[j]);
    if (k < n) append(haystack[k]);
  }
  return layout;
}

void validate(const NeedleParams& params, const CountTokens& count_tokens) {
  if (!count_tokens) fail(StatusCode::kInvalidArgument, "needle task: count_tokens is empty");
  if (params.target_tokens < 1 || params.target_tokens > kMaxNeedleTargetTokens)
    fail(StatusCode::kInvalidArgument, "needle task: target_tokens must be in [1, " +
                                           std::to_string(kMaxNeedleTargetTokens) + "], got " +
                                           std::to_string(params.target_tokens));
  if (params.depth && !(*params.depth >= 0 && *params.depth <= 1))
    fail(StatusCode::kInvalidArgument, "needle task: depth must be in [0, 1], got " + std::to_string(*params.depth));
  if (params.variant != NeedleVariant::kSingle && (params.n_needles < 2 || params.n_needles > kMaxNeedles))
    fail(StatusCode::kInvalidArgument, std::string("needle task: n_needles must be in [2, ") +
                                           std::to_string(kMaxNeedles) + "] for the " +
                                           needle_variant_name(params.variant) + " variant, got " +
                                           std::to_string(params.n_needles));
  if (params.haystack == NeedleHaystack::kCorpus && params.corpus_paths.empty())
    fail(StatusCode::kInvalidArgument, "needle task: the corpus haystack needs corpus_paths");
  if (params.haystack == NeedleHaystack::kNoise && !params.corpus_paths.empty())
    fail(StatusCode::kInvalidArgument, "needle task: corpus_paths given with the noise haystack");
}

bool contains_whole_number(std::string_view text, std::string_view number) {
  for (size_t at = text.find(number); at != std::string_view::npos; at = text.find(number, at + 1)) {
    const bool digit_before = at > 0 && is_digit(text[at - 1]);
    const size_t after = at + number.size();
    const bool digit_after = after < text.size() && is_digit(text[after]);
    if (!digit_before && !digit_after) return true;
  }
  return false;
}

size_t answers_found(const NeedleTask& task, std::string_view generated) {
  if (task.answers.empty()) fail(StatusCode::kInvalidArgument, "needle scoring: the task has no answers");
  size_t found = 0;
  for (const std::string& answer : task.answers) found += contains_whole_number(generated, answer);
  return found;
}

}  // namespace

const char* needle_variant_name(NeedleVariant variant) {
  switch (variant) {
    case NeedleVariant::kSingle: return "single";
    case NeedleVariant::kMultiKey: return "multi-key";
    case NeedleVariant::kMultiValue: return "multi-value";
    case NeedleVariant::kMultiQuery: return "multi-query";
  }
  return "unknown";
}

NeedleVariant parse_needle_variant(std::string_view name) {
  for (NeedleVariant v : {NeedleVariant::kSingle, NeedleVariant::kMultiKey, NeedleVariant::kMultiValue,
                          NeedleVariant::kMultiQuery})
    if (name == needle_variant_name(v)) return v;
  fail(StatusCode::kInvalidArgument, "unknown needle variant '" + std::string(name) +
                                         "' (expected single, multi-key, multi-value or multi-query)");
}

std::string needle_prompt(const NeedleTask& task) {
  return task.context + "\n\n" + task.question + "\n\n" + task.answer_prefix;
}

std::vector<std::string> load_corpus_sentences(const std::vector<std::string>& paths) {
  if (paths.empty()) fail(StatusCode::kInvalidArgument, "corpus: no file given");
  std::vector<std::string> sentences;
  for (const std::string& path : paths) {
    const std::string text = read_text_file(path);
    bool in_note = false;  // inside a transcriber's note
    for (const std::string& p : paragraphs_of(body_lines(text))) {
      const std::string l = lower(p);
      const bool prose = is_prose(p);
      if (l.find("transcriber") != std::string::npos) {
        in_note = true;
        continue;
      }
      if (in_note && prose) continue;
      in_note = false;
      if (l.starts_with("produced by") || l.find("gutenberg") != std::string::npos ||
          l.find("http://") != std::string::npos || l.find("https://") != std::string::npos ||
          l.find("www.") != std::string::npos || !prose)
        continue;
      split_sentences(p, sentences);
    }
  }
  if (sentences.empty()) fail(StatusCode::kInvalidArgument, "corpus: no prose sentence in " + paths.front() +
                                                                (paths.size() > 1 ? " and the other files" : ""));
  return sentences;
}

NeedleTask generate_needle_task(const NeedleParams& params, const CountTokens& count_tokens) {
  validate(params, count_tokens);
  const NeedleVariant variant = params.variant;
  const int n_needles = variant == NeedleVariant::kSingle ? 1 : params.n_needles;
  const int n_keys = variant == NeedleVariant::kMultiValue ? 1 : n_needles;

  // Random choices, always drawn in this order.
  SeededDraws draws(params.seed);
  std::vector<std::string> keys;
  std::vector<uint64_t> key_ids;
  while (int(keys.size()) < n_keys) {
    const uint64_t id = draws.below(kKeyAdjectives.size() * kKeyNouns.size());
    if (std::find(key_ids.begin(), key_ids.end(), id) != key_ids.end()) continue;
    key_ids.push_back(id);
    keys.push_back(std::string(kKeyAdjectives[id / kKeyNouns.size()]) + "-" +
                   std::string(kKeyNouns[id % kKeyNouns.size()]));
  }
  std::vector<std::string> numbers;
  while (int(numbers.size()) < n_needles) {
    const std::string number = std::to_string(kNeedleNumberMin + draws.below(kNeedleNumberSpan));
    if (std::find(numbers.begin(), numbers.end(), number) == numbers.end()) numbers.push_back(number);
  }
  std::vector<Needle> needles;
  for (int i = 0; i < n_needles; ++i) {
    const double drawn = draws.unit();
    const double depth = i == 0 && params.depth ? *params.depth : drawn;
    needles.push_back({keys[size_t(n_keys == 1 ? 0 : i)], numbers[size_t(i)], depth});
  }
  const uint64_t start_draw = draws.raw();

  NeedleTask task;
  const std::string text_tail = " mentioned in the provided text";
  switch (variant) {
    case NeedleVariant::kSingle:
    case NeedleVariant::kMultiKey:
      task.question = "What is the special magic number for " + keys[0] + text_tail + "?";
      task.answer_prefix = "The special magic number for " + keys[0] + text_tail + " is";
      task.answers = {numbers[0]};
      break;
    case NeedleVariant::kMultiValue:
    case NeedleVariant::kMultiQuery:
      task.question = "What are all the special magic numbers for " + join_keys(keys) + text_tail + "?";
      task.answer_prefix = "The special magic numbers for " + join_keys(keys) + text_tail + " are";
      task.answers = numbers;
      break;
  }

  std::vector<std::string> pool;
  if (params.haystack == NeedleHaystack::kCorpus) {
    pool = load_corpus_sentences(params.corpus_paths);
  } else {
    pool.assign(kNoiseSentences.begin(), kNoiseSentences.end());
  }
  const uint64_t start = start_draw % pool.size();
  // The haystack is the sentence stream pool[start], pool[start + 1], ..., wrapping around.
  auto sentence_at = [&](int64_t i) -> std::string_view { return pool[(start + uint64_t(i)) % pool.size()]; };
  auto prefix = [&](int64_t n) {
    std::vector<std::string_view> s;
    s.reserve(size_t(n));
    for (int64_t i = 0; i < n; ++i) s.push_back(sentence_at(i));
    return s;
  };
  // Builds the task around a haystack and counts its prompt.
  auto build = [&](const std::vector<std::string_view>& haystack) {
    NeedleTask t = task;
    Layout layout = assemble(haystack, needles);
    t.context = std::move(layout.context);
    t.needle_depths = std::move(layout.depths);
    t.depth = t.needle_depths[0];
    t.prompt_tokens = count_tokens(needle_prompt(t));
    if (t.prompt_tokens < 0)
      fail(StatusCode::kInvalidArgument, "needle task: count_tokens returned " + std::to_string(t.prompt_tokens));
    return t;
  };

  const int64_t target = params.target_tokens;
  NeedleTask best = build({});
  if (best.prompt_tokens > target)
    fail(StatusCode::kInvalidArgument, "needle task: target_tokens " + std::to_string(target) +
                                           " is too small: the needles, question and answer prefix alone take " +
                                           std::to_string(best.prompt_tokens) + " tokens");

  // Largest prefix of the sentence stream whose prompt fits: grow to bracket the target, then
  // narrow the bracket (lo fits, hi does not), alternating interpolation and bisection.
  const int64_t n_cap = 8 * target + 64;
  const int64_t base_tokens = best.prompt_tokens;
  int64_t lo = 0, hi = -1;
  int64_t lo_tokens = base_tokens, hi_tokens = 0;
  for (int64_t probe = std::min<int64_t>(16, n_cap);;) {
    NeedleTask t = build(prefix(probe));
    if (t.prompt_tokens > target) {
      hi = probe;
      hi_tokens = t.prompt_tokens;
      break;
    }
    lo = probe;
    lo_tokens = t.prompt_tokens;
    best = std::move(t);
    if (probe == n_cap) break;
    // Predict the sentence count from the tokens per sentence so far, 5% beyond it.
    const double per_sentence = double(std::max<int64_t>(lo_tokens - base_tokens, 1)) / double(lo);
    const double predicted = 1.05 * double(target - base_tokens) / per_sentence + 1;
    probe = std::min(n_cap, std::max(2 * probe, int64_t(std::min(predicted, double(n_cap)))));
  }
  bool bisect = false;
  while (hi > lo + 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (!bisect) {
      const double fraction = double(target - lo_tokens) / double(std::max<int64_t>(hi_tokens - lo_tokens, 1));
      mid = std::clamp(lo + int64_t(fraction * double(hi - lo)), lo + 1, hi - 1);
    }
    const int64_t width = hi - lo;
    NeedleTask t = build(prefix(mid));
    if (t.prompt_tokens <= target) {
      lo = mid;
      lo_tokens = t.prompt_tokens;
      best = std::move(t);
    } else {
      hi = mid;
      hi_tokens = t.prompt_tokens;
    }
    // Interpolation that failed to halve the bracket is followed by one bisection.
    bisect = !bisect && 2 * (hi - lo) > width;
  }

  // Long sentences can leave a gap: skip the one that did not fit and try the next ones.
  if (best.prompt_tokens * 10 < 9 * target && hi >= 0) {
    std::vector<std::string_view> chosen = prefix(lo);
    for (int64_t i = lo + 1; i <= lo + kGreedyFillTries && best.prompt_tokens * 10 < 9 * target; ++i) {
      chosen.push_back(sentence_at(i));
      NeedleTask t = build(chosen);
      if (t.prompt_tokens <= target) {
        best = std::move(t);
      } else {
        chosen.pop_back();
      }
    }
  }
  if (best.prompt_tokens * 10 < 9 * target)
    fail(StatusCode::kInvalidArgument, "needle task: cannot fill target_tokens " + std::to_string(target) +
                                           " to 90% with whole haystack sentences (best " +
                                           std::to_string(best.prompt_tokens) + " tokens)");
  return best;
}

bool needle_exact_match(const NeedleTask& task, std::string_view generated) {
  return answers_found(task, generated) == task.answers.size();
}

double needle_recall(const NeedleTask& task, std::string_view generated) {
  return double(answers_found(task, generated)) / double(task.answers.size());
}

}  // namespace certkv::eval
