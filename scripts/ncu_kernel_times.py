#!/usr/bin/env python3
"""Per-kernel times from Nsight Compute's CSV, one column per file and the ratio of each file to
the first: the medians over the launches of each kernel, in microseconds.

  ncu --clock-control none -k regex:"estimate|hist|select|attend" --launch-count 48 \\
      --metrics gpu__time_duration.sum --print-units base --csv BINARY ARGS... > run.csv
  ncu_kernel_times.py BASE.csv [HEAD.csv ...] [--markdown]

The CSV is what ncu prints on stdout, the program's own output before it included: the table
starts at the header line beginning with "ID". Metric values may carry thousands separators
("175,328"); units are converted from ns, us or ms. A kernel is named by its function name
without namespace, template arguments or parameters (estimate_by_popcount_kernel<128>(...) ->
estimate_by_popcount_kernel), listed in the order of its first launch.
"""
import argparse
import csv
import re
import statistics
import sys

_SCALE_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def short_name(kernel):
    """void ns::<unnamed>::estimate_kernel<128>(Args...) -> estimate_kernel."""
    name = kernel
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)  # ncu may cut "<unnamed>" to "unnamed>"
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    name = re.sub(r"<[^<>]*>$", "", name)  # trailing template arguments (one level)
    while re.search(r"<[^<>]*>$", name):
        name = re.sub(r"<[^<>]*>$", "", name)
    name = name.split()[-1] if name.split() else name
    return name.split("::")[-1]


def load(path, metric):
    """{kernel: [microseconds, ...]} in first-launch order."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"ncu_kernel_times: {path}: {e.strerror}")
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"ncu_kernel_times: {path}: no ncu CSV table (no header line starting with \"ID\")")
    times = {}
    for n, row in enumerate(csv.DictReader(lines[start:]), start + 2):
        if row.get("Metric Name") != metric:
            continue
        unit = (row.get("Metric Unit") or "").strip()
        if unit not in _SCALE_TO_US:
            sys.exit(f"ncu_kernel_times: {path}:{n}: unit {unit!r} of {metric} is not a time")
        try:
            value = float((row.get("Metric Value") or "").replace(",", ""))
        except ValueError:
            sys.exit(f"ncu_kernel_times: {path}:{n}: metric value {row.get('Metric Value')!r} is not a number")
        times.setdefault(short_name(row.get("Kernel Name") or "?"), []).append(value * _SCALE_TO_US[unit])
    if not times:
        sys.exit(f"ncu_kernel_times: {path}: no {metric} rows")
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--metric", default="gpu__time_duration.sum")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    runs = [load(p, args.metric) for p in args.csv]
    kernels = []
    for r in runs:
        kernels += [k for k in r if k not in kernels]
    head = ["kernel"] + [f"{p} us (launches)" for p in args.csv] + [f"/ {args.csv[0]}" for p in args.csv[1:]]
    rows = []
    for k in kernels:
        med = [statistics.median(r[k]) if k in r else None for r in runs]
        cells = [k] + [f"{m:.1f} ({len(r[k])})" if m is not None else "-" for m, r in zip(med, runs)]
        cells += [f"{m / med[0]:.3f}" if m is not None and med[0] else "-" for m in med[1:]]
        rows.append(cells)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in rows:
            print("| " + " | ".join(c) + " |")
    else:
        for c in rows:
            print("  ".join(c))


if __name__ == "__main__":
    main()
