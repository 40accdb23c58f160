// dither8's outlier RoPE pairs fixed for the model. A dither8 cache chooses, per (layer,
// kv_head), the m RoPE pairs of K it keeps exact from the first rows written to it
// (codec::select_outlier_pairs); in a pool shared by many sequences those rows are whichever
// sequence wrote first, so a sequence's pages, and its logits, would depend on the others. The
// engine instead fixes the pairs once per model, with the same rule, from the post-RoPE K of the
// first kOutlierCalibrationTokens tokens of the built-in calibration text
// (engine/gaac_self_calibration.h), so that dither8 is batch invariant.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/model.h"

namespace certkv::engine {

inline constexpr int kOutlierCalibrationTokens = 256;

// [n_layers][n_kv_heads][n_pairs] pair indices (each head's increasing). REQUIRES: 0 < n_pairs
// <= head_dim / 2 (certkv::Error kInvalidArgument). Throws as the forward pass does.
std::shared_ptr<const std::vector<uint16_t>> outlier_pairs_from_text(const model::Model& model, int n_pairs,
                                                                      int block_tokens, int n_threads);

}  // namespace certkv::engine
