// Reconstruction of the token rows of a GAAC slot (docs/format/gaac.md, format/gaac_layout.h)
// straight into the float rows attention works on: the exponent is the calibrated base plus the
// code (seed 003: integer addition, no table), sign and mantissa are the kept byte, and the float
// is the bf16 bit pattern shifted up by 16, so the rows equal those of the raw BF16 page.
//
// This is attention's fused reader (the CPU counterpart of a device kernel reading slots); the
// codec's decoders (codec/gaac.h) are the reference it is tested against. It validates what the
// format allows (a tag of 3, escape bytes past the slot: certkv::Error kCorrupt) and never reads
// past slot_bytes.
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/gaac.h"

namespace certkv::attention {

enum class GaacRowsKernel {
  kPortable,    // one group at a time, any CPU
  kAvx512Vbmi,  // 64 channels at a time: byte permutes and multishifts unpack the 3-bit codes
};

// kAvx512Vbmi when the CPU has AVX-512 F/BW/VBMI and BMI2, else kPortable (checked once).
GaacRowsKernel gaac_rows_best_kernel();
bool gaac_rows_kernel_supported(GaacRowsKernel kernel);

// Rows [0, n_rows) of a BF16 GAAC page as floats. slot: slot_bytes readable bytes;
// out: [n_rows][head_dim]. bases: the page's (layer, K/V, kv_head) bases, head_dim each.
// REQUIRES: 0 <= n_rows <= block_tokens, gaac_tile_channels(head_dim) != 0, bases sized head_dim
// (kInvalidArgument otherwise; base ranges are the calibration's to check).
void gaac_rows_to_float(const uint8_t* slot, size_t slot_bytes, int block_tokens, int head_dim,
                        const codec::GaacBases& bases, int n_rows, float* out,
                        GaacRowsKernel kernel = gaac_rows_best_kernel());

// The reference: codec::gaac_decode_rows_ref, then bf16 -> float.
void gaac_rows_to_float_ref(const uint8_t* slot, size_t slot_bytes, int block_tokens,
                            int head_dim, const codec::GaacBases& bases, int n_rows, float* out);

}  // namespace certkv::attention
