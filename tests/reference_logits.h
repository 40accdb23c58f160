// Reader of the golden reference-logit files (tests/golden/README.md, layout version 1) and the
// agreement figures of a forward pass against them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace certkv::testing {

struct ReferenceLogits {
  uint32_t n_vocab = 0;
  uint32_t n_tokens = 0;
  uint32_t top_k = 0;
  std::vector<int32_t> tokens;
  std::vector<int32_t> top_ids;      // [n_tokens][top_k]
  std::vector<float> top_logits;     // [n_tokens][top_k]
  std::vector<uint32_t> full_positions;
  std::vector<float> full_logits;    // [full_positions.size()][n_vocab]
};

// Throws std::runtime_error naming the file on any mismatch with the documented layout.
ReferenceLogits read_reference_logits(const std::string& path);

struct Agreement {
  double top1 = 0;              // fraction of positions whose argmax equals the reference's
  double top5_overlap = 0;      // mean |our top-5 ∩ reference top-5| / 5
  double topk_mean_abs = 0;     // mean |Δ logit| over the reference's top-k ids, all positions
  double topk_max_abs = 0;
  double full_rms_max = 0;      // worst per-position RMS Δ over full positions
  double full_max_abs = 0;      // max |Δ| over full vectors
  double full_mean_abs = 0;     // mean |Δ| over full vectors
  double kl_max = 0;            // max KL(reference || ours) over full positions
  std::string summary() const;
};

// logits: [n_tokens][n_vocab], row p after reading tokens 0..p.
Agreement compare_logits(const ReferenceLogits& ref, const std::vector<float>& logits);

}  // namespace certkv::testing
