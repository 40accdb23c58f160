#!/usr/bin/env bash
# The main job on a fresh machine: install, fetch the embedded default model, build, and run
# `certkv run` on it. Extra arguments go to `certkv run`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install_deps.sh"
bash "$root/scripts/fetch_models.sh"
bash "$root/scripts/build.sh"
"$root/build/tools/certkv/certkv" run "$@"
