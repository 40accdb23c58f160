#include "format/json.h"

#include <gtest/gtest.h>

#include <string>

#include "core/status.h"

namespace certkv::format {
namespace {

JsonValue parse(std::string_view text) { return parse_json(text, "test.json"); }

void expect_rejected(std::string_view text) {
  try {
    parse(text);
    ADD_FAILURE() << "accepted: " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kCorrupt) << e.what();
    EXPECT_NE(std::string(e.what()).find("test.json"), std::string::npos) << e.what();
  }
}

TEST(Json, Scalars) {
  EXPECT_TRUE(parse("null").is_null());
  EXPECT_TRUE(parse(" true ").as_bool());
  EXPECT_FALSE(parse("false").as_bool());
  EXPECT_EQ(parse("0").as_int(), 0);
  EXPECT_EQ(parse("-0").as_int(), 0);
  EXPECT_EQ(parse("501").as_int(), 501);
  EXPECT_EQ(parse("-3771").as_int(), -3771);
  EXPECT_EQ(parse("9223372036854775807").as_int(), INT64_MAX);
  EXPECT_EQ(parse("-9223372036854775808").as_int(), INT64_MIN);
  EXPECT_EQ(parse("\"abc\"").as_string(), "abc");
}

TEST(Json, Numbers) {
  EXPECT_TRUE(parse("17").is_integer());
  EXPECT_FALSE(parse("17.0").is_integer());
  EXPECT_EQ(parse("17.0").as_double(), 17.0);
  EXPECT_EQ(parse("1e-05").as_double(), 1e-5);
  EXPECT_EQ(parse("-2.5E+3").as_double(), -2500.0);
  EXPECT_EQ(parse("0.1").as_double(), 0.1);
  EXPECT_EQ(parse("500000.0").as_double(), 500000.0);
  EXPECT_EQ(parse("129").as_double(), 129.0);
  // Beyond int64: still a number, no longer an integer.
  const JsonValue big = parse("9223372036854775808");
  EXPECT_FALSE(big.is_integer());
  EXPECT_EQ(big.as_double(), 9223372036854775808.0);
}

TEST(Json, StringEscapes) {
  EXPECT_EQ(parse(R"("a\"b\\c\/d\be\ff\ng\rh\ti")").as_string(), "a\"b\\c/d\be\ff\ng\rh\ti");
  EXPECT_EQ(parse(R"("\u0041\u00e9\u20AC")").as_string(), "A\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(parse(R"("\ud83d\ude00")").as_string(), "\xF0\x9F\x98\x80");
  EXPECT_EQ(parse(R"("\u0000")").as_string(), std::string(1, '\0'));
  EXPECT_EQ(parse("\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"").as_string(),
            "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
}

TEST(Json, ArraysAndObjects) {
  const JsonValue v = parse(R"( { "a" : [1, 2.5, "x", [], {}], "b": {"c": null}, "d": true } )");
  ASSERT_TRUE(v.is_object());
  ASSERT_EQ(v.as_object().size(), 3u);
  EXPECT_EQ(v.as_object()[0].first, "a");
  EXPECT_EQ(v.as_object()[2].first, "d");
  const auto& a = v.find("a")->as_array();
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].as_int(), 1);
  EXPECT_EQ(a[1].as_double(), 2.5);
  EXPECT_EQ(a[2].as_string(), "x");
  EXPECT_TRUE(a[3].as_array().empty());
  EXPECT_TRUE(a[4].as_object().empty());
  EXPECT_TRUE(v.find("b")->find("c")->is_null());
  EXPECT_EQ(v.find("zzz"), nullptr);
  EXPECT_EQ(a[0].find("a"), nullptr);
}

TEST(Json, DepthLimit) {
  std::string ok(kJsonMaxDepth, '['), bad(kJsonMaxDepth + 1, '[');
  ok += std::string(kJsonMaxDepth, ']');
  bad += std::string(kJsonMaxDepth + 1, ']');
  EXPECT_NO_THROW(parse(ok));
  expect_rejected(bad);
  expect_rejected(std::string(100000, '['));
}

TEST(Json, RejectsMalformed) {
  for (const char* text : {
           "", " ", "{", "}", "[", "[1,]", "[1 2]", "{\"a\":1,}", "{\"a\" 1}", "{a:1}",
           "{\"a\":1 \"b\":2}", "{\"a\":1}x", "01", "-", "1.", ".5", "1e", "1e+", "+1", "NaN",
           "Infinity", "tru", "nul", "\"abc", "\"\\x\"", "\"\\u12\"", "\"\\u12g4\"",
           "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\u0041\"", "\"a\nb\"", "\"\x01\"",
           "\"\xC0\xAF\"", "\"\xE0\x80\xAF\"", "\"\xED\xA0\x80\"", "\"\xF4\x90\x80\x80\"",
           "\"\xC3\"", "\"\x80\"", "\"\xFF\"", "{\"a\":1,\"a\":2}", "// c\n1", "[1]/*x*/",
           "1e400", "\"a\"\"b\""}) {
    expect_rejected(text);
  }
}

TEST(Json, TruncatedDocumentsAreRejected) {
  const std::string doc = R"({"k":[1,-2.5e3,"s\u00e9",true,null,{"x":false}]})";
  ASSERT_NO_THROW(parse(doc));
  for (size_t n = 0; n < doc.size(); ++n) expect_rejected(std::string_view(doc).substr(0, n));
}

TEST(Json, WrongKindAccessorsThrow) {
  const JsonValue v = parse("[1.5]");
  EXPECT_THROW(v.as_object(), Error);
  EXPECT_THROW(v.as_array()[0].as_int(), Error);
  EXPECT_THROW(v.as_array()[0].as_string(), Error);
  EXPECT_THROW(parse("\"1\"").as_double(), Error);
  EXPECT_THROW(parse("1").as_bool(), Error);
}

TEST(Json, ErrorNamesSourceAndOffset) {
  try {
    parse_json("[1, 2, x]", "config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("byte 7"), std::string::npos) << e.what();
  }
}

TEST(Json, QuoteRoundTrips) {
  const std::string raw = std::string("a\"b\\c\n\t\x01\x1f z\xC3\xA9") + '\0' + "end";
  const std::string quoted = json_quote(raw);
  EXPECT_EQ(quoted.find('\n'), std::string::npos);
  EXPECT_EQ(parse(quoted).as_string(), raw);
  EXPECT_EQ(json_quote("plain"), "\"plain\"");
}

}  // namespace
}  // namespace certkv::format

namespace certkv::format {
namespace {

// A generation cut inside a character still prints valid JSON: the cut or malformed bytes become
// U+FFFD, and what was valid is kept byte for byte.
TEST(JsonQuote, MalformedUtf8BecomesReplacementCharacters) {
  const std::string sea = "\xe5\xa4\xa7\xe6\xb5\xb7";  // two CJK characters
  EXPECT_EQ(json_quote(sea), "\"" + sea + "\"");
  EXPECT_EQ(json_quote(sea.substr(0, 4)), "\"\xe5\xa4\xa7\xef\xbf\xbd\"");  // cut after 1 byte of 3
  EXPECT_EQ(json_quote("a\x80z"), "\"a\xef\xbf\xbdz\"");                     // stray continuation
  EXPECT_EQ(json_quote("\xc0\xaf"), "\"\xef\xbf\xbd\xef\xbf\xbd\"");         // overlong '/'
  EXPECT_EQ(json_quote("\xed\xa0\x80"), "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"");  // surrogate
  EXPECT_EQ(json_quote("\xf4\x90\x80\x80").find("\xef\xbf\xbd"), 1u);           // above U+10FFFF
  const JsonValue parsed = parse_json("[" + json_quote(sea.substr(0, 5)) + "]", "test");
  EXPECT_EQ(parsed.as_array()[0].as_string(), "\xe5\xa4\xa7\xef\xbf\xbd\xef\xbf\xbd");  // 2 bytes cut
}

}  // namespace
}  // namespace certkv::format
