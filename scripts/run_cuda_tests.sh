#!/usr/bin/env bash
# Builds the CUDA tests and the GPU benchmark here (no GPU needed to build; x86-64-v3 host code,
# no -march=native) and copies them to .devbin/ (git-ignored), which a device command
# carries. With --stage-model, also stages the real model and two corpus books in .devmodel/
# (git-ignored) for the device route's end-to-end tests, the model split in two halves so that
# each device command's working tree stays under its 64 MiB: carry one half in a first call and
# copy it to /tmp/certkv_model/ there, then carry the other in the next call while the machine
# is warm; --run joins them.
#
# On a machine with a GPU, pass --run: the device page encoders, the device KV cache against the
# host cache, the cross-backend attention harness, then the same under compute-sanitizer memcheck (the out-of-memory test is left out
# there: its refused cudaMalloc is reported as an API error by the sanitizer), then, when
# .devmodel/ holds the model, the device route end to end on it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--run" ]; then
  cd "$root/.devbin"
  export CERTKV_REQUIRE_DEVICE=1  # here a missing device or route fails the tests instead of skipping them
  # Every step runs (one device call sees every failure); the exit status says whether any failed.
  failed=""
  step() { "$@" || failed="$failed [$*]"; }
  step ./certkv_codec_cuda_tests
  step ./certkv_cache_cuda_tests
  step ./certkv_attention_cuda_tests
  step ./certkv_backend_cuda_tests
  step compute-sanitizer --tool memcheck --error-exitcode 9 ./certkv_codec_cuda_tests
  step compute-sanitizer --tool memcheck --error-exitcode 9 ./certkv_cache_cuda_tests
  step compute-sanitizer --tool memcheck --error-exitcode 9 ./certkv_attention_cuda_tests --gtest_filter='-*OutOfDevice*'
  step compute-sanitizer --tool memcheck --error-exitcode 9 ./certkv_backend_cuda_tests
  staged="$root/.devmodel"
  mkdir -p /tmp/certkv_model
  cp "$staged"/model.part-* /tmp/certkv_model/ 2>/dev/null || true
  if [ -f /tmp/certkv_model/model.part-00 ] && [ -f /tmp/certkv_model/model.part-01 ]; then
    cat /tmp/certkv_model/model.part-0[01] > /tmp/certkv_model.gguf
    export CERTKV_TEST_MODEL=/tmp/certkv_model.gguf CERTKV_TEST_CORPUS="$staged"
    step ./certkv_device_e2e_tests
  else
    echo "run_cuda_tests: no model staged in .devmodel/ (scripts/run_cuda_tests.sh --stage-model): device route end to end not run"
  fi
  if [ -n "$failed" ]; then
    echo "run_cuda_tests: FAILED:$failed"
    exit 1
  fi
  echo "run_cuda_tests: every step passed"
  exit 0
fi
if [ "${1:-}" = "--stage-model" ]; then
  model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$model" ] || bash "$root/scripts/fetch_models.sh"
  rm -rf "$root/.devmodel" && mkdir -p "$root/.devmodel"
  split -n 2 -d "$model" "$root/.devmodel/model.part-"
  cp "$root/tests/data/corpus/austen-emma.txt" "$root/tests/data/corpus/melville-moby-dick.txt" "$root/.devmodel/"
  exclude=$(git -C "$root" rev-parse --path-format=absolute --git-path info/exclude)  # a worktree's .git is a file
  grep -qx '/.devmodel/' "$exclude" 2>/dev/null || echo '/.devmodel/' >> "$exclude"
  ls -la "$root/.devmodel"
  exit 0
fi
# x86-64-v3 (AVX2, FMA): any H200 host has it, and the host forward pass of the CUDA backend's
# tests and benchmarks would crawl on baseline x86-64. The CLI links libcertkv.so: its copy goes
# beside it in .devbin/, where the RPATH entry $ORIGIN finds it (this build tree's path does not
# exist on the device).
cmake -S "$root" -B "$root/build-cuda" -DCERTKV_CUDA=ON -DCERTKV_NATIVE=OFF -DCERTKV_BUILD_BENCH=ON \
  "-DCMAKE_CXX_FLAGS=-march=x86-64-v3" '-DCMAKE_BUILD_RPATH=$ORIGIN' >/dev/null
cmake --build "$root/build-cuda" -j"$(nproc)" --target certkv_attention_cuda_tests certkv_codec_cuda_tests certkv_cache_cuda_tests certkv_backend_cuda_tests \
  certkv_device_e2e_tests certkv_cuda_decode_bench certkv_cuda_matmul_bench certkv_backend_decode certkv_cli
mkdir -p "$root/.devbin"
cp "$root/build-cuda/src/attention/certkv_attention_cuda_tests" "$root/build-cuda/src/codec/certkv_codec_cuda_tests" \
  "$root/build-cuda/src/cache/certkv_cache_cuda_tests" "$root/build-cuda/src/backend/certkv_backend_cuda_tests" \
  "$root/build-cuda/tests/certkv_device_e2e_tests" "$root/build-cuda/bench/certkv_cuda_decode_bench" \
  "$root/build-cuda/bench/certkv_backend_decode" "$root/build-cuda/bench/certkv_cuda_matmul_bench" \
  "$root/build-cuda/tools/certkv/certkv" "$root/.devbin/"
soname=$(readelf -d "$root/build-cuda/tools/certkv/certkv" | sed -n 's/.*Shared library: \[\(libcertkv\.so[^]]*\)\].*/\1/p')
cp -L "$root/build-cuda/src/api/$soname" "$root/.devbin/$soname"
exclude=$(git -C "$root" rev-parse --path-format=absolute --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.devbin/' "$exclude" 2>/dev/null || echo '/.devbin/' >> "$exclude"
echo "built .devbin/; on the GPU machine (carry .devbin): bash scripts/run_cuda_tests.sh --run"
