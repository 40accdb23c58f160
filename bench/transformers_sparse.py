"""Sparse decode through transformers on the CPU or a CUDA device: a real model (a GGUF file that transformers loads
and dequantizes itself, needing the gguf and accelerate packages), one book's text as the prompt,
then teacher-forced decode steps with CertkvCache(scheme) dense and with sparse=P. Per run: the
median decode step, and against the dense run the KL of each step's next-token distribution, top-1
agreement and the mean budget attended (the certificate's sparse entry).

    python3 bench/transformers_sparse.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text ../shared/data/corpus/melville-moby-dick.txt --prompt 4096 --steps 32 --sparse 0.9 \\
        --json docs/bench/cpu_transformers_sparse.json

With --device cuda the model and the cache live on the GPU (the cache's store is a cuda KvStore:
sparse decode there reads bf16 pages, so pass --scheme bf16; its sparse centroid c_q is the first
decode step's query, where the CPU store's is the prompt's mean query).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import transformers

import certkv.transformers as ct


def run(model, ids: torch.Tensor, n_prompt: int, cache) -> tuple[list[float], torch.Tensor]:
    """Prefill ids[:n_prompt], then one step per following token: the steps' seconds and the
    next-token log-probabilities after the prompt and after each step."""
    logp, seconds = [], []
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.no_grad():
        out = model(input_ids=ids[:, :n_prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logp.append(torch.log_softmax(out.logits[0, -1].float(), -1))
        for t in range(n_prompt, ids.shape[1] - 1):
            sync()
            start = time.perf_counter()
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            sync()
            seconds.append(time.perf_counter() - start)
            logp.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    return seconds, torch.stack(logp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--scheme", default="gaac")
    ap.add_argument("--sparse", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder, name = os.path.split(os.path.abspath(args.gguf))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.bfloat16,
                                                              attn_implementation=ct.ATTENTION_NAME)
    model.eval().to(args.device)
    with open(args.text, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : args.prompt + args.steps + 1].to(args.device)
    if ids.shape[1] < args.prompt + args.steps + 1:
        raise SystemExit(f"--text: {ids.shape[1]} tokens, fewer than prompt + steps + 1")
    max_tokens = args.prompt + args.steps + 32
    runs = {}
    for label, sparse in (("dense", None), (f"sparse {args.sparse:g}", args.sparse)):
        cache = ct.CertkvCache(model.config, scheme=args.scheme, max_tokens=max_tokens,
                               **({} if sparse is None else {"sparse": sparse}))
        seconds, logp = run(model, ids, args.prompt, cache)
        runs[label] = {"seconds": seconds, "logp": logp, "certificate": cache.certificate()}
        del cache
    dense, sparse_run = runs["dense"], runs[f"sparse {args.sparse:g}"]
    kl = (dense["logp"].exp() * (dense["logp"] - sparse_run["logp"])).sum(-1).cpu()
    top1 = (dense["logp"].argmax(-1) == sparse_run["logp"].argmax(-1)).float().mean().item()
    cells = []
    for label, r in runs.items():
        cell = {"label": label, "device": args.device, "scheme": args.scheme, "ctx": args.prompt, "steps": args.steps,
                "step_ms_median": statistics.median(r["seconds"]) * 1e3}
        if "sparse" in r["certificate"]:
            cell["sparse"] = r["certificate"]["sparse"]
        cells.append(cell)
        print(json.dumps(cell))
    summary = {"step_ratio_sparse_over_dense": cells[1]["step_ms_median"] / cells[0]["step_ms_median"],
               "kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "top1_agreement": top1}
    print(json.dumps(summary))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        cmd = ("python3 bench/transformers_sparse.py --gguf " + args.gguf + " --text " + args.text +
               f" --prompt {args.prompt} --steps {args.steps} --scheme {args.scheme} --sparse {args.sparse:g}"
               f" --threads {args.threads} --device {args.device}")
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "command": cmd, "model": name, "threads": args.threads, "cells": cells,
                       **summary}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
