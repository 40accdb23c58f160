#!/usr/bin/env python3
"""Per-cell medians of an A/B run of the decode benchmark (scripts/cuda_ab.sh): for each (shape,
batch, context, format), the median microseconds of the base and head trees over their rounds,
head / base, and the recall when the format reports one (it must not differ between the trees
unless the change meant it to).

  cuda_ab_summary.py AB.jsonl [--markdown]

Lines are the benchmark's own, tagged "tree" ("base" or "head") and "round". A cell present in one
tree only is listed with a dash for the other.
"""
import argparse
import json
import statistics
import sys


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"cuda_ab_summary: {path}:{n}: not JSON ({e})")
    return rows


def cells_of(rows):
    """{cell: {tree: {"us": [...], "recall": [...]}}} over the benchmark's timed lines."""
    cells = {}
    for r in rows:
        if r.get("kind") != "certkv" or "us" not in r:
            continue
        tree = r.get("tree")
        if tree not in ("base", "head"):
            sys.exit(f"cuda_ab_summary: a timed line without tree base/head: {r.get('format')}")
        key = (r["shape"], r["batch"], r["ctx"], r["format"])
        slot = cells.setdefault(key, {}).setdefault(tree, {"us": [], "recall": []})
        slot["us"].append(float(r["us"]))
        if "recall_mean" in r:
            slot["recall"].append(float(r["recall_mean"]))
    return cells


def summarize(cells):
    out = []
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3])):
        trees = cells[key]
        med = {t: statistics.median(trees[t]["us"]) for t in trees}
        recall = {t: trees[t]["recall"][0] for t in trees if trees[t]["recall"]}
        ratio = med["head"] / med["base"] if "head" in med and "base" in med else None
        out.append({"shape": key[0], "batch": key[1], "ctx": key[2], "format": key[3],
                    "base_us": med.get("base"), "head_us": med.get("head"), "head_over_base": ratio,
                    "rounds": {t: len(trees[t]["us"]) for t in trees},
                    "recall": recall})
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ab")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = summarize(cells_of(load(args.ab)))
    if not rows:
        sys.exit("cuda_ab_summary: no timed lines")
    if args.markdown:
        print("| shape | batch | ctx | format | base us | head us | head / base | recall |")
        print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        recall = " / ".join(f"{r['recall'][t]:.4f}" for t in ("base", "head") if t in r["recall"])
        cols = [r["shape"], str(r["batch"]), f"{r['ctx'] // 1024}K", r["format"], fmt(r["base_us"], ".1f"),
                fmt(r["head_us"], ".1f"), fmt(r["head_over_base"], ".3f"), recall or "-"]
        print("| " + " | ".join(cols) + " |" if args.markdown else "  ".join(cols))


if __name__ == "__main__":
    main()
