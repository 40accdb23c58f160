#!/usr/bin/env bash
# The end-to-end comparison on the device (docs/cuda.md), one part per device call. Table a:
# batched decode of one GGUF by certkv's CUDA backend (certkv_backend_decode, one KV class per
# invocation) and by llama.cpp's CUDA build (llama-batched-bench, flash attention on, f16 and q8_0
# KV). Table b: equal memory, as many sequences of the largest context as a pool of POOL_BYTES
# admits per class, all decoding together. Every line goes to OUT (JSON lines; llama.cpp's are
# tagged with engine and kv); bench/h200_e2e_table.py folds a run's lines into
# docs/bench/h200_e2e.json.
#
# usage: bash bench/h200_e2e_run.sh PART MODEL.gguf OUT.jsonl
#   PART llama      llama-batched-bench from LLAMA_BIN (bench/llama_cuda_build.sh's output)
#        certkv     certkv_backend_decode from CERTKV_BIN for each class in KV_CLASSES
#        equal      the same, with --pool-bytes POOL_BYTES (default 4 GiB) at the largest CTX
#   CTX (8192,32000), BATCH (1,8,32), STEPS (16), CORPUS (certkv's prompts: a folder of books),
#   KV_CLASSES ("bf16 fp8-e4m3 dither8 gaac sparse", sparse = bf16 pages with --sparse 0.9)
#
# llama-batched-bench runs each (context, batch) with the prompt prefilled once and copied to
# every sequence (-pps; each sequence still decodes over its own copy of the KV), 32 decode steps
# from that context; its decode rate is `speed_tg`. certkv prefills every sequence with its own
# text and times the median of STEPS steps. Both decode B sequences a step from context C.
set -euo pipefail
part=$1 model=$2 out=$3
ctx=${CTX:-8192,32000}
batch=${BATCH:-1,8,32}
steps=${STEPS:-16}
case "$part" in
  llama)
    bin=${LLAMA_BIN:?LLAMA_BIN: the folder holding llama-batched-bench}
    max_b=$(tr ',' '\n' <<<"$batch" | sort -n | tail -1)
    max_c=$(tr ',' '\n' <<<"$ctx" | sort -n | tail -1)
    for kv in f16 q8_0; do
      # Room for every sequence's prompt and 32 steps: non-unified KV splits -c over the sequences.
      "$bin/llama-batched-bench" -m "$model" -ngl 99 -fa on -ctk "$kv" -ctv "$kv" -pps \
        -c $((max_b * (max_c + 64))) -b 2048 -ub 512 -npp "$ctx" -ntg 32 -npl "$batch" \
        --output-format jsonl 2>"$out.llama_$kv.log" |
        sed -n "s/^{/{\"engine\": \"llama.cpp\", \"kv\": \"$kv\", /p" >>"$out"
    done
    ;;
  certkv)
    bin=${CERTKV_BIN:?CERTKV_BIN: the folder holding certkv_backend_decode}
    corpus=${CORPUS:?CORPUS: a folder of .txt books for the prompts}
    for kv in ${KV_CLASSES:-bf16 fp8-e4m3 dither8 gaac sparse}; do
      if [ "$kv" = sparse ]; then set -- --kv bf16 --sparse 0.9; else set -- --kv "$kv"; fi
      "$bin/certkv_backend_decode" --model "$model" --corpus "$corpus" --device cuda "$@" \
        --ctx "$ctx" --batch "$batch" --steps "$steps" --warmup 3 >>"$out" 2>>"$out.certkv.log"
    done
    ;;
  equal)
    bin=${CERTKV_BIN:?CERTKV_BIN: the folder holding certkv_backend_decode}
    corpus=${CORPUS:?CORPUS: a folder of .txt books for the prompts}
    max_c=$(tr ',' '\n' <<<"$ctx" | sort -n | tail -1)
    for kv in ${KV_CLASSES:-bf16 gaac fp8-e4m3 dither8}; do
      "$bin/certkv_backend_decode" --model "$model" --corpus "$corpus" --device cuda --kv "$kv" \
        --pool-bytes "${POOL_BYTES:-4294967296}" --ctx "$max_c" --steps "$steps" --warmup 3 >>"$out" 2>>"$out.certkv.log"
    done
    ;;
  *)
    echo "h200_e2e_run: PART is llama, certkv or equal, not '$part'" >&2
    exit 2
    ;;
esac
