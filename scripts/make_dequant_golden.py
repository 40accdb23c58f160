#!/usr/bin/env python3
"""Writes tests/golden/dequant_golden.bin: rows of ggml-quantized weights with the floats the
Python `gguf` package (gguf.quants.dequantize) decodes them to, for src/model/dequant_test.cc.

Records come from three sources:
  * rows of SmolLM2-135M-Instruct.Q4_1.gguf (Q8_0, Q4_1, F32): stored as (tensor name, row) plus
    the expected floats; the test reads the bytes from the model file;
  * rows of qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (Q4_K, Q6_K, Q5_0), when that model is
    present: bytes stored inline;
  * random data: gguf.quants.quantize where the package can quantize the type (F16, BF16, Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0); random bytes with chosen fp16 scales for the k-quants, which the
    package only dequantizes. Bytes stored inline.

File layout (little-endian):
  magic "CKDQGLD1", u32 record count, then per record:
  u32 ggml type id, u32 source (0 inline bytes, 1 row of the SmolLM2 model),
  u32 name length, name (tensor name, or a description), u64 row, u64 element count,
  u64 byte count (0 for source 1), the bytes, f32 expected[element count].

Usage: scripts/make_dequant_golden.py [--models DIR] [--out FILE]
"""

import argparse
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

# (tensor, row) pairs of SmolLM2 to check, chosen to cover first, middle and last rows.
SMOLLM2_ROWS = [
    ("token_embd.weight", 0),
    ("token_embd.weight", 1234),
    ("token_embd.weight", 49151),
    ("blk.0.attn_q.weight", 0),
    ("blk.0.attn_q.weight", 575),
    ("blk.29.ffn_down.weight", 100),
    ("blk.0.attn_norm.weight", 0),
]

# Row 7 of the first 2-D tensor of each of these types in the Qwen model.
QWEN_TYPES = (Q.Q4_K, Q.Q6_K, Q.Q5_0)

BLOCK = {Q.F32: 1, Q.F16: 1, Q.BF16: 1, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32,
         Q.Q8_0: 32, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256}
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def row_bytes(reader_tensor, row):
    data = np.asarray(reader_tensor.data)
    if data.ndim == 1:
        data = data.reshape(1, -1)
    return np.ascontiguousarray(data[row]).view(np.uint8).reshape(-1)


def expected_floats(qtype, raw, n):
    out = dequantize(raw.reshape(1, -1), qtype).astype(np.float32).reshape(-1)
    assert out.size == n, (qtype, out.size, n)
    return out


def random_floats(rng, n):
    # Blocks of 32 with scales spread over four decades and an outlier now and then.
    x = rng.standard_normal(n).astype(np.float32)
    scale = (10.0 ** rng.uniform(-3, 1, size=(n + 31) // 32)).astype(np.float32)
    x *= np.repeat(scale, 32)[:n]
    outliers = rng.random(n) < 0.01
    x[outliers] *= 20
    return x


def random_k_quant(rng, qtype, n_blocks):
    size = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 0.5, size=n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q6_K:
        raw[:, 208:210] = d
    else:
        dmin = rng.uniform(1e-4, 0.1, size=n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 0:2] = d
        raw[:, 2:4] = dmin
    return raw.reshape(-1)


def record(qtype, source, name, row, n, raw, expected):
    name_bytes = name.encode()
    head = struct.pack("<III", int(qtype), source, len(name_bytes)) + name_bytes
    head += struct.pack("<QQQ", row, n, 0 if raw is None else raw.size)
    body = b"" if raw is None else raw.tobytes()
    assert expected.dtype == np.float32 and expected.size == n
    return head + body + expected.tobytes()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=os.path.join(here, "..", "models"))
    parser.add_argument("--out", default=os.path.join(here, "..", "tests", "golden", "dequant_golden.bin"))
    args = parser.parse_args()

    records = []
    smollm2 = os.path.join(args.models, SMOLLM2)
    if not os.path.exists(smollm2):
        sys.exit(f"{smollm2} is missing: run scripts/fetch_models.sh")
    reader = GGUFReader(smollm2)
    tensors = {t.name: t for t in reader.tensors}
    for name, row in SMOLLM2_ROWS:
        t = tensors[name]
        raw = row_bytes(t, row)
        n = int(t.shape[0])
        records.append(record(t.tensor_type, 1, name, row, n, None, expected_floats(t.tensor_type, raw, n)))

    qwen = os.path.join(args.models, QWEN)
    if os.path.exists(qwen):
        reader = GGUFReader(qwen)
        seen = set()
        for t in reader.tensors:
            if t.tensor_type in QWEN_TYPES and t.tensor_type not in seen and len(t.shape) == 2:
                row = 7 % int(t.shape[1])
                raw = row_bytes(t, row)
                n = int(t.shape[0])
                records.append(record(t.tensor_type, 0, f"{QWEN}:{t.name}", row, n, raw,
                                      expected_floats(t.tensor_type, raw, n)))
                seen.add(t.tensor_type)
    else:
        print(f"note: {qwen} not found; k-quants are covered by random blocks only", file=sys.stderr)

    rng = np.random.default_rng(20261130)
    for qtype in (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        n = 256
        x = random_floats(rng, n)
        raw = np.asarray(quantize(x.reshape(1, -1), qtype)).view(np.uint8).reshape(-1)
        records.append(record(qtype, 0, f"random {qtype.name}", 0, n, raw, expected_floats(qtype, raw, n)))
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        n_blocks = 2
        raw = random_k_quant(rng, qtype, n_blocks)
        n = 256 * n_blocks
        records.append(record(qtype, 0, f"random {qtype.name}", 0, n, raw, expected_floats(qtype, raw, n)))

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(b"CKDQGLD1" + struct.pack("<I", len(records)))
        for r in records:
            f.write(r)
    print(f"wrote {len(records)} records, {os.path.getsize(args.out)} bytes to {args.out}")


if __name__ == "__main__":
    main()
