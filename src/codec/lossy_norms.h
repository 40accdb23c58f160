// Internal to the codec layer: the Tier A side data's norms of a lossy page (lossy_page.cc writes
// them as the K witness or the V rho). Their own translation unit, compiled with
// -ffp-contract=off (CMakeLists.txt): every product and sum is its own IEEE double rounding in
// the order below, as on the device (codec/cuda/lossy_encode_cuda.cu), whatever the host's FMA.
#pragma once

#include <cstdint>

#include "codec/lossy_page.h"

namespace certkv::codec::detail {

// The computed norms carry a relative error below 2^-44 (at most 256 squares summed in double);
// this factor covers it before the upward rounding.
inline constexpr double kNormSafety = 1.0 + 0x1p-40;

// bound[b * block_tokens + t] = sqrt(sum of r_c^2) * kNormSafety over the channels c of band b's
// RoPE pairs (K pages: witness_bands bands; V pages: one band of every channel), r = double(recon)
// - double(x); each band's squares summed in pair order, channel a then b of a pair.
// x: [block_tokens][head_dim] bf16, recon: the decoded page, bound: n_bands * block_tokens.
void tier_a_norm_bounds_ref(const LossyPageSpec& spec, const uint16_t* x, const float* recon, double* bound);
// The same doubles: a row's squares first, then each band's sum in that order, the roots eight at
// a time with AVX-512.
void tier_a_norm_bounds(const LossyPageSpec& spec, const uint16_t* x, const float* recon, double* bound);

}  // namespace certkv::codec::detail
