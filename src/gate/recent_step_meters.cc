#include "gate/recent_step_meters.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/status.h"

namespace certkv::gate {

RecentStepMeters::RecentStepMeters(int n_layers, int n_heads, int capacity)
    : n_layers_(n_layers), n_heads_(n_heads), capacity_(capacity) {
  if (n_layers < 1 || n_heads < 1 || capacity < 0)
    fail(StatusCode::kInvalidArgument, "recent step meters: need n_layers >= 1, n_heads >= 1 and capacity >= 0, got " +
                                           std::to_string(n_layers) + ", " + std::to_string(n_heads) + ", " +
                                           std::to_string(capacity));
  meters_.resize(size_t(capacity) * size_t(n_layers) * size_t(n_heads));
  steps_.resize(size_t(capacity));
  cells_.resize(size_t(capacity));
}

void RecentStepMeters::open_row() {
  row_ = next_;
  next_ = (next_ + 1) % capacity_;
  if (size_ < capacity_) ++size_;
  const size_t cells_per_step = size_t(n_layers_) * size_t(n_heads_);
  std::fill_n(meters_.begin() + std::ptrdiff_t(size_t(row_) * cells_per_step), cells_per_step,
              std::numeric_limits<float>::quiet_NaN());
  steps_[size_t(row_)] = step_;
  cells_[size_t(row_)] = 0;
}

RecentStepMeters::Step RecentStepMeters::step(int i) const {
  if (i < 0 || i >= size_)
    fail(StatusCode::kOutOfRange, "recent step meters: step " + std::to_string(i) + " of " + std::to_string(size_));
  const int oldest = size_ < capacity_ ? 0 : next_;
  const size_t row = size_t((oldest + i) % capacity_);
  return Step{steps_[row], cells_[row], &meters_[row * size_t(n_layers_) * size_t(n_heads_)]};
}

}  // namespace certkv::gate
