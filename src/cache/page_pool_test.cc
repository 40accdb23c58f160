#include "cache/page_pool.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "core/status.h"

namespace certkv::cache {
namespace {

using format::StorageClass;

// 112-byte pages (7 tokens x 8 channels x 2 bytes) are not a multiple of 64: the stride is 128.
constexpr size_t kPageBytes = 112;
constexpr size_t kStride = 128;

TEST(PagePool, HandsOutAlignedPagesInOrderAndGrowsInChunks) {
  PagePool pool(StorageClass::kBf16, kPageBytes, /*capacity_pages=*/10, /*pages_per_chunk=*/4);
  EXPECT_EQ(pool.page_stride_bytes(), kStride);
  EXPECT_EQ(pool.bytes_from_allocator(), 0u);
  std::vector<uint32_t> pages;
  for (int i = 0; i < 5; ++i) pages.push_back(pool.allocate());
  EXPECT_EQ(pages, (std::vector<uint32_t>{0, 1, 2, 3, 4}));
  for (uint32_t p : pages) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.data(p)) % 64, 0u) << "page " << p;
    EXPECT_EQ(pool.ref_count(p), 1u);
  }
  EXPECT_EQ(pool.n_chunks(), 2u);
  EXPECT_EQ(pool.bytes_from_allocator(), 2 * 4 * kStride);
  EXPECT_EQ(pool.pages_in_use(), 5u);
  EXPECT_EQ(pool.pages_free(), 3u);
  EXPECT_EQ(pool.pages_obtained(), 8u);
}

TEST(PagePool, PagesDoNotOverlap) {
  PagePool pool(StorageClass::kBf16, kPageBytes, 9, 4);
  std::vector<uint32_t> pages;
  for (int i = 0; i < 9; ++i) {
    pages.push_back(pool.allocate());
    std::memset(pool.data(pages.back()), 0x10 + i, kPageBytes);
  }
  for (int i = 0; i < 9; ++i) {
    const uint8_t* d = pool.data(pages[size_t(i)]);
    for (size_t b = 0; b < kPageBytes; ++b) ASSERT_EQ(d[b], uint8_t(0x10 + i)) << "page " << i;
  }
}

TEST(PagePool, LastChunkIsCutAtCapacityAndExhaustionIsAnError) {
  PagePool pool(StorageClass::kBf16, kPageBytes, 10, 4);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(pool.allocate(), uint32_t(i));
  EXPECT_EQ(pool.n_chunks(), 3u);
  EXPECT_EQ(pool.bytes_from_allocator(), (4 + 4 + 2) * kStride);
  try {
    pool.allocate();
    FAIL() << "allocation beyond the capacity succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("all 10 pages"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.pages_in_use(), 10u);
  pool.release(7);
  EXPECT_EQ(pool.allocate(), 7u);
}

TEST(PagePool, RefCountsAndDoubleRelease) {
  PagePool pool(StorageClass::kBf16, kPageBytes, 4, 4);
  const uint32_t p = pool.allocate();
  pool.retain(p);
  pool.retain(p);
  EXPECT_EQ(pool.ref_count(p), 3u);
  pool.release(p);
  pool.release(p);
  EXPECT_EQ(pool.ref_count(p), 1u);
  EXPECT_EQ(pool.pages_in_use(), 1u);
  pool.release(p);
  EXPECT_EQ(pool.ref_count(p), 0u);
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_EQ(pool.pages_free(), 4u);
  try {
    pool.release(p);
    FAIL() << "double release accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("not in use"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pool.retain(p), Error);
  EXPECT_THROW(pool.retain(99), Error);
  EXPECT_THROW(pool.data(99), Error);
}

TEST(PagePool, ReleasedPagesAreReusedBeforeGrowing) {
  PagePool pool(StorageClass::kBf16, kPageBytes, 100, 4);
  std::vector<uint32_t> pages;
  for (int i = 0; i < 4; ++i) pages.push_back(pool.allocate());
  const uint64_t bytes = pool.bytes_from_allocator();
  pool.release(pages[1]);
  pool.release(pages[3]);
  // Most recently freed first.
  EXPECT_EQ(pool.allocate(), pages[3]);
  EXPECT_EQ(pool.allocate(), pages[1]);
  EXPECT_EQ(pool.bytes_from_allocator(), bytes);
  EXPECT_EQ(pool.n_chunks(), 1u);
  EXPECT_EQ(pool.allocate(), 4u);
  EXPECT_EQ(pool.n_chunks(), 2u);
}

TEST(PagePool, ZeroCapacityRefusesEveryAllocation) {
  PagePool pool(StorageClass::kBf16, kPageBytes, 0, 4);
  EXPECT_THROW(pool.allocate(), Error);
  EXPECT_EQ(pool.bytes_from_allocator(), 0u);
}

TEST(PagePool, BadConstructionArguments) {
  EXPECT_THROW(PagePool(StorageClass::kBf16, 0, 4, 4), Error);
  EXPECT_THROW(PagePool(StorageClass::kBf16, kPageBytes, 4, 0), Error);
  for (size_t align : {size_t(0), size_t(3), size_t(48), size_t(128)}) {
    EXPECT_THROW(PagePool(StorageClass::kGaac, kPageBytes, 4, 4, align), Error) << align;
  }
}

TEST(PagePool, SmallerAlignmentPacksSlotsTighter) {
  // A GAAC slot of SmolLM2's shape: 1440 fixed bytes + 37 escape bytes.
  constexpr size_t kSlotBytes = 1477;
  PagePool packed(StorageClass::kGaac, kSlotBytes, 16, 8, /*page_align_bytes=*/16);
  PagePool padded(StorageClass::kGaac, kSlotBytes, 16, 8);
  EXPECT_EQ(packed.page_stride_bytes(), 1488u);
  EXPECT_EQ(padded.page_stride_bytes(), 1536u);
  PagePool unaligned(StorageClass::kGaac, kSlotBytes, 16, 8, 1);
  EXPECT_EQ(unaligned.page_stride_bytes(), kSlotBytes);
  const uint32_t a = packed.allocate(), b = packed.allocate();
  EXPECT_EQ(packed.data(b) - packed.data(a), 1488);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(packed.data(b)) % 16, 0u);
  EXPECT_EQ(packed.bytes_from_allocator(), 8u * 1488u);
}

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
// The pool's byte count is what the C library's heap actually handed out: measure the heap
// (arena plus mmap'ed blocks) around the growth of one chunk.
TEST(PagePool, AccountingMatchesTheHeapMeasurement) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator is not visible to mallinfo2";
#endif
  constexpr uint32_t kPagesPerChunk = 512;  // 64 KiB: below and above the usual mmap threshold
  for (uint32_t pages_per_chunk : {kPagesPerChunk, 8 * kPagesPerChunk}) {
    PagePool pool(StorageClass::kBf16, kPageBytes, 4 * pages_per_chunk, pages_per_chunk);
    const struct mallinfo2 before = mallinfo2();
    pool.allocate();
    const struct mallinfo2 after = mallinfo2();
    const int64_t heap_growth = int64_t(after.uordblks + after.hblkhd) -
                                int64_t(before.uordblks + before.hblkhd);
    const int64_t counted = int64_t(pool.bytes_from_allocator());
    EXPECT_EQ(counted, int64_t(pages_per_chunk * kStride));
    // The heap adds its header, alignment padding and (for mmap) page rounding; the free list
    // and ref-count vectors also come from the heap: a few bytes per page.
    EXPECT_GE(heap_growth, counted);
    EXPECT_LE(heap_growth, counted + 4096 + 16 * int64_t(pages_per_chunk)) << "heap grew by "
                                                                          << heap_growth;
  }
}
#endif

}  // namespace
}  // namespace certkv::cache
