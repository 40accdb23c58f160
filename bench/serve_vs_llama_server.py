#!/usr/bin/env python3
"""`certkv serve` against llama.cpp's llama-server, the same client on both (issue 25's goal:
certkv at least 1.5x the aggregate tokens/s, time to first token p50 and p99 no worse).

For each repeat and each client count (default 8 and 32): start one server with -np = clients on
a free loopback port, drive it with bench/openai_stream_client.py (POST /v1/completions, stream,
greedy, ignore_eos: CLIENTS requests of 410-word book excerpts, 128 tokens out, all sent at once),
stop it; then the other server. The order alternates between repeats. Both: the same GGUF, the
same threads, a context of CTX_PER_SLOT tokens per request (llama-server -c = clients x
CTX_PER_SLOT, continuous batching -cb; certkv serve -c CTX_PER_SLOT, bf16 KV, pool of clients
whole contexts). Writes one JSON (every run, medians, ratios certkv / llama-server, commit, cpu,
commands, machine load) and a plot.

usage (repository root):
  python3 bench/serve_vs_llama_server.py --llama-server BIN [--certkv build/tools/certkv/certkv]
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--corpus ../shared/data/corpus]
      [--clients 8 32] [--repeats 3] [--threads 2] [--out docs/bench/serve_vs_llama_server_cpu.json]
      [--plot docs/bench/serve_vs_llama_server_cpu.png] [--work DIR]
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

CTX_PER_SLOT = 800  # the longest request: a 410-word excerpt is at most ~640 tokens, plus 128 out
WORDS, MAX_TOKENS = 410, 128
FIELDS = ["generated_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "wall_seconds"]


def commands(args, system, clients, port):
    if system == "llama_server":
        return [args.llama_server, "-m", args.model, "-t", str(args.threads), "-np", str(clients), "-cb",
                "-c", str(clients * CTX_PER_SLOT), "--threads-http", str(clients + 8), "--host", "127.0.0.1",
                "--port", str(port)] + (["--poll", str(args.llama_poll)] if args.llama_poll is not None else [])
    return [args.certkv, "serve", "-m", args.model, "-t", str(args.threads), "-np", str(clients), "-c",
            str(CTX_PER_SLOT), "--threads-http", str(clients + 8), "--host", "127.0.0.1", "--port", str(port)]


def run_one(args, system, clients, requests, work, tag):
    port = client.free_port()
    cmd = commands(args, system, clients, port)
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    before = client.cpu_times()
    with client.Server(cmd, port, os.path.join(work, f"{tag}.log")):
        results, summary = client.run_load(f"http://127.0.0.1:{port}", requests, clients)
    after = client.cpu_times()
    delta = [b - a for a, b in zip(before, after)]
    summary.update({"system": system, "loadavg_before": load_before,
                    "cpu_steal_fraction": delta[7] / sum(delta) if sum(delta) else None,
                    "machine_busy_fraction": 1 - (delta[3] + delta[4]) / sum(delta) if sum(delta) else None})
    with open(os.path.join(work, f"{tag}.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps(summary) + "\n")
    if summary["errors"]:
        sys.exit(f"serve_vs_llama_server.py: {system} with {clients} clients: {summary['errors']} errors, e.g. "
                 + next(r["error"] for r in results if r["error"]))
    print(f"[{tag}] {json.dumps({k: summary[k] for k in FIELDS})}", file=sys.stderr)
    return summary, [r["text"] for r in results]


def plot(out_png, clients_list, medians, runs=None):
    """Bars: the medians; dots: every run (runs[clients][system] lists of summaries)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("generated_tok_per_s", "aggregate tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
              ("ttft_ms_p99", "TTFT p99 (ms)"), ("itl_ms_p50", "ITL p50 (ms)"), ("itl_ms_p99", "ITL p99 (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    width = 0.38
    for ax, (key, title) in zip(axes, panels):
        xs = range(len(clients_list))
        for k, (system, colour) in enumerate((("llama_server", "#888888"), ("certkv", "#1f77b4"))):
            vals = [medians[str(c)][system][key] for c in clients_list]
            ax.bar([x + (k - 0.5) * width for x in xs], vals, width, label=system.replace("_", "-"), color=colour)
            if runs:
                for x, c in zip(xs, clients_list):
                    ys = [r[key] for r in runs[str(c)][system]]
                    ax.plot([x + (k - 0.5) * width] * len(ys), ys, "k.", markersize=4)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{c} clients" for c in clients_list])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("certkv serve vs llama-server: SmolLM2-135M Q4_1, 2 CPU threads, 512-token prompts, 128 out "
                 "(bars: medians; dots: runs)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--certkv", default="build/tools/certkv/certkv")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--corpus", default="../shared/data/corpus")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/bench/serve_vs_llama_server_cpu.json")
    ap.add_argument("--plot", default="docs/bench/serve_vs_llama_server_cpu.png")
    ap.add_argument("--work", default=None)
    ap.add_argument("--plot-only", metavar="JSON", default=None,
                    help="draw --plot from a JSON this script wrote, and run nothing")
    ap.add_argument("--llama-poll", type=int, default=None,
                    help="llama-server --poll (0: its threads sleep while they wait for work; its default 50 "
                         "spins, which a shared machine punishes)")
    args = ap.parse_args()
    if args.plot_only:
        done = json.load(open(args.plot_only))
        plot(args.plot, [int(c) for c in done["medians"]], done["medians"], done["runs"])
        return
    for path in (args.llama_server, args.certkv, args.model):
        if not os.path.exists(path):
            sys.exit(f"serve_vs_llama_server.py: no {path}")
    work = args.work or tempfile.mkdtemp(prefix="serve_vs_llama_server.")
    os.makedirs(work, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parent.parent

    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()

    # The tree as it was when the runs began.
    commit = git("rev-parse", "--short", "HEAD")
    modified = len([l for l in git("status", "--porcelain", "--untracked-files=no").splitlines() if l])
    certkv_sha = subprocess.run(["sha256sum", args.certkv], capture_output=True, text=True).stdout[:16]

    prompt_commands, requests_by_clients = {}, {}
    for c in args.clients:
        cmd = ["python3", str(root / "bench/batch_prompts.py"), "books", args.corpus, str(c), str(WORDS), str(MAX_TOKENS)]
        prompt_commands[str(c)] = " ".join(cmd[1:]).replace(str(root) + "/", "")
        lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
        requests_by_clients[c] = [json.loads(l) for l in lines if l.strip()]

    runs = {str(c): {"llama_server": [], "certkv": []} for c in args.clients}
    texts = {str(c): {"llama_server": [], "certkv": []} for c in args.clients}

    def write(repeats_done):
        medians, ratios = {}, {}
        for c in map(str, args.clients):
            medians[c] = {s: {k: statistics.median(x[k] for x in runs[c][s]) for k in FIELDS} for s in runs[c]}
            ratios[c] = {k: medians[c]["certkv"][k] / medians[c]["llama_server"][k] for k in FIELDS
                         if medians[c]["llama_server"][k]}
        goal = {c: {"tok_per_s_ratio_at_least_1.5": ratios[c]["generated_tok_per_s"] >= 1.5,
                    "ttft_p50_no_worse": ratios[c]["ttft_ms_p50"] <= 1.0,
                    "ttft_p99_no_worse": ratios[c]["ttft_ms_p99"] <= 1.0} for c in ratios}
        same_text = {c: sum(a == b for a, b in zip(texts[c]["certkv"][0], texts[c]["llama_server"][0]))
                     for c in texts}
        stable = {c: {s: all(t == texts[c][s][0] for t in texts[c][s]) for s in texts[c]} for c in texts}

        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
        llama_version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
        out = {
            "benchmark": "certkv serve vs llama-server, OpenAI completions endpoint, streaming, CPU",
            "commit": commit,
            "worktree_modified_tracked_files": modified,
            "certkv_binary": {"path": args.certkv, "sha256_16": certkv_sha},
            "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "cpu": cpu, "cpu_count": os.cpu_count(), "model": os.path.basename(args.model), "threads": args.threads,
            "repeats": repeats_done,
            "order": "alternating: llama-server first in odd repeats, certkv first in even ones; no warm-up run",
            "requests": {"per_client_count": "one request per client, all sent at once", "words": WORDS,
                         "max_tokens": MAX_TOKENS, "sampling": "greedy (temperature 0), ignore_eos",
                         "prompts_commands": prompt_commands},
            "llama_server_version": (llama_version.stdout + llama_version.stderr).strip().splitlines()[-1:],
            "llama_server_build": "see docs/bench/engine_vs_llama_server_cpu.json, llama_cpp.version (the same binary)",
            "commands": {c: {s: " ".join(commands(args, s, int(c), 0)).replace("--port 0", "--port PORT")
                             for s in ("llama_server", "certkv")} for c in map(str, args.clients)},
            "client_command": "python3 bench/openai_stream_client.py --url http://127.0.0.1:PORT --prompts-file "
                              "<prompts> --parallel CLIENTS (run_load, in process)",
            "script_command": "python3 " + " ".join(sys.argv),
            "metric_notes": client.__doc__.split("What is measured")[1].strip(),
            "medians": medians,
            "ratios_certkv_over_llama_server": ratios,
            "goal": goal,
            "outputs": {"same_text_first_run_of": {c: f"{same_text[c]} of {len(texts[c]['certkv'][0])}" for c in texts},
                        "texts_identical_across_runs": stable},
            "runs": runs,
            "work_dir": work,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        plot(args.plot, args.clients, medians, runs)
        return out

    for r in range(1, args.repeats + 1):
        order = ("llama_server", "certkv") if r % 2 else ("certkv", "llama_server")
        for c in args.clients:
            for system in order:
                summary, t = run_one(args, system, c, requests_by_clients[c], work, f"{system}_{c}_{r}")
                runs[str(c)][system].append(summary)
                texts[str(c)][system].append(t)
        # Written after every repeat, so that an interrupted run keeps what it measured.
        out = write(r)
    print(json.dumps({k: out[k] for k in ("medians", "ratios_certkv_over_llama_server", "goal")}, indent=1))


if __name__ == "__main__":
    main()
