#!/usr/bin/env bash
# Builds llama.cpp's CUDA llama-batched-bench on the device machine, offline,
# from the llama.cpp sources inside the llama-cpp-python sdist on PyPI: the peer of the H200
# end-to-end benchmarks (docs/cuda.md). sm_90 only; flash attention kernels for the f16 and q8_0
# KV types the benchmarks use (GGML_CUDA_FA_ALL_QUANTS off).
#
# usage (repository root, `carry: [".peers"]`): bash bench/llama_cuda_build.sh [BUILD_DIR]
#   prints the directory holding the binaries on its last line.
#
# The payload .peers/llama-cpp-src.tar.gz (untracked, ~7 MB), made on a machine with PyPI:
#   python3 -m pip download --no-deps --no-binary=:all: -d /tmp/lcp llama-cpp-python==0.3.36
#   tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
#   cd /tmp/lcp/llama_cpp_python-0.3.36/vendor && tar czf .../.peers/llama-cpp-src.tar.gz \
#     --exclude='llama.cpp/models' --exclude='llama.cpp/docs' --exclude='llama.cpp/tests' \
#     --exclude='llama.cpp/examples' --exclude='llama.cpp/tools/ui' --exclude='llama.cpp/benches' \
#     --exclude='llama.cpp/app' --exclude='llama.cpp/tools/server' \
#     --exclude='llama.cpp/ggml/src/ggml-'{sycl,vulkan,opencl,metal,cann,hexagon} \
#     --exclude='llama.cpp/.git*' llama.cpp
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-/tmp/llama-cuda}
src=$(dirname "$build")/llama-cuda-src
payload=$root/.peers/llama-cpp-src.tar.gz
[ -f "$payload" ] || { echo "llama_cuda_build: no $payload (see this script's header)" >&2; exit 1; }
rm -rf "$src" && mkdir -p "$src"
tar xzf "$payload" -C "$src"
cmake -S "$src/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$build.configure.log"
cmake --build "$build" -j"$(nproc)" --target llama-batched-bench >"$build.build.log" 2>&1 ||
  { tail -30 "$build.build.log" >&2; exit 1; }
echo "$build/bin"
