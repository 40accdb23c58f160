// The KV page descriptor shared by the cache, the attention kernels and (later) the device.
// A page holds one block of block_tokens tokens of one (layer, K or V, kv_head).
#pragma once

#include <cstdint>

namespace certkv::format {

// How a page's bytes encode its block; the cache and the kernels dispatch on it. The codecs of
// DESIGN.md section 4 add their classes here.
enum class StorageClass : uint8_t {
  kBf16 = 0,  // raw: [block_tokens][head_dim] bf16, token-major
  kGaac = 1,  // GAAC slot (lossless, docs/format/gaac.md): fixed part + calibrated escape capacity
  kFp8 = 2,   // raw: [block_tokens][head_dim] FP8 bytes (E4M3 or E5M2, per the cache's scheme)
  kGaacFp8 = 3,  // GAAC slot of an FP8 page (lossless on the FP8 bytes; element per the scheme)
  kLossy = 4,    // page of a registered lossy scheme with its Tier A side data
                 // (docs/format/lossy_pages.md); pool 0 holds K pages, pool 1 V pages
  kDither8 = 5,  // certified INT8 page (docs/format/dither8.md); pool 0 K, pool 1 V
};

inline constexpr int kNumStorageClasses = 6;

inline const char* storage_class_name(StorageClass c) {
  switch (c) {
    case StorageClass::kBf16: return "bf16";
    case StorageClass::kGaac: return "gaac";
    case StorageClass::kFp8: return "fp8";
    case StorageClass::kGaacFp8: return "gaac-fp8";
    case StorageClass::kLossy: return "lossy";
    case StorageClass::kDither8: return "dither8";
  }
  return "unknown";
}

// One entry of a block table: which physical page holds a logical block, and how it is stored.
struct PageRef {
  uint32_t page;          // index into its pool
  StorageClass storage;   // class of that pool
  uint8_t pool;           // which pool of the class (GAAC slot pools differ by slot size); 0 for raw
  uint8_t reserved[2];
};
static_assert(sizeof(PageRef) == 8);

inline constexpr uint32_t kNoPage = 0xffffffffu;

}  // namespace certkv::format
