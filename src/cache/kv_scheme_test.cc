#include "cache/kv_scheme.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "core/status.h"

namespace certkv::cache {
namespace {

TEST(KvSchemeTable, EveryEntryIsConsistent) {
  std::set<std::string> names;
  int tier_b = 0;
  for (const KvSchemeInfo& s : kv_schemes()) {
    SCOPED_TRACE(s.name);
    EXPECT_TRUE(names.insert(s.name).second) << "duplicate name";
    EXPECT_EQ(parse_kv_scheme(s.name), s.scheme);
    EXPECT_EQ(&kv_scheme_info(s.scheme), &s);
    EXPECT_GT(std::string(s.summary).size(), 10u);
    EXPECT_FALSE(s.gaac && s.lossy);
    EXPECT_EQ(s.lossy, s.tier != MeterTier::kNone) << "lossy pages are exactly the metered ones";
    if (s.lossy) {
      EXPECT_EQ(std::string(codec::lossy_scheme_name(s.lossy_codec)), s.name);
      EXPECT_EQ(kv_scheme_lossy(s.scheme), s.lossy_codec);
      EXPECT_EQ(s.element, format::GaacElement::kBf16) << "lossy schemes keep bf16 tails";
    } else {
      EXPECT_THROW(kv_scheme_lossy(s.scheme), Error);
      EXPECT_EQ(s.default_window_tokens, 0);
    }
    if (s.gaac) {
      EXPECT_TRUE(s.full_blocks == format::StorageClass::kGaac ||
                  s.full_blocks == format::StorageClass::kGaacFp8);
    }
    if (s.cuda_fragment_pages) {
      // Fragment-major device pages: a device-served scheme whose raw pages the device's sparse
      // decode does not gather (it reads rows of row-major bf16 pages).
      EXPECT_TRUE(s.cuda_route);
      EXPECT_FALSE(s.cuda_sparse);
    }
    tier_b += s.tier == MeterTier::kB;
  }
  EXPECT_TRUE(kv_scheme_info(KvScheme::kDither8).cuda_fragment_pages) << "the cuda backend's dither8 pages";
  EXPECT_TRUE(kv_scheme_info(KvScheme::kGaac).cuda_fragment_pages) << "the cuda backend's GAAC device pages";
  // The device's byte order: the table's flag, and fp8-e4m3 with the exponent witness.
  using codec::WitnessCode;
  for (const KvSchemeInfo& s : kv_schemes())
    for (WitnessCode w : {WitnessCode::kFp16, WitnessCode::kPageScaled8, WitnessCode::kExponent})
      EXPECT_EQ(kv_scheme_device_fragment_pages(s.scheme, w),
                s.cuda_fragment_pages || (s.scheme == KvScheme::kFp8E4M3 && w == WitnessCode::kExponent))
          << s.name << " " << codec::witness_code_name(w);
  EXPECT_TRUE(kv_scheme_device_fragment_pages(KvScheme::kFp8E4M3, WitnessCode::kExponent));
  EXPECT_FALSE(kv_scheme_device_fragment_pages(KvScheme::kFp8E4M3, WitnessCode::kFp16));
  EXPECT_FALSE(kv_scheme_device_fragment_pages(KvScheme::kFp8E5M2, WitnessCode::kPageScaled8));
  EXPECT_FALSE(kv_scheme_info(KvScheme::kGaacE5M2).cuda_fragment_pages) << "GAAC slots over e5m2";
  EXPECT_EQ(names.size(), size_t(kNumKvSchemes));
  EXPECT_EQ(tier_b, 1);
  EXPECT_EQ(kv_scheme_info(KvScheme::kDither8).tier, MeterTier::kB);
  EXPECT_TRUE(kv_scheme_info(KvScheme::kGaac).lossless);
  EXPECT_EQ(kv_scheme_element(KvScheme::kGaacE5M2), format::GaacElement::kFp8E5M2);
}

TEST(KvSchemeTable, UnknownNamesAndValuesAreClearErrors) {
  try {
    parse_kv_scheme("zstd");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    const std::string m = e.what();
    EXPECT_NE(m.find("zstd"), std::string::npos);
    for (const KvSchemeInfo& s : kv_schemes()) EXPECT_NE(m.find(s.name), std::string::npos) << s.name;
  }
  EXPECT_THROW(kv_scheme_info(KvScheme(kNumKvSchemes)), Error);
  EXPECT_THROW(kv_scheme_info(KvScheme(-1)), Error);
  EXPECT_EQ(kv_scheme_names([](const KvSchemeInfo& s) { return s.tier == MeterTier::kB; }), "dither8");
}


// The witness a scheme's K pages keep, checked in this one place: every Tier A scheme takes fp16 and
// u8, fp8-e4m3 alone the exponent witness; the other schemes none (their config's default code is
// no request); a name resolves to its code or, null, to the scheme's default; refusals name the
// witness, the scheme and the schemes that take it.
TEST(KvSchemeTable, WitnessCodesEachSchemeTakes) {
  using codec::WitnessCode;
  for (const KvSchemeInfo& s : kv_schemes()) {
    const bool tier_a = s.tier == MeterTier::kA;
    EXPECT_EQ(kv_scheme_takes_witness(s.scheme, WitnessCode::kFp16), tier_a) << s.name;
    EXPECT_EQ(kv_scheme_takes_witness(s.scheme, WitnessCode::kPageScaled8), tier_a) << s.name;
    EXPECT_EQ(kv_scheme_takes_witness(s.scheme, WitnessCode::kExponent), s.scheme == KvScheme::kFp8E4M3) << s.name;
    EXPECT_EQ(s.default_witness, WitnessCode::kFp16) << s.name;
    EXPECT_EQ(resolve_kv_witness(s.scheme, nullptr, "w"), s.default_witness) << s.name;
    EXPECT_NO_THROW(check_kv_witness(s.scheme, s.default_witness, "w")) << s.name;
    for (const WitnessCode code : {WitnessCode::kFp16, WitnessCode::kPageScaled8, WitnessCode::kExponent}) {
      const char* name = codec::witness_code_name(code);
      if (kv_scheme_takes_witness(s.scheme, code)) {
        EXPECT_EQ(resolve_kv_witness(s.scheme, name, "w"), code) << s.name << " " << name;
        continue;
      }
      try {
        resolve_kv_witness(s.scheme, name, "config.witness");
        ADD_FAILURE() << s.name << " took " << name;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
        const std::string m = e.what();
        EXPECT_NE(m.find(std::string("config.witness ") + name), std::string::npos) << m;
        EXPECT_NE(m.find(s.name), std::string::npos) << m;
      }
      if (code != s.default_witness || tier_a) {
        EXPECT_THROW(check_kv_witness(s.scheme, code, "w"), Error) << s.name;
      }
    }
  }
  EXPECT_EQ(kv_scheme_names([](const KvSchemeInfo& s) { return kv_scheme_takes_witness(s.scheme, codec::WitnessCode::kExponent); }),
            "fp8-e4m3");
  try {
    resolve_kv_witness(KvScheme::kRtn8, "u16", "certkv_session_params.witness");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'u16' is not a witness (fp16, u8, exponent)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace certkv::cache
