// The meter of recent decode steps, kept for live views (the server dashboard's heatmap): a ring
// of the last `capacity` forward steps that metered at least one decode row. For each such step
// and each (layer, query head) it holds the largest meter over the step's metered sequences; an
// overflowed cell (log A = +inf, or a NaN or +inf meter) reads 1, as the request reports read it.
// A (layer, head) that no sequence metered in the step holds NaN.
//
// Cost: begin_step() is a counter update; record() a compare and a store into the current row,
// which is filled with NaN once, on the step's first recorded cell (n_layers x n_heads floats).
//
// Thread safety: none; the backend that owns it records from its forward thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace certkv::gate {

class RecentStepMeters {
 public:
  // capacity: steps kept (0: none, record() does nothing). Throws certkv::Error
  // kInvalidArgument for n_layers < 1, n_heads < 1 or capacity < 0.
  RecentStepMeters(int n_layers, int n_heads, int capacity);

  // A forward step begins; its number is the count of begin_step() calls so far (1-based).
  void begin_step() {
    ++step_;
    row_ = -1;
  }
  // One metered cell of the current step. REQUIRES: begin_step() called once before;
  // 0 <= layer < n_layers, 0 <= head < n_heads (unchecked: it runs on every cell).
  void record(int layer, int head, double meter, bool overflow) {
    if (capacity_ == 0) return;
    if (row_ < 0) open_row();
    const float value = overflow || !(meter <= 1.0) ? 1.0f : float(meter);
    float& cell = meters_[size_t(row_) * size_t(n_layers_ * n_heads_) + size_t(layer * n_heads_ + head)];
    if (!(cell >= value)) cell = value;  // NaN (no cell yet) or smaller
    ++cells_[size_t(row_)];
  }
  // `cells` metered cells of (layer, head) in the current step at once, meter the largest of them
  // (overflow: any overflowed): as many record() calls, one per cell. REQUIRES: as record(), and
  // cells >= 1.
  void record(int layer, int head, double meter, bool overflow, int64_t cells) {
    if (capacity_ == 0) return;
    record(layer, head, meter, overflow);
    cells_[size_t(row_)] += cells - 1;
  }

  int n_layers() const { return n_layers_; }
  int n_heads() const { return n_heads_; }
  int capacity() const { return capacity_; }
  int64_t steps_begun() const { return step_; }
  // Steps kept, at most capacity.
  int size() const { return size_; }

  // The i-th kept step, oldest first. REQUIRES: 0 <= i < size() (kOutOfRange otherwise).
  struct Step {
    int64_t step;          // its number (begin_step() count)
    int64_t cells;         // metered cells recorded in it, over every sequence
    const float* meters;   // [n_layers][n_heads]; NaN where none
  };
  Step step(int i) const;

 private:
  void open_row();

  int n_layers_, n_heads_, capacity_;
  int64_t step_ = 0;
  int row_ = -1;   // the current step's row, or -1 before its first cell
  int next_ = 0;   // the row the next opened step takes
  int size_ = 0;
  std::vector<float> meters_;     // [capacity][n_layers][n_heads]
  std::vector<int64_t> steps_;    // [capacity]
  std::vector<int64_t> cells_;    // [capacity]
};

}  // namespace certkv::gate
