#!/usr/bin/env bash
# scripts/cuda_ab.sh --run and scripts/cuda_ab_summary.py on stand-in benchmark binaries (no GPU):
# the rounds alternate base and head, every line is tagged, the medians and head / base are right,
# and bad input is refused.
set -euo pipefail
src=${1:?usage: scripts_cuda_ab.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/scripts" "$work/.devbin" "$work/.basebin" "$work/out"
cp "$src/scripts/cuda_ab.sh" "$src/scripts/cuda_ab_summary.py" "$work/scripts/"
# A stand-in benchmark: one timed cell whose microseconds depend on the tree and the call count
# (base 100, 104, ...; head 90, 80, ...), so the medians over 3 rounds are known.
for tree in base head; do
  dir=.basebin; [ "$tree" = head ] && dir=.devbin
  cat > "$work/$dir/certkv_cuda_decode_bench" <<BENCH
#!/usr/bin/env bash
out=""; while [ \$# -gt 0 ]; do [ "\$1" = --out ] && out=\$2; shift; done
n=\$(cat "$work/$tree.calls" 2>/dev/null || echo 0); echo \$((n + 1)) > "$work/$tree.calls"
us=\$([ $tree = base ] && echo \$((100 + 4 * n)) || echo \$((90 - 10 * n)))
printf '{"kind": "env"}\n{"kind": "certkv", "format": "sparse-p0.9", "shape": "32x8", "batch": 8, "ctx": 131072, "us": %s, "recall_mean": 0.78}\n' \$us > "\$out"
BENCH
  chmod +x "$work/$dir/certkv_cuda_decode_bench"
done
summary=$(bash "$work/scripts/cuda_ab.sh" --run "$work/out" 3 --reps 1)
echo "$summary"
# base 100, 104, 108 -> median 104; head 90, 80, 70 -> median 80; 80 / 104 = 0.769
[ "$summary" = "32x8  8  128K  sparse-p0.9  104.0  80.0  0.769  0.7800 / 0.7800" ] || { echo "unexpected summary"; exit 1; }
[ "$(grep -c '"tree": "base"' "$work/out/ab.jsonl")" = 6 ] || { echo "base lines missing"; exit 1; }
[ "$(grep -c '"tree": "head"' "$work/out/ab.jsonl")" = 6 ] || { echo "head lines missing"; exit 1; }
[ "$(grep -c '"round": 3' "$work/out/ab.jsonl")" = 4 ] || { echo "round tags missing"; exit 1; }
# Three named trees (--tree NAME=DIR, the first the base of the ratios), counters reset:
# main 100, 104 -> 102; head 90, 80 -> 85; other 50, 50 -> 50.
rm -f "$work"/*.calls
mkdir -p "$work/other"
printf '#!/usr/bin/env bash\nout=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\nprintf '"'"'{"kind": "certkv", "format": "sparse-p0.9", "shape": "32x8", "batch": 8, "ctx": 131072, "us": 50, "recall_mean": 0.78}\\n'"'"' > "$out"\n' > "$work/other/certkv_cuda_decode_bench"
chmod +x "$work/other/certkv_cuda_decode_bench"
summary=$(cd "$work" && bash scripts/cuda_ab.sh --run "$work/out" 2 --tree main=.basebin --tree head=.devbin --tree other="$work/other" --reps 1)
echo "$summary"
[ "$summary" = "32x8  8  128K  sparse-p0.9  102.0  85.0  50.0  0.833  0.490  0.7800 / 0.7800 / 0.7800" ] || { echo "unexpected three-tree summary"; exit 1; }
[ "$(grep -c '"tree": "other"' "$work/out/ab.jsonl")" = 2 ] || { echo "other lines missing"; exit 1; }
# Bad trees: no '=', a name twice, a folder without the benchmark, one tree only.
for bad in "--tree main" "--tree main=.basebin --tree main=.devbin" "--tree main=.basebin --tree x=$work/none" "--tree main=.basebin"; do
  # shellcheck disable=SC2086
  if (cd "$work" && bash scripts/cuda_ab.sh --run "$work/out" 1 $bad --reps 1) > "$work/bad.log" 2>&1; then
    echo "accepted: $bad"; exit 1
  fi
  grep -q "cuda_ab: " "$work/bad.log" || { echo "no message for: $bad"; cat "$work/bad.log"; exit 1; }
done
if python3 "$work/scripts/cuda_ab_summary.py" "$work/out/ab.jsonl" --trees main 2> "$work/err"; then echo "one tree accepted"; exit 1; fi
grep -q "two distinct names" "$work/err"
# A failing benchmark stops the run with its log's tail.
printf '#!/usr/bin/env bash\necho broken >&2\nexit 3\n' > "$work/.devbin/certkv_cuda_decode_bench"
if bash "$work/scripts/cuda_ab.sh" --run "$work/out" 1 > "$work/fail.log" 2>&1; then echo "a failing benchmark passed"; exit 1; fi
grep -q "the head benchmark failed" "$work/fail.log" || { echo "no message for the failing benchmark"; exit 1; }
# Bad input: no arguments, a line that is not JSON, a timed line without a tree.
if bash "$work/scripts/cuda_ab.sh" > /dev/null 2>&1; then echo "no arguments accepted"; exit 1; fi
echo 'not json' > "$work/bad.jsonl"
if python3 "$work/scripts/cuda_ab_summary.py" "$work/bad.jsonl" 2> "$work/err"; then echo "bad JSON accepted"; exit 1; fi
grep -q "not JSON" "$work/err"
echo '{"kind": "certkv", "us": 1, "shape": "32x8", "batch": 1, "ctx": 1, "format": "bf16"}' > "$work/bad.jsonl"
if python3 "$work/scripts/cuda_ab_summary.py" "$work/bad.jsonl" 2> "$work/err"; then echo "untagged line accepted"; exit 1; fi
grep -q "without tree" "$work/err"
echo "scripts_cuda_ab: ok"
