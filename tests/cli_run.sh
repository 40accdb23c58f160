#!/usr/bin/env bash
# certkv run on the embedded default: coherent greedy text, the JSON fields the issue names, and
# dump-kv writing a safetensors file whose tensors have the documented shapes.
# usage: cli_run.sh CERTKV_BINARY MODEL.gguf TEST_DATA_DIR (tests/data)
set -eu
bin=$1 model=$2 data=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" run --model "$model" --prompt "What is the capital of France? Answer in one sentence." --n 24 --json >"$tmp/run.json"
python3 - "$tmp/run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for key in ["text", "prompt_tokens", "generated_tokens", "prefill_tok_per_s", "decode_tok_per_s",
            "kv_bytes", "kv_bytes_bf16", "peak_rss_bytes"]:
    assert key in r, key
assert "Paris" in r["text"], r["text"]
assert r["generated_tokens"] >= 5 and r["prompt_tokens"] > 10
assert r["kv_bytes"] >= r["kv_bytes_bf16"] > 0
assert r["decode_tok_per_s"] > 0 and r["prefill_tok_per_s"] > 0
print("run ok:", r["text"][:80].replace("\n", " "))
PY
head -c 20000 "$data/corpus/wells-time-machine.txt" >"$tmp/text.txt"
"$bin" dump-kv --model "$model" --text-file "$tmp/text.txt" --tokens 100 --layers 0,29 --out "$tmp/kv.safetensors"
python3 - "$tmp/kv.safetensors" <<'PY'
import json, struct, sys
data = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', data[:8])[0]
h = json.loads(data[8:8 + n])
meta = h.pop('__metadata__')
assert meta['rope_layout'] == 'interleaved' and meta['head_dim'] == '64', meta
assert set(h) == {'layer0.k', 'layer0.v', 'layer0.q', 'layer29.k', 'layer29.v', 'layer29.q', 'tokens'}, set(h)
assert h['layer0.k']['shape'] == [3, 100, 64] and h['layer0.k']['dtype'] == 'BF16'
assert h['layer29.q']['shape'] == [9, 64] and h['layer29.q']['dtype'] == 'F32'
b, e = h['layer0.k']['data_offsets']
body = data[8 + n + b: 8 + n + e]
assert sum(1 for i in range(0, len(body), 2) if body[i:i+2] != b'\0\0') > 10000
print("dump-kv ok")
PY
echo "2 passed, 0 failed"
