#!/usr/bin/env bash
# Reproduces the meter figures of docs/meter.md on the embedded default (SmolLM2-135M-Instruct).
# Calibration books (used to choose dither8's m): austen-emma, dickens-tale-of-two-cities;
# evaluation books (held apart): melville-moby-dick, doyle-adventures-of-sherlock-holmes,
# conrad-heart-of-darkness. Every result is one JSON file under $OUT (default out/meter).
#   1. KV bytes per token of every scheme from the allocator (bench/kv_capacity_bench.cc);
#   2. audit of every lossy scheme at 2,048 and 8,192 tokens (doyle), 32 metered steps each;
#   3. dither8 coverage vs m (0, 2, 4, 8, 16) on a calibration book and on an evaluation book,
#      and vs delta (1e-4, 1e-2, 5e-2) at the default m;
#   4. teacher-forced KL / top-1 / top-5 of every lossy scheme, 2,048 tokens of melville;
#   5. meter overhead: decode tok/s with the meter on and off (dither8, rtn8), 3 interleaved runs;
#   6. needle accuracy (single, noise haystack) at 1,024 / 2,048 / 4,096 tokens: bf16, dither8,
#      fp8-e4m3 raw and gated, kivi2 raw and gated (STEPS: set NEEDLE=0 to skip; slow).
# usage: scripts/meter_measure.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
bin=$build/tools/certkv/certkv
out=${OUT:-$root/out/meter}
corpus=$root/../shared/data/corpus
model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
samples=${SAMPLES:-10}
[ -x "$bin" ] || { echo "meter_measure: no $bin (build first)" >&2; exit 1; }
[ -f "$model" ] || { echo "meter_measure: no $model (run scripts/fetch_models.sh)" >&2; exit 1; }
mkdir -p "$out"
git -C "$root" rev-parse --short HEAD >"$out/commit.txt"

"$build/bench/certkv_kv_capacity_bench" --benchmark_format=json >"$out/capacity.json"

for n in 2048 8192; do
  for kv in fp8-e4m3 fp8-e5m2 fp8-e4m3-scaled rtn8 rtn4 kivi2 dither8; do
    "$bin" audit --kv "$kv" --text-file "$corpus/doyle-adventures-of-sherlock-holmes.txt" \
      --tokens "$n" --steps 32 --json >"$out/audit-$kv-$n.json" || true
  done
done

for book in austen-emma melville-moby-dick; do
  for m in 0 2 4 8 16; do
    "$bin" audit --kv dither8 --outlier-pairs "$m" --text-file "$corpus/$book.txt" --tokens 2048 \
      --steps 32 --json >"$out/coverage-m$m-$book.json" || true
  done
done
for delta in 1e-4 1e-2 5e-2; do
  "$bin" audit --kv dither8 --delta "$delta" --text-file "$corpus/melville-moby-dick.txt" \
    --tokens 2048 --steps 32 --json >"$out/coverage-delta$delta.json" || true
done

for kv in fp8-e4m3 fp8-e5m2 fp8-e4m3-scaled rtn8 rtn4 kivi2 dither8; do
  "$bin" eval teacher-forced --kv "$kv" --text-file "$corpus/melville-moby-dick.txt" --tokens 2048 \
    --steps 16 --json >"$out/tf-$kv.json"
done

head -c 12000 "$corpus/conrad-heart-of-darkness.txt" >"$out/prompt.txt"
for rep in 1 2 3; do
  for kv in dither8 rtn8; do
    "$bin" run --raw --kv "$kv" --prompt-file "$out/prompt.txt" --n 128 --json >"$out/overhead-$kv-on-$rep.json"
    "$bin" run --raw --kv "$kv" --no-meter --prompt-file "$out/prompt.txt" --n 128 --json >"$out/overhead-$kv-off-$rep.json"
  done
done

if [ "${NEEDLE:-1}" != 0 ]; then
  for cfg in "bf16" "dither8" "fp8-e4m3" "fp8-e4m3 --gate" "kivi2" "kivi2 --gate"; do
    name=$(echo "$cfg" | tr ' ' '_' | tr -d '-')
    # shellcheck disable=SC2086
    "$bin" eval needle --kv $cfg --lengths 1024,2048,4096 --samples "$samples" --json \
      >"$out/needle-$name.json" 2>"$out/needle-$name.log"
  done
fi
python3 "$root/scripts/meter_summary.py" "$out"
