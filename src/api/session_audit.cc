#include "api/session_audit.h"

#include <algorithm>
#include <map>

#include "attention/decode_attention.h"
#include "format/safetensors.h"

namespace certkv::api {

SessionAudit::SessionAudit(const backend::Session& session, double tau, int32_t dump_cells,
                           uint64_t seed)
    : session_(session), accumulator_(tau), dump_cells_(std::max(dump_cells, 0)), rng_(seed) {}

SessionAudit::KeptCell SessionAudit::keep(const backend::MeterObservation& o, int head,
                                          const eval::AuditCell& cell) const {
  const cache::KvCache& cache = session_.kv_cache();
  const model::ModelConfig& c = session_.model().config();
  const int d = c.head_dim;
  const int kv_head = head / (c.n_heads / c.n_kv_heads);
  KeptCell kept;
  kept.cell = cell;
  kept.scale = c.attention_scale();
  kept.q.assign(o.q + size_t(head) * size_t(d), o.q + size_t(head + 1) * size_t(d));
  kept.k.resize(size_t(o.n_ctx) * size_t(d));
  kept.k_hat.resize(size_t(o.n_ctx) * size_t(d));
  cache.read_token_range_exact(session_.sequence(), o.layer, cache::KvTensor::kKey, kv_head, 0,
                               o.n_ctx, kept.k.data());
  cache.read_token_range_ref(session_.sequence(), o.layer, cache::KvTensor::kKey, kv_head, 0,
                             o.n_ctx, kept.k_hat.data());
  return kept;
}

void SessionAudit::observe(const backend::MeterObservation& o) {
  const model::ModelConfig& c = session_.model().config();
  attention::AttentionShape shape;
  shape.n_q_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.scale = c.attention_scale();
  std::vector<double> tv(size_t(c.n_heads));
  attention::decode_true_tv_ref(session_.kv_cache(), session_.sequence(), o.layer, shape, o.q,
                                o.n_ctx, tv.data());
  for (int h = 0; h < c.n_heads; ++h) {
    eval::AuditCell cell;
    cell.layer = o.layer;
    cell.head = h;
    cell.step = o.step;
    cell.meter = o.meters[h].meter;
    cell.tv = std::min(tv[size_t(h)], 1.0);
    cell.overflow = std::isinf(o.meters[h].log_a);
    accumulator_.add(cell);
    if (dump_cells_ == 0) continue;
    if (!have_max_ || cell.tv > max_tv_.cell.tv) max_tv_ = keep(o, h, cell);
    if (!have_max_ || cell.meter > max_meter_.cell.meter) max_meter_ = keep(o, h, cell);
    have_max_ = true;
    // Reservoir sampling (Vitter's algorithm R): cell i is kept with probability n / i.
    ++seen_;
    if (int64_t(reservoir_.size()) < dump_cells_) {
      reservoir_.push_back(keep(o, h, cell));
    } else {
      const int64_t j = int64_t(rng_() % uint64_t(seen_));
      if (j < dump_cells_) reservoir_[size_t(j)] = keep(o, h, cell);
    }
  }
}

void SessionAudit::dump(const std::string& path, const std::string& scheme) const {
  std::vector<const KeptCell*> cells;
  if (have_max_) {
    cells.push_back(&max_tv_);
    cells.push_back(&max_meter_);
  }
  for (const KeptCell& k : reservoir_) cells.push_back(&k);
  const int d = session_.model().config().head_dim;
  std::vector<format::SafetensorsTensorView> views;
  std::map<std::string, std::string> metadata;
  metadata["scheme"] = scheme;
  metadata["cells"] = std::to_string(cells.size());
  std::vector<double> meters(cells.size());
  for (size_t i = 0; i < cells.size(); ++i) {
    const KeptCell& k = *cells[i];
    const std::string name = "cell" + std::to_string(i);
    const int64_t s = int64_t(k.k.size() / size_t(d));
    meters[i] = k.cell.meter;
    views.push_back({name + ".q", "F32", {d}, k.q.data(), k.q.size() * 4});
    views.push_back({name + ".k", "F32", {s, d}, k.k.data(), k.k.size() * 4});
    views.push_back({name + ".k_hat", "F32", {s, d}, k.k_hat.data(), k.k_hat.size() * 4});
    views.push_back({name + ".scale", "F32", {1}, &k.scale, 4});
    views.push_back({name + ".meter", "F64", {1}, &meters[i], 8});
    metadata[name + ".layer"] = std::to_string(k.cell.layer);
    metadata[name + ".head"] = std::to_string(k.cell.head);
    metadata[name + ".step"] = std::to_string(k.cell.step);
    metadata[name + ".tv"] = std::to_string(k.cell.tv);
  }
  format::write_safetensors(path, views, metadata);
}

}  // namespace certkv::api
