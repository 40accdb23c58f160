#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/online_softmax.h"
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
  for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
    cache.read_token_range_ref(seq, layer, KvTensor::kKey, kv_head, 0, n_keys, k.data());
    cache.read_token_range_ref(seq, layer, KvTensor::kValue, kv_head, 0, n_keys, v.data());
    if (cache::kv_scheme_is_lossy(cache.scheme())) {
      // The blocks holding this call's tokens are read exactly (see prefill_attention).
      const int64_t from = pos0 / cache.block_tokens() * cache.block_tokens();
      cache.read_token_range_exact(seq, layer, KvTensor::kKey, kv_head, from, n_keys, &k[size_t(from) * size_t(d)]);
      cache.read_token_range_exact(seq, layer, KvTensor::kValue, kv_head, from, n_keys, &v[size_t(from) * size_t(d)]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t n_visible = pos0 + i + 1;
      for (int g = 0; g < group; ++g) {
        const size_t row = size_t(i) * size_t(shape.n_q_heads) + size_t(kv_head * group + g);
        const float* qh = q + row * size_t(d);
        double s_max = -INFINITY;
        for (int64_t t = 0; t < n_visible; ++t) {
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double(qh[c]) * double(k[size_t(t) * size_t(d) + c]);
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
          for (int c = 0; c < d; ++c) oh[c] += p * double(v[size_t(t) * size_t(d) + c]);
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
    // Lossy caches: the blocks holding this call's tokens are read exactly (a prompt chunk
    // attends its own keys and values as computed, earlier chunks as stored).
    k_tables.back().exact_from = v_tables.back().exact_from = pos0;
  }

  const size_t tile_keys = size_t(detail::blocks_per_tile(bt, d)) * size_t(bt);
  // Units are (query block, kv_head), the last query blocks (which see the most keys) first.
  detail::run_units(pool, n_qblocks * shape.n_kv_heads, [&](int64_t unit, int) {
    const int64_t qblock = n_qblocks - 1 - unit / shape.n_kv_heads;
    const int h = int(unit % shape.n_kv_heads);
    const int64_t i0 = qblock * kQueryBlockTokens;
    const int64_t i1 = std::min(n, i0 + kQueryBlockTokens);
    const size_t n_rows = size_t(i1 - i0) * size_t(group);

    thread_local std::vector<float> scratch;
    thread_local std::vector<detail::RowState> states;
    const size_t tile_pages = tile_keys / size_t(bt);
    scratch.resize(2 * n_rows * size_t(d) + 2 * tile_keys * size_t(d) + tile_keys + tile_pages);
    states.assign(n_rows, {detail::kMinusInfinity, 0.f});
    float* q_rows = scratch.data();  // [i - i0][g][d]
    float* acc = q_rows + n_rows * size_t(d);
    float* k_tile = acc + n_rows * size_t(d);
    float* v_tile = k_tile + tile_keys * size_t(d);
    float* s = v_tile + tile_keys * size_t(d);
    float* alphas = s + tile_keys;  // one per page of a tile
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = q + (size_t(i) * size_t(shape.n_q_heads) + size_t(h) * size_t(group)) * size_t(d);
      std::copy(src, src + size_t(group) * size_t(d), q_rows + size_t(i - i0) * size_t(group) * size_t(d));
    }
    std::fill(acc, acc + n_rows * size_t(d), 0.f);

    const int64_t key_end = pos0 + i1;
    for (int64_t t0 = 0; t0 < key_end; t0 += int64_t(tile_keys)) {
      const int64_t t1 = std::min(key_end, t0 + int64_t(tile_keys));
      detail::load_tile(k_tables[size_t(h)], t0, t1, k_tile);
      detail::load_tile(v_tables[size_t(h)], t0, t1, v_tile);
      for (int64_t i = i0; i < i1; ++i) {
        // Causal: query i sees positions [0, pos0 + i].
        const int64_t visible = pos0 + i + 1 - t0;
        if (visible <= 0) continue;
        const int n_visible = int(std::min(t1 - t0, visible));
        for (int g = 0; g < group; ++g) {
          const size_t r = size_t(i - i0) * size_t(group) + size_t(g);
          // One softmax update per page, as decode_attention makes them: a query's arithmetic
          // is then the same whatever the tile, the chunk or the path (prefill or decode).
          detail::update_row_pages(q_rows + r * size_t(d), k_tile, v_tile, n_visible, bt, d,
                                   shape.scale, &states[r], acc + r * size_t(d), s, alphas);
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
