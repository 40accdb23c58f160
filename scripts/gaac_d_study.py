#!/usr/bin/env python3
"""The content ratio of GAAC-D, GAAC's device layout (issue 27, item 3), against the CPU format,
on real KV: the same 11 stored bits per bf16 element (sign, 7 mantissa bits, a 3-bit exponent
code), a 2-bit mode tag per group of 8 elements, escape bits for 4-bit and raw groups; what
differs is which elements share a group and where a channel's 4-bit window lies.

  CPU GAAC (docs/format/gaac.md): K and V groups are 8 channels of one token; per channel a 3-bit
      window [b3, b3 + 8) and a 4-bit window [b4, b4 + 16), each the window covering the most
      calibration exponents (ties: the lowest base).
  GAAC-D: K groups 8 channels of one token, V groups 2 channels x 4 tokens (channels 2j, 2j + 1,
      tokens 4i .. 4i + 3 of a 16-token page); the 4-bit window tied to the 3-bit one,
      [b3 - k, b3 - k + 16) for k in 0, 4, 8 (clamped to the exponent range), so that both modes
      decode as one base plus a code.

A group is 3-bit when all 8 exponents fit the channels' 3-bit windows, else 4-bit when all fit
the 4-bit windows, else raw. Bits per group: 88 + 2 (tag) + 0 / 8 / 40 (escapes: bit 3 of each
4-bit code; bits 3..7 of each raw exponent). content ratio = 16 bits x elements / bits stored
(the seed's measure, docs/gaac.md "What ratio counts": no slot slack or raw fallback).

Dumps: `certkv dump-kv` files (docs/format/kv_dump.md: layerL.k / layerL.v [heads, N, D]) or the
decode benchmark's KV (scripts/make_bench_kv.py: k, v [E, N, 128]). Calibration per (layer or
entry, K/V, head, channel) from the --calib dumps, evaluation on --eval, pages of 16 tokens.

  python3 scripts/gaac_d_study.py --calib CAL.safetensors[,CAL2...] --eval EVAL.safetensors [--json OUT]

It also reports the device layout certkv ships (docs/format/gaac_fragments.md): every element a
4-bit code in the 16-wide window b4, exceptions stored whole, pages with too many kept raw.
"""
import argparse
import json
import struct
import sys

import numpy as np

T = 16


def load(path):
    """{(name, 'k'|'v'): uint16 array [heads, N, D]} from either dump form."""
    try:
        return read_dump(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        sys.exit(f"gaac_d_study: cannot read {path} as a KV dump: {e}")


def read_dump(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] != "BF16":
                continue
            a, b = info["data_offsets"]
            f.seek(base + a)
            arr = np.frombuffer(f.read(b - a), dtype=np.uint16).reshape(info["shape"])
            if name in ("k", "v"):  # the benchmark's KV: entries as heads of one tensor
                out[("bench", name)] = arr
            elif name.startswith("layer") and name[-2:] in (".k", ".v"):
                out[(name[:-2], name[-1])] = arr
        if not out:
            raise ValueError("no BF16 k / v tensors")
        for (name, kv), arr in out.items():
            if arr.ndim != 3 or arr.shape[2] % 8 != 0:
                raise ValueError(f"{name}.{kv}: shape {list(arr.shape)}, want [heads, tokens, head_dim (a multiple of 8)]")
        return out


def exponents(bits):
    return ((bits >> 7) & 0xFF).astype(np.int32)


def best_windows(e, width):
    """Per channel of e [heads, N, D]: the base of the width-wide window holding the most
    exponents (ties: the lowest), within [0, 256 - width]."""
    heads, _, d = e.shape
    hist = np.zeros((heads, d, 256), np.int64)
    for h in range(heads):
        for c in range(d):
            hist[h, c] = np.bincount(e[h, :, c], minlength=256)
    csum = np.concatenate([np.zeros((heads, d, 1), np.int64), np.cumsum(hist, axis=2)], axis=2)
    sums = csum[:, :, width:257] - csum[:, :, 0:257 - width]  # window starting at b
    return np.argmax(sums, axis=2)  # the first maximum


def modes(fit3, fit4):
    """0 / 1 / 2 (3-bit, 4-bit, raw) per group from per-group all() flags."""
    return np.where(fit3, 0, np.where(fit4, 1, 2))


def group_bits(m):
    return 90 + np.where(m == 1, 8, np.where(m == 2, 40, 0))


def evaluate(e, b3, b4, v_groups_2x4):
    """Modes of every group of e [heads, N, D] (N a multiple of 16) with windows b3, b4
    [heads, D]."""
    heads, n, d = e.shape
    c3 = e - b3[:, None, :]
    c4 = e - b4[:, None, :]
    ok3 = (c3 >= 0) & (c3 < 8)
    ok4 = (c4 >= 0) & (c4 < 16)
    if not v_groups_2x4:  # 8 channels of one token
        fit3 = ok3.reshape(heads, n, d // 8, 8).all(axis=3)
        fit4 = ok4.reshape(heads, n, d // 8, 8).all(axis=3)
    else:  # 2 channels x 4 tokens within each 16-token page
        def grouped(ok):
            x = ok.reshape(heads, n // 4, 4, d // 2, 2)  # [h, token quad, token, pair, channel]
            return x.transpose(0, 1, 3, 2, 4).reshape(heads, n // 4, d // 2, 8).all(axis=3)
        fit3, fit4 = grouped(ok3), grouped(ok4)
    return modes(fit3, fit4)


def summarize(mode_arrays):
    m = np.concatenate([x.ravel() for x in mode_arrays])
    bits = group_bits(m).sum()
    return {
        "content_ratio": round(float(16 * 8 * m.size / bits), 4),
        "bits_per_element": round(float(bits / (8 * m.size)), 4),
        "modes_pct": [round(float(100 * np.mean(m == i)), 3) for i in range(3)],
        "groups": int(m.size),
    }


def device_pages(e, bits, b4):
    """The device layout of docs/format/gaac_fragments.md on pages of e [heads, N, D] (N a multiple
    of 16): 12 bits an element plus D / 4 bytes of exceptions a page; a page with more than
    D / 16 - 1 exceptions (elements outside [b4, b4 + 16), zeros, subnormals, inf, NaN) stays raw
    bf16. (A subnormal or far exponent whose built value is not a bf16 would stay raw too; none
    occurs in real KV, and it is not modelled.) Returns (bytes stored, pages, pages kept raw,
    exceptions)."""
    heads, n, d = e.shape
    c = e - b4[:, None, :]
    out = (c < 0) | (c >= 16) | (e == 0) | (e == 255)
    per_page = out.reshape(heads, n // T, T, d).sum(axis=(2, 3))
    raw = per_page > d // 16 - 1
    stored = np.where(raw, 2 * T * d, T * d * 3 // 2 + d // 4).sum()
    return int(stored), int(per_page.size), int(raw.sum()), int(per_page.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calib", required=True, help="comma list of dumps to calibrate the windows on")
    ap.add_argument("--eval", required=True, help="the dump to measure")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    calib = [load(p) for p in args.calib.split(",")]
    ev = load(args.eval)
    layouts = [("gaac (CPU)", None, False)] + [(f"gaac-d, 4-bit window from b3 - {k}", k, True) for k in (0, 4, 8)]
    results = {"calib": args.calib, "eval": args.eval, "rows": []}
    acc = {(name, kv): [] for name, _, _ in layouts for kv in "kv"}
    device = {kv: [0, 0, 0, 0, 0] for kv in "kv"}  # stored, pages, raw, exceptions, elements
    for key in sorted(ev):
        name, kv = key
        if not any(key in c for c in calib):
            sys.exit(f"gaac_d_study: {name}.{kv} of {args.eval} is in no calibration dump")
        e_eval = exponents(ev[key])
        n = e_eval.shape[1] // T * T
        e_eval = e_eval[:, :n]
        e_cal = np.concatenate([exponents(c[key]) for c in calib if key in c], axis=1)
        b3 = best_windows(e_cal, 8)
        b4_free = best_windows(e_cal, 16)
        stored, pages, raw, exc = device_pages(e_eval, ev[key][:, :n], best_windows(e_cal, 16))
        for i, x in enumerate((stored, pages, raw, exc, e_eval.size)):
            device[kv][i] += x
        for label, k, tied in layouts:
            b4 = b4_free if not tied else np.clip(b3 - k, 0, 240)
            m = evaluate(e_eval, b3, b4, v_groups_2x4=tied and kv == "v")
            acc[(label, kv)].append(m)
    for label, _, _ in layouts:
        row = {"layout": label}
        for kv in "kv":
            row[kv] = summarize(acc[(label, kv)])
        row["both"] = summarize(acc[(label, "k")] + acc[(label, "v")])
        results["rows"].append(row)
    results["device_pages"] = {
        kv: {"content_ratio": round(2 * device[kv][4] / device[kv][0], 4), "pages": device[kv][1],
             "pages_kept_raw": device[kv][2], "exceptions_per_page": round(device[kv][3] / device[kv][1], 3)}
        for kv in "kv"}
    print(f"eval {args.eval}, calibrated on {args.calib}")
    for kv in "kv":
        r = results["device_pages"][kv]
        print(f"device pages {kv.upper()}: content ratio {r['content_ratio']:.4f}, {r['pages_kept_raw']} of {r['pages']} "
              f"pages kept raw, {r['exceptions_per_page']} exceptions a page")
    print(f"{'layout':40s} {'K ratio':>8s} {'V ratio':>8s} {'both':>8s}   K modes % (3/4/raw)     V modes %")
    for row in results["rows"]:
        print(f"{row['layout']:40s} {row['k']['content_ratio']:8.4f} {row['v']['content_ratio']:8.4f} "
              f"{row['both']['content_ratio']:8.4f}   {row['k']['modes_pct']}  {row['v']['modes_pct']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
