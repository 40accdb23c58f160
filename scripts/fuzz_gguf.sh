#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang, AddressSanitizer and UBSan in build-fuzz/ and
# runs each for N seconds (default 60), seeded with the first 64 KiB of the fixture GGUF and small
# synthetic GGUF and safetensors files. Crashing inputs land in build-fuzz/artifacts/.
# usage: scripts/fuzz_gguf.sh [seconds_per_fuzzer]
set -euo pipefail

seconds=${1:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CERTKV_FUZZ_BUILD_DIR:-$root/build-fuzz}
fixture=${CERTKV_FUZZ_FIXTURE:-$root/tests/data/models/llama-2-tiny-random.gguf}

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCERTKV_BUILD_FUZZ=ON -DCERTKV_SANITIZE_ADDRESS=ON -DCERTKV_SANITIZE_UNDEFINED=ON \
  -DCERTKV_BUILD_TESTS=OFF -DCERTKV_BUILD_BENCH=OFF -DCERTKV_CUDA=OFF -DCERTKV_NATIVE=OFF
cmake --build "$build" -j2 --target gguf_fuzz safetensors_fuzz

seeds=$build/seeds
mkdir -p "$seeds/gguf" "$seeds/safetensors" "$build/corpus/gguf" "$build/corpus/safetensors" \
  "$build/artifacts"
python3 "$root/scripts/make_fuzz_seeds.py" "$fixture" "$seeds"

for fuzzer in gguf safetensors; do
  echo "== ${fuzzer}_fuzz for ${seconds} s"
  "$build/fuzz/${fuzzer}_fuzz" "$build/corpus/$fuzzer" "$seeds/$fuzzer" \
    -max_total_time="$seconds" -max_len=65536 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/${fuzzer}-"
done
