"""Decode speed of a transformers Llama with its DynamicCache (SDPA) against
certkv.transformers.CertkvCache (certkv's attention over the pages, with the meter): the prompt's
prefill time and the time of each greedy decode step after it, on the CPU or a CUDA device, one
process.

    python3 bench/transformers_cache.py --threads 2 --prompt 512 --new 64
    python3 bench/transformers_cache.py --device cuda --shape llama-3.1-8b --batch 8 --prompt 4096 \\
        --new 128 --schemes fp8-e4m3,gaac --json out/transformers_cache.json

The model is a Llama made here with random weights, in bf16, of one of three shapes: SmolLM2-135M's
(30 layers, 9 query and 3 KV heads of 64, hidden 576), Llama-3.2-3B's (28 layers, 24 query and 8
KV heads of 128, hidden 3072) or Llama-3.1-8B's (32 layers, 32 query and 8 KV heads of 128, hidden
4096). On the CPU it is saved and loaded by transformers; on CUDA it is
built on the device (an 8B model is not written to disk). One set of weights serves every run:
the attention implementation is switched between them. Token ids are random; the DynamicCache +
sdpa baseline runs first. Each run prints one line; --json writes them as cells.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import transformers

import certkv.transformers as ct

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         tie_word_embeddings=False),
}


def make_model(config: transformers.LlamaConfig, device: str) -> transformers.LlamaForCausalLM:
    if device == "cpu":
        with tempfile.TemporaryDirectory() as d:
            transformers.LlamaForCausalLM(config).save_pretrained(d)
            return transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    # Built in bf16 on the device, as from_pretrained(dtype=bfloat16) builds it: parameters made
    # in bf16 (no float32 copy of 8B parameters), buffers that the model asks in float32 kept so.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def set_attention(model: transformers.PreTrainedModel, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # older transformers, or a model it would not switch
        model.config._attn_implementation = name


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model, ids, make_cache, new: int, device: str, prefill_kwargs: dict):
    """Prefill of ids, then `new` greedy decode steps: (cache, prefill seconds, step seconds)."""
    steps = []
    with torch.no_grad():
        cache = make_cache()
        synchronize(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, **prefill_kwargs)
        token = out.logits[:, -1:].argmax(-1)
        synchronize(device)
        prefill_s = time.perf_counter() - t0
        del out
        for _ in range(new):
            t0 = time.perf_counter()
            token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
            synchronize(device)
            steps.append(time.perf_counter() - t0)
    return cache, prefill_s, steps


def git_commit() -> str | None:
    """The commit of the library measured: CERTKV_COMMIT where the tree is a copy whose git history
    is not the build's (a device machine's), else the checkout's HEAD."""
    if os.environ.get("CERTKV_COMMIT"):
        return os.environ["CERTKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--schemes", default="gaac,dither8")
    ap.add_argument("--sparse", type=float, metavar="P",
                    help="also run each scheme with sparse decode at Top-p P (the store's defaults otherwise)")
    ap.add_argument("--json", metavar="PATH", help="write the runs as JSON cells")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    positions = args.prompt + args.new
    config = transformers.LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(8192, positions))
    model = make_model(config, args.device)
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(args.device)
    # On CUDA the prefill keeps the last position's logits only (a 128k vocabulary over a long
    # prompt would take more memory than the KV cache). The CPU figures of docs/python.md were
    # measured with every position's logits; kept so.
    prefill_kwargs = {"logits_to_keep": 1} if args.device == "cuda" else {}
    # Capacity of each layer: every row's positions, a partial last block taking a whole page.
    max_tokens = args.batch * (positions + 16)
    runs = [("DynamicCache + sdpa", "DynamicCache", "sdpa", "bf16",
             lambda: transformers.DynamicCache(config=model.config))]
    # The store attends on the calling thread (KvStore's n_threads 1, the default): between its
    # operators torch's own --threads workers keep the cores, so a thread of certkv's pool waits
    # for one (n_threads 2 made each layer's attention 5x slower on 2 cores).
    for scheme in args.schemes.split(","):
        runs.append((f"CertkvCache({scheme}) + certkv", "CertkvCache", ct.ATTENTION_NAME, scheme,
                     lambda s=scheme: ct.CertkvCache(model.config, scheme=s, max_tokens=max_tokens)))
        if args.sparse is not None:
            runs.append((f"CertkvCache({scheme}, sparse {args.sparse:g})", "CertkvCache", ct.ATTENTION_NAME, scheme,
                         lambda s=scheme: ct.CertkvCache(model.config, scheme=s, max_tokens=max_tokens,
                                                         sparse=args.sparse)))
    cells = []
    for name, cache_name, attention, kv, make_cache in runs:
        set_attention(model, attention)
        if args.device == "cuda":
            # Kernel loading and library handles would otherwise land in the first timed prefill.
            cache, _, _ = run(model, ids[:, :32], make_cache, 2, args.device, prefill_kwargs)
            del cache
            gc.collect()
        cache, prefill_s, steps = run(model, ids, make_cache, args.new, args.device, prefill_kwargs)
        decode_s = sum(steps)
        cell = {"engine": "transformers", "cache": cache_name, "attention": attention, "kv": kv, "batch": args.batch,
                "ctx": args.prompt, "new": args.new, "prefill_s": prefill_s,
                "step_ms": statistics.median(steps) * 1e3, "tok_per_s": args.batch * args.new / decode_s}
        extra = ""
        if isinstance(cache, ct.CertkvCache):
            c = cache.certificate()
            in_use = sum(c["kv_bytes_by_class"].values())  # pages in use; kv_bytes: what the pools hold
            cell.update(kv_bytes=c["kv_bytes"], kv_page_bytes_in_use=in_use, kv_bytes_bf16=c["kv_bytes_bf16"])
            extra = f"  kv pages {in_use} B, pools {c['kv_bytes']} B (bf16 {c['kv_bytes_bf16']} B)"
            if "sparse" in c:
                cell.update(sparse_p=c["sparse"]["p"], sparse_mean_budget=c["sparse"]["mean_budget"])
                extra += f"  sparse budget {c['sparse']['mean_budget']:.3f}"
            if c["metered"]:
                cell.update(tier=c["tier"], meter_max=c["meter_max"], meter_p99=c["meter_p99"],
                            coverage=c["coverage"], tau=c["tau"])
                extra += f"  meter max {c['meter_max']:.3g} p99 {c['meter_p99']:.3g} coverage {c['coverage']:.3f}"
        cells.append(cell)
        print(f"{name:32s} prefill {args.batch * args.prompt / prefill_s:8.1f} tok/s  decode "
              f"{cell['tok_per_s']:6.2f} tok/s  step {cell['step_ms']:.2f} ms{extra}", flush=True)
        # The cache's layers refer to the cache: freeing its store (and its device pages) takes
        # the cycle collector.
        del cache
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        report = {"commit": git_commit(), "device": args.device,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "shape": args.shape, "threads": args.threads, "cells": cells}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
