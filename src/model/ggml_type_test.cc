#include "model/ggml_type.h"

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "core/status.h"

namespace certkv::model {
namespace {

using format::GgmlType;

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

TEST(GgmlType, KnownBlockSizes) {
  struct Case { GgmlType type; const char* name; int64_t elements; size_t bytes; };
  const Case cases[] = {
      {GgmlType::kF32, "F32", 1, 4},       {GgmlType::kF16, "F16", 1, 2},
      {GgmlType::kBF16, "BF16", 1, 2},     {GgmlType::kQ4_0, "Q4_0", 32, 18},
      {GgmlType::kQ4_1, "Q4_1", 32, 20},   {GgmlType::kQ5_0, "Q5_0", 32, 22},
      {GgmlType::kQ5_1, "Q5_1", 32, 24},   {GgmlType::kQ8_0, "Q8_0", 32, 34},
      {GgmlType::kQ8_1, "Q8_1", 32, 36},   {GgmlType::kQ2_K, "Q2_K", 256, 84},
      {GgmlType::kQ3_K, "Q3_K", 256, 110}, {GgmlType::kQ4_K, "Q4_K", 256, 144},
      {GgmlType::kQ5_K, "Q5_K", 256, 176}, {GgmlType::kQ6_K, "Q6_K", 256, 210},
      {GgmlType::kQ8_K, "Q8_K", 256, 292},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(ggml_type_known(static_cast<uint32_t>(c.type)));
    EXPECT_STREQ(ggml_type_name(c.type), c.name);
    EXPECT_EQ(ggml_block_elements(c.type), c.elements);
    EXPECT_EQ(ggml_block_bytes(c.type), c.bytes);
    EXPECT_EQ(ggml_row_bytes(c.type, 0), 0u);
    EXPECT_EQ(ggml_row_bytes(c.type, c.elements * 3), c.bytes * 3);
    EXPECT_EQ(ggml_row_bytes(c.type, c.elements * 501), c.bytes * 501);
  }
  EXPECT_EQ(ggml_row_bytes(GgmlType::kF16, 17), 34u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kQ4_1, 576), 360u);
}

TEST(GgmlType, UnknownTypes) {
  for (uint32_t id : {4u, 5u, 16u, 29u, 31u, 1000u}) {
    const auto type = static_cast<GgmlType>(id);
    EXPECT_FALSE(ggml_type_known(id));
    EXPECT_STREQ(ggml_type_name(type), "unknown");
    EXPECT_EQ(ggml_block_elements(type), 0);
    EXPECT_EQ(ggml_block_bytes(type), 0u);
    expect_error([&] { ggml_row_bytes(type, 32); }, StatusCode::kUnsupported,
                 {std::to_string(id)});
  }
}

TEST(GgmlType, RowBytesRejectsPartialBlocks) {
  expect_error([] { ggml_row_bytes(GgmlType::kQ8_0, 33); }, StatusCode::kInvalidArgument,
               {"33", "Q8_0", "32"});
  expect_error([] { ggml_row_bytes(GgmlType::kQ4_K, 255); }, StatusCode::kInvalidArgument,
               {"255", "Q4_K"});
  expect_error([] { ggml_row_bytes(GgmlType::kF32, -1); }, StatusCode::kInvalidArgument, {"-1"});
}

}  // namespace
}  // namespace certkv::model
