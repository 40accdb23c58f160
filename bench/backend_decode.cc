// Batched decode through a backend, as llama-batched-bench measures it: B sequences of real text
// are prefilled to a context of C tokens, then every decode step runs all B together (one token
// each, greedy, drawn in the step) and is timed by the wall clock (a step returns once its tokens
// are on the host). One JSON line per (context, batch): the median step in ms, aggregate decode
// tokens/s (B / step), the prefill rate, KV bytes by class, the engine's shape and the timed steps'
// host time by phase (`host_ms`, ms a step: Backend::step_times).
//
// The largest batch's sequences are prefilled once per context, in ascending contexts (a longer
// context continues the same sequences); each batch then decodes the first B of them for --steps
// steps (their lengths grow by the steps: the line gives the mean context decoded). Sequence i
// reads the corpus's token stream from offset i * 7919 on (wrapping), so no two sequences hold the
// same KV.
//
// With --pool-bytes B (equal memory, table b of docs/bench/cuda_history.md): the pool holds B
// bytes of pages, each class at its own page size (BackendConfig::pool_bytes); sequences are
// admitted one after another, each reserving its whole context and steps up front and then
// prefilled, until the pool refuses one; then all the admitted sequences decode together. One line with `table` "b",
// `pool_bytes` and `sequences` (the admitted count) besides the decode figures.
//
// usage: certkv_backend_decode --model M.gguf --corpus DIR [--device cuda|cpu] [--kv SCHEME]
//          [--witness fp16|u8|exponent] [--sparse P] [--batch 1,8,32,64] [--ctx 8192,32768]
//          [--steps 64] [--warmup 4] [--chunk 2048] [--threads N] [--pool-tokens T | --pool-bytes B]
//          [--wait-encode-results] [--no-meter] [--stagger]
//
// --stagger: sequence i is prefilled to the context plus i % block_tokens tokens, so that the
// sequences complete their blocks on different steps, as a server's do (without it they complete
// them all on the same step, every block_tokens steps, and the median step never sees one); the
// line's "stagger" says which.
//
// --no-meter: a lossy scheme's decode computes no meter (BackendConfig::meter.enabled false), for
// the meter's cost against the same run without the flag; the line's "metered" says which.
//
// --wait-encode-results: the cuda backend waits for the encode results of the blocks a write
// completes in every such layer, instead of reading them once after the step (the default,
// BackendConfig::defer_encode_results); the line's "defer_encode_results" says which.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cache/kv_scheme.h"
#include "codec/lossy_page.h"
#include "core/status.h"
#include "engine/gaac_self_calibration.h"
#include "engine/outlier_pair_calibration.h"
#include "format/page.h"
#include "model/model.h"

using namespace certkv;
using clock_type = std::chrono::steady_clock;

namespace {

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) out.push_back(std::stoll(part));
  if (out.empty()) fail(StatusCode::kInvalidArgument, "an empty list: '" + s + "'");
  return out;
}

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

std::vector<int32_t> corpus_tokens(const model::Model& m, const std::string& dir) {
  std::vector<std::filesystem::path> books;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".txt") books.push_back(e.path());
  std::sort(books.begin(), books.end());
  if (books.empty()) fail(StatusCode::kNotFound, "no .txt books in " + dir);
  std::vector<int32_t> all;
  for (const auto& b : books) {
    std::ifstream f(b);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::vector<int32_t> t = m.tokenizer().encode(ss.str(), false, false);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, corpus, device = "cuda", kv = "bf16", witness, batches = "1,8,32,64", contexts = "8192,32768";
  double sparse_p = 0;
  int steps = 64, warmup = 4, chunk = 2048, threads = 16;
  int64_t pool_tokens = 0, pool_bytes = 0;
  bool defer_encode_results = true, meter = true, stagger = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") model_path = value();
    else if (a == "--corpus") corpus = value();
    else if (a == "--device") device = value();
    else if (a == "--kv") kv = value();
    else if (a == "--witness") witness = value();
    else if (a == "--sparse") sparse_p = std::stod(value());
    else if (a == "--batch") batches = value();
    else if (a == "--ctx") contexts = value();
    else if (a == "--steps") steps = std::stoi(value());
    else if (a == "--warmup") warmup = std::stoi(value());
    else if (a == "--chunk") chunk = std::stoi(value());
    else if (a == "--threads") threads = std::stoi(value());
    else if (a == "--pool-tokens") pool_tokens = std::stoll(value());
    else if (a == "--pool-bytes") pool_bytes = std::stoll(value());
    else if (a == "--wait-encode-results") defer_encode_results = false;
    else if (a == "--no-meter") meter = false;
    else if (a == "--stagger") stagger = true;
    else {
      std::fprintf(stderr, "unknown flag %s (see the header of bench/backend_decode.cc)\n", a.c_str());
      return 2;
    }
  }
  if (model_path.empty() || corpus.empty()) {
    std::fprintf(stderr, "usage: certkv_backend_decode --model M.gguf --corpus DIR [flags]\n");
    return 2;
  }
  try {
    std::vector<int64_t> bs = parse_list(batches), cs = parse_list(contexts);
    const int64_t max_b = *std::max_element(bs.begin(), bs.end());
    const int64_t max_c = *std::max_element(cs.begin(), cs.end());
    std::unique_ptr<model::Model> m = model::load_model(model_path);
    const std::vector<int32_t> stream = corpus_tokens(*m, corpus);

    backend::BackendConfig cfg;
    cfg.device = device == "cuda" ? model::Device::kCuda : model::Device::kCpu;
    // Each batch's cell decodes the first sequences again: room for every cell's steps.
    cfg.context_tokens = max_c + int64_t(steps + warmup) * int64_t(bs.size()) + 16 + (stagger ? cfg.block_tokens : 0);
    if (pool_bytes > 0) {
      cfg.pool_bytes = uint64_t(pool_bytes);
      bs = {1};  // one cell: every admitted sequence decodes
      cs = {max_c};
    } else {
      cfg.pool_tokens = pool_tokens > 0 ? pool_tokens : cfg.context_tokens * max_b;
    }
    cfg.n_threads = threads;
    cfg.defer_encode_results = defer_encode_results;
    cfg.meter.enabled = meter;
    cfg.kv_scheme = cache::parse_kv_scheme(kv);
    const cache::KvSchemeInfo& info = cache::kv_scheme_info(cfg.kv_scheme);
    cfg.witness = cache::resolve_kv_witness(cfg.kv_scheme, witness.empty() ? nullptr : witness.c_str(), "--witness");
    if (info.gaac) cfg.gaac_calibration = engine::self_calibrated_gaac(*m, info.element, cfg.block_tokens, threads);
    if (cfg.kv_scheme == cache::KvScheme::kDither8)
      cfg.outlier_pair_table = engine::outlier_pairs_from_text(*m, cache::kDefaultOutlierPairs, cfg.block_tokens, threads);
    if (sparse_p > 0) {
      cfg.sparse.enabled = true;
      cfg.sparse.p = sparse_p;
    }
    std::unique_ptr<backend::Backend> be = backend::make_backend(*m, cfg);

    std::vector<cache::SeqId> seqs;
    std::vector<int32_t> next;  // each sequence's next input token
    if (pool_bytes > 0) {
      // Admit while the pool can hold a whole sequence: its context and every step.
      for (;;) {
        const cache::SeqId seq = be->create_sequence();
        if (!be->reserve(seq, max_c + steps + warmup + (stagger ? cfg.block_tokens : 0))) {
          be->free_sequence(seq);
          break;
        }
        seqs.push_back(seq);
      }
      if (seqs.empty()) fail(StatusCode::kOutOfMemory, "the pool admits no sequence of the context");
      bs = {int64_t(seqs.size())};
    } else {
      for (int64_t i = 0; i < max_b; ++i) seqs.push_back(be->create_sequence());
    }
    next.assign(seqs.size(), 0);
    const int64_t n_seqs = int64_t(seqs.size());
    std::vector<int32_t> input;
    for (const int64_t ctx : cs) {
      // Prefill every sequence up to ctx, one chunk of one sequence per step (as llama-batched-bench
      // prefills each sequence's prompt).
      const clock_type::time_point t0 = clock_type::now();
      int64_t prefilled = 0;
      for (int64_t i = 0; i < n_seqs; ++i) {
        const int64_t target = ctx + (stagger ? i % cfg.block_tokens : 0);
        while (be->length(seqs[size_t(i)]) < target) {
          const int64_t at = be->length(seqs[size_t(i)]);
          const int64_t n = std::min<int64_t>(chunk, target - at);
          input.resize(size_t(n));
          for (int64_t t = 0; t < n; ++t) input[size_t(t)] = stream[size_t((i * 7919 + at + t) % int64_t(stream.size()))];
          backend::BatchItem it;
          it.seq = seqs[size_t(i)];
          it.tokens = input.data();
          it.n = n;
          it.end_of_input = at + n == target;
          it.token = it.end_of_input ? &next[size_t(i)] : nullptr;
          if (!be->reserve(it.seq, n)) fail(StatusCode::kOutOfMemory, "the pool cannot hold the prefill");
          be->forward({&it, 1});
          prefilled += n;
        }
      }
      const double prefill_s = seconds_since(t0);
      for (const int64_t b : bs) {
        std::vector<backend::BatchItem> items(static_cast<size_t>(b), backend::BatchItem{});
        std::vector<double> step_ms;
        int64_t len_sum = 0;
        backend::StepTimes before;
        for (int s = 0; s < warmup + steps; ++s) {
          if (s == warmup) before = be->step_times();
          for (int64_t i = 0; i < b; ++i) {
            backend::BatchItem& it = items[size_t(i)];
            it = backend::BatchItem{};
            it.seq = seqs[size_t(i)];
            it.tokens = &next[size_t(i)];
            it.n = 1;
            it.token = &next[size_t(i)];
            if (s >= warmup) len_sum += be->length(it.seq);
            if (!be->reserve(it.seq, 1)) fail(StatusCode::kOutOfMemory, "the pool cannot hold the decode");
          }
          const clock_type::time_point t = clock_type::now();
          be->forward(items);
          if (s >= warmup) step_ms.push_back(1e3 * seconds_since(t));
        }
        std::sort(step_ms.begin(), step_ms.end());
        const double median = step_ms[step_ms.size() / 2];
        // The timed steps' host time by phase (Backend::step_times), ms a step.
        const backend::StepTimes after = be->step_times();
        const double per_step = after.steps > before.steps ? 1e3 / double(after.steps - before.steps) : 0.0;
        char host[320];
        std::snprintf(host, sizeof(host),
                      "\"plan\": %.4f, \"enqueue\": %.4f, \"attention\": %.4f, \"wait\": %.4f, \"read_back\": %.4f, "
                      "\"meter\": %.4f",
                      per_step * (after.plan_seconds - before.plan_seconds),
                      per_step * (after.enqueue_seconds - before.enqueue_seconds),
                      per_step * (after.attention_seconds - before.attention_seconds),
                      per_step * (after.wait_seconds - before.wait_seconds),
                      per_step * (after.read_back_seconds - before.read_back_seconds),
                      per_step * (after.meter_seconds - before.meter_seconds));
        std::string bytes;
        for (const cache::StorageClassStats& c : be->memory_stats().by_class)
          bytes += std::string(bytes.empty() ? "" : ", ") + "\"" + format::storage_class_name(c.storage) +
                   "\": " + std::to_string(c.page_bytes_in_use);
        std::printf(
            "{\"engine\": \"certkv\", \"table\": \"%s\", \"pool_bytes\": %lld, \"sequences\": %lld, \"device\": \"%s\", \"kv\": \"%s\", \"witness\": \"%s\", \"sparse_p\": %g, \"defer_encode_results\": %s, \"metered\": %s, \"stagger\": %s, \"batch\": %lld, "
            "\"ctx\": %lld, \"ctx_decoded_mean\": %.1f, \"steps\": %d, \"step_ms\": %.4f, \"step_ms_min\": %.4f, "
            "\"step_ms_max\": %.4f, \"tok_per_s\": %.2f, \"prefill_tokens\": %lld, \"prefill_tok_per_s\": %.1f, "
            "\"sequences_held\": %lld, \"kv_bytes_in_use\": {%s}, \"host_ms\": {%s}}\n",
            pool_bytes > 0 ? "b" : "a", (long long)pool_bytes, (long long)b, device.c_str(), kv.c_str(),
            info.tier == cache::MeterTier::kA ? codec::witness_code_name(cfg.witness) : "none", sparse_p,
            defer_encode_results ? "true" : "false", meter && info.tier != cache::MeterTier::kNone ? "true" : "false", stagger ? "true" : "false", (long long)b, (long long)ctx, double(len_sum) / double(b * steps),
            steps, median, step_ms.front(), step_ms.back(), 1e3 * double(b) / median, (long long)prefilled,
            prefilled > 0 ? double(prefilled) / prefill_s : 0.0, (long long)n_seqs, bytes.c_str(), host);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {  // certkv::Error, and the corpus folder's filesystem errors
    std::fprintf(stderr, "certkv_backend_decode: %s\n", e.what());
    return 1;
  }
  return 0;
}
