#include "cache/cuda/device_pool.h"

#include <cuda_runtime.h>

#include <utility>
#include <vector>

namespace certkv::cache::cuda {

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

CudaStatus DeviceBuffer::allocate(size_t bytes, DeviceBuffer* out) {
  if (bytes == 0) bytes = 16;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory : StatusCode::kInternal;
    return cuda_error(code, "device allocation of " + std::to_string(bytes) + " bytes failed (" +
                                cudaGetErrorString(e) + "; " + std::to_string(free_bytes) + " of " +
                                std::to_string(total_bytes) + " bytes free)");
  }
  *out = DeviceBuffer();
  out->data_ = static_cast<uint8_t*>(p);
  out->size_ = bytes;
  return {};
}

CudaStatus DeviceBuffer::upload(size_t offset, const void* host, size_t n) {
  if (offset > size_ || n > size_ - offset)
    return cuda_error(StatusCode::kOutOfRange, "upload of " + std::to_string(n) + " bytes at " +
                                                   std::to_string(offset) + " is past the buffer (" +
                                                   std::to_string(size_) + " bytes)");
  const cudaError_t e = cudaMemcpy(data_ + offset, host, n, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("upload failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus DeviceBuffer::download(size_t offset, void* host, size_t n) const {
  if (offset > size_ || n > size_ - offset)
    return cuda_error(StatusCode::kOutOfRange, "download of " + std::to_string(n) + " bytes at " +
                                                   std::to_string(offset) + " is past the buffer");
  const cudaError_t e = cudaMemcpy(host, data_ + offset, n, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("download failed: ") + cudaGetErrorString(e));
  return {};
}

namespace {

CudaStatus range_error(const char* what, size_t offset, size_t n, size_t size) {
  return cuda_error(StatusCode::kOutOfRange, std::string(what) + " of " + std::to_string(n) + " bytes at " +
                                                 std::to_string(offset) + " is past the buffer (" +
                                                 std::to_string(size) + " bytes)");
}

}  // namespace

CudaStatus DeviceBuffer::upload_async(size_t offset, const void* host, size_t n, void* stream) {
  if (offset > size_ || n > size_ - offset) return range_error("upload", offset, n, size_);
  const cudaError_t e =
      cudaMemcpyAsync(data_ + offset, host, n, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("upload failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus DeviceBuffer::download_async(size_t offset, void* host, size_t n, void* stream) const {
  if (offset > size_ || n > size_ - offset) return range_error("download", offset, n, size_);
  const cudaError_t e =
      cudaMemcpyAsync(host, data_ + offset, n, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("download failed: ") + cudaGetErrorString(e));
  return {};
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

CudaStatus PinnedBuffer::allocate(size_t bytes, PinnedBuffer* out) {
  if (bytes == 0) bytes = 16;
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory : StatusCode::kInternal;
    return cuda_error(code, "page-locked host allocation of " + std::to_string(bytes) + " bytes failed (" +
                                cudaGetErrorString(e) + ")");
  }
  *out = PinnedBuffer();
  out->data_ = static_cast<uint8_t*>(p);
  out->size_ = bytes;
  return {};
}

CudaStatus synchronize_stream(void* stream) {
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("stream synchronization failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus copy_to_host(const void* device, void* host, size_t n) {
  if (n == 0) return {};
  const cudaError_t e = cudaMemcpy(host, device, n, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("device to host copy failed: ") + cudaGetErrorString(e));
  return {};
}

CudaStatus require_device_memory(const void* p, int device, const std::string& who, const char* name) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // the query's error is not sticky: clear it
    return cuda_error(StatusCode::kInvalidArgument, who + ": " + name + " is not CUDA memory");
  }
  if ((a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) && a.device == device) return {};
  return cuda_error(StatusCode::kInvalidArgument, who + ": " + name + " is not memory of CUDA device " +
                                                      std::to_string(device) + " (host or another device's memory)");
}

CudaStatus DevicePagePool::create(size_t page_bytes, int64_t n_pages, DevicePagePool* out) {
  if (page_bytes == 0 || n_pages < 1)
    return cuda_error(StatusCode::kInvalidArgument, "a page pool needs page_bytes >= 1 and n_pages >= 1");
  const size_t stride = (page_bytes + 15) / 16 * 16;
  if (size_t(n_pages) > SIZE_MAX / stride)
    return cuda_error(StatusCode::kOutOfMemory, "a pool of " + std::to_string(n_pages) + " pages overflows");
  DevicePagePool pool;
  CudaStatus s = DeviceBuffer::allocate(stride * size_t(n_pages), &pool.buffer_);
  if (!s.ok) return s;
  pool.page_bytes_ = page_bytes;
  pool.stride_ = stride;
  pool.n_pages_ = n_pages;
  *out = std::move(pool);
  return {};
}

CudaStatus DevicePagePool::write_pages(int64_t first, const uint8_t* host, int64_t n, size_t host_stride) {
  if (first < 0 || n < 0 || first > n_pages_ || n > n_pages_ - first)
    return cuda_error(StatusCode::kOutOfRange, "pages [" + std::to_string(first) + ", " + std::to_string(first + n) +
                                                   ") are outside the pool of " + std::to_string(n_pages_));
  if (n == 0) return {};
  if (host_stride == stride_) return buffer_.upload(size_t(first) * stride_, host, size_t(n) * stride_);
  const cudaError_t e = cudaMemcpy2D(buffer_.data() + size_t(first) * stride_, stride_, host, host_stride,
                                     page_bytes_, size_t(n), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) return cuda_error(StatusCode::kInternal, std::string("page upload failed: ") + cudaGetErrorString(e));
  return {};
}

}  // namespace certkv::cache::cuda
