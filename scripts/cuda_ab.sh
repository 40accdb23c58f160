#!/usr/bin/env bash
# A/B of the decode benchmark between two trees in one device command (the ratios of a change are
# only meaningful within one run on the shared machine).
#
# Here, once per base revision:
#   bash scripts/cuda_ab.sh --build-base REV     # the base tree's benchmark into .basebin/ (a worktree
#                                                 # under /tmp, its own CUDA build; a few minutes)
#   bash scripts/run_cuda_tests.sh               # the working tree's binaries into .devbin/
# On the device (carry .devbin/certkv_cuda_decode_bench, .basebin, .benchkv):
#   bash scripts/cuda_ab.sh --run $OUT ROUNDS [--tree NAME=DIR]... BENCH_ARGS...
#     runs base and head alternately ROUNDS times with the same arguments, writing
#     $OUT/ab.jsonl (every line of every run, tagged "tree": "base" / "head" and "round"), and
#     prints the per-cell medians and head / base (scripts/cuda_ab_summary.py).
#     With --tree options the runs are those trees instead, in the order given, each DIR (from the
#     repository root) holding a certkv_cuda_decode_bench (the first is the base of the ratios):
#     for instance main and two branches, each branch's benchmark built here by checking it out
#     and rebuilding build-cuda (a few seconds when only kernels changed) and copied to its own
#     folder.
# Example: bash scripts/cuda_ab.sh --run $OUT 2 --kv .benchkv/kv.safetensors \
#   --calib .benchkv/calib.safetensors --reps 5 --iters 10 --contexts 131072 --batches 1,8 \
#   --shapes 32x8,28x4 --formats sparse-p0.9,sparse-p0.9-z1.5
# One output file: the device returns only a few files per command.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  --build-base)
    rev=${2:?usage: cuda_ab.sh --build-base REV}
    wt=/tmp/certkv-ab-base
    git -C "$root" worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
    git -C "$root" worktree add --detach "$wt" "$rev" >/dev/null
    cmake -S "$wt" -B "$wt/build-cuda" -DCERTKV_CUDA=ON -DCERTKV_NATIVE=OFF -DCERTKV_BUILD_BENCH=ON >/dev/null
    cmake --build "$wt/build-cuda" -j"$(nproc)" --target certkv_cuda_decode_bench
    mkdir -p "$root/.basebin"
    cp "$wt/build-cuda/bench/certkv_cuda_decode_bench" "$root/.basebin/"
    git -C "$wt" rev-parse --short HEAD > "$root/.basebin/REVISION"
    grep -qx '/.basebin/' "$root/.git/info/exclude" 2>/dev/null || echo '/.basebin/' >> "$root/.git/info/exclude"
    git -C "$root" worktree remove --force "$wt"
    echo "built .basebin/certkv_cuda_decode_bench from $(cat "$root/.basebin/REVISION")"
    ;;
  --run)
    out=${2:?usage: cuda_ab.sh --run OUT_DIR ROUNDS BENCH_ARGS...}
    rounds=${3:?usage: cuda_ab.sh --run OUT_DIR ROUNDS BENCH_ARGS...}
    shift 3
    cd "$root"
    names=() dirs=()
    while [ "${1:-}" = --tree ]; do
      spec=${2:?usage: --tree NAME=DIR}
      name=${spec%%=*} dir=${spec#*=}
      [[ "$spec" == *=* && -n "$name" && -n "$dir" ]] || { echo "cuda_ab: --tree wants NAME=DIR, not '$spec'" >&2; exit 2; }
      [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "cuda_ab: tree name '$name': letters, digits, . _ - only" >&2; exit 2; }
      for n in "${names[@]}"; do [ "$n" != "$name" ] || { echo "cuda_ab: tree '$name' named twice" >&2; exit 2; }; done
      [ -x "$dir/certkv_cuda_decode_bench" ] || { echo "cuda_ab: no $dir/certkv_cuda_decode_bench" >&2; exit 2; }
      names+=("$name") dirs+=("$dir")
      shift 2
    done
    if [ ${#names[@]} -eq 0 ]; then names=(base head) dirs=(.basebin .devbin); fi
    [ ${#names[@]} -ge 2 ] || { echo "cuda_ab: give two trees or more" >&2; exit 2; }
    : > "$out/ab.jsonl"
    for ((r = 1; r <= rounds; ++r)); do
      for ((i = 0; i < ${#names[@]}; ++i)); do
        tree=${names[$i]} bin=${dirs[$i]}/certkv_cuda_decode_bench
        "$bin" "$@" --out /tmp/cuda_ab_run.jsonl > /tmp/cuda_ab_run.log 2>&1 ||
          { echo "cuda_ab: the $tree benchmark failed (round $r):"; tail -5 /tmp/cuda_ab_run.log; exit 1; }
        python3 - "$tree" "$r" /tmp/cuda_ab_run.jsonl >> "$out/ab.jsonl" <<'PY'
import json, sys
tree, rnd, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for line in open(path):
    if line.strip():
        d = json.loads(line)
        d["tree"], d["round"] = tree, rnd
        print(json.dumps(d))
PY
      done
    done
    python3 scripts/cuda_ab_summary.py "$out/ab.jsonl" --trees "$(IFS=,; echo "${names[*]}")"
    ;;
  *)
    echo "usage: cuda_ab.sh --build-base REV | --run OUT_DIR ROUNDS [--tree NAME=DIR]... BENCH_ARGS..." >&2
    exit 2
    ;;
esac
