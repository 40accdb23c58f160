#include "model/matmul_float.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "format/numeric.h"
#include "model/ggml_type.h"

namespace certkv::model {
namespace {

// Q8_0 weights with random scales and quants (any bytes are a valid Q8_0 block but the scale).
std::vector<uint8_t> random_q8_0(int64_t n_in, int64_t n_out, std::mt19937& rng) {
  std::vector<uint8_t> bytes(ggml_row_bytes(format::GgmlType::kQ8_0, n_in) * n_out);
  for (auto& b : bytes) b = uint8_t(rng());
  auto* blocks = reinterpret_cast<format::BlockQ8_0*>(bytes.data());
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (size_t i = 0; i < bytes.size() / sizeof(format::BlockQ8_0); ++i) blocks[i].d = format::float_to_fp16(scale(rng));
  return bytes;
}

TEST(MatmulFloat, AgreesWithTheExactReferenceToFp32Rounding) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int threads : {1, 2})
    for (int64_t n_tokens : {1, 3, 17, 129})
      for (int64_t n_out : {1, 7, 577}) {
        const int64_t n_in = 192;
        ThreadPool pool(threads);
        std::vector<uint8_t> bytes = random_q8_0(n_in, n_out, rng);
        WeightMatrix w{format::GgmlType::kQ8_0, bytes.data(), n_in, n_out,
                       ggml_row_bytes(format::GgmlType::kQ8_0, n_in)};
        std::vector<float> x(size_t(n_tokens * n_in));
        for (auto& v : x) v = normal(rng);
        std::vector<float> y(size_t(n_tokens * n_out)), ref(y.size()), q(y.size());
        matmul_float(w, x.data(), n_tokens, y.data(), pool);
        matmul_ref(w, x.data(), n_tokens, ref.data());
        matmul(w, x.data(), n_tokens, q.data(), pool, ActivationFormat::kInt8);
        double max_err = 0, max_err_int8 = 0, scale = 0;
        for (size_t i = 0; i < y.size(); ++i) {
          max_err = std::max(max_err, double(std::fabs(y[i] - ref[i])));
          max_err_int8 = std::max(max_err_int8, double(std::fabs(q[i] - ref[i])));
          scale = std::max(scale, double(std::fabs(ref[i])));
        }
        ASSERT_GT(scale, 0.1);
        // fp32 accumulation of 192 terms: relative error well under 1e-5 of the magnitude.
        EXPECT_LT(max_err, 1e-5 * scale * 8) << n_tokens << " " << n_out;
        // and it is closer to the exact product than the int8-activation path.
        EXPECT_LE(max_err, max_err_int8);
      }
}

TEST(MatmulFloat, RefusesUnsupportedTypes) {
  ThreadPool pool(1);
  uint8_t bytes[84] = {};
  WeightMatrix w{format::GgmlType::kQ2_K, bytes, 256, 1, 84};
  float x[256] = {}, y[1];
  EXPECT_THROW(matmul_float(w, x, 1, y, pool), Error);
}

}  // namespace
}  // namespace certkv::model
