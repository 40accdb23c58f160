// Teacher-forced quality: at every position the reference run (exact KV) and the test run
// (compressed KV) see the same token prefix, and their next-token distributions are compared.
// Per position: KL(softmax(ref) || softmax(test)) in nats, top-1 agreement and top-5 overlap.
// The summary over positions reports the mean, maximum and 99th percentile of KL and the
// agreement rates, the figures llama.cpp's perplexity tool reports for a KV format.
// Thread safety: compare_logits and sorted_quantile are reentrant; a QualityAccumulator is used by
// one thread at a time.
#pragma once

#include <cstdint>
#include <vector>

namespace certkv::eval {

struct PositionQuality {
  double kl = 0;             // KL(softmax(ref) || softmax(test)) in nats, >= 0
  bool top1_agree = false;   // argmax(ref) == argmax(test), ties to the lowest index
  double top5_overlap = 0;   // |top5(ref) ∩ top5(test)| / min(5, n_vocab), in [0, 1]
};

// ref, test: [n_vocab] logits of one position. Computed in double with the max subtracted before
// exponentiation, so any finite logits work. Top-k sets rank by logit, ties to the lowest index;
// with n_vocab < 5 the sets hold every token and the overlap divides by n_vocab, so identical
// logits always give overlap 1.
// Throws certkv::Error(kInvalidArgument) for n_vocab < 1, a null pointer, or a non-finite logit
// (the message names "ref" or "test" and the index).
PositionQuality compare_logits(const float* ref, const float* test, int n_vocab);

// Linear interpolation between order statistics (numpy's default): with h = (n - 1) q, returns
// sorted[floor(h)] + (h - floor(h)) (sorted[floor(h) + 1] - sorted[floor(h)]).
// REQUIRES: sorted is ascending. Throws kInvalidArgument when sorted is empty or q is not in [0, 1].
double sorted_quantile(const std::vector<double>& sorted, double q);

struct QualitySummary {
  int64_t n_positions = 0;
  double mean_kl = 0;
  double max_kl = 0;
  double p99_kl = 0;  // sorted_quantile of the per-position KL at 0.99
  double top1 = 0;    // fraction of positions whose top-1 agrees
  double top5 = 0;    // mean top-5 overlap
};

// Collects PositionQuality values in the order they are added. Every field of the summary is 0
// when nothing was added (n_positions == 0 tells that case apart).
class QualityAccumulator {
 public:
  // Throws kInvalidArgument when q.kl is negative or not finite, or q.top5_overlap is outside
  // [0, 1]: such a value cannot come from compare_logits.
  void add(const PositionQuality& q);
  QualitySummary summary() const;
  const std::vector<PositionQuality>& positions() const { return positions_; }

 private:
  std::vector<PositionQuality> positions_;
};

}  // namespace certkv::eval
