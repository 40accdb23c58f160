// Attention over a gaac-scheme cache: GAAC slots, raw fallback pages and the raw tail feed one
// softmax, and the float outputs are bit for bit those of the same tokens in a bf16 cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/thread_pool.h"
#include "format/numeric.h"

namespace certkv::attention {
namespace {

using cache::KvTensor;
using format::StorageClass;
using testing::CaseShape;

constexpr int kLayers = 2;
constexpr int kLayer = 1;

// K/V rows shaped like real ones: channel c of head h has its own scale 2^((c * 5 + h) % 9 - 4),
// values normal around it; every 11th block of a table is an outlier block whose elements are
// scaled by 2^[-12, 12] (raw groups, so it usually overflows its slot).
class KvGenerator {
 public:
  KvGenerator(const CaseShape& c, uint32_t seed) : c_(c), rng_(seed) {}

  // [n][n_kv_heads][head_dim] for positions [pos0, pos0 + n).
  std::vector<float> rows(int layer, int kv, int64_t pos0, int64_t n) {
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_int_distribution<int> wild(-12, 12);
    std::vector<float> x(size_t(n) * size_t(c_.n_kv_heads) * size_t(c_.head_dim));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t block = (pos0 + i) / c_.block_tokens;
      for (int h = 0; h < c_.n_kv_heads; ++h) {
        const bool outlier = (block * 3 + h + kv + layer) % 11 == 5;
        for (int ch = 0; ch < c_.head_dim; ++ch) {
          float scale = std::ldexp(1.f, (ch * 5 + h) % 9 - 4);
          if (outlier) scale = std::ldexp(scale, wild(rng_));
          x[(size_t(i) * size_t(c_.n_kv_heads) + size_t(h)) * size_t(c_.head_dim) + size_t(ch)] =
              scale * normal(rng_);
        }
      }
    }
    return x;
  }

 private:
  CaseShape c_;
  std::mt19937 rng_;
};

// A calibration from the codec's calibrator over 640 tokens of other data of the same kind.
std::shared_ptr<const codec::GaacCalibration> calibrate(const CaseShape& c) {
  codec::GaacShape shape;
  shape.n_layers = kLayers;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.block_tokens = c.block_tokens;
  codec::GaacCalibrator calibrator(shape);
  KvGenerator gen(c, 99);
  constexpr int kTokens = 640;
  std::vector<uint16_t> head_rows(size_t(kTokens) * size_t(c.head_dim));
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<float> x = gen.rows(layer, kv, 0, kTokens);
      for (int h = 0; h < c.n_kv_heads; ++h) {
        for (int t = 0; t < kTokens; ++t) {
          for (int ch = 0; ch < c.head_dim; ++ch) {
            head_rows[size_t(t) * size_t(c.head_dim) + size_t(ch)] = format::float_to_bf16(
                x[(size_t(t) * size_t(c.n_kv_heads) + size_t(h)) * size_t(c.head_dim) + size_t(ch)]);
          }
        }
        calibrator.add_bf16(layer, kv, h, head_rows.data(), kTokens);
      }
    }
  }
  return std::make_shared<const codec::GaacCalibration>(calibrator.finish());
}

struct CachePair {
  std::unique_ptr<cache::KvCache> bf16, gaac;
  cache::SeqId bf16_seq = 0, gaac_seq = 0;
};

CachePair make_pair(const CaseShape& c, int64_t max_tokens) {
  cache::KvCacheConfig cfg;
  cfg.n_layers = kLayers;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  CachePair p;
  p.bf16 = std::make_unique<cache::KvCache>(cfg);
  cfg.scheme = cache::KvScheme::kGaac;
  cfg.gaac_calibration = calibrate(c);
  p.gaac = std::make_unique<cache::KvCache>(cfg);
  p.bf16_seq = p.bf16->create_sequence();
  p.gaac_seq = p.gaac->create_sequence();
  return p;
}

// Appends n tokens to both caches in ragged steps (so that steps end inside blocks). With
// `last_uncommitted`, the final step is written but not committed: attention then reads rows
// written in the current step, as it does in a forward pass.
void append_both(CachePair& p, int64_t n, KvGenerator& gen, bool last_uncommitted = false) {
  static constexpr int64_t kSteps[] = {5, 1, 13, 64, 2, 300};
  for (int64_t done = 0, step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 6], n - done);
    const int64_t pos0 = p.bf16->length(p.bf16_seq);
    p.bf16->reserve(p.bf16_seq, m);
    p.gaac->reserve(p.gaac_seq, m);
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> k = gen.rows(layer, 0, pos0, m);
      const std::vector<float> v = gen.rows(layer, 1, pos0, m);
      p.bf16->write(p.bf16_seq, layer, k.data(), v.data(), m);
      p.gaac->write(p.gaac_seq, layer, k.data(), v.data(), m);
    }
    done += m;
    if (last_uncommitted && done == n) break;
    p.bf16->commit(p.bf16_seq, m);
    p.gaac->commit(p.gaac_seq, m);
  }
}

struct ClassMix {
  int64_t slots = 0, raw_complete = 0;
};

ClassMix class_mix(const cache::KvCache& cache, cache::SeqId seq, int64_t n_ctx) {
  ClassMix mix;
  const int64_t complete = n_ctx / cache.block_tokens();
  for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
    for (int h = 0; h < cache.config().n_kv_heads; ++h) {
      const format::PageRef* table = cache.block_table(seq, kLayer, kv, h);
      for (int64_t b = 0; b < complete; ++b) {
        (table[b].storage == StorageClass::kGaac ? mix.slots : mix.raw_complete) += 1;
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

struct GaacCase {
  CaseShape shape;
  const char* name;
};

void PrintTo(const GaacCase& c, std::ostream* os) { *os << c.name; }

class GaacAttention : public ::testing::TestWithParam<GaacCase> {};

TEST_P(GaacAttention, DecodeEqualsBf16BitForBit) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  std::mt19937 rng(77 + c.head_dim);
  ClassMix total;
  for (int64_t n : {1, 3, 17, 129, 501, 3771}) {
    SCOPED_TRACE("n_ctx " + std::to_string(n));
    CachePair p = make_pair(c, n);
    KvGenerator gen(c, uint32_t(n));
    append_both(p, n, gen);
    const ClassMix mix = class_mix(*p.gaac, p.gaac_seq, n);
    total.slots += mix.slots;
    total.raw_complete += mix.raw_complete;
    const std::vector<float> q = testing::uniform_values(size_t(c.n_q_heads) * c.head_dim, -2, 2, rng);

    std::vector<double> ref_bf16(q.size()), ref_gaac(q.size());
    decode_attention_ref(*p.bf16, p.bf16_seq, kLayer, shape, q.data(), n, ref_bf16.data());
    decode_attention_ref(*p.gaac, p.gaac_seq, kLayer, shape, q.data(), n, ref_gaac.data());
    testing::expect_nondegenerate(ref_bf16, "reference output");
    expect_bitwise_equal(ref_gaac, ref_bf16, "decode_attention_ref");

    for (int splits : {0, 1, 3}) {
      SCOPED_TRACE("n_splits " + std::to_string(splits));
      DecodeOptions options;
      options.n_splits = splits;
      for (ThreadPool* tp : {static_cast<ThreadPool*>(nullptr), &pool}) {
        std::vector<float> want(q.size()), got(q.size());
        decode_attention(*p.bf16, p.bf16_seq, kLayer, shape, q.data(), n, want.data(), tp, options);
        decode_attention(*p.gaac, p.gaac_seq, kLayer, shape, q.data(), n, got.data(), tp, options);
        expect_bitwise_equal(got, want, "decode_attention");
        double ref_max = 0;
        for (double e : ref_gaac) ref_max = std::max(ref_max, std::fabs(e));
        EXPECT_LT(testing::max_abs_diff(got, ref_gaac), 1e-5 * ref_max);
      }
    }
  }
  // The comparison covered slots and raw fallbacks (and, for ragged n, the raw tail).
  EXPECT_GT(total.slots, 0);
  EXPECT_GT(total.raw_complete, 0);
}

TEST_P(GaacAttention, PrefillEqualsBf16BitForBit) {
  const CaseShape c = GetParam().shape;
  const AttentionShape shape = testing::attention_shape(c);
  ThreadPool pool(2);
  std::mt19937 rng(5 + c.block_tokens);
  for (int64_t n : {1, 17, 501}) {
    SCOPED_TRACE("n_ctx " + std::to_string(n));
    CachePair p = make_pair(c, n);
    KvGenerator gen(c, uint32_t(3 * n));
    append_both(p, n, gen, /*last_uncommitted=*/true);
    // The queries of the last step (uncommitted, as in a forward pass), and of the whole prompt.
    const int64_t last = p.bf16->written_tokens(p.bf16_seq, kLayer) - p.bf16->length(p.bf16_seq);
    for (int64_t n_q : {last, n}) {
      const int64_t pos0 = n - n_q;
      const std::vector<float> q = testing::uniform_values(size_t(n_q) * c.n_q_heads * c.head_dim, -2, 2, rng);
      std::vector<float> want(q.size()), got(q.size()), got_pool(q.size());
      prefill_attention(*p.bf16, p.bf16_seq, kLayer, shape, q.data(), pos0, n_q, want.data());
      prefill_attention(*p.gaac, p.gaac_seq, kLayer, shape, q.data(), pos0, n_q, got.data());
      prefill_attention(*p.gaac, p.gaac_seq, kLayer, shape, q.data(), pos0, n_q, got_pool.data(), &pool);
      testing::expect_nondegenerate(want, "prefill output");
      expect_bitwise_equal(got, want, "prefill_attention");
      expect_bitwise_equal(got_pool, want, "prefill_attention on the pool");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GaacAttention,
    ::testing::Values(GaacCase{{1, 1, 64, 16}, "mha_d64_b16"},
                      GaacCase{{9, 3, 64, 16}, "smollm2_gqa3_d64_b16"},
                      GaacCase{{7, 1, 128, 7}, "gqa7_d128_b7"},
                      GaacCase{{4, 2, 256, 16}, "two_tiles_d256_b16"},
                      GaacCase{{3, 3, 8, 1}, "d8_b1"}),
    [](const ::testing::TestParamInfo<GaacCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace certkv::attention
