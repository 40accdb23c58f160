#include "index/rotation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/status.h"

namespace certkv::index {
namespace {

std::vector<float> gaussian_vector(int dim, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(dim));
  for (int i = 0; i < dim; ++i) x[i] = static_cast<float>(counter_standard_normal(seed, i));
  return x;
}

double norm(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

struct Case {
  RotationKind kind;
  int dim;
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int dim : {32, 64, 96, 128, 256}) cases.push_back({RotationKind::kHaar, dim});
  for (int dim : {32, 64, 128, 256}) cases.push_back({RotationKind::kRandomizedHadamard, dim});
  return cases;
}

TEST(CounterGenerator, KnownMomentsAndIndependentStreams) {
  const int n = 200000;
  double sum = 0.0, sum2 = 0.0, sum4 = 0.0;
  for (int i = 0; i < n; ++i) {
    const double z = counter_standard_normal(7, i);
    sum += z;
    sum2 += z * z;
    sum4 += z * z * z * z;
  }
  // Standard errors: mean 1/sqrt(n), E z^2 sqrt(2/n), E z^4 sqrt(96/n); 5 sigma margins.
  EXPECT_NEAR(sum / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(sum2 / n, 1.0, 5.0 * std::sqrt(2.0 / n));
  EXPECT_NEAR(sum4 / n, 3.0, 5.0 * std::sqrt(96.0 / n));
  int equal = 0;
  for (int i = 0; i < 1000; ++i) equal += counter_random_u64(1, i) == counter_random_u64(2, i);
  EXPECT_EQ(equal, 0);
  // Known answers pin the stream across machines and compilers.
  EXPECT_EQ(counter_random_u64(0, 0), 12035550249420947055ull);
  EXPECT_EQ(counter_random_u64(12345, 7), 14360108673706422801ull);
  EXPECT_NEAR(counter_standard_normal(1, 0), 1.3256718696671204, 1e-14);
}

TEST(Rotation, OrthogonalWithinTolerance) {
  for (const Case& c : all_cases()) {
    const Rotation rot(c.kind, c.dim, 1234);
    const std::vector<double> p = rot.matrix();
    double worst = 0.0;
    for (int a = 0; a < c.dim; ++a) {
      for (int b = 0; b < c.dim; ++b) {
        double dot = 0.0;  // (P^T P)[a][b]
        for (int i = 0; i < c.dim; ++i) dot += p[i * c.dim + a] * p[i * c.dim + b];
        worst = std::max(worst, std::abs(dot - (a == b ? 1.0 : 0.0)));
      }
    }
    EXPECT_LT(worst, 1e-5) << rotation_kind_name(c.kind) << " dim " << c.dim;
  }
}

TEST(Rotation, RotateMatchesDenseMatrixAndPreservesNorm) {
  for (const Case& c : all_cases()) {
    const Rotation rot(c.kind, c.dim, 99);
    const std::vector<double> p = rot.matrix();
    for (uint64_t s = 0; s < 4; ++s) {
      const std::vector<float> x = gaussian_vector(c.dim, 1000 + s);
      std::vector<float> y(c.dim);
      rot.rotate(x.data(), y.data());
      const double x_norm = norm(x);
      for (int j = 0; j < c.dim; ++j) {
        double expect = 0.0;
        for (int i = 0; i < c.dim; ++i) expect += p[i * c.dim + j] * x[i];
        ASSERT_NEAR(y[j], expect, 2e-5 * x_norm) << rotation_kind_name(c.kind) << " dim " << c.dim;
      }
      EXPECT_NEAR(norm(y), x_norm, 1e-5 * x_norm);
    }
  }
}

TEST(Rotation, DeterministicFromSeedAndDistinctAcrossSeeds) {
  for (const Case& c : all_cases()) {
    const std::vector<float> x = gaussian_vector(c.dim, 5);
    std::vector<float> y1(c.dim), y2(c.dim), y3(c.dim);
    Rotation(c.kind, c.dim, 42).rotate(x.data(), y1.data());
    Rotation(c.kind, c.dim, 42).rotate(x.data(), y2.data());
    Rotation(c.kind, c.dim, 43).rotate(x.data(), y3.data());
    EXPECT_EQ(y1, y2);
    double diff = 0.0;
    for (int i = 0; i < c.dim; ++i) diff += std::abs(y1[i] - y3[i]);
    EXPECT_GT(diff, 0.1) << rotation_kind_name(c.kind) << " dim " << c.dim;
  }
}

// For P Haar and a fixed unit x, y = P^T x is uniform on the sphere, so y_1^2 ~ Beta(1/2, (D-1)/2):
// mean 1/D, variance 2 (D - 1) / (D^2 (D + 2)). Also E[y_1] = 0.
TEST(Rotation, HaarFirstCoordinateFollowsBetaLaw) {
  for (int dim : {32, 64}) {
    const int n = 3000;
    std::vector<float> x(dim, 0.0f);
    x[dim / 3] = 0.6f;
    x[dim - 1] = 0.8f;  // unit vector, not a basis vector
    std::vector<float> y(dim);
    double sum_y = 0.0, sum_b = 0.0, sum_b2 = 0.0;
    for (int s = 0; s < n; ++s) {
      Rotation(RotationKind::kHaar, dim, 5000 + s).rotate(x.data(), y.data());
      const double b = static_cast<double>(y[0]) * y[0];
      sum_y += y[0];
      sum_b += b;
      sum_b2 += b * b;
    }
    const double d = dim;
    const double mean_b = 1.0 / d;
    const double var_b = 2.0 * (d - 1.0) / (d * d * (d + 2.0));
    const double sample_mean = sum_b / n;
    const double sample_var = sum_b2 / n - sample_mean * sample_mean;
    EXPECT_NEAR(sum_y / n, 0.0, 5.0 * std::sqrt(mean_b / n));
    EXPECT_NEAR(sample_mean, mean_b, 5.0 * std::sqrt(var_b / n)) << "dim " << dim;
    // Fourth moment of y_1^2 (Beta): E b^2 = 3 / (D (D + 2)); var(b^2) bounded by E b^4 =
    // 105 / (D (D+2)(D+4)(D+6)); a 5-sigma band on E b^2 carries the variance check.
    const double e_b2 = 3.0 / (d * (d + 2.0));
    const double e_b4 = 105.0 / (d * (d + 2.0) * (d + 4.0) * (d + 6.0));
    EXPECT_NEAR(sum_b2 / n, e_b2, 5.0 * std::sqrt(e_b4 / n)) << "dim " << dim;
    EXPECT_NEAR(sample_var, var_b, 0.25 * var_b) << "dim " << dim;
  }
}

TEST(Rotation, BadInputIsAnError) {
  EXPECT_THROW(Rotation(RotationKind::kHaar, 0, 1), Error);
  EXPECT_THROW(Rotation(RotationKind::kHaar, -4, 1), Error);
  EXPECT_THROW(Rotation(RotationKind::kRandomizedHadamard, 0, 1), Error);
  EXPECT_THROW(Rotation(RotationKind::kRandomizedHadamard, 96, 1), Error);
  EXPECT_THROW(Rotation(RotationKind::kRandomizedHadamard, 3, 1), Error);
  EXPECT_THROW(Rotation(static_cast<RotationKind>(7), 64, 1), Error);
  const Rotation rot(RotationKind::kHaar, 32, 1);
  std::vector<float> y(32);
  EXPECT_THROW(rot.rotate(nullptr, y.data()), Error);
  try {
    Rotation(RotationKind::kRandomizedHadamard, 96, 1);
    FAIL() << "expected certkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("dim"), std::string::npos);
  }
}

}  // namespace
}  // namespace certkv::index
