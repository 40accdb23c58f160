#include "kv_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "cli_json.h"

namespace certkv::tools {

bool find_kv_scheme(const std::string& name, certkv_kv_scheme_info* info) {
  for (int32_t i = 0; i < certkv_kv_scheme_count(); ++i) {
    certkv_kv_scheme_info s;
    if (certkv_kv_scheme_get(i, &s) == CERTKV_OK && name == s.name) {
      *info = s;
      return true;
    }
  }
  return false;
}

std::string kv_scheme_list(bool (*pick)(const certkv_kv_scheme_info&)) {
  std::string out;
  for (int32_t i = 0; i < certkv_kv_scheme_count(); ++i) {
    certkv_kv_scheme_info s;
    if (certkv_kv_scheme_get(i, &s) != CERTKV_OK || (pick && !pick(s))) continue;
    out += (out.empty() ? "" : ", ") + std::string(s.name);
  }
  return out;
}

std::string kv_scheme_help() {
  std::string out = "SCHEME (--kv):\n";
  for (int32_t i = 0; i < certkv_kv_scheme_count(); ++i) {
    certkv_kv_scheme_info s;
    if (certkv_kv_scheme_get(i, &s) != CERTKV_OK) continue;
    std::string name = "  " + std::string(s.name);
    name.resize(std::max<size_t>(name.size() + 1, 20), ' ');
    out += name + s.summary;
    if (s.cuda_route) out += " [cuda]";
    out += "\n";
  }
  return out;
}

std::string KvFlags::witness_label() const {
  if (!tier_a) return "";
  return witness.empty() ? "fp16" : witness;
}

void KvFlags::apply(certkv_session_params& params) const {
  params.kv = kv.c_str();
  params.outlier_pairs = outlier_pairs;
  params.recent_window_tokens = window;
  params.witness = witness.empty() ? nullptr : witness.c_str();
  params.meter = meter ? 1 : 0;
  params.meter_delta = delta;
  params.meter_tau = tau;
  params.gate = gate ? 1 : 0;
  params.sparse_p = sparse_p;
  params.sparse_window = sparse_window;
  params.sparse_dense_layers = sparse_dense_layers;
  params.sparse_rotation = sparse_rotation.empty() ? nullptr : sparse_rotation.c_str();
  params.sparse_deviations = sparse_deviations;
}

namespace {

// --sparse p=0.9,deviations=1.5,window=128,dense=2,rotation=haar (or a bare p: --sparse 0.9).
void parse_sparse(const std::string& spec, KvFlags& f) {
  auto bad = [&](const std::string& why) {
    throw UsageError{"flag --sparse '" + spec + "': " + why +
                     " (expected p=P[,deviations=Z][,window=N][,dense=L][,rotation=haar|hadamard])"};
  };
  auto number = [&](const std::string& key, const std::string& text) {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size()) bad(key + " '" + text + "' is not a number");
    return v;
  };
  auto integer = [&](const std::string& key, const std::string& text, long long lo, long long hi) {
    const double v = number(key, text);
    if (v != std::floor(v) || v < double(lo) || v > double(hi))
      bad(key + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return int32_t(v);
  };
  f.sparse_p = -1;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = item.find('=');
    const std::string key = eq == std::string::npos ? "p" : item.substr(0, eq);
    const std::string value = eq == std::string::npos ? item : item.substr(eq + 1);
    if (key == "p") {
      f.sparse_p = number("p", value);
      if (!(f.sparse_p > 0 && f.sparse_p <= 1)) bad("p must be in (0, 1], got " + value);
    } else if (key == "deviations") {
      f.sparse_deviations = number("deviations", value);
      if (!(f.sparse_deviations >= 0) || !std::isfinite(f.sparse_deviations))
        bad("deviations must be finite and >= 0, got " + value);
    } else if (key == "window") {
      f.sparse_window = integer("window", value, 0, 1 << 30);
    } else if (key == "dense") {
      f.sparse_dense_layers = integer("dense", value, 0, 1 << 16);
    } else if (key == "rotation") {
      if (value != "haar" && value != "hadamard") bad("rotation must be haar or hadamard");
      f.sparse_rotation = value;
    } else {
      bad("unknown key '" + key + "'");
    }
  }
  if (f.sparse_p < 0) bad("p is missing");
}

}  // namespace

KvFlags parse_kv_flags(const Flags& flags, const std::string& kv) {
  KvFlags f;
  f.kv = kv;
  certkv_kv_scheme_info scheme{};
  if (!find_kv_scheme(kv, &scheme))
    throw UsageError{"flag --kv: unknown KV scheme '" + kv + "' (available: " + kv_scheme_list() + ")"};
  f.gaac = scheme.needs_calibration != 0;
  f.lossy = scheme.lossy != 0;
  const std::string tier = scheme.meter_tier;
  const bool dither8 = tier == "B";
  f.tier_a = tier == "A";
  if (flags.has("outlier-pairs") && !dither8)
    throw UsageError{"flag --outlier-pairs applies to the Tier B scheme (dither8) only, not --kv " + kv};
  if (flags.has("outlier-pairs")) f.outlier_pairs = int32_t(flags.integer("outlier-pairs", 0, 128));
  if (flags.has("window") && !f.lossy)
    throw UsageError{"flag --window applies to lossy schemes only, not --kv " + kv};
  if (flags.has("window")) f.window = int32_t(flags.integer("window", 0, 1 << 20));
  if (flags.has("witness")) {
    if (!f.tier_a)
      throw UsageError{"flag --witness applies to the Tier A lossy schemes (" +
                       kv_scheme_list([](const certkv_kv_scheme_info& s) { return std::string(s.meter_tier) == "A"; }) +
                       "), not --kv " + kv};
    f.witness = flags.str("witness");  // its name and its scheme checked once, by the C API
  }
  for (const char* name : {"delta", "tau", "gate", "no-meter"})
    if (flags.has(name) && !f.lossy)
      throw UsageError{std::string("flag --") + name + " applies to lossy schemes (the meter) only, not --kv " + kv};
  if (flags.has("delta")) {
    const double d = flags.real("delta", 0.0, 1.0);
    if (!(d > 0 && d < 1)) throw UsageError{"flag --delta: must be in (0, 1), got " + flags.str("delta")};
    f.delta = d;
  }
  if (flags.has("tau")) {
    const double t = flags.real("tau", 0.0, 1e300);
    if (!(t > 0)) throw UsageError{"flag --tau: must be positive, got " + flags.str("tau")};
    f.tau = t;
  }
  f.gate = flags.has("gate");
  f.meter = !flags.has("no-meter");
  if (f.gate && !f.meter) throw UsageError{"flag --gate needs the meter (drop --no-meter)"};
  if (flags.has("sparse")) parse_sparse(flags.str("sparse"), f);
  if (f.gate && f.sparse_p > 0)
    throw UsageError{"flags --gate and --sparse do not combine yet (the meter does: drop --gate)"};
  return f;
}

JsonObject meter_json(const certkv_meter_stats& m) {
  JsonObject o;
  o.add("tier", m.tier)
      .add("certified", m.certified != 0)
      .add("tau", m.tau)
      .add("delta_loc", m.delta_loc)
      .add("cells", m.cells)
      .add("coverage", m.coverage)
      .add("max", m.max)
      .add("p50", m.p50)
      .add("p99", m.p99)
      .add("overflow", m.overflow)
      .add("repairs", m.repairs)
      .add("pagein_bytes", m.pagein_bytes)
      .add("exact_fallback_blocks", m.exact_fallback_blocks);
  if (m.tier[0] == 'B') o.add("note", "Tier B is valid for non-adaptive queries (teacher-forced text)");
  return o;
}

}  // namespace certkv::tools

namespace certkv::tools {

JsonObject sparse_json(const certkv_sparse_stats& s) {
  JsonObject o;
  o.add("p", s.p)
      .add("deviations", s.deviations)
      .add("widened_fraction", s.widened_fraction)
      .add("window", int64_t(s.window_tokens))
      .add("dense_layers", int64_t(s.dense_layers))
      .add("steps", s.steps)
      .add("cells", s.cells)
      .add("mean_budget", s.mean_budget)
      .add("mean_budget_all_layers", s.mean_budget_all_layers)
      .add("index_bytes", s.index_bytes)
      .add("indexed_tokens", s.indexed_tokens)
      .add("index_build_seconds", s.index_build_seconds)
      .add("index_build_us_per_token",
           s.index_appended_tokens > 0 ? 1e6 * s.index_build_seconds / double(s.index_appended_tokens) : 0.0);
  return o;
}

}  // namespace certkv::tools
