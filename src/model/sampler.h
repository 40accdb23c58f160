// Picks the next token from logits: greedy, or temperature with optional top-k and top-p
// (nucleus, Holtzman et al. 2020) truncation. A seeded stream of draws is counter-based: draw i of
// seed s uses the uniform sample_uniform(s, i), so a token depends on its logits, the parameters
// and its draw's index only, and any backend that implements sample_token draws the same tokens
// from the same logits (the CUDA backend does, on the device: backend/cuda/sample_kernels.h).
//
// sample_token's definition: greedy (argmax, lowest id on ties) for a temperature below
// kGreedyTemperature, 0 included (logit / T would leave float's range as T nears 0, and the
// draws tend to the argmax anyway); for temperature T >= kGreedyTemperature:
//   x_i = sample_key(logit_i, T) (float division, -0 as +0, NaN as -inf); candidates sorted by x
//   descending, lower id first on equal x; the first top_k of them when top_k > 0; w_i = exp(double(x_i -
//   x_0)) (float subtraction, double exp); with top_p < 1 the shortest prefix whose cumulative
//   mass sum w / W reaches top_p (W the sum over the candidates); then r = u * (sum of the kept
//   w) and the first kept candidate whose cumulative w exceeds r; if none does (rounding), the
//   last kept candidate whose w is positive (the first candidate if none is: NaN weights).
// Thread safety: sample_uniform and sample_token are pure; a Sampler is used by one thread at a
// time.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace certkv::model {

// Temperatures below this sample greedily (sample_greedy).
inline constexpr float kGreedyTemperature = 1e-6f;

struct SamplerParams {
  float temperature = 0.f;  // below kGreedyTemperature (0 included): greedy (argmax, lowest id on ties)
  int top_k = 0;            // 0: no limit
  float top_p = 1.f;        // in (0, 1]
  uint64_t seed = 0;
};

// Whether params draw greedily (temperature below kGreedyTemperature): every backend's test.
inline bool sample_greedy(const SamplerParams& params) { return params.temperature < kGreedyTemperature; }

// A candidate's sort key: logit / temperature, -0 as +0 and NaN as -inf (so that the keys are
// totally ordered).
float sample_key(float logit, float temperature);

// Throws certkv::Error kInvalidArgument for a negative or non-finite temperature, a negative
// top_k, or top_p outside (0, 1].
void check_sampler_params(const SamplerParams& params);

// The uniform in [0, 1) of draw `draw` of stream `seed`: 53 bits of a SplitMix64 finalizer of
// (seed, draw), a multiple of 2^-53.
double sample_uniform(uint64_t seed, uint64_t draw);

// The token params draw from logits [n_vocab] with uniform u in [0, 1) (the definition above).
// scratch: candidate storage reused between calls (may be null). REQUIRES: n_vocab >= 1 (else
// kInvalidArgument), params checked.
int32_t sample_token(const float* logits, int32_t n_vocab, const SamplerParams& params, double u,
                     std::vector<std::pair<float, int32_t>>* scratch = nullptr);

// A request's stream of draws: sample() uses draw draws() and counts it.
class Sampler {
 public:
  // Throws as check_sampler_params.
  explicit Sampler(const SamplerParams& params);
  // logits: [n_vocab]. REQUIRES: n_vocab >= 1.
  int32_t sample(const float* logits, int32_t n_vocab);
  const SamplerParams& params() const { return params_; }
  // Draws made so far (the index of the next one).
  uint64_t draws() const { return draws_; }
  // Counts a draw made elsewhere (a backend that sampled the token: BatchItem::draw).
  void count_draw() { ++draws_; }

 private:
  SamplerParams params_;
  uint64_t draws_ = 0;
  std::vector<std::pair<float, int32_t>> candidates_;
};

int32_t argmax(const float* logits, int32_t n);

// The most alternatives token_logprobs reports (OpenAI's top_logprobs go to 20).
inline constexpr int32_t kMaxTopLogprobs = 20;

// A token's log-probability under the model's distribution at its position (the log-softmax of
// the raw logits, whatever the sampler's temperature or truncation), with the `top` most likely
// tokens and theirs.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first, lower id first on ties
};

// m = the largest logit, logprob_i = (logit_i - m) - log(sum_j exp(logit_j - m)) (the exponentials
// in float, summed in double), rounded to float; a NaN logit counts as -inf; all of them -inf, or
// one +inf: every logprob -inf or NaN (no distribution to speak of). REQUIRES: n_vocab >= 1, token in [0, n_vocab),
// top in [0, kMaxTopLogprobs] (else kInvalidArgument).
TokenLogprob token_logprob(const float* logits, int32_t n_vocab, int32_t token, int32_t top);

}  // namespace certkv::model
