#!/usr/bin/env bash
# Bad input through the CLI: each case must exit non-zero with exactly one error line on stderr
# naming the file or flag at fault, and never crash (exit >= 128) or hang.
# usage: cli_bad_input.sh CERTKV_BINARY MODEL.gguf TEST_DATA_DIR (tests/data)
set -u
bin=$1 model=$2 data=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0 passed=0

expect_error() {  # name, expected substring, command...
  local name=$1 want=$2
  shift 2
  timeout 120 "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ $rc -eq 0 ] || [ $rc -ge 124 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$want" "$tmp/err"; then
    echo "FAIL $name: rc=$rc, stderr ($lines lines):"; sed 's/^/    /' "$tmp/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: $(cat "$tmp/err")"
    passed=$((passed + 1))
  fi
}

head -c 1000 "$model" >"$tmp/truncated.gguf"
printf 'GGUX\3\0\0\0' >"$tmp/badmagic.gguf"
cp "$model" "$tmp/flipped.gguf" && printf '\x63' | dd of="$tmp/flipped.gguf" bs=1 seek=4 conv=notrunc 2>/dev/null
python3 - "$tmp" <<'PY'
import struct, sys
d = sys.argv[1]
def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
# A GGUF v3 whose only tensor's offset points past the end of the file.
hdr = b'GGUF' + struct.pack('<IQQ', 3, 1, 1) + s('general.architecture') + struct.pack('<I', 8) + s('llama')
hdr += s('token_embd.weight') + struct.pack('<I', 2) + struct.pack('<QQ', 32, 4) + struct.pack('<I', 0) + struct.pack('<Q', 1 << 40)
hdr += b'\0' * ((32 - len(hdr) % 32) % 32)
open(d + '/offset.gguf', 'wb').write(hdr + b'\0' * 64)
# A well-formed GGUF of an unsupported architecture.
hdr = b'GGUF' + struct.pack('<IQQ', 3, 0, 1) + s('general.architecture') + struct.pack('<I', 8) + s('mamba')
open(d + '/arch.gguf', 'wb').write(hdr)
# A llama GGUF whose one matrix has an unsupported quant type (Q2_K = 10).
def u32(key, v): return s(key) + struct.pack('<II', 4, v)
meta = [s('general.architecture') + struct.pack('<I', 8) + s('llama'), u32('llama.block_count', 1),
        u32('llama.embedding_length', 256), u32('llama.feed_forward_length', 256),
        u32('llama.attention.head_count', 4)]
hdr = b'GGUF' + struct.pack('<IQQ', 3, 1, len(meta)) + b''.join(meta)
hdr += s('token_embd.weight') + struct.pack('<I', 2) + struct.pack('<QQ', 256, 4) + struct.pack('<I', 10) + struct.pack('<Q', 0)
hdr += b'\0' * ((32 - len(hdr) % 32) % 32)
open(d + '/quant.gguf', 'wb').write(hdr + b'\0' * (84 * 4))
# A safetensors file whose header length is past the end.
open(d + '/bad.safetensors', 'wb').write(struct.pack('<Q', 1 << 30) + b'{}')
PY
mkdir -p "$tmp/hf" && cp "$tmp/bad.safetensors" "$tmp/hf/model.safetensors"
printf '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32}' >"$tmp/hf/config.json"
yes "the quick brown fox jumps over the lazy dog" | head -n 400 >"$tmp/long.txt"

expect_error missing-model "no such file" "$bin" run --model "$tmp/none.gguf" --prompt hi
expect_error truncated-gguf "truncated.gguf" "$bin" run --model "$tmp/truncated.gguf" --prompt hi
expect_error wrong-magic "badmagic.gguf" "$bin" run --model "$tmp/badmagic.gguf" --prompt hi
expect_error flipped-version "flipped.gguf" "$bin" run --model "$tmp/flipped.gguf" --prompt hi
expect_error offset-past-end "token_embd.weight" "$bin" run --model "$tmp/offset.gguf" --prompt hi
expect_error unsupported-arch "mamba" "$bin" run --model "$tmp/arch.gguf" --prompt hi
expect_error unsupported-quant "Q2_K" "$bin" run --model "$tmp/quant.gguf" --prompt hi
expect_error bad-safetensors "model.safetensors" "$bin" run --model "$tmp/hf" --prompt hi
expect_error prompt-too-long "context" "$bin" run --model "$model" --prompt-file "$tmp/long.txt" --ctx 64 --n 4
expect_error unknown-flag "--bogus" "$bin" run --model "$model" --bogus
expect_error bad-number "--n" "$bin" run --model "$model" --n abc
expect_error flag-needs-value "--ctx" "$bin" run --model "$model" --ctx
expect_error unknown-kv "--kv" "$bin" run --model "$model" --kv zstd
expect_error bad-top-p "--top-p" "$bin" run --model "$model" --top-p 1.5
expect_error missing-prompt-file "--prompt-file" "$bin" run --model "$model" --prompt-file "$tmp/nope.txt"
expect_error unknown-command "unknown command" "$bin" frobnicate
expect_error dump-missing-out "--out" "$bin" dump-kv --model "$model" --text-file "$tmp/long.txt" --tokens 10
expect_error dump-bad-layers "--layers" "$bin" dump-kv --model "$model" --text-file "$tmp/long.txt" --tokens 10 --out "$tmp/x.safetensors" --layers 99
expect_error dump-short-text "--tokens" "$bin" dump-kv --model "$model" --text-file "$tmp/long.txt" --tokens 100000 --out "$tmp/x.safetensors"
expect_error dump-unwritable "$tmp/nodir/x.safetensors" "$bin" dump-kv --model "$model" --text-file "$tmp/long.txt" --tokens 8 --out "$tmp/nodir/x.safetensors" --layers 0

# certkv codec: a tiny real dump of the model, a dump and a calibration of another model's shape,
# and damaged calibration files.
"$bin" dump-kv --model "$model" --text-file "$tmp/long.txt" --tokens 32 --layers 0,1 --out "$tmp/kv.safetensors" 2>/dev/null
"$bin" codec --codec gaac --calib "$tmp/kv.safetensors" --save-calibration "$tmp/cal.safetensors" 2>/dev/null
python3 - "$tmp" <<'PY'
import json, struct, sys
d = sys.argv[1]
def write(path, tensors, meta):
    header, blobs, offset = {}, [], 0
    for name, dtype, shape, data in tensors:
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header['__metadata__'] = meta
    h = json.dumps(header).encode()
    h += b' ' * ((8 - len(h) % 8) % 8)
    open(path, 'wb').write(struct.pack('<Q', len(h)) + h + b''.join(blobs))
# A KV dump of another model: 2 layers, 1 kv head, head_dim 32, 32 tokens.
rows = struct.pack('<H', 0x3f80) * (32 * 32)
write(d + '/other.safetensors', [('layer%d.%s' % (l, kv), 'BF16', [1, 32, 32], rows) for l in range(2) for kv in 'kv'],
      {'format': 'certkv-kv-dump/1', 'n_layers': '2', 'n_kv_heads': '1', 'head_dim': '32', 'n_tokens': '32', 'layers': '0,1'})
cal = bytearray(open(d + '/cal.safetensors', 'rb').read())
n = struct.unpack('<Q', cal[:8])[0]
header = json.loads(cal[8:8 + n])
open(d + '/cal-truncated.safetensors', 'wb').write(cal[:len(cal) // 2])
bad = bytearray(cal)
bad[8 + n + header['layer1.v.b4']['data_offsets'][0] + 5] ^= 1  # one base off by one
open(d + '/cal-flipped.safetensors', 'wb').write(bad)
open(d + '/cal-version.safetensors', 'wb').write(cal.replace(b'certkv-gaac-calibration/1', b'certkv-gaac-calibration/7'))
PY
"$bin" codec --codec gaac --calib "$tmp/other.safetensors" --save-calibration "$tmp/other-cal.safetensors" 2>/dev/null

expect_error codec-unknown-name "unknown codec 'lzma'" "$bin" codec --codec lzma --calib "$tmp/kv.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-missing-calib "--calib" "$bin" codec --codec gaac --in "$tmp/kv.safetensors"
expect_error codec-other-model-dump "another model" "$bin" codec --codec gaac --calib "$tmp/other.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-other-model-calibration "other-cal.safetensors" "$bin" codec --codec gaac --calib "$tmp/other-cal.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-element-mismatch "cal.safetensors" "$bin" codec --codec gaac-e5m2 --calib "$tmp/cal.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-truncated-calibration "cal-truncated.safetensors" "$bin" codec --codec gaac --calib "$tmp/cal-truncated.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-flipped-calibration "cal-flipped.safetensors" "$bin" codec --codec gaac --calib "$tmp/cal-flipped.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-calibration-version "calibration/7" "$bin" codec --codec gaac --calib "$tmp/cal-version.safetensors" --in "$tmp/kv.safetensors"
expect_error codec-in-not-a-dump "is not a KV dump" "$bin" codec --codec gaac --calib "$tmp/kv.safetensors" --in "$tmp/cal.safetensors"

expect_error run-gaac-other-model "other-cal.safetensors" "$bin" run --model "$model" --kv gaac --gaac-calib "$tmp/other-cal.safetensors" --prompt hi --n 1

expect_error run-calibration-without-gaac "--gaac-calib" "$bin" run --model "$model" --kv fp8-e5m2-pages --gaac-calib "$tmp/cal.safetensors" --prompt hi --n 1

# The meter, the gate and the evaluations.
corpus="$data/corpus/stoker-dracula.txt"
expect_error run-unknown-kv "unknown KV scheme 'int3'" "$bin" run --model "$model" --kv int3 --prompt hi --n 1
expect_error run-tau-zero "--tau" "$bin" run --model "$model" --kv dither8 --tau 0 --prompt hi --n 1
expect_error run-delta-one "--delta" "$bin" run --model "$model" --kv dither8 --delta 1 --prompt hi --n 1
expect_error run-delta-negative "--delta" "$bin" run --model "$model" --kv dither8 --delta -0.5 --prompt hi --n 1
expect_error run-outliers-above-half "outlier pairs 40" "$bin" run --model "$model" --kv dither8 --outlier-pairs 40 --prompt hi --n 1
expect_error run-outliers-not-dither8 "--outlier-pairs" "$bin" run --model "$model" --kv rtn8 --outlier-pairs 2 --prompt hi --n 1
expect_error run-witness-unknown "'u16' is not a witness (fp16, u8, exponent)" "$bin" run --model "$model" --kv rtn8 --witness u16 --prompt hi --n 1
expect_error run-witness-exponent-rtn8 "witness exponent is not sound for kv rtn8" "$bin" run --model "$model" --kv rtn8 --witness exponent --prompt hi --n 1
expect_error run-witness-exponent-scaled "witness exponent is not sound for kv fp8-e4m3-scaled" "$bin" run --model "$model" --kv fp8-e4m3-scaled --witness exponent --prompt hi --n 1
expect_error run-witness-dither8 "--witness applies to the Tier A" "$bin" run --model "$model" --kv dither8 --witness u8 --prompt hi --n 1
expect_error run-witness-bf16 "--witness applies to the Tier A" "$bin" run --model "$model" --kv bf16 --witness u8 --prompt hi --n 1
expect_error run-gate-bf16 "--gate" "$bin" run --model "$model" --kv bf16 --gate --prompt hi --n 1
expect_error run-window-not-block "recent_window_tokens 20" "$bin" run --model "$model" --kv kivi2 --window 20 --prompt hi --n 1
expect_error audit-bf16 "lossy scheme" "$bin" audit --model "$model" --kv bf16 --text-file "$corpus" --tokens 64
expect_error audit-short-text "fewer than" "$bin" audit --model "$model" --kv rtn8 --text-file "$tmp/cal.safetensors" --tokens 100000
expect_error audit-missing-text "--text-file" "$bin" audit --model "$model" --kv rtn8 --tokens 64
expect_error eval-unknown-task "unknown evaluation 'perplexity'" "$bin" eval perplexity --kv rtn8
expect_error eval-tf-missing-file "cannot read file" "$bin" eval teacher-forced --model "$model" --kv rtn8 --text-file "$tmp/none.txt" --tokens 64
expect_error eval-needle-bad-length "--lengths" "$bin" eval needle --model "$model" --kv rtn8 --lengths 1024,abc --samples 1
expect_error eval-needle-too-long "context" "$bin" eval needle --model "$model" --kv rtn8 --lengths 100000 --samples 1
expect_error eval-needle-variant "--variant" "$bin" eval needle --model "$model" --kv rtn8 --lengths 1024 --variant multi-everything --samples 1
expect_error eval-needle-corpus "--corpus" "$bin" eval needle --model "$model" --kv rtn8 --lengths 1024 --samples 1 --haystack corpus --corpus "$tmp/no-books-here"

# Sparse decode (--ctx 256 where the spec is valid: the default window of 128 tokens must fit the
# context): the --sparse spec, its bounds against the context and the model, the gate, and a
# model file that does not state its RoPE (the SmolLM2 file with its rope.freq_base key renamed,
# offsets unchanged): dense decode runs it, sparse decode refuses it.
python3 - "$model" "$tmp/norope.gguf" <<'PY'
import sys
data = open(sys.argv[1], 'rb').read()
key = b'llama.rope.freq_base'
assert data.count(key) == 1, 'expected one llama.rope.freq_base key'
open(sys.argv[2], 'wb').write(data.replace(key, b'llama.rope.freq_bass'))
PY
expect_error sparse-p-zero "p must be in (0, 1], got 0" "$bin" run --model "$model" --sparse p=0 --prompt hi --n 1
expect_error sparse-p-above-one "p must be in (0, 1], got 1.5" "$bin" run --model "$model" --sparse p=1.5 --prompt hi --n 1
expect_error sparse-p-not-a-number "p 'abc' is not a number" "$bin" run --model "$model" --sparse p=abc --prompt hi --n 1
expect_error device-unknown "flag --device: expected cpu or cuda, got 'tpu'" "$bin" run --model "$model" --device tpu --prompt hi --n 1
expect_error device-cuda-rtn8 "device cuda: KV scheme rtn8 is not served on the device yet" "$bin" run --model "$model" --device cuda --kv rtn8 --prompt hi --n 1
expect_error device-cuda-sparse-gaac "device cuda: sparse decode on the device reads bf16 pages" "$bin" run --model "$model" --device cuda --kv dither8 --sparse p=0.9 --prompt hi --n 1
expect_error sparse-p-missing "p is missing" "$bin" run --model "$model" --sparse window=64 --prompt hi --n 1
expect_error sparse-unknown-key "unknown key 'budget'" "$bin" run --model "$model" --sparse p=0.9,budget=3 --prompt hi --n 1
expect_error sparse-negative-deviations "deviations must be finite and >= 0, got -1" "$bin" run --model "$model" --sparse p=0.9,deviations=-1 --prompt hi --n 1
expect_error sparse-deviations-not-a-number "deviations 'x' is not a number" "$bin" run --model "$model" --sparse p=0.9,deviations=x --prompt hi --n 1
expect_error sparse-bad-rotation "rotation must be haar or hadamard" "$bin" run --model "$model" --sparse p=0.9,rotation=qr --prompt hi --n 1
expect_error sparse-window-above-context "sparse window 1000" "$bin" run --model "$model" --ctx 256 --sparse p=0.9,window=1000 --prompt hi --n 1
expect_error sparse-dense-above-layers "sparse dense layers 999" "$bin" run --model "$model" --ctx 256 --sparse p=0.9,dense=999 --prompt hi --n 1
expect_error sparse-with-gate "--gate and --sparse" "$bin" run --model "$model" --kv dither8 --gate --sparse p=0.9 --prompt hi --n 1
expect_error sparse-audit-with-gate "--gate and --sparse" "$bin" audit --model "$model" --kv dither8 --gate --sparse p=0.9 --text-file "$corpus" --tokens 64
expect_error sparse-without-rope "RoPE" "$bin" run --model "$tmp/norope.gguf" --ctx 256 --sparse p=0.9 --prompt hi --n 1
if "$bin" run --model "$tmp/norope.gguf" --prompt hi --n 1 >"$tmp/out" 2>"$tmp/err"; then
  echo "ok   dense-without-rope: runs"
  passed=$((passed + 1))
else
  echo "FAIL dense-without-rope: dense decode must not need the RoPE key:"; sed 's/^/    /' "$tmp/err"
  failures=$((failures + 1))
fi

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
