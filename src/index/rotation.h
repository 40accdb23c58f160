// Random orthogonal rotations for the RaBitQ key index (DESIGN.md section 5, seed 002 section 3.2).
// A Rotation is a D x D orthogonal matrix P built once from a recorded 64-bit seed; the index and
// the query side both apply P^T. The matrix is a pure function of (kind, dim, seed): the random
// numbers come from a counter-based generator and a Box-Muller transform written here, so the
// same seed gives the same matrix with every compiler and standard library.
// Thread safety: a constructed Rotation is immutable; rotate() may be called concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "index/counter_random.h"

namespace certkv::index {

// Standard normal by Box-Muller from the uniforms at counters 2*counter and 2*counter + 1.
double counter_standard_normal(uint64_t seed, uint64_t counter);

enum class RotationKind : uint8_t {
  // Haar-distributed P: Gram-Schmidt QR of a Gaussian matrix with R's diagonal made positive
  // (the sign correction of Mezzadri 2007). O(D^2) per rotate, any D >= 1.
  kHaar = 0,
  // P = H S_1 H S_2 H S_3 / D^(3/2), H the D x D Sylvester-Hadamard matrix (entries +-1) and S_i
  // random sign diagonals. O(D log D) per rotate by the Walsh-Hadamard transform; D a power of 2.
  kRandomizedHadamard = 1,
};

const char* rotation_kind_name(RotationKind kind);

class Rotation {
 public:
  // REQUIRES: dim > 0; dim a power of two for kRandomizedHadamard (else certkv::Error
  // kInvalidArgument).
  Rotation(RotationKind kind, int dim, uint64_t seed);

  RotationKind kind() const { return kind_; }
  int dim() const { return dim_; }
  uint64_t seed() const { return seed_; }

  // y = P^T x.  x, y: [dim]; REQUIRES: x and y do not overlap (null -> certkv::Error).
  void rotate(const float* x, float* y) const;

  // P itself, row-major: P[i * dim + j]. Computed independently of rotate() for the Hadamard kind
  // (explicit matrix products), so tests can compare the two.
  std::vector<double> matrix() const;

  // What rotate() applies, for a port to another device: kHaar, P^T as floats, row-major
  // [dim][dim]; kRandomizedHadamard, the signs S_1, S_2, S_3 as +-1, [3][dim] (the other kind's
  // vector is empty).
  const std::vector<float>& p_transpose() const { return p_transpose_; }
  const std::vector<float>& signs() const { return signs_; }

 private:
  RotationKind kind_;
  int dim_;
  uint64_t seed_;
  std::vector<float> p_transpose_;  // kHaar: P^T row-major [dim][dim]
  std::vector<float> signs_;        // kRandomizedHadamard: S_1, S_2, S_3 as +-1, [3][dim]
};

}  // namespace certkv::index
