// How tight the exponent witness of fp8-e4m3 pages is against the fp16 witness, on real KV
// (docs/meter.md section 7): a plain program over `certkv dump-kv` files (docs/format/kv_dump.md),
// one JSON object on stdout.
//
//   certkv_witness_tightness DUMP.safetensors [--tau 0.2]
//
// For every dumped layer the keys and values go into two fp8-e4m3 caches, one per witness, and the
// dump's queries (the last position's, every query head) are attended over all of them (whole
// blocks; a partial last block stays exact in both). Per (layer, query head, token) it takes the
// engine's double-precision bound of each witness (attention::meter_logit_bound_ref on the page's
// error data) and reports the ratio exponent / fp16 (quantiles over tokens with a nonzero fp16
// bound, and the p~-weighted mean per cell); per (layer, query head) cell the meter of each witness
// on the production float path (attention::decode_attention, one thread), the true total variation
// (decode_true_tv_ref), the coverage at tau and the tightness meter / TV. Soundness is counted too,
// both expected 0 (exit status 1 otherwise): tokens whose exponent bound is below their true logit
// error |scale q . (k^ - k)|, and cells whose meter (either witness) is below their TV.
// A third bound, for the meter's cost (docs/server.md): the fp16 witness with each band's largest
// value over the token's page of 16 (a bound per page and band, as if stored at encode), against
// the per-token one: per cell the ratio of the p~-weighted c and of the logit term sum p~ (e^c - 1).
// The same page bound used only where the page carries little of the row's attention (a mass-gated
// bound, for the meter's cost): processing pages in order as decode attention does, a page whose
// largest score is more than delta below the running maximum of the pages before it takes the
// page bound, every other page the per-token one (either is an upper bound of the page's share of
// A - 1, so any such choice stays sound); per cell the logit term over the per-token one's, and
// the fraction of (cell, page) pairs that take the page bound, for delta 4, 8, 12 and 16.
// And how much the exponent witness's meter moves when its inputs move by one bf16 step, as the
// device's keys and values do (bf16 weight products, docs/cuda.md): every element of the dump's K
// and V moved one bf16 step up or down with probability 1/4 each (a fixed seed), the meters of the
// cells below 1 compared with the unmoved ones' (`perturbed_exponent`).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/decode_attention.h"
#include "attention/online_softmax.h"
#include "cache/kv_cache.h"
#include "codec/lossy_page.h"
#include "core/status.h"
#include "format/numeric.h"
#include "format/safetensors.h"

namespace {

using certkv::attention::AttentionShape;
using certkv::attention::HeadMeter;
namespace cache = certkv::cache;
namespace codec = certkv::codec;

double quantile(std::vector<double> x, double q) {
  if (x.empty()) return NAN;
  std::sort(x.begin(), x.end());
  const size_t i = std::min(x.size() - 1, size_t(q * double(x.size() - 1) + 0.5));
  return x[i];
}

std::string meta(const certkv::format::SafetensorsFile& f, const char* key) {
  const auto it = f.metadata().find(key);
  if (it == f.metadata().end()) certkv::fail(certkv::StatusCode::kInvalidArgument, std::string("dump lacks metadata ") + key);
  return it->second;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: certkv_witness_tightness DUMP.safetensors [--tau T]\n");
    return 2;
  }
  double tau = 0.2;
  for (int i = 2; i + 1 < argc; i += 2)
    if (std::strcmp(argv[i], "--tau") == 0) tau = std::atof(argv[i + 1]);
  try {
    const auto file = certkv::format::SafetensorsFile::open(argv[1]);
    const int d = std::stoi(meta(*file, "head_dim"));
    const int n_q = std::stoi(meta(*file, "n_heads"));
    const int n_kv = std::stoi(meta(*file, "n_kv_heads"));
    const int64_t n_tokens = std::stoll(meta(*file, "n_tokens"));
    const float scale = std::stof(meta(*file, "softmax_scale"));
    codec::RopePairing pairing;
    if (!codec::parse_rope_pairing(meta(*file, "rope_layout"), &pairing))
      certkv::fail(certkv::StatusCode::kInvalidArgument, "unknown rope_layout");
    std::vector<int> layers;
    for (const std::string list = meta(*file, "layers"); const auto& part : [&] {
           std::vector<std::string> out;
           size_t at = 0;
           while (at <= list.size()) {
             const size_t comma = std::min(list.find(',', at), list.size());
             out.push_back(list.substr(at, comma - at));
             at = comma + 1;
           }
           return out;
         }())
      layers.push_back(std::stoi(part));
    const int group = n_q / n_kv;
    const AttentionShape shape{n_q, n_kv, d, scale};
    std::vector<double> ratios, cell_ratios, page_c_ratios, page_term_ratios, meters[2], tv_all, tight[2];
    constexpr double kDeltas[] = {4, 8, 12, 16};
    constexpr int kGates = 4;
    std::vector<double> gated_term_ratios[kGates];
    int64_t gated_light_pages[kGates] = {0, 0, 0, 0}, gated_pages = 0;
    std::vector<double> moved;  // |meter moved - meter| / meter, exponent witness, cells below 1
    int64_t moved_cells = 0, moved_beyond_2pct = 0;
    std::mt19937_64 rng(99);
    int64_t unsound_tokens = 0, unsound_cells = 0, cells = 0, covered[2] = {0, 0};
    uint64_t fallback_blocks = 0;
    for (const int layer : layers) {
      const auto* kt = file->find("layer" + std::to_string(layer) + ".k");
      const auto* vt = file->find("layer" + std::to_string(layer) + ".v");
      const auto* qt = file->find("layer" + std::to_string(layer) + ".q");
      if (!kt || !vt || !qt) certkv::fail(certkv::StatusCode::kInvalidArgument, "dump lacks layer tensors");
      // [n_kv][N][d] bf16 -> [N][n_kv][d] float, as the cache's write takes them.
      std::vector<float> k(size_t(n_tokens) * n_kv * d), v(k.size());
      const uint16_t* kb = reinterpret_cast<const uint16_t*>(kt->data);
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(vt->data);
      for (int h = 0; h < n_kv; ++h)
        for (int64_t t = 0; t < n_tokens; ++t)
          for (int c = 0; c < d; ++c) {
            const size_t from = (size_t(h) * size_t(n_tokens) + size_t(t)) * d + c;
            const size_t to = (size_t(t) * n_kv + size_t(h)) * d + c;
            k[to] = certkv::format::bf16_to_float(kb[from]);
            v[to] = certkv::format::bf16_to_float(vb[from]);
          }
      const float* q = reinterpret_cast<const float*>(qt->data);
      std::unique_ptr<cache::KvCache> caches[2];
      cache::SeqId seqs[2];
      for (int w = 0; w < 2; ++w) {
        cache::KvCacheConfig cfg;
        cfg.n_layers = 1;
        cfg.n_kv_heads = n_kv;
        cfg.head_dim = d;
        cfg.block_tokens = 16;
        cfg.max_tokens = n_tokens + 16;
        cfg.scheme = cache::KvScheme::kFp8E4M3;
        cfg.rope_pairing = pairing;
        cfg.witness = w == 0 ? codec::WitnessCode::kFp16 : codec::WitnessCode::kExponent;
        caches[w] = std::make_unique<cache::KvCache>(cfg);
        seqs[w] = caches[w]->create_sequence();
        caches[w]->reserve(seqs[w], n_tokens);
        caches[w]->write(seqs[w], 0, k.data(), v.data(), n_tokens);
        caches[w]->commit(seqs[w], n_tokens);
      }
      fallback_blocks += caches[1]->memory_stats().exact_fallback_blocks;
      std::vector<HeadMeter> got[2];
      for (int w = 0; w < 2; ++w) {
        got[w].resize(size_t(n_q));
        std::vector<float> out(size_t(n_q) * d);
        certkv::attention::DecodeOptions options;
        options.meters = got[w].data();
        options.n_splits = 1;
        certkv::attention::decode_attention(*caches[w], seqs[w], 0, shape, q, n_tokens, out.data(), nullptr, options);
      }
      {
        // The exponent witness over K and V moved by one bf16 step in half their elements.
        std::vector<float> k_moved(k), v_moved(v);
        for (std::vector<float>* x : {&k_moved, &v_moved})
          for (float& e : *x) {
            const int r = int(rng() % 4);
            uint16_t b = certkv::format::float_to_bf16(e);
            if (r < 2 || (b & 0x7fff) == 0) continue;
            e = certkv::format::bf16_to_float(uint16_t(r == 2 ? b + 1 : b - 1));
          }
        cache::KvCacheConfig cfg = caches[1]->config();
        cache::KvCache moved_cache(cfg);
        const cache::SeqId seq = moved_cache.create_sequence();
        moved_cache.reserve(seq, n_tokens);
        moved_cache.write(seq, 0, k_moved.data(), v_moved.data(), n_tokens);
        moved_cache.commit(seq, n_tokens);
        std::vector<HeadMeter> m(static_cast<size_t>(n_q));
        std::vector<float> out(size_t(n_q) * d);
        certkv::attention::DecodeOptions options;
        options.meters = m.data();
        options.n_splits = 1;
        certkv::attention::decode_attention(moved_cache, seq, 0, shape, q, n_tokens, out.data(), nullptr, options);
        for (int h = 0; h < n_q; ++h) {
          const double a = got[1][size_t(h)].meter;
          if (!(a < 1.0)) continue;
          ++moved_cells;
          moved.push_back(std::fabs(double(m[size_t(h)].meter) - a) / a);
          moved_beyond_2pct += moved.back() > 0.02;
        }
      }
      std::vector<double> tv(static_cast<size_t>(n_q));
      certkv::attention::decode_true_tv_ref(*caches[1], seqs[1], 0, shape, q, n_tokens, tv.data());
      for (int kvh = 0; kvh < n_kv; ++kvh) {
        std::vector<float> bounds[2], k_exact(size_t(n_tokens) * d), k_hat(k_exact.size());
        caches[1]->read_token_range_exact(seqs[1], 0, cache::KvTensor::kKey, kvh, 0, n_tokens, k_exact.data());
        caches[1]->read_token_range_ref(seqs[1], 0, cache::KvTensor::kKey, kvh, 0, n_tokens, k_hat.data());
        certkv::attention::detail::TableReader tables[2] = {
            certkv::attention::detail::table_reader(*caches[0], seqs[0], 0, cache::KvTensor::kKey, kvh),
            certkv::attention::detail::table_reader(*caches[1], seqs[1], 0, cache::KvTensor::kKey, kvh)};
        int widths[2];
        for (int w = 0; w < 2; ++w) {
          widths[w] = certkv::attention::detail::key_bound_width(*tables[w].lossy);
          bounds[w].resize(size_t(widths[w]) * size_t(n_tokens));
          certkv::attention::detail::load_error_data(tables[w], 0, n_tokens, bounds[w].data(), size_t(n_tokens));
        }
        for (int g = 0; g < group; ++g) {
          const int h = kvh * group + g;
          const float* qh = q + size_t(h) * d;
          // p~ over the stored keys, for the weighted mean of the ratio.
          std::vector<double> s(static_cast<size_t>(n_tokens));
          double s_max = -INFINITY;
          for (int64_t t = 0; t < n_tokens; ++t) {
            double dot = 0;
            for (int c = 0; c < d; ++c) dot += double(qh[c]) * k_hat[size_t(t) * d + c];
            s[size_t(t)] = double(scale) * dot;
            s_max = std::max(s_max, s[size_t(t)]);
          }
          double z = 0, num = 0, den = 0, c_page_sum = 0, term_key = 0, term_page = 0;
          const std::vector<double> score = s;  // the logits, before the exponentials
          std::vector<double> e_key(static_cast<size_t>(n_tokens)), e_page(static_cast<size_t>(n_tokens));
          for (double& x : s) z += (x = std::exp(x - s_max));
          // The fp16 witness's band maxima over each page of 16 tokens.
          std::vector<float> page_max(bounds[0].size());
          for (int b = 0; b < widths[0]; ++b)
            for (int64_t p0 = 0; p0 < n_tokens; p0 += 16) {
              const int64_t p1 = std::min<int64_t>(n_tokens, p0 + 16);
              float m = 0.f;
              for (int64_t t = p0; t < p1; ++t) m = std::max(m, bounds[0][size_t(b) * size_t(n_tokens) + size_t(t)]);
              for (int64_t t = p0; t < p1; ++t) page_max[size_t(b) * size_t(n_tokens) + size_t(t)] = m;
            }
          for (int64_t t = 0; t < n_tokens; ++t) {
            double c[2];
            for (int w = 0; w < 2; ++w) {
              std::vector<float> bt(static_cast<size_t>(widths[w]));
              for (int b = 0; b < widths[w]; ++b) bt[size_t(b)] = bounds[w][size_t(b) * size_t(n_tokens) + size_t(t)];
              c[w] = certkv::attention::meter_logit_bound_ref(*tables[w].lossy, qh, scale, bt.data(), n_tokens, 1e-6);
            }
            {
              std::vector<float> bt(static_cast<size_t>(widths[0]));
              for (int b = 0; b < widths[0]; ++b) bt[size_t(b)] = page_max[size_t(b) * size_t(n_tokens) + size_t(t)];
              const double c_page = certkv::attention::meter_logit_bound_ref(*tables[0].lossy, qh, scale, bt.data(), n_tokens, 1e-6);
              const double w = s[size_t(t)] / z;
              c_page_sum += w * c_page;
              e_key[size_t(t)] = w * std::expm1(c[0]);
              e_page[size_t(t)] = w * std::expm1(c_page);
              term_key += e_key[size_t(t)];
              term_page += e_page[size_t(t)];
            }
            long double err = 0;
            for (int c2 = 0; c2 < d; ++c2)
              err += (long double)qh[c2] * ((long double)k_hat[size_t(t) * d + c2] - (long double)k_exact[size_t(t) * d + c2]);
            err = std::fabs(err) * std::fabs((long double)scale);
            unsound_tokens += (long double)c[1] < err;
            if (c[0] > 0) ratios.push_back(c[1] / c[0]);
            num += s[size_t(t)] / z * c[1];
            den += s[size_t(t)] / z * c[0];
          }
          if (den > 0) cell_ratios.push_back(num / den);
          if (den > 0) page_c_ratios.push_back(c_page_sum / den);
          if (term_key > 0) page_term_ratios.push_back(term_page / term_key);
          for (int gi = 0; gi < kGates; ++gi) {
            double running = -INFINITY, term = 0;
            for (int64_t p0 = 0; p0 < n_tokens; p0 += 16) {
              const int64_t p1 = std::min<int64_t>(n_tokens, p0 + 16);
              double page_top = -INFINITY;
              for (int64_t t = p0; t < p1; ++t) page_top = std::max(page_top, score[size_t(t)]);
              const bool light = page_top < running - kDeltas[gi];
              for (int64_t t = p0; t < p1; ++t) term += light ? e_page[size_t(t)] : e_key[size_t(t)];
              gated_light_pages[gi] += light;
              if (gi == 0) ++gated_pages;
              running = std::max(running, page_top);
            }
            if (term_key > 0) gated_term_ratios[gi].push_back(term / term_key);
          }
          ++cells;
          tv_all.push_back(tv[size_t(h)]);
          for (int w = 0; w < 2; ++w) {
            const double m = got[w][size_t(h)].meter;
            meters[w].push_back(m);
            covered[w] += m <= tau;
            unsound_cells += m < tv[size_t(h)];
            if (tv[size_t(h)] > 1e-12 && m < 1) tight[w].push_back(m / tv[size_t(h)]);
          }
        }
      }
    }
    const char* names[2] = {"fp16", "exponent"};
    std::printf("{\"dump\": \"%s\", \"layers\": %zu, \"cells\": %lld, \"tokens_per_cell\": %lld, \"tau\": %g,\n", argv[1],
                layers.size(), (long long)cells, (long long)n_tokens, tau);
    std::printf(" \"exact_fallback_blocks_exponent\": %llu, \"unsound_tokens\": %lld, \"unsound_cells\": %lld,\n",
                (unsigned long long)fallback_blocks, (long long)unsound_tokens, (long long)unsound_cells);
    std::printf(" \"c_ratio_exponent_over_fp16\": {\"tokens\": %zu, \"min\": %.4f, \"p10\": %.4f, \"median\": %.4f, "
                "\"p90\": %.4f, \"max\": %.4f},\n",
                ratios.size(), quantile(ratios, 0), quantile(ratios, 0.1), quantile(ratios, 0.5), quantile(ratios, 0.9),
                quantile(ratios, 1));
    std::printf(" \"c_ratio_p_weighted_per_cell\": {\"min\": %.4f, \"median\": %.4f, \"max\": %.4f},\n",
                quantile(cell_ratios, 0), quantile(cell_ratios, 0.5), quantile(cell_ratios, 1));
    std::printf(" \"page_band_max_over_token_fp16\": {\"c_p_weighted_per_cell\": {\"min\": %.4f, \"median\": %.4f, "
                "\"p90\": %.4f, \"max\": %.4f}, \"logit_term_per_cell\": {\"min\": %.4f, \"median\": %.4f, \"p90\": %.4f, "
                "\"max\": %.4f}},\n",
                quantile(page_c_ratios, 0), quantile(page_c_ratios, 0.5), quantile(page_c_ratios, 0.9),
                quantile(page_c_ratios, 1), quantile(page_term_ratios, 0), quantile(page_term_ratios, 0.5),
                quantile(page_term_ratios, 0.9), quantile(page_term_ratios, 1));
    std::printf(" \"mass_gated_page_bound\": [");
    for (int gi = 0; gi < kGates; ++gi)
      std::printf("%s{\"delta\": %g, \"light_page_fraction\": %.4f, \"term_ratio_median\": %.4f, "
                  "\"term_ratio_p90\": %.4f, \"term_ratio_max\": %.4f}",
                  gi ? ", " : "", kDeltas[gi], double(gated_light_pages[gi]) / double(std::max<int64_t>(gated_pages, 1)),
                  quantile(gated_term_ratios[gi], 0.5), quantile(gated_term_ratios[gi], 0.9),
                  quantile(gated_term_ratios[gi], 1.0));
    std::printf("],\n");
    std::printf(" \"perturbed_exponent\": {\"cells_below_1\": %lld, \"beyond_2pct\": %lld, \"rel_median\": %.4g, "
                "\"rel_p90\": %.4g, \"rel_p99\": %.4g, \"rel_max\": %.4g},\n",
                (long long)moved_cells, (long long)moved_beyond_2pct, quantile(moved, 0.5), quantile(moved, 0.9),
                quantile(moved, 0.99), quantile(moved, 1));
    std::printf(" \"true_tv\": {\"median\": %.6g, \"max\": %.6g},\n", quantile(tv_all, 0.5), quantile(tv_all, 1));
    for (int w = 0; w < 2; ++w)
      std::printf(" \"meter_%s\": {\"median\": %.6g, \"p90\": %.6g, \"coverage_at_tau\": %.4f, \"tightness_q50\": %.4g, "
                  "\"informative_cells\": %zu}%s\n",
                  names[w], quantile(meters[w], 0.5), quantile(meters[w], 0.9), double(covered[w]) / double(cells),
                  quantile(tight[w], 0.5), tight[w].size(), w == 0 ? "," : "");
    std::printf("}\n");
    return unsound_tokens == 0 && unsound_cells == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "certkv_witness_tightness: %s\n", e.what());
    return 1;
  }
}
