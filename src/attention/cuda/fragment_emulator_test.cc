// The host emulation of the fragment kernel's page decoders (fragment_emulator.h) against the
// codecs' `_ref` decoders, bit for bit: every element of every page class, K and V, on real
// SmolLM2 KV (src/codec/testdata) and on adversarial bytes (every E4M3 code, NaN codes among them,
// random dither8 codes, scales and outliers), head_dim 64 and 128, with outlier pairs in both RoPE
// pairings; and rows past a page's length poisoned without reaching a live element. No device.
#include "attention/cuda/fragment_emulator.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "codec/gaac_fragments.h"
#include "codec/lossy_page.h"
#include "format/safetensors.h"

namespace certkv::attention::cuda::emulate {
namespace {

constexpr int kT = fragment::kPageTokens;

// Equal as floats, bit for bit (NaN equal to NaN of the same bits too).
bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y || (std::isnan(a) && std::isnan(b));
}

// The emulated operands of the device page against the reference decode of the codec's page:
// rows below n must agree bit for bit.
template <int D>
void expect_page(PageClass cls, const codec::LossyPageSpec& spec, uint32_t block, const uint8_t* device_page,
                 const float* reference, int n, const std::string& what) {
  std::vector<double> values(size_t(kT) * D, 0.0);
  ASSERT_NO_THROW(operand_values<D>(cls, spec.key, device_page, spec, block, values.data())) << what;
  int mismatches = 0;
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < D; ++c) {
      const float got = float(values[size_t(t) * D + c]), want = reference[t * D + c];
      if (!same_bits(got, want) && mismatches++ < 5)
        ADD_FAILURE() << what << ": token " << t << " channel " << c << " emulated " << got << " reference " << want;
    }
  EXPECT_EQ(mismatches, 0) << what;
}

// One block of bf16 rows through every page class, K or V.
template <int D>
void check_rows(const std::vector<uint16_t>& rows, bool key, uint32_t block, uint64_t dither_key,
                codec::RopePairing pairing, const std::vector<uint16_t>& outlier_pairs, int n, const std::string& what) {
  // bf16: the rows themselves, fragment-major.
  {
    std::vector<uint16_t> page(size_t(kT) * D);
    fragment::fragment_page_from_rows<D, uint16_t>(rows.data(), key, page.data());
    std::vector<float> ref(size_t(kT) * D);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = format::bf16_to_float(rows[i]);
    codec::LossyPageSpec spec;
    spec.key = key;
    spec.head_dim = D;
    expect_page<D>(PageClass::kBf16, spec, block, reinterpret_cast<const uint8_t*>(page.data()), ref.data(), kT,
                   what + " bf16");
  }
  // fp8 E4M3 (the raw cast; a saturating cast is still a page of codes).
  {
    codec::LossyPageSpec spec;
    spec.scheme = codec::LossyScheme::kFp8E4M3;
    spec.key = key;
    spec.head_dim = D;
    spec.pairing = pairing;
    std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec)), device(size_t(kT) * D + 2 * kT);
    ASSERT_TRUE(codec::lossy_encode_page_ref(spec, block, rows.data(), cpu.data())) << what;
    std::vector<float> ref(size_t(kT) * D);
    codec::lossy_decode_page_ref(spec, block, cpu.data(), ref.data());
    fragment::fp8_fragment_page<D>(spec, cpu.data(), n, device.data());
    expect_page<D>(PageClass::kFp8, spec, block, device.data(), ref.data(), n, what + " fp8");
  }
  // dither8.
  {
    codec::LossyPageSpec spec;
    spec.scheme = codec::LossyScheme::kDither8;
    spec.key = key;
    spec.head_dim = D;
    spec.pairing = pairing;
    spec.dither_key = dither_key;
    if (key) {
      spec.n_outlier_pairs = int(outlier_pairs.size());
      spec.outlier_pairs = outlier_pairs.data();
    }
    std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec)), device(cpu.size());
    ASSERT_TRUE(codec::lossy_encode_page_ref(spec, block, rows.data(), cpu.data())) << what;
    std::vector<float> ref(size_t(kT) * D);
    codec::lossy_decode_page_ref(spec, block, cpu.data(), ref.data());
    fragment::dither8_fragment_page<D>(spec, cpu.data(), n, device.data());
    expect_page<D>(PageClass::kDither8, spec, block, device.data(), ref.data(), n, what + " dither8");
  }
}

TEST(FragmentEmulator, EveryPageClassIsTheReferenceOnRealKv) {
  const auto file = format::SafetensorsFile::open(std::string(CERTKV_SOURCE_DIR) +
                                                  "/src/codec/testdata/smollm2_kv_pages.safetensors");
  constexpr int kHeads = 3, kTokens = 32, kD = 64;
  const std::vector<uint16_t> pairs = {3, 7, 20, 31};  // outlier pairs (a RoPE pair index each)
  for (int layer : {0, 15, 29})
    for (bool key : {true, false}) {
      const format::SafetensorsTensor* eval = file->find("eval.layer" + std::to_string(layer) + (key ? ".k" : ".v"));
      ASSERT_NE(eval, nullptr);
      for (int h = 0; h < kHeads; ++h)
        for (int first = 0; first < kTokens; first += kT) {
          std::vector<uint16_t> rows(size_t(kT) * kD);
          std::memcpy(rows.data(), eval->data + (size_t(h) * kTokens + first) * kD * 2, rows.size() * 2);
          const std::string what = "layer " + std::to_string(layer) + (key ? " K" : " V") + " head " +
                                   std::to_string(h) + " tokens " + std::to_string(first);
          const uint32_t block = uint32_t(first / kT + 93);
          check_rows<kD>(rows, key, block, codec::dither8_key(layer, key, h),
                         h % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved, pairs,
                         first == 0 ? kT : 11, what);
        }
    }
}

// Adversarial values: normals over the whole bf16 range that E4M3 and dither8 take (tiny,
// subnormal in E4M3, zero, negative zero, large), at head_dim 64 and 128.
template <int D>
void check_adversarial_rows(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-14, 8), pick(0, 9);
  for (int rep = 0; rep < 6; ++rep) {
    std::vector<uint16_t> rows(size_t(kT) * D);
    for (auto& x : rows) {
      const int k = pick(rng);
      const float v = k == 0 ? 0.f : k == 1 ? -0.f : k == 2 ? 464.f * unit(rng) : std::ldexp(unit(rng), exponent(rng));
      x = format::float_to_bf16(v);
    }
    const std::vector<uint16_t> pairs = {0, 5, uint16_t(D / 2 - 1)};
    for (bool key : {true, false})
      check_rows<D>(rows, key, uint32_t(rng() % 100000), uint64_t(rng()) << 32 | rng(),
                    rep % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved, pairs,
                    1 + int(rng() % kT), "D " + std::to_string(D) + " rep " + std::to_string(rep));
  }
}

TEST(FragmentEmulator, EveryPageClassIsTheReferenceOnAdversarialValues) {
  check_adversarial_rows<64>(5);
  check_adversarial_rows<128>(6);
}

// Every E4M3 code, NaN codes too, at every position of a page; and dither8 pages of random codes,
// scales and outlier values written straight into the codec's layout.
TEST(FragmentEmulator, EveryE4M3CodeAndRandomDither8BytesAreTheReference) {
  constexpr int D = 128;
  for (bool key : {true, false}) {
    codec::LossyPageSpec spec;
    spec.scheme = codec::LossyScheme::kFp8E4M3;
    spec.key = key;
    spec.head_dim = D;
    for (int shift = 0; shift < 256; shift += 37) {
      std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec), 0), device(size_t(kT) * D + 2 * kT);
      for (int i = 0; i < kT * D; ++i) cpu[size_t(i)] = uint8_t(i + shift);
      std::vector<float> ref(size_t(kT) * D);
      codec::lossy_decode_page_ref(spec, 0, cpu.data(), ref.data());
      fragment::fp8_fragment_page<D>(spec, cpu.data(), kT, device.data());
      expect_page<D>(PageClass::kFp8, spec, 0, device.data(), ref.data(), kT, "every code, shift " + std::to_string(shift));
    }
  }
  std::mt19937 rng(17);
  const std::vector<uint16_t> pairs = {1, 9, 40, 63};
  for (int rep = 0; rep < 8; ++rep)
    for (bool key : {true, false}) {
      codec::LossyPageSpec spec;
      spec.scheme = codec::LossyScheme::kDither8;
      spec.key = key;
      spec.head_dim = D;
      spec.pairing = rep % 2 ? codec::RopePairing::kHalfSplit : codec::RopePairing::kInterleaved;
      spec.dither_key = uint64_t(rng()) << 32 | rng();
      if (key) {
        spec.n_outlier_pairs = int(pairs.size());
        spec.outlier_pairs = pairs.data();
      }
      const int G = D / codec::kQuantGroup, m = spec.n_outlier_pairs;
      const size_t record = size_t(D) + 2 * G + 4 * m;
      std::vector<uint8_t> cpu(codec::lossy_page_bytes(spec)), device(cpu.size());
      ASSERT_EQ(cpu.size(), kT * record);
      for (auto& b : cpu) b = uint8_t(rng());
      for (int t = 0; t < kT; ++t) {
        uint8_t* rec = cpu.data() + t * record;
        for (int o = 0; o < m; ++o)  // the codec stores code 0 on outlier channels
          for (int which = 0; which < 2; ++which) rec[codec::rope_pair_channel(spec.pairing, D, pairs[size_t(o)], which)] = 0;
        for (int g = 0; g < G; ++g) {  // finite scales
          const uint16_t sbits = uint16_t(rng() % 0x7c00) | (rng() % 2 ? 0x8000u : 0u);
          std::memcpy(rec + D + 2 * g, &sbits, 2);
        }
        for (int i = 0; i < 2 * m; ++i) {  // finite outlier values
          const uint16_t xbits = format::float_to_bf16(std::ldexp(float(int(rng() % 2001) - 1000), -3));
          std::memcpy(rec + D + 2 * G + 2 * i, &xbits, 2);
        }
      }
      const uint32_t block = uint32_t(rng());
      std::vector<float> ref(size_t(kT) * D);
      codec::lossy_decode_page_ref(spec, block, cpu.data(), ref.data());
      fragment::dither8_fragment_page<D>(spec, cpu.data(), kT, device.data());
      expect_page<D>(PageClass::kDither8, spec, block, device.data(), ref.data(), kT,
                     std::string("random dither8 bytes") + (key ? " K" : " V"));
    }
}

// The emulation's own checks bite: a byte permutation that keeps the wrong byte, or an fp16
// operation that is not exact, are caught.
// GAAC pages: the emulated PRMT decode with its exceptions patched, scaled back by the channel's
// base, is the reference decode of the page bit for bit (on real KV with the calibration's
// windows; on random windows with zeros, subnormals, infinities and NaN payloads as exceptions up
// to the page's capacity; head_dim 64 and 128, K and V maps). A decoder that misplaced a sign,
// a code bit or an exception fails here, though encoder and reference decoder agree.
template <int D>
void expect_gaac_page(const std::vector<uint16_t>& rows, bool key, const std::vector<uint8_t>& bases,
                      const std::string& what) {
  std::vector<uint8_t> page(size_t(fragment::gaac_page_bytes(D)));
  if (!codec::gaac_fragment_encode_page_ref(rows.data(), key, D, bases.data(), page.data())) return;  // kept exact
  std::vector<uint16_t> ref(rows.size());
  ASSERT_TRUE(codec::gaac_fragment_decode_page_ref(page.data(), key, D, bases.data(), ref.data())) << what;
  std::vector<double> values(rows.size());
  gaac_operand_values<D>(key, page.data(), bases.data(), values.data());
  int mismatches = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    if (!same_bits(float(values[i]), format::bf16_to_float(ref[i])) && mismatches++ < 5)
      ADD_FAILURE() << what << ": token " << i / D << " channel " << i % D << " emulated " << values[i] << " reference "
                    << format::bf16_to_float(ref[i]);
  EXPECT_EQ(mismatches, 0) << what;
}

TEST(FragmentEmulator, GaacPagesAreTheReference) {
  const auto file = format::SafetensorsFile::open(std::string(CERTKV_SOURCE_DIR) +
                                                  "/src/codec/testdata/smollm2_kv_pages.safetensors");
  const codec::GaacCalibration cal = codec::GaacCalibration::load(
      std::string(CERTKV_SOURCE_DIR) + "/src/codec/testdata/smollm2_gaac_calibration.safetensors",
      codec::GaacShape{30, 3, 64, kT, codec::GaacElement::kBf16});
  int pages = 0;
  for (int layer : {0, 15, 29})
    for (bool key : {true, false}) {
      const format::SafetensorsTensor* eval = file->find("eval.layer" + std::to_string(layer) + (key ? ".k" : ".v"));
      ASSERT_NE(eval, nullptr);
      for (int h = 0; h < 3; ++h)
        for (int first = 0; first < 32; first += kT) {
          std::vector<uint16_t> rows(size_t(kT) * 64);
          std::memcpy(rows.data(), eval->data + (size_t(h) * 32 + first) * 64 * 2, rows.size() * 2);
          expect_gaac_page<64>(rows, key, cal.bases(layer, key ? codec::kGaacKey : codec::kGaacValue, h).b4,
                               "real layer " + std::to_string(layer) + " head " + std::to_string(h));
          ++pages;
        }
    }
  EXPECT_EQ(pages, 36);
  std::mt19937 rng(17);
  const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc1, 0xffa5, 0x0080, 0x8080};
  auto random_pages = [&](auto d) {
    constexpr int D = decltype(d)::value;
    for (int rep = 0; rep < 24; ++rep) {
      std::vector<uint8_t> bases(D);
      for (auto& b : bases) b = uint8_t(rep % 3 == 0 ? 240 - rng() % 3 : 90 + rng() % 40);
      std::vector<uint16_t> rows(size_t(kT) * D);
      for (size_t i = 0; i < rows.size(); ++i) {
        const uint32_t e = bases[i % D] + rng() % 16;
        rows[i] = uint16_t(((rng() & 1) << 15) | (std::min<uint32_t>(e, 254) << 7) | (rng() & 0x7f));
      }
      const int n = rep % (fragment::gaac_exception_capacity(D) + 1);
      for (int i = 0; i < n; ++i) rows[rng() % rows.size()] = specials[rng() % std::size(specials)];
      expect_gaac_page<D>(rows, rep % 2 == 0, bases, "random D " + std::to_string(D) + " rep " + std::to_string(rep));
    }
  };
  random_pages(std::integral_constant<int, 64>{});
  random_pages(std::integral_constant<int, 128>{});
}

// One exception at each element of a page in turn (a negative value one exponent below its
// window, so its built bits are neither zero nor the decoded ones): each step, register and half of
// every lane's operands is patched once, K and V maps, head_dim 64 and 128.
TEST(FragmentEmulator, AnExceptionAtEveryElementIsPatchedInPlace) {
  std::mt19937 rng(29);
  auto every_element = [&](auto d) {
    constexpr int D = decltype(d)::value;
    std::vector<uint8_t> bases(D);
    for (auto& b : bases) b = uint8_t(100 + rng() % 30);
    std::vector<uint16_t> rows(size_t(kT) * D);
    for (size_t i = 0; i < rows.size(); ++i)
      rows[i] = uint16_t(((rng() & 1) << 15) | ((bases[i % D] + rng() % 16) << 7) | (rng() & 0x7f));
    std::vector<uint8_t> page(size_t(fragment::gaac_page_bytes(D)));
    const size_t count_at = size_t(fragment::gaac_low_bytes(D) + fragment::gaac_word_bytes(D));
    for (bool key : {true, false})
      for (size_t i = 0; i < rows.size(); ++i) {
        std::vector<uint16_t> one = rows;
        one[i] = uint16_t(0x8000u | unsigned(bases[i % D] - 1) << 7 | 0x55u);
        ASSERT_TRUE(codec::gaac_fragment_encode_page_ref(one.data(), key, D, bases.data(), page.data()));
        uint32_t count = 0;
        std::memcpy(&count, page.data() + count_at, 4);
        ASSERT_EQ(count, 1u) << "D " << D << " element " << i;
        expect_gaac_page<D>(one, key, bases, "D " + std::to_string(D) + (key ? " K" : " V") + " token " +
                                                 std::to_string(i / D) + " channel " + std::to_string(i % D));
        if (HasFailure()) return;
      }
  };
  every_element(std::integral_constant<int, 64>{});
  every_element(std::integral_constant<int, 128>{});
}

TEST(FragmentEmulator, ItsPremisesAreChecked) {
  EXPECT_EQ(byte_perm(0x44332211u, 0x88776655u, 0x7654u), 0x88776655u);
  EXPECT_EQ(byte_perm(0x44332211u, 0x88776655u, 0x3210u), 0x44332211u);
  EXPECT_EQ(bytes_to_1024_plus(0x00000080u, 0), 0x64006480u);  // {1024 + 0x80, 1024 + 0}
  EXPECT_THROW(exact_half(1.0 + 1.0 / 4096.0), std::logic_error);
  EXPECT_EQ(exact_half(1152.0), 1152.0);
}

}  // namespace
}  // namespace certkv::attention::cuda::emulate
