// The CUDA paged decode attention against the CPU double-precision reference over the same
// pages: ragged lengths, GQA ratios, block sizes, split counts, shuffled page placement; and
// refusals of unsupported shapes. Needs a CUDA device; fails (does not skip) without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "attention/cuda/decode_attention_cuda.h"
#include "attention/decode_attention.h"

namespace certkv::attention::cuda {
namespace {

struct Case {
  int64_t n_ctx;
  int n_q_heads, n_kv_heads, head_dim, block_tokens, n_splits;
};

template <typename T>
T* upload(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

double run_case(const Case& c) {
  cache::KvCacheConfig kc;
  kc.n_layers = 1;
  kc.n_kv_heads = c.n_kv_heads;
  kc.head_dim = c.head_dim;
  kc.block_tokens = c.block_tokens;
  kc.max_tokens = c.n_ctx + c.block_tokens;
  cache::KvCache kv(kc);
  const cache::SeqId seq = kv.create_sequence();
  std::mt19937 rng(uint32_t(c.n_ctx * 31 + c.head_dim));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(size_t(c.n_ctx) * c.n_kv_heads * c.head_dim), v(k.size());
  for (auto& x : k) x = normal(rng) * 2.f;
  for (auto& x : v) x = normal(rng);
  kv.reserve(seq, c.n_ctx);
  kv.write(seq, 0, k.data(), v.data(), c.n_ctx);
  kv.commit(seq, c.n_ctx);
  std::vector<float> q(size_t(c.n_q_heads) * c.head_dim);
  for (auto& x : q) x = normal(rng);
  AttentionShape shape{c.n_q_heads, c.n_kv_heads, c.head_dim, 1.f / std::sqrt(float(c.head_dim))};
  std::vector<double> ref(q.size());
  decode_attention_ref(kv, seq, 0, shape, q.data(), c.n_ctx, ref.data());

  // Gather every page into one device pool in shuffled order; tables point at the new slots.
  const int64_t n_blocks = kv.n_blocks(seq);
  const size_t page_elems = size_t(c.block_tokens) * c.head_dim;
  std::vector<int32_t> slot(size_t(2 * c.n_kv_heads * n_blocks));
  std::iota(slot.begin(), slot.end(), 0);
  std::shuffle(slot.begin(), slot.end(), rng);
  std::vector<uint16_t> pool(slot.size() * page_elems);
  std::vector<int32_t> k_table(size_t(c.n_kv_heads * n_blocks)), v_table(k_table.size());
  size_t next = 0;
  for (int which = 0; which < 2; ++which)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const format::PageRef* table =
          kv.block_table(seq, 0, which == 0 ? cache::KvTensor::kKey : cache::KvTensor::kValue, h);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int32_t s = slot[next++];
        std::copy_n(kv.page_bf16(table[b]), page_elems, pool.begin() + size_t(s) * page_elems);
        (which == 0 ? k_table : v_table)[size_t(h * n_blocks + b)] = s;
      }
    }
  PagedDecodeParams p;
  p.pages = upload(pool);
  p.n_pages = int64_t(slot.size());
  p.k_table = upload(k_table);
  p.v_table = upload(v_table);
  p.n_blocks = n_blocks;
  p.block_tokens = c.block_tokens;
  p.n_q_heads = c.n_q_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.n_ctx = c.n_ctx;
  p.scale = shape.scale;
  p.n_splits = c.n_splits;
  p.q = upload(q);
  float* out = nullptr;
  EXPECT_EQ(cudaMalloc(&out, q.size() * sizeof(float)), cudaSuccess);
  p.out = out;
  void* ws = nullptr;
  EXPECT_EQ(cudaMalloc(&ws, workspace_bytes(p)), cudaSuccess);
  p.workspace = ws;
  const CudaStatus st = paged_decode_attention_bf16(p);
  EXPECT_TRUE(st.ok) << st.message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(q.size());
  EXPECT_EQ(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  EXPECT_GT(norm, 1e-6);
  for (void* ptr : {(void*)p.pages, (void*)p.k_table, (void*)p.v_table, (void*)p.q, (void*)out, ws}) cudaFree(ptr);
  return err / norm;  // normalized mean squared error
}

TEST(PagedDecodeCuda, MatchesTheCpuReference) {
  ASSERT_GT(device_count(), 0) << "no CUDA device";
  for (int64_t n_ctx : {1, 3, 17, 129, 501, 3771})
    for (auto [nq, nkv] : {std::pair{8, 8}, std::pair{9, 3}, std::pair{28, 4}})
      for (int hd : {64, 128})
        for (int splits : {1, 4}) {
          const int bt = n_ctx % 2 ? 16 : 7;
          const int64_t blocks = (n_ctx + bt - 1) / bt;
          const Case c{n_ctx, nq, nkv, hd, bt, int(std::min<int64_t>(splits, blocks))};
          EXPECT_LT(run_case(c), 1e-9) << "n_ctx " << n_ctx << " heads " << nq << "/" << nkv << " hd " << hd
                                        << " splits " << c.n_splits;
        }
}

TEST(PagedDecodeCuda, RefusesUnsupportedShapes) {
  PagedDecodeParams p;
  p.n_q_heads = 8, p.n_kv_heads = 3, p.head_dim = 64, p.n_blocks = 4, p.n_ctx = 10;
  EXPECT_FALSE(supports(p).ok);
  p.n_kv_heads = 4, p.head_dim = 72;
  EXPECT_FALSE(supports(p).ok);
  p.head_dim = 64, p.n_ctx = 65;
  EXPECT_FALSE(supports(p).ok);
  p.n_ctx = 64;
  EXPECT_TRUE(supports(p).ok) << supports(p).message;
  EXPECT_FALSE(paged_decode_attention_bf16(p).ok);  // null pointers refused before any launch
}

}  // namespace
}  // namespace certkv::attention::cuda
