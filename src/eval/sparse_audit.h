// Statistics of a sparse-attention audit (DESIGN.md section 5; RaBitQCache, seed 002). For every
// audited (layer, query head, step) cell, the token set the sparse decode attended (Top-p over
// estimated logits on the indexed prefix, plus the whole unindexed local window) is compared with
// exact attention:
//   budget = n_attended / n_ctx, recall = true attention mass of the attended set.
// The logit estimator is audited token by token (error e_t = estimated - true logit), and three
// fixed-budget baselines are traced as recall curves over a grid of budgets, so they can be read
// at the sparse run's own mean budget:
//   topk_estimated  top-k of the estimated logits (the same scores, spent as a fixed budget),
//   topk_oracle     top-k of the true logits (the best any k-token selection can do),
//   quest           Quest page selection (Tang et al. 2024) by a per-page upper bound on <q, k>.
// Other selection rules can be audited on the same cells (certkv audit --sparse ... --rules):
// each cell then also carries one mask of the indexed prefix per rule, and the rule's budget and
// recall are the cell's as if the step had attended that mask plus the window. The decode itself
// follows the session's own rule, so later layers and steps see its outputs, not the rules'.
// Thread safety: a SparseAuditAccumulator is used by one thread at a time.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace certkv::eval {

// Budget grid of the baseline curves: f_i = i / kSparseAuditGridPoints for i = 1..200 (0.005 ..
// 1.000), plus f_0 = 0 (the window alone) so that interpolation below 0.005 is defined. At f_i a
// cell's total token budget is K_i = ceil(i * n_ctx / 200), computed in integers.
inline constexpr int kSparseAuditGridPoints = 200;

// Size of the uniform reservoir of |e_t| behind the estimator quantiles (reservoir sampling,
// Algorithm R, on std::mt19937_64 seeded with kSparseAuditReservoirSeed): the quantiles are exact
// while at most this many indexed tokens were seen, a uniform sample estimate beyond.
inline constexpr int64_t kSparseAuditReservoirSize = int64_t(1) << 17;
inline constexpr uint64_t kSparseAuditReservoirSeed = 0x5a7b1e5eedULL;

// Baseline names accepted by baseline_recall, in the order summaries list them.
inline constexpr std::array<const char*, 3> kSparseBaselineNames = {"topk_estimated", "topk_oracle", "quest"};

// One audited (layer, query head, step). The pointers are borrowed for the duration of add().
struct SparseAuditCell {
  int layer = 0;
  int head = 0;              // query head
  int64_t step = 0;          // decode step (or query position)
  int64_t n_ctx = 0;         // tokens in context
  int64_t n_indexed = 0;     // [0, n_indexed) indexed; [n_indexed, n_ctx) the window, always attended
  int head_dim = 0;
  float scale = 0;           // softmax scale
  int block_tokens = 0;      // page size; the quest baseline takes whole pages of the indexed prefix
  const float* q = nullptr;                 // q: [head_dim], post-RoPE query
  const float* k = nullptr;                 // k: [n_ctx][head_dim], exact keys
  const float* estimated_logits = nullptr;  // [n_indexed]: scale * estimated <q, k_t>; null allowed
                                            // only when n_indexed == 0
  // [n_indexed] or null: scale * ||q - c_q|| * ||k_t - c_k||, the factor that turns a logit error
  // into the error of the estimated centred cosine <q_c, k_c>. Entries must be finite and >= 0;
  // tokens whose entry is 0 are left out of the normalized error.
  const float* error_scale = nullptr;
  const int32_t* attended = nullptr;        // attended: [n_attended] distinct indices in [0, n_ctx)
  int64_t n_attended = 0;                   // that the sparse step attended: the Top-p selection
                                            // plus the whole window; null allowed only when 0
  // One mask per rule of the accumulator (in its order), each [n_indexed], 1 for a selected
  // token. Null allowed only when the accumulator has no rules.
  const uint8_t* const* rule_masks = nullptr;
};

// A baseline read off its mean recall curve at one budget fraction: mean_recall is the mean over
// cells of its recall, mean_budget the mean over cells of the budget it actually used (quest may
// overshoot by up to a page; both top-k baselines use more than the grid budget only when the
// window alone exceeds it).
struct SparseBaseline {
  std::string name;
  double mean_budget = 0;
  double mean_recall = 0;
};

// One rule's means over the cells (and per layer): what the session's own figures would be had it
// attended the rule's masks plus the window.
struct SparseRuleLayer {
  int layer = 0;
  int64_t cells = 0;
  double mean_budget = 0, mean_recall = 0;
};
struct SparseRuleSummary {
  std::string name;
  int64_t cells = 0;
  double mean_budget = 0, mean_recall = 0, recall_q10 = 0, min_recall = 0;
  std::vector<SparseRuleLayer> layers;  // by increasing layer
};

struct SparseAuditLayer {
  int layer = 0;
  int64_t cells = 0;
  double mean_budget = 0, mean_recall = 0, min_recall = 0;
  std::vector<SparseBaseline> baselines;  // kSparseBaselineNames order, at this layer's mean_budget
};

// Every field is 0 (and the vectors empty) when no cell was added.
struct SparseAuditSummary {
  int64_t cells = 0;
  double mean_budget = 0, mean_recall = 0;
  // Quantiles (sorted_quantile, linear interpolation) over cells.
  double recall_q01 = 0, recall_q10 = 0, recall_q50 = 0, min_recall = 0;
  double budget_q50 = 0, budget_q90 = 0, max_budget = 0;
  int64_t estimator_samples = 0;  // indexed tokens seen
  double estimator_bias = 0;      // mean e_t, in logit units
  double estimator_rms = 0;       // sqrt(mean e_t^2)
  double estimator_abs_q50 = 0, estimator_abs_q90 = 0, estimator_abs_q99 = 0;  // of |e_t|, from the reservoir
  // Theorem A.1 of seed 002 puts the error of the estimated centred cosine at O(1/sqrt(D)); with
  // z_t = e_t / error_scale[t] this is sqrt(mean over tokens of z_t^2 * head_dim), i.e. rms(z) *
  // sqrt(D), which stays O(1) if the theorem holds. 0 when no cell gave an error_scale > 0.
  int64_t normalized_samples = 0;  // tokens with error_scale[t] > 0
  double normalized_rms_sqrt_d = 0;
  std::vector<SparseBaseline> baselines;  // kSparseBaselineNames order, at mean_budget
  std::vector<SparseAuditLayer> layers;   // one per layer seen, by increasing layer
  std::vector<SparseRuleSummary> rules;   // one per rule, in the accumulator's order
};

class SparseAuditAccumulator {
 public:
  // rule_names: the other rules audited on every cell (SparseAuditCell::rule_masks), in order.
  explicit SparseAuditAccumulator(std::vector<std::string> rule_names = {});

  // Computes, in double, the true logits l_t = scale * <q, k_t>, the exact softmax over all n_ctx
  // tokens, the cell's budget and recall, the estimator errors on the indexed prefix and the three
  // baseline curves. O(n_ctx * head_dim + n_indexed log n_indexed).
  // Throws kInvalidArgument, naming the field, for: a negative layer, head or step; n_ctx < 1;
  // n_indexed outside [0, n_ctx]; head_dim < 1; block_tokens < 1; a scale that is not finite and
  // > 0; a null q, k or estimated_logits (when n_indexed > 0) or attended (when n_attended > 0);
  // n_attended outside [0, n_ctx]; an attended index out of range or repeated; a window token
  // missing from attended; a non-finite q, k or estimated logit; an error_scale entry that is not
  // finite and >= 0; null rule_masks (or a null mask) when the accumulator has rules and
  // n_indexed > 0. A rejected cell changes nothing.
  void add(const SparseAuditCell& cell);

  SparseAuditSummary summary() const;

  // Mean recall over cells of baseline `name` at budget fraction f, linearly interpolated on the
  // grid (for tables at budgets other than the sparse run's). Returns 0 when no cell was added.
  // Throws kInvalidArgument for f outside (0, 1] or a name not in kSparseBaselineNames.
  double baseline_recall(const std::string& name, double f) const;

 private:
  // Per baseline, per grid point i = 0..200: sums over cells of recall and of the budget used.
  struct Curves {
    std::array<std::array<double, kSparseAuditGridPoints + 1>, kSparseBaselineNames.size()> recall_sum{};
    std::array<std::array<double, kSparseAuditGridPoints + 1>, kSparseBaselineNames.size()> budget_sum{};
  };
  struct LayerSums {
    int64_t cells = 0;
    double budget_sum = 0;
    double recall_sum = 0;
    double min_recall = 0;
    Curves curves;
  };

  struct RuleSums {
    std::string name;
    std::vector<double> recall;  // per cell
    double budget_sum = 0;
    std::map<int, SparseRuleLayer> layers;  // sums in mean_budget and mean_recall until summary()
  };
  std::vector<RuleSums> rules_;

  std::vector<double> recall_;  // per cell, in the order added
  std::vector<double> budget_;  // per cell
  Curves curves_;
  std::map<int, LayerSums> layers_;

  int64_t estimator_samples_ = 0;
  double error_sum_ = 0;
  double error_sq_sum_ = 0;
  int64_t normalized_samples_ = 0;
  double normalized_sq_d_sum_ = 0;  // sum of z_t^2 * head_dim
  std::vector<double> abs_error_reservoir_;
  std::mt19937_64 reservoir_rng_;
};

}  // namespace certkv::eval
