// The C API's KV store on a CUDA device (device "cuda", certkv_kv_store_append_device and
// _attend_device) against the same store on the CPU given the same rows: three sequences of
// ragged lengths appended in one call per layer (a prompt each, then decode steps), decode steps of
// all three in one call. For every scheme the device serves (bf16, gaac calibrated on its first
// append, fp8-e4m3 with the fp16 and the exponent witness, dither8) at head_dim 64 (GQA 3) and
// 128 (GQA 7): outputs as the CPU store's, a lossy scheme's meter at or above the true total
// variation (over the rows the CPU store reads back: the same pages) and within the device
// route's bar of the CPU store's, the telemetry's cells, the pages by class; then the refusals;
// then a cuda store's read, crop and select against the CPU store's; then sparse decode.
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
  // Queries noted: at most the positions held, device memory; a store without sparse decode
  // notes nothing and goes on.
  const int64_t n21[1] = {21};
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, one_seq, n21, 1, q.p), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("is not in [1, 20]")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, one_seq, zero, 1, q.p), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, one_seq, n1, 1, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, one_seq, n1, 1, host_q.data()), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("q is not")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, one_seq, n1, 1, q.p), CERTKV_OK) << certkv_last_error();
  // Planned steps: refused before any change; the store goes on.
  ASSERT_EQ(certkv_kv_store_append_device(s, 1, one_seq, n20, 1, rows.p, rows.p), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_plan_device(s, one_seq, 1, 0, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("steps 0")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_plan_device(s, one_seq, 1, 21, nullptr), CERTKV_ERR_OUT_OF_MEMORY);
  EXPECT_TRUE(error_names("capacity of 40")) << certkv_last_error();
  const int32_t seq2[1] = {2};
  EXPECT_EQ(certkv_kv_store_plan_device(s, seq2, 1, 4, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("holds no position")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_planned_device(s, 0, rows.p, rows.p, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("no planned steps")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_attend_planned_device(s, 2, q.p, out.p, nullptr, nullptr), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(certkv_kv_store_finish_planned_device(s, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  int32_t recapture = -1;
  ASSERT_EQ(certkv_kv_store_plan_device(s, one_seq, 1, 4, &recapture), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(recapture, 1);
  EXPECT_EQ(certkv_kv_store_append_planned_device(s, 0, host_q.data(), rows.p, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("k is not")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_plan_device(s, one_seq, 1, 4, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("finish them first")) << certkv_last_error();
  ASSERT_EQ(certkv_kv_store_finish_planned_device(s, nullptr), CERTKV_OK) << certkv_last_error();  // nothing ran
  ASSERT_EQ(certkv_kv_store_length(s, 0, 0, &n), CERTKV_OK);
  EXPECT_EQ(n, 20);
  certkv_meter_stats m;
  ASSERT_EQ(certkv_kv_store_meter_stats(s, &m), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(m.cells, sh.heads);
  EXPECT_EQ(certkv_kv_store_append_device(nullptr, 0, one_seq, n1, 1, rows.p, rows.p), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_free(s);
}

// The same rows appended to (seq, layer) of a CPU store and a cuda store: rows token-major
// [n][kv_heads][dim].
void append_both(certkv_kv_store* cpu, certkv_kv_store* dev, int seq, int layer, const std::vector<float>& k,
                 const std::vector<float>& v, int n, const Shape& sh) {
  ASSERT_EQ(certkv_kv_store_append_f32(cpu, seq, layer, head_major(k, n, sh).data(), head_major(v, n, sh).data(), n),
            CERTKV_OK)
      << certkv_last_error();
  DeviceFloats dk(k.size()), dv(v.size());
  dk.up(k);
  dv.up(v);
  const int32_t seqs[1] = {seq};
  const int64_t count[1] = {n};
  ASSERT_EQ(certkv_kv_store_append_device(dev, layer, seqs, count, 1, dk.p, dv.p), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Each sequence's prompt of prompt[s] rows in every layer of both stores (rows reproducible from
// the sequence and layer).
void append_prompts(certkv_kv_store* cpu, certkv_kv_store* dev, const int (&prompt)[kSeqs], const Shape& sh) {
  for (int l = 0; l < kLayers; ++l)
    for (int s = 0; s < kSeqs; ++s)
      append_both(cpu, dev, s, l, make_rows(prompt[s], sh, uint32_t(100 * s + 10 * l + 1), true),
                  make_rows(prompt[s], sh, uint32_t(100 * s + 10 * l + 2), false), prompt[s], sh);
}

// K then V of every position of (seq, layer), as certkv_kv_store_read gives them (exact 0).
std::vector<float> read_all(certkv_kv_store* s, int seq, int layer, const Shape& sh) {
  int64_t n = 0;
  EXPECT_EQ(certkv_kv_store_length(s, seq, layer, &n), CERTKV_OK) << certkv_last_error();
  std::vector<float> x(2 * size_t(sh.kv_heads) * size_t(n) * size_t(sh.dim));
  for (int kv = 0; kv < 2; ++kv)
    EXPECT_EQ(certkv_kv_store_read(s, seq, layer, kv, 0, n, 0, x.data() + size_t(kv) * x.size() / 2), CERTKV_OK)
        << certkv_last_error();
  return x;
}

// Every sequence and layer of the cuda store reads back what the CPU store reads (the same pages,
// decoded on the host by the same _ref decoders: equal floats), and has its length.
void expect_same_reads(certkv_kv_store* cpu, certkv_kv_store* dev, int n_seqs, const Shape& sh, const char* when) {
  for (int s = 0; s < n_seqs; ++s)
    for (int l = 0; l < kLayers; ++l) {
      int64_t nc = -1, nd = -2;
      ASSERT_EQ(certkv_kv_store_length(cpu, s, l, &nc), CERTKV_OK);
      ASSERT_EQ(certkv_kv_store_length(dev, s, l, &nd), CERTKV_OK);
      ASSERT_EQ(nd, nc) << when << ": seq " << s << " layer " << l;
      const std::vector<float> a = read_all(cpu, s, l, sh), b = read_all(dev, s, l, sh);
      size_t differ = 0;
      for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
      EXPECT_EQ(differ, 0u) << when << ": seq " << s << " layer " << l << " (" << a.size() << " values)";
    }
}

// One decode step of every sequence of both stores (a new row each, then attention): the
// outputs agree within the device route's bar.
void expect_same_step(certkv_kv_store* cpu, certkv_kv_store* dev, int n_seqs, const Shape& sh, uint32_t seed) {
  const size_t qrow = size_t(sh.heads) * size_t(sh.dim);
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < n_seqs; ++s)
      append_both(cpu, dev, s, l, make_rows(1, sh, seed + 10 * uint32_t(s) + uint32_t(l), true),
                  make_rows(1, sh, seed + 10 * uint32_t(s) + uint32_t(l) + 5, false), 1, sh);
    std::mt19937 rng(seed + uint32_t(l));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> q(size_t(n_seqs) * qrow);
    for (float& x : q) x = bf16_value(2.f * normal(rng));
    DeviceFloats dq(q.size()), dout(q.size());
    dq.up(q);
    std::vector<int32_t> seqs(static_cast<size_t>(n_seqs));
    for (int s = 0; s < n_seqs; ++s) seqs[size_t(s)] = s;
    ASSERT_EQ(certkv_kv_store_attend_device(dev, l, seqs.data(), n_seqs, dq.p, dout.p, nullptr), CERTKV_OK)
        << certkv_last_error();
    const std::vector<float> out = dout.down(q.size());
    for (int s = 0; s < n_seqs; ++s) {
      std::vector<float> want(qrow);
      ASSERT_EQ(certkv_kv_store_attend(cpu, s, l, &q[size_t(s) * qrow], 1, want.data(), nullptr), CERTKV_OK)
          << certkv_last_error();
      double num = 0, den = 0;
      for (size_t i = 0; i < qrow; ++i) {
        const double d = double(out[size_t(s) * qrow + i]) - want[i];
        num += d * d;
        den += double(want[i]) * want[i];
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-300)), 4e-3) << "seq " << s << " layer " << l;
    }
  }
}

// A cuda store's read, crop and select (and reorder, select's case n = n_sequences) against the
// CPU store given the same rows and the same calls, for every scheme the device serves, at
// head_dim 64 and 128: reads equal float for float after each call; decode steps after them agree;
// a select that duplicates a sequence shares its whole blocks (the coded pages in use do not grow)
// and gives each copy its own tail (the copies then take different rows); a crop inside a block
// the device keeps lossy is refused, the store unchanged; exact reads of lossy pages are refused.
TEST(CApiKvStoreDevice, ReadCropAndSelectMatchTheCpuStore) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {{"bf16", nullptr, "bf16"},
                        {"gaac", nullptr, "gaac"},
                        {"gaac-e5m2", nullptr, "gaac-fp8"},
                        {"fp8-e4m3", nullptr, "lossy"},
                        {"fp8-e4m3", "exponent", "lossy"},
                        {"dither8", nullptr, "dither8"}};
  const Shape shapes[] = {{6, 2, 64}, {14, 2, 128}};
  const int prompt[kSeqs] = {37, 16, 70};  // a partial block, one whole block, four and a part
  for (const Case& cs : cases)
    for (const Shape& sh : shapes) {
      SCOPED_TRACE(std::string(cs.kv) + (cs.witness ? std::string(" witness ") + cs.witness : "") + " head_dim " +
                   std::to_string(sh.dim));
      const bool lossy = std::strcmp(cs.coded_class, "lossy") == 0 || std::strcmp(cs.coded_class, "dither8") == 0;
      certkv_kv_store_params pc = params(cs.kv, cs.witness, sh, nullptr);
      certkv_kv_store_params pd = params(cs.kv, cs.witness, sh, "cuda");
      certkv_kv_store *cpu = nullptr, *dev = nullptr;
      ASSERT_EQ(certkv_kv_store_create(&pc, &cpu), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
      append_prompts(cpu, dev, prompt, sh);
      expect_same_reads(cpu, dev, kSeqs, sh, "after the prompts");
      if (HasFatalFailure()) return;

      std::vector<float> one(size_t(sh.kv_heads) * size_t(sh.dim));
      EXPECT_EQ(certkv_kv_store_read(dev, 0, 0, 0, 0, 1, 1, one.data()), lossy ? CERTKV_ERR_UNSUPPORTED : CERTKV_OK);
      if (lossy) {
        EXPECT_TRUE(error_names("no exact values")) << certkv_last_error();
      }
      EXPECT_EQ(certkv_kv_store_read(dev, 0, 0, 0, 30, 38, 0, one.data()), CERTKV_ERR_OUT_OF_RANGE);

      certkv_kv_stats before, after;
      ASSERT_EQ(certkv_kv_store_kv_stats(dev, &before), CERTKV_OK) << certkv_last_error();
      // Grow to four: sequence 2 first, sequence 0 twice; sequence 1 last.
      const int32_t grow[4] = {2, 0, 0, 1};
      ASSERT_EQ(certkv_kv_store_select(cpu, grow, 4), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_select(dev, grow, 4), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_kv_stats(dev, &after), CERTKV_OK) << certkv_last_error();
      // Sequence 0's two copies share its two whole blocks; each has its own tail: one tail page
      // more per (K/V, kv head, layer) than before.
      EXPECT_EQ(after.pages_in_use, before.pages_in_use + 2u * uint64_t(sh.kv_heads) * kLayers);
      if (std::strcmp(cs.coded_class, "bf16") != 0) {
        EXPECT_EQ(class_pages(after, cs.coded_class), class_pages(before, cs.coded_class)) << "whole blocks shared";
      }
      EXPECT_EQ(after.n_tokens, before.n_tokens + prompt[0]);
      expect_same_reads(cpu, dev, 4, sh, "after the select");
      expect_same_step(cpu, dev, 4, sh, 500);  // the two copies of sequence 0 take different rows
      expect_same_reads(cpu, dev, 4, sh, "after a step past the select");
      if (HasFatalFailure()) return;

      // Crops: inside a partial block (raw: served by every scheme), to a block boundary, and
      // inside a whole block (lossless: decoded and written again; lossy: refused, unchanged).
      ASSERT_EQ(certkv_kv_store_crop(cpu, 0, 66), CERTKV_OK) << certkv_last_error();  // seq 0 is old 2 (71)
      ASSERT_EQ(certkv_kv_store_crop(dev, 0, 66), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_crop(cpu, 3, 16), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_crop(dev, 3, 16), CERTKV_OK) << certkv_last_error();
      const certkv_status inside = certkv_kv_store_crop(dev, 1, 21);  // 38 positions: block 1 is whole
      if (lossy) {
        EXPECT_EQ(inside, CERTKV_ERR_UNSUPPORTED);
        EXPECT_TRUE(error_names("multiple of 16")) << certkv_last_error();
      } else {
        EXPECT_EQ(inside, CERTKV_OK) << certkv_last_error();
        ASSERT_EQ(certkv_kv_store_crop(cpu, 1, 21), CERTKV_OK) << certkv_last_error();
      }
      EXPECT_EQ(certkv_kv_store_crop(dev, 1, 39), CERTKV_ERR_OUT_OF_RANGE);
      expect_same_reads(cpu, dev, 4, sh, "after the crops");
      expect_same_step(cpu, dev, 4, sh, 900);
      expect_same_reads(cpu, dev, 4, sh, "after a step past the crops");
      if (HasFatalFailure()) return;

      // Narrow to one sequence (what was sequence 2, the 4th): the others' pages are freed.
      const int32_t keep[1] = {2};
      ASSERT_EQ(certkv_kv_store_select(cpu, keep, 1), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_select(dev, keep, 1), CERTKV_OK) << certkv_last_error();
      const int32_t outside[1] = {1};
      EXPECT_EQ(certkv_kv_store_select(dev, outside, 1), CERTKV_ERR_OUT_OF_RANGE);
      certkv_kv_stats narrow;
      ASSERT_EQ(certkv_kv_store_kv_stats(dev, &narrow), CERTKV_OK) << certkv_last_error();
      EXPECT_LT(narrow.pages_in_use, after.pages_in_use);
      expect_same_reads(cpu, dev, 1, sh, "after narrowing");
      expect_same_step(cpu, dev, 1, sh, 1300);
      certkv_kv_store_free(dev);
      certkv_kv_store_free(cpu);
    }
}

// dither8 chooses each head's outlier pairs from the first whole block of a layer: a select before
// any block is whole copies the rows through the write path, which notes them for the choice, so
// each copy's first block chooses from its own rows as the CPU store's does.
TEST(CApiKvStoreDevice, SelectBeforeTheOutlierPairsAreChosen) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Shape sh{6, 2, 64};
  certkv_kv_store_params pc = params("dither8", nullptr, sh, nullptr);
  certkv_kv_store_params pd = params("dither8", nullptr, sh, "cuda");
  pc.n_sequences = pd.n_sequences = 1;
  certkv_kv_store *cpu = nullptr, *dev = nullptr;
  ASSERT_EQ(certkv_kv_store_create(&pc, &cpu), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
  for (int l = 0; l < kLayers; ++l)
    append_both(cpu, dev, 0, l, make_rows(10, sh, uint32_t(11 + l), true), make_rows(10, sh, uint32_t(21 + l), false), 10, sh);
  const int32_t twice[2] = {0, 0};
  ASSERT_EQ(certkv_kv_store_select(cpu, twice, 2), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_kv_store_select(dev, twice, 2), CERTKV_OK) << certkv_last_error();
  for (int s = 0; s < 2; ++s)
    for (int l = 0; l < kLayers; ++l)  // each copy completes its first block with rows of its own
      append_both(cpu, dev, s, l, make_rows(12, sh, uint32_t(31 + 10 * s + l), true),
                  make_rows(12, sh, uint32_t(51 + 10 * s + l), false), 12, sh);
  expect_same_reads(cpu, dev, 2, sh, "after both copies completed a block");
  expect_same_step(cpu, dev, 2, sh, 77);
  certkv_kv_stats st;
  ASSERT_EQ(certkv_kv_store_kv_stats(dev, &st), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(class_pages(st, "dither8"), 2u * 2u * uint64_t(sh.kv_heads) * kLayers);  // each copy's block 0
  certkv_kv_store_free(dev);
  certkv_kv_store_free(cpu);
}

// The sparse counters of the two stores are the same: the same steps, cells, dense cells, tokens
// indexed, and the same Top-p sets (budget and widened fraction).
void expect_same_sparse_counters(certkv_kv_store* cpu, certkv_kv_store* dev, double deviations, const char* when) {
  certkv_sparse_stats a, b;
  ASSERT_EQ(certkv_kv_store_sparse_stats(cpu, &a), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_kv_store_sparse_stats(dev, &b), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(b.sparse, 1) << when;
  EXPECT_GT(a.cells, 0) << when;
  EXPECT_EQ(b.steps, a.steps) << when;
  EXPECT_EQ(b.cells, a.cells) << when;
  EXPECT_EQ(b.indexed_tokens, a.indexed_tokens) << when;
  EXPECT_EQ(b.index_appended_tokens, a.index_appended_tokens) << when;
  EXPECT_NEAR(b.mean_budget, a.mean_budget, 1e-12) << when;
  EXPECT_NEAR(b.mean_budget_all_layers, a.mean_budget_all_layers, 1e-12) << when << ": the dense cells";
  EXPECT_NEAR(b.widened_fraction, a.widened_fraction, 1e-12) << when;
  EXPECT_LT(a.mean_budget, 0.9) << when << ": the Top-p sets leave tokens out";
  if (deviations > 0) {
    EXPECT_GT(a.widened_fraction, 0) << when;
  }
}

certkv_kv_store_params sparse_params(const char* device, const Shape& sh, double deviations) {
  certkv_kv_store_params p = params("bf16", nullptr, sh, device);
  p.sparse_p = 0.9;
  p.sparse_window = 32;
  p.sparse_dense_layers = 1;
  p.sparse_deviations = deviations;
  return p;
}

// Sparse decode on a cuda store (bf16 pages) against the CPU store given the same rows, queries
// and calls, at head_dim 64 (GQA 3) and 128 (GQA 7), with and without widening: layer 0 dense,
// layer 1 sparse over a 32-token window. Each step's outputs agree within the device route's bar,
// and the counters are the CPU store's: the same steps, cells, dense cells (a sequence too short
// for an index attends exactly: the budget over all layers), tokens indexed, and the same Top-p
// sets (budget and widened fraction: the device's estimates and buckets are the CPU's bit for
// bit). Then a select that duplicates a sequence (each copy keeps the parent's records) and a crop
// that truncates an index (its records of the kept prefix stay), with steps after each, keep the
// same agreement.
TEST(CApiKvStoreDevice, SparseDecodeMatchesTheCpuStore) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Shape shapes[] = {{6, 2, 64}, {14, 2, 128}};
  // Sequence 1 has no index until its context reaches 64; sequence 2's first step reads more keys
  // (its centroid, 1,101) than the 512 records a sequence's list reserves at first and than its
  // records (1,056).
  const int prompt[kSeqs] = {300, 30, 1100};
  for (const Shape& sh : shapes)
    for (const double deviations : {0.0, 1.5}) {
      SCOPED_TRACE("head_dim " + std::to_string(sh.dim) + " deviations " + std::to_string(deviations));
      const certkv_kv_store_params pc = sparse_params(nullptr, sh, deviations);
      const certkv_kv_store_params pd = sparse_params("cuda", sh, deviations);
      certkv_kv_store *cpu = nullptr, *dev = nullptr;
      ASSERT_EQ(certkv_kv_store_create(&pc, &cpu), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
      append_prompts(cpu, dev, prompt, sh);
      if (HasFatalFailure()) return;
      auto expect_same_counters = [&](const char* when) { expect_same_sparse_counters(cpu, dev, deviations, when); };
      for (int step = 0; step < 40; ++step) expect_same_step(cpu, dev, kSeqs, sh, 2000 + 97 * uint32_t(step));
      expect_same_counters("after 40 steps");
      if (HasFatalFailure()) return;

      const int32_t grow[4] = {2, 0, 0, 1};
      ASSERT_EQ(certkv_kv_store_select(cpu, grow, 4), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_select(dev, grow, 4), CERTKV_OK) << certkv_last_error();
      for (int step = 0; step < 8; ++step) expect_same_step(cpu, dev, 4, sh, 7000 + 31 * uint32_t(step));
      expect_same_counters("after the select");
      // Sequence 0 (old 2, 1,148 positions) cropped to 200: its index keeps the records of 160.
      ASSERT_EQ(certkv_kv_store_crop(cpu, 0, 200), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_crop(dev, 0, 200), CERTKV_OK) << certkv_last_error();
      for (int step = 0; step < 8; ++step) expect_same_step(cpu, dev, 4, sh, 9000 + 13 * uint32_t(step));
      expect_same_counters("after the crop");
      certkv_kv_store_free(dev);
      certkv_kv_store_free(cpu);
    }
}

// A prompt's queries noted on a cuda store (certkv_kv_store_note_queries_device) make the query
// centroid as the queries of the prefills a CPU store attends do: the same sums in the same order,
// so the same Top-p sets. Sequence 2's queries go in two calls (the sums continue), sequence 0's
// with sequence 2's second part in one call, sequence 1's not at all (its first sparse step's
// query), and the dense layer takes them too (it notes nothing). The prompt's queries lean away
// from the steps' (an offset on every 8th channel), so a centroid from the step's query selects
// other tokens: a CPU store without the notes selects differently, which the test checks first.
TEST(CApiKvStoreDevice, NotedPromptQueriesMakeTheCpuStoresQueryCentroid) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Shape shapes[] = {{6, 2, 64}, {14, 2, 128}};
  const int prompt[kSeqs] = {300, 30, 1100};
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(sh.dim));
    const certkv_kv_store_params pc = sparse_params(nullptr, sh, 0.0);
    const certkv_kv_store_params pd = sparse_params("cuda", sh, 0.0);
    certkv_kv_store *cpu = nullptr, *dev = nullptr, *plain = nullptr;
    ASSERT_EQ(certkv_kv_store_create(&pc, &cpu), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(certkv_kv_store_create(&pc, &plain), CERTKV_OK) << certkv_last_error();
    append_prompts(cpu, dev, prompt, sh);
    if (HasFatalFailure()) return;
    for (int l = 0; l < kLayers; ++l)
      for (int s = 0; s < kSeqs; ++s) {
        const std::vector<float> k = make_rows(prompt[s], sh, uint32_t(100 * s + 10 * l + 1), true);
        const std::vector<float> v = make_rows(prompt[s], sh, uint32_t(100 * s + 10 * l + 2), false);
        ASSERT_EQ(certkv_kv_store_append_f32(plain, s, l, head_major(k, prompt[s], sh).data(),
                                             head_major(v, prompt[s], sh).data(), prompt[s]),
                  CERTKV_OK)
            << certkv_last_error();
      }
    const size_t qrow = size_t(sh.heads) * size_t(sh.dim);
    for (int l = 0; l < kLayers; ++l) {
      auto prompt_queries = [&](int s) {
        std::mt19937 rng(uint32_t(500 + 10 * s + l));
        std::normal_distribution<float> normal(0.f, 1.f);
        std::vector<float> q(size_t(prompt[s]) * qrow);
        for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_value((i % 8 == 0 ? 4.f : 0.f) + normal(rng));
        return q;
      };
      const std::vector<float> q0 = prompt_queries(0), q2 = prompt_queries(2);
      const size_t split = 600;  // sequence 2's first call
      std::vector<float> out(q2.size());
      // The CPU store notes the queries of the prefills it attends (the last n_queries positions).
      ASSERT_EQ(certkv_kv_store_attend(cpu, 2, l, q2.data(), int32_t(split), out.data(), nullptr), CERTKV_OK)
          << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_attend(cpu, 0, l, q0.data(), prompt[0], out.data(), nullptr), CERTKV_OK)
          << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_attend(cpu, 2, l, q2.data() + split * qrow, int32_t(size_t(prompt[2]) - split),
                                       out.data(), nullptr),
                CERTKV_OK)
          << certkv_last_error();
      DeviceFloats first(split * qrow), second(size_t(prompt[0]) * qrow + q2.size() - split * qrow);
      first.up(std::vector<float>(q2.begin(), q2.begin() + std::ptrdiff_t(split * qrow)));
      std::vector<float> rest(q0);
      rest.insert(rest.end(), q2.begin() + std::ptrdiff_t(split * qrow), q2.end());
      second.up(rest);
      const int32_t only2[1] = {2}, both[2] = {0, 2};
      const int64_t n_first[1] = {int64_t(split)}, n_second[2] = {prompt[0], int64_t(prompt[2]) - int64_t(split)};
      ASSERT_EQ(certkv_kv_store_note_queries_device(dev, l, only2, n_first, 1, first.p), CERTKV_OK)
          << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_note_queries_device(dev, l, both, n_second, 2, second.p), CERTKV_OK)
          << certkv_last_error();
    }
    for (int step = 0; step < 12; ++step) {
      expect_same_step(cpu, dev, kSeqs, sh, 3000 + 41 * uint32_t(step));
      // The store without the notes takes the same rows and queries (its outputs are not compared).
      const uint32_t seed = 3000 + 41 * uint32_t(step);
      for (int l = 0; l < kLayers; ++l) {
        std::mt19937 rng(seed + uint32_t(l));
        std::normal_distribution<float> normal(0.f, 1.f);
        std::vector<float> q(size_t(kSeqs) * qrow), o(qrow);
        for (float& x : q) x = bf16_value(2.f * normal(rng));
        for (int s = 0; s < kSeqs; ++s) {
          const std::vector<float> k = make_rows(1, sh, seed + 10 * uint32_t(s) + uint32_t(l), true);
          const std::vector<float> v = make_rows(1, sh, seed + 10 * uint32_t(s) + uint32_t(l) + 5, false);
          ASSERT_EQ(certkv_kv_store_append_f32(plain, s, l, head_major(k, 1, sh).data(), head_major(v, 1, sh).data(), 1),
                    CERTKV_OK)
              << certkv_last_error();
          ASSERT_EQ(certkv_kv_store_attend(plain, s, l, &q[size_t(s) * qrow], 1, o.data(), nullptr), CERTKV_OK)
              << certkv_last_error();
        }
      }
    }
    certkv_sparse_stats noted, unnoted;
    ASSERT_EQ(certkv_kv_store_sparse_stats(cpu, &noted), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(certkv_kv_store_sparse_stats(plain, &unnoted), CERTKV_OK) << certkv_last_error();
    EXPECT_EQ(unnoted.cells, noted.cells);
    EXPECT_GT(std::fabs(unnoted.mean_budget - noted.mean_budget), 1e-6)
        << "the prompt's queries should give another centroid, so other Top-p sets";
    expect_same_sparse_counters(cpu, dev, 0.0, "after 12 steps");
    certkv_kv_store_free(plain);
    certkv_kv_store_free(dev);
    certkv_kv_store_free(cpu);
  }
}

// Planned decode steps under a CUDA graph (certkv_kv_store_plan_device): a stream capture of one
// decode step of every layer (append_planned + attend_planned), replayed step after step, against
// a second cuda store given the same rows and queries through append_device and attend_device.
// Ragged prompts (30, 16, 47) so the steps complete blocks at different replays. bf16 and gaac:
// the outputs are the eager store's bit for bit (a completed block's GAAC slot holds the raw
// page's values). fp8-e4m3 and dither8: a block completed during the plan is read exact until
// finish encodes it, so a sequence's step is the eager one's bit for bit (output and meter) until
// it completes a block in the plan, and after that closer to exact attention (a cpu bf16 store
// fed the same rows) than the eager step, summed over those cells. After finish, both stores read back the same values (the same pages), record the
// same number of metered cells and go on with the same steps; a second plan reuses the graph when
// plan says it may; a replay past the plan writes nothing and fails finish; the store refuses its
// other changes while a plan is open.
TEST(CApiKvStoreDevice, CapturedPlannedStepsReplayAsDecodeSteps) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {{"bf16", nullptr, "bf16"},
                        {"gaac", nullptr, "gaac"},
                        {"fp8-e4m3", nullptr, "lossy"},
                        {"dither8", nullptr, "dither8"}};
  const int prompt[kSeqs] = {30, 16, 530};  // 530: two of the kernel's 512-token splits
  for (const Case& cs : cases)
    for (const Shape& sh : {Shape{6, 2, 64}, Shape{14, 2, 128}}) {
      SCOPED_TRACE(std::string(cs.kv) + " head_dim " + std::to_string(sh.dim));
      const bool exact = std::strcmp(cs.kv, "bf16") == 0 || std::strcmp(cs.kv, "gaac") == 0;
      const certkv_kv_store_params pd = params(cs.kv, cs.witness, sh, "cuda");
      const certkv_kv_store_params pe = params("bf16", nullptr, sh, nullptr);
      certkv_kv_store *eager = nullptr, *planned = nullptr, *exact_ref = nullptr;
      ASSERT_EQ(certkv_kv_store_create(&pd, &eager), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_create(&pd, &planned), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_create(&pe, &exact_ref), CERTKV_OK) << certkv_last_error();
      const size_t row = size_t(sh.kv_heads) * size_t(sh.dim), qrow = size_t(sh.heads) * size_t(sh.dim);
      const int32_t seqs[kSeqs] = {0, 1, 2};
      // Rows [n][kv_heads][dim] of seq s (within an append of every sequence) into the exact store.
      auto append_exact = [&](int l, const std::vector<float>& k, const std::vector<float>& v, const int64_t* n) {
        size_t first = 0;
        for (int s = 0; s < kSeqs; ++s) {
          const std::vector<float> ks(k.begin() + std::ptrdiff_t(first * row), k.begin() + std::ptrdiff_t((first + size_t(n[s])) * row));
          const std::vector<float> vs(v.begin() + std::ptrdiff_t(first * row), v.begin() + std::ptrdiff_t((first + size_t(n[s])) * row));
          ASSERT_EQ(certkv_kv_store_append_f32(exact_ref, s, l, head_major(ks, int(n[s]), sh).data(),
                                               head_major(vs, int(n[s]), sh).data(), n[s]),
                    CERTKV_OK)
              << certkv_last_error();
          first += size_t(n[s]);
        }
      };
      // Rows of one append of every sequence to layer l of both stores (n[s] rows each).
      auto rows_of = [&](int l, const int64_t* n, uint32_t seed, bool keys) {
        std::vector<float> x;
        for (int s = 0; s < kSeqs; ++s) {
          const std::vector<float> r = make_rows(int(n[s]), sh, seed + 100 * uint32_t(s) + 10 * uint32_t(l), keys);
          x.insert(x.end(), r.begin(), r.end());
        }
        return x;
      };
      const int64_t prompt_n[kSeqs] = {prompt[0], prompt[1], prompt[2]}, one[kSeqs] = {1, 1, 1};
      for (int l = 0; l < kLayers; ++l) {
        DeviceFloats dk(row * 576), dv(row * 576);
        const std::vector<float> k = rows_of(l, prompt_n, 1, true), v = rows_of(l, prompt_n, 2, false);
        dk.up(k);
        dv.up(v);
        append_exact(l, k, v, prompt_n);
        for (certkv_kv_store* st : {eager, planned})
          ASSERT_EQ(certkv_kv_store_append_device(st, l, seqs, prompt_n, kSeqs, dk.p, dv.p), CERTKV_OK)
              << certkv_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      // The captured step's inputs and outputs: fixed device memory, refilled before each replay.
      std::vector<DeviceFloats*> k_in, v_in, q_in, out, meters;
      for (int l = 0; l < kLayers; ++l) {
        k_in.push_back(new DeviceFloats(kSeqs * row));
        v_in.push_back(new DeviceFloats(kSeqs * row));
        q_in.push_back(new DeviceFloats(kSeqs * qrow));
        out.push_back(new DeviceFloats(kSeqs * qrow));
        meters.push_back(new DeviceFloats(size_t(kSeqs * sh.heads)));
      }
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      cudaGraphExec_t exec = nullptr;
      auto capture = [&] {
        if (exec) cudaGraphExecDestroy(exec);
        exec = nullptr;
        cudaGraph_t graph = nullptr;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
        for (int l = 0; l < kLayers; ++l) {
          EXPECT_EQ(certkv_kv_store_append_planned_device(planned, l, k_in[size_t(l)]->p, v_in[size_t(l)]->p, stream),
                    CERTKV_OK)
              << certkv_last_error();
          EXPECT_EQ(certkv_kv_store_attend_planned_device(planned, l, q_in[size_t(l)]->p, out[size_t(l)]->p,
                                                          meters[size_t(l)]->p, stream),
                    CERTKV_OK)
              << certkv_last_error();
        }
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        cudaGraphDestroy(graph);
      };
      std::mt19937 rng(17);
      std::normal_distribution<float> normal(0.f, 1.f);
      int64_t steps_done = 0, plan_start = 0;
      int64_t identical_cells = 0, exact_read_cells = 0;
      double planned_error = 0, eager_error = 0;  // squared, against exact attention, where they differ
      // One step: the same rows and queries to both stores; the planned one through the graph.
      auto step = [&](bool compare) {
        std::vector<std::vector<float>> qs(kLayers);
        for (int l = 0; l < kLayers; ++l) {
          const std::vector<float> k = rows_of(l, one, 1000 + 7 * uint32_t(steps_done), true);
          const std::vector<float> v = rows_of(l, one, 2000 + 7 * uint32_t(steps_done), false);
          std::vector<float>& q = qs[size_t(l)];
          q.resize(kSeqs * qrow);
          for (float& x : q) x = bf16_value(2.f * normal(rng));
          k_in[size_t(l)]->up(k);
          v_in[size_t(l)]->up(v);
          q_in[size_t(l)]->up(q);
          if (compare) append_exact(l, k, v, one);
        }
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        for (int l = 0; l < kLayers && compare; ++l) {
          DeviceFloats eo(kSeqs * qrow), em(size_t(kSeqs * sh.heads));
          ASSERT_EQ(certkv_kv_store_append_device(eager, l, seqs, one, kSeqs, k_in[size_t(l)]->p, v_in[size_t(l)]->p),
                    CERTKV_OK)
              << certkv_last_error();
          ASSERT_EQ(certkv_kv_store_attend_device(eager, l, seqs, kSeqs, q_in[size_t(l)]->p, eo.p, em.p), CERTKV_OK)
              << certkv_last_error();
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const std::vector<float> a = eo.down(kSeqs * qrow), b = out[size_t(l)]->down(kSeqs * qrow);
          const std::vector<float> ma = em.down(size_t(kSeqs * sh.heads)), mb = meters[size_t(l)]->down(size_t(kSeqs * sh.heads));
          for (int s = 0; s < kSeqs; ++s) {
            // Whether seq s completed a block in this plan (its raw page read where eager reads the
            // block's lossy page).
            const int64_t before = prompt[s] + plan_start, now = prompt[s] + steps_done + 1;
            const bool same = exact || now / 16 == before / 16;
            std::vector<float> want(qrow);
            if (!same) {
              ASSERT_EQ(certkv_kv_store_attend(exact_ref, s, l, &qs[size_t(l)][size_t(s) * qrow], 1, want.data(), nullptr),
                        CERTKV_OK)
                  << certkv_last_error();
            }
            for (int h = 0; h < sh.heads; ++h) {
              size_t differ = 0;
              for (int d = 0; d < sh.dim; ++d) {
                const size_t i = (size_t(s) * size_t(sh.heads) + size_t(h)) * size_t(sh.dim) + size_t(d);
                differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
                if (!same) {
                  const double w = want[size_t(h) * size_t(sh.dim) + size_t(d)];
                  eager_error += (double(a[i]) - w) * (double(a[i]) - w);
                  planned_error += (double(b[i]) - w) * (double(b[i]) - w);
                }
              }
              exact_read_cells += !same;
              const size_t m = size_t(s) * size_t(sh.heads) + size_t(h);
              EXPECT_TRUE(mb[m] >= 0.f && mb[m] <= 1.f) << mb[m];
              if (same) {
                EXPECT_EQ(differ, 0u) << "step " << steps_done << " layer " << l << " seq " << s << " head " << h;
                EXPECT_EQ(std::memcmp(&ma[m], &mb[m], sizeof(float)), 0) << ma[m] << " " << mb[m];
                ++identical_cells;
              }
            }
          }
        }
        ++steps_done;
      };
      int32_t recapture = -1;
      int reuses = 0;
      // Rounds of (steps planned, steps replayed): the graph reused whenever plan says it may; the
      // last round replays fewer than it planned (the pages no row reached go back).
      const std::pair<int, int> rounds[] = {{20, 20}, {6, 6}, {6, 6}, {6, 6}, {12, 4}};
      for (const auto& [steps, replays] : rounds) {
        ASSERT_EQ(certkv_kv_store_plan_device(planned, seqs, kSeqs, steps, &recapture), CERTKV_OK) << certkv_last_error();
        plan_start = steps_done;
        if (steps == 20) {
          EXPECT_EQ(recapture, 1);
        }
        if (recapture || !exec)
          capture();
        else
          ++reuses;
        if (HasFatalFailure()) return;
        // The store refuses its other changes while planned.
        EXPECT_EQ(certkv_kv_store_append_device(planned, 0, seqs, one, kSeqs, k_in[0]->p, v_in[0]->p),
                  CERTKV_ERR_INVALID_ARGUMENT);
        EXPECT_TRUE(error_names("finish them first")) << certkv_last_error();
        EXPECT_EQ(certkv_kv_store_crop(planned, 0, 8), CERTKV_ERR_INVALID_ARGUMENT);
        for (int i = 0; i < replays; ++i) step(true);
        if (HasFatalFailure()) return;
        ASSERT_EQ(certkv_kv_store_finish_planned_device(planned, stream), CERTKV_OK) << certkv_last_error();
        for (int s = 0; s < kSeqs; ++s)
          for (int l = 0; l < kLayers; ++l) {
            int64_t ne = -1, np = -2;
            ASSERT_EQ(certkv_kv_store_length(eager, s, l, &ne), CERTKV_OK);
            ASSERT_EQ(certkv_kv_store_length(planned, s, l, &np), CERTKV_OK);
            EXPECT_EQ(np, ne);
            EXPECT_EQ(np, prompt[s] + steps_done);
            const std::vector<float> a = read_all(eager, s, l, sh), b = read_all(planned, s, l, sh);
            size_t differ = 0;
            for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
            EXPECT_EQ(differ, 0u) << "seq " << s << " layer " << l << ": the pages after finish";
          }
        certkv_meter_stats me, mp;
        ASSERT_EQ(certkv_kv_store_meter_stats(eager, &me), CERTKV_OK) << certkv_last_error();
        ASSERT_EQ(certkv_kv_store_meter_stats(planned, &mp), CERTKV_OK) << certkv_last_error();
        EXPECT_EQ(mp.cells, me.cells);
        if (!exact) {
          EXPECT_EQ(mp.cells, int64_t(steps_done) * kLayers * kSeqs * sh.heads);
        }
        // The same pages in use, class by class (what plan reserved and no row reached went back).
        certkv_kv_stats ke, kp;
        ASSERT_EQ(certkv_kv_store_kv_stats(eager, &ke), CERTKV_OK) << certkv_last_error();
        ASSERT_EQ(certkv_kv_store_kv_stats(planned, &kp), CERTKV_OK) << certkv_last_error();
        EXPECT_EQ(kp.pages_in_use, ke.pages_in_use);
        for (const char* storage : {"bf16", "gaac", "lossy", "dither8"})
          EXPECT_EQ(class_pages(kp, storage), class_pages(ke, storage)) << storage;
      }
      EXPECT_GT(identical_cells, 0);
      if (!exact) {
        EXPECT_GT(exact_read_cells, 0);
        EXPECT_LE(planned_error, eager_error) << "planned steps read the blocks they complete exact";
      }
      EXPECT_GE(reuses, 1) << "a later plan that moved nothing keeps the graph";
      // Past the plan: 2 steps planned, 3 replayed; the third writes nothing and finish says so.
      ASSERT_EQ(certkv_kv_store_plan_device(planned, seqs, kSeqs, 2, &recapture), CERTKV_OK) << certkv_last_error();
      if (recapture) capture();
      for (int i = 0; i < 3; ++i) step(false);
      certkv_meter_stats before;
      ASSERT_EQ(certkv_kv_store_meter_stats(planned, &before), CERTKV_OK) << certkv_last_error();
      EXPECT_EQ(certkv_kv_store_finish_planned_device(planned, stream), CERTKV_ERR_OUT_OF_RANGE);
      EXPECT_TRUE(error_names("past the 2 planned steps")) << certkv_last_error();
      certkv_meter_stats after;
      ASSERT_EQ(certkv_kv_store_meter_stats(planned, &after), CERTKV_OK) << certkv_last_error();
      if (!exact) {
        EXPECT_EQ(after.cells - before.cells, 2 * kLayers * kSeqs * sh.heads) << "the steps that ran, once each";
      }
      int64_t n0 = -1;
      ASSERT_EQ(certkv_kv_store_length(planned, 0, 1, &n0), CERTKV_OK);
      EXPECT_EQ(n0, prompt[0] + steps_done - 1);
      // And the store goes on: an eager step after it.
      DeviceFloats eo(kSeqs * qrow);
      ASSERT_EQ(certkv_kv_store_append_device(planned, 0, seqs, one, kSeqs, k_in[0]->p, v_in[0]->p), CERTKV_OK)
          << certkv_last_error();
      ASSERT_EQ(certkv_kv_store_attend_device(planned, 0, seqs, kSeqs, q_in[0]->p, eo.p, nullptr), CERTKV_OK)
          << certkv_last_error();
      EXPECT_EQ(certkv_kv_store_finish_planned_device(planned, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (exec) cudaGraphExecDestroy(exec);
      cudaStreamDestroy(stream);
      for (auto* group : {&k_in, &v_in, &q_in, &out, &meters})
        for (DeviceFloats* x : *group) delete x;
      certkv_kv_store_free(exact_ref);
      certkv_kv_store_free(planned);
      certkv_kv_store_free(eager);
    }
}

// A store with sparse decode refuses plans (its index updates wait for the host).
TEST(CApiKvStoreDevice, SparseStoresRefusePlannedSteps) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Shape sh{6, 2, 64};
  const certkv_kv_store_params pd = sparse_params("cuda", sh, 0.0);
  certkv_kv_store* dev = nullptr;
  ASSERT_EQ(certkv_kv_store_create(&pd, &dev), CERTKV_OK) << certkv_last_error();
  const int32_t seqs[1] = {0};
  EXPECT_EQ(certkv_kv_store_plan_device(dev, seqs, 1, 4, nullptr), CERTKV_ERR_UNSUPPORTED);
  EXPECT_TRUE(error_names("sparse")) << certkv_last_error();
  certkv_kv_store_free(dev);
}

}  // namespace
