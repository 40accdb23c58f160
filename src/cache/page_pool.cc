#include "cache/page_pool.h"

#include <algorithm>
#include <new>
#include <string>

#include "core/status.h"

namespace certkv::cache {

namespace {

constexpr size_t kChunkAlignBytes = 64;

std::string pool_name(format::StorageClass storage) {
  return std::string("page pool (") + format::storage_class_name(storage) + ")";
}

}  // namespace

void PagePool::AlignedDelete::operator()(uint8_t* p) const {
  ::operator delete[](p, std::align_val_t(kChunkAlignBytes));
}

PagePool::PagePool(format::StorageClass storage, size_t page_bytes, uint32_t capacity_pages,
                   uint32_t pages_per_chunk, size_t page_align_bytes)
    : storage_(storage),
      page_bytes_(page_bytes),
      capacity_pages_(capacity_pages),
      pages_per_chunk_(pages_per_chunk) {
  if (page_bytes == 0) fail(StatusCode::kInvalidArgument, pool_name(storage) + ": page_bytes is 0");
  if (page_align_bytes == 0 || page_align_bytes > kChunkAlignBytes ||
      (page_align_bytes & (page_align_bytes - 1)) != 0) {
    fail(StatusCode::kInvalidArgument, pool_name(storage) + ": page_align_bytes " +
                                           std::to_string(page_align_bytes) +
                                           " is not a power of two in [1, 64]");
  }
  page_stride_bytes_ = (page_bytes + page_align_bytes - 1) / page_align_bytes * page_align_bytes;
  if (pages_per_chunk == 0) {
    fail(StatusCode::kInvalidArgument, pool_name(storage) + ": pages_per_chunk is 0");
  }
}

PagePool::~PagePool() = default;

void PagePool::grow() {
  const uint32_t n_pages = std::min(pages_per_chunk_, capacity_pages_ - pages_obtained_);
  const size_t chunk_bytes = size_t(n_pages) * page_stride_bytes_;
  uint8_t* chunk = static_cast<uint8_t*>(
      ::operator new[](chunk_bytes, std::align_val_t(kChunkAlignBytes), std::nothrow));
  if (chunk == nullptr) {
    fail(StatusCode::kOutOfMemory, pool_name(storage_) + ": the system allocator refused a chunk of " +
                                       std::to_string(chunk_bytes) + " bytes");
  }
  chunks_.emplace_back(chunk);
  ref_counts_.resize(size_t(pages_obtained_) + n_pages, 0);
  // Push in reverse so that allocate() hands out the new pages in increasing order.
  for (uint32_t i = n_pages; i > 0; --i) free_list_.push_back(pages_obtained_ + i - 1);
  pages_obtained_ += n_pages;
  bytes_from_allocator_ += chunk_bytes;
}

uint32_t PagePool::allocate() {
  if (free_list_.empty()) {
    if (pages_obtained_ >= capacity_pages_) {
      fail(StatusCode::kOutOfMemory,
           pool_name(storage_) + ": out of pages: all " + std::to_string(capacity_pages_) +
               " pages of the capacity are in use (" + std::to_string(page_stride_bytes_) +
               " bytes each); free sequences or raise the cache's max_tokens");
    }
    grow();
  }
  const uint32_t page = free_list_.back();
  free_list_.pop_back();
  ref_counts_[page] = 1;
  ++pages_in_use_;
  return page;
}

void PagePool::retain(uint32_t page) {
  if (page >= pages_obtained_ || ref_counts_[page] == 0) {
    fail(StatusCode::kInvalidArgument,
         pool_name(storage_) + ": retain of page " + std::to_string(page) + " which is not in use");
  }
  ++ref_counts_[page];
}

void PagePool::release(uint32_t page) {
  if (page >= pages_obtained_ || ref_counts_[page] == 0) {
    fail(StatusCode::kInvalidArgument, pool_name(storage_) + ": release of page " +
                                           std::to_string(page) +
                                           " which is not in use (double release?)");
  }
  if (--ref_counts_[page] == 0) {
    free_list_.push_back(page);
    --pages_in_use_;
  }
}

uint32_t PagePool::ref_count(uint32_t page) const {
  return page < pages_obtained_ ? ref_counts_[page] : 0;
}

uint8_t* PagePool::data(uint32_t page) {
  return const_cast<uint8_t*>(static_cast<const PagePool*>(this)->data(page));
}

const uint8_t* PagePool::data(uint32_t page) const {
  if (page >= pages_obtained_) {
    fail(StatusCode::kOutOfRange, pool_name(storage_) + ": page " + std::to_string(page) +
                                      " does not exist (" + std::to_string(pages_obtained_) +
                                      " pages obtained)");
  }
  return chunks_[page / pages_per_chunk_].get() + size_t(page % pages_per_chunk_) * page_stride_bytes_;
}

}  // namespace certkv::cache
