#!/usr/bin/env python3
"""Seed inputs for fuzz/: GGUF and safetensors files small enough for libFuzzer.

usage: make_fuzz_seeds.py FIXTURE_GGUF OUT_DIR
Writes OUT_DIR/gguf/* (the first 64 KiB of the fixture, synthetic v2 and v3 files with every
value type and a few tensors) and OUT_DIR/safetensors/* (synthetic files of several dtypes).
The GGUF files are written here with struct, independently of certkv's reader.
"""
import json
import struct
import sys
from pathlib import Path

# GGUF value type ids (ggml/docs/gguf.md).
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FORMAT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
                 BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(t, v):
    if t == STR:
        return struct.pack("<I", STR) + gguf_string(v)
    if t == ARR:
        element, items = v
        out = struct.pack("<IIQ", ARR, element, len(items))
        for item in items:
            out += gguf_string(item) if element == STR else struct.pack(SCALAR_FORMAT[element], item)
        return out
    return struct.pack("<I", t) + struct.pack(SCALAR_FORMAT[t], v)


def gguf_file(version, kvs, tensors, alignment=32):
    """tensors: (name, dims, ggml_type, data bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, (t, v) in kvs:
        out += gguf_string(key) + gguf_value(t, v)
    offset, offsets = 0, []
    for name, dims, ggml_type, data in tensors:
        offset = (offset + alignment - 1) // alignment * alignment
        offsets.append(offset)
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
        offset += len(data)
    out += b"\0" * (-len(out) % alignment)
    data_start = len(out)
    for (_, _, _, data), off in zip(tensors, offsets):
        out += b"\0" * (data_start + off - len(out)) + data
    return out


def safetensors_file(tensors, metadata):
    """tensors: (name, dtype, shape, data bytes)."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def main():
    fixture, out = Path(sys.argv[1]), Path(sys.argv[2])
    (out / "gguf").mkdir(parents=True, exist_ok=True)
    (out / "safetensors").mkdir(parents=True, exist_ok=True)
    if fixture.exists():
        (out / "gguf" / "fixture_head.gguf").write_bytes(fixture.read_bytes()[:65536])

    kvs = [("general.architecture", (STR, "llama")), ("u8", (U8, 7)), ("i8", (I8, -3)),
           ("u16", (U16, 500)), ("i16", (I16, -500)), ("u32", (U32, 70000)), ("i32", (I32, -7)),
           ("f32", (F32, 0.5)), ("b", (BOOL, 1)), ("u64", (U64, 1 << 40)), ("i64", (I64, -(1 << 40))),
           ("f64", (F64, 2.25)), ("tokens", (ARR, (STR, ["<s>", "a", "bc"]))),
           ("scores", (ARR, (F32, [0.0, -1.0, -2.0]))), ("types", (ARR, (I32, [3, 1, 1])))]
    tensors = [("w.f32", [3, 2], 0, bytes(range(24))), ("w.f16", [17], 1, bytes(range(34))),
               ("w.q8_0", [32, 2], 8, bytes(range(68))), ("w.q4_1", [64], 3, bytes(range(40)))]
    for version in (2, 3):
        (out / "gguf" / f"synthetic_v{version}.gguf").write_bytes(gguf_file(version, kvs, tensors))
    aligned = [("general.alignment", (U32, 64))] + kvs[:3]
    (out / "gguf" / "aligned64.gguf").write_bytes(gguf_file(3, aligned, tensors[:2], alignment=64))

    st = [("a", "F32", [2, 3], bytes(range(24))), ("b", "BF16", [5], bytes(range(10))),
          ("c", "I64", [1], bytes(range(8))), ("d", "U8", [0], b"")]
    (out / "safetensors" / "synthetic.safetensors").write_bytes(
        safetensors_file(st, {"format": "pt", "note": "caf\u00e9 \"q\""}))
    (out / "safetensors" / "empty.safetensors").write_bytes(safetensors_file([], {}))


if __name__ == "__main__":
    main()
