// A pool of fixed-size pages of one storage class, ref-counted, with a capacity limit and memory
// accounting measured at the system allocator.
//
// Pages are numbered 0, 1, 2, ... in the order the pool first obtains them. Memory comes from the
// system allocator in chunks of `pages_per_chunk` pages (the last chunk is cut to the capacity),
// each chunk 64-byte aligned; a page starts at a multiple of `page_stride_bytes` (page_bytes rounded
// up to `page_align_bytes`, 64 by default) inside its chunk, so every page is that aligned. Chunks are never returned to the
// system before the pool is destroyed; a page whose ref count drops to zero goes to the free list,
// and allocate() takes from the free list before it grows the pool.
//
// Thread safety: not thread-safe. Concurrent data() reads are safe while no thread allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "format/page.h"

namespace certkv::cache {

class PagePool {
 public:
  // REQUIRES: page_bytes >= 1, pages_per_chunk >= 1, page_align_bytes a power of two in
  // [1, 64]. capacity_pages may be 0 (every allocate fails).
  PagePool(format::StorageClass storage, size_t page_bytes, uint32_t capacity_pages,
           uint32_t pages_per_chunk, size_t page_align_bytes = 64);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Returns a page with ref count 1; its bytes are unspecified (a reused page keeps old data).
  // Throws certkv::Error kOutOfMemory when capacity_pages pages are in use, or when the system
  // allocator refuses a chunk.
  uint32_t allocate();
  // REQUIRES: page is in use (ref count >= 1), else certkv::Error kInvalidArgument.
  void retain(uint32_t page);
  // Drops one reference; at zero the page returns to the free list.
  // REQUIRES: page is in use, else certkv::Error kInvalidArgument (a double release).
  void release(uint32_t page);
  // 0 for a page that is free or was never obtained.
  uint32_t ref_count(uint32_t page) const;

  // REQUIRES: page < pages_obtained() (checked: certkv::Error kOutOfRange).
  uint8_t* data(uint32_t page);
  const uint8_t* data(uint32_t page) const;

  format::StorageClass storage() const { return storage_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t page_stride_bytes() const { return page_stride_bytes_; }
  uint32_t capacity_pages() const { return capacity_pages_; }
  uint32_t pages_per_chunk() const { return pages_per_chunk_; }

  // Pages obtained from the system so far (in use + free).
  uint32_t pages_obtained() const { return pages_obtained_; }
  uint32_t pages_in_use() const { return pages_in_use_; }
  uint32_t pages_free() const { return uint32_t(free_list_.size()); }
  // Sum of the sizes of the chunks the system allocator returned (what this pool holds).
  uint64_t bytes_from_allocator() const { return bytes_from_allocator_; }
  size_t n_chunks() const { return chunks_.size(); }

 private:
  struct AlignedDelete {
    void operator()(uint8_t* p) const;
  };

  void grow();

  format::StorageClass storage_;
  size_t page_bytes_;
  size_t page_stride_bytes_;
  uint32_t capacity_pages_;
  uint32_t pages_per_chunk_;
  uint32_t pages_obtained_ = 0;
  uint32_t pages_in_use_ = 0;
  uint64_t bytes_from_allocator_ = 0;
  std::vector<std::unique_ptr<uint8_t[], AlignedDelete>> chunks_;
  std::vector<uint32_t> ref_counts_;  // one per obtained page
  std::vector<uint32_t> free_list_;   // stack: the most recently freed page is reused first
};

}  // namespace certkv::cache
