#include "index/code_dot.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>

namespace certkv::index {
namespace {

// sum_i c_i q_i from the levels themselves, independent of the planes.
template <int W>
int32_t dot_of_levels(const uint32_t (&code)[W], const uint8_t (&levels)[32 * W]) {
  int32_t sum = 0;
  for (int i = 0; i < 32 * W; ++i) sum += int32_t((code[i / 32] >> (i % 32)) & 1u) * levels[i];
  return sum;
}

template <int W>
void planes_of(const uint8_t (&levels)[32 * W], uint32_t (&planes)[4][W]) {
  for (int b = 0; b < 4; ++b)
    for (int w = 0; w < W; ++w) planes[b][w] = 0;
  for (int i = 0; i < 32 * W; ++i)
    for (int b = 0; b < 4; ++b) planes[b][i / 32] |= uint32_t((levels[i] >> b) & 1u) << (i % 32);
}

// Random codes and levels, with densities from empty to full (the carries of every weight are
// exercised), the two forms against each other and against the levels' own dot product.
template <int W>
void check_random(uint32_t seed) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 20000; ++trial) {
    const int density = trial % 9;  // 0/8 .. 8/8 of the bits set
    uint32_t code[W];
    uint8_t levels[32 * W];
    for (int w = 0; w < W; ++w) {
      code[w] = 0;
      for (int j = 0; j < 32; ++j) code[w] |= uint32_t(int(rng() % 8) < density) << j;
    }
    for (int i = 0; i < 32 * W; ++i) levels[i] = uint8_t(trial % 7 == 0 ? 15 : rng() % 16);
    uint32_t planes[4][W];
    planes_of<W>(levels, planes);
    const int32_t want = dot_of_levels<W>(code, levels);
    ASSERT_EQ(code_dot_planes_ref<W>(code, planes), want) << "W " << W << " trial " << trial;
    ASSERT_EQ(code_dot_planes<W>(code, planes), want) << "W " << W << " trial " << trial;
  }
}

TEST(CodeDot, CarrySaveFormEqualsThePlaneCounts) {
  check_random<1>(1);
  check_random<2>(2);
  check_random<3>(3);
  check_random<4>(4);
}

TEST(CodeDot, ExtremesOfEveryWidth) {
  uint32_t ones4[4] = {~0u, ~0u, ~0u, ~0u}, zeros4[4] = {0, 0, 0, 0};
  uint32_t full4[4][4], empty4[4][4] = {};
  for (auto& plane : full4)
    for (uint32_t& w : plane) w = ~0u;
  EXPECT_EQ(code_dot_planes<4>(ones4, full4), 15 * 128);  // every weight's carries at once
  EXPECT_EQ(code_dot_planes<4>(zeros4, full4), 0);
  EXPECT_EQ(code_dot_planes<4>(ones4, empty4), 0);
  uint32_t ones2[2] = {~0u, ~0u};
  uint32_t full2[4][2];
  for (auto& plane : full2)
    for (uint32_t& w : plane) w = ~0u;
  EXPECT_EQ(code_dot_planes<2>(ones2, full2), 15 * 64);
  // One bit per plane at the same position: 1 + 2 + 4 + 8.
  uint32_t one_bit[4] = {0, 0, 0, 1u << 31};
  uint32_t planes[4][4] = {};
  for (int b = 0; b < 4; ++b) planes[b][3] = 1u << 31;
  EXPECT_EQ(code_dot_planes<4>(one_bit, planes), 15);
}

}  // namespace
}  // namespace certkv::index
