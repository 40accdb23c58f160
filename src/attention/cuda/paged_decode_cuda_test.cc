// The cross-backend harness: every CUDA page format against the CPU references over the same
// encoded pages (the codecs' `_ref` decoders, double-precision attention, the meter's double
// formula), on ragged lengths, batches of unequal sequences, GQA ratios, head dims and split
// counts; meter >= true TV per head; refusals of unsupported shapes and bad buffers; corrupt
// tables, slots and lengths counted without reading out of bounds (run under compute-sanitizer
// by scripts/run_cuda_tests.sh). Needs a CUDA device; fails (does not skip) without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <vector>

#include "attention/cuda/device_kv.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "attention/online_softmax.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::attention::cuda {
namespace {

using cache::cuda::DeviceBuffer;

bool tiles_are_fp16(PageFormat f) { return f != PageFormat::kBf16 && f != PageFormat::kGaacBf16; }

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
};

std::string name_of(const Case& c) {
  std::string lens;
  for (int64_t l : c.lens) lens += std::to_string(l) + " ";
  return std::string(page_format_name(c.format)) + " D" + std::to_string(c.head_dim) + " " +
         std::to_string(c.n_q_heads) + "/" + std::to_string(c.n_kv_heads) + " lens " + lens + "splits " +
         std::to_string(c.n_splits) + " m " + std::to_string(c.n_outlier_pairs);
}

struct Result {
  double max_rel_err = 0;     // max over heads of ||out - ref|| / ||ref||
  double max_meter_gap = 0;   // max relative |A-1 gpu - A-1 ref|
  double min_meter_slack = 1; // min over heads of meter - true TV (must be >= 0)
  uint32_t corrupt = 0;
  int64_t raw_pages = 0;
  std::array<int64_t, 3> gaac_modes{};  // GAAC groups by mode (3-bit, 4-bit, raw)
  int64_t gaac_pages_without_escapes = 0;
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
  if (c.format == PageFormat::kGaacBf16 || c.format == PageFormat::kGaacE5M2) {
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
  DeviceBuffer q_d, out_d, meter_d, am1_d, ws_d;
  const size_t ws = workspace_bytes(p);
  EXPECT_TRUE(DeviceBuffer::allocate(q.size() * 4, &q_d).ok);
  EXPECT_TRUE(q_d.upload(0, q.data(), q.size() * 4).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(q.size() * 4, &out_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(size_t(batch) * Hq * 4, &meter_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(size_t(batch) * Hq * 4, &am1_d).ok);
  EXPECT_TRUE(DeviceBuffer::allocate(ws, &ws_d).ok);
  std::vector<float> poison(q.size(), std::nanf(""));
  EXPECT_TRUE(out_d.upload(0, poison.data(), poison.size() * 4).ok);  // every element must be written
  p.q = reinterpret_cast<const float*>(q_d.data());
  p.out = reinterpret_cast<float*>(out_d.data());
  const bool metered = page_format_metered(c.format);
  if (metered) {
    p.meter = reinterpret_cast<float*>(meter_d.data());
    p.a_minus_1 = reinterpret_cast<float*>(am1_d.data());
  }
  p.workspace = ws_d.data();
  p.workspace_size = ws;
  EXPECT_TRUE(reset_error_word(p).ok);
  const CudaStatus s = paged_decode(p);
  EXPECT_TRUE(s.ok) << s.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(read_error_word(p, &res.corrupt).ok);
  std::vector<float> out(q.size()), meter(size_t(batch) * Hq), am1(meter.size());
  EXPECT_TRUE(out_d.download(0, out.data(), out.size() * 4).ok);
  if (metered) {
    EXPECT_TRUE(meter_d.download(0, meter.data(), meter.size() * 4).ok);
    EXPECT_TRUE(am1_d.download(0, am1.data(), am1.size() * 4).ok);
  }

  for (int b = 0; b < batch; ++b) {
    const int64_t len = c.lens[size_t(b)];
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / G;
      std::vector<float> qr(static_cast<size_t>(D));
      for (int d = 0; d < D; ++d) qr[size_t(d)] = round_query(c.format, q[(size_t(b) * Hq + h) * D + d]);
      const float* kr = dkv.k_read()[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      const float* vr = dkv.v_read()[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      const uint16_t* kx = kv.k[size_t(b)].data() + size_t(kvh) * size_t(len) * D;
      std::vector<double> s_read(static_cast<size_t>(len)), s_exact(static_cast<size_t>(len));
      double m_read = -INFINITY, m_exact = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        double a = 0, e = 0;
        for (int d = 0; d < D; ++d) {
          a += double(qr[size_t(d)]) * kr[size_t(t) * D + d];
          e += double(qr[size_t(d)]) * format::bf16_to_float(kx[size_t(t) * D + d]);
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
      double tv = 0, am1_ref = 0;
      detail::QueryBoundWeights w;
      if (metered) w = detail::query_bound_weights(dkv.lossy_spec(true, kvh), qr.data(), p.sm_scale, len, p.delta_loc);
      const int width = c.format == PageFormat::kDither8 ? D / 32 : 16;
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
          const double ct = w.tier_b ? std::sqrt(var) + sum : sum;
          am1_ref += pt * std::expm1(ct);
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
        // The meter saturates at 1 once A - 1 >= sqrt(3) - 1: below 1, A - 1 must agree; above, the
        // device may overflow float (+inf or NaN: meter 1, the bound's answer) but must say 1.
        const double gap = am1_ref < 1.0 ? std::fabs(gpu - am1_ref) / std::max(am1_ref, 1e-6)
                                         : (meter[size_t(b) * Hq + h] == 1.f ? 0.0 : 1.0);
        res.max_meter_gap = std::max(res.max_meter_gap, gap);
        // TV is at most 1; its double sum can exceed 1 by rounding when the distributions part.
        res.min_meter_slack = std::min(res.min_meter_slack, double(meter[size_t(b) * Hq + h]) - std::min(tv, 1.0));
      }
    }
  }
  return res;
}

TEST(PagedDecodeCuda, DeviceIsPresent) { ASSERT_GT(device_count(), 0) << "no CUDA device: run these tests on the GPU machine"; }

TEST(PagedDecodeCuda, EveryFormatMatchesTheReferenceOnRaggedBatches) {
  const PageFormat formats[] = {PageFormat::kBf16, PageFormat::kGaacBf16, PageFormat::kGaacE5M2,
                                PageFormat::kFp8E4M3, PageFormat::kFp8E5M2, PageFormat::kDither8};
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
  for (PageFormat f : formats) {
    std::array<int64_t, 3> modes{};
    for (const Shape& s : shapes) {
      Case c{f, s.d, s.hq, s.hkv, s.lens, s.splits, f == PageFormat::kDither8 ? 4 : 0,
             seed % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved};
      const Result r = run_case(c, seed++);
      for (int m = 0; m < 3; ++m) modes[size_t(m)] += r.gaac_modes[size_t(m)];
      // bf16 probabilities in the P.V product (as flash attention rounds them) and fp16 value
      // reconstructions bound the error near 2^-9 relative; 4e-3 leaves room for neither more.
      EXPECT_LT(r.max_rel_err, 4e-3) << name_of(c);
      EXPECT_EQ(r.corrupt, 0u) << name_of(c);
      if (page_format_metered(f)) {
        EXPECT_LT(r.max_meter_gap, 2e-3) << name_of(c);
        EXPECT_GE(r.min_meter_slack, 0.0) << name_of(c) << ": meter below the true TV";
      }
    }
    if (f == PageFormat::kGaacBf16 || f == PageFormat::kGaacE5M2) {  // every decoder path ran
      EXPECT_GT(modes[0], 0) << page_format_name(f) << ": no 3-bit group";
      EXPECT_GT(modes[1], 0) << page_format_name(f) << ": no 4-bit group";
      EXPECT_GT(modes[2], 0) << page_format_name(f) << ": no raw group";
    }
  }
}

TEST(PagedDecodeCuda, GaacPagesWithoutEscapesMatchTheReference) {
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

TEST(PagedDecodeCuda, UnsupportedShapesAndBadBuffersAreRefused) {
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

TEST(PagedDecodeCuda, OutOfDeviceMemoryIsAStatus) {
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
  for (PageFormat f : {PageFormat::kBf16, PageFormat::kGaacBf16}) {
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
    DeviceBuffer q_d, out_d, ws_d, table_d;
    std::vector<float> q(size_t(8) * 128, 0.5f);
    ASSERT_TRUE(DeviceBuffer::allocate(q.size() * 4, &q_d).ok);
    ASSERT_TRUE(q_d.upload(0, q.data(), q.size() * 4).ok);
    ASSERT_TRUE(DeviceBuffer::allocate(q.size() * 4, &out_d).ok);
    ASSERT_TRUE(DeviceBuffer::allocate(workspace_bytes(p), &ws_d).ok);
    p.q = reinterpret_cast<const float*>(q_d.data());
    p.out = reinterpret_cast<float*>(out_d.data());
    p.workspace = ws_d.data();
    p.workspace_size = workspace_bytes(p);
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

}  // namespace
}  // namespace certkv::attention::cuda
