#!/usr/bin/env python3
"""A small Llama GGUF with random weights and a real tokenizer, for device runs that need a model
the CUDA route serves (head_dim 64) without carrying a real one over in chunks.

usage: make_tiny_llama_gguf.py FIXTURE_GGUF OUT_GGUF [--layers 2] [--seed 0]

FIXTURE_GGUF is tests/data/models/llama-2-tiny-random.gguf: its tokenizer (the complete Llama-2
SentencePiece vocabulary, 32,000 tokens) is copied; the model is new: 256-wide, 4 query and 2 KV
heads of 64 channels, a 512-wide SwiGLU, F16 weights drawn from a seeded normal distribution,
the output head tied to the embeddings (no output.weight). About 18 MB at 2 layers. Its text is
noise; what it is for is the mechanics (the device's pages, meters, the server, the engine).
The GGUF is read and written here with struct and NumPy, independently of certkv's loader.
"""
import argparse
import struct
from pathlib import Path

import numpy as np

# GGUF value type ids (ggml/docs/gguf.md) and ggml tensor types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FORMAT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
                 BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_F16 = 0, 1
ALIGNMENT = 32

EMBED, HEADS, KV_HEADS, FFN, CONTEXT = 256, 4, 2, 512, 4096
HEAD_DIM = EMBED // HEADS


class Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> bytes:
        n = self.scalar("<Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, t: int):
        if t == STR:
            return self.string()
        if t == ARR:
            element, n = self.scalar("<I"), self.scalar("<Q")
            return element, [self.value(element) for _ in range(n)]
        return self.scalar(SCALAR_FORMAT[t])


def read_metadata(path: Path) -> list[tuple[str, int, object]]:
    r = Reader(path.read_bytes())
    if r.data[:4] != b"GGUF":
        raise SystemExit(f"{path}: not a GGUF file")
    r.pos = 4
    version, _, n_kv = r.scalar("<I"), r.scalar("<Q"), r.scalar("<Q")
    if version not in (2, 3):
        raise SystemExit(f"{path}: GGUF version {version}, expected 2 or 3")
    kvs = []
    for _ in range(n_kv):
        key = r.string().decode()
        t = r.scalar("<I")
        kvs.append((key, t, r.value(t)))
    return kvs


def encode_value(t: int, v) -> bytes:
    if t == STR:
        return struct.pack("<Q", len(v)) + v
    if t == ARR:
        element, items = v
        return struct.pack("<IQ", element, len(items)) + b"".join(encode_value(element, x) for x in items)
    return struct.pack(SCALAR_FORMAT[t], v)


def gguf_bytes(kvs, tensors) -> bytes:
    """kvs: (key, type, value); tensors: (name, dims, ggml type, data)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs))]
    for key, t, v in kvs:
        out += [encode_value(STR, key.encode()), struct.pack("<I", t), encode_value(t, v)]
    offset, offsets = 0, []
    for name, dims, ggml_type, data in tensors:
        offset = (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        offsets.append(offset)
        out += [encode_value(STR, name.encode()), struct.pack("<I", len(dims)),
                b"".join(struct.pack("<Q", d) for d in dims), struct.pack("<IQ", ggml_type, offset)]
        offset += len(data)
    head = b"".join(out)
    head += b"\0" * (-len(head) % ALIGNMENT)
    body = bytearray()
    for (_, _, _, data), off in zip(tensors, offsets):
        body += b"\0" * (off - len(body)) + data
    return head + bytes(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fixture", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = [(k, t, v) for k, t, v in read_metadata(args.fixture) if k.startswith("tokenizer.")]
    vocab = next(len(v[1]) for k, t, v in tokenizer if k == "tokenizer.ggml.tokens")
    kvs = [("general.architecture", STR, b"llama"), ("general.name", STR, b"certkv tiny random llama"),
           ("llama.context_length", U32, CONTEXT), ("llama.embedding_length", U32, EMBED),
           ("llama.block_count", U32, args.layers), ("llama.feed_forward_length", U32, FFN),
           ("llama.rope.dimension_count", U32, HEAD_DIM), ("llama.attention.head_count", U32, HEADS),
           ("llama.attention.head_count_kv", U32, KV_HEADS),
           ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5), ("llama.rope.freq_base", F32, 10000.0),
           ("general.file_type", U32, 1)] + tokenizer
    rng = np.random.default_rng(args.seed)

    def f16(shape, scale):  # GGUF dims are ggml's: the first is the row length
        return (rng.standard_normal(shape[::-1]) * scale).astype("<f2").tobytes()

    ones = np.ones(EMBED, dtype="<f4").tobytes()
    tensors = [("token_embd.weight", [EMBED, vocab], GGML_F16, f16([EMBED, vocab], 1.0))]
    kv_width = KV_HEADS * HEAD_DIM
    for layer in range(args.layers):
        p = f"blk.{layer}."
        # Larger q and k weights than 1/sqrt(width), so that attention is not uniform and the
        # pages' errors show in the meter.
        tensors += [(p + "attn_norm.weight", [EMBED], GGML_F32, ones),
                    (p + "attn_q.weight", [EMBED, EMBED], GGML_F16, f16([EMBED, EMBED], 0.15)),
                    (p + "attn_k.weight", [EMBED, kv_width], GGML_F16, f16([EMBED, kv_width], 0.15)),
                    (p + "attn_v.weight", [EMBED, kv_width], GGML_F16, f16([EMBED, kv_width], 0.06)),
                    (p + "attn_output.weight", [EMBED, EMBED], GGML_F16, f16([EMBED, EMBED], 0.06)),
                    (p + "ffn_norm.weight", [EMBED], GGML_F32, ones),
                    (p + "ffn_gate.weight", [EMBED, FFN], GGML_F16, f16([EMBED, FFN], 0.06)),
                    (p + "ffn_up.weight", [EMBED, FFN], GGML_F16, f16([EMBED, FFN], 0.06)),
                    (p + "ffn_down.weight", [FFN, EMBED], GGML_F16, f16([FFN, EMBED], 0.04))]
    tensors.append(("output_norm.weight", [EMBED], GGML_F32, ones))
    args.out.write_bytes(gguf_bytes(kvs, tensors))
    print(f"{args.out}: {args.layers} layers, {HEADS} / {KV_HEADS} heads of {HEAD_DIM}, vocabulary {vocab}, "
          f"{args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
