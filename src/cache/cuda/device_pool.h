// Device memory for paged KV (the device half of the cache layer): an owning buffer and a page
// pool of fixed-stride slots, with allocation failures reported as statuses (out of device
// memory names the request and what the device had free), never as crashes.
//
// A pool holds n_pages slots of `stride` bytes, stride = page_bytes rounded up to 16, based at a
// cudaMalloc'ed (256-byte aligned) address: every slot is 16-byte aligned, as the decode kernels
// require. Pages are written from the host (write_pages); the kernels read them through block
// tables of slot indices.
// Thread safety: one owner; calls are synchronous unless they say otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/cuda_status.h"

namespace certkv::cache::cuda {

using certkv::CudaStatus;
using certkv::cuda_error;

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // kOutOfMemory when the device cannot hold `bytes` (the message says how much was free).
  static CudaStatus allocate(size_t bytes, DeviceBuffer* out);
  // Copies host bytes to [offset, offset + n). kOutOfRange past the end.
  CudaStatus upload(size_t offset, const void* host, size_t n);
  CudaStatus download(size_t offset, void* host, size_t n) const;
  // The same, enqueued on `stream` (a cudaStream_t; null: the default stream) and returning at
  // once: the host bytes must stay valid (upload) or are valid (download) only once the stream
  // has reached the copy (synchronize_stream). With page-locked host memory (PinnedBuffer) the
  // copy does not block the caller.
  CudaStatus upload_async(size_t offset, const void* host, size_t n, void* stream);
  CudaStatus download_async(size_t offset, void* host, size_t n, void* stream) const;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory (cudaHostAlloc): the staging area of asynchronous copies.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // kOutOfMemory when the host cannot lock `bytes`.
  static CudaStatus allocate(size_t bytes, PinnedBuffer* out);
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Waits until every call enqueued on `stream` (null: the default stream) has finished.
CudaStatus synchronize_stream(void* stream);

// Copies n bytes of device memory to the host after the default stream's work (synchronous).
CudaStatus copy_to_host(const void* device, void* host, size_t n);

// kInvalidArgument "<who>: <name> is not ..." unless p is memory that CUDA device `device` can
// read and write (device or managed memory of it): a host or another device's pointer would
// fault in a launch, leaving an error in the CUDA context of the whole process.
CudaStatus require_device_memory(const void* p, int device, const std::string& who, const char* name);

class DevicePagePool {
 public:
  // REQUIRES: page_bytes >= 1, n_pages >= 1 (kInvalidArgument otherwise).
  static CudaStatus create(size_t page_bytes, int64_t n_pages, DevicePagePool* out);
  // Writes n consecutive pages from host memory laid out with `host_stride` bytes per page
  // (page_bytes of each are copied). kOutOfRange when [first, first + n) is outside the pool.
  CudaStatus write_pages(int64_t first, const uint8_t* host, int64_t n, size_t host_stride);

  const uint8_t* data() const { return buffer_.data(); }
  size_t stride() const { return stride_; }
  size_t page_bytes() const { return page_bytes_; }
  int64_t n_pages() const { return n_pages_; }

 private:
  DeviceBuffer buffer_;
  size_t page_bytes_ = 0, stride_ = 0;
  int64_t n_pages_ = 0;
};

}  // namespace certkv::cache::cuda
