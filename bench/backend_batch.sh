#!/usr/bin/env bash
# The engine on each backend, cpu against cuda, with certkv batch on the same machine (the H200
# host: bash scripts/run_cuda_tests.sh builds the binary): greedy, the embedded default model
# (SmolLM2-135M-Instruct Q4_1) or $CERTKV_BENCH_MODEL, the host's threads (default 16).
#   short: 8 requests of ~512-token prompts from different books, 128 new tokens, 1 and 8 at once;
#          32 requests of them (the books cycling), 32 at once
#   long:  8 requests of ~4,000-token prompts, 64 new tokens, 8 at once
# Each cell runs REPEATS times; writes one JSON document (every summary line) to stdout.
# usage: bench/backend_batch.sh CERTKV_BIN CORPUS_DIR [REPEATS] [THREADS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$1 corpus=$2 repeats=${3:-2} threads=${4:-16}
model=${CERTKV_BENCH_MODEL:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$root/bench/batch_prompts.py
python3 "$py" books "$corpus" 8 410 128 >"$tmp/short8.jsonl"
head -1 "$tmp/short8.jsonl" >"$tmp/short1.jsonl"
python3 "$py" books "$corpus" 32 410 128 >"$tmp/short32.jsonl"
python3 "$py" books "$corpus" 8 3000 64 >"$tmp/long8.jsonl"
model_flag=()
[ -n "$model" ] && model_flag=(--model "$model")
cells=()
run() {  # name device parallel file
  local out="$tmp/$1_$2_$3_$r.json"
  "$bin" batch "${model_flag[@]}" --prompts-file "$tmp/$4" --raw --parallel "$3" --threads "$threads" \
    --device "$2" >"$tmp/lines.jsonl"
  tail -1 "$tmp/lines.jsonl" >"$out"
  # The texts, to compare the backends' outputs request by request.
  head -n -1 "$tmp/lines.jsonl" >"$tmp/$1_$2_$3_$r.texts"
  cells+=("$1 $2 $3 $r")
}
for r in $(seq "$repeats"); do
  for device in cpu cuda; do
    run short "$device" 1 short1.jsonl
    run short "$device" 8 short8.jsonl
    run short "$device" 32 short32.jsonl
    run long "$device" 8 long8.jsonl
  done
done
python3 - "$tmp" "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$threads" "${cells[@]}" <<'PY'
import json, subprocess, sys
tmp, commit, threads, cells = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
out = []
for c in cells:
    name, device, parallel, r = c.split()
    s = json.load(open(f"{tmp}/{name}_{device}_{parallel}_{r}.json"))
    texts = [json.loads(l).get("text") for l in open(f"{tmp}/{name}_{device}_{parallel}_{r}.texts") if l.strip()]
    ref = [json.loads(l).get("text") for l in open(f"{tmp}/{name}_cpu_{parallel}_{r}.texts") if l.strip()]
    out.append({"prompts": name, "device": device, "parallel": int(parallel), "repeat": int(r),
                "same_texts_as_cpu": sum(1 for a, b in zip(texts, ref) if a == b), "requests": len(texts),
                "summary": s})
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
cpu_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
print(json.dumps({"commit": commit, "gpu": gpu, "cpu": cpu_name, "threads": threads,
                  "command": "bash bench/backend_batch.sh CERTKV_BIN CORPUS_DIR", "cells": out}, indent=1))
PY
