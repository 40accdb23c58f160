#!/usr/bin/env python3
"""Per-cell medians of an A/B run of the decode benchmark (scripts/cuda_ab.sh): for each (shape,
batch, context, format), the median microseconds of each tree over its rounds, each tree's ratio
to the first (head / base for the default pair), and the recall when the format reports one (it
must not differ between the trees unless the change meant it to).

  cuda_ab_summary.py AB.jsonl [--trees base,head] [--markdown]

Lines are the benchmark's own, tagged "tree" and "round". --trees names the trees in order, the
first the base of the ratios (default: base,head); a timed line of another tree is an error. A
cell missing from a tree is listed with a dash there.
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


def cells_of(rows, trees):
    """{cell: {tree: {"us": [...], "recall": [...]}}} over the benchmark's timed lines."""
    cells = {}
    for r in rows:
        if r.get("kind") != "certkv" or "us" not in r:
            continue
        tree = r.get("tree")
        if tree not in trees:
            sys.exit(f"cuda_ab_summary: a timed line without tree {'/'.join(trees)}: {r.get('format')} (tree {tree!r})")
        key = (r["shape"], r["batch"], r["ctx"], r["format"])
        slot = cells.setdefault(key, {}).setdefault(tree, {"us": [], "recall": []})
        slot["us"].append(float(r["us"]))
        if "recall_mean" in r:
            slot["recall"].append(float(r["recall_mean"]))
    return cells


def summarize(cells, trees):
    out = []
    base = trees[0]
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3])):
        by_tree = cells[key]
        med = {t: statistics.median(by_tree[t]["us"]) for t in by_tree}
        recall = {t: by_tree[t]["recall"][0] for t in by_tree if by_tree[t]["recall"]}
        ratios = {t: med[t] / med[base] if t in med and base in med else None for t in trees[1:]}
        out.append({"shape": key[0], "batch": key[1], "ctx": key[2], "format": key[3],
                    "us": {t: med.get(t) for t in trees}, "over_base": ratios,
                    "rounds": {t: len(by_tree[t]["us"]) for t in by_tree}, "recall": recall})
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ab")
    ap.add_argument("--trees", default="base,head", help="tree names in order, the first the base of the ratios")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    trees = [t for t in args.trees.split(",") if t]
    if len(trees) < 2 or len(set(trees)) != len(trees):
        sys.exit(f"cuda_ab_summary: --trees wants two distinct names or more, not {args.trees!r}")
    rows = summarize(cells_of(load(args.ab), trees), trees)
    if not rows:
        sys.exit("cuda_ab_summary: no timed lines")
    if args.markdown:
        head = ["shape", "batch", "ctx", "format"] + [f"{t} us" for t in trees]
        head += [f"{t} / {trees[0]}" for t in trees[1:]] + ["recall"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for r in rows:
        recall = " / ".join(f"{r['recall'][t]:.4f}" for t in trees if t in r["recall"])
        cols = [r["shape"], str(r["batch"]), f"{r['ctx'] // 1024}K", r["format"]]
        cols += [fmt(r["us"][t], ".1f") for t in trees] + [fmt(r["over_base"][t], ".3f") for t in trees[1:]]
        cols.append(recall or "-")
        print("| " + " | ".join(cols) + " |" if args.markdown else "  ".join(cols))


if __name__ == "__main__":
    main()
