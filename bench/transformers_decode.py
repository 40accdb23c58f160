#!/usr/bin/env python3
"""Batched decode in transformers (bf16, SDPA), the peer of certkv_backend_decode: B sequences of
C tokens prefilled, then every decode step runs all B (one token each, greedy) and is timed with
CUDA synchronization; one JSON line per (context, batch) with the median step and aggregate
tokens/s.

The model is built from a config (Qwen2.5-0.5B's shape by default) with random weights, labelled
"synthetic weights": decode speed does not depend on the weights' values, and the device has no
network to fetch the checkpoint. Prompts are random token ids.

usage: python3 bench/transformers_decode.py [--batch 1,8,32] [--ctx 8192] [--steps 32]
           [--warmup 4] [--layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936]
"""
import argparse
import json
import statistics
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--ctx", default="8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=4864)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    a = ap.parse_args()
    cfg = transformers.Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=131072,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    for ctx in [int(x) for x in a.ctx.split(",")]:
        for b in [int(x) for x in a.batch.split(",")]:
            ids = torch.randint(3, a.vocab, (b, ctx), device="cuda")
            cache = transformers.DynamicCache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                for at in range(0, ctx, a.prefill_chunk):
                    out = model(input_ids=ids[:, at:at + a.prefill_chunk], past_key_values=cache, use_cache=True,
                                logits_to_keep=1)
                torch.cuda.synchronize()
                prefill_s = time.perf_counter() - t0
                nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
                steps = []
                for s in range(a.warmup + a.steps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
                    torch.cuda.synchronize()
                    if s >= a.warmup:
                        steps.append(1e3 * (time.perf_counter() - t))
            med = statistics.median(steps)
            print(json.dumps({"engine": "transformers", "kv": "bf16", "weights": "synthetic", "batch": b, "ctx": ctx,
                              "steps": a.steps, "step_ms": round(med, 4), "step_ms_min": round(min(steps), 4),
                              "step_ms_max": round(max(steps), 4), "tok_per_s": round(1e3 * b / med, 2),
                              "prefill_tok_per_s": round(b * ctx / prefill_s, 1),
                              "torch": torch.__version__, "transformers": transformers.__version__}), flush=True)
            del cache, out, ids
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
