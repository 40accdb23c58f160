// The gaac KV scheme of KvCache: fill-then-finalize into GAAC slots with raw fallback, the same
// bit patterns as a bf16 cache, sharing, per-class accounting and bad configurations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "core/status.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::cache {
namespace {

using format::PageRef;
using format::StorageClass;

KvCacheConfig small_config() {
  KvCacheConfig c;
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.block_tokens = 4;
  c.max_tokens = 1024;
  return c;
}

// The exponent a channel's values are centered on, and its calibrated windows around it.
int center_exponent(int layer, int kv, int head, int c) { return 118 + (c * 3 + head + layer + kv) % 9; }

// Bases b3 = center - 3 (window [center - 3, center + 5)), b4 = center - 7, and one escape
// capacity for every (layer, K/V).
std::shared_ptr<const codec::GaacCalibration> calibration_for(const KvCacheConfig& cfg,
                                                              size_t escape_capacity_bytes) {
  codec::GaacShape shape;
  shape.n_layers = cfg.n_layers;
  shape.n_kv_heads = cfg.n_kv_heads;
  shape.head_dim = cfg.head_dim;
  shape.block_tokens = cfg.block_tokens;
  auto cal = std::make_shared<codec::GaacCalibration>(shape);
  for (int l = 0; l < cfg.n_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      cal->set_escape_capacity_bytes(l, kv, escape_capacity_bytes);
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        codec::GaacBases& b = cal->bases(l, kv, h);
        b.b3.assign(size_t(cfg.head_dim), 0);
        b.b4.assign(size_t(cfg.head_dim), 0);
        for (int c = 0; c < cfg.head_dim; ++c) {
          b.b3[size_t(c)] = uint8_t(center_exponent(l, kv, h, c) - 3);
          b.b4[size_t(c)] = uint8_t(center_exponent(l, kv, h, c) - 7);
        }
      }
    }
  }
  return cal;
}

// The largest escape area of a 4 x 16 page (every group raw): every block fits.
constexpr size_t kEveryBlockFits = format::gaac_page_max_escape_bytes(format::GaacElement::kBf16, 4, 16);
static_assert(kEveryBlockFits == 40);

KvCacheConfig gaac_config(size_t escape_capacity_bytes = 8) {
  KvCacheConfig c = small_config();
  c.scheme = KvScheme::kGaac;
  c.gaac_calibration = calibration_for(c, escape_capacity_bytes);
  return c;
}

// KV data whose exponents sit mostly in the 3-bit window, sometimes in the 4-bit one, and, in
// every 5th block of a table, anywhere in [0, 254] (raw groups that overflow a small slot).
// Values are exact bf16, so the cache stores exactly these bit patterns.
class KvSource {
 public:
  explicit KvSource(const KvCacheConfig& cfg, uint32_t seed = 1) : cfg_(cfg), rng_(seed) {}

  // k, v: [n][n_kv_heads][head_dim] for positions [pos0, pos0 + n) of one layer.
  void fill(int layer, int64_t pos0, int64_t n, std::vector<float>& k, std::vector<float>& v) {
    const size_t count = size_t(n) * size_t(cfg_.n_kv_heads) * size_t(cfg_.head_dim);
    k.resize(count);
    v.resize(count);
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<float>& x = kv == 0 ? k : v;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t block = (pos0 + i) / cfg_.block_tokens;
        for (int h = 0; h < cfg_.n_kv_heads; ++h) {
          const bool outlier_block = (block + h + kv + layer) % 5 == 3;
          for (int c = 0; c < cfg_.head_dim; ++c) {
            int e = center_exponent(layer, kv, h, c);
            const uint32_t r = rng_();
            if (outlier_block) {
              e = int(r % 255);
            } else if (r % 16 == 0) {
              e += 5 + int((r >> 4) % 3);  // outside [center - 3, center + 5): a 4-bit group
            } else {
              e += int((r >> 4) % 8) - 3;
            }
            const uint16_t bits = uint16_t(((r >> 8) & 1u) << 15 | uint32_t(e) << 7 | ((r >> 9) & 0x7fu));
            x[(size_t(i) * size_t(cfg_.n_kv_heads) + size_t(h)) * size_t(cfg_.head_dim) + size_t(c)] =
                format::bf16_to_float(bits);
          }
        }
      }
    }
  }

 private:
  KvCacheConfig cfg_;
  std::mt19937 rng_;
};

// Appends n tokens to the same sequence of every cache, in steps of ragged sizes.
void append_to_all(const std::vector<KvCache*>& caches, const std::vector<SeqId>& seqs, int64_t n,
                   KvSource& source) {
  static constexpr int64_t kSteps[] = {5, 1, 13, 64, 2, 300};
  const KvCacheConfig& cfg = caches[0]->config();
  std::vector<float> k, v;
  for (int64_t done = 0, step = 0; done < n; ++step) {
    const int64_t m = std::min<int64_t>(kSteps[step % 6], n - done);
    const int64_t pos0 = caches[0]->length(seqs[0]);
    for (size_t i = 0; i < caches.size(); ++i) caches[i]->reserve(seqs[i], m);
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
      source.fill(layer, pos0, m, k, v);
      for (size_t i = 0; i < caches.size(); ++i) caches[i]->write(seqs[i], layer, k.data(), v.data(), m);
    }
    for (size_t i = 0; i < caches.size(); ++i) caches[i]->commit(seqs[i], m);
    done += m;
  }
}

// Every position of every table of `got` has the bit pattern of `want`.
void expect_same_bits(const KvCache& got, SeqId got_seq, const KvCache& want, SeqId want_seq) {
  const KvCacheConfig& cfg = got.config();
  const int64_t n = got.length(got_seq);
  ASSERT_EQ(n, want.length(want_seq));
  std::vector<float> a(size_t(n) * size_t(cfg.head_dim)), b(a.size());
  size_t nonzero = 0;
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        got.read_token_range_ref(got_seq, layer, kv, h, 0, n, a.data());
        want.read_token_range_ref(want_seq, layer, kv, h, 0, n, b.data());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "layer " << layer << " kv " << int(kv) << " head " << h;
        for (float x : b) nonzero += x != 0.f;
      }
    }
  }
  EXPECT_GT(nonzero, size_t(n) * size_t(cfg.head_dim));  // the data is not degenerate
}

// The class a complete block must take: a slot iff its escapes fit the capacity.
StorageClass expected_class(const KvCache& cache, SeqId seq, int layer, KvTensor kv, int h,
                            int64_t block) {
  const int bt = cache.block_tokens(), d = cache.head_dim();
  std::vector<float> rows(size_t(bt) * size_t(d));
  cache.read_token_range_ref(seq, layer, kv, h, block * bt, (block + 1) * bt, rows.data());
  std::vector<uint16_t> bits(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) bits[i] = format::float_to_bf16(rows[i]);
  const size_t need = codec::gaac_escape_bytes_needed(bits.data(), bt, d, cache.gaac_bases(layer, kv, h));
  const size_t capacity = cache.config().gaac_calibration->escape_capacity_bytes(layer, int(kv));
  return need <= capacity ? StorageClass::kGaac : StorageClass::kBf16;
}

struct ClassCounts {
  uint64_t gaac = 0, raw = 0;
};

// Checks every block's class (complete: by its escapes; the partial tail: raw) and counts them.
ClassCounts check_classes(const KvCache& cache, SeqId seq) {
  const KvCacheConfig& cfg = cache.config();
  const int64_t n = cache.length(seq);
  const int64_t complete = n / cfg.block_tokens;
  ClassCounts counts;
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        const PageRef* table = cache.block_table(seq, layer, kv, h);
        for (int64_t b = 0; b < cache.n_blocks(seq); ++b) {
          const StorageClass want =
              b < complete ? expected_class(cache, seq, layer, kv, h, b) : StorageClass::kBf16;
          EXPECT_EQ(table[b].storage, want) << "layer " << layer << " kv " << int(kv) << " head "
                                            << h << " block " << b << " of " << n << " tokens";
          (table[b].storage == StorageClass::kGaac ? counts.gaac : counts.raw) += 1;
        }
      }
    }
  }
  return counts;
}

TEST(KvCacheGaac, SchemeNamesParse) {
  EXPECT_EQ(parse_kv_scheme("bf16"), KvScheme::kBf16);
  EXPECT_EQ(parse_kv_scheme("gaac"), KvScheme::kGaac);
  EXPECT_STREQ(kv_scheme_name(KvScheme::kGaac), "gaac");
  try {
    parse_kv_scheme("zstd");
    FAIL() << "an unknown scheme was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'zstd'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bf16, gaac"), std::string::npos) << e.what();
  }
}

TEST(KvCacheGaac, SameBitsAsABf16CacheAndEachBlockInItsClass) {
  for (int64_t n : {1, 3, 17, 129, 501}) {
    SCOPED_TRACE(n);
    KvCache raw(small_config());
    KvCache gaac(gaac_config());
    const SeqId a = raw.create_sequence(), b = gaac.create_sequence();
    KvSource source(small_config(), uint32_t(n));
    append_to_all({&raw, &gaac}, {a, b}, n, source);
    expect_same_bits(gaac, b, raw, a);
    const ClassCounts counts = check_classes(gaac, b);
    if (n >= 129) {
      EXPECT_GT(counts.gaac, 0u);
      EXPECT_GT(counts.raw, 8u);  // fallbacks besides the 8 tails
    }
    // The raw cache holds only raw pages.
    for (const PageRef& ref : std::vector<PageRef>(raw.block_table(a, 1, KvTensor::kValue, 1),
                                                   raw.block_table(a, 1, KvTensor::kValue, 1) + raw.n_blocks(a))) {
      EXPECT_EQ(ref.storage, StorageClass::kBf16);
    }
  }
}

TEST(KvCacheGaac, TheTailIsFinalizedByTheWriteOfItsLastRow) {
  KvCache cache(gaac_config(kEveryBlockFits));  // every block fits
  const SeqId seq = cache.create_sequence();
  KvSource source(small_config());
  std::vector<float> k, v;
  for (int64_t pos = 0; pos < 8; ++pos) {
    cache.reserve(seq, 1);
    for (int layer = 0; layer < 2; ++layer) {
      source.fill(layer, pos, 1, k, v);
      cache.write(seq, layer, k.data(), v.data(), 1);
      // The block of `pos` is encoded exactly when its 4th row is written.
      const StorageClass want = pos % 4 == 3 ? StorageClass::kGaac : StorageClass::kBf16;
      EXPECT_EQ(cache.block_table(seq, layer, KvTensor::kKey, 1)[pos / 4].storage, want) << pos;
    }
    cache.commit(seq, 1);
  }
  const MemoryStats stats = cache.memory_stats();
  ASSERT_EQ(stats.by_class.size(), 2u);
  EXPECT_EQ(stats.by_class[0].pages_in_use, 0u);   // the raw tails went back to the pool
  EXPECT_EQ(stats.by_class[1].pages_in_use, 16u);  // 2 blocks x 8 tables
}

TEST(KvCacheGaac, PrefillEncodesWholeBlocksWithoutRawPages) {
  KvCache cache(gaac_config(kEveryBlockFits));
  const SeqId seq = cache.create_sequence();
  KvSource source(small_config());
  std::vector<float> k, v;
  constexpr int64_t kTokens = 4 * 40 + 2;  // 40 whole blocks and a partial one
  cache.reserve(seq, kTokens);
  EXPECT_EQ(cache.memory_stats().bytes_reserved_from_allocator, 0u);  // pending until written
  for (int layer = 0; layer < 2; ++layer) {
    source.fill(layer, 0, kTokens, k, v);
    cache.write(seq, layer, k.data(), v.data(), kTokens);
  }
  cache.commit(seq, kTokens);
  const ClassCounts counts = check_classes(cache, seq);
  EXPECT_EQ(counts.gaac, 40u * 8);
  EXPECT_EQ(counts.raw, 8u);
  // The raw pool only ever held the 8 tails: one chunk of one block per table.
  const PagePool& raw = cache.pool(StorageClass::kBf16);
  EXPECT_EQ(raw.pages_obtained(), 8u);
  EXPECT_EQ(raw.pages_in_use(), 8u);
}

TEST(KvCacheGaac, MemoryIsMeasuredPerClassFromThePools) {
  KvCache gaac(gaac_config());
  KvCache raw(small_config());
  const SeqId b = gaac.create_sequence(), a = raw.create_sequence();
  KvSource source(small_config(), 7);
  append_to_all({&raw, &gaac}, {a, b}, 900, source);
  const ClassCounts counts = check_classes(gaac, b);
  const MemoryStats stats = gaac.memory_stats();
  ASSERT_EQ(stats.by_class.size(), 2u);
  const StorageClassStats& r = stats.by_class[0];
  const StorageClassStats& g = stats.by_class[1];
  EXPECT_EQ(r.storage, StorageClass::kBf16);
  EXPECT_EQ(g.storage, StorageClass::kGaac);
  EXPECT_EQ(g.pages_in_use, counts.gaac);
  EXPECT_EQ(r.pages_in_use, counts.raw);
  EXPECT_EQ(g.n_pools, gaac.n_slot_pools());
  uint64_t slot_bytes = 0, slot_in_use = 0;
  for (size_t i = 0; i < gaac.n_slot_pools(); ++i) {
    slot_bytes += gaac.slot_pool(i).bytes_from_allocator();
    slot_in_use += uint64_t(gaac.slot_pool(i).pages_in_use()) * gaac.slot_pool(i).page_stride_bytes();
  }
  EXPECT_EQ(g.bytes_reserved_from_allocator, slot_bytes);
  EXPECT_EQ(g.page_bytes_in_use, slot_in_use);
  EXPECT_EQ(r.bytes_reserved_from_allocator, gaac.pool(StorageClass::kBf16).bytes_from_allocator());
  EXPECT_EQ(stats.bytes_reserved_from_allocator,
            r.bytes_reserved_from_allocator + g.bytes_reserved_from_allocator);
  EXPECT_EQ(stats.pages_in_use, counts.gaac + counts.raw);
  // Slots of head_dim 16 x 4 tokens: 64 + 24 + 2 fixed bytes + 8 escape bytes -> 98, stride 112;
  // a raw page is 128 bytes.
  EXPECT_EQ(gaac.gaac_slot_bytes(0, KvTensor::kKey), 98u);
  EXPECT_EQ(gaac.slot_pool(0).page_stride_bytes(), 112u);
  EXPECT_LT(stats.bytes_in_use, raw.memory_stats().bytes_in_use);
}

TEST(KvCacheGaac, OnePoolPerDistinctSlotStride) {
  KvCacheConfig cfg = small_config();
  cfg.scheme = KvScheme::kGaac;
  auto cal = std::make_shared<codec::GaacCalibration>(*calibration_for(cfg, 8));
  cal->set_escape_capacity_bytes(0, 0, 8);   // 98 -> stride 112
  cal->set_escape_capacity_bytes(0, 1, 20);  // 110 -> 112
  cal->set_escape_capacity_bytes(1, 0, 30);  // 120 -> 128
  cal->set_escape_capacity_bytes(1, 1, 0);   // 90 -> 96
  cfg.gaac_calibration = cal;
  KvCache cache(cfg);
  EXPECT_EQ(cache.n_slot_pools(), 3u);
  EXPECT_EQ(cache.gaac_slot_bytes(0, KvTensor::kValue), 110u);
  EXPECT_EQ(cache.gaac_slot_bytes(1, KvTensor::kKey), 120u);
  std::set<size_t> strides;
  for (size_t i = 0; i < cache.n_slot_pools(); ++i) strides.insert(cache.slot_pool(i).page_stride_bytes());
  EXPECT_EQ(strides, (std::set<size_t>{96, 112, 128}));
  const SeqId seq = cache.create_sequence();
  KvSource source(small_config(), 3);
  KvCache raw(small_config());
  const SeqId r = raw.create_sequence();
  append_to_all({&raw, &cache}, {r, seq}, 77, source);
  expect_same_bits(cache, seq, raw, r);
  check_classes(cache, seq);
}

TEST(KvCacheGaac, ForkSharesFinalizedSlotsAndCopiesTheRawTail) {
  KvCache cache(gaac_config(kEveryBlockFits));
  KvCache raw(small_config());
  const SeqId a = cache.create_sequence(), ra = raw.create_sequence();
  KvSource source(small_config(), 11);
  append_to_all({&raw, &cache}, {ra, a}, 10, source);  // blocks 0, 1 finalized; block 2 a tail
  const uint64_t in_use = cache.memory_stats().pages_in_use;
  const SeqId b = cache.fork_sequence(a);
  const SeqId rb = raw.fork_sequence(ra);
  EXPECT_EQ(cache.memory_stats().pages_in_use, in_use);
  const PageRef* ta = cache.block_table(a, 1, KvTensor::kKey, 0);
  EXPECT_EQ(ta[0].storage, StorageClass::kGaac);
  EXPECT_EQ(cache.ref_count(ta[0]), 2u);
  EXPECT_EQ(cache.ref_count(ta[2]), 2u);
  KvSource child_source(small_config(), 12);
  append_to_all({&raw, &cache}, {rb, b}, 7, child_source);  // copies the tail, finalizes it
  expect_same_bits(cache, b, raw, rb);
  expect_same_bits(cache, a, raw, ra);
  const PageRef* tb = cache.block_table(b, 1, KvTensor::kKey, 0);
  EXPECT_EQ(tb[0].page, ta[0].page);
  EXPECT_EQ(tb[2].storage, StorageClass::kGaac);
  EXPECT_EQ(ta[2].storage, StorageClass::kBf16);
  EXPECT_EQ(cache.ref_count(ta[2]), 1u);
  cache.free_sequence(a);
  raw.free_sequence(ra);
  EXPECT_EQ(cache.ref_count(tb[0]), 1u);
  expect_same_bits(cache, b, raw, rb);
  cache.free_sequence(b);
  const MemoryStats stats = cache.memory_stats();
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_GT(stats.pages_free, 0u);
}

TEST(KvCacheGaac, RewritesWithinAStepKeepTheLastValues) {
  KvCacheConfig cfg = gaac_config(kEveryBlockFits);
  KvCache cache(cfg);
  KvCache raw(small_config());
  const SeqId seq = cache.create_sequence(), r = raw.create_sequence();
  KvSource first(small_config(), 21), second(small_config(), 22);
  std::vector<float> k1, v1, k2, v2;
  cache.reserve(seq, 8);
  raw.reserve(r, 8);
  for (int layer = 0; layer < 2; ++layer) {
    first.fill(layer, 0, 8, k1, v1);
    second.fill(layer, 0, 8, k2, v2);
    // Layer 0: two whole writes (the second re-encodes); layer 1: a whole write, then a partial
    // one over rows 0..2 of the encoded block 0 (which goes back to a raw page).
    cache.write(seq, layer, k1.data(), v1.data(), 8);
    const int64_t n2 = layer == 0 ? 8 : 3;
    cache.write(seq, layer, k2.data(), v2.data(), n2);
    raw.write(r, layer, k1.data(), v1.data(), 8);
    raw.write(r, layer, k2.data(), v2.data(), n2);
  }
  cache.commit(seq, 8);
  raw.commit(r, 8);
  expect_same_bits(cache, seq, raw, r);
  EXPECT_EQ(cache.block_table(seq, 0, KvTensor::kKey, 0)[0].storage, StorageClass::kGaac);
  EXPECT_EQ(cache.block_table(seq, 1, KvTensor::kKey, 0)[0].storage, StorageClass::kBf16);
  EXPECT_EQ(cache.block_table(seq, 1, KvTensor::kKey, 0)[1].storage, StorageClass::kGaac);
}

TEST(KvCacheGaac, PendingBlocksCountAgainstTheCapacity) {
  KvCacheConfig cfg = gaac_config();
  cfg.max_tokens = 8;  // two blocks per table
  KvCache cache(cfg);
  const SeqId a = cache.create_sequence();
  const SeqId b = cache.create_sequence();
  cache.reserve(a, 8);
  try {
    cache.reserve(b, 1);
    FAIL() << "reserve beyond the capacity accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("max_tokens"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.reserved_tokens(b), 0);
  cache.free_sequence(a);  // drops the pending blocks
  KvCache raw(small_config());
  const SeqId r = raw.create_sequence();
  KvSource source(small_config());
  append_to_all({&raw, &cache}, {r, b}, 8, source);
  expect_same_bits(cache, b, raw, r);
}

TEST(KvCacheGaac, BadConfigurationsAreClearErrors) {
  auto expect_error = [](StatusCode code, const char* needle, const KvCacheConfig& cfg) {
    try {
      KvCache cache(cfg);
      ADD_FAILURE() << "accepted; expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  KvCacheConfig cfg = gaac_config();
  cfg.gaac_calibration = nullptr;
  expect_error(StatusCode::kInvalidArgument, "calibration", cfg);

  cfg = gaac_config();
  cfg.n_layers = 3;  // the calibration has 2
  expect_error(StatusCode::kInvalidArgument, "n_layers 2", cfg);
  expect_error(StatusCode::kInvalidArgument, "another model", cfg);
  cfg = gaac_config();
  cfg.block_tokens = 8;
  expect_error(StatusCode::kInvalidArgument, "block_tokens 4", cfg);
  cfg = gaac_config();
  cfg.head_dim = 200;  // 2 tiles of 100 channels: not a GAAC tiling
  expect_error(StatusCode::kUnsupported, "head_dim 200", cfg);

  codec::GaacShape fp8;
  fp8.n_layers = 2;
  fp8.n_kv_heads = 2;
  fp8.head_dim = 16;
  fp8.block_tokens = 4;
  fp8.element = format::GaacElement::kFp8E5M2;
  cfg = gaac_config();
  cfg.gaac_calibration = std::make_shared<codec::GaacCalibration>(fp8);
  expect_error(StatusCode::kInvalidArgument, "e5m2", cfg);

  KvCache raw(small_config());
  EXPECT_THROW(raw.gaac_bases(0, KvTensor::kKey, 0), Error);
  EXPECT_THROW(raw.gaac_slot_bytes(0, KvTensor::kKey), Error);
  KvCache gaac(gaac_config());
  EXPECT_THROW(gaac.slot_pool(99), Error);
  EXPECT_THROW(gaac.pool(StorageClass::kGaac), Error);
  PageRef bogus{};
  bogus.page = 0;
  bogus.storage = StorageClass::kGaac;
  bogus.pool = 200;
  EXPECT_THROW(gaac.page_bytes_of(bogus), Error);
  EXPECT_EQ(gaac.ref_count(bogus), 0u);
}

}  // namespace
}  // namespace certkv::cache
