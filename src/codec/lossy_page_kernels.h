// Internal to the codec layer: the lossy page decoders' kernels (lossy_page_x86.cc), bound to one
// validated spec by codec::LossyPageDecoder (lossy_page.h). Each kernel writes the floats of
// lossy_decode_page_ref bit for bit, NaNs of corrupt pages included.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/lossy_page.h"

namespace certkv::codec::detail {

// LossyDecodeArgs and LossyDecodeKernel are declared in lossy_page.h (the decoder holds them).
// REQUIRES (every kernel): 1 <= n_rows <= block_tokens; the CPU has the kernel's instructions.

// The x86 kernels (null on other architectures) and whether this CPU runs them.
LossyDecodeKernel lossy_decode_kernel_avx2();
LossyDecodeKernel lossy_decode_kernel_avx512();
bool cpu_runs_lossy_avx2();
bool cpu_runs_lossy_avx512();

}  // namespace certkv::codec::detail
