#!/usr/bin/env python3
"""Head_dim-128 KV for the GPU decode benchmark, from a certkv KV dump of a head_dim-64 model.

certkv runs no real model with head_dim 128 on the development machine, so each 128-channel
head is two real 64-channel KV heads of one layer side by side (kv heads 0 and 1 of the dumped
layers of Qwen2.5-Coder-0.5B), and each query is the matching pair of real queries (query g of
kv head 0's group next to query g of kv head 1's group), so scores are sums of two real heads'
scores. Values, keys and queries are real; only the pairing is made up.

  make_bench_kv.py DUMP.safetensors OUT.safetensors [--heads 8] [--q-per-kv 7]

OUT: k, v BF16 [heads][N][128]; q F32 [heads][q_per_kv][128]; metadata "source".
"""
import argparse
import json
import struct

import numpy as np


def read_dump(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "BF16":
            arr = np.frombuffer(raw, dtype=np.uint16).reshape(t["shape"])
        elif t["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype=np.float32).reshape(t["shape"])
        else:
            arr = np.frombuffer(raw, dtype=np.int32).reshape(t["shape"])
        tensors[name] = arr
    return meta, tensors


def write_safetensors(path, tensors, metadata):
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, arr in tensors:
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
        for _, _, arr in tensors:
            f.write(arr.tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-per-kv", type=int, default=7)
    args = ap.parse_args()
    meta, t = read_dump(args.dump)
    layers = [int(x) for x in meta["layers"].split(",")]
    n_heads, n_kv = int(meta["n_heads"]), int(meta["n_kv_heads"])
    group = n_heads // n_kv
    if n_kv < 2 or int(meta["head_dim"]) != 64 or group < args.q_per_kv:
        raise SystemExit("need a dump with >= 2 kv heads of head_dim 64 and >= q_per_kv queries per group")
    if len(layers) < args.heads:
        raise SystemExit(f"need {args.heads} dumped layers, the dump has {len(layers)}")
    ks, vs, qs = [], [], []
    for layer in layers[: args.heads]:
        k, v, q = t[f"layer{layer}.k"], t[f"layer{layer}.v"], t[f"layer{layer}.q"]
        ks.append(np.concatenate([k[0], k[1]], axis=-1))
        vs.append(np.concatenate([v[0], v[1]], axis=-1))
        qs.append(np.stack([np.concatenate([q[g], q[group + g]]) for g in range(args.q_per_kv)]))
    n = ks[0].shape[0] // 16 * 16
    k = np.ascontiguousarray(np.stack(ks)[:, :n]).view(np.uint16)
    v = np.ascontiguousarray(np.stack(vs)[:, :n]).view(np.uint16)
    q = np.ascontiguousarray(np.stack(qs).astype(np.float32))
    source = (f"{meta.get('model', '?')}: layers {','.join(map(str, layers[:args.heads]))}, kv heads 0|1 "
              f"side by side as head_dim 128; {n} tokens of {meta.get('source_text', '?')}")
    write_safetensors(args.out, [("k", "BF16", k), ("v", "BF16", v), ("q", "F32", q)], {"source": source})
    print(f"{args.out}: k, v [{args.heads}][{n}][128], q [{args.heads}][{args.q_per_kv}][128]; {source}")


if __name__ == "__main__":
    main()
