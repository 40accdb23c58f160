// Where the elements of a decode-attention tile, a staged page and the GAAC bases live in shared
// memory: constexpr index arithmetic shared by the kernels (tile_mma.cuh, paged_decode_cuda.cu,
// sparse_decode_cuda.cu) and the host tests that check its bank-conflict properties
// (tile_layout_test.cc). No CUDA headers.
//
// Shared memory has 32 banks of 4 bytes; a 16-byte access by a quarter warp (8 lanes) is one
// wavefront when the 8 addresses fall in 8 distinct 16-byte bank groups ((byte address / 16) mod 8).
// The layouts below are built so that the accesses of the kernels do.
#pragma once

#include "format/numeric.h"

namespace certkv::attention::cuda::tile {

inline constexpr int kTileTokens = 16;

// Element offset of chunk `chunk` (channels 8 chunk .. 8 chunk + 7) of row `row` in a tile: the
// chunk index XOR the row's low 3 bits, with bit 2 of that mask flipped in the upper half of a row
// when a half spans 8 chunks or more (D >= 128). Within a row it is a permutation of the chunks
// of each aligned group of 8, so 8 consecutive rows at one chunk, and 4 consecutive rows at one
// chunk of each half, fall in 8 distinct 16-byte bank groups (the row stride is a multiple of 128
// bytes).
template <int D>
CERTKV_HD constexpr int tile_index(int row, int chunk) {
  const int upper = (D >= 128 && chunk >= D / 16) ? 4 : 0;
  return row * D + 8 * (chunk ^ ((row ^ upper) & 7));
}
// tile_index(row, c ^ s) == tile_index(row, c) ^ tile_step<D>(s) for every chunk c and s of a row
// (the row offset is a multiple of 128 bytes, the chunk part below it, and bit 3 of c ^ s, which
// selects the upper half at D = 128, is bit 3 of c XOR bit 3 of s): a lane computes its chunk's
// offset once, and the others of a static step are one XOR each.
template <int D>
CERTKV_HD constexpr int tile_step(int s) {
  return 8 * (s ^ ((D >= 128 && s >= D / 16) ? 4 : 0));
}
template <int D>
constexpr bool tile_step_holds() {
  for (int row = 0; row < 16; ++row)
    for (int c = 0; c < D / 8; ++c)
      for (int x = 0; x < D / 8; ++x)
        if (tile_index<D>(row, c ^ x) != (tile_index<D>(row, c) ^ tile_step<D>(x))) return false;
  return true;
}
static_assert(tile_step_holds<64>() && tile_step_holds<128>(), "tile_step is an XOR of tile_index");
// The element offset of channel c of row `row`.
template <int D>
CERTKV_HD constexpr int tile_element(int row, int c) {
  return tile_index<D>(row, c / 8) + c % 8;
}

// The two layouts: kElements per tile; offset(row, chunk), the element offset of a row's 16-byte
// chunk; at(base, s), the offset of chunk c + s from base = offset(row, c), for a static step s
// whose bits are disjoint from c's (then c + s == c ^ s).
template <int D>
struct PaddedTile {
  static constexpr int kElements = kTileTokens * (D + 8);
  CERTKV_HD static constexpr int offset(int row, int chunk) { return row * (D + 8) + 8 * chunk; }
  CERTKV_HD static constexpr int at(int base, int s) { return base + 8 * s; }
};
template <int D>
struct SwizzledTile {
  static constexpr int kElements = kTileTokens * D;
  CERTKV_HD static constexpr int offset(int row, int chunk) { return tile_index<D>(row, chunk); }
  CERTKV_HD static constexpr int at(int base, int s) { return base ^ tile_step<D>(s); }
};

// The sparse attention's gathered rows (D bf16 each: D / 8 chunks of 16 bytes). A tile's rows are
// copied in D / 16 instructions of 32 lanes x 16 bytes, whole rows in row-major order: in
// instruction i, lane l copies chunk gather_chunk<D>(l) of row gather_row<D>(i, l). So D / 8
// consecutive lanes copy one row, and each instruction asks L2 for whole 128-byte lines (two per
// row at D = 128, one at D = 64) where a lane per row half asked for one 32-byte sector per row.
template <int D>
CERTKV_HD constexpr int gather_row(int i, int lane) {
  return i * (256 / D) + lane / (D / 8);
}
template <int D>
CERTKV_HD constexpr int gather_chunk(int lane) {
  return lane % (D / 8);
}

// Staged pages: chunk c of a page lands at permuted_chunk(c) = c ^ (c / 8 mod 4) inside the
// regions a kernel permutes (paged_decode_cuda.cu's stage_chunk: an fp8 page's codes, a GAAC bf16
// slot's sign-mantissa bytes): a permutation of each 128-byte row, so that a quarter warp reading
// 4 tokens x 2 row halves of fp8 codes, or 8 lanes' consecutive 64-byte runs, hits 8 bank groups.
// permuted_chunk(c ^ i) == permuted_chunk(c) ^ i for i < 8.
CERTKV_HD constexpr int permuted_chunk(int c) { return c ^ ((c >> 3) & 3); }

// Where base `which` (b3, b4) of channel c lives in a K or V row of the GAAC bases: each row half
// followed by 8 unused elements, so that the four (base, row half) pairs a quarter warp reads for
// one group start in 4 distinct bank groups. A row holds base_row_elements<D>() elements.
template <int D>
CERTKV_HD constexpr int base_index(int which, int c) {
  return which * (D + 16) + c + (c >= D / 2 ? 8 : 0);
}
template <int D>
CERTKV_HD constexpr int base_row_elements() {
  return 2 * (D + 16);
}

}  // namespace certkv::attention::cuda::tile
