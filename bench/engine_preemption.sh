#!/usr/bin/env bash
# Preemption by swap against preemption by recompute (docs/engine.md, "Preemption"), on the goal
# setup of bench/engine_goals.sh: 32 requests (410-word excerpts of different books, 32 new tokens,
# greedy) on a pool sized for 4 sequences of 700 tokens, SmolLM2-135M-Instruct Q4_1, 2 threads.
# For each KV scheme, each repeat runs both policies back to back (alternating which goes first);
# every output is compared with the request run alone. Writes one JSON document to stdout.
# usage: bench/engine_preemption.sh CORPUS_DIR [SCHEME:REPEATS ... (default "bf16:3 gaac:3")]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
corpus=$1
shift
runs=${*:-"bf16:3 gaac:3"}
bin=$root/build/tools/certkv/certkv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# gaac without --gaac-calib calibrates itself once; keep that cache out of the model folder.
export CERTKV_CACHE_DIR=${CERTKV_CACHE_DIR:-$root/build/gaac_calibration_cache}
mkdir -p "$CERTKV_CACHE_DIR"
python3 "$root/bench/batch_prompts.py" books "$corpus" 32 410 32 >"$tmp/books32.jsonl"
# 23,040 bytes a token of bf16 KV for SmolLM2 (30 layers x 2 x 3 heads x 64 x 2 bytes).
pool_bytes=$((4 * 700 * 23040))
for run in $runs; do
  kv=${run%%:*} repeats=${run##*:}
  "$bin" batch --prompts-file "$tmp/books32.jsonl" --raw --parallel 1 --threads 2 --ctx 700 \
    --kv "$kv" >"$tmp/alone_$kv.jsonl"
  for r in $(seq "$repeats"); do
    if [ $((r % 2)) -eq 1 ]; then order="recompute swap"; else order="swap recompute"; fi
    for policy in $order; do
      "$bin" batch --prompts-file "$tmp/books32.jsonl" --raw --parallel 32 --threads 2 --ctx 700 \
        --kv "$kv" --pool-bytes "$pool_bytes" --preemption "$policy" >"$tmp/${kv}_${policy}_$r.jsonl"
    done
  done
done
python3 - "$tmp" "$runs" "$(git -C "$root" rev-parse --short HEAD)" "$corpus" <<'PY'
import json, statistics, sys, subprocess
tmp, runs, commit, corpus = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4]
schemes = [r.split(":")[0] for r in runs]
repeats_of = {r.split(":")[0]: int(r.split(":")[1]) for r in runs}
def lines(name): return [json.loads(l) for l in open(f"{tmp}/{name}") if l.strip()]
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
out = {"commit": commit, "cpu": model_name, "threads": 2, "model": "SmolLM2-135M-Instruct Q4_1",
       "command": f"bash bench/engine_preemption.sh {corpus} {' '.join(runs)}",
       "setup": "32 requests, 410-word excerpts of different books, 32 new tokens, greedy, --ctx 700, "
                "--pool-bytes 4 x 700 x 23040 (a pool for 4 sequences)",
       "schemes": {}}
keys = ["wall_seconds", "preemptions", "swap_outs", "swapped_out_host_bytes", "swapped_out_pool_bytes",
        "host_bytes_peak", "swap_seconds", "recomputed_tokens", "recompute_seconds", "prefill_tokens",
        "steps", "generated_tok_per_s"]
for kv in schemes:
    repeats = repeats_of[kv]
    alone = lines(f"alone_{kv}.jsonl")
    per = {}
    for policy in ("recompute", "swap"):
        runs = []
        for r in range(1, repeats + 1):
            got = lines(f"{kv}_{policy}_{r}.jsonl")
            s = got[-1]
            run = {k: s[k] for k in keys}
            run["completed"] = sum(1 for x in got[:-1] if x.get("finish_reason") in ("length", "end", "stop"))
            run["identical_to_alone"] = sum(1 for a, b in zip(got[:-1], alone[:-1]) if "text" in a and a.get("text") == b.get("text"))
            runs.append(run)
        per[policy] = {"runs": runs, "median_wall_seconds": statistics.median(r["wall_seconds"] for r in runs)}
    ratios = [s["wall_seconds"] / r["wall_seconds"] for s, r in zip(per["swap"]["runs"], per["recompute"]["runs"])]
    out["schemes"][kv] = {"requests": len(alone) - 1, **per,
                          "swap_over_recompute_wall_ratios": ratios,
                          "median_swap_over_recompute_wall_ratio": statistics.median(ratios)}
print(json.dumps(out, indent=1))
PY
