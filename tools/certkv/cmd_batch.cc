#include "cmd_batch.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "certkv/certkv.hpp"
#include "options.h"
#include "kv_flags.h"

namespace certkv::tools {

namespace {

using nlohmann::json;

struct Line {
  std::string id;
  std::vector<int32_t> prompt;
  certkv_request_params params;
  std::vector<std::string> stop;
  std::vector<const char*> stop_ptrs;
  int64_t request = -1;
  std::string error;  // refused at submit
};

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = size_t(std::max(1.0, std::ceil(q * double(v.size()))));
  return v[std::min(rank, v.size()) - 1];
}

// The request of one input line (UsageError naming the line for anything malformed).
Line parse_line(const certkv::Model& model, const std::string& text, int line_no, bool raw,
                const certkv_request_params& defaults) {
  auto bad = [&](const std::string& why) {
    return UsageError{"--prompts-file line " + std::to_string(line_no) + ": " + why};
  };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw bad(std::string("not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw bad("expected a JSON object");
  Line line;
  line.params = defaults;
  try {
    line.id = j.contains("id") ? (j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump())
                               : std::to_string(line_no);
    std::string prompt;
    if (j.contains("messages")) {
      if (j.contains("prompt")) throw bad("give \"prompt\" or \"messages\", not both");
      std::vector<std::string> roles, contents;
      for (const json& m : j.at("messages")) {
        roles.push_back(m.at("role").get<std::string>());
        contents.push_back(m.at("content").get<std::string>());
      }
      std::vector<certkv_chat_message> messages;
      for (size_t i = 0; i < roles.size(); ++i) messages.push_back({roles[i].c_str(), contents[i].c_str()});
      line.prompt = model.chat_tokens(messages, true);
    } else if (j.contains("prompt")) {
      prompt = j.at("prompt").get<std::string>();
      if (raw) {
        line.prompt = model.tokenize(prompt, true, false);
      } else {
        const certkv_chat_message m{"user", prompt.c_str()};
        line.prompt = model.chat_tokens({m}, true);
      }
    } else {
      throw bad("needs \"prompt\" or \"messages\"");
    }
    if (j.contains("max_tokens")) line.params.max_tokens = j.at("max_tokens").get<int32_t>();
    if (j.contains("temperature")) line.params.sampler.temperature = j.at("temperature").get<float>();
    if (j.contains("top_p")) line.params.sampler.top_p = j.at("top_p").get<float>();
    if (j.contains("top_k")) line.params.sampler.top_k = j.at("top_k").get<int32_t>();
    if (j.contains("seed")) line.params.sampler.seed = j.at("seed").get<uint64_t>();
    if (j.contains("ignore_eos")) line.params.ignore_end = j.at("ignore_eos").get<bool>() ? 1 : 0;
    if (j.contains("stop")) {
      const json& s = j.at("stop");
      if (s.is_string()) line.stop.push_back(s.get<std::string>());
      else for (const json& x : s) line.stop.push_back(x.get<std::string>());
    }
  } catch (const json::exception& e) {
    throw bad(std::string("a field has the wrong type (") + e.what() + ")");
  }
  return line;
}

}  // namespace

int cmd_batch(int argc, char** argv) {
  Flags flags(kBatch);
  flags.parse(argc, argv, 2);
  if (!flags.has("prompts-file")) throw UsageError{"flag --prompts-file is required"};
  const std::string kv = flags.str("kv");
  const KvFlags kv_flags = parse_kv_flags(flags, kv);
  const std::string gaac_calib = flags.str("gaac-calib");
  const std::string activations = flags.str("activations");
  const std::string device = flags.str("device");
  if (device != "cpu" && device != "cuda") throw UsageError{"flag --device: expected cpu or cuda, got '" + device + "'"};
  const int64_t parallel = flags.integer("parallel", 1, 4096);
  const int64_t threads = flags.integer("threads", 1, 256);
  const bool raw = flags.has("raw");

  certkv_request_params defaults = certkv_request_default_params();
  defaults.max_tokens = int32_t(flags.integer("n", 1, 1 << 24));
  defaults.sampler.temperature = float(flags.real("temp", 0.0, 100.0));
  defaults.sampler.top_k = int32_t(flags.integer("top-k", 0, 1 << 30));
  defaults.sampler.top_p = float(flags.real("top-p", 1e-6, 1.0));
  defaults.sampler.seed = uint64_t(flags.integer("seed", 0, INT64_MAX));

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  std::ifstream in(flags.str("prompts-file"), std::ios::binary);
  if (!in) throw UsageError{"flag --prompts-file: cannot read '" + flags.str("prompts-file") + "'"};
  std::vector<Line> lines;
  std::string text;
  for (int line_no = 1; std::getline(in, text); ++line_no) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    lines.push_back(parse_line(model, text, line_no, raw, defaults));
  }
  if (lines.empty()) throw UsageError{"--prompts-file holds no request"};

  int64_t longest = 1;
  for (const Line& l : lines) longest = std::max<int64_t>(longest, int64_t(l.prompt.size()) + l.params.max_tokens);
  certkv_engine_params params = certkv_engine_default_params();
  params.session.context_tokens = flags.has("ctx") ? flags.integer("ctx", 1, int64_t(1) << 31)
                                                   : std::min<int64_t>(info.context_length, longest);
  params.session.n_threads = int32_t(threads);
  params.session.block_tokens = int32_t(flags.integer("block-tokens", 1, 4096));
  params.session.kv = kv.c_str();
  params.session.activations = activations.c_str();
  params.session.device = device.c_str();
  kv_flags.apply(params.session);
  if (!gaac_calib.empty()) params.session.gaac_calibration = gaac_calib.c_str();
  params.max_sequences = int32_t(parallel);
  params.step_tokens = flags.integer("step-tokens", 1, 1 << 20);
  params.pool_bytes = flags.has("pool-bytes") ? uint64_t(flags.integer("pool-bytes", 1, INT64_MAX)) : 0;
  params.prefix_sharing = flags.has("no-prefix-sharing") ? 0 : 1;
  const std::string preemption = flags.str("preemption");
  params.preemption = preemption.c_str();
  certkv_engine* engine_raw = nullptr;
  certkv::check(certkv_engine_create(model.get(), &params, &engine_raw));
  std::unique_ptr<certkv_engine, void (*)(certkv_engine*)> engine(engine_raw, certkv_engine_free);

  const auto start = std::chrono::steady_clock::now();
  for (Line& l : lines) {
    for (const std::string& s : l.stop) l.stop_ptrs.push_back(s.c_str());
    l.params.prompt = l.prompt.data();
    l.params.n_prompt = int32_t(l.prompt.size());
    l.params.stop = l.stop_ptrs.data();
    l.params.n_stop = int32_t(l.stop_ptrs.size());
    if (certkv_engine_submit(engine.get(), &l.params, &l.request) != CERTKV_OK) l.error = certkv_last_error();
  }
  certkv::check(certkv_engine_run(engine.get(), nullptr, nullptr));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::vector<double> ttft, itl;
  int64_t generated = 0;
  for (const Line& l : lines) {
    json o;
    o["id"] = l.id;
    if (!l.error.empty()) {
      o["error"] = l.error;
      printf("%s\n", o.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
      continue;
    }
    certkv_request_result r;
    certkv::check(certkv_engine_result(engine.get(), l.request, &r));
    size_t n_itl = 0;
    certkv_engine_itl(engine.get(), l.request, nullptr, 0, &n_itl);
    std::vector<double> lat(n_itl);
    certkv::check(certkv_engine_itl(engine.get(), l.request, lat.data(), lat.size(), &n_itl));
    itl.insert(itl.end(), lat.begin(), lat.end());
    ttft.push_back(r.ttft_ms);
    generated += r.generated_tokens;
    o["text"] = std::string(r.text, r.text_bytes);
    o["finish_reason"] = r.finish_reason;
    o["prompt_tokens"] = r.prompt_tokens;
    o["generated_tokens"] = r.generated_tokens;
    o["shared_prompt_tokens"] = r.shared_prompt_tokens;
    o["preemptions"] = r.preemptions;
    o["ttft_ms"] = r.ttft_ms;
    json cert;
    cert["scheme"] = kv;
    if (r.metered) {
      cert["meter_max"] = r.meter_max;
      cert["meter_p99"] = r.meter_p99;
      cert["coverage"] = r.coverage;
      cert["tau"] = kv_flags.tau;
      cert["gate_repairs"] = r.gate_repairs;
    }
    if (kv_flags.sparse_p > 0) cert["sparse_budget"] = r.sparse_budget;
    json bytes = json::object();
    for (int32_t i = 0; i < r.n_classes; ++i) bytes[r.kv_bytes[i].storage] = r.kv_bytes[i].bytes;
    cert["kv_bytes"] = bytes;
    o["certkv"] = cert;
    printf("%s\n", o.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  }
  certkv_engine_stats s;
  certkv::check(certkv_engine_get_stats(engine.get(), &s));
  json sum;
  sum["summary"] = true;
  sum["requests"] = lines.size();
  sum["parallel"] = parallel;
  sum["kv"] = kv;
  sum["wall_seconds"] = wall;
  sum["prefill_tokens"] = s.prefill_tokens;
  sum["generated_tokens"] = generated;
  sum["prefill_tok_per_s"] = s.prefill_seconds > 0 ? double(s.prefill_tokens) / s.prefill_seconds : 0.0;
  sum["decode_tok_per_s"] = s.decode_seconds > 0 ? double(s.decode_tokens) / s.decode_seconds : 0.0;
  sum["generated_tok_per_s"] = wall > 0 ? double(generated) / wall : 0.0;
  sum["ttft_ms_p50"] = quantile(ttft, 0.5);
  sum["ttft_ms_p99"] = quantile(ttft, 0.99);
  sum["itl_ms_p50"] = quantile(itl, 0.5);
  sum["itl_ms_p99"] = quantile(itl, 0.99);
  json peak = json::object();
  for (int32_t i = 0; i < s.n_classes; ++i) peak[s.peak_bytes[i].storage] = s.peak_bytes[i].bytes;
  sum["kv_bytes_peak"] = peak;
  sum["peak_pages_in_use"] = s.peak_pages_in_use;
  sum["pool_capacity_pages"] = s.pool_capacity_pages;
  sum["preemptions"] = s.preemptions;
  sum["preemption"] = preemption;
  sum["swap_outs"] = s.swap_outs;
  sum["swapped_out_host_bytes"] = s.swapped_out_host_bytes;
  sum["swapped_out_pool_bytes"] = s.swapped_out_pool_bytes;
  sum["host_bytes_peak"] = s.host_bytes_peak;
  sum["swap_seconds"] = s.swap_seconds;
  sum["recomputed_tokens"] = s.recomputed_tokens;
  sum["recompute_seconds"] = s.recompute_seconds;
  sum["shared_blocks"] = s.shared_blocks;
  sum["steps"] = s.steps;
  printf("%s\n", sum.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  return 0;
}

}  // namespace certkv::tools
