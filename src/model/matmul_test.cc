#include "model/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"
#include "model/quantized_dot.h"

namespace certkv::model {
namespace {

using format::GgmlType;

const GgmlType kAllTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ4_0,
                              GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ8_0,
                              GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};

bool is_float_type(GgmlType t) {
  return t == GgmlType::kF32 || t == GgmlType::kF16 || t == GgmlType::kBF16;
}

// Where the fp16 block scale d and the fp16 min / dmin (or -1) sit in a block.
struct ScaleFields {
  int d, m;
};

ScaleFields scale_fields(GgmlType t) {
  switch (t) {
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      return {0, 2};
    case GgmlType::kQ6_K:
      return {208, -1};
    default:
      return {0, -1};
  }
}

void put_half(uint8_t* p, float v) {
  const uint16_t h = format::float_to_fp16(v);
  std::memcpy(p, &h, 2);
}

float get_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return format::fp16_to_float(h);
}

// Random codes with finite random scales (d in +-[0.001, 0.1], mins in [-0.1, 0.1]) for
// quantized types; normal values for float types.
std::vector<uint8_t> random_weights(GgmlType type, int64_t n_in, int64_t n_out, std::mt19937& rng) {
  const size_t row_bytes = ggml_row_bytes(type, n_in);
  std::vector<uint8_t> data(row_bytes * size_t(n_out));
  std::uniform_real_distribution<float> scale(0.001f, 0.1f), min(-0.1f, 0.1f);
  std::normal_distribution<float> normal(0.f, 1.f);
  if (is_float_type(type)) {
    for (int64_t i = 0; i < n_in * n_out; ++i) {
      const float v = normal(rng);
      if (type == GgmlType::kF32) {
        std::memcpy(data.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h =
            type == GgmlType::kF16 ? format::float_to_fp16(v) : format::float_to_bf16(v);
        std::memcpy(data.data() + 2 * i, &h, 2);
      }
    }
    return data;
  }
  for (auto& b : data) b = uint8_t(rng());
  const size_t block_bytes = ggml_block_bytes(type);
  const ScaleFields f = scale_fields(type);
  for (size_t b = 0; b < data.size() / block_bytes; ++b) {
    uint8_t* p = data.data() + b * block_bytes;
    put_half(p + f.d, (rng() % 2 ? 1.f : -1.f) * scale(rng));
    if (f.m >= 0)
      put_half(p + f.m, type == GgmlType::kQ4_K || type == GgmlType::kQ5_K ? scale(rng) : min(rng));
  }
  return data;
}

std::vector<float> random_activations(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> decade(-2.f, 1.f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = normal(rng) * std::pow(10.f, decade(rng));
  return x;
}

// Bound on the sum of absolute values of the fp32 terms that matmul and matmul_quantized_ref add
// for output (t, o): sum_i (A |d_w| + C |m_w|) |d_x q_i|, with A the largest |scale * code| per
// unit d_w that the algorithm multiplies (codes are used unsigned, offsets enter through the
// constant term) and C the largest constant-term factor per unit of the block's d_w or min.
double term_magnitude(GgmlType type, const uint8_t* row, const QuantizedActivation& xq) {
  double a = 0, c = 0;
  switch (type) {
    case GgmlType::kQ4_0:
      a = 15;
      c = 8;
      break;
    case GgmlType::kQ4_1:
      a = 15;
      c = 1;
      break;
    case GgmlType::kQ5_0:
      a = 31;
      c = 16;
      break;
    case GgmlType::kQ5_1:
      a = 31;
      c = 1;
      break;
    case GgmlType::kQ8_0:
      a = 255;
      c = 128;
      break;
    case GgmlType::kQ4_K:
      a = 63 * 15;
      c = 63;
      break;
    case GgmlType::kQ5_K:
      a = 63 * 31;
      c = 63;
      break;
    case GgmlType::kQ6_K:
      a = 128 * 32;
      c = 0;
      break;
    default:
      break;
  }
  const ScaleFields f = scale_fields(type);
  const int64_t block = ggml_block_elements(type);
  const size_t block_bytes = ggml_block_bytes(type);
  const int64_t xblock = xq.block_elements;
  double sum = 0;
  for (size_t i = 0; i < xq.q.size(); ++i) {
    const uint8_t* p = row + (int64_t(i) / block) * block_bytes;
    const double dw = std::fabs(get_half(p + f.d));
    const double mw = f.m >= 0 ? std::fabs(get_half(p + f.m)) : dw;
    const double xhat = std::fabs(double(xq.d[i / size_t(xblock)]) * xq.q[i]);
    sum += (a * dw + c * mw) * xhat;
  }
  return sum;
}

constexpr double kU = 1.0 / (1 << 24);  // unit roundoff of fp32

struct Shape {
  int64_t n_tokens, n_in, n_out;
};

// Compares matmul with matmul_quantized_ref (same algorithm, other fp32 addition order) and
// with matmul_ref (exact) for one shape. Tolerances:
//  * vs matmul_quantized_ref: each side adds at most 2 n_blocks + 16 fp32 terms per output in
//    some order, so |difference| <= (3 n_blocks + 32) u sum|terms| (term_magnitude bounds it).
//    Float weights: (n_in / 16 + n_in + 32) u sum |w x|.
//  * vs matmul_ref: activation rounding moves each x_i by at most d_x / 2 = amax_block / 254,
//    so |difference| <= sum_i |w_i| amax(block of i) / 254, plus the fp32 terms above and the
//    rounding of the dequantized weights (u sum |w x|).
void check_shape(GgmlType type, const Shape& s, std::mt19937& rng, ThreadPool& pool) {
  SCOPED_TRACE(std::string(ggml_type_name(type)) + " tokens=" + std::to_string(s.n_tokens) +
               " n_in=" + std::to_string(s.n_in) + " n_out=" + std::to_string(s.n_out));
  const std::vector<uint8_t> data = random_weights(type, s.n_in, s.n_out, rng);
  const WeightMatrix w = weight_matrix(type, data.data(), s.n_in, s.n_out);
  const std::vector<float> x = random_activations(s.n_tokens * s.n_in, rng);
  const size_t n_y = size_t(s.n_tokens * s.n_out);
  std::vector<float> y(n_y, NAN), y_q(n_y, NAN), y_ref(n_y, NAN);
  matmul(w, x.data(), s.n_tokens, y.data(), pool);
  matmul_quantized_ref(w, x.data(), s.n_tokens, y_q.data());
  matmul_ref(w, x.data(), s.n_tokens, y_ref.data());

  const int64_t xblock = activation_block_elements(type);
  const int64_t n_blocks = xblock ? s.n_in / 32 : s.n_in;
  std::vector<float> row(size_t(s.n_in));
  double max_ref = 0;
  for (int64_t o = 0; o < s.n_out; ++o) {
    const uint8_t* wrow = data.data() + size_t(o) * w.row_bytes;
    dequantize_row_ref(type, wrow, row.data(), s.n_in);
    for (int64_t t = 0; t < s.n_tokens; ++t) {
      const float* xt = x.data() + t * s.n_in;
      double abs_wx = 0;
      for (int64_t i = 0; i < s.n_in; ++i) abs_wx += std::fabs(double(row[i]) * xt[i]);
      double tol_q, tol_ref;
      if (xblock == 0) {
        tol_q = double(s.n_in / 16 + s.n_in + 32) * kU * abs_wx;
        tol_ref = tol_q + kU * abs_wx;
      } else {
        const QuantizedActivation xq = quantize_activation_ref(xt, s.n_in, xblock);
        tol_q = double(3 * n_blocks + 32) * kU * term_magnitude(type, wrow, xq);
        double act_err = 0;
        for (int64_t i = 0; i < s.n_in; ++i)
          act_err += std::fabs(double(row[i])) * double(xq.d[i / xblock]) / 2.0;
        tol_ref = act_err * (1 + 1e-6) + 2 * tol_q + 2 * kU * abs_wx;
      }
      const size_t k = size_t(t * s.n_out + o);
      max_ref = std::max(max_ref, std::fabs(double(y_ref[k])));
      ASSERT_LE(std::fabs(double(y[k]) - y_q[k]), tol_q)
          << "t=" << t << " o=" << o << " matmul " << y[k] << " quantized ref " << y_q[k];
      ASSERT_LE(std::fabs(double(y[k]) - y_ref[k]), tol_ref)
          << "t=" << t << " o=" << o << " matmul " << y[k] << " exact ref " << y_ref[k];
    }
  }
  EXPECT_GT(max_ref, 0.0) << "all-zero products prove nothing";
}

TEST(Matmul, MatchesReferencesOnRaggedShapes) {
  std::mt19937 rng(2026);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    const int64_t block = activation_block_elements(type) ? ggml_block_elements(type) : 1;
    // Inputs: one block, a partial group of blocks, a longer row with a partial group, and
    // (32-element blocks) three sets of 16 blocks and one block more (float weights: lengths
    // that leave a partial vector of 16).
    const int64_t n_ins[4] = {block == 1 ? 5 : block, block == 1 ? 33 : 3 * block,
                              block == 1 ? 577 : (block == 32 ? 18 : 3) * block,
                              block == 1 ? 1571 : (block == 32 ? 49 : 5) * block};
    int which = 0;
    for (int64_t n_tokens : {1, 3, 8, 9, 17, 129}) {
      for (int64_t n_out : {1, 7, 577}) {
        check_shape(type, {n_tokens, n_ins[which++ % 4], n_out}, rng, pool);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// With d = 1, integer mins, and activations whose blocks hold +-127, every quantity is an exact
// small integer, so matmul must equal matmul_ref exactly.
TEST(Matmul, ExactOnIntegerData) {
  std::mt19937 rng(7);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    SCOPED_TRACE(ggml_type_name(type));
    const int64_t xblock = activation_block_elements(type);
    const int64_t n_in = xblock == 256 ? 512 : 576, n_out = 37, n_tokens = 11;
    std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    if (xblock != 0) {
      const size_t block_bytes = ggml_block_bytes(type);
      const ScaleFields f = scale_fields(type);
      for (size_t b = 0; b < data.size() / block_bytes; ++b) {
        uint8_t* p = data.data() + b * block_bytes;
        put_half(p + f.d, 1.f);
        if (f.m >= 0)
          put_half(p + f.m, type == GgmlType::kQ4_K || type == GgmlType::kQ5_K ? 1.f : -3.f);
        if (type == GgmlType::kQ4_K || type == GgmlType::kQ5_K) {
          for (int i = 4; i < 16; ++i) p[i] &= 0x03;  // sub-block scales and mins 0..3
        } else if (type == GgmlType::kQ6_K) {
          for (int i = 192; i < 208; ++i) p[i] = uint8_t(int8_t(p[i] % 7 - 3));
        }
      }
    } else {
      // Float weights: small integers.
      for (int64_t i = 0; i < n_in * n_out; ++i) {
        const float v = float(int(rng() % 9) - 4);
        if (type == GgmlType::kF32) {
          std::memcpy(data.data() + 4 * i, &v, 4);
        } else {
          const uint16_t h =
              type == GgmlType::kF16 ? format::float_to_fp16(v) : format::float_to_bf16(v);
          std::memcpy(data.data() + 2 * i, &h, 2);
        }
      }
    }
    std::vector<float> x(size_t(n_tokens * n_in));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(rng() % 255) - 127);
    const int64_t span = xblock ? xblock : 32;
    for (size_t i = 0; i < x.size(); i += size_t(span))
      x[i + rng() % span] = (rng() % 2) ? 127.f : -127.f;
    const WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    std::vector<float> y(size_t(n_tokens * n_out)), y_ref(y.size()), y_q(y.size());
    matmul(w, x.data(), n_tokens, y.data(), pool);
    matmul_ref(w, x.data(), n_tokens, y_ref.data());
    matmul_quantized_ref(w, x.data(), n_tokens, y_q.data());
    int64_t nonzero = 0;
    for (size_t k = 0; k < y.size(); ++k) {
      ASSERT_EQ(y[k], y_ref[k]) << "output " << k;
      ASSERT_EQ(y_q[k], y_ref[k]) << "output " << k;
      ASSERT_EQ(y_ref[k], std::nearbyint(y_ref[k])) << "output " << k << " is not an integer";
      nonzero += y_ref[k] != 0;
    }
    EXPECT_GT(nonzero, int64_t(y.size()) / 2);
  }
}

TEST(Matmul, ResultDoesNotDependOnThreadCount) {
  std::mt19937 rng(11);
  ThreadPool one(1), two(2), three(3);
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kQ6_K, GgmlType::kF16}) {
    const int64_t n_in = 768, n_out = 1000, n_tokens = 9;
    const std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    const WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    const std::vector<float> x = random_activations(n_tokens * n_in, rng);
    std::vector<float> y1(size_t(n_tokens * n_out)), y2(y1.size()), y3(y1.size());
    matmul(w, x.data(), n_tokens, y1.data(), one);
    matmul(w, x.data(), n_tokens, y2.data(), two);
    matmul(w, x.data(), n_tokens, y3.data(), three);
    EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * 4)) << ggml_type_name(type);
    EXPECT_EQ(0, std::memcmp(y1.data(), y3.data(), y1.size() * 4)) << ggml_type_name(type);
  }
}

// A token's result does not depend on how many tokens share the call, nor on where it sits
// among them (the engine's batch invariance stands on this): every token of a 19-token call
// equals the same token computed alone and in calls of 2..9, bit for bit.
TEST(Matmul, EachTokensResultIsIndependentOfTheOtherTokens) {
  std::mt19937 rng(13);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    SCOPED_TRACE(ggml_type_name(type));
    const int64_t xblock = activation_block_elements(type);
    const int64_t n_in = xblock == 256 ? 512 : 576, n_out = 67, n_tokens = 19;
    const std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    const WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    const std::vector<float> x = random_activations(n_tokens * n_in, rng);
    std::vector<float> all(size_t(n_tokens * n_out));
    matmul(w, x.data(), n_tokens, all.data(), pool);
    for (int64_t size = 1; size <= 9; ++size) {
      std::vector<float> part(size_t(size * n_out));
      for (int64_t t0 = 0; t0 + size <= n_tokens; t0 += size) {
        matmul(w, x.data() + t0 * n_in, size, part.data(), pool);
        ASSERT_EQ(0, std::memcmp(part.data(), all.data() + t0 * n_out, part.size() * 4))
            << size << " tokens from token " << t0;
      }
    }
  }
}

// The list form (one input, several matrices: q, k, v) writes what separate calls write, bit
// for bit, for every token count and thread count, with matrices of one type or of mixed types
// (both activation layouts and float weights in one call).
TEST(Matmul, SharedInputProductsEqualSeparateProducts) {
  std::mt19937 rng(17);
  ThreadPool one(1), two(2);
  const std::vector<std::vector<GgmlType>> lists = {
      {GgmlType::kQ4_1, GgmlType::kQ4_1, GgmlType::kQ4_1},
      {GgmlType::kQ8_0},
      {GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ5_0, GgmlType::kF16, GgmlType::kQ8_0}};
  const int64_t n_outs[] = {67, 17, 130, 5, 33};
  for (const std::vector<GgmlType>& types : lists) {
    const int64_t n_in = 512;
    std::vector<std::vector<uint8_t>> data;
    std::vector<WeightMatrix> w;
    for (size_t m = 0; m < types.size(); ++m) data.push_back(random_weights(types[m], n_in, n_outs[m], rng));
    for (size_t m = 0; m < types.size(); ++m) w.push_back(weight_matrix(types[m], data[m].data(), n_in, n_outs[m]));
    for (int64_t n_tokens = 1; n_tokens <= 9; ++n_tokens) {
      SCOPED_TRACE(std::string(ggml_type_name(types[0])) + " + " + std::to_string(types.size() - 1) +
                   " more, tokens=" + std::to_string(n_tokens));
      const std::vector<float> x = random_activations(n_tokens * n_in, rng);
      for (ThreadPool* pool : {&one, &two}) {
        std::vector<std::vector<float>> separate, shared;
        std::vector<float*> y;
        for (const WeightMatrix& wm : w) {
          separate.emplace_back(size_t(n_tokens * wm.n_out));
          shared.emplace_back(size_t(n_tokens * wm.n_out), NAN);
          matmul(wm, x.data(), n_tokens, separate.back().data(), *pool);
          y.push_back(shared.back().data());
        }
        matmul(w, x.data(), n_tokens, y, *pool);
        for (size_t m = 0; m < w.size(); ++m)
          ASSERT_EQ(0, std::memcmp(separate[m].data(), shared[m].data(), separate[m].size() * 4)) << "matrix " << m;
      }
    }
  }
}

TEST(MatmulErrors, SharedInputNeedsOneInputLength) {
  ThreadPool pool(2);
  std::mt19937 rng(19);
  const std::vector<uint8_t> a = random_weights(GgmlType::kQ4_1, 64, 2, rng);
  const std::vector<uint8_t> b = random_weights(GgmlType::kQ4_1, 96, 2, rng);
  const WeightMatrix w[2] = {weight_matrix(GgmlType::kQ4_1, a.data(), 64, 2), weight_matrix(GgmlType::kQ4_1, b.data(), 96, 2)};
  std::vector<float> x(96, 1.f), y0(2, -1.f), y1(2, -1.f);
  float* const y[2] = {y0.data(), y1.data()};
  try {
    matmul(w, x.data(), 1, y, pool);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  }
  try {
    matmul(std::span<const WeightMatrix>(w, 1), x.data(), 1, y, pool);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
  }
  for (float v : y0) EXPECT_EQ(v, -1.f);
  for (float v : y1) EXPECT_EQ(v, -1.f);
}

TEST(Matmul, NonFiniteActivationPoisonsItsTokenOnly) {
  std::mt19937 rng(5);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    SCOPED_TRACE(ggml_type_name(type));
    const int64_t n_in = 512, n_out = 9, n_tokens = 3;
    const std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    const WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    std::vector<float> x = random_activations(n_tokens * n_in, rng);
    x[1 * n_in + 300] = INFINITY;
    x[2 * n_in + 7] = NAN;
    std::vector<float> y(size_t(n_tokens * n_out)), y_q(y.size());
    matmul(w, x.data(), n_tokens, y.data(), pool);
    matmul_quantized_ref(w, x.data(), n_tokens, y_q.data());
    // Quantized weights: NaN (the block scale becomes NaN). Float weights: Inf times a weight
    // is +-Inf or NaN, and NaN stays NaN.
    auto poisoned = [&](float v) {
      return is_float_type(type) ? !std::isfinite(v) : std::isnan(v);
    };
    for (int64_t o = 0; o < n_out; ++o) {
      EXPECT_TRUE(std::isfinite(y[o])) << o;
      EXPECT_TRUE(poisoned(y[n_out + o])) << o;
      EXPECT_TRUE(std::isnan(y[2 * n_out + o])) << o;
      EXPECT_TRUE(std::isfinite(y_q[o])) << o;
      EXPECT_TRUE(poisoned(y_q[n_out + o])) << o;
      EXPECT_TRUE(std::isnan(y_q[2 * n_out + o])) << o;
    }
  }
}

// The kernel is the widest the CPU runs, capped by CERTKV_MATMUL_KERNEL (ctest runs the Matmul
// suites once per kernel this way, so each kernel meets the references above on this CPU).
TEST(MatmulKernel, IsTheWidestTheCpuRunsUnderTheEnvironmentsCap) {
  const MatmulKernel k = matmul_kernel();
  EXPECT_EQ(k, matmul_kernel());  // chosen once
  MatmulKernel widest = MatmulKernel::kPortable;
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  if (avx2) widest = MatmulKernel::kAvx2;
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx512vbmi"))
    widest = MatmulKernel::kAvx512;
#endif
  MatmulKernel cap = MatmulKernel::kAvx512;
  if (const char* env = std::getenv("CERTKV_MATMUL_KERNEL"))
    for (MatmulKernel c : {MatmulKernel::kPortable, MatmulKernel::kAvx2, MatmulKernel::kAvx512})
      if (std::string(env) == matmul_kernel_name(c)) cap = c;
  EXPECT_EQ(k, std::min(widest, cap)) << "chose " << matmul_kernel_name(k);
  EXPECT_STREQ(matmul_kernel_name(MatmulKernel::kPortable), "portable");
  EXPECT_STREQ(matmul_kernel_name(MatmulKernel::kAvx2), "avx2");
  EXPECT_STREQ(matmul_kernel_name(MatmulKernel::kAvx512), "avx512");
}

TEST(Matmul, ZeroSizedShapes) {
  ThreadPool pool(2);
  std::mt19937 rng(3);
  const std::vector<uint8_t> data = random_weights(GgmlType::kQ4_1, 64, 4, rng);
  std::vector<float> x(64, 1.f), y(4, -1.f);
  matmul(weight_matrix(GgmlType::kQ4_1, data.data(), 64, 4), x.data(), 0, y.data(), pool);
  for (float v : y) EXPECT_EQ(v, -1.f);
  matmul(weight_matrix(GgmlType::kQ4_1, data.data(), 0, 4), x.data(), 1, y.data(), pool);
  for (float v : y) EXPECT_EQ(v, 0.f);
}

void expect_error(StatusCode code, const std::string& needle, const std::function<void()>& fn) {
  try {
    fn();
    ADD_FAILURE() << "no error (expected one mentioning '" << needle << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(MatmulErrors, BadArgumentsAreRejectedBeforeWriting) {
  ThreadPool pool(2);
  std::vector<uint8_t> data(4096, 0);
  std::vector<float> x(1024, 1.f), y(64, -1.f);
  for (GgmlType type : {GgmlType::kQ2_K, GgmlType::kQ8_K, GgmlType::kQ8_1}) {
    EXPECT_FALSE(matmul_supports(type));
    WeightMatrix w{type, data.data(), 256, 2, 256};
    expect_error(StatusCode::kUnsupported, ggml_type_name(type),
                 [&] { matmul(w, x.data(), 1, y.data(), pool); });
    expect_error(StatusCode::kUnsupported, ggml_type_name(type),
                 [&] { matmul_ref(w, x.data(), 1, y.data()); });
  }
  WeightMatrix partial{GgmlType::kQ4_1, data.data(), 48, 2, 40};
  expect_error(StatusCode::kInvalidArgument, "48",
               [&] { matmul(partial, x.data(), 1, y.data(), pool); });
  WeightMatrix short_rows{GgmlType::kQ8_0, data.data(), 64, 2, 60};
  expect_error(StatusCode::kInvalidArgument, "row_bytes",
               [&] { matmul(short_rows, x.data(), 1, y.data(), pool); });
  WeightMatrix null_data{GgmlType::kQ8_0, nullptr, 64, 2, 68};
  expect_error(StatusCode::kInvalidArgument, "null",
               [&] { matmul(null_data, x.data(), 1, y.data(), pool); });
  WeightMatrix ok{GgmlType::kQ8_0, data.data(), 64, 2, 68};
  expect_error(StatusCode::kInvalidArgument, "-1",
               [&] { matmul(ok, x.data(), -1, y.data(), pool); });
  for (float v : y) EXPECT_EQ(v, -1.f);
}

// ---------------------------------------------------------------------------------------------
// The reference algorithm itself.

TEST(QuantizedDot, ActivationQuantizationKnownAnswer) {
  // amax 127 -> d = 1: codes are x rounded half to even.
  std::vector<float> x(32, 0.f);
  const float values[] = {127.f, -63.5f, 0.5f, 1.5f, 2.5f, -0.49f, 126.6f, -127.f};
  std::copy(std::begin(values), std::end(values), x.begin());
  const QuantizedActivation a = quantize_activation_ref(x.data(), 32, 32);
  const int expected[] = {127, -64, 0, 2, 2, 0, 127, -127};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a.q[i], expected[i]) << i;
  EXPECT_EQ(a.d[0], 1.f);
  EXPECT_EQ(a.sum32[0], 127 - 64 + 2 + 2 + 127 - 127);
  EXPECT_EQ(a.s[0], 67.f);
  // amax 2: d = 2/127, codes = round(x * 63.5).
  std::vector<float> y(32, 0.f);
  y[0] = 2.f;
  y[5] = -0.5f;  // -31.75 -> -32
  y[9] = 0.02f;  // 1.27 -> 1
  const QuantizedActivation b = quantize_activation_ref(y.data(), 32, 32);
  EXPECT_EQ(b.d[0], 2.f / 127.f);
  EXPECT_EQ(b.q[0], 127);
  EXPECT_EQ(b.q[5], -32);
  EXPECT_EQ(b.q[9], 1);
  // All-zero block: d = 0, codes 0.
  std::vector<float> z(256, 0.f);
  const QuantizedActivation c = quantize_activation_ref(z.data(), 256, 256);
  EXPECT_EQ(c.d[0], 0.f);
  for (int8_t q : c.q) EXPECT_EQ(q, 0);
  z[100] = -INFINITY;
  EXPECT_TRUE(std::isnan(quantize_activation_ref(z.data(), 256, 256).d[0]));
  expect_error(StatusCode::kInvalidArgument, "64",
               [&] { quantize_activation_ref(z.data(), 48, 64); });
}

TEST(QuantizedDot, Q4_1BlockByHand) {
  // One Q4_1 block: d = 0.5, m = -2; codes j % 16 for element j (both nibble halves); activation
  // x_i = 127 for even i, -127 for odd i (d_x = 1). Integer dot: sum_j code_j * x_j = 127 *
  // (sum of codes at even j - at odd j) = 127 * 2 * (0+2+...+14 - (1+3+...+15)) = -2032; s = 0.
  // y = 0.5 * -2032 + (-2) * 0 = -1016.
  format::BlockQ4_1 b;
  b.d = format::float_to_fp16(0.5f);
  b.m = format::float_to_fp16(-2.f);
  for (int j = 0; j < 16; ++j) b.qs[j] = uint8_t(j | j << 4);
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = i % 2 ? -127.f : 127.f;
  const QuantizedActivation a = quantize_activation_ref(x.data(), 32, 32);
  EXPECT_EQ(vec_dot_quantized_ref(GgmlType::kQ4_1, &b, a), -1016.f);
  expect_error(StatusCode::kUnsupported, "F16",
               [&] { vec_dot_quantized_ref(GgmlType::kF16, &b, a); });
  expect_error(StatusCode::kInvalidArgument, "256",
               [&] { vec_dot_quantized_ref(GgmlType::kQ4_K, &b, a); });
}

}  // namespace
}  // namespace certkv::model
