// The meter in decode attention: the production float path against the double reference,
// soundness against the true total variation per (head, step), split merging, exact caches,
// and bad options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "attention/online_softmax.h"
#include "attention/page_meter.h"
#include "attention/page_rows.h"
#include "cache/kv_cache.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace certkv::attention {
namespace {

using cache::KvScheme;
using testing::CaseShape;

constexpr KvScheme kLossySchemes[] = {KvScheme::kFp8E4M3, KvScheme::kFp8E5M2,
                                      KvScheme::kFp8E4M3Scaled, KvScheme::kRtn8,
                                      KvScheme::kRtn4, KvScheme::kKivi2, KvScheme::kDither8};

std::unique_ptr<cache::KvCache> lossy_cache(const CaseShape& c, KvScheme scheme, int64_t max_tokens,
                                            codec::WitnessCode witness = codec::WitnessCode::kFp16) {
  cache::KvCacheConfig cfg;
  cfg.witness = witness;
  cfg.n_layers = 2;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  cfg.scheme = scheme;
  cfg.rope_pairing = codec::RopePairing::kInterleaved;
  cfg.recent_window_tokens = scheme == KvScheme::kKivi2 ? 32 : -1;
  return std::make_unique<cache::KvCache>(cfg);
}

// Keys with a few large channels; values normal.
void append(cache::KvCache& cache, cache::SeqId seq, int64_t n, std::mt19937& rng) {
  const int d = cache.config().head_dim;
  std::normal_distribution<float> normal(0.f, 1.f);
  testing::append_in_ragged_steps(cache, seq, n, [&](float* k, float* v) {
    for (int c = 0; c < d; ++c) {
      k[c] = normal(rng) * (c == 5 || c == 6 ? 12.f : 1.5f);
      v[c] = normal(rng);
    }
  });
}

std::vector<float> queries(const CaseShape& c, float gain, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, gain);
  std::vector<float> q(size_t(c.n_q_heads) * size_t(c.head_dim));
  for (float& x : q) x = normal(rng);
  return q;
}

struct MeterCase {
  KvScheme scheme;
  CaseShape shape;
};

class DecodeMeterTest : public ::testing::TestWithParam<KvScheme> {};

TEST_P(DecodeMeterTest, FloatPathMatchesTheReferenceAndBoundsTheTrueTv) {
  const KvScheme scheme = GetParam();
  ThreadPool pool(2);
  std::mt19937 rng(101);
  int checked = 0, informative = 0;
  // Tier A schemes with each witness code they take (the float path and the reference read the
  // same bounds; the exponent witness's page-rows kernel makes them from the codes).
  for (int code = 0; code < (scheme == KvScheme::kDither8 ? 1 : codec::kNumWitnessCodes); ++code)
  if (code == 0 || cache::kv_scheme_takes_witness(scheme, codec::WitnessCode(code)))
  for (const CaseShape shape : {CaseShape{3, 3, 64, 16}, CaseShape{9, 3, 64, 16},
                                CaseShape{7, 1, 128, 16}, CaseShape{4, 2, 32, 16}}) {
    for (const int64_t n_ctx : {1, 17, 129, 501}) {
      auto cache = lossy_cache(shape, scheme, 1024, codec::WitnessCode(code));
      const cache::SeqId seq = cache->create_sequence();
      append(*cache, seq, n_ctx, rng);
      for (const float gain : {0.3f, 2.f}) {
        const std::vector<float> q = queries(shape, gain, rng);
        const AttentionShape as = testing::attention_shape(shape);
        MeterOptions mo;
        mo.delta_loc = 1e-6;
        std::vector<HeadMeter> ref(size_t(shape.n_q_heads));
        decode_meter_ref(*cache, seq, 1, as, q.data(), n_ctx, mo, ref.data());
        std::vector<double> tv(size_t(shape.n_q_heads));
        decode_true_tv_ref(*cache, seq, 1, as, q.data(), n_ctx, tv.data());
        std::vector<float> plain(q.size());
        decode_attention(*cache, seq, 1, as, q.data(), n_ctx, plain.data(), &pool);
        for (const int splits : {1, 3}) {
          std::vector<HeadMeter> got(size_t(shape.n_q_heads));
          std::vector<float> out(q.size());
          DecodeOptions options;
          options.n_splits = splits;
          options.meters = got.data();
          options.meter = mo;
          decode_attention(*cache, seq, 1, as, q.data(), n_ctx, out.data(), &pool, options);
          EXPECT_LT(testing::max_abs_diff(out, plain), 1e-5) << "the meter changed the output";
          for (int h = 0; h < shape.n_q_heads; ++h) {
            const std::string where = std::string(cache::kv_scheme_name(scheme)) + " witness " +
                                      codec::witness_code_name(codec::WitnessCode(code)) + " n_ctx " +
                                      std::to_string(n_ctx) + " head " + std::to_string(h) +
                                      " splits " + std::to_string(splits);
            const double a_got = std::expm1(got[size_t(h)].log_a), a_ref = std::expm1(ref[size_t(h)].log_a);
            if (std::isfinite(a_ref)) {
              // The float path lifts each bound c_t by 2^-16 relative (its rounding margin), which
              // moves A by about c_max 2^-16 relative: close where the meter is informative.
              if (ref[size_t(h)].meter < 1) {
                EXPECT_NEAR(a_got, a_ref, 2e-4 * a_ref + 1e-12) << where;
              }
              EXPECT_GE(a_got, a_ref * (1 - 1e-6)) << where << ": the float path must not be lower";
            } else {
              EXPECT_TRUE(std::isinf(got[size_t(h)].log_a)) << where;
            }
            EXPECT_NEAR(got[size_t(h)].value_rho, ref[size_t(h)].value_rho,
                        2e-4 * ref[size_t(h)].value_rho + 1e-12) << where;
            EXPECT_GE(got[size_t(h)].value_rho, ref[size_t(h)].value_rho) << where << ": value side lower";
            EXPECT_GE(got[size_t(h)].v_norm_max, ref[size_t(h)].v_norm_max) << where;
            EXPECT_LE(got[size_t(h)].v_norm_max, ref[size_t(h)].v_norm_max * (1 + 1e-6)) << where;
            // Theorem 1, per head and step.
            EXPECT_GE(got[size_t(h)].meter, tv[size_t(h)] - 1e-12) << where;
            ++checked;
            informative += got[size_t(h)].meter < 1 && tv[size_t(h)] > 0;
          }
        }
      }
    }
  }
  // The check must have informative cells (a meter pinned at 1 proves nothing).
  if (scheme != KvScheme::kKivi2 && scheme != KvScheme::kRtn4) {
    EXPECT_GT(informative, checked / 4);
  }
}

INSTANTIATE_TEST_SUITE_P(AllLossy, DecodeMeterTest, ::testing::ValuesIn(kLossySchemes),
                         [](const ::testing::TestParamInfo<KvScheme>& info) {
                           std::string name = cache::kv_scheme_name(info.param);
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

// The group forms of the meter kernels (decode attention's: one call per page for the rows of a
// GQA group, in fours and the rests) give each row exactly the floats it gets alone (a group of
// one), for both kernel sets the CPU may pick, every group size up to 9, ragged tiles, and large
// bounds (flagged per row); and a row alone gets logit_bounds' and the sums' floats.
TEST(MeterKernels, GroupFormsGiveEachRowItsFloatsAlone) {
  const detail::MeterKernels inline_paths{&detail::any_large_bound,     nullptr,
                                          &detail::group_bounds<false>, &detail::group_bounds<true>,
                                          &detail::group_sums,          &detail::bounds_from_fp16};
  std::vector<const detail::MeterKernels*> sets = {&inline_paths};
  if (detail::meter_kernels_avx512() != nullptr) sets.push_back(detail::meter_kernels_avx512());
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  int large_rows = 0;
  for (const detail::MeterKernels* mk : sets) {
    for (const bool tier_b : {false, true}) {
      for (const int width : {16, 4, 3}) {
        for (const size_t tile_keys : {size_t(16), size_t(32), size_t(64)}) {
          for (const int n_keys : {1, 7, 16, int(tile_keys)}) {
            for (int group = 1; group <= 9; ++group) {
              std::vector<detail::QueryBoundWeights> w(static_cast<size_t>(group));
              for (detail::QueryBoundWeights& x : w) {
                x.tier_b = tier_b;
                x.width = width;
                for (int b = 0; b < width; ++b) {
                  x.weight[b] = unit(rng) * 0.3f;
                  x.abs_weight[b] = unit(rng) * 0.1f;
                }
              }
              // A row with a weight that makes one bound large, another with a NaN bound.
              if (group >= 2) w[1].weight[0] = w[1].abs_weight[0] = 500.f;
              std::vector<float> bounds(size_t(width) * tile_keys), p(size_t(group) * tile_keys), rho(tile_keys);
              for (float& x : bounds) x = unit(rng) * 0.5f;
              for (float& x : p) x = unit(rng);
              for (float& x : rho) x = unit(rng);
              std::vector<float> c(size_t(group) * tile_keys, -1.f);
              std::vector<uint8_t> large(static_cast<size_t>(group), 7);
              (tier_b ? mk->group_bounds_b : mk->group_bounds_a)(w.data(), group, bounds.data(), tile_keys, n_keys,
                                                                  c.data(), large.data());
              std::vector<float> d(static_cast<size_t>(group)), r(static_cast<size_t>(group));
              mk->group_sums(p.data(), c.data(), rho.data(), tile_keys, group, n_keys, d.data(), r.data());
              for (int g = 0; g < group; ++g) {
                const std::string where = "tier " + std::string(tier_b ? "B" : "A") + " width " +
                                          std::to_string(width) + " tile " + std::to_string(tile_keys) + " keys " +
                                          std::to_string(n_keys) + " group " + std::to_string(group) + " row " +
                                          std::to_string(g);
                std::vector<float> one(tile_keys, -1.f);
                uint8_t one_large = 7;
                (tier_b ? mk->group_bounds_b : mk->group_bounds_a)(&w[size_t(g)], 1, bounds.data(), tile_keys, n_keys,
                                                                    one.data(), &one_large);
                for (int j = 0; j < n_keys; ++j)
                  ASSERT_EQ(c[size_t(g) * tile_keys + size_t(j)], one[size_t(j)]) << where << " key " << j;
                const bool is_large = mk->any_large_bound(one.data(), n_keys);
                ASSERT_EQ(one_large, is_large ? 1 : 0) << where;
                ASSERT_EQ(large[size_t(g)], is_large ? 1 : 0) << where;
                if (mk == &inline_paths) {  // a row alone: logit_bounds' floats
                  std::vector<float> plain(tile_keys, -1.f);
                  if (tier_b) {
                    detail::logit_bounds<true>(w[size_t(g)], bounds.data(), tile_keys, n_keys, plain.data());
                  } else {
                    detail::logit_bounds<false>(w[size_t(g)], bounds.data(), tile_keys, n_keys, plain.data());
                  }
                  for (int j = 0; j < n_keys; ++j) ASSERT_EQ(one[size_t(j)], plain[size_t(j)]) << where << " key " << j;
                }
                large_rows += is_large;
                float d_one = 0.f, r_one = 0.f;
                if (mk->sums != nullptr) {
                  mk->sums(p.data() + size_t(g) * tile_keys, one.data(), rho.data(), n_keys, &d_one, &r_one);
                } else {
                  d_one = detail::weighted_expm1_sum(p.data() + size_t(g) * tile_keys, one.data(), n_keys);
                  r_one = detail::dot(p.data() + size_t(g) * tile_keys, rho.data(), n_keys);
                }
                ASSERT_EQ(d[size_t(g)], d_one) << where;
                ASSERT_EQ(r[size_t(g)], r_one) << where;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(large_rows, 0) << "no row had a large bound: the flag went untested";
}

// A NaN bound (a corrupt page read as such) is flagged large in its row only.
TEST(MeterKernels, GroupFormsFlagANanBoundInItsRowOnly) {
  std::vector<const detail::MeterKernels*> sets = {&detail::meter_kernels()};
  if (detail::meter_kernels_avx512() != nullptr) sets.push_back(detail::meter_kernels_avx512());
  for (const detail::MeterKernels* mk : sets) {
    constexpr int kGroup = 5, kWidth = 16;
    constexpr size_t kTile = 16;
    std::vector<detail::QueryBoundWeights> w(kGroup);
    for (int g = 0; g < kGroup; ++g) {
      w[size_t(g)].width = kWidth;
      for (int b = 0; b < kWidth; ++b) w[size_t(g)].weight[b] = g == 3 && b == 2 ? 0.f : 0.01f;
    }
    std::vector<float> bounds(kWidth * kTile, 0.1f);
    bounds[5 * kTile + 9] = std::numeric_limits<float>::quiet_NaN();  // band 5, key 9: every row reads it
    std::vector<float> c(kGroup * kTile);
    std::vector<uint8_t> large(kGroup, 0);
    mk->group_bounds_a(w.data(), kGroup, bounds.data(), kTile, 16, c.data(), large.data());
    for (int g = 0; g < kGroup; ++g) EXPECT_EQ(large[size_t(g)], 1) << g;
    // Only the keys before the NaN: no row is large.
    mk->group_bounds_a(w.data(), kGroup, bounds.data(), kTile, 9, c.data(), large.data());
    for (int g = 0; g < kGroup; ++g) EXPECT_EQ(large[size_t(g)], 0) << g;
  }
}

TEST(DecodeMeter, ExactCachesAndExactPagesGiveZero) {
  const CaseShape shape{6, 2, 64, 16};
  std::mt19937 rng(5);
  auto bf16 = testing::make_cache(shape, 512);
  const cache::SeqId seq = bf16->create_sequence();
  testing::append_random(*bf16, seq, 200, rng);
  const std::vector<float> q = queries(shape, 1.f, rng);
  std::vector<HeadMeter> m(6, HeadMeter{1, 1, 1, 1, 1});
  std::vector<float> out(q.size());
  DecodeOptions options;
  options.meters = m.data();
  decode_attention(*bf16, seq, 0, testing::attention_shape(shape), q.data(), 200, out.data(), nullptr, options);
  for (const HeadMeter& h : m) EXPECT_EQ(h.meter, 0.0);
  // A lossy cache whose context is all tail (under one block) is exact too.
  auto lossy = lossy_cache(shape, KvScheme::kRtn8, 512);
  const cache::SeqId s2 = lossy->create_sequence();
  append(*lossy, s2, 15, rng);
  decode_attention(*lossy, s2, 0, testing::attention_shape(shape), q.data(), 15, out.data(), nullptr, options);
  for (const HeadMeter& h : m) EXPECT_EQ(h.meter, 0.0);
}

// A corrupt witness bounds nothing: a stored bound below 0 (fp16 witness), a negative page scale
// (u8 witness) or a NaN code (the exponent witness, on fp8-e4m3) reads as +inf, so the heads of
// that KV head get meter 1 on the float path and in the reference, and the other KV head's heads
// keep their meters.
TEST(DecodeMeter, CorruptWitnessBoundsNothing) {
  const CaseShape shape{4, 2, 64, 16};
  for (int code = 0; code < codec::kNumWitnessCodes; ++code) {
    SCOPED_TRACE(codec::witness_code_name(codec::WitnessCode(code)));
    std::mt19937 rng(21);
    const bool exponent = codec::WitnessCode(code) == codec::WitnessCode::kExponent;
    auto cache = lossy_cache(shape, exponent ? KvScheme::kFp8E4M3 : KvScheme::kRtn8, 512, codec::WitnessCode(code));
    const cache::SeqId seq = cache->create_sequence();
    append(*cache, seq, 129, rng);
    const std::vector<float> q = queries(shape, 0.3f, rng);
    const AttentionShape as = testing::attention_shape(shape);
    auto meters = [&](std::vector<HeadMeter>* got, std::vector<HeadMeter>* ref) {
      got->assign(4, HeadMeter{});
      ref->assign(4, HeadMeter{});
      std::vector<float> out(q.size());
      DecodeOptions options;
      options.meters = got->data();
      decode_attention(*cache, seq, 1, as, q.data(), 129, out.data(), nullptr, options);
      decode_meter_ref(*cache, seq, 1, as, q.data(), 129, MeterOptions{}, ref->data());
    };
    std::vector<HeadMeter> got, ref;
    meters(&got, &ref);
    for (int h = 0; h < 4; ++h) ASSERT_LT(got[size_t(h)].meter, 1.0) << "head " << h << ": the test needs informative meters";
    // KV head 0, layer 1, block 3: its first band's bound of token 0, or the page's scale.
    const format::PageRef ref_k = cache->block_table(seq, 1, cache::KvTensor::kKey, 0)[3];
    const codec::LossyPageSpec spec = cache->lossy_spec(1, cache::KvTensor::kKey, 0);
    uint8_t* page = const_cast<uint8_t*>(cache->page_bytes_of(ref_k));
    if (exponent) {
      page[64 + 9] = 0x7f;  // token 1, channel 9: a NaN code
    } else {
      const size_t at = codec::lossy_payload_bytes(spec) +
                        (spec.witness == codec::WitnessCode::kFp16 ? 0 : size_t(16) * codec::witness_bands(64));
      page[at] = 0x00;
      page[at + 1] = 0xbc;  // fp16 -1.0
    }
    meters(&got, &ref);
    for (int h = 0; h < 4; ++h) {
      const bool corrupt_head = h < 2;  // query heads 0 and 1 read KV head 0
      EXPECT_EQ(got[size_t(h)].meter == 1.0, corrupt_head) << "head " << h;
      EXPECT_EQ(ref[size_t(h)].meter == 1.0, corrupt_head) << "head " << h;
    }
  }
}

TEST(DecodeMeter, RepairedBlocksLowerTheMeter) {
  const CaseShape shape{3, 1, 64, 16};
  std::mt19937 rng(9);
  auto cache = lossy_cache(shape, KvScheme::kRtn4, 512);
  const cache::SeqId seq = cache->create_sequence();
  append(*cache, seq, 160, rng);
  const std::vector<float> q = queries(shape, 1.f, rng);
  const AttentionShape as = testing::attention_shape(shape);
  std::vector<HeadMeter> before(3), after(3);
  std::vector<double> contributions;
  decode_meter_ref(*cache, seq, 0, as, q.data(), 160, MeterOptions{}, before.data(), &contributions);
  ASSERT_EQ(contributions.size(), size_t(3 * 10));
  double total = 0;
  for (int b = 0; b < 10; ++b) total += contributions[size_t(b)];
  EXPECT_NEAR(total, std::expm1(before[0].log_a), 1e-9 * total);
  for (int64_t b = 0; b < 10; ++b) cache->repair_block(seq, 0, 0, b);
  decode_meter_ref(*cache, seq, 0, as, q.data(), 160, MeterOptions{}, after.data());
  for (int h = 0; h < 3; ++h) {
    EXPECT_GT(before[size_t(h)].log_a, 0.0);
    EXPECT_EQ(after[size_t(h)].meter, 0.0);
  }
}

// Writes positions [0, n) in ragged steps, each row's values a function of (position, layer,
// kv_head) alone, so that caches holding different lengths hold the same rows.
void append_by_position(cache::KvCache& cache, cache::SeqId seq, int64_t n) {
  const cache::KvCacheConfig& cfg = cache.config();
  const int d = cfg.head_dim;
  static constexpr int64_t kSteps[] = {37, 1, 200, 3, 64};
  for (int64_t done = 0, step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 5], n - done);
    cache.reserve(seq, m);
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      std::vector<float> k(size_t(m) * size_t(cfg.n_kv_heads) * size_t(d)), v(k.size());
      for (int64_t t = 0; t < m; ++t) {
        for (int h = 0; h < cfg.n_kv_heads; ++h) {
          std::mt19937 rng(uint32_t((done + t) * 131 + layer * 17 + h));
          std::normal_distribution<float> normal(0.f, 1.f);
          const size_t row = (size_t(t) * size_t(cfg.n_kv_heads) + size_t(h)) * size_t(d);
          for (int c = 0; c < d; ++c) {
            k[row + size_t(c)] = normal(rng) * (c == 5 || c == 6 ? 12.f : 1.5f);
            v[row + size_t(c)] = normal(rng);
          }
        }
      }
      cache.write(seq, layer, k.data(), v.data(), m);
    }
    cache.commit(seq, m);
    done += m;
  }
}

// Prefill over a lossy cache: query i reads what a decode step at its position reads (blocks
// ending after p + 1 - window exact, earlier ones as stored), so
//  - its output does not depend on where the chunk starts (bit for bit),
//  - it equals decode_attention with one split over a cache that holds p + 1 tokens (bit for bit),
//  - the float path matches the double reference,
//  - and it differs from attention over the exact values once a block before it is lossy.
TEST(LossyPrefill, EachQueryReadsWhatADecodeStepAtItsPositionReads) {
  ThreadPool pool(2);
  const CaseShape shape{6, 2, 64, 16};
  const AttentionShape as = testing::attention_shape(shape);
  constexpr int64_t kTokens = 250;
  for (const KvScheme scheme : {KvScheme::kRtn4, KvScheme::kDither8, KvScheme::kKivi2}) {
    SCOPED_TRACE(cache::kv_scheme_name(scheme));
    auto lossy = lossy_cache(shape, scheme, 512);
    cache::KvCacheConfig bf16_cfg = lossy->config();
    bf16_cfg.scheme = KvScheme::kBf16;
    cache::KvCache bf16(bf16_cfg);
    const cache::SeqId a = lossy->create_sequence(), b = bf16.create_sequence();
    append_by_position(*lossy, a, kTokens);
    append_by_position(bf16, b, kTokens);
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t row = size_t(as.n_q_heads) * size_t(as.head_dim);
    std::vector<float> q(size_t(kTokens) * row);
    for (float& x : q) x = normal(rng);
    std::vector<float> whole(q.size()), exact(q.size());
    prefill_attention(*lossy, a, 1, as, q.data(), 0, kTokens, whole.data(), &pool);
    prefill_attention(bf16, b, 1, as, q.data(), 0, kTokens, exact.data(), &pool);
    std::vector<double> ref(q.size());
    prefill_attention_ref(*lossy, a, 1, as, q.data(), 0, kTokens, ref.data());
    EXPECT_LT(testing::max_abs_diff(whole, ref), 2e-5);

    for (const int64_t pos0 : {int64_t(1), int64_t(100), int64_t(233), int64_t(249)}) {
      const int64_t n = kTokens - pos0;
      std::vector<float> part(size_t(n) * row);
      prefill_attention(*lossy, a, 1, as, q.data() + size_t(pos0) * row, pos0, n, part.data(), &pool);
      EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + std::ptrdiff_t(size_t(pos0) * row)))
          << "a chunk from " << pos0 << " reads other values than the whole prompt";
      std::vector<double> part_ref(part.size());
      prefill_attention_ref(*lossy, a, 1, as, q.data() + size_t(pos0) * row, pos0, n, part_ref.data());
      EXPECT_LT(testing::max_abs_diff(part, part_ref), 2e-5) << "pos0 " << pos0;
    }

    // The last position of a block (its block complete and lossy at that step), the first of
    // the next, and others.
    for (const int64_t p : {int64_t(40), int64_t(47), int64_t(48), int64_t(143), int64_t(249)}) {
      auto shorter = lossy_cache(shape, scheme, 512);
      const cache::SeqId c = shorter->create_sequence();
      append_by_position(*shorter, c, p + 1);
      std::vector<float> step(row);
      DecodeOptions one_split;
      one_split.n_splits = 1;
      decode_attention(*shorter, c, 1, as, q.data() + size_t(p) * row, p + 1, step.data(), nullptr, one_split);
      EXPECT_TRUE(std::equal(step.begin(), step.end(), whole.begin() + std::ptrdiff_t(size_t(p) * row)))
          << "position " << p << ": prefill and a decode step there read different values";
    }
    // Past the first blocks (and kivi2's 32-token window) the lossy pages show.
    const std::vector<float> late_whole(whole.begin() + std::ptrdiff_t(100 * row), whole.end());
    const std::vector<float> late_exact(exact.begin() + std::ptrdiff_t(100 * row), exact.end());
    EXPECT_GT(testing::max_abs_diff(late_whole, late_exact), 1e-4) << "every block read exact";
  }
}

TEST(DecodeMeter, Dither8NeedsAFailureProbabilityInRange) {
  const CaseShape shape{2, 1, 64, 16};
  std::mt19937 rng(3);
  auto cache = lossy_cache(shape, KvScheme::kDither8, 256);
  const cache::SeqId seq = cache->create_sequence();
  append(*cache, seq, 40, rng);
  const std::vector<float> q = queries(shape, 1.f, rng);
  std::vector<HeadMeter> m(2);
  std::vector<float> out(q.size());
  for (const double delta : {0.0, 1.0, -1.0, std::nan("")}) {
    DecodeOptions options;
    options.meters = m.data();
    options.meter.delta_loc = delta;
    EXPECT_THROW(decode_attention(*cache, seq, 0, testing::attention_shape(shape), q.data(), 40,
                                  out.data(), nullptr, options),
                 Error)
        << delta;
  }
}


// The exponent witness on real SmolLM2 keys and values (src/codec/testdata: layers 0, 15 and 29,
// 3 KV heads, 64 tokens each): every query row (Gaussian rows at two gains and the real keys of
// the other layers as query-like rows) and token gets c_t >= |sm_scale q . (k^_t - k_t)| (the
// float bound the kernel makes, exponent_bound_ref's, and the reference's), every head's meter on
// the float path >= the true TV, within a few ulps of the double reference; and against the fp16
// witness on the same cells the bound is looser by a bounded factor, for 0 witness bytes.
TEST(DecodeMeter, ExponentWitnessOnRealKv) {
  const auto file = format::SafetensorsFile::open(std::string(CERTKV_SOURCE_DIR) +
                                                  "/src/codec/testdata/smollm2_kv_pages.safetensors");
  constexpr int kHeads = 3, kTokens = 32, kD = 64, kQHeads = 9;
  const int layers[] = {0, 15, 29};
  // [layer][token][kv_head][d]: the calib rows then the eval rows of each head.
  auto rows_of = [&](int layer, bool key) {
    std::vector<float> out(size_t(2 * kTokens) * kHeads * kD);
    int part = 0;
    for (const char* set : {"calib", "eval"}) {
      const format::SafetensorsTensor* t = file->find(std::string(set) + ".layer" + std::to_string(layer) + (key ? ".k" : ".v"));
      EXPECT_NE(t, nullptr);
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(t->data);
      for (int h = 0; h < kHeads; ++h)
        for (int tok = 0; tok < kTokens; ++tok)
          for (int c = 0; c < kD; ++c)
            out[((size_t(part * kTokens + tok)) * kHeads + size_t(h)) * kD + size_t(c)] =
                format::bf16_to_float(bits[(size_t(h) * kTokens + size_t(tok)) * kD + size_t(c)]);
      ++part;
    }
    return out;
  };
  auto make = [&](codec::WitnessCode witness) {
    cache::KvCacheConfig cfg;
    cfg.n_layers = 3;
    cfg.n_kv_heads = kHeads;
    cfg.head_dim = kD;
    cfg.block_tokens = 16;
    cfg.max_tokens = 256;
    cfg.scheme = KvScheme::kFp8E4M3;
    cfg.witness = witness;
    auto cache = std::make_unique<cache::KvCache>(cfg);
    const cache::SeqId seq = cache->create_sequence();
    cache->reserve(seq, 2 * kTokens);
    for (int l = 0; l < 3; ++l) cache->write(seq, l, rows_of(layers[l], true).data(), rows_of(layers[l], false).data(), 2 * kTokens);
    cache->commit(seq, 2 * kTokens);
    return std::make_pair(std::move(cache), seq);
  };
  auto [exponent, s_exp] = make(codec::WitnessCode::kExponent);
  auto [fp16, s16] = make(codec::WitnessCode::kFp16);
  EXPECT_EQ(exponent->memory_stats().exact_fallback_blocks, 0u) << "SmolLM2's keys stay under 464 here";
  const int64_t n = 2 * kTokens;
  const AttentionShape as{kQHeads, kHeads, kD, 0.125f};
  std::mt19937 rng(61);
  std::normal_distribution<float> normal(0.f, 1.f);
  int tokens_checked = 0, heads_checked = 0;
  std::vector<double> ratios;
  for (int l = 0; l < 3; ++l) {
    std::vector<float> k_exact(size_t(n) * kD), k_hat(size_t(n) * kD), u(size_t(kD) * size_t(n));
    for (int kind = 0; kind < 3; ++kind) {
      std::vector<float> q(size_t(kQHeads) * kD);
      if (kind < 2) {
        for (float& x : q) x = (kind == 0 ? 1.f : 6.f) * normal(rng);
      } else {  // the keys of the next layer's first tokens as query-like rows
        const std::vector<float> other = rows_of(layers[(l + 1) % 3], true);
        for (size_t i = 0; i < q.size(); ++i) q[i] = other[i];
      }
      std::vector<HeadMeter> got(kQHeads), ref(kQHeads), got16(kQHeads);
      std::vector<double> tv(kQHeads);
      std::vector<float> out(q.size());
      DecodeOptions options;
      options.meters = got.data();
      decode_attention(*exponent, s_exp, l, as, q.data(), n, out.data(), nullptr, options);
      decode_meter_ref(*exponent, s_exp, l, as, q.data(), n, MeterOptions{}, ref.data());
      decode_true_tv_ref(*exponent, s_exp, l, as, q.data(), n, tv.data());
      options.meters = got16.data();
      decode_attention(*fp16, s16, l, as, q.data(), n, out.data(), nullptr, options);
      for (int h = 0; h < kQHeads; ++h) {
        const std::string where = "layer " + std::to_string(layers[l]) + " kind " + std::to_string(kind) + " head " + std::to_string(h);
        EXPECT_GE(got[size_t(h)].meter, tv[size_t(h)]) << where;
        EXPECT_GE(std::expm1(got[size_t(h)].log_a), std::expm1(ref[size_t(h)].log_a) * (1 - 1e-9)) << where;
        if (ref[size_t(h)].meter < 1) {
          EXPECT_NEAR(std::expm1(got[size_t(h)].log_a), std::expm1(ref[size_t(h)].log_a), 1e-4 * std::expm1(ref[size_t(h)].log_a)) << where;
        }
        ++heads_checked;
      }
      // Per row and token: c_t against the true logit error and the fp16 witness's c_t.
      for (int kvh = 0; kvh < kHeads; ++kvh) {
        exponent->read_token_range_exact(s_exp, l, cache::KvTensor::kKey, kvh, 0, n, k_exact.data());
        exponent->read_token_range_ref(s_exp, l, cache::KvTensor::kKey, kvh, 0, n, k_hat.data());
        const detail::TableReader table = detail::table_reader(*exponent, s_exp, l, cache::KvTensor::kKey, kvh);
        detail::load_error_data(table, 0, n, u.data(), size_t(n));
        const detail::TableReader table16 = detail::table_reader(*fp16, s16, l, cache::KvTensor::kKey, kvh);
        std::vector<float> w16(size_t(codec::witness_bands(kD)) * size_t(n));
        detail::load_error_data(table16, 0, n, w16.data(), size_t(n));
        for (int g = 0; g < kQHeads / kHeads; ++g) {
          const float* qh = q.data() + size_t(kvh * (kQHeads / kHeads) + g) * kD;
          const detail::QueryBoundWeights w = detail::query_bound_weights(*table.lossy, qh, as.scale, n, 1e-6);
          for (int64_t t = 0; t < n; ++t) {
            std::vector<float> ut(kD), wt(size_t(codec::witness_bands(kD)));
            for (int c = 0; c < kD; ++c) ut[size_t(c)] = u[size_t(c) * size_t(n) + size_t(t)];
            for (size_t b = 0; b < wt.size(); ++b) wt[b] = w16[b * size_t(n) + size_t(t)];
            long double err = 0;
            for (int c = 0; c < kD; ++c)
              err += (long double)qh[c] * ((long double)k_hat[size_t(t) * kD + size_t(c)] - (long double)k_exact[size_t(t) * kD + size_t(c)]);
            err = std::fabs(err) * (long double)as.scale;
            const float c_kernel = detail::exponent_bound_ref(w, qh, k_hat.data() + size_t(t) * kD, kD);
            const double c_ref = meter_logit_bound_ref(*table.lossy, qh, as.scale, ut.data(), n, 1e-6);
            const double c16 = meter_logit_bound_ref(*table16.lossy, qh, as.scale, wt.data(), n, 1e-6);
            EXPECT_GE((long double)c_kernel, err) << "layer " << layers[l] << " token " << t;
            EXPECT_GE((long double)c_ref, err) << "layer " << layers[l] << " token " << t;
            if (c16 > 0) ratios.push_back(c_ref / c16);
            ++tokens_checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(tokens_checked, 3 * 3 * kQHeads * int(n));
  EXPECT_EQ(heads_checked, 3 * 3 * kQHeads);
  std::sort(ratios.begin(), ratios.end());
  const double median = ratios[ratios.size() / 2];
  RecordProperty("median_c_ratio_exponent_over_fp16", std::to_string(median));
  // Looser than the residual's own norms (Cauchy-Schwarz per band against sum_c |q_c| |r_c| worst
  // cases), but not by an order of magnitude (docs/meter.md section 7: 1.27-1.33 on real KV).
  EXPECT_GT(median, 1.0);
  EXPECT_LT(median, 3.0);
}

// A block whose cast would saturate (|k| > 464) stays exact with the exponent witness: counted as
// an exact fallback, its keys read exactly, its tokens' bound 0; the fp16 witness's cache encodes it.
TEST(DecodeMeter, ExponentWitnessKeepsASaturatingBlockExact) {
  const CaseShape shape{3, 1, 64, 16};
  for (const codec::WitnessCode witness : {codec::WitnessCode::kExponent, codec::WitnessCode::kFp16}) {
    auto cache = lossy_cache(shape, KvScheme::kFp8E4M3, 256, witness);
    const cache::SeqId seq = cache->create_sequence();
    std::vector<float> k_rows(size_t(48) * 64), v_rows(k_rows.size(), 0.5f);
    for (int t = 0; t < 48; ++t)
      for (int c = 0; c < 64; ++c) k_rows[size_t(t) * 64 + size_t(c)] = 0.1f * float((c * 7 + t) % 11) - 0.37f;
    k_rows[size_t(20) * 64 + 3] = 600.f;  // token 20: block 1
    cache->reserve(seq, 48);
    for (int layer = 0; layer < 2; ++layer) cache->write(seq, layer, k_rows.data(), v_rows.data(), 48);
    cache->commit(seq, 48);
    const bool exponent = witness == codec::WitnessCode::kExponent;
    EXPECT_EQ(cache->memory_stats().exact_fallback_blocks, exponent ? 2u : 0u);  // block 1 of each layer
    std::vector<float> k(size_t(48) * 64);
    cache->read_token_range_ref(seq, 1, cache::KvTensor::kKey, 0, 0, 48, k.data());
    EXPECT_EQ(k[size_t(20) * 64 + 3], exponent ? 600.f : 448.f);
    const detail::TableReader table = detail::table_reader(*cache, seq, 1, cache::KvTensor::kKey, 0);
    const int width = detail::key_bound_width(*table.lossy);
    std::vector<float> bounds(size_t(width) * 48);
    detail::load_error_data(table, 0, 48, bounds.data(), 48);
    for (int t = 16; t < 32; ++t) EXPECT_EQ(bounds[size_t(t)] == 0.f, exponent) << t;
    for (int t = 0; t < 16; ++t) EXPECT_GT(bounds[size_t(t)], 0.f) << t;
  }
}

}  // namespace
}  // namespace certkv::attention
