// x86-64 CPU features that some compilers' __builtin_cpu_supports does not name (clang 14 knows
// neither F16C nor AMX), read from CPUID. Only meaningful beside an AVX check of the builtin
// (which also asks whether the OS saves the vector state).
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>

namespace certkv {

// F16C: CPUID leaf 1, ECX bit 29.
inline bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c >> 29 & 1) != 0;
}

// AMX-TILE and AMX-INT8: CPUID leaf 7 (sub-leaf 0), EDX bits 24 and 25. Whether the kernel lets a
// thread use the tile data is asked separately (arch_prctl).
inline bool cpu_has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (d >> 24 & 1) != 0 && (d >> 25 & 1) != 0;
}

}  // namespace certkv
#endif
