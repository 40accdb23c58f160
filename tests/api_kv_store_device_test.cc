// The C API's KV store on a CUDA device (device "cuda", certkv_kv_store_append_device and
// _attend_device) against the same store on the CPU given the same rows: three sequences of
// ragged lengths appended in one call per layer (a prompt each, then decode steps), decode steps of
// all three in one call. For every scheme the device serves (bf16, gaac calibrated on its first
// append, fp8-e4m3 with the fp16 and the exponent witness, dither8) at head_dim 64 (GQA 3) and
// 128 (GQA 7): outputs as the CPU store's, a lossy scheme's meter at or above the true total
// variation (over the rows the CPU store reads back: the same pages) and within the device
// route's bar of the CPU store's, the telemetry's cells, the pages by class; then the refusals.
// The queries are bf16 values, as the device rounds them (session_cuda_test.cc does the same).
// Needs a CUDA device (skipped without one); run on the GPU machine by scripts/run_cuda_tests.sh.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "certkv/certkv.h"

namespace {

constexpr int kLayers = 2, kSeqs = 3, kSteps = 20;
// Two prompts pass a round of the device store's append (2,048 rows of a sequence), so their
// append stores two rounds, the first one's encode results read before the second; dither8's
// first prompt goes whole (its outlier pairs chosen from all 2,100 rows, as the host store
// chooses them), the others in rounds.
constexpr int kPrompt[kSeqs] = {2100, 16, 2090};

bool error_names(const char* text) { return std::string(certkv_last_error()).find(text) != std::string::npos; }

// x rounded to bf16 (nearest even), as a float.
float bf16_value(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device memory of floats, freed at scope exit.
struct DeviceFloats {
  float* p = nullptr;
  explicit DeviceFloats(size_t n) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess); }
  ~DeviceFloats() { cudaFree(p); }
  void up(const std::vector<float>& x) {
    ASSERT_EQ(cudaMemcpy(p, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<float> down(size_t n) const {
    std::vector<float> x(n);
    EXPECT_EQ(cudaMemcpy(x.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return x;
  }
};

struct Shape {
  int heads, kv_heads, dim;
};

certkv_kv_store_params params(const char* kv, const char* witness, const Shape& sh, const char* device) {
  certkv_kv_store_params p = certkv_kv_store_default_params();
  p.kv = kv;
  p.witness = witness;
  p.n_layers = kLayers;
  p.n_heads = sh.heads;
  p.n_kv_heads = sh.kv_heads;
  p.head_dim = sh.dim;
  p.n_sequences = kSeqs;
  p.max_tokens = 8192;  // the three prompts, 20 steps each and a partial block each, with room
  p.rope_layout = "half-split";
  p.device = device;
  return p;
}

// Token-major rows [n][kv_heads][dim] of one (seq, layer): RoPE-like keys (a few large channels)
// or values, reproducible from the seed.
std::vector<float> make_rows(int n, const Shape& sh, uint32_t seed, bool keys) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(size_t(n) * size_t(sh.kv_heads) * size_t(sh.dim));
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = int(i % size_t(sh.dim));
    x[i] = (keys && c % 16 == 3 ? 5.f : 1.f) * normal(rng);
  }
  return x;
}

// [n][kv_heads][dim] -> [kv_heads][n][dim] (the host store's layout).
std::vector<float> head_major(const std::vector<float>& x, int n, const Shape& sh) {
  std::vector<float> y(x.size());
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < sh.kv_heads; ++h)
      std::memcpy(&y[(size_t(h) * n + t) * sh.dim], &x[(size_t(t) * sh.kv_heads + h) * sh.dim], sh.dim * sizeof(float));
  return y;
}

// The true total variation between the attention of q over the rows a store reads back (the
// pages) and over the exact rows, for query head hq of (seq, layer) with n positions.
double true_tv(certkv_kv_store* cpu, int seq, int layer, const float* q, int hq, const Shape& sh, int64_t n, double scale) {
  std::vector<float> read(size_t(sh.kv_heads) * size_t(n) * sh.dim), exact(read.size());
  EXPECT_EQ(certkv_kv_store_read(cpu, seq, layer, 0, 0, n, 0, read.data()), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_read(cpu, seq, layer, 0, 0, n, 1, exact.data()), CERTKV_OK) << certkv_last_error();
  const int h = hq / (sh.heads / sh.kv_heads);
  std::vector<double> lr(static_cast<size_t>(n)), le(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    double sr = 0, se = 0;
    for (int i = 0; i < sh.dim; ++i) {
      const size_t at = (size_t(h) * size_t(n) + size_t(t)) * size_t(sh.dim) + size_t(i);
      sr += double(q[i]) * read[at];
      se += double(q[i]) * exact[at];
    }
    lr[size_t(t)] = sr * scale;
    le[size_t(t)] = se * scale;
  }
  auto softmax = [](std::vector<double>& l) {
    const double mx = *std::max_element(l.begin(), l.end());
    double sum = 0;
    for (double& x : l) sum += (x = std::exp(x - mx));
    for (double& x : l) x /= sum;
  };
  softmax(lr);
  softmax(le);
  double tv = 0;
  for (int64_t t = 0; t < n; ++t) tv += 0.5 * std::fabs(lr[size_t(t)] - le[size_t(t)]);
  return tv;
}

uint64_t class_pages(const certkv_kv_stats& st, const char* storage) {
  for (int i = 0; i < st.n_classes; ++i)
    if (std::strcmp(st.by_class[i].storage, storage) == 0) return st.by_class[i].pages_in_use;
  return 0;
}

struct Case {
  const char* kv;
  const char* witness;
  const char* coded_class;  // the class a complete block goes to
};

TEST(CApiKvStoreDevice, DecodeStepsMatchTheCpuStore) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {{"bf16", nullptr, "bf16"},
                        {"gaac", nullptr, "gaac"},
                        {"fp8-e4m3", nullptr, "lossy"},
                        {"fp8-e4m3", "exponent", "lossy"},
                        {"dither8", nullptr, "dither8"}};
  const Shape shapes[] = {{6, 2, 64}, {14, 2, 128}};
  for (const Case& cs : cases)
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(std::string(cs.kv) + (cs.witness ? std::string(" witness ") + cs.witness : "") + " head_dim " +
                   std::to_string(sh.dim));
      const bool lossy = std::strcmp(cs.coded_class, "lossy") == 0 || std::strcmp(cs.coded_class, "dither8") == 0;
      const bool dither8 = std::strcmp(cs.kv, "dither8") == 0;
      certkv_kv_store_params pc = params(cs.kv, cs.witness, sh, nullptr);
      certkv_kv_store_params pd = params(cs.kv, cs.witness, sh, "cuda");
      certkv_kv_store *cpu = nullptr, *dev = nullptr;
      ASSERT_EQ(certkv_kv_store_create(&pc, &cpu), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
      const double scale = 1.0 / std::sqrt(double(sh.dim));
      const size_t row = size_t(sh.kv_heads) * size_t(sh.dim), qrow = size_t(sh.heads) * size_t(sh.dim);
      // Every row of (seq, layer), token-major: the prompt, then one per decode step.
      std::vector<std::vector<float>> k(kSeqs * kLayers), v(kSeqs * kLayers);
      for (int s = 0; s < kSeqs; ++s)
        for (int l = 0; l < kLayers; ++l) {
          k[size_t(s * kLayers + l)] = make_rows(kPrompt[s] + kSteps, sh, uint32_t(100 * s + 10 * l + 1), true);
          v[size_t(s * kLayers + l)] = make_rows(kPrompt[s] + kSteps, sh, uint32_t(100 * s + 10 * l + 2), false);
        }
      // Appends positions [begin[s], begin[s] + n[s]) of every sequence to a layer of both stores.
      auto append = [&](int l, const int64_t* begin, const int64_t* n) {
        std::vector<float> kd, vd;
        for (int s = 0; s < kSeqs; ++s) {
          const std::vector<float>& ks = k[size_t(s * kLayers + l)];
          const std::vector<float>& vs = v[size_t(s * kLayers + l)];
          const std::vector<float> kp(ks.begin() + begin[s] * int64_t(row), ks.begin() + (begin[s] + n[s]) * int64_t(row));
          const std::vector<float> vp(vs.begin() + begin[s] * int64_t(row), vs.begin() + (begin[s] + n[s]) * int64_t(row));
          kd.insert(kd.end(), kp.begin(), kp.end());
          vd.insert(vd.end(), vp.begin(), vp.end());
          ASSERT_EQ(certkv_kv_store_append_f32(cpu, s, l, head_major(kp, int(n[s]), sh).data(),
                                               head_major(vp, int(n[s]), sh).data(), n[s]),
                    CERTKV_OK)
              << certkv_last_error();
        }
        DeviceFloats dk(kd.size()), dv(vd.size());
        dk.up(kd);
        dv.up(vd);
        const int32_t seqs[kSeqs] = {0, 1, 2};
        ASSERT_EQ(certkv_kv_store_append_device(dev, l, seqs, n, kSeqs, dk.p, dv.p), CERTKV_OK) << certkv_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before dk, dv are freed
      };
      const int64_t zero[kSeqs] = {0, 0, 0}, prompt[kSeqs] = {kPrompt[0], kPrompt[1], kPrompt[2]};
      for (int l = 0; l < kLayers; ++l) append(l, zero, prompt);

      std::mt19937 rng(7);
      std::normal_distribution<float> normal(0.f, 1.f);
      double worst_out = 0, worst_gap = 0, min_slack = 1;
      int64_t metered_cells = 0;
      for (int step = 0; step < kSteps; ++step)
        for (int l = 0; l < kLayers; ++l) {
          const int64_t begin[kSeqs] = {kPrompt[0] + step, kPrompt[1] + step, kPrompt[2] + step}, one[kSeqs] = {1, 1, 1};
          append(l, begin, one);
          // Queries of bf16 values: the device rounds q to its tiles' element (bf16, or fp16, which
          // holds every bf16 value of this range), the host store does not.
          std::vector<float> q(kSeqs * qrow);
          for (float& x : q) x = bf16_value(2.f * normal(rng));
          DeviceFloats dq(q.size()), dout(q.size()), dmeters(size_t(kSeqs * sh.heads));
          dq.up(q);
          const int32_t seqs[kSeqs] = {2, 0, 1};  // not in slot order
          ASSERT_EQ(certkv_kv_store_attend_device(dev, l, seqs, kSeqs, dq.p, dout.p, dmeters.p), CERTKV_OK)
              << certkv_last_error();
          const std::vector<float> out = dout.down(q.size());
          const std::vector<float> meters = dmeters.down(size_t(kSeqs * sh.heads));
          for (int i = 0; i < kSeqs; ++i) {
            const int s = seqs[i];
            std::vector<float> out_cpu(qrow);
            std::vector<certkv_head_meter> m_cpu(size_t(sh.heads));
            ASSERT_EQ(certkv_kv_store_attend(cpu, s, l, &q[size_t(i) * qrow], 1, out_cpu.data(), m_cpu.data()), CERTKV_OK)
                << certkv_last_error();
            for (int hq = 0; hq < sh.heads; ++hq) {
              double num = 0, den = 0;
              for (int d = 0; d < sh.dim; ++d) {
                const double a = out[size_t(i) * qrow + size_t(hq) * sh.dim + d], b = out_cpu[size_t(hq) * sh.dim + d];
                num += (a - b) * (a - b);
                den += b * b;
              }
              worst_out = std::max(worst_out, std::sqrt(num / std::max(den, 1e-300)));
              const double md = meters[size_t(i) * sh.heads + hq], mc = m_cpu[size_t(hq)].meter;
              if (!lossy) {
                EXPECT_EQ(md, 0.0);
                continue;
              }
              ++metered_cells;
              const int64_t n = kPrompt[s] + step + 1;
              const double tv = true_tv(cpu, s, l, &q[size_t(i) * qrow + size_t(hq) * sh.dim], hq, sh, n, scale);
              EXPECT_GE(md, tv) << "seq " << s << " layer " << l << " head " << hq << ": the meter is below the true TV";
              min_slack = std::min(min_slack, md - tv);
              // The same pages on both (the device encodes the rows the CPU store encodes): only
              // float arithmetic apart, within the device route's bars (session_cuda_test.cc).
              const double tol = dither8 ? 0.05 : 1e-3;
              EXPECT_NEAR(md, mc, tol * mc + 1e-6) << "seq " << s << " layer " << l << " head " << hq;
              worst_gap = std::max(worst_gap, std::fabs(md - mc) / std::max(mc, 1e-300));
            }
          }
        }
      printf("[device store] %-8s %-8s head_dim %3d: worst output error %.2e; meter vs the CPU store's worst "
             "relative gap %.2e; smallest meter - TV %.3g\n",
             cs.kv, cs.witness ? cs.witness : "", sh.dim, worst_out, worst_gap, min_slack);
      EXPECT_LT(worst_out, 4e-3);

      certkv_meter_stats md, mc;
      ASSERT_EQ(certkv_kv_store_meter_stats(dev, &md), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_meter_stats(cpu, &mc), CERTKV_OK) << certkv_last_error();
      EXPECT_EQ(md.metered, mc.metered);
      EXPECT_EQ(md.cells, metered_cells);
      EXPECT_EQ(md.cells, mc.cells);
      if (lossy) {
        EXPECT_NEAR(md.max, mc.max, (dither8 ? 0.05 : 1e-3) * mc.max + 1e-6);
      }
      certkv_kv_stats sd, sc;
      ASSERT_EQ(certkv_kv_store_kv_stats(dev, &sd), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_kv_stats(cpu, &sc), CERTKV_OK) << certkv_last_error();
      EXPECT_EQ(sd.n_tokens, sc.n_tokens);
      EXPECT_EQ(sd.kv_bytes_bf16, sc.kv_bytes_bf16);
      EXPECT_GT(class_pages(sd, cs.coded_class), 0u);
      if (lossy) {
        EXPECT_LT(sd.kv_bytes_in_use, sd.kv_bytes_bf16);  // 8-bit pages, a few raw tails
      }
      certkv_kv_store_free(dev);
      certkv_kv_store_free(cpu);
    }
}

TEST(CApiKvStoreDevice, RefusalsLeaveTheStoreUsable) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Shape sh{6, 2, 64};
  certkv_kv_store_params p = params("fp8-e4m3", nullptr, sh, "cuda");
  p.max_tokens = 40;
  certkv_kv_store* s = nullptr;
  ASSERT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  const size_t row = size_t(sh.kv_heads) * sh.dim;
  DeviceFloats rows(64 * row), q(kSeqs * size_t(sh.heads) * sh.dim), out(kSeqs * size_t(sh.heads) * sh.dim);
  rows.up(std::vector<float>(64 * row, 0.25f));
  q.up(std::vector<float>(kSeqs * size_t(sh.heads) * sh.dim, 0.5f));
  const int32_t twice[2] = {1, 1}, outside[1] = {3}, one_seq[1] = {0};
  const int64_t n1[2] = {1, 1}, big[1] = {41}, zero[1] = {0};
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, twice, n1, 2, rows.p, rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("seq 1 named twice")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, outside, n1, 1, rows.p, rows.p), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(error_names("seqs[0] 3 outside [0, 3)")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_device(s, 2, one_seq, n1, 1, rows.p, rows.p), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, one_seq, zero, 1, rows.p, rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, one_seq, n1, 1, rows.p, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, one_seq, n1, 0, rows.p, rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  // Past the capacity: refused, nothing appended, the store goes on.
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, one_seq, big, 1, rows.p, rows.p), CERTKV_ERR_OUT_OF_MEMORY);
  EXPECT_TRUE(error_names("capacity of 40")) << certkv_last_error();
  int64_t n = -1;
  ASSERT_EQ(certkv_kv_store_length(s, 0, 0, &n), CERTKV_OK);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(certkv_kv_store_attend_device(s, 0, one_seq, 1, q.p, out.p, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("holds no position")) << certkv_last_error();
  const int64_t n20[1] = {20};
  ASSERT_EQ(certkv_kv_store_append_device(s, 0, one_seq, n20, 1, rows.p, rows.p), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_kv_store_length(s, 0, 0, &n), CERTKV_OK);
  EXPECT_EQ(n, 20);
  EXPECT_EQ(certkv_kv_store_attend_device(s, 0, one_seq, 1, q.p, nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(certkv_kv_store_attend_device(s, 0, one_seq, 1, q.p, out.p, nullptr), CERTKV_OK) << certkv_last_error();
  // Equal rows: every position attends equally, the output is the row.
  const std::vector<float> o = out.down(size_t(sh.heads) * sh.dim);
  for (float x : o) EXPECT_NEAR(x, 0.25f, 1e-3f);
  // Host memory where device memory is due: refused before any launch, the store goes on.
  std::vector<float> host_q(kSeqs * size_t(sh.heads) * sh.dim, 0.5f);
  EXPECT_EQ(certkv_kv_store_attend_device(s, 0, one_seq, 1, host_q.data(), out.p, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("q is not")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, one_seq, n1, 1, host_q.data(), rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("k is not")) << certkv_last_error();
  certkv_meter_stats m;
  ASSERT_EQ(certkv_kv_store_meter_stats(s, &m), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(m.cells, sh.heads);
  EXPECT_EQ(certkv_kv_store_append_device(nullptr, 0, one_seq, n1, 1, rows.p, rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_free(s);
}

}  // namespace
