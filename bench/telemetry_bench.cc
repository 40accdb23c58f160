// Cost of recording one (layer, head, step) meter cell in the telemetry (gate/telemetry.h), with
// and without sampling. A SmolLM2 decode step records 30 x 9 = 270 cells; compare 270 x the time
// per cell with the decode step's time (docs/meter.md).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "gate/telemetry.h"

namespace {

void BM_TelemetryRecord(benchmark::State& state) {
  certkv::gate::Telemetry telemetry(0.2, state.range(0));
  std::mt19937_64 rng(1);
  std::lognormal_distribution<double> meter(-4.0, 2.0);
  std::vector<double> cells(4096);
  for (double& c : cells) c = std::min(1.0, meter(rng));
  size_t i = 0;
  for (auto _ : state) {
    telemetry.record(cells[i]);
    i = (i + 1) & 4095;
  }
  benchmark::DoNotOptimize(telemetry.coverage());
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_TelemetryRecord)->Arg(1)->Arg(32);

}  // namespace
