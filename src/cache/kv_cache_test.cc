#include "cache/kv_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "format/numeric.h"

namespace certkv::cache {
namespace {

using format::PageRef;

KvCacheConfig small_config() {
  KvCacheConfig c;
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.block_tokens = 4;
  c.max_tokens = 64;
  return c;
}

// An integer (exact in bf16) that differs between layer, K/V, head, position and channel.
float value_at(int layer, KvTensor kv, int head, int64_t pos, int c, int salt = 0) {
  return float((pos * 7 + c * 3 + head * 11 + layer * 5 + int(kv) * 13 + salt * 17) % 61 - 30);
}

// Writes positions [length, length + n) of every layer with value_at(..., salt) and commits.
void append(KvCache& cache, SeqId seq, int64_t n, int salt = 0) {
  const KvCacheConfig& cfg = cache.config();
  const int64_t pos0 = cache.length(seq);
  cache.reserve(seq, n);
  std::vector<float> k(size_t(n) * cfg.n_kv_heads * cfg.head_dim), v(k.size());
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    for (int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        for (int c = 0; c < cfg.head_dim; ++c) {
          const size_t at = (size_t(i) * cfg.n_kv_heads + h) * cfg.head_dim + c;
          k[at] = value_at(layer, KvTensor::kKey, h, pos0 + i, c, salt);
          v[at] = value_at(layer, KvTensor::kValue, h, pos0 + i, c, salt);
        }
      }
    }
    cache.write(seq, layer, k.data(), v.data(), n);
  }
  cache.commit(seq, n);
}

// Checks positions [begin, end) of every (layer, K/V, head) hold value_at(..., salt).
void expect_values(const KvCache& cache, SeqId seq, int64_t begin, int64_t end, int salt = 0) {
  const KvCacheConfig& cfg = cache.config();
  std::vector<float> out(size_t(end - begin) * cfg.head_dim);
  int n_nonzero = 0;
  for (int layer = 0; layer < cfg.n_layers; ++layer) {
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        cache.read_token_range_ref(seq, layer, kv, h, begin, end, out.data());
        for (int64_t p = begin; p < end; ++p) {
          for (int c = 0; c < cfg.head_dim; ++c) {
            const float got = out[size_t(p - begin) * cfg.head_dim + c];
            ASSERT_EQ(got, value_at(layer, kv, h, p, c, salt))
                << "layer " << layer << " kv " << int(kv) << " head " << h << " pos " << p
                << " channel " << c;
            n_nonzero += got != 0.f;
          }
        }
      }
    }
  }
  // The check must be able to fail: the data is not all zero.
  if (end > begin) {
    EXPECT_GT(n_nonzero, 0);
  }
}

std::vector<uint32_t> pages_of(const KvCache& cache, SeqId seq, int layer, KvTensor kv, int h) {
  const PageRef* table = cache.block_table(seq, layer, kv, h);
  std::vector<uint32_t> pages;
  for (int64_t b = 0; b < cache.n_blocks(seq); ++b) pages.push_back(table[b].page);
  return pages;
}

TEST(KvCache, AppendGrowsBlockTablesAndReadsBack) {
  KvCache cache(small_config());
  const SeqId seq = cache.create_sequence();
  EXPECT_EQ(cache.length(seq), 0);
  EXPECT_EQ(cache.n_blocks(seq), 0);
  append(cache, seq, 3);
  EXPECT_EQ(cache.length(seq), 3);
  EXPECT_EQ(cache.n_blocks(seq), 1);
  append(cache, seq, 1);
  EXPECT_EQ(cache.n_blocks(seq), 1);
  append(cache, seq, 6);  // positions 4..9: blocks 1 and 2
  EXPECT_EQ(cache.length(seq), 10);
  EXPECT_EQ(cache.n_blocks(seq), 3);
  expect_values(cache, seq, 0, 10);
  // Every (layer, K/V, head, block) has its own page.
  std::set<uint32_t> all;
  for (int layer = 0; layer < 2; ++layer) {
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
      for (int h = 0; h < 2; ++h) {
        const PageRef* table = cache.block_table(seq, layer, kv, h);
        for (int64_t b = 0; b < 3; ++b) {
          EXPECT_EQ(table[b].storage, format::StorageClass::kBf16);
          EXPECT_EQ(cache.ref_count(table[b]), 1u);
          all.insert(table[b].page);
        }
      }
    }
  }
  EXPECT_EQ(all.size(), 2u * 2 * 2 * 3);
  EXPECT_EQ(cache.memory_stats().pages_in_use, 24u);
}

TEST(KvCache, PageLayoutIsTokenMajorBf16) {
  KvCache cache(small_config());
  const SeqId seq = cache.create_sequence();
  append(cache, seq, 6);
  const PageRef* table = cache.block_table(seq, 1, KvTensor::kValue, 1);
  const uint16_t* page = cache.page_bf16(table[1]);  // positions 4..7
  for (int row = 0; row < 2; ++row) {
    for (int c = 0; c < 8; ++c) {
      EXPECT_EQ(page[row * 8 + c], format::float_to_bf16(value_at(1, KvTensor::kValue, 1, 4 + row, c)));
    }
  }
}

TEST(KvCache, StoresBf16RoundedToNearestEven) {
  KvCacheConfig cfg = small_config();
  cfg.n_layers = 1;
  cfg.n_kv_heads = 1;
  KvCache cache(cfg);
  const SeqId seq = cache.create_sequence();
  // bf16 keeps 7 fraction bits: near 1 the step is 2^-7.
  const float half_step = std::ldexp(1.f, -8);
  const float k[8] = {1.f + half_step,                        // tie -> 1 (even)
                      1.f + 3 * half_step,                    // tie -> 1 + 2^-6 (even)
                      1.f + half_step + std::ldexp(1.f, -20),  // above the tie -> 1 + 2^-7
                      -(1.f + half_step),                     // tie -> -1
                      3.14159265f,
                      -1e-20f,
                      65504.f,
                      0.f};
  const float expected[8] = {1.f,
                             1.f + std::ldexp(1.f, -6),
                             1.f + std::ldexp(1.f, -7),
                             -1.f,
                             3.140625f,
                             format::bf16_to_float(format::float_to_bf16(-1e-20f)),
                             65536.f,
                             0.f};
  const float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  cache.reserve(seq, 1);
  cache.write(seq, 0, k, v, 1);
  cache.commit(seq, 1);
  float out[8];
  cache.read_token_range_ref(seq, 0, KvTensor::kKey, 0, 0, 1, out);
  for (int c = 0; c < 8; ++c) EXPECT_EQ(out[c], expected[c]) << "channel " << c;
  EXPECT_NE(out[5], 0.f);
  EXPECT_LT(std::fabs(out[5] + 1e-20f), 1e-22f);
}

TEST(KvCache, ForkSharesBlocksAndCopiesASharedTailOnWrite) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  append(cache, a, 6);  // block 0 full, block 1 holds 2 of 4 tokens
  const uint64_t in_use_before = cache.memory_stats().pages_in_use;
  const SeqId b = cache.fork_sequence(a);
  EXPECT_EQ(cache.length(b), 6);
  EXPECT_EQ(cache.memory_stats().pages_in_use, in_use_before);  // nothing copied yet
  for (int layer = 0; layer < 2; ++layer) {
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue}) {
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(pages_of(cache, a, layer, kv, h), pages_of(cache, b, layer, kv, h));
        for (int64_t blk = 0; blk < 2; ++blk) {
          EXPECT_EQ(cache.ref_count(cache.block_table(b, layer, kv, h)[blk]), 2u);
        }
      }
    }
  }
  expect_values(cache, b, 0, 6);

  const std::vector<uint32_t> a_pages = pages_of(cache, a, 0, KvTensor::kKey, 1);
  append(cache, b, 1, /*salt=*/1);  // writes the shared tail: copy first
  const std::vector<uint32_t> b_pages = pages_of(cache, b, 0, KvTensor::kKey, 1);
  EXPECT_EQ(b_pages[0], a_pages[0]);
  EXPECT_NE(b_pages[1], a_pages[1]);
  EXPECT_EQ(cache.memory_stats().pages_in_use, in_use_before + 8);  // one copy per table
  EXPECT_EQ(cache.ref_count(cache.block_table(a, 0, KvTensor::kKey, 1)[1]), 1u);
  EXPECT_EQ(cache.ref_count(cache.block_table(b, 0, KvTensor::kKey, 1)[1]), 1u);
  EXPECT_EQ(cache.ref_count(cache.block_table(b, 0, KvTensor::kKey, 1)[0]), 2u);
  // The copy carried the shared prefix; the parent does not see the child's token.
  expect_values(cache, b, 0, 6);
  expect_values(cache, b, 6, 7, /*salt=*/1);
  expect_values(cache, a, 0, 6);

  // The parent's tail is no longer shared: it writes in place.
  append(cache, a, 1, /*salt=*/2);
  EXPECT_EQ(pages_of(cache, a, 0, KvTensor::kKey, 1), a_pages);
  expect_values(cache, a, 6, 7, /*salt=*/2);
  expect_values(cache, b, 6, 7, /*salt=*/1);
}

TEST(KvCache, ForkAtABlockBoundaryCopiesNothing) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  append(cache, a, 8);
  const SeqId b = cache.fork_sequence(a);
  const uint64_t in_use = cache.memory_stats().pages_in_use;
  append(cache, b, 1, 1);
  EXPECT_EQ(cache.memory_stats().pages_in_use, in_use + 8);  // one new block per table
  const std::vector<uint32_t> a_pages = pages_of(cache, a, 1, KvTensor::kValue, 0);
  const std::vector<uint32_t> b_pages = pages_of(cache, b, 1, KvTensor::kValue, 0);
  ASSERT_EQ(b_pages.size(), 3u);
  EXPECT_EQ(b_pages[0], a_pages[0]);
  EXPECT_EQ(b_pages[1], a_pages[1]);
  expect_values(cache, b, 0, 8);
  expect_values(cache, b, 8, 9, 1);
}

TEST(KvCache, PagesReferencedCountsAPageSharedAmongTheSequencesOnce) {
  KvCache cache(small_config());  // 2 layers x K/V x 2 kv heads: 8 tables, 4-token blocks
  const SeqId a = cache.create_sequence();
  append(cache, a, 8);
  const SeqId b = cache.fork_prefix(a, 4);
  append(cache, b, 3, 1);
  const std::vector<SeqId> none, only_a{a}, only_b{b}, both{a, b};
  EXPECT_EQ(cache.pages_referenced(none), 0u);
  EXPECT_EQ(cache.pages_referenced(only_a), 16u);
  EXPECT_EQ(cache.pages_referenced(only_b), 16u);  // block 0 shared with a, block 1 its own
  EXPECT_EQ(cache.pages_referenced(both), 24u);
  EXPECT_EQ(cache.pages_referenced(both), cache.memory_stats().pages_in_use);
  cache.free_sequence(a);
  EXPECT_EQ(cache.pages_referenced(only_b), 16u);
  EXPECT_EQ(cache.memory_stats().pages_in_use, 16u);
  EXPECT_THROW(cache.pages_referenced(only_a), Error);
}

TEST(KvCache, ForkRefusesAnUncommittedReservation) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  append(cache, a, 3);
  cache.reserve(a, 2);
  try {
    cache.fork_sequence(a);
    FAIL() << "fork with a pending reservation accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("uncommitted"), std::string::npos) << e.what();
  }
}

TEST(KvCache, FreeReleasesPagesAndSharedPagesSurvive) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  append(cache, a, 9);
  const SeqId b = cache.fork_sequence(a);
  cache.free_sequence(a);
  EXPECT_FALSE(cache.has_sequence(a));
  EXPECT_EQ(cache.n_sequences(), 1u);
  for (int64_t blk = 0; blk < 3; ++blk) {
    EXPECT_EQ(cache.ref_count(cache.block_table(b, 0, KvTensor::kKey, 0)[blk]), 1u);
  }
  expect_values(cache, b, 0, 9);
  cache.free_sequence(b);
  const MemoryStats stats = cache.memory_stats();
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_EQ(stats.pages_free, cache.pool(format::StorageClass::kBf16).pages_obtained());
  EXPECT_EQ(stats.block_table_bytes, 0u);
  EXPECT_THROW(cache.length(a), Error);
}

TEST(KvCache, FreedPagesAreReused) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  append(cache, a, 12);
  const std::set<uint32_t> a_pages = [&] {
    std::set<uint32_t> s;
    for (int layer = 0; layer < 2; ++layer)
      for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue})
        for (int h = 0; h < 2; ++h)
          for (uint32_t p : pages_of(cache, a, layer, kv, h)) s.insert(p);
    return s;
  }();
  const uint64_t bytes = cache.memory_stats().bytes_reserved_from_allocator;
  cache.free_sequence(a);
  const SeqId b = cache.create_sequence();
  append(cache, b, 12, 3);
  std::set<uint32_t> b_pages;
  for (int layer = 0; layer < 2; ++layer)
    for (KvTensor kv : {KvTensor::kKey, KvTensor::kValue})
      for (int h = 0; h < 2; ++h)
        for (uint32_t p : pages_of(cache, b, layer, kv, h)) b_pages.insert(p);
  EXPECT_EQ(b_pages, a_pages);
  EXPECT_EQ(cache.memory_stats().bytes_reserved_from_allocator, bytes);
  expect_values(cache, b, 0, 12, 3);
}

TEST(KvCache, CapacityExhaustionIsACleanErrorAndLeavesTheSequenceUnchanged) {
  KvCacheConfig cfg = small_config();
  cfg.max_tokens = 8;  // two blocks per (layer, K/V, head)
  KvCache cache(cfg);
  const SeqId a = cache.create_sequence();
  append(cache, a, 3);  // the first block of every table
  const SeqId b = cache.create_sequence();
  append(cache, b, 1);  // the second block of every table
  try {
    cache.reserve(b, 4);
    FAIL() << "reserve beyond the capacity accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("max_tokens"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.n_blocks(b), 1);
  EXPECT_EQ(cache.reserved_tokens(b), 1);
  append(cache, b, 3);  // still fits in its block
  expect_values(cache, b, 0, 4);
  cache.free_sequence(a);
  append(cache, b, 4);
  EXPECT_EQ(cache.length(b), 8);
}

TEST(KvCache, MemoryAccountingFollowsTheAllocator) {
  KvCacheConfig cfg = small_config();
  cfg.pages_per_chunk = 8;  // one block of every (layer, K/V, head) per chunk
  cfg.max_tokens = 1000;
  KvCache cache(cfg);
  const PagePool& pool = cache.pool(format::StorageClass::kBf16);
  EXPECT_EQ(cache.page_bytes(), 4u * 8 * 2);
  EXPECT_EQ(pool.page_stride_bytes(), 64u);
  MemoryStats stats = cache.memory_stats();
  EXPECT_EQ(stats.bytes_reserved_from_allocator, 0u);
  const SeqId seq = cache.create_sequence();
  for (int64_t n = 1; n <= 40; ++n) {
    append(cache, seq, 1);
    stats = cache.memory_stats();
    const uint64_t blocks = uint64_t((n + 3) / 4);
    ASSERT_EQ(stats.by_class.size(), 1u);
    EXPECT_EQ(stats.by_class[0].storage, format::StorageClass::kBf16);
    EXPECT_EQ(stats.bytes_reserved_from_allocator, pool.bytes_from_allocator());
    EXPECT_EQ(stats.bytes_reserved_from_allocator, blocks * 8 * 64);  // whole chunks
    EXPECT_EQ(stats.pages_in_use, blocks * 8);
    EXPECT_EQ(stats.block_table_bytes, blocks * 8 * sizeof(PageRef));
    EXPECT_EQ(stats.bytes_in_use, blocks * 8 * 64 + stats.block_table_bytes);
    EXPECT_EQ(stats.pages_free, 0u);
  }
  // 2 (K, V) * 2 layers * 2 heads * 8 channels * 2 bytes per token.
  EXPECT_EQ(cache.kv_bytes_bf16(40), 40u * 128);
  EXPECT_EQ(cache.kv_bytes_bf16(1), 128u);
}

TEST(KvCache, DefaultChunkHoldsFourBlocksOfEveryTable) {
  KvCache cache(small_config());  // 8 tables, capacity 16 blocks each
  const SeqId seq = cache.create_sequence();
  append(cache, seq, 1);
  EXPECT_EQ(cache.pool(format::StorageClass::kBf16).pages_per_chunk(), 32u);
  EXPECT_EQ(cache.memory_stats().bytes_reserved_from_allocator, 32u * 64);
  EXPECT_EQ(cache.memory_stats().pages_free, 24u);
}

TEST(KvCache, WrittenTokensRunAheadOfLengthDuringAStep) {
  KvCache cache(small_config());
  const SeqId seq = cache.create_sequence();
  append(cache, seq, 3);
  cache.reserve(seq, 5);
  EXPECT_EQ(cache.reserved_tokens(seq), 8);
  std::vector<float> k(5 * 2 * 8, 1.5f), v(5 * 2 * 8, -2.5f);
  cache.write(seq, 0, k.data(), v.data(), 5);
  EXPECT_EQ(cache.length(seq), 3);
  EXPECT_EQ(cache.written_tokens(seq, 0), 8);
  EXPECT_EQ(cache.written_tokens(seq, 1), 3);
  std::vector<float> out(8 * 8);
  cache.read_token_range_ref(seq, 0, KvTensor::kValue, 1, 0, 8, out.data());
  EXPECT_EQ(out[7 * 8 + 3], -2.5f);
  EXPECT_THROW(cache.read_token_range_ref(seq, 1, KvTensor::kValue, 1, 0, 4, out.data()), Error);
  // Commit needs every layer written.
  try {
    cache.commit(seq, 5);
    FAIL() << "commit with layer 1 unwritten accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
  }
  cache.write(seq, 1, k.data(), v.data(), 5);
  cache.commit(seq, 5);
  EXPECT_EQ(cache.length(seq), 8);
}

TEST(KvCache, BadArgumentsAreErrors) {
  KvCache cache(small_config());
  const SeqId seq = cache.create_sequence();
  append(cache, seq, 2);
  std::vector<float> kv(2 * 8 * 8, 1.f);
  float out[64];
  auto expect_code = [](StatusCode code, const char* needle, auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_code(StatusCode::kNotFound, "sequence 999", [&] { cache.length(999); });
  expect_code(StatusCode::kNotFound, "sequence 999", [&] { cache.reserve(999, 1); });
  expect_code(StatusCode::kNotFound, "sequence 999", [&] { cache.fork_sequence(999); });
  expect_code(StatusCode::kNotFound, "sequence 999", [&] { cache.free_sequence(999); });
  expect_code(StatusCode::kOutOfRange, "layer 2", [&] { cache.write(seq, 2, kv.data(), kv.data(), 1); });
  expect_code(StatusCode::kOutOfRange, "layer -1", [&] { cache.block_table(seq, -1, KvTensor::kKey, 0); });
  expect_code(StatusCode::kOutOfRange, "kv_head 2", [&] { cache.block_table(seq, 0, KvTensor::kKey, 2); });
  expect_code(StatusCode::kOutOfRange, "reserve first", [&] { cache.write(seq, 0, kv.data(), kv.data(), 1); });
  expect_code(StatusCode::kOutOfRange, "beyond its reservation", [&] { cache.commit(seq, 1); });
  expect_code(StatusCode::kOutOfRange, "only [0, 2)", [&] {
    cache.read_token_range_ref(seq, 0, KvTensor::kKey, 0, 1, 3, out);
  });
  expect_code(StatusCode::kInvalidArgument, "reserve of -1", [&] { cache.reserve(seq, -1); });
  expect_code(StatusCode::kInvalidArgument, "write of 0", [&] {
    cache.reserve(seq, 1);
    cache.write(seq, 0, kv.data(), kv.data(), 0);
  });
  PageRef bogus{};
  bogus.page = 12345;
  bogus.storage = format::StorageClass::kBf16;
  expect_code(StatusCode::kInvalidArgument, "page 12345", [&] { cache.page_bf16(bogus); });

  KvCacheConfig cfg = small_config();
  cfg.head_dim = 12;
  expect_code(StatusCode::kUnsupported, "head_dim 12", [&] { KvCache c(cfg); });
  cfg.head_dim = 264;
  expect_code(StatusCode::kUnsupported, "head_dim 264", [&] { KvCache c(cfg); });
  cfg = small_config();
  cfg.block_tokens = 0;
  expect_code(StatusCode::kInvalidArgument, "block_tokens", [&] { KvCache c(cfg); });
  cfg = small_config();
  cfg.max_tokens = 0;
  expect_code(StatusCode::kInvalidArgument, "max_tokens", [&] { KvCache c(cfg); });
  cfg = small_config();
  cfg.n_layers = 100000;
  cfg.max_tokens = int64_t(1) << 30;
  expect_code(StatusCode::kInvalidArgument, "pages", [&] { KvCache c(cfg); });
}

TEST(KvCache, SequenceIdsAreNotReused) {
  KvCache cache(small_config());
  const SeqId a = cache.create_sequence();
  cache.free_sequence(a);
  const SeqId b = cache.create_sequence();
  EXPECT_NE(a, b);
  EXPECT_THROW(cache.length(a), Error);
}

}  // namespace
}  // namespace certkv::cache
