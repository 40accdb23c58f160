#include "eval/sparse_audit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "eval/quality.h"

namespace certkv::eval {
namespace {

// Owns the arrays a SparseAuditCell points into.
struct CellData {
  int layer = 0;
  int head = 0;
  int64_t step = 0;
  int64_t n_ctx = 0;
  int64_t n_indexed = 0;
  int head_dim = 0;
  float scale = 1;
  int block_tokens = 16;
  std::vector<float> q;                 // [head_dim]
  std::vector<float> k;                 // [n_ctx][head_dim]
  std::vector<float> estimated;         // [n_indexed]; empty means null
  std::vector<float> error_scale;       // [n_indexed]; empty means null
  std::vector<int32_t> attended;

  int64_t window() const { return n_ctx - n_indexed; }

  SparseAuditCell view() const {
    SparseAuditCell c;
    c.layer = layer;
    c.head = head;
    c.step = step;
    c.n_ctx = n_ctx;
    c.n_indexed = n_indexed;
    c.head_dim = head_dim;
    c.scale = scale;
    c.block_tokens = block_tokens;
    c.q = q.data();
    c.k = k.data();
    c.estimated_logits = estimated.empty() ? nullptr : estimated.data();
    c.error_scale = error_scale.empty() ? nullptr : error_scale.data();
    c.attended = attended.empty() ? nullptr : attended.data();
    c.n_attended = int64_t(attended.size());
    return c;
  }
};

// The test's own reference: true logits and exact attention, in double, from the float inputs.
std::vector<double> true_logits(const CellData& c) {
  std::vector<double> l(size_t(c.n_ctx));
  for (int64_t t = 0; t < c.n_ctx; ++t) {
    double dot = 0;
    for (int ch = 0; ch < c.head_dim; ++ch) dot += double(c.q[size_t(ch)]) * double(c.k[size_t(t * c.head_dim + ch)]);
    l[size_t(t)] = double(c.scale) * dot;
  }
  return l;
}

std::vector<double> exact_attention(const CellData& c) {
  const std::vector<double> l = true_logits(c);
  const double m = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double z = 0;
  for (size_t t = 0; t < l.size(); ++t) z += p[t] = std::exp(l[t] - m);
  for (double& x : p) x /= z;
  return p;
}

double mass_of(const std::vector<double>& P, const std::vector<bool>& in_set) {
  double s = 0;
  for (size_t t = 0; t < P.size(); ++t)
    if (in_set[t]) s += P[t];
  return s;
}

// Smallest K with 200 K >= i n_ctx.
int64_t budget_tokens(int i, int64_t n_ctx) {
  int64_t K = 0;
  while (200 * K < int64_t(i) * n_ctx) ++K;
  return K;
}

// The first grid point whose remaining budget K_i - window equals r.
int grid_point_for_remaining(int64_t n_ctx, int64_t window, int64_t r) {
  for (int i = 1; i <= 200; ++i)
    if (budget_tokens(i, n_ctx) - window == r) return i;
  ADD_FAILURE() << "no grid point leaves " << r << " tokens after the window";
  return 0;
}

double at_grid(int i) { return double(i) / 200.0; }

// Reference recall curves (grid points 0..200) of the baselines, written independently of the
// library: at every grid point build the selected set, then sum its exact attention.
std::vector<double> recall_curve(const CellData& c, const std::vector<double>& P,
                                 const std::vector<std::vector<int64_t>>& units) {
  std::vector<double> curve;
  for (int i = 0; i <= 200; ++i) {
    const int64_t remaining = std::max<int64_t>(0, budget_tokens(i, c.n_ctx) - c.window());
    std::vector<bool> in_set(size_t(c.n_ctx), false);
    for (int64_t t = c.n_indexed; t < c.n_ctx; ++t) in_set[size_t(t)] = true;
    int64_t taken = 0;
    for (size_t j = 0; j < units.size() && taken < remaining; ++j) {
      for (int64_t t : units[j]) in_set[size_t(t)] = true;
      taken += int64_t(units[j].size());
    }
    curve.push_back(mass_of(P, in_set));
  }
  return curve;
}

std::vector<double> reference_topk_curve(const CellData& c, const std::vector<double>& P,
                                         const std::vector<double>& score) {
  std::vector<int64_t> order(size_t(c.n_indexed));
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[size_t(a)] > score[size_t(b)]; });
  std::vector<std::vector<int64_t>> units;
  for (int64_t t : order) units.push_back({t});
  return recall_curve(c, P, units);
}

std::vector<double> reference_quest_curve(const CellData& c, const std::vector<double>& P) {
  std::vector<std::vector<int64_t>> pages;
  for (int64_t begin = 0; begin < c.n_indexed; begin += c.block_tokens) {
    pages.emplace_back();
    for (int64_t t = begin; t < std::min(begin + c.block_tokens, c.n_indexed); ++t) pages.back().push_back(t);
  }
  std::vector<double> bound;
  for (const std::vector<int64_t>& page : pages) {
    double b = 0;
    for (int ch = 0; ch < c.head_dim; ++ch) {
      double lo = std::numeric_limits<double>::infinity();
      double hi = -lo;
      for (int64_t t : page) {
        lo = std::min(lo, double(c.k[size_t(t * c.head_dim + ch)]));
        hi = std::max(hi, double(c.k[size_t(t * c.head_dim + ch)]));
      }
      const double qc = c.q[size_t(ch)];
      b += qc >= 0 ? qc * hi : qc * lo;
    }
    bound.push_back(b);
  }
  std::vector<size_t> order(pages.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bound[a] > bound[b]; });
  std::vector<std::vector<int64_t>> units;
  for (size_t j : order) units.push_back(pages[j]);
  return recall_curve(c, P, units);
}

// Random keys and query with a few heavy tokens; estimated = true logit + Gaussian noise; the
// attended set is the window plus every indexed token whose estimate beats the mean estimate.
CellData random_cell(std::mt19937& rng, int64_t n_ctx, int64_t window, int head_dim, int block_tokens,
                     double noise_logits) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  CellData c;
  c.n_ctx = n_ctx;
  c.n_indexed = n_ctx - std::min(n_ctx, window);
  c.head_dim = head_dim;
  c.scale = 1.0f / std::sqrt(float(head_dim));
  c.block_tokens = block_tokens;
  c.q.resize(size_t(head_dim));
  for (float& x : c.q) x = 2.0f * normal(rng);
  c.k.resize(size_t(n_ctx * head_dim));
  for (float& x : c.k) x = normal(rng);
  for (int64_t t = 0; t < n_ctx; t += 37)  // heavy tokens: keys aligned with q
    for (int ch = 0; ch < head_dim; ++ch) c.k[size_t(t * head_dim + ch)] += 0.1f * c.q[size_t(ch)];
  const std::vector<double> l = true_logits(c);
  std::normal_distribution<double> noise(0.0, noise_logits);
  double mean = 0;
  for (int64_t t = 0; t < c.n_indexed; ++t) {
    c.estimated.push_back(float(l[size_t(t)] + noise(rng)));
    mean += c.estimated.back() / double(c.n_indexed);
  }
  for (int64_t t = 0; t < c.n_ctx; ++t)
    if (t >= c.n_indexed || c.estimated[size_t(t)] > mean) c.attended.push_back(int32_t(t));
  return c;
}

TEST(SparseAudit, EmptySummary) {
  const SparseAuditAccumulator acc;
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 0);
  EXPECT_EQ(s.mean_recall, 0.0);
  EXPECT_EQ(s.estimator_samples, 0);
  EXPECT_TRUE(s.baselines.empty());
  EXPECT_TRUE(s.layers.empty());
  EXPECT_EQ(acc.baseline_recall("quest", 0.5), 0.0);
}

// Logits (0, ln 2, ln 3, ln 4): P = (0.1, 0.2, 0.3, 0.4). Tokens 0..2 indexed, token 3 the window.
CellData four_token_cell() {
  CellData c;
  c.n_ctx = 4;
  c.n_indexed = 3;
  c.head_dim = 2;
  c.scale = 1;
  c.block_tokens = 2;  // pages {0, 1} and {2}
  c.q = {1, 0};
  for (int t = 0; t < 4; ++t) {
    c.k.push_back(float(std::log(t + 1.0)));
    c.k.push_back(-3);  // meets q_1 = 0: changes neither the logits nor the page bounds
  }
  c.estimated = {5, 0, 0};
  c.attended = {3, 1};
  return c;
}

TEST(SparseAudit, HandComputedFourTokenCell) {
  const CellData c = four_token_cell();
  const std::vector<double> P = exact_attention(c);
  for (int t = 0; t < 4; ++t) ASSERT_NEAR(P[size_t(t)], 0.1 * (t + 1), 1e-7);
  SparseAuditAccumulator acc;
  acc.add(c.view());
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 1);
  EXPECT_EQ(s.mean_budget, 0.5);
  EXPECT_NEAR(s.mean_recall, P[1] + P[3], 1e-15);
  EXPECT_NEAR(s.min_recall, P[1] + P[3], 1e-15);
  EXPECT_EQ(s.max_budget, 0.5);

  // n_ctx = 4: K = 1 at f = 0.25 (the window alone), 2 at f = 0.5, 3 at f = 0.75.
  EXPECT_NEAR(acc.baseline_recall("topk_estimated", 0.25), P[3], 1e-15);
  EXPECT_NEAR(acc.baseline_recall("topk_estimated", 0.5), P[0] + P[3], 1e-15);       // estimate 5 wins
  EXPECT_NEAR(acc.baseline_recall("topk_estimated", 0.75), P[0] + P[1] + P[3], 1e-15);  // tie 0 = 0: lower index
  EXPECT_NEAR(acc.baseline_recall("topk_oracle", 0.5), P[2] + P[3], 1e-15);
  EXPECT_NEAR(acc.baseline_recall("topk_oracle", 0.75), P[1] + P[2] + P[3], 1e-15);
  // Quest bounds: page {0, 1} ln 2, page {2} ln 3. One token of budget takes page {2}; two tokens
  // take page {2} (1 < 2) and then page {0, 1}, overshooting to every token.
  EXPECT_NEAR(acc.baseline_recall("quest", 0.25), P[3], 1e-15);
  EXPECT_NEAR(acc.baseline_recall("quest", 0.5), P[2] + P[3], 1e-15);
  EXPECT_NEAR(acc.baseline_recall("quest", 0.75), 1.0, 1e-15);

  ASSERT_EQ(s.baselines.size(), 3u);
  EXPECT_EQ(s.baselines[0].name, "topk_estimated");
  EXPECT_EQ(s.baselines[1].name, "topk_oracle");
  EXPECT_EQ(s.baselines[2].name, "quest");
  for (const SparseBaseline& b : s.baselines) EXPECT_DOUBLE_EQ(b.mean_budget, 0.5) << b.name;
  EXPECT_NEAR(s.baselines[0].mean_recall, P[0] + P[3], 1e-15);
  EXPECT_NEAR(s.baselines[1].mean_recall, P[2] + P[3], 1e-15);
  EXPECT_NEAR(s.baselines[2].mean_recall, P[2] + P[3], 1e-15);

  const std::vector<double> l = true_logits(c);
  EXPECT_EQ(s.estimator_samples, 3);
  EXPECT_NEAR(s.estimator_bias, (5 - l[0] - l[1] - l[2]) / 3, 1e-15);
  EXPECT_EQ(s.normalized_samples, 0);
  EXPECT_EQ(s.normalized_rms_sqrt_d, 0.0);
}

// Rules: each mask plus the window, set beside exact attention, per cell and per layer; a rule
// that selects what the cell attended gives the cell's own figures.
TEST(SparseAudit, RulesAreTheirMasksPlusTheWindow) {
  CellData c = four_token_cell();  // P = (0.1, 0.2, 0.3, 0.4); token 3 the window
  const std::vector<double> P = exact_attention(c);
  SparseAuditAccumulator acc({"same", "none", "all"});
  const std::vector<uint8_t> same = {0, 1, 0}, none = {0, 0, 0}, all = {1, 1, 1};
  const uint8_t* masks[3] = {same.data(), none.data(), all.data()};
  SparseAuditCell cell = c.view();
  cell.rule_masks = masks;
  acc.add(cell);
  c.layer = 5;  // a second cell, in another layer: attends token 2
  c.attended = {3, 2};
  const std::vector<uint8_t> same2 = {0, 0, 1};
  const uint8_t* masks2[3] = {same2.data(), none.data(), all.data()};
  cell = c.view();
  cell.rule_masks = masks2;
  acc.add(cell);
  const SparseAuditSummary s = acc.summary();
  ASSERT_EQ(s.rules.size(), 3u);
  EXPECT_EQ(s.rules[0].name, "same");
  EXPECT_EQ(s.rules[0].cells, 2);
  EXPECT_EQ(s.rules[0].mean_budget, s.mean_budget);
  EXPECT_EQ(s.rules[0].mean_recall, s.mean_recall);
  EXPECT_EQ(s.rules[0].min_recall, s.min_recall);
  EXPECT_EQ(s.rules[0].recall_q10, s.recall_q10);
  EXPECT_EQ(s.rules[1].mean_budget, 0.25);
  EXPECT_NEAR(s.rules[1].mean_recall, P[3], 1e-15);
  EXPECT_EQ(s.rules[2].mean_budget, 1.0);
  EXPECT_NEAR(s.rules[2].mean_recall, 1.0, 1e-15);
  ASSERT_EQ(s.rules[0].layers.size(), 2u);
  EXPECT_EQ(s.rules[0].layers[0].layer, 0);
  EXPECT_EQ(s.rules[0].layers[1].layer, 5);
  EXPECT_EQ(s.rules[0].layers[1].cells, 1);
  EXPECT_NEAR(s.rules[0].layers[0].mean_recall, P[1] + P[3], 1e-15);
  EXPECT_NEAR(s.rules[0].layers[1].mean_recall, P[2] + P[3], 1e-15);
  EXPECT_EQ(s.rules[0].layers[1].mean_budget, 0.5);
  // A cell without its masks is refused and changes nothing.
  try {
    acc.add(c.view());
    ADD_FAILURE() << "accepted a cell without rule masks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rule_masks"), std::string::npos) << e.what();
  }
  const uint8_t* missing[3] = {same2.data(), nullptr, all.data()};
  cell = c.view();
  cell.rule_masks = missing;
  EXPECT_THROW(acc.add(cell), Error);
  EXPECT_EQ(acc.summary().cells, 2);
  EXPECT_EQ(acc.summary().rules[0].cells, 2);
}

TEST(SparseAudit, AttendingEveryTokenGivesRecallOne) {
  std::mt19937 rng(7);
  SparseAuditAccumulator acc;
  for (int64_t n_ctx : {1, 17, 129, 501}) {
    CellData c = random_cell(rng, n_ctx, 5, 64, 16, 0.5);
    c.attended.resize(size_t(n_ctx));
    std::iota(c.attended.rbegin(), c.attended.rend(), 0);  // every token, in reverse order
    acc.add(c.view());
  }
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 4);
  EXPECT_NEAR(s.min_recall, 1.0, 1e-12);
  EXPECT_NEAR(s.mean_recall, 1.0, 1e-12);
  EXPECT_EQ(s.mean_budget, 1.0);
  EXPECT_EQ(s.budget_q50, 1.0);
  EXPECT_EQ(s.max_budget, 1.0);
  for (const SparseBaseline& b : s.baselines) {
    EXPECT_NEAR(b.mean_recall, 1.0, 1e-12) << b.name;
    EXPECT_EQ(b.mean_budget, 1.0) << b.name;
  }
}

TEST(SparseAudit, OracleDominatesEstimatedAndCurvesAreMonotone) {
  std::mt19937 rng(11);
  SparseAuditAccumulator acc;
  int cells = 0;
  for (int64_t n_ctx : {129, 501})
    for (int block_tokens : {3, 16, 17})
      for (int64_t window : {0, 4, 33}) {
        CellData c = random_cell(rng, n_ctx, window, 64, block_tokens, 1.5);
        c.layer = cells % 3;
        c.step = cells++;
        acc.add(c.view());
      }
  bool estimated_loses_somewhere = false;
  double previous[3] = {0, 0, 0};
  for (int i = 1; i <= 200; ++i) {
    const double estimated = acc.baseline_recall("topk_estimated", at_grid(i));
    const double oracle = acc.baseline_recall("topk_oracle", at_grid(i));
    // The oracle's top-r set holds the largest mass of any r indexed tokens; only the order of
    // summation separates equal sets.
    EXPECT_GE(oracle, estimated - 1e-12) << "grid point " << i;
    estimated_loses_somewhere |= oracle > estimated + 1e-3;
    int m = 0;
    for (const char* name : kSparseBaselineNames) {
      const double r = acc.baseline_recall(name, at_grid(i));
      EXPECT_GE(r, previous[m]) << name << " decreases at grid point " << i;
      previous[m++] = r;
    }
  }
  EXPECT_TRUE(estimated_loses_somewhere) << "the noise should cost the estimated ranking some recall";
  for (const char* name : kSparseBaselineNames) EXPECT_NEAR(acc.baseline_recall(name, 1.0), 1.0, 1e-12) << name;
  // At 0.5% of the budget the window dominates: the recall is far from 1.
  EXPECT_LT(acc.baseline_recall("topk_oracle", 0.005), 0.9);
}

TEST(SparseAudit, ExactEstimatesMakeTopkEstimatedEqualOracle) {
  // Integer keys and query with scale 1/4: every logit is exact in float, and many tie.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> small(-2, 2);
  SparseAuditAccumulator acc;
  for (int64_t n_ctx : {129, 501})
    for (int head_dim : {32, 96}) {
      CellData c;
      c.n_ctx = n_ctx;
      c.n_indexed = n_ctx - 9;
      c.head_dim = head_dim;
      c.scale = 0.25f;
      c.block_tokens = 17;
      for (int ch = 0; ch < head_dim; ++ch) c.q.push_back(float(small(rng)));
      for (int64_t x = 0; x < n_ctx * head_dim; ++x) c.k.push_back(float(small(rng)));
      const std::vector<double> l = true_logits(c);
      for (int64_t t = 0; t < c.n_indexed; ++t) {
        c.estimated.push_back(float(l[size_t(t)]));
        ASSERT_EQ(double(c.estimated.back()), l[size_t(t)]);
      }
      EXPECT_LT(std::set<float>(c.estimated.begin(), c.estimated.end()).size(), size_t(c.n_indexed)) << "no ties";
      for (int64_t t = 0; t < n_ctx; t += 2) c.attended.push_back(int32_t(t));
      for (int64_t t = c.n_indexed | 1; t < n_ctx; t += 2) c.attended.push_back(int32_t(t));
      acc.add(c.view());
    }
  for (int i = 1; i <= 200; ++i)
    EXPECT_EQ(acc.baseline_recall("topk_estimated", at_grid(i)), acc.baseline_recall("topk_oracle", at_grid(i)))
        << "grid point " << i;
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.baselines[0].mean_recall, s.baselines[1].mean_recall);
  EXPECT_EQ(s.baselines[0].mean_budget, s.baselines[1].mean_budget);
  EXPECT_EQ(s.estimator_bias, 0.0);
  EXPECT_EQ(s.estimator_rms, 0.0);
  EXPECT_EQ(s.estimator_abs_q99, 0.0);
}

TEST(SparseAudit, QuestOnConstantPagesTakesTheDominantPageFirst) {
  // Pages of 16 identical keys: min = max, so a page's bound is exactly its logit. Page 3 is
  // dominant; page 5 has the largest keys but points against q (a bound built on |q| |k| would
  // put it first); page 7 is a partial page of 5 tokens.
  const int d = 32;
  const int B = 16;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> small(-2, 2);
  CellData c;
  c.n_indexed = 7 * B + 5;
  c.n_ctx = c.n_indexed + 12;
  c.head_dim = d;
  c.scale = 0.125f;
  c.block_tokens = B;
  for (int ch = 0; ch < d; ++ch) c.q.push_back(float(ch % 3 == 0 ? 3 : (ch % 3 == 1 ? -2 : 1)));
  const int64_t n_pages = 8;
  std::vector<std::vector<float>> page_key(n_pages, std::vector<float>(d));
  for (int64_t j = 0; j < n_pages; ++j)
    for (int ch = 0; ch < d; ++ch) {
      const float sign_q = c.q[size_t(ch)] > 0 ? 1.0f : -1.0f;
      page_key[size_t(j)][size_t(ch)] = j == 3 ? 2 * sign_q : (j == 5 ? -8 * sign_q : float(small(rng)));
    }
  for (int64_t t = 0; t < c.n_ctx; ++t)
    for (int ch = 0; ch < d; ++ch)
      c.k.push_back(t < c.n_indexed ? page_key[size_t(t / B)][size_t(ch)] : float(small(rng)));
  const std::vector<double> l = true_logits(c);
  for (int64_t t = 0; t < c.n_indexed; ++t) c.estimated.push_back(float(l[size_t(t)]));
  for (int64_t t = 3 * B; t < c.n_ctx; ++t)
    if (t >= c.n_indexed || t < 4 * B) c.attended.push_back(int32_t(t));

  // The test's own page order: by exact page logit.
  std::vector<double> page_logit(n_pages);
  for (int64_t j = 0; j < n_pages; ++j) page_logit[size_t(j)] = l[size_t(j * B)];
  std::vector<int64_t> order(n_pages);
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return page_logit[size_t(a)] > page_logit[size_t(b)]; });
  ASSERT_EQ(order[0], 3);
  ASSERT_EQ(order[7], 5);
  ASSERT_GT(page_logit[3], page_logit[size_t(order[1])] + 5.0) << "page 3 should dominate";

  const std::vector<double> P = exact_attention(c);
  auto page_mass = [&](int64_t j) {
    double s = 0;
    for (int64_t t = j * B; t < std::min((j + 1) * B, c.n_indexed); ++t) s += P[size_t(t)];
    return s;
  };
  double window_mass = 0;
  for (int64_t t = c.n_indexed; t < c.n_ctx; ++t) window_mass += P[size_t(t)];

  SparseAuditAccumulator acc;
  acc.add(c.view());
  const int64_t w = c.window();
  // One token of budget beyond the window already takes the whole dominant page.
  for (int64_t r : {1, 8, 16})
    EXPECT_NEAR(acc.baseline_recall("quest", at_grid(grid_point_for_remaining(c.n_ctx, w, r))), window_mass + page_mass(3),
                1e-12)
        << "remaining " << r;
  EXPECT_NEAR(acc.baseline_recall("quest", at_grid(grid_point_for_remaining(c.n_ctx, w, 17))),
              window_mass + page_mass(3) + page_mass(order[1]), 1e-12);
  // With exact estimates and a dominant page, the sparse step, both top-k baselines and quest agree
  // at 16 tokens beyond the window.
  const double at_16 = at_grid(grid_point_for_remaining(c.n_ctx, w, 16));
  EXPECT_NEAR(acc.baseline_recall("topk_oracle", at_16), window_mass + page_mass(3), 1e-12);
  EXPECT_NEAR(acc.summary().mean_recall, window_mass + page_mass(3), 1e-12);
  EXPECT_GT(window_mass + page_mass(3), 0.99);
}

TEST(SparseAudit, EstimatorStatsMatchKnownOffsets) {
  // Exact logits (integers times 1/4) plus offsets that are multiples of 1/8: every estimate is
  // exact in float, so e_t is exactly the offset.
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> small(-3, 3);
  SparseAuditAccumulator acc;
  std::vector<double> offsets;
  double z2d_sum = 0;
  int64_t z_count = 0;
  int cell_index = 0;
  for (int head_dim : {32, 128}) {
    CellData c;
    c.n_ctx = 501;
    c.n_indexed = 480;
    c.head_dim = head_dim;
    c.scale = 0.25f;
    c.block_tokens = 16;
    c.step = cell_index;
    for (int ch = 0; ch < head_dim; ++ch) c.q.push_back(float(small(rng)));
    for (int64_t x = 0; x < c.n_ctx * head_dim; ++x) c.k.push_back(float(small(rng)));
    const std::vector<double> l = true_logits(c);
    for (int64_t t = 0; t < c.n_indexed; ++t) {
      const double o = double((t * 7 + cell_index * 3) % 11 - 3) * 0.125;
      c.estimated.push_back(float(l[size_t(t)] + o));
      ASSERT_EQ(double(c.estimated.back()) - l[size_t(t)], o);
      offsets.push_back(o);
      const float es = t % 3 == 0 ? 0.0f : 0.5f;  // zero scale: left out of the normalized error
      c.error_scale.push_back(es);
      if (es > 0) {
        z2d_sum += (o / es) * (o / es) * head_dim;
        ++z_count;
      }
    }
    for (int64_t t = c.n_indexed; t < c.n_ctx; ++t) c.attended.push_back(int32_t(t));
    acc.add(c.view());
    ++cell_index;
  }
  double sum = 0, sq = 0;
  std::vector<double> abs_offsets;
  for (double o : offsets) {
    sum += o;
    sq += o * o;
    abs_offsets.push_back(std::abs(o));
  }
  std::sort(abs_offsets.begin(), abs_offsets.end());
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.estimator_samples, 960);
  EXPECT_DOUBLE_EQ(s.estimator_bias, sum / 960);
  EXPECT_DOUBLE_EQ(s.estimator_rms, std::sqrt(sq / 960));
  EXPECT_DOUBLE_EQ(s.estimator_abs_q50, sorted_quantile(abs_offsets, 0.50));
  EXPECT_DOUBLE_EQ(s.estimator_abs_q90, sorted_quantile(abs_offsets, 0.90));
  EXPECT_DOUBLE_EQ(s.estimator_abs_q99, sorted_quantile(abs_offsets, 0.99));
  EXPECT_NE(s.estimator_abs_q50, s.estimator_abs_q90);
  EXPECT_EQ(s.normalized_samples, z_count);
  EXPECT_EQ(z_count, 640);
  EXPECT_DOUBLE_EQ(s.normalized_rms_sqrt_d, std::sqrt(z2d_sum / double(z_count)));
}

TEST(SparseAudit, EstimatorQuantilesFromReservoirBeyondCapacity) {
  // Three cells of 100000 indexed tokens, all true logits 0; errors of cell j spread uniformly
  // over [j, j + 1). Keeping only the first 2^17 errors would put the median near 0.6, not 1.5.
  const int64_t n = 100000;
  SparseAuditAccumulator acc;
  double sum = 0;
  for (int j = 0; j < 3; ++j) {
    CellData c;
    c.n_ctx = n;
    c.n_indexed = n;
    c.head_dim = 1;
    c.scale = 1;
    c.block_tokens = 16;
    c.q = {1};
    c.k.assign(size_t(n), 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      c.estimated.push_back(float(j + double((t * 7919) % n) / double(n)));
      sum += c.estimated.back();
    }
    c.attended = {0};
    acc.add(c.view());
  }
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.estimator_samples, 3 * n);
  EXPECT_NEAR(s.estimator_bias, sum / double(3 * n), 1e-12);
  // Sampling spread with 2^17 values: about 0.004 at the median, 0.002 at q90, 0.0008 at q99.
  EXPECT_NEAR(s.estimator_abs_q50, 1.5, 0.02);
  EXPECT_NEAR(s.estimator_abs_q90, 2.7, 0.01);
  EXPECT_NEAR(s.estimator_abs_q99, 2.97, 0.005);
}

TEST(SparseAudit, AllWindowCellHasRecallOneForEveryBaseline) {
  std::mt19937 rng(2);
  SparseAuditAccumulator acc;
  for (int64_t n_ctx : {1, 17}) {
    CellData c = random_cell(rng, n_ctx, n_ctx, 32, 3, 0.5);
    ASSERT_EQ(c.n_indexed, 0);
    ASSERT_TRUE(c.estimated.empty());  // estimated_logits is null
    acc.add(c.view());
  }
  for (double f : {0.005, 0.3, 1.0})
    for (const char* name : kSparseBaselineNames) EXPECT_NEAR(acc.baseline_recall(name, f), 1.0, 1e-12) << name << " f " << f;
  const SparseAuditSummary s = acc.summary();
  EXPECT_NEAR(s.mean_recall, 1.0, 1e-12);
  EXPECT_EQ(s.mean_budget, 1.0);
  for (const SparseBaseline& b : s.baselines) {
    EXPECT_NEAR(b.mean_recall, 1.0, 1e-12) << b.name;
    EXPECT_EQ(b.mean_budget, 1.0) << b.name;
  }
  EXPECT_EQ(s.estimator_samples, 0);
  EXPECT_EQ(s.estimator_rms, 0.0);
}

TEST(SparseAudit, RaggedSizesMatchReference) {
  std::mt19937 rng(17);
  const int head_dims[] = {32, 64, 96, 128, 256};
  int cell_index = 0;
  for (int64_t n_ctx : {1, 3, 17, 129, 501})
    for (int block_tokens : {1, 3, 16, 17})
      for (int64_t window : {int64_t(0), int64_t(3), n_ctx}) {
        const CellData c = random_cell(rng, n_ctx, window, head_dims[cell_index++ % 5], block_tokens, 1.0);
        SCOPED_TRACE("n_ctx " + std::to_string(n_ctx) + ", block_tokens " + std::to_string(block_tokens) +
                     ", window " + std::to_string(c.window()) + ", head_dim " + std::to_string(c.head_dim));
        SparseAuditAccumulator acc;
        acc.add(c.view());
        const std::vector<double> P = exact_attention(c);
        std::vector<bool> attended(size_t(n_ctx), false);
        for (int32_t t : c.attended) attended[size_t(t)] = true;
        const SparseAuditSummary s = acc.summary();
        EXPECT_NEAR(s.mean_recall, mass_of(P, attended), 1e-12);
        EXPECT_DOUBLE_EQ(s.mean_budget, double(c.attended.size()) / double(n_ctx));

        const std::vector<double> estimated(c.estimated.begin(), c.estimated.end());
        const std::vector<double> curves[3] = {reference_topk_curve(c, P, estimated),
                                               reference_topk_curve(c, P, true_logits(c)), reference_quest_curve(c, P)};
        for (int m = 0; m < 3; ++m)
          for (int i = 1; i <= 200; ++i)
            ASSERT_NEAR(acc.baseline_recall(kSparseBaselineNames[size_t(m)], at_grid(i)), curves[m][size_t(i)], 1e-12)
                << kSparseBaselineNames[size_t(m)] << " at grid point " << i;
      }
}

TEST(SparseAudit, CellQuantilesAndLayers) {
  // Equal logits (every key the same): P_t = 1/100, so a cell attending r tokens has recall r/100,
  // and every baseline's recall equals the budget it used.
  std::vector<double> recalls;
  SparseAuditAccumulator acc;
  for (int i = 0; i < 100; ++i) {
    const int r = 1 + (i * 37) % 100;
    CellData c;
    c.layer = 2 - r % 3;
    c.head = i % 9;
    c.step = i;
    c.n_ctx = 100;
    c.n_indexed = 100;
    c.head_dim = 32;
    c.scale = 0.125f;
    c.block_tokens = 16;
    for (int ch = 0; ch < 32; ++ch) c.q.push_back(float(ch % 5 - 2));
    for (int t = 0; t < 100; ++t)
      for (int ch = 0; ch < 32; ++ch) c.k.push_back(float(ch % 4));
    c.estimated.assign(100, 0.0f);
    for (int t = 0; t < r; ++t) c.attended.push_back(int32_t(99 - t));
    acc.add(c.view());
    recalls.push_back(r / 100.0);
  }
  std::sort(recalls.begin(), recalls.end());
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 100);
  EXPECT_NEAR(s.mean_recall, 0.505, 1e-12);
  EXPECT_NEAR(s.mean_budget, 0.505, 1e-12);
  EXPECT_NEAR(s.recall_q01, sorted_quantile(recalls, 0.01), 1e-12);
  EXPECT_NEAR(s.recall_q10, sorted_quantile(recalls, 0.10), 1e-12);
  EXPECT_NEAR(s.recall_q50, sorted_quantile(recalls, 0.50), 1e-12);
  EXPECT_NEAR(s.min_recall, 0.01, 1e-12);
  EXPECT_NEAR(s.budget_q50, sorted_quantile(recalls, 0.50), 1e-15);
  EXPECT_NEAR(s.budget_q90, sorted_quantile(recalls, 0.90), 1e-15);
  EXPECT_EQ(s.max_budget, 1.0);
  for (const SparseBaseline& b : s.baselines) EXPECT_NEAR(b.mean_recall, b.mean_budget, 1e-12) << b.name;

  ASSERT_EQ(s.layers.size(), 3u);
  int64_t total = 0;
  for (int j = 0; j < 3; ++j) {
    const SparseAuditLayer& layer = s.layers[size_t(j)];
    EXPECT_EQ(layer.layer, j);
    // Layer 2 - (r mod 3) holds r = 3m + (2 - j); recall r / 100.
    double sum = 0;
    int64_t count = 0;
    int min_r = 101;
    for (int r = 1; r <= 100; ++r)
      if (2 - r % 3 == j) {
        sum += r / 100.0;
        ++count;
        min_r = std::min(min_r, r);
      }
    EXPECT_EQ(layer.cells, count);
    EXPECT_NEAR(layer.mean_recall, sum / double(count), 1e-12);
    EXPECT_NEAR(layer.mean_budget, sum / double(count), 1e-12);
    EXPECT_NEAR(layer.min_recall, min_r / 100.0, 1e-12);
    ASSERT_EQ(layer.baselines.size(), 3u);
    for (const SparseBaseline& b : layer.baselines) EXPECT_NEAR(b.mean_recall, b.mean_budget, 1e-12) << b.name;
    total += layer.cells;
  }
  EXPECT_EQ(total, 100);
}

// n_ctx = 3, head_dim 1, q = (1): the logit of token t is its key, ln w_t.
CellData three_token_cell(int layer, const std::vector<double>& w, const std::vector<float>& estimated,
                          int block_tokens, int32_t attended) {
  CellData c;
  c.layer = layer;
  c.n_ctx = 3;
  c.n_indexed = 3;
  c.head_dim = 1;
  c.scale = 1;
  c.block_tokens = block_tokens;
  c.q = {1};
  for (double x : w) c.k.push_back(float(std::log(x)));
  c.estimated = estimated;
  c.attended = {attended};
  return c;
}

TEST(SparseAudit, SummaryInterpolatesBetweenGridPoints) {
  // Cell A (layer 0): P ~ (5, 3, 2), estimates rank 1, 0, 2, pages of one token, attends {0}.
  // Cell B (layer 2): P ~ (1, 2, 7), estimates all tie (rank 0, 1, 2), one page of 3, attends {2}.
  const CellData a = three_token_cell(0, {5, 3, 2}, {1, 2, 0}, 1, 0);
  const CellData b = three_token_cell(2, {1, 2, 7}, {0, 0, 0}, 3, 2);
  const std::vector<double> Pa = exact_attention(a);
  const std::vector<double> Pb = exact_attention(b);
  SparseAuditAccumulator acc;
  acc.add(a.view());
  acc.add(b.view());
  const SparseAuditSummary s = acc.summary();
  EXPECT_DOUBLE_EQ(s.mean_budget, 1.0 / 3.0);
  EXPECT_NEAR(s.mean_recall, (Pa[0] + Pb[2]) / 2, 1e-15);

  // Mean budget 1/3 sits at h = 200/3 on the grid: between i = 66 (K = ceil(198/200) = 1) and
  // i = 67 (K = ceil(201/200) = 2), with weight 2/3 on i = 67.
  const double w67 = 2.0 / 3.0;
  auto lerp = [&](double at66, double at67) { return at66 + w67 * (at67 - at66); };
  const double est66 = (Pa[1] + Pb[0]) / 2, est67 = (Pa[1] + Pa[0] + Pb[0] + Pb[1]) / 2;
  const double orc66 = (Pa[0] + Pb[2]) / 2, orc67 = (Pa[0] + Pa[1] + Pb[2] + Pb[1]) / 2;
  const double quest66 = (Pa[0] + 1.0) / 2, quest67 = (Pa[0] + Pa[1] + 1.0) / 2;  // B's page is every token
  ASSERT_EQ(s.baselines.size(), 3u);
  EXPECT_NEAR(s.baselines[0].mean_recall, lerp(est66, est67), 1e-12);
  EXPECT_NEAR(s.baselines[1].mean_recall, lerp(orc66, orc67), 1e-12);
  EXPECT_NEAR(s.baselines[2].mean_recall, lerp(quest66, quest67), 1e-12);
  EXPECT_NEAR(s.baselines[0].mean_budget, lerp(1.0 / 3, 2.0 / 3), 1e-12);
  EXPECT_NEAR(s.baselines[1].mean_budget, lerp(1.0 / 3, 2.0 / 3), 1e-12);
  EXPECT_NEAR(s.baselines[2].mean_budget, lerp((1.0 / 3 + 1) / 2, (2.0 / 3 + 1) / 2), 1e-12);
  EXPECT_NEAR(acc.baseline_recall("topk_oracle", 1.0 / 3.0), lerp(orc66, orc67), 1e-12);

  // Per layer, each layer's curve is read at its own mean budget (1/3 for both).
  ASSERT_EQ(s.layers.size(), 2u);
  EXPECT_EQ(s.layers[0].layer, 0);
  EXPECT_EQ(s.layers[1].layer, 2);
  EXPECT_NEAR(s.layers[0].baselines[0].mean_recall, lerp(Pa[1], Pa[1] + Pa[0]), 1e-12);
  EXPECT_NEAR(s.layers[1].baselines[0].mean_recall, lerp(Pb[0], Pb[0] + Pb[1]), 1e-12);
  EXPECT_NEAR(s.layers[1].baselines[2].mean_recall, 1.0, 1e-12);
  EXPECT_NEAR(s.layers[1].baselines[2].mean_budget, 1.0, 1e-12);
  EXPECT_NEAR(s.layers[1].min_recall, Pb[2], 1e-15);
}

void expect_rejected(const SparseAuditCell& c, const std::string& field) {
  SparseAuditAccumulator acc;
  try {
    acc.add(c);
    ADD_FAILURE() << "accepted a cell with a bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
  const SparseAuditSummary s = acc.summary();
  EXPECT_EQ(s.cells, 0) << field;
  EXPECT_EQ(s.estimator_samples, 0) << field;
}

TEST(SparseAudit, RejectsBadCells) {
  std::mt19937 rng(1);
  const CellData good = random_cell(rng, 17, 4, 32, 3, 0.5);
  ASSERT_EQ(good.n_indexed, 13);
  SparseAuditAccumulator ok;
  ok.add(good.view());
  EXPECT_EQ(ok.summary().cells, 1);

  // A changed copy of `good`; the copies live until the end of the test.
  std::vector<std::unique_ptr<CellData>> copies;
  auto with = [&](auto change) {
    copies.push_back(std::make_unique<CellData>(good));
    change(*copies.back());
    return copies.back()->view();
  };
  auto with_view = [&](auto change) {
    SparseAuditCell v = good.view();
    change(v);
    return v;
  };
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr float inf = std::numeric_limits<float>::infinity();
  expect_rejected(with([](CellData& c) { c.layer = -1; }), "layer");
  expect_rejected(with([](CellData& c) { c.head = -1; }), "head");
  expect_rejected(with([](CellData& c) { c.step = -1; }), "step");
  expect_rejected(with([](CellData& c) { c.n_ctx = 0; }), "n_ctx");
  expect_rejected(with([](CellData& c) { c.n_indexed = -1; }), "n_indexed");
  expect_rejected(with([](CellData& c) { c.n_indexed = 18; }), "n_indexed");
  expect_rejected(with([](CellData& c) { c.head_dim = 0; }), "head_dim");
  expect_rejected(with([](CellData& c) { c.block_tokens = 0; }), "block_tokens");
  for (float bad_scale : {0.0f, -0.125f, nan, inf})
    expect_rejected(with([&](CellData& c) { c.scale = bad_scale; }), "scale");
  expect_rejected(with_view([](SparseAuditCell& v) { v.q = nullptr; }), "q is null");
  expect_rejected(with_view([](SparseAuditCell& v) { v.k = nullptr; }), "k is null");
  expect_rejected(with([](CellData& c) { c.estimated.clear(); }), "estimated_logits");
  expect_rejected(with([](CellData& c) { c.attended.clear(); }), "window token");  // empty set misses the window
  expect_rejected(with([](CellData& c) { c.q[5] = nan; }), "q[5]");
  expect_rejected(with([](CellData& c) { c.k[40] = -inf; }), "k[40]");
  expect_rejected(with([](CellData& c) { c.estimated[12] = nan; }), "estimated_logits[12]");
  expect_rejected(with([](CellData& c) { c.error_scale.assign(13, 1.0f); c.error_scale[2] = -1; }), "error_scale[2]");
  expect_rejected(with([](CellData& c) { c.error_scale.assign(13, 1.0f); c.error_scale[0] = nan; }), "error_scale[0]");
  expect_rejected(with([](CellData& c) { c.attended.push_back(17); }), "outside");
  expect_rejected(with([](CellData& c) { c.attended.push_back(-1); }), "outside");
  expect_rejected(with([](CellData& c) { c.attended.push_back(c.attended.front()); }), "repeated");
  expect_rejected(with([](CellData& c) { c.attended.pop_back(); }), "window token 16");
  expect_rejected(with([](CellData& c) { std::erase(c.attended, 13); }), "window token 13");
  expect_rejected(with([](CellData& c) { c.attended.assign(18, 0); std::iota(c.attended.begin(), c.attended.end(), 0); }),
                  "n_attended");

  expect_rejected(with_view([](SparseAuditCell& v) { v.attended = nullptr; }), "attended is null");
  expect_rejected(with_view([](SparseAuditCell& v) { v.n_attended = -1; }), "n_attended");


  // estimated_logits may be null when nothing is indexed.
  CellData all_window = good;
  all_window.n_indexed = 0;
  all_window.estimated.clear();
  all_window.attended.resize(17);
  std::iota(all_window.attended.begin(), all_window.attended.end(), 0);
  SparseAuditAccumulator acc;
  acc.add(all_window.view());
  EXPECT_EQ(acc.summary().cells, 1);
}

TEST(SparseAudit, BaselineRecallRejectsBadArguments) {
  std::mt19937 rng(4);
  SparseAuditAccumulator acc;
  acc.add(random_cell(rng, 129, 8, 64, 16, 0.5).view());
  EXPECT_THROW(acc.baseline_recall("quest", 0.0), Error);
  EXPECT_THROW(acc.baseline_recall("quest", -0.1), Error);
  EXPECT_THROW(acc.baseline_recall("quest", 1.0001), Error);
  EXPECT_THROW(acc.baseline_recall("quest", std::nan("")), Error);
  EXPECT_THROW(acc.baseline_recall("oracle", 0.5), Error);
  EXPECT_THROW(acc.baseline_recall("", 0.5), Error);
  EXPECT_GT(acc.baseline_recall("quest", 1e-9), 0.0);  // below the first grid point: toward the window alone
  EXPECT_NEAR(acc.baseline_recall("quest", 1.0), 1.0, 1e-12);
}

}  // namespace
}  // namespace certkv::eval
