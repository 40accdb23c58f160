// The C API's meter statistics from a telemetry (certkv_meter_stats), for the sessions and the
// stand-alone KV store alike.
#pragma once

#include "cache/kv_scheme.h"
#include "certkv/certkv.h"
#include "codec/lossy_page.h"
#include "gate/telemetry.h"

namespace certkv::api {

// Every field but exact_fallback_blocks (the caller's caches know it).
inline certkv_meter_stats meter_stats_of(const gate::Telemetry& t, cache::KvScheme scheme, bool metered,
                                         double delta_loc) {
  certkv_meter_stats stats{};
  stats.metered = metered ? 1 : 0;
  stats.tier = !metered ? "none" : codec::lossy_scheme_is_tier_b(cache::kv_scheme_lossy(scheme)) ? "B" : "A";
  stats.certified = t.tau() < 1 ? 1 : 0;
  stats.tau = t.tau();
  stats.delta_loc = delta_loc;
  stats.cells = t.cells();
  stats.coverage = t.coverage();
  stats.max = t.max();
  stats.p50 = t.p50();
  stats.p99 = t.p99();
  stats.overflow = t.overflow();
  stats.repairs = t.repairs();
  stats.pagein_bytes = uint64_t(t.pagein_bytes());
  return stats;
}

}  // namespace certkv::api
