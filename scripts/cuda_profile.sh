#!/usr/bin/env bash
# Nsight Compute profile of the decode split kernel, one launch per page format, on one benchmark
# cell (on the device; carry .devbin .benchkv; CERTKV_DEVBIN names another folder of binaries):
#   bash scripts/cuda_profile.sh OUT_DIR [formats] [context] [batch] [shape]
# Writes OUT_DIR/FORMAT.txt (speed of light, occupancy, launch, warp states, scheduler, pipes,
# instructions, memory) and OUT_DIR/FORMAT.sass.csv (per-instruction samples and stall reasons).
set -uo pipefail
out=${1:?usage: cuda_profile.sh OUT_DIR [formats] [context] [batch] [shape]}
formats=${2:-bf16,gaac,dither8,fp8-e4m3,fp8-e4m3-nometer}
context=${3:-65536}
batch=${4:-1}
shape=${5:-32x8}
bin=${CERTKV_DEVBIN:-.devbin}
for f in ${formats//,/ }; do
  ncu --clock-control none --kernel-name regex:split_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
    --section MemoryWorkloadAnalysis --section SourceCounters --import-source no \
    -o "$out/$f" -f \
    "$bin/certkv_cuda_decode_bench" --kv .benchkv/kv.safetensors --calib .benchkv/calib.safetensors \
    --out "$out/$f.jsonl" --contexts "$context" --batches "$batch" --shapes "$shape" --formats "$f" \
    --reps 1 --iters 3 > "$out/$f.log" 2>&1
  ncu --import "$out/$f.ncu-rep" --print-details all > "$out/$f.txt" 2>&1
  ncu --import "$out/$f.ncu-rep" --page source --csv --print-source sass > "$out/$f.sass.csv" 2>&1
  rm -f "$out/$f.ncu-rep"
  echo "$f: $(grep -m1 -E 'Duration' "$out/$f.txt")"
done
