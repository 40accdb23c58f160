#!/usr/bin/env python3
"""Prefill and decode speed of certkv against llama.cpp on the CPU, same GGUF, same threads.

For each context length N (default 512 and 4096) both engines read the same plain text (an
evaluation book of the corpus, no chat template) whose llama.cpp tokenization is exactly N
tokens, then decode --n-decode tokens greedily. Runs alternate between the engines
(llama.cpp, certkv, llama.cpp, certkv, ...) so that machine drift hits both, after one untimed
warm-up run per engine and context (page cache, first-call allocations). The table shows
medians over --repeats runs. Each run records how many cores other processes kept busy
meanwhile (from /proc/stat): sharing the cores makes llama.cpp's spinning threads many times
slower, so such runs are flagged and left out of the medians unless every run was shared.

llama.cpp (llama-cpp-python): n_batch = n_ubatch = 512, KV cache F16 (its default), flash
attention off (llama-cpp-python's default; --llamacpp-flash-attn turns it on),
n_ctx = N + n_decode. Prefill is one eval() of the N prompt tokens; decode is n_decode
single-token eval() calls, each fed the argmax of the previous logits; both timed with
time.perf_counter.

certkv: `<certkv> run --model M --prompt-file F --n <n_decode> --ctx <N + n_decode>
--threads T --raw --json`, which prints one JSON object carrying prefill_tok_per_s and
decode_tok_per_s (measured by certkv itself).

Usage:
  scripts/bench_vs_llamacpp.py --out out/bench_cpu.json
  scripts/bench_vs_llamacpp.py --llamacpp-only --contexts 512
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CERTKV = REPO_ROOT / "build" / "tools" / "certkv" / "certkv"
DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "data" / "corpus"
# An evaluation book (calibration uses other books); the prompt starts at the first paragraph
# boundary at or after this character.
BOOK = "wells-time-machine.txt"
START_CHAR = 10000
N_BATCH = 512
# Other processes using more than this many cores on average make a run unreliable.
OTHER_LOAD_WARN_CORES = 0.2


def fail(message):
    sys.exit(f"bench_vs_llamacpp.py: error: {message}")


def git_commit():
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
        return out + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "none"


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def open_llama(model, n_ctx, threads, flash_attn=False):
    import llama_cpp
    return llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
                           n_threads=threads, n_threads_batch=threads, logits_all=False,
                           flash_attn=flash_attn, verbose=False)


def prompt_text(llm, corpus_dir, n_tokens):
    """Returns (text, tokens) with llama.cpp's tokenization of text exactly n_tokens long."""
    path = corpus_dir / BOOK
    if not path.is_file():
        fail(f"corpus book {path} not found")
    book = path.read_text(encoding="utf-8")
    start = book.find("\n\n", START_CHAR)
    if start < 0:
        fail(f"no paragraph boundary after character {START_CHAR} in {BOOK}")
    window = book[start + 2:start + 2 + 12 * n_tokens]
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"
    tokens = llm.tokenize(window.encode("utf-8"), add_bos=add_bos, special=False)
    if len(tokens) <= n_tokens:
        fail(f"{BOOK} from char {start + 2} gives only {len(tokens)} tokens, need {n_tokens}")
    kept = tokens[:n_tokens]
    text = llm.detokenize(kept[1:] if add_bos else kept).decode("utf-8")
    again = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    if len(again) != n_tokens:
        fail(f"cut prompt retokenizes to {len(again)} tokens, not {n_tokens}")
    return text, again


def run_llamacpp(llm, tokens, n_decode):
    import llama_cpp
    n_vocab = llm.n_vocab()
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill_s = time.perf_counter() - start

    def last_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    next_id = int(np.argmax(last_logits()))
    start = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([next_id])
        next_id = int(np.argmax(last_logits()))
    decode_s = time.perf_counter() - start
    return {"prefill_tok_per_s": len(tokens) / prefill_s, "decode_tok_per_s": n_decode / decode_s,
            "prefill_s": prefill_s, "decode_s": decode_s}


def run_certkv(binary, model, prompt_file, n_decode, n_ctx, threads, n_tokens):
    cmd = [str(binary), "run", "--model", str(model), "--prompt-file", str(prompt_file),
           "--n", str(n_decode), "--ctx", str(n_ctx), "--threads", str(threads), "--raw", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"certkv exited with {proc.returncode}: {' '.join(cmd)}\n{proc.stderr.strip()}")
    result = None
    for line in reversed(proc.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if result is None:
        try:
            result = json.loads(proc.stdout)
        except json.JSONDecodeError:
            fail(f"certkv printed no JSON object: {' '.join(cmd)}\n{proc.stdout[-2000:]}")
    for key in ("prefill_tok_per_s", "decode_tok_per_s"):
        if key not in result:
            fail(f"certkv JSON lacks '{key}': {result}")
    for key in ("prompt_tokens", "n_prompt_tokens"):
        if key in result and int(result[key]) != n_tokens:
            print(f"warning: certkv tokenized the prompt to {result[key]} tokens, "
                  f"llama.cpp to {n_tokens}", file=sys.stderr)
    return result


def cpu_clock():
    """(wall s, machine busy CPU s from /proc/stat, this process and its children's CPU s)."""
    own = os.times()
    own_s = own.user + own.system + own.children_user + own.children_system
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy_s = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy_s = None
    return time.perf_counter(), busy_s, own_s


def other_cores_busy(before, after):
    """Average number of cores other processes kept busy between two cpu_clock() readings."""
    if before[1] is None or after[1] is None:
        return None
    wall = after[0] - before[0]
    return round(max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall), 3)


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--certkv", type=Path, default=DEFAULT_CERTKV, help="certkv CLI binary")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096],
                        help="prompt lengths in tokens")
    parser.add_argument("--n-decode", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--llamacpp-only", action="store_true", help="skip certkv")
    parser.add_argument("--llamacpp-flash-attn", action="store_true",
                        help="run llama.cpp with flash attention (off by default, as in "
                             "llama-cpp-python)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed first run of each engine at each context")
    args = parser.parse_args()

    try:
        import llama_cpp
    except ImportError:
        fail("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    if not args.model.is_file():
        fail(f"{args.model} not found; run scripts/fetch_models.sh")
    if not args.llamacpp_only and not os.access(args.certkv, os.X_OK):
        fail(f"certkv binary {args.certkv} not found or not executable "
             "(build tools/certkv, pass --certkv PATH, or use --llamacpp-only)")
    if args.repeats < 1 or args.n_decode < 1 or min(args.contexts) < 1:
        fail("--repeats, --n-decode and --contexts must be positive")

    engines = ["llama.cpp"] + ([] if args.llamacpp_only else ["certkv"])
    results = []
    with tempfile.TemporaryDirectory(prefix="certkv_bench_") as tmp:
        for n_prompt in args.contexts:
            n_ctx = n_prompt + args.n_decode
            llm = open_llama(args.model, n_ctx, args.threads, args.llamacpp_flash_attn)
            text, tokens = prompt_text(llm, args.corpus_dir, n_prompt)
            prompt_file = Path(tmp) / f"prompt_{n_prompt}.txt"
            prompt_file.write_bytes(text.encode("utf-8"))
            runs = {engine: [] for engine in engines}
            if args.warmup:
                for engine in engines:
                    if engine == "llama.cpp":
                        run_llamacpp(llm, tokens, args.n_decode)
                    else:
                        run_certkv(args.certkv, args.model, prompt_file, args.n_decode, n_ctx,
                                   args.threads, n_prompt)
            for repeat in range(args.repeats):
                for engine in engines:
                    clock_before = cpu_clock()
                    if engine == "llama.cpp":
                        run = run_llamacpp(llm, tokens, args.n_decode)
                    else:
                        run = run_certkv(args.certkv, args.model, prompt_file, args.n_decode,
                                         n_ctx, args.threads, n_prompt)
                    others = other_cores_busy(clock_before, cpu_clock())
                    run["other_processes_cores_busy"] = others
                    runs[engine].append(run)
                    print(f"  ctx {n_prompt:>6} run {repeat + 1}/{args.repeats} {engine:>9}: "
                          f"prefill {run['prefill_tok_per_s']:8.1f} tok/s, "
                          f"decode {run['decode_tok_per_s']:7.2f} tok/s"
                          + ("" if others is None else f"  (other processes: {others:.2f} cores)"),
                          flush=True)
                    if others is not None and others > OTHER_LOAD_WARN_CORES:
                        print(f"  warning: other processes kept {others:.2f} cores busy during "
                              "this run; its numbers are unreliable", file=sys.stderr, flush=True)
            del llm
            for engine in engines:
                clean = [r for r in runs[engine] if r["other_processes_cores_busy"] is None
                         or r["other_processes_cores_busy"] <= OTHER_LOAD_WARN_CORES]
                counted = clean or runs[engine]
                results.append({
                    "engine": engine, "prompt_tokens": n_prompt, "n_ctx": n_ctx,
                    "decode_tokens": args.n_decode,
                    "prefill_tok_per_s_median": median_of(counted, "prefill_tok_per_s"),
                    "decode_tok_per_s_median": median_of(counted, "decode_tok_per_s"),
                    "runs_in_median": len(counted),
                    "median_over": ("unshared runs" if clean
                                    else "all runs (every run shared the cores)"),
                    "runs": runs[engine]})

    print()
    print(f"{'engine':>10} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13}  median of")
    for r in results:
        print(f"{r['engine']:>10} {r['prompt_tokens']:>7} {r['prefill_tok_per_s_median']:>14.1f} "
              f"{r['decode_tok_per_s_median']:>13.2f}  {r['runs_in_median']} {r['median_over']}")

    if args.out:
        report = {
            "commit": git_commit(),
            "model": args.model.name,
            "threads": args.threads,
            "repeats": args.repeats,
            "warmup_runs": 1 if args.warmup else 0,
            "book": BOOK,
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_settings": {"n_batch": N_BATCH, "n_ubatch": N_BATCH,
                                   "kv_cache_type": "f16",
                                   "flash_attn": args.llamacpp_flash_attn},
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
