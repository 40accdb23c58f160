#!/usr/bin/env python3
"""Joins one H200 run's certkv and peer JSON lines (certkv_cuda_decode_bench, bench/decode_peers.py)
into docs/bench/h200_decode.json (with the commit measured), prints a markdown table of
microseconds, bandwidth and speedup over torch SDPA (bf16) per cell, and draws the plot.

  cuda_bench_summary.py CERTKV.jsonl PEERS.jsonl --commit SHA [--json OUT.json] [--plot OUT.png]
"""
import argparse
import json


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("certkv")
    ap.add_argument("peers")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    ours = [r for r in load(args.certkv) if r.get("kind") == "certkv"]
    env = [r for r in load(args.certkv) if r.get("kind") == "env"][0]
    peer_rows = [r for r in load(args.peers) if "peer" in r and "us" in r]
    peer_env = [r for r in load(args.peers) if r.get("kind") == "env"][0]
    sdpa = {(r["shape"], r["batch"], r["ctx"]): r["us"] for r in peer_rows if r["peer"] == "sdpa"}
    cells = []
    for r in ours:
        key = (r["shape"], r["batch"], r["ctx"])
        cells.append({"impl": "certkv " + r["format"], "shape": r["shape"], "batch": r["batch"], "ctx": r["ctx"],
                      "us": r["us"], "bytes": r["bytes"], "tb_s": r["tb_s"], "pct_copy": r["pct_copy"],
                      "speedup_vs_sdpa": sdpa[key] / r["us"] if key in sdpa else None,
                      **{k: r[k] for k in ("p", "deviations", "window", "recall_mean", "recall_min", "budget_mean") if k in r}})
    for r in peer_rows:
        key = (r["shape"], r["batch"], r["ctx"])
        cells.append({"impl": r["peer"] + (" (tensor cores)" if r.get("variant") == "tensor_cores" and not r["peer"].endswith("_tc") else ""),
                      "shape": r["shape"], "batch": r["batch"], "ctx": r["ctx"], "us": r["us"],
                      "bytes": r["kv_bytes"], "tb_s": r["tb_s"], "pct_copy": r["pct_copy"],
                      "speedup_vs_sdpa": sdpa[key] / r["us"] if key in sdpa else None, "rel_err": r.get("rel_err")})
    out = {"commit": args.commit, "gpu": env["gpu"], "copy_tb_s_certkv_run": env["copy_tb_s"],
           "copy_tb_s_peer_run": peer_env["copy_tb_s"], "kv_source": env["kv_source"],
           "timing": "both: CUDA graph replay between CUDA events (certkv: a graph of iters calls, every kernel of "
                     "each call; peers: torch.cuda.CUDAGraph); median of 7 repetitions; KV sets rotated past L2",
           "torch": peer_env.get("torch"), "flashinfer": peer_env.get("flashinfer"), "cells": cells}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"commit {args.commit}, {env['gpu']}, copy {env['copy_tb_s']:.2f} TB/s")
    print("| shape | batch | ctx | impl | us | MB read | TB/s | % copy | x SDPA | recall (mean / min), budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in sorted(cells, key=lambda c: (c["shape"], c["batch"], c["ctx"], c["impl"])):
        sp = f"{c['speedup_vs_sdpa']:.2f}" if c["speedup_vs_sdpa"] else "-"
        print(f"| {c['shape']} | {c['batch']} | {c['ctx'] // 1024}K | {c['impl']} | {c['us']:.1f} | "
              f"{c['bytes'] / 1e6:.1f} | {c['tb_s']:.2f} | {c['pct_copy']:.0f} | {sp} | "
              + (f"{c['recall_mean']:.3f} / {c['recall_min']:.3f}, {c['budget_mean']:.3f} |" if "recall_mean" in c else "- |"))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        # One panel per (shape, batch) the run measured, a row per shape.
        shapes = sorted({c["shape"] for c in cells}, key=lambda s: ("32x8", "28x4").index(s) if s in ("32x8", "28x4") else 2)
        batches = sorted({c["batch"] for c in cells})
        fig, axes = plt.subplots(len(shapes), len(batches), figsize=(6 * len(batches), 4 * len(shapes)),
                                 sharey=True, squeeze=False)
        for ax, (shape, batch) in zip(axes.flat, [(s, b) for s in shapes for b in batches]):
            impls = sorted({c["impl"] for c in cells if c["shape"] == shape and c["batch"] == batch})
            for impl in impls:
                pts = sorted((c["ctx"], c["speedup_vs_sdpa"]) for c in cells
                             if c["impl"] == impl and c["shape"] == shape and c["batch"] == batch and c["speedup_vs_sdpa"])
                if pts:
                    ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=impl,
                            linestyle="-" if impl.startswith("certkv") else "--")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape} heads, head_dim 128, batch {batch}")
            ax.set_xlabel("context (K tokens)")
            ax.set_ylabel("speedup over torch SDPA bf16")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Decode attention on {env['gpu']} (commit {args.commit})")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
