#include "model/gguf.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/ggml_type.h"

namespace certkv::model {
namespace {

using Bytes = std::vector<uint8_t>;
using format::GgmlType;

// ---- A small GGUF writer, enough to build valid and broken files byte by byte. ----

template <typename T>
void put(Bytes& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

void put_str(Bytes& b, const std::string& s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

void append(Bytes& b, const Bytes& tail) { b.insert(b.end(), tail.begin(), tail.end()); }

// A typed value as it follows a key: type id, then the payload.
template <typename T>
Bytes scalar(GgufType type, T v) {
  Bytes b;
  put<uint32_t>(b, static_cast<uint32_t>(type));
  put<T>(b, v);
  return b;
}

Bytes string_value(const std::string& s) {
  Bytes b;
  put<uint32_t>(b, static_cast<uint32_t>(GgufType::kString));
  put_str(b, s);
  return b;
}

template <typename T>
Bytes array_value(GgufType element, const std::vector<T>& values) {
  Bytes b;
  put<uint32_t>(b, static_cast<uint32_t>(GgufType::kArray));
  put<uint32_t>(b, static_cast<uint32_t>(element));
  put<uint64_t>(b, values.size());
  for (const T& v : values) put<T>(b, v);
  return b;
}

Bytes string_array_value(const std::vector<std::string>& values) {
  Bytes b;
  put<uint32_t>(b, static_cast<uint32_t>(GgufType::kArray));
  put<uint32_t>(b, static_cast<uint32_t>(GgufType::kString));
  put<uint64_t>(b, values.size());
  for (const auto& v : values) put_str(b, v);
  return b;
}

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type = 0;
  Bytes data;
  std::optional<uint64_t> offset;  // default: packed, each aligned
};

struct GgufSpec {
  uint32_t version = 3;
  uint64_t alignment = 32;  // used to lay out the data; write general.alignment yourself
  std::vector<std::pair<std::string, Bytes>> kvs;
  std::vector<TensorSpec> tensors;
};

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

Bytes build(const GgufSpec& spec) {
  Bytes b = {'G', 'G', 'U', 'F'};
  put<uint32_t>(b, spec.version);
  put<uint64_t>(b, spec.tensors.size());
  put<uint64_t>(b, spec.kvs.size());
  for (const auto& [key, value] : spec.kvs) {
    put_str(b, key);
    append(b, value);
  }
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const auto& t : spec.tensors) {
    const uint64_t offset = t.offset ? *t.offset : align_up(next, spec.alignment);
    offsets.push_back(offset);
    next = offset + t.data.size();
    put_str(b, t.name);
    put<uint32_t>(b, t.dims.size());
    for (uint64_t d : t.dims) put<uint64_t>(b, d);
    put<uint32_t>(b, t.type);
    put<uint64_t>(b, offset);
  }
  const uint64_t data_start = align_up(b.size(), spec.alignment);
  b.resize(data_start, 0);
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const Bytes& data = spec.tensors[i].data;
    if (offsets[i] > (uint64_t{1} << 32)) continue;  // a deliberately wild offset: no data
    const size_t at = data_start + offsets[i];
    if (b.size() < at + data.size()) b.resize(at + data.size());
    std::copy(data.begin(), data.end(), b.begin() + at);
  }
  return b;
}

Bytes pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 7 * i + 1);
  return b;
}

// A valid file with two tensors (F32 [3, 2] and Q8_0 [32, 1]) and a few metadata values.
GgufSpec small_spec(uint32_t version = 3) {
  GgufSpec s;
  s.version = version;
  s.kvs.emplace_back("general.architecture", string_value("llama"));
  s.kvs.emplace_back("llama.block_count", scalar<uint32_t>(GgufType::kUint32, 2));
  s.kvs.emplace_back("tokenizer.ggml.tokens", string_array_value({"a", "bc", ""}));
  s.tensors.push_back({"w.f32", {3, 2}, 0, pattern(24, 1), std::nullopt});
  s.tensors.push_back({"w.q8", {32, 1}, 8, pattern(34, 2), std::nullopt});
  return s;
}

// Parses a copy of exactly `n` bytes so AddressSanitizer sees any read past the end.
void parse_copy(const Bytes& b, size_t n, const std::string& name = "t.gguf") {
  const auto copy = std::make_unique<uint8_t[]>(n == 0 ? 1 : n);
  std::memcpy(copy.get(), b.data(), n);
  GgufFile::parse(copy.get(), n, name);
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

void expect_corrupt(const Bytes& b, std::initializer_list<std::string> needles) {
  expect_error([&] { parse_copy(b, b.size(), "bad.gguf"); }, StatusCode::kCorrupt, needles);
}

std::string models_dir() { return CERTKV_MODELS_DIR; }
std::string smollm_path() { return models_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }
std::string tiny_path() { return std::string(CERTKV_TEST_DATA_DIR) + "/models/llama-2-tiny-random.gguf"; }

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ---- Real files ----

TEST(GgufRealFile, SmolLM2) {
  const std::string path = smollm_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing: run scripts/fetch_models.sh";
  auto f = GgufFile::open(path);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->tensors().size(), 272u);
  EXPECT_EQ(f->metadata().size(), 33u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 30);
  EXPECT_EQ(f->get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f->get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(f->get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_FLOAT_EQ(static_cast<float>(*f->get_float("llama.attention.layer_norm_rms_epsilon")), 1e-5f);
  EXPECT_EQ(f->get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(f->get_bool("tokenizer.ggml.add_bos_token"), false);
  const auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.has_value());
  ASSERT_EQ(tokens->size(), 49152u);
  EXPECT_EQ((*tokens)[0], "<|endoftext|>");
  EXPECT_EQ((*tokens)[2], "<|im_end|>");
  EXPECT_EQ(tokens->back(), "ectable");
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges")->size(), 48900u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges")->front(), "\xC4\xA0 t");
  const auto types = f->get_int_array("tokenizer.ggml.token_type");
  ASSERT_EQ(types->size(), 49152u);
  EXPECT_EQ((*types)[0], 3);

  const GgufTensorInfo* embd = f->find_tensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->type, GgmlType::kQ8_0);
  EXPECT_EQ(embd->dims, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(embd->n_elements(), 576 * 49152);
  EXPECT_EQ(embd->n_bytes, 30081024u);
  const GgufTensorInfo* down = f->find_tensor("blk.0.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->type, GgmlType::kQ4_1);
  EXPECT_EQ(down->dims, (std::vector<int64_t>{1536, 576}));
  EXPECT_EQ(down->n_bytes, 552960u);
  EXPECT_EQ(f->find_tensor("blk.0.attn_norm.weight")->type, GgmlType::kF32);
  EXPECT_EQ(f->find_tensor("no.such.tensor"), nullptr);

  // The mapped data is the file's bytes: token_embd starts at file offset 1785664 (gguf-py) and
  // output_norm.weight, the last tensor, ends at the last byte of the file.
  const Bytes bytes = read_file(path);
  ASSERT_EQ(bytes.size(), 98362432u);
  EXPECT_EQ(std::memcmp(embd->data, bytes.data() + 1785664, 4096), 0);
  const GgufTensorInfo& last = f->tensors().back();
  EXPECT_EQ(last.name, "output_norm.weight");
  EXPECT_EQ(last.data - embd->data, 98360128 - 1785664);
  EXPECT_EQ(std::memcmp(last.data, bytes.data() + 98360128, 2304), 0);

  // The same bytes parsed from memory give the same table at the same relative offsets.
  auto g = GgufFile::parse(bytes.data(), bytes.size(), "copy");
  ASSERT_EQ(g->tensors().size(), f->tensors().size());
  for (size_t i = 0; i < g->tensors().size(); ++i) {
    EXPECT_EQ(g->tensors()[i].name, f->tensors()[i].name);
    EXPECT_EQ(g->tensors()[i].offset, f->tensors()[i].offset);
    EXPECT_EQ(g->tensors()[i].data - bytes.data(), f->tensors()[i].data - embd->data + 1785664);
  }
}

TEST(GgufRealFile, TinyLlamaFixture) {
  const std::string path = tiny_path();
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing";
  auto f = GgufFile::open(path);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->tensors().size(), 12u);
  EXPECT_EQ(f->metadata().size(), 18u);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(f->get_int("llama.embedding_length"), 8);
  const auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens->size(), 32000u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  const auto scores = f->get_float_array("tokenizer.ggml.scores");
  ASSERT_EQ(scores->size(), 32000u);
  EXPECT_EQ((*scores)[300], -41.0);
  const GgufTensorInfo* out = f->find_tensor("output.weight");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->type, GgmlType::kF16);
  EXPECT_EQ(out->dims, (std::vector<int64_t>{8, 32000}));
  EXPECT_EQ(out->n_bytes, 512000u);
  const Bytes bytes = read_file(path);
  ASSERT_EQ(bytes.size(), 1750560u);
  EXPECT_EQ(std::memcmp(out->data, bytes.data() + 1238560, out->n_bytes), 0);
}

TEST(GgufOpen, MissingFileIsNotFound) {
  expect_error([] { GgufFile::open("/nonexistent/dir/model.gguf"); }, StatusCode::kNotFound,
               {"/nonexistent/dir/model.gguf"});
}

TEST(GgufOpen, DirectoryIsIoError) {
  const std::string dir = ::testing::TempDir();
  expect_error([&] { GgufFile::open(dir); }, StatusCode::kIo, {dir});
}

TEST(GgufOpen, EmptyFileIsCorrupt) {
  const std::string path = ::testing::TempDir() + "/certkv_empty.gguf";
  { std::ofstream out(path, std::ios::binary); }
  expect_error([&] { GgufFile::open(path); }, StatusCode::kCorrupt, {path, "magic"});
  std::filesystem::remove(path);
}

TEST(GgufOpen, MapsAWrittenFile) {
  const Bytes b = build(small_spec());
  const std::string path = ::testing::TempDir() + "/certkv_small.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(b.data()), b.size());
  }
  auto f = GgufFile::open(path);
  EXPECT_EQ(f->name(), path);
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(std::memcmp(f->tensors()[1].data, pattern(34, 2).data(), 34), 0);
  std::filesystem::remove(path);
}

// ---- Synthetic files ----

class GgufVersions : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersions, EveryValueType) {
  GgufSpec s;
  s.version = GetParam();
  s.kvs.emplace_back("u8", scalar<uint8_t>(GgufType::kUint8, 250));
  s.kvs.emplace_back("i8", scalar<int8_t>(GgufType::kInt8, -7));
  s.kvs.emplace_back("u16", scalar<uint16_t>(GgufType::kUint16, 65000));
  s.kvs.emplace_back("i16", scalar<int16_t>(GgufType::kInt16, -32000));
  s.kvs.emplace_back("u32", scalar<uint32_t>(GgufType::kUint32, 4000000000u));
  s.kvs.emplace_back("i32", scalar<int32_t>(GgufType::kInt32, -2000000000));
  s.kvs.emplace_back("u64", scalar<uint64_t>(GgufType::kUint64, 9000000000000000000ull));
  s.kvs.emplace_back("i64", scalar<int64_t>(GgufType::kInt64, -9000000000000000000ll));
  s.kvs.emplace_back("f32", scalar<float>(GgufType::kFloat32, 0.375f));
  s.kvs.emplace_back("f64", scalar<double>(GgufType::kFloat64, -1e300));
  s.kvs.emplace_back("b0", scalar<uint8_t>(GgufType::kBool, 0));
  s.kvs.emplace_back("b1", scalar<uint8_t>(GgufType::kBool, 1));
  s.kvs.emplace_back("str", string_value("h\xC3\xA9llo\n"));
  s.kvs.emplace_back("empty", string_value(""));
  s.kvs.emplace_back("a.u8", array_value<uint8_t>(GgufType::kUint8, {1, 2, 255}));
  s.kvs.emplace_back("a.i8", array_value<int8_t>(GgufType::kInt8, {-128, 127}));
  s.kvs.emplace_back("a.u16", array_value<uint16_t>(GgufType::kUint16, {65535}));
  s.kvs.emplace_back("a.i16", array_value<int16_t>(GgufType::kInt16, {-1, 3}));
  s.kvs.emplace_back("a.u32", array_value<uint32_t>(GgufType::kUint32, {7, 4294967295u}));
  s.kvs.emplace_back("a.i32", array_value<int32_t>(GgufType::kInt32, {-5, 17, 129}));
  s.kvs.emplace_back("a.u64", array_value<uint64_t>(GgufType::kUint64, {501}));
  s.kvs.emplace_back("a.i64", array_value<int64_t>(GgufType::kInt64, {-3771}));
  s.kvs.emplace_back("a.f32", array_value<float>(GgufType::kFloat32, {1.5f, -0.25f}));
  s.kvs.emplace_back("a.f64", array_value<double>(GgufType::kFloat64, {3.0, 1e-300}));
  s.kvs.emplace_back("a.bool", array_value<uint8_t>(GgufType::kBool, {1, 0, 1}));
  s.kvs.emplace_back("a.str", string_array_value({"x", "", "yz"}));
  s.kvs.emplace_back("a.empty", array_value<uint32_t>(GgufType::kUint32, {}));
  s.tensors.push_back({"t", {17}, 0, pattern(68, 3), std::nullopt});
  const Bytes b = build(s);
  auto f = GgufFile::parse(b.data(), b.size(), "values.gguf");

  EXPECT_EQ(f->version(), GetParam());
  EXPECT_EQ(f->metadata().size(), 27u);
  EXPECT_EQ(f->get_int("u8"), 250);
  EXPECT_EQ(f->get_int("i8"), -7);
  EXPECT_EQ(f->get_int("u16"), 65000);
  EXPECT_EQ(f->get_int("i16"), -32000);
  EXPECT_EQ(f->get_int("u32"), 4000000000ll);
  EXPECT_EQ(f->get_int("i32"), -2000000000);
  EXPECT_EQ(f->get_int("u64"), 9000000000000000000ll);
  EXPECT_EQ(f->get_int("i64"), -9000000000000000000ll);
  EXPECT_EQ(f->get_float("f32"), 0.375);
  EXPECT_EQ(f->get_float("f64"), -1e300);
  EXPECT_EQ(f->get_float("u8"), 250.0);
  EXPECT_EQ(f->get_bool("b0"), false);
  EXPECT_EQ(f->get_bool("b1"), true);
  EXPECT_EQ(f->get_string("str"), "h\xC3\xA9llo\n");
  EXPECT_EQ(f->get_string("empty"), "");
  EXPECT_EQ(f->get_int_array("a.u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f->get_int_array("a.i8"), (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(f->get_int_array("a.u16"), (std::vector<int64_t>{65535}));
  EXPECT_EQ(f->get_int_array("a.i16"), (std::vector<int64_t>{-1, 3}));
  EXPECT_EQ(f->get_int_array("a.u32"), (std::vector<int64_t>{7, 4294967295ll}));
  EXPECT_EQ(f->get_int_array("a.i32"), (std::vector<int64_t>{-5, 17, 129}));
  EXPECT_EQ(f->get_int_array("a.u64"), (std::vector<int64_t>{501}));
  EXPECT_EQ(f->get_int_array("a.i64"), (std::vector<int64_t>{-3771}));
  EXPECT_EQ(f->get_float_array("a.f32"), (std::vector<double>{1.5, -0.25}));
  EXPECT_EQ(f->get_float_array("a.f64"), (std::vector<double>{3.0, 1e-300}));
  EXPECT_EQ(f->get_float_array("a.i32"), (std::vector<double>{-5, 17, 129}));
  EXPECT_EQ(f->get_string_array("a.str"), (std::vector<std::string>{"x", "", "yz"}));
  EXPECT_EQ(f->get_int_array("a.empty"), std::vector<int64_t>{});
  const GgufValue& bools = f->metadata().at("a.bool");
  EXPECT_EQ(bools.type, GgufType::kArray);
  EXPECT_EQ(bools.array_type, GgufType::kBool);
  EXPECT_EQ(std::get<std::vector<bool>>(bools.value), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(f->metadata().at("a.u16").array_type, GgufType::kUint16);
  EXPECT_EQ(f->metadata().at("u16").type, GgufType::kUint16);

  ASSERT_EQ(f->tensors().size(), 1u);
  const GgufTensorInfo& t = f->tensors()[0];
  EXPECT_EQ(t.type, GgmlType::kF32);
  EXPECT_EQ(t.n_bytes, 68u);
  EXPECT_EQ(std::memcmp(t.data, pattern(68, 3).data(), 68), 0);
  EXPECT_EQ((t.data - b.data()) % 32, 0);
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersions, ::testing::Values(2u, 3u));

TEST(GgufSynthetic, TensorGeometryForEveryKnownType) {
  GgufSpec s;
  struct Case { GgmlType type; std::vector<uint64_t> dims; uint64_t n_bytes; };
  const std::vector<Case> cases = {
      {GgmlType::kF32, {3}, 12},          {GgmlType::kF16, {17, 3}, 102},
      {GgmlType::kBF16, {1, 1, 1, 501}, 1002}, {GgmlType::kQ4_0, {64, 3}, 108},
      {GgmlType::kQ4_1, {32, 2, 1}, 40},  {GgmlType::kQ5_0, {32}, 22},
      {GgmlType::kQ5_1, {96}, 72},        {GgmlType::kQ8_0, {32, 17}, 578},
      {GgmlType::kQ8_1, {32}, 36},        {GgmlType::kQ2_K, {256}, 84},
      {GgmlType::kQ3_K, {256, 2}, 220},   {GgmlType::kQ4_K, {512}, 288},
      {GgmlType::kQ5_K, {256}, 176},      {GgmlType::kQ6_K, {256, 3}, 630},
      {GgmlType::kQ8_K, {256}, 292},      {GgmlType::kF32, {0, 5}, 0},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    s.tensors.push_back({"t" + std::to_string(i), cases[i].dims,
                         static_cast<uint32_t>(cases[i].type),
                         pattern(cases[i].n_bytes, static_cast<uint8_t>(i)), std::nullopt});
  }
  const Bytes b = build(s);
  auto f = GgufFile::parse(b.data(), b.size(), "types.gguf");
  ASSERT_EQ(f->tensors().size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const GgufTensorInfo& t = f->tensors()[i];
    EXPECT_EQ(t.name, "t" + std::to_string(i));
    EXPECT_EQ(t.type, cases[i].type);
    EXPECT_EQ(t.n_bytes, cases[i].n_bytes) << ggml_type_name(cases[i].type);
    EXPECT_EQ(t.dims.size(), cases[i].dims.size());
    EXPECT_EQ(t.offset % 32, 0u);
    const Bytes expected = pattern(cases[i].n_bytes, static_cast<uint8_t>(i));
    EXPECT_TRUE(std::equal(expected.begin(), expected.end(), t.data));
  }
}

TEST(GgufSynthetic, ZeroDimensionTensorIsAScalar) {
  GgufSpec s;
  s.tensors.push_back({"scalar", {}, 0, pattern(4, 9), std::nullopt});
  const Bytes b = build(s);
  auto f = GgufFile::parse(b.data(), b.size(), "scalar.gguf");
  EXPECT_EQ(f->tensors()[0].n_elements(), 1);
  EXPECT_EQ(f->tensors()[0].n_bytes, 4u);
}

TEST(GgufSynthetic, NoTensors) {
  GgufSpec s;
  s.kvs.emplace_back("k", scalar<uint32_t>(GgufType::kUint32, 1));
  const Bytes b = build(s);
  auto f = GgufFile::parse(b.data(), b.size(), "empty.gguf");
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(f->get_int("k"), 1);
}

TEST(GgufSynthetic, AlignmentKeyPlacesData) {
  for (uint32_t alignment : {1u, 8u, 64u, 4096u}) {
    GgufSpec s;
    s.alignment = alignment;
    s.kvs.emplace_back("general.alignment", scalar<uint32_t>(GgufType::kUint32, alignment));
    s.tensors.push_back({"a", {3}, 0, pattern(12, 4), std::nullopt});
    s.tensors.push_back({"b", {5}, 1, pattern(10, 5), std::nullopt});
    const Bytes b = build(s);
    auto f = GgufFile::parse(b.data(), b.size(), "aligned.gguf");
    EXPECT_EQ(f->alignment(), alignment);
    ASSERT_EQ(f->tensors().size(), 2u);
    EXPECT_EQ(f->tensors()[1].offset, align_up(12, alignment));
    EXPECT_EQ((f->tensors()[0].data - b.data()) % alignment, 0);
    EXPECT_EQ(std::memcmp(f->tensors()[1].data, pattern(10, 5).data(), 10), 0);
  }
}

TEST(GgufSynthetic, BadAlignmentValues) {
  for (uint32_t alignment : {0u, 3u, 48u}) {
    GgufSpec s = small_spec();
    s.kvs.emplace_back("general.alignment", scalar<uint32_t>(GgufType::kUint32, alignment));
    expect_corrupt(build(s), {"bad.gguf", "general.alignment", std::to_string(alignment)});
  }
  GgufSpec s = small_spec();
  s.kvs.emplace_back("general.alignment", scalar<uint64_t>(GgufType::kUint64, 32));
  expect_corrupt(build(s), {"general.alignment", "uint64"});
}

TEST(GgufSynthetic, TypedGettersRejectOtherTypes) {
  const Bytes b = build(small_spec());
  auto f = GgufFile::parse(b.data(), b.size(), "small.gguf");
  EXPECT_EQ(f->get_int("absent"), std::nullopt);
  EXPECT_EQ(f->get_string_array("absent"), std::nullopt);
  EXPECT_TRUE(f->has("llama.block_count"));
  EXPECT_FALSE(f->has("absent"));
  expect_error([&] { f->get_int("general.architecture"); }, StatusCode::kCorrupt,
               {"small.gguf", "general.architecture", "string"});
  expect_error([&] { f->get_string("llama.block_count"); }, StatusCode::kCorrupt,
               {"llama.block_count", "uint32"});
  expect_error([&] { f->get_bool("llama.block_count"); }, StatusCode::kCorrupt, {"bool"});
  expect_error([&] { f->get_float("general.architecture"); }, StatusCode::kCorrupt, {"number"});
  expect_error([&] { f->get_int_array("tokenizer.ggml.tokens"); }, StatusCode::kCorrupt,
               {"array of string"});
  expect_error([&] { f->get_float_array("tokenizer.ggml.tokens"); }, StatusCode::kCorrupt,
               {"array of string"});
  expect_error([&] { f->get_string_array("llama.block_count"); }, StatusCode::kCorrupt,
               {"uint32"});
}

// ---- Corruption ----

TEST(GgufCorrupt, WrongMagic) {
  Bytes b = build(small_spec());
  b[3] = 'X';
  expect_corrupt(b, {"bad.gguf", "magic"});
}

TEST(GgufCorrupt, UnsupportedVersions) {
  for (uint32_t version : {0u, 1u, 4u, 99u}) {
    const Bytes b = build(small_spec(version));
    expect_error([&] { parse_copy(b, b.size(), "old.gguf"); }, StatusCode::kUnsupported,
                 {"old.gguf", "version " + std::to_string(version)});
  }
  const Bytes b = build(small_spec(0x03000000u));
  expect_error([&] { parse_copy(b, b.size(), "be.gguf"); }, StatusCode::kUnsupported,
               {"be.gguf", "big-endian"});
}

TEST(GgufCorrupt, TruncatedAtEveryOffset) {
  for (uint32_t version : {2u, 3u}) {
    const Bytes b = build(small_spec(version));
    ASSERT_NO_THROW(parse_copy(b, b.size()));
    for (size_t n = 0; n < b.size(); ++n) {
      EXPECT_THROW(parse_copy(b, n), Error) << "truncated to " << n << " of " << b.size();
    }
  }
}

TEST(GgufCorrupt, EveryByteFlippedNeverCrashes) {
  const Bytes b = build(small_spec());
  size_t n_errors = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff}) {
      Bytes c = b;
      c[i] ^= mask;
      try {
        parse_copy(c, c.size());
      } catch (const Error&) {
        ++n_errors;
      }
    }
  }
  EXPECT_GT(n_errors, 0u);
}

TEST(GgufCorrupt, TensorPastEnd) {
  GgufSpec s = small_spec();
  s.tensors[1].offset = 1024;
  Bytes b = build(s);
  b.resize(b.size() - 1);  // the writer filled up to the tensor; cut its last byte
  expect_corrupt(b, {"bad.gguf", "tensor 'w.q8'", "past the end"});

  GgufSpec huge = small_spec();
  huge.tensors[0].offset = 0xffffffffffffffe0ull;  // aligned, and would wrap a 64-bit sum
  huge.tensors[0].data.clear();
  huge.tensors.resize(1);
  expect_corrupt(build(huge), {"tensor 'w.f32'", "past the end"});
}

TEST(GgufCorrupt, MisalignedOffset) {
  GgufSpec s = small_spec();
  s.tensors[1].offset = 40;
  expect_corrupt(build(s), {"bad.gguf", "tensor 'w.q8'", "offset 40", "alignment 32"});
}

TEST(GgufCorrupt, TooManyDimensions) {
  GgufSpec s = small_spec();
  s.tensors[0].dims = {3, 2, 1, 1, 1};
  expect_corrupt(build(s), {"tensor 'w.f32'", "5 dimensions"});
}

TEST(GgufCorrupt, ElementCountOverflow) {
  GgufSpec s = small_spec();
  s.tensors[0].dims = {1ull << 32, 1ull << 32};
  expect_corrupt(build(s), {"tensor 'w.f32'", "int64"});
  s.tensors[0].dims = {1ull << 63};
  expect_corrupt(build(s), {"tensor 'w.f32'", "dimension 0"});
  s.tensors[0].dims = {1ull << 62};  // fits int64 elements, but 4 bytes each does not fit 64 bits
  expect_corrupt(build(s), {"tensor 'w.f32'", "bytes"});
}

TEST(GgufCorrupt, RowNotAWholeNumberOfBlocks) {
  GgufSpec s = small_spec();
  s.tensors[1].dims = {33, 1};
  expect_corrupt(build(s), {"tensor 'w.q8'", "Q8_0", "33"});
}

TEST(GgufCorrupt, HugeStringLength) {
  Bytes b = {'G', 'G', 'U', 'F'};
  put<uint32_t>(b, 3);
  put<uint64_t>(b, 0);
  put<uint64_t>(b, 1);
  put<uint64_t>(b, 0x7fffffffffffffffull);  // key length
  append(b, Bytes(64, 'k'));
  expect_corrupt(b, {"bad.gguf", "key/value 0 key length", "past the end"});

  GgufSpec s = small_spec();
  Bytes v;
  put<uint32_t>(v, static_cast<uint32_t>(GgufType::kString));
  put<uint64_t>(v, 0xffffffffffffffffull);
  s.kvs.emplace_back("s", v);
  expect_corrupt(build(s), {"value of 's' length"});
}

TEST(GgufCorrupt, HugeArrayCount) {
  for (GgufType element : {GgufType::kUint8, GgufType::kString, GgufType::kFloat64}) {
    GgufSpec s = small_spec();
    Bytes v;
    put<uint32_t>(v, static_cast<uint32_t>(GgufType::kArray));
    put<uint32_t>(v, static_cast<uint32_t>(element));
    put<uint64_t>(v, 0x4000000000000000ull);
    s.kvs.emplace_back("arr", v);
    expect_corrupt(build(s), {"value of 'arr' element count", "past the end"});
  }
}

TEST(GgufCorrupt, HugeCounts) {
  Bytes b = build(small_spec());
  Bytes c = b;
  const uint64_t huge = 0x0100000000000000ull;
  std::memcpy(c.data() + 8, &huge, 8);
  expect_corrupt(c, {"tensor_count"});
  c = b;
  std::memcpy(c.data() + 16, &huge, 8);
  expect_corrupt(c, {"kv_count"});
}

TEST(GgufCorrupt, UnknownValueType) {
  GgufSpec s = small_spec();
  s.kvs.emplace_back("odd", scalar<uint32_t>(static_cast<GgufType>(13), 0));
  expect_corrupt(build(s), {"value of 'odd'", "unknown value type 13"});
  GgufSpec a = small_spec();
  a.kvs.emplace_back("odd", array_value<uint32_t>(static_cast<GgufType>(200), {1}));
  expect_corrupt(build(a), {"value of 'odd' element", "unknown value type 200"});
}

TEST(GgufCorrupt, ArrayOfArrays) {
  GgufSpec s = small_spec();
  s.kvs.emplace_back("nested", array_value<uint32_t>(GgufType::kArray, {}));
  expect_corrupt(build(s), {"'nested'", "array of arrays"});
}

TEST(GgufCorrupt, BadScalars) {
  GgufSpec s = small_spec();
  s.kvs.emplace_back("flag", scalar<uint8_t>(GgufType::kBool, 2));
  expect_corrupt(build(s), {"'flag'", "bool"});
  GgufSpec u = small_spec();
  u.kvs.emplace_back("big", scalar<uint64_t>(GgufType::kUint64, 1ull << 63));
  expect_corrupt(build(u), {"'big'", "int64"});
}

TEST(GgufCorrupt, UnknownGgmlType) {
  for (uint32_t type_id : {4u, 5u, 16u, 29u, 99u}) {
    GgufSpec s = small_spec();
    s.tensors[0].type = type_id;
    const Bytes b = build(s);
    expect_error([&] { parse_copy(b, b.size(), "t.gguf"); }, StatusCode::kUnsupported,
                 {"t.gguf", "tensor 'w.f32'", "type id " + std::to_string(type_id)});
  }
}

TEST(GgufCorrupt, DuplicateKey) {
  GgufSpec s = small_spec();
  s.kvs.emplace_back("llama.block_count", scalar<uint32_t>(GgufType::kUint32, 3));
  expect_corrupt(build(s), {"bad.gguf", "duplicate metadata key 'llama.block_count'"});
}

TEST(GgufCorrupt, DuplicateTensorName) {
  GgufSpec s = small_spec();
  s.tensors[1].name = "w.f32";
  expect_corrupt(build(s), {"bad.gguf", "duplicate tensor name 'w.f32'"});
}

}  // namespace
}  // namespace certkv::model
