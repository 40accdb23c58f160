// certkv_sparse_recall: the recall and budget of sparse decode's selection on the H200 benchmark's
// KV (scripts/make_bench_kv.py: real keys and queries, the unique tokens tiled to the context),
// computed on the CPU with the same index, query rounding and Top-p as the device kernels
// (bench/cuda/decode_bench.cc's sparse cells select these sets), and the same sets widened by the
// estimator's error. No GPU needed.
//
//   certkv_sparse_recall --kv .benchkv/kv.safetensors [--shape 32x8] [--contexts 65536,131072]
//                        [--jsonl OUT] [--label TEXT]
//
// A context longer than the file's tokens tiles them (the benchmark's KV of 4,096 real tokens tiled
// 32 times at 128K); a context of the file's length (an untiled dump) reads each token once.
// --jsonl also writes one JSON object per (context, rule): label, source, shape, tokens, tiles, ctx, p,
// margin, deviations, recall_mean, recall_min, budget_mean, reach_median, reach_max.
//
// Rules, per query head (the window's 128 last tokens always attended):
//   p P            Top-p at mass P over the estimated logits: {t : l~_t >= theta_P}
//   p P +d D       the Top-p set widened by a constant margin: {t : l~_t >= theta_P - D}
//   p P +z Z       widened by Z estimator deviations of the token, exactly as sparse decode
//                  widens (index::top_p_widen with index::rabitq_logit_deviation_scale, the set
//                  the CPU path and the CUDA selection take): {t : l~_t + Z sigma_t >= theta_P},
//                  sigma_t = sm_scale ||q - c_q|| ||k_t - c_k|| / sqrt(D - 1) (docs/sparse.md)
// Recall: the exact softmax mass of the attended set; budget: attended tokens / context. Reach: the
// largest gap bucket (1/256 logit below the row's largest estimated logit, index/top_p.h's a_t) of
// any indexed token the rule selects, median and largest over the heads: how far below the
// maximum a pass must look to see every selected token.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "format/numeric.h"
#include "format/safetensors.h"
#include "index/rabitq.h"
#include "index/rotation.h"
#include "index/top_p.h"

namespace {

using namespace certkv;

constexpr int D = 128;
constexpr int64_t kWindow = 128;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "certkv_sparse_recall: %s\n", message.c_str());
  std::exit(2);
}

std::vector<int64_t> int_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

struct Rule {
  double p = 0.9;
  double margin = 0;     // constant margin in logits
  double deviations = 0;  // multiples of sigma_t
};

// One query head: the estimated and exact logits of the unique tokens, their key norms and the
// query's.
struct Head {
  std::vector<float> estimated;  // sm_scale * estimate, as the device computes it
  std::vector<double> exact;     // sm_scale * <bf16(q), k>
  std::vector<float> key_norm;   // ||k_t - c_k||
  float query_norm = 0;          // ||q - c_q||
};

struct Result {
  double recall_mean = 0, recall_min = 1, budget_mean = 0;
  int reach_median = 0, reach_max = 0;
};

// a_t of index/top_p.h.
int gap_bucket(float l_max, float l) { return index::top_p_gap_bucket(l, l_max); }

// The tiled context of `ctx` tokens: token t is unique token t % N; the indexed prefix is every
// token but the window.
Result evaluate(const std::vector<Head>& heads, int64_t ctx, const Rule& rule) {
  Result r;
  std::vector<int> reach;
  for (const Head& h : heads) {
    const int64_t n = int64_t(h.estimated.size()), n_idx = ctx - kWindow;
    std::vector<float> logits(static_cast<size_t>(n_idx));
    for (int64_t t = 0; t < n_idx; ++t) logits[size_t(t)] = h.estimated[size_t(t % n)];
    std::vector<uint8_t> mask(static_cast<size_t>(n_idx));
    const index::TopPSelection s = index::top_p_select(logits.data(), n_idx, rule.p, mask.data());
    if (rule.deviations > 0) {
      std::vector<float> norms(static_cast<size_t>(n_idx));
      for (int64_t t = 0; t < n_idx; ++t) norms[size_t(t)] = h.key_norm[size_t(t % n)];
      index::top_p_widen(logits.data(), n_idx, s.threshold,
                         index::rabitq_logit_deviation_scale(rule.deviations, 1.f / std::sqrt(float(D)),
                                                             h.query_norm, D),
                         norms.data(), 1, mask.data());
    }
    const float l_max = *std::max_element(logits.begin(), logits.end());
    int head_reach = 0;
    for (int64_t t = 0; t < n_idx; ++t)
      if (mask[size_t(t)] || (rule.margin > 0 && double(logits[size_t(t)]) >= double(s.threshold) - rule.margin))
        head_reach = std::max(head_reach, gap_bucket(l_max, logits[size_t(t)]));
    reach.push_back(head_reach);
    const double mx = *std::max_element(h.exact.begin(), h.exact.end());
    double z = 0, got = 0;
    int64_t attended = 0;
    for (int64_t t = 0; t < ctx; ++t) {
      const size_t u = size_t(t % n);
      const double pt = std::exp(h.exact[u] - mx);
      z += pt;
      const bool take = t >= n_idx || mask[size_t(t)] ||
                        (rule.margin > 0 && double(h.estimated[u]) >= double(s.threshold) - rule.margin);
      if (take) {
        got += pt;
        ++attended;
      }
    }
    r.recall_mean += got / z / double(heads.size());
    r.recall_min = std::min(r.recall_min, got / z);
    r.budget_mean += double(attended) / double(ctx) / double(heads.size());
  }
  std::sort(reach.begin(), reach.end());
  if (!reach.empty()) {
    r.reach_median = reach[reach.size() / 2];
    r.reach_max = reach.back();
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kv_path, shape = "32x8", contexts_text = "65536,131072", jsonl_path, label;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--kv") kv_path = value();
    else if (a == "--shape") shape = value();
    else if (a == "--contexts") contexts_text = value();
    else if (a == "--jsonl") jsonl_path = value();
    else if (a == "--label") label = value();
    else die("unknown flag " + a + " (usage: --kv FILE [--shape QxKV] [--contexts N,N] [--jsonl OUT] [--label TEXT])");
  }
  if (kv_path.empty()) die("--kv is required");
  const size_t x = shape.find('x');
  if (x == std::string::npos) die("--shape must be QxKV, e.g. 32x8");
  const int n_q = std::stoi(shape.substr(0, x)), n_kv = std::stoi(shape.substr(x + 1));
  const std::vector<int64_t> contexts = int_list(contexts_text);

  const auto file = format::SafetensorsFile::open(kv_path);
  const auto* k = file->find("k");
  const auto* q = file->find("q");
  if (!k || !q || k->dtype != "BF16" || q->dtype != "F32" || k->shape.size() != 3 || q->shape.size() != 3 ||
      k->shape[2] != D || q->shape[0] != k->shape[0] || q->shape[2] != D)
    die(kv_path + ": needs BF16 k [n_kv][N][128] and F32 q [n_kv][q_per_kv][128]");
  const int src_kv = int(k->shape[0]), n = int(k->shape[1]), q_per_kv = int(q->shape[1]);
  if (n_kv < 1 || n_q % n_kv != 0 || n_kv > src_kv || n_q / n_kv > q_per_kv)
    die("shape " + shape + " does not fit the KV file");
  for (int64_t ctx : contexts)
    if (ctx <= kWindow) die("every context must exceed the window of 128 tokens");
  const int group = n_q / n_kv;
  const uint16_t* kbits = reinterpret_cast<const uint16_t*>(k->data);
  const float* qsrc = reinterpret_cast<const float*>(q->data);
  const double sm_scale = 1.0 / std::sqrt(double(D));

  // The index as decode_bench builds it: centroids of the head's unique keys and of its queries,
  // a Haar rotation seeded 11 + kv head, the query's rounding seeded 77 + query head.
  std::vector<Head> heads(static_cast<size_t>(n_q));
  std::vector<index::RabitqRecord<D>> records(static_cast<size_t>(n));
  for (int h = 0; h < n_kv; ++h) {
    std::vector<float> keys(size_t(n) * D), c_k(D, 0.f), c_q(D, 0.f);
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = format::bf16_to_float(kbits[size_t(h) * size_t(n) * D + i]);
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < D; ++d) c_k[size_t(d)] += keys[size_t(t) * D + size_t(d)] / float(n);
    for (int g = 0; g < q_per_kv; ++g)
      for (int d = 0; d < D; ++d) c_q[size_t(d)] += qsrc[(size_t(h) * q_per_kv + size_t(g)) * D + size_t(d)] / float(q_per_kv);
    const index::RabitqHead head(c_q, c_k, index::Rotation(index::RotationKind::kHaar, D, 11 + uint64_t(h)));
    index::rabitq_encode_keys<D>(head, keys.data(), n, records.data());
    for (int g = 0; g < group; ++g) {
      const int hh = h * group + g;
      const float* qv = qsrc + (size_t(h) * q_per_kv + size_t(g)) * D;
      const index::RabitqQuery<D> rq = index::rabitq_quantize_query<D>(head, qv, 77 + uint64_t(hh));
      Head& out = heads[size_t(hh)];
      out.estimated.resize(size_t(n));
      index::rabitq_estimate_scores_popcount<D>(head, rq, records.data(), n, out.estimated.data());
      for (float& s : out.estimated) s *= float(sm_scale);
      out.exact.resize(size_t(n));
      out.key_norm.resize(size_t(n));
      out.query_norm = rq.norm_q_centered;
      for (int t = 0; t < n; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double(format::bf16_to_float(format::float_to_bf16(qv[d]))) * keys[size_t(t) * D + size_t(d)];
        out.exact[size_t(t)] = dot * sm_scale;
        out.key_norm[size_t(t)] = records[size_t(t)].norm_k_centered;
      }
    }
  }

  std::vector<Rule> rules;
  for (double p : {0.9, 0.95, 0.99}) rules.push_back({p, 0, 0});
  for (double m : {0.5, 1.0, 2.0}) rules.push_back({0.9, m, 0});
  for (double z : {0.5, 1.0, 1.5, 2.0, 3.0}) rules.push_back({0.9, 0, z});
  rules.push_back({0.8, 0, 2.0});
  rules.push_back({0.95, 0, 1.0});
  rules.push_back({0.95, 0, 1.5});
  rules.push_back({0.99, 0, 1.0});
  FILE* jsonl = nullptr;
  if (!jsonl_path.empty() && (jsonl = std::fopen(jsonl_path.c_str(), "w")) == nullptr) die("cannot write " + jsonl_path);
  const auto json_escape = [](const std::string& text) {
    std::string out;
    for (char c : text) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out;
  };
  const auto found = file->metadata().find("source");
  const std::string source = json_escape(found != file->metadata().end() ? found->second : "");
  label = json_escape(label);
  std::printf("shape %s, %d unique tokens tiled; window %lld\n", shape.c_str(), n, (long long)kWindow);
  std::printf("%8s %-16s %12s %12s %12s %14s\n", "ctx", "rule", "recall mean", "recall min", "budget",
              "reach p50/max");
  for (int64_t ctx : contexts) {
    for (const Rule& rule : rules) {
      char name[64];
      if (rule.margin > 0) std::snprintf(name, sizeof(name), "p %.2f +d %.1f", rule.p, rule.margin);
      else if (rule.deviations > 0) std::snprintf(name, sizeof(name), "p %.2f +z %.1f", rule.p, rule.deviations);
      else std::snprintf(name, sizeof(name), "p %.2f", rule.p);
      const Result r = evaluate(heads, ctx, rule);
      if (jsonl != nullptr)
        std::fprintf(jsonl,
                     "{\"label\": \"%s\", \"source\": \"%s\", \"shape\": \"%s\", \"tokens\": %d, \"tiles\": %.4f, \"ctx\": %lld, "
                     "\"p\": %g, \"margin\": %g, \"deviations\": %g, \"recall_mean\": %.6f, \"recall_min\": %.6f, "
                     "\"budget_mean\": %.6f, \"reach_median\": %d, \"reach_max\": %d}\n",
                     label.c_str(), source.c_str(), json_escape(shape).c_str(), n, double(ctx) / double(n), (long long)ctx,
                     rule.p, rule.margin, rule.deviations, r.recall_mean, r.recall_min, r.budget_mean, r.reach_median,
                     r.reach_max);
      std::printf("%8lld %-16s %12.3f %12.3f %12.4f %9d/%d\n", (long long)ctx, name, r.recall_mean, r.recall_min,
                  r.budget_mean, r.reach_median, r.reach_max);
    }
  }
  if (jsonl != nullptr) std::fclose(jsonl);
  return 0;
}
