#!/usr/bin/env bash
# The figures of docs/sparse.md (issue 5) on the embedded default (SmolLM2-135M-Instruct):
#   1. recall and budget of sparse decode beside fixed top-k, oracle top-k and Quest at equal
#      budget, on three held-out books at 2K, 4K and 8K tokens, p = 0.9 and 0.95;
#   2. teacher-forced KL / top-1 against the dense bf16 run, with --sparse (bf16 and dither8 pages);
#   3. needle accuracy with and without --sparse.
# usage: scripts/sparse_measure.sh BUILD_DIR OUT_DIR   (then scripts/sparse_summary.py OUT_DIR)
set -eu
build=${1:-build} out=${2:-sparse-results}
bin="$build/tools/certkv/certkv"
corpus="$(cd "$(dirname "$0")/.." && pwd)/../shared/data/corpus"
mkdir -p "$out"
for book in melville-moby-dick doyle-adventures-of-sherlock-holmes conrad-heart-of-darkness; do
  for n in 2048 4096 8192; do
    for p in 0.9 0.95; do
      "$bin" audit --sparse "p=$p" --text-file "$corpus/$book.txt" --tokens "$n" --steps 8 --json \
        >"$out/audit_${book%%-*}_${n}_p${p}.json" 2>/dev/null
    done
  done
done
for kv in bf16 dither8; do
  for p in 0.9 0.95; do
    "$bin" eval teacher-forced --kv "$kv" --sparse "p=$p" --text-file "$corpus/melville-moby-dick.txt" \
      --tokens 2048 --steps 16 --json >"$out/tf_${kv}_p${p}.json" 2>/dev/null
  done
done
"$bin" eval teacher-forced --kv dither8 --text-file "$corpus/melville-moby-dick.txt" --tokens 2048 \
  --steps 16 --json >"$out/tf_dither8_dense.json" 2>/dev/null
"$bin" eval needle --kv bf16 --lengths 1024,2048,4096 --samples 10 --json >"$out/needle_dense.json" 2>/dev/null
"$bin" eval needle --kv bf16 --sparse p=0.9 --lengths 1024,2048,4096 --samples 10 --json \
  >"$out/needle_sparse.json" 2>/dev/null
