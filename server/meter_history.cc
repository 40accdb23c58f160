#include "meter_history.h"

#include <cmath>
#include <string>

namespace certkv::server {

std::string MeterHistory::update(certkv_engine* engine) {
  if (capacity_ == 0) return "";
  size_t n = 0;
  int32_t n_layers = 0, n_heads = 0;
  if (const certkv_status st = certkv_engine_recent_meters(engine, last_step_, nullptr, nullptr, 0, &n, &n_layers,
                                                           &n_heads);
      st != CERTKV_OK && st != CERTKV_ERR_OUT_OF_RANGE)
    return certkv_last_error();
  if (n == 0) return "";
  if (n_layers != n_layers_ || n_heads != n_heads_)
    return "the engine's meters are " + std::to_string(n_layers) + " layers x " + std::to_string(n_heads) +
           " heads, the model's " + std::to_string(n_layers_) + " x " + std::to_string(n_heads_);
  const size_t cells_per_step = size_t(n_layers) * size_t(n_heads);
  step_buffer_.resize(n);
  meter_buffer_.resize(n * cells_per_step);
  if (const certkv_status st = certkv_engine_recent_meters(engine, last_step_, step_buffer_.data(),
                                                           meter_buffer_.data(), n, &n, nullptr, nullptr);
      st != CERTKV_OK)
    return certkv_last_error();
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < n; ++i) {
    const float* m = meter_buffer_.data() + i * cells_per_step;
    steps_.push_back(Step{step_buffer_[i].step, step_buffer_[i].cells, std::vector<float>(m, m + cells_per_step)});
    last_step_ = step_buffer_[i].step;
  }
  while (steps_.size() > size_t(capacity_)) steps_.pop_front();
  return "";
}

nlohmann::json MeterHistory::to_json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json steps = nlohmann::json::array();
  for (const Step& s : steps_) {
    nlohmann::json layers = nlohmann::json::array();
    for (int32_t l = 0; l < n_layers_; ++l) {
      nlohmann::json heads = nlohmann::json::array();
      for (int32_t h = 0; h < n_heads_; ++h) {
        const float m = s.meters[size_t(l) * size_t(n_heads_) + size_t(h)];
        if (std::isnan(m))
          heads.push_back(nullptr);
        else
          heads.push_back(double(m));
      }
      layers.push_back(std::move(heads));
    }
    steps.push_back({{"step", s.step}, {"cells", s.cells}, {"meters", std::move(layers)}});
  }
  return {{"n_layers", n_layers_}, {"n_heads", n_heads_}, {"steps", std::move(steps)}};
}

}  // namespace certkv::server
