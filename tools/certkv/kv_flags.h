// The KV-scheme and meter flags (rows of the option table) shared by `certkv run`, `certkv eval` and `certkv audit`:
//   --kv SCHEME  --gaac-calib FILE  --outlier-pairs M  --window N  --delta D  --tau T  --gate
//   --no-meter  --sparse p=P[,deviations=Z][,window=N][,dense=L][,rotation=haar|hadamard]
#pragma once

#include <string>

#include "certkv/certkv.h"
#include "cli_json.h"
#include "options.h"

namespace certkv::tools {

struct KvFlags {
  std::string kv;
  bool gaac = false;   // a GAAC scheme (--gaac-calib, or the model calibrates itself)
  bool lossy = false;  // a lossy scheme (has the meter)
  bool tier_a = false; // a lossy scheme with a Tier A witness (every lossy scheme but dither8)
  int32_t outlier_pairs = -1;
  int32_t window = -1;
  std::string witness;  // --witness fp16|u8 (Tier A schemes); empty: the default (fp16)
  double delta = 1e-2;
  double tau = 0.2;
  bool gate = false;
  bool meter = true;
  // --sparse (sparse_p 0: dense decode).
  double sparse_p = 0;
  double sparse_deviations = 0;  // the Top-p set widened per token (certkv_session_params)
  int32_t sparse_window = -1;
  int32_t sparse_dense_layers = -1;
  std::string sparse_rotation;  // empty: the default
  // "fp16" or "u8" for a Tier A lossy scheme (the witness its K pages keep), "" otherwise.
  std::string witness_label() const;
  // Copies the scheme and meter settings into params (kv points into this object).
  void apply(certkv_session_params& params) const;
};

// The scheme table through the C API: the entry named `name` (false when there is none); the
// names of the entries `pick` accepts (all when null), comma-separated; the help lines of every
// scheme (name, summary, [cuda] where the device route serves it).
bool find_kv_scheme(const std::string& name, certkv_kv_scheme_info* info);
std::string kv_scheme_list(bool (*pick)(const certkv_kv_scheme_info&) = nullptr);
std::string kv_scheme_help();

// Validates the flags against the scheme: unknown scheme, tau <= 0, delta outside (0, 1), m out
// of range, --gate or meter flags with a scheme that has no meter: UsageError naming the flag.
KvFlags parse_kv_flags(const Flags& flags, const std::string& kv);

// {"tier": ..., "certified": ..., "tau": ..., "coverage": ..., "max": ..., "p50": ..., "p99": ...,
//  "cells": ..., "overflow": ..., "repairs": ..., "pagein_bytes": ..., ...}
JsonObject meter_json(const certkv_meter_stats& m);
// {"p": ..., "window": ..., "dense_layers": ..., "mean_budget": ..., "index_bytes": ..., ...}
JsonObject sparse_json(const certkv_sparse_stats& s);

}  // namespace certkv::tools
