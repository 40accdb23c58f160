#!/usr/bin/env bash
# The main job on a fresh machine: install, fetch the embedded default model, build what
# `certkv run` needs and run it. Extra arguments go to `certkv run`.
# Only the certkv tool is built (no tests, no benchmarks, no CUDA), in its own folder build-run/,
# so the first command is quick and never disturbs the test build in build/ (scripts/test.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install_deps.sh"
bash "$root/scripts/fetch_models.sh"
cmake -S "$root" -B "$root/build-run" -DCMAKE_BUILD_TYPE=Release \
  -DCERTKV_BUILD_TESTS=OFF -DCERTKV_BUILD_BENCH=OFF -DCERTKV_CUDA=OFF >/dev/null
cmake --build "$root/build-run" -j"$(nproc)" --target certkv_cli
exec "$root/build-run/tools/certkv/certkv" run "$@"
