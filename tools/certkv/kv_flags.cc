#include "kv_flags.h"

#include "cache/kv_cache.h"
#include "cli_json.h"
#include "core/status.h"

namespace certkv::tools {

void KvFlags::apply(certkv_session_params& params) const {
  params.kv = kv.c_str();
  params.outlier_pairs = outlier_pairs;
  params.recent_window_tokens = window;
  params.meter = meter ? 1 : 0;
  params.meter_delta = delta;
  params.meter_tau = tau;
  params.gate = gate ? 1 : 0;
}

void add_kv_flag_spec(std::map<std::string, bool>& spec) {
  for (const char* name : {"kv", "gaac-calib", "outlier-pairs", "window", "delta", "tau"})
    spec[name] = true;
  spec["gate"] = false;
  spec["no-meter"] = false;
}

KvFlags parse_kv_flags(const Flags& flags, const std::string& kv) {
  KvFlags f;
  f.kv = kv;
  cache::KvScheme scheme;
  try {
    scheme = cache::parse_kv_scheme(kv);
  } catch (const Error& e) {
    throw UsageError{std::string("flag --kv: ") + e.what()};
  }
  f.gaac = cache::kv_scheme_is_gaac(scheme);
  f.lossy = cache::kv_scheme_is_lossy(scheme);
  const bool dither8 = scheme == cache::KvScheme::kDither8;
  if (flags.has("outlier-pairs") && !dither8)
    throw UsageError{"flag --outlier-pairs applies to --kv dither8 only, not --kv " + kv};
  f.outlier_pairs = int32_t(flags.integer("outlier-pairs", -1, 0, 128));
  if (flags.has("window") && !f.lossy)
    throw UsageError{"flag --window applies to lossy schemes only, not --kv " + kv};
  f.window = int32_t(flags.integer("window", -1, 0, 1 << 20));
  for (const char* name : {"delta", "tau", "gate", "no-meter"})
    if (flags.has(name) && !f.lossy)
      throw UsageError{std::string("flag --") + name + " applies to lossy schemes (the meter) only, not --kv " + kv};
  if (flags.has("delta")) {
    const double d = flags.real("delta", 1e-2, 0.0, 1.0);
    if (!(d > 0 && d < 1)) throw UsageError{"flag --delta: must be in (0, 1), got " + flags.str("delta")};
    f.delta = d;
  }
  if (flags.has("tau")) {
    const double t = flags.real("tau", 0.2, 0.0, 1e300);
    if (!(t > 0)) throw UsageError{"flag --tau: must be positive, got " + flags.str("tau")};
    f.tau = t;
  }
  f.gate = flags.has("gate");
  f.meter = !flags.has("no-meter");
  if (f.gate && !f.meter) throw UsageError{"flag --gate needs the meter (drop --no-meter)"};
  return f;
}

std::string meter_json(const certkv_meter_stats& m) {
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
  return o.str();
}

}  // namespace certkv::tools
