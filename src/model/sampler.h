// Picks the next token from logits: greedy, or temperature with optional top-k and top-p
// (nucleus, Holtzman et al. 2020) truncation, from a seeded generator (same seed, same tokens).
// Thread safety: a Sampler is used by one thread at a time.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace certkv::model {

struct SamplerParams {
  float temperature = 0.f;  // 0: greedy (argmax, lowest id on ties)
  int top_k = 0;            // 0: no limit
  float top_p = 1.f;        // in (0, 1]
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws certkv::Error kInvalidArgument for a negative temperature or top_k, or top_p outside (0, 1].
  explicit Sampler(const SamplerParams& params);
  // logits: [n_vocab]. REQUIRES: n_vocab >= 1.
  int32_t sample(const float* logits, int32_t n_vocab);

 private:
  SamplerParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

int32_t argmax(const float* logits, int32_t n);

}  // namespace certkv::model
