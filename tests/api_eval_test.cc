// The C API's file writer and evaluations (what the certkv CLI stands on): safetensors writing,
// teacher-forced quality, needle tasks and GAAC measured on KV dumps; every bad input a status
// and a message naming the argument or file, never a crash.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "test_paths.h"

namespace {

using certkv::testing::test_data_path;

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("certkv_api_eval_" + std::to_string(getpid()) + "_" + name)).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool error_names(const std::string& what) { return std::string(certkv_last_error()).find(what) != std::string::npos; }

// ---- certkv_safetensors_write ------------------------------------------------------------------

TEST(CApiFiles, SafetensorsWriteLaysOutHeaderAndData) {
  const std::string path = temp_path("write.safetensors");
  const std::vector<float> a = {1.0f, -2.5f, 3.0f, 4.0f, 5.0f, 6.0f};
  const std::vector<int32_t> b = {7, 8, 9};
  const int64_t shape_a[] = {2, 3}, shape_b[] = {3};
  const certkv_tensor_view tensors[] = {{"a", "F32", shape_a, 2, a.data(), a.size() * 4},
                                        {"b", "I32", shape_b, 1, b.data(), b.size() * 4}};
  const certkv_metadata_entry meta[] = {{"format", "test/1"}, {"note", "two tensors"}};
  ASSERT_EQ(certkv_safetensors_write(path.c_str(), tensors, 2, meta, 2), CERTKV_OK) << certkv_last_error();
  const std::string bytes = read_file(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  EXPECT_EQ(header_bytes % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + header_bytes + 24 + 12);
  const std::string header = bytes.substr(8, header_bytes);
  EXPECT_NE(header.find("\"a\":{\"dtype\":\"F32\",\"shape\":[2, 3],\"data_offsets\":[0,24]}"), std::string::npos) << header;
  EXPECT_NE(header.find("\"b\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[24,36]}"), std::string::npos) << header;
  EXPECT_NE(header.find("\"note\":\"two tensors\""), std::string::npos) << header;
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_bytes, a.data(), 24), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + header_bytes + 24, b.data(), 12), 0);
  std::filesystem::remove(path);
}

TEST(CApiFiles, SafetensorsWriteRefusesBadInput) {
  const std::string path = temp_path("bad.safetensors");
  const float x[4] = {0, 1, 2, 3};
  const int64_t shape[] = {4};
  const certkv_tensor_view good = {"x", "F32", shape, 1, x, sizeof x};
  EXPECT_EQ(certkv_safetensors_write(nullptr, &good, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("null path")) << certkv_last_error();
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), nullptr, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_tensor_view bad_dtype = {"x", "Q9", shape, 1, x, sizeof x};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &bad_dtype, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("Q9")) << certkv_last_error();
  const certkv_tensor_view short_data = {"x", "F32", shape, 1, x, 12};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &short_data, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_tensor_view null_name = {nullptr, "F32", shape, 1, x, sizeof x};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &null_name, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_tensor_view too_many_dims = {"x", "F32", shape, 9, x, sizeof x};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &too_many_dims, 1, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_tensor_view twice[] = {good, good};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), twice, 2, nullptr, 0), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_metadata_entry repeated[] = {{"k", "1"}, {"k", "2"}};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &good, 1, repeated, 2), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("'k' given twice")) << certkv_last_error();
  const certkv_metadata_entry null_value[] = {{"k", nullptr}};
  EXPECT_EQ(certkv_safetensors_write(path.c_str(), &good, 1, null_value, 1), CERTKV_ERR_INVALID_ARGUMENT);
  const std::string unwritable = "/nonexistent-dir/x.safetensors";
  EXPECT_EQ(certkv_safetensors_write(unwritable.c_str(), &good, 1, nullptr, 0), CERTKV_ERR_IO);
  EXPECT_TRUE(error_names(unwritable)) << certkv_last_error();
  EXPECT_FALSE(std::filesystem::exists(path));
}

// ---- Teacher-forced quality ------------------------------------------------------------------

TEST(CApiEval, CompareLogitsAndSummarize) {
  const std::vector<float> ref = {1, 2, 3, 4, 5, 6, 7};
  certkv_position_quality same;
  ASSERT_EQ(certkv_compare_logits(ref.data(), ref.data(), 7, &same), CERTKV_OK) << certkv_last_error();
  EXPECT_NEAR(same.kl, 0.0, 1e-12);
  EXPECT_EQ(same.top1_agree, 1);
  EXPECT_EQ(same.top5_overlap, 1.0);
  // The test distribution swaps the two most likely tokens: top-1 differs, top-5 still agrees.
  std::vector<float> swapped = ref;
  std::swap(swapped[5], swapped[6]);
  certkv_position_quality differ;
  ASSERT_EQ(certkv_compare_logits(ref.data(), swapped.data(), 7, &differ), CERTKV_OK);
  EXPECT_GT(differ.kl, 0.1);
  EXPECT_EQ(differ.top1_agree, 0);
  EXPECT_EQ(differ.top5_overlap, 1.0);

  const certkv_position_quality positions[] = {same, differ};
  certkv_quality_summary s;
  ASSERT_EQ(certkv_quality_summarize(positions, 2, &s), CERTKV_OK);
  EXPECT_EQ(s.n_positions, 2);
  EXPECT_DOUBLE_EQ(s.mean_kl, differ.kl / 2);
  EXPECT_DOUBLE_EQ(s.max_kl, differ.kl);
  EXPECT_DOUBLE_EQ(s.top1, 0.5);
  EXPECT_DOUBLE_EQ(s.top5, 1.0);
  ASSERT_EQ(certkv_quality_summarize(nullptr, 0, &s), CERTKV_OK);
  EXPECT_EQ(s.n_positions, 0);
  EXPECT_EQ(s.mean_kl, 0.0);
}

TEST(CApiEval, QualityRefusesBadInput) {
  const std::vector<float> ref = {1, 2, 3};
  std::vector<float> test = {1, NAN, 3};
  certkv_position_quality q;
  EXPECT_EQ(certkv_compare_logits(ref.data(), test.data(), 3, &q), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("test")) << certkv_last_error();
  EXPECT_EQ(certkv_compare_logits(nullptr, ref.data(), 3, &q), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_compare_logits(ref.data(), ref.data(), 0, &q), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_compare_logits(ref.data(), ref.data(), 3, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_quality_summary s;
  const certkv_position_quality negative = {-1.0, 1, 1.0};
  EXPECT_EQ(certkv_quality_summarize(&negative, 1, &s), CERTKV_ERR_INVALID_ARGUMENT);
  const certkv_position_quality overlap = {0.0, 1, 1.5};
  EXPECT_EQ(certkv_quality_summarize(&overlap, 1, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_quality_summarize(nullptr, 1, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_quality_summarize(&negative, 1, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
}

// ---- Needle tasks ----------------------------------------------------------------------------

// A token is about four bytes of English.
int64_t count_by_bytes(void*, const char*, size_t n_bytes) { return int64_t(n_bytes / 4) + 1; }
int64_t count_fails(void*, const char*, size_t) { return -1; }

TEST(CApiEval, NeedleTaskIsGeneratedAndScored) {
  certkv_needle_params p = certkv_needle_default_params();
  p.target_tokens = 512;
  p.seed = 7;
  certkv_needle_task* task = nullptr;
  ASSERT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_OK) << certkv_last_error();
  certkv_needle_task_info info;
  ASSERT_EQ(certkv_needle_task_get_info(task, &info), CERTKV_OK);
  EXPECT_EQ(info.n_answers, 1);
  EXPECT_EQ(std::strlen(info.first_answer), 7u);
  EXPECT_NE(std::string(info.context).find(info.first_answer), std::string::npos);
  EXPECT_NE(std::string(info.question).find("special magic number"), std::string::npos) << info.question;
  EXPECT_LE(info.prompt_tokens, 512);
  EXPECT_GE(info.prompt_tokens, 460);
  const std::string right = std::string(" ") + info.first_answer + ".";
  int exact = -1;
  double recall = -1;
  ASSERT_EQ(certkv_needle_score(task, right.data(), right.size(), &exact, &recall), CERTKV_OK);
  EXPECT_EQ(exact, 1);
  EXPECT_EQ(recall, 1.0);
  const std::string wrong = " 1234567";
  ASSERT_EQ(certkv_needle_score(task, wrong.data(), wrong.size(), &exact, &recall), CERTKV_OK);
  EXPECT_EQ(exact, std::string(info.first_answer) == "1234567" ? 1 : 0);
  ASSERT_EQ(certkv_needle_score(task, nullptr, 0, &exact, nullptr), CERTKV_OK);
  EXPECT_EQ(exact, 0);
  certkv_needle_task_free(task);

  // A corpus haystack from the repository's book prefixes, multi-key.
  const std::string book = test_data_path("corpus/wells-time-machine.txt");
  const char* paths[] = {book.c_str()};
  p.corpus_paths = paths;
  p.n_corpus_paths = 1;
  p.variant = "multi-key";
  ASSERT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_needle_task_get_info(task, &info), CERTKV_OK);
  EXPECT_GE(info.n_answers, 1);
  certkv_needle_task_free(task);
}

TEST(CApiEval, NeedleRefusesBadInput) {
  certkv_needle_params p = certkv_needle_default_params();
  p.target_tokens = 512;
  certkv_needle_task* task = reinterpret_cast<certkv_needle_task*>(0x1);
  EXPECT_EQ(certkv_needle_check_variant("single"), CERTKV_OK);
  EXPECT_EQ(certkv_needle_check_variant("multi-everything"), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("multi-everything")) << certkv_last_error();
  EXPECT_EQ(certkv_needle_check_variant(nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  p.variant = "multi-everything";
  EXPECT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(task, nullptr);
  p.variant = nullptr;
  EXPECT_EQ(certkv_needle_task_create(&p, nullptr, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_needle_task_create(nullptr, count_by_bytes, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_needle_task_create(&p, count_fails, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("count_tokens")) << certkv_last_error();
  p.target_tokens = 10;
  EXPECT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("target_tokens")) << certkv_last_error();
  p.target_tokens = 512;
  const char* missing[] = {"/nonexistent/book.txt"};
  p.corpus_paths = missing;
  p.n_corpus_paths = 1;
  EXPECT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_ERR_NOT_FOUND);
  EXPECT_TRUE(error_names("/nonexistent/book.txt")) << certkv_last_error();
  p.corpus_paths = nullptr;
  EXPECT_EQ(certkv_needle_task_create(&p, count_by_bytes, nullptr, &task), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_needle_task_info info;
  EXPECT_EQ(certkv_needle_task_get_info(nullptr, &info), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_needle_score(nullptr, "1", 1, nullptr, nullptr), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_needle_task_free(nullptr);
}

// ---- GAAC on KV dumps ------------------------------------------------------------------------

uint16_t bf16_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// A KV dump (docs/format/kv_dump.md) of `layers` layers, 2 kv heads, head_dim 32, `tokens`
// tokens: smooth values of a few octaves per channel, as real keys and values are.
void write_kv_dump(const std::string& path, int layers, int tokens) {
  const int heads = 2, hd = 32;
  std::vector<std::vector<uint16_t>> data;
  std::vector<std::string> names;
  data.reserve(size_t(2 * layers));
  names.reserve(size_t(2 * layers));
  const int64_t shape[] = {heads, tokens, hd};
  std::vector<certkv_tensor_view> views;
  uint32_t state = 12345;
  for (int l = 0; l < layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint16_t>& rows = data.emplace_back(size_t(heads) * tokens * hd);
      for (size_t i = 0; i < rows.size(); ++i) {
        state = state * 1664525u + 1013904223u;
        const float u = float(state >> 8) / float(1 << 24) - 0.5f;
        const int channel = int(i % hd);
        rows[i] = bf16_of(u * std::ldexp(1.0f, channel % 4 - 1));
      }
      names.push_back("layer" + std::to_string(l) + (kv == 0 ? ".k" : ".v"));
      views.push_back({names.back().c_str(), "BF16", shape, 3, rows.data(), rows.size() * 2});
    }
  std::string layer_list;
  for (int l = 0; l < layers; ++l) {
    if (l > 0) layer_list += ',';
    layer_list += std::to_string(l);
  }
  const std::string n_layers = std::to_string(layers), n_tokens = std::to_string(tokens);
  const certkv_metadata_entry meta[] = {{"format", "certkv-kv-dump/1"}, {"n_layers", n_layers.c_str()},
                                        {"n_kv_heads", "2"},             {"head_dim", "32"},
                                        {"n_tokens", n_tokens.c_str()},  {"layers", layer_list.c_str()}};
  ASSERT_EQ(certkv_safetensors_write(path.c_str(), views.data(), views.size(), meta, 6), CERTKV_OK)
      << certkv_last_error();
}

TEST(CApiEval, GaacMeasureRoundTripsAKvDump) {
  const std::string dump = temp_path("dump.safetensors"), cal = temp_path("cal.safetensors");
  write_kv_dump(dump, 2, 72);
  certkv_gaac_measure_params p = certkv_gaac_measure_default_params();
  p.calibration = dump.c_str();
  p.in = dump.c_str();
  p.save_calibration = cal.c_str();
  p.segment_tokens = 32;
  p.passes = 1;
  p.verify_ref = 1;
  certkv_gaac_report* report = nullptr;
  ASSERT_EQ(certkv_gaac_measure(&p, &report), CERTKV_OK) << certkv_last_error();
  certkv_gaac_report_info info;
  ASSERT_EQ(certkv_gaac_report_get_info(report, &info), CERTKV_OK);
  EXPECT_EQ(info.encoded, 1);
  EXPECT_EQ(info.verify_ok, 1) << info.first_failure;
  EXPECT_EQ(info.ref_cross_checked, 1);
  EXPECT_STREQ(info.element, "bf16");
  EXPECT_EQ(info.n_layers, 2);
  EXPECT_EQ(info.n_kv_heads, 2);
  EXPECT_EQ(info.head_dim, 32);
  EXPECT_EQ(info.n_tokens, 72);
  // 72 tokens: 4 whole 16-token pages and a raw tail per (layer, K/V, head).
  EXPECT_EQ(info.total.pages, uint64_t(2 * 2 * 2 * 4));
  EXPECT_EQ(info.total.bf16_bytes, uint64_t(2 * 2 * 2 * 72 * 32 * 2));
  EXPECT_EQ(info.total.failed_pages, 0u);
  EXPECT_GT(info.total.ratio, 1.0);
  EXPECT_NEAR(info.total.mode_fraction_3bit + info.total.mode_fraction_4bit + info.total.mode_fraction_raw, 1.0, 1e-9);
  EXPECT_EQ(info.total.ratio_vs_fp8, 0.0);
  EXPECT_EQ(info.k.pages + info.v.pages, info.total.pages);
  EXPECT_EQ(info.n_segments, 2);  // blocks starting at tokens 0-31 and 32-63
  certkv_gaac_layer_report layer;
  ASSERT_EQ(certkv_gaac_report_layer(report, 1, &layer), CERTKV_OK);
  EXPECT_EQ(layer.layer, 1);
  EXPECT_EQ(layer.k.pages, 8u);
  EXPECT_EQ(certkv_gaac_report_layer(report, 2, &layer), CERTKV_ERR_OUT_OF_RANGE);
  certkv_gaac_tally k, v;
  ASSERT_EQ(certkv_gaac_report_segment(report, 0, &k, &v), CERTKV_OK);
  EXPECT_GT(k.pages, 0u);
  EXPECT_EQ(certkv_gaac_report_segment(report, -1, &k, &v), CERTKV_ERR_OUT_OF_RANGE);
  certkv_gaac_report_free(report);

  // The saved calibration encodes the same dump to the same size.
  p.calibration = cal.c_str();
  p.save_calibration = nullptr;
  ASSERT_EQ(certkv_gaac_measure(&p, &report), CERTKV_OK) << certkv_last_error();
  certkv_gaac_report_info again;
  ASSERT_EQ(certkv_gaac_report_get_info(report, &again), CERTKV_OK);
  EXPECT_EQ(again.total.stored_bytes, info.total.stored_bytes);
  EXPECT_NE(std::string(again.calibration).find(cal), std::string::npos) << again.calibration;
  certkv_gaac_report_free(report);

  // FP8 codec: its own calibration of the dump.
  p.codec = "gaac-e5m2";
  p.calibration = dump.c_str();
  ASSERT_EQ(certkv_gaac_measure(&p, &report), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_gaac_report_get_info(report, &again), CERTKV_OK);
  EXPECT_EQ(again.verify_ok, 1);
  EXPECT_GT(again.total.ratio_vs_fp8, 0.0);
  certkv_gaac_report_free(report);
  std::filesystem::remove(dump);
  std::filesystem::remove(cal);
}

TEST(CApiEval, GaacMeasureRefusesBadInput) {
  const std::string dump = temp_path("bad_dump.safetensors"), truncated = temp_path("truncated.safetensors");
  write_kv_dump(dump, 1, 32);
  const std::string bytes = read_file(dump);
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  certkv_gaac_report* report = reinterpret_cast<certkv_gaac_report*>(0x1);
  certkv_gaac_measure_params p = certkv_gaac_measure_default_params();
  EXPECT_EQ(certkv_gaac_measure(nullptr, &report), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_INVALID_ARGUMENT);  // no calibration
  EXPECT_TRUE(error_names("calibration")) << certkv_last_error();
  p.calibration = dump.c_str();
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_INVALID_ARGUMENT);  // nothing to do
  p.in = dump.c_str();
  p.codec = "lzma";
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(error_names("unknown codec 'lzma'")) << certkv_last_error();
  EXPECT_EQ(report, nullptr);
  p.codec = nullptr;
  p.block_tokens = 0;
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_INVALID_ARGUMENT);
  p.block_tokens = 16;
  p.in = "/nonexistent/kv.safetensors";
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_NOT_FOUND);
  EXPECT_TRUE(error_names("/nonexistent/kv.safetensors")) << certkv_last_error();
  p.in = truncated.c_str();
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_CORRUPT);
  EXPECT_TRUE(error_names(truncated)) << certkv_last_error();
  p.in = dump.c_str();
  p.calibration = truncated.c_str();
  EXPECT_EQ(certkv_gaac_measure(&p, &report), CERTKV_ERR_CORRUPT);
  const std::string readme = test_data_path("README.md");
  p.calibration = readme.c_str();
  EXPECT_NE(certkv_gaac_measure(&p, &report), CERTKV_OK);
  EXPECT_TRUE(error_names("README.md")) << certkv_last_error();
  EXPECT_EQ(report, nullptr);
  certkv_gaac_report_info info;
  EXPECT_EQ(certkv_gaac_report_get_info(nullptr, &info), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_gaac_layer_report layer;
  EXPECT_EQ(certkv_gaac_report_layer(nullptr, 0, &layer), CERTKV_ERR_INVALID_ARGUMENT);
  certkv_gaac_report_free(nullptr);
  std::filesystem::remove(dump);
  std::filesystem::remove(truncated);
}

}  // namespace
