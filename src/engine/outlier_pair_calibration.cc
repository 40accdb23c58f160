#include "engine/outlier_pair_calibration.h"

#include <algorithm>
#include <string>

#include "backend/session.h"
#include "codec/lossy_page.h"
#include "core/status.h"
#include "engine/gaac_self_calibration.h"

namespace certkv::engine {

std::shared_ptr<const std::vector<uint16_t>> outlier_pairs_from_text(const model::Model& model, int n_pairs,
                                                                      int block_tokens, int n_threads) {
  const model::ModelConfig& c = model.config();
  if (n_pairs < 1 || n_pairs > c.head_dim / 2)
    fail(StatusCode::kInvalidArgument, "outlier pairs " + std::to_string(n_pairs) + " must be in [1, head_dim / 2 = " +
                                           std::to_string(c.head_dim / 2) + "]");
  std::vector<int32_t> tokens = model.tokenizer().encode(gaac_calibration_text(), true, false);
  const int64_t n = std::min<int64_t>({int64_t(tokens.size()), kOutlierCalibrationTokens, c.context_length});
  tokens.resize(size_t(n));
  backend::BackendConfig bc;  // bf16 pages: the exact post-RoPE keys, rounded as every cache rounds them
  bc.context_tokens = n;
  bc.n_threads = n_threads;
  bc.block_tokens = block_tokens;
  backend::Session session(model, bc);
  session.prefill(tokens.data(), n, nullptr);
  const codec::RopePairing pairing = c.rope_layout == model::RopeLayout::kInterleaved
                                         ? codec::RopePairing::kInterleaved
                                         : codec::RopePairing::kHalfSplit;
  auto table = std::make_shared<std::vector<uint16_t>>(size_t(c.n_layers) * size_t(c.n_kv_heads) * size_t(n_pairs));
  std::vector<float> rows(size_t(n) * size_t(c.head_dim));
  for (int layer = 0; layer < c.n_layers; ++layer)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      session.kv_cache().read_token_range_ref(session.sequence(), layer, cache::KvTensor::kKey, h, 0, n, rows.data());
      codec::select_outlier_pairs(rows.data(), int(n), c.head_dim, pairing, n_pairs,
                                  table->data() + (size_t(layer) * size_t(c.n_kv_heads) + size_t(h)) * size_t(n_pairs));
    }
  return table;
}

}  // namespace certkv::engine
