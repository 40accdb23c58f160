#!/usr/bin/env bash
# The engine's goals on this CPU (docs/engine.md), measured with certkv batch on the embedded
# default (SmolLM2-135M-Instruct Q4_1), greedy, 2 threads; writes one JSON document to stdout.
#   1. 8 concurrent sequences against one (512-token prompts from different books, 128 new
#      tokens): aggregate decode tok/s, paired runs, median ratio.
#   2. 8 requests sharing a ~2,048-token prefix: blocks shared, peak pages with and without
#      sharing, each request's time to first token.
#   3. 32 requests on a pool sized for 4 sequences: all complete, outputs equal to each alone.
# usage: bench/engine_goals.sh CORPUS_DIR [REPEATS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
corpus=$1 repeats=${2:-3}
bin=$root/build/tools/certkv/certkv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=$root/bench/batch_prompts.py
python3 "$py" books "$corpus" 8 410 128 >"$tmp/books8.jsonl"
head -1 "$tmp/books8.jsonl" >"$tmp/books1.jsonl"
python3 "$py" prefix "$corpus" 8 1500 32 >"$tmp/prefix8.jsonl"
python3 "$py" books "$corpus" 32 410 32 >"$tmp/books32.jsonl"
for r in $(seq "$repeats"); do
  "$bin" batch --prompts-file "$tmp/books1.jsonl" --raw --parallel 1 --threads 2 | tail -1 >"$tmp/one_$r.json"
  "$bin" batch --prompts-file "$tmp/books8.jsonl" --raw --parallel 8 --threads 2 | tail -1 >"$tmp/eight_$r.json"
done
"$bin" batch --prompts-file "$tmp/prefix8.jsonl" --raw --parallel 8 --threads 2 >"$tmp/prefix_shared.jsonl"
"$bin" batch --prompts-file "$tmp/prefix8.jsonl" --raw --parallel 8 --threads 2 --no-prefix-sharing >"$tmp/prefix_alone.jsonl"
# 700 tokens a sequence (the longest prompt + 32, with margin); 23,040 bytes a token of bf16 KV for SmolLM2.
"$bin" batch --prompts-file "$tmp/books32.jsonl" --raw --parallel 32 --threads 2 --ctx 700 \
  --pool-bytes $((4 * 700 * 23040)) >"$tmp/pool4.jsonl"
"$bin" batch --prompts-file "$tmp/books32.jsonl" --raw --parallel 1 --threads 2 --ctx 700 >"$tmp/alone32.jsonl"
python3 - "$tmp" "$repeats" "$(git -C "$root" rev-parse --short HEAD)" <<'PY'
import json, statistics, sys, subprocess
tmp, repeats, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def lines(name): return [json.loads(l) for l in open(f"{tmp}/{name}") if l.strip()]
one = [json.load(open(f"{tmp}/one_{r}.json")) for r in range(1, repeats + 1)]
eight = [json.load(open(f"{tmp}/eight_{r}.json")) for r in range(1, repeats + 1)]
ratios = [e["decode_tok_per_s"] / o["decode_tok_per_s"] for o, e in zip(one, eight)]
shared, unshared = lines("prefix_shared.jsonl"), lines("prefix_alone.jsonl")
pool, alone = lines("pool4.jsonl"), lines("alone32.jsonl")
same = sum(1 for a, b in zip(pool[:-1], alone[:-1]) if "text" in a and a.get("text") == b.get("text"))
ttft = [r["ttft_ms"] for r in shared[:-1]]
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
print(json.dumps({
  "commit": commit, "cpu": model_name, "threads": 2, "model": "SmolLM2-135M-Instruct Q4_1",
  "command": "bash bench/engine_goals.sh ../shared/data/corpus " + str(repeats),
  "concurrency": {
    "one_decode_tok_per_s": [o["decode_tok_per_s"] for o in one],
    "eight_decode_tok_per_s": [e["decode_tok_per_s"] for e in eight],
    "eight_generated_tok_per_s_wall": [e["generated_tok_per_s"] for e in eight],
    "ratios": ratios, "median_ratio": statistics.median(ratios),
    "one_ttft_ms": [o["ttft_ms_p50"] for o in one], "eight_ttft_ms_p50": [e["ttft_ms_p50"] for e in eight]},
  "shared_prefix": {
    "prompt_tokens": [r["prompt_tokens"] for r in shared[:-1]],
    "shared_prompt_tokens": [r["shared_prompt_tokens"] for r in shared[:-1]],
    "shared_blocks": shared[-1]["shared_blocks"],
    "peak_pages_shared": shared[-1]["peak_pages_in_use"], "peak_pages_unshared": unshared[-1]["peak_pages_in_use"],
    "prefill_tokens_shared": shared[-1]["prefill_tokens"], "prefill_tokens_unshared": unshared[-1]["prefill_tokens"],
    "ttft_ms": ttft, "ttft_ms_unshared": [r["ttft_ms"] for r in unshared[:-1]],
    "same_texts_as_unshared": sum(1 for a, b in zip(shared[:-1], unshared[:-1]) if a["text"] == b["text"])},
  "pool_for_4": {
    "requests": len(pool) - 1, "completed": sum(1 for r in pool[:-1] if r.get("finish_reason") in ("length", "end", "stop")),
    "identical_to_alone": same, "preemptions": pool[-1]["preemptions"],
    "peak_pages_in_use": pool[-1]["peak_pages_in_use"], "pool_capacity_pages": pool[-1]["pool_capacity_pages"],
    "generated_tok_per_s": pool[-1]["generated_tok_per_s"], "alone_generated_tok_per_s": alone[-1]["generated_tok_per_s"]},
}, indent=1))
PY
