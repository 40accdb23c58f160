// The sparse tier's key index (DESIGN.md section 5, seed 002): per (layer, kv_head) the prefill
// centroids c_q, c_k, one random rotation P shared by every head (generated once from the
// recorded seed), and one RaBitQ record per indexed token (index/rabitq.h).
//
// Records are stored in index pages of page_records records (the cache's block_tokens), the pages
// of one (layer, kv_head) adjacent in one arena so the estimator scans a single stream; bytes()
// counts whole pages, the centroids and the rotation. Tokens are indexed in position order:
// append() extends the indexed prefix [0, indexed_tokens) of one (layer, kv_head).
//
// Thread safety: not thread-safe for mutation; the const functions may run concurrently with each
// other while nothing mutates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "index/rabitq.h"
#include "index/rotation.h"

namespace certkv::cache {

struct KeyIndexConfig {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;        // one of 32, 64, 96, 128, 256 (the RaBitQ record sizes)
  int page_records = 16;   // records per index page
  index::RotationKind rotation = index::RotationKind::kHaar;
  uint64_t seed = 0x5eed0002;  // of the rotation P
};

// What of a context is indexed (every backend's rule, and the C API's KV store's): the whole
// blocks before the window of the newest window_tokens. The first build indexes all of them;
// later updates wait until at least key_index_batch tokens are due (the window in whole blocks,
// one block when the window is under a block), so that a decode step rarely indexes.
inline int64_t key_index_target(int64_t n_tokens, int window_tokens, int block_tokens) {
  return std::max<int64_t>(0, n_tokens - window_tokens) / block_tokens * block_tokens;
}
inline int64_t key_index_batch(int window_tokens, int block_tokens) {
  return std::max<int64_t>(block_tokens, int64_t(window_tokens) / block_tokens * block_tokens);
}
// The indexed prefix of a context of n tokens in the C API's KV store (device cpu and cuda):
// key_index_target in whole batches of key_index_batch. A function of n alone: a sequence's index
// does not depend on when its steps ran, were cropped or copied.
inline int64_t store_indexed_tokens(int64_t n_tokens, int window_tokens, int block_tokens) {
  const int64_t batch = key_index_batch(window_tokens, block_tokens);
  return key_index_target(n_tokens, window_tokens, block_tokens) / batch * batch;
}

// Whether the index supports keys of this head_dim.
bool key_index_supports_head_dim(int head_dim);
// "haar" or "hadamard" (randomized Hadamard). Throws certkv::Error kInvalidArgument otherwise.
index::RotationKind parse_rotation_kind(std::string_view name);

class KeyIndex {
 public:
  // Throws certkv::Error: kInvalidArgument for a non-positive dimension or page_records;
  // kUnsupported for a head_dim the records do not cover, or a Hadamard rotation of a head_dim
  // that is not a power of two.
  explicit KeyIndex(const KeyIndexConfig& config);
  ~KeyIndex();
  KeyIndex(const KeyIndex&) = delete;
  KeyIndex& operator=(const KeyIndex&) = delete;

  const KeyIndexConfig& config() const { return config_; }
  const index::Rotation& rotation() const { return rotation_; }

  // Sets the centroids of (layer, kv_head) and drops its records. c_q, c_k: [head_dim], finite.
  void set_centroids(int layer, int kv_head, std::vector<float> c_q, std::vector<float> c_k);
  bool has_centroids(int layer, int kv_head) const;
  // REQUIRES: has_centroids (certkv::Error kInvalidArgument otherwise).
  const index::RabitqHead& head(int layer, int kv_head) const;

  // Indexes keys of positions [indexed_tokens, indexed_tokens + n). k: [n][head_dim], finite.
  // REQUIRES: has_centroids, n >= 0.
  void append(int layer, int kv_head, const float* k, int64_t n);
  int64_t indexed_tokens(int layer, int kv_head) const;
  // Keeps the records of positions [0, n) of (layer, kv_head) (nothing changes when n is at or
  // past indexed_tokens): a sequence cropped to n tokens or more keeps a valid index.
  // REQUIRES: n >= 0.
  void truncate(int layer, int kv_head, int64_t n);
  // A deep copy: the rotation, every head's centroids and records (a forked sequence's index).
  std::unique_ptr<KeyIndex> clone() const;
  // The records of (layer, kv_head): [indexed_tokens][record_bytes()] bytes, index::RabitqRecord
  // of the head_dim, in position order (valid until the next append to that head or clear).
  const uint8_t* records(int layer, int kv_head) const;

  // Estimated <q, k_t> for t in [0, indexed_tokens): the popcount estimator (Eq. 17-20, Eq. 6).
  // The query's randomized rounding draws from rounding_seed. q: [head_dim]; scores: [indexed].
  // query_norm_centered, when not null, gets ||q - c_q||.
  void estimate_scores(int layer, int kv_head, const float* q, uint64_t rounding_seed,
                       float* scores, float* query_norm_centered = nullptr) const;
  // The same estimate through rabitq_estimate_scores_ref (float dot products), for tests.
  void estimate_scores_ref(int layer, int kv_head, const float* q, uint64_t rounding_seed,
                           float* scores) const;
  // ||k_t - c_k|| of indexed token t.
  float key_norm_centered(int layer, int kv_head, int64_t t) const;

  // The same norms as a strided view: ||k_t - c_k|| is key_norms(...)[t * stride] for t in
  // [0, indexed_tokens), stride (in floats) written to *stride (valid as records()).
  const float* key_norms(int layer, int kv_head, int64_t* stride) const;
  // Drops every record and centroid.
  void clear();
  size_t record_bytes() const { return record_bytes_; }
  // Index pages in use (ceil(indexed / page_records) per head) * page bytes + centroids + the
  // rotation's parameters. The arena grows by doubling; its spare capacity is not counted.
  uint64_t bytes() const;

 private:
  KeyIndex(const KeyIndexConfig& config, index::Rotation rotation);
  struct HeadIndex {
    std::unique_ptr<index::RabitqHead> head;
    std::vector<uint8_t> records;  // [pages * page_records][record_bytes], the first n valid
    int64_t n = 0;
  };
  HeadIndex& at(int layer, int kv_head, const char* where);
  const HeadIndex& at(int layer, int kv_head, const char* where) const;

  KeyIndexConfig config_;
  index::Rotation rotation_;
  size_t record_bytes_ = 0;
  std::vector<HeadIndex> heads_;  // [layer * n_kv_heads + kv_head]
};

}  // namespace certkv::cache
