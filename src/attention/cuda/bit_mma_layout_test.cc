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

struct Inputs {
  uint32_t code[16][4] = {};       // token r's code, words past head_dim zero
  int q_u[8][128] = {};            // each head's 4-bit levels, 0 past head_dim
  uint32_t planes[8][4][4] = {};   // [head][bit][word], as the kernel stages them
};

Inputs random_inputs(int head_dim, int group, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  for (auto& row : in.code)
    for (int w = 0; w < head_dim / 32; ++w) row[w] = uint32_t(rng());
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < head_dim; ++i) {
      in.q_u[h][i] = int(rng() % 16);
      for (int bit = 0; bit < 4; ++bit)
        if ((in.q_u[h][i] >> bit) & 1) in.planes[h][bit][i / 32] |= 1u << (i % 32);
    }
  return in;
}

// The column assignment under test: (tile, column) -> (head, plane).
using ColumnMap = std::function<std::pair<int, int>(int, int)>;

// Counts the (lane, slot, token) cells whose combined accumulators differ from the integer.
int mismatches(const Inputs& in, int head_dim, int group, const ColumnMap& column_of) {
  std::array<std::array<uint32_t, 2>, 32> a{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    a[size_t(lane)] = {in.code[g][t], in.code[g + 8][t]};
  }
  const int tiles = group > 4 ? 4 : 2;
  std::array<Registers, kBitMmaTiles> acc{};
  for (int j = 0; j < tiles; ++j) {
    std::array<uint32_t, 32> b{};
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane >> 2, t = lane & 3;
      const auto [head, plane] = column_of(j, g);
      b[size_t(lane)] = in.planes[head][plane][t];
    }
    acc[size_t(j)] = bmma_m16n8k128_and_popc_ref(a, b);
  }
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int slot = 0; slot < tiles / 2; ++slot) {
      const int head = bit_mma_lane_head(t, slot);
      if (head >= group) continue;
      int32_t low[4], high[4];
      for (int i = 0; i < 4; ++i) {
        low[i] = acc[size_t(2 * slot)][size_t(lane)][size_t(i)];
        high[i] = acc[size_t(2 * slot + 1)][size_t(lane)][size_t(i)];
      }
      for (int half = 0; half < 2; ++half) {
        const int token = g + 8 * half;
        int32_t expected = 0;
        for (int i = 0; i < head_dim; ++i) expected += int32_t((in.code[token][i / 32] >> (i % 32)) & 1u) * in.q_u[head][i];
        uint32_t code[4], planes[4][4];
        for (int w = 0; w < 4; ++w) {
          code[w] = in.code[token][w];
          for (int bit = 0; bit < 4; ++bit) planes[bit][w] = in.planes[head][bit][w];
        }
        EXPECT_EQ(index::code_dot_planes_ref<4>(code, planes), expected);  // the reference itself
        bad += bit_mma_dot(low, high, half) != expected;
      }
    }
  }
  return bad;
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
  for (uint32_t fill : {0xffffffffu, 0u}) {
    Inputs in;
    for (auto& row : in.code)
      for (uint32_t& w : row) w = fill;
    for (int h = 0; h < 8; ++h)
      for (int i = 0; i < 128; ++i) {
        in.q_u[h][i] = 15;
        for (int bit = 0; bit < 4; ++bit) in.planes[h][bit][i / 32] |= 1u << (i % 32);
      }
    EXPECT_EQ(mismatches(in, 128, 8, kLayout), 0);
  }
}

// Negative controls: assignments a slip could produce (heads and plane pairs swapped between the
// tiles; the planes of a pair swapped) give wrong sums, so the check above can fail.
TEST(BitMmaLayout, AWrongColumnAssignmentIsCaught) {
  const ColumnMap tiles_swapped = [](int tile, int column) {
    return std::pair<int, int>{column / 2 + 4 * (tile % 2), 2 * (tile / 2) + column % 2};
  };
  const ColumnMap planes_swapped = [](int tile, int column) {
    return std::pair<int, int>{bit_mma_column_head(tile, column), 2 * (tile % 2) + 1 - column % 2};
  };
  const Inputs in = random_inputs(128, 8, 99);
  EXPECT_GT(mismatches(in, 128, 8, tiles_swapped), 0);
  EXPECT_GT(mismatches(in, 128, 8, planes_swapped), 0);
}

}  // namespace
}  // namespace certkv::attention::cuda::tile
