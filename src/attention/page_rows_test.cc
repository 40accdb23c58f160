// The page-rows kernel (page_rows.h) against its scalar reference bit for bit: ragged pages,
// every head_dim it takes, groups of 1 to 13 rows, maxima that move and that hold, scores whose
// exponentials underflow, unmetered and metered (Tier A, Tier B) with large and NaN bounds; each
// row's floats do not depend on the rows beside it; and the meter lanes' lift bounds the sum
// of their terms from above.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/online_softmax.h"
#include "attention/page_rows.h"
#include "attention/decode_attention.h"
#include "codec/lossy_page.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::attention {
namespace {

using detail::MeterLanes;
using detail::PageRows;
using detail::PageTiles;
using detail::QueryBoundWeights;
using detail::RowState;

// The kernel when this CPU runs it, else null (the test then has nothing to compare).
const detail::PageRowsKernels* kernels_or_null() {
  if (codec::lossy_best_kernel() != codec::LossyKernel::kAvx512) return nullptr;
  return detail::page_rows_kernels_avx512();
}

struct RowsCase {
  int d = 64, n_rows = 1, metered = 0;
  std::vector<float> q, acc, p, terms;
  std::vector<RowState> st;
  std::vector<QueryBoundWeights> w;
  std::vector<MeterLanes> lanes;

  PageRows rows(int max_keys) {
    p.assign(size_t(n_rows) * detail::page_rows_stride(max_keys), 0.f);
    terms.assign(2 * size_t(std::min(n_rows, 8)) * detail::page_rows_stride(max_keys), 0.f);
    PageRows r;
    r.q = q.data();
    r.n_rows = n_rows;
    r.d = d;
    r.scale = 1.f / std::sqrt(float(d));
    r.st = st.data();
    r.acc = acc.data();
    r.p = p.data();
    r.w = metered != 0 ? w.data() : nullptr;
    r.lanes = metered != 0 ? lanes.data() : nullptr;
    r.meter_terms = terms.data();
    return r;
  }
};

struct PageData {
  std::vector<float> k, v, bounds, rho;
  int n_keys = 0;
  size_t stride = 0;
  PageTiles tiles() const { return {k.data(), v.data(), n_keys, bounds.data(), stride, rho.data()}; }
};

RowsCase make_rows(int d, int n_rows, int metered, float q_gain, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  RowsCase c;
  c.d = d;
  c.n_rows = n_rows;
  c.metered = metered;
  c.q.resize(size_t(n_rows) * size_t(d));
  for (float& x : c.q) x = q_gain * normal(rng);
  c.acc.assign(c.q.size(), 0.f);
  c.st.assign(size_t(n_rows), {detail::kMinusInfinity, 0.f});
  c.w.resize(size_t(n_rows));
  c.lanes.resize(size_t(n_rows));
  for (int r = 0; r < n_rows; ++r) {
    QueryBoundWeights& w = c.w[size_t(r)];
    w.tier_b = metered == 2;
    w.width = metered == 2 ? d / codec::kQuantGroup : codec::witness_bands(d);
    for (int b = 0; b < w.width; ++b) {
      w.weight[b] = 0.3f * unit(rng);
      w.abs_weight[b] = 0.1f * unit(rng);
    }
    detail::clear_meter_lanes(&c.lanes[size_t(r)]);
  }
  return c;
}

PageData make_page(int d, int n_keys, int width, float k_gain, bool large_bound, bool nan_bound, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  PageData pg;
  pg.n_keys = n_keys;
  pg.stride = size_t(n_keys) + 3;  // bounds rows wider than the page, as a tile's are
  pg.k.resize(size_t(n_keys) * size_t(d));
  pg.v.resize(pg.k.size());
  for (float& x : pg.k) x = k_gain * normal(rng);
  for (float& x : pg.v) x = normal(rng);
  pg.bounds.resize(size_t(width) * pg.stride);
  for (float& x : pg.bounds) x = 0.5f * unit(rng);
  pg.rho.resize(size_t(n_keys));
  for (float& x : pg.rho) x = unit(rng);
  if (large_bound) pg.bounds[size_t(n_keys / 2)] = 1e4f;  // band 0 of one key: c over the large limit
  if (nan_bound) pg.bounds[size_t(n_keys - 1)] = std::numeric_limits<float>::quiet_NaN();
  return pg;
}

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

void expect_same(const RowsCase& a, const RowsCase& b, int max_keys, const std::string& where) {
  for (int r = 0; r < a.n_rows; ++r) {
    ASSERT_EQ(bits(a.st[size_t(r)].m), bits(b.st[size_t(r)].m)) << where << " row " << r << " m";
    ASSERT_EQ(bits(a.st[size_t(r)].l), bits(b.st[size_t(r)].l)) << where << " row " << r << " l";
    for (int c = 0; c < a.d; ++c)
      ASSERT_EQ(bits(a.acc[size_t(r) * size_t(a.d) + size_t(c)]), bits(b.acc[size_t(r) * size_t(a.d) + size_t(c)]))
          << where << " row " << r << " acc " << c;
    for (size_t j = 0; j < size_t(max_keys); ++j) {
      const size_t at = size_t(r) * detail::page_rows_stride(max_keys) + j;
      ASSERT_EQ(bits(a.p[at]), bits(b.p[at])) << where << " row " << r << " p " << j;
    }
    if (a.metered == 0) continue;
    const MeterLanes &x = a.lanes[size_t(r)], &y = b.lanes[size_t(r)];
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(bits(x.d[i]), bits(y.d[i])) << where << " row " << r << " lane d " << i;
      ASSERT_EQ(bits(x.rho[i]), bits(y.rho[i])) << where << " row " << r << " lane rho " << i;
    }
    ASSERT_EQ(std::bit_cast<uint64_t>(x.large), std::bit_cast<uint64_t>(y.large)) << where << " row " << r;
    ASSERT_EQ(x.roundings, y.roundings) << where << " row " << r;
  }
}

TEST(PageRows, KernelIsItsReferenceBitForBit) {
  const detail::PageRowsKernels* kernels = kernels_or_null();
  if (kernels == nullptr) GTEST_SKIP() << "no AVX-512 page-rows kernel on this CPU (or capped)";
  std::mt19937 rng(11);
  // A split's pages: full, ragged, one key, longer than a vector; the key gain grows then drops,
  // so the running maximum both moves (alpha < 1) and holds (alpha = 1), and large-gain pages
  // leave later keys' exponentials below e^-87.3.
  const int page_keys[] = {16, 5, 16, 33, 1, 64, 17, 16};
  const float page_gain[] = {0.5f, 1.f, 4.f, 2.f, 0.1f, 30.f, 1.f, 0.5f};
  int checked = 0;
  for (const int d : {16, 32, 48, 64, 96, 128}) {
    for (const int n_rows : {1, 2, 3, 4, 5, 7, 8, 9, 13}) {
      for (const int metered : {0, 1, 2}) {
        if (metered == 2 && d % codec::kQuantGroup != 0) continue;  // Tier B groups of 32 channels
        const std::string where = "d " + std::to_string(d) + " rows " + std::to_string(n_rows) + " metered " +
                                  std::to_string(metered);
        RowsCase kernel_case = make_rows(d, n_rows, metered, 1.f, rng);
        RowsCase ref_case = kernel_case;
        const int width = kernel_case.w[0].width;
        for (size_t i = 0; i < std::size(page_keys); ++i) {
          const PageData pg = make_page(d, page_keys[i], width, page_gain[i], i == 2, i == 6 && metered == 1, rng);
          PageRows kr = kernel_case.rows(64), rr = ref_case.rows(64);
          auto* update = metered == 0 ? kernels->update : metered == 1 ? kernels->update_tier_a : kernels->update_tier_b;
          update(kr, pg.tiles());
          detail::page_rows_update_ref(rr, pg.tiles(), metered);
          expect_same(kernel_case, ref_case, pg.n_keys, where + " page " + std::to_string(i));
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, (6 * 3 - 2) * 9 * 8);  // d 16 and 48 have no Tier B
}

TEST(PageRows, EachRowGetsItsFloatsAlone) {
  const detail::PageRowsKernels* kernels = kernels_or_null();
  if (kernels == nullptr) GTEST_SKIP() << "no AVX-512 page-rows kernel on this CPU (or capped)";
  std::mt19937 rng(12);
  for (const int metered : {0, 1, 2}) {
    RowsCase group = make_rows(64, 7, metered, 1.f, rng);
    std::vector<RowsCase> alone;
    for (int r = 0; r < group.n_rows; ++r) {
      RowsCase one = group;
      one.n_rows = 1;
      one.q.assign(group.q.begin() + r * 64, group.q.begin() + (r + 1) * 64);
      one.acc.assign(64, 0.f);
      one.st = {group.st[size_t(r)]};
      one.w = {group.w[size_t(r)]};
      one.lanes = {group.lanes[size_t(r)]};
      alone.push_back(one);
    }
    for (const int n_keys : {16, 9, 40}) {
      const PageData pg = make_page(64, n_keys, group.w[0].width, 2.f, n_keys == 9, false, rng);
      auto* update = metered == 0 ? kernels->update : metered == 1 ? kernels->update_tier_a : kernels->update_tier_b;
      update(group.rows(64), pg.tiles());
      for (RowsCase& one : alone) update(one.rows(64), pg.tiles());
    }
    for (int r = 0; r < group.n_rows; ++r) {
      const RowsCase& one = alone[size_t(r)];
      const std::string where = "metered " + std::to_string(metered) + " row " + std::to_string(r);
      EXPECT_EQ(bits(group.st[size_t(r)].l), bits(one.st[0].l)) << where;
      EXPECT_EQ(bits(group.st[size_t(r)].m), bits(one.st[0].m)) << where;
      for (int c = 0; c < 64; ++c) ASSERT_EQ(bits(group.acc[size_t(r) * 64 + size_t(c)]), bits(one.acc[size_t(c)])) << where;
      if (metered == 0) continue;
      for (int i = 0; i < 16; ++i) ASSERT_EQ(bits(group.lanes[size_t(r)].d[i]), bits(one.lanes[0].d[i])) << where;
    }
  }
}

// The lanes' d after a split, lifted, is at least the sum of the terms it bounds: p_j (e^{c_j} - 1)
// with the reference's own p_j and c_j exact (the weights times the bounds in long double), each
// page's alpha applied to what came before, in long double; the same for rho. Only the float
// rounding of c_j and of E(c_j) (below 2^-18 relative here: at most 16 terms and 8 roundings)
// is left to the merge's 2^-16 margin and allowed for.
TEST(PageRows, MeterLanesLiftIsAnUpperBoundOfTheirSums) {
  std::mt19937 rng(13);
  for (const int metered : {1, 2}) {
    for (const int n_pages : {1, 5, 300}) {
      RowsCase c = make_rows(64, 1, metered, 1.f, rng);
      long double d_exact = 0, rho_exact = 0;
      for (int i = 0; i < n_pages; ++i) {
        const PageData pg = make_page(64, i % 3 == 0 ? 16 : 11, c.w[0].width, i % 7 == 0 ? 3.f : 1.f, false, false, rng);
        const float m_before = c.st[0].m;
        PageRows rows = c.rows(16);
        detail::page_rows_update_ref(rows, pg.tiles(), metered);
        const float alpha = c.st[0].m == m_before ? 1.f : std::exp(m_before - c.st[0].m);
        d_exact *= alpha;
        rho_exact *= alpha;
        const QueryBoundWeights& w = c.w[0];
        for (int j = 0; j < pg.n_keys; ++j) {
          long double linear = 0, variance = 0;
          for (int g = 0; g < w.width; ++g) {
            const long double b = pg.bounds[size_t(g) * pg.stride + size_t(j)];
            linear += (long double)(metered == 2 ? w.abs_weight[g] : w.weight[g]) * b;
            variance += (long double)w.weight[g] * b * b;
          }
          const long double cj = metered == 2 ? std::sqrt(variance) + linear : linear;
          const long double pj = c.p[size_t(j)];
          d_exact += pj * std::expm1(cj) * (1 - std::ldexp(1.L, -18));
          rho_exact += pj * (long double)pg.rho[size_t(j)];
        }
      }
      detail::MeterRow row;
      detail::meter_row_from_lanes(c.lanes[0], &row);
      const std::string where = "metered " + std::to_string(metered) + " pages " + std::to_string(n_pages);
      EXPECT_GE((long double)row.d, d_exact) << where;
      EXPECT_GE((long double)row.rho, rho_exact) << where;
      EXPECT_LE((long double)row.d, d_exact * (1 + 1e-3L)) << where << ": the lift is small";
      EXPECT_GT(row.d, 0.0) << where;
    }
  }
}

// E(c) >= e^c - 1 on [0, 88): the remainder's coefficient is rounded up, and the polynomial's own
// float rounding (non-negative terms, at most 8 roundings) is within 2^-20 relative, inside the
// merge's 2^-16 margin.
TEST(PageRows, Expm1UpperBoundsTheExponential) {
  EXPECT_GE((long double)detail::kExpm1RemainderCoefficient, std::exp(0.5L) / 720.L);
  EXPECT_LE((long double)detail::kExpm1RemainderCoefficient, std::exp(0.5L) / 720.L * (1 + 1e-5L));
  int checked = 0;
  for (float c = 0.f; c < 88.f; c = c < 0.6f ? std::nextafter(c + c * 1e-3f, 1.f) : c * 1.01f) {
    const long double exact = std::expm1((long double)c);
    EXPECT_GE((long double)detail::expm1_upper_ref(c), exact * (1 - std::ldexp(1.L, -20))) << c;
    if (c > 0 && c < 0.5f) {
      EXPECT_LE((long double)detail::expm1_upper_ref(c), exact * (1 + 3e-5L)) << c;
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

TEST(PageRows, OnlyHeadDimsTheKernelTakes) {
  if (kernels_or_null() == nullptr) GTEST_SKIP() << "no AVX-512 page-rows kernel on this CPU (or capped)";
  for (const int d : {16, 64, 128}) EXPECT_NE(detail::page_rows_kernels(d), nullptr) << d;
  for (const int d : {8, 24, 40, 136, 256}) EXPECT_EQ(detail::page_rows_kernels(d), nullptr) << d;
}


// fma_upward_ref, the exponent witness's rounding (page_rows.h), is the smallest float at or above
// a b + c: against the exact value in binary128 (a b + c of these ranges fits its 113 bits), on
// normal results, results among the subnormals, and exact ones.
TEST(PageRows, FmaUpwardIsTheSmallestFloatAtOrAbove) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  std::uniform_int_distribution<int> exponent(-20, 20), tiny(-75, -70);
  int checked = 0, rounded = 0;
  for (int i = 0; i < 200000; ++i) {
    const bool subnormal = i % 5 == 0;
    const float a = std::ldexp(mantissa(rng), subnormal ? tiny(rng) : exponent(rng));
    const float b = std::ldexp(mantissa(rng), subnormal ? tiny(rng) : exponent(rng));
    const float c = i % 7 == 0 ? 0.f : subnormal ? std::ldexp(mantissa(rng), -140) : std::ldexp(mantissa(rng), exponent(rng));
    const __float128 exact = (__float128)a * (__float128)b + (__float128)c;
    const float f = detail::fma_upward_ref(a, b, c);
    ASSERT_GE((__float128)f, exact) << a << " " << b << " " << c;
    ASSERT_LT((__float128)std::nextafter(f, -1.f), exact) << a << " " << b << " " << c;
    rounded += (__float128)f != exact;
    ++checked;
  }
  EXPECT_GT(rounded, checked / 2) << "most results need rounding: the test can tell up from nearest";
  EXPECT_EQ(detail::fma_upward_ref(1.f, 1.f, 0.f), 1.f);
  EXPECT_EQ(detail::fma_upward_ref(0x1p-149f, 0.5f, 0.f), 0x1p-149f);  // never rounds to 0
  EXPECT_EQ(detail::fma_upward_ref(3e38f, 2.f, 0.f), std::numeric_limits<float>::infinity());
}

// Keys as an fp8-e4m3 page holds them (decoded codes) with the edge codes planted: both zeros, the
// smallest and largest subnormals, the smallest normal, +-448; and the weights of the exponent
// witness for real query rows.
std::vector<float> fp8_keys(int n, int d, float gain, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(size_t(n) * size_t(d));
  const float edges[] = {0.f, -0.f, 0x1p-9f, -0x1p-9f, 7 * 0x1p-9f, 0x1p-6f, 448.f, -448.f};
  for (size_t i = 0; i < k.size(); ++i) {
    const float x = i % 23 == 0 ? edges[(i / 23) % std::size(edges)] : gain * normal(rng);
    k[i] = format::fp8_to_float(format::float_to_fp8_ref(x, 4, 3), 4, 3);
  }
  return k;
}

codec::LossyPageSpec exponent_spec(int d) {
  codec::LossyPageSpec spec;
  spec.scheme = codec::LossyScheme::kFp8E4M3;
  spec.head_dim = d < 32 ? 32 : d;  // the weights read only head_dim and the witness
  spec.witness = codec::WitnessCode::kExponent;
  return spec;
}

RowsCase exponent_rows(int d, int n_rows, float q_gain, std::mt19937& rng) {
  RowsCase c = make_rows(d, n_rows, 3, q_gain, rng);
  codec::LossyPageSpec spec = exponent_spec(d);
  spec.head_dim = d;
  for (int r = 0; r < n_rows; ++r) {
    // query_bound_weights reads head_dim channels of q; its exponent fields need no spec check.
    c.w[size_t(r)] = detail::query_bound_weights(spec, c.q.data() + size_t(r) * size_t(d), 1.f / std::sqrt(float(d)), 1000, 1e-6);
  }
  return c;
}

// The exponent witness's kernel (one AND and one rounding-up FMA per 16 channels in the scores'
// pass) against its scalar reference, bit for bit: ragged pages, every head_dim the kernel takes,
// groups of 1 to 13 rows, lossy and exact pages (c = 0 on those), a NaN code (c = +inf: the large
// path), huge keys' exponentials underflowing; and each key's c against exponent_bound_ref.
TEST(PageRows, ExponentKernelIsItsReferenceBitForBit) {
  const detail::PageRowsKernels* kernels = kernels_or_null();
  if (kernels == nullptr) GTEST_SKIP() << "no AVX-512 page-rows kernel on this CPU (or capped)";
  std::mt19937 rng(41);
  const int page_keys[] = {16, 5, 16, 33, 1, 64, 17, 16};
  const float page_gain[] = {0.5f, 1.f, 4.f, 2.f, 0.1f, 30.f, 1.f, 0.5f};
  int checked = 0, bounds_checked = 0;
  for (const int d : {16, 32, 48, 64, 96, 128}) {
    for (const int n_rows : {1, 2, 3, 4, 5, 7, 8, 9, 13}) {
      const std::string where = "d " + std::to_string(d) + " rows " + std::to_string(n_rows);
      RowsCase kernel_case = exponent_rows(d, n_rows, 1.f, rng);
      RowsCase ref_case = kernel_case;
      for (size_t i = 0; i < std::size(page_keys); ++i) {
        const int n = page_keys[i];
        PageData pg;
        pg.n_keys = n;
        pg.stride = size_t(n);
        pg.k = fp8_keys(n, d, page_gain[i], rng);
        if (i == 6) pg.k[size_t(d) + 3] = std::numeric_limits<float>::quiet_NaN();  // a NaN code
        std::normal_distribution<float> normal(0.f, 1.f);
        pg.v.resize(pg.k.size());
        for (float& x : pg.v) x = normal(rng);
        pg.rho.assign(size_t(n), 0.01f);
        const bool exact_page = i == 3;
        pg.bounds.assign(size_t(n), exact_page ? 0.f : 1.f);
        PageRows kr = kernel_case.rows(64), rr = ref_case.rows(64);
        kernels->update_exponent(kr, pg.tiles());
        detail::page_rows_update_ref(rr, pg.tiles(), 3);
        expect_same(kernel_case, ref_case, n, where + " page " + std::to_string(i));
        // The kernel's c of the last block's rows (meter_terms holds c of its row r at 2 r stride,
        // stride of this page), each key's exponent_bound_ref bit for bit (0 on the exact page).
        const size_t stride = detail::page_rows_stride(n);
        for (int r = 0; r < std::min(n_rows, 8); ++r) {
          const int block_row = (n_rows > 8 ? (n_rows - 1) / 8 * 8 : 0) + r;  // the last block's rows
          if (block_row >= n_rows) break;
          for (int j = 0; j < n; ++j) {
            const float want = exact_page ? 0.f
                                          : detail::exponent_bound_ref(kernel_case.w[size_t(block_row)],
                                                                       kernel_case.q.data() + size_t(block_row) * size_t(d),
                                                                       pg.k.data() + size_t(j) * size_t(d), d);
            ASSERT_EQ(bits(kernel_case.terms[2 * size_t(r) * stride + size_t(j)]), bits(want))
                << where << " page " << i << " row " << block_row << " key " << j;
            ++bounds_checked;
          }
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 9 * 8);
  EXPECT_GT(bounds_checked, 10000);
}

// The exponent witness's c (exponent_bound_ref, the kernel's floats) is at least the true logit
// error |scale q . (k^ - k)| of every row and key, and at least the double-precision reference
// (meter_logit_bound_ref on the codes' bounds; the float path rounds every operation up, the
// reference to nearest, so the float may sit below it by the reference's own rounding only: 64
// double roundings, 2^-45 relative allowed), on adversarial keys (zeros, -0, bf16 subnormals, 2^-10, the limit 464, 448,
// ties) and queries (Gaussian, huge 1e30, tiny 1e-30, float subnormals, zeros, a negative scale).
// Past the limit (a saturated key) the bound fails: the negative control, why such pages stay exact.
TEST(PageRows, ExponentBoundCoversTheTrueLogitError) {
  std::mt19937 rng(43);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int d = 64;
  const float key_edges[] = {0.f, -0.f, 0x1p-133f, 0x1p-10f, 0x1p-11f, 464.f, -464.f, 448.f, 1.0625f, 0x1p-9f * 1.5f};
  int checked = 0, saturated_violations = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int kind = trial % 6;
    std::vector<float> q(static_cast<size_t>(d));
    for (float& x : q) {
      x = normal(rng);
      if (kind == 1) x *= 1e30f;
      if (kind == 2) x *= 1e-30f;
      if (kind == 3) x *= 1e-42f;  // float subnormals
      if (kind == 4 && (&x - q.data()) % 2 == 0) x = 0.f;
    }
    const float scale = kind == 5 ? -0.125f : 0.125f;
    const bool saturate = trial % 50 == 49;
    if (saturate) {  // the saturated channel's query weight the row's largest
      float top = 0.f;
      for (float x : q) top = std::max(top, std::fabs(x));
      q[7] = 2.f * top;
    }
    std::vector<float> k(static_cast<size_t>(d)), k_hat(static_cast<size_t>(d)), u(static_cast<size_t>(d));
    for (int c = 0; c < d; ++c) {
      float x = (c + trial) % 5 == 0 ? key_edges[size_t(c + trial) % std::size(key_edges)] : 8.f * normal(rng);
      if (saturate && c == 7) x = 1000.f;
      x = format::bf16_to_float(format::float_to_bf16(x));
      const uint8_t code = format::float_to_fp8_ref(x, 4, 3);
      k[size_t(c)] = x;
      k_hat[size_t(c)] = format::fp8_to_float(code, 4, 3);
      u[size_t(c)] = codec::exponent_witness_bound_of_code(code);
    }
    codec::LossyPageSpec spec = exponent_spec(d);
    const detail::QueryBoundWeights w = detail::query_bound_weights(spec, q.data(), scale, 1000, 1e-6);
    const float c_float = detail::exponent_bound_ref(w, q.data(), k_hat.data(), d);
    const double c_ref = meter_logit_bound_ref(spec, q.data(), scale, u.data(), 1000, 1e-6);
    long double err = 0;
    for (int c = 0; c < d; ++c) err += (long double)q[size_t(c)] * ((long double)k_hat[size_t(c)] - (long double)k[size_t(c)]);
    err = std::fabs(err * (long double)scale);
    if (saturate) {
      saturated_violations += (long double)c_float < err;
      continue;
    }
    const std::string where = "trial " + std::to_string(trial);
    EXPECT_GE((long double)c_float, err) << where;
    EXPECT_GE((long double)c_ref, err * (1 - 1e-15L)) << where;
    EXPECT_GE((long double)c_float, (long double)c_ref * (1 - 0x1p-45L)) << where;
    if (std::isfinite(c_ref) && c_ref > 1e-30) {
      EXPECT_LE(c_float, c_ref * (1 + 1e-6)) << where << ": rounding up costs a few ulps";
    }
    ++checked;
  }
  EXPECT_EQ(checked, 600 - 12);
  EXPECT_EQ(saturated_violations, 12) << "a saturated key's code bounds nothing";
}

}  // namespace
}  // namespace certkv::attention
