// Weight products on AMX tiles (Intel Advanced Matrix Extensions, AMX-INT8), for Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K and Q5_K weights.
//
// The algorithm is matmul_quantized_ref's (model/quantized_dot.h) to the bit: every token row is
// quantized to int8 blocks of 32, each block's integer dot product is exact (tdpbssd sums int8
// products in int32), and each output's blocks are scaled and added in fp32 in block order with
// the reference's expression, (d_w * d) * isum (+ m_w * s). So a token's outputs do not depend on
// how many tokens share the call, and the one-token product is the same arithmetic as the
// many-token one: batch invariance (backend/backend.h) holds by construction.
//
// Layout. A matrix is repacked once, at model load, into records of 16 output rows by one block
// of 32 inputs, groups of 16 rows in order and each group's blocks in order:
//   Q4_0, Q4_1, Q5_0, Q5_1: 256 bytes of nibbles, dword (r, n) at byte 64 r + 4 n = bytes
//               4r..4r+3 of row n's packed codes (low nibbles: elements 4r..4r+3, high:
//               16+4r..16+4r+3), r < 4; Q5 then 64 bytes of fifth bits, bit p the fifth bit of
//               byte p of the B tile below; then d of the 16 rows as float; Q4_1 and Q5_1 then m.
//   Q8_0:       512 bytes, the tile's VNNI order: byte 64 r + 4 n + j = code 4r + j of row n,
//               r < 8; then d of the 16 rows as float.
//   Q4_K, Q5_K: one record per super-block of 256 (model/matmul_tiles.cc, k_scales_at).
// Rows past n_out read as zero codes and scales. A record's nibbles, masked and shifted (and their
// fifth bits set), are the 8 x 64-byte B tile of the block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/thread_pool.h"
#include "format/ggml_blocks.h"
#include "model/matmul.h"

namespace certkv::model {

// True when this build has the tile path (-march with AMX-INT8), the CPU has AMX-TILE and
// AMX-INT8, the kernel grants this process the tile state, and the environment variable
// CERTKV_MATMUL_TILES is not "0". Decided at the first call, then fixed for the process.
bool matmul_tiles_available();

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K: the types with a tile layout.
bool matmul_tiles_support(format::GgmlType type);

// True when w can be repacked: a type with a tile layout, whole blocks a row, some rows.
bool matmul_tiles_fit(const WeightMatrix& w);

// Bytes of w repacked: ceil(n_out / 16) * (n_in / 32, or / 256 for K-quants) records.
// REQUIRES matmul_tiles_support(w.type) and w.n_in a multiple of the block (certkv::Error otherwise).
size_t matmul_tiles_bytes(const WeightMatrix& w);

// Writes w repacked (the layout above) into out, matmul_tiles_bytes(w) bytes. Plain code, no
// tile instructions: it runs on any CPU. Same REQUIRES as matmul_tiles_bytes.
void tile_weights(const WeightMatrix& w, uint8_t* out);

// y[m] = x w[m]^T for matrices that all carry tiles (w[m].tiles != nullptr), bit-identical to
// matmul_quantized_ref. Called by matmul; REQUIRES matmul_tiles_available(), shapes checked by
// matmul, all n_in equal.
void matmul_tiled(std::span<const WeightMatrix> w, const float* x, int64_t n_tokens,
                  std::span<float* const> y, ThreadPool& pool);

}  // namespace certkv::model
