// The counter-based random numbers of the key index (rotation.h): draw number `counter` of stream
// `seed` is a pure function of the two, defined once here for the host and the device (the
// device's query quantization draws the same uniforms as index::rabitq_quantize_query).
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::index {

inline constexpr uint64_t kCounterGolden = 0x9E3779B97F4A7C15ull;

// The splitmix64 output function (Steele, Lea and Flood 2014).
CERTKV_HD constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// SplitMix64 finalizer applied to (seed, counter): draw number `counter` of stream `seed`.
CERTKV_HD constexpr uint64_t counter_random_u64(uint64_t seed, uint64_t counter) {
  return splitmix64_mix(splitmix64_mix(seed + kCounterGolden) + (counter + 1) * kCounterGolden);
}

// Uniform on the open interval (0, 1), 53 random bits.
CERTKV_HD constexpr double counter_uniform(uint64_t seed, uint64_t counter) {
  return (static_cast<double>(counter_random_u64(seed, counter) >> 11) + 0.5) * 0x1.0p-53;
}

}  // namespace certkv::index
