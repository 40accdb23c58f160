#include "reference_logits.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace certkv::testing {

ReferenceLogits read_reference_logits(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t pos = 0;
  auto take = [&](void* dst, size_t n) {
    if (n > bytes.size() - pos) throw std::runtime_error(path + ": truncated");
    memcpy(dst, bytes.data() + pos, n);
    pos += n;
  };
  char magic[8];
  take(magic, 8);
  if (memcmp(magic, "CKVLOGIT", 8) != 0) throw std::runtime_error(path + ": bad magic");
  uint32_t version, n_full;
  ReferenceLogits r;
  take(&version, 4);
  if (version != 1) throw std::runtime_error(path + ": unknown version");
  take(&r.n_vocab, 4);
  take(&r.n_tokens, 4);
  take(&r.top_k, 4);
  take(&n_full, 4);
  r.tokens.resize(r.n_tokens);
  take(r.tokens.data(), 4 * size_t(r.n_tokens));
  r.top_ids.resize(size_t(r.n_tokens) * r.top_k);
  r.top_logits.resize(r.top_ids.size());
  for (size_t i = 0; i < r.top_ids.size(); ++i) {
    take(&r.top_ids[i], 4);
    take(&r.top_logits[i], 4);
  }
  r.full_positions.resize(n_full);
  take(r.full_positions.data(), 4 * size_t(n_full));
  r.full_logits.resize(size_t(n_full) * r.n_vocab);
  take(r.full_logits.data(), 4 * r.full_logits.size());
  if (pos != bytes.size()) throw std::runtime_error(path + ": trailing bytes");
  return r;
}

Agreement compare_logits(const ReferenceLogits& ref, const std::vector<float>& logits) {
  Agreement a;
  const size_t V = ref.n_vocab, K = ref.top_k;
  double topk_sum = 0;
  size_t topk_n = 0, top1_hits = 0;
  double top5_sum = 0;
  std::vector<int32_t> order(V);
  for (size_t p = 0; p < ref.n_tokens; ++p) {
    const float* row = &logits[p * V];
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 5, order.end(), [&](int32_t x, int32_t y) {
      return row[x] > row[y] || (row[x] == row[y] && x < y);
    });
    if (order[0] == ref.top_ids[p * K]) ++top1_hits;
    int overlap = 0;
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 5; ++j) overlap += order[i] == ref.top_ids[p * K + j];
    top5_sum += overlap / 5.0;
    for (size_t k = 0; k < K; ++k) {
      const double d = std::fabs(double(row[ref.top_ids[p * K + k]]) - ref.top_logits[p * K + k]);
      topk_sum += d;
      a.topk_max_abs = std::max(a.topk_max_abs, d);
      ++topk_n;
    }
  }
  a.top1 = double(top1_hits) / ref.n_tokens;
  a.top5_overlap = top5_sum / ref.n_tokens;
  a.topk_mean_abs = topk_sum / double(topk_n);
  double full_sum = 0;
  for (size_t f = 0; f < ref.full_positions.size(); ++f) {
    const float* ours = &logits[size_t(ref.full_positions[f]) * V];
    const float* theirs = &ref.full_logits[f * V];
    double ss = 0;
    double m_ref = -1e300, m_ours = -1e300;
    for (size_t v = 0; v < V; ++v) {
      const double d = double(ours[v]) - theirs[v];
      ss += d * d;
      full_sum += std::fabs(d);
      a.full_max_abs = std::max(a.full_max_abs, std::fabs(d));
      m_ref = std::max(m_ref, double(theirs[v]));
      m_ours = std::max(m_ours, double(ours[v]));
    }
    a.full_rms_max = std::max(a.full_rms_max, std::sqrt(ss / V));
    double z_ref = 0, z_ours = 0;
    for (size_t v = 0; v < V; ++v) {
      z_ref += std::exp(theirs[v] - m_ref);
      z_ours += std::exp(ours[v] - m_ours);
    }
    double kl = 0;
    for (size_t v = 0; v < V; ++v) {
      const double lp = theirs[v] - m_ref - std::log(z_ref);
      const double lq = ours[v] - m_ours - std::log(z_ours);
      kl += std::exp(lp) * (lp - lq);
    }
    a.kl_max = std::max(a.kl_max, kl);
  }
  a.full_mean_abs = full_sum / double(ref.full_positions.size() * V);
  return a;
}

std::string Agreement::summary() const {
  char buf[512];
  snprintf(buf, sizeof buf,
           "top1 %.4f, top5 overlap %.4f, top-k |d| mean %.4f max %.3f, full |d| mean %.4f max %.3f, "
           "worst RMS %.4f, max KL %.5f",
           top1, top5_overlap, topk_mean_abs, topk_max_abs, full_mean_abs, full_max_abs, full_rms_max, kl_max);
  return buf;
}

}  // namespace certkv::testing
