#include "format/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "core/status.h"

namespace certkv::format {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed * 31 + 5 * i + 1);
  return b;
}

// A file from a header text and data bytes, as the format lays them out.
Bytes make_file(const std::string& header, const Bytes& data) {
  Bytes b(8 + header.size() + data.size());
  const uint64_t n = header.size();
  std::memcpy(b.data(), &n, 8);
  std::memcpy(b.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(b.data() + 8 + header.size(), data.data(), data.size());
  return b;
}

// Parses a copy of exactly `n` bytes so AddressSanitizer sees any read past the end.
void parse_copy(const Bytes& b, size_t n, const std::string& name = "t.safetensors") {
  const auto copy = std::make_unique<uint8_t[]>(n == 0 ? 1 : n);
  std::memcpy(copy.get(), b.data(), n);
  SafetensorsFile::parse(copy.get(), n, name);
}

void expect_error(const std::function<void()>& fn, StatusCode code,
                  std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message '" << e.what() << "' does not mention '" << needle << "'";
    }
  }
}

void expect_corrupt(const std::string& header, const Bytes& data,
                    std::initializer_list<std::string> needles) {
  const Bytes b = make_file(header, data);
  expect_error([&] { parse_copy(b, b.size(), "bad.safetensors"); }, StatusCode::kCorrupt, needles);
}

std::string temp_path(const std::string& leaf) { return ::testing::TempDir() + "/" + leaf; }

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(Safetensors, KnownAnswerFile) {
  const float values[3] = {1.5f, -2.0f, 0.25f};
  Bytes data(12);
  std::memcpy(data.data(), values, 12);
  data.push_back(7);
  data.push_back(0xfe);
  const Bytes b = make_file(
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"I8","shape":[1,2],"data_offsets":[12,14]}})",
      data);
  auto f = SafetensorsFile::parse(b.data(), b.size(), "known.safetensors");
  EXPECT_EQ(f->name(), "known.safetensors");
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->tensors()[0].name, "w");
  EXPECT_EQ(f->tensors()[1].name, "b");
  const SafetensorsTensor* w = f->find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, "F32");
  EXPECT_EQ(w->shape, std::vector<int64_t>{3});
  EXPECT_EQ(w->n_bytes, 12u);
  float got[3];
  std::memcpy(got, w->data, 12);
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -2.0f);
  EXPECT_EQ(got[2], 0.25f);
  const SafetensorsTensor* i8 = f->find("b");
  EXPECT_EQ(i8->shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(static_cast<int8_t>(i8->data[1]), -2);
  EXPECT_EQ(f->find("missing"), nullptr);
  EXPECT_EQ(f->metadata().at("format"), "pt");
}

TEST(Safetensors, RoundTripEveryDtypeAndRaggedShapes) {
  const std::vector<std::string> dtypes = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3",
                                           "I16",  "U16", "F16", "BF16",    "I32",
                                           "U32",  "F32", "I64", "U64",     "F64"};
  const std::vector<std::vector<int64_t>> shapes = {{}, {1}, {3}, {17, 3}, {0, 5}, {2, 1, 129}, {501}};
  std::vector<Bytes> storage;
  std::vector<SafetensorsTensorView> views;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    for (size_t j = 0; j < shapes.size(); ++j) {
      if ((i + j) % 2 == 1 && j != 4) continue;  // keep the file small but cover every pair kind
      int64_t n = 1;
      for (int64_t d : shapes[j]) n *= d;
      const size_t n_bytes = static_cast<size_t>(n) * safetensors_dtype_bytes(dtypes[i]);
      storage.push_back(pattern(n_bytes, static_cast<uint8_t>(i * 7 + j)));
      views.push_back({dtypes[i] + "." + std::to_string(j), dtypes[i], shapes[j], nullptr, n_bytes});
    }
  }
  for (size_t k = 0; k < views.size(); ++k) views[k].data = storage[k].data();
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"quote\"and\\slash", "line\nbreak \xC3\xA9"}, {"", ""}};
  const std::string path = temp_path("certkv_roundtrip.safetensors");
  write_safetensors(path, views, metadata);

  const Bytes raw = read_file(path);
  uint64_t header_bytes;
  std::memcpy(&header_bytes, raw.data(), 8);
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(raw[8], '{');

  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->metadata(), metadata);
  ASSERT_EQ(f->tensors().size(), views.size());
  size_t n_nonzero = 0;
  for (size_t k = 0; k < views.size(); ++k) {
    const SafetensorsTensor& t = f->tensors()[k];
    EXPECT_EQ(t.name, views[k].name);
    EXPECT_EQ(t.dtype, views[k].dtype);
    EXPECT_EQ(t.shape, views[k].shape);
    ASSERT_EQ(t.n_bytes, views[k].n_bytes);
    if (t.n_bytes > 0) {
      EXPECT_EQ(std::memcmp(t.data, views[k].data, t.n_bytes), 0) << t.name;
    }
    EXPECT_EQ(f->find(t.name), &t);
    for (size_t b = 0; b < t.n_bytes; ++b) n_nonzero += t.data[b] != 0;
  }
  EXPECT_GT(n_nonzero, 1000u);
  std::filesystem::remove(path);
}

TEST(Safetensors, EmptyFileOfTensors) {
  const std::string path = temp_path("certkv_empty.safetensors");
  write_safetensors(path, {}, {});
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_EQ(read_file(path).size(), 16u);  // "{}" padded to 8 bytes
  std::filesystem::remove(path);
}

TEST(Safetensors, OpenErrors) {
  expect_error([] { SafetensorsFile::open("/nonexistent/x.safetensors"); }, StatusCode::kNotFound,
               {"/nonexistent/x.safetensors"});
  const std::string dir = ::testing::TempDir();
  expect_error([&] { SafetensorsFile::open(dir); }, StatusCode::kIo, {dir});
  const std::string empty = temp_path("certkv_zero.safetensors");
  { std::ofstream out(empty, std::ios::binary); }
  expect_error([&] { SafetensorsFile::open(empty); }, StatusCode::kCorrupt, {empty});
  std::filesystem::remove(empty);
}

TEST(Safetensors, TruncatedAtEveryOffset) {
  const Bytes b = make_file(
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
      R"("b":{"dtype":"U8","shape":[],"data_offsets":[6,7]}})",
      pattern(7, 1));
  ASSERT_NO_THROW(parse_copy(b, b.size()));
  for (size_t n = 0; n < b.size(); ++n) {
    EXPECT_THROW(parse_copy(b, n), Error) << "truncated to " << n << " of " << b.size();
  }
}

TEST(Safetensors, EveryByteFlippedNeverCrashes) {
  const Bytes b = make_file(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})",
      pattern(16, 2));
  size_t n_errors = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    for (uint8_t mask : {0x01, 0x20, 0x80, 0xff}) {
      Bytes c = b;
      c[i] ^= mask;
      try {
        parse_copy(c, c.size());
      } catch (const Error&) {
        ++n_errors;
      }
    }
  }
  EXPECT_GT(n_errors, b.size());
}

TEST(Safetensors, BadJson) {
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})", pattern(4, 1),
                 {"bad.safetensors", "JSON"});
  expect_corrupt(R"({"a":)", {}, {"bad.safetensors"});
  expect_corrupt("[1,2]", {}, {"not a JSON object"});
  expect_corrupt("", {}, {"bad.safetensors"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                 pattern(4, 1), {"duplicate key \"a\""});
}

TEST(Safetensors, BadEntries) {
  const Bytes d4 = pattern(4, 1);
  expect_corrupt(R"({"a":[]})", d4, {"tensor 'a'", "not an object"});
  expect_corrupt(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", d4, {"tensor 'a'", "dtype"});
  expect_corrupt(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", d4, {"tensor 'a'", "shape"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1]}})", d4, {"tensor 'a'", "data_offsets"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", d4, {"data_offsets"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", d4, {"shape"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", d4, {"shape"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", d4, {"end offset"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,4]}})", d4, {"begin offset"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", d4,
                 {"tensor 'a'", "unexpected field 'extra'"});
  expect_corrupt(R"({"__metadata__":{"k":1}})", {}, {"__metadata__", "'k'"});
  expect_corrupt(R"({"__metadata__":[]})", {}, {"__metadata__"});
  const Bytes b = make_file(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", pattern(1, 1));
  expect_error([&] { parse_copy(b, b.size(), "f4.safetensors"); }, StatusCode::kUnsupported,
               {"f4.safetensors", "tensor 'a'", "dtype 'F4'"});
}

TEST(Safetensors, OffsetsOutOfRange) {
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", pattern(4, 1),
                 {"bad.safetensors", "tensor 'a'", "past the data section"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551616]}})",
                 pattern(4, 1), {"tensor 'a'"});
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", pattern(8, 1),
                 {"tensor 'a'", "end before"});
}

TEST(Safetensors, SizeMismatch) {
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", pattern(12, 1),
                 {"tensor 'a'", "F32", "[3]", "8 data bytes"});
  expect_corrupt(R"({"a":{"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
                 {}, {"tensor 'a'"});
}

TEST(Safetensors, OverlappingTensors) {
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                 pattern(8, 1), {"'a'", "'b'", "overlap"});
  expect_corrupt(R"({"b":{"dtype":"U8","shape":[3],"data_offsets":[5,8]},"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]}})",
                 pattern(8, 1), {"overlap"});
  // Touching ranges and empty tensors anywhere are fine.
  const Bytes ok = make_file(
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}})",
      pattern(8, 1));
  EXPECT_NO_THROW(parse_copy(ok, ok.size()));
}

TEST(Safetensors, HeaderLength) {
  Bytes b = make_file(R"({})", {});
  const uint64_t too_long = 1000;
  std::memcpy(b.data(), &too_long, 8);
  expect_error([&] { parse_copy(b, b.size(), "h.safetensors"); }, StatusCode::kCorrupt,
               {"h.safetensors", "header length 1000", "past the end"});
  const uint64_t huge = 0xffffffffffffffffull;
  std::memcpy(b.data(), &huge, 8);
  expect_error([&] { parse_copy(b, b.size(), "h.safetensors"); }, StatusCode::kCorrupt,
               {"header length", "limit"});
  expect_error([&] { parse_copy(b, 7, "h.safetensors"); }, StatusCode::kCorrupt,
               {"h.safetensors", "8-byte"});
}

TEST(Safetensors, WriterRejectsBadInput) {
  const Bytes data = pattern(8, 3);
  const std::string path = temp_path("certkv_bad_write.safetensors");
  expect_error([&] { write_safetensors(path, {{"a", "F32", {3}, data.data(), 8}}, {}); },
               StatusCode::kInvalidArgument, {path, "tensor 'a'", "[3]"});
  expect_error([&] { write_safetensors(path, {{"a", "Q4", {8}, data.data(), 8}}, {}); },
               StatusCode::kInvalidArgument, {"tensor 'a'", "dtype 'Q4'"});
  expect_error(
      [&] {
        write_safetensors(path, {{"a", "U8", {8}, data.data(), 8}, {"a", "U8", {8}, data.data(), 8}},
                          {});
      },
      StatusCode::kInvalidArgument, {"tensor 'a'"});
  expect_error([&] { write_safetensors(path, {{"__metadata__", "U8", {8}, data.data(), 8}}, {}); },
               StatusCode::kInvalidArgument, {"__metadata__"});
  expect_error([&] { write_safetensors(path, {{"a", "U8", {-8}, data.data(), 8}}, {}); },
               StatusCode::kInvalidArgument, {"tensor 'a'"});
  expect_error([&] { write_safetensors("/nonexistent/dir/x.safetensors", {}, {}); },
               StatusCode::kIo, {"/nonexistent/dir/x.safetensors"});
  if (std::filesystem::exists("/dev/full")) {
    const Bytes big = pattern(1 << 16, 4);
    expect_error([&] { write_safetensors("/dev/full", {{"a", "U8", {1 << 16}, big.data(), big.size()}}, {}); },
                 StatusCode::kIo, {"/dev/full"});
  }
}

}  // namespace
}  // namespace certkv::format
