// Internal to the codec layer: the lossy page decoders' kernels (lossy_page_x86.cc), bound to one
// validated spec by codec::LossyPageDecoder (lossy_page.h). Each kernel writes the floats of
// lossy_decode_page_ref bit for bit, NaNs of corrupt pages included.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "codec/lossy_page.h"

namespace certkv::codec::detail {

// LossyDecodeArgs and LossyDecodeKernel are declared in lossy_page.h (the decoder holds them).
// REQUIRES (every kernel): 1 <= n_rows <= block_tokens; the CPU has the kernel's instructions.

// fp8-e4m3-scaled rows whose scale is NaN (a corrupt page): every element is the scale's NaN
// with the quiet bit set. The product s * code would keep the NaN of whichever operand the
// compiler put first when the code is NaN too, so the reference and every kernel write this
// row whole instead.
inline float scaled_row_nan(float s) { return std::bit_cast<float>(std::bit_cast<uint32_t>(s) | 0x00400000u); }

// The x86 kernels (null on other architectures) and whether this CPU runs them.
LossyDecodeKernel lossy_decode_kernel_avx2();
LossyDecodeKernel lossy_decode_kernel_avx512();
bool cpu_runs_lossy_avx2();
bool cpu_runs_lossy_avx512();

}  // namespace certkv::codec::detail
