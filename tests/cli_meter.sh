#!/usr/bin/env bash
# The meter through the CLI on the embedded default: `run --json` reports the meter, `audit`
# finds no violation and dumps cells an independent check recomputes, `eval teacher-forced` and
# `eval needle` run and report their figures.
# usage: cli_meter.sh CERTKV_BINARY MODEL.gguf TEST_DATA_DIR (tests/data)
set -eu
bin=$1 model=$2 data=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
text="$data/corpus/conrad-heart-of-darkness.txt"

"$bin" run --model "$model" --kv dither8 --prompt "Name three colours." --n 12 --json >"$tmp/run.json"
"$bin" run --model "$model" --kv fp8-e4m3 --gate --tau 0.05 --prompt "Name three colours." --n 12 --json >"$tmp/gated.json"
"$bin" audit --model "$model" --kv rtn4 --text-file "$text" --tokens 400 --steps 3 --json \
  --dump "$tmp/cells.safetensors" --dump-cells 3 >"$tmp/audit.json"
"$bin" audit --model "$model" --kv rtn4 --witness u8 --text-file "$text" --tokens 400 --steps 3 --json \
  >"$tmp/audit_u8.json"
"$bin" eval teacher-forced --model "$model" --kv rtn8 --text-file "$text" --tokens 300 --steps 2 \
  --json --per-position >"$tmp/tf.json"
"$bin" eval needle --model "$model" --kv rtn8 --lengths 300 --samples 1 --json >"$tmp/needle.json" 2>/dev/null
# The backing store GAAC-coded with a calibration of this model: same text, fewer backing bytes.
"$bin" dump-kv --model "$model" --text-file "$data/corpus/austen-emma.txt" --tokens 512 \
  --out "$tmp/dump.safetensors" 2>/dev/null
"$bin" codec --codec gaac --calib "$tmp/dump.safetensors" --save-calibration "$tmp/cal.safetensors" >/dev/null
head -c 6000 "$text" >"$tmp/prompt.txt"
"$bin" run --model "$model" --kv rtn8 --prompt-file "$tmp/prompt.txt" --raw --n 4 --json >"$tmp/backing_raw.json"
"$bin" run --model "$model" --kv rtn8 --gaac-calib "$tmp/cal.safetensors" --prompt-file "$tmp/prompt.txt" \
  --raw --n 4 --json >"$tmp/backing_gaac.json"

python3 - "$tmp" <<'PY'
import json, math, struct, sys
d = sys.argv[1]
run = json.load(open(d + '/run.json'))
m = run['meter']
for key in ('coverage', 'max', 'p50', 'p99', 'repairs', 'pagein_bytes', 'cells', 'tier'):
    assert key in m, key
assert m['tier'] == 'B' and m['cells'] > 0 and m['cells'] % (30 * 9) == 0, m
assert 0 <= m['coverage'] <= 1 and 0 <= m['p50'] <= m['p99'] <= m['max'] <= 1, m
gated = json.load(open(d + '/gated.json'))['meter']
assert gated['repairs'] > 0 and gated['pagein_bytes'] == gated['repairs'] * 16 * 64 * 2, gated

audit = json.load(open(d + '/audit.json'))
assert audit['cells'] == 3 * 30 * 9 and audit['violations'] == 0, audit
assert len(audit['layers']) == 30 and all(l['violations'] == 0 for l in audit['layers'])
# The page-scaled 8-bit witness: the same cells, sound, close to the fp16 witness's meter.
coded = json.load(open(d + '/audit_u8.json'))
assert audit['witness'] == 'fp16' and coded['witness'] == 'u8', (audit.get('witness'), coded.get('witness'))
assert coded['cells'] == audit['cells'] and coded['violations'] == 0, coded
assert abs(coded['coverage'] - audit['coverage']) <= 0.02, (coded['coverage'], audit['coverage'])
assert abs(coded['tightness']['q50'] / audit['tightness']['q50'] - 1) <= 0.05, (coded['tightness'], audit['tightness'])
# An independent recomputation of TV from the dumped cells.
raw = open(d + '/cells.safetensors', 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n])
meta = header.pop('__metadata__')
assert meta['scheme'] == 'rtn4'
def tensor(name):
    t = header[name]
    a, b = t['data_offsets']
    fmt = {'F32': 'f', 'F64': 'd'}[t['dtype']]
    data = raw[8 + n + a:8 + n + b]
    return struct.unpack('<%d%s' % (len(data) // struct.calcsize(fmt), fmt), data), t['shape']
cells = int(meta['cells'])
assert cells >= 3
for i in range(cells):
    q, _ = tensor('cell%d.q' % i)
    k, shape = tensor('cell%d.k' % i)
    kh, _ = tensor('cell%d.k_hat' % i)
    scale = tensor('cell%d.scale' % i)[0][0]
    meter = tensor('cell%d.meter' % i)[0][0]
    s, dim = shape
    def softmax(kk):
        x = [scale * sum(q[e] * kk[t * dim + e] for e in range(dim)) for t in range(s)]
        mx = max(x)
        w = [math.exp(v - mx) for v in x]
        z = sum(w)
        return [v / z for v in w]
    p, ph = softmax(k), softmax(kh)
    tv = 0.5 * sum(abs(a - b) for a, b in zip(p, ph))
    assert meter >= tv - 1e-9, (i, meter, tv)

tf = json.load(open(d + '/tf.json'))
assert tf['tokens'] == 300 and len(tf['kl']) == 300 and tf['top1'] > 0.9 and tf['mean_kl'] < 0.05, tf['mean_kl']
assert tf['meter']['cells'] == 2 * 30 * 9
needle = json.load(open(d + '/needle.json'))
assert needle['lengths'][0]['samples'] == 1 and 0 <= needle['accuracy'] <= 1
raw, coded = json.load(open(d + '/backing_raw.json')), json.load(open(d + '/backing_gaac.json'))
assert raw['text'] == coded['text'] and raw['kv_bytes'] == coded['kv_bytes'], (raw['text'], coded['text'])
assert 0 < coded['kv_backing_bytes'] < 0.85 * raw['kv_backing_bytes'], (coded['kv_backing_bytes'], raw['kv_backing_bytes'])
print('cli_meter: run, gate, audit (%d cells, tightness median %.3g), teacher-forced (KL %.2e), needle ok'
      % (audit['cells'], audit['tightness']['q50'], tf['mean_kl']))
PY
