// certkv command-line tool.
//   certkv run      generate text with a model (embedded default: SmolLM2-135M-Instruct)
//   certkv dump-kv  write post-RoPE K/V of a prefill, and the last queries, to safetensors
//   certkv info     print a model's configuration
//   certkv codec    GAAC on a KV dump: calibrate, encode, verify, measure
//   certkv batch, eval, audit (cmd_batch.cc, cmd_eval.cc)
// The flags of every command are rows of one table (options.cc); the tool stands on the C API
// (include/certkv) alone.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "certkv/certkv.hpp"
#include "cli_json.h"
#include "cmd_batch.h"
#include "cmd_codec.h"
#include "cmd_eval.h"
#include "http_server.h"
#include "kv_flags.h"
#include "options.h"

namespace {

using certkv::tools::Command;
using certkv::tools::Flags;
using certkv::tools::JsonObject;
using certkv::tools::KvFlags;
using certkv::tools::UsageError;
using certkv::tools::meter_json;
using certkv::tools::model_path;
using certkv::tools::parse_kv_flags;
using certkv::tools::read_text_file;

struct ProgressBar {
  bool enabled = false;
  bool tty = false;
  int64_t last_percent = -100;  // so the first chunk always prints
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

void show_progress(void* user, int64_t done, int64_t total) {
  auto* bar = static_cast<ProgressBar*>(user);
  if (!bar->enabled) return;
  const int64_t percent = total > 0 ? done * 100 / total : 100;
  if (!bar->tty && percent / 25 == bar->last_percent / 25 && done != total) return;
  bar->last_percent = percent;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - bar->start).count();
  const int width = 30;
  const int filled = int(percent * width / 100);
  fprintf(stderr, "%sprefill [%.*s%*s] %3lld%% %lld/%lld tokens, %.0f tok/s%s", bar->tty ? "\r" : "",
          filled, "##############################", width - filled, "", (long long)percent,
          (long long)done, (long long)total, s > 0 ? double(done) / s : 0.0,
          bar->tty ? (done == total ? "\n" : "") : "\n");
  fflush(stderr);
}

struct StreamState {
  bool print = true;
  std::string text;
};

int on_token(void* user, int32_t, const char* piece, size_t n) {
  auto* s = static_cast<StreamState*>(user);
  s->text.append(piece, n);
  if (s->print) {
    fwrite(piece, 1, n, stdout);
    fflush(stdout);
  }
  return 0;
}

// {"bf16": pages, "gaac": pages}: the KV pages in use per storage class.
JsonObject kv_pages_by_class(const certkv_kv_stats& kvs) {
  JsonObject o;
  for (int32_t i = 0; i < kvs.n_classes; ++i) o.add(kvs.by_class[i].storage, kvs.by_class[i].pages_in_use);
  return o;
}

JsonObject device_json(const certkv_device_stats& d) {
  JsonObject o;
  o.add("attention_calls", d.attention_calls)
      .add("attention_seconds", d.attention_seconds)
      .add("write_seconds", d.write_seconds)
      .add("gaac_slots", d.gaac_slots)
      .add("raw_pages", d.raw_pages)
      .add("blocks_not_fitting", d.blocks_not_fitting)
      .add("kv_bytes_in_use", d.kv_bytes_in_use)
      .add("kv_bytes_reserved", d.kv_bytes_reserved)
      .add("lossy_pages_in_use", d.lossy_pages_in_use)
      .add("pages_kept_exact", d.pages_kept_exact)
      .add("sparse_calls", d.sparse_calls);
  return o;
}

int cmd_run(int argc, char** argv) {
  Flags flags(certkv::tools::kRun);
  flags.parse(argc, argv, 2);
  if (flags.has("prompt") && flags.has("prompt-file"))
    throw UsageError{"give --prompt or --prompt-file, not both"};
  const std::string prompt = flags.has("prompt-file")
                                 ? read_text_file(flags.str("prompt-file"), "prompt-file")
                                 : flags.str("prompt");
  const int64_t n_new = flags.integer("n", 0, 1 << 24);
  const int64_t ctx = flags.has("ctx") ? flags.integer("ctx", 1, int64_t(1) << 31) : 0;
  const int64_t threads = flags.integer("threads", 1, 256);
  const int64_t block_tokens = flags.integer("block-tokens", 1, 4096);
  const std::string kv = flags.str("kv");
  const KvFlags kv_flags = parse_kv_flags(flags, kv);
  const bool kv_gaac = kv_flags.gaac;
  const std::string gaac_calib = flags.str("gaac-calib");
  if (!kv_gaac && !kv_flags.lossy && flags.has("gaac-calib"))
    throw UsageError{"flag --gaac-calib is used only with --kv gaac, gaac-e4m3, gaac-e5m2 or a lossy "
                     "scheme (its backing store), not --kv " + kv};
  const std::string activations = flags.str("activations");
  if (activations != "int8" && activations != "f32")
    throw UsageError{"flag --activations: expected int8 or f32, got '" + activations + "'"};
  const std::string device = flags.str("device");
  if (device != "cpu" && device != "cuda")
    throw UsageError{"flag --device: expected cpu or cuda, got '" + device + "'"};
  certkv_sampler_params sp = certkv_sampler_default_params();
  sp.temperature = float(flags.real("temp", 0.0, 100.0));
  sp.top_k = int32_t(flags.integer("top-k", 0, 1 << 30));
  sp.top_p = float(flags.real("top-p", 1e-6, 1.0));
  sp.seed = uint64_t(flags.integer("seed", 0, INT64_MAX));
  const bool json = flags.has("json");

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  std::vector<int32_t> tokens;
  if (flags.has("raw")) {
    tokens = model.tokenize(prompt, /*add_bos=*/true, /*parse_special=*/false);
  } else {
    std::vector<certkv_chat_message> messages;
    const std::string system = flags.str("system");
    if (flags.has("system")) messages.push_back({"system", system.c_str()});
    messages.push_back({"user", prompt.c_str()});
    tokens = model.chat_tokens(messages, true);
  }
  if (tokens.empty()) throw UsageError{"the prompt is empty"};

  certkv_session_params params = certkv_session_default_params();
  params.context_tokens = ctx > 0 ? ctx : std::min<int64_t>(info.context_length, int64_t(tokens.size()) + n_new);
  params.n_threads = int32_t(threads);
  params.block_tokens = int32_t(block_tokens);
  params.kv = kv.c_str();
  params.activations = activations.c_str();
  params.device = device.c_str();
  kv_flags.apply(params);
  if (!gaac_calib.empty()) params.gaac_calibration = gaac_calib.c_str();
  params.meter_planned_steps = n_new > 0 ? n_new : 1;
  if (int64_t(tokens.size()) > params.context_tokens)
    throw UsageError{"the prompt has " + std::to_string(tokens.size()) +
                     " tokens, more than the context of " + std::to_string(params.context_tokens) +
                     " (--ctx)"};
  certkv::Session session(model, params);

  ProgressBar bar;
  bar.enabled = tokens.size() >= 1024;
  bar.tty = isatty(STDERR_FILENO);
  certkv_generate_params gp = certkv_generate_default_params();
  gp.max_new_tokens = int32_t(std::min<int64_t>(n_new, params.context_tokens - int64_t(tokens.size())));
  gp.sampler = sp;
  gp.progress = show_progress;
  gp.progress_user = &bar;
  StreamState stream;
  stream.print = !json;
  certkv_generate_result r;
  certkv::check(certkv_generate(session.get(), tokens.data(), int32_t(tokens.size()), &gp, on_token,
                                &stream, &r));
  const certkv_kv_stats kvs = session.kv_stats();
  const double prefill_tps = r.prefill_seconds > 0 ? r.prompt_tokens / r.prefill_seconds : 0;
  const double decode_tps = r.decode_seconds > 0 ? r.decode_steps / r.decode_seconds : 0;
  const uint64_t rss = certkv_peak_rss_bytes();
  if (json) {
    JsonObject o;
    o.add("text", stream.text).add("model", info.name).add("kv", kv);
    if (!kv_flags.witness_label().empty()) o.add("witness", kv_flags.witness_label());
    o.add("activations", activations)
        .add("prompt_tokens", int64_t(r.prompt_tokens))
        .add("generated_tokens", int64_t(r.generated_tokens))
        .add("context_tokens", int64_t(params.context_tokens))
        .add("threads", int64_t(threads))
        .add("prefill_seconds", r.prefill_seconds)
        .add("decode_seconds", r.decode_seconds)
        .add("prefill_tok_per_s", prefill_tps)
        .add("decode_tok_per_s", decode_tps)
        .add("kv_bytes", kvs.kv_bytes)
        .add("kv_bytes_in_use", kvs.kv_bytes_in_use)
        .add("kv_bytes_bf16", kvs.kv_bytes_bf16)
        .add("kv_tokens", int64_t(kvs.n_tokens))
        .add("kv_backing_bytes", kvs.backing_bytes)
        .add("kv_pages_by_class", kv_pages_by_class(kvs))
        .add("peak_rss_bytes", rss);
    const certkv_meter_stats ms = session.meter_stats();
    if (ms.metered) o.add("meter", meter_json(ms));
    const certkv_sparse_stats ss = session.sparse_stats();
    if (ss.sparse) o.add("sparse", certkv::tools::sparse_json(ss));
    o.add("device", device);
    const certkv_device_stats ds = session.device_stats();
    if (ds.on_device) o.add("device_stats", device_json(ds));
    printf("%s\n", o.str().c_str());
  } else {
    printf("\n\n[certkv] %s | prompt %d tok, %.1f tok/s | generated %d tok, decode %.1f tok/s | kv %s %.2f MiB (bf16 %.2f MiB) | peak rss %.1f MiB\n",
           info.name, r.prompt_tokens, prefill_tps, r.generated_tokens, decode_tps, kv.c_str(),
           kvs.kv_bytes / 1048576.0, kvs.kv_bytes_bf16 / 1048576.0, rss / 1048576.0);
    const certkv_sparse_stats ss = session.sparse_stats();
    if (ss.sparse && ss.cells == 0)
      printf("[certkv] sparse p %g: no sparse decode step (the context never exceeded the %d-token "
             "window), every step attended every token\n", ss.p, ss.window_tokens);
    else if (ss.sparse)
      printf("[certkv] sparse p %g: mean budget %.3f of the context (%.3f with the %d dense layers), "
             "index %.2f MiB\n",
             ss.p, ss.mean_budget, ss.mean_budget_all_layers, ss.dense_layers,
             ss.index_bytes / 1048576.0);
  }
  return 0;
}

// "all", or a comma list of indices and ranges ("0,5,10-12").
std::vector<int> parse_layers(const std::string& spec, int n_layers) {
  std::vector<int> out;
  if (spec.empty() || spec == "all") {
    for (int i = 0; i < n_layers; ++i) out.push_back(i);
    return out;
  }
  std::set<int> seen;
  std::stringstream ss(spec);
  std::string item;
  auto number = [&](const std::string& s) {
    char* end = nullptr;
    const long v = strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0 || v >= n_layers)
      throw UsageError{"flag --layers: '" + s + "' is not a layer in [0, " + std::to_string(n_layers - 1) + "]"};
    return int(v);
  };
  while (std::getline(ss, item, ',')) {
    const size_t dash = item.find('-');
    int lo, hi;
    if (dash == std::string::npos) {
      lo = hi = number(item);
    } else {
      lo = number(item.substr(0, dash));
      hi = number(item.substr(dash + 1));
      if (hi < lo) throw UsageError{"flag --layers: empty range '" + item + "'"};
    }
    for (int l = lo; l <= hi; ++l)
      if (seen.insert(l).second) out.push_back(l);
  }
  if (out.empty()) throw UsageError{"flag --layers: no layer given"};
  return out;
}

int cmd_dump_kv(int argc, char** argv) {
  Flags flags(certkv::tools::kDumpKv);
  flags.parse(argc, argv, 2);
  for (const char* required : {"text-file", "tokens", "out"})
    if (!flags.has(required)) throw UsageError{std::string("flag --") + required + " is required"};
  const int64_t n = flags.integer("tokens", 1, int64_t(1) << 24);
  const int64_t threads = flags.integer("threads", 1, 256);
  const std::string text = read_text_file(flags.str("text-file"), "text-file");
  const std::string out_path = flags.str("out");

  certkv::Model model(model_path(flags));
  const certkv_model_info info = model.info();
  const std::vector<int> layers = parse_layers(flags.str("layers"), info.n_layers);
  std::vector<int32_t> tokens = model.tokenize(text, true, false);
  if (int64_t(tokens.size()) < n)
    throw UsageError{"flag --tokens: '" + flags.str("text-file") + "' has only " +
                     std::to_string(tokens.size()) + " tokens, fewer than " + std::to_string(n)};
  tokens.resize(size_t(n));
  if (n > info.context_length)
    fprintf(stderr, "certkv dump-kv: warning: %lld tokens exceed the model's trained context of %lld\n",
            (long long)n, (long long)info.context_length);

  certkv_session_params params = certkv_session_default_params();
  params.context_tokens = n;
  params.n_threads = int32_t(threads);
  params.capture_queries = 1;
  certkv::Session session(model, params);
  ProgressBar bar;
  bar.enabled = n >= 1024;
  bar.tty = isatty(STDERR_FILENO);
  session.prefill(tokens, nullptr, nullptr, show_progress, &bar);

  const int hd = info.head_dim;
  std::vector<std::vector<uint16_t>> kv_data;
  std::vector<std::vector<float>> q_data;
  // Names and shapes, reserved so that the views' pointers into them stay valid.
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::string> names;
  shapes.reserve(layers.size() * 3 + 1);
  names.reserve(layers.size() * 3 + 1);
  std::vector<certkv_tensor_view> views;
  auto add_view = [&](std::string name, const char* dtype, std::vector<int64_t> shape, const void* data,
                      size_t n_bytes) {
    names.push_back(std::move(name));
    shapes.push_back(std::move(shape));
    views.push_back({names.back().c_str(), dtype, shapes.back().data(), int32_t(shapes.back().size()), data, n_bytes});
  };
  kv_data.reserve(layers.size() * 2);
  q_data.reserve(layers.size());
  for (int layer : layers) {
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<uint16_t>& buf = kv_data.emplace_back(size_t(info.n_kv_heads) * n * hd);
      for (int h = 0; h < info.n_kv_heads; ++h)
        certkv::check(certkv_session_read_kv(session.get(), layer, kv, h, 0, n, buf.data() + size_t(h) * n * hd));
      add_view("layer" + std::to_string(layer) + (kv == 0 ? ".k" : ".v"), "BF16",
               {info.n_kv_heads, n, hd}, buf.data(), buf.size() * 2);
    }
    std::vector<float>& q = q_data.emplace_back(size_t(info.n_heads) * hd);
    certkv::check(certkv_session_last_queries(session.get(), layer, q.data()));
    add_view("layer" + std::to_string(layer) + ".q", "F32", {info.n_heads, hd}, q.data(), q.size() * 4);
  }
  add_view("tokens", "I32", {n}, tokens.data(), tokens.size() * 4);
  std::string layer_list;
  for (int l : layers) {
    if (!layer_list.empty()) layer_list += ',';
    layer_list += std::to_string(l);
  }
  char scale[32];
  snprintf(scale, sizeof scale, "%.9g", 1.0 / std::sqrt(double(hd)));
  char theta[32];
  snprintf(theta, sizeof theta, "%.9g", double(info.rope_theta));
  const std::map<std::string, std::string> meta = {
      {"format", "certkv-kv-dump/1"},
      {"model", info.name},
      {"architecture", info.architecture},
      {"rope_layout", info.rope_layout},
      {"rope_theta", theta},
      {"head_dim", std::to_string(hd)},
      {"n_heads", std::to_string(info.n_heads)},
      {"n_kv_heads", std::to_string(info.n_kv_heads)},
      {"n_layers", std::to_string(info.n_layers)},
      {"n_tokens", std::to_string(n)},
      {"layers", layer_list},
      {"softmax_scale", scale},
      {"k_layout", "[n_kv_heads, n_tokens, head_dim] post-RoPE keys, bf16"},
      {"v_layout", "[n_kv_heads, n_tokens, head_dim] values, bf16"},
      {"q_layout", "[n_heads, head_dim] post-RoPE queries of the last position, f32"},
      {"source_text", flags.str("text-file")},
  };
  std::vector<certkv_metadata_entry> entries;
  for (const auto& [key, value] : meta) entries.push_back({key.c_str(), value.c_str()});
  certkv::check(certkv_safetensors_write(out_path.c_str(), views.data(), views.size(), entries.data(),
                                         entries.size()));
  fprintf(stderr, "certkv dump-kv: wrote %zu layers x %lld tokens to %s\n", layers.size(), (long long)n,
          out_path.c_str());
  return 0;
}

int cmd_info(int argc, char** argv) {
  Flags flags(certkv::tools::kInfo);
  flags.parse(argc, argv, 2);
  certkv::Model model(model_path(flags));
  const certkv_model_info i = model.info();
  JsonObject o;
  o.add("name", i.name)
      .add("architecture", i.architecture)
      .add("weight_type", i.weight_type)
      .add("n_layers", int64_t(i.n_layers))
      .add("dim", int64_t(i.dim))
      .add("n_heads", int64_t(i.n_heads))
      .add("n_kv_heads", int64_t(i.n_kv_heads))
      .add("head_dim", int64_t(i.head_dim))
      .add("ffn_dim", int64_t(i.ffn_dim))
      .add("n_vocab", int64_t(i.n_vocab))
      .add("context_length", i.context_length)
      .add("rope_layout", i.rope_layout)
      .add("rope_theta", double(i.rope_theta))
      .add("weight_bytes", i.weight_bytes);
  printf("%s\n", o.str().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fputs(certkv::tools::overview_help().c_str(), stderr);
    return 2;
  }
  const std::string command = argv[1];
  try {
    if (command == "--version" || command == "version") {
      printf("certkv %s\n", certkv_version());
      return 0;
    }
    if (command == "-h" || command == "--help" || command == "help") {
      fputs(certkv::tools::overview_help().c_str(), stdout);
      return 0;
    }
    if (command == "run") return cmd_run(argc, argv);
    if (command == "batch") return certkv::tools::cmd_batch(argc, argv);
    if (command == "dump-kv") return cmd_dump_kv(argc, argv);
    if (command == "eval") return certkv::tools::cmd_eval(argc, argv);
    if (command == "audit") return certkv::tools::cmd_audit(argc, argv);
    if (command == "info") return cmd_info(argc, argv);
    if (command == "codec") return certkv::tools::cmd_codec(argc, argv);
    if (command == "serve") return certkv::server::serve_main(argc - 1, argv + 1);
    fprintf(stderr, "certkv: unknown command '%s' (run, batch, serve, dump-kv, info, eval, audit, codec; certkv -h)\n",
            command.c_str());
    return 2;
  } catch (const UsageError& e) {
    fprintf(stderr, "certkv %s: %s\n", command.c_str(), e.message.c_str());
    return 2;
  } catch (const certkv::ApiError& e) {
    fprintf(stderr, "certkv %s: %s\n", command.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    fprintf(stderr, "certkv %s: %s\n", command.c_str(), e.what());
    return 1;
  }
}
