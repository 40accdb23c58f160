#!/usr/bin/env python3
"""Folds the JSON lines of certkv_backend_decode, bench/transformers_decode.py and llama-batched-bench
(tagged by bench/h200_e2e_run.sh) from one H200 run into docs/bench/h200_e2e.json (`commit`, `gpu`, `cells`,
each cell {table, engine, kv, batch, ctx, tok_per_s, step_ms, sequences}) and draws the
aggregate decode tokens/s per engine and KV class beside it (h200_e2e.png).

usage: python3 bench/h200_e2e_table.py RUN.jsonl --commit C --gpu "NVIDIA H200" [--note TEXT]
           [--out docs/bench/h200_e2e.json]
"""
import argparse
import json
import pathlib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="docs/bench/h200_e2e.json")
    a = ap.parse_args()
    cells = []
    for line in open(a.run):
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("engine") == "llama.cpp":  # llama-batched-bench's jsonl, tagged by bench/h200_e2e_run.sh
            cells.append({"table": "a", "engine": "llama.cpp", "kv": d["kv"], "batch": d["pl"], "ctx": d["pp"],
                          "tok_per_s": round(d["speed_tg"], 2), "step_ms": round(1e3 * d["t_tg"] / d["tg"], 4),
                          "sequences": d["pl"], "ctx_decoded_mean": d["pp"] + (d["tg"] - 1) / 2,
                          "prefill_tok_per_s": round(d["speed_pp"], 1), "flash_attn": d["flash_attn"],
                          "prompt_shared": d["is_pp_shared"]})
            continue
        kv = d["kv"] + (f"+sparse p={d['sparse_p']:g}" if d.get("sparse_p") else "")
        cell = {"table": d.get("table", "a"), "engine": d["engine"], "kv": kv, "batch": d["batch"], "ctx": d["ctx"],
                "tok_per_s": d["tok_per_s"], "step_ms": d["step_ms"], "sequences": d.get("sequences", d["batch"])}
        for extra in ("prefill_tok_per_s", "weights", "kv_bytes_in_use", "ctx_decoded_mean", "host_ms", "pool_bytes"):
            if extra in d:
                cell[extra] = d[extra]
        cells.append(cell)
    doc = {"commit": a.commit, "gpu": a.gpu, "model": a.model, "note": a.note, "source": a.run, "cells": cells}
    out = pathlib.Path(a.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    cells = [c for c in cells if c["table"] == "a"]  # the plot: table a
    ctxs = sorted({c["ctx"] for c in cells})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 4.5), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        series = sorted({(c["engine"], c["kv"]) for c in cells if c["ctx"] == ctx})
        for engine, kv in series:
            pts = sorted((c["batch"], c["tok_per_s"]) for c in cells if c["ctx"] == ctx and c["engine"] == engine
                         and c["kv"] == kv)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{engine} {kv}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences decoding together)")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.set_title(f"context {ctx} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{a.model or 'model'} on {a.gpu}, commit {a.commit}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
