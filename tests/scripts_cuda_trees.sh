#!/usr/bin/env bash
# scripts/cuda_trees.sh on stand-in trees (no GPU): --run unpacks the packed trees, runs each
# tree's harness and memcheck in the packed order, writes trees.txt with the revisions, statuses,
# gtest summaries and failures, and exits 1 naming the failed steps; --build refuses bad
# arguments, a revision that does not exist and a working tree with changes.
set -euo pipefail
src=${1:?usage: scripts_cuda_trees.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/repo/scripts" "$work/out" "$work/bin"
cp "$src/scripts/cuda_trees.sh" "$work/repo/scripts/"
cd "$work/repo"

# Two trees: "good" passes; "bad" fails one test. A stand-in compute-sanitizer runs the binary.
for tree in good bad; do
  mkdir -p ".devtrees/$tree"
  echo "rev-$tree" > ".devtrees/$tree/REVISION"
  rc=0; [ $tree = bad ] && rc=1
  cat > ".devtrees/$tree/certkv_attention_cuda_tests" <<HARNESS
#!/usr/bin/env bash
echo "$tree \$1 \${CERTKV_REQUIRE_DEVICE:-unset}" >> "$work/calls"
if [ $rc = 0 ]; then echo "[  PASSED  ] 3 tests."; else
  echo "x_test.cc:10: Failure"; echo "Expected equality"; echo "[  PASSED  ] 2 tests."; echo "[  FAILED  ] 1 test, listed below:"; fi
exit $rc
HARNESS
  chmod +x ".devtrees/$tree/certkv_attention_cuda_tests"
  echo "fake bench" > ".devtrees/$tree/certkv_cuda_decode_bench"
done
printf 'good\nbad\n' > .devtrees/ORDER
mkdir -p .devpack && tar -cJf .devpack/trees.tar.xz .devtrees && rm -rf .devtrees
cat > "$work/bin/compute-sanitizer" <<'SAN'
#!/usr/bin/env bash
while [ "${1:-}" != "" ] && [ "${1#-}" != "$1" ]; do shift 2; done
"$@" > /dev/null; echo "========= ERROR SUMMARY: 0 errors"
SAN
chmod +x "$work/bin/compute-sanitizer"

rc=0
PATH="$work/bin:$PATH" bash scripts/cuda_trees.sh --run "$work/out" --filter 'Sparse*' > "$work/run.log" 2>&1 || rc=$?
cat "$work/run.log"
[ "$rc" = 1 ] || { echo "a failing tree must fail the run (rc $rc)"; exit 1; }
s="$work/out/trees.txt"
[ -f "$s" ] || { echo "no trees.txt"; exit 1; }
grep -qx '== good rev-good' "$s" || { echo "good tree header missing"; exit 1; }
grep -qx '== bad rev-bad' "$s" || { echo "bad tree header missing"; exit 1; }
[ "$(grep -n '^== ' "$s" | cut -d: -f1 | tr '\n' ' ')" = "$(grep -n '^== good' "$s" | cut -d: -f1) $(grep -n '^== bad' "$s" | cut -d: -f1) " ] ||
  { echo "trees out of the packed order"; exit 1; }
grep -q 'harness rc=1' "$s" || { echo "bad tree's status missing"; exit 1; }
grep -q 'x_test.cc:10: Failure' "$s" || { echo "the failure's text missing"; exit 1; }
[ "$(grep -c 'memcheck rc=0 ========= ERROR SUMMARY: 0 errors' "$s")" = 2 ] || { echo "memcheck lines missing"; exit 1; }
grep -q 'cuda_trees: FAILED: bad:harness$' "$s" || { echo "failed steps not named"; exit 1; }
[ -z "$(ls "$work/out" | grep -v '^trees.txt$')" ] || { echo "logs left in OUT"; exit 1; }
# Each tree ran twice (harness, memcheck), in order, with the filters and the device required.
[ "$(cat "$work/calls")" = "good --gtest_filter=Sparse* 1
good --gtest_filter=Sparse* 1
bad --gtest_filter=Sparse* 1
bad --gtest_filter=Sparse* 1" ] || { echo "unexpected calls:"; cat "$work/calls"; exit 1; }

# Every tree passing, memcheck skipped: exit 0.
printf 'good\n' > .devtrees/ORDER
PATH="$work/bin:$PATH" bash scripts/cuda_trees.sh --run "$work/out" --memcheck - > "$work/run.log" 2>&1 ||
  { cat "$work/run.log"; echo "a passing tree must pass"; exit 1; }
grep -q 'cuda_trees: every tree passed' "$work/out/trees.txt" || { echo "no success line"; exit 1; }
! grep -q memcheck "$work/out/trees.txt" || { echo "memcheck ran though skipped"; exit 1; }

# Refusals.
expect_refusal() {  # message, arguments...
  local msg=$1; shift
  if bash scripts/cuda_trees.sh "$@" > "$work/err" 2>&1; then echo "accepted: $*"; exit 1; fi
  grep -q "$msg" "$work/err" || { echo "no message '$msg' for $*:"; cat "$work/err"; exit 1; }
}
expect_refusal usage
expect_refusal usage --build
expect_refusal "unknown option" --run "$work/out" --bogus
expect_refusal "wants NAME=REV" --build main
expect_refusal "letters, digits" --build 'a b=HEAD'
git init -q . && git -c user.email=t@t -c user.name=t commit -q --allow-empty -m one
expect_refusal "not a revision" --build main=no-such-rev
expect_refusal "named twice" --build a=HEAD a=HEAD
git add scripts/cuda_trees.sh && git -c user.email=t@t -c user.name=t commit -q -m two
echo change >> scripts/cuda_trees.sh
expect_refusal "has changes" --build a=HEAD
rm -rf .devtrees .devpack
expect_refusal "no .devtrees" --run "$work/out" --memcheck -
echo "scripts_cuda_trees: ok"
