#!/usr/bin/env bash
# scripts/witness_study.py on a small synthetic dump in certkv dump-kv's format (two layers,
# head_dim 64, 4 query / 2 KV heads, 69 tokens: four whole blocks and a tail the study leaves
# exact): every witness form must be an upper bound on every token and cell, the DESIGN's form is
# its own baseline, a coded form is never tighter than it; the negative control (a zero witness)
# must be caught; bad input is refused with a message, not a traceback. The zero-byte ulp form
# (fp8 codes' own exponents) is sound too, and a saturated raw-E4M3 key makes its token unbounded.
set -euo pipefail
src=${1:?usage: scripts_witness_study.sh SOURCE_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tool="$src/scripts/witness_study.py"
python3 - "$work/dump.safetensors" "$work/saturated.safetensors" <<'PY'
import json, struct, sys
import numpy as np
rng = np.random.default_rng(7)
n_kv, n_q, d, n = 2, 4, 64, 69
tensors, blobs, offset = {}, [], 0
def add(name, dtype, arr):
    global offset
    raw = arr.tobytes()
    tensors[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
    blobs.append(raw)
    offset += len(raw)
for layer in (0, 3):
    # keys with a few large channels, as real keys have, rounded to bf16
    k = (rng.standard_normal((n_kv, n, d)) * (1 + 6 * (np.arange(d) % 13 == 0))).astype(np.float32)
    k_bf16 = ((k.view(np.uint32) + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16)
    add(f"layer{layer}.k", "BF16", k_bf16)
    add(f"layer{layer}.v", "BF16", k_bf16[:, ::-1].copy())
    add(f"layer{layer}.q", "F32", (rng.standard_normal((n_q, d)) * 2).astype(np.float32))
meta = {"head_dim": "64", "n_heads": "4", "n_kv_heads": "2", "softmax_scale": "0.125",
        "rope_layout": "interleaved", "layers": "0,3", "format": "certkv-kv-dump/1"}
header = json.dumps({"__metadata__": meta, **tensors}).encode()
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))
# The same dump with one key element of layer 0, KV head 0, token 5 at 600 (bf16 0x4416), past
# E4M3's 448: that token's raw-cast error is unbounded by its code.
blob = bytearray(b"".join(blobs))
at = tensors["layer0.k"]["data_offsets"][0] + 2 * (5 * d + 1)
blob[at:at + 2] = struct.pack("<H", 0x4416)
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + bytes(blob))
PY

for scheme in fp8-e4m3 fp8-e4m3-scaled rtn8; do
  forms=16x16,16x8,16x4,16x2,8x8,4x8,1x16,16x16p
  [ "$scheme" = rtn8 ] || forms=$forms,ulp
  python3 "$tool" "$work/dump.safetensors" --scheme "$scheme" --forms "$forms" --json "$work/$scheme.json" > "$work/$scheme.md"
  cat "$work/$scheme.md"
  python3 - "$work/$scheme.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["cells"] == 2 * 4, r["cells"]  # two layers x four query heads
forms = {(f["bands"], f["bits"], f["per_page"]): f for f in r["forms"]}
assert all(f["sound"] for f in r["forms"]), "a form is not an upper bound"
assert forms[(16, 16, False)]["c_ratio"] == 1.0
for key, f in forms.items():
    if key != (0, 0, False):
        assert f["c_ratio"] >= 1.0, (key, f["c_ratio"])  # coarser or fewer bands is never tighter
if r["scheme"] != "rtn8":
    ulp = forms[(0, 0, False)]
    assert ulp["bytes_per_token"] == 0 and ulp["unbounded_token_share"] == 0, ulp
assert forms[(16, 8, False)]["bytes_per_token"] == 16 + 2 / 16
assert forms[(16, 16, True)]["bytes_per_token"] == 2
assert forms[(16, 2, False)]["c_ratio"] > forms[(16, 8, False)]["c_ratio"]
PY
done

# A saturated key: its token is unbounded under the ulp form (1 of the 64 tokens of one of the
# four (layer, KV head) tables), and every form stays sound.
python3 "$tool" "$work/saturated.safetensors" --scheme fp8-e4m3 --forms 16x16,ulp --json "$work/sat.json" > "$work/sat.md"
python3 - "$work/sat.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert all(f["sound"] for f in r["forms"]), "a form is not an upper bound"
ulp = [f for f in r["forms"] if f["bits"] == 0][0]
assert abs(ulp["unbounded_token_share"] - 1 / 64 / 4) < 1e-12, ulp["unbounded_token_share"]
PY

# The negative control: a zero witness bounds nothing, and the check says so.
if python3 "$tool" "$work/dump.safetensors" --forms 16x16 --negative-control > "$work/neg.md" 2> "$work/neg.err"; then
  echo "the negative control passed: the soundness check cannot fail"; exit 1
fi
grep -q "not an upper bound" "$work/neg.err"
grep -q "| NO |" "$work/neg.md"
if python3 "$tool" "$work/dump.safetensors" --forms ulp --negative-control > "$work/neg.md" 2> "$work/neg.err"; then
  echo "the ulp form's negative control passed: the soundness check cannot fail"; exit 1
fi
grep -q "not an upper bound" "$work/neg.err"

# Bad input: each refused with the tool's message and exit status 1 or 2 (argparse), no traceback.
refuse() {
  local want=$1; shift
  if python3 "$tool" "$@" > "$work/out" 2> "$work/err"; then echo "accepted: $*"; exit 1; fi
  grep -q "$want" "$work/err" || { echo "no '$want' for: $*"; cat "$work/err"; exit 1; }
  ! grep -q Traceback "$work/err" || { echo "traceback for: $*"; exit 1; }
}
printf 'not a dump' > "$work/junk"
refuse "not a readable safetensors file" "$work/junk"
refuse "not a readable safetensors file" "$work/missing.safetensors"
head -c 300 "$work/dump.safetensors" > "$work/cut.safetensors"
refuse "not a readable safetensors file" "$work/cut.safetensors"
refuse "is not BANDSxBITS" "$work/dump.safetensors" --forms 16xx
refuse "bits 2, 4, 8 or 16" "$work/dump.safetensors" --forms 16x7
refuse "invalid choice" "$work/dump.safetensors" --scheme kivi9
refuse "the ulp form is defined for the fp8-e4m3 schemes" "$work/dump.safetensors" --scheme rtn8 --forms 16x16,ulp
python3 - "$work/dump.safetensors" "$work/nometa.safetensors" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
del h["__metadata__"]["rope_layout"]
out = json.dumps(h).encode()
open(sys.argv[2], "wb").write(struct.pack("<Q", len(out)) + out + raw[8 + n:])
PY
refuse "metadata 'rope_layout' missing" "$work/nometa.safetensors"
echo "scripts_witness_study: ok"
