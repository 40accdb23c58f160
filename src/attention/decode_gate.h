// The gate of one metered decode step (docs/meter.md, "The gate"): while a query head's meter is
// above tau, the lossy blocks with the largest share of its A - 1 are repaired from the backing
// store (cache::KvCache::repair_block) and the step is attended again. One definition for every
// caller that owns a host cache: the CPU backend (and through it the device route, whose pages
// follow the host's repairs) and the C API's KV store.
#pragma once
#include <cstdint>
#include <functional>

#include "attention/decode_attention.h"
#include "cache/kv_cache.h"

namespace certkv::attention {

// Called for each block repaired: its kv head, its logical index, the bytes paged in (> 0).
using RepairedBlock = std::function<void(int kv_head, int64_t block, uint64_t bytes)>;

// The gate after a metered decode step of (seq, layer) over n_ctx positions whose meters are in
// meters[0 .. shape.n_q_heads). For each KV head with a query head above tau, ranks the blocks by
// their share of the firing heads' A - 1 (decode_meter_ref in double) and repairs them in that
// order until each firing head's A, less the shares repaired, predicts a meter at most tau; then
// calls attend(), which must attend the step again and rewrite meters. Repeats while a head stays
// above tau and a round repaired something, at most kGateRounds rounds.
// Returns the number of blocks repaired (each a K and a V page). Throws what repair_block throws
// (kOutOfMemory when no raw page is free); the blocks repaired before stay repaired.
inline constexpr int kGateRounds = 8;
int64_t gate_decode_step(cache::KvCache& cache, cache::SeqId seq, int layer, const AttentionShape& shape,
                         const float* q, int64_t n_ctx, const MeterOptions& meter, double tau,
                         const HeadMeter* meters, const std::function<void()>& attend,
                         const RepairedBlock& repaired);

}  // namespace certkv::attention
