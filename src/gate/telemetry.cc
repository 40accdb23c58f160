#include "gate/telemetry.h"

#include <algorithm>
#include <cmath>

#include "core/status.h"

namespace certkv::gate {
namespace {

constexpr int kOctaves = kTelemetryMaxExponent - kTelemetryMinExponent;
constexpr size_t kBuckets = 2 + size_t(kOctaves) * kTelemetrySubBuckets;
constexpr size_t kTopBucket = kBuckets - 1;

// Bucket of a finite v >= 0: 0 below 2^kTelemetryMinExponent, kTopBucket at or above
// 2^kTelemetryMaxExponent, else 1 + octave * kTelemetrySubBuckets + sub-bucket. Exact: v = f 2^x
// with f in [1/2, 1), and (2f - 1) * kTelemetrySubBuckets is computed without rounding.
size_t bucket_of(double v) {
  int x = 0;
  const double f = std::frexp(v, &x);
  const int e = x - 1;  // v in [2^e, 2^(e+1))
  if (v == 0 || e < kTelemetryMinExponent) return 0;
  if (e >= kTelemetryMaxExponent) return kTopBucket;
  const int sub = int((2 * f - 1) * kTelemetrySubBuckets);
  return 1 + size_t(e - kTelemetryMinExponent) * kTelemetrySubBuckets + size_t(sub);
}

// Midpoint of an octave bucket (0 < bucket < kTopBucket).
double bucket_midpoint(size_t bucket) {
  const size_t i = bucket - 1;
  const int e = int(i / kTelemetrySubBuckets) + kTelemetryMinExponent;
  const double sub = double(i % kTelemetrySubBuckets);
  return std::ldexp(1 + (sub + 0.5) / kTelemetrySubBuckets, e);
}

}  // namespace

Telemetry::Telemetry(double tau, int64_t sample_every) : tau_(tau), sample_every_(sample_every) {
  if (!(tau >= 0)) fail(StatusCode::kInvalidArgument, "Telemetry: tau must be >= 0");
  if (sample_every < 1) fail(StatusCode::kInvalidArgument, "Telemetry: sample_every must be >= 1");
}

void Telemetry::record(double meter, bool overflow) {
  if (meter < 0) fail(StatusCode::kInvalidArgument, "Telemetry::record: meter is negative");
  ++offered_;
  if (until_next_ > 0) {
    --until_next_;
    return;
  }
  until_next_ = sample_every_ - 1;
  ++cells_;
  if (overflow || !std::isfinite(meter)) {
    ++overflow_;
    return;
  }
  if (meter <= tau_) ++covered_;
  add_value(meter);
}

void Telemetry::add_value(double meter) {
  min_ = values_ == 0 ? meter : std::min(min_, meter);
  max_ = values_ == 0 ? meter : std::max(max_, meter);
  ++values_;
  if (pending_.capacity() == 0) pending_.reserve(kTelemetryPendingValues);
  pending_.push_back(meter);
  if (pending_.size() == size_t(kTelemetryPendingValues)) fold_pending();
}

void Telemetry::fold_pending() const {
  if (pending_.empty()) return;
  size_t buckets[kTelemetryPendingValues];
  size_t lo = kTopBucket, hi = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    buckets[i] = bucket_of(pending_[i]);
    lo = std::min(lo, buckets[i]);
    hi = std::max(hi, buckets[i]);
  }
  cover(lo, hi);
  for (size_t i = 0; i < pending_.size(); ++i) ++histogram_[buckets[i] - first_bucket_];
  pending_.clear();
}

void Telemetry::cover(size_t lo, size_t hi) const {
  if (histogram_.empty()) {
    first_bucket_ = lo;
    histogram_.assign(hi - lo + 1, 0);
    return;
  }
  const size_t last = first_bucket_ + histogram_.size() - 1;
  if (lo >= first_bucket_ && hi <= last) return;
  const size_t first = std::min(lo, first_bucket_);
  std::vector<int64_t> grown(std::max(hi, last) - first + 1, 0);
  std::copy(histogram_.begin(), histogram_.end(), grown.begin() + ptrdiff_t(first_bucket_ - first));
  histogram_ = std::move(grown);
  first_bucket_ = first;
}

void Telemetry::add_repairs(int64_t n_pages, int64_t pagein_bytes) {
  if (n_pages < 0)
    fail(StatusCode::kInvalidArgument, "Telemetry::add_repairs: n_pages is negative");
  if (pagein_bytes < 0)
    fail(StatusCode::kInvalidArgument, "Telemetry::add_repairs: pagein_bytes is negative");
  repair_pages_ += n_pages;
  pagein_bytes_ += pagein_bytes;
}

void Telemetry::merge(const Telemetry& other) {
  if (other.tau_ != tau_) fail(StatusCode::kInvalidArgument, "Telemetry::merge: tau differs");
  if (other.sample_every_ != sample_every_)
    fail(StatusCode::kInvalidArgument, "Telemetry::merge: sample_every differs");
  offered_ += other.offered_;
  cells_ += other.cells_;
  covered_ += other.covered_;
  overflow_ += other.overflow_;
  repair_pages_ += other.repair_pages_;
  pagein_bytes_ += other.pagein_bytes_;
  if (other.values_ == 0) return;
  other.fold_pending();
  fold_pending();
  cover(other.first_bucket_, other.first_bucket_ + other.histogram_.size() - 1);
  for (size_t i = 0; i < other.histogram_.size(); ++i)
    histogram_[other.first_bucket_ + i - first_bucket_] += other.histogram_[i];
  min_ = values_ == 0 ? other.min_ : std::min(min_, other.min_);
  max_ = values_ == 0 ? other.max_ : std::max(max_, other.max_);
  values_ += other.values_;
}

double Telemetry::coverage() const { return cells_ == 0 ? 0 : double(covered_) / double(cells_); }

double Telemetry::max() const { return values_ == 0 ? 0 : max_; }

double Telemetry::quantile(double q) const {
  if (!(q >= 0 && q <= 1))
    fail(StatusCode::kInvalidArgument, "Telemetry::quantile: q must lie in [0, 1]");
  if (values_ == 0) return 0;
  fold_pending();
  const int64_t rank = std::max<int64_t>(1, int64_t(std::ceil(q * double(values_))));
  if (rank == 1) return min_;
  if (rank == values_) return max_;
  int64_t below = 0;
  size_t i = 0;  // the histogram holds every value: the rank falls within it
  while (below + histogram_[i] < rank) below += histogram_[i++];
  const size_t bucket = first_bucket_ + i;
  if (bucket == 0) return min_;
  if (bucket == kTopBucket) return max_;
  return std::clamp(bucket_midpoint(bucket), min_, max_);
}

SequenceTelemetry::SequenceTelemetry(int n_layers, double tau, int64_t sample_every)
    : tau_(tau), sample_every_(sample_every) {
  if (n_layers < 0) fail(StatusCode::kInvalidArgument, "SequenceTelemetry: n_layers must be >= 0");
  layers_.assign(size_t(n_layers), Telemetry(tau, sample_every));
}

void SequenceTelemetry::reset() {
  for (Telemetry& t : layers_) t = Telemetry(tau_, sample_every_);
}

Telemetry SequenceTelemetry::all() const {
  Telemetry whole(tau_, sample_every_);
  for (const Telemetry& t : layers_) whole.merge(t);
  return whole;
}

}  // namespace certkv::gate
