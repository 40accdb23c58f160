// DeviceForward on the tiny stories260K fixture (tests/data), with attention replaced by a copy of
// the queries (the forward's own kernels alone): the fused kernels give the unfused path's logits
// bit for bit, eagerly and replayed from graphs, on ragged row counts up to one chunk of the
// pinned products and past it.
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/device_forward.h"
#include "backend/host_forward.h"
#include "core/cuda_test_support.h"
#include "model/model.h"

namespace certkv::backend::cuda {
namespace {

// tests/data, or $CERTKV_TEST_DATA_DIR where the binary runs away from its build tree (the device).
std::string test_data() {
  const char* env = std::getenv("CERTKV_TEST_DATA_DIR");
  return env && env[0] ? std::string(env) : std::string(CERTKV_TEST_DATA_DIR);
}

const model::Model& stories() {
  static std::unique_ptr<model::Model> m =
      model::load_llama2c(test_data() + "/models/stories260K.bin", test_data() + "/models/tok512.bin");
  return *m;
}

// The logits of every row of one step of n_rows one-token sequences at ragged positions.
std::vector<float> step_logits(DeviceForward& f, const model::Model& m, int64_t n_rows) {
  const int nv = m.config().n_vocab;
  const size_t q_bytes = sizeof(float) * size_t(m.config().n_heads) * size_t(m.config().head_dim);
  std::vector<int32_t> tokens;
  for (int64_t r = 0; r < n_rows; ++r) tokens.push_back(int32_t((1 + 97 * r) % nv));
  std::vector<float> out(size_t(n_rows) * size_t(nv));
  std::vector<BatchItem> items;
  for (int64_t r = 0; r < n_rows; ++r) {
    BatchItem it;
    it.seq = cache::SeqId(r + 1);
    it.tokens = &tokens[size_t(r)];
    it.n = 1;
    it.last_logits = &out[size_t(r) * size_t(nv)];
    items.push_back(it);
  }
  const StepRows rows = plan_step(items, m.config(), 1 << 20, [](cache::SeqId seq) { return int64_t(seq) * 3 % 200; });
  f.run(rows, [&](int, float* q, const float*, const float*, float* out_rows) {
    ASSERT_EQ(cudaMemcpy(out_rows, q, q_bytes * size_t(n_rows), cudaMemcpyDeviceToDevice), cudaSuccess);
  });
  return out;
}

TEST(DeviceForward, FusedKernelsGiveTheUnfusedLogits) {
  CERTKV_NEED_CUDA_DEVICE();
  const model::Model& m = stories();
  std::unique_ptr<DeviceForward> fused = DeviceForward::create(m, true, true);
  std::unique_ptr<DeviceForward> fused_eager = DeviceForward::create(m, false, true);
  std::unique_ptr<DeviceForward> unfused = DeviceForward::create(m, false, false);
  for (const int64_t n_rows : {int64_t(1), int64_t(3), int64_t(17), int64_t(64), int64_t(100), kPinnedProductRows,
                               kPinnedProductRows + 5}) {
    const std::vector<float> a = step_logits(*fused, m, n_rows), b = step_logits(*fused_eager, m, n_rows),
                             c = step_logits(*unfused, m, n_rows);
    ASSERT_EQ(a, b) << n_rows << " rows: graphs against eager launches";
    ASSERT_EQ(b, c) << n_rows << " rows: fused against unfused";
  }
}

}  // namespace
}  // namespace certkv::backend::cuda
