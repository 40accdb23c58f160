// Decode attention over every page class against its _ref (docs/attention.md): the float path
// (pages decoded by the kernel codec::lossy_best_kernel picks, which ctest also caps to AVX2 and
// to the portable kernel through CERTKV_LOSSY_KERNEL) against decode_attention_ref, which reads
// the same pages through the codecs' _ref decoders, in double; and its meter against the
// double-precision decode_meter_ref, never below it on any cell.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attention/attention_test_support.h"
#include "attention/decode_attention.h"
#include "codec/lossy_page.h"
#include "core/thread_pool.h"

namespace certkv::attention {
namespace {

using cache::KvScheme;
using testing::CaseShape;

constexpr KvScheme kSchemes[] = {KvScheme::kFp8PagesE4M3, KvScheme::kFp8PagesE5M2, KvScheme::kFp8E4M3,
                                 KvScheme::kFp8E5M2,      KvScheme::kFp8E4M3Scaled, KvScheme::kRtn8,
                                 KvScheme::kRtn4,         KvScheme::kKivi2,        KvScheme::kDither8};

std::unique_ptr<cache::KvCache> scheme_cache(const CaseShape& c, KvScheme scheme, int64_t max_tokens) {
  cache::KvCacheConfig cfg;
  cfg.n_layers = 2;
  cfg.n_kv_heads = c.n_kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.block_tokens = c.block_tokens;
  cfg.max_tokens = max_tokens;
  cfg.scheme = scheme;
  cfg.rope_pairing = codec::RopePairing::kHalfSplit;
  if (scheme == KvScheme::kKivi2) cfg.recent_window_tokens = 32;
  return std::make_unique<cache::KvCache>(cfg);
}

// The kernel the environment asks for is the one decoding (when this CPU runs it).
TEST(PageClasses, TheLossyKernelFollowsTheEnvironment) {
  const char* env = std::getenv("CERTKV_LOSSY_KERNEL");
  if (env == nullptr) GTEST_SKIP() << "CERTKV_LOSSY_KERNEL not set: the widest kernel decodes";
  for (codec::LossyKernel k : {codec::LossyKernel::kPortable, codec::LossyKernel::kAvx2, codec::LossyKernel::kAvx512}) {
    if (std::string(env) == codec::lossy_kernel_name(k) && codec::lossy_kernel_supported(k)) {
      EXPECT_EQ(codec::lossy_best_kernel(), k);
    }
  }
}

class PageClassTest : public ::testing::TestWithParam<KvScheme> {};

// Ragged contexts (partial last blocks, splits ending inside blocks), GQA 1, 3 and 7, head_dim 64
// and 128, with and without a pool, metered or not.
TEST_P(PageClassTest, FloatPathMatchesTheReferenceAndItsMeterIsNeverBelow) {
  const KvScheme scheme = GetParam();
  const bool lossy = cache::kv_scheme_is_lossy(scheme);
  ThreadPool pool(2);
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.f, 1.f);
  int informative = 0, cells = 0;
  for (const CaseShape shape : {CaseShape{3, 3, 64, 16}, CaseShape{6, 2, 128, 16}, CaseShape{14, 2, 64, 16}}) {
    auto cache = scheme_cache(shape, scheme, 1100);
    for (const int64_t n_ctx : {1, 3, 17, 129, 501}) {
      SCOPED_TRACE(std::string(cache::kv_scheme_name(scheme)) + " q/kv " + std::to_string(shape.n_q_heads) + "/" +
                   std::to_string(shape.n_kv_heads) + " d " + std::to_string(shape.head_dim) + " n_ctx " +
                   std::to_string(n_ctx));
      const cache::SeqId seq = cache->create_sequence();
      testing::append_in_ragged_steps(*cache, seq, n_ctx, [&](float* k, float* v) {
        for (int c = 0; c < shape.head_dim; ++c) {
          k[c] = normal(rng) * (c == 3 || c == 3 + shape.head_dim / 2 ? 9.f : 1.f);
          v[c] = normal(rng);
        }
      });
      const AttentionShape as = testing::attention_shape(shape);
      std::vector<float> q(size_t(shape.n_q_heads) * size_t(shape.head_dim));
      for (float& x : q) x = 0.5f * normal(rng);
      std::vector<double> ref(q.size());
      decode_attention_ref(*cache, seq, 1, as, q.data(), n_ctx, ref.data());
      testing::expect_nondegenerate(ref, "reference output");
      MeterOptions mo;
      mo.delta_loc = 1e-6;
      std::vector<HeadMeter> meter_ref(size_t(shape.n_q_heads));
      if (lossy) decode_meter_ref(*cache, seq, 1, as, q.data(), n_ctx, mo, meter_ref.data());
      for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
        for (const bool metered : {false, true}) {
          std::vector<float> out(q.size());
          std::vector<HeadMeter> meters(size_t(shape.n_q_heads));
          DecodeOptions options;
          options.meter = mo;
          if (metered) options.meters = meters.data();
          decode_attention(*cache, seq, 1, as, q.data(), n_ctx, out.data(), p, options);
          EXPECT_LT(testing::max_abs_diff(out, ref), 2e-5) << (metered ? "metered" : "unmetered");
          if (!metered || !lossy) continue;
          for (int h = 0; h < shape.n_q_heads; ++h) {
            // A sound bound rounds up: the float meter is never below the double reference.
            EXPECT_GE(meters[size_t(h)].log_a, meter_ref[size_t(h)].log_a) << "head " << h;
            EXPECT_GE(meters[size_t(h)].meter, meter_ref[size_t(h)].meter) << "head " << h;
            EXPECT_GE(meters[size_t(h)].value_rho, meter_ref[size_t(h)].value_rho) << "head " << h;
            ++cells;
            informative += meters[size_t(h)].meter > 0 && meters[size_t(h)].meter < 1;
          }
        }
      }
      cache->free_sequence(seq);
    }
  }
  // (rtn4's and kivi2's coarse keys saturate the meter at these contexts, as in meter_test.cc.)
  if (lossy && scheme != KvScheme::kKivi2 && scheme != KvScheme::kRtn4) {
    EXPECT_GT(informative, 0) << "no informative meter among " << cells;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryClass, PageClassTest, ::testing::ValuesIn(kSchemes),
                         [](const ::testing::TestParamInfo<KvScheme>& info) {
                           std::string name = cache::kv_scheme_name(info.param);
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

}  // namespace
}  // namespace certkv::attention
