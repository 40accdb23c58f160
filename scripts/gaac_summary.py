#!/usr/bin/env python3
"""Markdown tables of the GAAC measurements written by scripts/gaac_measure.sh.

usage: gaac_summary.py JSON_DIR
JSON_DIR holds `certkv codec --json` outputs named CODEC-CALIBRATION-BOOK-LENGTH.json and,
optionally, codec_bench.json (Google Benchmark JSON of certkv_codec_bench).
"""
import glob
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def pct(x, digits=2):
    return f"{100 * x:.{digits}f}"


def modes(t):
    m = t["mode_fraction"]
    return f"{pct(m['3bit'])} / {pct(m['4bit'])} / {pct(m['raw'], 3)}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main():
    d = sys.argv[1]
    runs = {os.path.basename(p)[:-5]: load(p) for p in sorted(glob.glob(os.path.join(d, "gaac*.json")))}

    print("## Ratio on real KV (calibrated on austen-emma + dickens at 4K)\n")
    rows = []
    for name, r in runs.items():
        if not name.startswith("gaac-books4k-"):
            continue
        rows.append([name[len("gaac-books4k-"):], f"{r['ratio']:.4f}", f"{r['content_ratio']:.4f}",
                     f"{r['bits_per_element']:.3f}",
                     modes(r), pct(r["raw_block_fraction"]), f"{r['exponent_entropy_bits']:.3f}",
                     f"{r['by_kv']['k']['ratio']:.4f}", f"{r['by_kv']['v']['ratio']:.4f}",
                     f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}", r["kernel"], r["verify_ok"]])
    print(table(["eval", "ratio", "content ratio", "bits/elem", "3bit/4bit/raw groups %", "raw blocks %", "exp. entropy",
                 "K ratio", "V ratio", "enc GB/s", "dec GB/s", "kernel", "verify"], rows))

    print("\n## K vs V (calibrated on the books at 4K)\n")
    rows = []
    for name, r in runs.items():
        if not name.startswith("gaac-books4k-"):
            continue
        for kv in ("k", "v"):
            t = r["by_kv"][kv]
            rows.append([name[len("gaac-books4k-"):], kv.upper(), f"{t['ratio']:.4f}", f"{t['content_ratio']:.4f}",
                         f"{t['bits_per_element']:.3f}",
                         modes(t), pct(t["raw_block_fraction"]), f"{t['exponent_entropy_bits']:.3f}",
                         f"{t['escape_bytes_per_page']:.1f}"])
    print(table(["eval", "", "ratio", "content ratio", "bits/elem", "3bit/4bit/raw groups %", "raw blocks %", "exp. entropy",
                 "escape B/page"], rows))

    for name in ("gaac-books4k-melville-4k",):
        if name in runs:
            r = runs[name]
            print(f"\n## Per layer ({name[len('gaac-books4k-'):]}, calibrated on the books at 4K)\n")
            rows = []
            for l in r["layers"]:
                k, v = l["k"], l["v"]
                rows.append([l["layer"], f"{k['ratio']:.3f}", modes(k), f"{k['exponent_entropy_bits']:.2f}",
                             l["k_escape_capacity_bytes"], f"{v['ratio']:.3f}", modes(v),
                             f"{v['exponent_entropy_bits']:.2f}", l["v_escape_capacity_bytes"]])
            print(table(["layer", "K ratio", "K 3/4/raw %", "K entropy", "K cap B", "V ratio", "V 3/4/raw %",
                         "V entropy", "V cap B"], rows))
            break

    print("\n## RoPE drift: 8K evaluation, calibrated on 512-token prompts, on the books at 4K and at 8K\n")
    rows = []
    for book in ("melville", "doyle"):
        for cal, label in (("prompts512", "16 x 512-token prompts"), ("books4k", "books, 2 x 4096"),
                           ("books8k", "books, 2 x 8192")):
            name = f"gaac-{cal}-{book}-8k"
            if name not in runs:
                continue
            r = runs[name]
            segs = r["segments"]
            k_esc = " ".join(f"{s['k_escape_bytes_per_page']:.0f}" for s in segs)
            v_esc = " ".join(f"{s['v_escape_bytes_per_page']:.0f}" for s in segs)
            rows.append([book, label, f"{r['ratio']:.4f}", f"{r['content_ratio']:.4f}", f"{r['by_kv']['k']['ratio']:.4f}",
                         f"{r['by_kv']['v']['ratio']:.4f}", pct(r["by_kv"]["k"]["raw_block_fraction"]),
                         pct(r["by_kv"]["k"]["mode_fraction"]["raw"], 3), k_esc, v_esc])
    print(table(["eval 8K", "calibration", "ratio", "content ratio", "K ratio", "V ratio", "K raw blocks %", "K raw groups %",
                 "K escape B/page per 1K segment", "V escape B/page per 1K segment"], rows))

    rows = []
    for name, r in runs.items():
        if name.startswith("gaac-e"):
            rows.append([name, f"{r['ratio']:.4f}", f"{r['ratio_vs_fp8']:.4f}", f"{r['content_ratio'] / 2:.4f}",
                         f"{r['bits_per_element']:.3f}",
                         modes(r), pct(r["raw_block_fraction"]), f"{r['exponent_entropy_bits']:.3f}",
                         f"{r['encode_gbps']:.2f}", f"{r['decode_gbps']:.2f}", r["verify_ok"]])
    if rows:
        print("\n## FP8 variants (KV cast to FP8, calibrated on the books at 4K)\n")
        print(table(["run", "ratio vs BF16", "ratio vs FP8", "content ratio vs FP8", "bits/elem", "3bit/4bit/raw groups %", "raw blocks %",
                     "exp. entropy", "enc GB/s (FP8 bytes)", "dec GB/s", "verify"], rows))

    bench = os.path.join(d, "codec_bench.json")
    if os.path.exists(bench):
        b = load(bench)
        print("\n## Codec speed, one core, same KV (certkv_codec_bench)\n")
        rows = [[x["name"], f"{x['GBps'] / 1e0:.2f}", f"{x['ratio']:.4f}", f"{x['cpu_time']:.1f}"]
                for x in b["benchmarks"] if "GBps" in x]
        print(table(["benchmark", "GB/s (BF16 bytes, per CPU second)", "ratio", "CPU ms per pass"], rows))


if __name__ == "__main__":
    main()
