// Statistics of a meter audit (DESIGN.md section 4; WitCert, seed 000): for every audited
// (layer, query head, step) cell the meter (Theorem 1, an upper bound on attention total
// variation) is set beside the exact total variation between the attention distributions over
// exact and compressed keys. Soundness is checked per cell: a cell whose meter is below its TV
// (beyond a rounding tolerance) is a violation. Coverage at tau is the fraction of cells the gate
// would serve without repair. Tightness is the ratio meter / TV.
// Thread safety: an AuditAccumulator is used by one thread at a time; select_dump_cells is
// reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace certkv::eval {

struct AuditCell {
  int layer = 0;
  int head = 0;        // query head
  int64_t step = 0;    // decode step (or query position)
  double meter = 0;    // min(1, (A^2 - 1) / 2), or a raw unclamped score >= 0 (+inf allowed)
  double tv = 0;       // exact TV(p, p~) in [0, 1]
  bool overflow = false;  // A overflowed in the log domain; then the meter is >= 1
};

struct AuditLayerSummary {
  int layer = 0;
  int64_t cells = 0;
  int64_t violations = 0;
  double coverage_at_tau = 0;
  double max_meter = 0;
  double max_tv = 0;
};

// Tightness quantiles are over the informative cells only: tv > kAuditTvFloor (the ratio of a
// near-zero TV says nothing) and meter < 1 (a saturated meter carries no guarantee, only a risk
// rank). tightness_cells counts them; the quantiles are 0 when it is 0.
inline constexpr double kAuditTvFloor = 1e-12;

struct AuditSummary {
  double tau = 0;
  double violation_tolerance = 0;
  int64_t cells = 0;
  int64_t violations = 0;      // cells with meter < tv - violation_tolerance
  int64_t overflows = 0;       // cells with overflow set
  double coverage_at_tau = 0;  // fraction of cells with meter <= tau
  double max_meter = 0;
  double max_tv = 0;
  int64_t tightness_cells = 0;
  // Quantiles (sorted_quantile, linear interpolation) of meter / tv over the informative cells.
  double tightness_q01 = 0, tightness_q10 = 0, tightness_q50 = 0, tightness_q90 = 0, tightness_q99 = 0;
  // The cell with the largest tv - meter (the smallest soundness margin; the first one added on
  // ties); meaningful when cells > 0.
  AuditCell worst;
  std::vector<AuditLayerSummary> layers;  // one per layer seen, by increasing layer
};

class AuditAccumulator {
 public:
  // tau: the gate threshold (tau < 1 certified, tau >= 1 risk ranking). Throws kInvalidArgument
  // unless tau is finite and >= 0 and violation_tolerance is finite and >= 0.
  explicit AuditAccumulator(double tau, double violation_tolerance = 1e-9);

  // Throws kInvalidArgument, naming the field, for a negative layer, head or step, a NaN or
  // negative meter, a tv outside [0, 1 + 1e-12] or not finite, or overflow set with meter < 1.
  void add(const AuditCell& cell);
  AuditSummary summary() const;

 private:
  struct LayerCounts {
    int64_t cells = 0;
    int64_t violations = 0;
    int64_t covered = 0;
    double max_meter = 0;
    double max_tv = 0;
  };

  double tau_;
  double violation_tolerance_;
  int64_t cells_ = 0;
  int64_t violations_ = 0;
  int64_t overflows_ = 0;
  int64_t covered_ = 0;
  double max_meter_ = 0;
  double max_tv_ = 0;
  AuditCell worst_;
  std::vector<double> tightness_;     // meter / tv of the informative cells
  std::map<int, LayerCounts> layers_;
};

// Picks at most n cells to dump in full (e.g. their logits and witnesses), deterministically from
// `seed`: the cell with the largest tv and the cell with the largest meter (the first of equals)
// always, the rest uniformly at random without replacement. Returned in input order. When
// cells.size() <= n, returns all of them.
// Throws kInvalidArgument for n < 2 or a cell that add() would reject.
std::vector<AuditCell> select_dump_cells(const std::vector<AuditCell>& cells, int64_t n, uint64_t seed);

}  // namespace certkv::eval
