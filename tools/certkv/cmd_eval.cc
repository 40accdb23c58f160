#include "cmd_eval.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "certkv/certkv.hpp"
#include "cli_json.h"
#include "options.h"
#include "kv_flags.h"

namespace certkv::tools {

namespace {

constexpr const char* kEvalUsage =
    "usage: certkv eval teacher-forced --kv SCHEME --text-file F [flags]   (certkv eval teacher-forced -h)\n"
    "       certkv eval needle --kv SCHEME [flags]                         (certkv eval needle -h)\n";

// The first n tokens of a text file (with the model's BOS), or a usage error naming the count.
std::vector<int32_t> text_tokens(const certkv::Model& model, const Flags& flags, int64_t n) {
  const std::string text = read_text_file(flags.str("text-file"), "text-file");
  std::vector<int32_t> tokens = model.tokenize(text, /*add_special=*/true, /*parse_special=*/false);
  if (int64_t(tokens.size()) < n)
    throw UsageError{"flag --tokens: " + flags.str("text-file") + " has only " +
                     std::to_string(tokens.size()) + " tokens, fewer than " + std::to_string(n)};
  tokens.resize(size_t(n));
  return tokens;
}

certkv_session_params session_params(const Flags& flags, int64_t context_tokens) {
  certkv_session_params p = certkv_session_default_params();
  p.context_tokens = context_tokens;
  p.n_threads = int32_t(flags.integer("threads", 1, 256));
  p.block_tokens = int32_t(flags.integer("block-tokens", 1, 4096));
  return p;
}

// Runs tokens through a session: positions [0, n - steps) as prefill chunks, the last `steps`
// one at a time (metered decode steps). all_logits: [n][n_vocab].
void run_tokens(certkv::Session& session, const std::vector<int32_t>& tokens, int64_t steps,
                int n_vocab, std::vector<float>* all_logits) {
  const int64_t n = int64_t(tokens.size());
  const int64_t prefix = n - steps;
  if (all_logits) all_logits->resize(size_t(n) * size_t(n_vocab));
  float* out = all_logits ? all_logits->data() : nullptr;
  if (prefix > 0) {
    const std::vector<int32_t> head(tokens.begin(), tokens.begin() + prefix);
    std::vector<float> last(static_cast<size_t>(n_vocab));
    session.prefill(head, last.data(), out);
  }
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  for (int64_t i = prefix; i < n; ++i) {
    session.decode(tokens[size_t(i)], logits.data());
    if (out) std::copy(logits.begin(), logits.end(), out + size_t(i) * size_t(n_vocab));
  }
}

int cmd_teacher_forced(int argc, char** argv) {
  Flags flags(kEvalTeacherForced);
  flags.parse(argc, argv, 3);
  if (!flags.has("kv")) throw UsageError{"flag --kv is required"};
  if (!flags.has("text-file")) throw UsageError{"flag --text-file is required"};
  const int64_t n = flags.integer("tokens", 2, int64_t(1) << 24);
  const int64_t steps = flags.integer("steps", 0, n);
  const KvFlags kv = parse_kv_flags(flags, flags.str("kv"));
  const std::string calib = flags.str("gaac-calib");

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  const std::vector<int32_t> tokens = text_tokens(model, flags, n);
  const int n_vocab = int(info.n_vocab);

  std::vector<float> ref_logits, test_logits;
  {
    certkv_session_params p = session_params(flags, n);
    certkv::Session ref(model, p);
    run_tokens(ref, tokens, 0, n_vocab, &ref_logits);
  }
  certkv_session_params p = session_params(flags, n);
  kv.apply(p);
  if (kv.gaac) p.gaac_calibration = calib.c_str();
  p.meter_planned_steps = std::max<int64_t>(steps, 1);
  certkv::Session test(model, p);
  const auto t0 = std::chrono::steady_clock::now();
  run_tokens(test, tokens, steps, n_vocab, &test_logits);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // All positions, and the decode steps alone (the positions --sparse and the meter act on).
  std::vector<certkv_position_quality> positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    check(certkv_compare_logits(&ref_logits[size_t(i) * n_vocab], &test_logits[size_t(i) * n_vocab], n_vocab,
                                &positions[size_t(i)]));
  certkv_quality_summary q, dq;
  check(certkv_quality_summarize(positions.data(), positions.size(), &q));
  check(certkv_quality_summarize(positions.data() + (n - steps), size_t(steps), &dq));
  const certkv_kv_stats kvs = test.kv_stats();
  const certkv_meter_stats ms = test.meter_stats();
  if (flags.has("json")) {
    JsonObject o;
    o.add("model", info.name)
        .add("kv", kv.kv)
        .add("tokens", n)
        .add("metered_steps", steps)
        .add("mean_kl", q.mean_kl)
        .add("max_kl", q.max_kl)
        .add("p99_kl", q.p99_kl)
        .add("top1", q.top1)
        .add("top5", q.top5)
        .add("decode_mean_kl", dq.mean_kl)
        .add("decode_max_kl", dq.max_kl)
        .add("decode_top1", dq.top1)
        .add("decode_top5", dq.top5)
        .add("kv_bytes", kvs.kv_bytes)
        .add("kv_bytes_bf16", kvs.kv_bytes_bf16)
        .add("seconds", seconds);
    if (ms.metered && steps > 0) o.add("meter", meter_json(ms));
    const certkv_sparse_stats ss = test.sparse_stats();
    if (ss.sparse) o.add("sparse", sparse_json(ss));
    if (flags.has("per-position")) {
      Json kl = Json::array(), top1 = Json::array(), top5 = Json::array();
      for (const certkv_position_quality& pq : positions) {
        kl.push_back(pq.kl);
        top1.push_back(pq.top1_agree ? 1 : 0);
        top5.push_back(pq.top5_overlap);
      }
      o.add("kl", kl).add("top1_agree", top1).add("top5_overlap", top5);
    }
    printf("%s\n", o.str().c_str());
  } else {
    printf("%s kv %s, %lld tokens: mean KL %.3g, max KL %.3g, p99 KL %.3g, top-1 %.4f, top-5 %.4f\n",
           info.name, kv.kv.c_str(), (long long)n, q.mean_kl, q.max_kl, q.p99_kl, q.top1, q.top5);
    if (ms.metered && steps > 0)
      printf("meter (tier %s, tau %g): coverage %.4f over %lld cells, max %.3g, p50 %.3g, p99 %.3g\n",
             ms.tier, ms.tau, ms.coverage, (long long)ms.cells, ms.max, ms.p50, ms.p99);
  }
  return 0;
}

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 64 || v > (1ll << 24))
      throw UsageError{"flag --lengths: '" + item + "' is not a length in [64, 2^24]"};
    out.push_back(v);
  }
  if (out.empty()) throw UsageError{"flag --lengths: no length given"};
  return out;
}

int on_piece(void* user, int32_t, const char* piece, size_t n) {
  static_cast<std::string*>(user)->append(piece, n);
  return 0;
}

int cmd_needle(int argc, char** argv) {
  Flags flags(kEvalNeedle);
  flags.parse(argc, argv, 3);
  if (!flags.has("kv")) throw UsageError{"flag --kv is required"};
  const std::vector<int64_t> lengths = parse_lengths(flags.str("lengths"));
  const int64_t samples = flags.integer("samples", 1, 100000);
  const uint64_t seed = uint64_t(flags.integer("seed", 0, INT64_MAX));
  const int64_t max_new = flags.integer("max-new", 1, 256);
  const KvFlags kv = parse_kv_flags(flags, flags.str("kv"));
  const std::string calib = flags.str("gaac-calib");
  const std::string variant = flags.str("variant");
  if (certkv_needle_check_variant(variant.c_str()) != CERTKV_OK)
    throw UsageError{std::string("flag --variant: ") + certkv_last_error()};
  const std::string haystack = flags.str("haystack");
  std::vector<std::string> corpus;
  if (haystack == "corpus") {
    // The books' folder: --corpus, else the shared folder beside the source tree this tool was
    // built from.
    const std::string dir = flags.has("corpus") ? flags.str("corpus") : std::string(CERTKV_SHARED_DIR) + "/data/corpus";
    for (const char* book : {"dickens-tale-of-two-cities.txt", "melville-moby-dick.txt", "austen-emma.txt"}) {
      corpus.push_back(dir + "/" + book);
      if (!std::filesystem::is_regular_file(corpus.back()))
        throw UsageError{"flag --corpus: no " + std::string(book) + " in " + dir + " (the books of --haystack corpus)"};
    }
  } else if (haystack != "noise") {
    throw UsageError{"flag --haystack: expected noise or corpus, got '" + haystack + "'"};
  }
  std::vector<const char*> corpus_paths;
  for (const std::string& path : corpus) corpus_paths.push_back(path.c_str());
  certkv_needle_params np = certkv_needle_default_params();
  np.variant = variant.c_str();
  np.corpus_paths = corpus_paths.data();
  np.n_corpus_paths = corpus_paths.size();

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  // Tokens of the chat wrapping around the user's text (the prompt is counted with it).
  const std::vector<certkv_chat_message> empty = {{"user", ""}};
  const int64_t template_tokens = int64_t(model.tokenize(model.chat(empty, true), true, true).size());
  struct TokenCounter {
    const certkv::Model* model;
    int64_t template_tokens;
  } counter{&model, template_tokens};
  const certkv_count_tokens_fn count = [](void* user, const char* text, size_t n_bytes) -> int64_t {
    const auto* c = static_cast<const TokenCounter*>(user);
    try {
      return int64_t(c->model->tokenize(std::string_view(text, n_bytes), false, false).size()) + c->template_tokens;
    } catch (const certkv::ApiError&) {
      return -1;
    }
  };
  Json rows = Json::array();
  int64_t total_correct = 0, total = 0;
  for (size_t li = 0; li < lengths.size(); ++li) {
    const int64_t length = lengths[li];
    if (length + max_new > info.context_length)
      throw UsageError{"flag --lengths: " + std::to_string(length) + " + " + std::to_string(max_new) +
                       " generated tokens exceed the model's context of " + std::to_string(info.context_length)};
    int64_t correct = 0;
    double recall = 0;
    certkv_meter_stats last_meter{};
    int64_t repairs = 0;
    uint64_t pagein = 0;
    for (int64_t i = 0; i < samples; ++i) {
      np.target_tokens = length;
      np.seed = seed * 1000003u + uint64_t(length) * 7919u + uint64_t(i);
      certkv_needle_task* task_raw = nullptr;
      check(certkv_needle_task_create(&np, count, &counter, &task_raw));
      const std::unique_ptr<certkv_needle_task, void (*)(certkv_needle_task*)> task(task_raw, certkv_needle_task_free);
      certkv_needle_task_info ti;
      check(certkv_needle_task_get_info(task.get(), &ti));
      const std::string user = std::string(ti.context) + "\n\n" + ti.question;
      const std::vector<certkv_chat_message> messages = {{"user", user.c_str()}};
      const std::string text = model.chat(messages, true) + ti.answer_prefix;
      const std::vector<int32_t> tokens = model.tokenize(text, true, true);
      certkv_session_params p = session_params(flags, int64_t(tokens.size()) + max_new);
      kv.apply(p);
      if (kv.gaac) p.gaac_calibration = calib.c_str();
      p.meter_planned_steps = max_new;
      certkv::Session session(model, p);
      certkv_generate_params gp = certkv_generate_default_params();
      gp.max_new_tokens = int32_t(max_new);
      std::string generated;
      certkv_generate_result r;
      // The last prompt token runs as a decode step, so that the answer's first token, like the
      // rest, comes from decode attention (what the meter, the gate and --sparse act on).
      const std::vector<int32_t> head(tokens.begin(), tokens.end() - 1);
      std::vector<float> head_logits(static_cast<size_t>(info.n_vocab));
      session.prefill(head, head_logits.data());
      check(certkv_generate(session.get(), &tokens.back(), 1, &gp, on_piece, &generated, &r));
      int ok = 0;
      double sample_recall = 0;
      check(certkv_needle_score(task.get(), generated.data(), generated.size(), &ok, &sample_recall));
      correct += ok;
      recall += sample_recall;
      last_meter = session.meter_stats();
      repairs += last_meter.repairs;
      pagein += last_meter.pagein_bytes;
      fprintf(stderr, "needle %lld tokens, sample %lld: %s (answer %s, got \"%s\")\n", (long long)length,
              (long long)i, ok ? "ok" : "miss", ti.first_answer, generated.c_str());
    }
    total_correct += correct;
    total += samples;
    JsonObject row;
    row.add("length", length)
        .add("samples", samples)
        .add("accuracy", double(correct) / double(samples))
        .add("recall", recall / double(samples));
    if (last_meter.metered) row.add("repairs", repairs).add("pagein_bytes", pagein);
    rows.push_back(row.json());
    if (!flags.has("json"))
      printf("%s kv %s%s, %lld tokens: %lld/%lld exact (%.3f)%s\n", info.name, kv.kv.c_str(),
             kv.gate ? " (gated)" : "", (long long)length, (long long)correct, (long long)samples,
             double(correct) / double(samples),
             last_meter.metered ? (", repairs " + std::to_string(repairs)).c_str() : "");
  }
  if (flags.has("json")) {
    JsonObject o;
    o.add("model", info.name)
        .add("kv", kv.kv)
        .add("gate", kv.gate)
        .add("variant", variant)
        .add("haystack", haystack)
        .add("accuracy", double(total_correct) / double(total))
        .add("lengths", rows);
    printf("%s\n", o.str().c_str());
  }
  return 0;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  if (argc < 3 || std::string(argv[2]) == "-h" || std::string(argv[2]) == "--help") {
    fputs(kEvalUsage, argc < 3 ? stderr : stdout);
    return argc < 3 ? 2 : 0;
  }
  const std::string task = argv[2];
  if (task == "teacher-forced") return cmd_teacher_forced(argc, argv);
  if (task == "needle") return cmd_needle(argc, argv);
  throw UsageError{"unknown evaluation '" + task + "' (teacher-forced, needle)"};
}

namespace {

// Both audits: the session parameters for the text's n tokens with the last `steps` decoded.
certkv_session_params audit_params(const Flags& flags, int64_t n, int64_t steps, const KvFlags& kv) {
  certkv_session_params p = session_params(flags, n);
  kv.apply(p);
  p.meter_planned_steps = steps;
  return p;
}

// Both audits: runs the tokens (prefill, then `steps` decode steps); the seconds it took.
double timed_run(certkv::Session& session, const std::vector<int32_t>& tokens, int64_t steps, int n_vocab) {
  const auto t0 = std::chrono::steady_clock::now();
  run_tokens(session, tokens, steps, n_vocab, nullptr);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// certkv audit --sparse: the sparse audit (any --kv scheme).
int sparse_audit(const Flags& flags, int64_t n, int64_t steps) {
  const KvFlags kv = parse_kv_flags(flags, flags.has("kv") ? flags.str("kv") : "bf16");
  if (kv.gate) throw UsageError{"flag --gate: the sparse audit measures the ungated cache"};
  const std::string calib = flags.str("gaac-calib");
  const int32_t dump_cells = int32_t(flags.integer("dump-cells", 0, 1 << 16));
  const uint64_t seed = uint64_t(flags.integer("seed", 0, INT64_MAX));
  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  const std::vector<int32_t> tokens = text_tokens(model, flags, n);
  certkv_session_params p = audit_params(flags, n, steps, kv);
  if (!calib.empty()) p.gaac_calibration = calib.c_str();
  certkv::Session session(model, p);
  check(certkv_session_sparse_audit_enable(session.get(), flags.has("dump") ? dump_cells : 0, seed));
  // --rules P[zZ],...: other Top-p rules audited on the same cells.
  std::vector<std::pair<double, double>> rules;
  if (flags.has("rules")) {
    std::stringstream list(flags.str("rules"));
    std::string item;
    while (std::getline(list, item, ',')) {
      const size_t z = item.find('z');
      double p = 0, deviations = 0;
      try {
        size_t used = 0;
        p = std::stod(item.substr(0, z), &used);
        if (used != (z == std::string::npos ? item.size() : z)) throw std::invalid_argument(item);
        if (z != std::string::npos) {
          deviations = std::stod(item.substr(z + 1), &used);
          if (used != item.size() - z - 1) throw std::invalid_argument(item);
        }
      } catch (const std::exception&) {
        throw UsageError{"flag --rules: '" + item + "' is not P or PzZ (for example 0.9 or 0.9z1.5)"};
      }
      int32_t index = 0;
      check(certkv_session_sparse_audit_add_rule(session.get(), p, deviations, &index));
      rules.emplace_back(p, deviations);
    }
  }
  const double seconds = timed_run(session, tokens, steps, int(info.n_vocab));
  const certkv_sparse_audit_stats a = session.sparse_audit_stats();
  const certkv_sparse_stats ss = session.sparse_stats();
  if (flags.has("dump")) check(certkv_session_sparse_audit_dump(session.get(), flags.str("dump").c_str()));
  if (flags.has("json")) {
    Json layers = Json::array();
    for (int32_t l = 0; l < info.n_layers; ++l) {
      int64_t cells = 0;
      double budget = 0, recall = 0, min_recall = 0;
      check(certkv_session_sparse_audit_layer(session.get(), l, &cells, &budget, &recall, &min_recall));
      JsonObject lo;
      lo.add("layer", int64_t(l)).add("cells", cells);
      if (cells > 0) lo.add("budget", budget).add("recall", recall).add("min_recall", min_recall);
      else lo.add("dense", true);
      layers.push_back(lo.json());
    }
    JsonObject recall, budget, estimator, baselines;
    recall.add("mean", a.mean_recall).add("q01", a.recall_q01).add("q10", a.recall_q10)
        .add("q50", a.recall_q50).add("min", a.min_recall);
    budget.add("mean", a.mean_budget).add("q50", a.budget_q50).add("q90", a.budget_q90)
        .add("max", a.max_budget).add("mean_all_layers", ss.mean_budget_all_layers);
    estimator.add("samples", a.estimator_samples).add("bias", a.estimator_bias)
        .add("rms", a.estimator_rms).add("abs_q50", a.estimator_abs_q50)
        .add("abs_q90", a.estimator_abs_q90).add("abs_q99", a.estimator_abs_q99)
        .add("normalized_rms_sqrt_d", a.normalized_rms_sqrt_d);
    auto baseline = [](double b, double r) {
      JsonObject o;
      o.add("budget", b).add("recall", r);
      return o;
    };
    baselines.add("topk_estimated", baseline(a.topk_estimated_budget, a.topk_estimated_recall))
        .add("topk_oracle", baseline(a.topk_oracle_budget, a.topk_oracle_recall))
        .add("quest", baseline(a.quest_budget, a.quest_recall));
    JsonObject o;
    o.add("model", info.name)
        .add("kv", kv.kv)
        .add("tokens", n)
        .add("steps", steps)
        .add("p", ss.p)
        .add("deviations", ss.deviations)
        .add("widened_fraction", ss.widened_fraction)
        .add("window", int64_t(ss.window_tokens))
        .add("dense_layers", int64_t(ss.dense_layers))
        .add("cells", a.cells)
        .add("budget", budget)
        .add("recall", recall)
        .add("estimator", estimator)
        .add("baselines_at_equal_budget", baselines)
        .add("layers", layers)
        .add("index_bytes", ss.index_bytes)
        .add("index_build_us_per_token",
             ss.index_appended_tokens > 0 ? 1e6 * ss.index_build_seconds / double(ss.index_appended_tokens) : 0.0)
        .add("seconds", seconds);
    if (!rules.empty()) {
      Json rule_rows = Json::array();
      for (int32_t r = 0; r < int32_t(rules.size()); ++r) {
        int64_t cells = 0;
        double budget_mean = 0, recall_mean = 0, recall_q10 = 0;
        check(certkv_session_sparse_audit_rule(session.get(), r, -1, &cells, &budget_mean, &recall_mean, &recall_q10));
        Json per_layer = Json::array();
        for (int32_t l = 0; l < info.n_layers; ++l) {
          int64_t layer_cells = 0;
          double lb = 0, lr = 0, unused = 0;
          check(certkv_session_sparse_audit_rule(session.get(), r, l, &layer_cells, &lb, &lr, &unused));
          if (layer_cells == 0) continue;
          JsonObject lo;
          lo.add("layer", int64_t(l)).add("cells", layer_cells).add("budget", lb).add("recall", lr);
          per_layer.push_back(lo.json());
        }
        JsonObject ro;
        ro.add("p", rules[size_t(r)].first)
            .add("deviations", rules[size_t(r)].second)
            .add("cells", cells)
            .add("budget", budget_mean)
            .add("recall", recall_mean)
            .add("recall_q10", recall_q10)
            .add("layers", per_layer);
        rule_rows.push_back(ro.json());
      }
      o.add("rules", rule_rows);
    }
    if (flags.has("dump")) o.add("dump", flags.str("dump"));
    printf("%s\n", o.str().c_str());
  } else {
    printf("%s kv %s, %lld tokens, %lld audited steps, sparse p %g: %lld cells, mean budget %.3f, "
           "mean recall %.4f (q10 %.4f, min %.4f); at the same budget fixed top-k %.4f, oracle "
           "top-k %.4f, Quest %.4f; estimator rms %.3g logits\n",
           info.name, kv.kv.c_str(), (long long)n, (long long)steps, ss.p, (long long)a.cells,
           a.mean_budget, a.mean_recall, a.recall_q10, a.min_recall, a.topk_estimated_recall,
           a.topk_oracle_recall, a.quest_recall, a.estimator_rms);
    for (int32_t r = 0; r < int32_t(rules.size()); ++r) {
      int64_t cells = 0;
      double budget_mean = 0, recall_mean = 0, recall_q10 = 0;
      check(certkv_session_sparse_audit_rule(session.get(), r, -1, &cells, &budget_mean, &recall_mean, &recall_q10));
      printf("  rule p %g, %g deviations: mean budget %.3f, mean recall %.4f (q10 %.4f)\n", rules[size_t(r)].first,
             rules[size_t(r)].second, budget_mean, recall_mean, recall_q10);
    }
  }
  return 0;
}

}  // namespace

int cmd_audit(int argc, char** argv) {
  Flags flags(kAudit);
  flags.parse(argc, argv, 2);
  if (!flags.has("kv") && !flags.has("sparse")) throw UsageError{"flag --kv is required"};
  if (!flags.has("text-file")) throw UsageError{"flag --text-file is required"};
  const int64_t n = flags.integer("tokens", 2, int64_t(1) << 24);
  const int64_t steps = flags.has("steps") ? flags.integer("steps", 1, n) : std::min<int64_t>(64, n - 1);
  if (flags.has("rules") && !flags.has("sparse")) throw UsageError{"flag --rules needs --sparse"};
  if (flags.has("sparse")) return sparse_audit(flags, n, steps);
  const KvFlags kv = parse_kv_flags(flags, flags.str("kv"));
  if (!kv.lossy) throw UsageError{"flag --kv " + kv.kv + ": the audit needs a lossy scheme (it has no meter)"};
  if (!kv.meter) throw UsageError{"flag --no-meter: the audit checks the meter"};
  if (kv.gate) throw UsageError{"flag --gate: the audit checks the meter of the ungated cache"};
  const int32_t dump_cells = int32_t(flags.integer("dump-cells", 0, 1 << 16));
  const uint64_t seed = uint64_t(flags.integer("seed", 0, INT64_MAX));

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  const std::vector<int32_t> tokens = text_tokens(model, flags, n);
  certkv::Session session(model, audit_params(flags, n, steps, kv));
  check(certkv_session_audit_enable(session.get(), flags.has("dump") ? dump_cells : 0, seed));
  const double seconds = timed_run(session, tokens, steps, int(info.n_vocab));
  const certkv_audit_stats a = session.audit_stats();
  const certkv_meter_stats ms = session.meter_stats();
  if (flags.has("dump")) check(certkv_session_audit_dump(session.get(), flags.str("dump").c_str()));
  if (flags.has("json")) {
    Json layers = Json::array();
    for (int32_t l = 0; l < info.n_layers; ++l) {
      int64_t cells = 0, violations = 0;
      double coverage = 0;
      check(certkv_session_audit_layer(session.get(), l, &cells, &violations, &coverage));
      JsonObject lo;
      lo.add("layer", int64_t(l)).add("cells", cells).add("violations", violations).add("coverage", coverage);
      layers.push_back(lo.json());
    }
    JsonObject tight;
    tight.add("q01", a.tightness_q01).add("q10", a.tightness_q10).add("q50", a.tightness_q50)
        .add("q90", a.tightness_q90).add("q99", a.tightness_q99);
    JsonObject o;
    o.add("model", info.name).add("kv", kv.kv);
    if (!kv.witness_label().empty()) o.add("witness", kv.witness_label());
    o.add("tokens", n)
        .add("steps", steps)
        .add("tier", ms.tier)
        .add("tau", ms.tau)
        .add("delta_loc", ms.delta_loc)
        .add("cells", a.cells)
        .add("violations", a.violations)
        .add("coverage", a.coverage)
        .add("max_meter", a.max_meter)
        .add("max_tv", a.max_tv)
        .add("worst_margin", a.worst_margin)
        .add("tightness", tight)
        .add("layers", layers)
        .add("seconds", seconds);
    if (flags.has("dump")) o.add("dump", flags.str("dump"));
    printf("%s\n", o.str().c_str());
  } else {
    printf("%s kv %s, %lld tokens, %lld audited steps: %lld cells, %lld violations, coverage at tau %g "
           "%.4f, max meter %.3g, max TV %.3g, tightness median %.3g (q10 %.3g, q90 %.3g)\n",
           info.name, kv.kv.c_str(), (long long)n, (long long)steps, (long long)a.cells,
           (long long)a.violations, ms.tau, a.coverage, a.max_meter, a.max_tv, a.tightness_q50,
           a.tightness_q10, a.tightness_q90);
  }
  return a.violations == 0 ? 0 : 1;
}

}  // namespace certkv::tools
