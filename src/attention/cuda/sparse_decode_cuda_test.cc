// The sparse decode path on the GPU against the CPU: estimated logits (bit for bit) against
// index::rabitq_estimate_scores_popcount, Top-p on the quantized logits (theta, the selected
// count and the mass bit for bit, the set exactly) against index::top_p_select and
// top_p_select_ref run on the device's own logits, the selection lists against the masks, and the
// output against double attention over the selected tokens plus the window; p = 1 against dense
// attention; a threshold bucket holding every token; the Top-p stage alone on chosen logits (bucket
// edges, ties, the cap bucket, ragged rows); refusals. Ragged batches (nothing indexed, all
// indexed, windows of 1 to 300 tokens) and GQA 1 to 8. Needs a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/device_kv.h"
#include "attention/cuda/sparse_decode_cuda.h"
#include "core/cuda_test_support.h"
#include "format/numeric.h"
#include "index/rabitq.h"
#include "index/rotation.h"
#include "index/top_p.h"

namespace certkv::attention::cuda {
namespace {

using cache::cuda::DeviceBuffer;

struct SparseCase {
  int head_dim, n_q_heads, n_kv_heads;
  std::vector<int> lens, n_indexed;
  double p;
  uint32_t seed;
  bool flat_keys = false;  // every key equal: all logits tie (one gap bucket of every token)
  double deviations = 0;   // the Top-p set widened by this many estimator deviations per token
  int64_t pass_tokens = 0;  // tokens per CTA of the histogram and gather passes (0: chosen)
  EstimateForm form = EstimateForm::kChosen;  // the estimate's kernel
  int64_t split_chunks = 0;  // SparseDecodeParams::split_chunks (0: the batch's plan)
};

struct Host {
  HostLayerKv kv;
  std::vector<float> q;  // [batch][n_q][D], rounded to bf16
};

// Keys with a few strong directions so that attention is peaked the way real heads are, values
// random; queries near some keys.
Host make_inputs(const SparseCase& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int B = int(c.lens.size()), H = c.n_kv_heads, D = c.head_dim;
  Host h;
  h.kv.batch = B;
  h.kv.n_kv_heads = H;
  h.kv.head_dim = D;
  for (int len : c.lens) h.kv.lens.push_back(len);
  std::vector<float> directions(size_t(8) * D);
  for (float& x : directions) x = normal(rng);
  for (int b = 0; b < B; ++b) {
    const size_t n = size_t(H) * size_t(c.lens[size_t(b)]) * D;
    h.kv.k.emplace_back(n);
    h.kv.v.emplace_back(n);
    for (size_t i = 0; i < n; i += size_t(D)) {
      const int dir = int(rng() % 8);
      const float weight = (rng() % 16 == 0) ? 3.f : 0.3f;
      for (int d = 0; d < D; ++d) {
        const float key = c.flat_keys ? directions[size_t(d)] : weight * directions[size_t(dir) * D + d] + normal(rng);
        h.kv.k[size_t(b)][i + size_t(d)] = format::float_to_bf16(key);
        h.kv.v[size_t(b)][i + size_t(d)] = format::float_to_bf16(normal(rng));
      }
    }
  }
  h.q.resize(size_t(B) * c.n_q_heads * D);
  for (size_t i = 0; i < h.q.size(); i += size_t(D)) {
    const int dir = int(rng() % 8);
    for (int d = 0; d < D; ++d)
      h.q[i + size_t(d)] = format::bf16_to_float(format::float_to_bf16(1.5f * directions[size_t(dir) * D + d] + normal(rng)));
  }
  return h;
}

template <int D>
struct SparseRun {
  std::vector<float> out, logits, threshold;
  std::vector<double> mass;
  std::vector<int64_t> n_selected, n_widened;
  std::vector<float> margin;                // [b * n_q + h]: the query's margin_scale
  std::vector<std::vector<float>> norms;    // [b * n_kv + kv_head][n_indexed]: ||k_t - c_k||
  std::vector<uint32_t> entries;
  std::vector<int32_t> counts;
  int64_t chunks = 0, max_indexed = 0;
  // host references
  std::vector<std::vector<float>> cpu_scores;  // [b * n_q + h][n_indexed]
  CudaStatus status;
};

template <int D>
SparseRun<D> run(const SparseCase& c, const Host& h) {
  SparseRun<D> r;
  const int B = int(c.lens.size()), H = c.n_kv_heads, Hq = c.n_q_heads, G = Hq / H;
  const float scale = 1.f / std::sqrt(float(D));
  DeviceKvOptions opt;
  DeviceKv dkv;
  r.status = DeviceKv::build(h.kv, opt, &dkv);
  if (!r.status.ok) return r;
  PagedDecodeParams pp;
  dkv.describe(&pp);

  int64_t max_indexed = 0, max_window = 0;
  for (int b = 0; b < B; ++b) {
    max_indexed = std::max<int64_t>(max_indexed, c.n_indexed[size_t(b)]);
    max_window = std::max<int64_t>(max_window, c.lens[size_t(b)] - c.n_indexed[size_t(b)]);
  }
  r.max_indexed = max_indexed;
  const int64_t stride = std::max<int64_t>(max_indexed, 16);
  std::vector<index::RabitqRecord<D>> records(size_t(B) * H * size_t(stride));
  std::vector<DeviceRabitqQuery> queries(size_t(B) * Hq);
  const std::vector<uint64_t>& weights = index::top_p_bucket_weights();
  r.cpu_scores.resize(size_t(B) * Hq);
  r.margin.assign(size_t(B) * Hq, 0.f);
  r.norms.resize(size_t(B) * H);
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[size_t(b)], n = c.n_indexed[size_t(b)];
    for (int kvh = 0; kvh < H; ++kvh) {
      std::vector<float> keys(static_cast<size_t>(len) * D), c_k(static_cast<size_t>(D), 0.f), c_q(static_cast<size_t>(D), 0.f);
      for (size_t i = 0; i < keys.size(); ++i)
        keys[i] = format::bf16_to_float(h.kv.k[size_t(b)][size_t(kvh) * size_t(len) * D + i]);
      for (int t = 0; t < std::max(n, 1); ++t)
        for (int d = 0; d < D; ++d) c_k[size_t(d)] += keys[size_t(t) * D + size_t(d)] / float(std::max(n, 1));
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) c_q[size_t(d)] += h.q[(size_t(b) * Hq + size_t(kvh) * G + g) * D + size_t(d)] / float(G);
      const index::RabitqHead head(c_q, c_k, index::Rotation(index::RotationKind::kHaar, D, 7 + uint64_t(kvh)));
      index::RabitqRecord<D>* rec = records.data() + (size_t(b) * H + size_t(kvh)) * size_t(stride);
      if (n > 0) index::rabitq_encode_keys<D>(head, keys.data(), n, rec);
      for (int t = 0; t < n; ++t) r.norms[size_t(b) * H + size_t(kvh)].push_back(rec[t].norm_k_centered);
      for (int g = 0; g < G; ++g) {
        const int hh = kvh * G + g;
        const float* qv = h.q.data() + (size_t(b) * Hq + size_t(hh)) * D;
        const index::RabitqQuery<D> query = index::rabitq_quantize_query<D>(head, qv, 1000 + uint64_t(hh));
        const float margin = index::rabitq_logit_deviation_scale(c.deviations, scale, query.norm_q_centered, D);
        r.margin[size_t(b) * Hq + size_t(hh)] = margin;
        queries[size_t(b) * Hq + size_t(hh)] = device_rabitq_query<D>(head, query, margin);
        std::vector<float>& scores = r.cpu_scores[size_t(b) * Hq + size_t(hh)];
        scores.assign(size_t(n), 0.f);
        if (n > 0) index::rabitq_estimate_scores_popcount<D>(head, query, rec, n, scores.data());
      }
    }
  }

  DeviceBuffer rec_d, q_rab_d, w_d, nidx_d, q_d, out_d, thr_d, nsel_d, nwid_d, mass_d, ws_d;
  std::vector<int32_t> nidx(c.n_indexed.begin(), c.n_indexed.end());
  bool ok = DeviceBuffer::allocate(records.size() * sizeof(records[0]), &rec_d).ok &&
            rec_d.upload(0, records.data(), records.size() * sizeof(records[0])).ok &&
            DeviceBuffer::allocate(queries.size() * sizeof(queries[0]), &q_rab_d).ok &&
            q_rab_d.upload(0, queries.data(), queries.size() * sizeof(queries[0])).ok &&
            DeviceBuffer::allocate(weights.size() * 8, &w_d).ok && w_d.upload(0, weights.data(), weights.size() * 8).ok &&
            DeviceBuffer::allocate(nidx.size() * 4, &nidx_d).ok && nidx_d.upload(0, nidx.data(), nidx.size() * 4).ok &&
            DeviceBuffer::allocate(h.q.size() * 4, &q_d).ok && q_d.upload(0, h.q.data(), h.q.size() * 4).ok &&
            DeviceBuffer::allocate(h.q.size() * 4, &out_d).ok && DeviceBuffer::allocate(size_t(B) * Hq * 4, &thr_d).ok &&
            DeviceBuffer::allocate(size_t(B) * Hq * 8, &nsel_d).ok && DeviceBuffer::allocate(size_t(B) * Hq * 8, &nwid_d).ok &&
            DeviceBuffer::allocate(size_t(B) * Hq * 8, &mass_d).ok;
  EXPECT_TRUE(ok);
  SparseDecodeParams p;
  describe_pages(pp, &p);
  p.n_q_heads = Hq;
  p.sm_scale = scale;
  p.p = c.p;
  p.records = rec_d.data();
  p.record_stride = stride;
  p.n_indexed = reinterpret_cast<const int32_t*>(nidx_d.data());
  p.max_indexed = max_indexed;
  p.max_window = max_window;
  p.queries = reinterpret_cast<const DeviceRabitqQuery*>(q_rab_d.data());
  p.topp_weights = reinterpret_cast<const uint64_t*>(w_d.data());
  p.q = reinterpret_cast<const float*>(q_d.data());
  p.out = reinterpret_cast<float*>(out_d.data());
  p.threshold = reinterpret_cast<float*>(thr_d.data());
  p.n_selected = reinterpret_cast<int64_t*>(nsel_d.data());
  p.n_widened = reinterpret_cast<int64_t*>(nwid_d.data());
  p.mass = reinterpret_cast<double*>(mass_d.data());
  p.pass_tokens = c.pass_tokens;
  p.estimate_form = c.form;
  p.split_chunks = c.split_chunks;
  const size_t ws = workspace_bytes(p);
  EXPECT_TRUE(DeviceBuffer::allocate(ws, &ws_d).ok);
  p.workspace = ws_d.data();
  p.workspace_size = ws;
  std::vector<float> poison(h.q.size(), std::nanf(""));
  EXPECT_TRUE(out_d.upload(0, poison.data(), poison.size() * 4).ok);
  r.status = sparse_decode(p);
  if (!r.status.ok) return r;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.out.resize(h.q.size());
  r.threshold.resize(size_t(B) * Hq);
  r.n_selected.resize(size_t(B) * Hq);
  r.n_widened.resize(size_t(B) * Hq);
  r.mass.resize(size_t(B) * Hq);
  r.logits.resize(size_t(B) * Hq * size_t(std::max<int64_t>(max_indexed, 1)));
  r.chunks = selection_chunks(p);
  r.entries.resize(size_t(B) * H * size_t(std::max<int64_t>(r.chunks, 1)) * kSparseChunkTokens);
  r.counts.resize(size_t(B) * H * size_t(std::max<int64_t>(r.chunks, 1)));
  EXPECT_TRUE(out_d.download(0, r.out.data(), r.out.size() * 4).ok);
  EXPECT_TRUE(thr_d.download(0, r.threshold.data(), r.threshold.size() * 4).ok);
  EXPECT_TRUE(nsel_d.download(0, r.n_selected.data(), r.n_selected.size() * 8).ok);
  EXPECT_TRUE(nwid_d.download(0, r.n_widened.data(), r.n_widened.size() * 8).ok);
  EXPECT_TRUE(mass_d.download(0, r.mass.data(), r.mass.size() * 8).ok);
  EXPECT_EQ(cudaMemcpy(r.logits.data(), estimated_logits(p), size_t(B) * Hq * size_t(max_indexed) * 4,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  if (r.chunks > 0) {
    EXPECT_EQ(cudaMemcpy(r.entries.data(), selection_entries(p), r.entries.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(r.counts.data(), selection_counts(p), r.counts.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return r;
}

// Checks one case end to end; dense: also compares with attention over every token (p = 1).
template <int D>
void check_case(const SparseCase& c, bool dense_too = false) {
  SCOPED_TRACE("D " + std::to_string(D) + " " + std::to_string(c.n_q_heads) + "/" + std::to_string(c.n_kv_heads) +
               " p " + std::to_string(c.p) + " deviations " + std::to_string(c.deviations) + " seed " +
               std::to_string(c.seed));
  const Host h = make_inputs(c);
  const SparseRun<D> r = run<D>(c, h);
  ASSERT_TRUE(r.status.ok) << r.status.message;
  const int B = int(c.lens.size()), H = c.n_kv_heads, Hq = c.n_q_heads, G = Hq / H;
  const float scale = 1.f / std::sqrt(float(D));
  int64_t widened_total = 0;
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[size_t(b)], n = c.n_indexed[size_t(b)];
    // Each head's set on the CPU: Top-p on the device's logits, widened by index::top_p_widen.
    std::vector<std::vector<uint8_t>> chosen(static_cast<size_t>(Hq));
    for (int hh = 0; hh < Hq; ++hh) {
      const size_t row = size_t(b) * Hq + size_t(hh);
      const float* gl = r.logits.data() + row * size_t(r.max_indexed);
      // 1. The estimate: the CPU's popcount scores times the scale, bit for bit (both compute the
      // same unfused float steps in the same order; the index layer is built without contraction,
      // Rabitq.PopcountEstimateIsTheUnfusedFloatSequence), so both select from the same logits.
      for (int t = 0; t < n; ++t) {
        const float want = r.cpu_scores[row][size_t(t)] * scale;
        ASSERT_EQ(std::memcmp(&gl[t], &want, sizeof(float)), 0)
            << "seq " << b << " head " << hh << " token " << t << ": " << gl[t] << " against " << want;
      }
      // 2. Top-p on the device's logits: the same threshold (bit for bit), count, mass and set as
      // both CPU selections.
      std::vector<uint8_t> mask(static_cast<size_t>(n));
      if (n == 0) {
        EXPECT_TRUE(std::isinf(r.threshold[row]));
        EXPECT_EQ(r.n_selected[row], 0);
        EXPECT_EQ(r.n_widened[row], 0);
        continue;
      }
      std::vector<uint8_t> mask_ref(static_cast<size_t>(n));
      const index::TopPSelection sel = index::top_p_select(gl, n, c.p, mask.data());
      const index::TopPSelection sel_ref = index::top_p_select_ref(gl, n, c.p, mask_ref.data());
      EXPECT_EQ(std::memcmp(&r.threshold[row], &sel.threshold, sizeof(float)), 0)
          << "seq " << b << " head " << hh << ": theta " << r.threshold[row] << " against " << sel.threshold;
      EXPECT_EQ(std::memcmp(&sel_ref.threshold, &sel.threshold, sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(&r.mass[row], &sel.mass, sizeof(double)), 0)
          << "seq " << b << " head " << hh << ": mass " << r.mass[row] << " against " << sel.mass;
      EXPECT_EQ(mask, mask_ref);
      if (c.p == 1.0) {
        EXPECT_EQ(sel.n_selected, n);
      }
      const int64_t added = index::top_p_widen(gl, n, sel.threshold, r.margin[row],
                                               r.norms[size_t(b) * H + size_t(hh / G)].data(), 1, mask.data());
      EXPECT_EQ(r.n_selected[row], sel.n_selected + added) << "seq " << b << " head " << hh;
      EXPECT_EQ(r.n_widened[row], added) << "seq " << b << " head " << hh;
      widened_total += added;
      chosen[size_t(hh)] = mask;
    }
    // 3. The lists of each KV head: the tokens any head selected, in order, with their heads.
    for (int kvh = 0; kvh < H; ++kvh) {
      std::vector<uint32_t> want, got;
      for (int t = 0; t < n; ++t) {
        uint32_t heads = 0;
        for (int g = 0; g < G; ++g) heads |= uint32_t(chosen[size_t(kvh) * G + g][size_t(t)]) << g;
        if (heads) want.push_back(uint32_t(t) | (heads << 24));
      }
      for (int64_t ch = 0; ch < r.chunks; ++ch) {
        const size_t list = (size_t(b) * H + size_t(kvh)) * size_t(r.chunks) + size_t(ch);
        for (int i = 0; i < r.counts[list]; ++i) got.push_back(r.entries[list * kSparseChunkTokens + size_t(i)]);
      }
      EXPECT_EQ(got, want) << "seq " << b << " kv head " << kvh;
    }
    // 4. The output: double attention over each head's selected tokens and the window.
    for (int hh = 0; hh < Hq; ++hh) {
      const int kvh = hh / G;
      const float* q = h.q.data() + (size_t(b) * Hq + size_t(hh)) * D;
      const size_t row = size_t(b) * Hq + size_t(hh);
      auto attend = [&](bool every) {
        std::vector<double> s(static_cast<size_t>(len), -INFINITY), o(static_cast<size_t>(D), 0.0);
        double mx = -INFINITY;
        for (int t = 0; t < len; ++t) {
          const bool take = every || t >= n || chosen[size_t(hh)][size_t(t)];
          if (!take) continue;
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += double(q[d]) * format::bf16_to_float(h.kv.k[size_t(b)][(size_t(kvh) * size_t(len) + size_t(t)) * D + size_t(d)]);
          s[size_t(t)] = dot * scale;
          mx = std::max(mx, s[size_t(t)]);
        }
        double l = 0;
        for (int t = 0; t < len; ++t) {
          if (s[size_t(t)] == -INFINITY) continue;
          const double w = std::exp(s[size_t(t)] - mx);
          l += w;
          for (int d = 0; d < D; ++d)
            o[size_t(d)] += w * format::bf16_to_float(h.kv.v[size_t(b)][(size_t(kvh) * size_t(len) + size_t(t)) * D + size_t(d)]);
        }
        for (double& x : o) x /= l;
        return o;
      };
      const std::vector<double> ref = attend(false);
      double num = 0, den = 0;
      for (int d = 0; d < D; ++d) {
        const double got = r.out[row * D + size_t(d)];
        ASSERT_TRUE(std::isfinite(got)) << "seq " << b << " head " << hh << " dim " << d;
        num += (got - ref[size_t(d)]) * (got - ref[size_t(d)]);
        den += ref[size_t(d)] * ref[size_t(d)];
      }
      EXPECT_LT(std::sqrt(num / den), 4e-3) << "seq " << b << " head " << hh;
      if (dense_too) {
        const std::vector<double> dense = attend(true);
        double dn = 0, dd = 0;
        for (int d = 0; d < D; ++d) {
          dn += (r.out[row * D + size_t(d)] - dense[size_t(d)]) * (r.out[row * D + size_t(d)] - dense[size_t(d)]);
          dd += dense[size_t(d)] * dense[size_t(d)];
        }
        EXPECT_LT(std::sqrt(dn / dd), 4e-3) << "p = 1 against dense, seq " << b << " head " << hh;
      }
    }
  }
  if (c.deviations == 0) {
    EXPECT_EQ(widened_total, 0);
  } else if (c.p < 1.0) {
    EXPECT_GT(widened_total, 0) << "the widening added no token";
  }
}

TEST(SparseDecodeCuda, RaggedBatchesMatchTheCpuSelectionAndAttention) {
  CERTKV_NEED_CUDA_DEVICE();
  check_case<128>({128, 32, 8, {4096 + 100, 2000}, {4096, 1792}, 0.9, 1});
  check_case<128>({128, 28, 4, {17, 3000, 16 * 300 + 1}, {0, 2816, 16 * 300}, 0.9, 2});
  check_case<64>({64, 7, 7, {1500, 64}, {1280, 48}, 0.95, 3});
  check_case<64>({64, 9, 3, {9000}, {8960}, 0.5, 4});
  check_case<128>({128, 8, 1, {2048, 333}, {1920, 320}, 0.99, 5});
}

// Every form of the estimate (popcount, byte mma, bit mma; by default bit mma from 4 query heads
// per KV head, popcount below) at every group size from 1 to 8 and both head dims, several
// KV heads each: the logits equal to the CPU's bit for bit, the CPU's set and lists, the output
// (check_case); widened cases too.
TEST(SparseDecodeCuda, EveryGroupSizeAndFormOfTheEstimate) {
  CERTKV_NEED_CUDA_DEVICE();
  std::vector<SparseCase> cases = {
      {64, 8, 4, {2000, 777}, {1920, 752}, 0.9, 31},      // 2 heads
      {128, 10, 2, {3000, 1200}, {2880, 1088}, 0.9, 32},  // 5 heads
      {64, 12, 2, {2500}, {2400}, 0.8, 33},                // 6 heads
      {64, 16, 2, {1700, 3100}, {1600, 3072}, 0.95, 34},   // 8 heads, head_dim 64
      {128, 3, 3, {1000, 2100}, {992, 2048}, 0.9, 37},     // 1 head
      {128, 12, 4, {1300, 700}, {1280, 688}, 0.9, 38},     // 3 heads
      {128, 16, 4, {1800}, {1776}, 0.9, 39},               // 4 heads
      {64, 28, 4, {1400, 350}, {1392, 336}, 0.9, 40},      // 7 heads, head_dim 64
      {128, 32, 4, {2200}, {2192}, 0.9, 41},               // 8 heads
  };
  SparseCase widened_3_heads{64, 6, 2, {2600, 900}, {2560, 896}, 0.9, 35};  // 3 heads
  widened_3_heads.deviations = 1.5;
  cases.push_back(widened_3_heads);
  SparseCase widened_6_heads{128, 12, 2, {2600, 900}, {2560, 896}, 0.9, 36};  // 6 heads
  widened_6_heads.deviations = 1.5;
  cases.push_back(widened_6_heads);
  for (const EstimateForm form : {EstimateForm::kPopcount, EstimateForm::kByteMma, EstimateForm::kBitMma})
    for (SparseCase c : cases) {
      SCOPED_TRACE(std::string("estimate form ") + estimate_form_name(form) + ", " + std::to_string(c.n_q_heads) +
                   " / " + std::to_string(c.n_kv_heads) + " heads, head_dim " + std::to_string(c.head_dim));
      c.form = form;
      if (c.head_dim == 64) check_case<64>(c);
      else check_case<128>(c);
    }
}

// The Top-p set widened per token (index::top_p_widen): the device adds exactly the CPU's tokens
// (the same two rounded float operations on the same logits and norms), counts them, and attends
// them; ragged batches and GQA 1, 4, 7.
TEST(SparseDecodeCuda, WideningAddsTheCpuTokens) {
  CERTKV_NEED_CUDA_DEVICE();
  auto widened = [](SparseCase c, double z) {
    c.deviations = z;
    return c;
  };
  check_case<128>(widened({128, 32, 8, {4096 + 100, 2000}, {4096, 1792}, 0.9, 11}, 1.5));
  check_case<128>(widened({128, 28, 4, {17, 3000, 16 * 300 + 1}, {0, 2816, 16 * 300}, 0.8, 12}, 2.0));
  check_case<64>(widened({64, 7, 1, {1500, 64}, {1280, 48}, 0.9, 13}, 3.0));
  check_case<64>(widened({64, 9, 3, {9000}, {8960}, 0.5, 14}, 0.5));
}

// With split_chunks a row's splits are its own chunks (indexed, then its window's): its output is
// the same bit for bit alone and beside rows with longer indexes and windows, and still the
// CPU's selection and attention (check_case).
TEST(SparseDecodeCuda, FixedSplitsMakeARowsOutputIndependentOfTheBatch) {
  CERTKV_NEED_CUDA_DEVICE();
  for (int64_t split_chunks : {1, 4}) {
    SparseCase c{64, 9, 3, {9000, 1500, 64, 4096 + 1100}, {8960, 1280, 48, 4096}, 0.9, 51};
    c.split_chunks = split_chunks;
    check_case<64>(c);
    const Host h = make_inputs(c);
    const SparseRun<64> batch = run<64>(c, h);
    ASSERT_TRUE(batch.status.ok) << batch.status.message;
    const size_t q_row = size_t(c.n_q_heads) * 64;
    for (size_t b = 0; b < c.lens.size(); ++b) {
      SparseCase one = c;
      one.lens = {c.lens[b]};
      one.n_indexed = {c.n_indexed[b]};
      Host alone;
      alone.kv.batch = 1;
      alone.kv.n_kv_heads = c.n_kv_heads;
      alone.kv.head_dim = 64;
      alone.kv.lens = {c.lens[b]};
      alone.kv.k = {h.kv.k[b]};
      alone.kv.v = {h.kv.v[b]};
      alone.q.assign(h.q.begin() + long(b * q_row), h.q.begin() + long((b + 1) * q_row));
      const SparseRun<64> r = run<64>(one, alone);
      ASSERT_TRUE(r.status.ok) << r.status.message;
      EXPECT_EQ(std::memcmp(r.out.data(), batch.out.data() + b * q_row, q_row * sizeof(float)), 0)
          << "split_chunks " << split_chunks << ": row " << b << " differs alone";
    }
  }
}

TEST(SparseDecodeCuda, PEqualOneIsDenseAttention) {
  CERTKV_NEED_CUDA_DEVICE();
  check_case<128>({128, 16, 4, {3000, 517}, {2880, 512}, 1.0, 6}, true);
  check_case<64>({64, 6, 2, {1200}, {1024}, 1.0, 7}, true);
}

TEST(SparseDecodeCuda, AThresholdBucketOfEveryToken) {
  CERTKV_NEED_CUDA_DEVICE();
  // Every key the same: every logit ties, so the threshold bucket holds all 6,400 indexed tokens
  // (counted by every pass CTA), and all are selected.
  SparseCase c{128, 8, 2, {6400 + 50}, {6400}, 0.9, 8};
  c.flat_keys = true;
  check_case<128>(c);
}

// The histogram pass splits each row into spans of pass_tokens, one CTA each: every span width
// gives the CPU's threshold, set and lists — spans of one 16-token block, ragged spans that end
// inside the row, spans past the longest row (one CTA per row), and a threshold bucket counted by
// hundreds of CTAs.
TEST(SparseDecodeCuda, EveryPassSpanSelectsTheCpuTokens) {
  CERTKV_NEED_CUDA_DEVICE();
  for (const int64_t span : {16, 592, 1008, 8192}) {
    SCOPED_TRACE("pass_tokens " + std::to_string(span));
    SparseCase c{128, 32, 8, {4096 + 100, 2000}, {4096, 1792}, 0.9, 21};
    c.pass_tokens = span;
    check_case<128>(c);
  }
  SparseCase widened{128, 28, 4, {17, 3000, 16 * 300 + 1}, {0, 2816, 16 * 300}, 0.8, 22};
  widened.deviations = 1.5;
  widened.pass_tokens = 592;
  check_case<128>(widened);
  SparseCase flat{128, 8, 2, {6400 + 50}, {6400}, 0.9, 23};
  flat.flat_keys = true;
  flat.pass_tokens = 48;
  check_case<128>(flat);
}

// The Top-p stage alone (top_p_rows, sparse_decode's histogram and threshold kernels) on chosen
// logits: each row's theta, selected count and mass bit for bit those of index::top_p_select.
void check_top_p_rows(const std::vector<std::vector<float>>& rows, double p, int64_t pass_tokens,
                      const std::string& what) {
  SCOPED_TRACE(what + " p " + std::to_string(p) + " pass_tokens " + std::to_string(pass_tokens));
  int64_t stride = 16;
  for (const std::vector<float>& r : rows) stride = std::max<int64_t>(stride, (int64_t(r.size()) + 15) / 16 * 16);
  std::vector<float> logits(rows.size() * size_t(stride), 0.f);
  std::vector<int32_t> n(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r].begin(), rows[r].end(), logits.begin() + long(r * size_t(stride)));
    n[r] = int32_t(rows[r].size());
  }
  const std::vector<uint64_t>& weights = index::top_p_bucket_weights();
  TopPRowsParams t;
  t.rows = int(rows.size());
  t.stride = stride;
  t.p = p;
  t.pass_tokens = pass_tokens;
  DeviceBuffer l_d, n_d, w_d, thr_d, sel_d, mass_d, ws_d;
  const size_t R = rows.size();
  ASSERT_TRUE(DeviceBuffer::allocate(logits.size() * 4, &l_d).ok && l_d.upload(0, logits.data(), logits.size() * 4).ok &&
              DeviceBuffer::allocate(R * 4, &n_d).ok && n_d.upload(0, n.data(), R * 4).ok &&
              DeviceBuffer::allocate(weights.size() * 8, &w_d).ok && w_d.upload(0, weights.data(), weights.size() * 8).ok &&
              DeviceBuffer::allocate(R * 4, &thr_d).ok && DeviceBuffer::allocate(R * 8, &sel_d).ok &&
              DeviceBuffer::allocate(R * 8, &mass_d).ok &&
              DeviceBuffer::allocate(top_p_rows_workspace_bytes(t), &ws_d).ok);
  t.logits = reinterpret_cast<const float*>(l_d.data());
  t.n = reinterpret_cast<const int32_t*>(n_d.data());
  t.topp_weights = reinterpret_cast<const uint64_t*>(w_d.data());
  t.threshold = reinterpret_cast<float*>(thr_d.data());
  t.n_selected = reinterpret_cast<int64_t*>(sel_d.data());
  t.mass = reinterpret_cast<double*>(mass_d.data());
  t.workspace = ws_d.data();
  t.workspace_size = top_p_rows_workspace_bytes(t);
  const CudaStatus st = top_p_rows(t);
  ASSERT_TRUE(st.ok) << st.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> theta(R);
  std::vector<int64_t> selected(R);
  std::vector<double> mass(R);
  ASSERT_TRUE(thr_d.download(0, theta.data(), R * 4).ok && sel_d.download(0, selected.data(), R * 8).ok &&
              mass_d.download(0, mass.data(), R * 8).ok);
  for (size_t r = 0; r < R; ++r) {
    if (rows[r].empty()) {
      EXPECT_TRUE(std::isinf(theta[r])) << "row " << r;
      EXPECT_EQ(selected[r], 0) << "row " << r;
      continue;
    }
    std::vector<uint8_t> mask(rows[r].size());
    const index::TopPSelection sel = index::top_p_select(rows[r].data(), int64_t(rows[r].size()), p, mask.data());
    EXPECT_EQ(std::memcmp(&theta[r], &sel.threshold, sizeof(float)), 0)
        << "row " << r << ": theta " << theta[r] << " against " << sel.threshold << " (bucket " << sel.bucket << ")";
    EXPECT_EQ(selected[r], sel.n_selected) << "row " << r;
    EXPECT_EQ(std::memcmp(&mass[r], &sel.mass, sizeof(double)), 0) << "row " << r << ": " << mass[r] << " against " << sel.mass;
  }
}

TEST(SparseDecodeCuda, TopPOnChosenLogitsIsTheCpuSelection) {
  CERTKV_NEED_CUDA_DEVICE();
  std::vector<std::vector<float>> rows;
  // Bucket edges: gaps a / 256 exactly, and the floats just above and below them.
  for (float l_max : {0.0f, 1.0f, -3.5f, 1000.0f}) {
    std::vector<float> r = {l_max};
    for (int a = 1; a < 3000; a += 7) {
      const float edge = l_max - float(a) / 256.0f;
      r.push_back(edge);
      r.push_back(std::nextafter(edge, INFINITY));
      r.push_back(std::nextafter(edge, -INFINITY));
    }
    rows.push_back(r);
  }
  // Ties: a whole row equal; two tied groups; a tied group inside one bucket across its width.
  rows.push_back(std::vector<float>(5000, -2.25f));
  {
    std::vector<float> r(3000, 1.0f);
    for (size_t i = 0; i < r.size(); i += 2) r[i] = 0.5f;
    rows.push_back(r);
    std::vector<float> w(4000);
    for (size_t i = 0; i < w.size(); ++i) w[i] = -float(i % 256) / 65536.0f;  // all in bucket 0
    rows.push_back(w);
  }
  // The cap bucket: gaps of 44 logits and more, down to the lowest float.
  rows.push_back({0.0f, -43.99f, -44.0f, -45.0f, -1e30f, -FLT_MAX, -FLT_MAX, -50.0f});
  // Ragged random rows (normal x 12, heavy-tailed, integer-valued) and an empty one.
  std::mt19937 rng(91);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::cauchy_distribution<float> cauchy(0.f, 2.f);
  for (int64_t n : {int64_t(1), int64_t(3), int64_t(17), int64_t(129), int64_t(501), int64_t(3771), int64_t(40000)}) {
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> r(static_cast<size_t>(n));
      for (float& x : r)
        x = shape == 0 ? 12.f * normal(rng) : shape == 1 ? std::clamp(cauchy(rng), -1e6f, 1e6f) : std::round(3.f * normal(rng));
      rows.push_back(r);
    }
  }
  rows.push_back({});
  for (double p : {1e-300, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0 - std::ldexp(1.0, -40), 1.0})
    for (int64_t pass : {int64_t(0), int64_t(16), int64_t(1008)}) check_top_p_rows(rows, p, pass, "chosen logits");
}

// The estimate forms' names (the benchmark's -est-FORM) round-trip, other names are refused, and
// the chosen form follows the group size (no device needed).
TEST(SparseDecodeCuda, EstimateFormsByName) {
  for (const EstimateForm form :
       {EstimateForm::kChosen, EstimateForm::kPopcount, EstimateForm::kByteMma, EstimateForm::kBitMma}) {
    EstimateForm parsed = EstimateForm(99);
    EXPECT_TRUE(parse_estimate_form(estimate_form_name(form), &parsed));
    EXPECT_EQ(parsed, form);
  }
  EstimateForm untouched = EstimateForm::kBitMma;
  for (const char* bad : {"", "bit", "Bits", "bits ", "popcount2", "mma"}) EXPECT_FALSE(parse_estimate_form(bad, &untouched));
  EXPECT_FALSE(parse_estimate_form(nullptr, &untouched));
  EXPECT_EQ(untouched, EstimateForm::kBitMma);
  EXPECT_STREQ(estimate_form_name(EstimateForm(9)), "unknown");
  SparseDecodeParams p;
  p.n_kv_heads = 2;
  for (const auto& [q_heads, expected] : std::vector<std::pair<int, EstimateForm>>{
           {2, EstimateForm::kPopcount}, {6, EstimateForm::kPopcount}, {8, EstimateForm::kBitMma},
           {10, EstimateForm::kBitMma}, {16, EstimateForm::kBitMma}}) {
    p.n_q_heads = q_heads;
    EXPECT_EQ(estimate_form_of(p), expected) << q_heads << " query heads";
  }
  p.estimate_form = EstimateForm::kBitMma;
  EXPECT_EQ(estimate_form_of(p), EstimateForm::kBitMma);
  p.estimate_form = EstimateForm::kChosen;
  p.n_kv_heads = 0;  // not a valid launch (check() refuses it), but no division by zero here
  EXPECT_EQ(estimate_form_of(p), EstimateForm::kPopcount);
}

TEST(SparseDecodeCuda, BadInputIsRefused) {
  SparseDecodeParams p;
  p.batch = 1;
  p.n_q_heads = 8;
  p.n_kv_heads = 2;
  p.head_dim = 96;
  p.sm_scale = 0.1f;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  p.head_dim = 128;
  p.n_q_heads = 18;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);  // 9 query heads per KV head
  p.n_q_heads = 7;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);  // not integral
  p.batch = 65535;  // batch x n_q_heads past 2^31 - 1 (the merge kernel's grid has one CTA per row)
  p.n_q_heads = p.n_kv_heads = 65535;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  EXPECT_NE(check(p).message.find("batch x n_q_heads"), std::string::npos);
  p.batch = 1;
  p.n_kv_heads = 2;
  p.n_q_heads = 8;
  p.p = 0.0;
  p.table_stride = 16;
  p.max_seq_len = 256;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  p.p = 1.5;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  p.p = 0.9;
  p.max_indexed = 100;  // not a multiple of 16
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  p.max_indexed = 128;
  p.pass_tokens = 100;  // not a multiple of 16
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  EXPECT_NE(check(p).message.find("pass_tokens"), std::string::npos);
  p.pass_tokens = -16;
  EXPECT_NE(check(p).message.find("pass_tokens"), std::string::npos);
  p.pass_tokens = int64_t(1) << 40;  // past 2^24 (the longest context): the passes' grid would overflow
  EXPECT_NE(check(p).message.find("pass_tokens"), std::string::npos);
  p.pass_tokens = 0;
  p.estimate_form = EstimateForm(9);  // not a form
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  EXPECT_NE(check(p).message.find("estimate_form"), std::string::npos);
  p.estimate_form = EstimateForm::kBitMma;
  EXPECT_EQ(check(p).message.find("estimate_form"), std::string::npos);
  p.estimate_form = EstimateForm::kChosen;
  // Fixed splits and table rows (the engine's backend).
  p.split_chunks = -1;
  EXPECT_NE(check(p).message.find("split_chunks must be >= 0"), std::string::npos) << check(p).message;
  p.split_chunks = 4;
  p.n_splits = 2;
  EXPECT_NE(check(p).message.find("not both"), std::string::npos) << check(p).message;
  p.n_splits = 0;
  alignas(16) static int32_t fake_rows[1];
  p.table_rows = fake_rows;
  EXPECT_NE(check(p).message.find("n_table_rows"), std::string::npos) << check(p).message;
  p.n_table_rows = 1;
  p.table_row_stride = 1;  // below n_kv_heads x table_stride
  EXPECT_NE(check(p).message.find("table_row_stride"), std::string::npos) << check(p).message;
  p.table_row_stride = 0;
  p.table_rows = nullptr;
  p.split_chunks = 0;
  // Lists that do not start on 16 bytes: head_dim 64 (24-byte records) with an odd stride. Only
  // the pointer's alignment is checked, so a fake aligned address serves.
  alignas(16) static unsigned char fake_records[16];
  p.records = fake_records;
  p.head_dim = 64;
  p.record_stride = 129;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  EXPECT_NE(check(p).message.find("even stride"), std::string::npos);
  p.record_stride = 130;  // even: past this check, refused for the null pointers below
  EXPECT_EQ(check(p).message.find("even stride"), std::string::npos);
  p.head_dim = 128;
  p.record_stride = 129;  // 32-byte records: any stride
  EXPECT_EQ(check(p).message.find("even stride"), std::string::npos);
  p.records = nullptr;
  p.record_stride = 0;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);  // null pointers
  EXPECT_NE(check(p).message.find("cuda sparse decode"), std::string::npos);
}

}  // namespace
}  // namespace certkv::attention::cuda
