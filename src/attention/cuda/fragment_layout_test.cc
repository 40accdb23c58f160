// Host checks of the fragment-major page maps (fragment_layout.h): each map is a permutation of
// the page; a tensor-core product emulated lane by lane from the PTX ISA's operand layouts of
// mma.m16n8k16 (written out here, independently of the maps) over fragment-major pages gives
// K Q^T and V^T P^T of the row-major pages; the kernels' 16-byte operand loads are one wavefront
// per quarter warp; the transcoding round-trips; and the device cache's forms of the maps (its
// append, the device encoder's dither8 pages at finalize, read_page) are the kernels'. No device.
#include "attention/cuda/fragment_layout.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "codec/lossy_page.h"
#include "format/numeric.h"

namespace certkv::attention::cuda::fragment {
namespace {

// position(t, c) over a page of head_dim D takes every slot of the page once.
template <int D, class Position>
void expect_permutation(Position position, const char* name) {
  std::set<int> seen;
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < D; ++c) {
      const int e = position(t, c);
      EXPECT_GE(e, 0);
      EXPECT_LT(e, kPageTokens * D);
      seen.insert(e);
    }
  EXPECT_EQ(int(seen.size()), kPageTokens * D) << "D " << D << " " << name;
}

template <int D, class Element>
void expect_maps_permute() {
  expect_permutation<D>([](int t, int c) { return fragment_position<D, Element>(true, t, c); }, "K");
  expect_permutation<D>([](int t, int c) { return fragment_position<D, Element>(false, t, c); }, "V");
}

TEST(FragmentLayout, EveryMapIsAPermutationOfThePage) {
  expect_maps_permute<64, uint16_t>();
  expect_maps_permute<128, uint16_t>();
  expect_maps_permute<64, uint8_t>();
  expect_maps_permute<128, uint8_t>();
}

// The PTX ISA's fragments of mma.m16n8k16 with 16-bit operands (groupID g = lane / 4, t = lane % 4):
// A element a_i (i = 0..7, register i / 2): row g for i in {0, 1, 4, 5}, else g + 8; column 2 t +
// (i & 1), plus 8 for i >= 4. B element b_i (i = 0..3): row (k) 2 t + (i & 1), plus 8 for i >= 2;
// column g. C element c_i: row g for i < 2, else g + 8; column 2 t + (i & 1).
int a_row(int lane, int i) { return lane / 4 + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0); }
int a_col(int lane, int i) { return 2 * (lane % 4) + (i & 1) + (i >= 4 ? 8 : 0); }
int b_row(int lane, int i) { return 2 * (lane % 4) + (i & 1) + (i >= 2 ? 8 : 0); }
int b_col(int lane) { return lane / 4; }
int c_row(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
int c_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

// One emulated mma: the lanes' A elements (8 per lane) and B elements (4 per lane) as matrices,
// their product added to the lanes' C elements.
void mma_emulated(const std::array<std::array<float, 8>, 32>& a, const std::array<std::array<float, 4>, 32>& b,
                  std::array<std::array<double, 4>, 32>& c) {
  double A[16][16] = {}, B[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 8; ++i) A[a_row(l, i)][a_col(l, i)] = a[l][i];
    for (int i = 0; i < 4; ++i) B[b_row(l, i)][b_col(l)] = b[l][i];
  }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 16; ++k) c[l][i] += A[c_row(l, i)][k] * B[k][c_col(l, i)];
}

// Small integers: every product and sum below is exact in double.
std::vector<uint16_t> random_values(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> d(-64, 64);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = uint16_t(int16_t(d(rng)));
  return v;
}
float value_of(uint16_t x) { return float(int16_t(x)); }
float element_value(uint16_t x) { return float(int16_t(x)); }
float element_value(uint8_t x) { return float(int8_t(x)); }

// The emulated accumulators of S^T = K Q^T (c, in the C layout) against the row-major product.
template <int D>
void expect_scores(const std::array<std::array<double, 4>, 32>& c, const std::vector<uint16_t>& k_rows,
                   const std::vector<uint16_t>& q) {
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      const int token = c_row(l, i), head = c_col(l, i);
      double want = 0;
      for (int ch = 0; ch < D; ++ch) want += double(value_of(k_rows[token * D + ch])) * value_of(q[head * D + ch]);
      EXPECT_EQ(c[l][i], want) << "D " << D << " lane " << l << " c" << i;
    }
}

// Lane l's element i (register i / 2, half i % 2) of step s in a page: 16-bit pages at
// s * 256 + 8 l + i; pages of 8-bit codes at byte (s / 2) * 512 + 16 l + (s % 2) * 8 + i.
template <class Element>
int lane_element(int s, int l, int i) {
  return sizeof(Element) == 1 ? (s / 2) * 512 + 16 * l + (s % 2) * 8 + i : s * kStepElements + l * kLaneElements + i;
}

// S^T = K Q^T from a fragment-major K page, step by step: A from the page (lane_element), B = Q^T
// (channels of step s, heads 0..7). Codes are small integers in both element widths.
template <int D, class Element = uint16_t>
void check_scores(std::mt19937& rng) {
  std::vector<uint16_t> k_rows = random_values(rng, kPageTokens * D);
  if (sizeof(Element) == 1)
    for (auto& x : k_rows) x = uint16_t(int16_t(int8_t(uint8_t(x))));
  const std::vector<uint16_t> q = random_values(rng, 8 * D);
  std::vector<Element> rows(k_rows.begin(), k_rows.end()), page(kPageTokens * D);
  fragment_page_from_rows<D, Element>(rows.data(), true, page.data());
  std::array<std::array<double, 4>, 32> c{};
  for (int s = 0; s < D / 16; ++s) {
    std::array<std::array<float, 8>, 32> a{};
    std::array<std::array<float, 4>, 32> b{};
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 8; ++i) a[l][i] = element_value(page[size_t(lane_element<Element>(s, l, i))]);
      for (int i = 0; i < 4; ++i) b[l][i] = value_of(q[b_col(l) * D + 16 * s + b_row(l, i)]);
    }
    mma_emulated(a, b, c);
  }
  expect_scores<D>(c, k_rows, q);
}

// O^T = V^T P^T from a fragment-major V page: step s gives channels 16 s .. 16 s + 15 (A from the
// page), B = P^T (tokens, heads).
template <int D, class Element = uint16_t>
void check_values(std::mt19937& rng) {
  std::vector<uint16_t> v_rows = random_values(rng, kPageTokens * D);
  if (sizeof(Element) == 1)
    for (auto& x : v_rows) x = uint16_t(int16_t(int8_t(uint8_t(x))));
  const std::vector<uint16_t> p = random_values(rng, 8 * kPageTokens);  // [head][token]
  std::vector<Element> rows(v_rows.begin(), v_rows.end()), page(kPageTokens * D);
  fragment_page_from_rows<D, Element>(rows.data(), false, page.data());
  for (int s = 0; s < D / 16; ++s) {
    std::array<std::array<float, 8>, 32> a{};
    std::array<std::array<float, 4>, 32> b{};
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 8; ++i) a[l][i] = element_value(page[size_t(lane_element<Element>(s, l, i))]);
      for (int i = 0; i < 4; ++i) b[l][i] = value_of(p[b_col(l) * kPageTokens + b_row(l, i)]);
    }
    std::array<std::array<double, 4>, 32> c{};
    mma_emulated(a, b, c);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        const int channel = 16 * s + c_row(l, i), head = c_col(l, i);
        double want = 0;
        for (int t = 0; t < kPageTokens; ++t) want += double(value_of(v_rows[t * D + channel])) * value_of(p[head * kPageTokens + t]);
        EXPECT_EQ(c[l][i], want) << "D " << D << " step " << s << " lane " << l << " c" << i;
      }
  }
}

// The word map of dither8 K pages: a permutation, and the product of its A operands (registers 0..3
// from bytes {0, 1}, {4, 5}, {2, 3}, {6, 7} of a lane's 8 bytes of a step) with the query's B
// operand permuted alike (k index 2 t + (i & 1) + 8 (i >= 2) is channel 4 t + (i & 1) + 2 (i >= 2))
// is K Q^T.
template <int D>
void check_word_scores(std::mt19937& rng) {
  expect_permutation<D>([](int t, int c) { return word_key_byte(t, c); }, "word map");
  std::vector<uint16_t> k_rows = random_values(rng, kPageTokens * D);
  for (auto& x : k_rows) x = uint16_t(int16_t(int8_t(uint8_t(x))));
  const std::vector<uint16_t> q = random_values(rng, 8 * D);
  std::vector<uint8_t> page(kPageTokens * D);
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < D; ++c) page[size_t(word_key_byte(t, c))] = uint8_t(k_rows[size_t(t * D + c)]);
  const int byte_of_element[8] = {0, 1, 4, 5, 2, 3, 6, 7};
  std::array<std::array<double, 4>, 32> c{};
  for (int s = 0; s < D / 16; ++s) {
    std::array<std::array<float, 8>, 32> a{};
    std::array<std::array<float, 4>, 32> b{};
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 8; ++i)
        a[l][i] = element_value(page[size_t((s / 2) * 512 + 16 * l + (s % 2) * 8 + byte_of_element[i])]);
      for (int i = 0; i < 4; ++i) {
        const int k = b_row(l, i), channel = 16 * s + 4 * ((k % 8) / 2) + (k % 2) + 2 * (k / 8);
        b[l][i] = value_of(q[b_col(l) * D + channel]);
      }
    }
    mma_emulated(a, b, c);
  }
  expect_scores<D>(c, k_rows, q);
}

TEST(FragmentLayout, WordMapOfDither8KeysGivesTheScores) {
  std::mt19937 rng(11);
  check_word_scores<64>(rng);
  check_word_scores<128>(rng);
}

TEST(FragmentLayout, TensorCoreProductsOverFragmentPagesAreTheRowMajorProducts) {
  std::mt19937 rng(7);
  for (int rep = 0; rep < 3; ++rep) {
    check_scores<64>(rng);
    check_scores<128>(rng);
    check_values<64>(rng);
    check_values<128>(rng);
    check_scores<64, uint8_t>(rng);
    check_scores<128, uint8_t>(rng);
    check_values<64, uint8_t>(rng);
    check_values<128, uint8_t>(rng);
  }
}

TEST(FragmentLayout, AStepsOperandLoadsAreOneWavefrontPerQuarterWarp) {
  // Lane l loads 16 bytes at byte s * 512 + 16 l of a page (a multiple of 128 bytes in shared
  // memory): the 8 lanes of a quarter warp fall in 8 distinct 16-byte bank groups.
  for (int s = 0; s < 128 / 16; ++s)
    for (int quarter = 0; quarter < 4; ++quarter) {
      std::set<int> groups;
      for (int l = 8 * quarter; l < 8 * quarter + 8; ++l) groups.insert(((s * 512 + 16 * l) / 16) % 8);
      EXPECT_EQ(groups.size(), 8u);
    }
  // A lane's 16 bytes of codes (two steps) are one load too: byte (s / 2) * 512 + 16 l.
  for (int s = 0; s < 128 / 16; s += 2)
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(code_byte(s * kStepElements + l * kLaneElements + i), (s / 2) * 512 + 16 * l + i);
        EXPECT_EQ(code_byte((s + 1) * kStepElements + l * kLaneElements + i), (s / 2) * 512 + 16 * l + 8 + i);
      }
  // And a lane's 8 elements of a step are its own: the element (lane, register, half) sits at
  // 8 lane + 2 register + half in both maps.
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(operand_index(a_row(l, i), a_col(l, i)), l * kLaneElements + i);
    }
}

TEST(FragmentLayout, TranscodingRoundTrips) {
  std::mt19937 rng(3);
  for (bool key : {true, false}) {
    std::vector<uint16_t> rows(kPageTokens * 128), page(rows.size()), back(rows.size());
    for (auto& x : rows) x = uint16_t(rng());
    fragment_page_from_rows<128, uint16_t>(rows.data(), key, page.data());
    rows_from_fragment_page<128, uint16_t>(page.data(), key, back.data());
    EXPECT_EQ(back, rows);
    EXPECT_NE(page, rows);  // a different order
  }
}

// The device cache's forms of the maps (format/fragment_layout.h, head_dim at run time: what its
// append kernel and the device encoder index with, and what read_page and store_exact_block
// transcode with) are the kernels' maps.
template <int D>
void expect_runtime_maps_are_the_kernels() {
  for (int t = 0; t < kPageTokens; ++t)
    for (int c = 0; c < D; ++c) {
      ASSERT_EQ(element_index(true, t, c), key_index<D>(t, c)) << "D " << D;
      ASSERT_EQ(element_index(false, t, c), value_index<D>(t, c)) << "D " << D;
      ASSERT_EQ(dither8_code_byte(true, t, c), word_key_byte(t, c)) << "D " << D;
      ASSERT_EQ(dither8_code_byte(false, t, c), (fragment_position<D, uint8_t>(false, t, c))) << "D " << D;
    }
  std::mt19937 rng(D);
  for (bool key : {true, false}) {
    std::vector<uint16_t> rows(size_t(kPageTokens) * D), want(rows.size()), got(rows.size()), back(rows.size());
    for (auto& x : rows) x = uint16_t(rng());
    fragment_page_from_rows<D, uint16_t>(rows.data(), key, want.data());
    bf16_page_to_fragments(key, D, rows.data(), got.data());
    EXPECT_EQ(got, want) << "D " << D << (key ? " K" : " V");
    bf16_page_from_fragments(key, D, got.data(), back.data());
    EXPECT_EQ(back, rows) << "D " << D << (key ? " K" : " V");
  }
}

TEST(FragmentLayout, TheDeviceCachesMapsAreTheKernelsMaps) {
  expect_runtime_maps_are_the_kernels<64>();
  expect_runtime_maps_are_the_kernels<128>();
}

// A dither8 block finalized on the device: the codec's page (lossy_encode_page_ref's bytes)
// transcoded as the device encoder writes it (LossyDeviceLayout::kFragments, through
// dither8_page_to_fragments' offsets) is, bit for bit, dither8_fragment_page of that page (the
// builder the kernel's tests and the emulator check); and read_page's transcoding back gives the
// codec's page. K pages with 0 and 4 outlier pairs over both RoPE pairings, V pages, head_dim 64
// and 128, many blocks (the dither's counter).
template <int D>
void expect_finalized_dither8_pages_are_the_kernels() {
  constexpr int G = D / codec::kQuantGroup;
  std::mt19937 rng(D + 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::vector<uint16_t> pairs = {1, 9, 17, D / 2 - 1};
  int pages = 0;
  for (int rep = 0; rep < 6; ++rep)
    for (int kind = 0; kind < 3; ++kind) {  // K with outliers, K without, V
      codec::LossyPageSpec spec;
      spec.scheme = codec::LossyScheme::kDither8;
      spec.key = kind < 2;
      spec.head_dim = D;
      spec.pairing = rep % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved;
      spec.dither_key = codec::dither8_key(rep, spec.key, kind);
      if (kind == 0) {
        spec.n_outlier_pairs = int(pairs.size());
        spec.outlier_pairs = pairs.data();
      }
      const int m = spec.n_outlier_pairs;
      std::vector<uint16_t> rows(size_t(kPageTokens) * D);
      for (size_t i = 0; i < rows.size(); ++i)
        rows[i] = format::float_to_bf16(normal(rng) * std::ldexp(1.f, int(i % D) % 7 - 3));
      const uint32_t block = uint32_t(rng() % 5000);
      std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec)), want(cpu.size()), got(cpu.size(), 0xaa),
          back(cpu.size());
      ASSERT_TRUE(codec::lossy_encode_page_ref(spec, block, rows.data(), cpu.data()));
      ASSERT_EQ(cpu.size(), size_t(kPageTokens) * (D + 2 * G + 4 * m)) << "the device page's bytes are the codec's";
      dither8_fragment_page<D>(spec, cpu.data(), kPageTokens, want.data());
      dither8_page_to_fragments(spec.key, D, G, m, cpu.data(), got.data());
      ASSERT_EQ(got, want) << "D " << D << ", kind " << kind << ", rep " << rep;
      dither8_page_from_fragments(spec.key, D, G, m, got.data(), back.data());
      ASSERT_EQ(back, cpu) << "D " << D << ", kind " << kind << ", rep " << rep;
      ++pages;
    }
  EXPECT_EQ(pages, 18);
}

TEST(FragmentLayout, Dither8PagesFinalizedOnTheDeviceAreTheKernelsPages) {
  expect_finalized_dither8_pages_are_the_kernels<64>();
  expect_finalized_dither8_pages_are_the_kernels<128>();
}

// An fp8-e4m3 block with the exponent witness finalized on the device: the codec's page
// transcoded as the device encoder writes it (LossyDeviceLayout::kFragments, fp8_page_to_fragments'
// offsets: K the codes alone, V the codes then rho) is, bit for bit, fp8_fragment_page of that page
// (the builder the kernel's tests and the emulator check); and the transcoding back gives the
// codec's page. K and V, both RoPE pairings, head_dim 64 and 128.
template <int D>
void expect_finalized_fp8_pages_are_the_kernels() {
  std::mt19937 rng(D + 2);
  std::normal_distribution<float> normal(0.f, 1.f);
  int pages = 0;
  for (int rep = 0; rep < 4; ++rep)
    for (bool key : {true, false}) {
      codec::LossyPageSpec spec;
      spec.scheme = codec::LossyScheme::kFp8E4M3;
      spec.key = key;
      spec.head_dim = D;
      spec.witness = codec::WitnessCode::kExponent;
      spec.pairing = rep % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved;
      std::vector<uint16_t> rows(size_t(kPageTokens) * D);
      for (size_t i = 0; i < rows.size(); ++i)
        rows[i] = format::float_to_bf16(normal(rng) * std::ldexp(1.f, int(i % D) % 9 - 6));
      std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec)), want(cpu.size()), got(cpu.size(), 0xaa),
          back(cpu.size());
      ASSERT_TRUE(codec::lossy_encode_page_ref(spec, 0, rows.data(), cpu.data()));
      ASSERT_EQ(cpu.size(), size_t(fp8_page_bytes(key, D))) << "the device page's bytes are the codec's";
      fp8_fragment_page<D>(spec, cpu.data(), kPageTokens, want.data());
      fp8_page_to_fragments(key, D, cpu.data(), got.data());
      ASSERT_EQ(got, want) << "D " << D << (key ? " K" : " V") << ", rep " << rep;
      fp8_page_from_fragments(key, D, got.data(), back.data());
      ASSERT_EQ(back, cpu) << "D " << D << (key ? " K" : " V") << ", rep " << rep;
      ++pages;
    }
  EXPECT_EQ(pages, 8);
}

TEST(FragmentLayout, Fp8ExponentWitnessPagesFinalizedOnTheDeviceAreTheKernelsPages) {
  expect_finalized_fp8_pages_are_the_kernels<64>();
  expect_finalized_fp8_pages_are_the_kernels<128>();
}

}  // namespace
}  // namespace certkv::attention::cuda::fragment
