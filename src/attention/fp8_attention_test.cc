// Attention over FP8 caches: raw FP8 pages (fp8-e4m3, fp8-e5m2) give the outputs of a bf16 cache
// holding the FP8-rounded K/V, and GAAC-coded FP8 pages (gaac-e4m3, gaac-e5m2) give the outputs
// of the raw FP8 cache bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/thread_pool.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::attention {
namespace {

using cache::KvScheme;
using cache::KvTensor;
using format::GaacElement;
using format::StorageClass;
using testing::CaseShape;

constexpr int kLayers = 2;
constexpr int kLayer = 1;

// K/V rows with a per-channel scale 2^((c * 5 + h) % 9 - 4); every 11th block of a table is an
// outlier block scaled by 2^[-6, 6] per element (so that some blocks overflow their slot).
std::vector<float> kv_rows(const CaseShape& c, int layer, int kv, int64_t pos0, int64_t n,
                           std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> wild(-6, 6);
  std::vector<float> x(size_t(n) * size_t(c.n_kv_heads) * size_t(c.head_dim));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = (pos0 + i) / c.block_tokens;
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const bool outlier = (block * 3 + h + kv + layer) % 11 == 5;
      for (int ch = 0; ch < c.head_dim; ++ch) {
        float scale = std::ldexp(1.f, (ch * 5 + h) % 9 - 4);
        if (outlier) scale = std::ldexp(scale, wild(rng));
        x[(size_t(i) * size_t(c.n_kv_heads) + size_t(h)) * size_t(c.head_dim) + size_t(ch)] =
            scale * normal(rng);
      }
    }
  }
  return x;
}

float fp8_rounded(GaacElement e, float x) {
  const uint16_t h = format::float_to_bf16(x);
  return e == GaacElement::kFp8E4M3 ? format::fp8_e4m3_to_float(format::bf16_to_fp8_e4m3_ref(h))
                                    : format::fp8_e5m2_to_float(format::bf16_to_fp8_e5m2_ref(h));
}

std::shared_ptr<const codec::GaacCalibration> calibrate(const CaseShape& c, GaacElement e) {
  codec::GaacShape shape{kLayers, c.n_kv_heads, c.head_dim, c.block_tokens, e};
  codec::GaacCalibrator calibrator(shape);
  std::mt19937 rng(99);
  constexpr int kTokens = 640;
  std::vector<uint8_t> head_rows(size_t(kTokens) * size_t(c.head_dim));
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<float> x = kv_rows(c, layer, kv, 0, kTokens, rng);
      for (int h = 0; h < c.n_kv_heads; ++h) {
        for (int t = 0; t < kTokens; ++t) {
          for (int ch = 0; ch < c.head_dim; ++ch) {
            const uint16_t b = format::float_to_bf16(
                x[(size_t(t) * size_t(c.n_kv_heads) + size_t(h)) * size_t(c.head_dim) + size_t(ch)]);
            head_rows[size_t(t) * size_t(c.head_dim) + size_t(ch)] =
                e == GaacElement::kFp8E4M3 ? format::bf16_to_fp8_e4m3_ref(b)
                                           : format::bf16_to_fp8_e5m2_ref(b);
          }
        }
        calibrator.add_fp8(layer, kv, h, head_rows.data(), kTokens);
      }
    }
  }
  return std::make_shared<const codec::GaacCalibration>(calibrator.finish());
}

// Three caches fed the same tokens: `want` (bf16, fed the FP8-rounded values), `raw` (fp8-*) and
// `coded` (gaac-*).
struct Caches {
  std::unique_ptr<cache::KvCache> want, raw, coded;
  cache::SeqId want_seq = 0, raw_seq = 0, coded_seq = 0;
};

Caches make_caches(const CaseShape& c, GaacElement e, int64_t max_tokens) {
  cache::KvCacheConfig cfg;
  cfg.n_layers = kLayers;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  Caches p;
  p.want = std::make_unique<cache::KvCache>(cfg);
  const bool e4m3 = e == GaacElement::kFp8E4M3;
  cfg.scheme = e4m3 ? KvScheme::kFp8PagesE4M3 : KvScheme::kFp8PagesE5M2;
  p.raw = std::make_unique<cache::KvCache>(cfg);
  cfg.scheme = e4m3 ? KvScheme::kGaacE4M3 : KvScheme::kGaacE5M2;
  cfg.gaac_calibration = calibrate(c, e);
  p.coded = std::make_unique<cache::KvCache>(cfg);
  p.want_seq = p.want->create_sequence();
  p.raw_seq = p.raw->create_sequence();
  p.coded_seq = p.coded->create_sequence();
  return p;
}

// Appends n tokens to the three caches in ragged steps; with `last_uncommitted` the final step
// is written but not committed.
void append_all(Caches& p, const CaseShape& c, GaacElement e, int64_t n, std::mt19937& rng,
                bool last_uncommitted = false) {
  static constexpr int64_t kSteps[] = {5, 1, 13, 64, 2, 300};
  for (int64_t done = 0, step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 6], n - done);
    const int64_t pos0 = p.want->length(p.want_seq);
    p.want->reserve(p.want_seq, m);
    p.raw->reserve(p.raw_seq, m);
    p.coded->reserve(p.coded_seq, m);
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> k = kv_rows(c, layer, 0, pos0, m, rng);
      const std::vector<float> v = kv_rows(c, layer, 1, pos0, m, rng);
      std::vector<float> k8(k.size()), v8(v.size());
      for (size_t i = 0; i < k.size(); ++i) k8[i] = fp8_rounded(e, k[i]);
      for (size_t i = 0; i < v.size(); ++i) v8[i] = fp8_rounded(e, v[i]);
      p.want->write(p.want_seq, layer, k8.data(), v8.data(), m);
      p.raw->write(p.raw_seq, layer, k.data(), v.data(), m);
      p.coded->write(p.coded_seq, layer, k.data(), v.data(), m);
    }
    done += m;
    if (last_uncommitted && done == n) break;
    p.want->commit(p.want_seq, m);
    p.raw->commit(p.raw_seq, m);
    p.coded->commit(p.coded_seq, m);
  }
}

struct ClassMix {
  int64_t slots = 0, raw_complete = 0;
};

ClassMix class_mix(const cache::KvCache& cache, cache::SeqId seq, int64_t n_ctx) {
  ClassMix mix;
  for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
    for (int h = 0; h < cache.config().n_kv_heads; ++h) {
      const format::PageRef* table = cache.block_table(seq, kLayer, kv, h);
      for (int64_t b = 0; b < n_ctx / cache.block_tokens(); ++b) {
        if (table[b].storage == StorageClass::kGaacFp8) {
          ++mix.slots;
        } else {
          EXPECT_EQ(table[b].storage, StorageClass::kFp8);
          ++mix.raw_complete;
        }
      }
    }
  }
  return mix;
}

template <typename T>
void expect_bitwise_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << what << ": element " << i << " differs: " << got[i] << " vs " << want[i];
  }
}

struct Fp8Case {
  CaseShape shape;
  GaacElement element;
  const char* name;
};

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

class Fp8Attention : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8Attention, DecodeEqualsRoundedReferenceAndGaacEqualsRaw) {
  const CaseShape c = GetParam().shape;
  const GaacElement e = GetParam().element;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  std::mt19937 rng(31 + c.head_dim);
  ClassMix total;
  for (int64_t n : {1, 3, 17, 129, 501, 1771}) {
    SCOPED_TRACE("n_ctx " + std::to_string(n));
    Caches p = make_caches(c, e, n);
    append_all(p, c, e, n, rng);
    const ClassMix mix = class_mix(*p.coded, p.coded_seq, n);
    total.slots += mix.slots;
    total.raw_complete += mix.raw_complete;
    EXPECT_EQ(p.raw->block_table(p.raw_seq, kLayer, KvTensor::kKey, 0)[0].storage, StorageClass::kFp8);
    const std::vector<float> q = testing::uniform_values(size_t(c.n_q_heads) * c.head_dim, -2, 2, rng);

    std::vector<double> ref_want(q.size()), ref_raw(q.size()), ref_coded(q.size());
    decode_attention_ref(*p.want, p.want_seq, kLayer, shape, q.data(), n, ref_want.data());
    decode_attention_ref(*p.raw, p.raw_seq, kLayer, shape, q.data(), n, ref_raw.data());
    decode_attention_ref(*p.coded, p.coded_seq, kLayer, shape, q.data(), n, ref_coded.data());
    testing::expect_nondegenerate(ref_want, "reference output");
    expect_bitwise_equal(ref_raw, ref_want, "decode_attention_ref fp8 vs rounded bf16");
    expect_bitwise_equal(ref_coded, ref_raw, "decode_attention_ref gaac-fp8 vs fp8");

    for (int splits : {0, 3}) {
      SCOPED_TRACE("n_splits " + std::to_string(splits));
      DecodeOptions options;
      options.n_splits = splits;
      for (ThreadPool* tp : {static_cast<ThreadPool*>(nullptr), &pool}) {
        std::vector<float> want(q.size()), raw(q.size()), coded(q.size());
        decode_attention(*p.want, p.want_seq, kLayer, shape, q.data(), n, want.data(), tp, options);
        decode_attention(*p.raw, p.raw_seq, kLayer, shape, q.data(), n, raw.data(), tp, options);
        decode_attention(*p.coded, p.coded_seq, kLayer, shape, q.data(), n, coded.data(), tp, options);
        expect_bitwise_equal(raw, want, "decode_attention fp8 vs rounded bf16");
        expect_bitwise_equal(coded, raw, "decode_attention gaac-fp8 vs fp8");
      }
    }
  }
  EXPECT_GT(total.slots, 0);
  EXPECT_GT(total.raw_complete, 0);
}

TEST_P(Fp8Attention, PrefillGaacEqualsRawBitForBit) {
  const CaseShape c = GetParam().shape;
  const GaacElement e = GetParam().element;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  std::mt19937 rng(5 + c.block_tokens);
  for (int64_t n : {1, 17, 501}) {
    SCOPED_TRACE("n_ctx " + std::to_string(n));
    Caches p = make_caches(c, e, n);
    append_all(p, c, e, n, rng, /*last_uncommitted=*/true);
    const int64_t last = p.raw->written_tokens(p.raw_seq, kLayer) - p.raw->length(p.raw_seq);
    for (int64_t n_q : {last, n}) {
      const int64_t pos0 = n - n_q;
      const std::vector<float> q = testing::uniform_values(size_t(n_q) * c.n_q_heads * c.head_dim, -2, 2, rng);
      std::vector<float> want(q.size()), raw(q.size()), coded(q.size());
      prefill_attention(*p.want, p.want_seq, kLayer, shape, q.data(), pos0, n_q, want.data());
      prefill_attention(*p.raw, p.raw_seq, kLayer, shape, q.data(), pos0, n_q, raw.data());
      prefill_attention(*p.coded, p.coded_seq, kLayer, shape, q.data(), pos0, n_q, coded.data(), &pool);
      testing::expect_nondegenerate(want, "prefill output");
      expect_bitwise_equal(raw, want, "prefill_attention fp8 vs rounded bf16");
      expect_bitwise_equal(coded, raw, "prefill_attention gaac-fp8 vs fp8");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8Attention,
    ::testing::Values(Fp8Case{{9, 3, 64, 16}, GaacElement::kFp8E5M2, "e5m2_gqa3_d64_b16"},
                      Fp8Case{{9, 3, 64, 16}, GaacElement::kFp8E4M3, "e4m3_gqa3_d64_b16"},
                      Fp8Case{{7, 1, 128, 7}, GaacElement::kFp8E5M2, "e5m2_d128_b7"},
                      Fp8Case{{4, 2, 256, 16}, GaacElement::kFp8E4M3, "e4m3_two_tiles_d256_b16"},
                      Fp8Case{{3, 3, 8, 1}, GaacElement::kFp8E5M2, "e5m2_d8_b1"}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace certkv::attention
