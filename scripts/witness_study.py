#!/usr/bin/env python3
"""How tight the Tier A meter stays with a smaller witness, on real KV dumps (no GPU).

The fp8 decode kernel with the meter reads, beside a token's fp8 K and V (2 x head_dim bytes),
the K page's witness (16 fp16 band norms of the key residual, 32 bytes) and the V page's rho
(2 bytes). On the H200 both kernels run near the copy bandwidth, so the meter's cost is about
those bytes (docs/cuda.md, "Where it stands"). This study asks what a smaller witness costs in
tightness: for each witness form it recomputes c_t = sm_scale * sum_b ||q_b|| w_{t,b} (DESIGN.md
section 4) with fewer bands and / or coarser codes (rounded up), the meter
min(1, (A^2 - 1) / 2) with A = sum_t p~_t e^{c_t}, and the coverage at tau (the share of
(layer, query head) cells with meter <= tau), against the true total variation.

Every form is an upper bound by construction (Cauchy-Schwarz per band, values rounded up); the
study checks it on every token (c_t >= |sm_scale q . (k^_t - k_t)|) and on every cell
(meter >= TV) and exits 1 if any form breaks it (--negative-control stores a zero witness, which
the check must catch).

  witness_study.py DUMP.safetensors [DUMP...] [--scheme fp8-e4m3|fp8-e4m3-scaled|rtn8]
                   [--tau 0.2] [--forms 16x16,16x8,8x16,...] [--json OUT.json]

DUMP: `certkv dump-kv` output (post-RoPE K, V and the last position's queries of every layer).
A form BxE is B bands with E-bit values: E = 16 is fp16 rounded up (the DESIGN's witness);
E = 2, 4 or 8 is a code c in [0, 2^E - 1] per band, value = page_max (c + 1) / 2^E with
c = ceil(2^E w / page_max) - 1 (page_max: the page's largest band norm, stored once per page as
fp16 rounded up; 0 when the page's norms are all 0), exact in float, so that a kernel can feed
c + 1 to the tensor cores as exact fp16 integers and apply the page's scale after the product. Bytes per token: B * E / 8 (+ 2 / 16 for the page scale of the coded forms). A suffix p
(BxEp) stores one witness per page instead of per token: each band's largest norm over the
page's 16 tokens (bytes per token B * E / 8 / 16).

The form `ulp` stores nothing: for the fp8 schemes a code's own exponent bounds its rounding
error, |k^_i - k_i| <= u(k^_i) = s 2^(max(E_i, -6) - 4) for E4M3 (E_i the exponent of k^_i / s,
s = 1 unscaled; 2^-10 for a zero or subnormal code), so c_t = sm_scale sum_i |q_i| u(k^_i), a
product of |q| with the codes' exponents that a kernel can make on the tensor cores from the
bytes it already reads. It holds only where no element saturated: a raw E4M3 element with
|k| > 464 has an unbounded error, so its token's c_t is +inf (such a page would be kept exact;
the table gives the share of tokens).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

BLOCK = 16


def load_dump(path):
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if n > 1 << 24:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
            base = 8 + n
            meta = header.pop("__metadata__", {})
            tensors = {}
            for name, t in header.items():
                begin, end = t["data_offsets"]
                f.seek(base + begin)
                raw = f.read(end - begin)
                if len(raw) != end - begin:
                    raise ValueError(f"tensor {name} runs past the end of the file")
                if t["dtype"] == "BF16":
                    a = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
                elif t["dtype"] == "F32":
                    a = np.frombuffer(raw, dtype=np.float32)
                else:
                    continue
                tensors[name] = a.reshape(t["shape"])
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        sys.exit(f"witness_study: {path}: not a readable safetensors file ({e})")
    for key in ("head_dim", "n_heads", "n_kv_heads", "softmax_scale", "rope_layout", "layers"):
        if key not in meta:
            sys.exit(f"witness_study: {path}: not a certkv dump-kv file (metadata '{key}' missing)")
    d, n_q, n_kv = int(meta["head_dim"]), int(meta["n_heads"]), int(meta["n_kv_heads"])
    for layer in meta["layers"].split(","):
        k, q = tensors.get(f"layer{layer}.k"), tensors.get(f"layer{layer}.q")
        if k is None or q is None or k.ndim != 3 or k.shape[0] != n_kv or k.shape[2] != d or q.shape != (n_q, d):
            sys.exit(f"witness_study: {path}: layer {layer}'s k [{n_kv}, n, {d}] and q [{n_q}, {d}] missing or misshapen")
        if not (np.isfinite(k).all() and np.isfinite(q).all()):
            sys.exit(f"witness_study: {path}: layer {layer} holds values that are not finite")
    return meta, tensors


def round_e4m3(x):
    """Saturating round-to-nearest-even cast to FP8 E4M3 (max 448, subnormals below 2^-6)."""
    a = np.abs(x).astype(np.float64)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -30)))
    e = np.maximum(e, -6.0)
    q = 2.0 ** (e - 3)
    r = np.round(a / q) * q  # numpy rounds half to even
    r = np.minimum(r, 448.0)
    return (np.sign(x) * r).astype(np.float32)


def e4m3_half_ulp(kh_unscaled):
    """u(k^) = 2^(max(E, -6) - 4) for E4M3 values (E = floor(log2 |k^|); subnormals and 0: 2^-10)."""
    a = np.abs(kh_unscaled).astype(np.float64)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -30)))
    return 2.0 ** (np.maximum(e, -6.0) - 4.0)


def ulp_bound(scheme, k):
    """Per-element bound on |k^ - k| from the codes alone, +inf on saturated (unbounded) elements."""
    if scheme == "fp8-e4m3":
        u = e4m3_half_ulp(round_e4m3(k))
        return np.where(np.abs(k) > 464.0, np.inf, u)
    if scheme == "fp8-e4m3-scaled":
        s = fp16_up(np.abs(k).max(axis=-1, keepdims=True) / 448.0)
        s = np.where(s == 0, 1.0, s)
        return e4m3_half_ulp(round_e4m3(k / s)) * s
    sys.exit(f"witness_study: the ulp form is defined for the fp8-e4m3 schemes, not '{scheme}'")


def fp16_up(x):
    """x rounded up to an fp16 value (x >= 0)."""
    h = x.astype(np.float16)
    low = h.astype(np.float64) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float64)


def quantize(scheme, k):
    if scheme == "fp8-e4m3":
        return round_e4m3(k)
    if scheme == "fp8-e4m3-scaled":
        s = fp16_up(np.abs(k).max(axis=-1, keepdims=True) / 448.0)
        s = np.where(s == 0, 1.0, s)
        return (round_e4m3(k / s) * s).astype(np.float32)
    if scheme == "rtn8":
        g = k.reshape(k.shape[:-1] + (-1, 32))
        s = np.abs(g).max(axis=-1, keepdims=True).astype(np.float64) / 127.0
        s = s.astype(np.float16).astype(np.float64)
        s = np.where(s == 0, 1.0, s)
        return (np.clip(np.round(g / s), -127, 127) * s).reshape(k.shape).astype(np.float32)
    sys.exit(f"witness_study: unknown scheme '{scheme}'")


def pair_channels(head_dim, rope_layout):
    """Channel index pairs (2j, 2j + 1) interleaved or (j, j + d/2) half-split, j in pair order."""
    p = np.arange(head_dim // 2)
    if rope_layout == "interleaved":
        return np.stack([2 * p, 2 * p + 1], axis=1)
    return np.stack([p, p + head_dim // 2], axis=1)


def band_norms(x, pairs, n_bands):
    """||x_b|| over n_bands contiguous ranges of RoPE pairs (the codec's witness_band_of_pair)."""
    n_pairs = pairs.shape[0]
    sq = (x[..., pairs[:, 0]].astype(np.float64) ** 2 + x[..., pairs[:, 1]].astype(np.float64) ** 2)
    band = (np.arange(n_pairs) * n_bands) // n_pairs
    out = np.zeros(x.shape[:-1] + (n_bands,))
    for b in range(n_bands):
        out[..., b] = sq[..., band == b].sum(axis=-1)
    return np.sqrt(out)


def witness(w, bits, per_page=False):
    """The stored, rounded-up witness of true band norms w [tokens, bands]."""
    if per_page:
        n = w.shape[0]
        top = w.reshape(n // BLOCK, BLOCK, -1).max(axis=1, keepdims=True)
        w = np.broadcast_to(top, (n // BLOCK, BLOCK, w.shape[1])).reshape(n, -1).copy()
    if bits == 16:
        return fp16_up(w)
    # E-bit codes against the page's largest band norm (fp16, rounded up): value = top (c + 1) / 2^E
    # with c = ceil(2^E w / top) - 1 in [0, 2^E - 1], exact in float (11 + E + 1 significant
    # bits), at least the norm; a page whose norms are all 0 stores top = 0 (every value 0).
    steps = float(2 ** bits)
    out = np.zeros_like(w)
    for start in range(0, w.shape[0], BLOCK):
        page = w[start:start + BLOCK]
        top = fp16_up(np.array([page.max()]))[0]
        if top == 0:
            continue
        code = np.clip(np.ceil(steps * page / top) - 1, 0, steps - 1)
        code[top * (code + 1) / steps < page] += 1  # guard the float steps: never below the norm
        out[start:start + BLOCK] = top * (code + 1) / steps
    return out


def softmax(x):
    m = x.max()
    e = np.exp(x - m)
    return e / e.sum()


def study(paths, scheme, forms, tau, negative_control=False):
    results = {f: {"meter": [], "tv": [], "c_mean": [], "sound": True} for f in forms}
    cells = 0
    for path in paths:
        meta, t = load_dump(path)
        d = int(meta["head_dim"])
        n_q, n_kv = int(meta["n_heads"]), int(meta["n_kv_heads"])
        scale = float(meta["softmax_scale"])
        pairs = pair_channels(d, meta["rope_layout"])
        layers = [int(x) for x in meta["layers"].split(",")]
        for layer in layers:
            k_all, q_all = t[f"layer{layer}.k"], t[f"layer{layer}.q"]
            for kvh in range(n_kv):
                k = k_all[kvh]
                n = (k.shape[0] // BLOCK) * BLOCK  # whole blocks: the tail stays exact
                k = k[:n]
                kh = quantize(scheme, k)
                r = (kh - k).astype(np.float64)
                per_form = {}
                for f in forms:
                    if f == ULP:
                        per_form[f] = ulp_bound(scheme, k)
                        results[f].setdefault("unbounded_tokens", []).append(float(np.mean(~np.isfinite(per_form[f]).all(axis=1))))
                        if negative_control:
                            per_form[f] = np.zeros_like(per_form[f])
                        continue
                    b, bits, per_page = f
                    per_form[f] = witness(band_norms(r, pairs, b), bits, per_page)
                    if negative_control:
                        per_form[f] = np.zeros_like(per_form[f])
                for g in range(n_q // n_kv):
                    q = q_all[kvh * (n_q // n_kv) + g].astype(np.float64)
                    logits_hat = scale * (kh.astype(np.float64) @ q)
                    logits = scale * (k.astype(np.float64) @ q)
                    err = np.abs(logits_hat - logits)
                    p_hat, p = softmax(logits_hat), softmax(logits)
                    tv = 0.5 * np.abs(p_hat - p).sum()
                    cells += 1
                    for f in forms:
                        if f == ULP:
                            with np.errstate(invalid="ignore"):
                                c = scale * (per_form[f] @ np.abs(q)) * (1 + 2.0 ** -20)
                            c = np.where(np.isnan(c), np.inf, c)  # inf * 0: still unbounded
                        else:
                            qb = band_norms(q[None, :], pairs, f[0])[0]
                            c = scale * (per_form[f] @ qb) * (1 + 2.0 ** -20)
                        if np.any(c < err):
                            results[f]["sound"] = False
                        a = float(np.sum(p_hat * np.exp(np.minimum(c, 700.0))))
                        meter = min(1.0, (a * a - 1.0) / 2.0)
                        if meter < tv:
                            results[f]["sound"] = False
                        results[f]["meter"].append(meter)
                        results[f]["tv"].append(tv)
                        results[f]["c_mean"].append(float(np.sum(p_hat * c)))
    return results, cells


ULP = (0, 0, False)  # the zero-byte form


def parse_forms(text):
    forms = []
    for item in text.split(","):
        if item == "ulp":
            forms.append(ULP)
            continue
        per_page = item.endswith("p")
        try:
            b, e = (int(x) for x in (item[:-1] if per_page else item).split("x"))
        except ValueError:
            sys.exit(f"witness_study: form '{item}' is not BANDSxBITS[p]")
        if b < 1 or e not in (2, 4, 8, 16):
            sys.exit(f"witness_study: form '{item}': bands >= 1, bits 2, 4, 8 or 16")
        forms.append((b, e, per_page))
    return forms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--scheme", default="fp8-e4m3", choices=["fp8-e4m3", "fp8-e4m3-scaled", "rtn8"])
    ap.add_argument("--tau", type=float, default=0.2)
    ap.add_argument("--forms", default="16x16,16x8,16x4,16x2,8x8,4x8,1x16,16x16p")
    ap.add_argument("--json")
    ap.add_argument("--negative-control", action="store_true", help="store a zero witness (the check must fail)")
    args = ap.parse_args()
    forms = parse_forms(args.forms)
    results, cells = study(args.dumps, args.scheme, forms, args.tau, args.negative_control)
    base = forms[0]
    print(f"{args.scheme}: {cells} (layer, query head) cells over {len(args.dumps)} dump(s); tau {args.tau}")
    print("| witness (bands x bits) | bytes / token | meter p50 | meter p90 | coverage at tau | mean c / first form's | sound |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    ok = True
    for f in forms:
        r = results[f]
        m = np.array(r["meter"])
        c_ratio = float(np.mean(np.array(r["c_mean"]) / np.maximum(np.array(results[base]["c_mean"]), 1e-300)))
        nbytes = 0.0 if f == ULP else f[0] * f[1] / 8 / (BLOCK if f[2] else 1) + (2 / BLOCK if f[1] < 16 else 0)
        row = {"bands": f[0], "bits": f[1], "per_page": f[2], "bytes_per_token": nbytes, "meter_p50": float(np.median(m)),
               "meter_p90": float(np.quantile(m, 0.9)), "coverage": float(np.mean(m <= args.tau)),
               "c_ratio": c_ratio, "sound": r["sound"]}
        if f == ULP:
            row["unbounded_token_share"] = float(np.mean(r["unbounded_tokens"]))
        rows.append(row)
        ok &= r["sound"]
        name = f"ulp (unbounded tokens {row['unbounded_token_share']:.4f})" if f == ULP else f"{f[0]} x {f[1]}{' per page' if f[2] else ''}"
        print(f"| {name} | {nbytes:.3g} | {row['meter_p50']:.4g} | {row['meter_p90']:.4g} | "
              f"{row['coverage']:.3f} | {c_ratio:.3f} | {'yes' if r['sound'] else 'NO'} |")
    tv = np.array(results[base]["tv"])
    print(f"true TV: p50 {np.median(tv):.4g}, p90 {np.quantile(tv, 0.9):.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scheme": args.scheme, "tau": args.tau, "cells": cells,
                       "dumps": [os.path.basename(p) for p in args.dumps], "forms": rows,
                       "tv_p50": float(np.median(tv)), "tv_p90": float(np.quantile(tv, 0.9))}, f, indent=1)
    if not ok:
        print("witness_study: a form is not an upper bound (see 'sound')", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
