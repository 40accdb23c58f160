#include "eval/audit.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "core/status.h"
#include "eval/quality.h"

namespace certkv::eval {
namespace {

// Exact TV computed in double may exceed 1 by rounding, never by more than this.
constexpr double kTvRoundingSlack = 1e-12;

std::string cell_name(const AuditCell& c) {
  return "AuditCell (layer " + std::to_string(c.layer) + ", head " + std::to_string(c.head) + ", step " +
         std::to_string(c.step) + ")";
}

void check_cell(const AuditCell& c) {
  if (c.layer < 0 || c.head < 0 || c.step < 0)
    fail(StatusCode::kInvalidArgument, cell_name(c) + ": layer, head and step must be >= 0");
  if (!(c.meter >= 0))
    fail(StatusCode::kInvalidArgument, cell_name(c) + ": meter must be >= 0, got " + std::to_string(c.meter));
  if (!(std::isfinite(c.tv) && c.tv >= 0 && c.tv <= 1 + kTvRoundingSlack))
    fail(StatusCode::kInvalidArgument, cell_name(c) + ": tv must be in [0, 1], got " + std::to_string(c.tv));
  if (c.overflow && c.meter < 1)
    fail(StatusCode::kInvalidArgument,
         cell_name(c) + ": overflow is set but meter is " + std::to_string(c.meter) + " (an overflow means 1)");
}

size_t index_of_max(const std::vector<AuditCell>& cells, double AuditCell::*field) {
  size_t best = 0;
  for (size_t i = 1; i < cells.size(); ++i)
    if (cells[i].*field > cells[best].*field) best = i;
  return best;
}

}  // namespace

AuditAccumulator::AuditAccumulator(double tau, double violation_tolerance)
    : tau_(tau), violation_tolerance_(violation_tolerance) {
  if (!(std::isfinite(tau) && tau >= 0))
    fail(StatusCode::kInvalidArgument, "audit tau must be finite and >= 0, got " + std::to_string(tau));
  if (!(std::isfinite(violation_tolerance) && violation_tolerance >= 0))
    fail(StatusCode::kInvalidArgument,
         "audit violation_tolerance must be finite and >= 0, got " + std::to_string(violation_tolerance));
}

void AuditAccumulator::add(const AuditCell& cell) {
  check_cell(cell);
  const bool violation = cell.meter < cell.tv - violation_tolerance_;
  const bool covered = cell.meter <= tau_;
  if (cells_ == 0 || cell.tv - cell.meter > worst_.tv - worst_.meter) worst_ = cell;
  ++cells_;
  violations_ += violation;
  overflows_ += cell.overflow;
  covered_ += covered;
  max_meter_ = std::max(max_meter_, cell.meter);
  max_tv_ = std::max(max_tv_, cell.tv);
  if (cell.tv > kAuditTvFloor && cell.meter < 1) tightness_.push_back(cell.meter / cell.tv);

  LayerCounts& layer = layers_[cell.layer];
  ++layer.cells;
  layer.violations += violation;
  layer.covered += covered;
  layer.max_meter = std::max(layer.max_meter, cell.meter);
  layer.max_tv = std::max(layer.max_tv, cell.tv);
}

AuditSummary AuditAccumulator::summary() const {
  AuditSummary s;
  s.tau = tau_;
  s.violation_tolerance = violation_tolerance_;
  s.cells = cells_;
  s.violations = violations_;
  s.overflows = overflows_;
  s.coverage_at_tau = cells_ > 0 ? double(covered_) / double(cells_) : 0.0;
  s.max_meter = max_meter_;
  s.max_tv = max_tv_;
  s.worst = worst_;
  s.tightness_cells = int64_t(tightness_.size());
  if (!tightness_.empty()) {
    std::vector<double> sorted = tightness_;
    std::sort(sorted.begin(), sorted.end());
    s.tightness_q01 = sorted_quantile(sorted, 0.01);
    s.tightness_q10 = sorted_quantile(sorted, 0.10);
    s.tightness_q50 = sorted_quantile(sorted, 0.50);
    s.tightness_q90 = sorted_quantile(sorted, 0.90);
    s.tightness_q99 = sorted_quantile(sorted, 0.99);
  }
  for (const auto& [index, counts] : layers_) {
    AuditLayerSummary layer;
    layer.layer = index;
    layer.cells = counts.cells;
    layer.violations = counts.violations;
    layer.coverage_at_tau = double(counts.covered) / double(counts.cells);
    layer.max_meter = counts.max_meter;
    layer.max_tv = counts.max_tv;
    s.layers.push_back(layer);
  }
  return s;
}

std::vector<AuditCell> select_dump_cells(const std::vector<AuditCell>& cells, int64_t n, uint64_t seed) {
  if (n < 2)
    fail(StatusCode::kInvalidArgument,
         "dump cell count must be >= 2 (the largest-tv and largest-meter cells), got " + std::to_string(n));
  for (const AuditCell& c : cells) check_cell(c);
  if (cells.size() <= uint64_t(n)) return cells;

  std::vector<bool> chosen(cells.size(), false);
  chosen[index_of_max(cells, &AuditCell::tv)] = true;
  chosen[index_of_max(cells, &AuditCell::meter)] = true;
  std::vector<size_t> rest;
  for (size_t i = 0; i < cells.size(); ++i)
    if (!chosen[i]) rest.push_back(i);
  const size_t n_forced = cells.size() - rest.size();
  // Partial Fisher-Yates on the raw mt19937_64 stream (the same on every standard library).
  std::mt19937_64 rng(seed);
  const size_t n_random = size_t(n) - n_forced;
  for (size_t i = 0; i < n_random; ++i) {
    const size_t j = i + size_t(rng() % (rest.size() - i));
    std::swap(rest[i], rest[j]);
    chosen[rest[i]] = true;
  }
  std::vector<AuditCell> out;
  out.reserve(size_t(n));
  for (size_t i = 0; i < cells.size(); ++i)
    if (chosen[i]) out.push_back(cells[i]);
  return out;
}

}  // namespace certkv::eval
