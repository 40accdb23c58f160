// Page encoding of device memory for front ends that hold KV rows on a CUDA device themselves (the
// C API's certkv_gaac_encode_pages_device and certkv_lossy_encode_pages_device, the torch
// operators on CUDA tensors): many pages of one stream per call through the device encoders
// (codec/cuda/gaac_encode_cuda.h, codec/cuda/lossy_encode_cuda.h), whose bytes are the host
// reference encoders' byte for byte.
//
// Every call runs on the CUDA device current at the call and enqueues on `stream` (a
// cudaStream_t; null: the legacy default stream): the tasks, bases and outlier pairs go up from
// the host in stream order into memory allocated on the stream and freed on it after the launch,
// so nothing waits for the device. The pointers given must be memory of the current device
// (kInvalidArgument otherwise, before any launch).
// Thread safety: any thread; calls on one stream run in call order.
#pragma once

#include <cstdint>
#include <span>

#include "codec/gaac.h"
#include "codec/lossy_page.h"

namespace certkv::backend::cuda {

// What a page of the device GAAC encoder takes: the element, the page shape, the window bases
// (host, head_dim each) and the escape capacity of a slot.
struct DeviceGaacPages {
  codec::GaacElement element = codec::GaacElement::kBf16;
  int block_tokens = 0;
  int head_dim = 0;
  std::span<const uint8_t> b3, b4;
  uint64_t escape_capacity_bytes = 0;
};

// used_bytes[i] of a page whose escapes do not fit its slot.
inline constexpr uint32_t kDevicePageDoesNotFit = 0xFFFFFFFFu;

// Encodes n_pages pages: pages device [n_pages][block_tokens][head_dim] elements (bf16 bits or
// FP8 bytes); slots device [n_pages][slot_bytes] (format::gaac_slot_bytes); used_bytes device
// [n_pages]: the bytes written, or kDevicePageDoesNotFit. Throws certkv::Error: kInvalidArgument
// for bases out of their windows, a shape GAAC does not tile, n_pages outside [0, 2^31), memory
// that is not the current device's; kUnsupported in a build without CUDA or without a device;
// kInternal for a failed allocation or launch.
void encode_gaac_pages_on_device(const DeviceGaacPages& codec, const void* pages, int64_t n_pages, uint8_t* slots,
                                 uint32_t* used_bytes, void* stream);

// Encodes n_pages pages of spec (a lossy scheme the device encodes: fp8-e4m3, fp8-e5m2, dither8;
// spec.outlier_pairs host memory): pages device [n_pages][block_tokens][head_dim] bf16 bits,
// page i the block first_block + i of its stream; out device [n_pages][lossy_page_bytes(spec)];
// encoded device [n_pages]: 1 when the page was written, 0 when the encoder refuses the block (as
// lossy_encode_page). Throws certkv::Error: kUnsupported naming the scheme for one the device
// does not encode, in a build without CUDA or without a device; kInvalidArgument for a spec
// validate_lossy_page_spec refuses, n_pages outside [0, 2^31), blocks past 2^32, memory that is
// not the current device's; kInternal for a failed allocation or launch.
void encode_lossy_pages_on_device(const codec::LossyPageSpec& spec, uint32_t first_block, const uint16_t* pages,
                                  int64_t n_pages, uint8_t* out, uint8_t* encoded, void* stream);

}  // namespace certkv::backend::cuda
