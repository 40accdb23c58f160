// A region of code compiled for wider instructions than the build's target (the run-time kernels
// of matmul_x86.cc and matmul_tiles.cc): CERTKV_TARGET_PUSH("avx2,fma") ... CERTKV_TARGET_POP().
// GCC's `#pragma GCC target`, clang's `#pragma clang attribute` (which ignores GCC's). Include the
// headers a region uses before it, so that what they define keeps the build's own target.
#pragma once

#define CERTKV_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define CERTKV_TARGET_PUSH(isa) CERTKV_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define CERTKV_TARGET_POP() CERTKV_PRAGMA(clang attribute pop)
#else
#define CERTKV_TARGET_PUSH(isa) CERTKV_PRAGMA(GCC push_options) CERTKV_PRAGMA(GCC target(isa))
#define CERTKV_TARGET_POP() CERTKV_PRAGMA(GCC pop_options)
#endif
