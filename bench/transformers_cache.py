"""Decode speed of a transformers Llama on the CPU with its DynamicCache (SDPA) against
certkv.transformers.CertkvCache (certkv's attention over the pages, with the meter): tokens per
second of greedy generation after a prompt, one process, threads as given.

    python3 bench/transformers_cache.py --threads 2 --prompt 512 --new 64

The model is a Llama made here (random weights, SmolLM2-135M's shape: 30 layers, 9 query and 3
KV heads of 64, hidden 576), loaded in bf16 by transformers.
"""

import argparse
import tempfile
import time

import torch
import transformers

import certkv.transformers as ct


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--schemes", default="gaac,dither8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                      max_position_embeddings=8192, tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as d:
        transformers.LlamaForCausalLM(config).save_pretrained(d)
        models = {attn: transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=attn).eval()
                  for attn in ("sdpa", ct.ATTENTION_NAME)}
    ids = torch.randint(3, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    runs = [("DynamicCache + sdpa", "sdpa", lambda m: transformers.DynamicCache(config=m.config))]
    for scheme in args.schemes.split(","):
        runs.append((f"CertkvCache({scheme}) + certkv", ct.ATTENTION_NAME,
                     lambda m, s=scheme: ct.CertkvCache(m.config, scheme=s, n_threads=args.threads)))
    for name, attn, make in runs:
        model = models[attn]
        with torch.no_grad():
            cache = make(model)
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache)
            t1 = time.perf_counter()
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(args.new):
                token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
            t2 = time.perf_counter()
        extra = ""
        if isinstance(cache, ct.CertkvCache):
            c = cache.certificate()
            extra = f"  kv {c['kv_bytes']} B (bf16 {c['kv_bytes_bf16']} B)"
            if c["metered"]:
                extra += f"  meter max {c['meter_max']:.3g} p99 {c['meter_p99']:.3g} coverage {c['coverage']:.3f}"
        print(f"{name:32s} prefill {args.prompt / (t1 - t0):8.1f} tok/s  decode {args.new / (t2 - t1):6.2f} tok/s{extra}",
              flush=True)


if __name__ == "__main__":
    main()
