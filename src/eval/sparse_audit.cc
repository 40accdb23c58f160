#include "eval/sparse_audit.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/status.h"
#include "eval/quality.h"

namespace certkv::eval {
namespace {

constexpr int kTopkEstimated = 0;
constexpr int kTopkOracle = 1;
constexpr int kQuest = 2;
constexpr size_t kMethods = kSparseBaselineNames.size();
constexpr size_t kCurvePoints = kSparseAuditGridPoints + 1;

using Curve = std::array<double, kCurvePoints>;

std::string cell_name(const SparseAuditCell& c) {
  return "SparseAuditCell (layer " + std::to_string(c.layer) + ", head " + std::to_string(c.head) + ", step " +
         std::to_string(c.step) + ")";
}

[[noreturn]] void reject(const SparseAuditCell& c, const std::string& what) {
  fail(StatusCode::kInvalidArgument, cell_name(c) + ": " + what);
}

void check_finite(const SparseAuditCell& c, const float* x, int64_t n, const char* field) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      reject(c, std::string(field) + "[" + std::to_string(i) + "] is not finite (" + std::to_string(x[i]) + ")");
}

void check_cell(const SparseAuditCell& c, size_t n_rules) {
  if (c.layer < 0 || c.head < 0 || c.step < 0) reject(c, "layer, head and step must be >= 0");
  if (c.n_ctx < 1) reject(c, "n_ctx must be >= 1, got " + std::to_string(c.n_ctx));
  if (c.n_indexed < 0 || c.n_indexed > c.n_ctx)
    reject(c, "n_indexed must be in [0, n_ctx = " + std::to_string(c.n_ctx) + "], got " + std::to_string(c.n_indexed));
  if (c.head_dim < 1) reject(c, "head_dim must be >= 1, got " + std::to_string(c.head_dim));
  if (c.block_tokens < 1) reject(c, "block_tokens must be >= 1, got " + std::to_string(c.block_tokens));
  if (!(std::isfinite(c.scale) && c.scale > 0)) reject(c, "scale must be finite and > 0, got " + std::to_string(c.scale));
  if (c.q == nullptr) reject(c, "q is null");
  if (c.k == nullptr) reject(c, "k is null");
  if (c.estimated_logits == nullptr && c.n_indexed > 0) reject(c, "estimated_logits is null but n_indexed > 0");
  if (c.n_attended < 0 || c.n_attended > c.n_ctx)
    reject(c, "n_attended must be in [0, n_ctx = " + std::to_string(c.n_ctx) + "], got " + std::to_string(c.n_attended));
  if (c.attended == nullptr && c.n_attended > 0) reject(c, "attended is null but n_attended > 0");
  if (n_rules > 0 && c.n_indexed > 0) {
    if (c.rule_masks == nullptr) reject(c, "rule_masks is null but the audit has rules");
    for (size_t r = 0; r < n_rules; ++r)
      if (c.rule_masks[r] == nullptr) reject(c, "rule_masks[" + std::to_string(r) + "] is null");
  }

  check_finite(c, c.q, c.head_dim, "q");
  check_finite(c, c.k, c.n_ctx * c.head_dim, "k");
  if (c.n_indexed > 0) check_finite(c, c.estimated_logits, c.n_indexed, "estimated_logits");
  if (c.error_scale != nullptr)
    for (int64_t t = 0; t < c.n_indexed; ++t)
      if (!(std::isfinite(c.error_scale[t]) && c.error_scale[t] >= 0))
        reject(c, "error_scale[" + std::to_string(t) + "] must be finite and >= 0, got " +
                      std::to_string(c.error_scale[t]));

  std::vector<bool> seen(size_t(c.n_ctx), false);
  for (int64_t i = 0; i < c.n_attended; ++i) {
    const int32_t t = c.attended[i];
    if (t < 0 || t >= c.n_ctx)
      reject(c, "attended[" + std::to_string(i) + "] = " + std::to_string(t) + " is outside [0, n_ctx = " +
                    std::to_string(c.n_ctx) + ")");
    if (seen[size_t(t)]) reject(c, "attended[" + std::to_string(i) + "] = " + std::to_string(t) + " is repeated");
    seen[size_t(t)] = true;
  }
  for (int64_t t = c.n_indexed; t < c.n_ctx; ++t)
    if (!seen[size_t(t)]) reject(c, "window token " + std::to_string(t) + " is missing from attended");
}

// K_i = ceil(i * n_ctx / 200): the total token budget at grid point i.
int64_t grid_budget_tokens(int i, int64_t n_ctx) {
  return (int64_t(i) * n_ctx + kSparseAuditGridPoints - 1) / kSparseAuditGridPoints;
}

// Indexed tokens [0, n_indexed) by decreasing score, ties to the lower index.
std::vector<int64_t> rank_tokens(int64_t n_indexed, const auto& score) {
  std::vector<int64_t> order(static_cast<size_t>(n_indexed));
  std::iota(order.begin(), order.end(), int64_t(0));
  std::sort(order.begin(), order.end(), [&score](int64_t a, int64_t b) {
    return score(a) > score(b) || (score(a) == score(b) && a < b);
  });
  return order;
}

// One cell's curves for one baseline, from the order in which it adds indexed tokens, grouped in
// units (a token for top-k, a page for quest): unit j adds unit_tokens[j] tokens holding
// unit_mass[j] of the exact attention. At grid point i the baseline adds units while the tokens
// taken are below the remaining budget max(0, K_i - window), so the last unit may overshoot it.
void trace_curve(const std::vector<int64_t>& unit_tokens, const std::vector<double>& unit_mass, int64_t n_ctx,
                 int64_t window, double window_mass, Curve& recall, Curve& budget) {
  std::vector<int64_t> taken_tokens(unit_tokens.size() + 1, 0);
  std::vector<double> taken_mass(unit_mass.size() + 1, 0.0);
  for (size_t j = 0; j < unit_tokens.size(); ++j) {
    taken_tokens[j + 1] = taken_tokens[j] + unit_tokens[j];
    taken_mass[j + 1] = taken_mass[j] + unit_mass[j];
  }
  for (int i = 0; i <= kSparseAuditGridPoints; ++i) {
    const int64_t remaining = std::max<int64_t>(0, grid_budget_tokens(i, n_ctx) - window);
    const size_t m = size_t(std::lower_bound(taken_tokens.begin(), taken_tokens.end(), remaining) - taken_tokens.begin());
    recall[size_t(i)] = window_mass + taken_mass[m];
    budget[size_t(i)] = double(window + taken_tokens[m]) / double(n_ctx);
  }
}

// Linear interpolation at budget fraction f in [0, 1] of a curve of sums over `cells` cells.
double interpolate_mean(const Curve& sums, int64_t cells, double f) {
  if (cells == 0) return 0.0;
  const double h = f * kSparseAuditGridPoints;
  const int i0 = std::min(int(std::floor(h)), kSparseAuditGridPoints - 1);
  return std::lerp(sums[size_t(i0)], sums[size_t(i0) + 1], h - double(i0)) / double(cells);
}

}  // namespace

SparseAuditAccumulator::SparseAuditAccumulator(std::vector<std::string> rule_names)
    : reservoir_rng_(kSparseAuditReservoirSeed) {
  for (std::string& name : rule_names) rules_.push_back(RuleSums{std::move(name), {}, 0, {}});
}

void SparseAuditAccumulator::add(const SparseAuditCell& cell) {
  check_cell(cell, rules_.size());
  const int64_t n_ctx = cell.n_ctx;
  const int64_t n_indexed = cell.n_indexed;
  const int64_t window = n_ctx - n_indexed;
  const int64_t d = cell.head_dim;

  // True logits l_t = scale <q, k_t> and exact attention P = softmax(l), in double.
  std::vector<double> l(static_cast<size_t>(n_ctx));
  for (int64_t t = 0; t < n_ctx; ++t) {
    const float* k_t = cell.k + t * d;
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double(cell.q[c]) * double(k_t[c]);
    l[size_t(t)] = double(cell.scale) * dot;
  }
  const double l_max = *std::max_element(l.begin(), l.end());
  std::vector<double> P(static_cast<size_t>(n_ctx));
  double Z = 0;
  for (int64_t t = 0; t < n_ctx; ++t) {
    P[size_t(t)] = std::exp(l[size_t(t)] - l_max);
    Z += P[size_t(t)];
  }
  for (double& p : P) p /= Z;

  double recall = 0;
  for (int64_t i = 0; i < cell.n_attended; ++i) recall += P[size_t(cell.attended[i])];
  const double budget = double(cell.n_attended) / double(n_ctx);
  double window_mass = 0;
  for (int64_t t = n_indexed; t < n_ctx; ++t) window_mass += P[size_t(t)];

  // Estimator error e_t on the indexed prefix, and its normalization by error_scale (Theorem A.1
  // of seed 002: the centred cosine estimate is off by O(1/sqrt(D))).
  for (int64_t t = 0; t < n_indexed; ++t) {
    const double e = double(cell.estimated_logits[t]) - l[size_t(t)];
    error_sum_ += e;
    error_sq_sum_ += e * e;
    if (estimator_samples_ < kSparseAuditReservoirSize) {
      abs_error_reservoir_.push_back(std::abs(e));
    } else {
      const uint64_t j = reservoir_rng_() % uint64_t(estimator_samples_ + 1);
      if (j < uint64_t(kSparseAuditReservoirSize)) abs_error_reservoir_[size_t(j)] = std::abs(e);
    }
    ++estimator_samples_;
    if (cell.error_scale != nullptr && cell.error_scale[t] > 0) {
      const double z = e / double(cell.error_scale[t]);
      normalized_sq_d_sum_ += z * z * double(d);
      ++normalized_samples_;
    }
  }

  Curves cell_curves;
  const std::vector<int64_t> single_tokens(size_t(n_indexed), 1);
  const auto trace_topk = [&](int method, const std::vector<int64_t>& order) {
    std::vector<double> mass(order.size());
    for (size_t j = 0; j < order.size(); ++j) mass[j] = P[size_t(order[j])];
    trace_curve(single_tokens, mass, n_ctx, window, window_mass, cell_curves.recall_sum[size_t(method)],
                cell_curves.budget_sum[size_t(method)]);
  };
  trace_topk(kTopkEstimated, rank_tokens(n_indexed, [&](int64_t t) { return cell.estimated_logits[t]; }));
  trace_topk(kTopkOracle, rank_tokens(n_indexed, [&](int64_t t) { return l[size_t(t)]; }));

  // Quest: page j covers [j B, min((j + 1) B, n_indexed)); its bound on the logit of any of its
  // tokens is scale * sum_c max(q_c min_c, q_c max_c) over the channelwise min and max of its keys.
  const int64_t B = cell.block_tokens;
  const int64_t n_pages = (n_indexed + B - 1) / B;
  std::vector<double> bound(static_cast<size_t>(n_pages));
  for (int64_t j = 0; j < n_pages; ++j) {
    const int64_t begin = j * B;
    const int64_t end = std::min(begin + B, n_indexed);
    double sum = 0;
    for (int64_t c = 0; c < d; ++c) {
      float k_min = cell.k[begin * d + c];
      float k_max = k_min;
      for (int64_t t = begin + 1; t < end; ++t) {
        k_min = std::min(k_min, cell.k[t * d + c]);
        k_max = std::max(k_max, cell.k[t * d + c]);
      }
      const double q_c = cell.q[c];
      sum += std::max(q_c * double(k_min), q_c * double(k_max));
    }
    bound[size_t(j)] = double(cell.scale) * sum;
  }
  const std::vector<int64_t> page_order = rank_tokens(n_pages, [&](int64_t j) { return bound[size_t(j)]; });
  std::vector<int64_t> page_tokens(page_order.size());
  std::vector<double> page_mass(page_order.size(), 0.0);
  for (size_t r = 0; r < page_order.size(); ++r) {
    const int64_t begin = page_order[r] * B;
    const int64_t end = std::min(begin + B, n_indexed);
    page_tokens[r] = end - begin;
    for (int64_t t = begin; t < end; ++t) page_mass[r] += P[size_t(t)];
  }
  trace_curve(page_tokens, page_mass, n_ctx, window, window_mass, cell_curves.recall_sum[kQuest],
              cell_curves.budget_sum[kQuest]);

  for (size_t r = 0; r < rules_.size(); ++r) {
    // Summed in the order sparse decode lists what it attends (selected tokens, then the window),
    // so a rule that selects what the step attended gives its recall to the last bit.
    double rule_recall = 0;
    int64_t rule_tokens = window;
    for (int64_t t = 0; t < n_indexed; ++t)
      if (cell.rule_masks[r][t] != 0) {
        rule_recall += P[size_t(t)];
        ++rule_tokens;
      }
    for (int64_t t = n_indexed; t < n_ctx; ++t) rule_recall += P[size_t(t)];
    const double rule_budget = double(rule_tokens) / double(n_ctx);
    RuleSums& rule = rules_[r];
    rule.recall.push_back(rule_recall);
    rule.budget_sum += rule_budget;
    SparseRuleLayer& rl = rule.layers[cell.layer];
    rl.layer = cell.layer;
    ++rl.cells;
    rl.mean_budget += rule_budget;
    rl.mean_recall += rule_recall;
  }

  recall_.push_back(recall);
  budget_.push_back(budget);
  LayerSums& layer = layers_[cell.layer];
  layer.min_recall = layer.cells == 0 ? recall : std::min(layer.min_recall, recall);
  ++layer.cells;
  layer.budget_sum += budget;
  layer.recall_sum += recall;
  for (size_t m = 0; m < kMethods; ++m)
    for (size_t i = 0; i < kCurvePoints; ++i) {
      curves_.recall_sum[m][i] += cell_curves.recall_sum[m][i];
      curves_.budget_sum[m][i] += cell_curves.budget_sum[m][i];
      layer.curves.recall_sum[m][i] += cell_curves.recall_sum[m][i];
      layer.curves.budget_sum[m][i] += cell_curves.budget_sum[m][i];
    }
}

namespace {

std::vector<SparseBaseline> baselines_at(const auto& curves, int64_t cells, double f) {
  std::vector<SparseBaseline> out;
  for (size_t m = 0; m < kMethods; ++m)
    out.push_back({kSparseBaselineNames[m], interpolate_mean(curves.budget_sum[m], cells, f),
                   interpolate_mean(curves.recall_sum[m], cells, f)});
  return out;
}

}  // namespace

SparseAuditSummary SparseAuditAccumulator::summary() const {
  SparseAuditSummary s;
  s.cells = int64_t(recall_.size());
  if (s.cells == 0) return s;
  const double n = double(s.cells);
  s.mean_budget = std::accumulate(budget_.begin(), budget_.end(), 0.0) / n;
  s.mean_recall = std::accumulate(recall_.begin(), recall_.end(), 0.0) / n;

  std::vector<double> sorted = recall_;
  std::sort(sorted.begin(), sorted.end());
  s.recall_q01 = sorted_quantile(sorted, 0.01);
  s.recall_q10 = sorted_quantile(sorted, 0.10);
  s.recall_q50 = sorted_quantile(sorted, 0.50);
  s.min_recall = sorted.front();
  sorted = budget_;
  std::sort(sorted.begin(), sorted.end());
  s.budget_q50 = sorted_quantile(sorted, 0.50);
  s.budget_q90 = sorted_quantile(sorted, 0.90);
  s.max_budget = sorted.back();

  s.estimator_samples = estimator_samples_;
  if (estimator_samples_ > 0) {
    s.estimator_bias = error_sum_ / double(estimator_samples_);
    s.estimator_rms = std::sqrt(error_sq_sum_ / double(estimator_samples_));
    sorted = abs_error_reservoir_;
    std::sort(sorted.begin(), sorted.end());
    s.estimator_abs_q50 = sorted_quantile(sorted, 0.50);
    s.estimator_abs_q90 = sorted_quantile(sorted, 0.90);
    s.estimator_abs_q99 = sorted_quantile(sorted, 0.99);
  }
  s.normalized_samples = normalized_samples_;
  if (normalized_samples_ > 0) s.normalized_rms_sqrt_d = std::sqrt(normalized_sq_d_sum_ / double(normalized_samples_));

  s.baselines = baselines_at(curves_, s.cells, s.mean_budget);
  for (const auto& [index, sums] : layers_) {
    SparseAuditLayer layer;
    layer.layer = index;
    layer.cells = sums.cells;
    layer.mean_budget = sums.budget_sum / double(sums.cells);
    layer.mean_recall = sums.recall_sum / double(sums.cells);
    layer.min_recall = sums.min_recall;
    layer.baselines = baselines_at(sums.curves, sums.cells, layer.mean_budget);
    s.layers.push_back(layer);
  }
  for (const RuleSums& rule : rules_) {
    SparseRuleSummary r;
    r.name = rule.name;
    r.cells = int64_t(rule.recall.size());
    r.mean_budget = rule.budget_sum / double(r.cells);
    r.mean_recall = std::accumulate(rule.recall.begin(), rule.recall.end(), 0.0) / double(r.cells);
    sorted = rule.recall;
    std::sort(sorted.begin(), sorted.end());
    r.recall_q10 = sorted_quantile(sorted, 0.10);
    r.min_recall = sorted.front();
    for (const auto& [index, sums] : rule.layers) {
      SparseRuleLayer l = sums;
      l.mean_budget /= double(sums.cells);
      l.mean_recall /= double(sums.cells);
      r.layers.push_back(l);
    }
    s.rules.push_back(r);
  }
  return s;
}

double SparseAuditAccumulator::baseline_recall(const std::string& name, double f) const {
  if (!(f > 0 && f <= 1))
    fail(StatusCode::kInvalidArgument, "baseline_recall budget fraction f must be in (0, 1], got " + std::to_string(f));
  for (size_t m = 0; m < kMethods; ++m)
    if (name == kSparseBaselineNames[m]) return interpolate_mean(curves_.recall_sum[m], int64_t(recall_.size()), f);
  fail(StatusCode::kInvalidArgument,
       "baseline_recall: unknown baseline name '" + name + "' (expected topk_estimated, topk_oracle or quest)");
}

}  // namespace certkv::eval
