#!/usr/bin/env python3
"""`certkv serve --step-tokens`: time to first token against the gaps between tokens.

A step runs every decode and then prompt chunks up to step_tokens; a long step is a gap for every
request decoding in it. For each pair (the order alternating) and each value of --step-tokens,
starts the server on a free loopback port and drives it with bench/openai_stream_client.py: one
410-word book excerpt per client (bench/batch_prompts.py books), 128 tokens out, greedy,
ignore_eos, all sent at once. Writes one JSON: every run's summary, the medians per value, the
commit, cpu and commands.

usage (repository root):
  python3 bench/serve_step_tokens.py [--certkv build/tools/certkv/certkv]
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--corpus ../shared/data/corpus]
      [--values 512 128] [--pairs 3] [--clients 8] [--threads 2]
      [--out docs/bench/serve_step_tokens_cpu.json]
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import openai_stream_client as client  # noqa: E402

FIELDS = ["generated_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "wall_seconds"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--certkv", default="build/tools/certkv/certkv")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--corpus", default="../shared/data/corpus")
    ap.add_argument("--values", type=int, nargs="+", default=[512, 128])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/bench/serve_step_tokens_cpu.json")
    args = ap.parse_args()
    root = pathlib.Path(__file__).resolve().parent.parent

    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    modified = len([l for l in git("status", "--porcelain", "--untracked-files=no").splitlines() if l])
    work = tempfile.mkdtemp(prefix="serve_step_tokens.")
    prompts_cmd = ["python3", str(root / "bench/batch_prompts.py"), "books", args.corpus, str(args.clients), "410",
                   "128"]
    lines = subprocess.run(prompts_cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    requests = [json.loads(l) for l in lines if l.strip()]

    def command(step_tokens, port):
        return [args.certkv, "serve", "-m", args.model, "-t", str(args.threads), "-np", str(args.clients), "-c", "800",
                "--step-tokens", str(step_tokens), "--port", str(port)]

    runs = {str(v): [] for v in args.values}
    for pair in range(1, args.pairs + 1):
        order = args.values if pair % 2 else list(reversed(args.values))
        for v in order:
            port = client.free_port()
            with client.Server(command(v, port), port, os.path.join(work, f"{v}_{pair}.log")):
                results, summary = client.run_load(f"http://127.0.0.1:{port}", requests, args.clients)
            if summary["errors"]:
                sys.exit(f"serve_step_tokens.py: --step-tokens {v}: " + next(r["error"] for r in results if r["error"]))
            runs[str(v)].append(summary)
            print(f"[pair {pair}] --step-tokens {v}: {json.dumps({k: round(summary[k], 1) for k in FIELDS})}",
                  file=sys.stderr)
    medians = {v: {k: statistics.median(s[k] for s in r) for k in FIELDS} for v, r in runs.items()}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    out = {
        "benchmark": "certkv serve: --step-tokens, time to first token against inter-token latency",
        "commit": commit, "worktree_modified_tracked_files": modified,
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu, "cpu_count": os.cpu_count(), "model": os.path.basename(args.model), "threads": args.threads,
        "clients": args.clients, "pairs": args.pairs, "order": "alternating between pairs",
        "commands": {"server": " ".join(command("N", 0)).replace("--port 0", "--port PORT"),
                     "prompts": " ".join(prompts_cmd[1:]).replace(str(root) + "/", ""),
                     "script": "python3 " + " ".join(sys.argv)},
        "medians": medians, "runs": runs,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
