// The device forward kernels and the device weight product against their host references
// (backend/forward_ops.h, model::argmax, model::sample_token, format::float_to_bf16,
// device_matmul_ref), on ragged row
// counts; their refusals of bad shapes run anywhere, the device cases skip without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cuda/device_matmul.h"
#include "backend/cuda/forward_kernels.h"
#include "backend/cuda/sample_kernels.h"
#include "backend/forward_ops.h"
#include "core/cuda_test_support.h"
#include "format/ggml_blocks.h"
#include "format/numeric.h"
#include "model/sampler.h"

namespace certkv::backend::cuda {
namespace {

using testing::DeviceBytes;

std::vector<float> normal_values(size_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

template <typename T>
std::vector<T> run_and_read(const DeviceBytes& bytes, size_t n) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<T> out(n);
  bytes.download(out.data(), n * sizeof(T));
  return out;
}

// An F32 weight matrix over w ([n_out][n_in]); upload_matrix rounds it to bf16.
model::WeightMatrix f32_matrix(const std::vector<float>& w, int64_t n_in, int64_t n_out) {
  model::WeightMatrix m;
  m.type = format::GgmlType::kF32;
  m.data = reinterpret_cast<const uint8_t*>(w.data());
  m.n_in = n_in;
  m.n_out = n_out;
  m.row_bytes = size_t(n_in) * 4;
  return m;
}

constexpr int64_t kRaggedRows[] = {1, 3, 17, 100};

TEST(ForwardKernels, RmsNormMatchesTheHostRowByRow) {
  CERTKV_NEED_CUDA_DEVICE();
  for (const int n : {64, 576, 896}) {
    for (const int64_t rows : kRaggedRows) {
      const std::vector<float> x = normal_values(size_t(rows * n), 3.f, uint32_t(n + rows));
      const std::vector<float> w = normal_values(size_t(n), 1.f, 7);
      DeviceBytes dx(x.size() * 4), dw(w.size() * 4), dy(x.size() * 4);
      dx.upload(x.data(), x.size() * 4);
      dw.upload(w.data(), w.size() * 4);
      ASSERT_TRUE(rms_norm_rows(reinterpret_cast<float*>(dx.data()), rows, n, reinterpret_cast<float*>(dw.data()),
                                1e-5f, reinterpret_cast<float*>(dy.data()), nullptr)
                      .ok);
      const std::vector<float> y = run_and_read<float>(dy, x.size());
      std::vector<float> ref(x.size());
      for (int64_t r = 0; r < rows; ++r) backend::rms_norm(&x[size_t(r * n)], w.data(), n, 1e-5f, &ref[size_t(r * n)]);
      for (size_t i = 0; i < x.size(); ++i) {
        // The float sum of squares differs from the host's double one by a few ulps (relative).
        ASSERT_NEAR(y[i], ref[i], 1e-5f * std::fabs(ref[i]) + 1e-30f) << "n " << n << " rows " << rows << " i " << i;
      }
    }
  }
}

TEST(ForwardKernels, RopeMatchesTheHostInBothLayouts) {
  CERTKV_NEED_CUDA_DEVICE();
  for (const bool half_split : {false, true}) {
    for (const int64_t rows : kRaggedRows) {
      const int heads = 3, hd = 64, half = hd / 2;
      std::vector<float> x = normal_values(size_t(rows * heads * hd), 2.f, uint32_t(rows));
      std::vector<float> cos(size_t(rows * half)), sin(size_t(rows * half));
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < half; ++j) {
          const double angle = double(r * 37 + 5) * std::pow(10000.0, -2.0 * j / hd);
          cos[size_t(r * half + j)] = float(std::cos(angle));
          sin[size_t(r * half + j)] = float(std::sin(angle));
        }
      DeviceBytes dx(x.size() * 4), dc(cos.size() * 4), ds(sin.size() * 4);
      dx.upload(x.data(), x.size() * 4);
      dc.upload(cos.data(), cos.size() * 4);
      ds.upload(sin.data(), sin.size() * 4);
      ASSERT_TRUE(rope_rows(reinterpret_cast<float*>(dx.data()), rows, heads, hd, half_split,
                            reinterpret_cast<float*>(dc.data()), reinterpret_cast<float*>(ds.data()), nullptr)
                      .ok);
      const std::vector<float> got = run_and_read<float>(dx, x.size());
      const model::RopeLayout layout = half_split ? model::RopeLayout::kHalfSplit : model::RopeLayout::kInterleaved;
      std::vector<float> ref = x;
      for (int64_t r = 0; r < rows; ++r)
        apply_rope(&ref[size_t(r * heads * hd)], heads, hd, layout, &cos[size_t(r * half)], &sin[size_t(r * half)]);
      for (size_t i = 0; i < x.size(); ++i) {
        // The same two products and a sum; a fused multiply-add may round once where the host
        // rounds twice: within 2^-22 of the inputs' magnitude.
        const size_t j = i % size_t(hd);
        const size_t partner = half_split ? (j < size_t(half) ? i + size_t(half) : i - size_t(half)) : (i ^ 1u);
        const float scale = std::fabs(x[i]) + std::fabs(x[partner]);
        ASSERT_NEAR(got[i], ref[i], std::ldexp(scale, -22) + 1e-30f) << "rows " << rows << " i " << i;
      }
    }
  }
}

TEST(ForwardKernels, SwigluMatchesTheHostToAFewUlps) {
  CERTKV_NEED_CUDA_DEVICE();
  for (const int64_t rows : kRaggedRows) {
    const int width = 1536;
    std::vector<float> gate = normal_values(size_t(rows * width), 4.f, 11);
    const std::vector<float> up = normal_values(gate.size(), 2.f, 12);
    gate[0] = 200.f;  // silu saturates: g, and 0 for -200
    if (gate.size() > 1) gate[1] = -200.f;
    DeviceBytes dg(gate.size() * 4), du(up.size() * 4);
    dg.upload(gate.data(), gate.size() * 4);
    du.upload(up.data(), up.size() * 4);
    float* pg = reinterpret_cast<float*>(dg.data());
    ASSERT_TRUE(swiglu_rows(pg, reinterpret_cast<float*>(du.data()), rows, width, width, pg, nullptr).ok);  // in place
    const std::vector<float> got = run_and_read<float>(dg, gate.size());
    std::vector<float> ref = gate;
    backend::swiglu_rows(ref.data(), up.data(), rows, width);
    for (size_t i = 0; i < gate.size(); ++i)  // expf against the host's exp, then a division and a product
      ASSERT_NEAR(got[i], ref[i], std::ldexp(std::fabs(ref[i]), -20) + 1e-30f) << "rows " << rows << " i " << i;
  }
}

TEST(ForwardKernels, ElementwiseKernelsAreExact) {
  CERTKV_NEED_CUDA_DEVICE();
  const int64_t rows = 17;
  const int width = 192, n_vocab = 50;
  const std::vector<float> x = normal_values(size_t(rows * width), 1.f, 21);
  const std::vector<float> y = normal_values(x.size(), 1.f, 22);
  const std::vector<float> b = normal_values(size_t(width), 1.f, 23);
  DeviceBytes dx(x.size() * 4), dy(y.size() * 4), db(b.size() * 4), dbf(x.size() * 4), dsum(x.size() * 4);
  dx.upload(x.data(), x.size() * 4);
  dy.upload(y.data(), y.size() * 4);
  db.upload(b.data(), b.size() * 4);
  float* px = reinterpret_cast<float*>(dx.data());
  // The two bf16 terms: the high term x rounded, the low term the rest rounded, together x to
  // 2^-16 of |x|.
  ASSERT_TRUE(split_bf16_rows(px, rows, width, reinterpret_cast<uint16_t*>(dbf.data()), nullptr).ok);
  const std::vector<uint16_t> bf = run_and_read<uint16_t>(dbf, 2 * x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bf[i], format::float_to_bf16(x[i]));
    ASSERT_EQ(bf[x.size() + i], format::float_to_bf16(x[i] - format::bf16_to_float(bf[i])));
    ASSERT_LE(std::fabs(format::bf16_to_float(bf[i]) + format::bf16_to_float(bf[x.size() + i]) - x[i]),
              std::ldexp(std::fabs(x[i]), -16));
  }
  // The three partial products summed in their order: (t_hi + t_lo) + u.
  const std::vector<float> t = normal_values(2 * x.size(), 1.f, 24);
  DeviceBytes dt3(t.size() * 4);
  dt3.upload(t.data(), t.size() * 4);
  ASSERT_TRUE(sum_split_products(reinterpret_cast<float*>(dt3.data()), reinterpret_cast<float*>(dy.data()), rows, width,
                                 reinterpret_cast<float*>(dsum.data()), nullptr)
                  .ok);
  const std::vector<float> summed = run_and_read<float>(dsum, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(summed[i], (t[i] + t[x.size() + i]) + y[i]);
  ASSERT_TRUE(add_rows(px, reinterpret_cast<float*>(dy.data()), int64_t(x.size()), nullptr).ok);
  ASSERT_TRUE(add_bias_rows(px, reinterpret_cast<float*>(db.data()), rows, width, nullptr).ok);
  const std::vector<float> sum = run_and_read<float>(dx, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(sum[i], (x[i] + y[i]) + b[i % size_t(width)]);

  // Embedding rows of a bf16 table, and of a two-term one, tokens at both ends of the vocabulary.
  std::vector<uint16_t> table(size_t(2 * n_vocab * width));
  for (size_t i = 0; i < table.size(); ++i) table[i] = format::float_to_bf16(float(int(i % 997) - 498) / 64.f);
  const std::vector<int32_t> tokens = {0, 49, 7, 7, 23};
  DeviceBytes dt(table.size() * 2), dtok(tokens.size() * 4), de(tokens.size() * width * 4);
  dt.upload(table.data(), table.size() * 2);
  dtok.upload(tokens.data(), tokens.size() * 4);
  const uint16_t* hi = reinterpret_cast<uint16_t*>(dt.data());
  for (const bool two_terms : {false, true}) {
    ASSERT_TRUE(embed_rows(reinterpret_cast<int32_t*>(dtok.data()), int64_t(tokens.size()), hi,
                           two_terms ? hi + n_vocab * width : nullptr, n_vocab, width, reinterpret_cast<float*>(de.data()),
                           nullptr)
                    .ok);
    const std::vector<float> e = run_and_read<float>(de, tokens.size() * width);
    for (size_t r = 0; r < tokens.size(); ++r)
      for (int i = 0; i < width; ++i) {
        const size_t at = size_t(tokens[r]) * width + size_t(i);
        const float want = two_terms ? format::bf16_to_float(table[at]) + format::bf16_to_float(table[size_t(n_vocab * width) + at])
                                     : format::bf16_to_float(table[at]);
        ASSERT_EQ(e[r * width + size_t(i)], want) << "two terms " << two_terms;
      }
  }
}

TEST(ForwardKernels, GatherAndScatterMoveWholeRows) {
  CERTKV_NEED_CUDA_DEVICE();
  const int64_t rows = 11;
  const int width = 77;  // not a multiple of the block
  const std::vector<float> x = normal_values(size_t(rows * width), 1.f, 41);
  const std::vector<int32_t> index = {10, 3, 0, 7, 4, 9, 1};  // a subset, out of order
  const int64_t n = int64_t(index.size());
  DeviceBytes dx(x.size() * 4), di(index.size() * 4), dg(size_t(n) * width * 4), ds(x.size() * 4);
  dx.upload(x.data(), x.size() * 4);
  di.upload(index.data(), index.size() * 4);
  const std::vector<float> zeros(x.size(), 0.f);
  ds.upload(zeros.data(), zeros.size() * 4);
  const int32_t* pi = reinterpret_cast<int32_t*>(di.data());
  ASSERT_TRUE(gather_rows(reinterpret_cast<float*>(dx.data()), pi, n, width, reinterpret_cast<float*>(dg.data()),
                          nullptr)
                  .ok);
  ASSERT_TRUE(scatter_rows(reinterpret_cast<float*>(dg.data()), pi, n, width, reinterpret_cast<float*>(ds.data()),
                           nullptr)
                  .ok);
  const std::vector<float> g = run_and_read<float>(dg, size_t(n) * width);
  const std::vector<float> back = run_and_read<float>(ds, x.size());
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < width; ++i)
      ASSERT_EQ(g[size_t(j * width + i)], x[size_t(index[size_t(j)] * width + i)]) << "row " << j;
  std::vector<bool> gathered(size_t(rows), false);
  for (int32_t r : index) gathered[size_t(r)] = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < width; ++i)
      ASSERT_EQ(back[size_t(r * width + i)], gathered[size_t(r)] ? x[size_t(r * width + i)] : 0.f) << "row " << r;
}

TEST(ForwardKernels, SplitColumnsAndStridedSwiglu) {
  CERTKV_NEED_CUDA_DEVICE();
  const int64_t rows = 5;
  const int width = 2 * 96;  // [gate | up] of 96, and q, k, v of 64, 64, 64
  const std::vector<float> y = normal_values(size_t(rows * width), 2.f, 61);
  DeviceBytes dy(y.size() * 4), dq(size_t(rows) * 64 * 4), dk(size_t(rows) * 64 * 4), dv(size_t(rows) * 64 * 4),
      ds(size_t(rows) * 96 * 4);
  dy.upload(y.data(), y.size() * 4);
  const ColumnPart parts[3] = {{reinterpret_cast<float*>(dq.data()), 0, 64},
                               {reinterpret_cast<float*>(dk.data()), 64, 64},
                               {reinterpret_cast<float*>(dv.data()), 128, 64}};
  const float* py = reinterpret_cast<float*>(dy.data());
  ASSERT_TRUE(split_columns(py, rows, width, parts, 3, nullptr).ok);
  ASSERT_TRUE(swiglu_rows(py, py + 96, rows, 96, width, reinterpret_cast<float*>(ds.data()), nullptr).ok);
  const DeviceBytes* outs[3] = {&dq, &dk, &dv};
  for (int j = 0; j < 3; ++j) {
    const std::vector<float> got = run_and_read<float>(*outs[j], size_t(rows) * 64);
    for (int64_t r = 0; r < rows; ++r)
      for (int i = 0; i < 64; ++i) ASSERT_EQ(got[size_t(r * 64 + i)], y[size_t(r * width + 64 * j + i)]) << "part " << j;
  }
  const std::vector<float> got = run_and_read<float>(ds, size_t(rows) * 96);
  std::vector<float> gate(size_t(rows) * 96), up(gate.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < 96; ++i) {
      gate[size_t(r * 96 + i)] = y[size_t(r * width + i)];
      up[size_t(r * 96 + i)] = y[size_t(r * width + 96 + i)];
    }
  backend::swiglu_rows(gate.data(), up.data(), rows, 96);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], gate[i], std::ldexp(std::fabs(gate[i]), -20) + 1e-30f);
}

TEST(ForwardKernels, ArgmaxIsTheHostsFirstLargest) {
  CERTKV_NEED_CUDA_DEVICE();
  const int n = 49152;
  std::vector<std::vector<float>> rows;
  rows.push_back(normal_values(size_t(n), 5.f, 31));
  std::vector<float> tie(size_t(n), 1.f);
  tie[40000] = 2.f;
  tie[300] = 2.f;  // the first of two equal maxima
  rows.push_back(tie);
  std::vector<float> nan_first = normal_values(size_t(n), 1.f, 32);
  nan_first[0] = std::numeric_limits<float>::quiet_NaN();  // never beaten on the host
  rows.push_back(nan_first);
  std::vector<float> nan_later = normal_values(size_t(n), 1.f, 33);
  nan_later[n - 1] = std::numeric_limits<float>::quiet_NaN();
  nan_later[12345] = 100.f;
  rows.push_back(nan_later);
  rows.push_back(std::vector<float>(size_t(n), -std::numeric_limits<float>::infinity()));
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  DeviceBytes dl(flat.size() * 4), dout(rows.size() * 4);
  dl.upload(flat.data(), flat.size() * 4);
  ASSERT_TRUE(argmax_rows(reinterpret_cast<float*>(dl.data()), int64_t(rows.size()), n,
                          reinterpret_cast<int32_t*>(dout.data()), nullptr)
                  .ok);
  const std::vector<int32_t> got = run_and_read<int32_t>(dout, rows.size());
  for (size_t r = 0; r < rows.size(); ++r) EXPECT_EQ(got[r], model::argmax(rows[r].data(), n)) << "row " << r;
}

// Draws rows of `logits` ([*][n]) on the device for `params` (one SampleRow each, logit rows
// given), greedy rows first as sample_rows wants them; returns the tokens in params' order.
std::vector<int32_t> device_draws(const std::vector<float>& logits, int n, const std::vector<SampleRow>& params) {
  std::vector<size_t> order;
  for (int greedy = 1; greedy >= 0; --greedy)
    for (size_t j = 0; j < params.size(); ++j)
      if ((params[j].temperature == 0.f) == bool(greedy)) order.push_back(j);
  std::vector<SampleRow> rows;
  int n_greedy = 0;
  for (size_t j : order) {
    rows.push_back(params[j]);
    n_greedy += params[j].temperature == 0.f;
  }
  const int m = int(rows.size());
  const size_t ws = sample_rows_workspace_bytes(m - n_greedy, n);
  DeviceBytes dl(logits.size() * 4), dr(rows.size() * sizeof(SampleRow)), dt(rows.size() * 4), dw(std::max<size_t>(ws, 1));
  dl.upload(logits.data(), logits.size() * 4);
  dr.upload(rows.data(), rows.size() * sizeof(SampleRow));
  const CudaStatus st = sample_rows(reinterpret_cast<float*>(dl.data()), n, reinterpret_cast<SampleRow*>(dr.data()), m,
                                    n_greedy, reinterpret_cast<int32_t*>(dt.data()), dw.data(), ws, nullptr);
  EXPECT_TRUE(st.ok) << st.message;
  const std::vector<int32_t> got = run_and_read<int32_t>(dt, rows.size());
  std::vector<int32_t> out(params.size());
  for (size_t k = 0; k < order.size(); ++k) out[order[k]] = got[k];
  return out;
}

model::SamplerParams host_params(const SampleRow& r) {
  model::SamplerParams p;
  p.temperature = r.temperature;
  p.top_k = r.top_k;
  p.top_p = r.top_p;
  return p;
}

// Every draw equals model::sample_token's from the same logits and uniform: ragged vocabularies
// (up to Qwen2.5's 151,936), temperatures, top-k and top-p cuts, greedy rows mixed in.
TEST(SampleKernels, DrawTheHostsTokensFromTheSameLogits) {
  CERTKV_NEED_CUDA_DEVICE();
  for (const int n : {7, 1000, 49152, 151936}) {
    std::vector<float> logits;
    std::vector<SampleRow> params;
    std::mt19937_64 rng{uint64_t(n)};
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    int row = 0;
    for (const float t : {0.f, 0.3f, 1.f, 2.5f})
      for (const int k : {0, 1, 5, 40})
        for (const float p : {1.f, 0.9f, 0.3f}) {
          const std::vector<float> l = normal_values(size_t(n), 4.f, uint32_t(n + row));
          logits.insert(logits.end(), l.begin(), l.end());
          params.push_back(SampleRow{row++, k, t, p, unit(rng)});
        }
    const std::vector<int32_t> got = device_draws(logits, n, params);
    for (size_t j = 0; j < params.size(); ++j) {
      const SampleRow& r = params[j];
      EXPECT_EQ(got[j], model::sample_token(&logits[size_t(r.logit_row) * size_t(n)], n, host_params(r), r.u))
          << "n " << n << " T " << r.temperature << " top_k " << r.top_k << " top_p " << r.top_p << " u " << r.u;
    }
  }
}

// The order of equal keys (lower id first), -0 equal to +0, NaN logits as -inf, and uniforms at
// the ends of [0, 1): the same tokens as the host.
TEST(SampleKernels, TiesZerosAndNansAsTheHost) {
  CERTKV_NEED_CUDA_DEVICE();
  const int n = 3000;
  std::vector<float> ties(size_t(n), -5.f);
  for (int i : {2999, 17, 1500, 3}) ties[size_t(i)] = 1.f;  // four equal maxima
  std::vector<float> zeros(size_t(n), -30.f);
  zeros[10] = -0.f;
  zeros[5] = 0.f;
  zeros[2000] = -0.f;
  std::vector<float> nans = normal_values(size_t(n), 2.f, 5);
  for (int i = 0; i < n; i += 7) nans[size_t(i)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits;
  for (const auto* l : {&ties, &zeros, &nans}) logits.insert(logits.end(), l->begin(), l->end());
  std::vector<SampleRow> params;
  for (int row = 0; row < 3; ++row)
    for (const double u : {0.0, 0.1, 0.26, 0.49, 0.51, 0.74, 0.76, 0.999, 1.0 - 0x1.0p-53})
      for (const int k : {0, 2})
        params.push_back(SampleRow{row, k, 1.f, 1.f, u});
  params.push_back(SampleRow{2, 0, 0.f, 1.f, 0.5});  // greedy over NaNs
  const std::vector<int32_t> got = device_draws(logits, n, params);
  for (size_t j = 0; j < params.size(); ++j) {
    const SampleRow& r = params[j];
    const int32_t want = model::sample_token(&logits[size_t(r.logit_row) * size_t(n)], n, host_params(r), r.u);
    EXPECT_EQ(got[j], want) << "row " << r.logit_row << " top_k " << r.top_k << " u " << r.u;
    // A draw never takes a NaN logit (greedy keeps model::argmax's rule: a NaN at id 0 stands).
    if (r.logit_row == 2 && r.temperature > 0.f) {
      EXPECT_NE(got[j] % 7, 0) << "a NaN logit was drawn";
    }
  }
}

TEST(SampleKernels, RefusesBadCountsAndASmallWorkspace) {
  float* p = reinterpret_cast<float*>(uintptr_t(256));
  SampleRow* rows = reinterpret_cast<SampleRow*>(uintptr_t(512));
  int32_t* t = reinterpret_cast<int32_t*>(uintptr_t(768));
  EXPECT_EQ(sample_rows(p, 0, rows, 1, 1, t, nullptr, 0, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sample_rows(p, 10, rows, 2, 3, t, nullptr, 0, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sample_rows(p, 10, nullptr, 2, 1, t, nullptr, 0, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sample_rows(p, 151936, rows, 20000, 0, t, nullptr, 0, nullptr).code, StatusCode::kInvalidArgument);
  // One row with a temperature needs its keys and the sort's storage.
  EXPECT_GT(sample_rows_workspace_bytes(1, 10), size_t(0));
  EXPECT_EQ(sample_rows(p, 10, rows, 2, 1, t, p, sample_rows_workspace_bytes(1, 10) - 1, nullptr).code,
            StatusCode::kInvalidArgument);
  EXPECT_EQ(sample_rows_workspace_bytes(0, 10), size_t(0));
  EXPECT_TRUE(sample_rows(p, 10, rows, 0, 0, t, nullptr, 0, nullptr).ok);  // nothing to do
}

TEST(DeviceMatmul, MatchesTheDoubleReferenceOnRaggedRows) {
  CERTKV_NEED_CUDA_DEVICE();
  std::unique_ptr<DeviceMatmul> mm;
  ASSERT_TRUE(DeviceMatmul::create(nullptr, &mm).ok);
  const int64_t n_in = 576, n_out = 192;
  const std::vector<float> wf = normal_values(size_t(n_in * n_out), 0.05f, 41);
  const model::WeightMatrix w = f32_matrix(wf, n_in, n_out);
  DeviceMatrix dm;
  ASSERT_TRUE(upload_matrix(w, &dm).ok);
  ASSERT_EQ(dequantized_weights(w), wf);
  for (const int64_t rows : kRaggedRows) {
    const std::vector<float> x = normal_values(size_t(rows * n_in), 1.f, uint32_t(rows));
    DeviceBytes dx(x.size() * 4), dy(size_t(rows * n_out) * 4);
    dx.upload(x.data(), x.size() * 4);
    ASSERT_TRUE(mm->multiply(dm, reinterpret_cast<float*>(dx.data()), rows, reinterpret_cast<float*>(dy.data())).ok);
    const std::vector<float> y = run_and_read<float>(dy, size_t(rows * n_out));
    std::vector<double> ref(y.size());
    device_matmul_ref(wf.data(), n_in, n_out, x.data(), rows, ref.data());
    double sum_sq = 0;
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t o = 0; o < n_out; ++o) {
        double magnitude = 0;
        for (int64_t i = 0; i < n_in; ++i)
          magnitude += std::fabs(double(x[size_t(t * n_in + i)]) * double(wf[size_t(o * n_in + i)]));
        // Per product the terms left out are within 3 * 2^-18 of |w x| (the two lows' rounding
        // and W_lo x_lo); the three fp32 sums over n_in terms (any order; 4x for adders that
        // truncate) and the two adds after them within 3 n_in 2^-22 of the magnitude.
        const double err = std::fabs(double(y[size_t(t * n_out + o)]) - ref[size_t(t * n_out + o)]);
        ASSERT_LE(err, magnitude * (3 * std::ldexp(1.0, -18) + 3 * double(n_in) * std::ldexp(1.0, -22)))
            << "rows " << rows;
        sum_sq += (err / magnitude) * (err / magnitude);
      }
    // Typically far inside that: at fp32's own level. One bf16 product (each operand rounded to
    // 8 bits) sits near 2^-15 of the magnitude here; the split products must stay below 2^-18.
    EXPECT_LT(std::sqrt(sum_sq / double(rows * n_out)), std::ldexp(1.0, -18)) << "rows " << rows;
  }
}

// Batch invariance of the weight products: a row's outputs must not depend on how many rows
// share the product. Rows of SmolLM2's shapes (q, k, v stacked: 576 -> 960; gate, up: 576 ->
// 3072) and Qwen2.5-0.5B's (896 -> 1152, 896 -> 9728, 4864 -> 896), every count from 1 to 64
// rows, then 100 and 512; the first row compared bit for bit with the same row alone.
TEST(DeviceMatmul, ARowsProductDoesNotDependOnTheRowCount) {
  CERTKV_NEED_CUDA_DEVICE();
  std::unique_ptr<DeviceMatmul> mm;
  ASSERT_TRUE(DeviceMatmul::create(nullptr, &mm).ok);
  for (const auto& [n_in, n_out] : {std::pair<int64_t, int64_t>{576, 576}, {576, 960}, {576, 3072}, {1536, 576},
                                    {576, 49152}, {896, 1152}, {896, 9728}, {4864, 896}}) {
    const std::vector<float> wf = normal_values(size_t(n_in * n_out), 0.05f, 51);
    const model::WeightMatrix w = f32_matrix(wf, n_in, n_out);
    DeviceMatrix dm;
    ASSERT_TRUE(upload_matrix(w, &dm).ok);
    const int64_t max_rows = 512;
    const std::vector<float> x = normal_values(size_t(max_rows * n_in), 1.f, 52);
    DeviceBytes dx(x.size() * 4), dy(size_t(max_rows * n_out) * 4);
    dx.upload(x.data(), x.size() * 4);
    std::vector<float> alone;
    std::vector<int64_t> counts;
    for (int64_t rows = 1; rows <= kProductRows; ++rows) counts.push_back(rows);
    counts.push_back(100);
    counts.push_back(max_rows);
    for (const int64_t rows : counts) {
      ASSERT_TRUE(mm->multiply(dm, reinterpret_cast<float*>(dx.data()), rows, reinterpret_cast<float*>(dy.data())).ok);
      const std::vector<float> y = run_and_read<float>(dy, size_t(n_out));  // row 0
      if (alone.empty()) alone = y;
      EXPECT_TRUE(std::equal(y.begin(), y.end(), alone.begin()))
          << n_in << " -> " << n_out << ": row 0 among " << rows << " rows differs from row 0 alone";
    }
  }
}

// The pinned kernel: one cuBLASLt algorithm per shape for every row count, so a row keeps its
// bits from 1 row to several chunks of kPinnedProductRows.
TEST(DeviceMatmul, APinnedRowsProductDoesNotDependOnTheRowCount) {
  CERTKV_NEED_CUDA_DEVICE();
  std::unique_ptr<DeviceMatmul> mm;
  ASSERT_TRUE(DeviceMatmul::create(nullptr, &mm, ProductKernel::kPinned).ok);
  for (const auto& [n_in, n_out] : {std::pair<int64_t, int64_t>{576, 576}, {576, 3072}, {1536, 576}, {576, 49152},
                                    {896, 1152}, {896, 9728}, {4864, 896}}) {
    const std::vector<float> wf = normal_values(size_t(n_in * n_out), 0.05f, 53);
    const model::WeightMatrix w = f32_matrix(wf, n_in, n_out);
    DeviceMatrix dm;
    ASSERT_TRUE(upload_matrix(w, &dm).ok);
    const CudaStatus pinned = mm->reserve(n_in, n_out);
    ASSERT_TRUE(pinned.ok) << pinned.message;
    const int64_t max_rows = 2 * kPinnedProductRows + 1;
    const std::vector<float> x = normal_values(size_t(max_rows * n_in), 1.f, 54);
    DeviceBytes dx(x.size() * 4), dy(size_t(max_rows * n_out) * 4);
    dx.upload(x.data(), x.size() * 4);
    std::vector<float> alone;
    std::vector<int64_t> counts;
    for (int64_t rows = 1; rows <= 80; ++rows) counts.push_back(rows);
    for (const int64_t rows : {int64_t(100), int64_t(512), int64_t(1000), kPinnedProductRows, kPinnedProductRows + 1,
                               max_rows})
      counts.push_back(rows);
    for (const int64_t rows : counts) {
      ASSERT_TRUE(mm->multiply(dm, reinterpret_cast<float*>(dx.data()), rows, reinterpret_cast<float*>(dy.data())).ok);
      const std::vector<float> y = run_and_read<float>(dy, size_t(n_out));  // row 0
      if (alone.empty()) alone = y;
      EXPECT_TRUE(std::equal(y.begin(), y.end(), alone.begin()))
          << n_in << " -> " << n_out << ": row 0 among " << rows << " rows differs from row 0 alone";
    }
    // Within the same bound as the heuristic kernel's products (MatchesTheDoubleReference...).
    std::vector<double> ref(static_cast<size_t>(n_out));
    device_matmul_ref(wf.data(), n_in, n_out, x.data(), 1, ref.data());
    for (int64_t o = 0; o < n_out; ++o) {
      double magnitude = 0;
      for (int64_t i = 0; i < n_in; ++i) magnitude += std::fabs(double(x[size_t(i)]) * double(wf[size_t(o * n_in + i)]));
      ASSERT_LE(std::fabs(double(alone[size_t(o)]) - ref[size_t(o)]),
                magnitude * (3 * std::ldexp(1.0, -18) + 3 * double(n_in) * std::ldexp(1.0, -22)))
          << n_in << " -> " << n_out << " output " << o;
    }
  }
  EXPECT_EQ(DeviceMatmul::create(nullptr, &mm, ProductKernel::kPinned, 0).code, StatusCode::kInvalidArgument);
}

// Each fused form against the kernels it replaces, bit for bit, on ragged rows; the qkv form with
// and without biases.
TEST(ForwardKernels, FusedFormsGiveTheUnfusedBits) {
  CERTKV_NEED_CUDA_DEVICE();
  auto floats_of = [](const DeviceBytes& b) { return reinterpret_cast<float*>(b.data()); };
  auto terms_of = [](const DeviceBytes& b) { return reinterpret_cast<uint16_t*>(b.data()); };
  for (const int64_t rows : kRaggedRows) {
    SCOPED_TRACE(rows);
    const int n = 896, ffn = 320, qw = 448, kw = 64;
    // RMSNorm, then split.
    {
      const std::vector<float> x = normal_values(size_t(rows * n), 2.f, 61), w = normal_values(size_t(n), 1.f, 62);
      DeviceBytes dx(x.size() * 4), dw(w.size() * 4), dy(x.size() * 4), a(x.size() * 4), b(x.size() * 4);
      dx.upload(x.data(), x.size() * 4);
      dw.upload(w.data(), w.size() * 4);
      ASSERT_TRUE(rms_norm_rows(floats_of(dx), rows, n, floats_of(dw), 1e-6f, floats_of(dy), nullptr).ok);
      ASSERT_TRUE(split_bf16_rows(floats_of(dy), rows, n, terms_of(a), nullptr).ok);
      ASSERT_TRUE(rms_norm_split_rows(floats_of(dx), rows, n, floats_of(dw), 1e-6f, terms_of(b), nullptr).ok);
      EXPECT_EQ(run_and_read<uint16_t>(a, size_t(2 * rows * n)), run_and_read<uint16_t>(b, size_t(2 * rows * n)));
    }
    // A product's sum into the residual stream.
    {
      const std::vector<float> t = normal_values(size_t(2 * rows * n), 3.f, 63), u = normal_values(size_t(rows * n), 1.f, 64),
                               x = normal_values(size_t(rows * n), 5.f, 65);
      DeviceBytes dt(t.size() * 4), du(u.size() * 4), x1(x.size() * 4), x2(x.size() * 4), y(x.size() * 4);
      dt.upload(t.data(), t.size() * 4);
      du.upload(u.data(), u.size() * 4);
      x1.upload(x.data(), x.size() * 4);
      x2.upload(x.data(), x.size() * 4);
      ASSERT_TRUE(sum_split_products(floats_of(dt), floats_of(du), rows, n, floats_of(y), nullptr).ok);
      ASSERT_TRUE(add_rows(floats_of(x1), floats_of(y), rows * n, nullptr).ok);
      ASSERT_TRUE(sum_split_add_rows(floats_of(dt), floats_of(du), rows, n, floats_of(x2), nullptr).ok);
      EXPECT_EQ(run_and_read<uint32_t>(x1, x.size()), run_and_read<uint32_t>(x2, x.size()));
    }
    // [gate | up] sums through SwiGLU, split.
    {
      const std::vector<float> t = normal_values(size_t(2 * rows * 2 * ffn), 2.f, 66),
                               u = normal_values(size_t(rows * 2 * ffn), 0.5f, 67);
      DeviceBytes dt(t.size() * 4), du(u.size() * 4), y(u.size() * 4), act(size_t(rows * ffn) * 4),
          a(size_t(2 * rows * ffn) * 2), b(size_t(2 * rows * ffn) * 2);
      dt.upload(t.data(), t.size() * 4);
      du.upload(u.data(), u.size() * 4);
      ASSERT_TRUE(sum_split_products(floats_of(dt), floats_of(du), rows, 2 * ffn, floats_of(y), nullptr).ok);
      ASSERT_TRUE(swiglu_rows(floats_of(y), floats_of(y) + ffn, rows, ffn, 2 * int64_t(ffn), floats_of(act), nullptr).ok);
      ASSERT_TRUE(split_bf16_rows(floats_of(act), rows, ffn, terms_of(a), nullptr).ok);
      ASSERT_TRUE(sum_split_swiglu_split_rows(floats_of(dt), floats_of(du), rows, ffn, terms_of(b), nullptr).ok);
      EXPECT_EQ(run_and_read<uint16_t>(a, size_t(2 * rows * ffn)), run_and_read<uint16_t>(b, size_t(2 * rows * ffn)));
    }
    // [q | k | v] sums into q, k, v, with biases and without.
    for (const bool bias : {true, false}) {
      const int width = qw + 2 * kw;
      const std::vector<float> t = normal_values(size_t(2 * rows * width), 2.f, 68),
                               u = normal_values(size_t(rows * width), 0.5f, 69),
                               bs = normal_values(size_t(width), 1.f, 70);
      DeviceBytes dt(t.size() * 4), du(u.size() * 4), db(bs.size() * 4), y(u.size() * 4);
      DeviceBytes q1(size_t(rows * qw) * 4), k1(size_t(rows * kw) * 4), v1(size_t(rows * kw) * 4);
      DeviceBytes q2(size_t(rows * qw) * 4), k2(size_t(rows * kw) * 4), v2(size_t(rows * kw) * 4);
      dt.upload(t.data(), t.size() * 4);
      du.upload(u.data(), u.size() * 4);
      db.upload(bs.data(), bs.size() * 4);
      ASSERT_TRUE(sum_split_products(floats_of(dt), floats_of(du), rows, width, floats_of(y), nullptr).ok);
      const ColumnPart parts[3] = {{floats_of(q1), 0, qw}, {floats_of(k1), qw, kw}, {floats_of(v1), qw + kw, kw}};
      ASSERT_TRUE(split_columns(floats_of(y), rows, width, parts, 3, nullptr).ok);
      const float* bq = floats_of(db);
      if (bias) {
        ASSERT_TRUE(add_bias_rows(floats_of(q1), bq, rows, qw, nullptr).ok);
        ASSERT_TRUE(add_bias_rows(floats_of(k1), bq + qw, rows, kw, nullptr).ok);
        ASSERT_TRUE(add_bias_rows(floats_of(v1), bq + qw + kw, rows, kw, nullptr).ok);
      }
      ASSERT_TRUE(sum_split_qkv_rows(floats_of(dt), floats_of(du), rows, qw, kw, bias ? bq : nullptr,
                                     bias ? bq + qw : nullptr, bias ? bq + qw + kw : nullptr, floats_of(q2),
                                     floats_of(k2), floats_of(v2), nullptr)
                      .ok);
      EXPECT_EQ(run_and_read<uint32_t>(q1, size_t(rows * qw)), run_and_read<uint32_t>(q2, size_t(rows * qw)));
      EXPECT_EQ(run_and_read<uint32_t>(k1, size_t(rows * kw)), run_and_read<uint32_t>(k2, size_t(rows * kw)));
      EXPECT_EQ(run_and_read<uint32_t>(v1, size_t(rows * kw)), run_and_read<uint32_t>(v2, size_t(rows * kw)));
    }
  }
}

// The products of an input split ahead (what the fused forward runs) give multiply()'s bits once
// summed; they need the pinned kernel and one chunk.
TEST(DeviceMatmul, ProductsOfASplitInputGiveMultiplysBits) {
  CERTKV_NEED_CUDA_DEVICE();
  std::unique_ptr<DeviceMatmul> mm;
  ASSERT_TRUE(DeviceMatmul::create(nullptr, &mm, ProductKernel::kPinned).ok);
  const int64_t n_in = 896, n_out = 1152;
  const std::vector<float> wf = normal_values(size_t(n_in * n_out), 0.05f, 71);
  DeviceMatrix dm;
  ASSERT_TRUE(upload_matrix(f32_matrix(wf, n_in, n_out), &dm).ok);
  ASSERT_TRUE(mm->reserve(n_in, n_out).ok);
  for (const int64_t rows : {int64_t(1), int64_t(7), int64_t(64), int64_t(300), kPinnedProductRows}) {
    const std::vector<float> x = normal_values(size_t(rows * n_in), 1.f, uint32_t(72 + rows));
    DeviceBytes dx(x.size() * 4), y1(size_t(rows * n_out) * 4), y2(size_t(rows * n_out) * 4), terms(x.size() * 4);
    dx.upload(x.data(), x.size() * 4);
    ASSERT_TRUE(mm->multiply(dm, reinterpret_cast<float*>(dx.data()), rows, reinterpret_cast<float*>(y1.data())).ok);
    uint16_t* hi_lo = reinterpret_cast<uint16_t*>(terms.data());
    ASSERT_TRUE(split_bf16_rows(reinterpret_cast<float*>(dx.data()), rows, int(n_in), hi_lo, nullptr).ok);
    const float *t = nullptr, *u = nullptr;
    ASSERT_TRUE(mm->products(dm, hi_lo, rows, &t, &u).ok);
    ASSERT_TRUE(sum_split_products(t, u, rows, int(n_out), reinterpret_cast<float*>(y2.data()), nullptr).ok);
    EXPECT_EQ(run_and_read<uint32_t>(y1, size_t(rows * n_out)), run_and_read<uint32_t>(y2, size_t(rows * n_out)))
        << rows << " rows";
  }
  const float* t = nullptr;
  const float* u = nullptr;
  DeviceBytes one(size_t(2 * n_in) * 2);
  const uint16_t* hi_lo = reinterpret_cast<const uint16_t*>(one.data());
  EXPECT_EQ(mm->products(dm, hi_lo, 0, &t, &u).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(mm->products(dm, hi_lo, kPinnedProductRows + 1, &t, &u).code, StatusCode::kInvalidArgument);
  std::unique_ptr<DeviceMatmul> heuristic;
  ASSERT_TRUE(DeviceMatmul::create(nullptr, &heuristic, ProductKernel::kHeuristic).ok);
  EXPECT_EQ(heuristic->products(dm, hi_lo, 1, &t, &u).code, StatusCode::kInvalidArgument);
}

TEST(ForwardKernels, RefuseBadShapesBeforeAnyLaunch) {
  float* p = reinterpret_cast<float*>(uintptr_t(256));  // never dereferenced: refused first
  uint16_t* b = reinterpret_cast<uint16_t*>(uintptr_t(256));
  EXPECT_EQ(rms_norm_rows(p, 2, 0, p, 1e-5f, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rms_norm_rows(p, 2, 8, p, 1e-5f, nullptr, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rms_norm_rows(p, -1, 8, p, 1e-5f, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rope_rows(p, 2, 3, 63, false, p, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rope_rows(p, 2, 0, 64, false, p, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rope_rows(nullptr, 2, 3, 64, false, p, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(swiglu_rows(p, nullptr, 2, 8, 8, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(swiglu_rows(p, p, 2, 8, 7, p, nullptr).code, StatusCode::kInvalidArgument);
  const ColumnPart outside{p, 5, 4};
  EXPECT_EQ(split_columns(p, 2, 8, &outside, 1, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(add_rows(nullptr, p, 4, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(add_bias_rows(p, p, 2, 0, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(split_bf16_rows(p, -1, 8, b, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sum_split_products(p, nullptr, 2, 8, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rms_norm_split_rows(p, 2, 8, p, -1.f, b, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(rms_norm_split_rows(p, 2, 8, p, 1e-5f, nullptr, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sum_split_add_rows(p, p, 2, 0, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sum_split_swiglu_split_rows(p, nullptr, 2, 8, b, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(sum_split_qkv_rows(p, p, 2, 8, 0, nullptr, nullptr, nullptr, p, p, p, nullptr).code,
            StatusCode::kInvalidArgument);
  EXPECT_EQ(sum_split_qkv_rows(p, p, 2, 8, 4, nullptr, nullptr, nullptr, p, nullptr, p, nullptr).code,
            StatusCode::kInvalidArgument);
  EXPECT_EQ(embed_rows(nullptr, 2, b, nullptr, 10, 8, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(argmax_rows(p, 2, 0, reinterpret_cast<int32_t*>(p), nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(gather_rows(p, nullptr, 2, 8, p, nullptr).code, StatusCode::kInvalidArgument);
  EXPECT_EQ(scatter_rows(p, reinterpret_cast<int32_t*>(p), 2, 0, p, nullptr).code, StatusCode::kInvalidArgument);
  // Nothing to do is not an error.
  EXPECT_TRUE(rms_norm_rows(p, 0, 8, p, 1e-5f, p, nullptr).ok);
  EXPECT_TRUE(add_rows(nullptr, nullptr, 0, nullptr).ok);
}

}  // namespace
}  // namespace certkv::backend::cuda
