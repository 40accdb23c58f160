// The cross-backend harness: every CUDA page format against the CPU references over the same
// encoded pages (the codecs' `_ref` decoders, double-precision attention, the meter's double
// formula and its value side), on ragged lengths, batches of unequal sequences, GQA ratios, head
// dims and split counts, lossy batches with exact bf16 pages beside the lossy ones; meter >= true
// TV per head; refusals of unsupported shapes and bad buffers; corrupt tables, slots and lengths
// counted without reading out of bounds (run under compute-sanitizer by scripts/run_cuda_tests.sh).
// Needs a CUDA device; fails (does not skip) without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "attention/cuda/device_kv.h"
#include "attention/cuda/fragment_decode_cuda.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "format/fragment_layout.h"
#include "attention/online_softmax.h"
#include "cache/kv_scheme.h"
#include "format/gaac_layout.h"
#include "core/cuda_test_support.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::attention::cuda {
namespace {

using cache::cuda::DeviceBuffer;

// max and min that keep a NaN: an output never written stays the poison NaN and fails every check.
// Probability mass the float kernels cannot hold: a token whose probability relative to its warp's
// running maximum is below 2^-149 is 0 in float, so the meter, the value side and A - 1 may miss
// the double reference's terms of such tokens. Their total stays far below this floor in every
// case here (the heads where it shows have a true TV of 1e-60 and less); it only keeps a 1e-65 TV
// from reading as a meter below it.
constexpr double kFloatUnreachableMass = 1e-30;
// ln(FLT_MAX): a logit bound c_t at or above it makes p (e^c - 1) overflow float in the warp that
// holds the token (relative to that warp's maximum) even where the head's A - 1, relative to the
// global maximum, is small; the kernels then report A - 1 as +inf and the meter as 1 (a sound, if
// vacuous, bound).
constexpr double kFloatExpLimit = 88.72;

double max_keep_nan(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }
double min_keep_nan(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::min(a, b); }

// The device buffers of one launch, attached to p: the query (uploaded), the output, for
// `meter_rows` > 0 one buffer of 3 x meter_rows floats holding p.meter, p.a_minus_1 and
// p.value_rho in that order (filled with `side_fill` when it is given), and the workspace.
struct LaunchBuffers {
  DeviceBuffer q, out, side, workspace;
};

::testing::AssertionResult attach_launch_buffers(const std::vector<float>& q, int meter_rows, PagedDecodeParams* p,
                                                LaunchBuffers* b, const std::vector<float>& side_fill = {}) {
  const size_t side_floats = size_t(3) * size_t(meter_rows);
  if (!side_fill.empty() && side_fill.size() != side_floats) return ::testing::AssertionFailure() << "side_fill size";
  const bool ok = DeviceBuffer::allocate(q.size() * 4, &b->q).ok && b->q.upload(0, q.data(), q.size() * 4).ok &&
                  DeviceBuffer::allocate(q.size() * 4, &b->out).ok &&
                  (meter_rows == 0 || DeviceBuffer::allocate(side_floats * 4, &b->side).ok) &&
                  (side_fill.empty() || b->side.upload(0, side_fill.data(), side_floats * 4).ok) &&
                  DeviceBuffer::allocate(workspace_bytes(*p), &b->workspace).ok;
  if (!ok) return ::testing::AssertionFailure() << "device buffers could not be allocated or filled";
  p->q = reinterpret_cast<const float*>(b->q.data());
  p->out = reinterpret_cast<float*>(b->out.data());
  if (meter_rows > 0) {
    p->meter = reinterpret_cast<float*>(b->side.data());
    p->a_minus_1 = p->meter + meter_rows;
    p->value_rho = p->meter + 2 * meter_rows;
  }
  p->workspace = b->workspace.data();
  p->workspace_size = workspace_bytes(*p);
  return ::testing::AssertionSuccess();
}

bool is_dither8(PageFormat f) { return f == PageFormat::kDither8 || f == PageFormat::kDither8Fragments; }

bool tiles_are_fp16(PageFormat f) {
  return f != PageFormat::kBf16 && f != PageFormat::kBf16Fragments && f != PageFormat::kGaacBf16 &&
         f != PageFormat::kGaacFragments;
}

float round_query(PageFormat f, float x) {
  return tiles_are_fp16(f) ? format::fp16_to_float(format::float_to_fp16(x))
                           : format::bf16_to_float(format::float_to_bf16(x));
}

// KV with the spread of real heads: per-channel scales over three decades, a few large RoPE
// channels in keys, and rare spikes (so GAAC sees 4-bit and raw groups and full slots).
// narrow: every element of a channel has that channel's exponent (|x| in [2^e, 2^(e+1))), so every
// GAAC group is 3-bit and every page takes the kernel's path without escapes.
HostLayerKv make_kv(int batch, int n_kv_heads, int head_dim, const std::vector<int64_t>& lens, uint32_t seed,
                    bool narrow = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  HostLayerKv kv;
  kv.batch = batch;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = head_dim;
  kv.lens = lens;
  std::vector<float> k_scale(size_t(n_kv_heads) * head_dim), v_scale(k_scale.size());
  for (size_t i = 0; i < k_scale.size(); ++i) {
    k_scale[i] = std::pow(10.f, -1.3f + 2.3f * uniform(rng));
    v_scale[i] = std::pow(10.f, -1.f + 1.2f * uniform(rng));
  }
  for (int h = 0; h < n_kv_heads; ++h) k_scale[size_t(h) * head_dim + 5] = 40.f;  // an outlier channel
  for (int b = 0; b < batch; ++b) {
    const size_t n = size_t(n_kv_heads) * size_t(lens[size_t(b)]) * head_dim;
    kv.k.emplace_back(n);
    kv.v.emplace_back(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t ch = (i / (size_t(lens[size_t(b)]) * head_dim)) * head_dim + i % head_dim;
      if (narrow) {
        const float e_k = std::exp2(std::floor(std::log2(k_scale[ch]))), e_v = std::exp2(std::floor(std::log2(v_scale[ch])));
        kv.k[size_t(b)][i] = format::float_to_bf16((uniform(rng) < 0.5f ? -1.f : 1.f) * e_k * (1.f + 0.99f * uniform(rng)));
        kv.v[size_t(b)][i] = format::float_to_bf16((uniform(rng) < 0.5f ? -1.f : 1.f) * e_v * (1.f + 0.99f * uniform(rng)));
        continue;
      }
      const float spike = uniform(rng) < 0.002f ? 300.f : 1.f;
      kv.k[size_t(b)][i] = format::float_to_bf16(normal(rng) * k_scale[ch] * spike);
      kv.v[size_t(b)][i] = format::float_to_bf16(normal(rng) * v_scale[ch]);
    }
  }
  return kv;
}

codec::GaacCalibration calibrate(PageFormat f, const HostLayerKv& kv) {
  codec::GaacShape shape;
  shape.n_layers = 1;
  shape.n_kv_heads = kv.n_kv_heads;
  shape.head_dim = kv.head_dim;
  shape.block_tokens = 16;
  shape.element = f == PageFormat::kGaacE5M2 ? format::GaacElement::kFp8E5M2 : format::GaacElement::kBf16;
  codec::GaacCalibrator calibrator(shape);
  for (int b = 0; b < kv.batch; ++b)
    for (int which = 0; which < 2; ++which)
      for (int h = 0; h < kv.n_kv_heads; ++h) {
        const int64_t len = kv.lens[size_t(b)];
        const uint16_t* rows = (which == 0 ? kv.k : kv.v)[size_t(b)].data() + size_t(h) * size_t(len) * kv.head_dim;
        if (shape.element == format::GaacElement::kBf16) {
          calibrator.add_bf16(0, which, h, rows, int(len));
        } else {
          std::vector<uint8_t> fp8(size_t(len) * kv.head_dim);
          for (size_t i = 0; i < fp8.size(); ++i) fp8[i] = format::bf16_to_fp8_e5m2_ref(rows[i]);
          calibrator.add_fp8(0, which, h, fp8.data(), int(len));
        }
      }
  return calibrator.finish();
}

struct Case {
  PageFormat format;
  int head_dim, n_q_heads, n_kv_heads;
  std::vector<int64_t> lens;
  int n_splits;  // 0: chosen
  int n_outlier_pairs = 0;
  codec::RopePairing pairing = codec::RopePairing::kInterleaved;
  bool narrow = false;  // make_kv(..., narrow)
  // Lossy formats: exact (bf16 raw) pages, DeviceKvOptions::exact_*.
  int exact_k_every = 0, exact_v_every = 0;
  bool exact_tail = false;
  codec::WitnessCode witness = codec::WitnessCode::kFp16;  // fp8 K pages
};

std::string name_of(const Case& c) {
  std::string lens;
  for (int64_t l : c.lens) lens += std::to_string(l) + " ";
  return std::string(page_format_name(c.format)) + " D" + std::to_string(c.head_dim) + " " +
         std::to_string(c.n_q_heads) + "/" + std::to_string(c.n_kv_heads) + " lens " + lens + "splits " +
         std::to_string(c.n_splits) + " m " + std::to_string(c.n_outlier_pairs) + " exact K 1/" +
         std::to_string(c.exact_k_every) + " V 1/" + std::to_string(c.exact_v_every) + (c.exact_tail ? " tail" : "") +
         " witness " + codec::witness_code_name(c.witness);
}

struct Result {
  double max_rel_err = 0;     // max over heads of ||out - ref|| / ||ref||
  double max_meter_gap = 0;   // max relative |A-1 gpu - A-1 ref|
  double min_meter_slack = 1; // min over heads of meter + kFloatUnreachableMass - true TV (>= 0)
  // The value side against sum_t p_t rho_t in double: max relative gap (infinite when the
  // reference is 0 and the device's is not), min over heads of gpu / ref - 1 (1 where ref is 0).
  double max_value_rho_gap = 0;
  double min_value_rho_excess = 1;
  // Max over heads of the device's meter, A - 1 and value side (0 where every page is exact).
  double max_meter = 0, max_a_minus_1 = 0, max_value_rho = 0;
  // Heads whose A - 1 overflowed float on the device (each with a token of c_t >= kFloatExpLimit).
  int64_t overflowed_heads = 0;
  uint32_t corrupt = 0;
  int64_t raw_pages = 0;
  // Tokens (per KV head) by page class, [2 k_exact + v_exact] (lossy formats: exact or lossy).
  std::array<int64_t, 4> token_classes{};
  std::array<int64_t, 3> gaac_modes{};  // GAAC groups by mode (3-bit, 4-bit, raw)
  int64_t gaac_pages_without_escapes = 0;
  // Metered formats: (token, head) cells of lossy K pages by the range of their bound c_t in the
  // kernel's meter_term: (0, 1/4), [1/4, 8), [8, inf).
  std::array<int64_t, 3> meter_ranges{};
};

Result run_case(const Case& c, uint32_t seed) {
  Result res;
  const int batch = int(c.lens.size());
  const HostLayerKv kv = make_kv(batch, c.n_kv_heads, c.head_dim, c.lens, seed, c.narrow);
  codec::GaacCalibration calibration;
  DeviceKvOptions opt;
  opt.format = c.format;
  opt.keep_reconstruction = true;
  opt.seed = seed;
  opt.n_outlier_pairs = c.n_outlier_pairs;
  opt.pairing = c.pairing;
  opt.exact_k_every = c.exact_k_every;
  opt.exact_v_every = c.exact_v_every;
  opt.exact_tail = c.exact_tail;
  opt.witness = c.witness;
  if (c.format == PageFormat::kGaacBf16 || c.format == PageFormat::kGaacE5M2 || c.format == PageFormat::kGaacFragments) {
    calibration = calibrate(c.format, kv);
    opt.gaac = &calibration;
  }
  DeviceKv dkv;
  const CudaStatus built = DeviceKv::build(kv, opt, &dkv);
  EXPECT_TRUE(built.ok) << built.message;
  if (!built.ok) return res;
  res.raw_pages = dkv.raw_pages();
  res.gaac_modes = dkv.gaac_group_modes();
  res.gaac_pages_without_escapes = dkv.gaac_pages_without_escapes();

  const int D = c.head_dim, Hq = c.n_q_heads, G = Hq / c.n_kv_heads;
  std::mt19937 rng(seed * 7 + 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(size_t(batch) * Hq * D);
  for (auto& x : q) x = normal(rng) * 1.5f;

  PagedDecodeParams p;
  dkv.describe(&p);
  p.n_q_heads = Hq;
  p.sm_scale = 1.f / std::sqrt(float(D));
  p.n_splits = c.n_splits;
  p.delta_loc = 1e-6;
  DeviceBuffer q_d, out_d, meter_d, am1_d, rho_d, ws_d;
  const size_t ws = workspace_bytes(p);
  EXPECT_TRUE(DeviceBuffer::allocate(q.size() * 4, &q_d).ok);
  EXPECT_TRUE(q_d.upload(0, q.data(), q.size() * 4).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(q.size() * 4, &out_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(size_t(batch) * Hq * 4, &meter_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(size_t(batch) * Hq * 4, &am1_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(size_t(batch) * Hq * 4, &rho_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(ws, &ws_d).ok);
  std::vector<float> poison(q.size(), std::nanf(""));
  EXPECT_TRUE(out_d.upload(0, poison.data(), poison.size() * 4).ok);  // every element must be written
  const bool metered = page_format_metered(c.format);
  if (metered) {  // every meter output must be written too
    EXPECT_TRUE(meter_d.upload(0, poison.data(), size_t(batch) * Hq * 4).ok);
    EXPECT_TRUE(am1_d.upload(0, poison.data(), size_t(batch) * Hq * 4).ok);
    EXPECT_TRUE(rho_d.upload(0, poison.data(), size_t(batch) * Hq * 4).ok);
  }
  p.q = reinterpret_cast<const float*>(q_d.data());
  p.out = reinterpret_cast<float*>(out_d.data());
  if (metered) {
    p.meter = reinterpret_cast<float*>(meter_d.data());
    p.a_minus_1 = reinterpret_cast<float*>(am1_d.data());
    p.value_rho = reinterpret_cast<float*>(rho_d.data());
  }
  p.workspace = ws_d.data();
  p.workspace_size = ws;
  EXPECT_TRUE(reset_error_word(p).ok);
  const CudaStatus s = paged_decode(p);
  EXPECT_TRUE(s.ok) << s.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(read_error_word(p, &res.corrupt).ok);
  std::vector<float> out(q.size()), meter(size_t(batch) * Hq), am1(meter.size()), value_rho(meter.size());
  EXPECT_TRUE(out_d.download(0, out.data(), out.size() * 4).ok);
  if (metered) {
    EXPECT_TRUE(meter_d.download(0, meter.data(), meter.size() * 4).ok);
    EXPECT_TRUE(am1_d.download(0, am1.data(), am1.size() * 4).ok);
    EXPECT_TRUE(rho_d.download(0, value_rho.data(), value_rho.size() * 4).ok);
  }

  for (int b = 0; b < batch; ++b) {
    const int64_t len = c.lens[size_t(b)];
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / G;
      // Each K page class sees the query rounded to its tile element: the format's, and bf16 on
      // a lossy format's exact pages.
      std::vector<float> qr(static_cast<size_t>(D)), q_exact(static_cast<size_t>(D));
      for (int d = 0; d < D; ++d) {
        qr[size_t(d)] = round_query(c.format, q[(size_t(b) * Hq + h) * D + d]);
        q_exact[size_t(d)] = format::bf16_to_float(format::float_to_bf16(q[(size_t(b) * Hq + h) * D + d]));
      }
      const float* kr = dkv.k_read()[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      const float* vr = dkv.v_read()[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      const uint16_t* kx = kv.k[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      std::vector<double> s_read(static_cast<size_t>(len)), s_exact(static_cast<size_t>(len));
      double m_read = -INFINITY, m_exact = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const bool k_exact = dkv.exact_page(true, b, kvh, t / 16);
        const bool v_exact = dkv.exact_page(false, b, kvh, t / 16);
        if (h % G == 0) ++res.token_classes[size_t(2 * k_exact + v_exact)];
        const std::vector<float>& qt = k_exact ? q_exact : qr;
        double a = 0, e = 0;
        for (int d = 0; d < D; ++d) {
          a += double(qt[size_t(d)]) * kr[size_t(t) * D + d];
          e += double(qt[size_t(d)]) * format::bf16_to_float(kx[size_t(t) * D + d]);
        }
        s_read[size_t(t)] = a * p.sm_scale;
        s_exact[size_t(t)] = e * p.sm_scale;
        m_read = std::max(m_read, s_read[size_t(t)]);
        m_exact = std::max(m_exact, s_exact[size_t(t)]);
      }
      double l_read = 0, l_exact = 0;
      for (int64_t t = 0; t < len; ++t) {
        l_read += std::exp(s_read[size_t(t)] - m_read);
        l_exact += std::exp(s_exact[size_t(t)] - m_exact);
      }
      std::vector<double> ref(static_cast<size_t>(D), 0.0);
      double tv = 0, am1_ref = 0, rho_ref = 0, max_ct = 0;
      detail::QueryBoundWeights w;
      if (metered) w = detail::query_bound_weights(dkv.lossy_spec(true, kvh), qr.data(), p.sm_scale, len, p.delta_loc);
      const int width = page_format_dither8_bytes(c.format) ? D / 32 : 16;
      for (int64_t t = 0; t < len; ++t) {
        const double pt = std::exp(s_read[size_t(t)] - m_read) / l_read;
        const double pe = std::exp(s_exact[size_t(t)] - m_exact) / l_exact;
        tv += 0.5 * std::fabs(pt - pe);
        for (int d = 0; d < D; ++d) ref[size_t(d)] += pt * vr[size_t(t) * D + d];
        if (metered) {
          const float* bt = dkv.k_bounds()[size_t(b)].data() + (size_t(kvh) * size_t(len) + size_t(t)) * width;
          double var = 0, sum = 0;
          for (int g = 0; g < width; ++g) {
            if (w.tier_b) {
              var += double(w.weight[g]) * bt[g] * bt[g];
              sum += double(w.abs_weight[g]) * bt[g];
            } else {
              sum += double(w.weight[g]) * bt[g];
            }
          }
          double ct = w.tier_b ? std::sqrt(var) + sum : sum;  // 0 on exact K pages (no bound data)
          if (c.format == PageFormat::kFp8Fragments) {
            // The zero-byte bound: each code's half-step 2^(E - 4), plus 2^-10 (subnormal and
            // zero codes), against |q|; 0 on exact pages.
            ct = 0;
            if (!dkv.exact_page(true, b, kvh, t / 16)) {
              for (int d = 0; d < D; ++d) {
                const double x = std::fabs(double(kr[size_t(t) * D + d]));
                const double u = (x > 0 ? std::exp2(std::floor(std::log2(x)) - 4) : 0.0) + std::exp2(-10.0);
                ct += std::fabs(double(qr[size_t(d)])) * u;
              }
              ct *= p.sm_scale;
            }
          }
          // p (e^c - 1), through log p where e^c alone would overflow (p may underflow there).
          am1_ref += ct < 700 ? pt * std::expm1(ct) : std::exp(s_read[size_t(t)] - m_read - std::log(l_read) + ct);
          max_ct = std::max(max_ct, ct);
          if (ct > 0) ++res.meter_ranges[ct < 0.25 ? 0 : ct < 8 ? 1 : 2];
          rho_ref += pt * dkv.v_rho()[size_t(b)][size_t(kvh) * size_t(len) + size_t(t)];  // 0 on exact V pages
        }
      }
      double num = 0, den = 0;
      for (int d = 0; d < D; ++d) {
        const double o = out[(size_t(b) * Hq + h) * D + d];
        EXPECT_TRUE(std::isfinite(o)) << name_of(c) << " seq " << b << " head " << h << " dim " << d;
        num += (o - ref[size_t(d)]) * (o - ref[size_t(d)]);
        den += ref[size_t(d)] * ref[size_t(d)];
      }
      res.max_rel_err = std::max(res.max_rel_err, std::sqrt(num / std::max(den, 1e-300)));
      if (metered) {
        const double gpu = am1[size_t(b) * Hq + h];
        const double meter_h = meter[size_t(b) * Hq + h];
        // The meter saturates at 1 once A - 1 >= sqrt(3) - 1: below 1, A - 1 must agree; above, the
        // device may overflow float (+inf: meter 1, the bound's answer) but must say 1. Below 1 the
        // device may overflow only where a token's bound reaches kFloatExpLimit (and must then say
        // +inf and 1).
        double gap = 0;
        if (!std::isfinite(gpu)) {
          const bool allowed = gpu == INFINITY && meter_h == 1.0 && (am1_ref >= 1.0 || max_ct >= kFloatExpLimit);
          gap = allowed ? 0.0 : 1.0;
          res.overflowed_heads += allowed;
          if (!allowed)
            ADD_FAILURE() << name_of(c) << " seq " << b << " head " << h << ": A - 1 " << gpu << ", meter " << meter_h
                          << ", reference A - 1 " << am1_ref << ", largest c_t " << max_ct;
        } else if (am1_ref < 1.0) {
          gap = std::fabs(gpu - am1_ref) / std::max(am1_ref, 1e-6);
        } else {
          gap = meter_h == 1.0 ? 0.0 : 1.0;
        }
        res.max_meter_gap = max_keep_nan(res.max_meter_gap, gap);
        // TV is at most 1; its double sum can exceed 1 by rounding when the distributions part.
        EXPECT_TRUE(meter_h >= 0 && meter_h <= 1) << name_of(c) << " seq " << b << " head " << h << ": meter " << meter_h;
        res.min_meter_slack = min_keep_nan(res.min_meter_slack, meter_h - std::min(tv, 1.0) + kFloatUnreachableMass);
        const double rho_gpu = value_rho[size_t(b) * Hq + h];
        EXPECT_TRUE(std::isfinite(rho_gpu)) << name_of(c) << " seq " << b << " head " << h << ": value side " << rho_gpu;
        const bool rho_reachable = rho_ref > kFloatUnreachableMass;
        const double rho_gap = rho_reachable ? std::fabs(rho_gpu - rho_ref) / rho_ref
                                             : (rho_gpu <= kFloatUnreachableMass ? 0.0 : INFINITY);
        res.max_value_rho_gap = max_keep_nan(res.max_value_rho_gap, rho_gap);
        res.min_value_rho_excess = min_keep_nan(res.min_value_rho_excess, rho_reachable ? rho_gpu / rho_ref - 1 : 1.0);
        res.max_meter = max_keep_nan(res.max_meter, meter_h);
        res.max_a_minus_1 = max_keep_nan(res.max_a_minus_1, std::fabs(gpu));
        res.max_value_rho = max_keep_nan(res.max_value_rho, std::fabs(rho_gpu));
      }
    }
  }
  return res;
}

// The value side against the double sum_t p_t rho_t: within 10^-3 (the kernel lifts it by 2^-12
// for its float sums) and never below it beyond 10^-5 (the kernel's float logits).
void expect_value_side_matches(const Result& r, const std::string& name) {
  EXPECT_LT(r.max_value_rho_gap, 1e-3) << name << ": value side";
  EXPECT_GE(r.min_value_rho_excess, -1e-5) << name << ": value side below the reference";
}

TEST(PagedDecodeCuda, DeviceIsPresent) {
  CERTKV_NEED_CUDA_DEVICE();
  EXPECT_GT(device_count(), 0);
}

// The square roots of dither8's certificate (tile_mma.cuh, sqrt_upper) round up for every finite
// non-negative float, by at most 2^-17 relative from 2^-126 up; 0 gives a tiny positive bound,
// +inf and NaN a NaN (a meter of 1).
TEST(PagedDecodeCuda, SqrtUpperBoundsTheRootOfEveryFloat) {
  CERTKV_NEED_CUDA_DEVICE();
  SqrtUpperCheck r;
  const CudaStatus st = check_sqrt_upper(&r);
  ASSERT_TRUE(st.ok) << st.message;
  EXPECT_EQ(r.checked, 0x7f800000ull);
  EXPECT_EQ(r.below, 0ull) << "floats whose bound is below the root";
  EXPECT_EQ(r.loose, 0ull) << "floats whose bound exceeds the root by more than 2^-17";
  EXPECT_GT(r.at_zero, 0.f);
  EXPECT_LE(r.at_zero, 0x1p-62f);
  EXPECT_TRUE(std::isnan(r.at_inf));
  EXPECT_TRUE(std::isnan(r.at_nan));
}

// The page format of each scheme the device serves follows the scheme table (no device): dither8
// and gaac, which the table marks cuda_fragment_pages, are read as kDither8Fragments and
// kGaacFragments (what the device KV cache writes for them), the others in their own formats;
// the bulk-copy kernel, which splits by counters, reads every fragment format and bf16's rows.
TEST(PagedDecodeCuda, PageFormatOfFollowsTheSchemeTable) {
  EXPECT_EQ(page_format_of(cache::KvScheme::kDither8), PageFormat::kDither8Fragments);
  EXPECT_EQ(page_format_of(cache::KvScheme::kBf16), PageFormat::kBf16);
  EXPECT_EQ(page_format_of(cache::KvScheme::kGaac), PageFormat::kGaacFragments);
  // fp8-e4m3's K pages with the exponent witness are the codes alone: the fragment kernel's pages.
  EXPECT_EQ(page_format_of(cache::KvScheme::kFp8E4M3, codec::WitnessCode::kExponent), PageFormat::kFp8Fragments);
  EXPECT_EQ(page_format_of(cache::KvScheme::kFp8E4M3, codec::WitnessCode::kPageScaled8), PageFormat::kFp8E4M3);
  EXPECT_EQ(page_format_of(cache::KvScheme::kGaacE5M2), PageFormat::kGaacE5M2);
  EXPECT_EQ(page_format_of(cache::KvScheme::kFp8E4M3), PageFormat::kFp8E4M3);
  EXPECT_EQ(page_format_of(cache::KvScheme::kFp8E5M2), PageFormat::kFp8E5M2);
  for (const cache::KvSchemeInfo& s : cache::kv_schemes()) {
    if (!s.cuda_route) continue;
    SCOPED_TRACE(s.name);
    EXPECT_EQ(page_format_fragments(page_format_of(s.scheme)), s.cuda_fragment_pages);
    EXPECT_EQ(page_format_metered(page_format_of(s.scheme)), s.lossy);
  }
  EXPECT_TRUE(page_format_fragments(PageFormat::kBf16Fragments));
  EXPECT_TRUE(page_format_fragments(PageFormat::kFp8Fragments));
  EXPECT_TRUE(page_format_fragments(PageFormat::kGaacFragments));
  EXPECT_FALSE(page_format_fragments(PageFormat::kDither8));
  EXPECT_TRUE(page_format_fragments(PageFormat::kInt8Fragments));
  EXPECT_FALSE(page_format_metered(PageFormat::kInt8Fragments));  // the yardstick carries no certificate
  EXPECT_TRUE(page_format_dither8_bytes(PageFormat::kInt8Fragments));
  EXPECT_TRUE(page_format_dither8_bytes(PageFormat::kDither8));
  EXPECT_FALSE(page_format_dither8_bytes(PageFormat::kFp8Fragments));
  EXPECT_FALSE(page_format_fragments(PageFormat::kBf16));
  EXPECT_TRUE(page_format_bulk_copied(PageFormat::kBf16));
  EXPECT_TRUE(page_format_bulk_copied(PageFormat::kGaacFragments));
  EXPECT_FALSE(page_format_bulk_copied(PageFormat::kGaacBf16));
  EXPECT_FALSE(page_format_bulk_copied(PageFormat::kFp8E4M3));
}

// check() on parameters whose device pointers are only addresses (it never dereferences them, and
// runs without a device: CI runs this): the shapes it does not serve, misaligned pools, strides
// below a page, missing buffers and codec parameters, the raw pools of the GAAC and lossy
// formats, and slot pools that may be absent while they hold no page.
TEST(PagedDecodeCuda, CheckRefusesBadInputWithoutADevice) {
  auto address = [](uintptr_t a) { return reinterpret_cast<uint8_t*>(a); };
  std::vector<int32_t> table(64), lens(1, 100);
  std::vector<float> q(1024), out(1024);
  std::vector<uint64_t> keys(8);
  std::vector<int32_t> channels(64);
  std::vector<uint8_t> bases(4096);
  alignas(16) static uint8_t workspace[1 << 20];
  auto base = [&](PageFormat f) {
    PagedDecodeParams p;
    p.format = f;
    p.batch = 1;
    p.n_q_heads = 8;
    p.n_kv_heads = 2;
    p.head_dim = 64;
    p.sm_scale = 0.125f;
    p.k_pages = address(0x100000);
    p.v_pages = address(0x200000);
    p.k_page_stride = p.v_page_stride = 4096;
    p.n_k_pages = p.n_v_pages = 8;
    p.k_raw_pages = address(0x300000);
    p.v_raw_pages = address(0x400000);
    p.raw_page_stride = 2048;
    p.n_k_raw_pages = p.n_v_raw_pages = 4;
    p.k_table = p.v_table = table.data();
    p.table_stride = 32;
    p.seq_lens = lens.data();
    p.max_seq_len = 100;
    p.gaac_bases = bases.data();
    p.dither_keys = keys.data();
    p.n_outlier_pairs = page_format_dither8_bytes(f) ? 2 : 0;
    p.outlier_channels = channels.data();
    p.q = q.data();
    p.out = out.data();
    p.workspace = workspace;
    p.workspace_size = sizeof(workspace);
    return p;
  };
  for (PageFormat f : {PageFormat::kBf16, PageFormat::kGaacBf16, PageFormat::kFp8E4M3, PageFormat::kDither8,
                       PageFormat::kBf16Fragments, PageFormat::kFp8Fragments, PageFormat::kDither8Fragments,
                       PageFormat::kGaacFragments, PageFormat::kInt8Fragments}) {
    const std::string name = page_format_name(f);
    EXPECT_TRUE(check(base(f)).ok) << name << ": " << check(base(f)).message;
    PagedDecodeParams p = base(f);
    // The exponent witness is made from fp8-e4m3 fragment-major codes, and only there.
    p.witness = codec::WitnessCode::kExponent;
    if (f == PageFormat::kFp8Fragments) {
      EXPECT_TRUE(check(p).ok) << check(p).message;
    } else {
      EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
      EXPECT_NE(check(p).message.find("exponent witness is made from the codes"), std::string::npos)
          << check(p).message;
    }
    p.witness = static_cast<codec::WitnessCode>(7);
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    EXPECT_NE(check(p).message.find("witness code 7 is unknown"), std::string::npos) << check(p).message;
    p = base(f);
    p.head_dim = 96;
    EXPECT_EQ(check(p).code, StatusCode::kUnsupported) << name;
    EXPECT_NE(check(p).message.find("head_dim 96"), std::string::npos) << check(p).message;
    p = base(f);
    p.n_q_heads = 18;  // 9 query heads per KV head
    EXPECT_EQ(check(p).code, StatusCode::kUnsupported) << name;
    p = base(f);
    p.n_q_heads = 5;  // not integral
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.block_tokens = 32;
    EXPECT_EQ(check(p).code, StatusCode::kUnsupported) << name;
    p = base(f);
    p.k_pages += 8;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    EXPECT_NE(check(p).message.find("misaligned"), std::string::npos) << check(p).message;
    p = base(f);
    p.k_page_stride = 512;  // below any page of head_dim 64
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.k_page_stride = -16;  // a negative stride would address before the pool
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.v_page_stride = -4096;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.n_splits = 65536;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.table_stride = int64_t(1) << 60;  // 16 x table_stride would overflow
    p.max_seq_len = int64_t(1) << 62;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    // The error word's helpers check the split plan and the workspace they address.
    p = base(f);
    p.workspace = nullptr;
    uint32_t count = 0;
    EXPECT_EQ(reset_error_word(p).code, StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(read_error_word(p, &count).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.workspace_size = 16;
    EXPECT_EQ(reset_error_word(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.n_splits = -1;
    EXPECT_EQ(reset_error_word(p).code, StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(read_error_word(base(f), nullptr).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.q = nullptr;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.max_seq_len = 32 * 16 + 1;  // past the tables
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.workspace_size = 16;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.k_pages = nullptr;  // a pool with pages must be there
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p.n_k_pages = 0;  // one without pages may be absent
    EXPECT_TRUE(check(p).ok) << name << ": " << check(p).message;
    p = base(f);
    p.head_dim = 96;
    EXPECT_FALSE(paged_decode(p).ok) << name;  // refused before any launch
    if (page_format_dither8_bytes(f)) {
      p = base(f);
      p.dither_keys = nullptr;  // int8-fragments reads no dither
      if (is_dither8(f)) EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
      else EXPECT_TRUE(check(p).ok) << name << ": " << check(p).message;
      p = base(f);
      p.n_outlier_pairs = kMaxDeviceOutlierPairs + 1;
      EXPECT_EQ(check(p).code, StatusCode::kUnsupported) << name;
    }
    if (f == PageFormat::kInt8Fragments) {  // no certificate: a meter is refused, not ignored
      p = base(f);
      std::vector<float> meter(64);
      p.meter = meter.data();
      EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
      EXPECT_NE(check(p).message.find("carry no certificate"), std::string::npos) << check(p).message;
    }
    if (f == PageFormat::kBf16 || f == PageFormat::kBf16Fragments) continue;  // no raw pages
    p = base(f);
    p.raw_page_stride = 2048 - 16;  // below a raw page
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.raw_page_stride = -2048;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base(f);
    p.k_raw_pages = nullptr;  // raw pages without a pool
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p.n_k_raw_pages = 0;
    EXPECT_TRUE(check(p).ok) << name << ": " << check(p).message;
  }
  PagedDecodeParams p = base(PageFormat::kGaacBf16);
  p.gaac_bases = nullptr;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  // Escape capacities: the most a page can use (every group raw) is served; one byte more would
  // overrun the kernel's stage and is refused, as is a negative one, for K and for V.
  for (PageFormat f : {PageFormat::kGaacBf16, PageFormat::kGaacE5M2}) {
    const int64_t most = int64_t(format::gaac_page_max_escape_bytes(
        f == PageFormat::kGaacBf16 ? format::GaacElement::kBf16 : format::GaacElement::kFp8E5M2, 16, 64));
    p = base(f);
    p.k_page_stride = p.v_page_stride = 8192;  // room for a slot with the largest escape area
    p.k_escape_capacity = p.v_escape_capacity = most;
    EXPECT_TRUE(check(p).ok) << page_format_name(f) << ": " << check(p).message;
    for (int kv = 0; kv < 2; ++kv) {
      PagedDecodeParams bad = p;
      (kv == 0 ? bad.k_escape_capacity : bad.v_escape_capacity) = most + 1;
      EXPECT_EQ(check(bad).code, StatusCode::kInvalidArgument) << page_format_name(f);
      EXPECT_NE(check(bad).message.find("escape capacity"), std::string::npos) << check(bad).message;
      (kv == 0 ? bad.k_escape_capacity : bad.v_escape_capacity) = -1;
      EXPECT_EQ(check(bad).code, StatusCode::kInvalidArgument) << page_format_name(f);
      EXPECT_NE(check(bad).message.find("negative escape capacity"), std::string::npos) << check(bad).message;
    }
  }
  p = base(PageFormat::kDither8);
  p.dither_keys = nullptr;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  p = base(PageFormat::kDither8);
  p.n_outlier_pairs = kMaxDeviceOutlierPairs + 1;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  p = base(PageFormat::kDither8);
  p.delta_loc = 1.0;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
}

TEST(PagedDecodeCuda, EveryFormatMatchesTheReferenceOnRaggedBatches) {
  CERTKV_NEED_CUDA_DEVICE();
  const PageFormat formats[] = {PageFormat::kBf16,     PageFormat::kBf16Fragments, PageFormat::kGaacBf16,
                                PageFormat::kGaacE5M2, PageFormat::kFp8E4M3,      PageFormat::kFp8E5M2,
                                PageFormat::kDither8,  PageFormat::kFp8Fragments,    PageFormat::kDither8Fragments,
                                PageFormat::kGaacFragments, PageFormat::kInt8Fragments};
  struct Shape {
    int d, hq, hkv;
    std::vector<int64_t> lens;
    int splits;
  };
  const std::vector<Shape> shapes = {
      {128, 32, 8, {1000}, 0},          {128, 28, 4, {17, 4099}, 0},  {64, 9, 3, {1, 16, 33, 515}, 0},
      {64, 14, 2, {2048}, 7},           {128, 8, 8, {300, 31}, 1},     {64, 8, 1, {15, 1601}, 3},
      {128, 6, 2, {5000, 64, 129}, 0},
  };
  uint32_t seed = 1;
  std::array<int64_t, 3> all_meter_ranges{};  // over the metered formats, which share meter_term
  for (PageFormat f : formats) {
    std::array<int64_t, 3> modes{}, meter_ranges{};
    for (const Shape& s : shapes) {
      Case c{f, s.d, s.hq, s.hkv, s.lens, s.splits, page_format_dither8_bytes(f) ? 4 : 0,
             seed % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved};
      const Result r = run_case(c, seed++);
      for (int m = 0; m < 3; ++m) {
        modes[size_t(m)] += r.gaac_modes[size_t(m)];
        meter_ranges[size_t(m)] += r.meter_ranges[size_t(m)];
      }
      // bf16 probabilities in the P.V product (as flash attention rounds them) and fp16 value
      // reconstructions bound the error near 2^-9 relative; 4e-3 leaves room for neither more.
      EXPECT_LT(r.max_rel_err, 4e-3) << name_of(c);
      EXPECT_EQ(r.corrupt, 0u) << name_of(c);
      if (page_format_metered(f)) {
        EXPECT_LT(r.max_meter_gap, 2e-3) << name_of(c);
        EXPECT_GE(r.min_meter_slack, 0.0) << name_of(c) << ": meter below the true TV";
        expect_value_side_matches(r, name_of(c));
      }
    }
    if (page_format_metered(f)) {
      std::printf("%s: meter cells by c_t range (0, 1/4) %lld, [1/4, 8) %lld, [8, inf) %lld\n", page_format_name(f),
                  static_cast<long long>(meter_ranges[0]), static_cast<long long>(meter_ranges[1]),
                  static_cast<long long>(meter_ranges[2]));
      for (int m = 0; m < 3; ++m) all_meter_ranges[size_t(m)] += meter_ranges[size_t(m)];
    }
    if (f == PageFormat::kGaacBf16 || f == PageFormat::kGaacE5M2) {  // every decoder path ran
      EXPECT_GT(modes[0], 0) << page_format_name(f) << ": no 3-bit group";
      EXPECT_GT(modes[1], 0) << page_format_name(f) << ": no 4-bit group";
      EXPECT_GT(modes[2], 0) << page_format_name(f) << ": no raw group";
    }
  }
  // Each of meter_term's three ranges of c (below 1/4, 1/4 to 8, from 8) held live cells.
  EXPECT_GT(all_meter_ranges[0], 0) << "no bound below 1/4";
  EXPECT_GT(all_meter_ranges[1], 0) << "no bound from 1/4 to 8";
  EXPECT_GT(all_meter_ranges[2], 0) << "no bound from 8";
}

// GAAC pages in the device layout attend as the bf16 pages they code, bit for bit: the built
// operands times the query scaled by 2^(b - kGaacBuilt) are the bf16 products, and the output,
// kept in the built units of the V channels and scaled back once, is the bf16 pages' output. KV
// whose every element sits in its window but for a few exceptions per page (zeros, values far
// outside the window, both signs); then pages with one more exception than a page holds, kept
// exact: attended in their place, their values scaled into the built units, they add the same bits
// as their coded neighbours would (the kernel attended them after the others before, which changed
// the sums' order); then the first KV head's values scaled by 2^-80, so that its V windows fall
// below the bases the kernel keeps built units for: that head's pages are summed a page at a time
// in value units, each page's sum rounded once more as it is added (so within pages x 2^-21 of the
// head's largest |v| of the bf16 output: both sides' roundings, with room), the other heads' still
// to the bit. Each set of pages attended as GAAC device pages, as bf16 fragment-major pages and as
// the bf16 scheme's token-major pages. Ragged lengths, GQA 1, 4 and 7, head_dim 64 and 128, the same
// split plan for all three.
TEST(PagedDecodeCuda, GaacFragmentPagesAttendAsTheirBf16PagesBitForBit) {
  CERTKV_NEED_CUDA_DEVICE();
  struct Shape {
    int d, hq, hkv;
    std::vector<int64_t> lens;
    int splits;
  };
  const std::vector<Shape> shapes = {{128, 32, 8, {1000, 17}, 5}, {64, 28, 4, {4099, 1, 260}, 0}, {128, 14, 2, {515}, 1},
                                     {64, 8, 8, {33, 2048}, 3}};
  uint32_t seed = 40;
  enum Pass { kInWindow, kExactPages, kFarWindow };
  for (Pass pass : {kInWindow, kExactPages, kFarWindow}) {
    const bool exact_pages = pass == kExactPages;
    for (const Shape& sh : shapes) {
      HostLayerKv kv = make_kv(int(sh.lens.size()), sh.hkv, sh.d, sh.lens, seed, /*narrow=*/true);
      if (pass == kFarWindow)  // KV head 0's values times 2^-80: exponent fields down by 80, exact
        for (size_t b = 0; b < kv.v.size(); ++b)
          for (size_t i = 0; i < size_t(sh.lens[b]) * size_t(sh.d); ++i) {
            uint16_t& x = kv.v[b][i];
            if ((x & 0x7fff) != 0) x = uint16_t(x - (80 << 7));
          }
      // Up to the capacity of exceptions per page: zeros and values 2^20 past their window; with
      // exact_pages, every fifth page of a side one past it (zeros at distinct elements).
      std::mt19937 rng(seed);
      const int capacity = format::fragment::gaac_exception_capacity(sh.d);
      int64_t page = 0, overfull = 0;
      for (auto* side : {&kv.k, &kv.v})
        for (size_t b = 0; b < side->size(); ++b) {
          const int64_t len = sh.lens[b];
          for (int h = 0; h < sh.hkv; ++h)
            for (int64_t t0 = 0; t0 < len; t0 += 16, ++page) {
              const int64_t n = std::min<int64_t>(16, len - t0);
              if (exact_pages && page % 5 == 2) {
                for (int e = 0; e <= capacity && e < 64; ++e)  // capacity + 1 zeros (at most 8)
                  (*side)[b][(size_t(h) * len + size_t(t0 + e % n)) * sh.d + size_t(e) * 5 % size_t(sh.d)] = 0;
                overfull += n * sh.d > capacity;
                continue;
              }
              for (int e = 0; e < int(rng() % (capacity + 1)); ++e) {
                uint16_t& x = (*side)[b][(size_t(h) * len + size_t(t0 + int64_t(rng() % n))) * sh.d + rng() % sh.d];
                x = e % 2 == 0 ? uint16_t(0x8000 * (rng() & 1))
                               : uint16_t((x & 0x807f) | std::min(254, ((x >> 7) & 0xff) + 20) << 7);
              }
            }
        }
      codec::GaacCalibration calibration = calibrate(PageFormat::kGaacFragments, kv);
      const PageFormat formats[3] = {PageFormat::kBf16Fragments, PageFormat::kBf16, PageFormat::kGaacFragments};
      std::vector<float> outs[3];
      for (int which = 0; which < 3; ++which) {
        DeviceKvOptions opt;
        opt.format = formats[which];
        opt.gaac = &calibration;
        opt.seed = seed;
        DeviceKv dkv;
        const CudaStatus built = DeviceKv::build(kv, opt, &dkv);
        ASSERT_TRUE(built.ok) << built.message;
        if (formats[which] == PageFormat::kGaacFragments) {
          if (exact_pages) {
            EXPECT_GE(dkv.raw_pages(), overfull) << "pages past their capacity were coded";
            EXPECT_GT(dkv.raw_pages(), 0);
          } else {
            EXPECT_EQ(dkv.raw_pages(), 0) << "a page was kept exact";
          }
        }
        PagedDecodeParams p;
        dkv.describe(&p);
        p.n_q_heads = sh.hq;
        p.sm_scale = 1.f / std::sqrt(float(sh.d));
        p.n_splits = sh.splits > 0 ? sh.splits : 9;
        std::mt19937 qrng(seed + 1);
        std::normal_distribution<float> normal(0.f, 1.f);
        std::vector<float> q(sh.lens.size() * size_t(sh.hq) * sh.d);
        for (auto& x : q) x = normal(qrng) * 1.5f;
        LaunchBuffers bufs;
        ASSERT_TRUE(attach_launch_buffers(q, 0, &p, &bufs));
        ASSERT_TRUE(reset_error_word(p).ok);
        const CudaStatus ran = paged_decode(p);
        ASSERT_TRUE(ran.ok) << ran.message;
        outs[which].resize(q.size());
        ASSERT_EQ(cudaMemcpy(outs[which].data(), p.out, q.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        uint32_t corrupt = 1;
        ASSERT_TRUE(read_error_word(p, &corrupt).ok);
        EXPECT_EQ(corrupt, 0u) << page_format_name(formats[which]);
      }
      // Rows [sequence][query head][channel]; with kFarWindow the query heads of KV head 0 apart.
      const int group = sh.hq / sh.hkv;
      auto far = [&](size_t i) { return pass == kFarWindow && int(i / size_t(sh.d)) % sh.hq < group; };
      float far_max = 0.f, v_max = 0.f;
      int64_t pages = 0;
      for (size_t i = 0; i < outs[0].size(); ++i)
        if (far(i)) far_max = std::max(far_max, std::fabs(outs[0][i]));
      for (size_t b = 0; b < kv.v.size(); ++b) {
        pages = std::max<int64_t>(pages, (sh.lens[b] + 15) / 16);
        for (size_t i = 0; i < size_t(sh.lens[b]) * size_t(sh.d); ++i)
          v_max = std::max(v_max, std::fabs(format::bf16_to_float(kv.v[b][i])));
      }
      const float far_tolerance = float(pages) * 0x1p-21f * v_max;
      for (int which = 1; which < 3; ++which) {
        int differ = 0, far_differ = 0;
        for (size_t i = 0; i < outs[0].size(); ++i) {
          if (!far(i) || formats[which] != PageFormat::kGaacFragments) {
            differ += std::memcmp(&outs[0][i], &outs[which][i], 4) != 0;
          } else {
            ASSERT_TRUE(std::isfinite(outs[which][i]));
            far_differ += std::fabs(outs[which][i] - outs[0][i]) > far_tolerance;
          }
        }
        EXPECT_EQ(differ, 0) << page_format_name(formats[which]) << " against bf16-fragments, head_dim " << sh.d << ", "
                             << sh.hq << " / " << sh.hkv << " heads, pass " << int(pass) << ": " << differ << " of "
                             << outs[0].size() << " outputs differ";
        EXPECT_EQ(far_differ, 0) << "KV head 0 in value units, head_dim " << sh.d;
      }
      if (pass == kFarWindow) {
        EXPECT_GT(far_max, 0.f);
      }
      ++seed;
    }
  }
}

// The fragment kernel merges a row group's splits in the last of its CTAs to finish, counted on
// the workspace's counters: launch after launch (the counters back at zero each time) the outputs
// are the same bits, for one split, a few and many; and with a fixed split size a sequence's rows
// are the same bits alone and beside others (batch invariance).
TEST(PagedDecodeCuda, FragmentPagesMergeTheirSplitsLaunchAfterLaunch) {
  CERTKV_NEED_CUDA_DEVICE();
  const std::vector<int64_t> lens = {4099, 17, 1000};
  const HostLayerKv kv = make_kv(3, 4, 128, lens, 21);
  DeviceKvOptions opt;
  opt.format = PageFormat::kBf16Fragments;
  DeviceKv dkv;
  ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(size_t(3) * 28 * 128);
  for (auto& x : q) x = normal(rng);
  auto run = [&](PagedDecodeParams p, int launches) {
    LaunchBuffers bufs;
    std::vector<std::vector<float>> outs;
    EXPECT_TRUE(attach_launch_buffers(q, 0, &p, &bufs));
    EXPECT_TRUE(reset_error_word(p).ok);
    for (int i = 0; i < launches; ++i) {
      EXPECT_TRUE(paged_decode(p).ok);
      outs.emplace_back(q.size());
      EXPECT_EQ(cudaMemcpy(outs.back().data(), p.out, q.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    uint32_t corrupt = 1;
    EXPECT_TRUE(read_error_word(p, &corrupt).ok);
    EXPECT_EQ(corrupt, 0u);
    return outs;
  };
  PagedDecodeParams base;
  dkv.describe(&base);
  base.n_q_heads = 28;
  base.sm_scale = 0.088f;
  for (int splits : {1, 3, 40}) {
    PagedDecodeParams p = base;
    p.n_splits = splits;
    const auto outs = run(p, 3);
    for (float x : outs[0]) ASSERT_TRUE(std::isfinite(x)) << splits << " splits";
    EXPECT_EQ(outs[1], outs[0]) << splits << " splits";
    EXPECT_EQ(outs[2], outs[0]) << splits << " splits";
  }
  // Sequence 0 alone (batch 1, its tables and length) against the batch, 8 blocks per split.
  PagedDecodeParams p = base;
  p.split_blocks = 8;
  const std::vector<float> together = run(p, 1)[0];
  PagedDecodeParams alone = p;
  alone.batch = 1;
  const std::vector<float> single = run(alone, 1)[0];
  for (size_t i = 0; i < size_t(28) * 128; ++i) ASSERT_EQ(single[i], together[i]) << "element " << i;
}

TEST(PagedDecodeCuda, GaacPagesWithoutEscapesMatchTheReference) {
  CERTKV_NEED_CUDA_DEVICE();
  // Every group 3-bit: the kernel skips the escape scan (a warp-uniform branch the ragged test
  // may never take).
  for (PageFormat f : {PageFormat::kGaacBf16, PageFormat::kGaacE5M2}) {
    Case c{f, 128, 12, 3, {777, 64}, 0};
    c.narrow = true;
    const Result r = run_case(c, 41);
    EXPECT_GT(r.gaac_pages_without_escapes, 0) << page_format_name(f);
    EXPECT_EQ(r.gaac_modes[1] + r.gaac_modes[2], 0) << page_format_name(f);
    EXPECT_LT(r.max_rel_err, 4e-3) << page_format_name(f);
    EXPECT_EQ(r.corrupt, 0u) << page_format_name(f);
  }
}

TEST(PagedDecodeCuda, GaacSpikesGoToEscapesAndRawPages) {
  CERTKV_NEED_CUDA_DEVICE();
  // A calibration that leaves escape capacity 0 sends every page with an escape to the raw pool.
  Case c{PageFormat::kGaacBf16, 128, 8, 2, {4096}, 0};
  const HostLayerKv kv = make_kv(1, 2, 128, c.lens, 99);
  codec::GaacCalibration calibration = calibrate(c.format, kv);
  calibration.set_escape_capacity_bytes(0, codec::kGaacKey, 0);
  DeviceKvOptions opt;
  opt.format = c.format;
  opt.gaac = &calibration;
  DeviceKv dkv;
  ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
  EXPECT_GT(dkv.raw_pages(), 0);
  const Result r = run_case(c, 99);  // its own calibration: escapes in slots
  EXPECT_LT(r.max_rel_err, 4e-3);
}

// A lossy batch's shape and exact pages (DeviceKvOptions::exact_*), and its case: dither8 with 4
// outlier pairs, the pairing alternating with the seed.
struct LossyShape {
  int d, hq, hkv;
  std::vector<int64_t> lens;
  int splits, k_every, v_every;
  bool tail;
};

Case lossy_case(PageFormat f, const LossyShape& s, uint32_t seed) {
  Case c{f, s.d, s.hq, s.hkv, s.lens, s.splits, page_format_dither8_bytes(f) ? 4 : 0,
         seed % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved};
  c.exact_k_every = s.k_every;
  c.exact_v_every = s.v_every;
  c.exact_tail = s.tail;
  return c;
}

// A lossy session keeps its incomplete tail block, and blocks it cannot encode, as exact bf16
// pages beside the lossy ones: one launch reads both classes, K and V independently, the exact
// pages on the bf16 path (bf16 query, bf16 probabilities) with c = 0 and rho = 0. The references
// read the exact values there and compute A - 1 and the value side with 0 on those pages.
TEST(PagedDecodeCuda, LossyFormatsWithExactPagesMatchTheReference) {
  CERTKV_NEED_CUDA_DEVICE();
  const PageFormat formats[] = {PageFormat::kFp8E4M3, PageFormat::kFp8E5M2, PageFormat::kDither8,
                                PageFormat::kFp8Fragments, PageFormat::kDither8Fragments};
  const std::vector<LossyShape> shapes = {
      {128, 8, 8, {300, 31}, 1, 3, 4, true},          // GQA 1, one split
      {64, 8, 2, {17, 1601, 40}, 3, 2, 2, true},      // GQA 4: K and V exact on the same or other blocks
      {128, 28, 4, {1, 16, 4099}, 0, 5, 0, true},     // GQA 7: exact K pages (and the tails)
      {64, 8, 1, {2048, 33}, 0, 0, 3, false},         // GQA 8: exact V pages only
      {128, 16, 2, {515, 129}, 3, 1, 0, false},       // every K page exact, V lossy
      {64, 12, 3, {777, 5}, 0, 0, 1, true},           // every V page exact, K lossy but the tails
      {128, 32, 8, {1000, 70, 3001}, 0, 7, 2, true},  // GQA 4, splits chosen
  };
  uint32_t seed = 500;
  for (PageFormat f : formats) {
    std::array<int64_t, 4> classes{};
    for (const LossyShape& s : shapes) {
      const Case c = lossy_case(f, s, seed);
      const Result r = run_case(c, seed++);
      for (int i = 0; i < 4; ++i) classes[size_t(i)] += r.token_classes[size_t(i)];
      EXPECT_GT(r.raw_pages, 0) << name_of(c);
      const int64_t exact_k = r.token_classes[2] + r.token_classes[3], exact_v = r.token_classes[1] + r.token_classes[3];
      const int64_t lossy_k = r.token_classes[0] + r.token_classes[1], lossy_v = r.token_classes[0] + r.token_classes[2];
      // (kFp8Fragments keeps exact also the K pages where the cast saturated: the KV's spikes.)
      if (f != PageFormat::kFp8Fragments) {
        EXPECT_EQ(exact_k > 0, s.k_every > 0 || s.tail) << name_of(c);
      }
      EXPECT_EQ(exact_v > 0, s.v_every > 0 || s.tail) << name_of(c);
      EXPECT_EQ(lossy_k > 0, s.k_every != 1) << name_of(c);
      EXPECT_EQ(lossy_v > 0, s.v_every != 1) << name_of(c);
      EXPECT_LT(r.max_rel_err, 4e-3) << name_of(c);
      EXPECT_EQ(r.corrupt, 0u) << name_of(c);
      EXPECT_LT(r.max_meter_gap, 2e-3) << name_of(c);
      EXPECT_GE(r.min_meter_slack, 0.0) << name_of(c) << ": meter below the true TV";
      expect_value_side_matches(r, name_of(c));
    }
    // Every pairing of the classes ran: both lossy, exact K with lossy V, the reverse, both exact.
    for (int i = 0; i < 4; ++i) EXPECT_GT(classes[size_t(i)], 0) << page_format_name(f) << ": token class " << i;
  }
}

// The u8 witness (codec::WitnessCode::kPageScaled8) on the fp8 formats: the kernel builds its
// logit bounds from the codes and the page scale, and the meter matches the reference's over the
// coded bounds read back (DeviceKv::k_bounds, codec::lossy_witness_bounds) on ragged batches,
// every GQA ratio the kernel takes a shape of, exact pages beside the lossy ones, and both
// pairings; it stays at or above the true TV, and not below the fp16 witness's meter on the same
// KV by more than the fp16 rounding.
TEST(PagedDecodeCuda, CodedWitnessMeterMatchesTheReference) {
  CERTKV_NEED_CUDA_DEVICE();
  const std::vector<LossyShape> shapes = {
      {128, 32, 8, {1000}, 0, 0, 0, false},       {128, 28, 4, {17, 4099}, 0, 5, 0, true},
      {64, 9, 3, {1, 16, 33, 515}, 0, 0, 3, true}, {64, 8, 1, {15, 1601}, 3, 2, 2, true},
      {128, 6, 2, {5000, 64, 129}, 0, 0, 0, false},
  };
  uint32_t seed = 900;
  for (PageFormat f : {PageFormat::kFp8E4M3, PageFormat::kFp8E5M2}) {
    for (const LossyShape& s : shapes) {
      Case c = lossy_case(f, s, seed);
      c.witness = codec::WitnessCode::kPageScaled8;
      const Result coded = run_case(c, seed);
      EXPECT_LT(coded.max_rel_err, 4e-3) << name_of(c);
      EXPECT_EQ(coded.corrupt, 0u) << name_of(c);
      EXPECT_LT(coded.max_meter_gap, 2e-3) << name_of(c);
      EXPECT_GE(coded.min_meter_slack, 0.0) << name_of(c) << ": meter below the true TV";
      EXPECT_GT(coded.max_a_minus_1, 0.0) << name_of(c) << ": no lossy K page bounded anything";
      expect_value_side_matches(coded, name_of(c));
      c.witness = codec::WitnessCode::kFp16;
      const Result fp16 = run_case(c, seed++);  // the same KV, queries and slots
      // A coded bound is at least the exact norm's bound, which the fp16 bound exceeds by at most
      // one fp16 step (2^-10 relative): a code may land below the fp16 bound, never by more.
      EXPECT_GE(coded.max_a_minus_1, fp16.max_a_minus_1 * 0.99) << name_of(c) << ": coded bounds below fp16's";
    }
  }
}

// A corrupt witness bounds nothing, with either code: an fp16 bound, or a u8 page's scale w_max,
// that reads as NaN or below 0 gives the query heads of its KV head meter 1 (as
// codec::lossy_witness_bounds reads it on the CPU; an fp16 NaN used to vanish in the kernel's
// max with 0, and a negative bound to lower the sum), the other KV head's meters are unchanged,
// and so are the outputs (the witness is side data only the meter reads).
TEST(PagedDecodeCuda, CorruptWitnessSaturatesTheMeter) {
  CERTKV_NEED_CUDA_DEVICE();
  // Plain normal keys and values (no spikes: the meter must be below 1 as built).
  HostLayerKv kv;
  kv.batch = 1;
  kv.n_kv_heads = 2;
  kv.head_dim = 128;
  kv.lens = {256};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto* rows : {&kv.k, &kv.v}) {
    rows->emplace_back(size_t(2) * 256 * 128);
    for (uint16_t& x : rows->back()) x = format::float_to_bf16(normal(rng));
  }
  std::vector<float> q(size_t(8) * 128);
  for (float& x : q) x = 0.5f * normal(rng);
  for (codec::WitnessCode witness : {codec::WitnessCode::kFp16, codec::WitnessCode::kPageScaled8}) {
    SCOPED_TRACE(codec::witness_code_name(witness));
    DeviceKvOptions opt;
    opt.format = PageFormat::kFp8E4M3;
    opt.witness = witness;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    p.n_q_heads = 8;
    p.sm_scale = 0.088f;
    p.n_splits = 3;
    LaunchBuffers bufs;
    ASSERT_TRUE(attach_launch_buffers(q, 8, &p, &bufs));
    auto run = [&](std::vector<float>* out, std::vector<float>* meter) {
      const CudaStatus s = paged_decode(p);
      ASSERT_TRUE(s.ok) << s.message;
      out->resize(q.size());
      meter->resize(8);
      ASSERT_EQ(cudaMemcpy(out->data(), p.out, out->size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(meter->data(), p.meter, 8 * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    };
    std::vector<float> out_clean, meter_clean;
    run(&out_clean, &meter_clean);
    for (int h = 0; h < 8; ++h) ASSERT_LT(meter_clean[size_t(h)], 1.f) << "head " << h << ": saturated as built";
    // Block 5 of KV head 0: its K page's fp16 bound of band 3, token 2, or its u8 page's w_max (after
    // the codes), set to NaN, then to -1.
    int32_t entry = 0;
    ASSERT_EQ(cudaMemcpy(&entry, p.k_table + 5, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_GE(entry, 0);
    const int64_t side = witness == codec::WitnessCode::kFp16 ? 2 * (3 * 16 + 2) : 16 * 16;
    uint8_t* scale = const_cast<uint8_t*>(p.k_pages) + int64_t(entry) * p.k_page_stride + 16 * 128 + side;
    uint16_t kept = 0;
    ASSERT_EQ(cudaMemcpy(&kept, scale, 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint16_t bad : {uint16_t(0x7e00), uint16_t(0xbc00)}) {
      ASSERT_EQ(cudaMemcpy(scale, &bad, 2, cudaMemcpyHostToDevice), cudaSuccess);
      std::vector<float> out, meter;
      run(&out, &meter);
      for (int h = 0; h < 4; ++h) EXPECT_EQ(meter[size_t(h)], 1.f) << "stored " << bad << ", head " << h;
      for (int h = 4; h < 8; ++h) EXPECT_EQ(meter[size_t(h)], meter_clean[size_t(h)]) << "stored " << bad << ", head " << h;
      EXPECT_EQ(out, out_clean) << "stored " << bad;
    }
    ASSERT_EQ(cudaMemcpy(scale, &kept, 2, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<float> out, meter;
    run(&out, &meter);
    EXPECT_EQ(meter, meter_clean) << "restored";
  }
}

// Every page exact: nothing for the meter to bound, so A - 1, the meter and the value side are
// exactly 0, and the output is bf16 attention over the exact values.
TEST(PagedDecodeCuda, LossyBatchWithEveryPageExactHasAZeroMeter) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kFp8E4M3, PageFormat::kFp8E5M2, PageFormat::kDither8}) {
    for (const Case& shape : {Case{f, 128, 16, 4, {333, 16}, 0}, Case{f, 64, 7, 7, {1, 900}, 3}}) {
      Case c = shape;
      c.n_outlier_pairs = f == PageFormat::kDither8 ? 2 : 0;
      c.exact_k_every = c.exact_v_every = 1;
      const Result r = run_case(c, 77);
      EXPECT_EQ(r.token_classes[0] + r.token_classes[1] + r.token_classes[2], 0) << name_of(c);
      EXPECT_GT(r.token_classes[3], 0) << name_of(c);
      EXPECT_LT(r.max_rel_err, 4e-3) << name_of(c);
      EXPECT_EQ(r.corrupt, 0u) << name_of(c);
      EXPECT_EQ(r.max_meter, 0.0) << name_of(c);
      EXPECT_EQ(r.max_a_minus_1, 0.0) << name_of(c);
      EXPECT_EQ(r.max_value_rho, 0.0) << name_of(c);
      EXPECT_GE(r.min_meter_slack, 0.0) << name_of(c);
    }
  }
}

// Formats without lossy pages: the value side (and A - 1, the meter) are 0 when asked for.
TEST(PagedDecodeCuda, ValueSideIsZeroWithoutLossyPages) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kBf16, PageFormat::kGaacBf16}) {
    const HostLayerKv kv = make_kv(1, 2, 64, {200}, 21);
    codec::GaacCalibration calibration = calibrate(f, kv);
    DeviceKvOptions opt;
    opt.format = f;
    opt.gaac = &calibration;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    p.n_q_heads = 4;
    p.sm_scale = 0.125f;
    LaunchBuffers bufs;
    const std::vector<float> q(size_t(4) * 64, 0.25f), poison(12, std::nanf(""));
    ASSERT_TRUE(attach_launch_buffers(q, 4, &p, &bufs, poison));
    ASSERT_TRUE(reset_error_word(p).ok);
    ASSERT_TRUE(paged_decode(p).ok) << page_format_name(f);
    uint32_t corrupt = 1;
    ASSERT_TRUE(read_error_word(p, &corrupt).ok);
    EXPECT_EQ(corrupt, 0u);
    std::vector<float> side(poison.size());
    ASSERT_TRUE(bufs.side.download(0, side.data(), side.size() * 4).ok);
    for (float x : side) EXPECT_EQ(x, 0.f) << page_format_name(f);
  }
}

TEST(PagedDecodeCuda, UnsupportedShapesAndBadBuffersAreRefused) {
  CERTKV_NEED_CUDA_DEVICE();
  const HostLayerKv kv = make_kv(1, 2, 64, {64}, 5);
  DeviceKvOptions opt;
  DeviceKv dkv;
  ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
  DeviceBuffer buf;
  ASSERT_TRUE(DeviceBuffer::allocate(1 << 20, &buf).ok);
  auto base = [&] {
    PagedDecodeParams p;
    dkv.describe(&p);
    p.n_q_heads = 6;
    p.sm_scale = 0.125f;
    p.q = reinterpret_cast<const float*>(buf.data());
    p.out = reinterpret_cast<float*>(buf.data() + 4096);
    p.workspace = buf.data() + 65536;
    p.workspace_size = 1 << 19;
    return p;
  };
  EXPECT_TRUE(check(base()).ok) << check(base()).message;
  PagedDecodeParams p = base();
  p.head_dim = 96;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  EXPECT_NE(check(p).message.find("head_dim 96"), std::string::npos);
  p = base();
  p.n_q_heads = 18;  // 9 per KV head
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  p = base();
  p.n_q_heads = 5;
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.block_tokens = 32;
  EXPECT_EQ(check(p).code, StatusCode::kUnsupported);
  p = base();
  p.k_pages += 8;
  EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument);
  EXPECT_NE(check(p).message.find("misaligned"), std::string::npos);
  p = base();
  p.v_page_stride = 2056;
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.k_page_stride = 1024;  // smaller than a bf16 page
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.workspace_size = 16;
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.q = nullptr;
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.max_seq_len = 1 << 20;  // past the tables
  EXPECT_FALSE(check(p).ok);
  p = base();
  p.format = PageFormat::kDither8;
  EXPECT_FALSE(check(p).ok);  // no generator keys; and bf16-sized pages are too small
  p = base();
  p.head_dim = 96;
  EXPECT_FALSE(paged_decode(p).ok);  // refused before any launch
}

// The raw pools of a lossy format (its exact bf16 pages): present where they have pages, aligned,
// a stride of at least a bf16 page and a multiple of 16; a pool without pages may be absent.
TEST(PagedDecodeCuda, LossyRawPoolsAreChecked) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kFp8E4M3, PageFormat::kDither8}) {
    const HostLayerKv kv = make_kv(1, 2, 64, {100}, 7);
    DeviceKvOptions opt;
    opt.format = f;
    opt.exact_k_every = 3;
    opt.exact_v_every = 2;
    opt.exact_tail = true;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    DeviceBuffer buf;
    ASSERT_TRUE(DeviceBuffer::allocate(1 << 20, &buf).ok);
    auto base = [&] {
      PagedDecodeParams p;
      dkv.describe(&p);
      p.n_q_heads = 4;
      p.sm_scale = 0.125f;
      p.q = reinterpret_cast<const float*>(buf.data());
      p.out = reinterpret_cast<float*>(buf.data() + 4096);
      p.workspace = buf.data() + 65536;
      p.workspace_size = 1 << 19;
      return p;
    };
    const std::string name = page_format_name(f);
    PagedDecodeParams p = base();
    ASSERT_GT(p.n_k_raw_pages, 0) << name;
    ASSERT_GT(p.n_v_raw_pages, 0) << name;
    EXPECT_EQ(p.raw_page_stride, 16 * 64 * 2) << name;
    EXPECT_TRUE(check(p).ok) << name << ": " << check(p).message;
    p.raw_page_stride -= 16;  // smaller than a bf16 page
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    EXPECT_NE(check(p).message.find("raw"), std::string::npos) << name << ": " << check(p).message;
    p = base();
    p.raw_page_stride += 8;  // not a multiple of 16
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base();
    p.k_raw_pages += 8;  // misaligned
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base();
    p.v_raw_pages = nullptr;  // pages without a pool
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base();
    p.n_k_raw_pages = -1;
    EXPECT_EQ(check(p).code, StatusCode::kInvalidArgument) << name;
    p = base();
    p.v_raw_pages = nullptr;  // no V raw pool at all: fine (its entries would be corrupt)
    p.n_v_raw_pages = 0;
    EXPECT_TRUE(check(p).ok) << name << ": " << check(p).message;
    p = base();
    p.raw_page_stride -= 16;
    EXPECT_FALSE(paged_decode(p).ok) << name;  // refused before any launch
  }
}

TEST(PagedDecodeCuda, OutOfDeviceMemoryIsAStatus) {
  CERTKV_NEED_CUDA_DEVICE();
  DeviceBuffer huge;
  const CudaStatus s = DeviceBuffer::allocate(size_t(1) << 50, &huge);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.code, StatusCode::kOutOfMemory);
  EXPECT_NE(s.message.find("free"), std::string::npos);
  cache::cuda::DevicePagePool pool;
  EXPECT_EQ(cache::cuda::DevicePagePool::create(4096, int64_t(1) << 40, &pool).code, StatusCode::kOutOfMemory);
  EXPECT_EQ(cache::cuda::DevicePagePool::create(0, 4, &pool).code, StatusCode::kInvalidArgument);
  // The device still works after a refused allocation.
  DeviceBuffer small;
  EXPECT_TRUE(DeviceBuffer::allocate(1024, &small).ok);
}

// Corrupt tables, lengths and slots: counted in the error word, never read past the pools.
TEST(PagedDecodeCuda, CorruptEntriesAreCountedNotRead) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kBf16, PageFormat::kBf16Fragments, PageFormat::kGaacBf16, PageFormat::kGaacFragments}) {
    const HostLayerKv kv = make_kv(1, 2, 128, {256}, 11);
    codec::GaacCalibration calibration = calibrate(f, kv);
    DeviceKvOptions opt;
    opt.format = f;
    opt.gaac = &calibration;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    p.n_q_heads = 8;
    p.sm_scale = 0.088f;
    LaunchBuffers bufs;
    DeviceBuffer table_d;
    std::vector<float> q(size_t(8) * 128, 0.5f);
    ASSERT_TRUE(attach_launch_buffers(q, 0, &p, &bufs));
    // Tables: a K entry past the pool, a V entry naming a raw page that does not exist.
    std::vector<int32_t> tables(size_t(2) * 2 * 16);
    ASSERT_EQ(cudaMemcpy(tables.data(), p.k_table, tables.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    tables[3] = int32_t(p.n_k_pages) + 1000;
    tables[32 + 5] = -1000000;
    ASSERT_TRUE(DeviceBuffer::allocate(tables.size() * 4, &table_d).ok);
    ASSERT_TRUE(table_d.upload(0, tables.data(), tables.size() * 4).ok);
    p.k_table = reinterpret_cast<const int32_t*>(table_d.data());
    p.v_table = p.k_table + 32;
    ASSERT_TRUE(reset_error_word(p).ok);
    ASSERT_TRUE(paged_decode(p).ok);
    uint32_t corrupt = 0;
    ASSERT_TRUE(read_error_word(p, &corrupt).ok);
    EXPECT_EQ(corrupt, 2u) << page_format_name(f);
    {
      // A caller-owned word (PagedDecodeParams::error_word) takes the counts instead, the
      // workspace's stays as it was, and the word accumulates over launches until it is reset.
      DeviceBuffer word;
      ASSERT_TRUE(DeviceBuffer::allocate(sizeof(uint32_t), &word).ok);
      PagedDecodeParams own = p;
      own.error_word = reinterpret_cast<uint32_t*>(word.data());
      ASSERT_TRUE(reset_error_word(own).ok);
      ASSERT_TRUE(paged_decode(own).ok);
      ASSERT_TRUE(paged_decode(own).ok);
      uint32_t counted = 0;
      ASSERT_TRUE(read_error_word(own, &counted).ok);
      EXPECT_EQ(counted, 4u) << page_format_name(f);
      ASSERT_TRUE(read_error_word(p, &corrupt).ok);
      EXPECT_EQ(corrupt, 2u) << page_format_name(f);
    }
    std::vector<float> out(q.size());
    ASSERT_EQ(cudaMemcpy(out.data(), p.out, out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (float x : out) EXPECT_TRUE(std::isfinite(x));
    if (f == PageFormat::kGaacBf16) {
      // A slot whose tags say "invalid" (0xff = four tags of 3) is refused by the decoder.
      const size_t tag_offset = format::gaac_tile_tag_offset(format::GaacElement::kBf16, 16, 128);
      const int32_t slot = tables[0];
      ASSERT_GE(slot, 0);
      const uint8_t bad = 0xff;
      ASSERT_EQ(cudaMemcpy(const_cast<uint8_t*>(p.k_pages) + size_t(slot) * p.k_page_stride + tag_offset, &bad, 1,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_TRUE(reset_error_word(p).ok);
      ASSERT_TRUE(paged_decode(p).ok);
      ASSERT_TRUE(read_error_word(p, &corrupt).ok);
      EXPECT_EQ(corrupt, 3u);
    }
  }
}

// Device data the host cannot check, corrupt: counted in the error word and never read past.
// A raw entry in a bf16 table (bf16 pages have no raw class); a sequence length 0 (every token
// masked: the rows come out 0, not 0/0); a dither8 outlier channel outside the head (it indexes
// the query in shared memory).
TEST(PagedDecodeCuda, CorruptDeviceDataIsCountedNotRead) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kBf16, PageFormat::kDither8, PageFormat::kDither8Fragments}) {
    const HostLayerKv kv = make_kv(1, 2, 128, {256}, 13);
    DeviceKvOptions opt;
    opt.format = f;
    opt.n_outlier_pairs = page_format_dither8_bytes(f) ? 2 : 0;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    const std::string name = page_format_name(f);
    p.n_q_heads = 8;
    p.sm_scale = 0.088f;
    p.n_splits = 3;
    LaunchBuffers bufs;
    DeviceBuffer table_d;
    std::vector<float> q(size_t(8) * 128, 0.5f);
    ASSERT_TRUE(attach_launch_buffers(q, 0, &p, &bufs));
    auto run = [&](uint32_t* corrupt, std::vector<float>* out) {
      ASSERT_TRUE(reset_error_word(p).ok);
      const CudaStatus s = paged_decode(p);
      ASSERT_TRUE(s.ok) << s.message;
      ASSERT_TRUE(read_error_word(p, corrupt).ok);
      out->resize(q.size());
      ASSERT_EQ(cudaMemcpy(out->data(), p.out, out->size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    };
    uint32_t corrupt = 0;
    std::vector<float> out;
    run(&corrupt, &out);
    ASSERT_EQ(corrupt, 0u) << name << ": the pages as built";
    const std::vector<float> clean = out;
    if (f == PageFormat::kBf16) {
      // The K pool doubles as a raw pool, and block 2's K entry names its page 0 as raw.
      std::vector<int32_t> tables(size_t(2) * 2 * 16);
      ASSERT_EQ(cudaMemcpy(tables.data(), p.k_table, tables.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      tables[2] = -1;
      ASSERT_TRUE(DeviceBuffer::allocate(tables.size() * 4, &table_d).ok);
      ASSERT_TRUE(table_d.upload(0, tables.data(), tables.size() * 4).ok);
      PagedDecodeParams raw = p;
      raw.k_table = reinterpret_cast<const int32_t*>(table_d.data());
      raw.v_table = raw.k_table + 32;
      raw.k_raw_pages = raw.v_raw_pages = p.k_pages;
      raw.n_k_raw_pages = raw.n_v_raw_pages = p.n_k_pages;
      raw.raw_page_stride = p.k_page_stride;
      std::swap(p, raw);
      run(&corrupt, &out);
      std::swap(p, raw);
      EXPECT_EQ(corrupt, 1u) << "a raw entry in a bf16 table";
      for (float x : out) EXPECT_TRUE(std::isfinite(x));
    } else {
      // Channel 128 (head_dim) as kv head 0's first outlier channel: counted once per CTA of
      // that head (3 splits), and the scores leave it out.
      std::vector<int32_t> channels(size_t(2) * 2 * opt.n_outlier_pairs);
      ASSERT_EQ(cudaMemcpy(channels.data(), p.outlier_channels, channels.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      const int32_t kept = channels[0];
      channels[0] = 128;
      ASSERT_EQ(cudaMemcpy(const_cast<int32_t*>(p.outlier_channels), channels.data(), channels.size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      run(&corrupt, &out);
      EXPECT_EQ(corrupt, 3u) << "one bad channel, 3 CTAs of its head";
      for (float x : out) EXPECT_TRUE(std::isfinite(x));
      channels[0] = kept;
      ASSERT_EQ(cudaMemcpy(const_cast<int32_t*>(p.outlier_channels), channels.data(), channels.size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    // Length 0: counted once per KV head (the first split's CTA), every row 0.
    const int32_t zero = 0;
    int32_t len = 0;
    ASSERT_EQ(cudaMemcpy(&len, p.seq_lens, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(const_cast<int32_t*>(p.seq_lens), &zero, 4, cudaMemcpyHostToDevice), cudaSuccess);
    run(&corrupt, &out);
    EXPECT_EQ(corrupt, 2u) << name << ": length 0";
    for (float x : out) EXPECT_EQ(x, 0.f) << name;
    ASSERT_EQ(cudaMemcpy(const_cast<int32_t*>(p.seq_lens), &len, 4, cudaMemcpyHostToDevice), cudaSuccess);
    run(&corrupt, &out);
    EXPECT_EQ(corrupt, 0u) << name;
    EXPECT_EQ(out, clean) << name << ": the same launch gives the same output";
  }
}

// A lossy cache before its first block is finalized holds raw pages only: its lossy pools may not
// exist yet (null, no pages). The launch is accepted and gives what it gives with the pools there.
TEST(PagedDecodeCuda, LossyLaunchWithoutLossyPoolsReadsItsRawPages) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kFp8E4M3, PageFormat::kDither8}) {
    const HostLayerKv kv = make_kv(1, 2, 128, {13}, 29);  // less than one block
    DeviceKvOptions opt;
    opt.format = f;
    opt.n_outlier_pairs = f == PageFormat::kDither8 ? 2 : 0;
    opt.exact_tail = true;
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    const std::string name = page_format_name(f);
    p.n_q_heads = 8;
    p.sm_scale = 0.088f;
    LaunchBuffers bufs;
    std::vector<float> q(size_t(8) * 128);
    for (size_t i = 0; i < q.size(); ++i) q[i] = float(int(i % 7) - 3) * 0.25f;
    ASSERT_TRUE(attach_launch_buffers(q, 8, &p, &bufs));
    std::vector<float> with_pools(q.size()), without(q.size()), side(3 * 8);
    for (int run = 0; run < 2; ++run) {
      if (run == 1) {
        p.k_pages = p.v_pages = nullptr;
        p.n_k_pages = p.n_v_pages = 0;
      }
      ASSERT_TRUE(check(p).ok) << name << ": " << check(p).message;
      ASSERT_TRUE(reset_error_word(p).ok);
      ASSERT_TRUE(paged_decode(p).ok);
      uint32_t corrupt = 1;
      ASSERT_TRUE(read_error_word(p, &corrupt).ok);
      EXPECT_EQ(corrupt, 0u) << name;
      ASSERT_TRUE(bufs.out.download(0, (run == 0 ? with_pools : without).data(), q.size() * 4).ok);
      ASSERT_TRUE(bufs.side.download(0, side.data(), side.size() * 4).ok);
      for (float x : side) EXPECT_EQ(x, 0.f) << name << ": only exact pages";
    }
    EXPECT_EQ(with_pools, without) << name;
    for (float x : without) EXPECT_TRUE(std::isfinite(x)) << name;
  }
}

// A lossy format's raw entries outside its raw pools (past the K pool, into a V pool that does not
// exist) are counted and read as zeros; outputs, the meter and the value side stay finite (A - 1
// may be +inf, with meter 1: the spikes' e4m3 residuals pass fp16, so their witness is +inf).
TEST(PagedDecodeCuda, ExactPageEntriesOutsideTheRawPoolsAreCounted) {
  CERTKV_NEED_CUDA_DEVICE();
  for (PageFormat f : {PageFormat::kFp8E4M3, PageFormat::kDither8}) {
    const HostLayerKv kv = make_kv(1, 2, 128, {256}, 13);
    DeviceKvOptions opt;
    opt.format = f;
    opt.n_outlier_pairs = f == PageFormat::kDither8 ? 2 : 0;
    opt.exact_k_every = 2;  // exact K pages only: no V raw pool
    DeviceKv dkv;
    ASSERT_TRUE(DeviceKv::build(kv, opt, &dkv).ok);
    PagedDecodeParams p;
    dkv.describe(&p);
    const std::string name = page_format_name(f);
    ASSERT_GT(p.n_k_raw_pages, 0) << name;
    ASSERT_EQ(p.n_v_raw_pages, 0) << name;
    ASSERT_EQ(p.v_raw_pages, nullptr) << name;
    p.n_q_heads = 8;
    p.sm_scale = 0.088f;
    LaunchBuffers bufs;
    DeviceBuffer table_d;
    std::vector<float> q(size_t(8) * 128, 0.5f);
    ASSERT_TRUE(attach_launch_buffers(q, 8, &p, &bufs));
    ASSERT_TRUE(check(p).ok) << check(p).message;
    // Tables [K, V][kv_head][16 blocks]: an exact K entry one past the K raw pool, a lossy K entry
    // far past it, a V entry naming a raw page of the absent V pool.
    std::vector<int32_t> tables(size_t(2) * 2 * 16);
    ASSERT_EQ(cudaMemcpy(tables.data(), p.k_table, tables.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int exact_k = -1, lossy_k = -1;
    for (int i = 0; i < 32; ++i) (tables[size_t(i)] < 0 ? exact_k : lossy_k) = i;
    ASSERT_GE(exact_k, 0);
    ASSERT_GE(lossy_k, 0);
    tables[size_t(exact_k)] = -int32_t(p.n_k_raw_pages) - 1;
    tables[size_t(lossy_k)] = -int32_t(p.n_k_raw_pages) - 1000;
    ASSERT_GE(tables[32 + 7], 0);
    tables[32 + 7] = -1;
    ASSERT_TRUE(DeviceBuffer::allocate(tables.size() * 4, &table_d).ok);
    ASSERT_TRUE(table_d.upload(0, tables.data(), tables.size() * 4).ok);
    p.k_table = reinterpret_cast<const int32_t*>(table_d.data());
    p.v_table = p.k_table + 32;
    ASSERT_TRUE(reset_error_word(p).ok);
    ASSERT_TRUE(paged_decode(p).ok);
    uint32_t corrupt = 0;
    ASSERT_TRUE(read_error_word(p, &corrupt).ok);
    EXPECT_EQ(corrupt, 3u) << name;
    std::vector<float> out(q.size()), side(3 * 8);
    ASSERT_EQ(cudaMemcpy(out.data(), p.out, out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_TRUE(bufs.side.download(0, side.data(), side.size() * 4).ok);
    for (float x : out) EXPECT_TRUE(std::isfinite(x)) << name;
    for (size_t i = 0; i < side.size(); ++i) {
      const bool a_minus_1 = i >= 8 && i < 16;
      const bool ok = std::isfinite(side[i]) || (a_minus_1 && side[i] == INFINITY && side[i - 8] == 1.f);
      EXPECT_TRUE(ok) << name << (i < 8 ? " meter" : a_minus_1 ? " A - 1" : " value side") << " of head " << i % 8
                      << ": " << side[i];
    }
  }
}

}  // namespace
}  // namespace certkv::attention::cuda
