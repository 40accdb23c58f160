// Host tests of bit_mma_layout.h: a warp's m16n8k128 .b1 AND-POPC product, emulated from the PTX
// fragment definitions (a reference written from the ISA's row / column formulas, independent of
// the layout under test), gives every lane's <c_b, q_u> for its tokens and heads exactly, for
// head_dim 64 and 128 and groups of 1 to 8 heads; a wrong column assignment fails the same check.
#include "attention/cuda/bit_mma_layout.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <functional>
#include <random>

#include "index/code_dot.h"

namespace certkv::attention::cuda::tile {
namespace {

using Registers = std::array<std::array<int32_t, 4>, 32>;  // per lane: c0..c3

// mma.sync m16n8k128 .b1 AND-POPC with C = 0, from the PTX fragments: lane 4 g + t holds
// a[0] = bits 32 t.. of row g, a[1] = bits 32 t.. of row g + 8, b = bits 32 t.. of column g;
// it receives d[0], d[1] = row g, columns 2 t, 2 t + 1 and d[2], d[3] = row g + 8.
Registers bmma_m16n8k128_and_popc_ref(const std::array<std::array<uint32_t, 2>, 32>& a,
                                      const std::array<uint32_t, 32>& b) {
  uint32_t rows[16][4] = {}, columns[8][4] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    rows[g][t] = a[size_t(lane)][0];
    rows[g + 8][t] = a[size_t(lane)][1];
    columns[g][t] = b[size_t(lane)];
  }
  Registers d{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
      int32_t sum = 0;
      for (int w = 0; w < 4; ++w) sum += index::popcount32(rows[r][w] & columns[n][w]);
      d[size_t(lane)][size_t(i)] = sum;
    }
  }
  return d;
}

// The kernel's inputs as it receives them: 64-bit code words (index::RabitqRecord::code) and
// 64-bit query planes (DeviceRabitqQuery::planes), bits past head_dim zero; q_u for the reference.
struct Inputs {
  uint64_t code[16][2] = {};      // token r's code
  int q_u[8][128] = {};           // each head's 4-bit levels, 0 past head_dim
  uint64_t planes64[8][4][2] = {};  // [head][bit][word]
};

Inputs random_inputs(int head_dim, int group, uint32_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  for (auto& row : in.code)
    for (int i = 0; i < head_dim; ++i) row[i / 64] |= (rng() & 1) << (i % 64);
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < head_dim; ++i) {
      in.q_u[h][i] = int(rng() % 16);
      for (int bit = 0; bit < 4; ++bit)
        if ((in.q_u[h][i] >> bit) & 1) in.planes64[h][bit][i / 64] |= uint64_t(1) << (i % 64);
    }
  return in;
}

// The column assignment under test: (tile, column) -> (head, plane).
using ColumnMap = std::function<std::pair<int, int>(int, int)>;

// Counts the (lane, cell) pairs whose combined accumulators differ from the integer. The warp's
// registers are built with the kernel's own helpers (bit_mma_word, bit_mma_a_token, the B
// registers through `column_of`, bit_mma_tiles, bit_mma_cell_dot), the product by the emulation.
using CellCombine = std::function<int32_t(const int32_t (&)[kBitMmaTiles][4], int)>;
const CellCombine kCellDot = [](const int32_t (&acc)[kBitMmaTiles][4], int cell) { return bit_mma_cell_dot(acc, cell); };

int mismatches(const Inputs& in, int head_dim, int group, const ColumnMap& column_of,
               const CellCombine& combine = kCellDot) {
  const int words = head_dim / 32;
  uint32_t planes[8][4][4] = {};  // as the kernel stages them in shared memory
  for (int h = 0; h < group; ++h)
    for (int bit = 0; bit < 4; ++bit)
      for (int w = 0; w < 4; ++w) planes[h][bit][w] = bit_mma_word(in.planes64[h][bit], w, words);
  std::array<std::array<uint32_t, 2>, 32> a{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 2; ++r) a[size_t(lane)][size_t(r)] = bit_mma_word(in.code[bit_mma_a_token(g, r)], t, words);
  }
  std::array<Registers, kBitMmaTiles> acc{};
  for (int j = 0; j < bit_mma_tiles(group); ++j) {
    std::array<uint32_t, 32> b{};
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane >> 2, t = lane & 3;
      const auto [head, plane] = column_of(j, g);
      b[size_t(lane)] = planes[head][plane][t];
    }
    acc[size_t(j)] = bmma_m16n8k128_and_popc_ref(a, b);
  }
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    int32_t lane_acc[kBitMmaTiles][4];
    for (int j = 0; j < kBitMmaTiles; ++j)
      for (int i = 0; i < 4; ++i) lane_acc[j][i] = acc[size_t(j)][size_t(lane)][size_t(i)];
    for (int cell = 0; cell < 4; ++cell) {
      const int head = bit_mma_lane_head(t, bit_mma_cell_slot(cell));
      if (head >= group) continue;
      const int token = g + 8 * bit_mma_cell_half(cell);
      int32_t expected = 0;
      for (int i = 0; i < head_dim; ++i) expected += int32_t((in.code[token][i / 64] >> (i % 64)) & 1u) * in.q_u[head][i];
      uint32_t code[4], head_planes[4][4];
      for (int w = 0; w < 4; ++w) {
        code[w] = bit_mma_word(in.code[token], w, words);
        for (int bit = 0; bit < 4; ++bit) head_planes[bit][w] = planes[head][bit][w];
      }
      EXPECT_EQ(index::code_dot_planes_ref<4>(code, head_planes), expected);  // the reference itself
      bad += combine(lane_acc, cell) != expected;
    }
  }
  return bad;
}

// The kernel's B registers are bit_mma_b_register(planes, j, g, t); the column map under test
// must give the same word (checked here for the layout's own map).
TEST(BitMmaLayout, TheKernelsBRegistersAreTheColumnMap) {
  uint32_t planes[8][4][4];
  for (int h = 0; h < 8; ++h)
    for (int bit = 0; bit < 4; ++bit)
      for (int w = 0; w < 4; ++w) planes[h][bit][w] = uint32_t(100 * h + 10 * bit + w);
  for (int j = 0; j < kBitMmaTiles; ++j)
    for (int g = 0; g < 8; ++g)
      for (int t = 0; t < 4; ++t)
        EXPECT_EQ(bit_mma_b_register(planes, j, g, t),
                  planes[bit_mma_column_head(j, g)][bit_mma_column_plane(j, g)][t]);
}

const ColumnMap kLayout = [](int tile, int column) {
  return std::pair<int, int>{bit_mma_column_head(tile, column), bit_mma_column_plane(tile, column)};
};

TEST(BitMmaLayout, EveryLaneGetsTheIntegerTermOfItsTokensAndHeads) {
  uint32_t seed = 1;
  for (int head_dim : {64, 128})
    for (int group = 1; group <= 8; ++group)
      for (int rep = 0; rep < 20; ++rep) {
        SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", group " + std::to_string(group));
        EXPECT_EQ(mismatches(random_inputs(head_dim, group, seed++), head_dim, group, kLayout), 0);
      }
}

TEST(BitMmaLayout, ExtremeCodesAndLevels) {
  // All ones against the largest levels (the largest sum, 15 x 128 = 1,920), and codes of zeros.
  for (uint64_t fill : {~uint64_t(0), uint64_t(0)}) {
    Inputs in;
    for (auto& row : in.code)
      for (uint64_t& w : row) w = fill;
    for (int h = 0; h < 8; ++h)
      for (int i = 0; i < 128; ++i) {
        in.q_u[h][i] = 15;
        for (int bit = 0; bit < 4; ++bit) in.planes64[h][bit][i / 64] |= uint64_t(1) << (i % 64);
      }
    EXPECT_EQ(mismatches(in, 128, 8, kLayout), 0);
  }
}

// Negative controls: slips the kernel could make (heads and plane pairs swapped between the tiles;
// the planes of a pair swapped; a cell's slot and token half swapped) give wrong sums, so the
// check above can fail.
TEST(BitMmaLayout, AWrongColumnAssignmentIsCaught) {
  const ColumnMap tiles_swapped = [](int tile, int column) {
    return std::pair<int, int>{column / 2 + 4 * (tile % 2), 2 * (tile / 2) + column % 2};
  };
  const ColumnMap planes_swapped = [](int tile, int column) {
    return std::pair<int, int>{bit_mma_column_head(tile, column), 2 * (tile % 2) + 1 - column % 2};
  };
  // A cell's slot and token half swapped when the accumulators are combined.
  const CellCombine cell_swapped = [](const int32_t (&acc)[kBitMmaTiles][4], int cell) {
    return bit_mma_dot(acc[2 * bit_mma_cell_half(cell)], acc[2 * bit_mma_cell_half(cell) + 1], bit_mma_cell_slot(cell));
  };
  const Inputs in = random_inputs(128, 8, 99);
  EXPECT_GT(mismatches(in, 128, 8, tiles_swapped), 0);
  EXPECT_GT(mismatches(in, 128, 8, planes_swapped), 0);
  EXPECT_GT(mismatches(in, 128, 8, kLayout, cell_swapped), 0);
}

}  // namespace
}  // namespace certkv::attention::cuda::tile
