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
// per step of each sequence; rotate: the batch order turns by one each step.
inline std::vector<std::vector<float>> run_batched(const model::Model& m, const BackendConfig& cfg,
                                            const std::vector<std::vector<int32_t>>& prompts,
                                            const std::vector<int>& chunk, bool rotate, int decode_steps) {
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

}  // namespace certkv::testing
