// Plain reference: every fp32 multiplication and addition rounds on its own (no fused
// multiply-add), so the result does not depend on the compiler's contraction choices.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "model/quantized_dot.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/status.h"
#include "format/numeric.h"
#include "model/dequant.h"
#include "model/ggml_type.h"

namespace certkv::model {
namespace {

using format::GgmlType;

float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return format::fp16_to_float(bits);
}

// One 32-element block of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: scale d, min m (0 when the type has
// none) and the 32 integer codes c with the type's offset removed (so w_i = d * c_i + m).
struct Block32 {
  float d = 0, m = 0;
  int c[32] = {};
};

Block32 decode_block32(GgmlType type, const uint8_t* p) {
  Block32 b;
  b.d = fp16_at(p);
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: {
      const bool has_min = type == GgmlType::kQ4_1;
      if (has_min) b.m = fp16_at(p + 2);
      const uint8_t* qs = p + (has_min ? 4 : 2);
      const int offset = has_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) {
        b.c[j] = (qs[j] & 0xF) - offset;
        b.c[j + 16] = (qs[j] >> 4) - offset;
      }
      break;
    }
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      const bool has_min = type == GgmlType::kQ5_1;
      if (has_min) b.m = fp16_at(p + 2);
      const uint8_t* qh_bytes = p + (has_min ? 4 : 2);
      const uint32_t qh = uint32_t(qh_bytes[0]) | uint32_t(qh_bytes[1]) << 8 |
                          uint32_t(qh_bytes[2]) << 16 | uint32_t(qh_bytes[3]) << 24;
      const uint8_t* qs = qh_bytes + 4;
      const int offset = has_min ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        b.c[j] = ((qs[j] & 0xF) | int((qh >> j) & 1u) << 4) - offset;
        b.c[j + 16] = ((qs[j] >> 4) | int((qh >> (j + 16)) & 1u) << 4) - offset;
      }
      break;
    }
    case GgmlType::kQ8_0:
      for (int j = 0; j < 32; ++j) b.c[j] = int8_t(p[2 + j]);
      break;
    default:
      break;
  }
  return b;
}

float dot_block32_row(GgmlType type, const uint8_t* row, const QuantizedActivation& x) {
  const size_t block_bytes = ggml_block_bytes(type);
  const int64_t nb = int64_t(x.d.size());
  const bool has_min = type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1;
  float sum = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const Block32 w = decode_block32(type, row + b * block_bytes);
    int32_t isum = 0;
    for (int j = 0; j < 32; ++j) isum += w.c[j] * x.q[32 * b + j];
    float term = (w.d * x.d[b]) * float(isum);
    if (has_min) term = term + w.m * x.s[b];
    sum = sum + term;
  }
  return sum;
}

float dot_q45_k_row(GgmlType type, const uint8_t* row, const QuantizedActivation& x) {
  const bool fifth_bit = type == GgmlType::kQ5_K;
  const size_t block_bytes = ggml_block_bytes(type);
  const int64_t nb = int64_t(x.d.size());
  float sum = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * block_bytes;
    const float d = fp16_at(p);
    const float dmin = fp16_at(p + 2);
    const uint8_t* scales = p + 4;
    const uint8_t* qh = p + 16;
    const uint8_t* qs = p + (fifth_bit ? 48 : 16);
    const int8_t* xq = x.q.data() + 256 * b;
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      k_quant_scale_min(j, scales, &sc, &m);
      int32_t sub = 0;
      for (int l = 0; l < 32; ++l) {
        int c = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
        if (fifth_bit) c |= ((qh[l] >> j) & 1) << 4;
        sub += c * xq[32 * j + l];
      }
      isum += int32_t(sc) * sub;
      msum += int32_t(m) * x.sum32[8 * b + j];
    }
    sum = sum + ((d * x.d[b]) * float(isum) - (dmin * x.d[b]) * float(msum));
  }
  return sum;
}

float dot_q6_k_row(const uint8_t* row, const QuantizedActivation& x) {
  const int64_t nb = int64_t(x.d.size());
  float sum = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ql = row + b * sizeof(format::BlockQ6_K);
    const uint8_t* qh = ql + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(ql + 192);
    const float d = fp16_at(ql + 208);
    const int8_t* xq = x.q.data() + 256 * b;
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t sub = 0;
      for (int e = 16 * j; e < 16 * j + 16; ++e) {
        const int h = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
        const uint8_t low_byte = ql[64 * h + l + 32 * (quarter % 2)];
        const int low = quarter < 2 ? (low_byte & 0xF) : (low_byte >> 4);
        const int high = (qh[32 * h + l] >> (2 * quarter)) & 3;
        sub += ((low | high << 4) - 32) * xq[e];
      }
      isum += int32_t(scales[j]) * sub;
    }
    sum = sum + (d * x.d[b]) * float(isum);
  }
  return sum;
}

}  // namespace

int64_t activation_block_elements(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
      return 32;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return 256;
    default:
      return 0;
  }
}

QuantizedActivation quantize_activation_ref(const float* x, int64_t n, int64_t block_elements) {
  if ((block_elements != 32 && block_elements != 256) || n < 0 || n % block_elements != 0) {
    fail(StatusCode::kInvalidArgument,
         "quantize_activation_ref: " + std::to_string(n) + " elements in blocks of " +
             std::to_string(block_elements) + " (blocks must be 32 or 256 and divide the row)");
  }
  QuantizedActivation a;
  a.block_elements = block_elements;
  const int64_t nb = n / block_elements;
  a.q.assign(size_t(n), 0);
  a.d.assign(size_t(nb), 0.f);
  a.s.assign(size_t(nb), 0.f);
  a.sum32.assign(size_t(n / 32), 0);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * block_elements;
    float amax = 0;
    bool finite = true;
    for (int64_t i = 0; i < block_elements; ++i) {
      finite = finite && std::isfinite(xb[i]);
      amax = std::fmax(amax, std::fabs(xb[i]));
    }
    if (!finite) {
      a.d[b] = a.s[b] = std::nanf("");
      continue;
    }
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t block_sum = 0;
    for (int64_t i = 0; i < block_elements; ++i) {
      const int q = int(std::nearbyint(xb[i] * id));
      a.q[size_t(b * block_elements + i)] = int8_t(q);
      a.sum32[size_t((b * block_elements + i) / 32)] += q;
      block_sum += q;
    }
    a.d[b] = d;
    a.s[b] = d * float(block_sum);
  }
  return a;
}

float vec_dot_quantized_ref(GgmlType type, const void* w_row, const QuantizedActivation& x) {
  const int64_t block = activation_block_elements(type);
  if (block == 0) {
    fail(StatusCode::kUnsupported, std::string("vec_dot_quantized_ref: weight type ") +
                                       ggml_type_name(type) + " has no quantized dot product");
  }
  if (x.block_elements != block) {
    fail(StatusCode::kInvalidArgument,
         std::string("vec_dot_quantized_ref: ") + ggml_type_name(type) +
             " weights need activations in blocks of " + std::to_string(block) + ", got " +
             std::to_string(x.block_elements));
  }
  const auto* row = static_cast<const uint8_t*>(w_row);
  switch (type) {
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      return dot_q45_k_row(type, row, x);
    case GgmlType::kQ6_K:
      return dot_q6_k_row(row, x);
    default:
      return dot_block32_row(type, row, x);
  }
}

}  // namespace certkv::model
