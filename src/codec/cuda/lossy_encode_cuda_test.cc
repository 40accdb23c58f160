// Lossy page encoding on the device against the CPU reference lossy_encode_page_ref, page by
// page: the refusal flag and, for an encoded page, every byte (codes, scales, outlier values,
// witness or rho), then the decode of the device bytes against that of the reference bytes.
// Schemes fp8-e4m3, fp8-e5m2, dither8; K and V pages; head_dim 64 and 128 at 16 tokens with both
// RoPE pairings and, on dither8 K pages, 0 and 4 outlier pairs; ragged shapes (32 and 256
// channels at 1, 3, 17 and 4096 tokens, up to every pair an outlier). Every launch holds hundreds
// of pages, each with its own slot, dither key and outlier list: realistic keys and values with
// massive activations on the outlier pairs, pages with a NaN or an Inf, all-zero pages, bf16
// subnormals, small values (fp8 subnormal codes, fp16 subnormal scales), and values at the limits
// (a dither8 scale just inside or past fp16, E5M2 just below or at its overflow, saturated E4M3
// with +Inf witnesses). Source pages are not 4-byte aligned and slots start at odd addresses,
// with guard bytes between them. The refusals of check_lossy_encode need no device; the rest skip
// without one.
#include "codec/cuda/lossy_encode_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_test_support.h"
#include "codec/lossy_page.h"
#include "format/fragment_layout.h"
#include "format/numeric.h"

namespace certkv::codec::cuda {
namespace {

using ::certkv::testing::DeviceBytes;

using format::bf16_to_float;
using format::float_to_bf16;



constexpr uint16_t kBf16Max = 0x7f7f;  // 3.39e38, the largest finite bf16
// NaN, -NaN, a signalling NaN, +Inf, -Inf.
constexpr uint16_t kNonFinite[] = {0x7fc0, 0xffc1, 0x7f81, 0x7f80, 0xff80};

struct Shape {
  LossyScheme scheme;
  bool key;
  int block_tokens;
  int head_dim;
  RopePairing pairing;
  int n_outlier_pairs;  // dither8 K pages
  WitnessCode witness = WitnessCode::kFp16;  // fp8 K pages
};

std::string shape_name(const Shape& s) {
  return std::string(lossy_scheme_name(s.scheme)) + (s.key ? " K" : " V") +
         " T=" + std::to_string(s.block_tokens) + " D=" + std::to_string(s.head_dim) +
         (s.pairing == RopePairing::kInterleaved ? " interleaved" : " half-split") +
         " m=" + std::to_string(s.n_outlier_pairs) + " witness " + witness_code_name(s.witness);
}

// The launch's spec: the outlier lists and dither keys are per task.
LossyPageSpec spec_of(const Shape& s) {
  LossyPageSpec spec;
  spec.scheme = s.scheme;
  spec.key = s.key;
  spec.block_tokens = s.block_tokens;
  spec.head_dim = s.head_dim;
  spec.pairing = s.pairing;
  spec.n_outlier_pairs = s.n_outlier_pairs;
  spec.witness = s.witness;
  return spec;
}

// Bytes of a page of shape s: its outlier pairs do not change the size, pairs 0 .. m - 1 stand in.
size_t page_bytes_of(const Shape& s) {
  std::vector<uint16_t> pairs(static_cast<size_t>(s.n_outlier_pairs));
  std::iota(pairs.begin(), pairs.end(), uint16_t(0));
  LossyPageSpec spec = spec_of(s);
  spec.outlier_pairs = pairs.data();
  return lossy_page_bytes(spec);
}

enum class PageKind { kRealistic, kNonFinite, kZero, kTiny, kSmall, kAtTheLimit };
constexpr int kNumPageKinds = 6;

struct Page {
  std::vector<uint16_t> x;         // [T][D] bf16, the exact block
  std::vector<uint16_t> outliers;  // dither8 K pages: the head's m pairs, increasing
  uint32_t slot = 0;
  uint64_t dither_key = 0;
  bool expect_encoded = true;  // what the generator built the page for
  bool ref_encoded = false;    // the CPU encoder's answer
  std::vector<uint8_t> ref_bytes;
};

// The CPU reference's spec of one page: the launch's spec with the page's key and outliers.
LossyPageSpec page_spec(const Shape& s, const Page& p) {
  LossyPageSpec spec = spec_of(s);
  spec.dither_key = p.dither_key;
  spec.outlier_pairs = p.outliers.empty() ? nullptr : p.outliers.data();
  return spec;
}

// sign * 2^e with e uniform in [lo, hi).
float log_uniform(std::mt19937_64& rng, float lo, float hi) {
  const float e = std::uniform_real_distribution<float>(lo, hi)(rng);
  return (rng() % 2 ? -1.0f : 1.0f) * std::exp2(e);
}

// Keys or values: every channel normal with its own log-normal scale, the channels of the hot
// pairs massive (20 to 1500, beyond E4M3's 448).
// Whether a shape's K pages carry the exponent witness: their values must stay within
// kExponentWitnessLimit (a saturating cast breaks the bound), or the page stays exact.
bool exponent_key(const Shape& s) { return s.key && s.witness == WitnessCode::kExponent; }
float within_exponent_limit(const Shape& s, float v) {
  return exponent_key(s) ? std::clamp(v, -kExponentWitnessLimit, kExponentWitnessLimit) : v;
}

void fill_realistic(const Shape& s, const std::vector<uint8_t>& hot, std::mt19937_64& rng,
                    std::vector<uint16_t>* x) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> sigma(size_t(s.head_dim));
  for (int c = 0; c < s.head_dim; ++c) {
    sigma[size_t(c)] = hot[size_t(c)] ? std::fabs(log_uniform(rng, 4.3f, 10.55f))
                                      : std::exp(0.5f * normal(rng)) * (s.key ? 1.0f : 0.25f);
  }
  for (int t = 0; t < s.block_tokens; ++t) {
    for (int c = 0; c < s.head_dim; ++c) {
      const float v = hot[size_t(c)] ? sigma[size_t(c)] * (1.0f + 0.05f * normal(rng))
                                     : sigma[size_t(c)] * normal(rng);
      (*x)[size_t(t) * size_t(s.head_dim) + size_t(c)] = float_to_bf16(within_exponent_limit(s, v));
    }
  }
}

// Values at the limits of the scheme. dither8: each group's largest non-outlier value is just
// inside the fp16 scale limit (8257536 / 126.5 = 65277) or well inside; when refusing, one group
// reaches 8290304 (scale 65536, past 65504) or more; outlier channels hold huge finite values,
// which the amax leaves out. E5M2: magnitudes up to 61184 (reads back 57344); when refusing, one
// reaches 61440 (rounds to Inf) or more. E4M3: up to 2^20, saturated at 448, residual norms past
// 65504 (+Inf witnesses).
void fill_at_the_limit(const Shape& s, const std::vector<uint8_t>& outlier, bool refuse,
                       std::mt19937_64& rng, std::vector<uint16_t>* x, bool* refused) {
  const size_t d = size_t(s.head_dim);
  *refused = false;
  if (s.scheme == LossyScheme::kDither8) {
    const float tops[] = {8257536.0f, 8224768.0f, 4194304.0f, 1e6f, 3.0f};
    const float past[] = {8290304.0f, 1e10f, bf16_to_float(kBf16Max)};
    const float huge[] = {1e30f, -1e30f, bf16_to_float(kBf16Max), -bf16_to_float(kBf16Max)};
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int groups = s.head_dim / kQuantGroup;
    const int refusing_item = int(rng() % uint64_t(s.block_tokens * groups));
    for (int t = 0; t < s.block_tokens; ++t) {
      for (int grp = 0; grp < groups; ++grp) {
        std::vector<int> regular;
        for (int c = grp * kQuantGroup; c < (grp + 1) * kQuantGroup; ++c) {
          if (!outlier[size_t(c)]) regular.push_back(c);
        }
        const float top = tops[rng() % std::size(tops)];
        for (int c = grp * kQuantGroup; c < (grp + 1) * kQuantGroup; ++c) {
          const float v = outlier[size_t(c)] ? huge[rng() % std::size(huge)]
                                             : std::clamp(normal(rng) * top / 3.0f, -top, top);
          (*x)[size_t(t) * d + size_t(c)] = float_to_bf16(v);
        }
        if (regular.empty()) continue;
        const int c = regular[rng() % regular.size()];
        float v = top;
        if (refuse && t * groups + grp == refusing_item) {
          v = past[rng() % std::size(past)];
          *refused = true;
        }
        (*x)[size_t(t) * d + size_t(c)] = float_to_bf16(rng() % 2 ? -v : v);
      }
    }
    return;
  }
  const bool e5m2 = s.scheme == LossyScheme::kFp8E5M2;
  const float boundary[] = {57344.0f, 61184.0f, 448.0f, 464.0f, 480.0f, 65504.0f, 0.015625f};
  for (size_t i = 0; i < x->size(); ++i) {
    float v = rng() % 8 == 0 ? boundary[rng() % std::size(boundary)] * (rng() % 2 ? -1.0f : 1.0f)
                             : log_uniform(rng, -16.0f, e5m2 ? 15.9f : 20.0f);
    if (e5m2 && std::fabs(bf16_to_float(float_to_bf16(v))) >= 61440.0f) {
      v = v < 0 ? -61184.0f : 61184.0f;
    }
    (*x)[i] = float_to_bf16(within_exponent_limit(s, v));
  }
  if (exponent_key(s) && refuse) {  // one value past the limit: the page stays exact
    const float past[] = {466.0f, 480.0f, 1e6f, bf16_to_float(kBf16Max)};  // 466: the next bf16 past 464
    const float v = past[rng() % std::size(past)];
    (*x)[rng() % x->size()] = float_to_bf16(rng() % 2 ? -v : v);
    *refused = true;
  }
  if (e5m2 && refuse) {
    const float past[] = {61440.0f, 65536.0f, 1e6f, bf16_to_float(kBf16Max)};
    const float v = past[rng() % std::size(past)];
    (*x)[rng() % x->size()] = float_to_bf16(rng() % 2 ? -v : v);
    *refused = true;
  }
}

Page make_page(const Shape& s, PageKind kind, std::mt19937_64& rng) {
  Page p;
  const int n_pairs = s.head_dim / 2;
  // The page's head and slot (the largest slot makes the dither counter pass 2^32).
  p.slot = rng() % 4 == 0 ? 0xFFFFFFFFu - uint32_t(rng() % 2) : uint32_t(rng());
  p.dither_key = dither8_key(int(rng() % 32), s.key, int(rng() % 8));
  std::vector<int> pairs(static_cast<size_t>(n_pairs));
  std::iota(pairs.begin(), pairs.end(), 0);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  for (int i = 0; i < s.n_outlier_pairs; ++i) p.outliers.push_back(uint16_t(pairs[size_t(i)]));
  std::sort(p.outliers.begin(), p.outliers.end());
  // Massive activations sit on the outlier pairs, or on two pairs when there are none.
  std::vector<uint8_t> hot(size_t(s.head_dim), 0), outlier(size_t(s.head_dim), 0);
  for (int i = 0; i < std::max(s.n_outlier_pairs, 2); ++i) {
    for (int which = 0; which < 2; ++which) {
      const size_t c = size_t(rope_pair_channel(s.pairing, s.head_dim, pairs[size_t(i)], which));
      hot[c] = 1;
      if (i < s.n_outlier_pairs) outlier[c] = 1;
    }
  }
  const size_t n = size_t(s.block_tokens) * size_t(s.head_dim);
  p.x.assign(n, 0);
  switch (kind) {
    case PageKind::kRealistic:
      fill_realistic(s, hot, rng, &p.x);
      break;
    case PageKind::kNonFinite: {
      fill_realistic(s, hot, rng, &p.x);
      const size_t t = rng() % uint64_t(s.block_tokens);
      // Half the time in an outlier channel, when there are outliers.
      size_t c = rng() % uint64_t(s.head_dim);
      if (s.n_outlier_pairs > 0 && rng() % 2 == 0) {
        c = size_t(rope_pair_channel(s.pairing, s.head_dim, p.outliers[rng() % p.outliers.size()],
                                     int(rng() % 2)));
      }
      p.x[t * size_t(s.head_dim) + c] = kNonFinite[rng() % std::size(kNonFinite)];
      p.expect_encoded = false;
      break;
    }
    case PageKind::kZero:
      for (uint16_t& v : p.x) v = rng() % 2 ? 0x8000 : 0x0000;
      break;
    case PageKind::kTiny:
      // bf16 subnormals and the smallest normals (below 2^-118), and zeros.
      for (uint16_t& v : p.x) {
        const uint16_t sign = rng() % 2 ? 0x8000 : 0;
        const uint64_t r = rng() % 4;
        v = r == 0   ? sign
            : r == 3 ? uint16_t(sign | (1 + rng() % 8) << 7 | rng() % 128)
                     : uint16_t(sign | (1 + rng() % 127));
      }
      break;
    case PageKind::kSmall:
      // 2^-30 to 2^-8: fp8 subnormals and zeros, dither8 scales among the fp16 subnormals.
      for (uint16_t& v : p.x) v = float_to_bf16(log_uniform(rng, -30.0f, -8.0f));
      break;
    case PageKind::kAtTheLimit: {
      bool refused = false;
      fill_at_the_limit(s, outlier, rng() % 2 == 0, rng, &p.x, &refused);
      p.expect_encoded = !refused;
      break;
    }
  }
  return p;
}

// Where byte `offset` of a page lies, for failure messages.
std::string page_region(const Shape& s, size_t offset) {
  const size_t d = size_t(s.head_dim), groups = d / kQuantGroup;
  if (s.scheme == LossyScheme::kDither8) {
    const size_t record = d + 2 * groups + 4 * size_t(s.n_outlier_pairs);
    const size_t t = offset / record, in = offset % record;
    const std::string token = "token " + std::to_string(t) + " ";
    if (in < d) return token + "code of channel " + std::to_string(in);
    if (in < d + 2 * groups) return token + "scale of group " + std::to_string((in - d) / 2);
    return token + "outlier value " + std::to_string((in - d - 2 * groups) / 2);
  }
  const size_t payload = size_t(s.block_tokens) * d;
  if (offset < payload) {
    return "token " + std::to_string(offset / d) + " code of channel " + std::to_string(offset % d);
  }
  if (s.key && s.witness == WitnessCode::kPageScaled8) {
    const size_t entry = offset - payload, cells = size_t(witness_bands(s.head_dim)) * size_t(s.block_tokens);
    if (entry >= cells) return "the witness scale w_max";
    return "witness code of band " + std::to_string(entry / size_t(s.block_tokens)) + " token " +
           std::to_string(entry % size_t(s.block_tokens));
  }
  const size_t entry = (offset - payload) / 2;
  if (!s.key) return "rho of token " + std::to_string(entry);
  return "witness of band " + std::to_string(entry / size_t(s.block_tokens)) + " token " +
         std::to_string(entry % size_t(s.block_tokens));
}

struct RunSummary {
  int encoded[kNumPageKinds] = {};
  int refused[kNumPageKinds] = {};
};

// Builds n_pages pages of shape s, encodes them on the CPU and in one device launch, and compares
// page by page. LossyDeviceLayout::kFragments (dither8; fp8-e4m3 with the exponent witness; 16
// tokens): the exact blocks go to the device fragment-major (as the device KV cache's raw pages hold
// them) and each device page must be the reference's page transcoded
// (format::fragment::dither8_page_to_fragments, fp8_page_to_fragments), bit for bit.
RunSummary encode_and_compare(const Shape& s, int n_pages, uint64_t seed,
                              LossyDeviceLayout layout = LossyDeviceLayout::kCodec) {
  const bool fragments = layout == LossyDeviceLayout::kFragments;
  const int groups = s.head_dim / kQuantGroup;
  SCOPED_TRACE(shape_name(s));
  std::mt19937_64 rng(seed);
  const LossyPageSpec spec = spec_of(s);
  const size_t page_bytes = page_bytes_of(s);
  const size_t n_elements = size_t(s.block_tokens) * size_t(s.head_dim);
  const size_t m = size_t(s.n_outlier_pairs);
  std::vector<Page> pages;
  RunSummary summary;
  for (int i = 0; i < n_pages; ++i) {
    Page p = make_page(s, static_cast<PageKind>(i % kNumPageKinds), rng);
    p.ref_bytes.assign(page_bytes, 0);
    p.ref_encoded = lossy_encode_page_ref(page_spec(s, p), p.slot, p.x.data(), p.ref_bytes.data());
    // The generator built each page for one outcome; the reference agrees.
    EXPECT_EQ(p.ref_encoded, p.expect_encoded) << "page " << i << " kind " << i % kNumPageKinds;
    int* count = p.ref_encoded ? summary.encoded : summary.refused;
    ++count[i % kNumPageKinds];
    pages.push_back(std::move(p));
  }

  // Source pages at odd element offsets (2-byte but not 4-byte aligned); slots at odd byte
  // offsets, each after a guard byte that must stay untouched.
  const size_t np = size_t(n_pages);
  std::vector<size_t> src_offset(np), dst_offset(np);
  size_t src_elements = 0, dst_bytes = 0;
  for (size_t i = 0; i < np; ++i) {
    src_offset[i] = src_elements + 1;
    src_elements += 1 + n_elements;
    dst_offset[i] = dst_bytes + 1;
    dst_bytes += 1 + page_bytes;
  }
  ++dst_bytes;  // a guard byte after the last page
  std::vector<uint16_t> src(src_elements, 0x5a5a);
  std::vector<uint16_t> outlier_lists(std::max<size_t>(np * m, 1), 0);
  for (size_t i = 0; i < np; ++i) {
    if (fragments)
      format::fragment::bf16_page_to_fragments(s.key, s.head_dim, pages[i].x.data(), src.data() + src_offset[i]);
    else
      std::copy(pages[i].x.begin(), pages[i].x.end(), src.begin() + ptrdiff_t(src_offset[i]));
    std::copy(pages[i].outliers.begin(), pages[i].outliers.end(),
              outlier_lists.begin() + ptrdiff_t(i * m));
  }
  DeviceBytes d_src(src_elements * 2), d_dst(dst_bytes), d_lists(outlier_lists.size() * 2),
      d_tasks(np * sizeof(LossyEncodeTask)), d_encoded(np);
  d_src.upload(src.data(), src_elements * 2);
  d_lists.upload(outlier_lists.data(), outlier_lists.size() * 2);
  // Unwritten bytes and answers show as 0xcd and 0xab.
  std::vector<uint8_t> dst(dst_bytes, 0xcd);
  d_dst.upload(dst.data(), dst_bytes);
  std::vector<uint8_t> encoded(np, 0xab);
  d_encoded.upload(encoded.data(), np);
  std::vector<LossyEncodeTask> tasks(np);
  for (size_t i = 0; i < np; ++i) {
    LossyEncodeTask& t = tasks[i];
    t.src = reinterpret_cast<const uint16_t*>(d_src.data()) + src_offset[i];
    t.dst = d_dst.data() + dst_offset[i];
    t.block = pages[i].slot;
    t.dither_key = pages[i].dither_key;
    t.outlier_pairs = m > 0 ? reinterpret_cast<const uint16_t*>(d_lists.data()) + i * m : nullptr;
  }
  d_tasks.upload(tasks.data(), np * sizeof(LossyEncodeTask));

  const CudaStatus status =
      lossy_encode_pages(spec, reinterpret_cast<const LossyEncodeTask*>(d_tasks.data()), n_pages,
                         d_encoded.data(), nullptr, layout);
  EXPECT_TRUE(status.ok) << status.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d_encoded.download(encoded.data(), np);
  d_dst.download(dst.data(), dst_bytes);

  for (size_t i = 0; i < np; ++i) {
    EXPECT_EQ(dst[dst_offset[i] - 1], 0xcd) << "the guard byte before page " << i;
  }
  EXPECT_EQ(dst[dst_bytes - 1], 0xcd) << "the guard byte after the last page";
  int failures = 0;
  std::vector<float> ref_decoded(n_elements), got_decoded(n_elements);
  for (size_t i = 0; i < np && failures < 10; ++i) {
    const Page& p = pages[i];
    const uint8_t expected = p.ref_encoded ? kLossyEncoded : kLossyRefused;
    if (encoded[i] != expected) {
      ADD_FAILURE() << "page " << i << " (kind " << i % kNumPageKinds << "): device answer "
                    << int(encoded[i]) << ", CPU " << int(expected);
      ++failures;
      continue;
    }
    if (!p.ref_encoded) continue;
    const uint8_t* stored = dst.data() + dst_offset[i];
    // What the device must hold, and the device page in the codec's order.
    std::vector<uint8_t> want = p.ref_bytes, codec_order(stored, stored + page_bytes);
    if (fragments && s.scheme == LossyScheme::kDither8) {
      format::fragment::dither8_page_to_fragments(s.key, s.head_dim, groups, int(m), p.ref_bytes.data(), want.data());
      format::fragment::dither8_page_from_fragments(s.key, s.head_dim, groups, int(m), stored, codec_order.data());
    } else if (fragments) {
      format::fragment::fp8_page_to_fragments(s.key, s.head_dim, p.ref_bytes.data(), want.data());
      format::fragment::fp8_page_from_fragments(s.key, s.head_dim, stored, codec_order.data());
    }
    const uint8_t* got = codec_order.data();
    const auto mismatch = std::mismatch(want.begin(), want.end(), stored);
    if (mismatch.first != want.end()) {
      const size_t offset = size_t(mismatch.first - want.begin());
      ADD_FAILURE() << "page " << i << " (kind " << i % kNumPageKinds << ", slot " << p.slot
                    << "): first differing byte " << offset << " of " << page_bytes << " ("
                    << (fragments ? std::string("fragment-major") : page_region(s, offset)) << "): device "
                    << int(*mismatch.second) << ", CPU " << int(*mismatch.first);
      ++failures;
    }
    const LossyPageSpec ps = page_spec(s, p);
    lossy_decode_page_ref(ps, p.slot, p.ref_bytes.data(), ref_decoded.data());
    lossy_decode_page_ref(ps, p.slot, got, got_decoded.data());
    if (std::memcmp(ref_decoded.data(), got_decoded.data(), n_elements * sizeof(float)) != 0) {
      ADD_FAILURE() << "page " << i << ": the device page decodes differently";
      ++failures;
    }
  }
  return summary;
}

int kind_index(PageKind k) { return static_cast<int>(k); }

TEST(LossyEncodeCuda, MatchesTheReferenceOnEverySchemeShapeAndPairing) {
  CERTKV_NEED_CUDA_DEVICE();
  const LossyScheme schemes[] = {LossyScheme::kFp8E4M3, LossyScheme::kFp8E5M2,
                                 LossyScheme::kDither8};
  const int n_pages = 240;  // 40 of each kind
  uint64_t seed = 1;
  for (LossyScheme scheme : schemes) {
    for (bool key : {true, false}) {
      for (int head_dim : {64, 128}) {
        for (RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
          for (int m : {0, 4}) {
            if (m > 0 && !(scheme == LossyScheme::kDither8 && key)) continue;
            for (WitnessCode witness : {WitnessCode::kFp16, WitnessCode::kPageScaled8, WitnessCode::kExponent}) {  // fp8 K pages: every code
              if (witness != WitnessCode::kFp16 && (scheme == LossyScheme::kDither8 || !key)) continue;
              if (witness == WitnessCode::kExponent && scheme != LossyScheme::kFp8E4M3) continue;
              const Shape s{scheme, key, 16, head_dim, pairing, m, witness};
              const RunSummary r = encode_and_compare(s, n_pages, seed++);
              // Every page kind took its outcome; the limit pages took both where the scheme can
              // refuse (the reference's answers were checked against the generator's above).
              const int per_kind = n_pages / kNumPageKinds;
              EXPECT_EQ(r.encoded[kind_index(PageKind::kRealistic)], per_kind) << shape_name(s);
              EXPECT_EQ(r.refused[kind_index(PageKind::kNonFinite)], per_kind) << shape_name(s);
              EXPECT_EQ(r.encoded[kind_index(PageKind::kZero)], per_kind) << shape_name(s);
              EXPECT_EQ(r.encoded[kind_index(PageKind::kTiny)], per_kind) << shape_name(s);
              EXPECT_EQ(r.encoded[kind_index(PageKind::kSmall)], per_kind) << shape_name(s);
              const int limit = kind_index(PageKind::kAtTheLimit);
              EXPECT_GE(r.encoded[limit], per_kind / 4) << shape_name(s);
              if (scheme == LossyScheme::kFp8E4M3 && witness != WitnessCode::kExponent) {
                EXPECT_EQ(r.refused[limit], 0) << shape_name(s);
              } else {
                EXPECT_GE(r.refused[limit], per_kind / 4) << shape_name(s);
              }
            }
          }
        }
      }
    }
  }
}

// dither8 pages read and written fragment-major (LossyDeviceLayout::kFragments, what the device
// KV cache finalizes for the fragment kernel): the reference's page transcoded, bit for bit, and
// refused exactly where the reference refuses, over every page kind, K (0 and 4 outlier pairs)
// and V, head_dim 64 and 128, both pairings.
TEST(LossyEncodeCuda, Dither8PagesFragmentMajorAreTheReferencesTranscoded) {
  CERTKV_NEED_CUDA_DEVICE();
  const int n_pages = 240;  // 40 of each kind
  const int per_kind = n_pages / kNumPageKinds;
  uint64_t seed = 500;
  for (bool key : {true, false})
    for (int head_dim : {64, 128})
      for (RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit})
        for (int m : {0, 4}) {
          if (m > 0 && !key) continue;
          const Shape s{LossyScheme::kDither8, key, 16, head_dim, pairing, m};
          const RunSummary r = encode_and_compare(s, n_pages, seed++, LossyDeviceLayout::kFragments);
          EXPECT_EQ(r.encoded[kind_index(PageKind::kRealistic)], per_kind) << shape_name(s);
          EXPECT_EQ(r.refused[kind_index(PageKind::kNonFinite)], per_kind) << shape_name(s);
          EXPECT_GE(r.refused[kind_index(PageKind::kAtTheLimit)], per_kind / 4) << shape_name(s);
        }
}

// fp8-e4m3 pages with the exponent witness read and written fragment-major (what the fragment
// kernel reads with its zero-byte meter): the reference's page transcoded, bit for bit, and
// refused exactly where the reference refuses (a K page with a value past the saturation limit
// stays exact), over every page kind, K and V, head_dim 64 and 128, both pairings.
TEST(LossyEncodeCuda, Fp8ExponentWitnessPagesFragmentMajorAreTheReferencesTranscoded) {
  CERTKV_NEED_CUDA_DEVICE();
  const int n_pages = 240;  // 40 of each kind
  const int per_kind = n_pages / kNumPageKinds;
  uint64_t seed = 700;
  for (bool key : {true, false})
    for (int head_dim : {64, 128})
      for (RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalfSplit}) {
        const Shape s{LossyScheme::kFp8E4M3, key, 16, head_dim, pairing, 0,
                      key ? WitnessCode::kExponent : WitnessCode::kFp16};
        const RunSummary r = encode_and_compare(s, n_pages, seed++, LossyDeviceLayout::kFragments);
        EXPECT_EQ(r.encoded[kind_index(PageKind::kRealistic)], per_kind) << shape_name(s);
        EXPECT_EQ(r.refused[kind_index(PageKind::kNonFinite)], per_kind) << shape_name(s);
        EXPECT_GE(r.encoded[kind_index(PageKind::kAtTheLimit)], per_kind / 4) << shape_name(s);
        if (key) {
          EXPECT_GE(r.refused[kind_index(PageKind::kAtTheLimit)], per_kind / 4) << shape_name(s);
        }
      }
}

TEST(LossyEncodeCuda, MatchesTheReferenceOnRaggedShapes) {
  CERTKV_NEED_CUDA_DEVICE();
  const LossyScheme schemes[] = {LossyScheme::kFp8E4M3, LossyScheme::kFp8E5M2,
                                 LossyScheme::kDither8};
  uint64_t seed = 1000;
  for (LossyScheme scheme : schemes) {
    for (bool key : {true, false}) {
      for (int head_dim : {32, 256}) {
        const bool outliers = scheme == LossyScheme::kDither8 && key;
        // Every pair an outlier at D = 32 (no channel quantized: zero scales); the most pairs at
        // D = 256.
        const int m_max = std::min(kMaxOutlierPairs, head_dim / 2);
        for (int m : outliers ? std::vector<int>{0, 3, m_max} : std::vector<int>{0}) {
          for (int block_tokens : {1, 3, 17}) {
            const RopePairing pairing =
                seed % 2 ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
            encode_and_compare(Shape{scheme, key, block_tokens, head_dim, pairing, m}, 36, seed++);
            if (scheme != LossyScheme::kDither8 && key)
              encode_and_compare(Shape{scheme, key, block_tokens, head_dim, pairing, m, WitnessCode::kPageScaled8},
                                 36, seed++);
          }
        }
        // The largest block: long loops per CTA, counters far past one slot's (and, with the u8
        // witness, one page scale over 4096 tokens).
        encode_and_compare(
            Shape{scheme, key, 4096, head_dim, RopePairing::kHalfSplit, outliers ? 5 : 0}, 6,
            seed++);
        if (scheme != LossyScheme::kDither8 && key)
          encode_and_compare(Shape{scheme, key, 4096, head_dim, RopePairing::kHalfSplit, 0, WitnessCode::kPageScaled8},
                             6, seed++);
      }
    }
  }
}

TEST(LossyEncodeCuda, Dither8OutlierListsThatBreakTheRuleAreRefused) {
  CERTKV_NEED_CUDA_DEVICE();
  const Shape s{LossyScheme::kDither8, true, 16, 64, RopePairing::kHalfSplit, 4};
  const LossyPageSpec spec = spec_of(s);
  const size_t page_bytes = page_bytes_of(s);
  const size_t n_elements = 16 * 64;
  std::mt19937_64 rng(7);
  const Page page = make_page(s, PageKind::kRealistic, rng);
  std::vector<uint8_t> ref(page_bytes);
  ASSERT_TRUE(lossy_encode_page_ref(page_spec(s, page), page.slot, page.x.data(), ref.data()));
  // Task 0 has the page's valid list; then no list, a repeated pair, a decreasing list and a pair
  // past head_dim / 2 = 32.
  const std::vector<uint16_t> lists[] = {page.outliers, {3, 3, 7, 9}, {9, 7, 3, 1}, {1, 2, 3, 32}};
  std::vector<uint16_t> flat;
  for (const auto& l : lists) flat.insert(flat.end(), l.begin(), l.end());
  const int n_tasks = 5;
  DeviceBytes d_src(n_elements * 2), d_dst(page_bytes * n_tasks), d_lists(flat.size() * 2),
      d_tasks(n_tasks * sizeof(LossyEncodeTask)), d_encoded(n_tasks);
  d_src.upload(page.x.data(), n_elements * 2);
  d_lists.upload(flat.data(), flat.size() * 2);
  const uint16_t* lists_on_device = reinterpret_cast<const uint16_t*>(d_lists.data());
  const uint16_t* task_lists[n_tasks] = {lists_on_device, nullptr, lists_on_device + 4,
                                         lists_on_device + 8, lists_on_device + 12};
  std::vector<LossyEncodeTask> tasks(n_tasks);
  for (int i = 0; i < n_tasks; ++i) {
    tasks[size_t(i)].src = reinterpret_cast<const uint16_t*>(d_src.data());
    tasks[size_t(i)].dst = d_dst.data() + size_t(i) * page_bytes;
    tasks[size_t(i)].block = page.slot;
    tasks[size_t(i)].dither_key = page.dither_key;
    tasks[size_t(i)].outlier_pairs = task_lists[i];
  }
  d_tasks.upload(tasks.data(), tasks.size() * sizeof(LossyEncodeTask));
  const CudaStatus status =
      lossy_encode_pages(spec, reinterpret_cast<const LossyEncodeTask*>(d_tasks.data()), n_tasks,
                         d_encoded.data(), nullptr);
  ASSERT_TRUE(status.ok) << status.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> encoded(n_tasks, 0xab), got(page_bytes);
  d_encoded.download(encoded.data(), n_tasks);
  d_dst.download(got.data(), page_bytes);
  EXPECT_EQ(encoded, (std::vector<uint8_t>{kLossyEncoded, kLossyRefused, kLossyRefused,
                                           kLossyRefused, kLossyRefused}));
  EXPECT_EQ(got, ref);
}

TEST(LossyEncodeCuda, CheckRefusesOtherSchemesBadSpecsAndArrays) {
  // Non-null stand-ins: check_lossy_encode never reads the arrays.
  LossyEncodeTask task;
  uint8_t flag = 0;
  const Shape base{LossyScheme::kDither8, true, 16, 64, RopePairing::kInterleaved, 0};
  auto with = [&](auto edit) {
    LossyPageSpec spec = spec_of(base);
    edit(spec);
    return spec;
  };
  struct Refusal {
    LossyPageSpec spec;
    int n_tasks;
    const LossyEncodeTask* tasks;
    uint8_t* encoded;
    StatusCode code;
    const char* says;
  };
  const Refusal refusals[] = {
      {with([](LossyPageSpec& s) { s.scheme = LossyScheme::kRtn8; }), 1, &task, &flag,
       StatusCode::kUnsupported, "rtn8"},
      {with([](LossyPageSpec& s) { s.scheme = LossyScheme::kRtn4; }), 1, &task, &flag,
       StatusCode::kUnsupported, "rtn4"},
      {with([](LossyPageSpec& s) { s.scheme = LossyScheme::kFp8E4M3Scaled; }), 1, &task, &flag,
       StatusCode::kUnsupported, "fp8-e4m3-scaled"},
      {with([](LossyPageSpec& s) { s.scheme = LossyScheme::kKivi2; }), 1, &task, &flag,
       StatusCode::kUnsupported, "kivi2"},
      {with([](LossyPageSpec& s) { s.scheme = static_cast<LossyScheme>(9); }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "scheme 9 is unknown"},
      {with([](LossyPageSpec& s) { s.pairing = static_cast<RopePairing>(5); }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "pairing 5"},
      {with([](LossyPageSpec& s) { s.head_dim = 48; }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "head_dim"},
      {with([](LossyPageSpec& s) { s.head_dim = 512; }), 1, &task, &flag, StatusCode::kUnsupported,
       "head_dim 512"},
      {with([](LossyPageSpec& s) { s.block_tokens = 0; }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "block_tokens"},
      {with([](LossyPageSpec& s) { s.block_tokens = 4097; }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "block_tokens"},
      {with([](LossyPageSpec& s) {
         s.key = false;
         s.n_outlier_pairs = 2;
       }),
       1, &task, &flag, StatusCode::kInvalidArgument, "V page"},
      {with([](LossyPageSpec& s) {
         s.scheme = LossyScheme::kFp8E5M2;
         s.n_outlier_pairs = 2;
       }),
       1, &task, &flag, StatusCode::kInvalidArgument, "only dither8"},
      {with([](LossyPageSpec& s) { s.n_outlier_pairs = 33; }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "n_outlier_pairs 33"},
      {with([](LossyPageSpec& s) { s.n_outlier_pairs = -1; }), 1, &task, &flag,
       StatusCode::kInvalidArgument, "negative"},
      {spec_of(base), -1, &task, &flag, StatusCode::kInvalidArgument, "n_tasks"},
      {spec_of(base), 3, nullptr, &flag, StatusCode::kInvalidArgument, "tasks is null"},
      {spec_of(base), 3, &task, nullptr, StatusCode::kInvalidArgument, "encoded is null"},
  };
  for (const Refusal& r : refusals) {
    const CudaStatus status = check_lossy_encode(r.spec, r.n_tasks, r.tasks, r.encoded);
    EXPECT_FALSE(status.ok) << r.says;
    EXPECT_EQ(status.code, r.code) << r.says << ": " << status.message;
    EXPECT_NE(status.message.find(r.says), std::string::npos) << status.message;
    // The encoder refuses the same way, before any launch (the arrays are host pointers here).
    const CudaStatus encoded = lossy_encode_pages(r.spec, r.tasks, r.n_tasks, r.encoded, nullptr);
    EXPECT_FALSE(encoded.ok) << r.says;
    EXPECT_EQ(encoded.message, status.message);
  }
  // The three schemes on K and V pages, with the outlier count at its limit: spec.outlier_pairs
  // is not read (each task carries its list).
  for (LossyScheme scheme : {LossyScheme::kFp8E4M3, LossyScheme::kFp8E5M2, LossyScheme::kDither8}) {
    for (bool key : {true, false}) {
      const int m = scheme == LossyScheme::kDither8 && key ? 64 : 0;
      for (WitnessCode witness : {WitnessCode::kFp16, WitnessCode::kPageScaled8}) {
        const Shape s{scheme, key, 16, 128, RopePairing::kHalfSplit, m, witness};
        const CudaStatus status = check_lossy_encode(spec_of(s), 1, &task, &flag);
        EXPECT_TRUE(status.ok) << shape_name(s) << ": " << status.message;
      }
    }
  }
  // Fragment-major device pages: dither8's and fp8-e4m3's with the exponent witness (K; V pages
  // keep rho), of 16 tokens only, and a known layout.
  struct LayoutRefusal {
    Shape shape;
    LossyDeviceLayout layout;
    StatusCode code;
    const char* says;
  };
  const LayoutRefusal layout_refusals[] = {
      {Shape{LossyScheme::kFp8E4M3, true, 16, 64, RopePairing::kInterleaved, 0}, LossyDeviceLayout::kFragments,
       StatusCode::kUnsupported, "fragment-major device pages of scheme fp8-e4m3 with witness fp16 are not made"},
      {Shape{LossyScheme::kFp8E5M2, false, 16, 64, RopePairing::kInterleaved, 0}, LossyDeviceLayout::kFragments,
       StatusCode::kUnsupported, "fragment-major device pages of scheme fp8-e5m2 are not made"},
      {Shape{LossyScheme::kFp8E4M3, true, 32, 64, RopePairing::kInterleaved, 0, WitnessCode::kExponent},
       LossyDeviceLayout::kFragments, StatusCode::kUnsupported, "fragment-major pages hold 16 tokens"},
      {Shape{LossyScheme::kDither8, true, 17, 64, RopePairing::kInterleaved, 0}, LossyDeviceLayout::kFragments,
       StatusCode::kUnsupported, "fragment-major pages hold 16 tokens"},
      {Shape{LossyScheme::kDither8, false, 16, 32, RopePairing::kInterleaved, 0}, static_cast<LossyDeviceLayout>(7),
       StatusCode::kInvalidArgument, "layout 7 is unknown"},
  };
  for (const LayoutRefusal& r : layout_refusals) {
    const CudaStatus status = check_lossy_encode(spec_of(r.shape), 1, &task, &flag, r.layout);
    EXPECT_EQ(status.code, r.code) << r.says << ": " << status.message;
    EXPECT_NE(status.message.find(r.says), std::string::npos) << status.message;
    EXPECT_EQ(lossy_encode_pages(spec_of(r.shape), &task, 1, &flag, nullptr, r.layout).message, status.message);
  }
  for (bool key : {true, false})
    for (int head_dim : {64, 128}) {
      const Shape shapes[] = {{LossyScheme::kDither8, key, 16, head_dim, RopePairing::kHalfSplit, key ? 8 : 0},
                              {LossyScheme::kFp8E4M3, key, 16, head_dim, RopePairing::kHalfSplit, 0,
                               key ? WitnessCode::kExponent : WitnessCode::kFp16}};
      for (const Shape& s : shapes) {
        const CudaStatus status = check_lossy_encode(spec_of(s), 1, &task, &flag, LossyDeviceLayout::kFragments);
        EXPECT_TRUE(status.ok) << shape_name(s) << ": " << status.message;
      }
    }
  // No tasks: nothing to check in the arrays, nothing launched.
  EXPECT_TRUE(check_lossy_encode(spec_of(base), 0, nullptr, nullptr).ok);
  EXPECT_TRUE(lossy_encode_pages(spec_of(base), nullptr, 0, nullptr, nullptr).ok);
}

}  // namespace
}  // namespace certkv::codec::cuda
