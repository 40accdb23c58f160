#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "codec/gaac.h"
#include "core/status.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace certkv::codec {
namespace {

using format::GaacElement;

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("certkv_gaac_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

StatusCode code_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

bool same_calibration(const GaacCalibration& a, const GaacCalibration& b) {
  if (!(a.shape() == b.shape())) return false;
  for (int l = 0; l < a.shape().n_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      if (a.escape_capacity_bytes(l, kv) != b.escape_capacity_bytes(l, kv)) return false;
      for (int h = 0; h < a.shape().n_kv_heads; ++h) {
        if (a.bases(l, kv, h).b3 != b.bases(l, kv, h).b3 ||
            a.bases(l, kv, h).b4 != b.bases(l, kv, h).b4) {
          return false;
        }
      }
    }
  }
  return true;
}

// Rows like KV: channel c has magnitude 2^(c % 9 - 4), occasional outliers.
std::vector<uint16_t> kv_like_rows(int n_tokens, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> rows(size_t(n_tokens) * size_t(head_dim));
  for (size_t i = 0; i < rows.size(); ++i) {
    const int c = int(i % size_t(head_dim));
    float v = normal(rng) * std::exp2(float(c % 9 - 4));
    if (rng() % 200 == 0) v *= 4096.0f;
    rows[i] = format::float_to_bf16(v);
  }
  return rows;
}

// A window is not pinned at the calibration's largest exponent when its floor holds little: 16
// exponents 100..115, one sample at 100 and eight at 115. Covering all of them ([100, 116), weight
// 4 + ... ) loses the weight 8 at 116 for the 4 at 100, so the window has one exponent of
// headroom, [101, 117): a value twice the largest seen stays in the window, the rare floor is an
// escape.
TEST(GaacCalibrator, WindowsKeepHeadroomAboveTheLargestExponentOverAThinFloor) {
  const GaacShape shape{1, 1, 8, 1, GaacElement::kBf16};
  GaacCalibrator calibrator(shape);
  std::vector<uint16_t> rows(32 * 8, uint16_t(127 << 7));
  int t = 0;
  for (int e = 100; e <= 115; ++e) rows[size_t(t++) * 8] = uint16_t(e << 7 | 0x11);  // one each
  while (t < 23) rows[size_t(t++) * 8] = uint16_t(115 << 7 | 0x22);                // 8 at 115 in all
  for (; t < 32; ++t) rows[size_t(t) * 8] = uint16_t(108 << 7);                     // the middle
  calibrator.add_bf16(0, kGaacKey, 0, rows.data(), 32);
  const GaacCalibration cal = calibrator.finish();
  EXPECT_EQ(cal.bases(0, kGaacKey, 0).b4[0], 101);
}

TEST(GaacCalibrator, WindowsCoverTheMostWeightLowestBaseOnTies) {
  const GaacShape shape{1, 1, 8, 1, GaacElement::kBf16};
  GaacCalibrator calibrator(shape);
  // A sample weighs 4 at its exponent and 1 at the exponent above. Channel 0: 5 x exponent 100,
  // 5 x 107, 6 x 108: weights 20 at 100, 5 at 101, 20 at 107, 29 at 108, 6 at 109. The 8-wide
  // windows holding 107..109 (bases 102..107) weigh 55, more than [101, 109) with 54 and [100,
  // 108) with 45: b3 = 102. The 16-wide windows holding 100..109 (bases 94..100) weigh all 80:
  // b4 = 94. Other channels: exponent 127 only (weights at 127 and 128).
  std::vector<uint16_t> rows(16 * 8, uint16_t(127 << 7));
  const int exponents[16] = {100, 100, 100, 100, 100, 107, 107, 107,
                             107, 107, 108, 108, 108, 108, 108, 108};
  for (int t = 0; t < 16; ++t) rows[size_t(t) * 8] = uint16_t(exponents[t] << 7 | 0x33);
  calibrator.add_bf16(0, kGaacKey, 0, rows.data(), 16);
  const GaacCalibration cal = calibrator.finish();
  EXPECT_EQ(cal.bases(0, kGaacKey, 0).b3[0], 102);
  EXPECT_EQ(cal.bases(0, kGaacKey, 0).b4[0], 94);
  EXPECT_EQ(cal.bases(0, kGaacKey, 0).b3[1], 121);  // lowest base covering 127 and 128
  EXPECT_EQ(cal.bases(0, kGaacKey, 0).b4[1], 113);
  // Nothing seen for V: bases 0, capacity 0.
  EXPECT_EQ(cal.bases(0, kGaacValue, 0).b3[0], 0);
  EXPECT_EQ(cal.escape_capacity_bytes(0, kGaacValue), 0u);
}

TEST(GaacCalibrator, CapacityMinimisesStoredBytes) {
  const int head_dim = 64, block_tokens = 16;
  const GaacShape shape{2, 2, head_dim, block_tokens, GaacElement::kBf16};
  GaacCalibrator calibrator(shape);
  std::vector<std::vector<uint16_t>> streams;
  for (int l = 0; l < 2; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < 2; ++h) {
        streams.push_back(kv_like_rows(16 * 40 + 5, head_dim, uint32_t(l * 10 + kv * 3 + h)));
        calibrator.add_bf16(l, kv, h, streams.back().data(), 16 * 40 + 5);
      }
    }
  }
  const GaacCalibration cal = calibrator.finish();
  const size_t fixed = format::gaac_page_fixed_bytes(GaacElement::kBf16, block_tokens, head_dim);
  size_t s = 0;
  for (int l = 0; l < 2; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<size_t> needs;
      for (int h = 0; h < 2; ++h, ++s) {
        for (int p = 0; p < 40; ++p) {
          needs.push_back(gaac_escape_bytes_needed(streams[s].data() + size_t(p) * 16 * head_dim,
                                                   block_tokens, head_dim, cal.bases(l, kv, h)));
        }
      }
      auto bytes_at = [&](size_t cap) {
        size_t total = 0;
        for (size_t n : needs) total += n <= cap ? fixed + cap : 2048;
        return total;
      };
      size_t best = 0;
      for (size_t cap = 0; cap <= 640; ++cap) {
        if (bytes_at(cap) < bytes_at(best)) best = cap;
      }
      EXPECT_EQ(cal.escape_capacity_bytes(l, kv), best) << l << " " << kv;
      EXPECT_GT(best, 0u);  // the data has outliers: some escapes are worth a slot
      EXPECT_LT(bytes_at(best), needs.size() * 2048 * 10 / 13);
    }
  }
}

TEST(GaacCalibrator, RejectsWrongElementAndIndices) {
  GaacCalibrator calibrator(GaacShape{2, 3, 64, 16, GaacElement::kBf16});
  std::vector<uint16_t> rows(64 * 16);
  std::vector<uint8_t> fp8(64 * 16);
  EXPECT_EQ(code_of([&] { calibrator.add_bf16(2, 0, 0, rows.data(), 16); }),
            StatusCode::kOutOfRange);
  EXPECT_EQ(code_of([&] { calibrator.add_bf16(0, 2, 0, rows.data(), 16); }),
            StatusCode::kOutOfRange);
  EXPECT_EQ(code_of([&] { calibrator.add_bf16(0, 0, 3, rows.data(), 16); }),
            StatusCode::kOutOfRange);
  EXPECT_EQ(code_of([&] { calibrator.add_fp8(0, 0, 0, fp8.data(), 16); }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { GaacCalibrator bad(GaacShape{1, 1, 12, 16, GaacElement::kBf16}); }),
            StatusCode::kInvalidArgument);
}

GaacCalibration sample_calibration() {
  const GaacShape shape{3, 2, 64, 16, GaacElement::kBf16};
  GaacCalibrator calibrator(shape);
  for (int l = 0; l < 3; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < 2; ++h) {
        const auto rows = kv_like_rows(160, 64, uint32_t(100 + l * 7 + kv * 3 + h));
        calibrator.add_bf16(l, kv, h, rows.data(), 160);
      }
    }
  }
  return calibrator.finish();
}

TEST(GaacCalibrationFile, SaveLoadRoundTrip) {
  const GaacCalibration cal = sample_calibration();
  const std::string path = temp_path("roundtrip.safetensors");
  cal.save(path);
  const GaacCalibration back = GaacCalibration::load(path, cal.shape());
  EXPECT_TRUE(same_calibration(cal, back));
  EXPECT_NE(cal.bases(1, kGaacValue, 1).b3[5], 0);  // a real calibration, not all zeros
  const auto file = format::SafetensorsFile::open(path);
  EXPECT_EQ(file->metadata().at("format"), "certkv-gaac-calibration/1");
  EXPECT_EQ(file->find("layer2.v.b4")->shape, (std::vector<int64_t>{2, 64}));
  // The window rule travels with the file; a calibration made by hand names none.
  EXPECT_EQ(cal.windows(), GaacCalibration::kWindows);
  EXPECT_EQ(back.windows(), GaacCalibration::kWindows);
  EXPECT_EQ(file->metadata().at("windows"), GaacCalibration::kWindows);
  GaacCalibration by_hand(cal.shape());
  by_hand.save(path);
  EXPECT_EQ(format::SafetensorsFile::open(path)->metadata().count("windows"), 0u);
  EXPECT_EQ(GaacCalibration::load(path, cal.shape()).windows(), "");
  std::remove(path.c_str());
}

TEST(GaacCalibrationFile, ShapeMismatchNamesFileAndField) {
  const GaacCalibration cal = sample_calibration();
  const std::string path = temp_path("shape.safetensors");
  cal.save(path);
  for (auto mutate : std::vector<std::function<void(GaacShape&)>>{
           [](GaacShape& s) { s.n_layers = 30; }, [](GaacShape& s) { s.n_kv_heads = 3; },
           [](GaacShape& s) { s.head_dim = 128; }, [](GaacShape& s) { s.block_tokens = 32; },
           [](GaacShape& s) { s.element = GaacElement::kFp8E5M2; }}) {
    GaacShape other = cal.shape();
    mutate(other);
    std::string message;
    EXPECT_EQ(code_of([&] { GaacCalibration::load(path, other); }, &message),
              StatusCode::kInvalidArgument);
    EXPECT_NE(message.find(path), std::string::npos) << message;
  }
  std::remove(path.c_str());
}

TEST(GaacCalibrationFile, WrongVersionMissingAndTruncated) {
  const GaacCalibration cal = sample_calibration();
  const std::string path = temp_path("version.safetensors");
  const uint8_t zeros[16] = {};
  format::write_safetensors(path, {{"layer0.k.b3", "U8", {2, 8}, zeros, 16}},
                            {{"format", "certkv-gaac-calibration/2"}});
  std::string message;
  EXPECT_EQ(code_of([&] { GaacCalibration::load(path, cal.shape()); }, &message),
            StatusCode::kCorrupt);
  EXPECT_NE(message.find("certkv-gaac-calibration/2"), std::string::npos) << message;
  EXPECT_EQ(code_of([&] { GaacCalibration::load(path + ".absent", cal.shape()); }),
            StatusCode::kNotFound);

  cal.save(path);
  const std::vector<uint8_t> bytes = read_bytes(path);
  for (size_t n = 0; n < bytes.size(); n += (n < 64 ? 1 : 97)) {
    write_bytes(path, std::vector<uint8_t>(bytes.begin(), bytes.begin() + ptrdiff_t(n)));
    EXPECT_NE(code_of([&] { GaacCalibration::load(path, cal.shape()); }), StatusCode::kOk)
        << "truncated to " << n;
  }
  std::remove(path.c_str());
}

TEST(GaacCalibrationFile, EveryByteFlipFailsOrLoadsTheSameCalibration) {
  const GaacCalibration cal = sample_calibration();
  const std::string path = temp_path("flip.safetensors");
  cal.save(path);
  const std::vector<uint8_t> bytes = read_bytes(path);
  size_t n_rejected = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> bad(bytes);
    bad[i] ^= 0x04;
    write_bytes(path, bad);
    try {
      const GaacCalibration back = GaacCalibration::load(path, cal.shape());
      EXPECT_TRUE(same_calibration(cal, back)) << "byte " << i;
    } catch (const Error&) {
      ++n_rejected;
    }
  }
  // Every data byte is covered by the checksum.
  EXPECT_GT(n_rejected, bytes.size() / 2);
  std::remove(path.c_str());
}

// Real KV of SmolLM2-135M (src/codec/testdata/README.md): BF16 rows of layers 0, 15 and 29 from
// two books, and a calibration made from 2048 tokens of the first book.
class GaacRealKv : public ::testing::Test {
 protected:
  static constexpr int kHeads = 3, kHeadDim = 64, kBlockTokens = 16;
  static constexpr int kLayers[3] = {0, 15, 29};
  void SetUp() override {
    file_ = format::SafetensorsFile::open(std::string(CERTKV_SOURCE_DIR) +
                                          "/src/codec/testdata/smollm2_kv_pages.safetensors");
  }
  // [n_tokens][head_dim] rows of one head of "calib" or "eval".
  std::vector<uint16_t> rows(const std::string& book, int layer, int kv, int head) const {
    const std::string name = book + ".layer" + std::to_string(layer) + (kv ? ".v" : ".k");
    const format::SafetensorsTensor* t = file_->find(name);
    if (t == nullptr) ADD_FAILURE() << "fixture lacks " << name;
    std::vector<uint16_t> out(size_t(t->shape[1]) * kHeadDim);
    memcpy(out.data(), t->data + size_t(head) * out.size() * 2, out.size() * 2);
    return out;
  }
  // Encodes every eval page with the plain and the best SIMD path, checks the bytes agree and
  // decode bit-exactly; returns stored bytes (slot when it fits, raw when not) and mode counts.
  size_t encode_eval_pages(const std::function<const GaacBases&(int, int, int)>& bases_of,
                           const std::function<size_t(int, int)>& capacity_of,
                           size_t* raw_bytes, size_t groups[3]) const {
    size_t stored = 0;
    for (int l = 0; l < 3; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        const size_t cap = capacity_of(l, kv);
        for (int h = 0; h < kHeads; ++h) {
          const std::vector<uint16_t> r = rows("eval", kLayers[l], kv, h);
          EXPECT_GT(std::count_if(r.begin(), r.end(), [](uint16_t v) { return v != 0; }),
                    ptrdiff_t(r.size() / 2));
          const GaacBases& bases = bases_of(l, kv, h);
          for (size_t p = 0; p + kBlockTokens * kHeadDim <= r.size(); p += kBlockTokens * kHeadDim) {
            const uint16_t* page = r.data() + p;
            const size_t slot_bytes =
                format::gaac_slot_bytes(GaacElement::kBf16, kBlockTokens, kHeadDim, cap);
            std::vector<uint8_t> ref(slot_bytes), simd(slot_bytes);
            const size_t used =
                gaac_encode_page_ref(page, kBlockTokens, kHeadDim, bases, cap, ref.data());
            EXPECT_EQ(gaac_encode_page(page, kBlockTokens, kHeadDim, bases, cap, simd.data()),
                      used);
            *raw_bytes += 2048;
            if (used == kGaacDoesNotFit) {
              stored += 2048;
              continue;
            }
            stored += slot_bytes;
            EXPECT_TRUE(std::equal(ref.begin(), ref.begin() + ptrdiff_t(used), simd.begin()));
            std::vector<uint16_t> out(size_t(kBlockTokens) * kHeadDim);
            gaac_decode_page(ref.data(), slot_bytes, kBlockTokens, kHeadDim, bases, out.data());
            EXPECT_TRUE(std::equal(out.begin(), out.end(), page)) << l << kv << h << p;
            const GaacModeCounts m = gaac_count_modes(GaacElement::kBf16, ref.data(), slot_bytes,
                                                      kBlockTokens, kHeadDim);
            for (int i = 0; i < 3; ++i) groups[i] += m.groups[i];
          }
        }
      }
    }
    return stored;
  }
  std::unique_ptr<format::SafetensorsFile> file_;
};

TEST_F(GaacRealKv, CalibratedOnOneBookEncodesAnother) {
  const GaacCalibration cal = GaacCalibration::load(
      std::string(CERTKV_SOURCE_DIR) + "/src/codec/testdata/smollm2_gaac_calibration.safetensors",
      GaacShape{30, kHeads, kHeadDim, kBlockTokens, GaacElement::kBf16});
  size_t raw_bytes = 0, groups[3] = {0, 0, 0};
  const size_t stored = encode_eval_pages(
      [&](int l, int kv, int h) -> const GaacBases& { return cal.bases(kLayers[l], kv, h); },
      [&](int l, int kv) { return cal.escape_capacity_bytes(kLayers[l], kv); }, &raw_bytes,
      groups);
  const double ratio = double(raw_bytes) / double(stored);
  const double n_groups = double(groups[0] + groups[1] + groups[2]);
  RecordProperty("ratio", std::to_string(ratio));
  EXPECT_GT(ratio, 1.33);
  EXPECT_LE(ratio, 16.0 / 11.25);
  EXPECT_GT(groups[0] / n_groups, 0.8);
  EXPECT_LT(groups[2] / n_groups, 0.01);
}

TEST_F(GaacRealKv, CalibratorOnRealRowsAndUnrelatedBasesStayLossless) {
  const GaacShape shape{3, kHeads, kHeadDim, kBlockTokens, GaacElement::kBf16};
  GaacCalibrator calibrator(shape);
  for (int l = 0; l < 3; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kHeads; ++h) {
        const std::vector<uint16_t> r = rows("calib", kLayers[l], kv, h);
        calibrator.add_bf16(l, kv, h, r.data(), int(r.size() / kHeadDim));
      }
    }
  }
  const GaacCalibration cal = calibrator.finish();
  const GaacCalibration unrelated(shape);  // bases 0: every group raw, the largest capacity
  size_t raw_a = 0, raw_b = 0, groups_a[3] = {0, 0, 0}, groups_b[3] = {0, 0, 0};
  const size_t stored_calibrated = encode_eval_pages(
      [&](int l, int kv, int h) -> const GaacBases& { return cal.bases(l, kv, h); },
      [&](int l, int kv) { return cal.escape_capacity_bytes(l, kv); }, &raw_a, groups_a);
  const size_t stored_unrelated = encode_eval_pages(
      [&](int l, int kv, int h) -> const GaacBases& { return unrelated.bases(l, kv, h); },
      [&](int l, int kv) { return unrelated.escape_capacity_bytes(l, kv); }, &raw_b, groups_b);
  EXPECT_EQ(groups_b[0] + groups_b[1], 0u);
  EXPECT_GT(groups_b[2], 0u);
  EXPECT_LT(stored_calibrated, stored_unrelated);
  EXPECT_LT(stored_calibrated, raw_a);
}

}  // namespace
}  // namespace certkv::codec
