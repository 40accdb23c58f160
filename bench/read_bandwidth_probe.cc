// The rate at which this CPU's cores stream bytes from memory, the floor under a decode step that
// must read its weights and its KV pages once (docs/engine.md, "What bounds it"): T threads each
// sum its share of a 256 MiB buffer with 64-byte loads (two independent accumulators), five
// passes, the best and the median of the passes printed. Not part of the build; run it by hand:
//   g++ -O2 -march=native -pthread bench/read_bandwidth_probe.cc -o /tmp/read_probe && /tmp/read_probe 1 && /tmp/read_probe 2
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  if (threads < 1 || threads > 256) {
    std::fprintf(stderr, "usage: read_bandwidth_probe [threads 1..256]\n");
    return 2;
  }
  const size_t bytes = size_t(256) << 20;
  auto* buffer = static_cast<unsigned char*>(std::aligned_alloc(64, bytes));
  if (buffer == nullptr) return 1;
  std::memset(buffer, 1, bytes);  // touched: every page mapped before the timed passes
  std::vector<double> rates;
  float sink = 0.f;
  for (int pass = 0; pass < 5; ++pass) {
    std::vector<float> sums(size_t(threads), 0.f);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const size_t share = bytes / size_t(threads) / 128 * 128;
        const unsigned char* p = buffer + size_t(t) * share;
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (size_t i = 0; i < share; i += 128) {
          a = _mm256_add_ps(a, _mm256_add_ps(_mm256_load_ps(reinterpret_cast<const float*>(p + i)),
                                             _mm256_load_ps(reinterpret_cast<const float*>(p + i + 32))));
          b = _mm256_add_ps(b, _mm256_add_ps(_mm256_load_ps(reinterpret_cast<const float*>(p + i + 64)),
                                             _mm256_load_ps(reinterpret_cast<const float*>(p + i + 96))));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(a, b));
        for (float x : lanes) sums[size_t(t)] += x;
      });
    for (std::thread& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(double(bytes) / s / 1e9);
    for (float x : sums) sink += x;
  }
  std::sort(rates.begin(), rates.end());
  std::printf("{\"threads\": %d, \"bytes\": %zu, \"gb_per_s_best\": %.1f, \"gb_per_s_median\": %.1f, \"sink\": %g}\n",
              threads, bytes, rates.back(), rates[rates.size() / 2], double(sink));
  std::free(buffer);
  return 0;
}
