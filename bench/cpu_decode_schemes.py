#!/usr/bin/env python3
"""Decode tokens/s of `certkv run` per KV scheme on the CPU, end to end (issue 30), for one or
two builds in the same run.

Each round runs every (build, scheme) once on the same prompt (a character range of a book),
the order of the builds alternating between rounds; a scheme's ratio is its decode tok/s over
bf16's of the same build and round, and the JSON keeps every run, the per-round ratios and their
medians. Comparing two builds (--base) gives each scheme's ratio to bf16 before and after, which
survives a machine whose speed drifts between rounds better than raw tok/s.

usage (repository root):
  python3 bench/cpu_decode_schemes.py [--certkv build/tools/certkv/certkv] [--base OTHER/certkv]
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--book PATH] [--chars 5000:18500]
      [--schemes bf16,gaac,fp8-e4m3,dither8,rtn4,kivi2] [--threads 1,2] [--rounds 3] [--n 24]
      [--out docs/bench/cpu_decode_schemes.json]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(binary, model, prompt_file, scheme, threads, n):
    cmd = [binary, "run", "--model", model, "--prompt-file", prompt_file, "--raw", "--n", str(n), "--threads",
           str(threads), "--kv", scheme, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    r = json.loads(line)
    return {"decode_tok_per_s": r["decode_tok_per_s"], "prefill_tok_per_s": r["prefill_tok_per_s"],
            "prompt_tokens": r["prompt_tokens"], "generated_tokens": r["generated_tokens"], "text": r["text"]}


def git_commit(path):
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--certkv", default="build/tools/certkv/certkv")
    ap.add_argument("--base", default=None, help="a second certkv binary to compare with")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--book", default="tests/data/corpus/austen-pride-and-prejudice.txt")
    ap.add_argument("--chars", default="5000:18500")
    ap.add_argument("--schemes", default="bf16,gaac,fp8-e4m3,dither8,rtn4,kivi2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--out", default="docs/bench/cpu_decode_schemes.json")
    args = ap.parse_args()

    begin, end = (int(x) for x in args.chars.split(":"))
    with open(args.book, encoding="utf-8") as f:
        text = f.read()[begin:end]
    prompt = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8")
    prompt.write(text)
    prompt.close()
    builds = {"after": args.certkv}
    if args.base:
        builds["before"] = args.base
    schemes = args.schemes.split(",")
    if "bf16" not in schemes:
        sys.exit("cpu_decode_schemes: the ratios need bf16 among --schemes")
    runs = []
    for threads in (int(t) for t in args.threads.split(",")):
        for rnd in range(args.rounds):
            order = list(builds) if rnd % 2 == 0 else list(reversed(list(builds)))
            for build in order:
                for scheme in schemes:
                    r = run_once(builds[build], args.model, prompt.name, scheme, threads, args.n)
                    r.update({"build": build, "scheme": scheme, "threads": threads, "round": rnd})
                    runs.append(r)
                    print(f"threads {threads} round {rnd} {build:6s} {scheme:9s} decode {r['decode_tok_per_s']:.1f} tok/s",
                          file=sys.stderr)
    os.unlink(prompt.name)

    summary = []
    for threads in sorted({r["threads"] for r in runs}):
        for build in builds:
            for scheme in schemes:
                ratios, tok = [], []
                for rnd in range(args.rounds):
                    pick = {r["scheme"]: r for r in runs
                            if r["threads"] == threads and r["build"] == build and r["round"] == rnd}
                    ratios.append(pick[scheme]["decode_tok_per_s"] / pick["bf16"]["decode_tok_per_s"])
                    tok.append(pick[scheme]["decode_tok_per_s"])
                summary.append({"threads": threads, "build": build, "scheme": scheme,
                                "decode_tok_per_s_median": round(statistics.median(tok), 2),
                                "vs_bf16_median": round(statistics.median(ratios), 3),
                                "vs_bf16_per_round": [round(x, 3) for x in ratios]})
    result = {
        "benchmark": "cpu_decode_schemes",
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(os.path.dirname(os.path.abspath(args.certkv)) or "."),
        "base_commit": git_commit(os.path.dirname(os.path.abspath(args.base))) if args.base else None,
        "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
        "cpu_count": os.cpu_count(),
        "model": os.path.basename(args.model),
        "prompt": f"{args.book} characters [{begin}, {end})",
        "prompt_tokens": runs[0]["prompt_tokens"],
        "generated_tokens": args.n,
        "command": "python3 " + " ".join(sys.argv),
        "summary": summary,
        "runs": runs,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    for s in summary:
        print(f"threads {s['threads']} {s['build']:6s} {s['scheme']:9s} {s['decode_tok_per_s_median']:8.1f} tok/s  "
              f"{s['vs_bf16_median']:.3f}x bf16  {s['vs_bf16_per_round']}")


if __name__ == "__main__":
    main()
