#!/usr/bin/env bash
# Several revisions' device binaries in one device command: main and the branches a stop wants
# measured, each tested by its own harness and then timed against the others (scripts/cuda_ab.sh).
#
# Here (a clean working tree; build-cuda is configured if it is not):
#   bash scripts/cuda_trees.sh --build NAME=REV [NAME=REV]...
#     checks out each REV in turn (detached), rebuilds build-cuda's attention harness and decode
#     benchmark (incremental: seconds when only kernels differ) and copies them, with the
#     revision, to .devtrees/NAME/; then returns to the branch it started on and packs .devtrees
#     into .devpack/trees.tar.xz (xz: the binaries of five trees fit a device command's 64 MiB
#     beside .benchkv).
# On the device (carry .devpack and, for the timings, .benchkv):
#   bash scripts/cuda_trees.sh --run OUT [--filter GTEST_FILTER] [--memcheck GTEST_FILTER]
#     unpacks .devpack/trees.tar.xz into .devtrees/ and, tree by tree in the packed order, runs
#     its attention harness (CERTKV_REQUIRE_DEVICE=1: a missing device fails instead of skipping;
#     --filter, default every test) and compute-sanitizer memcheck over --memcheck (default
#     'Sparse*'; '-' skips it), writing OUT/trees.txt: per tree its revision, each step's exit
#     status, gtest's summary and the first failures. Exits 1 when any step failed. Then, in the
#     same command: bash scripts/cuda_ab.sh --run OUT ROUNDS --tree main=.devtrees/main ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: cuda_trees.sh --build NAME=REV [NAME=REV]... | --run OUT [--filter F] [--memcheck F]"
case "${1:-}" in
  --build)
    shift
    [ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
    names=() revs=()
    for spec in "$@"; do
      name=${spec%%=*} rev=${spec#*=}
      [[ "$spec" == *=* && -n "$name" && -n "$rev" ]] || { echo "cuda_trees: wants NAME=REV, not '$spec'" >&2; exit 2; }
      [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "cuda_trees: tree name '$name': letters, digits, . _ - only" >&2; exit 2; }
      for n in "${names[@]}"; do [ "$n" != "$name" ] || { echo "cuda_trees: tree '$name' named twice" >&2; exit 2; }; done
      git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "cuda_trees: '$rev' is not a revision" >&2; exit 2; }
      names+=("$name") revs+=("$rev")
    done
    [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || {
      echo "cuda_trees: the working tree has changes; commit or stash them first" >&2; exit 2; }
    start=$(git -C "$root" symbolic-ref --quiet --short HEAD || git -C "$root" rev-parse HEAD)
    restore() { git -C "$root" checkout --quiet "$start"; }
    trap restore EXIT
    [ -f "$root/build-cuda/CMakeCache.txt" ] ||
      cmake -S "$root" -B "$root/build-cuda" -DCERTKV_CUDA=ON -DCERTKV_NATIVE=OFF -DCERTKV_BUILD_BENCH=ON >/dev/null
    rm -rf "$root/.devtrees" && mkdir -p "$root/.devtrees"
    for i in "${!names[@]}"; do
      git -C "$root" checkout --quiet --detach "${revs[$i]}"
      cmake --build "$root/build-cuda" -j"$(nproc)" --target certkv_attention_cuda_tests certkv_cuda_decode_bench >/dev/null
      dir="$root/.devtrees/${names[$i]}"
      mkdir -p "$dir"
      cp "$root/build-cuda/src/attention/certkv_attention_cuda_tests" "$root/build-cuda/bench/certkv_cuda_decode_bench" "$dir/"
      git -C "$root" rev-parse --short HEAD > "$dir/REVISION"
      echo "${names[$i]}: $(cat "$dir/REVISION") ($(git -C "$root" log -1 --format=%s | cut -c1-60))"
    done
    printf '%s\n' "${names[@]}" > "$root/.devtrees/ORDER"
    mkdir -p "$root/.devpack"
    tar -C "$root" -cf - .devtrees | xz -T2 -6 > "$root/.devpack/trees.tar.xz"
    for d in /.devtrees/ /.devpack/; do
      grep -qx "$d" "$root/.git/info/exclude" 2>/dev/null || echo "$d" >> "$root/.git/info/exclude"
    done
    echo "packed .devpack/trees.tar.xz ($(du -h "$root/.devpack/trees.tar.xz" | cut -f1)): carry .devpack"
    ;;
  --run)
    out=${2:?$usage}
    shift 2
    filter='*' memcheck='Sparse*'
    while [ $# -gt 0 ]; do
      case "$1" in
        --filter) filter=${2:?$usage}; shift 2 ;;
        --memcheck) memcheck=${2:?$usage}; shift 2 ;;
        *) echo "cuda_trees: unknown option '$1'" >&2; exit 2 ;;
      esac
    done
    cd "$root"
    [ -d .devtrees ] || { [ -f .devpack/trees.tar.xz ] && tar -xJf .devpack/trees.tar.xz; } ||
      { echo "cuda_trees: no .devtrees and no .devpack/trees.tar.xz (cuda_trees.sh --build here first)" >&2; exit 2; }
    [ -f .devtrees/ORDER ] || { echo "cuda_trees: .devtrees/ORDER missing" >&2; exit 2; }
    summary="$out/trees.txt"
    : > "$summary"
    failed=""
    export CERTKV_REQUIRE_DEVICE=1
    while read -r name; do
      dir=.devtrees/$name
      echo "== $name $(cat "$dir/REVISION" 2>/dev/null || echo '?')" >> "$summary"
      rc=0
      "$dir/certkv_attention_cuda_tests" --gtest_filter="$filter" > "$out/$name.harness.log" 2>&1 || rc=$?
      echo "harness rc=$rc" >> "$summary"
      grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.harness.log" >> "$summary" || true
      grep -E 'meter cells by' "$out/$name.harness.log" >> "$summary" || true
      grep -B2 -A8 -E 'Failure$' "$out/$name.harness.log" | head -40 >> "$summary" || true
      [ "$rc" = 0 ] || failed="$failed $name:harness"
      if [ "$memcheck" != - ]; then
        rc=0
        compute-sanitizer --tool memcheck --error-exitcode 9 "$dir/certkv_attention_cuda_tests" \
          --gtest_filter="$memcheck" > "$out/$name.memcheck.log" 2>&1 || rc=$?
        echo "memcheck rc=$rc $(grep -E 'ERROR SUMMARY' "$out/$name.memcheck.log" | head -1)" >> "$summary"
        [ "$rc" = 0 ] || failed="$failed $name:memcheck"
      fi
      rm -f "$out/$name.harness.log" "$out/$name.memcheck.log"  # the device returns few files: trees.txt holds what matters
    done < .devtrees/ORDER
    cat "$summary"
    if [ -n "$failed" ]; then
      echo "cuda_trees: FAILED:$failed" | tee -a "$summary"
      exit 1
    fi
    echo "cuda_trees: every tree passed" | tee -a "$summary"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
