// The Tier A side data's norms (codec/lossy_norms.h). This file must stay compiled with
// -ffp-contract=off (src/codec/CMakeLists.txt names it): with FMA contraction, `sum += r * r`
// would round once where the device and the definition round twice.
#include "codec/lossy_norms.h"

#include <cmath>
#include <vector>

#include "core/x86_simd.h"
#include "format/numeric.h"

namespace certkv::codec::detail {

namespace {
constexpr int kMaxHeadDim = 256;
}  // namespace

void tier_a_norm_bounds_ref(const LossyPageSpec& spec, const uint16_t* x, const float* recon, double* bound) {
  const int d = spec.head_dim, bt = spec.block_tokens;
  const int n_bands = spec.key ? witness_bands(d) : 1;
  std::vector<double> sum_sq(static_cast<size_t>(n_bands));
  for (int t = 0; t < bt; ++t) {
    std::fill(sum_sq.begin(), sum_sq.end(), 0.0);
    for (int pair = 0; pair < d / 2; ++pair) {
      const int b = spec.key ? witness_band_of_pair(d, pair) : 0;
      for (int which = 0; which < 2; ++which) {
        const size_t i = size_t(t) * d + size_t(rope_pair_channel(spec.pairing, d, pair, which));
        const double r = double(recon[i]) - double(format::bf16_to_float(x[i]));
        sum_sq[size_t(b)] += r * r;
      }
    }
    for (int b = 0; b < n_bands; ++b) bound[size_t(b) * bt + t] = std::sqrt(sum_sq[size_t(b)]) * kNormSafety;
  }
}

void tier_a_norm_bounds(const LossyPageSpec& spec, const uint16_t* x, const float* recon, double* bound) {
  const int d = spec.head_dim, bt = spec.block_tokens;
  const int n_bands = spec.key ? witness_bands(d) : 1;
  // The reference's order of the channels, band by band: band b holds the pairs [first(b),
  // first(b + 1)), channel a then b of each.
  int channel[kMaxHeadDim];
  for (int pair = 0; pair < d / 2; ++pair)
    for (int which = 0; which < 2; ++which) channel[2 * pair + which] = rope_pair_channel(spec.pairing, d, pair, which);
  int band_end[kMaxHeadDim / 2 + 1];
  for (int b = 0; b < n_bands; ++b) band_end[b] = 2 * (spec.key ? witness_band_first_pair(d, b + 1) : d / 2);
  double sq[kMaxHeadDim];
  for (int t = 0; t < bt; ++t) {
    const float* r_row = recon + size_t(t) * d;
    const uint16_t* x_row = x + size_t(t) * d;
    for (int c = 0; c < d; ++c) {
      const double r = double(r_row[c]) - double(format::bf16_to_float(x_row[c]));
      sq[c] = r * r;
    }
    for (int b = 0, i = 0; b < n_bands; ++b) {
      double sum = 0.0;
      for (; i < band_end[b]; ++i) sum += sq[channel[i]];
      bound[size_t(b) * bt + t] = sum;
    }
  }
  // Each sum's root (correctly rounded, as std::sqrt), times kNormSafety.
  const size_t n = size_t(n_bands) * size_t(bt);
  size_t i = 0;
#if defined(__AVX512F__)
  for (; i + 8 <= n; i += 8)
    _mm512_storeu_pd(bound + i, _mm512_mul_pd(_mm512_sqrt_pd(_mm512_loadu_pd(bound + i)), _mm512_set1_pd(kNormSafety)));
#endif
  for (; i < n; ++i) bound[i] = std::sqrt(bound[i]) * kNormSafety;
}

}  // namespace certkv::codec::detail
