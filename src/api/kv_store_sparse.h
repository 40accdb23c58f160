// Sparse decode in the C API's KV store (certkv_kv_store_params.sparse_p, device cpu): one key
// index per (layer, sequence), kept by the backends' rule (cache::key_index_target) and read by
// attention::sparse_decode_attention at each decode step of a layer past the dense ones.
//
// The indexed prefix is cache::store_indexed_tokens of the context, the rest attended exactly as the
// window. The centroids of a (layer, sequence) are set at its first sparse decode step: c_k the mean of
// the exact keys stored so far, c_q the mean of the queries of the prefills attended before (over
// the tokens and the query heads of each KV head's group, as the backends take the first
// prefill's), or of that step's query when no prefill was attended (a store filled by appends
// alone). They are kept for the sequence's life: a crop keeps the records of the prefix its
// shorter context indexes, and a copy (select) takes a copy of the records, so a sequence selects
// what it would have selected had it never been cropped or copied.
//
// Thread safety: as the store, one call at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "cache/key_index.h"
#include "cache/kv_cache.h"
#include "index/rotation.h"

namespace certkv::api {

// The key index of one (layer, sequence) of a store whose layers are caches of one layer each.
class StoreKeyIndex {
 public:
  explicit StoreKeyIndex(const cache::KeyIndexConfig& config);
  // A prefill's queries, for the query centroid (nothing once the centroids are set).
  // q: [n][n_heads][head_dim].
  void note_queries(const float* q, int64_t n, int n_heads);
  // Brings the index up to date for a decode step over the first n positions of seq in `cache`
  // (its layer 0), whose query is q [n_heads][head_dim] (the centroids set at the first call).
  // Returns the tokens appended to each KV head's records.
  int64_t update(const cache::KvCache& cache, cache::SeqId seq, int64_t n, const float* q, int n_heads,
                 const backend::SparseConfig& config);
  // A crop to n_tokens: keeps the records of store_indexed_tokens(n_tokens), which the shorter
  // context indexes (keys of positions it keeps), and the centroids.
  void crop(int64_t n_tokens, const backend::SparseConfig& config);
  // A deep copy: centroids (or the noted queries) and records (a select's copy of a sequence).
  StoreKeyIndex copy() const;
  const cache::KeyIndex& index() const { return *index_; }
  bool has_records() const { return index_->indexed_tokens(0, 0) > 0; }

 private:
  StoreKeyIndex(const cache::KeyIndexConfig& config, std::unique_ptr<cache::KeyIndex> index);
  cache::KeyIndexConfig config_;
  std::unique_ptr<cache::KeyIndex> index_;
  std::vector<double> query_sums_;  // [n_kv_heads][head_dim], until the centroids are set
  int64_t query_rows_ = 0;          // tokens x group heads summed
  std::vector<std::vector<float>> c_q_, c_k_;  // [n_kv_heads][head_dim] once set
};

}  // namespace certkv::api
