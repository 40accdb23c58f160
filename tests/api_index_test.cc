// The C API's key index and Top-p selection on arrays (certkv_rabitq_*, certkv_top_p_select) and its
// safetensors reader (certkv_safetensors_*): the same records, estimates and selections as the
// index layer called directly, refusals that name the argument, and corrupt files refused cleanly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "index/rabitq.h"
#include "index/top_p.h"

namespace {


std::vector<float> gaussian(size_t n, uint32_t seed, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

template <int D>
void expect_same_as_index_layer(int64_t n_tokens, const char* rotation, certkv::index::RotationKind kind) {
  SCOPED_TRACE("head_dim " + std::to_string(D) + ", " + std::to_string(n_tokens) + " tokens, " + rotation);
  const std::vector<float> c_q = gaussian(D, 1), c_k = gaussian(D, 2, 0.5f);
  const std::vector<float> k = gaussian(size_t(n_tokens) * D, 3), q = gaussian(D, 4);
  const certkv_rabitq_head head{D, c_q.data(), c_k.data(), rotation, 99};
  size_t record_bytes = 0;
  ASSERT_EQ(certkv_rabitq_record_bytes(D, &record_bytes), CERTKV_OK);
  ASSERT_EQ(record_bytes, sizeof(certkv::index::RabitqRecord<D>));
  std::vector<uint8_t> records(size_t(n_tokens) * record_bytes);
  ASSERT_EQ(certkv_rabitq_encode_keys(&head, k.data(), n_tokens, records.data()), CERTKV_OK) << certkv_last_error();
  std::vector<float> scores(static_cast<size_t>(n_tokens)), scores_ref(static_cast<size_t>(n_tokens));
  ASSERT_EQ(certkv_rabitq_estimate_scores(&head, records.data(), n_tokens, q.data(), 7, scores.data(),
                                          scores_ref.data()),
            CERTKV_OK)
      << certkv_last_error();

  const certkv::index::RabitqHead h(c_q, c_k, certkv::index::Rotation(kind, D, 99));
  std::vector<certkv::index::RabitqRecord<D>> expected(static_cast<size_t>(n_tokens));
  certkv::index::rabitq_encode_keys<D>(h, k.data(), n_tokens, expected.data());
  EXPECT_EQ(std::memcmp(records.data(), expected.data(), records.size()), 0);
  const certkv::index::RabitqQuery<D> query = certkv::index::rabitq_quantize_query<D>(h, q.data(), 7);
  std::vector<float> popcount(static_cast<size_t>(n_tokens)), ref(static_cast<size_t>(n_tokens));
  certkv::index::rabitq_estimate_scores_popcount<D>(h, query, expected.data(), n_tokens, popcount.data());
  certkv::index::rabitq_estimate_scores_ref<D>(h, query, expected.data(), n_tokens, ref.data());
  for (int64_t t = 0; t < n_tokens; ++t) {
    EXPECT_EQ(scores[size_t(t)], popcount[size_t(t)]) << "token " << t;
    EXPECT_EQ(scores_ref[size_t(t)], ref[size_t(t)]) << "token " << t;
    EXPECT_NEAR(scores[size_t(t)], scores_ref[size_t(t)], 1e-4f * (1 + std::fabs(scores_ref[size_t(t)])));
  }
}

TEST(CApiIndex, RecordsAndEstimatesAreTheIndexLayers) {
  for (int64_t n : {1, 3, 17, 129}) {
    expect_same_as_index_layer<32>(n, "haar", certkv::index::RotationKind::kHaar);
    expect_same_as_index_layer<64>(n, "hadamard", certkv::index::RotationKind::kRandomizedHadamard);
    expect_same_as_index_layer<96>(n, "haar", certkv::index::RotationKind::kHaar);
    expect_same_as_index_layer<128>(n, "hadamard", certkv::index::RotationKind::kRandomizedHadamard);
  }
}

TEST(CApiIndex, AKeyAtTheCentroidScoresExactly) {
  const int d = 64;
  const std::vector<float> c_q = gaussian(d, 5), c_k = gaussian(d, 6), q = gaussian(d, 7);
  const certkv_rabitq_head head{d, c_q.data(), c_k.data(), "haar", 1};
  std::vector<uint8_t> record(24);
  ASSERT_EQ(certkv_rabitq_encode_keys(&head, c_k.data(), 1, record.data()), CERTKV_OK);
  float score = 0;
  ASSERT_EQ(certkv_rabitq_estimate_scores(&head, record.data(), 1, q.data(), 0, &score, nullptr), CERTKV_OK);
  double exact = 0;
  for (int i = 0; i < d; ++i) exact += double(q[size_t(i)]) * c_k[size_t(i)];
  EXPECT_NEAR(score, exact, 1e-4 * (1 + std::fabs(exact)));
}

TEST(CApiIndex, TopPSelectIsTheIndexLayers) {
  std::mt19937 rng(11);
  for (int64_t n : {1, 3, 17, 129, 501, 3771}) {
    for (double p : {0.5, 0.9, 0.99, 1.0}) {
      std::vector<float> logits = gaussian(size_t(n), uint32_t(n));
      for (float& l : logits) l = std::round(l * 64) / 64 * 3;  // ties within buckets
      std::vector<uint8_t> mask(static_cast<size_t>(n)), expected_mask(static_cast<size_t>(n));
      certkv_top_p_selection got{};
      ASSERT_EQ(certkv_top_p_select(logits.data(), n, p, mask.data(), &got), CERTKV_OK) << certkv_last_error();
      const certkv::index::TopPSelection want = certkv::index::top_p_select_ref(logits.data(), n, p, expected_mask.data());
      EXPECT_EQ(mask, expected_mask) << n << " tokens, p " << p;
      EXPECT_EQ(got.threshold, want.threshold);
      EXPECT_EQ(got.bucket, want.bucket);
      EXPECT_EQ(got.n_selected, want.n_selected);
      EXPECT_EQ(got.mass, want.mass);
      EXPECT_EQ(got.n_boundary, want.n_boundary);
      EXPECT_GE(got.mass, p);
    }
  }
}

void expect_refused(certkv_status status, certkv_status expected, const std::string& names) {
  EXPECT_EQ(status, expected);
  EXPECT_NE(std::string(certkv_last_error()).find(names), std::string::npos) << certkv_last_error();
}

TEST(CApiIndex, BadInputIsRefusedNamingTheArgument) {
  const int d = 64;
  std::vector<float> c_q(d, 0.0f), c_k(d, 0.0f), q(d, 1.0f), k(size_t(d) * 2, 1.0f);
  std::vector<uint8_t> records(48);
  float scores[2];
  certkv_rabitq_head head{d, c_q.data(), c_k.data(), "haar", 0};
  size_t bytes = 0;
  expect_refused(certkv_rabitq_record_bytes(48, &bytes), CERTKV_ERR_INVALID_ARGUMENT, "head_dim 48");
  expect_refused(certkv_rabitq_encode_keys(nullptr, k.data(), 2, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "null head");
  expect_refused(certkv_rabitq_encode_keys(&head, k.data(), -1, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "n_tokens -1");
  expect_refused(certkv_rabitq_encode_keys(&head, nullptr, 2, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "null k");
  k[5] = std::numeric_limits<float>::quiet_NaN();
  expect_refused(certkv_rabitq_encode_keys(&head, k.data(), 2, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "k has a non-finite value");
  c_k[0] = std::numeric_limits<float>::infinity();
  expect_refused(certkv_rabitq_encode_keys(&head, k.data(), 2, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "head.c_k");
  c_k[0] = 0;
  head.rotation = "givens";
  expect_refused(certkv_rabitq_encode_keys(&head, q.data(), 1, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "rotation 'givens'");
  head.rotation = "hadamard";
  head.head_dim = 96;
  std::vector<float> c96(96, 0.0f);
  head.c_q = head.c_k = c96.data();
  expect_refused(certkv_rabitq_encode_keys(&head, c96.data(), 1, records.data()), CERTKV_ERR_INVALID_ARGUMENT,
                 "power of");
  head = {d, c_q.data(), c_k.data(), "haar", 0};
  q[0] = std::numeric_limits<float>::infinity();
  expect_refused(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr),
                 CERTKV_ERR_INVALID_ARGUMENT, "q has a non-finite value");
  // Records that did not come from the encoder (a file, a caller's bytes): refused naming the token
  // and the field, where they would give inf, NaN or wrong scores.
  q[0] = 0.5f;
  k[5] = 1.0f;
  ASSERT_EQ(certkv_rabitq_encode_keys(&head, k.data(), 2, records.data()), CERTKV_OK) << certkv_last_error();
  ASSERT_EQ(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr), CERTKV_OK)
      << certkv_last_error();
  auto* rec = reinterpret_cast<certkv::index::RabitqRecord<64>*>(records.data());
  const certkv::index::RabitqRecord<64> good = rec[1];
  rec[1].alpha = 0.f;
  expect_refused(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr),
                 CERTKV_ERR_INVALID_ARGUMENT, "record 1: alpha");
  rec[1] = good;
  rec[1].norm_k_centered = std::numeric_limits<float>::quiet_NaN();
  expect_refused(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr),
                 CERTKV_ERR_INVALID_ARGUMENT, "record 1: norm_k_centered");
  rec[1] = good;
  rec[1].code_popcount += 1;
  expect_refused(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr),
                 CERTKV_ERR_INVALID_ARGUMENT, "record 1: code_popcount");
  rec[1] = good;
  rec[0].cq_dot_k = std::numeric_limits<float>::infinity();
  expect_refused(certkv_rabitq_estimate_scores(&head, records.data(), 2, q.data(), 0, scores, nullptr),
                 CERTKV_ERR_INVALID_ARGUMENT, "record 0: cq_dot_k");

  float logits[3] = {1, 2, 3};
  uint8_t mask[3];
  certkv_top_p_selection s;
  expect_refused(certkv_top_p_select(logits, 3, 0.0, mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "p 0");
  expect_refused(certkv_top_p_select(logits, 3, 1.5, mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "p 1.5");
  expect_refused(certkv_top_p_select(logits, 3, std::nan(""), mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "p nan");
  expect_refused(certkv_top_p_select(logits, 0, 0.9, mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "n 0");
  expect_refused(certkv_top_p_select(nullptr, 3, 0.9, mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "null logits");
  logits[1] = -std::numeric_limits<float>::infinity();
  expect_refused(certkv_top_p_select(logits, 3, 0.9, mask, &s), CERTKV_ERR_INVALID_ARGUMENT, "logits has a non-finite");
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("certkv_api_index_test_" + name)).string();
}

TEST(CApiSafetensors, ReadsWhatItWrote) {
  const std::string path = temp_path("round_trip.safetensors");
  const std::vector<uint16_t> k = {1, 2, 3, 4, 5, 6};
  const std::vector<float> q = {0.5f, -1.5f};
  const int64_t k_shape[] = {1, 3, 2}, q_shape[] = {1, 2};
  const certkv_tensor_view views[] = {{"layer0.k", "BF16", k_shape, 3, k.data(), 12},
                                      {"layer0.q", "F32", q_shape, 2, q.data(), 8}};
  const certkv_metadata_entry meta[] = {{"format", "certkv-kv-dump/1"}, {"head_dim", "2"}};
  ASSERT_EQ(certkv_safetensors_write(path.c_str(), views, 2, meta, 2), CERTKV_OK) << certkv_last_error();
  certkv_safetensors* file = nullptr;
  ASSERT_EQ(certkv_safetensors_open(path.c_str(), &file), CERTKV_OK) << certkv_last_error();
  size_t n_tensors = 0, n_metadata = 0;
  ASSERT_EQ(certkv_safetensors_count(file, &n_tensors, &n_metadata), CERTKV_OK);
  ASSERT_EQ(n_tensors, 2u);
  ASSERT_EQ(n_metadata, 2u);
  certkv_tensor_view t{};
  ASSERT_EQ(certkv_safetensors_tensor(file, 0, &t), CERTKV_OK);
  EXPECT_STREQ(t.name, "layer0.k");
  EXPECT_STREQ(t.dtype, "BF16");
  ASSERT_EQ(t.n_dims, 3);
  EXPECT_EQ(t.shape[1], 3);
  ASSERT_EQ(t.n_bytes, 12u);
  EXPECT_EQ(std::memcmp(t.data, k.data(), 12), 0);
  ASSERT_EQ(certkv_safetensors_tensor(file, 1, &t), CERTKV_OK);
  EXPECT_EQ(std::memcmp(t.data, q.data(), 8), 0);
  certkv_metadata_entry e{};
  ASSERT_EQ(certkv_safetensors_metadata(file, 0, &e), CERTKV_OK);
  EXPECT_STREQ(e.key, "format");
  EXPECT_STREQ(e.value, "certkv-kv-dump/1");
  expect_refused(certkv_safetensors_tensor(file, 2, &t), CERTKV_ERR_OUT_OF_RANGE, "index 2");
  expect_refused(certkv_safetensors_metadata(file, 5, &e), CERTKV_ERR_OUT_OF_RANGE, "index 5");
  certkv_safetensors_free(file);
  std::filesystem::remove(path);
}

TEST(CApiSafetensors, CorruptAndMissingFilesAreRefused) {
  const std::string path = temp_path("corrupt.safetensors");
  const std::vector<float> x(64, 1.0f);
  const int64_t shape[] = {64};
  const certkv_tensor_view view{"x", "F32", shape, 1, x.data(), 256};
  ASSERT_EQ(certkv_safetensors_write(path.c_str(), &view, 1, nullptr, 0), CERTKV_OK);
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 10);  // a truncated data section
  certkv_safetensors* file = nullptr;
  expect_refused(certkv_safetensors_open(path.c_str(), &file), CERTKV_ERR_CORRUPT, path);
  EXPECT_EQ(file, nullptr);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.put('\xff');  // a byte of the JSON header
  }
  EXPECT_EQ(certkv_safetensors_open(path.c_str(), &file), CERTKV_ERR_CORRUPT) << certkv_last_error();
  std::filesystem::remove(path);
  expect_refused(certkv_safetensors_open(path.c_str(), &file), CERTKV_ERR_NOT_FOUND, path);
  expect_refused(certkv_safetensors_open(nullptr, &file), CERTKV_ERR_INVALID_ARGUMENT, "null path");
}

}  // namespace
