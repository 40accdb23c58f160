#!/usr/bin/env bash
# Installs what building and testing certkv needs on a fresh Debian machine (run as root):
# compiler, CMake, GoogleTest, Google Benchmark, zstd and lz4 (for bench/codec_bench.cc),
# pkg-config, Python 3, unzip; git and xz-utils (the device scripts' tests pack and check out
# trees). Skips what is already there.
set -euo pipefail
need=()
for pkg in g++ cmake make libgtest-dev libgmock-dev libbenchmark-dev libzstd-dev liblz4-dev pkg-config python3 unzip git xz-utils; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "certkv set-up: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}"
fi
