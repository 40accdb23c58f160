#include "model/ggml_type.h"

#include <string>

#include "core/status.h"

namespace certkv::model {
namespace {

using format::GgmlType;

struct TypeTraits {
  const char* name;
  int64_t block_elements;
  size_t block_bytes;
};

// Block sizes as ggml defines them (ggml.c type_traits); the quantized ones match the structs
// in format/ggml_blocks.h where those exist.
bool lookup(GgmlType type, TypeTraits* out) {
  switch (type) {
    case GgmlType::kF32: *out = {"F32", 1, 4}; return true;
    case GgmlType::kF16: *out = {"F16", 1, 2}; return true;
    case GgmlType::kBF16: *out = {"BF16", 1, 2}; return true;
    case GgmlType::kQ4_0: *out = {"Q4_0", 32, 18}; return true;
    case GgmlType::kQ4_1: *out = {"Q4_1", 32, 20}; return true;
    case GgmlType::kQ5_0: *out = {"Q5_0", 32, 22}; return true;
    case GgmlType::kQ5_1: *out = {"Q5_1", 32, 24}; return true;
    case GgmlType::kQ8_0: *out = {"Q8_0", 32, 34}; return true;
    case GgmlType::kQ8_1: *out = {"Q8_1", 32, 36}; return true;
    case GgmlType::kQ2_K: *out = {"Q2_K", 256, 84}; return true;
    case GgmlType::kQ3_K: *out = {"Q3_K", 256, 110}; return true;
    case GgmlType::kQ4_K: *out = {"Q4_K", 256, 144}; return true;
    case GgmlType::kQ5_K: *out = {"Q5_K", 256, 176}; return true;
    case GgmlType::kQ6_K: *out = {"Q6_K", 256, 210}; return true;
    case GgmlType::kQ8_K: *out = {"Q8_K", 256, 292}; return true;
  }
  return false;
}

static_assert(sizeof(format::BlockQ4_0) == 18 && sizeof(format::BlockQ4_1) == 20 &&
              sizeof(format::BlockQ8_0) == 34 && sizeof(format::BlockQ8_1) == 36 &&
              sizeof(format::BlockQ4_K) == 144 && sizeof(format::BlockQ5_K) == 176 &&
              sizeof(format::BlockQ6_K) == 210 && sizeof(format::BlockQ8_K) == 292);

}  // namespace

bool ggml_type_known(uint32_t id) {
  TypeTraits traits;
  return lookup(static_cast<GgmlType>(id), &traits);
}

const char* ggml_type_name(GgmlType type) {
  TypeTraits traits;
  return lookup(type, &traits) ? traits.name : "unknown";
}

int64_t ggml_block_elements(GgmlType type) {
  TypeTraits traits;
  return lookup(type, &traits) ? traits.block_elements : 0;
}

size_t ggml_block_bytes(GgmlType type) {
  TypeTraits traits;
  return lookup(type, &traits) ? traits.block_bytes : 0;
}

size_t ggml_row_bytes(GgmlType type, int64_t n_elements) {
  TypeTraits traits;
  if (!lookup(type, &traits)) {
    fail(StatusCode::kUnsupported,
         "ggml type id " + std::to_string(static_cast<uint32_t>(type)) + " is not supported");
  }
  if (n_elements < 0 || n_elements % traits.block_elements != 0) {
    fail(StatusCode::kInvalidArgument,
         std::string("ggml_row_bytes: ") + std::to_string(n_elements) + " elements of " +
             traits.name + " is not a whole number of blocks of " +
             std::to_string(traits.block_elements));
  }
  const uint64_t n_blocks = static_cast<uint64_t>(n_elements / traits.block_elements);
  if (n_blocks > SIZE_MAX / traits.block_bytes) {
    fail(StatusCode::kOutOfRange, std::string("ggml_row_bytes: ") + std::to_string(n_elements) +
                                      " elements of " + traits.name + " overflow size_t");
  }
  return static_cast<size_t>(n_blocks) * traits.block_bytes;
}

}  // namespace certkv::model
