// The C API's KV store (certkv_kv_store_*): rows appended in ragged pieces read back bit for bit
// (bf16, gaac), attention equal to a plain double-precision softmax over the rows read back, the
// meter of lossy schemes at or above the true total variation and output error it bounds, crop
// and reorder, and refusals that name the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "certkv/certkv.h"

namespace {

constexpr int kLayers = 2, kHeads = 6, kKvHeads = 2, kHeadDim = 64, kBlock = 16;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rows [n_kv_heads][n][head_dim] of bf16 bits: RoPE-like keys (a few large channels), or values;
// `specials` mixes in -0, subnormals, infinities and quiet NaN (a GAAC page must keep them).
std::vector<uint16_t> rows_bf16(int n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const uint16_t special[] = {0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc1, 0x7f7f};
  std::vector<uint16_t> x(size_t(kKvHeads) * size_t(n) * kHeadDim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = int(i % kHeadDim);
    const float scale = c % 16 == 3 ? 6.f : 1.f;
    x[i] = to_bf16(scale * normal(rng));
    if (specials && rng() % 97 == 0) x[i] = special[rng() % 7];
  }
  return x;
}

struct Store {
  certkv_kv_store* s = nullptr;
  explicit Store(const char* kv, int n_sequences = 1, int64_t max_tokens = 0, const char* layout = "half-split",
                 double gate_tau = 0) {
    certkv_kv_store_params p = certkv_kv_store_default_params();
    if (gate_tau > 0) {
      p.gate = 1;
      p.meter_tau = gate_tau;
    }
    p.kv = kv;
    p.n_layers = kLayers;
    p.n_heads = kHeads;
    p.n_kv_heads = kKvHeads;
    p.head_dim = kHeadDim;
    p.block_tokens = kBlock;
    p.n_sequences = n_sequences;
    p.max_tokens = max_tokens;
    p.rope_layout = layout;
    p.n_threads = 2;
    EXPECT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  }
  ~Store() { certkv_kv_store_free(s); }
};

// Appends the positions [begin, end) of full [n_kv_heads][n][head_dim] rows.
certkv_status append_range(certkv_kv_store* s, int seq, int layer, const std::vector<uint16_t>& k,
                           const std::vector<uint16_t>& v, int n, int begin, int end) {
  std::vector<uint16_t> kp, vp;
  for (int h = 0; h < kKvHeads; ++h)
    for (int t = begin; t < end; ++t)
      for (int c = 0; c < kHeadDim; ++c) {
        kp.push_back(k[(size_t(h) * n + t) * kHeadDim + c]);
        vp.push_back(v[(size_t(h) * n + t) * kHeadDim + c]);
      }
  return certkv_kv_store_append_bf16(s, seq, layer, kp.data(), vp.data(), end - begin);
}

// Ragged pieces, none a multiple of the block: 129, 1, 3, 17 (150 tokens); or 1, 3, 17, 129
// (a first append too short to calibrate GAAC on: its blocks stay raw, still bit for bit).
constexpr int kTokens = 150;

void append_ragged(certkv_kv_store* s, int seq, int layer, const std::vector<uint16_t>& k,
                   const std::vector<uint16_t>& v, bool short_first = false) {
  const int long_first[] = {129, 1, 3, 17}, short_pieces[] = {1, 3, 17, 129};
  int at = 0;
  for (int piece : short_first ? short_pieces : long_first) {
    ASSERT_EQ(append_range(s, seq, layer, k, v, kTokens, at, at + piece), CERTKV_OK) << certkv_last_error();
    at += piece;
  }
}

// Whether the last error message names `text`.
bool error_names(const char* text) { return std::string(certkv_last_error()).find(text) != std::string::npos; }

std::vector<float> read(certkv_kv_store* s, int seq, int layer, int kv, int64_t begin, int64_t end, int exact) {
  std::vector<float> out(size_t(kKvHeads) * size_t(end - begin) * kHeadDim);
  EXPECT_EQ(certkv_kv_store_read(s, seq, layer, kv, begin, end, exact, out.data()), CERTKV_OK) << certkv_last_error();
  return out;
}

std::vector<uint16_t> bits_of(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    b[i] = uint16_t(u >> 16);
  }
  return b;
}

uint64_t class_pages(const certkv_kv_stats& st, const char* storage) {
  for (int i = 0; i < st.n_classes; ++i)
    if (std::strcmp(st.by_class[i].storage, storage) == 0) return st.by_class[i].pages_in_use;
  return 0;
}

TEST(CApiKvStore, Bf16AndGaacReadBackBitForBit) {
  for (const char* kv : {"bf16", "gaac", "gaac short first"}) {
    const bool short_first = std::string(kv) == "gaac short first";
    Store st(short_first ? "gaac" : kv, 2);
    std::vector<std::vector<uint16_t>> ks, vs;
    for (int seq = 0; seq < 2; ++seq)
      for (int layer = 0; layer < kLayers; ++layer) {
        ks.push_back(rows_bf16(kTokens, 11 + 7 * seq + layer, true));
        vs.push_back(rows_bf16(kTokens, 101 + 7 * seq + layer, true));
        append_ragged(st.s, seq, layer, ks.back(), vs.back(), short_first);
      }
    for (int seq = 0; seq < 2; ++seq)
      for (int layer = 0; layer < kLayers; ++layer) {
        int64_t n = 0;
        ASSERT_EQ(certkv_kv_store_length(st.s, seq, layer, &n), CERTKV_OK);
        EXPECT_EQ(n, kTokens);
        const size_t i = size_t(seq * kLayers + layer);
        EXPECT_EQ(bits_of(read(st.s, seq, layer, 0, 0, kTokens, 0)), ks[i]) << kv << " K seq " << seq << " layer " << layer;
        EXPECT_EQ(bits_of(read(st.s, seq, layer, 1, 0, kTokens, 0)), vs[i]) << kv << " V seq " << seq << " layer " << layer;
      }
    certkv_kv_stats stats;
    ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &stats), CERTKV_OK);
    EXPECT_EQ(stats.n_tokens, 2 * kTokens);
    EXPECT_EQ(stats.kv_bytes_bf16, uint64_t(2) * kTokens * kLayers * kKvHeads * kHeadDim * 2 * 2);
    if (std::string(kv) == "gaac") {
      // Not a pass on raw pages alone: complete blocks went to GAAC slots, in fewer bytes.
      EXPECT_GT(class_pages(stats, "gaac"), 0u);
      EXPECT_LT(stats.kv_bytes_in_use, stats.kv_bytes_bf16);
    }
  }
}

TEST(CApiKvStore, F32RowsRoundToBf16) {
  Store st("bf16");
  std::vector<float> k(size_t(kKvHeads) * 5 * kHeadDim), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.1f * float(i) + 1e-4f;
    v[i] = -0.37f * float(i);
  }
  ASSERT_EQ(certkv_kv_store_append_f32(st.s, 0, 1, k.data(), v.data(), 5), CERTKV_OK) << certkv_last_error();
  const std::vector<float> kr = read(st.s, 0, 1, 0, 0, 5, 0), vr = read(st.s, 0, 1, 1, 0, 5, 0);
  for (size_t i = 0; i < k.size(); ++i) {
    ASSERT_EQ(kr[i], from_bf16(to_bf16(k[i]))) << i;
    ASSERT_EQ(vr[i], from_bf16(to_bf16(v[i]))) << i;
  }
  int64_t n = -1;
  ASSERT_EQ(certkv_kv_store_length(st.s, 0, 0, &n), CERTKV_OK);
  EXPECT_EQ(n, 0);  // layers are appended on their own
}

// Plain softmax attention in double of query heads q [n_heads][head_dim] over rows
// [n_kv_heads][n][head_dim] (positions [0, n_ctx)), GQA heads h -> h / (n_heads / n_kv_heads).
std::vector<double> softmax_attention(const float* q, const std::vector<float>& k, const std::vector<float>& v,
                                      int n, int n_ctx, double scale, std::vector<std::vector<double>>* p_out = nullptr) {
  std::vector<double> out(size_t(kHeads) * kHeadDim, 0.0);
  const int group = kHeads / kKvHeads;
  for (int h = 0; h < kHeads; ++h) {
    const int g = h / group;
    std::vector<double> s(static_cast<size_t>(n_ctx), 0.0);
    double m = -INFINITY;
    for (int t = 0; t < n_ctx; ++t) {
      double dot = 0;
      for (int c = 0; c < kHeadDim; ++c) dot += double(q[h * kHeadDim + c]) * double(k[(size_t(g) * n + t) * kHeadDim + c]);
      s[size_t(t)] = scale * dot;
      m = std::max(m, s[size_t(t)]);
    }
    double z = 0;
    for (double& x : s) z += (x = std::exp(x - m));
    for (double& x : s) x /= z;
    for (int t = 0; t < n_ctx; ++t)
      for (int c = 0; c < kHeadDim; ++c)
        out[size_t(h) * kHeadDim + c] += s[size_t(t)] * double(v[(size_t(g) * n + t) * kHeadDim + c]);
    if (p_out) p_out->push_back(s);
  }
  return out;
}

std::vector<float> queries(int n_queries, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.5f);
  std::vector<float> q(size_t(n_queries) * kHeads * kHeadDim);
  for (float& x : q) x = normal(rng);
  return q;
}

TEST(CApiKvStore, AttendEqualsDoubleSoftmaxOverReadBackRows) {
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  for (const char* kv : {"bf16", "gaac", "fp8-e4m3-pages", "dither8", "rtn4"}) {
    Store st(kv);
    const std::vector<uint16_t> k = rows_bf16(kTokens, 3, false), v = rows_bf16(kTokens, 4, false);
    append_ragged(st.s, 0, 1, k, v);
    const std::vector<float> kr = read(st.s, 0, 1, 0, 0, kTokens, 0), vr = read(st.s, 0, 1, 1, 0, kTokens, 0);
    // A decode step: the last position's query.
    const std::vector<float> q = queries(1, 9);
    std::vector<float> out(size_t(kHeads) * kHeadDim);
    ASSERT_EQ(certkv_kv_store_attend(st.s, 0, 1, q.data(), 1, out.data(), nullptr), CERTKV_OK) << certkv_last_error();
    const std::vector<double> want = softmax_attention(q.data(), kr, vr, kTokens, kTokens, scale);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 2e-5 * (1 + std::fabs(want[i]))) << kv << " " << i;
    // A prefill of the last 5 positions: query i attends to positions [0, kTokens - 5 + i].
    const std::vector<float> q5 = queries(5, 10);
    std::vector<float> out5(q5.size());
    ASSERT_EQ(certkv_kv_store_attend(st.s, 0, 1, q5.data(), 5, out5.data(), nullptr), CERTKV_OK) << certkv_last_error();
    if (std::string(kv) == "bf16" || std::string(kv) == "gaac" || std::string(kv) == "fp8-e4m3-pages") {
      for (int i = 0; i < 5; ++i) {
        const std::vector<double> w = softmax_attention(q5.data() + size_t(i) * kHeads * kHeadDim, kr, vr, kTokens,
                                                        kTokens - 5 + i + 1, scale);
        for (size_t j = 0; j < w.size(); ++j)
          ASSERT_NEAR(out5[size_t(i) * kHeads * kHeadDim + j], w[j], 2e-5 * (1 + std::fabs(w[j]))) << kv << " query " << i;
      }
    }
  }
}

TEST(CApiKvStore, LossyMeterBoundsTheTrueError) {
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  for (const char* kv : {"dither8", "rtn4", "fp8-e4m3", "kivi2"}) {
    Store st(kv);
    const std::vector<uint16_t> k = rows_bf16(kTokens + 40, 21, false), v = rows_bf16(kTokens + 40, 22, false);
    constexpr int kSteps = 40;
    double largest = 0;
    // The prompt, then decode steps of one token each: every step's meter over the true error.
    ASSERT_EQ(append_range(st.s, 0, 0, k, v, kTokens + kSteps, 0, kTokens), CERTKV_OK) << certkv_last_error();
    for (int step = 0; step < kSteps; ++step) {
      const int n = kTokens + step + 1;
      ASSERT_EQ(append_range(st.s, 0, 0, k, v, kTokens + kSteps, n - 1, n), CERTKV_OK) << certkv_last_error();
      const std::vector<float> q = queries(1, 1000 + uint32_t(n));
      std::vector<float> out(size_t(kHeads) * kHeadDim);
      certkv_head_meter meters[kHeads];
      ASSERT_EQ(certkv_kv_store_attend(st.s, 0, 0, q.data(), 1, out.data(), meters), CERTKV_OK) << certkv_last_error();
      const std::vector<float> kr = read(st.s, 0, 0, 0, 0, n, 0), vr = read(st.s, 0, 0, 1, 0, n, 0);
      const std::vector<float> ke = read(st.s, 0, 0, 0, 0, n, 1), ve = read(st.s, 0, 0, 1, 0, n, 1);
      std::vector<std::vector<double>> p_hat, p;
      const std::vector<double> y_hat = softmax_attention(q.data(), kr, vr, n, n, scale, &p_hat);
      const std::vector<double> y = softmax_attention(q.data(), ke, ve, n, n, scale, &p);
      for (int h = 0; h < kHeads; ++h) {
        double tv = 0, err2 = 0;
        for (int t = 0; t < n; ++t) tv += 0.5 * std::fabs(p[size_t(h)][size_t(t)] - p_hat[size_t(h)][size_t(t)]);
        for (int c = 0; c < kHeadDim; ++c) {
          const double d = y_hat[size_t(h) * kHeadDim + c] - y[size_t(h) * kHeadDim + c];
          err2 += d * d;
        }
        EXPECT_GE(meters[h].meter, tv) << kv << " step " << n << " head " << h;
        EXPECT_GE(meters[h].output_bound, std::sqrt(err2)) << kv << " step " << n << " head " << h;
        largest = std::max(largest, meters[h].meter);
      }
    }
    // Not a pass on exact pages: the pages were lossy and the meter saw it.
    EXPECT_GT(largest, 0.0) << kv;
    certkv_meter_stats ms;
    ASSERT_EQ(certkv_kv_store_meter_stats(st.s, &ms), CERTKV_OK);
    EXPECT_EQ(ms.metered, 1);
    EXPECT_EQ(ms.cells, int64_t(kSteps) * kHeads);
    EXPECT_EQ(std::string(ms.tier), std::string(kv) == "dither8" ? "B" : "A");
    EXPECT_NEAR(ms.max, largest, largest * 0.004 + 1e-300);
    certkv_kv_stats ks;
    ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &ks), CERTKV_OK);
    EXPECT_GT(ks.backing_bytes, 0u) << kv;
  }
}

TEST(CApiKvStore, LosslessSchemesAreNotMetered) {
  Store st("gaac");
  const std::vector<uint16_t> k = rows_bf16(40, 5, false), v = rows_bf16(40, 6, false);
  ASSERT_EQ(append_range(st.s, 0, 0, k, v, 40, 0, 40), CERTKV_OK);
  const std::vector<float> q = queries(1, 3);
  std::vector<float> out(size_t(kHeads) * kHeadDim);
  certkv_head_meter meters[kHeads];
  ASSERT_EQ(certkv_kv_store_attend(st.s, 0, 0, q.data(), 1, out.data(), meters), CERTKV_OK);
  for (const certkv_head_meter& m : meters) EXPECT_EQ(m.meter, 0.0);
  certkv_meter_stats ms;
  ASSERT_EQ(certkv_kv_store_meter_stats(st.s, &ms), CERTKV_OK);
  EXPECT_EQ(ms.metered, 0);
  EXPECT_EQ(std::string(ms.tier), "none");
  EXPECT_EQ(ms.cells, 0);
}

TEST(CApiKvStore, CropKeepsAPrefixAndAppendsAfterIt) {
  for (const char* kv : {"bf16", "gaac", "dither8"}) {
    Store st(kv);
    const std::vector<uint16_t> k = rows_bf16(kTokens, 31, false), v = rows_bf16(kTokens, 32, false);
    for (int layer = 0; layer < kLayers; ++layer) append_ragged(st.s, 0, layer, k, v);
    const std::vector<float> exact_k = read(st.s, 0, 1, 0, 0, kTokens, 1);
    for (int64_t keep : {int64_t(149), int64_t(37), int64_t(32), int64_t(0)}) {
      ASSERT_EQ(certkv_kv_store_crop(st.s, 0, keep), CERTKV_OK) << kv << ": " << certkv_last_error();
      for (int layer = 0; layer < kLayers; ++layer) {
        int64_t n = -1;
        ASSERT_EQ(certkv_kv_store_length(st.s, 0, layer, &n), CERTKV_OK);
        EXPECT_EQ(n, keep);
      }
      const std::vector<float> now = read(st.s, 0, 1, 0, 0, keep, 1);
      for (int h = 0; h < kKvHeads; ++h)
        for (int64_t t = 0; t < keep; ++t)
          for (int c = 0; c < kHeadDim; ++c)
            ASSERT_EQ(now[(size_t(h) * keep + t) * kHeadDim + c], exact_k[(size_t(h) * kTokens + t) * kHeadDim + c])
                << kv << " keep " << keep;
    }
    // Appending after a crop continues the sequence: the same rows as appended from the start.
    for (int layer = 0; layer < kLayers; ++layer) append_ragged(st.s, 0, layer, k, v);
    EXPECT_EQ(bits_of(read(st.s, 0, 1, 0, 0, kTokens, 1)), k) << kv;
    if (std::string(kv) != "dither8") {
      EXPECT_EQ(bits_of(read(st.s, 0, 1, 1, 0, kTokens, 0)), v) << kv;
    }
  }
}

TEST(CApiKvStore, ReorderSharesPages) {
  Store st("gaac", 3);
  std::vector<std::vector<uint16_t>> ks;
  for (int seq = 0; seq < 3; ++seq) {
    ks.push_back(rows_bf16(40 + seq, 50 + seq, false));
    for (int layer = 0; layer < kLayers; ++layer)
      ASSERT_EQ(append_range(st.s, seq, layer, ks.back(), ks.back(), 40 + seq, 0, 40 + seq), CERTKV_OK);
  }
  certkv_kv_stats before;
  ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &before), CERTKV_OK);
  const int32_t src[3] = {2, 0, 2};
  ASSERT_EQ(certkv_kv_store_reorder(st.s, src), CERTKV_OK) << certkv_last_error();
  for (int i = 0; i < 3; ++i) {
    int64_t n = 0;
    ASSERT_EQ(certkv_kv_store_length(st.s, i, 1, &n), CERTKV_OK);
    ASSERT_EQ(n, 40 + src[i]);
    EXPECT_EQ(bits_of(read(st.s, i, 1, 0, 0, n, 0)), ks[size_t(src[i])]) << i;
  }
  certkv_kv_stats after;
  ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &after), CERTKV_OK);
  EXPECT_LE(after.pages_in_use, before.pages_in_use);  // the copy of sequence 2 shares its pages
  // Each copy is its own sequence from here on.
  const std::vector<uint16_t> more = rows_bf16(1, 77, false);
  ASSERT_EQ(append_range(st.s, 0, 1, more, more, 1, 0, 1), CERTKV_OK);
  int64_t n0 = 0, n2 = 0;
  ASSERT_EQ(certkv_kv_store_length(st.s, 0, 1, &n0), CERTKV_OK);
  ASSERT_EQ(certkv_kv_store_length(st.s, 2, 1, &n2), CERTKV_OK);
  EXPECT_EQ(n0, 43);
  EXPECT_EQ(n2, 42);
  EXPECT_EQ(bits_of(read(st.s, 2, 1, 0, 0, 42, 0)), ks[2]);
}

// select grows the batch (copies share their pages: one prompt, several samples) and narrows it
// (rows dropped, their pages freed): every new sequence reads, and attends, exactly what its source
// did; later appends go to one copy only; a refused select leaves the store as it was.
TEST(CApiKvStore, SelectGrowsAndNarrowsTheBatch) {
  for (const char* kv : {"gaac", "dither8"}) {
    Store st(kv, 3);
    std::vector<std::vector<uint16_t>> ks;
    for (int seq = 0; seq < 3; ++seq) {
      ks.push_back(rows_bf16(40 + seq, 60 + seq, false));
      for (int layer = 0; layer < kLayers; ++layer)
        ASSERT_EQ(append_range(st.s, seq, layer, ks.back(), ks.back(), 40 + seq, 0, 40 + seq), CERTKV_OK);
    }
    const std::vector<float> q = queries(1, 31);
    std::vector<std::vector<float>> before(3, std::vector<float>(size_t(kHeads) * kHeadDim));
    for (int seq = 0; seq < 3; ++seq)
      ASSERT_EQ(certkv_kv_store_attend(st.s, seq, 1, q.data(), 1, before[size_t(seq)].data(), nullptr), CERTKV_OK);
    certkv_kv_stats three;
    ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &three), CERTKV_OK);

    // Refused: the store is unchanged.
    const int32_t out_of_range[2] = {0, 3};
    EXPECT_EQ(certkv_kv_store_select(st.s, out_of_range, 2), CERTKV_ERR_OUT_OF_RANGE);
    EXPECT_TRUE(error_names("src[1] 3")) << certkv_last_error();
    EXPECT_EQ(certkv_kv_store_select(st.s, out_of_range, 0), CERTKV_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(error_names("n 0")) << certkv_last_error();
    EXPECT_EQ(certkv_kv_store_select(st.s, nullptr, 1), CERTKV_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(certkv_kv_store_select(nullptr, out_of_range, 1), CERTKV_ERR_INVALID_ARGUMENT);
    int64_t n = 0;
    ASSERT_EQ(certkv_kv_store_length(st.s, 2, 1, &n), CERTKV_OK);
    EXPECT_EQ(n, 42);

    // Grown to 5: 2, 2, 0, 1, 2.
    const int32_t grown[5] = {2, 2, 0, 1, 2};
    ASSERT_EQ(certkv_kv_store_select(st.s, grown, 5), CERTKV_OK) << kv << ": " << certkv_last_error();
    for (int i = 0; i < 5; ++i) {
      const int src = grown[i];
      ASSERT_EQ(certkv_kv_store_length(st.s, i, 1, &n), CERTKV_OK);
      ASSERT_EQ(n, 40 + src);
      EXPECT_EQ(bits_of(read(st.s, i, 1, 0, 0, n, 1)), ks[size_t(src)]) << kv << " " << i;
      std::vector<float> out(size_t(kHeads) * kHeadDim);
      ASSERT_EQ(certkv_kv_store_attend(st.s, i, 1, q.data(), 1, out.data(), nullptr), CERTKV_OK);
      EXPECT_EQ(out, before[size_t(src)]) << kv << " " << i;  // bit for bit: the same pages
    }
    EXPECT_EQ(certkv_kv_store_length(st.s, 5, 1, &n), CERTKV_ERR_OUT_OF_RANGE);
    certkv_kv_stats five;
    ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &five), CERTKV_OK);
    EXPECT_EQ(five.pages_in_use, three.pages_in_use) << kv;  // the copies share every page

    // One copy goes on alone.
    const std::vector<uint16_t> more = rows_bf16(1, 99, false);
    ASSERT_EQ(append_range(st.s, 1, 1, more, more, 1, 0, 1), CERTKV_OK);
    ASSERT_EQ(certkv_kv_store_length(st.s, 1, 1, &n), CERTKV_OK);
    EXPECT_EQ(n, 43);
    ASSERT_EQ(certkv_kv_store_length(st.s, 4, 1, &n), CERTKV_OK);
    EXPECT_EQ(n, 42);
    EXPECT_EQ(bits_of(read(st.s, 4, 1, 0, 0, 42, 1)), ks[2]) << kv;

    // Narrowed to one row: what 3 (source 1) was.
    const int32_t one[1] = {3};
    ASSERT_EQ(certkv_kv_store_select(st.s, one, 1), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(certkv_kv_store_length(st.s, 0, 0, &n), CERTKV_OK);
    EXPECT_EQ(n, 41);
    EXPECT_EQ(bits_of(read(st.s, 0, 0, 0, 0, 41, 1)), ks[1]) << kv;
    EXPECT_EQ(certkv_kv_store_length(st.s, 1, 0, &n), CERTKV_ERR_OUT_OF_RANGE);
    certkv_kv_stats narrowed;
    ASSERT_EQ(certkv_kv_store_kv_stats(st.s, &narrowed), CERTKV_OK);
    EXPECT_LT(narrowed.pages_in_use, three.pages_in_use) << kv;  // the others' pages freed
    EXPECT_EQ(narrowed.n_tokens, 41);
  }
}

// The gate: a decode step whose meter passes tau has blocks repaired from the backing store and is
// attended again; what comes back is the attention over the repaired pages, metered soundly, and
// under tau. A sequence that shares the pages (reorder) keeps its own, lossy, tables.
TEST(CApiKvStore, GateRepairsAStepAboveTauAndLeavesOtherSequencesAlone) {
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  constexpr double kTau = 0.02;
  for (const char* kv : {"rtn4", "kivi2", "dither8"}) {
    Store gated(kv, 2, 0, "half-split", kTau), plain(kv, 2, 0, "half-split");
    const int n_prompt = kTokens, n = kTokens + 1;
    const std::vector<uint16_t> k = rows_bf16(n, 31, false), v = rows_bf16(n, 32, false);
    for (certkv_kv_store* s : {gated.s, plain.s}) {
      ASSERT_EQ(append_range(s, 0, 1, k, v, n, 0, n_prompt), CERTKV_OK) << certkv_last_error();
      const int32_t both_are_seq0[2] = {0, 0};
      ASSERT_EQ(certkv_kv_store_reorder(s, both_are_seq0), CERTKV_OK) << certkv_last_error();
      ASSERT_EQ(append_range(s, 0, 1, k, v, n, n_prompt, n), CERTKV_OK) << certkv_last_error();
    }
    const std::vector<float> shared_before = read(gated.s, 1, 1, 0, 0, n_prompt, 0);
    const std::vector<float> q = queries(1, 41);
    std::vector<float> out(size_t(kHeads) * kHeadDim), out_plain(out.size());
    certkv_head_meter meters[kHeads], meters_plain[kHeads];
    ASSERT_EQ(certkv_kv_store_attend(plain.s, 0, 1, q.data(), 1, out_plain.data(), meters_plain), CERTKV_OK);
    double largest_plain = 0;
    for (const certkv_head_meter& m : meters_plain) largest_plain = std::max(largest_plain, m.meter);
    ASSERT_GT(largest_plain, kTau) << kv << ": the step must fire for the test to test the gate";
    ASSERT_EQ(certkv_kv_store_attend(gated.s, 0, 1, q.data(), 1, out.data(), meters), CERTKV_OK) << certkv_last_error();

    certkv_meter_stats ms;
    ASSERT_EQ(certkv_kv_store_meter_stats(gated.s, &ms), CERTKV_OK);
    EXPECT_GT(ms.repairs, 0) << kv;
    EXPECT_GT(ms.pagein_bytes, 0u) << kv;
    EXPECT_EQ(ms.cells, kHeads);
    // The telemetry records the step as it came, before repair: the ungated store's meters.
    EXPECT_NEAR(ms.max, largest_plain, largest_plain * 0.004) << kv;

    // What came back is the attention over the pages as they now are, and its meter bounds the
    // true error and is under tau.
    const std::vector<float> kr = read(gated.s, 0, 1, 0, 0, n, 0), vr = read(gated.s, 0, 1, 1, 0, n, 0);
    const std::vector<float> ke = read(gated.s, 0, 1, 0, 0, n, 1), ve = read(gated.s, 0, 1, 1, 0, n, 1);
    std::vector<std::vector<double>> p_hat, p;
    const std::vector<double> y_hat = softmax_attention(q.data(), kr, vr, n, n, scale, &p_hat);
    softmax_attention(q.data(), ke, ve, n, n, scale, &p);
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(out[i], y_hat[i], 2e-5 * (1 + std::fabs(y_hat[i]))) << kv << " " << i;
    for (int h = 0; h < kHeads; ++h) {
      double tv = 0;
      for (int t = 0; t < n; ++t) tv += 0.5 * std::fabs(p[size_t(h)][size_t(t)] - p_hat[size_t(h)][size_t(t)]);
      EXPECT_GE(meters[h].meter, tv) << kv << " head " << h;
      EXPECT_LE(meters[h].meter, kTau) << kv << " head " << h;
    }
    // Some blocks of sequence 0 now read their exact values; sequence 1, which shared them,
    // still reads its lossy pages.
    const std::vector<float> lossy = read(plain.s, 0, 1, 0, 0, n, 0);
    size_t exact_now = 0;
    for (size_t i = 0; i < kr.size(); ++i) exact_now += kr[i] == ke[i] && lossy[i] != ke[i];
    EXPECT_GT(exact_now, 0u) << kv;
    EXPECT_EQ(read(gated.s, 1, 1, 0, 0, n_prompt, 0), shared_before) << kv;
  }
}


TEST(CApiKvStore, RefusalsNameTheValue) {
  certkv_kv_store* s = nullptr;
  certkv_kv_store_params p = certkv_kv_store_default_params();
  p.n_layers = 2;
  p.n_heads = 6;
  p.n_kv_heads = 2;
  p.head_dim = 64;
  EXPECT_EQ(certkv_kv_store_create(nullptr, &s), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_params bad = p;
  bad.kv = "int3";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("'int3'")) << certkv_last_error();
  EXPECT_TRUE(error_names("dither8")) << certkv_last_error();  // the known schemes are listed
  bad = p;
  bad.n_heads = 5;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("n_heads 5")) << certkv_last_error();
  bad = p;
  bad.n_layers = 0;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("n_layers 0")) << certkv_last_error();
  bad = p;
  bad.kv = "dither8";
  bad.witness = "u8";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("witness u8")) << certkv_last_error();
  bad = p;
  bad.gaac_calibration = "/nonexistent.safetensors";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("not kv bf16")) << certkv_last_error();
  bad = p;
  bad.kv = "gaac";
  bad.gaac_calibration = "/nonexistent.safetensors";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_NOT_FOUND) << certkv_last_error();
  bad = p;
  bad.rope_layout = "neox";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("'neox'")) << certkv_last_error();
  bad = p;
  bad.head_dim = 12;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_UNSUPPORTED) << certkv_last_error();
  bad = p;
  bad.kv = "gaac";
  bad.head_dim = 12;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_UNSUPPORTED) << certkv_last_error();
  bad = p;
  bad.kv = "dither8";
  bad.head_dim = 40;  // lossy pages quantize groups of 32 channels
  EXPECT_NE(certkv_kv_store_create(&bad, &s), CERTKV_OK);
  EXPECT_TRUE(error_names("head_dim")) << certkv_last_error();
  for (const char* lossless : {"bf16", "gaac"}) {
    bad = p;
    bad.kv = lossless;
    bad.gate = 1;
    EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT) << lossless;
    EXPECT_TRUE(error_names((std::string("kv ") + lossless + " is lossless").c_str())) << certkv_last_error();
  }
  EXPECT_EQ(s, nullptr);

  p.max_tokens = 64;
  ASSERT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  std::vector<uint16_t> rows(size_t(2) * 80 * 64, 0x3f80);
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 0, 2, rows.data(), rows.data(), 1), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(error_names("layer 2 outside [0, 2)")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 1, 0, rows.data(), rows.data(), 1), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(error_names("seq 1 outside [0, 1)")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 0, 0, rows.data(), nullptr, 1), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 0, 0, rows.data(), rows.data(), 0), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("n_tokens 0")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_bf16(nullptr, 0, 0, rows.data(), rows.data(), 1), CERTKV_ERR_INVALID_ARGUMENT);
  // Past the capacity: refused, nothing appended.
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 0, 0, rows.data(), rows.data(), 80), CERTKV_ERR_OUT_OF_MEMORY);
  int64_t n = -1;
  ASSERT_EQ(certkv_kv_store_length(s, 0, 0, &n), CERTKV_OK);
  EXPECT_EQ(n, 0);
  ASSERT_EQ(certkv_kv_store_append_bf16(s, 0, 0, rows.data(), rows.data(), 10), CERTKV_OK);
  std::vector<float> out(size_t(2) * 20 * 64);
  EXPECT_EQ(certkv_kv_store_read(s, 0, 0, 0, 0, 11, 0, out.data()), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(error_names("[0, 11) outside the 10 stored")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_read(s, 0, 0, 2, 0, 1, 0, out.data()), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_read(s, 0, 0, 0, 0, 1, 0, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  std::vector<float> q(size_t(11) * 6 * 64, 0.5f), o(q.size());
  EXPECT_EQ(certkv_kv_store_attend(s, 0, 0, q.data(), 11, o.data(), nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("n_queries 11")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_attend(s, 0, 1, q.data(), 1, o.data(), nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_head_meter meters[6];
  EXPECT_EQ(certkv_kv_store_attend(s, 0, 0, q.data(), 2, o.data(), meters), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("decode steps")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_crop(s, 0, 11), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(error_names("n_tokens 11")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_crop(s, 0, 1), CERTKV_ERR_OUT_OF_RANGE);  // layer 1 holds 0
  EXPECT_TRUE(error_names("layer 1")) << certkv_last_error();
  const int32_t src[1] = {1};
  EXPECT_EQ(certkv_kv_store_reorder(s, src), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(certkv_kv_store_reorder(s, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_meter_stats(s, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_kv_stats(nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_free(s);
  certkv_kv_store_free(nullptr);
}

// A store with sparse decode (layer 0 dense, layer 1 sparse; a 32-token window).
certkv_kv_store* sparse_store(const char* kv, double p_sparse, int n_sequences = 1) {
  certkv_kv_store_params p = certkv_kv_store_default_params();
  p.kv = kv;
  p.n_layers = kLayers;
  p.n_heads = kHeads;
  p.n_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.block_tokens = kBlock;
  p.n_sequences = n_sequences;
  p.max_tokens = 4096;
  p.rope_layout = "half-split";
  p.n_threads = 2;
  p.sparse_p = p_sparse;
  p.sparse_window = 32;
  p.sparse_dense_layers = p_sparse != 0 ? 1 : -1;
  certkv_kv_store* s = nullptr;
  EXPECT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  return s;
}

// Sparse decode in the store: at p = 1 every indexed token is selected, so a decode step is
// dense attention summed in another order (and its meter the dense one's); at p = 0.5 fewer tokens
// are attended. Layer 0 stays dense; the indexed prefix is the whole blocks before the window in
// whole batches of the window (600 tokens, window 32: 560). A prefill's queries set the query
// centroid.
TEST(CApiKvStoreSparse, AtPOneIsDenseAndBelowItAttendsLess) {
  constexpr int kN = 600;
  for (const char* kv : {"bf16", "fp8-e4m3"}) {
    SCOPED_TRACE(kv);
    certkv_kv_store *dense = sparse_store(kv, 0), *all = sparse_store(kv, 1.0), *half = sparse_store(kv, 0.5);
    const std::vector<uint16_t> k = rows_bf16(kN, 21, false), v = rows_bf16(kN, 22, false);
    const std::vector<float> q8 = queries(8, 23), q = queries(1, 24);
    for (certkv_kv_store* s : {dense, all, half})
      for (int layer = 0; layer < kLayers; ++layer) {
        for (int at = 0; at < kN;) {  // ragged appends
          const int piece = std::min(kN - at, 37 + 100 * layer);
          ASSERT_EQ(append_range(s, 0, layer, k, v, kN, at, at + piece), CERTKV_OK) << certkv_last_error();
          at += piece;
        }
        std::vector<float> prefill(q8.size());
        ASSERT_EQ(certkv_kv_store_attend(s, 0, layer, q8.data(), 8, prefill.data(), nullptr), CERTKV_OK);
      }
    std::vector<std::vector<float>> out(3, std::vector<float>(size_t(kHeads) * kHeadDim));
    std::vector<std::vector<certkv_head_meter>> meters(3, std::vector<certkv_head_meter>(kHeads));
    certkv_kv_store* stores[3] = {dense, all, half};
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int i = 0; i < 3; ++i)
        ASSERT_EQ(certkv_kv_store_attend(stores[i], 0, layer, q.data(), 1, out[size_t(i)].data(), meters[size_t(i)].data()),
                  CERTKV_OK)
            << certkv_last_error();
      for (size_t j = 0; j < out[0].size(); ++j) {
        if (layer == 0) {  // dense in every store: the same call
          ASSERT_EQ(out[1][j], out[0][j]) << j;
          ASSERT_EQ(out[2][j], out[0][j]) << j;
        } else {
          ASSERT_NEAR(out[1][j], out[0][j], 2e-5 * (1 + std::fabs(out[0][j]))) << j;
          ASSERT_TRUE(std::isfinite(out[2][j])) << j;
        }
      }
      if (std::string(kv) == "fp8-e4m3" && layer == 1) {
        // The p = 1 meter bounds the total variation over every token, as the dense one does; the
        // two paths sum its terms in other orders (over gathered rows, over pages): measured
        // 1.7e-5 apart, relative.
        const double scale = 1.0 / std::sqrt(double(kHeadDim));
        const std::vector<float> kr = read(all, 0, 1, 0, 0, kN, 0), vr = read(all, 0, 1, 1, 0, kN, 0);
        const std::vector<float> ke = read(all, 0, 1, 0, 0, kN, 1), ve = read(all, 0, 1, 1, 0, kN, 1);
        std::vector<std::vector<double>> p_hat, p_exact;
        softmax_attention(q.data(), kr, vr, kN, kN, scale, &p_hat);
        softmax_attention(q.data(), ke, ve, kN, kN, scale, &p_exact);
        for (int h = 0; h < kHeads; ++h) {
          double tv = 0;
          for (int t = 0; t < kN; ++t) tv += 0.5 * std::fabs(p_exact[size_t(h)][size_t(t)] - p_hat[size_t(h)][size_t(t)]);
          EXPECT_GE(meters[1][size_t(h)].meter, tv) << "head " << h;
          EXPECT_NEAR(meters[1][size_t(h)].meter, meters[0][size_t(h)].meter, 1e-4 * meters[0][size_t(h)].meter);
          EXPECT_GT(meters[2][size_t(h)].meter, 0.0);
        }
      }
    }
    certkv_sparse_stats sd, sa, sh;
    ASSERT_EQ(certkv_kv_store_sparse_stats(dense, &sd), CERTKV_OK);
    ASSERT_EQ(certkv_kv_store_sparse_stats(all, &sa), CERTKV_OK);
    ASSERT_EQ(certkv_kv_store_sparse_stats(half, &sh), CERTKV_OK);
    EXPECT_EQ(sd.sparse, 0);
    EXPECT_EQ(sa.sparse, 1);
    EXPECT_EQ(sa.steps, 1);
    EXPECT_EQ(sa.cells, kHeads);
    EXPECT_EQ(sa.mean_budget, 1.0);
    EXPECT_EQ(sa.dense_layers, 1);
    EXPECT_EQ(sa.window_tokens, 32);
    EXPECT_EQ(sa.indexed_tokens, (kN - 32) / 32 * 32);  // 560: whole blocks before the window, in batches of 32
    EXPECT_GT(sa.index_bytes, 0u);
    EXPECT_EQ(sh.cells, kHeads);
    EXPECT_LT(sh.mean_budget, 0.9);
    EXPECT_GT(sh.mean_budget, 32.0 / kN);
    EXPECT_LT(sh.mean_budget_all_layers, 1.0);
    EXPECT_GT(sh.mean_budget_all_layers, sh.mean_budget);  // layer 0's cells count as budget 1
    for (certkv_kv_store* s : stores) certkv_kv_store_free(s);
  }
}

// A sequence's sparse decode after a crop, or after a select copied it, attends what it would
// have attended had it never been cropped or copied, bit for bit: the index keeps its centroids and
// is rebuilt from the kept keys, and what is indexed is a function of the context alone.
TEST(CApiKvStoreSparse, CropAndSelectDecodeAsIfNeverCropped) {
  constexpr int kN = 440;
  const std::vector<uint16_t> k = rows_bf16(kN, 31, false), v = rows_bf16(kN, 32, false);
  const std::vector<uint16_t> k2 = rows_bf16(1, 33, false), v2 = rows_bf16(1, 34, false);  // position 400's row after the crop
  const std::vector<float> q0 = queries(1, 35), q1 = queries(1, 36), q2 = queries(1, 37);
  const int layer = 1;
  // Rows to both layers (a crop keeps a prefix of every layer); the steps run in layer 1.
  auto append_range = [](certkv_kv_store* s, int seq, int, const std::vector<uint16_t>& k,
                         const std::vector<uint16_t>& v, int n, int begin, int end) {
    for (int l = 0; l < kLayers; ++l)
      if (const certkv_status st = ::append_range(s, seq, l, k, v, n, begin, end); st != CERTKV_OK) return st;
    return CERTKV_OK;
  };
  auto step = [&](certkv_kv_store* s, int seq, const std::vector<float>& q) {
    std::vector<float> out(size_t(kHeads) * kHeadDim);
    EXPECT_EQ(certkv_kv_store_attend(s, seq, layer, q.data(), 1, out.data(), nullptr), CERTKV_OK) << certkv_last_error();
    return out;
  };
  // The reference: 400 rows, a step, the new row, a step.
  certkv_kv_store* ref = sparse_store("bf16", 0.5);
  ASSERT_EQ(append_range(ref, 0, layer, k, v, kN, 0, 400), CERTKV_OK);
  step(ref, 0, q0);
  ASSERT_EQ(append_range(ref, 0, layer, k2, v2, 1, 0, 1), CERTKV_OK);
  const std::vector<float> want = step(ref, 0, q2);
  // Cropped: 400 rows, a step, 40 rows more and a step (more records), a crop back to 400.
  certkv_kv_store* cropped = sparse_store("bf16", 0.5);
  ASSERT_EQ(append_range(cropped, 0, layer, k, v, kN, 0, 400), CERTKV_OK);
  step(cropped, 0, q0);
  ASSERT_EQ(append_range(cropped, 0, layer, k, v, kN, 400, kN), CERTKV_OK);
  step(cropped, 0, q1);
  certkv_sparse_stats before;
  ASSERT_EQ(certkv_kv_store_sparse_stats(cropped, &before), CERTKV_OK);
  EXPECT_EQ(before.indexed_tokens, 384);  // 440 - 32 = 408 -> 400 in blocks -> 384 in batches of 32
  ASSERT_EQ(certkv_kv_store_crop(cropped, 0, 400), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(append_range(cropped, 0, layer, k2, v2, 1, 0, 1), CERTKV_OK);
  EXPECT_EQ(step(cropped, 0, q2), want);
  // Copied: 400 rows and a step in sequence 0 of a store of two; select {1, 0, 0}; both copies
  // take the new row and the step.
  certkv_kv_store* copied = sparse_store("bf16", 0.5, 2);
  ASSERT_EQ(append_range(copied, 0, layer, k, v, kN, 0, 400), CERTKV_OK);
  ASSERT_EQ(append_range(copied, 1, layer, k, v, kN, 0, 50), CERTKV_OK);
  step(copied, 0, q0);
  const int32_t src[3] = {1, 0, 0};
  ASSERT_EQ(certkv_kv_store_select(copied, src, 3), CERTKV_OK) << certkv_last_error();
  for (int seq : {1, 2}) {
    ASSERT_EQ(append_range(copied, seq, layer, k2, v2, 1, 0, 1), CERTKV_OK);
    EXPECT_EQ(step(copied, seq, q2), want) << "copy " << seq;
  }
  // Cropped below the indexed prefix, then grown with other rows: the records of the positions
  // cropped away do not survive (they would score the old keys). Against a store that never held
  // them: the same first step (the same centroids), then the other rows.
  const std::vector<uint16_t> kb = rows_bf16(kN, 38, false), vb = rows_bf16(kN, 39, false);
  certkv_kv_store* regrown = sparse_store("bf16", 0.5);
  ASSERT_EQ(append_range(regrown, 0, layer, k, v, kN, 0, 300), CERTKV_OK);
  step(regrown, 0, q0);
  ASSERT_EQ(append_range(regrown, 0, layer, k, v, kN, 300, kN), CERTKV_OK);
  step(regrown, 0, q1);  // records of k's positions up to 384
  ASSERT_EQ(certkv_kv_store_crop(regrown, 0, 300), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(append_range(regrown, 0, layer, kb, vb, kN, 300, kN), CERTKV_OK);
  certkv_kv_store* other = sparse_store("bf16", 0.5);
  ASSERT_EQ(append_range(other, 0, layer, k, v, kN, 0, 300), CERTKV_OK);
  step(other, 0, q0);
  ASSERT_EQ(append_range(other, 0, layer, kb, vb, kN, 300, kN), CERTKV_OK);
  EXPECT_EQ(step(regrown, 0, q2), step(other, 0, q2));
  for (certkv_kv_store* s : {ref, cropped, copied, regrown, other}) certkv_kv_store_free(s);
}

TEST(CApiKvStoreSparse, RefusalsNameTheValue) {
  certkv_kv_store_params p = certkv_kv_store_default_params();
  p.n_layers = kLayers;
  p.n_heads = kHeads;
  p.n_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  certkv_kv_store* s = nullptr;
  auto refused = [&](certkv_kv_store_params bad, certkv_status want, const char* text) {
    EXPECT_EQ(certkv_kv_store_create(&bad, &s), want) << text;
    EXPECT_TRUE(error_names(text)) << certkv_last_error();
    EXPECT_EQ(s, nullptr);
  };
  certkv_kv_store_params bad = p;
  bad.sparse_p = 1.5;
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "sparse_p 1.5");
  bad = p;
  bad.sparse_p = -0.1;
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "sparse_p -0.1");
  bad = p;
  bad.sparse_p = 0.9;
  bad.sparse_dense_layers = 3;
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "sparse_dense_layers 3");
  bad = p;
  bad.sparse_deviations = 1;
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "set sparse_p too");
  bad = p;
  bad.sparse_p = 0.9;
  bad.sparse_window = -2;
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "sparse_window -2");
  bad = p;
  bad.sparse_p = 0.9;
  bad.sparse_rotation = "dct";
  refused(bad, CERTKV_ERR_INVALID_ARGUMENT, "sparse_rotation");
  bad = p;
  bad.sparse_p = 0.9;
  bad.head_dim = 48;
  refused(bad, CERTKV_ERR_UNSUPPORTED, "head_dim 48");
  bad = p;
  bad.sparse_p = 0.9;
  bad.kv = "fp8-e4m3";
  bad.gate = 1;
  refused(bad, CERTKV_ERR_UNSUPPORTED, "the gate and sparse decode");
  bad = p;
  bad.sparse_p = 0.9;
  bad.device = "cuda";
  bad.kv = "fp8-e4m3";  // the device's sparse kernel reads bf16 pages
  refused(bad, CERTKV_ERR_UNSUPPORTED, "sparse decode on device cuda reads bf16 pages, not fp8-e4m3");
  // Too short a context for an index: dense decode, no sparse cell yet.
  p.sparse_p = 0.9;
  ASSERT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  const std::vector<uint16_t> k = rows_bf16(40, 41, false), v = rows_bf16(40, 42, false);
  ASSERT_EQ(append_range(s, 0, 1, k, v, 40, 0, 40), CERTKV_OK);
  const std::vector<float> q = queries(1, 43);
  std::vector<float> out(size_t(kHeads) * kHeadDim);
  ASSERT_EQ(certkv_kv_store_attend(s, 0, 1, q.data(), 1, out.data(), nullptr), CERTKV_OK) << certkv_last_error();
  certkv_sparse_stats st;
  ASSERT_EQ(certkv_kv_store_sparse_stats(s, &st), CERTKV_OK);
  EXPECT_EQ(st.sparse, 1);
  EXPECT_EQ(st.cells, 0);
  EXPECT_EQ(st.mean_budget, 1.0);
  EXPECT_EQ(certkv_kv_store_sparse_stats(nullptr, &st), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_free(s);
}

// The lossy page codecs one page at a time: for every lossy scheme, K and V pages of each head and
// block encode to pages that decode to what a KV store holding the same rows reads back (the same
// bytes and the same reconstruction: dither8 keyed by the store's layer and kv head); a row that
// is not finite is refused (kept exact); any bytes decode without a crash; bad codecs are named.
TEST(CApiLossyPages, PagesAreAStoresPages) {
  constexpr int kN = 40, kLayer = 1;
  const std::vector<uint16_t> k = rows_bf16(kN, 51, false), v = rows_bf16(kN, 52, false);
  for (const char* kv : {"fp8-e4m3", "fp8-e5m2", "fp8-e4m3-scaled", "rtn8", "rtn4", "kivi2", "dither8"}) {
    SCOPED_TRACE(kv);
    certkv_kv_store_params p = certkv_kv_store_default_params();
    p.kv = kv;
    p.n_layers = kLayers;
    p.n_heads = kHeads;
    p.n_kv_heads = kKvHeads;
    p.head_dim = kHeadDim;
    p.rope_layout = "half-split";
    p.recent_window_tokens = 0;
    p.outlier_pairs = 0;
    certkv_kv_store* s = nullptr;
    ASSERT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
    ASSERT_EQ(append_range(s, 0, kLayer, k, v, kN, 0, kN), CERTKV_OK) << certkv_last_error();
    for (int kvt = 0; kvt < 2; ++kvt) {
      const std::vector<uint16_t>& rows = kvt == 0 ? k : v;
      const std::vector<float> stored = read(s, 0, kLayer, kvt, 0, 2 * kBlock, 0);
      certkv_lossy_page_codec c{};
      c.kv = kv;
      c.key = kvt == 0 ? 1 : 0;
      c.block_tokens = kBlock;
      c.head_dim = kHeadDim;
      c.rope_layout = "half-split";
      c.layer = kLayer;
      size_t bytes = 0;
      ASSERT_EQ(certkv_lossy_page_bytes(&c, &bytes), CERTKV_OK) << certkv_last_error();
      EXPECT_GT(bytes, 0u);
      EXPECT_LT(bytes, size_t(kBlock) * kHeadDim * 2);
      for (int h = 0; h < kKvHeads; ++h)
        for (uint32_t b = 0; b < 2; ++b) {
          c.kv_head = h;
          const uint16_t* page_rows = &rows[(size_t(h) * kN + b * kBlock) * kHeadDim];
          std::vector<uint8_t> page(bytes);
          int encoded = -1;
          ASSERT_EQ(certkv_lossy_encode_page(&c, b, page_rows, page.data(), &encoded), CERTKV_OK) << certkv_last_error();
          ASSERT_EQ(encoded, 1);
          std::vector<float> out(size_t(kBlock) * kHeadDim);
          ASSERT_EQ(certkv_lossy_decode_page(&c, b, page.data(), out.data()), CERTKV_OK) << certkv_last_error();
          const float* want = &stored[(size_t(h) * 2 * kBlock + b * kBlock) * kHeadDim];
          EXPECT_EQ(std::memcmp(out.data(), want, out.size() * sizeof(float)), 0) << "kv " << kvt << " head " << h << " block " << b;
          // Not the exact rows: the page is lossy.
          bool differs = false;
          for (size_t i = 0; i < out.size(); ++i) differs |= out[i] != from_bf16(page_rows[i]);
          EXPECT_TRUE(differs);
          // A row with a value that is not finite is refused.
          std::vector<uint16_t> bad(page_rows, page_rows + out.size());
          bad[size_t(3) * kHeadDim + 5] = 0x7fc0;  // NaN
          ASSERT_EQ(certkv_lossy_encode_page(&c, b, bad.data(), page.data(), &encoded), CERTKV_OK);
          EXPECT_EQ(encoded, 0);
          // Any bytes decode.
          std::mt19937 rng(b * 7 + uint32_t(h));
          for (uint8_t& x : page) x = uint8_t(rng());
          EXPECT_EQ(certkv_lossy_decode_page(&c, b, page.data(), out.data()), CERTKV_OK) << certkv_last_error();
        }
    }
    certkv_kv_store_free(s);
  }
  certkv_lossy_page_codec c{};
  c.kv = "fp8-e4m3";
  c.key = 1;
  c.block_tokens = kBlock;
  c.head_dim = kHeadDim;
  size_t bytes = 0;
  certkv_lossy_page_codec bad = c;
  bad.kv = "gaac";
  EXPECT_EQ(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("gaac is not a lossy scheme")) << certkv_last_error();
  bad = c;
  bad.kv = "fp9";
  EXPECT_EQ(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_ERR_INVALID_ARGUMENT);
  bad = c;
  bad.head_dim = 48;
  EXPECT_NE(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_OK);
  EXPECT_TRUE(error_names("head_dim")) << certkv_last_error();
  bad = c;
  bad.kv = "dither8";
  bad.witness = "u8";
  EXPECT_NE(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_OK);
  EXPECT_TRUE(error_names("witness")) << certkv_last_error();
  const uint16_t pairs[2] = {1, 5};
  bad = c;
  bad.kv = "dither8";
  bad.key = 0;
  bad.n_outlier_pairs = 2;
  bad.outlier_pairs = pairs;
  EXPECT_NE(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_OK);
  bad = c;
  bad.rope_layout = "sideways";
  EXPECT_EQ(certkv_lossy_page_bytes(&bad, &bytes), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("rope_layout 'sideways'")) << certkv_last_error();
  EXPECT_EQ(certkv_lossy_page_bytes(nullptr, &bytes), CERTKV_ERR_INVALID_ARGUMENT);
}

// The device choice is checked in every build: an unknown device, a scheme the table does not
// serve on cuda (naming both) and a recent window are refused before any device is asked for; a
// cpu store refuses the device functions. In a build without CUDA, or with no device (CI), a cuda
// store is refused saying so; where one is made, the host-row functions refuse it and the
// sequence functions serve it (tests/api_kv_store_device_test.cc runs it on a device).
TEST(CApiKvStore, DeviceChoiceIsChecked) {
  certkv_kv_store* s = nullptr;
  certkv_kv_store_params p = certkv_kv_store_default_params();
  p.n_layers = 2;
  p.n_heads = 6;
  p.n_kv_heads = 2;
  p.head_dim = 64;
  certkv_kv_store_params bad = p;
  bad.device = "gpu";
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device 'gpu'")) << certkv_last_error();
  for (const char* kv : {"kivi2", "rtn4", "fp8-e4m3-scaled"}) {
    bad = p;
    bad.kv = kv;
    bad.device = "cuda";
    EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_UNSUPPORTED) << kv;
    EXPECT_TRUE(error_names((std::string("kv ") + kv + " is not served on device cuda").c_str())) << certkv_last_error();
    EXPECT_TRUE(error_names("dither8")) << certkv_last_error();  // the schemes that are
  }
  bad = p;
  bad.kv = "fp8-e4m3";
  bad.device = "cuda";
  bad.gate = 1;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_UNSUPPORTED);
  EXPECT_TRUE(error_names("the gate is not served on device cuda")) << certkv_last_error();
  bad = p;
  bad.kv = "fp8-e4m3";
  bad.device = "cuda";
  bad.recent_window_tokens = 32;
  EXPECT_EQ(certkv_kv_store_create(&bad, &s), CERTKV_ERR_UNSUPPORTED);
  EXPECT_TRUE(error_names("recent window")) << certkv_last_error();
  EXPECT_EQ(s, nullptr);

  // A cpu store refuses the device functions, naming its device.
  ASSERT_EQ(certkv_kv_store_create(&p, &s), CERTKV_OK) << certkv_last_error();
  const int32_t seqs[1] = {0};
  const int64_t n[1] = {1};
  std::vector<float> rows(size_t(2) * 64 * 6, 1.f);
  EXPECT_EQ(certkv_kv_store_append_device(s, 0, seqs, n, 1, rows.data(), rows.data()), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_attend_device(s, 0, seqs, 1, rows.data(), rows.data(), nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_note_queries_device(s, 0, seqs, n, 1, rows.data()), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_plan_device(s, seqs, 1, 4, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("certkv_kv_store_plan_device: the store's device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_append_planned_device(s, 0, rows.data(), rows.data(), nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_attend_planned_device(s, 0, rows.data(), rows.data(), nullptr, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_finish_planned_device(s, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("device is cpu")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_finish_planned_device(nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  int32_t open = -1;
  EXPECT_EQ(certkv_kv_store_planned_device(s, &open), CERTKV_OK);
  EXPECT_EQ(open, 0);  // a cpu store never holds a plan
  EXPECT_EQ(certkv_kv_store_planned_device(s, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_kv_store_planned_device(nullptr, &open), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_kv_store_free(s);
  s = nullptr;

  certkv_kv_store_params cuda = p;
  cuda.device = "cuda";
  const certkv_status st = certkv_kv_store_create(&cuda, &s);
  if (st != CERTKV_OK) {
    EXPECT_EQ(st, CERTKV_ERR_UNSUPPORTED);
    EXPECT_TRUE(error_names("no CUDA")) << certkv_last_error();  // no backend, or no device
    EXPECT_EQ(s, nullptr);
    return;
  }
  std::vector<uint16_t> bits(size_t(2) * 64, 0x3f80);
  EXPECT_EQ(certkv_kv_store_append_bf16(s, 0, 0, bits.data(), bits.data(), 1), CERTKV_ERR_UNSUPPORTED);
  EXPECT_TRUE(error_names("on device cuda")) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_attend(s, 0, 0, rows.data(), 1, rows.data(), nullptr), CERTKV_ERR_UNSUPPORTED);
  // Crop, reorder, select and read serve it (tests/api_kv_store_device_test.cc compares them with
  // a cpu store's); here on an empty store.
  EXPECT_EQ(certkv_kv_store_crop(s, 0, 0), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_crop(s, 0, 1), CERTKV_ERR_OUT_OF_RANGE);
  EXPECT_EQ(certkv_kv_store_reorder(s, seqs), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_select(s, seqs, 1), CERTKV_OK) << certkv_last_error();
  std::vector<float> out(64);
  EXPECT_EQ(certkv_kv_store_read(s, 0, 0, 0, 0, 0, 0, out.data()), CERTKV_OK) << certkv_last_error();
  EXPECT_EQ(certkv_kv_store_read(s, 0, 0, 0, 0, 1, 0, out.data()), CERTKV_ERR_OUT_OF_RANGE);
  certkv_kv_store_free(s);
}

}  // namespace
