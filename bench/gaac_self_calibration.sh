#!/usr/bin/env bash
# GAAC self-calibration, built-in text against online (docs/engine.md, "GAAC without a calibration
# step"): for each model, calibrate
#   builtin      from the text built into the library (src/engine/gaac_calibration_text.txt, Dickens),
#                4,096 tokens, as engine/gaac_self_calibration.cc does;
#   online_N     from the first prefill of a prompt of N tokens (a passage of Moby-Dick);
# then encode the post-RoPE KV of held-out prompts of other books (Austen, Conrad, Doyle, Stoker;
# 500 to 2,000 tokens) with each calibration, and report the compression ratio (bf16 bytes over
# stored bytes, fixed-capacity slots and raw fallbacks included) and the blocks that did not fit
# their slot. KV dumps come from `certkv dump-kv`, calibration and encoding from `certkv codec`.
# Writes one JSON document to stdout.
# usage: bench/gaac_self_calibration.sh MODEL.gguf [MODEL.gguf ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build/tools/certkv/certkv
corpus=$root/tests/data/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
online_lengths="512 2000"
heldout="austen-emma:2000 conrad-heart-of-darkness:1500 doyle-adventures-of-sherlock-holmes:1000 stoker-dracula:500"
for model in "$@"; do
  m=$(basename "$model")
  "$bin" dump-kv --model "$model" --text-file "$root/src/engine/gaac_calibration_text.txt" --tokens 4096 \
    --threads 2 --out "$tmp/$m.builtin.kv" 2>/dev/null
  cals="builtin"
  for n in $online_lengths; do
    "$bin" dump-kv --model "$model" --text-file "$corpus/melville-moby-dick.txt" --tokens "$n" \
      --threads 2 --out "$tmp/$m.online_$n.kv" 2>/dev/null
    cals="$cals online_$n"
  done
  for cal in $cals; do
    "$bin" codec --codec gaac --calib "$tmp/$m.$cal.kv" --save-calibration "$tmp/$m.$cal.cal" >/dev/null
  done
  for h in $heldout; do
    book=${h%%:*} n=${h##*:}
    "$bin" dump-kv --model "$model" --text-file "$corpus/$book.txt" --tokens "$n" --threads 2 \
      --out "$tmp/$m.held.$book.kv" 2>/dev/null
    for cal in $cals; do
      "$bin" codec --codec gaac --calib "$tmp/$m.$cal.cal" --in "$tmp/$m.held.$book.kv" --json --passes 1 \
        >"$tmp/$m.$cal.$book.json"
    done
  done
  echo "$m" >>"$tmp/models"
done
python3 - "$tmp" "$(git -C "$root" rev-parse --short HEAD)" "$online_lengths" "$heldout" "$*" <<'PY'
import json, sys, subprocess
tmp, commit, online, heldout, models_arg = sys.argv[1:6]
cals = ["builtin"] + [f"online_{n}" for n in online.split()]
books = [(h.split(":")[0], int(h.split(":")[1])) for h in heldout.split()]
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
out = {"commit": commit, "command": f"bash bench/gaac_self_calibration.sh {models_arg}",
       "calibrations": {"builtin": "src/engine/gaac_calibration_text.txt (Dickens), 4096 tokens",
                        **{f"online_{n}": f"first prefill: tests/data/corpus/melville-moby-dick.txt, {n} tokens"
                           for n in online.split()}},
       "held_out": {b: n for b, n in books}, "models": {}}
for m in open(f"{tmp}/models").read().split():
    res = {}
    for cal in cals:
        per, bf16, stored, pages, raw = {}, 0, 0, 0, 0
        for b, _ in books:
            j = json.load(open(f"{tmp}/{m}.{cal}.{b}.json"))
            per[b] = {"ratio": j["ratio"], "raw_block_fraction": j["raw_block_fraction"],
                      "pages": j["pages"], "raw_pages": j["raw_pages"]}
            bf16 += j["bf16_bytes"]; stored += j["stored_bytes"]; pages += j["pages"]; raw += j["raw_pages"]
        res[cal] = {"ratio_all_held_out": bf16 / stored, "raw_pages": raw, "pages": pages,
                    "raw_block_fraction": raw / pages, "by_book": per}
    out["models"][m] = res
print(json.dumps(out, indent=1))
PY
