"""Decode steps of a cuda KvStore through the eager calls against planned steps replayed from a CUDA
graph: every layer's append and attention of one step, no model around them (what a graph saves is
the host's work and the launches, which a model's own step pays per layer too).

    python3 bench/planned_steps.py --schemes bf16,fp8-e4m3 --batches 1,8 --context 4096 --json out.jsonl

Shape: Llama-3.2-3B's attention (28 layers, 24 query / 8 KV heads, head_dim 128) unless given.
Per cell: the median over rounds of the mean step time of `--steps` steps, eager
(append_device + torch.ops.certkv.kv_store_decode per layer) and planned (one graph replay per
step), alternating, on the same store contents. Needs torch with CUDA and certkv built with its
CUDA backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

import certkv
import certkv.torch_ops as ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="bf16,fp8-e4m3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # CERTKV_COMMIT names the library's commit where the tree is a copy without its history.
    commit = os.environ.get("CERTKV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name()
    lines = []
    for scheme in args.schemes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            lines.append(cell(args, scheme, batch, commit, gpu))
            print(json.dumps(lines[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


def cell(args, scheme: str, batch: int, commit: str, gpu: str) -> dict:
    L, H, Hkv, D = args.layers, args.heads, args.kv_heads, args.head_dim
    stream = torch.cuda.current_stream().cuda_stream
    total_steps = 2 * args.rounds * args.steps + 8
    store = certkv.KvStore(scheme, n_layers=L, n_heads=H, n_kv_heads=Hkv, head_dim=D, rope_layout="half-split",
                           n_sequences=batch, max_tokens=batch * (args.context + total_steps + 16), device="cuda",
                           cuda_stream=stream)
    handle = ops.register_store(store)
    seqs = list(range(batch))
    g = torch.Generator(device="cuda").manual_seed(1)
    for layer in range(L):
        k = torch.randn(batch * args.context, Hkv, D, device="cuda", generator=g)
        v = torch.randn(batch * args.context, Hkv, D, device="cuda", generator=g)
        store.append_device(layer, seqs, [args.context] * batch, k.data_ptr(), v.data_ptr())
    torch.cuda.synchronize()
    k_in = [torch.randn(batch, Hkv, D, device="cuda", generator=g) for _ in range(L)]
    v_in = [torch.randn(batch, Hkv, D, device="cuda", generator=g) for _ in range(L)]
    q_in = [torch.randn(batch, H, D, device="cuda", generator=g) for _ in range(L)]

    def eager_step() -> None:
        for layer in range(L):
            store.append_device(layer, seqs, [1] * batch, k_in[layer].data_ptr(), v_in[layer].data_ptr())
            torch.ops.certkv.kv_store_decode(handle, layer, seqs, q_in[layer])

    def timed(run) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps * 1e3

    eager_step()  # warm
    eager_ms, planned_ms = [], []
    graph = None
    for _ in range(args.rounds):
        eager_ms.append(timed(eager_step))
        if store.plan_device(seqs, args.steps + 1) or graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for layer in range(L):
                    torch.ops.certkv.kv_store_step_planned(handle, layer, k_in[layer], v_in[layer], q_in[layer])
        graph.replay()  # the plan's extra step: warm
        planned_ms.append(timed(graph.replay))
        store.finish_planned_device(stream)
    return {"commit": commit, "gpu": gpu, "scheme": scheme, "batch": batch, "context": args.context,
            "layers": L, "heads": H, "kv_heads": Hkv, "head_dim": D, "steps": args.steps, "rounds": args.rounds,
            "eager_step_ms": eager_ms, "planned_step_ms": planned_ms,
            "eager_ms_median": statistics.median(eager_ms), "planned_ms_median": statistics.median(planned_ms),
            "planned_over_eager": statistics.median(p / e for p, e in zip(planned_ms, eager_ms))}


if __name__ == "__main__":
    main()
