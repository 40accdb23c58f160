// The int8 multiply-add rate of one core through AMX tiles against AVX-512 VNNI, for the batched
// products of docs/engine.md ("Since then"): four independent 16 x 64 by 64 x 16 tile products
// (tdpbusd) in a loop, then eight independent vpdpbusd chains. Not part of the build (it needs a
// CPU and kernel with AMX); run it by hand:
//   g++ -O2 -march=native -mamx-tile -mamx-int8 bench/amx_probe.cc -o /tmp/amx_probe && /tmp/amx_probe
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for the tile data state
constexpr long kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("amx_probe: the kernel grants no AMX tile state here\n");
    return 1;
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static uint8_t a[2 * 16 * 64];
  alignas(64) static int8_t b[2 * 16 * 64];
  alignas(64) static int32_t c[16 * 16];
  for (int i = 0; i < 2 * 16 * 64; ++i) {
    a[i] = uint8_t(i * 7);
    b[i] = int8_t(i * 13);
  }
  constexpr int kIters = 4000000;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 1024, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 1024, 64);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  const double amx_s = seconds_since(t0);
  _tile_stored(0, c, 64);
  _tile_release();
  std::printf("AMX tdpbusd:   %8.1f GMAC/s on one core (%.3f s; c[0] %d)\n", double(kIters) * 4 * 16 * 16 * 64 / amx_s / 1e9,
              amx_s, c[0]);

  __m512i acc[8];
  for (auto& x : acc) x = _mm512_setzero_si512();
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters * 4; ++i) {
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_dpbusd_epi32(acc[k], x, y);
  }
  const double vnni_s = seconds_since(t0);
  int32_t sink = 0;
  for (auto& v : acc) sink += _mm512_reduce_add_epi32(v);
  std::printf("VNNI vpdpbusd: %8.1f GMAC/s on one core (%.3f s; sum %d)\n", double(kIters) * 4 * 8 * 64 / vnni_s / 1e9,
              vnni_s, sink);
  return 0;
}
