#!/usr/bin/env bash
# Builds certkv and runs the whole test suite (unit, end-to-end on the real model, CLI).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The tests read the public-domain corpus and the tiny model fixtures of the shared folder that
# sits beside the repository (CMake's CERTKV_SHARED_DIR).
if [ ! -d "$root/../shared/data/corpus" ] || [ ! -d "$root/../shared/data/models" ]; then
  echo "test.sh: $root/../shared/data (corpus and model fixtures) is missing; the tests need it" >&2
  exit 1
fi
bash "$root/scripts/install_deps.sh"
bash "$root/scripts/fetch_models.sh" --all
bash "$root/scripts/build.sh" -DCERTKV_BUILD_TESTS=ON
cd "$root/build"
ctest --output-on-failure -j"$(nproc)"
