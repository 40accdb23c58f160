#include "model/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/status.h"

namespace certkv::model {

int32_t argmax(const float* logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplerParams& params) : params_(params), rng_(params.seed) {
  if (!(params.temperature >= 0.f) || !std::isfinite(params.temperature))
    fail(StatusCode::kInvalidArgument, "temperature must be a finite number >= 0");
  if (params.top_k < 0) fail(StatusCode::kInvalidArgument, "top-k must be >= 0");
  if (!(params.top_p > 0.f && params.top_p <= 1.f))
    fail(StatusCode::kInvalidArgument, "top-p must be in (0, 1]");
}

int32_t Sampler::sample(const float* logits, int32_t n_vocab) {
  if (n_vocab < 1) fail(StatusCode::kInvalidArgument, "sampling needs at least one logit");
  if (params_.temperature == 0.f) return argmax(logits, n_vocab);

  candidates_.resize(size_t(n_vocab));
  for (int32_t i = 0; i < n_vocab; ++i) candidates_[i] = {logits[i] / params_.temperature, i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t n = candidates_.size();
  if (params_.top_k > 0 && size_t(params_.top_k) < n) {
    std::partial_sort(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(), by_logit);
    n = size_t(params_.top_k);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  const float max_logit = candidates_[0].first;
  double total = 0;
  std::vector<double> prob(n);
  for (size_t i = 0; i < n; ++i) total += prob[i] = std::exp(double(candidates_[i].first - max_logit));
  // Nucleus: the shortest prefix (by probability) whose mass reaches top_p.
  if (params_.top_p < 1.f) {
    double mass = 0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      mass += prob[i] / total;
      if (mass >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    total = 0;
    for (size_t i = 0; i < n; ++i) total += prob[i];
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double r = uniform(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= prob[i];
    if (r < 0) return candidates_[i].second;
  }
  return candidates_[n - 1].second;
}

}  // namespace certkv::model
