// KeyIndex: record storage in whole index pages, the estimator against its reference, the
// indexed prefix, accounting, and bad input.
#include "cache/key_index.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/status.h"

namespace certkv::cache {
namespace {

KeyIndexConfig config(int head_dim, int page_records = 16,
                      index::RotationKind rotation = index::RotationKind::kHaar) {
  KeyIndexConfig c;
  c.n_layers = 2;
  c.n_kv_heads = 3;
  c.head_dim = head_dim;
  c.page_records = page_records;
  c.rotation = rotation;
  return c;
}

std::vector<float> normal(size_t n, std::mt19937& rng, float mean = 0.f) {
  std::normal_distribution<float> dist(mean, 1.f);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

TEST(KeyIndex, EstimatesAgreeWithTheReferenceAndTrackTheTruth) {
  for (int d : {32, 64, 96, 128, 256}) {
    for (auto rotation : {index::RotationKind::kHaar, index::RotationKind::kRandomizedHadamard}) {
      if (rotation == index::RotationKind::kRandomizedHadamard && d == 96) continue;
      std::mt19937 rng(static_cast<uint32_t>(d));
      KeyIndex idx(config(d, 16, rotation));
      idx.set_centroids(1, 2, normal(size_t(d), rng, 0.2f), normal(size_t(d), rng, 0.5f));
      const int64_t n = 501;
      const std::vector<float> k = normal(size_t(n) * size_t(d), rng, 0.5f);
      // Ragged appends.
      int64_t done = 0;
      for (int64_t step : {1, 16, 17, 3, 464})
        if (done < n) {
          const int64_t m = std::min(step, n - done);
          idx.append(1, 2, k.data() + size_t(done) * size_t(d), m);
          done += m;
        }
      ASSERT_EQ(idx.indexed_tokens(1, 2), n);
      EXPECT_EQ(idx.indexed_tokens(0, 0), 0);
      const std::vector<float> q = normal(size_t(d), rng);
      std::vector<float> est(static_cast<size_t>(n)), ref(static_cast<size_t>(n));
      float qn = 0;
      idx.estimate_scores(1, 2, q.data(), 7, est.data(), &qn);
      idx.estimate_scores_ref(1, 2, q.data(), 7, ref.data());
      // The error of the cosine estimate, est - <q, k> over ||q - c_q|| ||k - c_k||, has rms
      // about sqrt(pi/2 - 1) / sqrt(D) = 0.76 / sqrt(D) (Theorem A.1 of the seed).
      double err2 = 0;
      for (int64_t t = 0; t < n; ++t) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(q[size_t(c)]) * k[size_t(t) * size_t(d) + size_t(c)];
        EXPECT_NEAR(est[size_t(t)], ref[size_t(t)], 1e-3 * (1 + std::fabs(ref[size_t(t)])));
        const double e = (est[size_t(t)] - dot) / (double(qn) * idx.key_norm_centered(1, 2, t));
        err2 += e * e;
      }
      const double rms_sqrt_d = std::sqrt(err2 / double(n) * d);
      EXPECT_GT(rms_sqrt_d, 0.4) << "d " << d;
      EXPECT_LT(rms_sqrt_d, 1.1) << "d " << d;
      EXPECT_GT(qn, 0.f);
      EXPECT_GT(idx.key_norm_centered(1, 2, 0), 0.f);
      // The strided view of the norms holds every token's key_norm_centered.
      int64_t stride = 0;
      const float* norms = idx.key_norms(1, 2, &stride);
      EXPECT_EQ(size_t(stride) * sizeof(float), idx.record_bytes()) << "d " << d;
      for (int64_t t = 0; t < n; ++t) ASSERT_EQ(norms[t * stride], idx.key_norm_centered(1, 2, t)) << "d " << d;
    }
  }
}

TEST(KeyIndex, BytesCountWholePagesAndTheHeads) {
  const int d = 64;
  std::mt19937 rng(3);
  KeyIndex idx(config(d, 16));
  EXPECT_EQ(idx.bytes(), 0u);
  EXPECT_EQ(idx.record_bytes(), 24u);
  idx.set_centroids(0, 0, normal(d, rng), normal(d, rng));
  const uint64_t head_bytes = 2 * d * sizeof(float) + uint64_t(d) * d * sizeof(float);
  EXPECT_EQ(idx.bytes(), head_bytes);
  const std::vector<float> k = normal(size_t(17) * d, rng);
  idx.append(0, 0, k.data(), 17);  // 17 records take 2 pages
  EXPECT_EQ(idx.bytes(), head_bytes + 2 * 16 * 24);
  idx.set_centroids(0, 0, normal(d, rng), normal(d, rng));  // drops the records
  EXPECT_EQ(idx.indexed_tokens(0, 0), 0);
  EXPECT_EQ(idx.bytes(), head_bytes);
  idx.clear();
  EXPECT_EQ(idx.bytes(), 0u);
  EXPECT_FALSE(idx.has_centroids(0, 0));
}

TEST(KeyIndex, BadInput) {
  std::mt19937 rng(4);
  EXPECT_THROW(KeyIndex(config(48)), Error);
  EXPECT_THROW(KeyIndex(config(96, 16, index::RotationKind::kRandomizedHadamard)), Error);
  EXPECT_THROW(KeyIndex(config(64, 0)), Error);
  KeyIndexConfig zero = config(64);
  zero.n_kv_heads = 0;
  EXPECT_THROW(KeyIndex{zero}, Error);
  KeyIndex idx(config(64));
  const std::vector<float> k = normal(64, rng);
  EXPECT_THROW(idx.append(0, 0, k.data(), 1), Error);  // no centroids
  EXPECT_THROW(idx.set_centroids(2, 0, normal(64, rng), normal(64, rng)), Error);
  EXPECT_THROW(idx.set_centroids(0, 3, normal(64, rng), normal(64, rng)), Error);
  EXPECT_THROW(idx.set_centroids(0, 0, normal(63, rng), normal(64, rng)), Error);
  idx.set_centroids(0, 0, normal(64, rng), normal(64, rng));
  EXPECT_THROW(idx.append(0, 0, nullptr, 1), Error);
  EXPECT_THROW(idx.append(0, 0, k.data(), -1), Error);
  std::vector<float> bad = k;
  bad[3] = NAN;
  EXPECT_THROW(idx.append(0, 0, bad.data(), 1), Error);
  EXPECT_THROW(idx.key_norm_centered(0, 0, 0), Error);
  int64_t stride = 0;
  EXPECT_THROW(idx.key_norms(0, 0, nullptr), Error);
  EXPECT_THROW(idx.key_norms(0, 5, &stride), Error);
  EXPECT_THROW(parse_rotation_kind("qr"), Error);
  EXPECT_EQ(parse_rotation_kind("hadamard"), index::RotationKind::kRandomizedHadamard);
}

}  // namespace
}  // namespace certkv::cache
