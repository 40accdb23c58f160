// Host checks of the shared-memory layouts of the decode kernels (tile_layout.h): every layout is a
// permutation of its slots, and the 16-byte accesses the kernels make (ldmatrix rows, the
// decoders' stores and staged reads, the GAAC base loads) fall in 8 distinct bank groups per
// quarter warp. Negative controls show the checker failing the padded layout for the decoders'
// stores at D = 128 and unpermuted fp8 stage reads, the conflicts the layouts remove. No device.
#include "attention/cuda/tile_layout.h"

#include <gtest/gtest.h>

#include <array>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

namespace certkv::attention::cuda::tile {
namespace {

// The 16-byte bank group of a byte offset (regions start on 128-byte rows).
int bank_group(int byte) { return (byte / 16) % 8; }

// True when the 8 byte offsets of a quarter warp's 16-byte accesses fall in 8 distinct groups.
bool one_wavefront(const std::array<int, 8>& bytes) {
  std::set<int> groups;
  for (int b : bytes) groups.insert(bank_group(b));
  return groups.size() == 8;
}

// Element offsets of every (row, chunk) of a tile of layout L: distinct, 16-byte aligned, inside
// the tile.
template <int D, class L>
void expect_permutation() {
  std::set<int> seen;
  for (int row = 0; row < kTileTokens; ++row)
    for (int chunk = 0; chunk < D / 8; ++chunk) {
      const int e = L::offset(row, chunk);
      EXPECT_EQ(e % 8, 0) << "D " << D << " row " << row << " chunk " << chunk;
      EXPECT_GE(e, 0);
      EXPECT_LE(e + 8, L::kElements);
      EXPECT_TRUE(seen.insert(e).second) << "D " << D << " row " << row << " chunk " << chunk << " reused";
    }
}

// ldmatrix as tile_scores and tile_pv address it: matrix m of an x4 load is lanes 8m .. 8m + 7,
// each giving one row address; the steps are L::at from the lane's first chunk.
template <int D, class L>
void expect_ldmatrix_one_wavefront() {
  for (int kk = 0; kk < D / 16; ++kk)
    for (int m = 0; m < 4; ++m) {
      std::array<int, 8> scores{}, values{};
      for (int i = 0; i < 8; ++i) {
        const int lane = 8 * m + i;
        const int ld_token = ((lane >> 3) & 1) * 8 + (lane & 7);
        const int ld = L::at(L::offset(ld_token, lane >> 4), 2 * kk);
        EXPECT_EQ(ld, L::offset(ld_token, 2 * kk + (lane >> 4)));
        scores[size_t(i)] = 2 * ld;
        const int vt_token = (lane >> 4) * 8 + (lane & 7);
        const int vt = L::at(L::offset(vt_token, (lane >> 3) & 1), 2 * kk);
        EXPECT_EQ(vt, L::offset(vt_token, 2 * kk + ((lane >> 3) & 1)));
        values[size_t(i)] = 2 * vt;
      }
      EXPECT_TRUE(one_wavefront(scores)) << "D " << D << " step " << kk << " matrix " << m;
      EXPECT_TRUE(one_wavefront(values)) << "D " << D << " step " << kk << " matrix " << m;
    }
}

// The decoders' stores: lane l writes chunk i of half l % 2 of row l / 2 (paged_decode_cuda.cu's
// tile_chunk). Returns whether every quarter warp's store of every chunk is one wavefront.
template <int D, class L>
bool decoder_stores_one_wavefront() {
  bool all = true;
  for (int i = 0; i < D / 16; ++i)
    for (int q = 0; q < 4; ++q) {
      std::array<int, 8> bytes{};
      for (int k = 0; k < 8; ++k) {
        const int lane = 8 * q + k, t = lane >> 1, h = lane & 1;
        const int e = L::at(L::offset(t, h * (D / 16)), i);
        EXPECT_EQ(e, L::offset(t, h * (D / 16) + i));
        bytes[size_t(k)] = 2 * e;
      }
      all = all && one_wavefront(bytes);
    }
  return all;
}

// The sparse attention's row copies (gather_row, gather_chunk): over the D / 16 instructions every
// (row, chunk) of a tile once; each instruction's lanes ask for whole 128-byte lines of the rows in
// global memory (a row of D bf16 starts on a multiple of 128 bytes: D * 2 is 128 or 256); and the
// padded tile's stores of each quarter warp are one wavefront. Checks that every (row, chunk) is
// copied once, and returns whether every instruction reads whole lines and stores in one wavefront
// per quarter warp (the negative control, the lane-per-row-half copy, does neither).
struct GatherCopy {
  bool whole_lines = true, one_wavefront = true;
};
template <int D, class Copy>
GatherCopy gather_copy_of(Copy copy) {
  GatherCopy g;
  std::set<std::pair<int, int>> seen;
  for (int i = 0; i < D / 16; ++i) {
    std::map<int, int> line_bytes;  // 128-byte line of the tile's rows -> bytes asked for
    for (int q = 0; q < 4; ++q) {
      std::array<int, 8> bytes{};
      for (int k = 0; k < 8; ++k) {
        const int lane = 8 * q + k;
        const auto [row, chunk] = copy(i, lane);
        EXPECT_TRUE(row >= 0 && row < kTileTokens && chunk >= 0 && chunk < D / 8) << "D " << D;
        EXPECT_TRUE(seen.insert({row, chunk}).second) << "D " << D << " row " << row << " chunk " << chunk << " twice";
        line_bytes[(row * D * 2 + 16 * chunk) / 128] += 16;
        bytes[size_t(k)] = 2 * PaddedTile<D>::offset(row, chunk);
      }
      g.one_wavefront = g.one_wavefront && one_wavefront(bytes);
    }
    for (const auto& [line, n] : line_bytes) g.whole_lines = g.whole_lines && n == 128;
  }
  EXPECT_EQ(seen.size(), size_t(kTileTokens * D / 8)) << "D " << D;
  return g;
}

TEST(TileLayout, EveryLayoutIsAPermutationOfItsChunks) {
  expect_permutation<64, PaddedTile<64>>();
  expect_permutation<128, PaddedTile<128>>();
  expect_permutation<64, SwizzledTile<64>>();
  expect_permutation<128, SwizzledTile<128>>();
}

TEST(TileLayout, LdmatrixRowsAreOneWavefrontInBothLayouts) {
  expect_ldmatrix_one_wavefront<64, PaddedTile<64>>();
  expect_ldmatrix_one_wavefront<128, PaddedTile<128>>();
  expect_ldmatrix_one_wavefront<64, SwizzledTile<64>>();
  expect_ldmatrix_one_wavefront<128, SwizzledTile<128>>();
}

TEST(TileLayout, DecoderStoresAreOneWavefrontOnlyInTheSwizzledLayout) {
  EXPECT_TRUE((decoder_stores_one_wavefront<64, SwizzledTile<64>>()));
  EXPECT_TRUE((decoder_stores_one_wavefront<128, SwizzledTile<128>>()));
  // At D = 128 the padded rows (272 bytes) put both halves of a token in one bank group: the
  // conflict removed. At D = 64 (144-byte rows) the halves fall 4 groups apart.
  EXPECT_FALSE((decoder_stores_one_wavefront<128, PaddedTile<128>>()));
  EXPECT_TRUE((decoder_stores_one_wavefront<64, PaddedTile<64>>()));
}

// tile_element (the dither8 decoder's per-channel stores) places the D channels of a row on the
// row's own D elements, each once, and keeps the 8 channels of a chunk together in order.
template <int kDim>
void expect_elements_permute_their_row() {
  for (int row = 0; row < kTileTokens; ++row) {
    std::vector<int> hit(static_cast<size_t>(kDim), 0);
    for (int c = 0; c < kDim; ++c) {
      const int e = tile_element<kDim>(row, c);
      ASSERT_GE(e, row * kDim);
      ASSERT_LT(e, (row + 1) * kDim);
      ++hit[size_t(e - row * kDim)];
      if (c % 8 != 0) {
        EXPECT_EQ(e, tile_element<kDim>(row, c - 1) + 1);
      }
    }
    for (int n : hit) EXPECT_EQ(n, 1) << "D " << kDim << " row " << row;
  }
}

TEST(TileLayout, TileElementPermutesTheChannelsOfItsRow) {
  expect_elements_permute_their_row<64>();
  expect_elements_permute_their_row<128>();
}

// The staged regions: a permutation of each 128-byte row; the copy loop's shortcut; the readers.
TEST(TileLayout, PermutedStagesAreBijectiveAndReadInOneWavefront) {
  for (int region : {64, 128, 256}) {  // fp8 and GAAC bf16 codes at D = 64, 128 (chunks)
    std::vector<int> hit(size_t(region), 0);
    for (int c = 0; c < region; ++c) {
      const int p = permuted_chunk(c);
      ASSERT_GE(p, 0);
      ASSERT_LT(p, region);
      EXPECT_EQ(p / 8, c / 8) << "chunk " << c << " left its 128-byte row";
      ++hit[size_t(p)];
      for (int i = 0; i < 8; ++i) EXPECT_EQ(permuted_chunk(c ^ i), permuted_chunk(c) ^ i);
    }
    for (int c = 0; c < region; ++c) EXPECT_EQ(hit[size_t(c)], 1);
    // stage_page: chunk lane + 32 j lands at lane + 32 j + (permuted_chunk(lane) - lane).
    for (int lane = 0; lane < 32; ++lane)
      for (int c = lane; c < region; c += 32) EXPECT_EQ(permuted_chunk(c), c + (permuted_chunk(lane) - lane));
  }
  for (int D : {64, 128}) {
    // fp8 codes: lane l reads chunks t D/16 + h D/32 + i of token t = l / 2, half h = l % 2.
    for (int i = 0; i < D / 32; ++i)
      for (int q = 0; q < 4; ++q) {
        std::array<int, 8> permuted{}, plain{};
        for (int k = 0; k < 8; ++k) {
          const int lane = 8 * q + k;
          const int c0 = (lane >> 1) * (D / 16) + (lane & 1) * (D / 32);
          permuted[size_t(k)] = 16 * (permuted_chunk(c0) ^ i);
          plain[size_t(k)] = 16 * (c0 + i);
        }
        EXPECT_TRUE(one_wavefront(permuted)) << "fp8 D " << D << " chunk " << i << " quarter " << q;
        EXPECT_FALSE(one_wavefront(plain)) << "fp8 D " << D << ": the unpermuted read should conflict";
      }
    // GAAC bf16 sign-mantissa bytes: lane l reads chunks l (D/32) + i (D/16 groups of 8 bytes).
    const int per_lane = D / 32;
    for (int i = 0; i < per_lane; ++i)
      for (int q = 0; q < 4; ++q) {
        std::array<int, 8> permuted{};
        for (int k = 0; k < 8; ++k) permuted[size_t(k)] = 16 * (permuted_chunk((8 * q + k) * per_lane) ^ i);
        EXPECT_TRUE(one_wavefront(permuted)) << "GAAC D " << D << " chunk " << i << " quarter " << q;
      }
  }
}

template <int D>
void expect_bases_in_distinct_groups() {
  std::set<int> seen;
  for (int which = 0; which < 2; ++which)
    for (int c = 0; c < D; ++c) {
      const int e = base_index<D>(which, c);
      EXPECT_GE(e, 0);
      EXPECT_LT(e, base_row_elements<D>());
      EXPECT_TRUE(seen.insert(e).second);
    }
  // Group j of each half: a quarter warp's lanes read (b3 or b4) x (half 0 or 1), 16 bytes each.
  for (int j = 0; j < D / 16; ++j) {
    std::set<int> groups;
    for (int which = 0; which < 2; ++which)
      for (int h = 0; h < 2; ++h) {
        const int e = base_index<D>(which, h * (D / 2) + 8 * j);
        EXPECT_EQ(e % 8, 0);
        groups.insert(bank_group(2 * e));
      }
    EXPECT_EQ(groups.size(), 4u) << "D " << D << " group " << j;
  }
}

TEST(TileLayout, GaacBasesOfAQuarterWarpStartInFourBankGroups) {
  expect_bases_in_distinct_groups<64>();
  expect_bases_in_distinct_groups<128>();
}

TEST(TileLayout, SparseRowCopiesReadWholeLinesAndStoreInOneWavefront) {
  auto rows_in_order = [](auto d) {
    constexpr int D = decltype(d)::value;
    return [](int i, int lane) { return std::pair<int, int>{gather_row<D>(i, lane), gather_chunk<D>(lane)}; };
  };
  const GatherCopy d64 = gather_copy_of<64>(rows_in_order(std::integral_constant<int, 64>{}));
  const GatherCopy d128 = gather_copy_of<128>(rows_in_order(std::integral_constant<int, 128>{}));
  EXPECT_TRUE(d64.whole_lines && d64.one_wavefront);
  EXPECT_TRUE(d128.whole_lines && d128.one_wavefront);
  // Negative control: a lane per row half taking the row's chunks alternately (chunk 2 i + half),
  // the copy before: a sector per row and instruction, never a whole line, and rows r and r + 1
  // of a quarter warp in one bank group.
  auto by_halves = [](int i, int lane) { return std::pair<int, int>{lane >> 1, 2 * i + (lane & 1)}; };
  const GatherCopy h64 = gather_copy_of<64>(by_halves), h128 = gather_copy_of<128>(by_halves);
  EXPECT_FALSE(h64.whole_lines || h64.one_wavefront);
  EXPECT_FALSE(h128.whole_lines || h128.one_wavefront);
}

}  // namespace
}  // namespace certkv::attention::cuda::tile
