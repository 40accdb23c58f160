// The rate at which one core retires fused multiply-adds of 16 floats, the floor under decode
// attention's float pass (docs/attention.md, "Where this leaves the goals": 112 of them a token
// and layer at Qwen2.5-0.5B's shape): 12 independent accumulator chains, more than an FMA's
// latency times the pipes that run it, so the loop is bound by their throughput; five passes, the
// best and the median printed. Not part of the build; run it by hand on an AVX-512 CPU:
//   g++ -O2 -mavx512f -mfma bench/fma_rate_probe.cc -o /tmp/fma_probe && /tmp/fma_probe
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  constexpr int kChains = 12;
  constexpr long kIterations = 100000000;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.0001f);
  std::vector<double> rates;
  for (int pass = 0; pass < 5; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < kIterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
      // The chains stay in registers and the loop stays: the compiler may not fold or hoist them.
      __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]),
                       "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]), "+v"(acc[10]), "+v"(acc[11]));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(double(kIterations) * kChains / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  float sink = 0.f;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("{\"g_fma16_per_s_best\": %.2f, \"g_fma16_per_s_median\": %.2f, \"sink\": %g}\n", rates.back(),
              rates[rates.size() / 2], double(sink));
  return 0;
}
