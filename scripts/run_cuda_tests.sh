#!/usr/bin/env bash
# Builds the CUDA tests here (no GPU needed to build; portable x86-64 code, no -march=native)
# and prints the device command that runs them. On a machine with a GPU, pass --run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$root" -B "$root/build-cuda" -DCERTKV_CUDA=ON -DCERTKV_NATIVE=OFF -DCERTKV_BUILD_BENCH=OFF >/dev/null
cmake --build "$root/build-cuda" -j"$(nproc)" --target certkv_attention_cuda_tests
bin=build-cuda/src/attention/certkv_attention_cuda_tests
if [ "${1:-}" = "--run" ]; then
  "$root/$bin"
  compute-sanitizer --tool memcheck "$root/$bin"
else
  echo "built $bin; on the GPU machine: ./$bin && compute-sanitizer --tool memcheck ./$bin"
fi
