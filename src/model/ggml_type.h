// Block geometry of the ggml tensor types a GGUF file may carry: how many elements one block
// holds and how many bytes it takes. Dense types (F32, F16, BF16) are blocks of one element.
// Thread safety: every function is pure.
#pragma once

#include <cstddef>
#include <cstdint>

#include "format/ggml_blocks.h"

namespace certkv::model {

// True when `id` is one of the format::GgmlType values with a known block size.
bool ggml_type_known(uint32_t id);

// "F32", "Q4_1", ...; "unknown" for an id outside format::GgmlType.
const char* ggml_type_name(format::GgmlType type);

// Elements per block; 0 if the type is unknown.
int64_t ggml_block_elements(format::GgmlType type);

// Bytes per block; 0 if the type is unknown.
size_t ggml_block_bytes(format::GgmlType type);

// Bytes of a row of `n_elements` elements.
// REQUIRES: the type is known, n_elements >= 0 and a multiple of ggml_block_elements(type);
// otherwise throws certkv::Error (kUnsupported for an unknown type, kInvalidArgument otherwise).
size_t ggml_row_bytes(format::GgmlType type, int64_t n_elements);

}  // namespace certkv::model
