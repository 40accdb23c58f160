#include "format/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace certkv::format {
namespace {

TEST(Utf8, CompletePrefixHoldsBackAnUnfinishedCharacter) {
  const std::string sea = "ab\xe5\xa4\xa7\xe6\xb5\xb7";
  for (size_t cut = 0; cut <= sea.size(); ++cut) {
    const size_t whole = complete_utf8_prefix(sea.substr(0, cut));
    const size_t expect = cut < 2 ? cut : cut < 5 ? 2 : cut < 8 ? 5 : 8;
    EXPECT_EQ(whole, expect) << "cut " << cut;
  }
  EXPECT_EQ(complete_utf8_prefix("a\x80"), 2u);  // a stray byte is not waited for
  EXPECT_EQ(complete_utf8_prefix("\xf0\x9f\x99"), 0u);
  EXPECT_EQ(complete_utf8_prefix("\xf0\x9f\x99\x82"), 4u);
}

TEST(Utf8, ValidTextIsKeptAndEveryMalformedByteReplaced) {
  const std::string ok = "plain, caf\xc3\xa9, \xe5\xa4\xa7, \xf0\x9f\x99\x82";
  EXPECT_EQ(valid_utf8(ok), ok);
  EXPECT_EQ(valid_utf8(""), "");
  EXPECT_EQ(valid_utf8("\xe5\xa4"), "\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(valid_utf8("x\xff"), "x\xef\xbf\xbd");
}

}  // namespace
}  // namespace certkv::format
