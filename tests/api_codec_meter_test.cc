// The C API's page codec (certkv_gaac_*) and row meter (certkv_meter_tier_*): bit-exact round
// trips on adversarial bit patterns, known answers of the meter, refusals that name the value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "certkv/certkv.h"

namespace {

// Rows of one stream: mostly values near 1 (what calibration learns), with NaN payloads,
// infinities, subnormals, zeros of both signs and huge exponents mixed in.
std::vector<uint16_t> adversarial_bf16_rows(int n_tokens, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  const uint16_t specials[] = {0x7fc1, 0xffff, 0x7f80, 0xff80, 0x0001, 0x807f, 0x0000, 0x8000, 0x7f7f, 0x0080};
  std::vector<uint16_t> rows(size_t(n_tokens) * size_t(head_dim));
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint32_t r = rng();
    rows[i] = r % 7 == 0 ? specials[(r >> 8) % 10] : uint16_t(0x3f00 + (r >> 16) % 0x200) ^ uint16_t((r & 1) << 15);
  }
  return rows;
}

struct Codec {
  std::vector<uint8_t> b3, b4;
  certkv_gaac_page_codec c{};
};

Codec calibrate(const char* element, int block_tokens, int head_dim, const void* rows, int64_t n) {
  Codec k;
  k.b3.resize(size_t(head_dim));
  k.b4.resize(size_t(head_dim));
  uint64_t capacity = 0;
  EXPECT_EQ(certkv_gaac_calibrate(element, block_tokens, head_dim, rows, n, k.b3.data(), k.b4.data(), &capacity),
            CERTKV_OK)
      << certkv_last_error();
  k.c = {element, block_tokens, head_dim, k.b3.data(), k.b4.data(), capacity};
  return k;
}

TEST(CApiGaacPages, Bf16PagesRoundTripBitForBit) {
  const int bt = 16, d = 64, n = 16 * 9;
  const std::vector<uint16_t> rows = adversarial_bf16_rows(n, d, 7);
  const Codec k = calibrate("bf16", bt, d, rows.data(), n);
  size_t slot_bytes = 0;
  ASSERT_EQ(certkv_gaac_slot_bytes(&k.c, &slot_bytes), CERTKV_OK);
  ASSERT_LT(slot_bytes, size_t(bt) * d * 2 + 1024);
  int fitted = 0;
  for (int p = 0; p < n / bt; ++p) {
    const uint16_t* page = rows.data() + size_t(p) * bt * d;
    std::vector<uint8_t> slot(slot_bytes);
    size_t used = 0;
    ASSERT_EQ(certkv_gaac_encode_page(&k.c, page, slot.data(), &used), CERTKV_OK) << certkv_last_error();
    if (used == 0) continue;  // kept raw by its owner
    ++fitted;
    ASSERT_LE(used, slot_bytes);
    std::vector<uint16_t> out(size_t(bt) * d, 0x5555);
    ASSERT_EQ(certkv_gaac_decode_page(&k.c, slot.data(), slot_bytes, out.data()), CERTKV_OK) << certkv_last_error();
    EXPECT_EQ(out, std::vector<uint16_t>(page, page + size_t(bt) * d)) << "page " << p;
  }
  EXPECT_GT(fitted, 0);
}

TEST(CApiGaacPages, Fp8PagesRoundTripEveryByte) {
  const int bt = 16, d = 128;
  std::vector<uint8_t> rows(size_t(bt) * 4 * d);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = uint8_t(i * 37 % 256);
  for (const char* element : {"e4m3", "e5m2"}) {
    const Codec k = calibrate(element, bt, d, rows.data(), 4 * bt);
    size_t slot_bytes = 0;
    ASSERT_EQ(certkv_gaac_slot_bytes(&k.c, &slot_bytes), CERTKV_OK);
    for (int p = 0; p < 4; ++p) {
      const uint8_t* page = rows.data() + size_t(p) * bt * d;
      std::vector<uint8_t> slot(slot_bytes), out(size_t(bt) * d);
      size_t used = 0;
      ASSERT_EQ(certkv_gaac_encode_page(&k.c, page, slot.data(), &used), CERTKV_OK) << certkv_last_error();
      if (used == 0) continue;
      ASSERT_EQ(certkv_gaac_decode_page(&k.c, slot.data(), slot_bytes, out.data()), CERTKV_OK);
      EXPECT_EQ(out, std::vector<uint8_t>(page, page + size_t(bt) * d)) << element << " page " << p;
    }
  }
}

TEST(CApiGaacPages, RefusalsNameTheValue) {
  std::vector<uint16_t> rows(64 * 16);
  std::vector<uint8_t> b3(64), b4(64);
  uint64_t capacity = 0;
  EXPECT_EQ(certkv_gaac_calibrate("fp16", 16, 64, rows.data(), 16, b3.data(), b4.data(), &capacity),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("'fp16'"), std::string::npos);
  EXPECT_EQ(certkv_gaac_calibrate("bf16", 16, 12, rows.data(), 16, b3.data(), b4.data(), &capacity),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("head_dim 12"), std::string::npos);
  EXPECT_EQ(certkv_gaac_calibrate("bf16", 16, 64, rows.data(), 0, b3.data(), b4.data(), &capacity),
            CERTKV_ERR_INVALID_ARGUMENT);
  // A base past the exponent range: b4 + 16 > 256.
  std::vector<uint8_t> bad(64, 250);
  const certkv_gaac_page_codec codec{"bf16", 16, 64, bad.data(), bad.data(), 0};
  std::vector<uint8_t> slot(4096);
  size_t used = 0;
  EXPECT_EQ(certkv_gaac_encode_page(&codec, rows.data(), slot.data(), &used), CERTKV_ERR_INVALID_ARGUMENT);
  // A slot the format rejects: every mode tag 3.
  const Codec k = calibrate("bf16", 16, 64, rows.data(), 16);
  size_t slot_bytes = 0;
  ASSERT_EQ(certkv_gaac_slot_bytes(&k.c, &slot_bytes), CERTKV_OK);
  std::vector<uint8_t> garbage(slot_bytes, 0xff);
  EXPECT_EQ(certkv_gaac_decode_page(&k.c, garbage.data(), garbage.size(), rows.data()), CERTKV_ERR_CORRUPT);
}

// The device encoders' C API checks its arguments before it touches a device: bad bases, a
// negative count, null buffers, a scheme the device does not encode; a host pointer is refused
// (INVALID_ARGUMENT) where a device is present and the whole call is UNSUPPORTED where none is.
// Zero pages succeed in every build, with or without a device. Their bytes on a device: tests/python/test_transformers_cuda.py.
TEST(CApiDevicePageEncode, RefusalsBeforeAnyLaunch) {
  std::vector<uint16_t> rows(64 * 16);
  std::vector<uint8_t> bad(64, 250), ok(64, 100), slot(8192);
  uint32_t used = 0;
  const certkv_gaac_page_codec bad_codec{"bf16", 16, 64, bad.data(), bad.data(), 0};
  EXPECT_EQ(certkv_gaac_encode_pages_device(&bad_codec, rows.data(), 1, slot.data(), &used, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("channel 0"), std::string::npos) << certkv_last_error();
  const certkv_gaac_page_codec codec{"bf16", 16, 64, ok.data(), ok.data(), 0};
  EXPECT_EQ(certkv_gaac_encode_pages_device(&codec, rows.data(), -1, slot.data(), &used, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_gaac_encode_pages_device(&codec, nullptr, 1, slot.data(), &used, nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_gaac_encode_pages_device(&codec, nullptr, 0, nullptr, nullptr, nullptr), CERTKV_OK)
      << certkv_last_error();  // zero pages: nothing to launch
  const certkv_status host = certkv_gaac_encode_pages_device(&codec, rows.data(), 1, slot.data(), &used, nullptr);
  EXPECT_TRUE(host == CERTKV_ERR_INVALID_ARGUMENT || host == CERTKV_ERR_UNSUPPORTED) << certkv_last_error();
  if (host == CERTKV_ERR_INVALID_ARGUMENT) {  // a device is present: the host pointer is named
    EXPECT_NE(std::string(certkv_last_error()).find("device page encode: pages is not"), std::string::npos)
        << certkv_last_error();
  }
  certkv_lossy_page_codec lossy{};
  lossy.kv = "rtn4";
  lossy.key = 1;
  lossy.block_tokens = 16;
  lossy.head_dim = 64;
  std::vector<uint8_t> page(8192), encoded(1);
  const certkv_status rtn = certkv_lossy_encode_pages_device(&lossy, 0, rows.data(), 1, page.data(), encoded.data(), nullptr);
  EXPECT_EQ(rtn, CERTKV_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(certkv_last_error()).find("rtn4 pages are encoded on the host only (the device encodes "
                                                  "fp8-e4m3, fp8-e5m2, dither8)"),
            std::string::npos)
      << certkv_last_error();
  lossy.kv = "fp8-e4m3";
  lossy.witness = "rho";  // not a K page's witness
  EXPECT_EQ(certkv_lossy_encode_pages_device(&lossy, 0, rows.data(), 1, page.data(), encoded.data(), nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("witness"), std::string::npos) << certkv_last_error();
  lossy.witness = nullptr;
  EXPECT_EQ(certkv_lossy_encode_pages_device(&lossy, 0, nullptr, 0, nullptr, nullptr, nullptr), CERTKV_OK)
      << certkv_last_error();
  EXPECT_EQ(certkv_lossy_encode_pages_device(&lossy, 0, nullptr, 1, page.data(), encoded.data(), nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_lossy_encode_pages_device(&lossy, 0, rows.data(), -2, page.data(), encoded.data(), nullptr),
            CERTKV_ERR_INVALID_ARGUMENT);
}

// The two-token case of DESIGN.md section 4: p~ = (1/2, 1/2), c = (0.1, 0.1).
TEST(CApiMeter, TierAKnownAnswer) {
  const int d = 4;
  const float q[d] = {1, 0, 0, 0};
  const float k[2 * d] = {0, 0, 0, 0, 0, 0, 0, 0};
  const float k_hat[2 * d] = {0.1f, 0, 0, 0, 0.1f, 0, 0, 0};
  double bounds[2];
  certkv_meter_row row;
  ASSERT_EQ(certkv_meter_tier_a(q, k, k_hat, 2, d, "interleaved", 1.0, bounds, &row), CERTKV_OK)
      << certkv_last_error();
  const double c = double(0.1f);
  EXPECT_NEAR(bounds[0], c, 1e-7);
  EXPECT_GE(bounds[0], c);
  EXPECT_NEAR(row.meter, (std::exp(2 * c) - 1) / 2, 1e-6);
  EXPECT_NEAR(row.log_a, c, 1e-6);
  EXPECT_NEAR(row.tv, 0.0, 1e-12);
  EXPECT_EQ(row.max_bound, bounds[0]);
  // Half-split pairs channel 0 with channel 2: the same single band, the same bound.
  certkv_meter_row half;
  ASSERT_EQ(certkv_meter_tier_a(q, k, k_hat, 2, d, "half-split", 1.0, nullptr, &half), CERTKV_OK);
  EXPECT_EQ(half.meter, row.meter);
}

TEST(CApiMeter, TierBKnownAnswerAndOutliers) {
  const int d = 32;
  std::vector<float> q(d, 0.f), k(2 * d, 0.f), k_hat(2 * d, 0.f);
  q[0] = 2.f;
  const float scales[2] = {0.05f, 0.05f};
  const double delta = 1e-3;
  double bounds[2];
  certkv_meter_row row;
  ASSERT_EQ(certkv_meter_tier_b(q.data(), k.data(), k_hat.data(), scales, 2, d, "interleaved", nullptr, 0, 1.0,
                                delta, bounds, &row),
            CERTKV_OK)
      << certkv_last_error();
  const double s = double(0.05f), sigma2 = 4.0 * s * s / 12.0;
  const double want = std::sqrt(2 * sigma2 * std::log(2 * 2 / delta)) + 2.0 * s / 256.0;
  ASSERT_LT(want, 0.5);  // the meter below its cap of 1
  EXPECT_NEAR(bounds[0], want, 1e-12);
  EXPECT_NEAR(row.meter, (std::exp(2 * want) - 1) / 2, 1e-9);
  // Pair 0 holds channel 0: as an outlier it is exact, and the bound is 0.
  const uint16_t outliers[1] = {0};
  ASSERT_EQ(certkv_meter_tier_b(q.data(), k.data(), k_hat.data(), scales, 2, d, "interleaved", outliers, 1, 1.0,
                                delta, bounds, &row),
            CERTKV_OK);
  EXPECT_EQ(bounds[0], 0.0);
  EXPECT_EQ(row.meter, 0.0);
}

TEST(CApiMeter, RefusalsNameTheArgument) {
  const float q[4] = {1, 0, 0, 0}, k[4] = {0, 0, 0, 0};
  const float nan_k[4] = {NAN, 0, 0, 0};
  certkv_meter_row row;
  EXPECT_EQ(certkv_meter_tier_a(q, k, k, 1, 4, "sideways", 1.0, nullptr, &row), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("rope_layout 'sideways'"), std::string::npos);
  EXPECT_EQ(certkv_meter_tier_a(q, k, nan_k, 1, 4, "interleaved", 1.0, nullptr, &row), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("k_hat"), std::string::npos);
  EXPECT_EQ(certkv_meter_tier_a(q, k, k, 1, 3, "interleaved", 1.0, nullptr, &row), CERTKV_ERR_INVALID_ARGUMENT);
  const float scales[1] = {1};
  EXPECT_EQ(certkv_meter_tier_b(q, k, k, scales, 1, 4, "interleaved", nullptr, 0, 1.0, 1e-3, nullptr, &row),
            CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("head_dim"), std::string::npos);
}

}  // namespace
