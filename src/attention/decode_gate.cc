#include "attention/decode_gate.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gate/meter.h"

namespace certkv::attention {

int64_t gate_decode_step(cache::KvCache& cache, cache::SeqId seq, int layer, const AttentionShape& shape,
                         const float* q, int64_t n_ctx, const MeterOptions& meter, double tau,
                         const HeadMeter* meters, const std::function<void()>& attend,
                         const RepairedBlock& repaired) {
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int64_t n_blocks = (n_ctx + cache.block_tokens() - 1) / cache.block_tokens();
  std::vector<double> contributions;  // [n_q_heads][n_blocks]: block j's share of head h's A - 1
  int64_t n_repaired = 0;
  for (int round = 0; round < kGateRounds; ++round) {
    bool firing = false;
    for (int h = 0; h < shape.n_q_heads; ++h) firing |= meters[h].meter > tau;
    if (!firing) break;
    std::vector<HeadMeter> ref(size_t(shape.n_q_heads));
    decode_meter_ref(cache, seq, layer, shape, q, n_ctx, meter, ref.data(), &contributions);
    bool repaired_any = false;
    for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
      std::vector<int> heads;
      std::vector<double> a_minus_1;
      for (int g = 0; g < group; ++g) {
        const int h = kv_head * group + g;
        if (meters[h].meter > tau) {
          heads.push_back(h);
          a_minus_1.push_back(std::expm1(ref[size_t(h)].log_a));
        }
      }
      if (heads.empty()) continue;
      std::vector<double> share(size_t(n_blocks), 0.0);
      for (int h : heads)
        for (int64_t b = 0; b < n_blocks; ++b)
          share[size_t(b)] += contributions[size_t(h) * size_t(n_blocks) + size_t(b)];
      std::vector<int64_t> order;
      for (int64_t b = 0; b < n_blocks; ++b)
        if (share[size_t(b)] > 0) order.push_back(b);
      std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return share[size_t(x)] > share[size_t(y)]; });
      auto predicted_over = [&] {
        for (double d : a_minus_1)
          if (gate::meter_from_log_a(std::log1p(std::max(d, 0.0))) > tau) return true;
        return false;
      };
      for (int64_t b : order) {
        if (!predicted_over()) break;
        const uint64_t bytes = cache.repair_block(seq, layer, kv_head, b);
        if (bytes == 0) continue;
        ++n_repaired;
        repaired_any = true;
        repaired(kv_head, b, bytes);
        for (size_t i = 0; i < heads.size(); ++i)
          a_minus_1[i] -= contributions[size_t(heads[i]) * size_t(n_blocks) + size_t(b)];
      }
    }
    if (!repaired_any) break;
    attend();
  }
  return n_repaired;
}

}  // namespace certkv::attention
