#!/usr/bin/env bash
# Installs what building and testing certkv needs on a fresh Debian machine (run as root):
# compiler, CMake, GoogleTest, Google Benchmark, zstd and lz4 (for bench/codec_bench.cc), nlohmann-json
# (the CLI's JSON input and output, the server), cpp-httplib (the server),
# pkg-config, Python 3 with NumPy (scripts/witness_study.py) and prometheus_client (the server test
# parses /metrics with it), unzip; git and xz-utils (the device scripts' tests pack and check out
# trees); chromium (the server's dashboard is tested in headless Chromium, tests/server_dashboard_check.py),
# without its recommended packages; the openai Python client (tests/server_openai_check.py);
# nanobind, scikit-build-core, pytest and ml_dtypes (the Python package, tests/python); torch
# (CPU wheel) and transformers where PyTorch's wheel index is reached. Skips what is already there.
set -euo pipefail
need=()
for pkg in g++ cmake make libgtest-dev libgmock-dev libbenchmark-dev libzstd-dev liblz4-dev nlohmann-json3-dev libcpp-httplib-dev pkg-config python3 unzip git xz-utils; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "certkv set-up: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}"
fi
# Chromium for the dashboard's test, without its recommended packages (fonts, themes, extensions).
if ! dpkg -s chromium >/dev/null 2>&1; then
  echo "certkv set-up: installing chromium"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium
fi
# NumPy for the python3 on PATH (which may not be Debian's): Debian's package when that python3
# is Debian's, else pip.
if ! python3 -c 'import numpy' 2>/dev/null; then
  echo "certkv set-up: installing NumPy for $(command -v python3)"
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-numpy
  else
    python3 -m pip install -q numpy
  fi
  python3 -c 'import numpy' || { echo "certkv set-up: NumPy did not install" >&2; exit 1; }
fi
# prometheus_client for the same python3, the same way.
if ! python3 -c 'import prometheus_client' 2>/dev/null; then
  echo "certkv set-up: installing prometheus_client for $(command -v python3)"
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-prometheus-client
  else
    python3 -m pip install -q prometheus_client
  fi
  python3 -c 'import prometheus_client' || { echo "certkv set-up: prometheus_client did not install" >&2; exit 1; }
fi
# The official openai client for the same python3 (the server's client test), from PyPI: Debian
# has no package of it; Debian's own python3 needs pip and --break-system-packages (PEP 668).
if ! python3 -c 'import openai' 2>/dev/null; then
  echo "certkv set-up: installing openai for $(command -v python3)"
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq python3-pip
    fi
    python3 -m pip install -q --break-system-packages openai
  else
    python3 -m pip install -q openai
  fi
  python3 -c 'import openai' || { echo "certkv set-up: openai did not install" >&2; exit 1; }
fi
# The Python package's build and tests (docs/python.md) for the same python3, from PyPI: nanobind
# (the bindings), scikit-build-core (pip wheel ., tests/python_wheel_check.sh), pytest, ml_dtypes
# (its bfloat16 arrays in tests/python); Debian's python3 also
# needs its headers (python3-dev) and pip's --break-system-packages (PEP 668).
if ! python3 -c 'import nanobind, scikit_build_core, pytest, ml_dtypes' 2>/dev/null; then
  echo "certkv set-up: installing nanobind, scikit-build-core, pytest and ml_dtypes for $(command -v python3)"
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    if ! dpkg -s python3-dev python3-pip >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq python3-dev python3-pip
    fi
    python3 -m pip install -q --break-system-packages nanobind scikit-build-core pytest ml_dtypes
  else
    python3 -m pip install -q nanobind scikit-build-core pytest ml_dtypes
  fi
  python3 -c 'import nanobind, scikit_build_core, pytest, ml_dtypes' || { echo "certkv set-up: nanobind, scikit-build-core, pytest or ml_dtypes did not install" >&2; exit 1; }
fi
# PyTorch and transformers for the same python3, at the versions certkv.transformers is written
# and tested against: certkv.transformers and certkv.torch_ops, and their tests
# (tests/python/test_transformers.py, test_torch_ops.py). torch comes from PyTorch's CPU wheel
# index where it can be reached (about 200 MB), else from PyPI (its Linux build, whose CUDA
# libraries come with it: about 5 GB installed, a minute here; it runs on the CPU all the same).
# A torch or transformers already installed is kept, whatever its version.
pip_user_flags=()
[ "$(command -v python3)" = /usr/bin/python3 ] && pip_user_flags=(--break-system-packages)
torch_version=2.11.0 transformers_version=5.17.0
if ! python3 -c 'import torch' 2>/dev/null; then
  echo "certkv set-up: installing torch $torch_version for $(command -v python3)"
  python3 -m pip install -q --retries 1 --timeout 15 "${pip_user_flags[@]}" "torch==$torch_version" \
    --index-url https://download.pytorch.org/whl/cpu ||
    { echo "certkv set-up: no torch $torch_version from PyTorch's CPU wheel index (the reason is above); installing it from PyPI" >&2
      python3 -m pip install -q "${pip_user_flags[@]}" "torch==$torch_version"; } ||
    echo "certkv set-up: torch did not install; certkv.transformers' tests will be skipped" >&2
fi
if python3 -c 'import torch' 2>/dev/null && ! python3 -c 'import transformers' 2>/dev/null; then
  echo "certkv set-up: installing transformers $transformers_version for $(command -v python3)"
  python3 -m pip install -q "${pip_user_flags[@]}" "transformers==$transformers_version"
  python3 -c 'import transformers' || { echo "certkv set-up: transformers did not install" >&2; exit 1; }
fi
# matplotlib for the same python3, the same way as NumPy: the plots of the benchmarks
# (bench/serve_vs_llama_server.py, scripts/cuda_bench_summary.py --plot).
if ! python3 -c 'import matplotlib' 2>/dev/null; then
  echo "certkv set-up: installing matplotlib for $(command -v python3)"
  if [ "$(command -v python3)" = /usr/bin/python3 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-matplotlib
  else
    python3 -m pip install -q matplotlib
  fi
  python3 -c 'import matplotlib' || { echo "certkv set-up: matplotlib did not install" >&2; exit 1; }
fi
