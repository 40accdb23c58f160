#include "attention/cuda/device_kv.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "attention/cuda/fragment_layout.h"
#include "cache/kv_scheme.h"
#include "codec/gaac_fragments.h"
#include "core/status.h"
#include "format/fp8.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::attention::cuda {

PageFormat page_format_of(cache::KvScheme scheme, codec::WitnessCode witness) {
  // The cache layer says whether the device stores the scheme's pages fragment-major; the format
  // follows from it (a scheme stored so without a fragment format is a table error).
  const cache::KvSchemeInfo& info = cache::kv_scheme_info(scheme);
  if (cache::kv_scheme_device_fragment_pages(scheme, witness)) {
    if (scheme == cache::KvScheme::kDither8) return PageFormat::kDither8Fragments;
    if (scheme == cache::KvScheme::kGaac) return PageFormat::kGaacFragments;
    if (scheme == cache::KvScheme::kFp8E4M3) return PageFormat::kFp8Fragments;
    fail(StatusCode::kInternal, std::string("KV scheme ") + info.name +
                                    " is marked fragment-major in the scheme table, but no fragment page format reads it");
  }
  switch (scheme) {
    case cache::KvScheme::kGaac: return PageFormat::kGaacBf16;
    case cache::KvScheme::kGaacE5M2: return PageFormat::kGaacE5M2;
    case cache::KvScheme::kFp8E4M3: return PageFormat::kFp8E4M3;
    case cache::KvScheme::kFp8E5M2: return PageFormat::kFp8E5M2;
    case cache::KvScheme::kDither8: return PageFormat::kDither8;
    default: return PageFormat::kBf16;
  }
}

namespace {

constexpr int kT = 16;
constexpr int kBands = 16;

CudaStatus invalid(const std::string& message) {
  return cache::cuda::cuda_error(StatusCode::kInvalidArgument, "device kv: " + message);
}

bool is_gaac(PageFormat f) {
  return f == PageFormat::kGaacBf16 || f == PageFormat::kGaacE5M2 || f == PageFormat::kGaacFragments;
}
// The lossy formats: the metered ones, and int8-fragments (dither8's bytes read without the dither).
bool is_lossy(PageFormat f) { return page_format_metered(f) || f == PageFormat::kInt8Fragments; }

// Runs body(i) for i in [0, n) on all hardware threads.
template <typename Body>
void parallel_for(int64_t n, Body body) {
  const int threads = int(std::max(1u, std::min(64u, std::thread::hardware_concurrency())));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&] {
      for (int64_t i = next.fetch_add(64); i < n; i = next.fetch_add(64))
        for (int64_t j = i; j < std::min(n, i + 64); ++j) body(j);
    });
  for (auto& t : pool) t.join();
}

}  // namespace

codec::LossyPageSpec DeviceKv::lossy_spec(bool key, int kv_head) const {
  codec::LossyPageSpec spec;
  spec.key = key;
  spec.block_tokens = kT;
  spec.head_dim = shape_.head_dim;
  spec.pairing = options_.pairing;
  switch (options_.format) {
    case PageFormat::kFp8E4M3:
    case PageFormat::kFp8Fragments:  // its codes and rho; the witness is not stored
      spec.scheme = codec::LossyScheme::kFp8E4M3;
      spec.witness = options_.witness;
      break;
    case PageFormat::kFp8E5M2:
      spec.scheme = codec::LossyScheme::kFp8E5M2;
      spec.witness = options_.witness;
      break;
    default:
      spec.scheme = codec::LossyScheme::kDither8;
      spec.dither_key = codec::dither8_key(options_.layer, key, kv_head);
      if (key) {
        spec.n_outlier_pairs = options_.n_outlier_pairs;
        spec.outlier_pairs = outlier_pairs_[size_t(kv_head)].data();
      }
  }
  return spec;
}

bool DeviceKv::exact_page(bool key, int b, int kv_head, int64_t block) const {
  if (!is_lossy(options_.format)) return false;
  const int64_t blocks = (shape_.lens[size_t(b)] + kT - 1) / kT;
  const size_t id = size_t(first_page_[size_t(b)] + int64_t(kv_head) * blocks + block);
  return (key ? exact_k_ : exact_v_)[id] != 0;
}

bool DeviceKv::exact_by_option(bool key, int b, int kv_head, int64_t block) const {
  if (!is_lossy(options_.format)) return false;
  const int64_t len = shape_.lens[size_t(b)];
  if (options_.exact_tail && len % kT != 0 && block == (len - 1) / kT) return true;
  const int64_t every = key ? options_.exact_k_every : options_.exact_v_every;
  const int64_t phase = key ? int64_t(b) + kv_head : 2 * int64_t(b) + kv_head + 1;
  return every > 0 && (block + phase) % every == 0;
}

CudaStatus DeviceKv::build(const HostLayerKv& kv, const DeviceKvOptions& options, DeviceKv* out) {
  const int D = kv.head_dim, H = kv.n_kv_heads;
  if (D != 64 && D != 128) return invalid("head_dim " + std::to_string(D) + " is unsupported (64 or 128)");
  if (kv.batch < 1 || H < 1 || kv.lens.size() != size_t(kv.batch) || kv.k.size() != size_t(kv.batch) ||
      kv.v.size() != size_t(kv.batch))
    return invalid("batch, lens, k and v disagree");
  for (int b = 0; b < kv.batch; ++b) {
    if (kv.lens[size_t(b)] < 1) return invalid("sequence " + std::to_string(b) + " is empty");
    const size_t n = size_t(H) * size_t(kv.lens[size_t(b)]) * size_t(D);
    if (kv.k[size_t(b)].size() != n || kv.v[size_t(b)].size() != n)
      return invalid("sequence " + std::to_string(b) + " holds the wrong number of values");
  }
  const PageFormat f = options.format;
  const bool dither = page_format_dither8_bytes(f);
  const format::GaacElement element = f == PageFormat::kGaacE5M2 ? format::GaacElement::kFp8E5M2 : format::GaacElement::kBf16;
  if (is_gaac(f)) {
    if (options.gaac == nullptr) return invalid("GAAC pages need a calibration");
    const codec::GaacShape& s = options.gaac->shape();
    if (s.element != element || s.head_dim != D || s.n_kv_heads < H || s.block_tokens != kT ||
        options.layer < 0 || options.layer >= s.n_layers)
      return invalid("the GAAC calibration does not match the format, shape or layer");
    if (f == PageFormat::kGaacFragments)
      for (int kvi = 0; kvi < 2; ++kvi)
        for (int h = 0; h < H; ++h)
          for (uint8_t b : options.gaac->bases(options.layer, kvi, h).b4)
            if (b > 240) return invalid("a GAAC window base above 240 (its window would pass the exponents)");
  }
  if (dither && (options.n_outlier_pairs < 0 || options.n_outlier_pairs > kMaxDeviceOutlierPairs))
    return invalid("n_outlier_pairs must be in [0, " + std::to_string(kMaxDeviceOutlierPairs) + "]");
  if (options.exact_k_every < 0 || options.exact_v_every < 0) return invalid("exact_k_every / exact_v_every < 0");
  if ((options.exact_k_every > 0 || options.exact_v_every > 0 || options.exact_tail) && !is_lossy(f))
    return invalid("exact pages are for the lossy formats");

  DeviceKv r;
  r.shape_ = kv;
  r.shape_.k.clear();
  r.shape_.v.clear();
  r.options_ = options;
  std::vector<int64_t> blocks(size_t(kv.batch)), first(size_t(kv.batch));
  for (int b = 0; b < kv.batch; ++b) {
    blocks[size_t(b)] = (kv.lens[size_t(b)] + kT - 1) / kT;
    first[size_t(b)] = r.n_pages_;
    r.n_pages_ += blocks[size_t(b)] * H;
    r.table_stride_ = std::max(r.table_stride_, blocks[size_t(b)]);
    r.max_len_ = std::max(r.max_len_, kv.lens[size_t(b)]);
  }

  // Outlier pairs (dither8 K) from sequence 0's keys.
  r.outlier_pairs_.assign(size_t(H), {});
  if (dither) {
    const int64_t len0 = kv.lens[0];
    std::vector<float> rows(size_t(len0) * size_t(D));
    for (int h = 0; h < H; ++h) {
      for (size_t i = 0; i < rows.size(); ++i) rows[i] = format::bf16_to_float(kv.k[0][size_t(h) * rows.size() + i]);
      r.outlier_pairs_[size_t(h)].resize(size_t(options.n_outlier_pairs));
      codec::select_outlier_pairs(rows.data(), int(len0), D, options.pairing, options.n_outlier_pairs,
                                  r.outlier_pairs_[size_t(h)].data());
    }
  }

  // Page sizes.
  size_t k_bytes = 0, v_bytes = 0, raw_bytes = 0;
  switch (f) {
    case PageFormat::kBf16:
    case PageFormat::kBf16Fragments: k_bytes = v_bytes = size_t(kT) * D * 2; break;
    case PageFormat::kGaacFragments:
      k_bytes = v_bytes = size_t(format::fragment::gaac_page_bytes(D));
      raw_bytes = size_t(kT) * D * 2;  // exact pages: bf16, fragment-major
      break;
    case PageFormat::kFp8Fragments:
      k_bytes = size_t(kT) * D;
      v_bytes = size_t(kT) * D + size_t(kT) * 2;
      raw_bytes = size_t(kT) * D * 2;  // exact pages: bf16, fragment-major
      break;
    case PageFormat::kGaacBf16:
    case PageFormat::kGaacE5M2:
      r.k_capacity_ = options.gaac->escape_capacity_bytes(options.layer, codec::kGaacKey);
      r.v_capacity_ = options.gaac->escape_capacity_bytes(options.layer, codec::kGaacValue);
      k_bytes = format::gaac_slot_bytes(element, kT, D, r.k_capacity_);
      v_bytes = format::gaac_slot_bytes(element, kT, D, r.v_capacity_);
      raw_bytes = format::gaac_page_raw_bytes(element, kT, D);
      break;
    default:
      k_bytes = codec::lossy_page_bytes(r.lossy_spec(true, 0));
      v_bytes = codec::lossy_page_bytes(r.lossy_spec(false, 0));
      raw_bytes = size_t(kT) * D * 2;  // exact pages: bf16
  }
  const size_t k_stride = (k_bytes + 15) / 16 * 16, v_stride = (v_bytes + 15) / 16 * 16;

  // Slots: one shuffled order per pool.
  std::vector<int32_t> k_slot(size_t(r.n_pages_)), v_slot(size_t(r.n_pages_));
  std::iota(k_slot.begin(), k_slot.end(), 0);
  std::iota(v_slot.begin(), v_slot.end(), 0);
  std::mt19937 rng(options.seed);
  if (!options.contiguous_slots) {
    std::shuffle(k_slot.begin(), k_slot.end(), rng);
    std::shuffle(v_slot.begin(), v_slot.end(), rng);
  }

  std::vector<uint8_t> k_host(size_t(r.n_pages_) * k_stride, 0), v_host(size_t(r.n_pages_) * v_stride, 0);
  std::vector<int32_t> tables(size_t(2) * kv.batch * H * size_t(r.table_stride_), 0);
  const size_t table_half = tables.size() / 2;
  if (options.keep_reconstruction) {
    r.k_read_.resize(size_t(kv.batch));
    r.v_read_.resize(size_t(kv.batch));
    r.k_bounds_.resize(size_t(kv.batch));
    r.v_rho_.resize(size_t(kv.batch));
    const int width = dither ? D / codec::kQuantGroup : kBands;
    for (int b = 0; b < kv.batch; ++b) {
      r.k_read_[size_t(b)].assign(kv.k[size_t(b)].size(), 0.f);
      r.v_read_[size_t(b)].assign(kv.v[size_t(b)].size(), 0.f);
      if (is_lossy(f)) {
        r.k_bounds_[size_t(b)].assign(size_t(H) * size_t(kv.lens[size_t(b)]) * width, 0.f);
        r.v_rho_[size_t(b)].assign(size_t(H) * size_t(kv.lens[size_t(b)]), 0.0);
      }
    }
  }

  // Encodes page id (sequence b, kv head h, block j) of K or V into `page` (stride bytes);
  // returns the bytes a decode reads, or 0 when a GAAC page does not fit its slot.
  auto locate = [&](int64_t id, int* b, int* h, int64_t* j) {
    int bb = int(std::upper_bound(first.begin(), first.end(), id) - first.begin()) - 1;
    const int64_t local = id - first[size_t(bb)];
    *b = bb;
    *h = int(local / blocks[size_t(bb)]);
    *j = local % blocks[size_t(bb)];
  };
  std::atomic<bool> failed{false};
  std::mutex raw_mutex;
  std::vector<std::pair<int64_t, bool>> raw_ids;  // (page id, key) that went raw
  std::atomic<int64_t> bytes_read{0}, meter_side_bytes{0};
  std::atomic<int64_t> mode_counts[3] = {0, 0, 0}, pages_without_escapes{0};
  auto count_modes = [&](const uint8_t* page) {  // one tile (D <= 128)
    const uint8_t* tags = page + format::gaac_tile_tag_offset(element, kT, D);
    int64_t counts[3] = {0, 0, 0};
    for (int g = 0; g < kT * D / 8; ++g) ++counts[std::min(2, (tags[g / 4] >> (2 * (g % 4))) & 3)];
    for (int m = 0; m < 3; ++m) mode_counts[m] += counts[m];
    if (counts[1] + counts[2] == 0) ++pages_without_escapes;
  };
  auto encode = [&](int64_t id, bool key, uint8_t* page, bool record_reconstruction) -> size_t {
    int b, h;
    int64_t j;
    locate(id, &b, &h, &j);
    const int64_t len = kv.lens[size_t(b)];
    const std::vector<uint16_t>& src = key ? kv.k[size_t(b)] : kv.v[size_t(b)];
    uint16_t rows[kT * 128] = {0};
    const int64_t t0 = j * kT, n = std::min<int64_t>(kT, len - t0);
    std::copy_n(src.begin() + (size_t(h) * size_t(len) + size_t(t0)) * size_t(D), size_t(n) * size_t(D), rows);
    float read[kT * 128];
    float bounds[kT * kBands];
    double rho[kT];
    size_t stored = 0;
    switch (f) {
      case PageFormat::kBf16:
        std::copy_n(reinterpret_cast<const uint8_t*>(rows), size_t(kT) * D * 2, page);
        for (int i = 0; i < kT * D; ++i) read[i] = format::bf16_to_float(rows[i]);
        stored = size_t(kT) * D * 2;
        break;
      case PageFormat::kBf16Fragments: {
        // Rows past the length hold NaN here: the kernel must mask them (a device page past its
        // sequence's length may hold anything).
        for (int64_t t = n; t < kT; ++t) std::fill_n(rows + t * D, D, uint16_t(0x7fc0));
        uint16_t fragments[kT * 128];
        if (D == 64) fragment::fragment_page_from_rows<64, uint16_t>(rows, key, fragments);
        else fragment::fragment_page_from_rows<128, uint16_t>(rows, key, fragments);
        std::copy_n(reinterpret_cast<const uint8_t*>(fragments), size_t(kT) * D * 2, page);
        for (int i = 0; i < kT * D; ++i) read[i] = format::bf16_to_float(rows[i]);
        stored = size_t(kT) * D * 2;
        break;
      }
      case PageFormat::kFp8Fragments: {
        // The raw cast's codes (and a V page's rho), fragment-major. A K page where the cast
        // saturated (|k| > 464, the largest code 448 plus its half-step) goes exact: there a code
        // would not bound its error.
        const codec::LossyPageSpec spec = r.lossy_spec(key, h);
        std::vector<uint8_t> encoded(codec::lossy_page_bytes(spec));
        if (key)
          for (int64_t i = 0; i < n * D; ++i)
            if (!(std::fabs(format::bf16_to_float(rows[i])) <= 464.f)) return 0;
        if (!codec::lossy_encode_page(spec, uint32_t(j), rows, encoded.data())) {
          failed = true;
          return 0;
        }
        codec::lossy_decode_page_ref(spec, uint32_t(j), encoded.data(), read);
        std::fill_n(bounds, kT * kBands, 0.f);  // no witness: a code's bound is its half-step
        if (!key) {
          const uint16_t* v_rho = codec::lossy_value_rho(spec, encoded.data());
          for (int t = 0; t < kT; ++t) rho[t] = format::fp16_to_float(v_rho[t]);
        }
        // (Rows past the length are poisoned: the kernel must mask them.)
        if (D == 64) fragment::fp8_fragment_page<64>(spec, encoded.data(), n, page);
        else fragment::fp8_fragment_page<128>(spec, encoded.data(), n, page);
        stored = key ? k_bytes : v_bytes;
        break;
      }
      case PageFormat::kGaacFragments: {
        // Rows past the length hold 2^b of each channel's window (zeros would be exceptions): the
        // kernel masks them.
        const codec::GaacBases& bases = options.gaac->bases(options.layer, key ? codec::kGaacKey : codec::kGaacValue, h);
        for (int64_t t = n; t < kT; ++t)
          for (int c = 0; c < D; ++c) rows[t * D + c] = uint16_t(std::max(1, int(bases.b4[size_t(c)])) << 7);
        if (!codec::gaac_fragment_encode_page_ref(rows, key, D, bases.b4.data(), page)) return 0;
        std::vector<uint16_t> back(size_t(kT) * D);
        if (!codec::gaac_fragment_decode_page_ref(page, key, D, bases.b4.data(), back.data())) {
          failed = true;
          return 0;
        }
        for (int i = 0; i < kT * D; ++i) read[i] = format::bf16_to_float(back[size_t(i)]);
        stored = size_t(format::fragment::gaac_page_bytes(D));
        break;
      }
      case PageFormat::kGaacBf16: {
        const codec::GaacBases& bases = options.gaac->bases(options.layer, key ? codec::kGaacKey : codec::kGaacValue, h);
        if (codec::gaac_encode_page_ref(rows, kT, D, bases, key ? r.k_capacity_ : r.v_capacity_, page) ==
            codec::kGaacDoesNotFit)
          return 0;
        count_modes(page);
        std::vector<uint16_t> back(size_t(kT) * D);
        codec::gaac_decode_page_ref(page, key ? k_bytes : v_bytes, kT, D, bases, back.data());
        for (int i = 0; i < kT * D; ++i) read[i] = format::bf16_to_float(back[size_t(i)]);
        stored = key ? k_bytes : v_bytes;  // the kernel stages the whole slot
        break;
      }
      case PageFormat::kGaacE5M2: {
        uint8_t fp8[kT * 128];
        for (int i = 0; i < kT * D; ++i) fp8[i] = format::bf16_to_fp8_e5m2_ref(rows[i]);
        const codec::GaacBases& bases = options.gaac->bases(options.layer, key ? codec::kGaacKey : codec::kGaacValue, h);
        if (codec::gaac_encode_page_fp8_ref(element, fp8, kT, D, bases, key ? r.k_capacity_ : r.v_capacity_, page) ==
            codec::kGaacDoesNotFit)
          return 0;
        count_modes(page);
        uint8_t back[kT * 128];
        codec::gaac_decode_page_fp8_ref(element, page, key ? k_bytes : v_bytes, kT, D, bases, back);
        for (int i = 0; i < kT * D; ++i) read[i] = format::fp8_e5m2_to_float(back[i]);
        stored = key ? k_bytes : v_bytes;  // the kernel stages the whole slot
        break;
      }
      default: {
        const codec::LossyPageSpec spec = r.lossy_spec(key, h);
        if (!codec::lossy_encode_page(spec, uint32_t(j), rows, page)) {  // dither8: keyed by the block
          failed = true;
          return 0;
        }
        codec::lossy_decode_page_ref(spec, uint32_t(j), page, read);
        if (f == PageFormat::kInt8Fragments && key) {  // s q = s (q - xi) + s xi: the dither put back
          const int G = D / codec::kQuantGroup;
          float scales[kT * 128 / codec::kQuantGroup];
          codec::dither8_scales(spec, page, scales);
          std::vector<bool> outlier(size_t(D), false);
          for (int o = 0; o < spec.n_outlier_pairs; ++o)
            for (int which = 0; which < 2; ++which)
              outlier[size_t(codec::rope_pair_channel(spec.pairing, D, spec.outlier_pairs[o], which))] = true;
          for (int64_t t = 0; t < n; ++t)
            for (int c = 0; c < D; ++c)
              if (!outlier[size_t(c)])
                read[t * D + c] += scales[t * G + c / codec::kQuantGroup] *
                                   codec::dither8_xi(spec.dither_key, uint64_t(j) * kT + uint64_t(t), c);
        }
        stored = codec::lossy_page_bytes(spec);
        if (key && record_reconstruction) {
          if (dither) {
            codec::dither8_scales(spec, page, bounds);
          } else {
            float w[kBands * kT];  // [band][token], either witness code read back as floats
            codec::lossy_witness_bounds(spec, page, w);
            for (int t = 0; t < kT; ++t)
              for (int band = 0; band < kBands; ++band) bounds[t * kBands + band] = w[band * kT + t];
          }
        }
        if (!key && record_reconstruction) {
          if (dither) {
            const int G = D / codec::kQuantGroup;
            float scales[kT * 128 / codec::kQuantGroup];
            codec::dither8_scales(spec, page, scales);
            for (int t = 0; t < kT; ++t) {
              double sum_sq = 0;
              for (int g = 0; g < G; ++g) sum_sq += double(codec::kQuantGroup) * scales[t * G + g] * scales[t * G + g];
              rho[t] = (0.5 + double(codec::kDither8Slack)) * std::sqrt(sum_sq);
            }
          } else {
            const uint16_t* v_rho = codec::lossy_value_rho(spec, page);
            for (int t = 0; t < kT; ++t) rho[t] = format::fp16_to_float(v_rho[t]);
          }
        }
        if (f == PageFormat::kDither8Fragments || f == PageFormat::kInt8Fragments) {
          if (D == 64) fragment::dither8_fragment_page<64>(spec, page, n, page);
          else fragment::dither8_fragment_page<128>(spec, page, n, page);
        }
      }
    }
    if (record_reconstruction) {
      std::vector<float>& dst = key ? r.k_read_[size_t(b)] : r.v_read_[size_t(b)];
      std::copy_n(read, size_t(n) * size_t(D), dst.begin() + (size_t(h) * size_t(len) + size_t(t0)) * size_t(D));
      if (key && is_lossy(f)) {
        const int width = dither ? D / codec::kQuantGroup : kBands;
        std::copy_n(bounds, size_t(n) * size_t(width),
                    r.k_bounds_[size_t(b)].begin() + (size_t(h) * size_t(len) + size_t(t0)) * size_t(width));
      }
      if (!key && is_lossy(f))
        std::copy_n(rho, size_t(n), r.v_rho_[size_t(b)].begin() + size_t(h) * size_t(len) + size_t(t0));
    }
    return stored;
  };

  // Tiled KV: encode the distinct blocks once (not dither8, whose pages depend on the block's
  // position).
  const bool reuse = kv.period_blocks > 0 && !dither && !options.keep_reconstruction;
  std::vector<uint8_t> k_unique, v_unique;
  std::vector<size_t> k_unique_used, v_unique_used;
  if (reuse) {
    const int64_t n_unique = int64_t(H) * std::min(kv.period_blocks, blocks[0]);
    k_unique.assign(size_t(n_unique) * k_stride, 0);
    v_unique.assign(size_t(n_unique) * v_stride, 0);
    k_unique_used.assign(size_t(n_unique), 0);
    v_unique_used.assign(size_t(n_unique), 0);
    const int64_t per_head = n_unique / H;
    parallel_for(n_unique, [&](int64_t u) {
      const int64_t id = (u / per_head) * blocks[0] + u % per_head;  // sequence 0, head u / per_head
      k_unique_used[size_t(u)] = encode(id, true, k_unique.data() + size_t(u) * k_stride, false);
      v_unique_used[size_t(u)] = encode(id, false, v_unique.data() + size_t(u) * v_stride, false);
    });
  }

  parallel_for(r.n_pages_, [&](int64_t id) {
    int b, h;
    int64_t j;
    locate(id, &b, &h, &j);
    const size_t t_index = (size_t(b) * H + size_t(h)) * size_t(r.table_stride_) + size_t(j);
    for (int key = 1; key >= 0; --key) {
      if (r.exact_by_option(key != 0, b, h, j)) {  // to the raw pool, as bf16
        std::lock_guard<std::mutex> lock(raw_mutex);
        raw_ids.emplace_back(id, key != 0);
        continue;
      }
      const int32_t slot = key ? k_slot[size_t(id)] : v_slot[size_t(id)];
      uint8_t* page = (key ? k_host.data() : v_host.data()) + size_t(slot) * (key ? k_stride : v_stride);
      size_t stored;
      if (reuse) {
        const int64_t per_head = std::min(kv.period_blocks, blocks[0]);
        const size_t u = size_t(h) * size_t(per_head) + size_t(j % kv.period_blocks);
        const size_t stride = key ? k_stride : v_stride;
        std::copy_n((key ? k_unique : v_unique).data() + u * stride, stride, page);
        stored = (key ? k_unique_used : v_unique_used)[u];
      } else {
        stored = encode(id, key != 0, page, options.keep_reconstruction);
      }
      if (stored == 0) {
        std::lock_guard<std::mutex> lock(raw_mutex);
        raw_ids.emplace_back(id, key != 0);
        continue;
      }
      bytes_read += int64_t(stored);
      if (f == PageFormat::kFp8E4M3 || f == PageFormat::kFp8E5M2 || f == PageFormat::kFp8Fragments)
        meter_side_bytes += int64_t(stored) - kT * D;
      tables[(key ? 0 : table_half) + t_index] = slot;
    }
  });
  if (failed) return invalid("a block could not be encoded (a value not finite, or a scale out of fp16 range)");

  // GAAC pages that did not fit and a lossy format's exact pages: raw pool, entries -(index + 1).
  std::sort(raw_ids.begin(), raw_ids.end());
  r.first_page_ = first;
  r.exact_k_.assign(size_t(r.n_pages_), 0);
  r.exact_v_.assign(size_t(r.n_pages_), 0);
  for (const auto& [id, key] : raw_ids) (key ? r.exact_k_ : r.exact_v_)[size_t(id)] = 1;
  std::vector<uint8_t> k_raw_host, v_raw_host;
  int64_t n_k_raw = 0, n_v_raw = 0;
  const size_t raw_stride = (std::max<size_t>(raw_bytes, 16) + 15) / 16 * 16;
  for (const auto& [id, key] : raw_ids) {
    int b, h;
    int64_t j;
    locate(id, &b, &h, &j);
    const int64_t len = kv.lens[size_t(b)];
    const std::vector<uint16_t>& src = key ? kv.k[size_t(b)] : kv.v[size_t(b)];
    std::vector<uint8_t>& host = key ? k_raw_host : v_raw_host;
    int64_t& count = key ? n_k_raw : n_v_raw;
    const size_t at = host.size();
    host.resize(at + raw_stride, 0);
    const int64_t t0 = j * kT, n = std::min<int64_t>(kT, len - t0);
    const uint16_t* rows = src.data() + (size_t(h) * size_t(len) + size_t(t0)) * size_t(D);
    std::vector<float> read(size_t(kT) * D, 0.f);
    for (int64_t i = 0; i < n * D; ++i) {
      if (f != PageFormat::kGaacE5M2) {  // bf16: gaac, and the exact pages of a lossy format
        std::copy_n(reinterpret_cast<const uint8_t*>(rows + i), 2, host.data() + at + size_t(i) * 2);
        read[size_t(i)] = format::bf16_to_float(rows[i]);
      } else {
        const uint8_t e = format::bf16_to_fp8_e5m2_ref(rows[i]);
        host[at + size_t(i)] = e;
        read[size_t(i)] = format::fp8_e5m2_to_float(e);
      }
    }
    if (options.keep_reconstruction) {
      std::vector<float>& dst = key ? r.k_read_[size_t(b)] : r.v_read_[size_t(b)];
      std::copy_n(read.begin(), size_t(n) * size_t(D), dst.begin() + (size_t(h) * size_t(len) + size_t(t0)) * size_t(D));
    }
    if (f == PageFormat::kFp8Fragments || f == PageFormat::kDither8Fragments || f == PageFormat::kInt8Fragments ||
        f == PageFormat::kGaacFragments) {  // exact pages: bf16, fragment-major
      std::vector<uint16_t> row_major(size_t(kT) * D), fragments(size_t(kT) * D);
      std::copy_n(reinterpret_cast<const uint16_t*>(host.data() + at), size_t(kT) * D, row_major.data());
      if (D == 64) fragment::fragment_page_from_rows<64, uint16_t>(row_major.data(), key, fragments.data());
      else fragment::fragment_page_from_rows<128, uint16_t>(row_major.data(), key, fragments.data());
      std::copy_n(reinterpret_cast<const uint8_t*>(fragments.data()), size_t(kT) * D * 2, host.data() + at);
    }
    const size_t t_index = (size_t(b) * H + size_t(h)) * size_t(r.table_stride_) + size_t(j);
    tables[(key ? 0 : table_half) + t_index] = -int32_t(count) - 1;
    ++count;
    r.bytes_read_ += int64_t(raw_bytes);
    ++r.raw_pages_;
  }
  r.bytes_read_ += bytes_read.load();
  r.meter_side_bytes_ = meter_side_bytes.load();
  for (int m = 0; m < 3; ++m) r.gaac_group_modes_[size_t(m)] = mode_counts[m].load();
  r.gaac_pages_without_escapes_ = pages_without_escapes.load();

  // Upload.
  CudaStatus s = cache::cuda::DevicePagePool::create(k_bytes, r.n_pages_, &r.k_pool_);
  if (s.ok) s = cache::cuda::DevicePagePool::create(v_bytes, r.n_pages_, &r.v_pool_);
  if (s.ok) s = r.k_pool_.write_pages(0, k_host.data(), r.n_pages_, k_stride);
  if (s.ok) s = r.v_pool_.write_pages(0, v_host.data(), r.n_pages_, v_stride);
  if (s.ok && n_k_raw > 0) {
    s = cache::cuda::DevicePagePool::create(raw_stride, n_k_raw, &r.k_raw_);
    if (s.ok) s = r.k_raw_.write_pages(0, k_raw_host.data(), n_k_raw, raw_stride);
  }
  if (s.ok && n_v_raw > 0) {
    s = cache::cuda::DevicePagePool::create(raw_stride, n_v_raw, &r.v_raw_);
    if (s.ok) s = r.v_raw_.write_pages(0, v_raw_host.data(), n_v_raw, raw_stride);
  }
  if (s.ok) s = cache::cuda::DeviceBuffer::allocate(tables.size() * 4, &r.tables_);
  if (s.ok) s = r.tables_.upload(0, tables.data(), tables.size() * 4);
  std::vector<int32_t> lens(kv.lens.begin(), kv.lens.end());
  if (s.ok) s = cache::cuda::DeviceBuffer::allocate(lens.size() * 4, &r.lens_);
  if (s.ok) s = r.lens_.upload(0, lens.data(), lens.size() * 4);
  if (s.ok && is_gaac(f)) {
    std::vector<uint8_t> bases(size_t(2) * H * 2 * D);
    for (int kvi = 0; kvi < 2; ++kvi)
      for (int h = 0; h < H; ++h) {
        const codec::GaacBases& gb = options.gaac->bases(options.layer, kvi, h);
        std::copy_n(gb.b3.begin(), D, bases.begin() + ((size_t(kvi) * H + h) * 2 + 0) * D);
        std::copy_n(gb.b4.begin(), D, bases.begin() + ((size_t(kvi) * H + h) * 2 + 1) * D);
      }
    s = cache::cuda::DeviceBuffer::allocate(bases.size(), &r.bases_);
    if (s.ok) s = r.bases_.upload(0, bases.data(), bases.size());
  }
  if (s.ok && dither) {
    std::vector<uint64_t> keys(size_t(2) * H);
    std::vector<int32_t> channels(size_t(H) * 2 * std::max(1, options.n_outlier_pairs), 0);
    for (int h = 0; h < H; ++h) {
      keys[size_t(h)] = codec::dither8_key(options.layer, true, h);
      keys[size_t(H + h)] = codec::dither8_key(options.layer, false, h);
      for (int o = 0; o < options.n_outlier_pairs; ++o)
        for (int which = 0; which < 2; ++which)
          channels[size_t(h) * 2 * options.n_outlier_pairs + 2 * o + which] =
              codec::rope_pair_channel(options.pairing, D, r.outlier_pairs_[size_t(h)][size_t(o)], which);
    }
    s = cache::cuda::DeviceBuffer::allocate(keys.size() * 8, &r.keys_);
    if (s.ok) s = r.keys_.upload(0, keys.data(), keys.size() * 8);
    if (s.ok) s = cache::cuda::DeviceBuffer::allocate(channels.size() * 4, &r.outliers_);
    if (s.ok) s = r.outliers_.upload(0, channels.data(), channels.size() * 4);
  }
  if (!s.ok) return s;
  *out = std::move(r);
  return {};
}

void DeviceKv::describe(PagedDecodeParams* p) const {
  const int H = shape_.n_kv_heads;
  p->format = options_.format;
  p->batch = shape_.batch;
  p->n_kv_heads = H;
  p->head_dim = shape_.head_dim;
  p->block_tokens = kT;
  p->k_pages = k_pool_.data();
  p->v_pages = v_pool_.data();
  p->k_page_stride = int64_t(k_pool_.stride());
  p->v_page_stride = int64_t(v_pool_.stride());
  p->n_k_pages = k_pool_.n_pages();
  p->n_v_pages = v_pool_.n_pages();
  p->k_raw_pages = k_raw_.data();
  p->v_raw_pages = v_raw_.data();
  p->raw_page_stride = int64_t(std::max(k_raw_.stride(), v_raw_.stride()));
  p->n_k_raw_pages = k_raw_.n_pages();
  p->n_v_raw_pages = v_raw_.n_pages();
  const size_t half = size_t(shape_.batch) * H * size_t(table_stride_);
  p->k_table = reinterpret_cast<const int32_t*>(tables_.data());
  p->v_table = reinterpret_cast<const int32_t*>(tables_.data()) + half;
  p->table_stride = table_stride_;
  p->seq_lens = reinterpret_cast<const int32_t*>(lens_.data());
  p->max_seq_len = max_len_;
  p->gaac_bases = bases_.data();
  p->k_escape_capacity = int64_t(k_capacity_);
  p->v_escape_capacity = int64_t(v_capacity_);
  p->dither_keys = reinterpret_cast<const uint64_t*>(keys_.data());
  p->n_outlier_pairs = page_format_dither8_bytes(options_.format) ? options_.n_outlier_pairs : 0;
  p->outlier_channels = reinterpret_cast<const int32_t*>(outliers_.data());
  p->rope_half_split = options_.pairing == codec::RopePairing::kHalfSplit;
  p->witness = options_.witness;
}

}  // namespace certkv::attention::cuda
