#include "api/session_sparse_audit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "core/status.h"
#include "format/safetensors.h"
#include "index/rabitq.h"
#include "index/top_p.h"

namespace certkv::api {

SessionSparseAudit::SessionSparseAudit(const backend::Session& session, int32_t dump_cells,
                                       uint64_t seed)
    : session_(session), dump_cells_(std::max(dump_cells, 0)), rng_(seed) {}

int SessionSparseAudit::add_rule(double p, double deviations) {
  if (seen_ > 0 || accumulator_.summary().cells > 0)
    fail(StatusCode::kInvalidArgument, "sparse audit: rules must be added before the first audited step");
  if (!(p > 0 && p <= 1)) fail(StatusCode::kInvalidArgument, "sparse audit rule: p must be in (0, 1], got " + std::to_string(p));
  if (!(std::isfinite(deviations) && deviations >= 0))
    fail(StatusCode::kInvalidArgument,
         "sparse audit rule: deviations must be finite and >= 0, got " + std::to_string(deviations));
  rules_.push_back({p, deviations});
  std::vector<std::string> names;
  for (const Rule& r : rules_) {
    char name[64];
    if (r.deviations > 0) snprintf(name, sizeof name, "p%gz%g", r.p, r.deviations);
    else snprintf(name, sizeof name, "p%g", r.p);
    names.push_back(name);
  }
  accumulator_ = eval::SparseAuditAccumulator(std::move(names));
  return int(rules_.size()) - 1;
}

void SessionSparseAudit::observe(const backend::SparseObservation& o) {
  const model::ModelConfig& c = session_.model().config();
  const cache::KeyIndex& index = *session_.key_index();
  const int d = c.head_dim;
  const int group = c.n_heads / c.n_kv_heads;
  const float scale = c.attention_scale();
  std::vector<float> k(size_t(o.n_ctx) * size_t(d));
  std::vector<float> error_scale(size_t(o.n_indexed));
  std::vector<std::vector<uint8_t>> masks(rules_.size(), std::vector<uint8_t>(size_t(o.n_indexed)));
  std::vector<const uint8_t*> mask_ptrs;
  for (const std::vector<uint8_t>& m : masks) mask_ptrs.push_back(m.data());
  for (int kv_head = 0; kv_head < c.n_kv_heads; ++kv_head) {
    session_.kv_cache().read_token_range_exact(session_.sequence(), o.layer, cache::KvTensor::kKey,
                                               kv_head, 0, o.n_ctx, k.data());
    const std::vector<float>& c_q = index.head(o.layer, kv_head).c_q();
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const float* qh = o.q + size_t(h) * size_t(d);
      double q_norm2 = 0;
      for (int i = 0; i < d; ++i) q_norm2 += (double(qh[i]) - c_q[size_t(i)]) * (double(qh[i]) - c_q[size_t(i)]);
      const double q_norm = std::sqrt(q_norm2);
      for (int64_t t = 0; t < o.n_indexed; ++t)
        error_scale[size_t(t)] = float(double(scale) * q_norm * index.key_norm_centered(o.layer, kv_head, t));
      const std::vector<int32_t>& attended = (*o.attended)[size_t(h)];
      const float* estimated = (*o.estimated_logits)[size_t(h)].data();
      for (size_t r = 0; r < rules_.size() && o.n_indexed > 0; ++r) {
        const index::TopPSelection sel = index::top_p_select(estimated, o.n_indexed, rules_[r].p, masks[r].data());
        if (rules_[r].deviations > 0) {
          int64_t stride = 0;
          const float* norms = index.key_norms(o.layer, kv_head, &stride);
          index::top_p_widen(estimated, o.n_indexed, sel.threshold,
                             index::rabitq_logit_deviation_scale(rules_[r].deviations, scale,
                                                                 (*o.query_norms)[size_t(h)], d),
                             norms, stride, masks[r].data());
        }
      }
      eval::SparseAuditCell cell;
      cell.layer = o.layer;
      cell.head = h;
      cell.step = o.step;
      cell.n_ctx = o.n_ctx;
      cell.n_indexed = o.n_indexed;
      cell.head_dim = d;
      cell.scale = scale;
      cell.block_tokens = session_.kv_cache().block_tokens();
      cell.q = qh;
      cell.k = k.data();
      cell.estimated_logits = estimated;
      cell.error_scale = error_scale.data();
      cell.attended = attended.data();
      cell.n_attended = int64_t(attended.size());
      cell.rule_masks = mask_ptrs.data();
      accumulator_.add(cell);
      if (dump_cells_ == 0) continue;
      // Reservoir sampling (Vitter's algorithm R): cell i is kept with probability n / i.
      ++seen_;
      int64_t slot = int64_t(reservoir_.size());
      if (slot >= dump_cells_) {
        slot = int64_t(rng_() % uint64_t(seen_));
        if (slot >= dump_cells_) continue;
      } else {
        reservoir_.emplace_back();
      }
      KeptCell& kept = reservoir_[size_t(slot)];
      kept.layer = o.layer;
      kept.head = h;
      kept.step = o.step;
      kept.n_indexed = o.n_indexed;
      kept.scale = scale;
      kept.q.assign(qh, qh + d);
      kept.k = k;
      kept.attended = attended;
      // Recall, in double, for the dump's metadata (a reader recomputes it from q, k, attended).
      std::vector<double> logit(static_cast<size_t>(o.n_ctx));
      double l_max = -INFINITY;
      for (int64_t t = 0; t < o.n_ctx; ++t) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += double(qh[i]) * k[size_t(t) * size_t(d) + size_t(i)];
        l_max = std::max(l_max, logit[size_t(t)] = double(scale) * dot);
      }
      double z = 0, mass = 0;
      for (double& l : logit) z += (l = std::exp(l - l_max));
      for (int32_t t : attended) mass += logit[size_t(t)];
      kept.recall = mass / z;
    }
  }
}

void SessionSparseAudit::dump(const std::string& path) const {
  const int d = session_.model().config().head_dim;
  std::vector<format::SafetensorsTensorView> views;
  std::map<std::string, std::string> metadata;
  metadata["cells"] = std::to_string(reservoir_.size());
  metadata["p"] = std::to_string(session_.config().sparse.p);
  for (size_t i = 0; i < reservoir_.size(); ++i) {
    const KeptCell& k = reservoir_[i];
    const std::string name = "cell" + std::to_string(i);
    const int64_t s = int64_t(k.k.size() / size_t(d));
    views.push_back({name + ".q", "F32", {d}, k.q.data(), k.q.size() * 4});
    views.push_back({name + ".k", "F32", {s, d}, k.k.data(), k.k.size() * 4});
    views.push_back({name + ".scale", "F32", {1}, &k.scale, 4});
    views.push_back({name + ".attended", "I32", {int64_t(k.attended.size())}, k.attended.data(),
                     k.attended.size() * 4});
    metadata[name + ".layer"] = std::to_string(k.layer);
    metadata[name + ".head"] = std::to_string(k.head);
    metadata[name + ".step"] = std::to_string(k.step);
    metadata[name + ".n_indexed"] = std::to_string(k.n_indexed);
    char recall[32];
    snprintf(recall, sizeof recall, "%.17g", k.recall);
    metadata[name + ".recall"] = recall;
  }
  format::write_safetensors(path, views, metadata);
}

}  // namespace certkv::api
