// The C API: converts between C structs and the model layer, catches every certkv::Error (and
// any other exception) at the boundary and reports it as a status plus certkv_last_error().
#include "certkv/certkv.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "api/api_meter_stats.h"
#include "api/api_status.h"
#include "api/session_audit.h"
#include "api/session_sparse_audit.h"
#include "codec/gaac.h"
#include "format/numeric.h"
#include "core/status.h"
#include "model/chat_template.h"
#include "model/model.h"
#include "model/sampler.h"
#include "backend/session.h"
#include "engine/engine.h"
#include "engine/gaac_self_calibration.h"

struct certkv_model {
  std::unique_ptr<certkv::model::Model> model;
  std::string weight_type;
  // GAAC calibrations loaded for this model, by path and block_tokens: each file is read once and
  // shared by the sessions that name it.
  mutable std::mutex calibrations_mutex;
  mutable std::map<std::pair<std::string, int>, std::shared_ptr<const certkv::codec::GaacCalibration>>
      calibrations;
};

struct certkv_session {
  const certkv_model* model;
  std::unique_ptr<certkv::backend::Session> session;
  std::vector<float> logits;
  std::unique_ptr<certkv::api::SessionAudit> audit;
  std::unique_ptr<certkv::api::SessionSparseAudit> sparse_audit;
};

struct certkv_sampler {
  std::unique_ptr<certkv::model::Sampler> sampler;
};

namespace certkv::api {
namespace {
thread_local std::string g_last_error;
}  // namespace

certkv_status set_error(certkv_status status, const std::string& message) {
  g_last_error = message;
  return status;
}

void clear_error() { g_last_error.clear(); }

const char* last_error() { return g_last_error.c_str(); }

}  // namespace certkv::api

namespace {

using certkv::api::guarded;
using certkv::api::set_error;

certkv::model::SamplerParams to_sampler_params(const certkv_sampler_params& p) {
  certkv::model::SamplerParams s;
  s.temperature = p.temperature;
  s.top_k = p.top_k;
  s.top_p = p.top_p;
  s.seed = p.seed;
  return s;
}

certkv_status copy_out(const std::string& bytes, char* buf, size_t capacity, size_t* n_bytes,
                       bool nul_terminate) {
  *n_bytes = bytes.size();
  const size_t need = bytes.size() + (nul_terminate ? 1 : 0);
  if (capacity < need)
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "buffer of " + std::to_string(capacity) +
                                                  " bytes is too small, " + std::to_string(need) +
                                                  " needed");
  if (!bytes.empty()) memcpy(buf, bytes.data(), bytes.size());
  if (nul_terminate) buf[bytes.size()] = '\0';
  return CERTKV_OK;
}

}  // namespace

extern "C" {

const char* certkv_last_error(void) { return certkv::api::last_error(); }

const char* certkv_status_string(certkv_status status) {
  return certkv::status_code_name(static_cast<certkv::StatusCode>(status));
}


certkv_status certkv_model_load(const char* path, certkv_model** out) {
  CERTKV_REQUIRE(path != nullptr && out != nullptr, "certkv_model_load: null argument");
  *out = nullptr;
  return guarded([&] {
    auto m = std::make_unique<certkv_model>();
    m->model = certkv::model::load_model(path);
    m->weight_type = m->model->weight_type_summary();
    *out = m.release();
  });
}

certkv_status certkv_model_load_llama2c(const char* checkpoint_path, const char* tokenizer_path,
                                        certkv_model** out) {
  CERTKV_REQUIRE(checkpoint_path && tokenizer_path && out, "certkv_model_load_llama2c: null argument");
  *out = nullptr;
  return guarded([&] {
    auto m = std::make_unique<certkv_model>();
    m->model = certkv::model::load_llama2c(checkpoint_path, tokenizer_path);
    m->weight_type = m->model->weight_type_summary();
    *out = m.release();
  });
}

void certkv_model_free(certkv_model* model) { delete model; }

certkv_status certkv_model_get_info(const certkv_model* model, certkv_model_info* info) {
  CERTKV_REQUIRE(model && info, "certkv_model_get_info: null argument");
  const certkv::model::ModelConfig& c = model->model->config();
  info->architecture = c.architecture.c_str();
  info->name = c.name.c_str();
  info->rope_layout = certkv::model::rope_layout_name(c.rope_layout);
  info->weight_type = model->weight_type.c_str();
  info->n_layers = c.n_layers;
  info->dim = c.dim;
  info->n_heads = c.n_heads;
  info->n_kv_heads = c.n_kv_heads;
  info->head_dim = c.head_dim;
  info->ffn_dim = c.ffn_dim;
  info->n_vocab = c.n_vocab;
  info->context_length = c.context_length;
  info->rope_theta = c.rope_theta;
  info->weight_bytes = model->model->weight_bytes();
  return CERTKV_OK;
}

certkv_status certkv_tokenize(const certkv_model* model, const char* text, size_t text_bytes,
                              int add_special, int parse_special, int32_t* tokens,
                              int32_t capacity, int32_t* n_tokens) {
  CERTKV_REQUIRE(model && (text || text_bytes == 0) && n_tokens && (tokens || capacity == 0),
                 "certkv_tokenize: null argument");
  CERTKV_REQUIRE(capacity >= 0, "certkv_tokenize: negative capacity");
  std::vector<int32_t> ids;
  certkv_status s = guarded([&] {
    const certkv::model::Tokenizer& tok = model->model->tokenizer();
    ids = tok.encode(std::string_view(text ? text : "", text_bytes),
                     add_special != 0 && tok.spec().add_bos, parse_special != 0);
  });
  if (s != CERTKV_OK) return s;
  if (ids.size() > size_t(INT32_MAX)) return set_error(CERTKV_ERR_OUT_OF_RANGE, "text too long");
  *n_tokens = int32_t(ids.size());
  if (ids.size() > size_t(capacity))
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "token buffer of " + std::to_string(capacity) +
                                                  " is too small, " + std::to_string(ids.size()) +
                                                  " needed");
  if (!ids.empty()) memcpy(tokens, ids.data(), ids.size() * sizeof(int32_t));
  return CERTKV_OK;
}

certkv_status certkv_token_to_piece(const certkv_model* model, int32_t token, char* buf,
                                    size_t capacity, size_t* n_bytes) {
  CERTKV_REQUIRE(model && n_bytes && (buf || capacity == 0), "certkv_token_to_piece: null argument");
  CERTKV_REQUIRE(token >= 0 && token < model->model->tokenizer().n_vocab(),
                 "token id " + std::to_string(token) + " is outside the vocabulary");
  std::string piece;
  certkv_status s = guarded([&] { piece = model->model->tokenizer().token_piece(token); });
  if (s != CERTKV_OK) return s;
  return copy_out(piece, buf, capacity, n_bytes, false);
}

certkv_status certkv_detokenize(const certkv_model* model, const int32_t* tokens, size_t n_tokens,
                                int render_special, char* buf, size_t capacity, size_t* n_bytes) {
  CERTKV_REQUIRE(model && n_bytes && (tokens || n_tokens == 0) && (buf || capacity == 0),
                 "certkv_detokenize: null argument");
  const int32_t n_vocab = model->model->tokenizer().n_vocab();
  for (size_t i = 0; i < n_tokens; ++i)
    CERTKV_REQUIRE(tokens[i] >= 0 && tokens[i] < n_vocab,
                   "tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                       " is outside the vocabulary of " + std::to_string(n_vocab));
  std::string text;
  certkv_status s = guarded([&] {
    text = model->model->tokenizer().decode(std::vector<int32_t>(tokens, tokens + n_tokens), render_special != 0);
  });
  if (s != CERTKV_OK) return s;
  return copy_out(text, buf, capacity, n_bytes, false);
}

int certkv_token_is_end(const certkv_model* model, int32_t token) {
  if (!model || token < 0 || token >= model->model->tokenizer().n_vocab()) return 0;
  return model->model->tokenizer().is_end_of_generation(token) ? 1 : 0;
}

certkv_status certkv_apply_chat_template(const certkv_model* model,
                                         const certkv_chat_message* messages, size_t n_messages,
                                         int add_generation_prompt, char* buf, size_t capacity,
                                         size_t* n_bytes) {
  CERTKV_REQUIRE(model && (messages || n_messages == 0) && n_bytes && (buf || capacity == 0),
                 "certkv_apply_chat_template: null argument");
  std::vector<certkv::model::ChatMessage> list;
  for (size_t i = 0; i < n_messages; ++i) {
    CERTKV_REQUIRE(messages[i].role && messages[i].content,
                   "certkv_apply_chat_template: message " + std::to_string(i) + " has a null field");
    list.push_back({messages[i].role, messages[i].content});
  }
  std::string text;
  certkv_status s = guarded([&] {
    text = certkv::model::apply_chat_template(model->model->tokenizer().spec(), list,
                                              add_generation_prompt != 0);
  });
  if (s != CERTKV_OK) return s;
  return copy_out(text, buf, capacity, n_bytes, true);
}

certkv_status certkv_tokenize_chat(const certkv_model* model, const certkv_chat_message* messages,
                                   size_t n_messages, int add_generation_prompt, int32_t* tokens, int32_t capacity,
                                   int32_t* n_tokens) {
  CERTKV_REQUIRE(model && (messages || n_messages == 0) && n_tokens && (tokens || capacity == 0),
                 "certkv_tokenize_chat: null argument");
  CERTKV_REQUIRE(capacity >= 0, "certkv_tokenize_chat: negative capacity");
  std::vector<certkv::model::ChatMessage> list;
  for (size_t i = 0; i < n_messages; ++i) {
    CERTKV_REQUIRE(messages[i].role && messages[i].content,
                   "certkv_tokenize_chat: message " + std::to_string(i) + " has a null field");
    list.push_back({messages[i].role, messages[i].content});
  }
  std::vector<int32_t> ids;
  certkv_status s = guarded([&] {
    ids = certkv::model::tokenize_chat(model->model->tokenizer(), list, add_generation_prompt != 0);
  });
  if (s != CERTKV_OK) return s;
  if (ids.size() > size_t(INT32_MAX)) return set_error(CERTKV_ERR_OUT_OF_RANGE, "chat too long");
  *n_tokens = int32_t(ids.size());
  if (ids.size() > size_t(capacity))
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "token buffer of " + std::to_string(capacity) +
                                                  " is too small, " + std::to_string(ids.size()) + " needed");
  if (!ids.empty()) memcpy(tokens, ids.data(), ids.size() * sizeof(int32_t));
  return CERTKV_OK;
}

certkv_session_params certkv_session_default_params(void) {
  certkv_session_params p;
  p.context_tokens = 0;
  p.n_threads = 2;
  p.block_tokens = 16;
  p.prefill_chunk_tokens = 512;
  p.kv = "bf16";
  p.capture_queries = 0;
  p.activations = "int8";
  p.gaac_calibration = nullptr;
  p.outlier_pairs = -1;
  p.recent_window_tokens = -1;
  p.meter = 1;
  p.meter_delta = 1e-2;
  p.meter_tau = 0.2;
  p.gate = 0;
  p.meter_planned_steps = 0;
  p.meter_sample_every = 1;
  p.sparse_p = 0;
  p.sparse_window = -1;
  p.sparse_dense_layers = -1;
  p.sparse_rotation = nullptr;
  p.sparse_deviations = 0;
  p.device = nullptr;
  p.witness = nullptr;
  return p;
}

namespace {

// The model's calibration at `path` for pages of block_tokens and elements `element`, loaded on
// first use; a cached calibration of another element is a clear error.
std::shared_ptr<const certkv::codec::GaacCalibration> model_calibration(
    const certkv_model& model, const std::string& path, int block_tokens,
    certkv::format::GaacElement element) {
  std::lock_guard<std::mutex> lock(model.calibrations_mutex);
  auto& slot = model.calibrations[{path, block_tokens}];
  if (slot && slot->shape().element != element) {
    certkv::fail(certkv::StatusCode::kInvalidArgument,
                 "GAAC calibration " + path + " has element " +
                     certkv::codec::gaac_element_name(slot->shape().element) +
                     "; the KV scheme needs " + certkv::codec::gaac_element_name(element));
  }
  if (!slot) {
    const certkv::model::ModelConfig& c = model.model->config();
    certkv::codec::GaacShape expected;
    expected.n_layers = c.n_layers;
    expected.n_kv_heads = c.n_kv_heads;
    expected.head_dim = c.head_dim;
    expected.block_tokens = block_tokens;
    expected.element = element;
    slot = std::make_shared<const certkv::codec::GaacCalibration>(
        certkv::codec::GaacCalibration::load(path, expected));
  }
  return slot;
}

// The model's GAAC calibration from the built-in text (engine/gaac_self_calibration.h), made or
// read from its cache file on first use.
std::shared_ptr<const certkv::codec::GaacCalibration> model_self_calibration(
    const certkv_model& model, int block_tokens, int n_threads, certkv::format::GaacElement element) {
  std::lock_guard<std::mutex> lock(model.calibrations_mutex);
  auto& slot = model.calibrations[{std::string("<built-in text> ") +
                                       certkv::codec::gaac_element_name(element),
                                   block_tokens}];
  if (!slot)
    slot = certkv::engine::self_calibrated_gaac(*model.model, element, block_tokens,
                                                std::max(1, n_threads));
  return slot;
}

}  // namespace

namespace {

// The backend configuration of session parameters (validated; the message names the field).
certkv_status backend_config_of(const certkv_model* model, const certkv_session_params& p,
                                certkv::backend::BackendConfig* out) {
  const std::string kv = p.kv ? p.kv : "bf16";
  certkv::cache::KvScheme scheme;
  try {
    scheme = certkv::cache::parse_kv_scheme(kv);
  } catch (const certkv::Error& e) {
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, std::string("certkv_session_params.kv: ") + e.what());
  }
  const std::string activations = p.activations ? p.activations : "int8";
  if (activations != "int8" && activations != "f32")
    return set_error(CERTKV_ERR_INVALID_ARGUMENT,
                     "activations '" + activations + "' is unknown (int8 or f32)");
  if (!(p.sparse_deviations >= 0) || !std::isfinite(p.sparse_deviations))
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, "certkv_session_params.sparse_deviations must be finite and >= 0, got " +
                                                      std::to_string(p.sparse_deviations));
  if (p.sparse_deviations != 0 && p.sparse_p == 0)
    return set_error(CERTKV_ERR_INVALID_ARGUMENT,
                     "certkv_session_params.sparse_deviations widens sparse decode's selection: set sparse_p too");
  certkv::codec::WitnessCode witness;
  try {
    witness = certkv::cache::resolve_kv_witness(scheme, p.witness, "certkv_session_params.witness");
  } catch (const certkv::Error& e) {
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, e.what());
  }
  certkv::model::Device device = certkv::model::Device::kCpu;
  try {
    if (p.device != nullptr) device = certkv::model::parse_device(p.device);
  } catch (const certkv::Error& e) {
    return set_error(CERTKV_ERR_INVALID_ARGUMENT, std::string("certkv_session_params.device: ") + e.what());
  }
  return guarded([&] {
    certkv::backend::BackendConfig c;
    c.device = device;
    c.activations = activations == "f32" ? certkv::model::ActivationFormat::kFloat32
                                         : certkv::model::ActivationFormat::kInt8;
    c.context_tokens = p.context_tokens;
    c.n_threads = p.n_threads;
    c.block_tokens = p.block_tokens;
    c.prefill_chunk_tokens = p.prefill_chunk_tokens;
    c.capture_queries = p.capture_queries != 0;
    c.kv_scheme = scheme;
    c.outlier_pairs = p.outlier_pairs;
    c.recent_window_tokens = p.recent_window_tokens;
    c.witness = witness;
    c.meter.enabled = p.meter != 0;
    c.meter.delta_req = p.meter_delta;
    c.meter.tau = p.meter_tau;
    c.meter.gate = p.gate != 0;
    c.meter.planned_steps = p.meter_planned_steps;
    c.meter.sample_every = p.meter_sample_every;
    if (p.sparse_p != 0) {
      c.sparse.enabled = true;
      c.sparse.p = p.sparse_p;
      c.sparse.deviations = p.sparse_deviations;
      if (p.sparse_window != -1) c.sparse.window_tokens = p.sparse_window;
      if (p.sparse_dense_layers != -1) c.sparse.dense_layers = p.sparse_dense_layers;
      if (p.sparse_rotation != nullptr) c.sparse.rotation = certkv::cache::parse_rotation_kind(p.sparse_rotation);
    }
    const bool backing_calibration = certkv::cache::kv_scheme_is_lossy(c.kv_scheme) &&
                                     p.gaac_calibration != nullptr && p.gaac_calibration[0] != '\0';
    const bool self_calibration = certkv::cache::kv_scheme_is_gaac(c.kv_scheme) &&
                                  (p.gaac_calibration == nullptr || p.gaac_calibration[0] == '\0');
    if (self_calibration)
      c.gaac_calibration = model_self_calibration(*model, p.block_tokens, p.n_threads,
                                                  certkv::cache::kv_scheme_element(c.kv_scheme));
    else if (certkv::cache::kv_scheme_is_gaac(c.kv_scheme) || backing_calibration)
      c.gaac_calibration = model_calibration(*model, p.gaac_calibration, p.block_tokens,
                                             certkv::cache::kv_scheme_element(c.kv_scheme));
    *out = c;
  });
}

}  // namespace

certkv_status certkv_session_create(const certkv_model* model, const certkv_session_params* params,
                                    certkv_session** out) {
  CERTKV_REQUIRE(model && out, "certkv_session_create: null argument");
  *out = nullptr;
  const certkv_session_params p = params ? *params : certkv_session_default_params();
  certkv::backend::BackendConfig c;
  if (const certkv_status st = backend_config_of(model, p, &c); st != CERTKV_OK) return st;
  return guarded([&] {
    auto s = std::make_unique<certkv_session>();
    s->model = model;
    s->session = std::make_unique<certkv::backend::Session>(*model->model, c);
    s->logits.resize(size_t(model->model->config().n_vocab));
    *out = s.release();
  });
}

void certkv_session_free(certkv_session* session) { delete session; }

certkv_status certkv_session_prefill(certkv_session* session, const int32_t* tokens,
                                     int32_t n_tokens, float* logits, float* all_logits,
                                     certkv_progress_fn progress, void* progress_user) {
  CERTKV_REQUIRE(session && tokens, "certkv_session_prefill: null argument");
  CERTKV_REQUIRE(n_tokens >= 1, "certkv_session_prefill: needs at least one token");
  return guarded([&] {
    certkv::backend::ProgressFn fn;
    if (progress) fn = [&](int64_t done, int64_t total) { progress(progress_user, done, total); };
    session->session->prefill(tokens, n_tokens, logits, all_logits, fn);
  });
}

certkv_status certkv_session_decode(certkv_session* session, int32_t token, float* logits) {
  CERTKV_REQUIRE(session, "certkv_session_decode: null session");
  return guarded([&] { session->session->decode(token, logits); });
}

certkv_status certkv_session_reset(certkv_session* session) {
  CERTKV_REQUIRE(session, "certkv_session_reset: null session");
  return guarded([&] { session->session->reset(); });
}

int64_t certkv_session_n_past(const certkv_session* session) {
  return session ? session->session->n_past() : 0;
}

certkv_status certkv_session_kv_stats(const certkv_session* session, certkv_kv_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_kv_stats: null argument");
  return guarded([&] {
    const certkv::cache::KvCache& cache = session->session->kv_cache();
    const certkv::cache::MemoryStats m = cache.memory_stats();
    stats->n_tokens = session->session->n_past();
    stats->kv_bytes = m.bytes_reserved_from_allocator + m.block_table_bytes;
    stats->kv_bytes_in_use = m.bytes_in_use;
    stats->kv_bytes_bf16 = cache.kv_bytes_bf16(stats->n_tokens);
    stats->pages_in_use = m.pages_in_use;
    stats->pages_free = m.pages_free;
    stats->backing_bytes = m.backing_bytes_reserved_from_allocator;
    stats->exact_fallback_blocks = m.exact_fallback_blocks;
    stats->n_classes = 0;
    for (const certkv::cache::StorageClassStats& c : m.by_class) {
      if (stats->n_classes == CERTKV_MAX_KV_CLASSES) break;
      certkv_kv_class_stats& out = stats->by_class[stats->n_classes++];
      out.storage = certkv::format::storage_class_name(c.storage);
      out.pages_in_use = c.pages_in_use;
      out.bytes_from_allocator = c.bytes_reserved_from_allocator;
      out.page_bytes_in_use = c.page_bytes_in_use;
    }
  });
}

certkv_status certkv_session_read_kv(const certkv_session* session, int32_t layer, int32_t kv,
                                     int32_t kv_head, int64_t begin, int64_t end, uint16_t* out) {
  CERTKV_REQUIRE(session && out, "certkv_session_read_kv: null argument");
  CERTKV_REQUIRE(kv == 0 || kv == 1, "certkv_session_read_kv: kv must be 0 (K) or 1 (V)");
  return guarded([&] {
    const certkv::cache::KvCache& cache = session->session->kv_cache();
    const int hd = cache.head_dim();
    std::vector<float> rows(size_t(std::max<int64_t>(0, end - begin)) * size_t(hd));
    cache.read_token_range_ref(session->session->sequence(), layer,
                               kv == 0 ? certkv::cache::KvTensor::kKey : certkv::cache::KvTensor::kValue,
                               kv_head, begin, end, rows.data());
    // bf16 pages convert back to their stored bit patterns exactly; a lossy page's
    // reconstruction is rounded to nearest.
    for (size_t i = 0; i < rows.size(); ++i) out[i] = certkv::format::float_to_bf16(rows[i]);
  });
}

certkv_status certkv_session_read_kv_f32(const certkv_session* session, int32_t layer, int32_t kv,
                                         int32_t kv_head, int64_t begin, int64_t end, int exact,
                                         float* out) {
  CERTKV_REQUIRE(session && out, "certkv_session_read_kv_f32: null argument");
  CERTKV_REQUIRE(kv == 0 || kv == 1, "certkv_session_read_kv_f32: kv must be 0 (K) or 1 (V)");
  return guarded([&] {
    const certkv::cache::KvCache& cache = session->session->kv_cache();
    const auto tensor = kv == 0 ? certkv::cache::KvTensor::kKey : certkv::cache::KvTensor::kValue;
    if (exact)
      cache.read_token_range_exact(session->session->sequence(), layer, tensor, kv_head, begin, end, out);
    else
      cache.read_token_range_ref(session->session->sequence(), layer, tensor, kv_head, begin, end, out);
  });
}

certkv_status certkv_session_meter_stats(const certkv_session* session, certkv_meter_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_meter_stats: null argument");
  return guarded([&] {
    const certkv::backend::Session& s = *session->session;
    const certkv::gate::Telemetry t = s.telemetry();
    *stats = certkv::api::meter_stats_of(t, s.config().kv_scheme, s.metered(), s.delta_loc());
    stats->exact_fallback_blocks = s.kv_cache().memory_stats().exact_fallback_blocks;
  });
}

certkv_status certkv_session_meter_reset(certkv_session* session) {
  CERTKV_REQUIRE(session, "certkv_session_meter_reset: null session");
  return guarded([&] { session->session->reset_telemetry(); });
}

certkv_status certkv_session_audit_enable(certkv_session* session, int32_t dump_cells, uint64_t seed) {
  CERTKV_REQUIRE(session, "certkv_session_audit_enable: null session");
  CERTKV_REQUIRE(dump_cells >= 0, "certkv_session_audit_enable: dump_cells must be >= 0");
  return guarded([&] {
    certkv::backend::Session& s = *session->session;
    if (!s.metered())
      certkv::fail(certkv::StatusCode::kInvalidArgument,
                   std::string("audit needs a metered session (a lossy KV scheme with the meter on); "
                               "this one has kv ") + certkv::cache::kv_scheme_name(s.config().kv_scheme));
    if (s.device_decoder() != nullptr)
      certkv::fail(certkv::StatusCode::kUnsupported,
                   "device cuda: the audit measures the true total variation over the host cache's pages, "
                   "which are not the pages the device's meter bounds (dither8 draws another dither there): "
                   "audit with device cpu");
    session->audit = std::make_unique<certkv::api::SessionAudit>(s, s.config().meter.tau, dump_cells, seed);
    certkv::api::SessionAudit* audit = session->audit.get();
    s.set_meter_observer([audit](const certkv::backend::MeterObservation& o) { audit->observe(o); });
  });
}

certkv_status certkv_session_audit_stats(const certkv_session* session, certkv_audit_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_audit_stats: null argument");
  CERTKV_REQUIRE(session->audit, "certkv_session_audit_stats: the audit is not enabled");
  return guarded([&] {
    const certkv::eval::AuditSummary a = session->audit->accumulator().summary();
    *stats = certkv_audit_stats{};
    stats->cells = a.cells;
    stats->violations = a.violations;
    stats->coverage = a.coverage_at_tau;
    stats->max_meter = a.max_meter;
    stats->max_tv = a.max_tv;
    stats->tightness_q01 = a.tightness_q01;
    stats->tightness_q10 = a.tightness_q10;
    stats->tightness_q50 = a.tightness_q50;
    stats->tightness_q90 = a.tightness_q90;
    stats->tightness_q99 = a.tightness_q99;
    stats->worst_margin = a.cells > 0 ? a.worst.tv - a.worst.meter : 0;
  });
}

certkv_status certkv_session_audit_layer(const certkv_session* session, int32_t layer,
                                         int64_t* cells, int64_t* violations, double* coverage) {
  CERTKV_REQUIRE(session && cells && violations && coverage, "certkv_session_audit_layer: null argument");
  CERTKV_REQUIRE(session->audit, "certkv_session_audit_layer: the audit is not enabled");
  return guarded([&] {
    *cells = 0;
    *violations = 0;
    *coverage = 0;
    for (const certkv::eval::AuditLayerSummary& l : session->audit->accumulator().summary().layers) {
      if (l.layer != layer) continue;
      *cells = l.cells;
      *violations = l.violations;
      *coverage = l.coverage_at_tau;
    }
  });
}

certkv_status certkv_session_audit_dump(const certkv_session* session, const char* path) {
  CERTKV_REQUIRE(session && path, "certkv_session_audit_dump: null argument");
  CERTKV_REQUIRE(session->audit, "certkv_session_audit_dump: the audit is not enabled");
  return guarded([&] {
    session->audit->dump(path, certkv::cache::kv_scheme_name(session->session->config().kv_scheme));
  });
}

certkv_status certkv_session_device_stats(const certkv_session* session, certkv_device_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_device_stats: null argument");
  return guarded([&] {
    *stats = certkv_device_stats{};
    const certkv::model::DeviceDecoder* d = session->session->device_decoder();
    if (d == nullptr) return;
    const certkv::model::DeviceDecodeStats s = d->stats();
    stats->on_device = 1;
    stats->attention_calls = s.attention_calls;
    stats->attention_seconds = s.attention_seconds;
    stats->write_seconds = s.write_seconds;
    stats->gaac_slots = s.slots_in_use;
    stats->raw_pages = s.raw_pages_in_use;
    stats->blocks_not_fitting = s.blocks_not_fitting;
    stats->kv_bytes_in_use = s.kv_bytes_in_use;
    stats->kv_bytes_reserved = s.kv_bytes_reserved;
    stats->lossy_pages_in_use = s.lossy_pages_in_use;
    stats->pages_kept_exact = s.pages_kept_exact;
    stats->sparse_calls = s.sparse_calls;
  });
}

certkv_status certkv_session_sparse_stats(const certkv_session* session, certkv_sparse_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_sparse_stats: null argument");
  return guarded([&] {
    const certkv::backend::Session& s = *session->session;
    const certkv::backend::SparseConfig& cfg = s.config().sparse;
    const certkv::backend::SparseStats& st = s.sparse_stats();
    *stats = certkv_sparse_stats{};
    if (s.key_index() == nullptr) return;
    *stats = certkv::api::sparse_stats_of(cfg.p, cfg.window_tokens, cfg.dense_layers, cfg.deviations, st);
    const certkv::cache::KeyIndex& index = *s.key_index();
    stats->index_bytes = index.bytes();
    stats->indexed_tokens = cfg.dense_layers < s.model().config().n_layers
                                ? index.indexed_tokens(cfg.dense_layers, 0)
                                : 0;
  });
}

certkv_status certkv_session_sparse_layer(const certkv_session* session, int32_t layer,
                                          int64_t* cells, double* mean_budget) {
  CERTKV_REQUIRE(session && cells && mean_budget, "certkv_session_sparse_layer: null argument");
  return guarded([&] {
    const certkv::backend::SparseStats& st = session->session->sparse_stats();
    if (layer < 0 || layer >= session->session->model().config().n_layers)
      certkv::fail(certkv::StatusCode::kOutOfRange,
                   "certkv_session_sparse_layer: layer " + std::to_string(layer) + " out of range");
    *cells = 0;
    *mean_budget = 0;
    if (st.layer_cells.empty()) return;
    *cells = st.layer_cells[size_t(layer)];
    *mean_budget = *cells > 0 ? st.layer_sum_budget[size_t(layer)] / double(*cells) : 0;
  });
}

certkv_status certkv_session_sparse_reset(certkv_session* session) {
  CERTKV_REQUIRE(session, "certkv_session_sparse_reset: null session");
  return guarded([&] { session->session->reset_sparse_stats(); });
}

certkv_status certkv_session_sparse_audit_enable(certkv_session* session, int32_t dump_cells,
                                                 uint64_t seed) {
  CERTKV_REQUIRE(session, "certkv_session_sparse_audit_enable: null session");
  CERTKV_REQUIRE(dump_cells >= 0, "certkv_session_sparse_audit_enable: dump_cells must be >= 0");
  return guarded([&] {
    certkv::backend::Session& s = *session->session;
    if (s.key_index() == nullptr)
      certkv::fail(certkv::StatusCode::kInvalidArgument,
                   "the sparse audit needs a sparse session (certkv_session_params.sparse_p)");
    if (s.device_decoder() != nullptr)
      certkv::fail(certkv::StatusCode::kUnsupported,
                   "device cuda: the sparse audit reads the CPU path's selections: audit with device cpu");
    session->sparse_audit = std::make_unique<certkv::api::SessionSparseAudit>(s, dump_cells, seed);
    certkv::api::SessionSparseAudit* audit = session->sparse_audit.get();
    s.set_sparse_observer([audit](const certkv::backend::SparseObservation& o) { audit->observe(o); });
  });
}

certkv_status certkv_session_sparse_audit_stats(const certkv_session* session,
                                                certkv_sparse_audit_stats* stats) {
  CERTKV_REQUIRE(session && stats, "certkv_session_sparse_audit_stats: null argument");
  CERTKV_REQUIRE(session->sparse_audit, "certkv_session_sparse_audit_stats: the audit is not enabled");
  return guarded([&] {
    const certkv::eval::SparseAuditSummary a = session->sparse_audit->accumulator().summary();
    *stats = certkv_sparse_audit_stats{};
    stats->cells = a.cells;
    stats->mean_budget = a.mean_budget;
    stats->mean_recall = a.mean_recall;
    stats->recall_q01 = a.recall_q01;
    stats->recall_q10 = a.recall_q10;
    stats->recall_q50 = a.recall_q50;
    stats->min_recall = a.min_recall;
    stats->budget_q50 = a.budget_q50;
    stats->budget_q90 = a.budget_q90;
    stats->max_budget = a.max_budget;
    stats->estimator_samples = a.estimator_samples;
    stats->estimator_bias = a.estimator_bias;
    stats->estimator_rms = a.estimator_rms;
    stats->estimator_abs_q50 = a.estimator_abs_q50;
    stats->estimator_abs_q90 = a.estimator_abs_q90;
    stats->estimator_abs_q99 = a.estimator_abs_q99;
    stats->normalized_rms_sqrt_d = a.normalized_rms_sqrt_d;
    for (const certkv::eval::SparseBaseline& b : a.baselines) {
      if (b.name == "topk_estimated") {
        stats->topk_estimated_budget = b.mean_budget;
        stats->topk_estimated_recall = b.mean_recall;
      } else if (b.name == "topk_oracle") {
        stats->topk_oracle_budget = b.mean_budget;
        stats->topk_oracle_recall = b.mean_recall;
      } else if (b.name == "quest") {
        stats->quest_budget = b.mean_budget;
        stats->quest_recall = b.mean_recall;
      }
    }
  });
}

certkv_status certkv_session_sparse_audit_layer(const certkv_session* session, int32_t layer,
                                                int64_t* cells, double* mean_budget,
                                                double* mean_recall, double* min_recall) {
  CERTKV_REQUIRE(session && cells && mean_budget && mean_recall && min_recall,
                 "certkv_session_sparse_audit_layer: null argument");
  CERTKV_REQUIRE(session->sparse_audit, "certkv_session_sparse_audit_layer: the audit is not enabled");
  return guarded([&] {
    *cells = 0;
    *mean_budget = *mean_recall = *min_recall = 0;
    for (const certkv::eval::SparseAuditLayer& l : session->sparse_audit->accumulator().summary().layers) {
      if (l.layer != layer) continue;
      *cells = l.cells;
      *mean_budget = l.mean_budget;
      *mean_recall = l.mean_recall;
      *min_recall = l.min_recall;
    }
  });
}

certkv_status certkv_session_sparse_audit_add_rule(certkv_session* session, double p,
                                                   double deviations, int32_t* rule) {
  CERTKV_REQUIRE(session && rule, "certkv_session_sparse_audit_add_rule: null argument");
  CERTKV_REQUIRE(session->sparse_audit, "certkv_session_sparse_audit_add_rule: the audit is not enabled");
  return guarded([&] { *rule = int32_t(session->sparse_audit->add_rule(p, deviations)); });
}

certkv_status certkv_session_sparse_audit_rule(const certkv_session* session, int32_t rule,
                                               int32_t layer, int64_t* cells, double* mean_budget,
                                               double* mean_recall, double* recall_q10) {
  CERTKV_REQUIRE(session && cells && mean_budget && mean_recall && recall_q10,
                 "certkv_session_sparse_audit_rule: null argument");
  CERTKV_REQUIRE(session->sparse_audit, "certkv_session_sparse_audit_rule: the audit is not enabled");
  return guarded([&] {
    if (rule < 0 || rule >= session->sparse_audit->rules())
      certkv::fail(certkv::StatusCode::kInvalidArgument,
                   "certkv_session_sparse_audit_rule: no rule " + std::to_string(rule));
    *cells = 0;
    *mean_budget = *mean_recall = *recall_q10 = 0;
    const certkv::eval::SparseAuditSummary a = session->sparse_audit->accumulator().summary();
    if (a.rules.empty()) return;  // no cell audited yet
    const certkv::eval::SparseRuleSummary& r = a.rules[size_t(rule)];
    if (layer < 0) {
      *cells = r.cells;
      *mean_budget = r.mean_budget;
      *mean_recall = r.mean_recall;
      *recall_q10 = r.recall_q10;
      return;
    }
    for (const certkv::eval::SparseRuleLayer& l : r.layers) {
      if (l.layer != layer) continue;
      *cells = l.cells;
      *mean_budget = l.mean_budget;
      *mean_recall = l.mean_recall;
    }
  });
}

certkv_status certkv_session_sparse_audit_dump(const certkv_session* session, const char* path) {
  CERTKV_REQUIRE(session && path, "certkv_session_sparse_audit_dump: null argument");
  CERTKV_REQUIRE(session->sparse_audit, "certkv_session_sparse_audit_dump: the audit is not enabled");
  return guarded([&] { session->sparse_audit->dump(path); });
}

certkv_status certkv_session_last_queries(const certkv_session* session, int32_t layer, float* out) {
  CERTKV_REQUIRE(session && out, "certkv_session_last_queries: null argument");
  return guarded([&] {
    const std::vector<float>& q = session->session->last_queries(layer);
    memcpy(out, q.data(), q.size() * sizeof(float));
  });
}

certkv_sampler_params certkv_sampler_default_params(void) {
  certkv_sampler_params p;
  p.temperature = 0.f;
  p.top_k = 0;
  p.top_p = 1.f;
  p.seed = 0;
  return p;
}

certkv_status certkv_sampler_create(const certkv_sampler_params* params, certkv_sampler** out) {
  CERTKV_REQUIRE(out, "certkv_sampler_create: null argument");
  *out = nullptr;
  const certkv_sampler_params p = params ? *params : certkv_sampler_default_params();
  return guarded([&] {
    auto s = std::make_unique<certkv_sampler>();
    s->sampler = std::make_unique<certkv::model::Sampler>(to_sampler_params(p));
    *out = s.release();
  });
}

void certkv_sampler_free(certkv_sampler* sampler) { delete sampler; }

certkv_status certkv_sampler_sample(certkv_sampler* sampler, const float* logits, int32_t n_vocab,
                                    int32_t* token) {
  CERTKV_REQUIRE(sampler && logits && token, "certkv_sampler_sample: null argument");
  return guarded([&] { *token = sampler->sampler->sample(logits, n_vocab); });
}

certkv_generate_params certkv_generate_default_params(void) {
  certkv_generate_params p;
  p.max_new_tokens = 128;
  p.stop_at_end = 1;
  p.sampler = certkv_sampler_default_params();
  p.progress = nullptr;
  p.progress_user = nullptr;
  return p;
}

certkv_status certkv_generate(certkv_session* session, const int32_t* tokens, int32_t n_tokens,
                              const certkv_generate_params* params, certkv_token_fn on_token,
                              void* user, certkv_generate_result* result) {
  CERTKV_REQUIRE(session && tokens && result, "certkv_generate: null argument");
  CERTKV_REQUIRE(n_tokens >= 1, "certkv_generate: the prompt has no tokens");
  const certkv_generate_params p = params ? *params : certkv_generate_default_params();
  CERTKV_REQUIRE(p.max_new_tokens >= 0, "certkv_generate: max_new_tokens must be >= 0");
  memset(result, 0, sizeof *result);
  result->prompt_tokens = n_tokens;
  return guarded([&] {
    using clock = std::chrono::steady_clock;
    certkv::model::Sampler sampler(to_sampler_params(p.sampler));
    certkv::backend::Session& s = *session->session;
    const certkv::model::Tokenizer& tok = session->model->model->tokenizer();
    const int32_t n_vocab = session->model->model->config().n_vocab;
    float* logits = session->logits.data();
    certkv::backend::ProgressFn fn;
    if (p.progress) fn = [&](int64_t done, int64_t total) { p.progress(p.progress_user, done, total); };
    const auto t0 = clock::now();
    s.prefill(tokens, n_tokens, logits, nullptr, fn);
    const auto t1 = clock::now();
    result->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    for (int32_t i = 0; i < p.max_new_tokens; ++i) {
      const int32_t token = sampler.sample(logits, n_vocab);
      ++result->generated_tokens;
      const bool end = p.stop_at_end && tok.is_end_of_generation(token);
      if (on_token && !end) {
        const std::string piece = tok.token_piece(token);
        if (on_token(user, token, piece.data(), piece.size()) != 0) break;
      }
      if (end || i + 1 == p.max_new_tokens || s.n_past() >= s.context_tokens()) break;
      s.decode(token, logits);
      ++result->decode_steps;
    }
    result->decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  });
}

uint64_t certkv_peak_rss_bytes(void) {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return uint64_t(usage.ru_maxrss) * 1024u;  // Linux reports KiB
}

}  // extern "C"

const char* certkv_version(void) { return CERTKV_VERSION_STRING; }

// ---- The engine ------------------------------------------------------------------------------

struct certkv_engine {
  const certkv_model* model;
  std::unique_ptr<certkv::engine::Engine> engine;
};

certkv_engine_params certkv_engine_default_params(void) {
  certkv_engine_params p{};
  p.session = certkv_session_default_params();
  p.max_sequences = 8;
  p.step_tokens = 512;
  p.pool_bytes = 0;
  p.prefix_sharing = 1;
  p.meter_recent_steps = 64;
  p.preemption = nullptr;
  return p;
}

certkv_status certkv_engine_create(const certkv_model* model, const certkv_engine_params* params,
                                   certkv_engine** out) {
  CERTKV_REQUIRE(model && out, "certkv_engine_create: null argument");
  *out = nullptr;
  const certkv_engine_params p = params ? *params : certkv_engine_default_params();
  certkv::engine::EngineConfig c;
  if (const certkv_status st = backend_config_of(model, p.session, &c.backend); st != CERTKV_OK)
    return st;
  c.max_sequences = p.max_sequences;
  c.step_tokens = p.step_tokens;
  c.prefix_sharing = p.prefix_sharing != 0;
  c.backend.meter.recent_steps = p.meter_recent_steps;
  return guarded([&] {
    if (p.preemption != nullptr) c.preemption = certkv::engine::parse_preemption(p.preemption);
    const certkv::model::ModelConfig& mc = model->model->config();
    const int64_t context = c.backend.context_tokens > 0 ? c.backend.context_tokens : mc.context_length;
    // The pool in tokens of every (layer, K/V, kv_head) table, counted at the scheme's raw page
    // element (bf16: 2 bytes, fp8: 1).
    const uint64_t element_bytes =
        certkv::cache::kv_scheme_element(c.backend.kv_scheme) == certkv::format::GaacElement::kBf16 ? 2 : 1;
    const uint64_t bytes_per_token =
        2ull * uint64_t(mc.n_layers) * uint64_t(mc.n_kv_heads) * uint64_t(mc.head_dim) * element_bytes;
    if (p.pool_bytes > 0 && c.backend.device == certkv::model::Device::kCuda) {
      c.backend.pool_bytes = p.pool_bytes;  // each class at its own page bytes (BackendConfig::pool_bytes)
    } else if (p.pool_bytes > 0) {
      const uint64_t tokens = p.pool_bytes / bytes_per_token;
      if (tokens < uint64_t(context))
        certkv::fail(certkv::StatusCode::kInvalidArgument,
                     "the KV pool of " + std::to_string(p.pool_bytes) + " bytes holds " +
                         std::to_string(tokens) + " tokens (" + std::to_string(bytes_per_token) +
                         " bytes each), fewer than one sequence of the context (" +
                         std::to_string(context) + " tokens)");
      c.backend.pool_tokens = int64_t(tokens);
    } else {
      c.backend.pool_tokens = context * std::max<int64_t>(1, p.max_sequences);
    }
    auto e = std::make_unique<certkv_engine>();
    e->model = model;
    e->engine = std::make_unique<certkv::engine::Engine>(*model->model, c);
    *out = e.release();
  });
}

void certkv_engine_free(certkv_engine* engine) { delete engine; }

certkv_request_params certkv_request_default_params(void) {
  certkv_request_params p{};
  p.max_tokens = 128;
  p.sampler = certkv_sampler_default_params();
  p.logprobs = -1;
  return p;
}

certkv_status certkv_engine_submit(certkv_engine* engine, const certkv_request_params* params,
                                   int64_t* id) {
  CERTKV_REQUIRE(engine && params && id, "certkv_engine_submit: null argument");
  CERTKV_REQUIRE(params->prompt || params->n_prompt == 0, "certkv_engine_submit: null prompt");
  CERTKV_REQUIRE(params->n_prompt >= 0 && params->n_stop >= 0 && (params->stop || params->n_stop == 0),
                 "certkv_engine_submit: negative count or null stop list");
  return guarded([&] {
    certkv::engine::RequestParams r;
    r.prompt.assign(params->prompt, params->prompt + params->n_prompt);
    r.max_tokens = params->max_tokens;
    r.sampling = to_sampler_params(params->sampler);
    for (int32_t i = 0; i < params->n_stop; ++i) {
      if (!params->stop[i])
        certkv::fail(certkv::StatusCode::kInvalidArgument, "certkv_engine_submit: null stop string");
      r.stop.emplace_back(params->stop[i]);
    }
    r.ignore_end = params->ignore_end != 0;
    r.logprobs = params->logprobs;
    r.prompt_logprobs = params->prompt_logprobs != 0;
    *id = engine->engine->submit(std::move(r));
  });
}

namespace {

// The engine's callback over a C one; the requests whose callback asked to stop go to cancel.
certkv::engine::TokenCallback engine_callback(certkv_engine_token_fn fn, void* user,
                                              std::vector<int64_t>* cancel) {
  if (!fn) return {};
  return [=](certkv::engine::RequestId id, int32_t token, std::string_view text) {
    if (fn(user, id, token, text.data(), text.size()) != 0) cancel->push_back(id);
  };
}

}  // namespace

certkv_status certkv_engine_step(certkv_engine* engine, certkv_engine_token_fn on_token, void* user,
                                 int* active) {
  CERTKV_REQUIRE(engine, "certkv_engine_step: null engine");
  return guarded([&] {
    std::vector<int64_t> cancel;
    const bool more = engine->engine->step(engine_callback(on_token, user, &cancel));
    for (int64_t id : cancel) engine->engine->cancel(id);
    if (active) *active = more ? 1 : 0;
  });
}

certkv_status certkv_engine_run(certkv_engine* engine, certkv_engine_token_fn on_token, void* user) {
  CERTKV_REQUIRE(engine, "certkv_engine_run: null engine");
  return guarded([&] {
    std::vector<int64_t> cancel;
    const auto cb = engine_callback(on_token, user, &cancel);
    while (engine->engine->step(cb)) {
      for (int64_t id : cancel) engine->engine->cancel(id);
      cancel.clear();
    }
  });
}

certkv_status certkv_engine_cancel(certkv_engine* engine, int64_t id) {
  CERTKV_REQUIRE(engine, "certkv_engine_cancel: null engine");
  return guarded([&] { engine->engine->cancel(id); });
}

namespace {

int32_t fill_class_bytes(const std::vector<certkv::cache::ClassBytes>& in, certkv_class_bytes* out) {
  int32_t n = 0;
  for (const certkv::cache::ClassBytes& c : in) {
    if (n == CERTKV_MAX_KV_CLASSES) break;
    out[n].storage = certkv::format::storage_class_name(c.storage);
    out[n].bytes = c.bytes;
    ++n;
  }
  return n;
}

}  // namespace

certkv_status certkv_engine_result(const certkv_engine* engine, int64_t id,
                                   certkv_request_result* result) {
  CERTKV_REQUIRE(engine && result, "certkv_engine_result: null argument");
  return guarded([&] {
    const certkv::engine::RequestReport& r = engine->engine->report(id);
    *result = certkv_request_result{};
    result->finished = r.status == certkv::engine::RequestStatus::kFinished;
    result->finish_reason = certkv::engine::finish_reason_name(r.finish);
    result->text = r.text.c_str();
    result->text_bytes = r.text.size();
    result->prompt_tokens = int32_t(r.prompt_tokens);
    result->generated_tokens = int32_t(r.tokens.size());
    result->shared_prompt_tokens = int32_t(r.shared_prompt_tokens);
    result->preemptions = int32_t(r.preemptions);
    result->ttft_ms = r.ttft_ms;
    double sum = 0;
    for (double v : r.itl_ms) sum += v;
    result->itl_ms_mean = r.itl_ms.empty() ? 0 : sum / double(r.itl_ms.size());
    result->metered = r.attention.metered;
    result->meter_max = r.attention.meter_max;
    result->meter_p99 = r.attention.meter_p99;
    result->coverage = r.attention.coverage;
    result->gate_repairs = r.attention.gate_repairs;
    result->sparse_budget = r.attention.sparse_budget;
    result->sparse_estimated_mass = r.attention.sparse_estimated_mass;
    result->sparse_indexed_cells = r.attention.sparse_indexed_cells;
    result->error = r.error.c_str();
    result->n_classes = fill_class_bytes(r.kv_bytes, result->kv_bytes);
    result->meter_cells = r.attention.meter_cells;
  });
}

certkv_status certkv_engine_result_layers(const certkv_engine* engine, int64_t id,
                                          certkv_layer_meter* out, size_t capacity, size_t* n) {
  CERTKV_REQUIRE(engine && n && (out || capacity == 0), "certkv_engine_result_layers: null argument");
  return guarded([&] {
    const auto& layers = engine->engine->report(id).attention.layers;
    *n = layers.size();
    if (layers.size() > capacity)
      certkv::fail(certkv::StatusCode::kOutOfRange, "certkv_engine_result_layers: " +
                                                        std::to_string(layers.size()) + " layers, capacity " +
                                                        std::to_string(capacity));
    for (size_t i = 0; i < layers.size(); ++i)
      out[i] = certkv_layer_meter{layers[i].meter_max, layers[i].meter_p99, layers[i].coverage,
                                  layers[i].cells, layers[i].gate_repairs};
  });
}

static_assert(CERTKV_MAX_TOP_LOGPROBS == certkv::model::kMaxTopLogprobs, "one limit for the C API and the sampler");

certkv_status certkv_engine_logprobs(const certkv_engine* engine, int64_t id, int prompt, size_t first,
                                     certkv_token_logprob* out, size_t capacity, size_t* n) {
  CERTKV_REQUIRE(engine && n && (out || capacity == 0), "certkv_engine_logprobs: null argument");
  return guarded([&] {
    const certkv::engine::RequestReport& r = engine->engine->report(id);
    const std::vector<certkv::model::TokenLogprob>& all = prompt ? r.prompt_logprobs : r.logprobs;
    *n = all.size();
    if (first > all.size())
      certkv::fail(certkv::StatusCode::kInvalidArgument, "certkv_engine_logprobs: entry " + std::to_string(first) +
                                                             " of " + std::to_string(all.size()));
    const size_t count = std::min(capacity, all.size() - first);
    for (size_t i = 0; i < count; ++i) {
      const certkv::model::TokenLogprob& e = all[first + i];
      certkv_token_logprob& o = out[i];
      o = certkv_token_logprob{};
      o.token = e.token;
      o.logprob = e.logprob;
      o.n_top = int32_t(e.top.size());
      for (size_t k = 0; k < e.top.size(); ++k) {
        o.top_tokens[k] = e.top[k].first;
        o.top_logprobs[k] = e.top[k].second;
      }
    }
  });
}

certkv_status certkv_engine_itl(const certkv_engine* engine, int64_t id, double* out,
                                size_t capacity, size_t* n) {
  CERTKV_REQUIRE(engine && n && (out || capacity == 0), "certkv_engine_itl: null argument");
  return guarded([&] {
    const std::vector<double>& itl = engine->engine->report(id).itl_ms;
    *n = itl.size();
    if (itl.size() > capacity)
      certkv::fail(certkv::StatusCode::kOutOfRange, "certkv_engine_itl: " + std::to_string(itl.size()) +
                                                        " latencies, capacity " + std::to_string(capacity));
    std::copy(itl.begin(), itl.end(), out);
  });
}

certkv_status certkv_engine_release(certkv_engine* engine, int64_t id) {
  CERTKV_REQUIRE(engine, "certkv_engine_release: null engine");
  return guarded([&] { engine->engine->release(id); });
}

certkv_status certkv_engine_get_stats(const certkv_engine* engine, certkv_engine_stats* stats) {
  CERTKV_REQUIRE(engine && stats, "certkv_engine_get_stats: null argument");
  return guarded([&] {
    const certkv::engine::EngineStats s = engine->engine->stats();
    *stats = certkv_engine_stats{};
    stats->steps = s.steps;
    stats->prefill_tokens = s.prefill_tokens;
    stats->decode_tokens = s.decode_tokens;
    stats->prefill_seconds = s.prefill_seconds;
    stats->decode_seconds = s.decode_seconds;
    stats->preemptions = s.preemptions;
    stats->shared_blocks = s.shared_blocks;
    stats->evicted_prefixes = s.evicted_prefixes;
    stats->cached_prefixes = s.cached_prefixes;
    stats->running = s.running;
    stats->waiting = s.waiting;
    stats->last_metered_step = s.last_metered_step;
    stats->pool_pages_in_use = s.pool_pages_in_use;
    stats->pool_capacity_pages = s.pool_capacity_pages;
    stats->peak_pages_in_use = s.peak_pages_in_use;
    stats->n_classes = fill_class_bytes(s.peak_bytes, stats->peak_bytes);
    uint64_t pages_in_use = 0;
    for (const certkv::cache::StorageClassStats& c : s.in_use_by_class) {
      pages_in_use += c.pages_in_use;
      if (stats->n_classes_in_use == CERTKV_MAX_KV_CLASSES) continue;
      certkv_kv_class_stats& out = stats->in_use[stats->n_classes_in_use++];
      out.storage = certkv::format::storage_class_name(c.storage);
      out.pages_in_use = c.pages_in_use;
      out.bytes_from_allocator = c.bytes_reserved_from_allocator;
      out.page_bytes_in_use = c.page_bytes_in_use;
    }
    stats->swap_outs = s.swap_outs;
    stats->swap_ins = s.swap_ins;
    stats->swapped_out_host_bytes = s.swapped_out_host_bytes;
    stats->swapped_out_pool_bytes = s.swapped_out_pool_bytes;
    stats->host_bytes_peak = s.host_bytes_peak;
    stats->swap_seconds = s.swap_seconds;
    stats->recomputed_tokens = s.recomputed_tokens;
    stats->recompute_seconds = s.recompute_seconds;
    stats->live_pages_in_use = s.live_pages_in_use;
    const certkv::backend::BackendConfig& bc = engine->engine->backend().config();
    const int32_t head_dim = engine->model->model->config().head_dim;
    stats->page_bytes_as_bf16 = pages_in_use * uint64_t(bc.block_tokens) * uint64_t(head_dim) * 2;
  });
}

certkv_status certkv_engine_recent_meters(const certkv_engine* engine, int64_t after_step,
                                          certkv_meter_step* steps, float* meters, size_t capacity,
                                          size_t* n, int32_t* n_layers, int32_t* n_heads) {
  CERTKV_REQUIRE(engine && n && ((steps && meters) || capacity == 0), "certkv_engine_recent_meters: null argument");
  CERTKV_REQUIRE(after_step >= 0, "certkv_engine_recent_meters: after_step " + std::to_string(after_step) +
                                      " is negative");
  return guarded([&] {
    const certkv::gate::RecentStepMeters& recent = engine->engine->recent_meters();
    if (n_layers) *n_layers = recent.n_layers();
    if (n_heads) *n_heads = recent.n_heads();
    int first = recent.size();  // the oldest kept step numbered above after_step
    while (first > 0 && recent.step(first - 1).step > after_step) --first;
    *n = size_t(recent.size() - first);
    if (*n > capacity)
      certkv::fail(certkv::StatusCode::kOutOfRange, "certkv_engine_recent_meters: " + std::to_string(*n) +
                                                        " steps, capacity " + std::to_string(capacity));
    const size_t cells_per_step = size_t(recent.n_layers()) * size_t(recent.n_heads());
    for (int i = first; i < recent.size(); ++i) {
      const certkv::gate::RecentStepMeters::Step s = recent.step(i);
      const size_t at = size_t(i - first);
      steps[at] = certkv_meter_step{s.step, s.cells};
      std::copy(s.meters, s.meters + cells_per_step, meters + at * cells_per_step);
    }
  });
}

// ---- The scheme table ---------------------------------------------------------------------------

int32_t certkv_kv_scheme_count(void) { return int32_t(certkv::cache::kv_schemes().size()); }

certkv_status certkv_kv_scheme_get(int32_t index, certkv_kv_scheme_info* info) {
  CERTKV_REQUIRE(info, "certkv_kv_scheme_get: null info");
  CERTKV_REQUIRE(index >= 0 && index < certkv_kv_scheme_count(),
                 "certkv_kv_scheme_get: index " + std::to_string(index) + " outside [0, " +
                     std::to_string(certkv_kv_scheme_count()) + ")");
  const certkv::cache::KvSchemeInfo& s = certkv::cache::kv_schemes()[size_t(index)];
  info->name = s.name;
  info->summary = s.summary;
  info->meter_tier = s.tier == certkv::cache::MeterTier::kA   ? "A"
                     : s.tier == certkv::cache::MeterTier::kB ? "B"
                                                              : "none";
  info->lossless = s.lossless ? 1 : 0;
  info->needs_calibration = s.gaac ? 1 : 0;
  info->lossy = s.lossy ? 1 : 0;
  info->cuda_route = s.cuda_route ? 1 : 0;
  info->batch_invariant = s.batch_invariant ? 1 : 0;
  info->default_window_tokens = s.default_window_tokens;
  return CERTKV_OK;
}
