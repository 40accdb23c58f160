// The C API's meter statistics from a telemetry (certkv_meter_stats), and its sparse statistics
// from a sequence's counters (certkv_sparse_stats), for the sessions and the stand-alone KV store
// alike.
#pragma once

#include "backend/backend.h"
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

// Every field but index_bytes and indexed_tokens (the caller's key indexes know them).
inline certkv_sparse_stats sparse_stats_of(double p, int window_tokens, int dense_layers, double deviations,
                                           const backend::SparseStats& st) {
  certkv_sparse_stats stats{};
  stats.sparse = 1;
  stats.p = p;
  stats.window_tokens = window_tokens;
  stats.dense_layers = dense_layers;
  stats.steps = st.steps;
  stats.cells = st.cells;
  // No sparse cell yet: every step attended every token.
  stats.mean_budget = st.cells > 0 ? st.sum_budget / double(st.cells) : 1;
  const int64_t all = st.cells + st.dense_cells;
  stats.mean_budget_all_layers = all > 0 ? (st.sum_budget + double(st.dense_cells)) / double(all) : 1;
  stats.index_build_seconds = st.index_build_seconds;
  stats.index_appended_tokens = st.index_appended_tokens;
  stats.deviations = deviations;
  stats.widened_fraction = st.context_tokens > 0 ? double(st.widened_tokens) / double(st.context_tokens) : 0;
  return stats;
}

}  // namespace certkv::api
