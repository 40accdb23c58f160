// Helpers of the backend and engine tests: ragged prompts, a batched run through any backend
// (make_backend: the CPU or the CUDA backend), and a bit-for-bit comparison of logits.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/model.h"
#include "model/sampler.h"

namespace certkv::testing {

using backend::BackendConfig;
using backend::BatchItem;

// Ragged prompts of distinct tokens (deterministic).
inline std::vector<std::vector<int32_t>> ragged_prompts(const model::Model& m, std::vector<int> lengths,
                                                 uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> tok(3, std::min(m.config().n_vocab, 4000) - 1);
  std::vector<std::vector<int32_t>> out;
  for (int n : lengths) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t& t : p) t = tok(rng);
    p[0] = 1;
    out.push_back(std::move(p));
  }
  return out;
}

// Runs the prompts through one backend, then decode_steps greedy tokens each; returns per
// sequence the logits of every forward that ended its input, concatenated. chunk: prompt tokens
// per step of each sequence; rotate: the batch order turns by one each step. memory: the
// backend's memory_stats at the end, every sequence still live (null: not wanted).
inline std::vector<std::vector<float>> run_batched(const model::Model& m, const BackendConfig& cfg,
                                            const std::vector<std::vector<int32_t>>& prompts,
                                            const std::vector<int>& chunk, bool rotate, int decode_steps,
                                            cache::MemoryStats* memory = nullptr) {
  std::unique_ptr<backend::Backend> be = backend::make_backend(m, cfg);
  const int32_t nv = m.config().n_vocab;
  const size_t n = prompts.size();
  std::vector<cache::SeqId> seqs;
  for (size_t i = 0; i < n; ++i) seqs.push_back(be->create_sequence());
  std::vector<std::vector<int32_t>> tokens = prompts;
  std::vector<int64_t> done(n, 0);
  std::vector<int> decoded(n, 0);
  std::vector<std::vector<float>> out(n);
  std::vector<float> logits(n * size_t(nv));
  for (int step = 0;; ++step) {
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = rotate ? (i + size_t(step)) % n : i;
    std::vector<BatchItem> items;
    std::vector<size_t> who;
    for (size_t i : order) {
      const int64_t left = int64_t(tokens[i].size()) - done[i];
      if (left == 0) continue;
      BatchItem it;
      it.seq = seqs[i];
      it.tokens = tokens[i].data() + done[i];
      it.n = std::min<int64_t>(left, chunk[i]);
      it.end_of_input = done[i] + it.n == int64_t(tokens[i].size());
      it.last_logits = it.end_of_input ? &logits[items.size() * size_t(nv)] : nullptr;
      items.push_back(it);
      who.push_back(i);
    }
    if (items.empty()) break;
    be->forward(items);
    for (size_t j = 0; j < items.size(); ++j) {
      const size_t i = who[j];
      done[i] += items[j].n;
      if (!items[j].last_logits) continue;
      out[i].insert(out[i].end(), items[j].last_logits, items[j].last_logits + nv);
      if (decoded[i]++ < decode_steps) tokens[i].push_back(model::argmax(items[j].last_logits, nv));
    }
  }
  if (memory != nullptr) *memory = be->memory_stats();
  return out;
}

inline void expect_bit_identical(const std::vector<std::vector<float>>& a,
                          const std::vector<std::vector<float>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << what << " sequence " << i;
    ASSERT_FALSE(a[i].empty());
    for (float x : a[i]) ASSERT_TRUE(std::isfinite(x)) << what;
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)), 0)
        << what << ": sequence " << i << " differs";
  }
}

// Draws in the step (BatchItem::token) against the host's definition: sequences with ragged
// prompts and assorted sampling parameters run a prefill and `steps` decode steps through the
// backend, each drawing its next token there; the items that also take their logits check the
// token against model::sample_token of those logits with the draw's uniform, and a twin of each
// sequence (the same prompt and parameters) that draws without taking logits draws the same token
// (its logits are the same bits: batch invariance).
inline void expect_draws_as_the_host(const model::Model& m, const BackendConfig& cfg, int steps) {
  std::unique_ptr<backend::Backend> be = backend::make_backend(m, cfg);
  const int32_t nv = m.config().n_vocab;
  std::vector<model::SamplerParams> params(5);
  params[1].temperature = 0.8f, params[1].top_k = 40, params[1].seed = 7;
  params[2].temperature = 1.2f, params[2].top_p = 0.9f, params[2].seed = 8;
  params[3].temperature = 0.5f, params[3].top_k = 5, params[3].top_p = 0.7f, params[3].seed = 9;
  params[4].temperature = 2.f, params[4].seed = 10;
  const std::vector<std::vector<int32_t>> prompts = ragged_prompts(m, {7, 30, 2, 40, 15}, 21);
  const size_t n = prompts.size();
  std::vector<cache::SeqId> seqs, twins;
  for (size_t i = 0; i < n; ++i) {
    seqs.push_back(be->create_sequence());
    twins.push_back(be->create_sequence());
  }
  std::vector<std::vector<int32_t>> inputs = prompts;
  std::vector<float> logits(n * size_t(nv));
  std::vector<int32_t> drawn(n), twin_drawn(n);
  int64_t sampled_draws = 0;
  for (int step = 0; step <= steps; ++step) {
    std::vector<BatchItem> items;
    for (size_t i = 0; i < n; ++i)
      for (int twin = 0; twin < 2; ++twin) {
        BatchItem it;
        it.seq = twin ? twins[i] : seqs[i];
        it.tokens = inputs[i].data();
        it.n = int64_t(inputs[i].size());
        it.last_logits = twin ? nullptr : &logits[i * size_t(nv)];
        it.token = twin ? &twin_drawn[i] : &drawn[i];
        it.sampling = params[i];
        it.draw = uint64_t(step);
        items.push_back(it);
      }
    // Twins and sequences in turned orders: positions in the batch differ every step.
    std::rotate(items.begin(), items.begin() + (step % int(items.size())), items.end());
    be->forward(items);
    for (size_t i = 0; i < n; ++i) {
      const int32_t want = model::sample_token(&logits[i * size_t(nv)], nv, params[i],
                                               model::sample_uniform(params[i].seed, uint64_t(step)));
      EXPECT_EQ(drawn[i], want) << "sequence " << i << " step " << step;
      EXPECT_EQ(twin_drawn[i], drawn[i]) << "the twin of sequence " << i << " step " << step;
      sampled_draws += params[i].temperature > 0.f;
      inputs[i] = {drawn[i]};
    }
  }
  EXPECT_EQ(sampled_draws, int64_t(4) * (steps + 1));
  // Bad sampling parameters are refused before the step changes anything.
  BatchItem bad;
  bad.seq = seqs[0];
  bad.tokens = inputs[0].data();
  bad.n = 1;
  int32_t token = -1;
  bad.token = &token;
  bad.sampling.temperature = 1.f;
  bad.sampling.top_p = 0.f;
  const int64_t before = be->length(seqs[0]);
  EXPECT_THROW(be->forward({&bad, 1}), Error);
  EXPECT_EQ(be->length(seqs[0]), before);
  EXPECT_EQ(token, -1);
}

}  // namespace certkv::testing
