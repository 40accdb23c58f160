// The C API's KV store (certkv_kv_store_*): the cache layer's paged KV cache and the attention
// layer's decode attention with the meter, for front ends that compute K and V themselves (the
// Python package's certkv.KvStore and its transformers cache).
//
// One cache::KvCache per layer (its first_model_layer the layer, so dither8 keys its pages as a
// whole-model cache does): a model's layers append one after another, each with its own length,
// and a GAAC scheme without a calibration file calibrates each layer on its first append. A store
// of device "cuda" keeps its pages in a backend::cuda::DeviceKvStore instead (the same per-layer
// shape and calibration, on the device) and takes device rows and queries.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "api/api_meter_stats.h"
#include "api/api_status.h"
#include "api/kv_store_sparse.h"
#include "attention/decode_attention.h"
#include "attention/decode_gate.h"
#include "attention/sparse_decode.h"
#include "backend/backend.h"
#include "backend/cuda/device_kv_store.h"
#include "cache/kv_cache.h"
#include "cache/kv_scheme.h"
#include "certkv/certkv.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "format/fp8.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"
#include "gate/meter.h"
#include "gate/telemetry.h"

namespace cache = certkv::cache;
namespace codec = certkv::codec;
using certkv::StatusCode;
using certkv::api::guarded;
using certkv::api::set_error;

struct certkv_kv_store {
  cache::KvScheme scheme = cache::KvScheme::kBf16;
  cache::KvCacheConfig layer_config;  // of every layer's cache (n_layers 1), but its calibration
  int n_layers = 0;
  int n_heads = 0;
  int n_sequences = 0;
  float sm_scale = 0.f;
  double delta_loc = 0;
  bool metered = false;
  bool gate = false;  // params.gate: decode steps above tau repaired (certkv_kv_store_attend)
  double tau = 0.2;   // params.meter_tau
  // A GAAC scheme without a calibration file: each layer's cache is made at its first append,
  // calibrated on it. Otherwise every cache is made at create.
  bool calibrate_on_first_append = false;
  std::vector<std::shared_ptr<const codec::GaacCalibration>> calibrations;  // [layer] or empty
  std::vector<std::unique_ptr<cache::KvCache>> layers;                     // [layer]
  std::vector<std::vector<cache::SeqId>> seqs;                             // [layer][seq]
  std::unique_ptr<certkv::ThreadPool> pool;
  std::unique_ptr<certkv::gate::Telemetry> telemetry;
  std::vector<float> rows;                       // [n_tokens][n_kv_heads][head_dim] for write
  std::vector<certkv::attention::HeadMeter> head_meters;
  // Sparse decode (params.sparse_p): on device cpu each (layer, sequence) of the layers past the
  // dense ones has its key index (api/kv_store_sparse.h), the others' vectors staying empty; on
  // device cuda the device store keeps them.
  certkv::backend::SparseConfig sparse;  // enabled: params.sparse_p != 0, window and dense layers resolved
  cache::KeyIndexConfig key_index_config;
  std::vector<std::vector<certkv::api::StoreKeyIndex>> key_indexes;  // [layer][seq]
  certkv::backend::SparseStats sparse_stats;  // steps: (sequence, layer) decode steps of the sparse layers
  // Device "cuda": the pages on the device (layers, seqs and pool then stay empty). Declared
  // last: destroyed first, before the telemetry it records into.
  std::unique_ptr<certkv::backend::cuda::DeviceKvStore> device;
};

namespace {

int kv_heads(const certkv_kv_store& s) { return s.layer_config.n_kv_heads; }
int head_dim(const certkv_kv_store& s) { return s.layer_config.head_dim; }

// The layer's cache for layer `layer`, made from `calibration`, with the store's sequences.
void make_layer(certkv_kv_store& s, int layer, std::shared_ptr<const codec::GaacCalibration> calibration) {
  cache::KvCacheConfig c = s.layer_config;
  c.first_model_layer = layer;
  c.gaac_calibration = std::move(calibration);
  auto kv = std::make_unique<cache::KvCache>(c);
  std::vector<cache::SeqId>& ids = s.seqs[size_t(layer)];
  ids.clear();
  for (int i = 0; i < s.n_sequences; ++i) ids.push_back(kv->create_sequence());
  s.layers[size_t(layer)] = std::move(kv);
}

// One layer of a model-wide calibration as the calibration of a one-layer cache.
std::shared_ptr<const codec::GaacCalibration> layer_calibration(const codec::GaacCalibration& all, int layer) {
  codec::GaacShape shape = all.shape();
  shape.n_layers = 1;
  auto one = std::make_shared<codec::GaacCalibration>(shape);
  for (int kv = 0; kv < 2; ++kv) {
    one->set_escape_capacity_bytes(0, kv, all.escape_capacity_bytes(layer, kv));
    for (int h = 0; h < shape.n_kv_heads; ++h) one->bases(0, kv, h) = all.bases(layer, kv, h);
  }
  return one;
}

// The calibration of one layer from rows [n][n_kv_heads][head_dim] float (rounded as the cache
// stores them: bf16, then the scheme's FP8 element).
std::shared_ptr<const codec::GaacCalibration> calibrate_layer(const certkv_kv_store& s, const float* k,
                                                              const float* v, int64_t n) {
  const int h_kv = kv_heads(s), d = head_dim(s);
  codec::GaacShape shape;
  shape.n_layers = 1;
  shape.n_kv_heads = h_kv;
  shape.head_dim = d;
  shape.block_tokens = s.layer_config.block_tokens;
  shape.element = cache::kv_scheme_element(s.scheme);
  codec::GaacCalibrator calibrator(shape);
  std::vector<uint16_t> bf16(size_t(n) * size_t(d));
  std::vector<uint8_t> fp8(size_t(n) * size_t(d));
  for (int kv = 0; kv < 2; ++kv) {
    const float* x = kv == 0 ? k : v;
    for (int h = 0; h < h_kv; ++h) {
      for (int64_t t = 0; t < n; ++t)
        for (int c = 0; c < d; ++c) {
          const uint16_t b = certkv::format::float_to_bf16(x[(size_t(t) * size_t(h_kv) + size_t(h)) * size_t(d) + size_t(c)]);
          bf16[size_t(t) * size_t(d) + size_t(c)] = b;
          if (shape.element == certkv::format::GaacElement::kFp8E4M3)
            fp8[size_t(t) * size_t(d) + size_t(c)] = certkv::format::bf16_to_fp8_e4m3_ref(b);
          else if (shape.element == certkv::format::GaacElement::kFp8E5M2)
            fp8[size_t(t) * size_t(d) + size_t(c)] = certkv::format::bf16_to_fp8_e5m2_ref(b);
        }
      if (shape.element == certkv::format::GaacElement::kBf16)
        calibrator.add_bf16(0, kv, h, bf16.data(), int(n));
      else
        calibrator.add_fp8(0, kv, h, fp8.data(), int(n));
    }
  }
  return std::make_shared<const codec::GaacCalibration>(calibrator.finish());
}

std::string where_seq(const char* where, int32_t seq, int32_t layer) {
  return std::string(where) + " (seq " + std::to_string(seq) + ", layer " + std::to_string(layer) + ")";
}

// UNSUPPORTED for a store of device "cuda" in the functions that take host rows and queries.
certkv_status refuse_device_store(const char* where, const certkv_kv_store* store) {
  if (store == nullptr || !store->device) return CERTKV_OK;
  return set_error(CERTKV_ERR_UNSUPPORTED, std::string(where) +
                                               ": the store's pages are on device cuda; it takes device rows and "
                                               "queries (certkv_kv_store_append_device, _attend_device)");
}

// Fails with a message naming the function for a null store, or a seq or layer out of range.
certkv_status check_seq_layer(const char* where, const certkv_kv_store* store, int32_t seq, int32_t layer) {
  CERTKV_REQUIRE(store != nullptr, std::string(where) + ": null store");
  if (seq < 0 || seq >= store->n_sequences)
    return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(where) + ": seq " + std::to_string(seq) +
                                                  " outside [0, " + std::to_string(store->n_sequences) + ")");
  if (layer < 0 || layer >= store->n_layers)
    return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(where) + ": layer " + std::to_string(layer) +
                                                  " outside [0, " + std::to_string(store->n_layers) + ")");
  return CERTKV_OK;
}

int64_t layer_length(const certkv_kv_store& s, int32_t seq, int32_t layer) {
  if (s.device) return s.device->length(seq, layer);
  const cache::KvCache* c = s.layers[size_t(layer)].get();
  return c ? c->length(s.seqs[size_t(layer)][size_t(seq)]) : 0;
}

// Appends rows [n][n_kv_heads][head_dim] float (s.rows) to (seq, layer): reserve, write, commit.
void append_rows(certkv_kv_store& s, int32_t seq, int32_t layer, int64_t n) {
  const size_t half = size_t(n) * size_t(kv_heads(s)) * size_t(head_dim(s));
  const float* k = s.rows.data();
  const float* v = s.rows.data() + half;
  if (!s.layers[size_t(layer)]) make_layer(s, layer, calibrate_layer(s, k, v, n));
  cache::KvCache& c = *s.layers[size_t(layer)];
  const cache::SeqId id = s.seqs[size_t(layer)][size_t(seq)];
  c.reserve(id, n);
  try {
    c.write(id, 0, k, v, n);
  } catch (...) {
    // A write that failed (a pool chunk the system refused) leaves the sequence unusable: it is
    // emptied rather than left half-written.
    c.free_sequence(id);
    s.seqs[size_t(layer)][size_t(seq)] = c.create_sequence();
    throw;
  }
  c.commit(id, n);
}

// [n_kv_heads][n][head_dim] -> s.rows [n][n_kv_heads][head_dim] for K, then for V.
template <typename T, typename ToFloat>
void gather_rows(certkv_kv_store& s, const T* k, const T* v, int64_t n, ToFloat to_float) {
  const size_t h_kv = size_t(kv_heads(s)), d = size_t(head_dim(s));
  const size_t half = size_t(n) * h_kv * d;
  s.rows.resize(2 * half);
  for (int kv = 0; kv < 2; ++kv) {
    const T* src = kv == 0 ? k : v;
    float* dst = s.rows.data() + size_t(kv) * half;
    for (size_t h = 0; h < h_kv; ++h)
      for (size_t t = 0; t < size_t(n); ++t)
        for (size_t c = 0; c < d; ++c) dst[(t * h_kv + h) * d + c] = to_float(src[(h * size_t(n) + t) * d + c]);
  }
}

template <typename T, typename ToFloat>
certkv_status append(const char* where, certkv_kv_store* store, int32_t seq, int32_t layer, const T* k,
                     const T* v, int64_t n_tokens, ToFloat to_float) {
  if (const certkv_status st = refuse_device_store(where, store); st != CERTKV_OK) return st;
  if (const certkv_status st = check_seq_layer(where, store, seq, layer); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(k && v, where_seq(where, seq, layer) + ": null k or v");
  CERTKV_REQUIRE(n_tokens >= 1 && n_tokens <= (int64_t(1) << 31),
                 where_seq(where, seq, layer) + ": n_tokens " + std::to_string(n_tokens) + " is not in [1, 2^31]");
  return guarded([&] {
    gather_rows(*store, k, v, n_tokens, to_float);
    append_rows(*store, seq, layer, n_tokens);
  });
}

// kv_stats of a store of device "cuda": its pages on the device, by class (raw pages, coded pages).
void device_kv_stats(const certkv_kv_store& s, certkv_kv_stats* stats) {
  const certkv::backend::cuda::DeviceKvStoreStats d = s.device->stats();
  const cache::KvSchemeInfo& info = cache::kv_scheme_info(s.scheme);
  stats->n_tokens = d.tokens_layer0;
  stats->kv_bytes = d.bytes_reserved;
  stats->kv_bytes_in_use = d.bytes_in_use;
  stats->kv_bytes_bf16 = d.kv_bytes_bf16;
  stats->pages_in_use = uint64_t(d.raw_pages_in_use + d.coded_pages_in_use);
  stats->exact_fallback_blocks = uint64_t(d.pages_kept_exact);
  const certkv::format::StorageClass raw = info.element == certkv::format::GaacElement::kBf16
                                               ? certkv::format::StorageClass::kBf16
                                               : certkv::format::StorageClass::kFp8;
  stats->by_class[stats->n_classes++] = certkv_kv_class_stats{certkv::format::storage_class_name(raw),
                                                              uint64_t(d.raw_pages_in_use), 0, d.raw_bytes_in_use};
  if (info.full_blocks != raw)
    stats->by_class[stats->n_classes++] = certkv_kv_class_stats{
        certkv::format::storage_class_name(info.full_blocks), uint64_t(d.coded_pages_in_use), 0, d.coded_bytes_in_use};
}

// A store of device "cuda" and a layer in range (the device functions' first check).
certkv_status check_device_store(const char* where, const certkv_kv_store* store, int32_t layer) {
  CERTKV_REQUIRE(store != nullptr, std::string(where) + ": null store");
  CERTKV_REQUIRE(store->device != nullptr,
                 std::string(where) + ": the store's device is cpu (create it with device \"cuda\")");
  if (layer < 0 || layer >= store->n_layers)
    return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(where) + ": layer " + std::to_string(layer) +
                                                  " outside [0, " + std::to_string(store->n_layers) + ")");
  return CERTKV_OK;
}

// The arguments of append_device / attend_device: a store of device "cuda", the layer, and n_seqs
// distinct sequences in range.
certkv_status check_device_call(const char* where, const certkv_kv_store* store, int32_t layer, const int32_t* seqs,
                                int32_t n_seqs) {
  if (const certkv_status st = check_device_store(where, store, layer); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(seqs != nullptr && n_seqs >= 1 && n_seqs <= store->n_sequences,
                 std::string(where) + ": n_seqs " + std::to_string(n_seqs) + " is not in [1, " +
                     std::to_string(store->n_sequences) + "] (or null seqs)");
  std::vector<char> seen(size_t(store->n_sequences), 0);
  for (int32_t i = 0; i < n_seqs; ++i) {
    if (seqs[i] < 0 || seqs[i] >= store->n_sequences)
      return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(where) + ": seqs[" + std::to_string(i) + "] " +
                                                    std::to_string(seqs[i]) + " outside [0, " +
                                                    std::to_string(store->n_sequences) + ")");
    CERTKV_REQUIRE(!seen[size_t(seqs[i])], std::string(where) + ": seq " + std::to_string(seqs[i]) + " named twice");
    seen[size_t(seqs[i])] = 1;
  }
  return CERTKV_OK;
}

}  // namespace

extern "C" {

certkv_kv_store_params certkv_kv_store_default_params(void) {
  certkv_kv_store_params p{};
  p.kv = nullptr;
  p.block_tokens = 16;
  p.n_sequences = 1;
  p.max_tokens = 0;
  p.rope_layout = nullptr;
  p.sm_scale = 0;
  p.outlier_pairs = -1;
  p.recent_window_tokens = -1;
  p.witness = nullptr;
  p.gaac_calibration = nullptr;
  p.meter_delta = 1e-2;
  p.meter_tau = 0.2;
  p.meter_planned_steps = 0;
  p.n_threads = 1;
  p.gate = 0;
  p.sparse_p = 0;
  p.sparse_window = -1;
  p.sparse_dense_layers = -1;
  p.sparse_deviations = 0;
  p.sparse_rotation = nullptr;
  return p;
}

certkv_status certkv_kv_store_create(const certkv_kv_store_params* params, certkv_kv_store** out) {
  const char* w = "certkv_kv_store_create";
  CERTKV_REQUIRE(params && out, std::string(w) + ": null argument");
  *out = nullptr;
  const certkv_kv_store_params& p = *params;
  const std::string kv = p.kv ? p.kv : "bf16";
  cache::KvScheme scheme;
  try {
    scheme = cache::parse_kv_scheme(kv);
  } catch (const certkv::Error& e) {
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, std::string(w) + ": kv: " + e.what());
  }
  const cache::KvSchemeInfo& info = cache::kv_scheme_info(scheme);
  auto positive = [&](int64_t value, const char* field) -> certkv_status {
    CERTKV_REQUIRE(value >= 1, std::string(w) + ": " + field + " " + std::to_string(value) + " is below 1");
    return CERTKV_OK;
  };
  for (auto [value, field] : {std::pair<int64_t, const char*>{p.n_layers, "n_layers"}, {p.n_heads, "n_heads"},
                              {p.n_kv_heads, "n_kv_heads"}, {p.head_dim, "head_dim"},
                              {p.block_tokens, "block_tokens"}, {p.n_sequences, "n_sequences"},
                              {p.n_threads, "n_threads"}})
    if (const certkv_status st = positive(value, field); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(p.n_heads % p.n_kv_heads == 0, std::string(w) + ": n_heads " + std::to_string(p.n_heads) +
                                                    " is not a multiple of n_kv_heads " +
                                                    std::to_string(p.n_kv_heads));
  CERTKV_REQUIRE(p.max_tokens >= 0, std::string(w) + ": max_tokens " + std::to_string(p.max_tokens) + " is negative");
  codec::RopePairing pairing = codec::RopePairing::kInterleaved;
  CERTKV_REQUIRE(p.rope_layout == nullptr || codec::parse_rope_pairing(p.rope_layout, &pairing),
                 std::string(w) + ": rope_layout '" + (p.rope_layout ? p.rope_layout : "") +
                     "' is not interleaved or half-split");
  CERTKV_REQUIRE(std::isfinite(p.sm_scale), std::string(w) + ": sm_scale is not finite");
  codec::WitnessCode witness;
  try {
    witness = cache::resolve_kv_witness(scheme, p.witness, std::string(w) + ": witness");
  } catch (const certkv::Error& e) {
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, e.what());
  }
  const bool has_file = p.gaac_calibration != nullptr && p.gaac_calibration[0] != '\0';
  CERTKV_REQUIRE(!has_file || info.gaac || info.lossy,
                 std::string(w) + ": gaac_calibration applies to the GAAC and lossy schemes, not kv " + info.name);
  CERTKV_REQUIRE(p.meter_delta > 0 && p.meter_delta < 1,
                 std::string(w) + ": meter_delta " + std::to_string(p.meter_delta) + " is not in (0, 1)");
  CERTKV_REQUIRE(p.meter_tau > 0 && std::isfinite(p.meter_tau),
                 std::string(w) + ": meter_tau " + std::to_string(p.meter_tau) + " is not finite and > 0");
  CERTKV_REQUIRE(p.meter_planned_steps >= 0, std::string(w) + ": meter_planned_steps is negative");
  const std::string device = p.device ? p.device : "cpu";
  CERTKV_REQUIRE(device == "cpu" || device == "cuda", std::string(w) + ": device '" + device + "' is not cpu or cuda");
  const bool on_cuda = device == "cuda";
  if (on_cuda && !info.cuda_route)
    return set_error(CERTKV_ERR_UNSUPPORTED,
                     std::string(w) + ": kv " + info.name + " is not served on device cuda (" +
                         cache::kv_scheme_names([](const cache::KvSchemeInfo& i) { return i.cuda_route; }) + " are)");
  CERTKV_REQUIRE(p.gate == 0 || info.lossy,
                 std::string(w) + ": the gate repairs lossy pages from their backing store; kv " + info.name +
                     " is lossless");
  if (on_cuda && p.gate != 0)
    return set_error(CERTKV_ERR_UNSUPPORTED, std::string(w) + ": the gate is not served on device cuda (its pages "
                                                              "keep no exact backing store); gate on device cpu");
  CERTKV_REQUIRE(p.sparse_p == 0 || (p.sparse_p > 0 && p.sparse_p <= 1),
                 std::string(w) + ": sparse_p " + std::to_string(p.sparse_p) + " is not 0 (dense) or in (0, 1]");
  CERTKV_REQUIRE(p.sparse_deviations >= 0 && std::isfinite(p.sparse_deviations),
                 std::string(w) + ": sparse_deviations must be finite and >= 0");
  CERTKV_REQUIRE(p.sparse_deviations == 0 || p.sparse_p != 0,
                 std::string(w) + ": sparse_deviations widens sparse decode's selection: set sparse_p too");
  CERTKV_REQUIRE(p.sparse_window >= -1, std::string(w) + ": sparse_window " + std::to_string(p.sparse_window) +
                                            " is negative (-1: 128)");
  CERTKV_REQUIRE(p.sparse_dense_layers >= -1 && p.sparse_dense_layers <= p.n_layers,
                 std::string(w) + ": sparse_dense_layers " + std::to_string(p.sparse_dense_layers) +
                     " is not in [0, n_layers = " + std::to_string(p.n_layers) + "] (-1: 2)");
  certkv::index::RotationKind rotation = certkv::index::RotationKind::kHaar;
  if (p.sparse_rotation != nullptr) {
    try {
      rotation = cache::parse_rotation_kind(p.sparse_rotation);
    } catch (const certkv::Error& e) {
      return set_error(CERTKV_ERR_INVALID_ARGUMENT, std::string(w) + ": sparse_rotation: " + e.what());
    }
  }
  if (p.sparse_p != 0) {
    if (on_cuda && !info.cuda_sparse)
      return set_error(CERTKV_ERR_UNSUPPORTED,
                       std::string(w) + ": sparse decode on device cuda reads " +
                           cache::kv_scheme_names([](const cache::KvSchemeInfo& i) { return i.cuda_sparse; }) +
                           " pages, not " + info.name + " (device cpu serves sparse decode over every scheme)");
    if (!cache::key_index_supports_head_dim(p.head_dim))
      return set_error(CERTKV_ERR_UNSUPPORTED, std::string(w) + ": sparse decode: head_dim " +
                                                   std::to_string(p.head_dim) +
                                                   " is not supported by the key index (32, 64, 96, 128, 256)");
    if (p.gate != 0)
      return set_error(CERTKV_ERR_UNSUPPORTED,
                       std::string(w) + ": the gate and sparse decode do not combine yet (the meter does)");
  }
  if (on_cuda && info.lossy && p.recent_window_tokens > 0)
    return set_error(CERTKV_ERR_UNSUPPORTED, std::string(w) + ": device cuda keeps no full-precision recent window "
                                                              "(recent_window_tokens " +
                                                              std::to_string(p.recent_window_tokens) + ")");
  return guarded([&] {
    auto s = std::make_unique<certkv_kv_store>();
    s->scheme = scheme;
    s->n_layers = p.n_layers;
    s->n_heads = p.n_heads;
    s->n_sequences = p.n_sequences;
    s->sm_scale = p.sm_scale != 0 ? float(p.sm_scale) : float(1.0 / std::sqrt(double(p.head_dim)));
    cache::KvCacheConfig& c = s->layer_config;
    c.n_layers = 1;
    c.n_kv_heads = p.n_kv_heads;
    c.head_dim = p.head_dim;
    c.block_tokens = p.block_tokens;
    c.max_tokens = p.max_tokens != 0 ? p.max_tokens : int64_t(4096) * p.n_sequences;
    c.scheme = scheme;
    c.rope_pairing = pairing;
    c.outlier_pairs = p.outlier_pairs;
    c.recent_window_tokens = p.recent_window_tokens;
    c.witness = witness;
    s->metered = info.lossy;
    s->gate = p.gate != 0;
    s->tau = p.meter_tau;
    const int64_t steps = p.meter_planned_steps != 0 ? p.meter_planned_steps : c.max_tokens;
    s->delta_loc = certkv::gate::local_delta(p.meter_delta, p.n_layers, p.n_heads, steps);
    s->telemetry = std::make_unique<certkv::gate::Telemetry>(p.meter_tau);
    s->pool = std::make_unique<certkv::ThreadPool>(p.n_threads);
    s->layers.resize(size_t(p.n_layers));
    s->seqs.resize(size_t(p.n_layers));
    if (p.sparse_p != 0) {
      certkv::backend::SparseConfig& sp = s->sparse;
      sp.enabled = true;
      sp.p = p.sparse_p;
      sp.deviations = p.sparse_deviations;
      sp.window_tokens = p.sparse_window == -1 ? 128 : p.sparse_window;
      sp.dense_layers = p.sparse_dense_layers == -1 ? std::min(2, int(p.n_layers)) : p.sparse_dense_layers;
      sp.rotation = rotation;
      cache::KeyIndexConfig& ic = s->key_index_config;
      ic.n_layers = 1;
      ic.n_kv_heads = p.n_kv_heads;
      ic.head_dim = p.head_dim;
      ic.page_records = p.block_tokens;
      ic.rotation = sp.rotation;
      ic.seed = sp.seed;
      s->key_indexes.resize(size_t(p.n_layers));
      if (!on_cuda)
        for (int l = sp.dense_layers; l < p.n_layers; ++l)
          for (int i = 0; i < p.n_sequences; ++i) s->key_indexes[size_t(l)].emplace_back(ic);
    }
    if (has_file) {
      codec::GaacShape shape;
      shape.n_layers = p.n_layers;
      shape.n_kv_heads = p.n_kv_heads;
      shape.head_dim = p.head_dim;
      shape.block_tokens = p.block_tokens;
      shape.element = info.element;
      const codec::GaacCalibration all = codec::GaacCalibration::load(p.gaac_calibration, shape);
      for (int l = 0; l < p.n_layers; ++l) s->calibrations.push_back(layer_calibration(all, l));
    }
    s->calibrate_on_first_append = info.gaac && !has_file;
    if (s->calibrate_on_first_append) {
      if (certkv::format::gaac_tile_channels(p.head_dim) == 0)
        certkv::fail(StatusCode::kUnsupported, std::string(w) + ": head_dim " + std::to_string(p.head_dim) +
                                                   " does not split into GAAC tiles (kv " + info.name + ")");
      // The shape is checked now, not at the first append: a cache with a calibration of every
      // base 0 refuses what the real one would.
      codec::GaacShape shape;
      shape.n_layers = 1;
      shape.n_kv_heads = p.n_kv_heads;
      shape.head_dim = p.head_dim;
      shape.block_tokens = p.block_tokens;
      shape.element = info.element;
      cache::KvCacheConfig probe = c;
      probe.max_tokens = p.block_tokens;
      probe.gaac_calibration = std::make_shared<const codec::GaacCalibration>(shape);
      cache::KvCache check(probe);
    }
    if (on_cuda) {
      certkv::backend::cuda::DeviceKvStoreConfig d;
      d.layer = c;
      d.n_layers = p.n_layers;
      d.n_heads = p.n_heads;
      d.n_sequences = p.n_sequences;
      if (info.gaac) d.calibrations = s->calibrations;
      d.sm_scale = s->sm_scale;
      d.delta_loc = s->delta_loc;
      d.stream = p.cuda_stream;
      d.sparse = s->sparse;
      const certkv_kv_store* raw = s.get();
      s->device = certkv::backend::cuda::make_device_kv_store(
          d, [raw](const float* k, const float* v, int64_t n) { return calibrate_layer(*raw, k, v, n); },
          *s->telemetry);
    } else if (!s->calibrate_on_first_append) {
      for (int l = 0; l < p.n_layers; ++l)
        make_layer(*s, l, has_file ? s->calibrations[size_t(l)] : nullptr);
    }
    *out = s.release();
  });
}

void certkv_kv_store_free(certkv_kv_store* store) { delete store; }

certkv_status certkv_kv_store_append_bf16(certkv_kv_store* store, int32_t seq, int32_t layer,
                                          const uint16_t* k, const uint16_t* v, int64_t n_tokens) {
  return append("certkv_kv_store_append_bf16", store, seq, layer, k, v, n_tokens,
                [](uint16_t b) { return certkv::format::bf16_to_float(b); });
}

certkv_status certkv_kv_store_append_f32(certkv_kv_store* store, int32_t seq, int32_t layer,
                                         const float* k, const float* v, int64_t n_tokens) {
  return append("certkv_kv_store_append_f32", store, seq, layer, k, v, n_tokens, [](float x) { return x; });
}

certkv_status certkv_kv_store_length(const certkv_kv_store* store, int32_t seq, int32_t layer,
                                     int64_t* n_tokens) {
  if (const certkv_status st = check_seq_layer("certkv_kv_store_length", store, seq, layer); st != CERTKV_OK)
    return st;
  CERTKV_REQUIRE(n_tokens, "certkv_kv_store_length: null n_tokens");
  return guarded([&] { *n_tokens = layer_length(*store, seq, layer); });
}

certkv_status certkv_kv_store_read(const certkv_kv_store* store, int32_t seq, int32_t layer, int32_t kv,
                                   int64_t begin, int64_t end, int exact, float* out) {
  const char* w = "certkv_kv_store_read";
  if (const certkv_status st = check_seq_layer(w, store, seq, layer); st != CERTKV_OK) return st;
  if (store->device && exact && store->metered)
    return set_error(CERTKV_ERR_UNSUPPORTED, where_seq(w, seq, layer) + ": device cuda keeps no exact values of " +
                                                 cache::kv_scheme_name(store->scheme) +
                                                 "'s lossy pages (exact = 0 reads what attention reads)");
  CERTKV_REQUIRE(kv == 0 || kv == 1, where_seq(w, seq, layer) + ": kv " + std::to_string(kv) + " is not 0 (K) or 1 (V)");
  const int64_t n = layer_length(*store, seq, layer);
  if (begin < 0 || begin > end || end > n)
    return set_error(CERTKV_ERR_OUT_OF_RANGE, where_seq(w, seq, layer) + ": positions [" + std::to_string(begin) +
                                                  ", " + std::to_string(end) + ") outside the " +
                                                  std::to_string(n) + " stored");
  CERTKV_REQUIRE(out || begin == end, where_seq(w, seq, layer) + ": null out");
  if (begin == end) return CERTKV_OK;
  if (store->device) return guarded([&] { store->device->read(seq, layer, kv, begin, end, out); });
  return guarded([&] {
    cache::KvCache& c = *store->layers[size_t(layer)];
    const cache::SeqId id = store->seqs[size_t(layer)][size_t(seq)];
    const size_t per_head = size_t(end - begin) * size_t(head_dim(*store));
    for (int h = 0; h < kv_heads(*store); ++h) {
      float* dst = out + size_t(h) * per_head;
      if (exact)
        c.read_token_range_exact(id, 0, cache::KvTensor(kv), h, begin, end, dst);
      else
        c.read_token_range_ref(id, 0, cache::KvTensor(kv), h, begin, end, dst);
    }
  });
}

certkv_status certkv_kv_store_attend(certkv_kv_store* store, int32_t seq, int32_t layer, const float* q,
                                     int32_t n_queries, float* out, certkv_head_meter* meters) {
  const char* w = "certkv_kv_store_attend";
  if (const certkv_status st = refuse_device_store(w, store); st != CERTKV_OK) return st;
  if (const certkv_status st = check_seq_layer(w, store, seq, layer); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(q && out, where_seq(w, seq, layer) + ": null q or out");
  const int64_t n = layer_length(*store, seq, layer);
  CERTKV_REQUIRE(n_queries >= 1 && n_queries <= n,
                 where_seq(w, seq, layer) + ": n_queries " + std::to_string(n_queries) + " is not in [1, " +
                     std::to_string(n) + "] (the positions stored; append the queries' K and V first)");
  CERTKV_REQUIRE(meters == nullptr || n_queries == 1,
                 where_seq(w, seq, layer) + ": meters are computed for decode steps (n_queries 1), not for " +
                     std::to_string(n_queries) + " queries");
  return guarded([&] {
    cache::KvCache& c = *store->layers[size_t(layer)];
    const cache::SeqId id = store->seqs[size_t(layer)][size_t(seq)];
    certkv::attention::AttentionShape shape;
    shape.n_q_heads = store->n_heads;
    shape.n_kv_heads = kv_heads(*store);
    shape.head_dim = head_dim(*store);
    shape.scale = store->sm_scale;
    certkv::api::StoreKeyIndex* key_index =
        store->key_indexes.empty() || store->key_indexes[size_t(layer)].empty()
            ? nullptr
            : &store->key_indexes[size_t(layer)][size_t(seq)];
    if (n_queries > 1) {
      if (key_index) key_index->note_queries(q, n_queries, store->n_heads);
      certkv::attention::prefill_attention(c, id, 0, shape, q, n - n_queries, n_queries, out, store->pool.get());
      return;
    }
    certkv::attention::DecodeOptions options;
    std::vector<certkv::attention::HeadMeter>& m = store->head_meters;
    if (store->metered) {
      m.assign(size_t(store->n_heads), {});
      options.meters = m.data();
      options.meter.delta_loc = store->delta_loc;
    }
    auto attend = [&] { certkv::attention::decode_attention(c, id, 0, shape, q, n, out, store->pool.get(), options); };
    certkv::backend::SparseStats& ss = store->sparse_stats;
    if (key_index) {
      const auto start = std::chrono::steady_clock::now();
      ss.index_appended_tokens += key_index->update(c, id, n, q, store->n_heads, store->sparse);
      ss.index_build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (key_index && key_index->has_records()) {
      certkv::attention::SparseDecodeOptions so;
      so.p = store->sparse.p;
      so.deviations = store->sparse.deviations;
      so.rounding_seed = certkv::attention::sparse_step_rounding_seed(store->sparse.seed, n - 1, store->n_layers, layer);
      so.meters = options.meters;
      so.meter = options.meter;
      std::vector<certkv::attention::SparseHeadStats> heads(size_t(store->n_heads));
      certkv::attention::sparse_decode_attention(c, id, 0, shape, q, n, key_index->index(), so, out, heads.data(),
                                                 store->pool.get());
      ss.steps += 1;
      for (const certkv::attention::SparseHeadStats& h : heads) {
        ss.cells += 1;
        ss.sum_budget += double(h.n_attended) / double(n);
        ss.widened_tokens += h.n_widened;
        ss.context_tokens += n;
      }
    } else {
      attend();
      if (store->sparse.enabled) ss.dense_cells += store->n_heads;
    }
    if (store->metered)
      for (const certkv::attention::HeadMeter& hm : m) store->telemetry->record(hm.meter, std::isinf(hm.log_a));
    if (store->gate)
      certkv::attention::gate_decode_step(c, id, 0, shape, q, n, options.meter, store->tau, m.data(), attend,
                                          [&](int, int64_t, uint64_t bytes) {
                                            store->telemetry->add_repairs(2, int64_t(bytes));
                                          });
    for (int h = 0; h < store->n_heads && meters; ++h) {
      const certkv::attention::HeadMeter hm = store->metered ? m[size_t(h)] : certkv::attention::HeadMeter{};
      meters[h] = certkv_head_meter{hm.meter, hm.log_a, hm.value_rho, hm.v_norm_max, hm.output_bound};
    }
  });
}

certkv_status certkv_kv_store_append_device(certkv_kv_store* store, int32_t layer, const int32_t* seqs,
                                            const int64_t* n_tokens, int32_t n_seqs, const float* k, const float* v) {
  const char* w = "certkv_kv_store_append_device";
  if (const certkv_status st = check_device_call(w, store, layer, seqs, n_seqs); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(n_tokens && k && v, std::string(w) + ": null n_tokens, k or v");
  for (int32_t i = 0; i < n_seqs; ++i)
    CERTKV_REQUIRE(n_tokens[i] >= 1 && n_tokens[i] <= (int64_t(1) << 31),
                   std::string(w) + ": n_tokens[" + std::to_string(i) + "] " + std::to_string(n_tokens[i]) +
                       " is not in [1, 2^31]");
  return guarded([&] {
    store->device->append(layer, std::span<const int32_t>(seqs, size_t(n_seqs)),
                          std::span<const int64_t>(n_tokens, size_t(n_seqs)), k, v);
  });
}

certkv_status certkv_kv_store_attend_device(certkv_kv_store* store, int32_t layer, const int32_t* seqs, int32_t n_seqs,
                                            const float* q, float* out, float* meters) {
  const char* w = "certkv_kv_store_attend_device";
  if (const certkv_status st = check_device_call(w, store, layer, seqs, n_seqs); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(q && out, std::string(w) + ": null q or out");
  for (int32_t i = 0; i < n_seqs; ++i)
    CERTKV_REQUIRE(store->device->length(seqs[i], layer) >= 1,
                   std::string(w) + ": seq " + std::to_string(seqs[i]) + " holds no position of layer " +
                       std::to_string(layer) + " (append its K and V first)");
  return guarded([&] { store->device->attend(layer, std::span<const int32_t>(seqs, size_t(n_seqs)), q, out, meters); });
}

certkv_status certkv_kv_store_note_queries_device(certkv_kv_store* store, int32_t layer, const int32_t* seqs,
                                                  const int64_t* n_tokens, int32_t n_seqs, const float* q) {
  const char* w = "certkv_kv_store_note_queries_device";
  if (const certkv_status st = check_device_call(w, store, layer, seqs, n_seqs); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(n_tokens && q, std::string(w) + ": null n_tokens or q");
  for (int32_t i = 0; i < n_seqs; ++i) {
    const int64_t held = store->device->length(seqs[i], layer);
    CERTKV_REQUIRE(n_tokens[i] >= 1 && n_tokens[i] <= held,
                   std::string(w) + ": n_tokens[" + std::to_string(i) + "] " + std::to_string(n_tokens[i]) +
                       " is not in [1, " + std::to_string(held) + "] (the positions seq " + std::to_string(seqs[i]) +
                       " holds of layer " + std::to_string(layer) + "; append the queries' K and V first)");
  }
  return guarded([&] {
    store->device->note_queries(layer, std::span<const int32_t>(seqs, size_t(n_seqs)),
                                std::span<const int64_t>(n_tokens, size_t(n_seqs)), q);
  });
}

certkv_status certkv_kv_store_plan_device(certkv_kv_store* store, const int32_t* seqs, int32_t n_seqs, int64_t steps,
                                          int32_t* recapture) {
  const char* w = "certkv_kv_store_plan_device";
  if (const certkv_status st = check_device_call(w, store, 0, seqs, n_seqs); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(steps >= 1 && steps <= (int64_t(1) << 20),
                 std::string(w) + ": steps " + std::to_string(steps) + " is not in [1, 2^20]");
  return guarded([&] {
    const bool again = store->device->plan(std::span<const int32_t>(seqs, size_t(n_seqs)), steps);
    if (recapture) *recapture = again ? 1 : 0;
  });
}

certkv_status certkv_kv_store_append_planned_device(certkv_kv_store* store, int32_t layer, const float* k,
                                                    const float* v, void* stream) {
  const char* w = "certkv_kv_store_append_planned_device";
  if (const certkv_status st = check_device_store(w, store, layer); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(k && v, std::string(w) + ": null k or v");
  return guarded([&] { store->device->append_planned(layer, k, v, stream); });
}

certkv_status certkv_kv_store_attend_planned_device(certkv_kv_store* store, int32_t layer, const float* q, float* out,
                                                    float* meters, void* stream) {
  const char* w = "certkv_kv_store_attend_planned_device";
  if (const certkv_status st = check_device_store(w, store, layer); st != CERTKV_OK) return st;
  CERTKV_REQUIRE(q && out, std::string(w) + ": null q or out");
  return guarded([&] { store->device->attend_planned(layer, q, out, meters, stream); });
}

certkv_status certkv_kv_store_finish_planned_device(certkv_kv_store* store, void* stream) {
  const char* w = "certkv_kv_store_finish_planned_device";
  if (const certkv_status st = check_device_store(w, store, 0); st != CERTKV_OK) return st;
  return guarded([&] { store->device->finish_planned(stream); });
}

certkv_status certkv_kv_store_planned_device(const certkv_kv_store* store, int32_t* open) {
  CERTKV_REQUIRE(store != nullptr && open != nullptr, "certkv_kv_store_planned_device: null store or open");
  return guarded([&] { *open = store->device != nullptr && store->device->planned() ? 1 : 0; });
}

certkv_status certkv_kv_store_crop(certkv_kv_store* store, int32_t seq, int64_t n_tokens) {
  const char* w = "certkv_kv_store_crop";
  if (const certkv_status st = check_seq_layer(w, store, seq, 0); st != CERTKV_OK) return st;
  for (int l = 0; l < store->n_layers; ++l)
    if (n_tokens < 0 || n_tokens > layer_length(*store, seq, l))
      return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(w) + ": n_tokens " + std::to_string(n_tokens) +
                                                    " is not in [0, " + std::to_string(layer_length(*store, seq, l)) +
                                                    "] (seq " + std::to_string(seq) + ", layer " + std::to_string(l) + ")");
  if (store->device) return guarded([&] { store->device->crop(seq, n_tokens); });
  return guarded([&] {
    // The key indexes first: their records of the positions kept stay valid whatever follows.
    for (auto& layer : store->key_indexes)
      if (!layer.empty()) layer[size_t(seq)].crop(n_tokens, store->sparse);
    const int bt = store->layer_config.block_tokens;
    const int64_t whole = n_tokens / bt * bt;
    const size_t h_kv = size_t(kv_heads(*store)), d = size_t(head_dim(*store));
    for (int l = 0; l < store->n_layers; ++l) {
      if (!store->layers[size_t(l)]) continue;
      cache::KvCache& c = *store->layers[size_t(l)];
      cache::SeqId& id = store->seqs[size_t(l)][size_t(seq)];
      if (n_tokens == c.length(id)) continue;
      // The whole blocks are shared with the new sequence as they are; the rows of a partial last
      // block are written again from their exact values, as they were appended (a raw tail).
      const int64_t tail = n_tokens - whole;
      std::vector<float> exact(2 * size_t(tail) * h_kv * d);
      for (int kv = 0; kv < 2; ++kv)
        for (size_t h = 0; h < h_kv; ++h) {
          std::vector<float> head(size_t(tail) * d);
          if (tail > 0) c.read_token_range_exact(id, 0, cache::KvTensor(kv), int(h), whole, n_tokens, head.data());
          for (size_t t = 0; t < size_t(tail); ++t)
            std::memcpy(&exact[size_t(kv) * size_t(tail) * h_kv * d + (t * h_kv + h) * d], &head[t * d], d * sizeof(float));
        }
      const cache::SeqId cropped = c.fork_prefix(id, whole);
      c.free_sequence(id);
      id = cropped;
      if (tail > 0) {
        c.reserve(id, tail);
        c.write(id, 0, exact.data(), exact.data() + size_t(tail) * h_kv * d, tail);
        c.commit(id, tail);
      }
    }
  });
}

namespace {

// certkv_kv_store_select and _reorder: the store's sequences become src[0 .. n).
certkv_status select_sequences(const char* w, certkv_kv_store* store, const int32_t* src, int32_t n) {
  CERTKV_REQUIRE(store && src, std::string(w) + ": null argument");
  CERTKV_REQUIRE(n >= 1, std::string(w) + ": n " + std::to_string(n) + " is below 1");
  for (int32_t i = 0; i < n; ++i)
    if (src[i] < 0 || src[i] >= store->n_sequences)
      return set_error(CERTKV_ERR_OUT_OF_RANGE, std::string(w) + ": src[" + std::to_string(i) + "] " +
                                                    std::to_string(src[i]) + " outside [0, " +
                                                    std::to_string(store->n_sequences) + ")");
  if (store->device)
    return guarded([&] {
      store->device->select(std::span<const int32_t>(src, size_t(n)));
      store->n_sequences = n;
    });
  return guarded([&] {
    // The key indexes' copies first (nothing to undo if one fails), then every layer's new
    // sequences (a layer not made yet is made at its first append, with n sequences); if one
    // cannot be made, those made are freed and the store is as it was.
    std::vector<std::vector<certkv::api::StoreKeyIndex>> key_indexes(store->key_indexes.size());
    for (size_t l = 0; l < store->key_indexes.size(); ++l)
      if (!store->key_indexes[l].empty())
        for (int32_t i = 0; i < n; ++i) key_indexes[l].push_back(store->key_indexes[l][size_t(src[i])].copy());
    std::vector<std::vector<cache::SeqId>> selected(size_t(store->n_layers));
    try {
      for (int l = 0; l < store->n_layers; ++l)
        if (store->layers[size_t(l)])
          for (int32_t i = 0; i < n; ++i)
            selected[size_t(l)].push_back(store->layers[size_t(l)]->fork_sequence(store->seqs[size_t(l)][size_t(src[i])]));
    } catch (...) {
      for (int l = 0; l < store->n_layers; ++l)
        for (cache::SeqId id : selected[size_t(l)]) store->layers[size_t(l)]->free_sequence(id);
      throw;
    }
    for (int l = 0; l < store->n_layers; ++l) {
      if (!store->layers[size_t(l)]) continue;
      for (cache::SeqId id : store->seqs[size_t(l)]) store->layers[size_t(l)]->free_sequence(id);
      store->seqs[size_t(l)] = std::move(selected[size_t(l)]);
    }
    store->key_indexes = std::move(key_indexes);
    store->n_sequences = n;
  });
}

}  // namespace

certkv_status certkv_kv_store_reorder(certkv_kv_store* store, const int32_t* src) {
  return select_sequences("certkv_kv_store_reorder", store, src, store ? store->n_sequences : 0);
}

certkv_status certkv_kv_store_select(certkv_kv_store* store, const int32_t* src, int32_t n) {
  return select_sequences("certkv_kv_store_select", store, src, n);
}

certkv_status certkv_kv_store_meter_stats(const certkv_kv_store* store, certkv_meter_stats* stats) {
  CERTKV_REQUIRE(store && stats, "certkv_kv_store_meter_stats: null argument");
  return guarded([&] {
    if (store->device) store->device->drain();
    const certkv::gate::Telemetry& t = *store->telemetry;
    *stats = certkv::api::meter_stats_of(t, store->scheme, store->metered, store->delta_loc);
    if (store->device) stats->exact_fallback_blocks += uint64_t(store->device->stats().pages_kept_exact);
    for (const auto& c : store->layers)
      if (c) stats->exact_fallback_blocks += c->memory_stats().exact_fallback_blocks;
  });
}

certkv_status certkv_kv_store_sparse_stats(const certkv_kv_store* store, certkv_sparse_stats* stats) {
  CERTKV_REQUIRE(store && stats, "certkv_kv_store_sparse_stats: null argument");
  *stats = certkv_sparse_stats{};
  if (!store->sparse.enabled) return CERTKV_OK;
  const certkv::backend::SparseConfig& cfg = store->sparse;
  if (store->device)
    return guarded([&] {
      const certkv::backend::cuda::DeviceSparseStats d = store->device->sparse_stats();
      *stats = certkv::api::sparse_stats_of(cfg.p, cfg.window_tokens, cfg.dense_layers, cfg.deviations, d.counters);
      stats->index_bytes = d.index_bytes;
      stats->indexed_tokens = d.indexed_tokens;
    });
  *stats = certkv::api::sparse_stats_of(cfg.p, cfg.window_tokens, cfg.dense_layers, cfg.deviations,
                                        store->sparse_stats);
  for (const auto& layer : store->key_indexes)
    for (const certkv::api::StoreKeyIndex& k : layer) {
      stats->index_bytes += k.index().bytes();
      stats->indexed_tokens += k.index().indexed_tokens(0, 0);
    }
  return CERTKV_OK;
}

certkv_status certkv_kv_store_kv_stats(const certkv_kv_store* store, certkv_kv_stats* stats) {
  CERTKV_REQUIRE(store && stats, "certkv_kv_store_kv_stats: null argument");
  return guarded([&] {
    *stats = certkv_kv_stats{};
    if (store->device) {
      device_kv_stats(*store, stats);
      return;
    }
    for (int l = 0; l < store->n_layers; ++l) {
      const cache::KvCache* c = store->layers[size_t(l)].get();
      if (!c) continue;
      const cache::MemoryStats m = c->memory_stats();
      int64_t tokens = 0;
      for (int i = 0; i < store->n_sequences; ++i) tokens += layer_length(*store, i, l);
      if (l == 0) stats->n_tokens = tokens;
      stats->kv_bytes += m.bytes_reserved_from_allocator + m.block_table_bytes;
      stats->kv_bytes_in_use += m.bytes_in_use;
      stats->kv_bytes_bf16 += c->kv_bytes_bf16(tokens);
      stats->pages_in_use += m.pages_in_use;
      stats->pages_free += m.pages_free;
      stats->backing_bytes += m.backing_bytes_reserved_from_allocator;
      stats->exact_fallback_blocks += m.exact_fallback_blocks;
      for (const cache::StorageClassStats& sc : m.by_class) {
        const char* name = certkv::format::storage_class_name(sc.storage);
        int32_t i = 0;
        while (i < stats->n_classes && std::strcmp(stats->by_class[i].storage, name) != 0) ++i;
        if (i == CERTKV_MAX_KV_CLASSES) continue;
        if (i == stats->n_classes) stats->by_class[stats->n_classes++] = certkv_kv_class_stats{name, 0, 0, 0};
        stats->by_class[i].pages_in_use += sc.pages_in_use;
        stats->by_class[i].bytes_from_allocator += sc.bytes_reserved_from_allocator;
        stats->by_class[i].page_bytes_in_use += sc.page_bytes_in_use;
      }
    }
  });
}

}  // extern "C"
