// The KV page descriptor shared by the cache, the attention kernels and (later) the device.
// A page holds one block of block_tokens tokens of one (layer, K or V, kv_head).
#pragma once

#include <cstdint>

namespace certkv::format {

// How a page's bytes encode its block. Only kBf16 exists in this version; the codecs of
// DESIGN.md sections 3-4 add their classes here, and the cache and kernels dispatch on it.
enum class StorageClass : uint8_t {
  kBf16 = 0,  // raw: [block_tokens][head_dim] bf16, token-major
};

inline const char* storage_class_name(StorageClass c) {
  switch (c) {
    case StorageClass::kBf16: return "bf16";
  }
  return "unknown";
}

// One entry of a block table: which physical page holds a logical block, and how it is stored.
struct PageRef {
  uint32_t page;          // index into the pool of its storage class
  StorageClass storage;   // class of that pool
  uint8_t reserved[3];
};
static_assert(sizeof(PageRef) == 8);

inline constexpr uint32_t kNoPage = 0xffffffffu;

}  // namespace certkv::format
