#!/usr/bin/env bash
# Reproduces the GAAC figures of docs/gaac.md on the embedded default (SmolLM2-135M-Instruct):
#   1. KV dumps (certkv dump-kv, all 30 layers) of the calibration books (austen-emma,
#      dickens-tale-of-two-cities) at 4096 and 8192 tokens and as sixteen 512-token prompts,
#      and of the evaluation books (melville-moby-dick, doyle-adventures-of-sherlock-holmes) at
#      4096 and 8192 tokens;
#   2. three calibrations (books at 4K, books at 8K, 512-token prompts);
#   3. certkv codec --json on every evaluation dump (gaac, gaac-e4m3, gaac-e5m2), and the RoPE
#      drift runs (512-token calibration vs 8K calibration on the 8K dumps);
#   4. bench/codec_bench.cc (GAAC beside zstd -1 and lz4) on one evaluation dump;
#   5. a summary table (scripts/gaac_summary.py).
# The dumps are large (94 MB per 4K dump, 1.3 GB in all): they go to $WORK, never the repo.
# usage: scripts/gaac_measure.sh [BUILD_DIR]   (default: build; needs certkv and, for step 4,
#        certkv_codec_bench, i.e. a build with libzstd-dev and liblz4-dev installed)
# env: WORK (default /tmp/certkv-gaac), THREADS for dump-kv (default 2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
bin=$build/tools/certkv/certkv
bench=$build/bench/certkv_codec_bench
work=${WORK:-/tmp/certkv-gaac}
threads=${THREADS:-2}
corpus=$root/../shared/data/corpus
model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x "$bin" ] || { echo "gaac_measure: no $bin (build certkv_cli first)" >&2; exit 1; }
[ -f "$model" ] || { echo "gaac_measure: no $model (run scripts/fetch_models.sh)" >&2; exit 1; }
mkdir -p "$work/json"

dump() {  # text-file tokens out
  [ -f "$3" ] && return 0
  "$bin" dump-kv --model "$model" --text-file "$1" --tokens "$2" --out "$3.tmp" --threads "$threads"
  mv "$3.tmp" "$3"
}

# 1. Dumps. The 512-token prompts start at 8 evenly spaced paragraph starts of each book.
python3 - "$corpus" "$work" <<'PY'
import sys
corpus, work = sys.argv[1], sys.argv[2]
for book in ['austen-emma', 'dickens-tale-of-two-cities']:
    text = open(f'{corpus}/{book}.txt', encoding='utf-8').read()
    for i in range(8):
        start = 0 if i == 0 else text.find('\n\n', len(text) * i // 8) + 2
        open(f'{work}/prompt-{book}-{i}.txt', 'w', encoding='utf-8').write(text[start:start + 20000])
PY
for n in 4 8; do
  dump "$corpus/austen-emma.txt" $((n * 1024)) "$work/cal-austen-${n}k.safetensors"
  dump "$corpus/dickens-tale-of-two-cities.txt" $((n * 1024)) "$work/cal-dickens-${n}k.safetensors"
  dump "$corpus/melville-moby-dick.txt" $((n * 1024)) "$work/eval-melville-${n}k.safetensors"
  dump "$corpus/doyle-adventures-of-sherlock-holmes.txt" $((n * 1024)) "$work/eval-doyle-${n}k.safetensors"
done
prompts=()
for book in austen-emma dickens-tale-of-two-cities; do
  for i in 0 1 2 3 4 5 6 7; do
    dump "$work/prompt-$book-$i.txt" 512 "$work/cal512-$book-$i.safetensors"
    prompts+=("$work/cal512-$book-$i.safetensors")
  done
done

# 2. Calibrations (BF16; the FP8 codecs calibrate on the books at 4K inside step 3).
cal4k=$work/cal-austen-4k.safetensors,$work/cal-dickens-4k.safetensors
cal8k=$work/cal-austen-8k.safetensors,$work/cal-dickens-8k.safetensors
cal512=$(IFS=,; echo "${prompts[*]}")
set -x
"$bin" codec --codec gaac --calib "$cal4k" --save-calibration "$work/gaac-books-4k.safetensors"
"$bin" codec --codec gaac --calib "$cal8k" --save-calibration "$work/gaac-books-8k.safetensors"
"$bin" codec --codec gaac --calib "$cal512" --save-calibration "$work/gaac-prompts-512.safetensors"

# 3. Ratio, mode mix, entropy, speed, bit-exact round trip (--verify also checks the _ref paths).
for book in melville doyle; do
  for n in 4 8; do
    "$bin" codec --codec gaac --calib "$work/gaac-books-4k.safetensors" --in "$work/eval-$book-${n}k.safetensors" \
      --verify --json >"$work/json/gaac-books4k-$book-${n}k.json"
  done
  for c in gaac-e4m3 gaac-e5m2; do
    "$bin" codec --codec $c --calib "$cal4k" --in "$work/eval-$book-4k.safetensors" --verify --json \
      >"$work/json/$c-books4k-$book-4k.json"
  done
  # RoPE drift: short-prompt calibration at 8K, then calibration at deployment length.
  "$bin" codec --codec gaac --calib "$work/gaac-prompts-512.safetensors" --in "$work/eval-$book-8k.safetensors" \
    --json >"$work/json/gaac-prompts512-$book-8k.json"
  "$bin" codec --codec gaac --calib "$work/gaac-books-8k.safetensors" --in "$work/eval-$book-8k.safetensors" \
    --json >"$work/json/gaac-books8k-$book-8k.json"
done

# 4. GAAC beside zstd -1 and lz4 on the same KV, one core.
if [ -x "$bench" ]; then
  CERTKV_BENCH_KV=$work/eval-melville-4k.safetensors CERTKV_BENCH_GAAC_CALIBRATION=$work/gaac-books-4k.safetensors \
    "$bench" --benchmark_min_time=0.5 --benchmark_format=json --benchmark_out="$work/json/codec_bench.json" \
    --benchmark_out_format=json >/dev/null
fi
set +x

# 5. Summary.
python3 "$root/scripts/gaac_summary.py" "$work/json"
