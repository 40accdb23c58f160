// Page encoding of device memory (backend/cuda/device_page_codecs.h).
#include "backend/cuda/device_page_codecs.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attention/cuda/paged_decode_cuda.h"
#include "cache/cuda/device_pool.h"
#include "codec/cuda/gaac_encode_cuda.h"
#include "codec/cuda/lossy_encode_cuda.h"
#include "core/cuda_status.h"
#include "core/status.h"
#include "format/gaac_layout.h"

namespace certkv::backend::cuda {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(StatusCode::kInternal, std::string("device page encode: ") + what + ": " + cudaGetErrorString(e));
}

// kInvalidArgument unless p is memory of the current device.
void require_device_memory(const void* p, const char* name) {
  int device = -1;
  check_cuda(cudaGetDevice(&device), "no current CUDA device");
  throw_if_failed(cache::cuda::require_device_memory(p, device, "device page encode", name));
}

void require_devices() {
  if (attention::cuda::device_count() < 1)
    fail(StatusCode::kUnsupported, "device page encode: no CUDA device is visible to this process");
}

// Host bytes in stream order into memory allocated on the stream (freed by ~StreamBytes on the
// stream, after the launches enqueued before it).
class StreamBytes {
 public:
  StreamBytes(const void* host, size_t bytes, cudaStream_t stream) : stream_(stream) {
    check_cuda(cudaMallocAsync(&data_, bytes, stream), "allocating on the stream");
    // From pageable memory the copy takes the bytes before it returns (staged): the host buffer
    // may go at once.
    const cudaError_t e = cudaMemcpyAsync(data_, host, bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) {
      cudaFreeAsync(data_, stream);
      check_cuda(e, "copying to the device");
    }
  }
  ~StreamBytes() { cudaFreeAsync(data_, stream_); }
  StreamBytes(const StreamBytes&) = delete;
  StreamBytes& operator=(const StreamBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

void require_page_count(int64_t n_pages) {
  if (n_pages < 0 || n_pages >= (int64_t(1) << 31))
    fail(StatusCode::kInvalidArgument, "device page encode: n_pages " + std::to_string(n_pages) + " is not in [0, 2^31)");
}

}  // namespace

void encode_gaac_pages_on_device(const DeviceGaacPages& c, const void* pages, int64_t n_pages, uint8_t* slots,
                                 uint32_t* used_bytes, void* stream) {
  require_page_count(n_pages);
  codec::GaacBases bases;
  bases.b3.assign(c.b3.begin(), c.b3.end());
  bases.b4.assign(c.b4.begin(), c.b4.end());
  codec::validate_gaac_bases(c.element, c.block_tokens, c.head_dim, bases);
  if (c.escape_capacity_bytes >= (uint64_t(1) << 32))
    fail(StatusCode::kInvalidArgument, "device page encode: escape capacity " + std::to_string(c.escape_capacity_bytes) +
                                           " bytes past 2^32");
  const size_t slot_bytes = format::gaac_slot_bytes(c.element, c.block_tokens, c.head_dim, size_t(c.escape_capacity_bytes));
  const size_t page_bytes = size_t(c.block_tokens) * size_t(c.head_dim) * (c.element == codec::GaacElement::kBf16 ? 2 : 1);
  throw_if_failed(codec::cuda::check_gaac_encode(c.element, c.block_tokens, c.head_dim, 0, nullptr, nullptr));
  if (n_pages == 0) return;
  require_devices();
  require_device_memory(pages, "pages");
  require_device_memory(slots, "slots");
  require_device_memory(used_bytes, "used_bytes");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::vector<uint8_t> both(2 * size_t(c.head_dim));
  std::copy(bases.b3.begin(), bases.b3.end(), both.begin());
  std::copy(bases.b4.begin(), bases.b4.end(), both.begin() + c.head_dim);
  const StreamBytes device_bases(both.data(), both.size(), s);
  std::vector<codec::cuda::GaacEncodeTask> tasks(static_cast<size_t>(n_pages));
  for (size_t i = 0; i < tasks.size(); ++i) {
    tasks[i].src = static_cast<const uint8_t*>(pages) + i * page_bytes;
    tasks[i].dst = slots + i * slot_bytes;
    tasks[i].b3 = device_bases.data();
    tasks[i].b4 = device_bases.data() + c.head_dim;
    tasks[i].escape_capacity = uint32_t(c.escape_capacity_bytes);
  }
  const StreamBytes device_tasks(tasks.data(), sizeof(codec::cuda::GaacEncodeTask) * tasks.size(), s);
  throw_if_failed(codec::cuda::gaac_encode_pages(
      c.element, c.block_tokens, c.head_dim, reinterpret_cast<const codec::cuda::GaacEncodeTask*>(device_tasks.data()),
      int(n_pages), used_bytes, stream));
}

void encode_lossy_pages_on_device(const codec::LossyPageSpec& spec, uint32_t first_block, const uint16_t* pages,
                                  int64_t n_pages, uint8_t* out, uint8_t* encoded, void* stream) {
  require_page_count(n_pages);
  codec::validate_lossy_page_spec(spec);
  if (spec.scheme != codec::LossyScheme::kFp8E4M3 && spec.scheme != codec::LossyScheme::kFp8E5M2 &&
      spec.scheme != codec::LossyScheme::kDither8)
    fail(StatusCode::kUnsupported, std::string("device page encode: ") + codec::lossy_scheme_name(spec.scheme) +
                                       " pages are encoded on the host only (the device encodes fp8-e4m3, fp8-e5m2 "
                                       "and dither8)");
  if (uint64_t(first_block) + uint64_t(n_pages) > (uint64_t(1) << 32))
    fail(StatusCode::kInvalidArgument, "device page encode: blocks " + std::to_string(first_block) + " + " +
                                           std::to_string(n_pages) + " pass 2^32");
  throw_if_failed(codec::cuda::check_lossy_encode(spec, 0, nullptr, nullptr));
  if (n_pages == 0) return;
  require_devices();
  require_device_memory(pages, "pages");
  require_device_memory(out, "out");
  require_device_memory(encoded, "encoded");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t rows = size_t(spec.block_tokens) * size_t(spec.head_dim), bytes = codec::lossy_page_bytes(spec);
  const uint16_t none = 0;
  const size_t n_pairs = size_t(spec.n_outlier_pairs);
  const StreamBytes device_pairs(n_pairs > 0 ? static_cast<const void*>(spec.outlier_pairs) : &none,
                                 sizeof(uint16_t) * std::max<size_t>(n_pairs, 1), s);
  std::vector<codec::cuda::LossyEncodeTask> tasks(static_cast<size_t>(n_pages));
  for (size_t i = 0; i < tasks.size(); ++i) {
    tasks[i].src = pages + i * rows;
    tasks[i].dst = out + i * bytes;
    tasks[i].block = first_block + uint32_t(i);
    tasks[i].dither_key = spec.dither_key;
    tasks[i].outlier_pairs = n_pairs > 0 ? reinterpret_cast<const uint16_t*>(device_pairs.data()) : nullptr;
  }
  const StreamBytes device_tasks(tasks.data(), sizeof(codec::cuda::LossyEncodeTask) * tasks.size(), s);
  throw_if_failed(codec::cuda::lossy_encode_pages(
      spec, reinterpret_cast<const codec::cuda::LossyEncodeTask*>(device_tasks.data()), int(n_pages), encoded, stream));
}

}  // namespace certkv::backend::cuda
