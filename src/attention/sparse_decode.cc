#include "attention/sparse_decode.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "attention/online_softmax.h"
#include "attention/work_queue.h"
#include "core/status.h"
#include "gate/meter.h"
#include "index/top_p.h"

namespace certkv::attention {

namespace {

using cache::KvTensor;

// Rows gathered per query head before one online-softmax update.
constexpr int kGatherRows = 64;

// Checks the arguments shared by the production path and the reference; returns n_indexed.
int64_t validate_sparse(const char* entry, const cache::KvCache& cache, cache::SeqId seq, int layer,
                        const AttentionShape& shape, const float* q, int64_t n_ctx,
                        const cache::KeyIndex& index, const SparseDecodeOptions& options,
                        const void* out) {
  validate_decode(entry, cache, seq, layer, shape, q, n_ctx, out);
  if (!(options.p > 0 && options.p <= 1))
    fail(StatusCode::kInvalidArgument,
         std::string(entry) + ": p " + std::to_string(options.p) + " is outside (0, 1]");
  if (!(options.deviations >= 0) || !std::isfinite(options.deviations))
    fail(StatusCode::kInvalidArgument, std::string(entry) + ": deviations " +
                                           std::to_string(options.deviations) +
                                           " must be finite and >= 0");
  const cache::KeyIndexConfig& ic = index.config();
  if (ic.n_layers != cache.config().n_layers || ic.n_kv_heads != shape.n_kv_heads ||
      ic.head_dim != shape.head_dim)
    fail(StatusCode::kInvalidArgument,
         std::string(entry) + ": the key index's shape (" + std::to_string(ic.n_layers) +
             " layers, " + std::to_string(ic.n_kv_heads) + " kv heads, head_dim " +
             std::to_string(ic.head_dim) + ") does not match the cache");
  const int64_t n_indexed = index.indexed_tokens(layer, 0);
  for (int h = 1; h < shape.n_kv_heads; ++h)
    if (index.indexed_tokens(layer, h) != n_indexed)
      fail(StatusCode::kInvalidArgument, std::string(entry) + ": kv heads of layer " +
                                             std::to_string(layer) +
                                             " are indexed to different lengths");
  if (n_indexed > n_ctx || n_indexed % cache.block_tokens() != 0)
    fail(StatusCode::kInvalidArgument,
         std::string(entry) + ": the indexed prefix (" + std::to_string(n_indexed) +
             " tokens) must be whole blocks of " + std::to_string(cache.block_tokens()) +
             " and at most n_ctx " + std::to_string(n_ctx));
  return n_indexed;
}


// Estimated logits of head h's indexed prefix and its Top-p selection (ascending indices).
void select_head(const cache::KeyIndex& index, int layer, int kv_head, int head, const float* q,
                 float scale, int64_t n_indexed, const SparseDecodeOptions& options, bool reference,
                 std::vector<float>& logits, std::vector<int32_t>& selected, SparseHeadStats& st) {
  st = SparseHeadStats{};
  st.n_indexed = n_indexed;
  logits.resize(size_t(n_indexed));
  selected.clear();
  if (n_indexed == 0) return;
  float norm_q_centered = 0;
  index.estimate_scores(layer, kv_head, q, sparse_head_rounding_seed(options.rounding_seed, head),
                        logits.data(), &norm_q_centered);
  for (float& l : logits) l *= scale;
  thread_local std::vector<uint8_t> mask;
  mask.resize(size_t(n_indexed));
  const index::TopPSelection sel =
      reference ? index::top_p_select_ref(logits.data(), n_indexed, options.p, mask.data())
                : index::top_p_select(logits.data(), n_indexed, options.p, mask.data());
  if (options.deviations > 0) {
    int64_t stride = 0;
    const float* norms = index.key_norms(layer, kv_head, &stride);
    st.n_widened = index::top_p_widen(
        logits.data(), n_indexed, sel.threshold,
        index::rabitq_logit_deviation_scale(options.deviations, scale, norm_q_centered, index.config().head_dim),
        norms, stride, mask.data());
  }
  selected.reserve(size_t(sel.n_selected + st.n_widened));
  for (int64_t t = 0; t < n_indexed; ++t)
    if (mask[size_t(t)]) selected.push_back(int32_t(t));
  st.n_selected = sel.n_selected + st.n_widened;
  st.estimated_mass = sel.mass;
  st.boundary_tokens = sel.n_boundary;
  st.norm_q_centered = norm_q_centered;
}

// The rows one query head gathers before an online-softmax update.
struct Gather {
  std::vector<float> k, v, c, rho;
  int n = 0;
};

}  // namespace

void sparse_decode_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                             const AttentionShape& shape, const float* q, int64_t n_ctx,
                             const cache::KeyIndex& index, const SparseDecodeOptions& options,
                             float* out, SparseHeadStats* stats, ThreadPool* pool) {
  const int64_t n_indexed =
      validate_sparse("sparse_decode_attention", cache, seq, layer, shape, q, n_ctx, index,
                      options, out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int bt = cache.block_tokens();

  // Phase 1, per query head: estimate, select.
  std::vector<std::vector<int32_t>> selected(size_t(shape.n_q_heads));
  std::vector<std::vector<float>> logits(size_t(shape.n_q_heads));
  std::vector<SparseHeadStats> head_stats(size_t(shape.n_q_heads));
  detail::run_units(pool, shape.n_q_heads, [&](int64_t h, int) {
    select_head(index, layer, int(h) / group, int(h), q + size_t(h) * size_t(d), shape.scale,
                n_indexed, options, false, logits[size_t(h)], selected[size_t(h)],
                head_stats[size_t(h)]);
  });

  std::vector<detail::TableReader> k_tables, v_tables;
  for (int h = 0; h < shape.n_kv_heads; ++h) {
    k_tables.push_back(detail::table_reader(cache, seq, layer, KvTensor::kKey, h));
    v_tables.push_back(detail::table_reader(cache, seq, layer, KvTensor::kValue, h));
  }
  const bool metered = options.meters != nullptr && k_tables[0].lossy.has_value();
  if (metered && codec::lossy_scheme_is_tier_b(k_tables[0].lossy->scheme) &&
      !(options.meter.delta_loc > 0 && options.meter.delta_loc < 1))
    fail(StatusCode::kInvalidArgument, "sparse_decode_attention: meter.delta_loc " +
                                           std::to_string(options.meter.delta_loc) +
                                           " is outside (0, 1)");
  const int bound_width = metered ? detail::key_bound_width(*k_tables[0].lossy) : 0;

  // Phase 2, per kv head: the selected rows of every head of the group, block by block (a block
  // that is not raw bf16 is reconstructed once for the group), then the window for all heads.
  std::vector<detail::RowState> states(size_t(shape.n_q_heads));
  std::vector<detail::MeterRow> meter_rows(size_t(shape.n_q_heads));
  detail::run_units(pool, shape.n_kv_heads, [&](int64_t unit, int) {
    const int kv_head = int(unit);
    const detail::TableReader& kr = k_tables[size_t(kv_head)];
    const detail::TableReader& vr = v_tables[size_t(kv_head)];
    const size_t tile = size_t(bt);
    thread_local std::vector<float> block;
    block.resize(2 * tile * size_t(d) + tile + tile * size_t(bound_width) + 2 * tile);
    float* k_block = block.data();
    float* v_block = k_block + tile * size_t(d);
    float* s = v_block + tile * size_t(d);
    float* bounds = s + tile;                          // [bound_width][tile], band-major
    float* rho = bounds + tile * size_t(bound_width);  // [tile]
    float* c = rho + tile;                             // [tile]
    thread_local std::vector<Gather> gathers;
    thread_local std::vector<float> gather_s;
    gathers.resize(size_t(group));
    gather_s.resize(std::max<size_t>(kGatherRows, tile));
    thread_local std::vector<detail::QueryBoundWeights> weights;
    weights.resize(size_t(group));
    std::vector<size_t> cursor(size_t(group), 0);
    const int first = kv_head * group;
    for (int g = 0; g < group; ++g) {
      Gather& ga = gathers[size_t(g)];
      ga.k.resize(size_t(kGatherRows) * size_t(d));
      ga.v.resize(size_t(kGatherRows) * size_t(d));
      ga.c.assign(size_t(kGatherRows), 0.f);
      ga.rho.assign(size_t(kGatherRows), 0.f);
      ga.n = 0;
      states[size_t(first + g)] = {detail::kMinusInfinity, 0.f};
      meter_rows[size_t(first + g)] = {0.0, 0.f};
      std::fill(out + size_t(first + g) * size_t(d), out + size_t(first + g + 1) * size_t(d), 0.f);
      if (metered)
        weights[size_t(g)] = detail::query_bound_weights(
            *kr.lossy, q + size_t(first + g) * size_t(d), shape.scale, n_ctx,
            options.meter.delta_loc);
    }
    auto flush = [&](int g) {
      Gather& ga = gathers[size_t(g)];
      if (ga.n == 0) return;
      const int h = first + g;
      float* acc = out + size_t(h) * size_t(d);
      if (metered)
        detail::update_row_metered(q + size_t(h) * size_t(d), ga.k.data(), ga.v.data(), ga.n, d,
                                   shape.scale, ga.c.data(), ga.rho.data(), &states[size_t(h)],
                                   &meter_rows[size_t(h)], acc, gather_s.data());
      else
        detail::update_row(q + size_t(h) * size_t(d), ga.k.data(), ga.v.data(), ga.n, d,
                           shape.scale, &states[size_t(h)], acc, gather_s.data());
      ga.n = 0;
    };

    const int64_t n_index_blocks = n_indexed / bt;
    for (int64_t b = 0; b < n_index_blocks; ++b) {
      const int64_t t0 = b * bt, t1 = t0 + bt;
      bool any = false;
      for (int g = 0; g < group; ++g) {
        const std::vector<int32_t>& sel = selected[size_t(first + g)];
        any |= cursor[size_t(g)] < sel.size() && sel[cursor[size_t(g)]] < t1;
      }
      if (!any) continue;
      const format::PageRef kref = kr.table[b], vref = vr.table[b];
      const bool raw = kref.storage == format::StorageClass::kBf16 &&
                       vref.storage == format::StorageClass::kBf16;
      if (!raw) {
        detail::load_tile(kr, t0, t1, k_block);
        detail::load_tile(vr, t0, t1, v_block);
        if (metered) {
          detail::load_error_data(kr, t0, t1, bounds, tile);
          detail::load_error_data(vr, t0, t1, rho, tile);
        }
      }
      for (int g = 0; g < group; ++g) {
        const std::vector<int32_t>& sel = selected[size_t(first + g)];
        size_t& at = cursor[size_t(g)];
        if (at >= sel.size() || sel[at] >= t1) continue;
        if (metered && !raw) detail::logit_bounds(weights[size_t(g)], bounds, tile, bt, c);
        Gather& ga = gathers[size_t(g)];
        for (; at < sel.size() && sel[at] < t1; ++at) {
          const int row = int(sel[at] - t0);
          float* kd = ga.k.data() + size_t(ga.n) * size_t(d);
          float* vd = ga.v.data() + size_t(ga.n) * size_t(d);
          if (raw) {
            detail::bf16_to_float_rows(cache.page_bf16(kref) + size_t(row) * size_t(d), kd, size_t(d));
            detail::bf16_to_float_rows(cache.page_bf16(vref) + size_t(row) * size_t(d), vd, size_t(d));
            ga.c[size_t(ga.n)] = 0.f;
            ga.rho[size_t(ga.n)] = 0.f;
          } else {
            std::copy_n(k_block + size_t(row) * size_t(d), d, kd);
            std::copy_n(v_block + size_t(row) * size_t(d), d, vd);
            ga.c[size_t(ga.n)] = metered ? c[row] : 0.f;
            ga.rho[size_t(ga.n)] = metered ? rho[row] : 0.f;
          }
          if (++ga.n == kGatherRows) flush(g);
        }
      }
    }
    for (int g = 0; g < group; ++g) flush(g);

    // The window [n_indexed, n_ctx), every head, one page per tile.
    for (int64_t t0 = n_indexed; t0 < n_ctx; t0 += bt) {
      const int64_t t1 = std::min<int64_t>(n_ctx, t0 + bt);
      const int n_keys = int(t1 - t0);
      detail::load_tile(kr, t0, t1, k_block);
      detail::load_tile(vr, t0, t1, v_block);
      if (metered) {
        detail::load_error_data(kr, t0, t1, bounds, tile);
        detail::load_error_data(vr, t0, t1, rho, tile);
      }
      for (int g = 0; g < group; ++g) {
        const int h = first + g;
        float* acc = out + size_t(h) * size_t(d);
        if (metered) {
          detail::logit_bounds(weights[size_t(g)], bounds, tile, n_keys, c);
          detail::update_row_metered(q + size_t(h) * size_t(d), k_block, v_block, n_keys, d,
                                     shape.scale, c, rho, &states[size_t(h)],
                                     &meter_rows[size_t(h)], acc, s);
        } else {
          detail::update_row(q + size_t(h) * size_t(d), k_block, v_block, n_keys, d, shape.scale,
                             &states[size_t(h)], acc, s);
        }
      }
    }
  });

  for (int h = 0; h < shape.n_q_heads; ++h) {
    float* o = out + size_t(h) * size_t(d);
    const float inv_l = 1.f / states[size_t(h)].l;
    for (int c = 0; c < d; ++c) o[c] *= inv_l;
    SparseHeadStats& st = head_stats[size_t(h)];
    st.n_attended = st.n_selected + (n_ctx - n_indexed);
    if (options.meters != nullptr) {
      HeadMeter& hm = options.meters[size_t(h)];
      hm = HeadMeter{};
      if (metered) {
        // As decode_attention: A - 1 = D / l, lifted by 2^-16 for the float sums.
        const double lift = 1.0 + 1.0 / 65536.0;
        const double a_minus_1 = meter_rows[size_t(h)].d / double(states[size_t(h)].l) * lift;
        hm.log_a = std::isfinite(a_minus_1) ? std::log1p(a_minus_1) : INFINITY;
        hm.meter = gate::meter_from_log_a(hm.log_a);
        hm.value_rho = double(meter_rows[size_t(h)].rho) / double(states[size_t(h)].l) * lift;
        hm.v_norm_max = cache.value_norm_max(seq, layer, h / group);
        hm.output_bound = 2 * hm.meter * hm.v_norm_max + hm.value_rho;
      }
    }
    if (stats != nullptr) stats[h] = st;
  }
  if (options.attended != nullptr) {
    options.attended->assign(size_t(shape.n_q_heads), {});
    for (int h = 0; h < shape.n_q_heads; ++h) {
      std::vector<int32_t>& a = (*options.attended)[size_t(h)];
      a = std::move(selected[size_t(h)]);
      for (int64_t t = n_indexed; t < n_ctx; ++t) a.push_back(int32_t(t));
    }
  }
  if (options.estimated_logits != nullptr) *options.estimated_logits = std::move(logits);
  if (options.query_norms != nullptr) {
    options.query_norms->resize(size_t(shape.n_q_heads));
    for (int h = 0; h < shape.n_q_heads; ++h) (*options.query_norms)[size_t(h)] = head_stats[size_t(h)].norm_q_centered;
  }
}

void sparse_decode_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                                 const AttentionShape& shape, const float* q, int64_t n_ctx,
                                 const cache::KeyIndex& index, const SparseDecodeOptions& options,
                                 double* out, std::vector<std::vector<int32_t>>* attended) {
  const int64_t n_indexed = validate_sparse("sparse_decode_attention_ref", cache, seq, layer,
                                            shape, q, n_ctx, index, options, out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  std::vector<float> k(size_t(n_ctx) * size_t(d)), v(size_t(n_ctx) * size_t(d));
  std::vector<float> logits;
  std::vector<int32_t> set;
  if (attended != nullptr) attended->assign(size_t(shape.n_q_heads), {});
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kValue, kv_head, 0, n_ctx, v.data());
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const float* qh = q + size_t(h) * size_t(d);
      SparseHeadStats st;
      select_head(index, layer, kv_head, h, qh, shape.scale, n_indexed, options, true, logits,
                  set, st);
      for (int64_t t = n_indexed; t < n_ctx; ++t) set.push_back(int32_t(t));
      std::vector<double> s(set.size());
      double s_max = -INFINITY;
      for (size_t i = 0; i < set.size(); ++i) {
        double dot = 0;
        for (int c = 0; c < d; ++c)
          dot += double(qh[c]) * double(k[size_t(set[i]) * size_t(d) + size_t(c)]);
        s[i] = double(shape.scale) * dot;
        s_max = std::max(s_max, s[i]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - s_max));
      double* oh = out + size_t(h) * size_t(d);
      std::fill(oh, oh + d, 0.0);
      for (size_t i = 0; i < set.size(); ++i)
        for (int c = 0; c < d; ++c)
          oh[c] += s[i] / sum * double(v[size_t(set[i]) * size_t(d) + size_t(c)]);
      if (attended != nullptr) (*attended)[size_t(h)] = set;
    }
  }
}

}  // namespace certkv::attention
