// Meter telemetry (DESIGN.md section 4; WitCert, seed 000): the aggregate of the per-(layer, head,
// step) meter values that the engine and the C API report: cells, coverage at tau (the fraction
// of cells whose meter is at most tau), max, p50 / p99, overflow cells, and the repairs the gate
// made (pages and bytes paged in from the exact backing store).
//
// Sampling: with sample_every = k, record() keeps the 1st, (k+1)-th, (2k+1)-th, ... cell offered
// and skips the others at the cost of one counter update, so that telemetry stays far below the
// cost of the decode it observes. Every statistic except offered() is over the kept cells.
//
// Overflow cells (the meter saturated because A overflowed, log A = +inf, or the value is NaN or
// +inf) count as cells that are never covered; max and the percentiles are over the other cells,
// and the overflow count is reported on its own.
//
// Percentiles come from a log-linear histogram (HdrHistogram-style): each binary octave
// [2^e, 2^(e+1)) with kTelemetryMinExponent <= e < kTelemetryMaxExponent is split into
// kTelemetrySubBuckets equal buckets; a bucket reports its midpoint, clamped to the recorded
// [min, max] (ranks 1 and n report the exact min and max). Bucket bounds are exact binary
// fractions, so a percentile p in [2^kTelemetryMinExponent, 2^kTelemetryMaxExponent) is reported
// within relative error kTelemetryQuantileRelativeError of the exact nearest-rank value. Values
// below 2^kTelemetryMinExponent (including 0) share one bucket reported as the recorded minimum
// (absolute error below 2^kTelemetryMinExponent); values at or above 2^kTelemetryMaxExponent share
// one reported as the recorded maximum. The histogram merges exactly. It holds the buckets from
// the lowest to the highest recorded (8 bytes each, 1 KiB an octave), allocated on the first
// value and grown as values arrive: a meter spread over a few octaves costs a few KiB, not the
// 64 KiB of every bucket.
//
// Values reach the histogram in batches of kTelemetryPendingValues: a decode step records one
// value per (layer, query head) into many telemetries whose histograms the step's weight and KV
// reads have evicted from cache, and a batch touches each histogram's lines once instead of once
// per value. Every statistic includes the values still pending.
//
// Thread safety: none, not even between const calls (quantile and merge fold the pending values
// in); keep one Telemetry per thread and merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace certkv::gate {

inline constexpr int kTelemetryMinExponent = -50;  // 2^-50 ~ 8.9e-16
inline constexpr int kTelemetryMaxExponent = 14;   // 2^14 = 16384 (raw risk scores above 1)
inline constexpr int kTelemetrySubBuckets = 128;   // buckets per octave
// Half a bucket over its lower bound: 1 / (2 * kTelemetrySubBuckets) = 0.39%.
inline constexpr double kTelemetryQuantileRelativeError = 1.0 / (2 * kTelemetrySubBuckets);
inline constexpr int kTelemetryPendingValues = 256;

class Telemetry {
 public:
  // REQUIRES: tau >= 0 (tau < 1: certified coverage; tau >= 1: risk ranking), sample_every >= 1.
  // Throws certkv::Error kInvalidArgument otherwise.
  explicit Telemetry(double tau, int64_t sample_every = 1);

  // One (layer, head, step) cell. meter: the meter (or, for tau >= 1, the raw risk score),
  // >= 0 or NaN; overflow: A overflowed (log A = +inf). A NaN or +inf meter counts as overflow.
  // Throws certkv::Error kInvalidArgument on a negative meter.
  void record(double meter) { record(meter, false); }
  void record(double meter, bool overflow);

  // The gate paged in n_pages exact pages holding pagein_bytes bytes. REQUIRES: both >= 0.
  void add_repairs(int64_t n_pages, int64_t pagein_bytes);

  // Adds the cells and repairs of `other`. REQUIRES: the same tau and sample_every (throws
  // certkv::Error kInvalidArgument otherwise). The sampling phase stays this object's.
  void merge(const Telemetry& other);

  double tau() const { return tau_; }
  int64_t sample_every() const { return sample_every_; }
  int64_t offered() const { return offered_; }   // cells passed to record(), kept or not
  int64_t cells() const { return cells_; }       // kept cells
  int64_t covered() const { return covered_; }   // kept cells with meter <= tau, not overflow
  int64_t overflow() const { return overflow_; }
  double coverage() const;  // covered / cells; 0 with no cells
  double max() const;       // over kept non-overflow cells; 0 with none
  // Nearest-rank quantile (the value of rank ceil(q n), at least 1, of the n kept non-overflow
  // values in increasing order), to the accuracy stated above; 0 with none. REQUIRES: 0 <= q <= 1.
  double quantile(double q) const;
  double p50() const { return quantile(0.5); }
  double p99() const { return quantile(0.99); }
  int64_t repairs() const { return repair_pages_; }
  int64_t pagein_bytes() const { return pagein_bytes_; }

 private:
  void add_value(double meter);
  // Moves the pending values into the histogram.
  void fold_pending() const;
  // Grows the histogram to hold buckets lo..hi (and the ones it held).
  void cover(size_t lo, size_t hi) const;

  double tau_;
  int64_t sample_every_;
  int64_t offered_ = 0;
  int64_t until_next_ = 0;  // offered cells to skip before the next kept one
  int64_t cells_ = 0;
  int64_t covered_ = 0;
  int64_t overflow_ = 0;
  int64_t values_ = 0;  // kept non-overflow cells (the histogram's total)
  double min_ = 0;
  double max_ = 0;
  // Buckets first_bucket_ .. first_bucket_ + size - 1 of: [0] below 2^kTelemetryMinExponent; then
  // the octave buckets; last, the top bucket. Empty before the first value; without the pending
  // values (below).
  mutable std::vector<int64_t> histogram_;
  mutable size_t first_bucket_ = 0;
  // Recorded values not yet in the histogram, fewer than kTelemetryPendingValues.
  mutable std::vector<double> pending_;
  int64_t repair_pages_ = 0;
  int64_t pagein_bytes_ = 0;
};

// The meter cells of one sequence, kept per layer (a request's certificate reports both its
// layers and its whole); the whole is the layers' merge, which is exact (Telemetry::merge), so
// each cell is recorded once. With sample_every = k each layer keeps every k-th of its own cells.
class SequenceTelemetry {
 public:
  // REQUIRES: n_layers >= 0, and Telemetry's (throws certkv::Error kInvalidArgument).
  SequenceTelemetry(int n_layers, double tau, int64_t sample_every = 1);

  // One (layer, head, step) cell, as Telemetry::record. REQUIRES: 0 <= layer < n_layers()
  // (unchecked: it runs on every cell).
  void record(int layer, double meter, bool overflow) { layers_[size_t(layer)].record(meter, overflow); }
  // The gate's repairs in one layer, as Telemetry::add_repairs.
  void add_repairs(int layer, int64_t n_pages, int64_t pagein_bytes) {
    layers_[size_t(layer)].add_repairs(n_pages, pagein_bytes);
  }
  // Every cell and repair so far dropped.
  void reset();

  int n_layers() const { return int(layers_.size()); }
  const std::vector<Telemetry>& layers() const { return layers_; }
  // Every layer's cells and repairs in one telemetry.
  Telemetry all() const;

 private:
  double tau_;
  int64_t sample_every_;
  std::vector<Telemetry> layers_;
};

}  // namespace certkv::gate
