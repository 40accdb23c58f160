// The tile step shared by decode_attention and prefill_attention: pages (bf16, FP8 or GAAC) -> float
// tile, and the online softmax update of a set of query rows by one tile of keys and values
// (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the (m, l, acc) form
// of FlashAttention, Dao et al. 2022, Algorithm 1):
//   m' = max(m, max_j s_j),  l' = l e^{m - m'} + sum_j e^{s_j - m'},
//   acc' = acc e^{m - m'} + sum_j e^{s_j - m'} v_j;   the output is acc / l at the end.
// Internal to the attention layer. AVX2 + FMA paths under #ifdef __AVX2__, portable loops otherwise.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "attention/page_meter.h"
#include "cache/kv_cache.h"
#include "codec/gaac.h"
#include "codec/lossy_page.h"
#include "format/fp8.h"
#include "format/numeric.h"
#include "format/page.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "core/x86_simd.h"
#define CERTKV_ATTENTION_AVX2 1
#endif

namespace certkv::attention::detail {

// Softmax state of one query row: running max m, running sum l, and acc (head_dim floats,
// held by the caller).
struct RowState {
  float m;
  float l;
};

inline constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

// dst[i] = bf16 src[i] as float, i < n. REQUIRES: n % 8 == 0.
inline void bf16_to_float_rows(const uint16_t* src, float* dst, size_t n) {
#if CERTKV_ATTENTION_AVX2
  for (size_t i = 0; i < n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
#else
  for (size_t i = 0; i < n; ++i) dst[i] = format::bf16_to_float(src[i]);
#endif
}

// Pages per key tile: a tile of K (and one of V) as float stays near 16 KiB, so that the tiles
// and the query rows working on them stay in the inner caches.
inline int64_t blocks_per_tile(int block_tokens, int head_dim) {
  const int64_t blocks = 4096 / (int64_t(block_tokens) * head_dim);
  return blocks > 1 ? blocks : 1;
}

// One block table (K or V of one (layer, kv_head)) as load_tile reads it: the entries and, for a
// GAAC cache, the bases and slot bytes its slots were encoded with. Valid while the cache is not
// mutated.
struct TableReader {
  const cache::KvCache* cache;
  const format::PageRef* table;
  int64_t n_entries;  // block table entries (n_blocks of the sequence)
  size_t slot_bytes;
  // Bound to the table's bases (the cache's) and the best kernel; empty unless
  // cache->scheme() == kGaac.
  std::optional<codec::GaacRowDecoder> gaac;
  format::GaacElement element;         // of the cache's pages
  const codec::GaacBases* fp8_bases;   // GAAC FP8 schemes: the table's bases; else null
  // Lossy schemes: what the table's lossy pages are (empty otherwise), and where a Tier A page's
  // side data starts (lossy_payload_bytes).
  std::optional<codec::LossyPageSpec> lossy;
  size_t side_offset = 0;
  size_t lossy_side_bytes = 0;  // lossy_page_bytes - lossy_payload_bytes
  // Lossy schemes: the page decoder bound to `lossy` (validated once, not per page) and the
  // widest kernel this CPU runs.
  std::optional<codec::LossyPageDecoder> lossy_decoder;
  // Schemes with raw FP8 pages (fp8-*-pages, gaac-e4m3/e5m2) and head_dim a multiple of 32: the
  // FP8 cast decoder for those pages (the floats of format::fp8_to_float).
  std::optional<codec::LossyPageDecoder> fp8_decoder;
  int layer = 0;
  cache::KvTensor kv = cache::KvTensor::kKey;
  int kv_head = 0;
};

inline TableReader table_reader(const cache::KvCache& cache, cache::SeqId seq, int layer,
                                cache::KvTensor kv, int kv_head) {
  TableReader r{&cache, cache.block_table(seq, layer, kv, kv_head), cache.n_blocks(seq), 0,
                std::nullopt, cache::kv_scheme_element(cache.scheme()), nullptr, std::nullopt, 0, 0,
                std::nullopt, std::nullopt, layer, kv, kv_head};
  if (r.element != format::GaacElement::kBf16 && cache.head_dim() % codec::kQuantGroup == 0) {
    codec::LossyPageSpec cast;
    cast.scheme = r.element == format::GaacElement::kFp8E4M3 ? codec::LossyScheme::kFp8E4M3
                                                             : codec::LossyScheme::kFp8E5M2;
    cast.block_tokens = cache.block_tokens();
    cast.head_dim = cache.head_dim();
    r.fp8_decoder.emplace(cast);
  }
  if (cache::kv_scheme_is_lossy(cache.scheme())) {
    r.lossy = cache.lossy_spec(layer, kv, kv_head);
    r.side_offset = codec::lossy_payload_bytes(*r.lossy);
    r.lossy_side_bytes = codec::lossy_page_bytes(*r.lossy) - r.side_offset;
    r.lossy_decoder.emplace(*r.lossy);
  } else if (cache.scheme() == cache::KvScheme::kGaac) {
    r.gaac.emplace(cache.block_tokens(), cache.head_dim(), cache.gaac_bases(layer, kv, kv_head));
    r.slot_bytes = cache.gaac_slot_bytes(layer, kv);
  } else if (cache::kv_scheme_is_gaac(cache.scheme())) {
    r.fp8_bases = &cache.gaac_bases(layer, kv, kv_head);
    r.slot_bytes = cache.gaac_slot_bytes(layer, kv);
  }
  return r;
}

// dst[i] = FP8 src[i] of `element` as float, i < n.
inline void fp8_to_float_rows(format::GaacElement element, const uint8_t* src, float* dst,
                              size_t n) {
  const int exponent_bits = element == format::GaacElement::kFp8E4M3 ? 4 : 5;
  const int mantissa_bits = element == format::GaacElement::kFp8E4M3 ? 3 : 2;
  for (size_t i = 0; i < n; ++i) dst[i] = format::fp8_to_float(src[i], exponent_bits, mantissa_bits);
}

// Bytes of a page of the table in `storage` (what prefetch_page fetches).
inline size_t page_bytes_of_class(const TableReader& r, format::StorageClass storage) {
  const size_t elements = size_t(r.cache->block_tokens()) * size_t(r.cache->head_dim());
  switch (storage) {
    case format::StorageClass::kBf16:
      return 2 * elements;
    case format::StorageClass::kFp8:
      return elements;
    case format::StorageClass::kGaac:
    case format::StorageClass::kGaacFp8:
      return r.slot_bytes;
    case format::StorageClass::kLossy:
    case format::StorageClass::kDither8:
      return r.lossy ? r.side_offset + r.lossy_side_bytes : 0;
  }
  return 0;
}

// The "load" step of a page class: starts fetching page `index` of the table into the caches, so
// that its bytes arrive while the page before it is decoded (pages of a pool are not adjacent in
// table order, which the hardware prefetchers do not follow). REQUIRES: the block is written.
inline void prefetch_page(const TableReader& r, int64_t index) {
  const format::PageRef ref = r.table[index];
  // GAAC slots are fetched by load_tile itself. Raw bf16 pages are fetched too: with eight
  // sequences decoding, a step's 2 KiB pages come from all over the pool and their loads waited
  // on memory (one page ahead: the eight-sequence step 5-9% faster on one thread, SmolLM2 at 576
  // tokens; two pages ahead no better, four slower; docs/engine.md, "Tile products").
  if (ref.storage == format::StorageClass::kGaac) return;
  const char* p = reinterpret_cast<const char*>(r.cache->page_bytes_of(ref));
  const size_t bytes = page_bytes_of_class(r, ref.storage);
  for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
}

// Rows [0, n) of a raw FP8 page of the table as floats.
inline void fp8_page_rows(const TableReader& r, const uint8_t* page, int64_t n, float* rows) {
  if (r.fp8_decoder) {
    r.fp8_decoder->decode(0, page, int(n), rows);
  } else {
    fp8_to_float_rows(r.element, page, rows, size_t(n) * size_t(r.cache->head_dim()));
  }
}

// Converts positions [begin, end) of one block table (K or V) to float rows, a page at a time:
// raw pages from bf16 or FP8, GAAC slots reconstructed straight into the rows by the table's
// codec::GaacRowDecoder (the same bit patterns as the raw page, so the same floats), GAAC FP8
// slots decoded to FP8 bytes (codec _ref decoder, a per-thread page buffer), then to floats.
// Lossy pages of blocks ending after `exact_from` are read exactly, from the backing store
// (prefill: what a decode step at a query's position reads, prefill_attention).
// out: [end - begin][head_dim].
// REQUIRES: begin % block_tokens == 0; the positions are written.
inline void load_tile(const TableReader& r, int64_t begin, int64_t end, float* out,
                      int64_t exact_from = std::numeric_limits<int64_t>::max()) {
  const cache::KvCache& cache = *r.cache;
  const int64_t bt = cache.block_tokens();
  const size_t d = size_t(cache.head_dim());
  for (int64_t start = begin; start < end; start += bt) {
    const int64_t n = end - start < bt ? end - start : bt;
    const format::PageRef ref = r.table[start / bt];
    float* rows = out + size_t(start - begin) * d;
    if (ref.storage == format::StorageClass::kGaac && r.gaac) {
      // A slot is read as three streams (sign+mantissa, codes, tags) and escapes: fetch the next
      // slot of the table while this one is decoded.
      const int64_t next = start / bt + 1;
      if (next < r.n_entries && r.table[next].storage == format::StorageClass::kGaac) {
        const char* p = reinterpret_cast<const char*>(cache.page_bytes_of(r.table[next]));
        for (size_t at = 0; at < r.slot_bytes; at += 64) __builtin_prefetch(p + at);
      }
      r.gaac->decode_rows(cache.page_bytes_of(ref), r.slot_bytes, 0, int(n), rows);
    } else if (ref.storage == format::StorageClass::kGaacFp8 && r.fp8_bases != nullptr) {
      thread_local std::vector<uint8_t> page;
      page.resize(size_t(bt) * d);
      codec::gaac_decode_page_fp8_ref(r.element, cache.page_bytes_of(ref), r.slot_bytes, int(bt),
                                      int(d), *r.fp8_bases, page.data());
      fp8_page_rows(r, page.data(), n, rows);
    } else if (ref.storage == format::StorageClass::kFp8) {
      fp8_page_rows(r, cache.page_fp8(ref), n, rows);
    } else if (r.lossy && (ref.storage == format::StorageClass::kLossy ||
                           ref.storage == format::StorageClass::kDither8) &&
               (start / bt + 1) * bt > exact_from) {
      thread_local std::vector<uint16_t> exact;
      exact.resize(size_t(bt) * d);
      cache.read_exact_page(ref, r.layer, r.kv, r.kv_head, exact.data());
      bf16_to_float_rows(exact.data(), rows, size_t(n) * d);
    } else if (r.lossy && (ref.storage == format::StorageClass::kLossy ||
                           ref.storage == format::StorageClass::kDither8)) {
      r.lossy_decoder->decode(uint32_t(start / bt), cache.page_bytes_of(ref), int(n), rows);
    } else {
      bf16_to_float_rows(cache.page_bf16(ref), rows, size_t(n) * d);
    }
  }
}

#if CERTKV_ATTENTION_AVX2
// Sums of each of eight vectors, lane i of the result = horizontal sum of a[i].
inline __m256 horizontal_sums8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 t0123 = _mm256_hadd_ps(s01, s23);
  const __m256 t4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0123, t4567, 0x20),
                       _mm256_permute2f128_ps(t0123, t4567, 0x31));
}

inline float horizontal_sum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

using simd::exp_range_reduced8;

// e^x for x <= 0, 8 lanes; lanes below -87.3 give 0 (the float range ends near e^-87.3).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 lower = _mm256_set1_ps(-87.3f);
  const __m256 underflow = _mm256_cmp_ps(x, lower, _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, exp_range_reduced8(_mm256_max_ps(x, lower)));
}
#endif

// s[j] = scale * <q, k_j> for j < n_keys; k: [n_keys][d]. Returns max_j s[j].
// REQUIRES: n_keys >= 1, d % 8 == 0.
inline float scores_of_row(const float* q, const float* k, int n_keys, int d, float scale,
                           float* s) {
  int j = 0;
  float s_max = kMinusInfinity;
#if CERTKV_ATTENTION_AVX2
  if (n_keys >= 8) {
    __m256 max8 = _mm256_set1_ps(kMinusInfinity);
    for (; j + 8 <= n_keys; j += 8) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      const float* kj = k + size_t(j) * size_t(d);
      for (int c = 0; c < d; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int u = 0; u < 8; ++u) {
          acc[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj + size_t(u) * size_t(d) + c), acc[u]);
        }
      }
      const __m256 s8 = _mm256_mul_ps(horizontal_sums8(acc), _mm256_set1_ps(scale));
      _mm256_storeu_ps(s + j, s8);
      max8 = _mm256_max_ps(max8, s8);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, max8);
    for (float e : lanes) s_max = e > s_max ? e : s_max;
  }
  for (; j < n_keys; ++j) {
    const float* kj = k + size_t(j) * size_t(d);
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(kj + c), acc);
    s[j] = scale * horizontal_sum(acc);
    s_max = s[j] > s_max ? s[j] : s_max;
  }
#else
  for (; j < n_keys; ++j) {
    const float* kj = k + size_t(j) * size_t(d);
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int c = 0; c < d; c += 8) {
      for (int u = 0; u < 8; ++u) lanes[u] += q[c + u] * kj[c + u];
    }
    s[j] = scale * (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                    ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
    s_max = s[j] > s_max ? s[j] : s_max;
  }
#endif
  return s_max;
}

// s[j] = e^{s[j] - m} in place for j < n; returns their sum. REQUIRES: s[j] <= m.
inline float exp_shifted_and_sum(float* s, int n, float m) {
  float sum = 0.f;
  int j = 0;
#if CERTKV_ATTENTION_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = horizontal_sum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// acc[c] = acc[c] * alpha + sum_{j < n} p[j] v[j][c], c < d; v: [n][d]. REQUIRES: d % 8 == 0.
inline void rescale_and_accumulate(float* acc, float alpha, const float* p, const float* v, int n,
                                   int d) {
  int c = 0;
#if CERTKV_ATTENTION_AVX2
  const __m256 av = _mm256_set1_ps(alpha);
  // 64 channels at a time: eight independent chains of fused multiply-adds (four left the loop
  // bound by their latency). Every lane computes the same sequence whatever the chunk.
  for (; c + 64 <= d; c += 64) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8 * u), av);
    for (int j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v + size_t(j) * size_t(d) + c;
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), a[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(acc + c + 8 * u, a[u]);
  }
  for (; c + 32 <= d; c += 32) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + c), av);
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8), av);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 16), av);
    __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 24), av);
    for (int j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v + size_t(j) * size_t(d) + c;
      a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), a0);
      a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), a1);
      a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), a2);
      a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), a3);
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
  }
  for (; c < d; c += 8) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + c), av);
    for (int j = 0; j < n; ++j) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + size_t(j) * size_t(d) + c), a0);
    }
    _mm256_storeu_ps(acc + c, a0);
  }
#else
  for (; c < d; ++c) {
    float a = acc[c] * alpha;
    for (int j = 0; j < n; ++j) a += p[j] * v[size_t(j) * size_t(d) + c];
    acc[c] = a;
  }
#endif
}

// Online softmax update of one query row by keys/values [0, n_keys) of a float tile.
// k, v: [n_keys][d]; acc: [d]; s: scratch of n_keys floats. REQUIRES: n_keys >= 1, d % 8 == 0.
inline void update_row(const float* q, const float* k, const float* v, int n_keys, int d,
                       float scale, RowState* state, float* acc, float* s) {
  const float tile_max = scores_of_row(q, k, n_keys, d, scale, s);
  const float m_new = tile_max > state->m ? tile_max : state->m;
  // 0 on the first tile (m = -inf); exactly 1, which std::exp(0) also gives, while the maximum
  // holds (most tiles after the first few): the exponential is then not evaluated.
  const float alpha = m_new == state->m ? 1.f : std::exp(state->m - m_new);
  const float tile_sum = exp_shifted_and_sum(s, n_keys, m_new);
  state->l = state->l * alpha + tile_sum;
  state->m = m_new;
  rescale_and_accumulate(acc, alpha, s, v, n_keys, d);
}

// acc[c] = (...((acc[c] alpha_0 + sum_{j in page 0} p[j] v[j][c]) alpha_1 + sum_{j in page 1} ...),
// pages of page_tokens keys (the last may be shorter): per lane the same operations, in the same
// order, as rescale_and_accumulate called once per page, with acc kept in registers between
// pages. REQUIRES: AVX2 (the portable path calls update_row per page instead); d % 8 == 0.
#if CERTKV_ATTENTION_AVX2
inline void rescale_and_accumulate_pages(float* acc, const float* alphas, const float* p,
                                         const float* v, int n, int page_tokens, int d) {
  int c = 0;
  auto run = [&]<int kVectors>() {
    __m256 a[kVectors];
    for (int u = 0; u < kVectors; ++u) a[u] = _mm256_loadu_ps(acc + c + 8 * u);
    for (int j0 = 0, page = 0; j0 < n; j0 += page_tokens, ++page) {
      const __m256 av = _mm256_set1_ps(alphas[page]);
      for (int u = 0; u < kVectors; ++u) a[u] = _mm256_mul_ps(a[u], av);
      const int j1 = j0 + page_tokens < n ? j0 + page_tokens : n;
      for (int j = j0; j < j1; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* vj = v + size_t(j) * size_t(d) + c;
        for (int u = 0; u < kVectors; ++u) a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), a[u]);
      }
    }
    for (int u = 0; u < kVectors; ++u) _mm256_storeu_ps(acc + c + 8 * u, a[u]);
  };
  for (; c + 64 <= d; c += 64) run.template operator()<8>();
  for (; c + 32 <= d; c += 32) run.template operator()<4>();
  for (; c < d; c += 8) run.template operator()<1>();
}
#endif

// The same floats as update_row called once per page of page_tokens keys of the tile, in page
// order (what decode_attention computes page by page), without storing acc between pages.
// k, v: [n_keys][d]; s: scratch of n_keys floats, alphas: of ceil(n_keys / page_tokens) floats.
inline void update_row_pages(const float* q, const float* k, const float* v, int n_keys,
                             int page_tokens, int d, float scale, RowState* state, float* acc,
                             float* s, float* alphas) {
#if CERTKV_ATTENTION_AVX2
  for (int j0 = 0, page = 0; j0 < n_keys; j0 += page_tokens, ++page) {
    const int n = n_keys - j0 < page_tokens ? n_keys - j0 : page_tokens;
    // As update_row, for one page.
    const float tile_max = scores_of_row(q, k + size_t(j0) * size_t(d), n, d, scale, s + j0);
    const float m_new = tile_max > state->m ? tile_max : state->m;
    const float alpha = m_new == state->m ? 1.f : std::exp(state->m - m_new);
    const float tile_sum = exp_shifted_and_sum(s + j0, n, m_new);
    state->l = state->l * alpha + tile_sum;
    state->m = m_new;
    alphas[page] = alpha;
  }
  rescale_and_accumulate_pages(acc, alphas, s, v, n_keys, page_tokens, d);
#else
  (void)alphas;
  for (int j0 = 0; j0 < n_keys; j0 += page_tokens) {
    const int n = n_keys - j0 < page_tokens ? n_keys - j0 : page_tokens;
    update_row(q, k + size_t(j0) * size_t(d), v + size_t(j0) * size_t(d), n, d, scale, state, acc, s);
  }
#endif
}

// Per-token error data of positions [begin, end) of a lossy table, for the meter:
//   K tables, Tier A: the witness w_{t,b} (out: [end - begin][witness_bands]);
//   K tables, Tier B (dither8): the scales s_{t,g} (out: [end - begin][head_dim / kQuantGroup]);
//   V tables: rho_t >= ||v^_t - v_t|| (out: [end - begin]).
// Pages that are not lossy (bf16 tails, repaired or exact-fallback blocks) are exact: zeros.
// REQUIRES: r.lossy; begin % block_tokens == 0.
inline int key_bound_width(const codec::LossyPageSpec& spec) {
  return codec::lossy_scheme_is_tier_b(spec.scheme) ? spec.head_dim / codec::kQuantGroup : codec::witness_width(spec);
}

// MeterKernels::bounds_from_fp16's inline path: dst[i] = fp16 src[i] as float, i < n (exact), a
// value below 0 or NaN read as +inf.
inline void fp16_to_float_rows(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#if defined(__F16C__) && CERTKV_ATTENTION_AVX2
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity()), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_blendv_ps(v, inf, _mm256_cmp_ps(v, zero, _CMP_NGE_UQ)));
  }
#endif
  for (; i < n; ++i) {
    const float v = format::fp16_to_float(src[i]);
    dst[i] = v >= 0.f ? v : std::numeric_limits<float>::infinity();
  }
}

inline void bounds_from_fp16(const uint16_t* src, size_t src_stride, int rows, int n, float* dst, size_t dst_stride) {
  for (int i = 0; i < rows; ++i) fp16_to_float_rows(src + size_t(i) * src_stride, dst + size_t(i) * dst_stride, size_t(n));
}

// rho_t of a dither8 V page from its scales, codec::dither8_value_rho in float:
// rho_t = (1/2 + slack) sqrt(32 sum_g s_{t,g}^2) (V pages keep no outliers). s^2 and 32 s^2 are
// exact in float (an fp16 s has 11 bits); the sum of at most 8 terms, the square root and the
// product round by less than 2^-21 relative, covered by lifting the result by 2^-20.
// scales: [groups][stride] band-major; rho: [n].
inline void dither8_rho_from_scales(const float* scales, size_t stride, int groups, int64_t n, float* rho) {
  const float r = (0.5f + codec::kDither8Slack) * (1.0f + 1.0f / 1048576.0f);
  int64_t j = 0;
#if CERTKV_ATTENTION_AVX2
  // Eight tokens at a time, each lane the loop below: sum = fma(32 s, s, sum) over the groups.
  for (; j + 8 <= n; j += 8) {
    __m256 sum_sq = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      const __m256 sg = _mm256_loadu_ps(scales + size_t(g) * stride + size_t(j));
      sum_sq = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(float(codec::kQuantGroup)), sg), sg, sum_sq);
    }
    _mm256_storeu_ps(rho + j, _mm256_mul_ps(_mm256_set1_ps(r), _mm256_sqrt_ps(sum_sq)));
  }
#endif
  for (; j < n; ++j) {
    float sum_sq = 0.f;
    for (int g = 0; g < groups; ++g) {
      const float sg = scales[size_t(g) * stride + size_t(j)];
      sum_sq += float(codec::kQuantGroup) * sg * sg;
    }
    rho[j] = r * std::sqrt(sum_sq);
  }
}

inline const MeterKernels& meter_kernels();  // below, with the inline paths it may choose

// The Tier A side data of rows [0, n) of one lossy page, band-major: K pages the witness
// w_{t,b} (dst[b * stride + t], b < key_bound_width), V pages rho_t (dst[t]).
inline void tier_a_error_data(const TableReader& r, const uint8_t* bytes, int64_t n, float* dst, size_t stride) {
  const codec::LossyPageSpec& spec = *r.lossy;
  const int bt = spec.block_tokens;
  const int width = spec.key ? key_bound_width(spec) : 1;
  if (spec.key && spec.witness == codec::WitnessCode::kExponent) {
    // No stored witness: each channel's bound u_{t,c} from its code (a band per channel).
    codec::exponent_witness_bounds(bytes, spec.head_dim, int(n), dst, stride);
    return;
  }
  if (spec.key && spec.witness != codec::WitnessCode::kFp16) {
    // A coded witness, read back as floats straight into the band-major rows.
    codec::page_scaled_witness_bounds(bytes + r.side_offset, width, bt, int(n), dst, stride);
    return;
  }
  // Tier A side data is band-major [width][bt] (docs/format/lossy_pages.md).
  meter_kernels().bounds_from_fp16(reinterpret_cast<const uint16_t*>(bytes + r.side_offset), size_t(bt), width, int(n),
                                   dst, stride);
}

// Per-token error data of positions [begin, end) of a lossy table, band-major:
// out[b * stride + (t - begin)] for b < width (key_bound_width for K tables, 1 for V tables):
//   K tables, Tier A: the witness w_{t,b};  K tables, Tier B (dither8): the scales s_{t,g};
//   V tables: rho_t >= ||v^_t - v_t||.
// Pages that are not lossy (bf16 tails, repaired or exact-fallback blocks) are exact: zeros.
// The reference meter's reader; decode attention gets the same data from load_tile_metered.
// REQUIRES: r.lossy; begin % block_tokens == 0; stride >= end - begin.
inline void load_error_data(const TableReader& r, int64_t begin, int64_t end, float* out,
                            size_t stride) {
  const cache::KvCache& cache = *r.cache;
  const codec::LossyPageSpec& spec = *r.lossy;
  const int64_t bt = cache.block_tokens();
  const int width = spec.key ? key_bound_width(spec) : 1;
  const bool tier_b = codec::lossy_scheme_is_tier_b(spec.scheme);
  thread_local std::vector<float> page;
  for (int64_t start = begin; start < end; start += bt) {
    const int64_t n = end - start < bt ? end - start : bt;
    const format::PageRef ref = r.table[start / bt];
    float* dst = out + size_t(start - begin);
    const bool lossy_page = ref.storage == format::StorageClass::kLossy ||
                            ref.storage == format::StorageClass::kDither8;
    if (!lossy_page) {
      for (int b = 0; b < width; ++b) std::fill(dst + size_t(b) * stride, dst + size_t(b) * stride + size_t(n), 0.f);
      continue;
    }
    const uint8_t* bytes = cache.page_bytes_of(ref);
    if (tier_b) {
      const int width_scales = spec.head_dim / codec::kQuantGroup;
      page.resize(size_t(bt) * size_t(width_scales));
      codec::dither8_scales(spec, bytes, page.data());  // [bt][width]
      if (spec.key) {
        for (int64_t j = 0; j < n; ++j)
          for (int b = 0; b < width; ++b) dst[size_t(b) * stride + size_t(j)] = page[size_t(j) * size_t(width) + size_t(b)];
      } else {
        // Band-major, then rho from the scales.
        std::vector<float> band_major(size_t(width_scales) * size_t(bt));
        for (int64_t j = 0; j < n; ++j)
          for (int g = 0; g < width_scales; ++g)
            band_major[size_t(g) * size_t(bt) + size_t(j)] = page[size_t(j) * size_t(width_scales) + size_t(g)];
        dither8_rho_from_scales(band_major.data(), size_t(bt), width_scales, n, dst);
      }
    } else {
      tier_a_error_data(r, bytes, n, dst, stride);
    }
  }
}

// load_tile and load_error_data of a lossy table in one pass over its pages (decode attention's
// metered path): rows [end - begin][head_dim] as load_tile gives them, and the error data
// band-major, err[b * stride + (t - begin)], as load_error_data gives it. dither8 pages give
// their scales from the decoding pass itself (no second read of the page's scales).
// REQUIRES: r.lossy; begin % block_tokens == 0; stride >= end - begin.
inline void load_tile_metered(const TableReader& r, int64_t begin, int64_t end, float* rows_out,
                              float* err, size_t stride) {
  const cache::KvCache& cache = *r.cache;
  const codec::LossyPageSpec& spec = *r.lossy;
  const int64_t bt = cache.block_tokens();
  const size_t d = size_t(cache.head_dim());
  const int width = spec.key ? key_bound_width(spec) : 1;
  const bool tier_b = codec::lossy_scheme_is_tier_b(spec.scheme);
  for (int64_t start = begin; start < end; start += bt) {
    const int64_t n = end - start < bt ? end - start : bt;
    const format::PageRef ref = r.table[start / bt];
    float* rows = rows_out + size_t(start - begin) * d;
    float* dst = err + size_t(start - begin);
    const bool lossy_page = ref.storage == format::StorageClass::kLossy ||
                            ref.storage == format::StorageClass::kDither8;
    if (!lossy_page) {
      load_tile(r, start, start + n, rows);
      for (int b = 0; b < width; ++b) std::fill(dst + size_t(b) * stride, dst + size_t(b) * stride + size_t(n), 0.f);
      continue;
    }
    const uint8_t* bytes = cache.page_bytes_of(ref);
    const uint32_t block = uint32_t(start / bt);
    if (!tier_b) {
      r.lossy_decoder->decode(block, bytes, int(n), rows);
      tier_a_error_data(r, bytes, n, dst, stride);
    } else if (spec.key) {
      r.lossy_decoder->decode(block, bytes, int(n), rows, dst, stride);
    } else {
      float scales[(256 / codec::kQuantGroup) * 64];  // [groups][bt], bt <= 64 here
      if (bt <= 64) {
        r.lossy_decoder->decode(block, bytes, int(n), rows, scales, size_t(bt));
        dither8_rho_from_scales(scales, size_t(bt), spec.head_dim / codec::kQuantGroup, n, dst);
      } else {
        r.lossy_decoder->decode(block, bytes, int(n), rows);
        load_error_data(r, start, start + n, dst, stride);
      }
    }
  }
}

// What one query row contributes to the per-token logit bounds c_t (DESIGN.md section 4):
//   Tier A (Theorem 2):  c_t = |scale| sum_b ||q_b|| w_{t,b};  weight[b] = |scale| ||q_b||.
//   Tier B (Lemma 2):    c_t = sqrt(2 sigma_t^2 log(2 S / delta_loc)) + |scale| kDither8Slack
//                              sum_g (sum_{c in g} |q_c|) s_{t,g},
//                        sigma_t^2 = scale^2 sum_g (sum_{c in g} q_c^2) s_{t,g}^2 / 12,
//   sums over the channels that are not outliers (those are exact).
//   The exponent witness (codec::WitnessCode::kExponent, a band per channel): Theorem 2 with
//                        ||q_b|| = |q_c| and w = u_{t,c}:  c_t = |scale| sum_c |q_c| u_{t,c}.
//                        For the page-rows kernel, which makes the bound from the codes in the
//                        scores' pass (page_rows.h), also abs_scale = |scale| and
//                        q_term = 2^-10 sum_c |q_c| rounded up.
struct QueryBoundWeights {
  bool tier_b = false;
  int width = 0;
  float weight[256];     // Tier A: |scale| ||q_b||;  Tier B: scale^2 sum q_c^2 / 12 * 2 log(2S/delta)
  float abs_weight[256];  // Tier B: |scale| kDither8Slack sum |q_c|
  float abs_scale = 0.f;  // the exponent witness
  float q_term = 0.f;     // the exponent witness
};

// The smallest float >= x, for x >= 0 (+inf above float's range): float(x) rounds to nearest, and
// where that fell below x the next float up is one more in the bits (from +0 too, and from the
// largest float to +inf).
inline float float_upward(double x) {
  float f = float(x);
  if (double(f) < x) f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) + 1u);
  return f;
}

// exponent_weights: the exponent witness's weight[c] (its band-per-channel form); the page-rows
// kernel, which makes the bound from the codes, reads only abs_scale and q_term.
// Written into *out (decode attention's per-row scratch: the struct holds 2 KiB of weights, of
// which a row fills its width).
inline void query_bound_weights(const codec::LossyPageSpec& spec, const float* q, float scale, int64_t n_ctx,
                                double delta_loc, bool exponent_weights, QueryBoundWeights* out) {
  QueryBoundWeights& w = *out;
  w.abs_scale = 0.f;
  w.q_term = 0.f;
  const int d = spec.head_dim;
  w.tier_b = codec::lossy_scheme_is_tier_b(spec.scheme);
  w.width = key_bound_width(spec);
  double acc[64] = {0}, acc_abs[64] = {0};
  if (w.tier_b) {
    bool outlier[256] = {false};
    for (int i = 0; i < spec.n_outlier_pairs; ++i)
      for (int which = 0; which < 2; ++which)
        outlier[codec::rope_pair_channel(spec.pairing, d, spec.outlier_pairs[i], which)] = true;
    for (int c = 0; c < d; ++c) {
      if (outlier[c]) continue;
      acc[c / codec::kQuantGroup] += double(q[c]) * q[c];
      acc_abs[c / codec::kQuantGroup] += std::fabs(double(q[c]));
    }
    const double log_term = 2.0 * std::log(2.0 * double(n_ctx) / delta_loc);
    for (int g = 0; g < w.width; ++g) {
      w.weight[g] = float(double(scale) * scale * acc[g] / 12.0 * log_term);
      w.abs_weight[g] = float(std::fabs(double(scale)) * codec::kDither8Slack * acc_abs[g]);
    }
  } else if (spec.witness == codec::WitnessCode::kExponent) {
    // 2^-10 sum |q_c| in double (eight independent sums, so the loop vectorizes): at most 256
    // additions of non-negative terms, relative error below 2^-45, lifted by 2^-40, rounded up.
    double abs_sum[8] = {};
    for (int c0 = 0; c0 < d; c0 += 8)
      for (int i = 0; i < 8; ++i) abs_sum[i] += std::fabs(double(q[c0 + i]));
    const double sum = ((abs_sum[0] + abs_sum[1]) + (abs_sum[2] + abs_sum[3])) +
                       ((abs_sum[4] + abs_sum[5]) + (abs_sum[6] + abs_sum[7]));
    w.abs_scale = std::fabs(scale);
    w.q_term = float_upward(std::ldexp(sum, -10) * (1.0 + 0x1p-40));
    if (exponent_weights) {
      // weight[c] = |scale| |q_c| (exact in double), lifted by 2^-14 and rounded up to float (not
      // 2^-16 as the bands below): logit_bounds then sums up to 256 terms (head_dim) where the
      // bands sum 64 at most; a float sum of n non-negative terms is at least (1 - 2^-24)^(n + 1)
      // of its exact value, and 2^-14 = 1024 2^-24 covers n + 1 <= 257. (As on the other Tier A
      // paths, a product below float's normal range, 2^-126, may lose up to 2^-150; the page-rows
      // kernel's upward rounding has no such exception.)
      for (int c = 0; c < d; ++c) {
        w.weight[c] = float_upward(std::fabs(double(scale)) * std::fabs(double(q[c])) * (1.0 + 0x1p-14));
        w.abs_weight[c] = 0.f;
      }
    }
    return;
  } else {
    // In float (this runs for every query row of every split): the squares, each pair's sum,
    // then band by band over its pairs in pair order. A band sums at most 2 P / n_bands <= 16
    // non-negative terms, so with the square root, |scale| and the cast the weight is within
    // 24 2^-24 (< 2^-19) of its exact value, far inside the 2^-16 nudge below.
    float pair_sq[128];
    const int n_pairs = d / 2;
    for (int j = 0; j < n_pairs; ++j) {
      const float x0 = q[codec::rope_pair_channel(spec.pairing, d, j, 0)];
      const float x1 = q[codec::rope_pair_channel(spec.pairing, d, j, 1)];
      pair_sq[j] = x0 * x0 + x1 * x1;
    }
    const float abs_scale = std::fabs(scale);
    for (int b = 0, j = 0; b < w.width; ++b) {
      float band = 0.f;
      for (const int end = codec::witness_band_first_pair(d, b + 1); j < end; ++j) band += pair_sq[j];
      w.weight[b] = abs_scale * std::sqrt(band);
      w.abs_weight[b] = 0.f;
    }
  }
  // Float rounding of the weights and of the sums in logit_bounds (at most 64 positive terms)
  // must not lower the bound: nudge each weight up by 2^-16 relative.
  for (int g = 0; g < w.width; ++g) {
    w.weight[g] *= 1.0f + 1.0f / 65536.0f;
    w.abs_weight[g] *= 1.0f + 1.0f / 65536.0f;
  }
}

inline QueryBoundWeights query_bound_weights(const codec::LossyPageSpec& spec, const float* q, float scale,
                                             int64_t n_ctx, double delta_loc, bool exponent_weights = true) {
  QueryBoundWeights w;
  query_bound_weights(spec, q, scale, n_ctx, delta_loc, exponent_weights, &w);
  return w;
}

// c[j] for the keys of a tile. bounds_t: [width][tile_keys] (load_error_data, band-major).
// Sixteen keys at a time with four independent sums (two key halves x even and odd bands), so
// that the loop over bands is not one chain of dependent FMAs.
// kTierB: w.tier_b, fixed per page class (decode_attention's policies).
template <bool kTierB>
inline void logit_bounds(const QueryBoundWeights& w, const float* bounds_t, size_t tile_keys,
                         int n_keys, float* c) {
  int j = 0;
#if CERTKV_ATTENTION_AVX2
  for (; j + 16 <= n_keys; j += 16) {
    // a*: keys j..j+7, b*: keys j+8..j+15; *0 even bands, *1 odd bands.
    __m256 la0 = _mm256_setzero_ps(), la1 = la0, lb0 = la0, lb1 = la0;
    __m256 qa0 = la0, qa1 = la0, qb0 = la0, qb1 = la0;
    int g = 0;
    for (; g + 2 <= w.width; g += 2) {
      const float* r0 = bounds_t + size_t(g) * tile_keys + size_t(j);
      const float* r1 = r0 + tile_keys;
      const __m256 a0 = _mm256_loadu_ps(r0), b0 = _mm256_loadu_ps(r0 + 8);
      const __m256 a1 = _mm256_loadu_ps(r1), b1 = _mm256_loadu_ps(r1 + 8);
      const __m256 w0 = _mm256_set1_ps(kTierB ? w.abs_weight[g] : w.weight[g]);
      const __m256 w1 = _mm256_set1_ps(kTierB ? w.abs_weight[g + 1] : w.weight[g + 1]);
      la0 = _mm256_fmadd_ps(w0, a0, la0);
      lb0 = _mm256_fmadd_ps(w0, b0, lb0);
      la1 = _mm256_fmadd_ps(w1, a1, la1);
      lb1 = _mm256_fmadd_ps(w1, b1, lb1);
      if constexpr (kTierB) {
        const __m256 v0 = _mm256_set1_ps(w.weight[g]), v1 = _mm256_set1_ps(w.weight[g + 1]);
        qa0 = _mm256_fmadd_ps(_mm256_mul_ps(v0, a0), a0, qa0);
        qb0 = _mm256_fmadd_ps(_mm256_mul_ps(v0, b0), b0, qb0);
        qa1 = _mm256_fmadd_ps(_mm256_mul_ps(v1, a1), a1, qa1);
        qb1 = _mm256_fmadd_ps(_mm256_mul_ps(v1, b1), b1, qb1);
      }
    }
    if (g < w.width) {
      const float* r0 = bounds_t + size_t(g) * tile_keys + size_t(j);
      const __m256 a0 = _mm256_loadu_ps(r0), b0 = _mm256_loadu_ps(r0 + 8);
      const __m256 w0 = _mm256_set1_ps(kTierB ? w.abs_weight[g] : w.weight[g]);
      la0 = _mm256_fmadd_ps(w0, a0, la0);
      lb0 = _mm256_fmadd_ps(w0, b0, lb0);
      if constexpr (kTierB) {
        const __m256 v0 = _mm256_set1_ps(w.weight[g]);
        qa0 = _mm256_fmadd_ps(_mm256_mul_ps(v0, a0), a0, qa0);
        qb0 = _mm256_fmadd_ps(_mm256_mul_ps(v0, b0), b0, qb0);
      }
    }
    __m256 ca = _mm256_add_ps(la0, la1), cb = _mm256_add_ps(lb0, lb1);
    if constexpr (kTierB) {
      ca = _mm256_add_ps(_mm256_sqrt_ps(_mm256_add_ps(qa0, qa1)), ca);
      cb = _mm256_add_ps(_mm256_sqrt_ps(_mm256_add_ps(qb0, qb1)), cb);
    }
    _mm256_storeu_ps(c + j, ca);
    _mm256_storeu_ps(c + j + 8, cb);
  }
#endif
  for (; j < n_keys; ++j) {
    float var = 0.f, sum = 0.f;
    for (int g = 0; g < w.width; ++g) {
      const float b = bounds_t[size_t(g) * tile_keys + size_t(j)];
      if constexpr (kTierB) {
        var += w.weight[g] * b * b;
        sum += w.abs_weight[g] * b;
      } else {
        sum += w.weight[g] * b;
      }
    }
    c[j] = kTierB ? std::sqrt(var) + sum : sum;
  }
}

// The same, choosing the tier at run time (meter_ref).
inline void logit_bounds(const QueryBoundWeights& w, const float* bounds_t, size_t tile_keys, int n_keys, float* c) {
  if (w.tier_b) {
    logit_bounds<true>(w, bounds_t, tile_keys, n_keys, c);
  } else {
    logit_bounds<false>(w, bounds_t, tile_keys, n_keys, c);
  }
}

#if CERTKV_ATTENTION_AVX2
// e^c - 1 for 0 <= c < 88, 8 lanes, relative error below 1e-6: below 1/2 its Taylor series to
// c^9 / 9! (truncation below 3e-10 relative); above, e^c (c = n ln2 + r, |r| <= ln2 / 2, e^r by
// exp_range_reduced8) minus 1, which cancels nothing since e^c > 1.6.
inline __m256 expm1_nonnegative8(__m256 c) {
  __m256 t = _mm256_set1_ps(1.f / 362880.f);
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 40320.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 5040.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 720.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 120.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 24.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f / 6.f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(0.5f));
  t = _mm256_fmadd_ps(t, c, _mm256_set1_ps(1.f));
  const __m256 small = _mm256_mul_ps(t, c);
  const __m256 is_small = _mm256_cmp_ps(c, _mm256_set1_ps(0.5f), _CMP_LT_OQ);
  // Every lane below 1/2 (the usual case of an informative meter): the exponential is not needed.
  if (_mm256_movemask_ps(is_small) == 0xff) return small;
  const __m256 large = _mm256_sub_ps(exp_range_reduced8(c), _mm256_set1_ps(1.f));
  return _mm256_blendv_ps(large, small, is_small);
}
#endif

// Meter state of one query row beside its RowState, in the scaling of l (the running sum of
// e^{s~_t - m}): A - 1 = sum_t p~_t (e^{c_t} - 1) = d / l, so
//   d   = sum_t e^{s~_t - m} (e^{c_t} - 1)   (double: e^{c_t} may be large),
//   rho = sum_t e^{s~_t - m} rho_t.
// Carrying A - 1 rather than A keeps the bound's rounding relative to its own size.
struct MeterRow {
  double d;
  float rho;
};


// Whether some c[j] is at or above kLargeLogitBound, or NaN (an overflow: the meter is 1).
inline bool any_large_bound(const float* c, int n_keys) {
  int j = 0;
#if CERTKV_ATTENTION_AVX2
  const __m256 limit = _mm256_set1_ps(kLargeLogitBound);
  for (; j + 8 <= n_keys; j += 8)
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(c + j), limit, _CMP_NLT_UQ)) != 0) return true;
#endif
  for (; j < n_keys; ++j)
    if (!(c[j] < kLargeLogitBound)) return true;
  return false;
}

// sum_j a[j] b[j].
inline float dot(const float* a, const float* b, int n) {
  int j = 0;
  float sum = 0.f;
#if CERTKV_ATTENTION_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  sum = horizontal_sum(acc);
#endif
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// sum_j p[j] (e^{c[j]} - 1) over the keys whose bound is below kLargeLogitBound.
inline float weighted_expm1_sum(const float* p, const float* c, int n_keys) {
  int j = 0;
  float sum = 0.f;
#if CERTKV_ATTENTION_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 limit = _mm256_set1_ps(kLargeLogitBound);
  for (; j + 8 <= n_keys; j += 8) {
    const __m256 cj = _mm256_loadu_ps(c + j);
    const __m256 below = _mm256_cmp_ps(cj, limit, _CMP_LT_OQ);  // false for NaN and large bounds
    const __m256 e = expm1_nonnegative8(_mm256_and_ps(cj, below));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(p + j), _mm256_and_ps(e, below), acc);
  }
  sum = horizontal_sum(acc);
#endif
  for (; j < n_keys; ++j)
    if (c[j] < kLargeLogitBound) sum += p[j] * std::expm1(c[j]);
  return sum;
}

// The group forms of the paths above: each row's floats those of the one-row calls.
template <bool kTierB>
inline void group_bounds(const QueryBoundWeights* w, int group, const float* bounds_t, size_t tile_keys, int n_keys,
                         float* c, uint8_t* large) {
  for (int g = 0; g < group; ++g) {
    float* cg = c + size_t(g) * tile_keys;
    logit_bounds<kTierB>(w[g], bounds_t, tile_keys, n_keys, cg);
    large[g] = any_large_bound(cg, n_keys) ? 1 : 0;
  }
}

inline void group_sums(const float* p, const float* c, const float* rho, size_t tile_keys, int group, int n_keys,
                       float* d, float* r) {
  for (int g = 0; g < group; ++g) {
    d[g] = weighted_expm1_sum(p + size_t(g) * tile_keys, c + size_t(g) * tile_keys, n_keys);
    r[g] = dot(p + size_t(g) * tile_keys, rho, n_keys);
  }
}

// The meter kernels decode attention uses: AVX-512 where codec::lossy_best_kernel() is (the page
// decoders' choice, so CERTKV_LOSSY_KERNEL caps both), else the paths above.
inline const MeterKernels& meter_kernels() {
  static const MeterKernels* const chosen = [] {
    static const MeterKernels inline_paths{
        &any_large_bound,
        [](const float* p, const float* c, const float* rho, int n_keys, float* d, float* r) {
          *d = weighted_expm1_sum(p, c, n_keys);
          *r = dot(p, rho, n_keys);
        },
        &group_bounds<false>,
        &group_bounds<true>,
        &group_sums,
        &bounds_from_fp16};
    const MeterKernels* avx512 = meter_kernels_avx512();
    return avx512 != nullptr && codec::lossy_best_kernel() == codec::LossyKernel::kAvx512 ? avx512 : &inline_paths;
  }();
  return *chosen;
}

// update_row of a metered tile, less the meter's sums: with c: [n_keys] the row's logit bounds
// and has_large whether one of them is at or above kLargeLogitBound (or NaN), returns the
// contribution of those keys to the meter's d in double, sum_j e^{s~_j - m' + c_j} (e^{c_j} would
// leave float's range; NaN when a bound is NaN), and sets alpha = e^{m - m'}. s holds the row's
// e^{s~_j - m'} afterwards, for the sums (MeterKernels::sums or group_sums).
inline double update_row_unsummed(const float* q, const float* k, const float* v, int n_keys, int d, float scale,
                                  const float* c, bool has_large, RowState* state, float* acc, float* s,
                                  float* alpha_out) {
  const float tile_max = scores_of_row(q, k, n_keys, d, scale, s);
  const float m_new = tile_max > state->m ? tile_max : state->m;
  // As in update_row: exactly 1, std::exp(0)'s value, while the maximum holds.
  const float alpha = m_new == state->m ? 1.f : std::exp(state->m - m_new);
  double large = 0;
  if (has_large) {
    for (int j = 0; j < n_keys; ++j)
      if (!(c[j] < kLargeLogitBound)) large += std::exp(double(s[j]) - double(m_new) + double(c[j]));
  }
  const float tile_sum = exp_shifted_and_sum(s, n_keys, m_new);
  state->l = state->l * alpha + tile_sum;
  state->m = m_new;
  rescale_and_accumulate(acc, alpha, s, v, n_keys, d);
  *alpha_out = alpha;
  return large;
}

// The meter row's update by a tile whose sums are d_tile, rho_tile and large term `large`.
inline void add_meter_tile(MeterRow* meter, float alpha, float d_tile, float rho_tile, double large) {
  meter->d = meter->d * double(alpha) + double(d_tile) + large;
  meter->rho = meter->rho * alpha + rho_tile;
}

// update_row plus the meter: c: [n_keys] logit bounds, rho: [n_keys] value error bounds.
inline void update_row_metered(const float* q, const float* k, const float* v, int n_keys, int d,
                               float scale, const float* c, const float* rho, RowState* state,
                               MeterRow* meter, float* acc, float* s) {
  const MeterKernels& mk = meter_kernels();
  float alpha;
  const double large =
      update_row_unsummed(q, k, v, n_keys, d, scale, c, mk.any_large_bound(c, n_keys), state, acc, s, &alpha);
  float d_tile, rho_tile;
  mk.sums(s, c, rho, n_keys, &d_tile, &rho_tile);
  add_meter_tile(meter, alpha, d_tile, rho_tile, large);
}

}  // namespace certkv::attention::detail
