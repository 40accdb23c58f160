// certkv._certkv: the nanobind module under the Python package certkv. It stands on the C API
// (certkv/certkv.h, through the C++ wrapper certkv.hpp) alone, as every front end does; the
// Python layer (python/certkv/*.py) checks arguments and shapes the results.
//
// Failures of the C API raise the exception certkv._errors.error_for_status builds (its message
// is certkv_last_error()). Long calls (model load, prefill, decode, generation, engine steps)
// release the GIL; no callback of the C API calls into Python.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "certkv/certkv.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using certkv::ApiError;
using certkv::check;

template <typename T>
using Array = nb::ndarray<T, nb::numpy, nb::c_contig>;
template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

// A NumPy array that owns a vector's storage.
template <typename T>
Array<T> to_numpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return Array<T>(owned->data(), shape.size(), shape.begin(), owner);
}

nb::bytes to_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

// ---- Sessions and engines: their settings from the Python layer's dict ----------------------

// certkv_session_params with the strings it points at.
struct SessionOptions {
  certkv_session_params params = certkv_session_default_params();
  std::string kv, activations, gaac_calibration, sparse_rotation, witness, device;
};

std::unique_ptr<SessionOptions> session_options(const nb::dict& d) {
  auto o = std::make_unique<SessionOptions>();
  certkv_session_params& p = o->params;
  for (auto [key_obj, value] : d) {
    const std::string key = nb::cast<std::string>(key_obj);
    if (value.is_none()) continue;
    if (key == "kv") p.kv = (o->kv = nb::cast<std::string>(value)).c_str();
    else if (key == "activations") p.activations = (o->activations = nb::cast<std::string>(value)).c_str();
    else if (key == "gaac_calibration") p.gaac_calibration = (o->gaac_calibration = nb::cast<std::string>(value)).c_str();
    else if (key == "sparse_rotation") p.sparse_rotation = (o->sparse_rotation = nb::cast<std::string>(value)).c_str();
    else if (key == "witness") p.witness = (o->witness = nb::cast<std::string>(value)).c_str();
    else if (key == "device") p.device = (o->device = nb::cast<std::string>(value)).c_str();
    else if (key == "context_tokens") p.context_tokens = nb::cast<int64_t>(value);
    else if (key == "n_threads") p.n_threads = nb::cast<int32_t>(value);
    else if (key == "block_tokens") p.block_tokens = nb::cast<int32_t>(value);
    else if (key == "prefill_chunk_tokens") p.prefill_chunk_tokens = nb::cast<int32_t>(value);
    else if (key == "outlier_pairs") p.outlier_pairs = nb::cast<int32_t>(value);
    else if (key == "recent_window_tokens") p.recent_window_tokens = nb::cast<int32_t>(value);
    else if (key == "meter") p.meter = nb::cast<bool>(value) ? 1 : 0;
    else if (key == "meter_delta") p.meter_delta = nb::cast<double>(value);
    else if (key == "meter_tau") p.meter_tau = nb::cast<double>(value);
    else if (key == "gate") p.gate = nb::cast<bool>(value) ? 1 : 0;
    else if (key == "meter_planned_steps") p.meter_planned_steps = nb::cast<int64_t>(value);
    else if (key == "sparse_p") p.sparse_p = nb::cast<double>(value);
    else if (key == "sparse_window") p.sparse_window = nb::cast<int32_t>(value);
    else if (key == "sparse_dense_layers") p.sparse_dense_layers = nb::cast<int32_t>(value);
    else if (key == "sparse_deviations") p.sparse_deviations = nb::cast<double>(value);
    else throw nb::value_error(("unknown session option '" + key + "'").c_str());
  }
  return o;
}

certkv_sampler_params sampler_params(float temperature, int32_t top_k, float top_p, uint64_t seed) {
  certkv_sampler_params s = certkv_sampler_default_params();
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.seed = seed;
  return s;
}

nb::dict kv_stats_dict(const certkv_kv_stats& s) {
  nb::dict d, pages, bytes;
  for (int32_t i = 0; i < s.n_classes; ++i) {
    pages[s.by_class[i].storage] = s.by_class[i].pages_in_use;
    bytes[s.by_class[i].storage] = s.by_class[i].page_bytes_in_use;
  }
  d["n_tokens"] = s.n_tokens;
  d["kv_bytes"] = s.kv_bytes;
  d["kv_bytes_in_use"] = s.kv_bytes_in_use;
  d["kv_bytes_bf16"] = s.kv_bytes_bf16;
  d["backing_bytes"] = s.backing_bytes;
  d["exact_fallback_blocks"] = s.exact_fallback_blocks;
  d["pages_by_class"] = pages;
  d["page_bytes_by_class"] = bytes;
  return d;
}

nb::dict meter_stats_dict(const certkv_meter_stats& m) {
  nb::dict d;
  d["metered"] = m.metered != 0;
  d["tier"] = m.tier;
  d["certified"] = m.certified != 0;
  d["tau"] = m.tau;
  d["delta_loc"] = m.delta_loc;
  d["cells"] = m.cells;
  d["coverage"] = m.coverage;
  d["max"] = m.max;
  d["p50"] = m.p50;
  d["p99"] = m.p99;
  d["overflow"] = m.overflow;
  d["gate_repairs"] = m.repairs;
  d["pagein_bytes"] = m.pagein_bytes;
  d["exact_fallback_blocks"] = m.exact_fallback_blocks;
  return d;
}

nb::dict sparse_stats_dict(const certkv_sparse_stats& s) {
  nb::dict d;
  d["sparse"] = s.sparse != 0;
  d["p"] = s.p;
  d["deviations"] = s.deviations;
  d["window_tokens"] = s.window_tokens;
  d["dense_layers"] = s.dense_layers;
  d["steps"] = s.steps;
  d["cells"] = s.cells;
  d["mean_budget"] = s.mean_budget;
  d["mean_budget_all_layers"] = s.mean_budget_all_layers;
  d["index_bytes"] = s.index_bytes;
  d["indexed_tokens"] = s.indexed_tokens;
  d["index_appended_tokens"] = s.index_appended_tokens;
  d["index_build_seconds"] = s.index_build_seconds;
  d["widened_fraction"] = s.widened_fraction;
  return d;
}

// ---- Model -----------------------------------------------------------------------------------

struct Model {
  std::unique_ptr<certkv::Model> model;
  // A GGUF file or Hugging Face folder; with a tokenizer, a llama2.c checkpoint and its tokenizer.bin.
  Model(const std::string& path, const std::optional<std::string>& tokenizer) {
    nb::gil_scoped_release release;
    model = tokenizer ? std::make_unique<certkv::Model>(path, *tokenizer) : std::make_unique<certkv::Model>(path);
  }
  const certkv_model* get() const { return model->get(); }
};

nb::dict model_info(const Model& m) {
  const certkv_model_info i = m.model->info();
  nb::dict d;
  d["architecture"] = i.architecture;
  d["name"] = i.name;
  d["rope_layout"] = i.rope_layout;
  d["weight_type"] = i.weight_type;
  d["n_layers"] = i.n_layers;
  d["dim"] = i.dim;
  d["n_heads"] = i.n_heads;
  d["n_kv_heads"] = i.n_kv_heads;
  d["head_dim"] = i.head_dim;
  d["ffn_dim"] = i.ffn_dim;
  d["n_vocab"] = i.n_vocab;
  d["context_length"] = i.context_length;
  d["rope_theta"] = i.rope_theta;
  d["weight_bytes"] = i.weight_bytes;
  return d;
}

std::string chat(const Model& m, const std::vector<std::pair<std::string, std::string>>& messages,
                 bool add_generation_prompt) {
  std::vector<certkv_chat_message> c;
  for (const auto& [role, content] : messages) c.push_back({role.c_str(), content.c_str()});
  return m.model->chat(c, add_generation_prompt);
}

std::vector<int32_t> chat_tokens(const Model& m, const std::vector<std::pair<std::string, std::string>>& messages,
                                 bool add_generation_prompt) {
  std::vector<certkv_chat_message> c;
  for (const auto& [role, content] : messages) c.push_back({role.c_str(), content.c_str()});
  return m.model->chat_tokens(c, add_generation_prompt);
}

// ---- Session ---------------------------------------------------------------------------------

struct Session {
  nb::object model_ref;  // keeps the Model alive while the session lives
  const Model* model;
  std::unique_ptr<SessionOptions> options;
  certkv_session* session = nullptr;
  int32_t n_vocab = 0;

  Session(nb::object model_obj, const nb::dict& opts)
      : model_ref(model_obj), model(nb::cast<const Model*>(model_obj)), options(session_options(opts)) {
    n_vocab = model->model->info().n_vocab;
    nb::gil_scoped_release release;
    check(certkv_session_create(model->get(), &options->params, &session));
  }
  ~Session() { certkv_session_free(session); }

  Array<float> prefill(const std::vector<int32_t>& tokens) {
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    {
      nb::gil_scoped_release release;
      check(certkv_session_prefill(session, tokens.data(), int32_t(tokens.size()), logits.data(), nullptr,
                                   nullptr, nullptr));
    }
    return to_numpy(std::move(logits), {size_t(n_vocab)});
  }
  Array<float> decode(int32_t token) {
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    {
      nb::gil_scoped_release release;
      check(certkv_session_decode(session, token, logits.data()));
    }
    return to_numpy(std::move(logits), {size_t(n_vocab)});
  }
  // certkv_generate: the pieces of the generated tokens and the counts and times.
  std::pair<std::vector<nb::bytes>, nb::dict> generate(const std::vector<int32_t>& tokens, int32_t max_new_tokens,
                                                       bool stop_at_end, float temperature, int32_t top_k,
                                                       float top_p, uint64_t seed) {
    certkv_generate_params gp = certkv_generate_default_params();
    gp.max_new_tokens = max_new_tokens;
    gp.stop_at_end = stop_at_end ? 1 : 0;
    gp.sampler = sampler_params(temperature, top_k, top_p, seed);
    std::vector<std::string> pieces;
    certkv_generate_result r;
    {
      nb::gil_scoped_release release;
      check(certkv_generate(
          session, tokens.data(), int32_t(tokens.size()), &gp,
          [](void* user, int32_t, const char* piece, size_t n) {
            static_cast<std::vector<std::string>*>(user)->emplace_back(piece, n);
            return 0;
          },
          &pieces, &r));
    }
    std::vector<nb::bytes> out;
    for (const std::string& p : pieces) out.push_back(to_bytes(p));
    nb::dict d;
    d["prompt_tokens"] = r.prompt_tokens;
    d["generated_tokens"] = r.generated_tokens;
    d["prefill_seconds"] = r.prefill_seconds;
    d["decode_steps"] = r.decode_steps;
    d["decode_seconds"] = r.decode_seconds;
    return {out, d};
  }
  int32_t n_layers() const { return model->model->info().n_layers; }

  // The audit's totals and, per layer, (cells, violations, coverage).
  nb::dict audit_stats() const {
    certkv_audit_stats a{};
    check(certkv_session_audit_stats(session, &a));
    nb::dict d;
    d["cells"] = a.cells;
    d["violations"] = a.violations;
    d["coverage"] = a.coverage;
    d["max_meter"] = a.max_meter;
    d["max_tv"] = a.max_tv;
    d["tightness_q01"] = a.tightness_q01;
    d["tightness_q10"] = a.tightness_q10;
    d["tightness_q50"] = a.tightness_q50;
    d["tightness_q90"] = a.tightness_q90;
    d["tightness_q99"] = a.tightness_q99;
    d["worst_margin"] = a.worst_margin;
    nb::list layers;
    for (int32_t l = 0; l < n_layers(); ++l) {
      int64_t cells = 0, violations = 0;
      double coverage = 0;
      check(certkv_session_audit_layer(session, l, &cells, &violations, &coverage));
      nb::dict e;
      e["cells"] = cells;
      e["violations"] = violations;
      e["coverage"] = coverage;
      layers.append(e);
    }
    d["layers"] = layers;
    return d;
  }

  // Enables the sparse audit with further Top-p rules (p, deviations) audited on the same cells.
  void sparse_audit_enable(int32_t dump_cells, uint64_t seed, const std::vector<std::pair<double, double>>& rules) {
    check(certkv_session_sparse_audit_enable(session, dump_cells, seed));
    for (const auto& [p, deviations] : rules) {
      int32_t index = 0;
      check(certkv_session_sparse_audit_add_rule(session, p, deviations, &index));
    }
  }

  // The sparse audit's totals, per layer (cells, mean_budget, mean_recall, min_recall), and each
  // added rule's means over every layer (cells, mean_budget, mean_recall, recall_q10).
  nb::dict sparse_audit_stats(int32_t n_rules) const {
    certkv_sparse_audit_stats a{};
    check(certkv_session_sparse_audit_stats(session, &a));
    nb::dict d;
    d["cells"] = a.cells;
    d["mean_budget"] = a.mean_budget;
    d["mean_recall"] = a.mean_recall;
    d["recall_q01"] = a.recall_q01;
    d["recall_q10"] = a.recall_q10;
    d["recall_q50"] = a.recall_q50;
    d["min_recall"] = a.min_recall;
    d["budget_q50"] = a.budget_q50;
    d["budget_q90"] = a.budget_q90;
    d["max_budget"] = a.max_budget;
    d["estimator_samples"] = a.estimator_samples;
    d["estimator_bias"] = a.estimator_bias;
    d["estimator_rms"] = a.estimator_rms;
    d["estimator_abs_q50"] = a.estimator_abs_q50;
    d["estimator_abs_q90"] = a.estimator_abs_q90;
    d["estimator_abs_q99"] = a.estimator_abs_q99;
    d["normalized_rms_sqrt_d"] = a.normalized_rms_sqrt_d;
    d["topk_estimated_budget"] = a.topk_estimated_budget;
    d["topk_estimated_recall"] = a.topk_estimated_recall;
    d["topk_oracle_budget"] = a.topk_oracle_budget;
    d["topk_oracle_recall"] = a.topk_oracle_recall;
    d["quest_budget"] = a.quest_budget;
    d["quest_recall"] = a.quest_recall;
    nb::list layers, rules;
    for (int32_t l = 0; l < n_layers(); ++l) {
      int64_t cells = 0;
      double budget = 0, recall = 0, min_recall = 0;
      check(certkv_session_sparse_audit_layer(session, l, &cells, &budget, &recall, &min_recall));
      nb::dict e;
      e["cells"] = cells;
      e["mean_budget"] = budget;
      e["mean_recall"] = recall;
      e["min_recall"] = min_recall;
      layers.append(e);
    }
    for (int32_t r = 0; r < n_rules; ++r) {
      int64_t cells = 0;
      double budget = 0, recall = 0, q10 = 0;
      check(certkv_session_sparse_audit_rule(session, r, -1, &cells, &budget, &recall, &q10));
      nb::dict e;
      e["cells"] = cells;
      e["mean_budget"] = budget;
      e["mean_recall"] = recall;
      e["recall_q10"] = q10;
      rules.append(e);
    }
    d["layers"] = layers;
    d["rules"] = rules;
    return d;
  }

  nb::dict device_stats() const {
    certkv_device_stats a{};
    check(certkv_session_device_stats(session, &a));
    nb::dict d;
    d["on_device"] = a.on_device != 0;
    d["attention_calls"] = a.attention_calls;
    d["attention_seconds"] = a.attention_seconds;
    d["write_seconds"] = a.write_seconds;
    d["gaac_slots"] = a.gaac_slots;
    d["raw_pages"] = a.raw_pages;
    d["blocks_not_fitting"] = a.blocks_not_fitting;
    d["kv_bytes_in_use"] = a.kv_bytes_in_use;
    d["kv_bytes_reserved"] = a.kv_bytes_reserved;
    d["lossy_pages_in_use"] = a.lossy_pages_in_use;
    d["pages_kept_exact"] = a.pages_kept_exact;
    d["sparse_calls"] = a.sparse_calls;
    return d;
  }

  nb::dict kv_stats() const {
    certkv_kv_stats s;
    check(certkv_session_kv_stats(session, &s));
    return kv_stats_dict(s);
  }
  nb::dict meter_stats() const {
    certkv_meter_stats s;
    check(certkv_session_meter_stats(session, &s));
    return meter_stats_dict(s);
  }
  nb::dict sparse_stats() const {
    certkv_sparse_stats s;
    check(certkv_session_sparse_stats(session, &s));
    return sparse_stats_dict(s);
  }
};

struct Sampler {
  certkv_sampler* sampler = nullptr;
  Sampler(float temperature, int32_t top_k, float top_p, uint64_t seed) {
    const certkv_sampler_params p = sampler_params(temperature, top_k, top_p, seed);
    check(certkv_sampler_create(&p, &sampler));
  }
  ~Sampler() { certkv_sampler_free(sampler); }
  int32_t sample(In<float> logits) {
    int32_t token = 0;
    check(certkv_sampler_sample(sampler, logits.data(), int32_t(logits.size()), &token));
    return token;
  }
};

// ---- Engine ----------------------------------------------------------------------------------

struct Engine {
  nb::object model_ref;
  std::unique_ptr<SessionOptions> options;
  certkv_engine* engine = nullptr;

  Engine(nb::object model_obj, const nb::dict& opts, int32_t max_sequences, int64_t step_tokens,
         uint64_t pool_bytes, bool prefix_sharing)
      : model_ref(model_obj), options(session_options(opts)) {
    const Model* model = nb::cast<const Model*>(model_obj);
    certkv_engine_params p = certkv_engine_default_params();
    p.session = options->params;
    p.max_sequences = max_sequences;
    p.step_tokens = step_tokens;
    p.pool_bytes = pool_bytes;
    p.prefix_sharing = prefix_sharing ? 1 : 0;
    nb::gil_scoped_release release;
    check(certkv_engine_create(model->get(), &p, &engine));
  }
  ~Engine() { certkv_engine_free(engine); }

  int64_t submit(const std::vector<int32_t>& prompt, int32_t max_tokens, float temperature, int32_t top_k,
                 float top_p, uint64_t seed, const std::vector<std::string>& stop, bool ignore_end, int32_t logprobs,
                 bool prompt_logprobs) {
    std::vector<const char*> stop_ptrs;
    for (const std::string& s : stop) stop_ptrs.push_back(s.c_str());
    certkv_request_params r = certkv_request_default_params();
    r.prompt = prompt.data();
    r.n_prompt = int32_t(prompt.size());
    r.max_tokens = max_tokens;
    r.sampler = sampler_params(temperature, top_k, top_p, seed);
    r.stop = stop_ptrs.empty() ? nullptr : stop_ptrs.data();
    r.n_stop = int32_t(stop_ptrs.size());
    r.ignore_end = ignore_end ? 1 : 0;
    r.logprobs = logprobs;
    r.prompt_logprobs = prompt_logprobs ? 1 : 0;
    int64_t id = 0;
    check(certkv_engine_submit(engine, &r, &id));
    return id;
  }
  // One batched step: the text each request completed in it, in order, and whether requests remain.
  std::pair<std::vector<std::pair<int64_t, nb::bytes>>, bool> step() {
    std::vector<std::pair<int64_t, std::string>> pieces;
    int active = 0;
    {
      nb::gil_scoped_release release;
      check(certkv_engine_step(
          engine,
          [](void* user, int64_t request, int32_t, const char* text, size_t n) {
            if (n > 0) static_cast<std::vector<std::pair<int64_t, std::string>>*>(user)->emplace_back(
                request, std::string(text, n));
            return 0;
          },
          &pieces, &active));
    }
    std::vector<std::pair<int64_t, nb::bytes>> out;
    for (const auto& [id, text] : pieces) out.emplace_back(id, to_bytes(text));
    return {out, active != 0};
  }
  nb::dict result(int64_t id) const {
    certkv_request_result r;
    check(certkv_engine_result(engine, id, &r));
    nb::dict d, kv_bytes;
    d["finished"] = r.finished != 0;
    d["finish_reason"] = r.finish_reason;
    d["text"] = to_bytes(std::string(r.text ? r.text : "", r.text_bytes));
    d["prompt_tokens"] = r.prompt_tokens;
    d["generated_tokens"] = r.generated_tokens;
    d["shared_prompt_tokens"] = r.shared_prompt_tokens;
    d["preemptions"] = r.preemptions;
    d["ttft_ms"] = r.ttft_ms;
    d["itl_ms_mean"] = r.itl_ms_mean;
    d["metered"] = r.metered != 0;
    d["meter_max"] = r.meter_max;
    d["meter_p99"] = r.meter_p99;
    d["coverage"] = r.coverage;
    d["meter_cells"] = r.meter_cells;
    d["gate_repairs"] = r.gate_repairs;
    d["sparse_budget"] = r.sparse_budget;
    d["sparse_estimated_mass"] = r.sparse_estimated_mass;
    for (int32_t i = 0; i < r.n_classes; ++i) kv_bytes[r.kv_bytes[i].storage] = r.kv_bytes[i].bytes;
    d["kv_bytes"] = kv_bytes;
    d["error"] = r.error ? r.error : "";
    return d;
  }
  // certkv_engine_logprobs: (token, logprob, [(token, logprob) of the alternatives]) per entry.
  std::vector<std::tuple<int32_t, float, std::vector<std::pair<int32_t, float>>>> logprobs(int64_t id, bool prompt) const {
    size_t n = 0;
    check(certkv_engine_logprobs(engine, id, prompt ? 1 : 0, 0, nullptr, 0, &n));
    std::vector<certkv_token_logprob> entries(n);
    check(certkv_engine_logprobs(engine, id, prompt ? 1 : 0, 0, entries.data(), entries.size(), &n));
    std::vector<std::tuple<int32_t, float, std::vector<std::pair<int32_t, float>>>> out;
    for (const certkv_token_logprob& e : entries) {
      std::vector<std::pair<int32_t, float>> top;
      for (int32_t k = 0; k < e.n_top; ++k) top.emplace_back(e.top_tokens[k], e.top_logprobs[k]);
      out.emplace_back(e.token, e.logprob, std::move(top));
    }
    return out;
  }
  void cancel(int64_t id) { check(certkv_engine_cancel(engine, id)); }
  void release(int64_t id) { check(certkv_engine_release(engine, id)); }
};

// ---- GAAC pages ------------------------------------------------------------------------------

struct GaacCodec {
  std::string element;
  std::vector<uint8_t> b3, b4;
  certkv_gaac_page_codec c{};
  GaacCodec(std::string e, int32_t block_tokens, int32_t head_dim, In<uint8_t> b3_in, In<uint8_t> b4_in,
            uint64_t capacity)
      : element(std::move(e)), b3(b3_in.data(), b3_in.data() + b3_in.size()),
        b4(b4_in.data(), b4_in.data() + b4_in.size()) {
    if (b3.size() != size_t(head_dim) || b4.size() != size_t(head_dim))
      throw nb::value_error("b3 and b4 must have head_dim entries");
    c = {element.c_str(), block_tokens, head_dim, b3.data(), b4.data(), capacity};
  }
  size_t element_bytes() const { return element == "bf16" ? 2 : 1; }
  size_t page_bytes() const { return size_t(c.block_tokens) * size_t(c.head_dim) * element_bytes(); }
  size_t slot_bytes() const {
    size_t n = 0;
    check(certkv_gaac_slot_bytes(&c, &n));
    return n;
  }
};

// rows: [n_tokens][head_dim] elements (bytes of uint16 or uint8): the bases and the capacity.
std::tuple<Array<uint8_t>, Array<uint8_t>, uint64_t> gaac_calibrate(const std::string& element, int32_t block_tokens,
                                                                   int32_t head_dim, nb::ndarray<nb::c_contig> rows,
                                                                   int64_t n_tokens) {
  std::vector<uint8_t> b3(size_t(head_dim > 0 ? head_dim : 0)), b4(b3.size());
  uint64_t capacity = 0;
  {
    nb::gil_scoped_release release;
    check(certkv_gaac_calibrate(element.c_str(), block_tokens, head_dim, rows.data(), n_tokens, b3.data(),
                                b4.data(), &capacity));
  }
  const size_t d = b3.size();
  return {to_numpy(std::move(b3), {d}), to_numpy(std::move(b4), {d}), capacity};
}

// pages: [n_pages][block_tokens][head_dim]: slots [n_pages][slot_bytes] and bytes used per page
// (0: did not fit).
std::pair<Array<uint8_t>, Array<uint64_t>> gaac_encode(const GaacCodec& codec, nb::ndarray<nb::c_contig> pages,
                                                       size_t n_pages) {
  const size_t slot_bytes = codec.slot_bytes();
  std::vector<uint8_t> slots(n_pages * slot_bytes);
  std::vector<uint64_t> used(n_pages);
  {
    nb::gil_scoped_release release;
    const auto* base = static_cast<const uint8_t*>(pages.data());
    for (size_t p = 0; p < n_pages; ++p) {
      size_t u = 0;
      check(certkv_gaac_encode_page(&codec.c, base + p * codec.page_bytes(), slots.data() + p * slot_bytes, &u));
      used[p] = u;
    }
  }
  return {to_numpy(std::move(slots), {n_pages, slot_bytes}), to_numpy(std::move(used), {n_pages})};
}

// slots: [n_pages][slot_bytes] into out: [n_pages][block_tokens][head_dim] elements.
void gaac_decode(const GaacCodec& codec, In<uint8_t> slots, size_t n_pages, nb::ndarray<nb::c_contig> out) {
  const size_t slot_bytes = codec.slot_bytes();
  if (slots.size() != n_pages * slot_bytes) throw nb::value_error("slots: expected n_pages x slot_bytes bytes");
  nb::gil_scoped_release release;
  auto* base = static_cast<uint8_t*>(out.data());
  for (size_t p = 0; p < n_pages; ++p)
    check(certkv_gaac_decode_page(&codec.c, slots.data() + p * slot_bytes, slot_bytes, base + p * codec.page_bytes()));
}

// pages, slots, used: device pointers (ints) of CUDA memory on the current device; work enqueued
// on `stream` (a cudaStream_t as an int). used: uint32 per page, UINT32_MAX for a page that did not fit.
void gaac_encode_device(const GaacCodec& codec, uintptr_t pages, int64_t n_pages, uintptr_t slots, uintptr_t used,
                        uintptr_t stream) {
  nb::gil_scoped_release release;
  check(certkv_gaac_encode_pages_device(&codec.c, reinterpret_cast<const void*>(pages), n_pages,
                                        reinterpret_cast<uint8_t*>(slots), reinterpret_cast<uint32_t*>(used),
                                        reinterpret_cast<void*>(stream)));
}

// ---- Lossy pages ----------------------------------------------------------------------------

// certkv_lossy_page_codec with the strings and pairs it points at.
struct LossyCodec {
  certkv_lossy_page_codec c{};
  std::string kv, rope_layout, witness;
  std::vector<uint16_t> pairs;
  LossyCodec(std::string kv_, bool key, int32_t block_tokens, int32_t head_dim, std::string rope_layout_,
             std::optional<std::string> witness_, int32_t layer, int32_t kv_head, std::vector<uint16_t> pairs_)
      : kv(std::move(kv_)), rope_layout(std::move(rope_layout_)), witness(witness_.value_or("")), pairs(std::move(pairs_)) {
    c.kv = kv.c_str();
    c.key = key ? 1 : 0;
    c.block_tokens = block_tokens;
    c.head_dim = head_dim;
    c.rope_layout = rope_layout.c_str();
    c.witness = witness_ ? witness.c_str() : nullptr;
    c.layer = layer;
    c.kv_head = kv_head;
    c.n_outlier_pairs = int32_t(pairs.size());
    c.outlier_pairs = pairs.empty() ? nullptr : pairs.data();
  }
  size_t page_bytes() const {
    size_t b = 0;
    check(certkv_lossy_page_bytes(&c, &b));
    return b;
  }
};

// pages: [n_pages][block_tokens][head_dim] bf16 bits, page i at block first_block + i: the pages'
// bytes [n_pages][page_bytes] and whether each was encoded (0: keep it exact).
std::pair<Array<uint8_t>, Array<uint8_t>> lossy_encode(const LossyCodec& codec, In<uint16_t> pages, size_t n_pages,
                                                        uint32_t first_block) {
  const size_t rows = size_t(codec.c.block_tokens) * size_t(codec.c.head_dim), bytes = codec.page_bytes();
  if (pages.size() != n_pages * rows) throw nb::value_error("pages: expected n_pages x block_tokens x head_dim values");
  std::vector<uint8_t> out(n_pages * bytes), encoded(n_pages);
  {
    nb::gil_scoped_release release;
    for (size_t p = 0; p < n_pages; ++p) {
      int e = 0;
      check(certkv_lossy_encode_page(&codec.c, first_block + uint32_t(p), pages.data() + p * rows, out.data() + p * bytes, &e));
      encoded[p] = uint8_t(e);
    }
  }
  return {to_numpy(std::move(out), {n_pages, bytes}), to_numpy(std::move(encoded), {n_pages})};
}

// As lossy_encode on device pointers (ints): pages bf16 bits, out [n_pages][page_bytes], encoded
// uint8 [n_pages]; work enqueued on `stream`.
void lossy_encode_device(const LossyCodec& codec, uintptr_t pages, int64_t n_pages, uint32_t first_block,
                         uintptr_t out, uintptr_t encoded, uintptr_t stream) {
  nb::gil_scoped_release release;
  check(certkv_lossy_encode_pages_device(&codec.c, first_block, reinterpret_cast<const uint16_t*>(pages), n_pages,
                                         reinterpret_cast<uint8_t*>(out), reinterpret_cast<uint8_t*>(encoded),
                                         reinterpret_cast<void*>(stream)));
}

// bytes: [n_pages][page_bytes] into [n_pages][block_tokens][head_dim] float.
Array<float> lossy_decode(const LossyCodec& codec, In<uint8_t> bytes, size_t n_pages, uint32_t first_block) {
  const size_t rows = size_t(codec.c.block_tokens) * size_t(codec.c.head_dim), page = codec.page_bytes();
  if (bytes.size() != n_pages * page) throw nb::value_error("pages: expected n_pages x page_bytes bytes");
  std::vector<float> out(n_pages * rows);
  {
    nb::gil_scoped_release release;
    for (size_t p = 0; p < n_pages; ++p)
      check(certkv_lossy_decode_page(&codec.c, first_block + uint32_t(p), bytes.data() + p * page, out.data() + p * rows));
  }
  return to_numpy(std::move(out), {n_pages, size_t(codec.c.block_tokens), size_t(codec.c.head_dim)});
}

// ---- The meter -------------------------------------------------------------------------------

nb::dict meter_row_dict(const certkv_meter_row& r, std::vector<double>&& bounds) {
  const size_t n = bounds.size();
  nb::dict d;
  d["meter"] = r.meter;
  d["log_a"] = r.log_a;
  d["tv"] = r.tv;
  d["max_bound"] = r.max_bound;
  d["bounds"] = to_numpy(std::move(bounds), {n});
  return d;
}

nb::dict meter_tier_a(In<float> q, In<float> k, In<float> k_hat, int64_t n_tokens, int32_t head_dim,
                      const std::string& rope_layout, double sm_scale) {
  std::vector<double> bounds(size_t(n_tokens > 0 ? n_tokens : 0));
  certkv_meter_row row;
  check(certkv_meter_tier_a(q.data(), k.data(), k_hat.data(), n_tokens, head_dim, rope_layout.c_str(), sm_scale,
                            bounds.data(), &row));
  return meter_row_dict(row, std::move(bounds));
}

nb::dict meter_tier_b(In<float> q, In<float> k, In<float> k_hat, In<float> scales, int64_t n_tokens,
                      int32_t head_dim, const std::string& rope_layout, In<uint16_t> outlier_pairs, double sm_scale,
                      double delta_loc) {
  std::vector<double> bounds(size_t(n_tokens > 0 ? n_tokens : 0));
  certkv_meter_row row;
  check(certkv_meter_tier_b(q.data(), k.data(), k_hat.data(), scales.data(), n_tokens, head_dim,
                            rope_layout.c_str(), outlier_pairs.size() ? outlier_pairs.data() : nullptr,
                            int32_t(outlier_pairs.size()), sm_scale, delta_loc, bounds.data(), &row));
  return meter_row_dict(row, std::move(bounds));
}

// ---- KV stores -------------------------------------------------------------------------------

// certkv_kv_store_params with the strings it points at.
struct KvStoreOptions {
  certkv_kv_store_params params = certkv_kv_store_default_params();
  std::string kv, rope_layout, witness, gaac_calibration, device, sparse_rotation;
};

std::unique_ptr<KvStoreOptions> kv_store_options(const nb::dict& d) {
  auto o = std::make_unique<KvStoreOptions>();
  certkv_kv_store_params& p = o->params;
  for (auto [key_obj, value] : d) {
    const std::string key = nb::cast<std::string>(key_obj);
    if (value.is_none()) continue;
    if (key == "kv") p.kv = (o->kv = nb::cast<std::string>(value)).c_str();
    else if (key == "rope_layout") p.rope_layout = (o->rope_layout = nb::cast<std::string>(value)).c_str();
    else if (key == "witness") p.witness = (o->witness = nb::cast<std::string>(value)).c_str();
    else if (key == "gaac_calibration") p.gaac_calibration = (o->gaac_calibration = nb::cast<std::string>(value)).c_str();
    else if (key == "device") p.device = (o->device = nb::cast<std::string>(value)).c_str();
    // A cudaStream_t as the int torch gives it (torch.cuda.current_stream().cuda_stream).
    else if (key == "cuda_stream") p.cuda_stream = reinterpret_cast<void*>(nb::cast<uintptr_t>(value));
    else if (key == "n_layers") p.n_layers = nb::cast<int32_t>(value);
    else if (key == "n_heads") p.n_heads = nb::cast<int32_t>(value);
    else if (key == "n_kv_heads") p.n_kv_heads = nb::cast<int32_t>(value);
    else if (key == "head_dim") p.head_dim = nb::cast<int32_t>(value);
    else if (key == "block_tokens") p.block_tokens = nb::cast<int32_t>(value);
    else if (key == "n_sequences") p.n_sequences = nb::cast<int32_t>(value);
    else if (key == "max_tokens") p.max_tokens = nb::cast<int64_t>(value);
    else if (key == "sm_scale") p.sm_scale = nb::cast<double>(value);
    else if (key == "outlier_pairs") p.outlier_pairs = nb::cast<int32_t>(value);
    else if (key == "recent_window_tokens") p.recent_window_tokens = nb::cast<int32_t>(value);
    else if (key == "meter_delta") p.meter_delta = nb::cast<double>(value);
    else if (key == "meter_tau") p.meter_tau = nb::cast<double>(value);
    else if (key == "meter_planned_steps") p.meter_planned_steps = nb::cast<int64_t>(value);
    else if (key == "n_threads") p.n_threads = nb::cast<int32_t>(value);
    else if (key == "gate") p.gate = nb::cast<bool>(value) ? 1 : 0;
    else if (key == "sparse_p") p.sparse_p = nb::cast<double>(value);
    else if (key == "sparse_window") p.sparse_window = nb::cast<int32_t>(value);
    else if (key == "sparse_dense_layers") p.sparse_dense_layers = nb::cast<int32_t>(value);
    else if (key == "sparse_deviations") p.sparse_deviations = nb::cast<double>(value);
    else if (key == "sparse_rotation") p.sparse_rotation = (o->sparse_rotation = nb::cast<std::string>(value)).c_str();
    else throw nb::value_error(("unknown KV store option '" + key + "'").c_str());
  }
  return o;
}

// One certkv_kv_store. Array shapes are checked by the Python layer (certkv.KvStore); here the
// sizes are checked again against the store's before any pointer is passed on.
struct KvStore {
  certkv_kv_store* store = nullptr;
  certkv_kv_store_params params;

  explicit KvStore(const nb::dict& options) {
    std::unique_ptr<KvStoreOptions> o = kv_store_options(options);
    check(certkv_kv_store_create(&o->params, &store));
    params = o->params;
    params.kv = params.rope_layout = params.witness = params.gaac_calibration = params.device = nullptr;  // not kept
    params.sparse_rotation = nullptr;
  }
  ~KvStore() { certkv_kv_store_free(store); }
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  size_t row_elements(int64_t n_tokens) const {
    return size_t(params.n_kv_heads) * size_t(n_tokens) * size_t(params.head_dim);
  }
  template <typename T>
  void require_rows(const char* name, const In<T>& a, int64_t n_tokens) const {
    if (n_tokens < 1 || a.size() != row_elements(n_tokens))
      throw nb::value_error((std::string(name) + ": expected n_kv_heads x n_tokens x head_dim elements").c_str());
  }
  void append_bf16(int32_t seq, int32_t layer, In<uint16_t> k, In<uint16_t> v, int64_t n_tokens) {
    require_rows("k", k, n_tokens);
    require_rows("v", v, n_tokens);
    nb::gil_scoped_release release;
    check(certkv_kv_store_append_bf16(store, seq, layer, k.data(), v.data(), n_tokens));
  }
  void append_f32(int32_t seq, int32_t layer, In<float> k, In<float> v, int64_t n_tokens) {
    require_rows("k", k, n_tokens);
    require_rows("v", v, n_tokens);
    nb::gil_scoped_release release;
    check(certkv_kv_store_append_f32(store, seq, layer, k.data(), v.data(), n_tokens));
  }
  nb::dict sparse_stats() const {
    certkv_sparse_stats s;
    check(certkv_kv_store_sparse_stats(store, &s));
    return sparse_stats_dict(s);
  }
  int64_t length(int32_t seq, int32_t layer) const {
    int64_t n = 0;
    check(certkv_kv_store_length(store, seq, layer, &n));
    return n;
  }
  Array<float> read(int32_t seq, int32_t layer, int32_t kv, int64_t begin, int64_t end, bool exact) const {
    const int64_t n = end > begin ? end - begin : 0;
    std::vector<float> out(row_elements(n));
    {
      nb::gil_scoped_release release;
      check(certkv_kv_store_read(store, seq, layer, kv, begin, end, exact ? 1 : 0, out.data()));
    }
    return to_numpy(std::move(out), {size_t(params.n_kv_heads), size_t(n), size_t(params.head_dim)});
  }
  // q: [n_queries][n_heads][head_dim] into out (the same size); meters: [n_heads][5] float64
  // (meter, log_a, value_rho, v_norm_max, output_bound), or None.
  void attend(int32_t seq, int32_t layer, In<float> q, int32_t n_queries,
              nb::ndarray<float, nb::c_contig, nb::device::cpu> out,
              std::optional<nb::ndarray<double, nb::c_contig, nb::device::cpu>> meters) {
    const size_t elements = size_t(n_queries > 0 ? n_queries : 0) * size_t(params.n_heads) * size_t(params.head_dim);
    if (q.size() != elements) throw nb::value_error("q: expected n_queries x n_heads x head_dim elements");
    if (out.size() != elements) throw nb::value_error("out: expected n_queries x n_heads x head_dim elements");
    std::vector<certkv_head_meter> m(meters ? size_t(params.n_heads) : 0);
    if (meters && meters->size() != size_t(params.n_heads) * 5) throw nb::value_error("meters: expected n_heads x 5");
    {
      nb::gil_scoped_release release;
      check(certkv_kv_store_attend(store, seq, layer, q.data(), n_queries, out.data(), meters ? m.data() : nullptr));
    }
    if (meters) {
      double* d = meters->data();
      for (size_t h = 0; h < m.size(); ++h) {
        d[h * 5 + 0] = m[h].meter;
        d[h * 5 + 1] = m[h].log_a;
        d[h * 5 + 2] = m[h].value_rho;
        d[h * 5 + 3] = m[h].v_norm_max;
        d[h * 5 + 4] = m[h].output_bound;
      }
    }
  }
  // A cuda store's rows and decode steps: device pointers as ints (torch's data_ptr(), CuPy's
  // data.ptr), checked by the C API against the store's device, not dereferenced here.
  void append_device(int32_t layer, const std::vector<int32_t>& seqs, const std::vector<int64_t>& n_tokens,
                     uintptr_t k, uintptr_t v) {
    if (n_tokens.size() != seqs.size()) throw nb::value_error("n_tokens: expected one count per entry of seqs");
    nb::gil_scoped_release release;
    check(certkv_kv_store_append_device(store, layer, seqs.data(), n_tokens.data(), int32_t(seqs.size()),
                                        reinterpret_cast<const float*>(k), reinterpret_cast<const float*>(v)));
  }
  // meters 0: not written.
  void attend_device(int32_t layer, const std::vector<int32_t>& seqs, uintptr_t q, uintptr_t out, uintptr_t meters) {
    nb::gil_scoped_release release;
    check(certkv_kv_store_attend_device(store, layer, seqs.data(), int32_t(seqs.size()),
                                        reinterpret_cast<const float*>(q), reinterpret_cast<float*>(out),
                                        reinterpret_cast<float*>(meters)));
  }
  void note_queries_device(int32_t layer, const std::vector<int32_t>& seqs, const std::vector<int64_t>& n_tokens,
                           uintptr_t q) {
    if (n_tokens.size() != seqs.size()) throw nb::value_error("n_tokens: expected one count per entry of seqs");
    nb::gil_scoped_release release;
    check(certkv_kv_store_note_queries_device(store, layer, seqs.data(), n_tokens.data(), int32_t(seqs.size()),
                                              reinterpret_cast<const float*>(q)));
  }
  bool plan_device(const std::vector<int32_t>& seqs, int64_t steps) {
    int32_t recapture = 0;
    nb::gil_scoped_release release;
    check(certkv_kv_store_plan_device(store, seqs.data(), int32_t(seqs.size()), steps, &recapture));
    return recapture != 0;
  }
  void append_planned_device(int32_t layer, uintptr_t k, uintptr_t v, uintptr_t stream) {
    nb::gil_scoped_release release;
    check(certkv_kv_store_append_planned_device(store, layer, reinterpret_cast<const float*>(k),
                                                reinterpret_cast<const float*>(v), reinterpret_cast<void*>(stream)));
  }
  void attend_planned_device(int32_t layer, uintptr_t q, uintptr_t out, uintptr_t meters, uintptr_t stream) {
    nb::gil_scoped_release release;
    check(certkv_kv_store_attend_planned_device(store, layer, reinterpret_cast<const float*>(q),
                                                reinterpret_cast<float*>(out), reinterpret_cast<float*>(meters),
                                                reinterpret_cast<void*>(stream)));
  }
  void finish_planned_device(uintptr_t stream) {
    nb::gil_scoped_release release;
    check(certkv_kv_store_finish_planned_device(store, reinterpret_cast<void*>(stream)));
  }
  bool planned_device() const {
    int32_t open = 0;
    check(certkv_kv_store_planned_device(store, &open));
    return open != 0;
  }
  void crop(int32_t seq, int64_t n_tokens) { check(certkv_kv_store_crop(store, seq, n_tokens)); }
  void reorder(const std::vector<int32_t>& src) {
    if (src.size() != size_t(params.n_sequences)) throw nb::value_error("src: expected n_sequences entries");
    check(certkv_kv_store_reorder(store, src.data()));
  }
  void select(const std::vector<int32_t>& src) {
    if (src.empty() || src.size() > size_t(INT32_MAX)) throw nb::value_error("src: expected 1 to 2^31 - 1 entries");
    check(certkv_kv_store_select(store, src.data(), int32_t(src.size())));
    params.n_sequences = int32_t(src.size());
  }
  nb::dict meter_stats() const {
    certkv_meter_stats m;
    check(certkv_kv_store_meter_stats(store, &m));
    return meter_stats_dict(m);
  }
  nb::dict kv_stats() const {
    certkv_kv_stats s;
    check(certkv_kv_store_kv_stats(store, &s));
    return kv_stats_dict(s);
  }
};

// ---- The key index and Top-p selection -----------------------------------------------------

certkv_rabitq_head rabitq_head(In<float> c_q, In<float> c_k, const std::string& rotation, uint64_t seed) {
  if (c_q.size() != c_k.size()) throw nb::value_error("c_k: expected as many values as c_q");
  return {int32_t(c_q.size()), c_q.data(), c_k.data(), rotation.c_str(), seed};
}

size_t rabitq_record_bytes(int32_t head_dim) {
  size_t bytes = 0;
  check(certkv_rabitq_record_bytes(head_dim, &bytes));
  return bytes;
}

// k: [n_tokens][head_dim]: the records [n_tokens][record_bytes] as bytes.
Array<uint8_t> rabitq_encode_keys(In<float> c_q, In<float> c_k, const std::string& rotation, uint64_t seed,
                                  In<float> k, int64_t n_tokens) {
  const certkv_rabitq_head head = rabitq_head(c_q, c_k, rotation, seed);
  const size_t record_bytes = rabitq_record_bytes(head.head_dim);
  if (n_tokens < 0 || k.size() != size_t(n_tokens) * c_q.size())
    throw nb::value_error("k: expected n_tokens x head_dim values");
  std::vector<uint8_t> records(size_t(n_tokens) * record_bytes);
  {
    nb::gil_scoped_release release;
    check(certkv_rabitq_encode_keys(&head, k.data(), n_tokens, records.data()));
  }
  return to_numpy(std::move(records), {size_t(n_tokens), record_bytes});
}

// The estimated scores, and the float reference's beside them when asked for.
std::pair<Array<float>, std::optional<Array<float>>> rabitq_estimate_scores(
    In<float> c_q, In<float> c_k, const std::string& rotation, uint64_t seed, In<uint8_t> records,
    int64_t n_tokens, In<float> q, uint64_t rounding_seed, bool reference) {
  const certkv_rabitq_head head = rabitq_head(c_q, c_k, rotation, seed);
  const size_t record_bytes = rabitq_record_bytes(head.head_dim);
  if (n_tokens < 0 || records.size() != size_t(n_tokens) * record_bytes)
    throw nb::value_error("records: expected n_tokens records of the head's record size");
  if (q.size() != c_q.size()) throw nb::value_error("q: expected head_dim values");
  std::vector<float> scores(static_cast<size_t>(n_tokens)), scores_ref(reference ? static_cast<size_t>(n_tokens) : 0);
  {
    nb::gil_scoped_release release;
    check(certkv_rabitq_estimate_scores(&head, records.data(), n_tokens, q.data(), rounding_seed, scores.data(),
                                        reference ? scores_ref.data() : nullptr));
  }
  std::optional<Array<float>> ref;
  if (reference) ref = to_numpy(std::move(scores_ref), {size_t(n_tokens)});
  return {to_numpy(std::move(scores), {size_t(n_tokens)}), std::move(ref)};
}

std::pair<Array<uint8_t>, nb::dict> top_p_select(In<float> logits, double p) {
  const size_t n = logits.size();
  std::vector<uint8_t> mask(n);
  certkv_top_p_selection s;
  {
    nb::gil_scoped_release release;
    check(certkv_top_p_select(logits.data(), int64_t(n), p, mask.data(), &s));
  }
  nb::dict d;
  d["threshold"] = s.threshold;
  d["bucket"] = s.bucket;
  d["n_selected"] = s.n_selected;
  d["mass"] = s.mass;
  d["n_boundary"] = s.n_boundary;
  return {to_numpy(std::move(mask), {n}), d};
}

// ---- safetensors files (KV dumps) ------------------------------------------------------------

// The tensors (name, dtype, shape, bytes) in the header's order, and the metadata.
std::pair<std::vector<nb::tuple>, nb::dict> safetensors_read(const std::string& path) {
  certkv_safetensors* raw = nullptr;
  check(certkv_safetensors_open(path.c_str(), &raw));
  std::unique_ptr<certkv_safetensors, void (*)(certkv_safetensors*)> file(raw, certkv_safetensors_free);
  size_t n_tensors = 0, n_metadata = 0;
  check(certkv_safetensors_count(file.get(), &n_tensors, &n_metadata));
  std::vector<nb::tuple> tensors;
  for (size_t i = 0; i < n_tensors; ++i) {
    certkv_tensor_view t;
    check(certkv_safetensors_tensor(file.get(), i, &t));
    std::vector<int64_t> shape(t.shape, t.shape + t.n_dims);
    tensors.push_back(nb::make_tuple(std::string(t.name), std::string(t.dtype), shape,
                                     nb::bytes(static_cast<const char*>(t.data), t.n_bytes)));
  }
  nb::dict metadata;
  for (size_t i = 0; i < n_metadata; ++i) {
    certkv_metadata_entry e;
    check(certkv_safetensors_metadata(file.get(), i, &e));
    metadata[e.key] = e.value;
  }
  return {tensors, metadata};
}

// tensors: (name, dtype, shape, C-contiguous array of the dtype's bytes).
void safetensors_write(const std::string& path, const std::vector<nb::tuple>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::vector<std::string> names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<nb::ndarray<nb::c_contig, nb::device::cpu>> arrays;
  names.reserve(tensors.size());
  dtypes.reserve(tensors.size());
  shapes.reserve(tensors.size());
  arrays.reserve(tensors.size());
  std::vector<certkv_tensor_view> views;
  for (const nb::tuple& t : tensors) {
    names.push_back(nb::cast<std::string>(t[0]));
    dtypes.push_back(nb::cast<std::string>(t[1]));
    shapes.push_back(nb::cast<std::vector<int64_t>>(t[2]));
    arrays.push_back(nb::cast<nb::ndarray<nb::c_contig, nb::device::cpu>>(t[3]));
    views.push_back({names.back().c_str(), dtypes.back().c_str(), shapes.back().data(),
                     int32_t(shapes.back().size()), arrays.back().data(), arrays.back().nbytes()});
  }
  std::vector<certkv_metadata_entry> entries;
  for (const auto& [key, value] : metadata) entries.push_back({key.c_str(), value.c_str()});
  check(certkv_safetensors_write(path.c_str(), views.data(), views.size(), entries.data(), entries.size()));
}

std::vector<nb::dict> kv_schemes() {
  std::vector<nb::dict> out;
  for (int32_t i = 0; i < certkv_kv_scheme_count(); ++i) {
    certkv_kv_scheme_info s;
    check(certkv_kv_scheme_get(i, &s));
    nb::dict d;
    d["name"] = s.name;
    d["summary"] = s.summary;
    d["meter_tier"] = s.meter_tier;
    d["lossless"] = s.lossless != 0;
    d["needs_calibration"] = s.needs_calibration != 0;
    d["lossy"] = s.lossy != 0;
    d["cuda_route"] = s.cuda_route != 0;
    d["batch_invariant"] = s.batch_invariant != 0;
    d["default_window_tokens"] = s.default_window_tokens;
    out.push_back(d);
  }
  return out;
}

}  // namespace

NB_MODULE(_certkv, m) {
  m.doc() = "certkv's C API for the Python package certkv (use the package, not this module)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ApiError& e) {
      nb::object error = nb::module_::import_("certkv._errors").attr("error_for_status")(
          certkv_status_string(e.status()), int(e.status()), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
  m.def("version", [] { return std::string(certkv_version()); });
  m.def("default_model_path", [] { return std::string(CERTKV_DEFAULT_MODEL); });
  m.def("kv_schemes", &kv_schemes);
  m.def("default_meter_tau", [] { return certkv_session_default_params().meter_tau; });

  nb::class_<Model>(m, "Model")
      .def(nb::init<const std::string&, const std::optional<std::string>&>(), "path"_a, "tokenizer"_a = nb::none())
      .def("info", &model_info)
      .def("tokenize", [](const Model& mo, const std::string& text, bool add_special, bool parse_special) {
        return mo.model->tokenize(text, add_special, parse_special);
      })
      .def("piece", [](const Model& mo, int32_t token) { return to_bytes(mo.model->piece(token)); })
      .def("detokenize", [](const Model& mo, const std::vector<int32_t>& tokens, bool render_special) {
        return to_bytes(mo.model->detokenize(tokens, render_special));
      })
      .def("is_end", [](const Model& mo, int32_t token) { return certkv_token_is_end(mo.get(), token) != 0; })
      .def("chat", &chat)
      .def("chat_tokens", &chat_tokens);

  nb::class_<Session>(m, "Session")
      .def(nb::init<nb::object, const nb::dict&>())
      .def("audit_enable", [](Session& s, int32_t dump_cells, uint64_t seed) {
        check(certkv_session_audit_enable(s.session, dump_cells, seed));
      })
      .def("audit_stats", &Session::audit_stats)
      .def("audit_dump", [](const Session& s, const std::string& path) {
        nb::gil_scoped_release release;
        check(certkv_session_audit_dump(s.session, path.c_str()));
      })
      .def("sparse_audit_enable", &Session::sparse_audit_enable)
      .def("sparse_audit_stats", &Session::sparse_audit_stats)
      .def("sparse_audit_dump", [](const Session& s, const std::string& path) {
        nb::gil_scoped_release release;
        check(certkv_session_sparse_audit_dump(s.session, path.c_str()));
      })
      .def("device_stats", &Session::device_stats)
      .def("prefill", &Session::prefill)
      .def("decode", &Session::decode)
      .def("generate", &Session::generate)
      .def("reset", [](Session& s) {
        check(certkv_session_reset(s.session));
        check(certkv_session_meter_reset(s.session));
        check(certkv_session_sparse_reset(s.session));
      })
      .def("n_past", [](const Session& s) { return certkv_session_n_past(s.session); })
      .def("kv_stats", &Session::kv_stats)
      .def("meter_stats", &Session::meter_stats)
      .def("sparse_stats", &Session::sparse_stats);

  nb::class_<Sampler>(m, "Sampler")
      .def(nb::init<float, int32_t, float, uint64_t>())
      .def("sample", &Sampler::sample);

  nb::class_<Engine>(m, "Engine")
      .def(nb::init<nb::object, const nb::dict&, int32_t, int64_t, uint64_t, bool>())
      .def("submit", &Engine::submit)
      .def("logprobs", &Engine::logprobs)
      .def("step", &Engine::step)
      .def("result", &Engine::result)
      .def("cancel", &Engine::cancel)
      .def("release", &Engine::release);

  nb::class_<GaacCodec>(m, "GaacCodec")
      .def(nb::init<std::string, int32_t, int32_t, In<uint8_t>, In<uint8_t>, uint64_t>())
      .def_prop_ro("slot_bytes", &GaacCodec::slot_bytes);
  m.def("gaac_calibrate", &gaac_calibrate);
  m.def("gaac_encode", &gaac_encode);
  m.def("gaac_encode_device", &gaac_encode_device, "codec"_a, "pages_ptr"_a, "n_pages"_a, "slots_ptr"_a, "used_ptr"_a,
        "stream"_a);
  nb::class_<LossyCodec>(m, "LossyCodec")
      .def(nb::init<std::string, bool, int32_t, int32_t, std::string, std::optional<std::string>, int32_t, int32_t,
                    std::vector<uint16_t>>())
      .def_prop_ro("page_bytes", &LossyCodec::page_bytes);
  m.def("lossy_encode", &lossy_encode);
  m.def("lossy_encode_device", &lossy_encode_device, "codec"_a, "pages_ptr"_a, "n_pages"_a, "first_block"_a,
        "out_ptr"_a, "encoded_ptr"_a, "stream"_a);
  m.def("lossy_decode", &lossy_decode);
  m.def("gaac_decode", &gaac_decode);
  m.def("meter_tier_a", &meter_tier_a);
  m.def("meter_tier_b", &meter_tier_b);
  nb::class_<KvStore>(m, "KvStore")
      .def(nb::init<const nb::dict&>())
      .def("append_bf16", &KvStore::append_bf16)
      .def("append_f32", &KvStore::append_f32)
      .def("length", &KvStore::length)
      .def("read", &KvStore::read)
      .def("attend", &KvStore::attend, "seq"_a, "layer"_a, "q"_a, "n_queries"_a, "out"_a, "meters"_a.none())
      .def("append_device", &KvStore::append_device, "layer"_a, "seqs"_a, "n_tokens"_a, "k_ptr"_a, "v_ptr"_a)
      .def("attend_device", &KvStore::attend_device, "layer"_a, "seqs"_a, "q_ptr"_a, "out_ptr"_a, "meters_ptr"_a)
      .def("note_queries_device", &KvStore::note_queries_device, "layer"_a, "seqs"_a, "n_tokens"_a, "q_ptr"_a)
      .def("plan_device", &KvStore::plan_device, "seqs"_a, "steps"_a)
      .def("append_planned_device", &KvStore::append_planned_device, "layer"_a, "k_ptr"_a, "v_ptr"_a, "stream"_a)
      .def("attend_planned_device", &KvStore::attend_planned_device, "layer"_a, "q_ptr"_a, "out_ptr"_a, "meters_ptr"_a,
           "stream"_a)
      .def("finish_planned_device", &KvStore::finish_planned_device, "stream"_a)
      .def("planned_device", &KvStore::planned_device)
      .def("crop", &KvStore::crop)
      .def("reorder", &KvStore::reorder)
      .def("select", &KvStore::select)
      .def("meter_stats", &KvStore::meter_stats)
      .def("kv_stats", &KvStore::kv_stats)
      .def("sparse_stats", &KvStore::sparse_stats);
  m.def("rabitq_record_bytes", &rabitq_record_bytes);
  m.def("rabitq_encode_keys", &rabitq_encode_keys);
  m.def("rabitq_estimate_scores", &rabitq_estimate_scores);
  m.def("top_p_select", &top_p_select);
  m.def("safetensors_read", &safetensors_read);
  m.def("safetensors_write", &safetensors_write);
}
