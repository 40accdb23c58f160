// The KV store's key indexes (api/kv_store_sparse.h).
#include "api/kv_store_sparse.h"

#include <utility>

#include "index/rabitq.h"

namespace certkv::api {

StoreKeyIndex::StoreKeyIndex(const cache::KeyIndexConfig& config)
    : StoreKeyIndex(config, std::make_unique<cache::KeyIndex>(config)) {}

StoreKeyIndex::StoreKeyIndex(const cache::KeyIndexConfig& config, std::unique_ptr<cache::KeyIndex> index)
    : config_(config), index_(std::move(index)) {}

void StoreKeyIndex::note_queries(const float* q, int64_t n, int n_heads) {
  if (!c_q_.empty()) return;
  const int h_kv = config_.n_kv_heads, d = config_.head_dim;
  query_sums_.resize(size_t(h_kv) * size_t(d), 0.0);
  index::rabitq_add_query_sums(q, n, n_heads, h_kv, d, query_sums_.data());
  query_rows_ += n * (n_heads / h_kv);
}

int64_t StoreKeyIndex::update(const cache::KvCache& cache, cache::SeqId seq, int64_t n, const float* q, int n_heads,
                              const backend::SparseConfig& config) {
  const int h_kv = config_.n_kv_heads, d = config_.head_dim;
  std::vector<float> keys;
  if (c_q_.empty()) {
    // The centroids, made whole before any is kept (a read that throws leaves none set).
    std::vector<double> sums = query_sums_;
    int64_t rows = query_rows_;
    if (rows == 0) {  // no prefill attended: this step's query
      sums.assign(size_t(h_kv) * size_t(d), 0.0);
      index::rabitq_add_query_sums(q, 1, n_heads, h_kv, d, sums.data());
      rows = n_heads / h_kv;
    }
    std::vector<std::vector<float>> c_q(static_cast<size_t>(h_kv), std::vector<float>(static_cast<size_t>(d)));
    std::vector<std::vector<float>> c_k(static_cast<size_t>(h_kv), std::vector<float>(static_cast<size_t>(d)));
    keys.resize(size_t(n) * size_t(d));
    for (int h = 0; h < h_kv; ++h) {
      cache.read_token_range_exact(seq, 0, cache::KvTensor::kKey, h, 0, n, keys.data());
      std::vector<double> k_sum(size_t(d), 0.0);
      for (int64_t t = 0; t < n; ++t)
        for (int i = 0; i < d; ++i) k_sum[size_t(i)] += keys[size_t(t) * size_t(d) + size_t(i)];
      for (int i = 0; i < d; ++i) {
        c_k[size_t(h)][size_t(i)] = float(k_sum[size_t(i)] / double(n));
        c_q[size_t(h)][size_t(i)] = float(sums[size_t(h) * size_t(d) + size_t(i)] / double(rows));
      }
    }
    for (int h = 0; h < h_kv; ++h) index_->set_centroids(0, h, c_q[size_t(h)], c_k[size_t(h)]);
    c_q_ = std::move(c_q);
    c_k_ = std::move(c_k);
    query_sums_.clear();
    query_sums_.shrink_to_fit();
  }
  const int64_t target = cache::store_indexed_tokens(n, config.window_tokens, config_.page_records);
  // The indexed prefix only grows with n, and crop() truncates it: it is never past the target.
  const int64_t from = index_->indexed_tokens(0, 0);
  if (from >= target) return 0;
  keys.resize(size_t(target - from) * size_t(d));
  for (int h = 0; h < h_kv; ++h) {
    cache.read_token_range_exact(seq, 0, cache::KvTensor::kKey, h, from, target, keys.data());
    index_->append(0, h, keys.data(), target - from);
  }
  return target - from;
}

void StoreKeyIndex::crop(int64_t n_tokens, const backend::SparseConfig& config) {
  const int64_t keep = cache::store_indexed_tokens(n_tokens, config.window_tokens, config_.page_records);
  for (int h = 0; h < config_.n_kv_heads; ++h) index_->truncate(0, h, keep);
}

StoreKeyIndex StoreKeyIndex::copy() const {
  StoreKeyIndex c(config_, index_->clone());
  c.query_sums_ = query_sums_;
  c.query_rows_ = query_rows_;
  c.c_q_ = c_q_;
  c.c_k_ = c_k_;
  return c;
}

}  // namespace certkv::api
