#!/usr/bin/env bash
# scripts/ncu_kernel_times.py on stand-in Nsight Compute CSV (no GPU): the table is found after
# the program's own output, thousands separators and units are read, kernels are named without
# namespaces, templates or parameters, the medians and the ratio to the first file are right, and
# bad input is refused with a message.
set -euo pipefail
src=${1:?usage: scripts_ncu_kernel_times.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tool="$src/scripts/ncu_kernel_times.py"
header='"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
row() {  # id, kernel name, unit, value
  printf '"%s","1","bench","host","%s","1","13","(128, 1, 1)","(8, 8, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","%s","%s"\n' "$@"
}
{
  echo '==PROF== Connected to process 1 (bench)'
  echo 'shape  batch  ctx  format  us'
  echo "$header"
  row 0 'void unnamed>::estimate_kernel<128>(Params, float *, unsigned int *)' ns '175,000'
  row 1 'tile::merge_kernel<128>(float *, const float *)' ns '5,000'
  row 2 'void unnamed>::estimate_kernel<128>(Params, float *, unsigned int *)' ns '177,000'
  row 3 'tile::merge_kernel<128>(float *, const float *)' ns '7,000'
  row 4 'void unnamed>::estimate_kernel<128>(Params, float *, unsigned int *)' ns '1,000,000'
} > "$work/base.csv"
{
  echo "$header"
  row 0 'void certkv::attention::cuda::<unnamed>::estimate_kernel<(int)128, (bool)1>(certkv::Params)' us '88.5'
  row 1 'unnamed>::select_kernel(Params, const float *)' ms '0.0125'
} > "$work/head.csv"
out=$(python3 "$tool" "$work/base.csv" "$work/head.csv")
echo "$out"
# estimate: base 175, 177, 1000 -> median 177; head 88.5 -> 0.500. merge: base 5, 7 -> 6.
expected="estimate_kernel  177.0 (3)  88.5 (1)  0.500
merge_kernel  6.0 (2)  -  -
select_kernel  -  12.5 (1)  -"
[ "$out" = "$expected" ] || { echo "unexpected output"; exit 1; }
# The table is captured whole before it is searched: grep -q would close the pipe at the first
# match, and the tool's next write would fail with a broken pipe under pipefail.
markdown=$(python3 "$tool" "$work/base.csv" --markdown)
grep -qx '| estimate_kernel | 177.0 (3) |' <<< "$markdown" || { echo "markdown row missing"; echo "$markdown"; exit 1; }
# Bad input: no table, a value that is not a number, a unit that is not a time, a missing file.
expect_refusal() {  # file, message
  if python3 "$tool" "$1" > /dev/null 2> "$work/err"; then echo "accepted: $1"; exit 1; fi
  grep -q "$2" "$work/err" || { echo "no message '$2' for $1:"; cat "$work/err"; exit 1; }
}
echo 'no table here' > "$work/none.csv"
expect_refusal "$work/none.csv" "no ncu CSV table"
{ echo "$header"; row 0 'k(int)' ns 'n/a'; } > "$work/nan.csv"
expect_refusal "$work/nan.csv" "is not a number"
{ echo "$header"; row 0 'k(int)' byte '12'; } > "$work/unit.csv"
expect_refusal "$work/unit.csv" "is not a time"
expect_refusal "$work/missing.csv" "No such file"
echo "scripts_ncu_kernel_times: ok"
