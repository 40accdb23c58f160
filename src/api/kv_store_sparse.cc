// The KV store's key indexes (api/kv_store_sparse.h).
#include "api/kv_store_sparse.h"

#include <utility>

namespace certkv::api {

StoreKeyIndex::StoreKeyIndex(const cache::KeyIndexConfig& config)
    : config_(config), index_(std::make_unique<cache::KeyIndex>(config)) {}

void StoreKeyIndex::note_queries(const float* q, int64_t n, int n_heads) {
  if (!c_q_.empty()) return;
  const int h_kv = config_.n_kv_heads, d = config_.head_dim, group = n_heads / h_kv;
  query_sums_.resize(size_t(h_kv) * size_t(d), 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < n_heads; ++h)
      for (int i = 0; i < d; ++i)
        query_sums_[size_t(h / group) * size_t(d) + size_t(i)] += q[(size_t(t) * size_t(n_heads) + size_t(h)) * size_t(d) + size_t(i)];
  query_rows_ += n * group;
}

int64_t StoreKeyIndex::update(const cache::KvCache& cache, cache::SeqId seq, int64_t n, const float* q, int n_heads,
                              const StoreSparseConfig& config) {
  const int h_kv = config_.n_kv_heads, d = config_.head_dim;
  std::vector<float> keys;
  const bool first = c_q_.empty();
  if (first) {
    if (query_rows_ == 0) note_queries(q, 1, n_heads);
    c_q_.assign(size_t(h_kv), std::vector<float>(size_t(d)));
    c_k_.assign(size_t(h_kv), std::vector<float>(size_t(d)));
    keys.resize(size_t(n) * size_t(d));
    for (int h = 0; h < h_kv; ++h) {
      cache.read_token_range_exact(seq, 0, cache::KvTensor::kKey, h, 0, n, keys.data());
      std::vector<double> k_sum(size_t(d), 0.0);
      for (int64_t t = 0; t < n; ++t)
        for (int i = 0; i < d; ++i) k_sum[size_t(i)] += keys[size_t(t) * size_t(d) + size_t(i)];
      for (int i = 0; i < d; ++i) {
        c_k_[size_t(h)][size_t(i)] = float(k_sum[size_t(i)] / double(n));
        c_q_[size_t(h)][size_t(i)] = float(query_sums_[size_t(h) * size_t(d) + size_t(i)] / double(query_rows_));
      }
      index_->set_centroids(0, h, c_q_[size_t(h)], c_k_[size_t(h)]);
    }
    query_sums_.clear();
    query_sums_.shrink_to_fit();
  }
  const int64_t target = store_indexed_tokens(n, config.window_tokens, config_.page_records);
  int64_t from = index_->indexed_tokens(0, 0);
  if (from > target) {  // never after a crop, which drops the records
    drop_records();
    from = 0;
  }
  if (target == from) return 0;
  keys.resize(size_t(target - from) * size_t(d));
  for (int h = 0; h < h_kv; ++h) {
    cache.read_token_range_exact(seq, 0, cache::KvTensor::kKey, h, from, target, keys.data());
    index_->append(0, h, keys.data(), target - from);
  }
  return target - from;
}

void StoreKeyIndex::drop_records() {
  for (size_t h = 0; h < c_q_.size(); ++h) index_->set_centroids(0, int(h), c_q_[h], c_k_[h]);
}

StoreKeyIndex StoreKeyIndex::copy_without_records() const {
  StoreKeyIndex copy(config_);
  copy.query_sums_ = query_sums_;
  copy.query_rows_ = query_rows_;
  copy.c_q_ = c_q_;
  copy.c_k_ = c_k_;
  for (size_t h = 0; h < c_q_.size(); ++h) copy.index_->set_centroids(0, int(h), c_q_[h], c_k_[h]);
  return copy;
}

}  // namespace certkv::api
