#include "cache/key_index.h"

#include <cstddef>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "core/status.h"

namespace certkv::cache {

namespace {

// Calls f(std::integral_constant<int, D>) for the record size of head_dim D.
template <class F>
void with_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default:
      fail(StatusCode::kUnsupported, "key index: head_dim " + std::to_string(head_dim) +
                                         " is not supported (32, 64, 96, 128 or 256)");
  }
}

index::Rotation make_rotation(const KeyIndexConfig& c) {
  if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.page_records <= 0)
    fail(StatusCode::kInvalidArgument,
         "key index: n_layers " + std::to_string(c.n_layers) + ", n_kv_heads " +
             std::to_string(c.n_kv_heads) + ", head_dim " + std::to_string(c.head_dim) +
             " and page_records " + std::to_string(c.page_records) + " must be positive");
  if (!key_index_supports_head_dim(c.head_dim))
    fail(StatusCode::kUnsupported, "key index: head_dim " + std::to_string(c.head_dim) +
                                       " is not supported (32, 64, 96, 128 or 256)");
  if (c.rotation == index::RotationKind::kRandomizedHadamard && (c.head_dim & (c.head_dim - 1)) != 0)
    fail(StatusCode::kUnsupported, "key index: the randomized Hadamard rotation needs a head_dim "
                                   "that is a power of two, got " + std::to_string(c.head_dim));
  return index::Rotation(c.rotation, c.head_dim, c.seed);
}

}  // namespace

bool key_index_supports_head_dim(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

index::RotationKind parse_rotation_kind(std::string_view name) {
  if (name == "haar") return index::RotationKind::kHaar;
  if (name == "hadamard") return index::RotationKind::kRandomizedHadamard;
  fail(StatusCode::kInvalidArgument,
       "unknown rotation '" + std::string(name) + "' (known: haar, hadamard)");
}

KeyIndex::KeyIndex(const KeyIndexConfig& config) : KeyIndex(config, make_rotation(config)) {}

KeyIndex::KeyIndex(const KeyIndexConfig& config, index::Rotation rotation)
    : config_(config), rotation_(std::move(rotation)) {
  with_head_dim(config.head_dim, [&](auto dim) {
    record_bytes_ = index::rabitq_bytes_per_token<decltype(dim)::value>();
  });
  heads_.resize(size_t(config.n_layers) * size_t(config.n_kv_heads));
}

std::unique_ptr<KeyIndex> KeyIndex::clone() const {
  std::unique_ptr<KeyIndex> c(new KeyIndex(config_, rotation_));
  for (size_t i = 0; i < heads_.size(); ++i) {
    const HeadIndex& from = heads_[i];
    HeadIndex& to = c->heads_[i];
    if (from.head) to.head = std::make_unique<index::RabitqHead>(*from.head);
    to.records = from.records;
    to.n = from.n;
  }
  return c;
}

void KeyIndex::truncate(int layer, int kv_head, int64_t n) {
  HeadIndex& h = at(layer, kv_head, "truncate");
  if (n < 0) fail(StatusCode::kInvalidArgument, "key index truncate: n must be >= 0");
  h.n = std::min(h.n, n);
}

KeyIndex::~KeyIndex() = default;

KeyIndex::HeadIndex& KeyIndex::at(int layer, int kv_head, const char* where) {
  return const_cast<HeadIndex&>(std::as_const(*this).at(layer, kv_head, where));
}

const KeyIndex::HeadIndex& KeyIndex::at(int layer, int kv_head, const char* where) const {
  if (layer < 0 || layer >= config_.n_layers || kv_head < 0 || kv_head >= config_.n_kv_heads)
    fail(StatusCode::kOutOfRange, std::string("key index ") + where + ": (layer " +
                                      std::to_string(layer) + ", kv_head " +
                                      std::to_string(kv_head) + ") out of range");
  return heads_[size_t(layer) * size_t(config_.n_kv_heads) + size_t(kv_head)];
}

void KeyIndex::set_centroids(int layer, int kv_head, std::vector<float> c_q, std::vector<float> c_k) {
  HeadIndex& h = at(layer, kv_head, "set_centroids");
  h.head = std::make_unique<index::RabitqHead>(std::move(c_q), std::move(c_k), rotation_);
  h.records.clear();
  h.records.shrink_to_fit();
  h.n = 0;
}

bool KeyIndex::has_centroids(int layer, int kv_head) const {
  return at(layer, kv_head, "has_centroids").head != nullptr;
}

const index::RabitqHead& KeyIndex::head(int layer, int kv_head) const {
  const HeadIndex& h = at(layer, kv_head, "head");
  if (!h.head)
    fail(StatusCode::kInvalidArgument, "key index: (layer " + std::to_string(layer) +
                                           ", kv_head " + std::to_string(kv_head) +
                                           ") has no centroids yet");
  return *h.head;
}

void KeyIndex::append(int layer, int kv_head, const float* k, int64_t n) {
  const index::RabitqHead& rh = head(layer, kv_head);
  HeadIndex& h = at(layer, kv_head, "append");
  if (n < 0) fail(StatusCode::kInvalidArgument, "key index append: n must be >= 0");
  if (n == 0) return;
  if (k == nullptr) fail(StatusCode::kInvalidArgument, "key index append: null keys");
  const int64_t page = config_.page_records;
  const int64_t pages = (h.n + n + page - 1) / page;
  const size_t needed = size_t(pages) * size_t(page) * record_bytes_;
  if (h.records.size() < needed) {
    // Grow by doubling in whole pages, so appends are amortized O(1) per token.
    size_t grown = std::max(needed, h.records.size() * 2);
    grown = (grown / (size_t(page) * record_bytes_)) * size_t(page) * record_bytes_;
    h.records.resize(std::max(grown, needed));
  }
  with_head_dim(config_.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    auto* records = reinterpret_cast<index::RabitqRecord<D>*>(h.records.data());
    index::rabitq_encode_keys<D>(rh, k, n, records + h.n);
  });
  h.n += n;
}

int64_t KeyIndex::indexed_tokens(int layer, int kv_head) const {
  return at(layer, kv_head, "indexed_tokens").n;
}

void KeyIndex::estimate_scores(int layer, int kv_head, const float* q, uint64_t rounding_seed,
                               float* scores, float* query_norm_centered) const {
  const index::RabitqHead& rh = head(layer, kv_head);
  const HeadIndex& h = at(layer, kv_head, "estimate_scores");
  with_head_dim(config_.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const index::RabitqQuery<D> query = index::rabitq_quantize_query<D>(rh, q, rounding_seed);
    if (query_norm_centered != nullptr) *query_norm_centered = query.norm_q_centered;
    const auto* records = reinterpret_cast<const index::RabitqRecord<D>*>(h.records.data());
    index::rabitq_estimate_scores_popcount<D>(rh, query, records, h.n, scores);
  });
}

void KeyIndex::estimate_scores_ref(int layer, int kv_head, const float* q, uint64_t rounding_seed,
                                   float* scores) const {
  const index::RabitqHead& rh = head(layer, kv_head);
  const HeadIndex& h = at(layer, kv_head, "estimate_scores_ref");
  with_head_dim(config_.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    const index::RabitqQuery<D> query = index::rabitq_quantize_query<D>(rh, q, rounding_seed);
    const auto* records = reinterpret_cast<const index::RabitqRecord<D>*>(h.records.data());
    index::rabitq_estimate_scores_ref<D>(rh, query, records, h.n, scores);
  });
}

const uint8_t* KeyIndex::records(int layer, int kv_head) const {
  return at(layer, kv_head, "records").records.data();
}

float KeyIndex::key_norm_centered(int layer, int kv_head, int64_t t) const {
  const HeadIndex& h = at(layer, kv_head, "key_norm_centered");
  if (t < 0 || t >= h.n)
    fail(StatusCode::kOutOfRange, "key index: token " + std::to_string(t) + " is not indexed");
  float norm = 0;
  with_head_dim(config_.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    norm = reinterpret_cast<const index::RabitqRecord<D>*>(h.records.data())[t].norm_k_centered;
  });
  return norm;
}

const float* KeyIndex::key_norms(int layer, int kv_head, int64_t* stride) const {
  const HeadIndex& h = at(layer, kv_head, "key_norms");
  if (stride == nullptr) fail(StatusCode::kInvalidArgument, "key index: key_norms needs a stride output");
  const float* norms = nullptr;
  with_head_dim(config_.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    using Record = index::RabitqRecord<D>;
    static_assert(sizeof(Record) % sizeof(float) == 0 && offsetof(Record, norm_k_centered) % sizeof(float) == 0);
    *stride = int64_t(sizeof(Record) / sizeof(float));
    norms = reinterpret_cast<const float*>(h.records.data() + offsetof(Record, norm_k_centered));
  });
  return norms;
}

void KeyIndex::clear() {
  for (HeadIndex& h : heads_) h = HeadIndex{};
}

uint64_t KeyIndex::bytes() const {
  const size_t d = size_t(config_.head_dim);
  // A head's rotation copy: P^T (Haar) or three sign vectors (Hadamard), in floats.
  const size_t rotation_floats =
      config_.rotation == index::RotationKind::kHaar ? d * d : 3 * d;
  uint64_t total = 0;
  for (const HeadIndex& h : heads_) {
    if (!h.head) continue;
    const uint64_t pages = uint64_t(h.n + config_.page_records - 1) / uint64_t(config_.page_records);
    total += pages * uint64_t(config_.page_records) * record_bytes_ + 2 * d * sizeof(float) +
             rotation_floats * sizeof(float);
  }
  return total;
}

}  // namespace certkv::cache
