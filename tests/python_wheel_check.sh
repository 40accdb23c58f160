#!/usr/bin/env bash
# The Python package as a user builds it (docs/python.md): `pip wheel .` on the checkout
# (scikit-build-core and nanobind of the set-up, no build isolation: CI needs no index), then the
# wheel unpacked alone, with no build tree on the path, imports, finds its libcertkv.so through
# the module's RPATH and runs: a GAAC round trip, a Tier A row, four tokens of generation.
# usage: python_wheel_check.sh SOURCE_DIR MODEL
set -euo pipefail
src=$(cd "$1" && pwd)
model=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip wheel --no-build-isolation --no-deps \
  -w "$work/dist" "$src" >"$work/wheel.log" 2>&1; then
  cat "$work/wheel.log" >&2
  echo "python_wheel_check: FAILED: pip wheel $src" >&2
  exit 1
fi
echo "pip wheel: $(($(date +%s) - start)) s, $(basename "$work"/dist/certkv-*.whl)"
python3 -m zipfile -e "$work"/dist/certkv-*.whl "$work/site"
cd "$work"
PYTHONPATH="$work/site" CERTKV_MODEL="$model" python3 - "$work/site" <<'PY'
import sys

import numpy as np

import certkv

assert certkv.__file__.startswith(sys.argv[1]), certkv.__file__
rows = np.random.default_rng(0).integers(0x3E00, 0x4100, (40, 64)).astype(np.uint16)
cal = certkv.codec.calibrate(rows)
assert np.array_equal(certkv.codec.decode(certkv.codec.encode(rows, cal)), rows)
q = np.ones(64, dtype=np.float32)
k = np.zeros((3, 64), dtype=np.float32)
assert certkv.meter.tier_a(q, k, k + 0.01).meter > 0
result = certkv.Session(kv="fp8-e4m3").generate("Name a colour.", max_tokens=4)
assert result.text and result.certificate["metered"], result
print("wheel", certkv.__version__, "runs:", repr(result.text))
PY
