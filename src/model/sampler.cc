#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/status.h"

namespace certkv::model {

int32_t argmax(const float* logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

TokenLogprob token_logprob(const float* logits, int32_t n_vocab, int32_t token, int32_t top) {
  if (n_vocab < 1 || token < 0 || token >= n_vocab)
    fail(StatusCode::kInvalidArgument, "token_logprob: token " + std::to_string(token) + " outside a vocabulary of " +
                                           std::to_string(n_vocab));
  if (top < 0 || top > kMaxTopLogprobs)
    fail(StatusCode::kInvalidArgument, "token_logprob: top must be in [0, " + std::to_string(kMaxTopLogprobs) +
                                           "], got " + std::to_string(top));
  auto value = [](float x) { return std::isnan(x) ? -INFINITY : x; };
  float m = -INFINITY;
  for (int32_t i = 0; i < n_vocab; ++i) m = std::max(m, value(logits[i]));
  // The terms e^(x - m) <= 1 in float (exp of a float), summed in double: each term within an ulp
  // of float, the sum's own error far below it.
  double sum = 0;
  if (std::isfinite(m))
    for (int32_t i = 0; i < n_vocab; ++i) sum += double(std::exp(value(logits[i]) - m));
  // (x - m) - log(sum): exact where x is the largest, whatever the logits' size.
  const double log_sum = std::isfinite(m) ? std::log(sum) : 0;
  auto logprob = [&](int32_t i) {
    return std::isfinite(m) ? float(double(value(logits[i]) - m) - log_sum) : -INFINITY;
  };
  TokenLogprob out;
  out.token = token;
  out.logprob = logprob(token);
  if (top > 0) {
    // The `top` most likely in one pass: a heap whose front is the least likely kept.
    const auto likelier = [&](int32_t a, int32_t b) {
      const float va = value(logits[a]), vb = value(logits[b]);
      return va > vb || (va == vb && a < b);
    };
    std::vector<int32_t> kept;
    kept.reserve(size_t(top) + 1);
    for (int32_t i = 0; i < n_vocab; ++i) {
      if (int32_t(kept.size()) == top && !likelier(i, kept.front())) continue;
      kept.push_back(i);
      std::push_heap(kept.begin(), kept.end(), likelier);
      if (int32_t(kept.size()) > top) {
        std::pop_heap(kept.begin(), kept.end(), likelier);
        kept.pop_back();
      }
    }
    std::sort(kept.begin(), kept.end(), likelier);
    for (int32_t i : kept) out.top.emplace_back(i, logprob(i));
  }
  return out;
}

void check_sampler_params(const SamplerParams& params) {
  if (!(params.temperature >= 0.f) || !std::isfinite(params.temperature))
    fail(StatusCode::kInvalidArgument, "temperature must be a finite number >= 0");
  if (params.top_k < 0) fail(StatusCode::kInvalidArgument, "top-k must be >= 0");
  if (!(params.top_p > 0.f && params.top_p <= 1.f)) fail(StatusCode::kInvalidArgument, "top-p must be in (0, 1]");
}

double sample_uniform(uint64_t seed, uint64_t draw) {
  // SplitMix64 (Steele, Lea, Flood 2014): the finalizer of the draw-th state of the seed's stream.
  uint64_t z = seed + (draw + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

float sample_key(float logit, float temperature) {
  const float x = logit / temperature + 0.f;  // + 0.f: -0 becomes +0
  return std::isnan(x) ? -INFINITY : x;
}

int32_t sample_token(const float* logits, int32_t n_vocab, const SamplerParams& params, double u,
                     std::vector<std::pair<float, int32_t>>* scratch) {
  if (n_vocab < 1) fail(StatusCode::kInvalidArgument, "sampling needs at least one logit");
  if (sample_greedy(params)) return argmax(logits, n_vocab);

  std::vector<std::pair<float, int32_t>> local;
  std::vector<std::pair<float, int32_t>>& candidates = scratch ? *scratch : local;
  candidates.resize(size_t(n_vocab));
  for (int32_t i = 0; i < n_vocab; ++i) candidates[size_t(i)] = {sample_key(logits[i], params.temperature), i};
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t n = candidates.size();
  if (params.top_k > 0 && size_t(params.top_k) < n) {
    std::partial_sort(candidates.begin(), candidates.begin() + params.top_k, candidates.end(), by_logit);
    n = size_t(params.top_k);
  } else {
    std::sort(candidates.begin(), candidates.end(), by_logit);
  }
  const float max_x = candidates[0].first;
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += std::exp(double(candidates[i].first - max_x));
  // Nucleus: the shortest prefix whose mass reaches top_p.
  size_t keep = n;
  double kept = total;
  if (params.top_p < 1.f) {
    double mass = 0;
    for (size_t i = 0; i < n; ++i) {
      mass += std::exp(double(candidates[i].first - max_x));
      if (mass / total >= params.top_p) {
        keep = i + 1;
        kept = mass;
        break;
      }
    }
  }
  const double r = u * kept;
  double cumulative = 0;
  size_t last_positive = 0;
  for (size_t i = 0; i < keep; ++i) {
    const double w = std::exp(double(candidates[i].first - max_x));
    cumulative += w;
    if (cumulative > r) return candidates[i].second;
    if (w > 0) last_positive = i;
  }
  return candidates[last_positive].second;
}

Sampler::Sampler(const SamplerParams& params) : params_(params) { check_sampler_params(params); }

int32_t Sampler::sample(const float* logits, int32_t n_vocab) {
  return sample_token(logits, n_vocab, params_, sample_uniform(params_.seed, draws_++), &candidates_);
}

}  // namespace certkv::model
