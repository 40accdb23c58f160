#!/usr/bin/env bash
# Builds the CUDA tests and the GPU benchmark here (no GPU needed to build; portable x86-64 host
# code, no -march=native) and copies them to .devbin/ (git-ignored), which a device command
# carries. On a machine with a GPU, pass --run: the cross-backend harness, then the same under
# compute-sanitizer memcheck (the out-of-memory test is left out there: its refused cudaMalloc
# is reported as an API error by the sanitizer).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--run" ]; then
  bin="$root/.devbin/certkv_attention_cuda_tests"
  "$bin"
  compute-sanitizer --tool memcheck --error-exitcode 9 "$bin" --gtest_filter='-*OutOfDevice*'
  exit 0
fi
cmake -S "$root" -B "$root/build-cuda" -DCERTKV_CUDA=ON -DCERTKV_NATIVE=OFF -DCERTKV_BUILD_BENCH=ON >/dev/null
cmake --build "$root/build-cuda" -j"$(nproc)" --target certkv_attention_cuda_tests certkv_cuda_decode_bench
mkdir -p "$root/.devbin"
cp "$root/build-cuda/src/attention/certkv_attention_cuda_tests" "$root/build-cuda/bench/certkv_cuda_decode_bench" "$root/.devbin/"
grep -qx '/.devbin/' "$root/.git/info/exclude" 2>/dev/null || echo '/.devbin/' >> "$root/.git/info/exclude"
echo "built .devbin/; on the GPU machine (carry .devbin): bash scripts/run_cuda_tests.sh --run"
