#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/online_softmax.h"
#include "attention/page_rows.h"
#include "attention/work_queue.h"
#include "core/status.h"

namespace certkv::attention {

namespace {

using cache::KvTensor;

// Query tokens processed together against each page: each page is converted from bf16 once per
// block of this many queries (times the GQA group).
constexpr int64_t kQueryBlockTokens = 32;

void validate_prefill(const char* entry, const cache::KvCache& cache, cache::SeqId seq, int layer,
                      const AttentionShape& shape, const void* q, int64_t pos0, int64_t n,
                      const void* out) {
  validate_shape(cache, layer, shape);
  if (q == nullptr || out == nullptr) fail(StatusCode::kInvalidArgument, std::string(entry) + ": null q or out");
  const int64_t written = cache.written_tokens(seq, layer);
  if (pos0 < 0 || n < 1 || pos0 + n > written) {
    fail(StatusCode::kOutOfRange,
         std::string(entry) + ": queries at positions [" + std::to_string(pos0) + ", " +
             std::to_string(pos0 + n) + ") need keys the cache does not hold: layer " +
             std::to_string(layer) + " of sequence " + std::to_string(seq) + " has " +
             std::to_string(written) + " tokens written (need pos0 >= 0, n >= 1)");
  }
}

// Lossy caches read a block exactly while it ends after this position of a sequence of n_tokens
// (the incomplete block and the recent window): KvCache::recent_window_tokens.
int64_t exact_from_of(const cache::KvCache& cache, int64_t n_tokens) {
  return n_tokens - cache.recent_window_tokens();
}

int64_t block_end(int64_t t, int64_t block_tokens) { return (t / block_tokens + 1) * block_tokens; }

// The start of the first page of [t0, t1) (page starts t0 + k block_tokens) that ends after
// `exact_from`; t1 when none does.
int64_t first_page_ending_after(int64_t exact_from, int64_t t0, int64_t t1, int64_t block_tokens) {
  for (int64_t start = t0; start < t1; start += block_tokens)
    if (block_end(start, block_tokens) > exact_from) return start;
  return t1;
}

}  // namespace

void prefill_attention_ref(const cache::KvCache& cache, cache::SeqId seq, int layer,
                           const AttentionShape& shape, const float* q, int64_t pos0, int64_t n,
                           double* out) {
  validate_prefill("prefill_attention_ref", cache, seq, layer, shape, q, pos0, n, out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int64_t n_keys = pos0 + n;
  std::vector<float> k(size_t(n_keys) * size_t(d)), v(size_t(n_keys) * size_t(d));
  std::vector<double> s(static_cast<size_t>(n_keys));
  const bool lossy = cache::kv_scheme_is_lossy(cache.scheme());
  std::vector<float> k_exact, v_exact;
  if (lossy) {
    k_exact.resize(k.size());
    v_exact.resize(v.size());
  }
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_keys, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kValue, kv_head, 0, n_keys, v.data());
    if (lossy) {
      cache.read_token_range_exact(seq, layer, KvTensor::kKey, kv_head, 0, n_keys, k_exact.data());
      cache.read_token_range_exact(seq, layer, KvTensor::kValue, kv_head, 0, n_keys, v_exact.data());
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t n_visible = pos0 + i + 1;
      // Lossy caches: what a decode step at this position reads (see prefill_attention).
      const int64_t exact_from = exact_from_of(cache, n_visible);
      const auto key = [&](int64_t t) {
        const bool exact = lossy && block_end(t, cache.block_tokens()) > exact_from;
        return &(exact ? k_exact : k)[size_t(t) * size_t(d)];
      };
      const auto value = [&](int64_t t) {
        const bool exact = lossy && block_end(t, cache.block_tokens()) > exact_from;
        return &(exact ? v_exact : v)[size_t(t) * size_t(d)];
      };
      for (int g = 0; g < group; ++g) {
        const size_t row = size_t(i) * size_t(shape.n_q_heads) + size_t(kv_head * group + g);
        const float* qh = q + row * size_t(d);
        double s_max = -INFINITY;
        for (int64_t t = 0; t < n_visible; ++t) {
          double dot = 0;
          const float* kt = key(t);
          for (int c = 0; c < d; ++c) dot += double(qh[c]) * double(kt[c]);
          s[size_t(t)] = double(shape.scale) * dot;
          s_max = std::max(s_max, s[size_t(t)]);
        }
        double sum = 0;
        for (int64_t t = 0; t < n_visible; ++t) {
          s[size_t(t)] = std::exp(s[size_t(t)] - s_max);
          sum += s[size_t(t)];
        }
        double* oh = out + row * size_t(d);
        for (int c = 0; c < d; ++c) oh[c] = 0;
        for (int64_t t = 0; t < n_visible; ++t) {
          const double p = s[size_t(t)] / sum;
          const float* vt = value(t);
          for (int c = 0; c < d; ++c) oh[c] += p * double(vt[c]);
        }
      }
    }
  }
}

void prefill_attention(const cache::KvCache& cache, cache::SeqId seq, int layer,
                       const AttentionShape& shape, const float* q, int64_t pos0, int64_t n,
                       float* out, ThreadPool* pool) {
  validate_prefill("prefill_attention", cache, seq, layer, shape, q, pos0, n, out);
  const int d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  const int bt = cache.block_tokens();
  const int64_t n_qblocks = (n + kQueryBlockTokens - 1) / kQueryBlockTokens;

  std::vector<detail::TableReader> k_tables, v_tables;
  for (int h = 0; h < shape.n_kv_heads; ++h) {
    k_tables.push_back(detail::table_reader(cache, seq, layer, KvTensor::kKey, h));
    v_tables.push_back(detail::table_reader(cache, seq, layer, KvTensor::kValue, h));
  }
  const bool lossy = cache::kv_scheme_is_lossy(cache.scheme());

  const size_t tile_keys = size_t(detail::blocks_per_tile(bt, d)) * size_t(bt);
  // The kernels decode_attention uses for this head_dim, or null for the inline paths.
  const detail::PageRowsKernels* const rows_kernels = detail::page_rows_kernels(d);
  // Units are (query block, kv_head), the last query blocks (which see the most keys) first.
  detail::run_units(pool, n_qblocks * shape.n_kv_heads, [&](int64_t unit, int) {
    const int64_t qblock = n_qblocks - 1 - unit / shape.n_kv_heads;
    const int h = int(unit % shape.n_kv_heads);
    const int64_t i0 = qblock * kQueryBlockTokens;
    const int64_t i1 = std::min(n, i0 + kQueryBlockTokens);
    const size_t n_rows = size_t(i1 - i0) * size_t(group);
    // Lossy caches: query i reads what a decode step at its position reads, whatever the chunk
    // (blocks ending after exact_from_of(cache, pos0 + i + 1) exact, earlier ones as stored).
    // The block's queries share tile A, in which only the pages exact for every one of them are
    // exact; tile B holds the pages exact for some of them.
    const int64_t exact_lo = exact_from_of(cache, pos0 + i0 + 1);
    const int64_t exact_hi = exact_from_of(cache, pos0 + i1);

    thread_local std::vector<float> scratch;
    thread_local std::vector<detail::RowState> states;
    const size_t tile_pages = tile_keys / size_t(bt);
    const size_t tiles = lossy ? 4 : 2;
    const size_t p_stride = detail::page_rows_stride(bt);
    scratch.resize(2 * n_rows * size_t(d) + tiles * tile_keys * size_t(d) + tile_keys + tile_pages +
                   size_t(group) * p_stride);
    states.assign(n_rows, {detail::kMinusInfinity, 0.f});
    float* q_rows = scratch.data();  // [i - i0][g][d]
    float* acc = q_rows + n_rows * size_t(d);
    float* k_tile = acc + n_rows * size_t(d);
    float* v_tile = k_tile + tile_keys * size_t(d);
    float* s = v_tile + tile_keys * size_t(d);
    float* alphas = s + tile_keys;  // one per page of a tile
    float* k_exact = alphas + tile_pages;
    float* v_exact = k_exact + (lossy ? tile_keys * size_t(d) : 0);
    float* p_rows = v_exact + (lossy ? tile_keys * size_t(d) : 0);  // page_rows' p: [group][p_stride]
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = q + (size_t(i) * size_t(shape.n_q_heads) + size_t(h) * size_t(group)) * size_t(d);
      std::copy(src, src + size_t(group) * size_t(d), q_rows + size_t(i - i0) * size_t(group) * size_t(d));
    }
    std::fill(acc, acc + n_rows * size_t(d), 0.f);

    const int64_t key_end = pos0 + i1;
    for (int64_t t0 = 0; t0 < key_end; t0 += int64_t(tile_keys)) {
      const int64_t t1 = std::min(key_end, t0 + int64_t(tile_keys));
      detail::load_tile(k_tables[size_t(h)], t0, t1, k_tile, exact_hi);
      detail::load_tile(v_tables[size_t(h)], t0, t1, v_tile, exact_hi);
      // Pages [mixed0, mixed1) are exact for some of the block's queries only.
      const int64_t mixed0 = lossy ? first_page_ending_after(exact_lo, t0, t1, bt) : t1;
      const int64_t mixed1 = lossy ? first_page_ending_after(exact_hi, t0, t1, bt) : t1;
      if (mixed0 < mixed1) {
        const int64_t min_exact = std::numeric_limits<int64_t>::min();
        detail::load_tile(k_tables[size_t(h)], mixed0, mixed1, k_exact + size_t(mixed0 - t0) * size_t(d), min_exact);
        detail::load_tile(v_tables[size_t(h)], mixed0, mixed1, v_exact + size_t(mixed0 - t0) * size_t(d), min_exact);
      }
      for (int64_t i = i0; i < i1; ++i) {
        // Causal: query i sees positions [0, pos0 + i].
        const int64_t visible = pos0 + i + 1 - t0;
        if (visible <= 0) continue;
        const int64_t t_end = t0 + std::min(t1 - t0, visible);
        // Pages [t0, split) as tile A holds them, [split, mixed1) exact from tile B, the rest A.
        const int64_t split =
            mixed0 < mixed1 ? first_page_ending_after(exact_from_of(cache, pos0 + i + 1), mixed0, mixed1, bt) : mixed1;
        const struct {
          int64_t begin, end;
          const float *k, *v;
        } ranges[3] = {{t0, std::min(split, t_end), k_tile, v_tile},
                       {split, std::min(mixed1, t_end), k_exact, v_exact},
                       {std::max(split, mixed1), t_end, k_tile, v_tile}};
        if (rows_kernels != nullptr) {
          // The query's group in one call per page, as decode_attention's splits make them.
          detail::PageRows rows;
          const size_t r = size_t(i - i0) * size_t(group);
          rows.q = q_rows + r * size_t(d);
          rows.n_rows = group;
          rows.d = d;
          rows.scale = shape.scale;
          rows.st = &states[r];
          rows.acc = acc + r * size_t(d);
          rows.p = p_rows;
          for (const auto& range : ranges) {
            for (int64_t t = range.begin; t < range.end; t += bt) {
              const size_t at = size_t(t - t0);
              const int n_keys = int(std::min<int64_t>(bt, range.end - t));
              rows_kernels->update(rows, {range.k + at * size_t(d), range.v + at * size_t(d), n_keys, nullptr, 0, nullptr});
            }
          }
          continue;
        }
        for (int g = 0; g < group; ++g) {
          const size_t r = size_t(i - i0) * size_t(group) + size_t(g);
          // One softmax update per page, as decode_attention makes them: a query's arithmetic
          // is then the same whatever the tile, the chunk or the path (prefill or decode).
          for (const auto& range : ranges) {
            if (range.begin >= range.end) continue;
            const size_t at = size_t(range.begin - t0);
            detail::update_row_pages(q_rows + r * size_t(d), range.k + at * size_t(d), range.v + at * size_t(d),
                                     int(range.end - range.begin), bt, d, shape.scale, &states[r],
                                     acc + r * size_t(d), s + at, alphas + at / size_t(bt));
          }
        }
      }
    }

    for (int64_t i = i0; i < i1; ++i) {
      for (int g = 0; g < group; ++g) {
        const size_t r = size_t(i - i0) * size_t(group) + size_t(g);
        const float inv_l = 1.f / states[r].l;
        float* o = out + (size_t(i) * size_t(shape.n_q_heads) + size_t(h) * size_t(group) + size_t(g)) * size_t(d);
        const float* a = acc + r * size_t(d);
        for (int c = 0; c < d; ++c) o[c] = a[c] * inv_l;
      }
    }
  });
}

}  // namespace certkv::attention
