// The audit behind certkv_session_sparse_audit_*: on every sparse (step, layer) of a session,
// exact attention over every token beside the sparse step (eval::SparseAuditAccumulator: budget,
// recall, estimator error, fixed top-k and Quest baselines), and optionally a sample of cells
// kept whole (query, exact keys, attended indices) for an independent recomputation. Other
// Top-p rules (p, deviations) can be audited on the same cells: each selects from the cell's
// estimated logits as sparse decode would (index::top_p_select, then index::top_p_widen with the
// step's query norm), and its budget and recall are reported beside the session's own.
// Thread safety: used by the session's thread only.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "eval/sparse_audit.h"
#include "backend/session.h"

namespace certkv::api {

class SessionSparseAudit {
 public:
  // dump_cells: cells kept by reservoir sampling.
  SessionSparseAudit(const backend::Session& session, int32_t dump_cells, uint64_t seed);

  // Adds a rule (named "pP" or "pPzZ"); returns its index. REQUIRES: no cell observed yet (else
  // certkv::Error kInvalidArgument), 0 < p <= 1, finite deviations >= 0.
  int add_rule(double p, double deviations);
  int rules() const { return int(rules_.size()); }
  void observe(const backend::SparseObservation& o);
  const eval::SparseAuditAccumulator& accumulator() const { return accumulator_; }
  // Writes the kept cells (format in certkv.h, certkv_session_sparse_audit_dump).
  void dump(const std::string& path) const;

 private:
  struct KeptCell {
    int layer = 0, head = 0;
    int64_t step = 0, n_indexed = 0;
    float scale = 0;
    double recall = 0;
    std::vector<float> q, k;
    std::vector<int32_t> attended;
  };

  struct Rule {
    double p = 0, deviations = 0;
  };

  const backend::Session& session_;
  std::vector<Rule> rules_;
  eval::SparseAuditAccumulator accumulator_;
  int32_t dump_cells_;
  std::mt19937_64 rng_;
  int64_t seen_ = 0;
  std::vector<KeptCell> reservoir_;
};

}  // namespace certkv::api
