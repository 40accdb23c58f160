#include "codec/cuda/gaac_encode_cuda.h"

#include <cuda_runtime.h>

#include <string>

#include "format/fragment_layout.h"

namespace certkv::codec::cuda {

namespace {

using format::GaacElement;

constexpr int kWarpsPerCta = 4;
constexpr int kThreads = 32 * kWarpsPerCta;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// One page shape, evaluated on the host from format/gaac_layout.h. Byte counts fit in 32 bits
// (check_gaac_encode).
struct Geometry {
  GaacElement element;
  int exponent_bits;       // E
  int mantissa_bits;       // S - 1
  int sign_mantissa_bits;  // S
  int element_bytes;
  bool four_bit_valid;  // false for e4m3
  int head_dim;
  int tile_channels;
  uint32_t groups_per_token;  // per tile
  uint32_t tile_groups;
  uint32_t tag_bytes;  // per tile; a unit of work is one tag byte (4 groups, fewer at a tile's end)
  uint32_t n_units;    // n_tiles * tag_bytes
  uint32_t code_offset;
  uint32_t tag_offset;
  uint32_t tile_fixed_bytes;
  uint32_t page_fixed_bytes;
};

Geometry geometry_of(GaacElement element, int block_tokens, int head_dim) {
  Geometry g{};
  const int channels = format::gaac_tile_channels(head_dim);
  g.element = element;
  g.exponent_bits = format::gaac_exponent_bits(element);
  g.sign_mantissa_bits = format::gaac_sign_mantissa_bits(element);
  g.mantissa_bits = g.sign_mantissa_bits - 1;
  g.element_bytes = format::gaac_element_bytes(element);
  g.four_bit_valid = format::gaac_mode_valid(element, format::kGaacMode4Bit);
  g.head_dim = head_dim;
  g.tile_channels = channels;
  g.groups_per_token = uint32_t(format::gaac_groups_per_token(channels));
  g.tile_groups = uint32_t(format::gaac_tile_groups(block_tokens, channels));
  g.tag_bytes = uint32_t(format::gaac_tile_tag_bytes(block_tokens, channels));
  g.n_units = uint32_t(format::gaac_n_tiles(head_dim)) * g.tag_bytes;
  g.code_offset = uint32_t(format::gaac_tile_code_offset(element, block_tokens, channels));
  g.tag_offset = uint32_t(format::gaac_tile_tag_offset(element, block_tokens, channels));
  g.tile_fixed_bytes = uint32_t(format::gaac_tile_fixed_bytes(element, block_tokens, channels));
  g.page_fixed_bytes = uint32_t(format::gaac_page_fixed_bytes(element, block_tokens, head_dim));
  return g;
}

// The 8 elements of group `group` of tile `tile`, split into sign+mantissa and exponent fields
// (the exponent as stored, biased).
struct Group {
  int channel0;  // page channel of element 0
  uint32_t sign_mantissa[8];
  uint32_t exponent[8];
};

__device__ Group load_group(const Geometry& g, const uint8_t* src, int tile, uint32_t group) {
  Group out;
  const uint32_t token = group / g.groups_per_token;
  out.channel0 = tile * g.tile_channels + 8 * int(group % g.groups_per_token);
  const uint8_t* p =
      src + (size_t(token) * size_t(g.head_dim) + size_t(out.channel0)) * size_t(g.element_bytes);
  const uint32_t mantissa_mask = (1u << g.mantissa_bits) - 1;
  const uint32_t exponent_mask = (1u << g.exponent_bits) - 1;
  for (int j = 0; j < 8; ++j) {
    const uint32_t v =
        g.element_bytes == 2 ? uint32_t(p[2 * j]) | uint32_t(p[2 * j + 1]) << 8 : uint32_t(p[j]);
    out.sign_mantissa[j] =
        ((v >> (g.exponent_bits + g.mantissa_bits)) << g.mantissa_bits) | (v & mantissa_mask);
    out.exponent[j] = (v >> g.mantissa_bits) & exponent_mask;
  }
  return out;
}

// The narrowest mode whose window holds all 8 exponents (seed 003; codec/gaac.cc choose_mode).
__device__ unsigned group_mode(const Geometry& g, const Group& group, const uint8_t* b3,
                               const uint8_t* b4) {
  bool fits3 = true;
  bool fits4 = g.four_bit_valid;
  for (int j = 0; j < 8; ++j) {
    const int d3 = int(group.exponent[j]) - int(b3[group.channel0 + j]);
    const int d4 = int(group.exponent[j]) - int(b4[group.channel0 + j]);
    fits3 = fits3 && d3 >= 0 && d3 < 8;
    fits4 = fits4 && d4 >= 0 && d4 < 16;
  }
  return fits3 ? format::kGaacMode3Bit : fits4 ? format::kGaacMode4Bit : format::kGaacModeRaw;
}

__device__ int escape_bytes_of_mode(const Geometry& g, unsigned mode) {
  return format::gaac_mode_escape_bytes(g.element, static_cast<uint8_t>(mode));
}

// Packs 8 fields of w bits into w bytes: element j owns bits [w j, w j + w) of the little-endian
// bit string (docs/format/gaac.md, "Bit packing").
__device__ void put_fields(uint8_t* dst, const uint32_t* values, int w) {
  const uint64_t mask = (uint64_t(1) << w) - 1;
  uint64_t acc = 0;
  for (int j = 0; j < 8; ++j) acc |= (uint64_t(values[j]) & mask) << (w * j);
  for (int i = 0; i < w; ++i) dst[i] = static_cast<uint8_t>(acc >> (8 * i));
}

// The groups of unit `unit` (one tag byte): tile, first group, end group.
struct Unit {
  int tile;
  uint32_t tag_byte;
  uint32_t group_begin, group_end;
};

__device__ Unit unit_of(const Geometry& g, uint32_t unit) {
  Unit u;
  u.tile = int(unit / g.tag_bytes);
  u.tag_byte = unit % g.tag_bytes;
  u.group_begin = u.tag_byte * format::kGaacGroupsPerTagByte;
  u.group_end = min(u.group_begin + uint32_t(format::kGaacGroupsPerTagByte), g.tile_groups);
  return u;
}

// One warp per task; lane l codes units [l n, l n + n) of the page, n = ceil(n_units / 32), so
// its groups are contiguous in page order and it alone writes their tag bytes.
__global__ void __launch_bounds__(kThreads)
    gaac_encode_kernel(Geometry g, const GaacEncodeTask* tasks, uint32_t n_tasks,
                       uint32_t* used_bytes) {
  const uint32_t task_index = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  if (task_index >= n_tasks) return;  // the whole warp
  const uint32_t lane = threadIdx.x % 32;
  const GaacEncodeTask task = tasks[task_index];
  const uint32_t units_per_lane = (g.n_units + 31) / 32;
  const uint32_t unit_begin = min(g.n_units, lane * units_per_lane);
  const uint32_t unit_end = min(g.n_units, unit_begin + units_per_lane);

  uint32_t lane_escape_bytes = 0;
  for (uint32_t unit = unit_begin; unit < unit_end; ++unit) {
    const Unit u = unit_of(g, unit);
    for (uint32_t group = u.group_begin; group < u.group_end; ++group) {
      const Group x = load_group(g, task.src, u.tile, group);
      lane_escape_bytes += uint32_t(escape_bytes_of_mode(g, group_mode(g, x, task.b3, task.b4)));
    }
  }
  // Escapes lie back to back in page order: a lane's start is the sum over the lanes before it.
  uint32_t inclusive = lane_escape_bytes;
  for (int delta = 1; delta < 32; delta *= 2) {
    const uint32_t before = __shfl_up_sync(kFullWarp, inclusive, delta);
    if (lane >= uint32_t(delta)) inclusive += before;
  }
  const uint32_t page_escape_bytes = __shfl_sync(kFullWarp, inclusive, 31);
  if (page_escape_bytes > task.escape_capacity) {
    if (lane == 0) used_bytes[task_index] = kGaacDeviceDoesNotFit;
    return;
  }

  uint8_t* escapes = task.dst + g.page_fixed_bytes;
  uint32_t escape_pos = inclusive - lane_escape_bytes;
  for (uint32_t unit = unit_begin; unit < unit_end; ++unit) {
    const Unit u = unit_of(g, unit);
    uint8_t* tile_start = task.dst + size_t(u.tile) * g.tile_fixed_bytes;
    uint32_t tags = 0;
    for (uint32_t group = u.group_begin; group < u.group_end; ++group) {
      const Group x = load_group(g, task.src, u.tile, group);
      const unsigned mode = group_mode(g, x, task.b3, task.b4);
      uint32_t low[8];
      uint32_t high[8];
      for (int j = 0; j < 8; ++j) {
        const uint32_t base = mode == format::kGaacMode3Bit   ? task.b3[x.channel0 + j]
                              : mode == format::kGaacMode4Bit ? task.b4[x.channel0 + j]
                                                              : 0u;
        const uint32_t code = x.exponent[j] - base;
        low[j] = code & 7u;
        high[j] = code >> format::kGaacCodeBits;
      }
      put_fields(tile_start + size_t(group) * size_t(g.sign_mantissa_bits), x.sign_mantissa,
                 g.sign_mantissa_bits);
      put_fields(tile_start + g.code_offset + size_t(group) * format::kGaacCodeBits, low,
                 format::kGaacCodeBits);
      tags |= mode << (format::kGaacTagBits * (group % format::kGaacGroupsPerTagByte));
      const int n_escape = escape_bytes_of_mode(g, mode);
      if (n_escape > 0) put_fields(escapes + escape_pos, high, n_escape);
      escape_pos += uint32_t(n_escape);
    }
    tile_start[g.tag_offset + u.tag_byte] = static_cast<uint8_t>(tags);
  }
  if (lane == 0) used_bytes[task_index] = g.page_fixed_bytes + page_escape_bytes;
}

CudaStatus invalid(const std::string& message) {
  return cuda_error(StatusCode::kInvalidArgument, "GAAC device encode: " + message);
}

}  // namespace

CudaStatus check_gaac_encode(GaacElement element, int block_tokens, int head_dim, int n_tasks,
                             const void* tasks, const void* used_bytes) {
  if (element != GaacElement::kBf16 && element != GaacElement::kFp8E4M3 &&
      element != GaacElement::kFp8E5M2) {
    return invalid("unknown element format " + std::to_string(static_cast<int>(element)));
  }
  if (block_tokens < 1) {
    return invalid("block_tokens must be at least 1, got " + std::to_string(block_tokens));
  }
  if (format::gaac_tile_channels(head_dim) == 0) {
    return invalid("head_dim " + std::to_string(head_dim) +
                   " does not split into equal tiles of at most 128 channels, multiples of 8");
  }
  if (n_tasks < 0) return invalid("n_tasks must not be negative, got " + std::to_string(n_tasks));
  if (n_tasks > 0 && tasks == nullptr) {
    return invalid("tasks is null for " + std::to_string(n_tasks) + " tasks");
  }
  if (n_tasks > 0 && used_bytes == nullptr) {
    return invalid("used_bytes is null for " + std::to_string(n_tasks) + " tasks");
  }
  const size_t slot_bytes_max = format::gaac_page_fixed_bytes(element, block_tokens, head_dim) +
                                format::gaac_page_max_escape_bytes(element, block_tokens, head_dim);
  if (slot_bytes_max >= kGaacDeviceDoesNotFit) {
    return cuda_error(StatusCode::kUnsupported,
                      "GAAC device encode: a page of " + std::to_string(block_tokens) + " x " +
                          std::to_string(head_dim) + " needs up to " +
                          std::to_string(slot_bytes_max) + " bytes, past 32-bit byte counts");
  }
  return {};
}

CudaStatus gaac_encode_pages(GaacElement element, int block_tokens, int head_dim,
                             const GaacEncodeTask* tasks, int n_tasks, uint32_t* used_bytes,
                             void* stream) {
  const CudaStatus checked =
      check_gaac_encode(element, block_tokens, head_dim, n_tasks, tasks, used_bytes);
  if (!checked.ok || n_tasks == 0) return checked;
  const Geometry g = geometry_of(element, block_tokens, head_dim);
  const uint32_t n = uint32_t(n_tasks);
  const uint32_t n_ctas = (n + kWarpsPerCta - 1) / kWarpsPerCta;
  gaac_encode_kernel<<<n_ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(g, tasks, n,
                                                                                 used_bytes);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    const std::string reason = cudaGetErrorString(e);
    return cuda_error(StatusCode::kInternal, "GAAC device encode: kernel launch failed: " + reason);
  }
  return {};
}

namespace {

namespace frag = format::fragment;

__device__ inline void store32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
  p[2] = uint8_t(v >> 16);
  p[3] = uint8_t(v >> 24);
}

// One warp a page, 32 consecutive elements at a time: each lane codes its element (its low byte
// stored, its code and sign bits OR-ed across the 8 lanes of its word), and the exceptions of the
// 32 take their places in element order by a ballot.
__global__ void __launch_bounds__(kThreads)
    gaac_fragment_encode_kernel(int head_dim, bool key, const GaacEncodeTask* tasks, uint32_t n, uint32_t* used) {
  const uint32_t page = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  const int lane = int(threadIdx.x % 32);
  if (page >= n) return;  // whole warps leave together
  const GaacEncodeTask t = tasks[page];
  const int D = head_dim, capacity = frag::gaac_exception_capacity(D);
  uint8_t* exceptions = t.dst + frag::gaac_low_bytes(D) + frag::gaac_word_bytes(D);
  int count = 0;
  bool ok = true;
  for (int first = 0; first < frag::kPageTokens * D; first += 32) {
    const int i = first + lane;
    const uint16_t x = uint16_t(t.src[2 * i] | (t.src[2 * i + 1] << 8));
    const int base = t.b4[frag::element_channel(key, i)];
    const bool in = frag::gaac_in_window(x, base);
    uint16_t built = 0;
    const bool built_ok = in || frag::gaac_built(x, base, &built);
    const unsigned out = __ballot_sync(kFullWarp, !in);
    ok = ok && __all_sync(kFullWarp, built_ok);
    const int at = count + __popc(out & ((1u << lane) - 1u));
    if (!in && at < capacity) store32(exceptions + 4 + 4 * at, frag::gaac_exception(i, built));
    count += __popc(out);
    const int code = in ? ((x >> 7) & 0xff) - base : 0;
    t.dst[frag::code_byte(i)] = in ? uint8_t(((code & 1) << 7) | (x & 0x7f)) : uint8_t(0);
    uint32_t bits = in ? (uint32_t(code >> 1) << frag::gaac_code_bit(i % 8)) | (uint32_t(x >> 15) << frag::gaac_sign_bit(i % 8))
                       : 0u;
    bits |= __shfl_xor_sync(kFullWarp, bits, 1);
    bits |= __shfl_xor_sync(kFullWarp, bits, 2);
    bits |= __shfl_xor_sync(kFullWarp, bits, 4);
    if (i % 8 == 0) store32(t.dst + frag::gaac_word_byte(D, i / frag::kStepElements, (i % frag::kStepElements) / 8), bits);
  }
  for (int j = count + lane; j < capacity; j += 32) store32(exceptions + 4 + 4 * j, 0u);  // as the `_ref` page
  if (lane == 0) {
    store32(exceptions, uint32_t(count));
    used[page] = ok && count <= capacity ? uint32_t(frag::gaac_page_bytes(D)) : kGaacDeviceDoesNotFit;
  }
}

}  // namespace

CudaStatus gaac_fragment_encode_pages(int head_dim, bool key, const GaacEncodeTask* tasks, int n_tasks,
                                      uint32_t* used_bytes, void* stream) {
  if (head_dim != 64 && head_dim != 128)
    return invalid("GAAC device pages: head_dim " + std::to_string(head_dim) + " is not 64 or 128");
  const CudaStatus checked = check_gaac_encode(GaacElement::kBf16, frag::kPageTokens, head_dim, n_tasks, tasks, used_bytes);
  if (!checked.ok || n_tasks == 0) return checked;
  const uint32_t n = uint32_t(n_tasks);
  gaac_fragment_encode_kernel<<<(n + kWarpsPerCta - 1) / kWarpsPerCta, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      head_dim, key, tasks, n, used_bytes);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return cuda_error(StatusCode::kInternal, std::string("GAAC device pages: encode launch failed: ") + cudaGetErrorString(e));
  return {};
}

}  // namespace certkv::codec::cuda
