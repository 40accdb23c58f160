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

}  // namespace
}  // namespace certkv::cache
