#!/usr/bin/env bash
# scripts/gaac_d_study.py on synthetic dumps in certkv dump-kv's format whose exponents make every
# group's mode known: calibration exponents in [120, 128) on every channel (b3 = 120; the CPU's
# best 16-wide window the lowest that holds them, 112; GAAC-D's windows 120 - k); evaluation
# exponents inside them but for one K element at 130 (raw for the CPU format and for k = 8, 4-bit
# for k = 0 and 4) and one V element at 100 (raw everywhere: one 8 x 1 group, one 2 x 4 group).
# Checks the modes, the group counts of both groupings, the ratio 16 x 8 x groups / bits, and
# that bad input is refused with a message.
set -euo pipefail
src=${1:?usage: scripts_gaac_d_study.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tool="$src/scripts/gaac_d_study.py"
python3 - "$work" <<'PY'
import json, struct, sys
import numpy as np
work = sys.argv[1]
rng = np.random.default_rng(3)
heads, n, d = 2, 32, 64
def bf16(exponent, sign, mantissa):
    return ((sign << 15) | (exponent << 7) | mantissa).astype(np.uint16)
def write(path, tensors_by_name):
    tensors, blobs, offset = {}, [], 0
    for name, arr in tensors_by_name.items():
        raw = arr.tobytes()
        tensors[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header = json.dumps({"__metadata__": {"format": "certkv-kv-dump/1"}, **tensors}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))
def sample():
    e = rng.integers(120, 128, size=(heads, n, d))
    return e, rng.integers(0, 2, size=e.shape), rng.integers(0, 128, size=e.shape)
cal = {}
for layer in (0, 1):
    for kv in "kv":
        e, s, m = sample()
        e[:] = 120 + (np.arange(n) % 8)[None, :, None]  # every exponent of [120, 128) on every channel
        cal[f"layer{layer}.{kv}"] = bf16(e, s, m)
write(f"{work}/cal.safetensors", cal)
ev = {}
for layer in (0, 1):
    for kv in "kv":
        e, s, m = sample()
        if layer == 0 and kv == "k":
            e[0, 3, 5] = 130
        if layer == 1 and kv == "v":
            e[0, 6, 9] = 100
        ev[f"layer{layer}.{kv}"] = bf16(e, s, m)
write(f"{work}/eval.safetensors", ev)
write(f"{work}/odd.safetensors", {"layer0.k": np.zeros((2, 16, 12), np.uint16)})
PY
python3 "$tool" --calib "$work/cal.safetensors" --eval "$work/eval.safetensors" --json "$work/out.json"
python3 - "$work/out.json" <<'PY'
import json, sys
rows = {r["layout"]: r for r in json.load(open(sys.argv[1]))["rows"]}
groups = 2 * 2 * 32 * 64 // 8  # two layers x heads x tokens x channels / 8, either grouping
def check(layout, kv, modes_count):
    r = rows[layout][kv]
    assert r["groups"] == groups, (layout, kv, r["groups"])
    got = [round(p * groups / 100) for p in r["modes_pct"]]
    assert got == modes_count, (layout, kv, got, modes_count)
    bits = 90 * groups + 8 * modes_count[1] + 40 * modes_count[2]
    assert abs(r["content_ratio"] - 16 * 8 * groups / bits) < 1e-4, (layout, kv, r["content_ratio"])
cpu, d0, d4, d8 = ("gaac (CPU)", "gaac-d, 4-bit window from b3 - 0", "gaac-d, 4-bit window from b3 - 4",
                   "gaac-d, 4-bit window from b3 - 8")
check(cpu, "k", [groups - 1, 0, 1])
check(d8, "k", [groups - 1, 0, 1])
check(d4, "k", [groups - 1, 1, 0])
check(d0, "k", [groups - 1, 1, 0])
for layout in (cpu, d0, d4, d8):
    check(layout, "v", [groups - 1, 0, 1])
print("gaac_d_study: every mode, count and ratio as constructed")
PY
# Bad input: a missing file, a head_dim that is not a multiple of 8, an evaluation tensor with no
# calibration: a message, not a traceback.
for args in "--calib $work/none.safetensors --eval $work/eval.safetensors" \
            "--calib $work/odd.safetensors --eval $work/odd.safetensors" \
            "--calib $work/odd.safetensors --eval $work/eval.safetensors"; do
  if python3 "$tool" $args > "$work/bad.out" 2> "$work/bad.err"; then echo "accepted: $args" >&2; exit 1; fi
  grep -q "^gaac_d_study: " "$work/bad.err" || { cat "$work/bad.err" >&2; exit 1; }
  ! grep -q Traceback "$work/bad.err"
done
echo "gaac_d_study: bad input refused"
