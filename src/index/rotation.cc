#include "index/rotation.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/status.h"

namespace certkv::index {
namespace {

bool is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// In-place unnormalized Walsh-Hadamard transform: x <- H x. x: [n], n a power of two.
void walsh_hadamard(float* x, int n) {
  for (int half = 1; half < n; half *= 2) {
    for (int base = 0; base < n; base += 2 * half) {
      for (int i = base; i < base + half; ++i) {
        const float a = x[i];
        const float b = x[i + half];
        x[i] = a + b;
        x[i + half] = a - b;
      }
    }
  }
}

// Haar P (Mezzadri 2007): A Gaussian, A = Q R with diag(R) > 0, P = Q. Modified Gram-Schmidt run
// twice per column keeps Q orthogonal to double rounding; dividing by ||v|| > 0 is the sign fix.
std::vector<double> haar_matrix(int dim, uint64_t seed) {
  const size_t d = static_cast<size_t>(dim);
  std::vector<double> q(d * d);  // column-major: column j at q[j * d]
  for (size_t j = 0; j < d; ++j) {
    double* v = &q[j * d];
    for (size_t i = 0; i < d; ++i) v[i] = counter_standard_normal(seed, j * d + i);
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t c = 0; c < j; ++c) {
        const double* u = &q[c * d];
        double dot = 0.0;
        for (size_t i = 0; i < d; ++i) dot += u[i] * v[i];
        for (size_t i = 0; i < d; ++i) v[i] -= dot * u[i];
      }
    }
    double norm2 = 0.0;
    for (size_t i = 0; i < d; ++i) norm2 += v[i] * v[i];
    const double inv_norm = 1.0 / std::sqrt(norm2);
    for (size_t i = 0; i < d; ++i) v[i] *= inv_norm;
  }
  std::vector<double> p(d * d);  // row-major
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) p[i * d + j] = q[j * d + i];
  }
  return p;
}

}  // namespace

double counter_standard_normal(uint64_t seed, uint64_t counter) {
  const double u1 = counter_uniform(seed, 2 * counter);
  const double u2 = counter_uniform(seed, 2 * counter + 1);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

const char* rotation_kind_name(RotationKind kind) {
  switch (kind) {
    case RotationKind::kHaar:
      return "haar";
    case RotationKind::kRandomizedHadamard:
      return "randomized_hadamard";
  }
  return "unknown";
}

Rotation::Rotation(RotationKind kind, int dim, uint64_t seed) : kind_(kind), dim_(dim), seed_(seed) {
  if (dim <= 0) {
    fail(StatusCode::kInvalidArgument, "Rotation: dim must be > 0, got " + std::to_string(dim));
  }
  const size_t d = static_cast<size_t>(dim);
  switch (kind) {
    case RotationKind::kHaar: {
      const std::vector<double> p = haar_matrix(dim, seed);
      p_transpose_.resize(d * d);
      for (size_t i = 0; i < d; ++i) {
        for (size_t j = 0; j < d; ++j) p_transpose_[j * d + i] = static_cast<float>(p[i * d + j]);
      }
      return;
    }
    case RotationKind::kRandomizedHadamard: {
      if (!is_power_of_two(dim)) {
        fail(StatusCode::kInvalidArgument,
             "Rotation: randomized_hadamard needs dim a power of two, got " + std::to_string(dim));
      }
      signs_.resize(3 * d);
      for (size_t i = 0; i < 3 * d; ++i) {
        signs_[i] = (counter_random_u64(seed, i) >> 63) != 0 ? -1.0f : 1.0f;
      }
      return;
    }
  }
  fail(StatusCode::kInvalidArgument,
       "Rotation: unknown kind " + std::to_string(static_cast<int>(kind)));
}

void Rotation::rotate(const float* x, float* y) const {
  if (x == nullptr || y == nullptr) fail(StatusCode::kInvalidArgument, "Rotation::rotate: null x or y");
  const size_t d = static_cast<size_t>(dim_);
  if (kind_ == RotationKind::kHaar) {
    for (size_t j = 0; j < d; ++j) {
      const float* row = &p_transpose_[j * d];
      float acc = 0.0f;
      for (size_t i = 0; i < d; ++i) acc += row[i] * x[i];
      y[j] = acc;
    }
    return;
  }
  // P^T = S_3 H S_2 H S_1 H / D^(3/2)  (H and S_i are symmetric).
  std::memcpy(y, x, d * sizeof(float));
  const float* s1 = &signs_[0];
  const float* s2 = &signs_[d];
  const float* s3 = &signs_[2 * d];
  walsh_hadamard(y, dim_);
  for (size_t i = 0; i < d; ++i) y[i] *= s1[i];
  walsh_hadamard(y, dim_);
  for (size_t i = 0; i < d; ++i) y[i] *= s2[i];
  walsh_hadamard(y, dim_);
  const float scale = static_cast<float>(1.0 / (static_cast<double>(dim_) * std::sqrt(static_cast<double>(dim_))));
  for (size_t i = 0; i < d; ++i) y[i] *= s3[i] * scale;
}

std::vector<double> Rotation::matrix() const {
  const size_t d = static_cast<size_t>(dim_);
  if (kind_ == RotationKind::kHaar) return haar_matrix(dim_, seed_);
  // P = H S_1 H S_2 H S_3 / D^(3/2), H[i][j] = (-1)^popcount(i & j).
  auto h = [](size_t i, size_t j) { return (__builtin_popcountll(i & j) & 1) ? -1.0 : 1.0; };
  std::vector<double> p(d * d), next(d * d);
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) p[i * d + j] = h(i, j) * signs_[j];  // H S_1
  }
  for (int stage = 1; stage < 3; ++stage) {
    const float* s = &signs_[stage * d];
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) {
        double acc = 0.0;
        for (size_t m = 0; m < d; ++m) acc += p[i * d + m] * h(m, j);
        next[i * d + j] = acc * s[j];
      }
    }
    p.swap(next);
  }
  const double scale = 1.0 / (static_cast<double>(dim_) * std::sqrt(static_cast<double>(dim_)));
  for (double& v : p) v *= scale;
  return p;
}

}  // namespace certkv::index
