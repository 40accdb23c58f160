// The rate at which one core retires fused multiply-adds of 16 floats, the floor under decode
// attention's float pass (docs/attention.md, "Where this leaves the goals": 112 of them a token
// and layer at Qwen2.5-0.5B's shape), and with the argument `dpbusd` the rate of vpdpbusd (64
// byte products summed into 16 int32 lanes), the floor under the int8 weight products
// (docs/engine.md, "What bounds the 8-vs-1 ratio on the Zen 5 host"): 12 independent accumulator
// chains, more than an instruction's latency times the pipes that run it, so the loop is bound by
// their throughput; five passes, the best and the median printed. Not part of the build; run it by
// hand on an AVX-512 CPU (VNNI for dpbusd):
//   g++ -O2 -march=native bench/fma_rate_probe.cc -o /tmp/fma_probe && /tmp/fma_probe && /tmp/fma_probe dpbusd
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kChains = 12;
constexpr long kIterations = 100000000;

// Giga-instructions a second of op over kChains chains, five passes, sorted.
template <class V, class Op>
std::vector<double> rates(V (&acc)[kChains], Op op) {
  std::vector<double> out;
  for (int pass = 0; pass < 5; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < kIterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = op(acc[i]);
      // The chains stay in registers and the loop stays: the compiler may not fold or hoist them.
      __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                       "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.push_back(double(kIterations) * kChains / s / 1e9);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "dpbusd") == 0) {
    __m512i acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
    const std::vector<double> r = rates(acc, [&](__m512i a) { return _mm512_dpbusd_epi32(a, x, y); });
    int sink = 0;
    for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
    std::printf("{\"g_dpbusd_per_s_best\": %.2f, \"g_dpbusd_per_s_median\": %.2f, \"gmac_per_s_median\": %.0f, \"sink\": %d}\n",
                r.back(), r[r.size() / 2], 64 * r[r.size() / 2], sink);
    return 0;
  }
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.0001f);
  const std::vector<double> r = rates(acc, [&](__m512 a) { return _mm512_fmadd_ps(a, x, y); });
  float sink = 0.f;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("{\"g_fma16_per_s_best\": %.2f, \"g_fma16_per_s_median\": %.2f, \"sink\": %g}\n", r.back(),
              r[r.size() / 2], double(sink));
  return 0;
}
