// <immintrin.h> for the SIMD kernels. GCC 12 reports its own intrinsics' deliberately undefined
// operands (GCC bug 105593) under -Wall; the warnings are silenced for this header only.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif
