// The operands of the sparse estimate's bit form (sparse_decode_cuda.cu): RaBitQ's integer term
// <c_b, q_u> = sum_b 2^b popcount(c_b & plane_b) (seed 002, Eq. 20) for 16 tokens and up to 8
// query heads at once on tensor cores, by `mma.sync.aligned.m16n8k128.row.col.s32.b1.b1.s32.and.popc`
// (D = A AND-POPC B + C: d[r][n] = c[r][n] + popcount(row r of A & column n of B), 128-bit rows
// and columns). Index arithmetic only, no CUDA headers, so that the host tests
// (bit_mma_layout_test.cc) check it against the integer on the host.
//
// The PTX fragments of m16n8k128 .b1 (PTX ISA, "Matrix Fragments for mma.m16n8k128"), for lane
// 4 g + t (g = groupID, t = threadID_in_group):
//   A (16 x 128, rows): register 0 holds bits 32 t .. 32 t + 31 of row g, register 1 of row g + 8;
//   B (128 x 8, columns): its one register holds bits 32 t .. 32 t + 31 of column g;
//   C (16 x 8, s32): c0, c1 are row g, columns 2 t and 2 t + 1; c2, c3 the same of row g + 8.
//
// The estimate's rows are 16 tokens (row r: word t of its code in lane t's register; head_dim 64
// leaves words 2 and 3 zero), and its columns are (head, plane) pairs over four 8-column tiles:
// column n of tile j is plane 2 (j % 2) + n % 2 of head n / 2 + 4 (j / 2). So lane 4 g + t ends
// with all four planes of head t (tiles 0 and 1) and of head t + 4 (tiles 2 and 3) for tokens g
// and g + 8 in its accumulators: the 16 tokens x 4 heads of a group of up to 4 take every lane
// (two tiles, two mma), and a group of up to 8 four tiles.
#pragma once

#include <cstdint>

#include "format/numeric.h"

namespace certkv::attention::cuda::tile {

inline constexpr int kBitMmaTiles = 4;  // 8-column tiles: 2 heads' slots x 2 plane pairs
inline constexpr int kBitMmaWords = 4;  // 32-bit words of a 128-bit row or column

// The query head and the plane of column `column` (0..7) of tile `tile` (0..3).
CERTKV_HD constexpr int bit_mma_column_head(int tile, int column) { return column / 2 + 4 * (tile / 2); }
CERTKV_HD constexpr int bit_mma_column_plane(int tile, int column) { return 2 * (tile % 2) + column % 2; }

// The head whose planes lane 4 g + t holds in slot s (tiles 2 s and 2 s + 1): t + 4 s.
CERTKV_HD constexpr int bit_mma_lane_head(int t, int slot) { return t + 4 * slot; }

// The 8-column tiles a group of `group` query heads needs: 2 up to 4 heads, 4 up to 8.
CERTKV_HD constexpr int bit_mma_tiles(int group) { return group > 4 ? 4 : 2; }

// Word w (0..3) of a 128-bit row or column held as 64-bit words (index::RabitqRecord::code,
// DeviceRabitqQuery::planes), 0 from word `words` on (the head dim's 32-bit words). Every form of
// the estimate reads codes and planes as 32-bit words through it.
CERTKV_HD constexpr uint32_t bit_mma_word(const uint64_t* bits, int w, int words) {
  return w < words ? uint32_t(bits[w / 2] >> (32 * (w % 2))) : 0u;
}

// A: lane 4 g + t's register r (0, 1) is word t of token g + 8 r of the tile.
CERTKV_HD constexpr int bit_mma_a_token(int g, int r) { return g + 8 * r; }

// B: lane 4 g + t's register of tile j is word t of column g: plane
// bit_mma_column_plane(j, g) of head bit_mma_column_head(j, g). planes[head][plane][word].
template <class Planes>
CERTKV_HD constexpr uint32_t bit_mma_b_register(const Planes& planes, int tile, int g, int t) {
  return planes[bit_mma_column_head(tile, g)][bit_mma_column_plane(tile, g)][t];
}

// <c_b, q_u> of the lane's token `half` (0: row g, accumulators c0 and c1; 1: row g + 8, c2 and
// c3) and its head of a slot, from that slot's two tiles: `low` (planes 0 and 1) and `high`
// (planes 2 and 3). Exact: at most 15 x 128 = 1,920.
CERTKV_HD constexpr int32_t bit_mma_dot(const int32_t (&low)[4], const int32_t (&high)[4], int half) {
  return low[2 * half] + 2 * low[2 * half + 1] + 4 * high[2 * half] + 8 * high[2 * half + 1];
}

// A lane's cell i (0..3): slot i & 1 (head bit_mma_lane_head(t, i & 1)), token half i >> 1 (token
// g + 8 (i >> 1)); its <c_b, q_u> from the lane's accumulators of every tile.
CERTKV_HD constexpr int bit_mma_cell_slot(int i) { return i & 1; }
CERTKV_HD constexpr int bit_mma_cell_half(int i) { return i >> 1; }
CERTKV_HD constexpr int32_t bit_mma_cell_dot(const int32_t (&acc)[kBitMmaTiles][4], int i) {
  return bit_mma_dot(acc[2 * bit_mma_cell_slot(i)], acc[2 * bit_mma_cell_slot(i) + 1], bit_mma_cell_half(i));
}

// Every column of every tile is one (head, plane) pair, and the accumulators a lane combines are
// its head's four planes (checked at compile time, with the weights 1, 2, 4, 8 of bit_mma_dot
// below; the host tests run the whole product).
constexpr bool bit_mma_columns_hold() {
  bool seen[8][4] = {};
  for (int j = 0; j < kBitMmaTiles; ++j)
    for (int n = 0; n < 8; ++n) {
      bool& s = seen[bit_mma_column_head(j, n)][bit_mma_column_plane(j, n)];
      if (s) return false;
      s = true;
    }
  for (int t = 0; t < 4; ++t)
    for (int slot = 0; slot < 2; ++slot)
      for (int j = 2 * slot; j < 2 * slot + 2; ++j)
        for (int e = 0; e < 2; ++e) {  // accumulator column 2 t + e of tile j
          if (bit_mma_column_head(j, 2 * t + e) != bit_mma_lane_head(t, slot)) return false;
          if (bit_mma_column_plane(j, 2 * t + e) != 2 * (j % 2) + e) return false;
        }
  return true;
}
static_assert(bit_mma_columns_hold(), "each (head, plane) once; a lane's four planes of its heads");
// Plane p's count alone (1 in accumulator column e = p % 2 of tile p / 2, both token halves)
// combines to 2^p.
constexpr bool bit_mma_weights_hold() {
  for (int plane = 0; plane < 4; ++plane)
    for (int half = 0; half < 2; ++half) {
      int32_t low[4] = {0, 0, 0, 0}, high[4] = {0, 0, 0, 0};
      (plane < 2 ? low : high)[2 * half + plane % 2] = 1;
      if (bit_mma_dot(low, high, half) != (1 << plane)) return false;
    }
  return true;
}
static_assert(bit_mma_weights_hold(), "plane p weighs 2^p");

}  // namespace certkv::attention::cuda::tile
