#include "attention/decode_attention.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <string>
#include <vector>

#include "attention/online_softmax.h"
#include "attention/page_rows.h"
#include "attention/work_queue.h"
#include "core/status.h"
#include "gate/meter.h"

namespace certkv::attention {

namespace {

using cache::KvTensor;

constexpr int kMaxHeadDim = 256;
// A split of fewer blocks than this costs more in merging and scheduling than it gains.
constexpr int64_t kMinBlocksPerSplit = 8;

[[noreturn]] void fail_attention(StatusCode code, const char* entry, const std::string& message) {
  fail(code, std::string(entry) + ": " + message);
}

}  // namespace

void validate_shape(const cache::KvCache& cache, int layer, const AttentionShape& shape) {
  const cache::KvCacheConfig& config = cache.config();
  const char* entry = "attention";
  if (shape.n_q_heads <= 0 || shape.n_kv_heads <= 0) {
    fail_attention(StatusCode::kInvalidArgument, entry,
                   "n_q_heads " + std::to_string(shape.n_q_heads) + " and n_kv_heads " +
                       std::to_string(shape.n_kv_heads) + " must be positive");
  }
  if (shape.n_q_heads % shape.n_kv_heads != 0) {
    fail_attention(StatusCode::kInvalidArgument, entry,
                   "n_q_heads " + std::to_string(shape.n_q_heads) +
                       " is not a multiple of n_kv_heads " + std::to_string(shape.n_kv_heads));
  }
  if (shape.head_dim <= 0 || shape.head_dim % 8 != 0 || shape.head_dim > kMaxHeadDim) {
    fail_attention(StatusCode::kUnsupported, entry,
                   "head_dim " + std::to_string(shape.head_dim) +
                       " is not supported (need a positive multiple of 8, at most " +
                       std::to_string(kMaxHeadDim) + ")");
  }
  if (shape.n_kv_heads != config.n_kv_heads || shape.head_dim != config.head_dim) {
    fail_attention(StatusCode::kInvalidArgument, entry,
                   "shape (n_kv_heads " + std::to_string(shape.n_kv_heads) + ", head_dim " +
                       std::to_string(shape.head_dim) + ") does not match the kv cache (" +
                       std::to_string(config.n_kv_heads) + ", " + std::to_string(config.head_dim) +
                       ")");
  }
  if (!std::isfinite(shape.scale)) {
    fail_attention(StatusCode::kInvalidArgument, entry, "scale is not finite");
  }
  if (layer < 0 || layer >= config.n_layers) {
    fail_attention(StatusCode::kOutOfRange, entry,
                   "layer " + std::to_string(layer) + " out of range [0, " +
                       std::to_string(config.n_layers) + ")");
  }
}

void validate_decode(const char* entry, const cache::KvCache& cache, cache::SeqId seq, int layer,
                     const AttentionShape& shape, const void* q, int64_t n_ctx, const void* out) {
  validate_shape(cache, layer, shape);
  if (q == nullptr || out == nullptr) {
    fail_attention(StatusCode::kInvalidArgument, entry, "null q or out");
  }
  const int64_t written = cache.written_tokens(seq, layer);
  if (n_ctx < 1 || n_ctx > written) {
    fail_attention(StatusCode::kOutOfRange, entry,
                   "n_ctx " + std::to_string(n_ctx) + " outside [1, " + std::to_string(written) +
                       "], the tokens written to layer " + std::to_string(layer) +
                       " of sequence " + std::to_string(seq));
  }
}

void decode_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                          const AttentionShape& shape, const float* q, int64_t n_ctx,
                          double* out) {
  validate_decode("decode_attention_ref", cache, seq, layer, shape, q, n_ctx, out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  std::vector<float> k(size_t(n_ctx) * size_t(d)), v(size_t(n_ctx) * size_t(d));
  std::vector<double> s(static_cast<size_t>(n_ctx));
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_ctx, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kValue, kv_head, 0, n_ctx, v.data());
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      const float* qh = q + size_t(h) * size_t(d);
      double s_max = -INFINITY;
      for (int64_t t = 0; t < n_ctx; ++t) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(qh[c]) * double(k[size_t(t) * size_t(d) + c]);
        s[size_t(t)] = double(shape.scale) * dot;
        s_max = std::max(s_max, s[size_t(t)]);
      }
      double sum = 0;
      for (int64_t t = 0; t < n_ctx; ++t) {
        s[size_t(t)] = std::exp(s[size_t(t)] - s_max);
        sum += s[size_t(t)];
      }
      double* oh = out + size_t(h) * size_t(d);
      for (int c = 0; c < d; ++c) oh[c] = 0;
      for (int64_t t = 0; t < n_ctx; ++t) {
        const double p = s[size_t(t)] / sum;
        for (int c = 0; c < d; ++c) oh[c] += p * double(v[size_t(t) * size_t(d) + c]);
      }
    }
  }
}

int choose_decode_splits(int64_t n_ctx, int block_tokens, int n_kv_heads, int n_threads) {
  const int64_t n_blocks = (n_ctx + block_tokens - 1) / block_tokens;
  if (n_threads <= 1 || n_blocks < 2 * kMinBlocksPerSplit) return 1;
  // Four units of work per thread, so that the shared counter in run_units can balance them.
  const int64_t want = (4 * int64_t(n_threads) + n_kv_heads - 1) / n_kv_heads;
  return int(std::clamp<int64_t>(want, 1, n_blocks / kMinBlocksPerSplit));
}

void decode_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                      const AttentionShape& shape, const float* q, int64_t n_ctx, float* out,
                      ThreadPool* pool, const DecodeOptions& options) {
  DecodeQuery query;
  query.seq = seq;
  query.q = q;
  query.n_ctx = n_ctx;
  query.out = out;
  query.options = options;
  decode_attention_batch(cache, layer, shape, {&query, 1}, pool);
}

namespace {

// What one query of a batched step needs: its split plan, page tables and partial results.
struct QueryPlan {
  int64_t n_splits = 1, blocks_per_split = 1;
  int64_t first_unit = 0;  // of the step's units
  bool metered = false;
  std::vector<detail::TableReader> k_tables, v_tables;
  // Partial results of split s of kv_head h, query head g of the group, at
  // index (h * n_splits + s) * group + g: state (m, l) and acc [d].
  std::vector<detail::RowState> states;
  std::vector<float> accs;
  std::vector<detail::MeterRow> meter_rows;
};

}  // namespace

// Page classes of decode attention, in the shape of the device kernels' (the FormatTraits and
// hooks of attention/cuda/paged_decode_cuda.cu): a class says how a page pair is loaded and
// decoded and what its meter term reads; one loop (decode_split) runs every class, and the
// epilogue (the softmax update of each query row, the merge of splits and the meter's) is
// shared. docs/attention.md.
//   load:        start fetching the next K and V pages while this pair is decoded;
//   decode:      a page's rows as floats, one page per tile (decode reads each page once, and
//                small tiles keep its loads interleaved with the arithmetic: at 32K tokens, 4-page
//                tiles measured 1.5x slower), and for a metered class its error data band-major;
//   meter term:  c_t of a query row from that data (Tier A witness or Tier B scales).

// One (kv_head, split) of a step: its tables, its query rows and where its partials go.
struct SplitWork {
  const detail::TableReader* k = nullptr;
  const detail::TableReader* v = nullptr;
  const float* qg = nullptr;  // [group][d]
  int h = 0, group = 0, d = 0, bt = 0;
  float scale = 0.f;
  int64_t t_begin = 0, t_end = 0;
  detail::RowState* st = nullptr;  // [group]
  float* acc = nullptr;            // [group][d]
  detail::MeterRow* mr = nullptr;  // [group], metered classes
  int64_t n_ctx = 0;
  double delta_loc = 0;
};

// Every page without the meter: bf16, GAAC slots, FP8 pages, and lossy pages of an unmetered call.
struct UnmeteredPages {
  static constexpr bool kMeter = false;
  static constexpr bool kTierB = false;
  static void decode(const detail::TableReader& r, int64_t t0, int64_t t1, float* rows, float*, size_t) {
    detail::load_tile(r, t0, t1, rows);
  }
};

// Tier A lossy pages (fp8 casts, fp8-e4m3-scaled, rtn8, rtn4, kivi2): rows from the page decoder,
// the witness w_{t,b} (K) or rho_t (V) from the page's side data.
struct TierAPages {
  static constexpr bool kMeter = true;
  static constexpr bool kTierB = false;
  static void decode(const detail::TableReader& r, int64_t t0, int64_t t1, float* rows, float* err, size_t stride) {
    detail::load_tile_metered(r, t0, t1, rows, err, stride);
  }
};

// fp8-e4m3 pages with the exponent witness on the page-rows kernel: rows from the page decoder and
// no bound data but whether a key's page is lossy (1) or exact (0): the kernel makes c_t from the
// codes in the scores' pass (page_rows.h). V pages: rho_t as TierAPages. (Without the kernel the
// class is TierAPages, its witness a band per channel: codec::exponent_witness_bounds.)
struct ExponentPages {
  static constexpr bool kMeter = true;
  static constexpr bool kTierB = false;
  static constexpr bool kExponent = true;
  static void decode(const detail::TableReader& r, int64_t t0, int64_t t1, float* rows, float* err, size_t stride) {
    if (!r.lossy->key) {
      detail::load_tile_metered(r, t0, t1, rows, err, stride);
      return;
    }
    const int64_t bt = r.cache->block_tokens();
    const size_t d = size_t(r.cache->head_dim());
    for (int64_t start = t0; start < t1; start += bt) {
      const int64_t n = std::min(t1 - start, bt);
      const format::PageRef ref = r.table[start / bt];
      float* rows_at = rows + size_t(start - t0) * d;
      const bool lossy = ref.storage == format::StorageClass::kLossy;
      if (lossy) {
        r.lossy_decoder->decode(uint32_t(start / bt), r.cache->page_bytes_of(ref), int(n), rows_at);
      } else {
        detail::load_tile(r, start, start + n, rows_at);
      }
      std::fill_n(err + size_t(start - t0), size_t(n), lossy ? 1.f : 0.f);
    }
  }
};

// dither8 pages: rows and the stored scales s_{t,g} in one pass of the page decoder (K), rho_t
// from the scales (V).
struct Dither8Pages {
  static constexpr bool kMeter = true;
  static constexpr bool kTierB = true;
  static void decode(const detail::TableReader& r, int64_t t0, int64_t t1, float* rows, float* err, size_t stride) {
    detail::load_tile_metered(r, t0, t1, rows, err, stride);
  }
};

// The start of a split: its rows' softmax states and accumulators cleared; metered, each row's
// query bound weights (weights: [group]).
// exponent_weights: the exponent witness's per-channel weights (not for ExponentPages, whose
// kernel makes the bound from the codes).
void start_split(const SplitWork& w, detail::QueryBoundWeights* weights, bool exponent_weights = true) {
  for (int g = 0; g < w.group; ++g) w.st[g] = {detail::kMinusInfinity, 0.f};
  std::fill(w.acc, w.acc + size_t(w.group) * size_t(w.d), 0.f);
  if (weights == nullptr) return;
  for (int g = 0; g < w.group; ++g)
    detail::query_bound_weights(*w.k->lossy, w.qg + size_t(g) * size_t(w.d), w.scale, w.n_ctx, w.delta_loc,
                                exponent_weights, &weights[g]);
}

// The split's pages in order, one page per tile: the next K and V pages fetched (load), this
// one's rows decoded into k_tile and v_tile and, metered, its error data into bounds
// ([width][bt], band-major) and rho (decode); then epilogue(n_keys).
template <class Pages, class Epilogue>
void for_each_page(const SplitWork& w, float* k_tile, float* v_tile, float* bounds, float* rho, Epilogue&& epilogue) {
  for (int64_t t0 = w.t_begin; t0 < w.t_end; t0 += w.bt) {
    const int64_t t1 = std::min(w.t_end, t0 + w.bt);
    if (t1 < w.t_end) {
      detail::prefetch_page(*w.k, t1 / w.bt);
      detail::prefetch_page(*w.v, t1 / w.bt);
    }
    Pages::decode(*w.k, t0, t1, k_tile, bounds, size_t(w.bt));
    Pages::decode(*w.v, t0, t1, v_tile, rho, size_t(w.bt));
    epilogue(int(t1 - t0));
  }
}

// decode_split through the page-rows kernels (page_rows.h): every row of the group updated by a
// page in one call, a metered page's meter sums kept in per-row lanes across the split.
template <class Pages>
void decode_split_rows(const SplitWork& w, const detail::PageRowsKernels& kernels) {
  const size_t tile_keys = size_t(w.bt), d = size_t(w.d), group = size_t(w.group);
  constexpr bool kExponent = requires { Pages::kExponent; };
  const size_t bound_width = kExponent ? 1 : Pages::kMeter ? size_t(detail::key_bound_width(*w.k->lossy)) : 0;
  struct Scratch {
    std::vector<float> tiles;
    std::vector<detail::QueryBoundWeights> weights;
    std::vector<detail::MeterLanes> lanes;
  };
  thread_local Scratch scratch;
  const size_t p_stride = detail::page_rows_stride(w.bt);
  const size_t terms_floats = Pages::kMeter ? 2 * std::min<size_t>(group, 8) * p_stride : 0;
  scratch.tiles.resize(2 * tile_keys * d + group * p_stride +
                       (Pages::kMeter ? tile_keys * bound_width + tile_keys : 0) + terms_floats);
  float* k_tile = scratch.tiles.data();
  float* v_tile = k_tile + tile_keys * d;
  float* p = v_tile + tile_keys * d;        // [group][p_stride]
  float* bounds = p + group * p_stride;      // metered: [bound_width][tile_keys] (band-major)
  float* rho = bounds + tile_keys * bound_width;  // [tile_keys]
  float* terms = rho + (Pages::kMeter ? tile_keys : 0);  // metered: PageRows::meter_terms
  if constexpr (Pages::kMeter) {
    scratch.weights.resize(group);
    scratch.lanes.resize(group);
    for (detail::MeterLanes& lanes : scratch.lanes) detail::clear_meter_lanes(&lanes);
  }
  start_split(w, Pages::kMeter ? scratch.weights.data() : nullptr, !kExponent);
  detail::PageRows rows;
  rows.q = w.qg;
  rows.n_rows = w.group;
  rows.d = w.d;
  rows.scale = w.scale;
  rows.st = w.st;
  rows.acc = w.acc;
  rows.p = p;
  if constexpr (Pages::kMeter) {
    rows.w = scratch.weights.data();
    rows.lanes = scratch.lanes.data();
    rows.meter_terms = terms;
  }
  auto* const update = !Pages::kMeter ? kernels.update
                       : kExponent    ? kernels.update_exponent
                       : Pages::kTierB ? kernels.update_tier_b
                                       : kernels.update_tier_a;
  for_each_page<Pages>(w, k_tile, v_tile, bounds, rho, [&](int n_keys) {
    update(rows, detail::PageTiles{k_tile, v_tile, n_keys, bounds, tile_keys, rho});
  });
  if constexpr (Pages::kMeter) {
    for (int g = 0; g < w.group; ++g) detail::meter_row_from_lanes(scratch.lanes[size_t(g)], &w.mr[g]);
  }
}

template <class Pages>
void decode_split(const SplitWork& w) {
  if (const detail::PageRowsKernels* kernels = detail::page_rows_kernels(w.d); kernels != nullptr) {
    decode_split_rows<Pages>(w, *kernels);
    return;
  }
  const size_t tile_keys = size_t(w.bt), d = size_t(w.d), group = size_t(w.group);
  const size_t bound_width = Pages::kMeter ? size_t(detail::key_bound_width(*w.k->lossy)) : 0;
  // Metered, each row of the group keeps its probabilities until the page's sums (one call for
  // the group), so s and c are [group][tile_keys].
  const size_t rows_kept = Pages::kMeter ? group : 1;
  // One thread-local object (each thread-local of a shared library is a lookup).
  struct Scratch {
    std::vector<float> tiles;
    std::vector<detail::QueryBoundWeights> weights;
    // Per row of the group: alpha, the sums and the large term of a page, whether it has one.
    std::vector<float> alpha, d, rho;
    std::vector<double> large;
    std::vector<uint8_t> has_large;
  };
  thread_local Scratch scratch;
  scratch.tiles.resize(2 * tile_keys * d + rows_kept * tile_keys +
                       (Pages::kMeter ? tile_keys * bound_width + tile_keys + group * tile_keys : 0));
  float* k_tile = scratch.tiles.data();
  float* v_tile = k_tile + tile_keys * d;
  float* s = v_tile + tile_keys * d;              // [rows_kept][tile_keys]
  float* bounds = s + rows_kept * tile_keys;      // metered: [bound_width][tile_keys] (band-major)
  float* rho = bounds + tile_keys * bound_width;  // [tile_keys]
  float* c = rho + tile_keys;                     // [group][tile_keys]
  if constexpr (Pages::kMeter) {
    scratch.weights.resize(group);
    scratch.alpha.resize(group);
    scratch.d.resize(group);
    scratch.rho.resize(group);
    scratch.large.resize(group);
    scratch.has_large.resize(group);
    for (int g = 0; g < w.group; ++g) w.mr[g] = {0.0, 0.f};
  }
  start_split(w, Pages::kMeter ? scratch.weights.data() : nullptr);
  for_each_page<Pages>(w, k_tile, v_tile, bounds, rho, [&](int n_keys) {
    if constexpr (Pages::kMeter) {
      // The meter term of every row at once, the softmax update of each, then the sums at once.
      const detail::MeterKernels& mk = detail::meter_kernels();
      uint8_t* has_large = scratch.has_large.data();
      (Pages::kTierB ? mk.group_bounds_b : mk.group_bounds_a)(scratch.weights.data(), w.group, bounds, tile_keys,
                                                              n_keys, c, has_large);
      for (int g = 0; g < w.group; ++g) {
        const size_t row = size_t(g) * tile_keys;
        scratch.large[size_t(g)] =
            detail::update_row_unsummed(w.qg + size_t(g) * d, k_tile, v_tile, n_keys, w.d, w.scale, c + row,
                                        has_large[g] != 0, &w.st[g], w.acc + size_t(g) * d, s + row, &scratch.alpha[size_t(g)]);
      }
      mk.group_sums(s, c, rho, tile_keys, w.group, n_keys, scratch.d.data(), scratch.rho.data());
      for (int g = 0; g < w.group; ++g)
        detail::add_meter_tile(&w.mr[g], scratch.alpha[size_t(g)], scratch.d[size_t(g)], scratch.rho[size_t(g)],
                               scratch.large[size_t(g)]);
    } else {
      for (int g = 0; g < w.group; ++g)
        detail::update_row(w.qg + size_t(g) * d, k_tile, v_tile, n_keys, w.d, w.scale, &w.st[g], w.acc + size_t(g) * d,
                           s);
    }
  });
}

void decode_attention_batch(const cache::KvCache& cache, int layer, const AttentionShape& shape,
                            std::span<const DecodeQuery> queries, ThreadPool* pool) {
  for (const DecodeQuery& dq : queries)
    validate_decode("decode_attention", cache, dq.seq, layer, shape, dq.q, dq.n_ctx, dq.out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int bt = cache.block_tokens();
  const int n_threads = pool != nullptr ? pool->n_threads() : 1;
  std::vector<QueryPlan> plans(queries.size());
  int64_t n_units = 0;
  for (size_t i = 0; i < queries.size(); ++i) {
    const DecodeQuery& dq = queries[i];
    QueryPlan& pl = plans[i];
    const int64_t n_blocks = (dq.n_ctx + bt - 1) / bt;
    int64_t n_splits = dq.options.n_splits > 0
                           ? dq.options.n_splits
                           : choose_decode_splits(dq.n_ctx, bt, shape.n_kv_heads, n_threads);
    n_splits = std::clamp<int64_t>(n_splits, 1, n_blocks);
    pl.blocks_per_split = (n_blocks + n_splits - 1) / n_splits;
    pl.n_splits = (n_blocks + pl.blocks_per_split - 1) / pl.blocks_per_split;
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      pl.k_tables.push_back(detail::table_reader(cache, dq.seq, layer, KvTensor::kKey, h));
      pl.v_tables.push_back(detail::table_reader(cache, dq.seq, layer, KvTensor::kValue, h));
    }
    const size_t n_partials = size_t(shape.n_kv_heads) * size_t(pl.n_splits) * size_t(group);
    pl.states.resize(n_partials);
    pl.accs.resize(n_partials * size_t(d));
    pl.metered = dq.options.meters != nullptr && pl.k_tables[0].lossy.has_value();
    if (pl.metered && codec::lossy_scheme_is_tier_b(pl.k_tables[0].lossy->scheme) &&
        !(dq.options.meter.delta_loc > 0 && dq.options.meter.delta_loc < 1)) {
      fail_attention(StatusCode::kInvalidArgument, "decode_attention",
                     "meter.delta_loc " + std::to_string(dq.options.meter.delta_loc) +
                         " is outside (0, 1)");
    }
    pl.meter_rows.resize(pl.metered ? n_partials : 0);
    pl.first_unit = n_units;
    n_units += int64_t(shape.n_kv_heads) * pl.n_splits;
  }

  // The merge of a query's splits (and of its meter), run by the unit that finishes the query's
  // last split: in parallel over the queries, and the same arithmetic whichever thread runs it.
  auto merge = [&](size_t qi) {
    const DecodeQuery& dq = queries[qi];
    const QueryPlan& pl = plans[qi];
    const int64_t n_splits = pl.n_splits;
    // Merge the splits by their log-sum-exp weights: with M = max_s m_s,
    // out = sum_s e^{m_s - M} acc_s / sum_s e^{m_s - M} l_s.
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      // max ||v||, kept at write time.
      const double v_max = pl.metered ? cache.value_norm_max(dq.seq, layer, h) : 0.0;
      for (int g = 0; g < group; ++g) {
        float* o = dq.out + (size_t(h) * size_t(group) + size_t(g)) * size_t(d);
        auto partial = [&](int64_t split) {
          return (size_t(h) * size_t(n_splits) + size_t(split)) * size_t(group) + size_t(g);
        };
        float m_max = detail::kMinusInfinity;
        for (int64_t sp = 0; sp < n_splits; ++sp) m_max = std::max(m_max, pl.states[partial(sp)].m);
        float l_total = 0.f;
        std::fill(o, o + d, 0.f);
        for (int64_t sp = 0; sp < n_splits; ++sp) {
          const size_t i = partial(sp);
          const float w = pl.states[i].m == m_max ? 1.f : std::exp(pl.states[i].m - m_max);
          l_total += w * pl.states[i].l;
          const float* a = &pl.accs[i * size_t(d)];
          for (int c = 0; c < d; ++c) o[c] += w * a[c];
        }
        const float inv_l = 1.f / l_total;
        for (int c = 0; c < d; ++c) o[c] *= inv_l;
        if (dq.options.meters == nullptr) continue;
        HeadMeter& hm = dq.options.meters[size_t(h) * size_t(group) + size_t(g)];
        hm = HeadMeter{};
        if (!pl.metered) continue;
        // A - 1, the value side and max ||v|| merge like the output (the same LSE weights).
        double d_total = 0, rho_total = 0;
        for (int64_t sp = 0; sp < n_splits; ++sp) {
          const size_t i = partial(sp);
          // e^0 is 1: a query of one split (short contexts) evaluates no exponential.
          const double w = pl.states[i].m == m_max ? 1.0 : std::exp(double(pl.states[i].m) - double(m_max));
          d_total += w * pl.meter_rows[i].d;
          rho_total += w * double(pl.meter_rows[i].rho);
        }
        // Float rounding of the sums above is at most a few parts in 10^6 of each: lift by 2^-16.
        const double lift = 1.0 + 1.0 / 65536.0;
        const double a_minus_1 = d_total / double(l_total) * lift;
        hm.log_a = std::isfinite(a_minus_1) ? std::log1p(a_minus_1) : INFINITY;
        hm.meter = gate::meter_from_a_minus_1(a_minus_1);  // 1 for +inf and NaN
        hm.value_rho = rho_total / double(l_total) * lift;
        hm.v_norm_max = v_max;
        hm.output_bound = 2 * hm.meter * hm.v_norm_max + hm.value_rho;
      }
    }
  };
  std::unique_ptr<std::atomic<int64_t>[]> units_left(new std::atomic<int64_t>[queries.size()]);
  for (size_t qi = 0; qi < queries.size(); ++qi)
    units_left[qi].store(int64_t(shape.n_kv_heads) * plans[qi].n_splits, std::memory_order_relaxed);
  detail::run_units(pool, n_units, [&](int64_t step_unit, int) {
    const size_t qi = size_t(std::upper_bound(plans.begin(), plans.end(), step_unit,
                                              [](int64_t u, const QueryPlan& p) { return u < p.first_unit; }) -
                             plans.begin()) - 1;
    const DecodeQuery& dq = queries[qi];
    QueryPlan& pl = plans[qi];
    const int64_t unit = step_unit - pl.first_unit;
    SplitWork w;
    w.h = int(unit / pl.n_splits);
    const int64_t split = unit % pl.n_splits;
    w.k = &pl.k_tables[size_t(w.h)];
    w.v = &pl.v_tables[size_t(w.h)];
    w.qg = dq.q + size_t(w.h) * size_t(group) * size_t(d);
    w.group = group;
    w.d = d;
    w.bt = bt;
    w.scale = shape.scale;
    w.t_begin = split * pl.blocks_per_split * bt;
    w.t_end = std::min(dq.n_ctx, (split + 1) * pl.blocks_per_split * bt);
    const size_t first = size_t(unit) * size_t(group);
    w.st = &pl.states[first];
    w.acc = &pl.accs[first * size_t(d)];
    if (!pl.metered) {
      decode_split<UnmeteredPages>(w);
    } else {
      w.mr = &pl.meter_rows[first];
      w.n_ctx = dq.n_ctx;
      w.delta_loc = dq.options.meter.delta_loc;
      if (codec::lossy_scheme_is_tier_b(w.k->lossy->scheme)) {
        decode_split<Dither8Pages>(w);
      } else if (const detail::PageRowsKernels* kernels = detail::page_rows_kernels(d);
                 kernels != nullptr && w.k->lossy->witness == codec::WitnessCode::kExponent) {
        decode_split_rows<ExponentPages>(w, *kernels);
      } else {
        decode_split<TierAPages>(w);
      }
    }
    if (units_left[qi].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(qi);
  });
}

}  // namespace certkv::attention
