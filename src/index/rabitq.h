// RaBitQ key index and score estimator (DESIGN.md section 5; seed 002 sections 3.1-3.3, Eq. 6 and
// Eq. 17-20, Theorem A.1). Record layout in prose: docs/format/rabitq_index.md.
//
// Per (layer, kv_head) a RabitqHead holds the prefill centroids c_q, c_k and the rotation P. Each
// key k_t becomes one RabitqRecord<D>: the sign code of P^T k_c with k_c = (k - c_k)/||k - c_k||,
// and the scalars Eq. 6 needs. A query q is centered, normalized, rotated and quantized to 4 bits
// with randomized rounding (RabitqQuery<D>); then, for every token,
//   <q, k> ~= ||q - c_q|| ||k - c_k|| est<q_c, k_c> + <q, c_k> + <c_q, k> - <c_q, c_k>      (Eq. 6)
//   est<q_c, k_c> = <c_bar, q_bar> / alpha,  alpha = <c_bar, P^T k_c>                    (Thm A.1)
// with c_bar = (2 c_b - 1)/sqrt(D) the code vector and q_bar the dequantized query. Over the random
// choice of P (Haar) and of the rounding, est is unbiased; its spread is O(1/sqrt(D)).
//
// D (head_dim) is a template parameter so the record has a fixed size; rabitq.cc instantiates
// D in {32, 64, 96, 128, 256}.
// Thread safety: pure functions over caller-owned buffers; RabitqHead is immutable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "index/rotation.h"

namespace certkv::index {

inline constexpr int kRabitqQueryBits = 4;  // B_q of the seed's Theorem A.2
inline constexpr int kRabitqQueryLevels = (1 << kRabitqQueryBits) - 1;  // q_u in [0, 15]

// One token's index entry; plain fixed-size fields so host and device code share it.
template <int D>
struct RabitqRecord {
  static constexpr int kWords = (D + 63) / 64;
  // c_b: bit (i % 64) of code[i / 64] is 1 iff coordinate i of P^T k_c is >= 0; bits >= D are 0.
  uint64_t code[kWords];
  float alpha;             // <c_bar, P^T k_c> in (0, 1]; 1 when ||k - c_k|| == 0
  float norm_k_centered;   // ||k - c_k||
  float cq_dot_k;          // <c_q, k>
  int32_t code_popcount;   // sum_i c_b[i], the second term of Eq. 20
};
static_assert(sizeof(RabitqRecord<32>) == 24);
static_assert(sizeof(RabitqRecord<64>) == 24);
static_assert(sizeof(RabitqRecord<96>) == 32);
static_assert(sizeof(RabitqRecord<128>) == 32);
static_assert(sizeof(RabitqRecord<256>) == 48);

// The query after centering, normalization, rotation and 4-bit quantization:
// q' = P^T (q - c_q)/||q - c_q||,  q_bar = delta * q_u + q_l * 1  (seed section 3.3).
template <int D>
struct RabitqQuery {
  static constexpr int kWords = (D + 63) / 64;
  uint8_t q_u[D];                               // in [0, kRabitqQueryLevels]
  uint64_t bit_planes[kRabitqQueryBits][kWords];  // plane b: bit i set iff q_u[i] has bit b
  int32_t sum_q_u;                              // sum_i q_u[i]
  float delta;                                  // (q_r - q_l) / 15; 0 when q' is constant
  float q_l;                                    // min_i q'[i]
  float norm_q_centered;                        // ||q - c_q||; 0 means q == c_q
  float q_dot_ck;                               // <q, c_k>
};

class RabitqHead {
 public:
  // c_q, c_k: [dim] prefill centroids of the queries and keys of this (layer, kv_head).
  // REQUIRES: c_q.size() == c_k.size() == rotation.dim(), all values finite (else certkv::Error).
  RabitqHead(std::vector<float> c_q, std::vector<float> c_k, Rotation rotation);

  int dim() const { return rotation_.dim(); }
  const std::vector<float>& c_q() const { return c_q_; }
  const std::vector<float>& c_k() const { return c_k_; }
  const Rotation& rotation() const { return rotation_; }
  float cq_dot_ck() const { return cq_dot_ck_; }  // <c_q, c_k>, the last term of Eq. 6

 private:
  std::vector<float> c_q_;
  std::vector<float> c_k_;
  Rotation rotation_;
  float cq_dot_ck_;
};

// The sums behind a query centroid (c_q = sums / rows in double, rounded once to float): adds n
// query rows q [n][n_heads][dim] to sums [n_kv_heads][dim], each KV head's group of n_heads /
// n_kv_heads query heads onto its row, in double, token by token and within a token head by head
// (one rounding per addition). rows grows by n times the group. The one order of the sums: the C
// API's stores (the host's and, on the device, attention::cuda::add_query_sums) give the same bits.
// REQUIRES: n >= 0, n_kv_heads >= 1 dividing n_heads, dim >= 1, non-null pointers when n > 0.
void rabitq_add_query_sums(const float* q, int64_t n, int n_heads, int n_kv_heads, int dim, double* sums);

// Builds one record per key. k: [n_tokens][D]; records: [n_tokens].
// k == c_k (norm 0) gives code 0, alpha 1, norm 0: its score is then exactly
// <q, c_k> + <c_q, k> - <c_q, c_k> = <q, k>.
// REQUIRES: head.dim() == D, n_tokens >= 0, finite keys, non-null pointers when n_tokens > 0.
template <int D>
void rabitq_encode_keys(const RabitqHead& head, const float* k, int64_t n_tokens,
                        RabitqRecord<D>* records);

// Centers, normalizes, rotates and quantizes q: [D]. Randomized rounding draws its uniforms from
// counter_uniform(rounding_seed, i), so E[q_bar] = q' over the seed. q == c_q gives
// norm_q_centered 0 and q_u 0 (the Eq. 6 product term then vanishes).
// REQUIRES: head.dim() == D, finite q, q non-null.
template <int D>
RabitqQuery<D> rabitq_quantize_query(const RabitqHead& head, const float* q, uint64_t rounding_seed);

// Estimated <q, k_t> for every token. records: [n_tokens]; scores: [n_tokens].
// _ref: float dot product of q_bar with the +-1/sqrt(D) code vector, divided by alpha, then Eq. 6.
template <int D>
void rabitq_estimate_scores_ref(const RabitqHead& head, const RabitqQuery<D>& query,
                                const RabitqRecord<D>* records, int64_t n_tokens, float* scores);
// Same estimate through Eq. 20: <c_b, q_u> = sum_b 2^b popcount(c_b & plane_b), integer exact.
template <int D>
void rabitq_estimate_scores_popcount(const RabitqHead& head, const RabitqQuery<D>& query,
                                     const RabitqRecord<D>* records, int64_t n_tokens,
                                     float* scores);

// The spread of one token's estimated logit. By the proof of seed 002's Theorem A.1 (Eq. 35-39)
// the estimate of the unit vectors' inner product errs by
//   est<q_c, k_c> - <q_c, k_c> = sqrt(1 - alpha^2) / alpha * sqrt(1 - <q_c, k_c>^2) * X,
// X distributed as one coordinate of a random unit vector in D - 1 dimensions (variance
// 1 / (D - 1)); the first factor is below 1 for alpha above 1/sqrt(2) (alpha is about 0.8 for
// a random rotation, where sigma_t below overstates the spread by about 25%). So over the random
// rotation the standard deviation of scale * est<q, k_t> is at most about
//   sigma_t = scale ||q - c_q|| ||k_t - c_k|| / sqrt(D - 1)
// (a spread, not a bound on the error; the 4-bit query's rounding, Theorem A.2, adds a little).
// Returns z sigma_t / ||k_t - c_k||, the factor top_p_widen multiplies each token's key norm by,
// computed in double and rounded once to float (the host and the device take the same value).
// REQUIRES: head_dim >= 2, deviations >= 0 and finite, and a factor below FLT_MAX (else
// certkv::Error kInvalidArgument naming deviations).
float rabitq_logit_deviation_scale(double deviations, float scale, float norm_q_centered, int head_dim);

// What is wrong with a record that did not come from rabitq_encode_keys (one read from a file or
// made by a caller), or null when nothing is: alpha in (0, 1], a finite norm >= 0 and <c_q, k>,
// no code bit at or past D, and the popcount of the code. A record that fails would give scores
// that are inf, NaN or simply wrong.
template <int D>
const char* rabitq_record_problem(const RabitqRecord<D>& r) {
  if (!(r.alpha > 0.f && r.alpha <= 1.f)) return "alpha is not in (0, 1]";
  if (!(r.norm_k_centered >= 0.f && r.norm_k_centered <= 3.4e38f)) return "norm_k_centered is not finite and >= 0";
  if (!(r.cq_dot_k >= -3.4e38f && r.cq_dot_k <= 3.4e38f)) return "cq_dot_k is not finite";
  int popcount = 0;
  for (int w = 0; w < RabitqRecord<D>::kWords; ++w) {
    const int bits_in_word = D - 64 * w < 64 ? D - 64 * w : 64;
    if (bits_in_word < 64 && (r.code[w] >> bits_in_word) != 0) return "code has a bit at or past head_dim";
    popcount += __builtin_popcountll(r.code[w]);
  }
  if (popcount != r.code_popcount) return "code_popcount is not the code's popcount";
  return nullptr;
}

// Index bytes per token per kv_head for head_dim D.
template <int D>
constexpr size_t rabitq_bytes_per_token() {
  return sizeof(RabitqRecord<D>);
}

}  // namespace certkv::index
