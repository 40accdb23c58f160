#!/usr/bin/env bash
# The H200 decode benchmark in one device command: certkv's formats and the peers (torch SDPA,
# FlashInfer) over the same real KV, in one run. Prepare here first:
#   bash scripts/run_cuda_tests.sh                          # .devbin/ binaries
#   certkv dump-kv --model models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --text-file BOOK \
#       --tokens 4096 --layers 2,5,8,11,14,17,20,23 --out D.safetensors   (melville; austen-emma for CAL)
#   python3 scripts/make_bench_kv.py D.safetensors .benchkv/kv.safetensors   (and .benchkv/calib.safetensors)
#   the FlashInfer payload in .peers/ (bench/peers_setup.sh says how)
# Then on the device (carry .devbin .benchkv .peers): bash scripts/cuda_bench.sh $OUT
# and here: python3 scripts/cuda_bench_summary.py OUT/certkv.jsonl OUT/peers.jsonl --commit SHA \
#   --json docs/bench/h200_decode.json --plot docs/bench/h200_decode.png
# With --subset (carry .devbin .benchkv; .peers does not fit beside .benchkv in one command's
# 64 MiB): the 32x8 shape at batch 1 and 8, 64K and 128K, the formats of docs/bench/cuda_runs.md's run
# tables, against torch SDPA alone (about two minutes).
set -uo pipefail
if [ "${1:-}" = "--subset" ]; then
  out=${2:?usage: cuda_bench.sh --subset OUT_DIR}
  cells=(--contexts 65536,131072 --batches 1,8 --shapes 32x8)
  .devbin/certkv_cuda_decode_bench --kv .benchkv/kv.safetensors --calib .benchkv/calib.safetensors \
    --out "$out/certkv.jsonl" --reps 7 --iters 10 "${cells[@]}" \
    --formats bf16,bf16-fragments,gaac,gaac-e5m2,dither8,dither8-fragments,dither8-fragments-nometer,int8-fragments,gaac-fragments,fp8-e4m3,fp8-e4m3-nometer,fp8-e4m3-fragments,fp8-e4m3-fragments-nometer,sparse-p0.9,sparse-p0.9-z1.5 2>&1 | tee "$out/certkv.log"
  PYTHONUNBUFFERED=1 python3 bench/decode_peers.py --kv .benchkv/kv.safetensors --out "$out/peers.jsonl" \
    --peers sdpa "${cells[@]}" 2>&1 | tee "$out/peers.log"
  exit 0
fi
out=${1:?usage: cuda_bench.sh [--subset] OUT_DIR}
.devbin/certkv_cuda_decode_bench --kv .benchkv/kv.safetensors --calib .benchkv/calib.safetensors \
  --out "$out/certkv.jsonl" --reps 7 --iters 10 \
  --formats bf16,bf16-fragments,gaac,gaac-e5m2,dither8,dither8-fragments,dither8-fragments-nometer,int8-fragments,gaac-fragments,fp8-e4m3,fp8-e4m3-nometer,fp8-e4m3-fragments,fp8-e4m3-fragments-nometer,sparse-p0.9,sparse-p0.9-z1.5,sparse-p0.99 2>&1 | tee "$out/certkv.log"
source bench/peers_setup.sh > "$out/peers_setup.log" 2>&1
PYTHONUNBUFFERED=1 python3 bench/decode_peers.py --kv .benchkv/kv.safetensors --out "$out/peers.jsonl" \
  --peers sdpa,flashinfer_bf16_tc,flashinfer_fp8_tc,flashinfer_bf16 2>&1 | tee "$out/peers.log"
