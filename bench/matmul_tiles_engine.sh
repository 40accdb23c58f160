#!/usr/bin/env bash
# The tile products (model/matmul_tiles.h) end to end: certkv batch on the embedded default
# (SmolLM2-135M-Instruct Q4_1, greedy, raw book excerpts as in bench/engine_goals.sh: 8 prompts of
# about 512 tokens, 128 new tokens each), one sequence and eight, with the tile path on and off
# (CERTKV_MATMUL_TILES), the order alternating within each round. Writes one JSON document.
# usage: bench/matmul_tiles_engine.sh CORPUS_DIR [ROUNDS] [THREADS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
corpus=$1 rounds=${2:-3} threads=${3:-2}
bin=$root/build/tools/certkv/certkv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$root/bench/batch_prompts.py" books "$corpus" 8 410 128 >"$tmp/books8.jsonl"
head -1 "$tmp/books8.jsonl" >"$tmp/books1.jsonl"
for r in $(seq "$rounds"); do
  order="1 0"
  [ $((r % 2)) = 0 ] && order="0 1"
  for tiles in $order; do
    for n in 1 8; do
      CERTKV_MATMUL_TILES=$tiles "$bin" batch --prompts-file "$tmp/books$n.jsonl" --raw --parallel "$n" \
        --threads "$threads" | tail -1 >"$tmp/r${r}_t${tiles}_n$n.json"
    done
  done
done
python3 - "$tmp" "$rounds" "$threads" "$(git -C "$root" rev-parse --short HEAD)" <<'PY'
import json, statistics, subprocess, sys
tmp, rounds, threads, commit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def run(r, t, n): return json.load(open(f"{tmp}/r{r}_t{t}_n{n}.json"))
cells = {}
for t in (0, 1):
    for n in (1, 8):
        runs = [run(r, t, n) for r in range(1, rounds + 1)]
        cells[f"tiles{t}_seq{n}"] = {
            "decode_tok_per_s": [x["decode_tok_per_s"] for x in runs],
            "prefill_tok_per_s": [x["prefill_tok_per_s"] for x in runs],
            "ttft_ms_p50": [x["ttft_ms_p50"] for x in runs]}
def med(t, n, k): return statistics.median(cells[f"tiles{t}_seq{n}"][k])
ratios = {
    f"eight_vs_one_tiles{t}": statistics.median(
        [run(r, t, 8)["decode_tok_per_s"] / run(r, t, 1)["decode_tok_per_s"] for r in range(1, rounds + 1)])
    for t in (0, 1)}
for n in (1, 8):
    for k in ("decode_tok_per_s", "prefill_tok_per_s", "ttft_ms_p50"):
        ratios[f"tiles_over_off_seq{n}_{k}"] = statistics.median(
            [run(r, 1, n)[k] / run(r, 0, n)[k] for r in range(1, rounds + 1)])
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
load = open("/proc/loadavg").read().split()[:3]
print(json.dumps({"commit": commit, "cpu": model_name, "threads": threads, "rounds": rounds,
                  "model": "SmolLM2-135M-Instruct Q4_1", "load_average_after": load,
                  "command": f"bash bench/matmul_tiles_engine.sh ../shared/data/corpus {rounds} {threads}",
                  "cells": cells, "median_ratios": ratios}, indent=1))
PY
