// The audit behind certkv_session_audit_*: on every metered (step, layer) of a session, the true
// total variation between exact and compressed attention beside the reported meter, per query
// head, accumulated by eval::AuditAccumulator; optionally a sample of cells kept whole (query,
// exact and reconstructed keys) for an independent recomputation.
// Thread safety: used by the session's thread only.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "eval/audit.h"
#include "backend/session.h"

namespace certkv::api {

class SessionAudit {
 public:
  // dump_cells: cells kept by reservoir sampling (plus the cells of largest TV and meter).
  SessionAudit(const backend::Session& session, double tau, int32_t dump_cells, uint64_t seed);

  void observe(const backend::MeterObservation& o);
  const eval::AuditAccumulator& accumulator() const { return accumulator_; }
  // Writes the kept cells (docs/format in certkv.h, certkv_session_audit_dump).
  void dump(const std::string& path, const std::string& scheme) const;

 private:
  struct KeptCell {
    eval::AuditCell cell;
    float scale = 0;
    std::vector<float> q, k, k_hat;
  };
  KeptCell keep(const backend::MeterObservation& o, int head, const eval::AuditCell& cell) const;

  const backend::Session& session_;
  eval::AuditAccumulator accumulator_;
  int32_t dump_cells_;
  std::mt19937_64 rng_;
  int64_t seen_ = 0;
  std::vector<KeptCell> reservoir_;
  KeptCell max_tv_, max_meter_;
  bool have_max_ = false;
};

}  // namespace certkv::api
