#!/usr/bin/env bash
# scripts/make_tiny_llama_gguf.py writes a GGUF that certkv loads with the shape it says (head_dim
# 64, the shape the CUDA route serves), and that runs greedily with a metered lossy scheme (a cell
# per layer and head of each decode step: the first token comes from the prefill): the
# device runs use it where carrying a real model over would take several calls.
# usage: scripts_tiny_llama_gguf.sh CERTKV_BINARY SOURCE_DIR
set -eu
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 "$src/scripts/make_tiny_llama_gguf.py" "$src/tests/data/models/llama-2-tiny-random.gguf" "$tmp/tiny.gguf" --layers 3
"$bin" info --model "$tmp/tiny.gguf" >"$tmp/info.json"
"$bin" run --model "$tmp/tiny.gguf" --kv dither8 --raw --prompt "The quick brown fox jumps over the lazy dog" \
  --n 8 --json >"$tmp/run.json"
python3 - "$tmp/info.json" "$tmp/run.json" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
want = {"architecture": "llama", "n_layers": 3, "dim": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
        "ffn_dim": 512, "n_vocab": 32000, "weight_type": "F16"}
assert all(info[k] == v for k, v in want.items()), info
run = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
assert run["generated_tokens"] == 8 and run["prompt_tokens"] > 5, run
assert run["meter"]["cells"] == (8 - 1) * 3 * 4 and 0 <= run["meter"]["max"] <= 1, run["meter"]
print("tiny llama ok:", info["weight_bytes"], "weight bytes; meter max", run["meter"]["max"])
PY
