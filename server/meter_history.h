// The meter of the engine's recent decode steps, per (layer, query head), as the dashboard's
// heatmap shows it (GET /dashboard/state). The scheduler thread copies new steps out of the
// engine (certkv_engine_recent_meters) after each step that added one; handler threads read a
// JSON copy. Thread safe.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "certkv/certkv.h"

namespace certkv::server {

class MeterHistory {
 public:
  // capacity: steps kept, the engine's meter_recent_steps; n_layers x n_heads: the model's layers
  // and query heads. REQUIRES: capacity >= 0.
  MeterHistory(int capacity, int32_t n_layers, int32_t n_heads)
      : capacity_(capacity), n_layers_(n_layers), n_heads_(n_heads) {}

  // The scheduler thread, after a step: copies the steps the engine added since the last call.
  // Returns "" or the C API's error.
  std::string update(certkv_engine* engine);

  // {"n_layers", "n_heads", "steps": [{"step", "cells", "meters": [layer][head] (null: no cell)}]},
  // oldest step first.
  nlohmann::json to_json() const;

 private:
  struct Step {
    int64_t step;
    int64_t cells;
    std::vector<float> meters;  // [n_layers][n_heads], NaN: no cell
  };

  const int capacity_;
  const int32_t n_layers_, n_heads_;
  mutable std::mutex mutex_;
  int64_t last_step_ = 0;  // the newest step copied
  std::deque<Step> steps_;
  // The scheduler thread's buffers.
  std::vector<certkv_meter_step> step_buffer_;
  std::vector<float> meter_buffer_;
};

}  // namespace certkv::server
