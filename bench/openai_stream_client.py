#!/usr/bin/env python3
"""A concurrent streaming client of an OpenAI-compatible server (certkv serve, llama-server).

Reads the JSONL requests of bench/batch_prompts.py ("id", "prompt", "max_tokens"), sends each to
POST /v1/completions with stream: true, temperature 0 (greedy) and ignore_eos (both servers
generate exactly max_tokens), from PARALLEL client threads at once, each sending one request at a
time, and prints one JSON summary. Standard library only; loopback servers only.

usage: bench/openai_stream_client.py --url http://127.0.0.1:PORT --prompts-file F.jsonl
                                     [--parallel 8] [--wait-health 300]

What is measured (client clock, time.perf_counter):
  wall_seconds         from the moment the threads are released together (a barrier) to the end
                       of the last response
  generated_tok_per_s  all generated tokens (the usage of each response; llama-server: its
                       timings.predicted_n when it sends no usage) / wall_seconds
  ttft_ms              per request, from sending it to the first event carrying text
  itl_ms               the gaps between consecutive events carrying text of one request (both
                       servers send one event a token, except certkv holding back the bytes of an
                       incomplete UTF-8 character or a possible stop string; counted in
                       text_events against generated_tokens)
  *_p50, *_p99         nearest-rank quantiles: over requests (TTFT), over all gaps (ITL)
"""
import argparse
import http.client
import json
import os
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.parse


def quantile(values, q):
    """Nearest rank: the ceil(q * n)-th smallest (at least the first)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(max(1, math.ceil(q * len(v))), len(v)) - 1]


def parse_url(url):
    u = urllib.parse.urlparse(url)
    if u.scheme != "http" or not u.hostname:
        sys.exit(f"openai_stream_client.py: --url must be http://HOST:PORT, got {url!r}")
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"openai_stream_client.py: loopback servers only, got {u.hostname!r}")
    return u.hostname, u.port or 80


def wait_health(host, port, seconds):
    deadline = time.monotonic() + seconds
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            body = r.read().decode("utf-8", "replace")
            c.close()
            if r.status == 200:
                return
            last = f"HTTP {r.status} {body[:200]}"
        except OSError as e:
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(f"/health not ready after {seconds} s ({last})")


def stream_request(host, port, req, timeout):
    body = json.dumps({"prompt": req["prompt"], "max_tokens": int(req["max_tokens"]), "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    rec = {"id": req.get("id"), "error": None}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t_send = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            return rec
        times, texts, usage, timings, done = [], [], None, None, False
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec["error"] = json.dumps(chunk["error"])[:300]
                break
            text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if text:
                times.append(now)
                texts.append(text)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
        if rec["error"] is None and not done:
            rec["error"] = "the stream ended without data: [DONE]"
        generated = (usage or {}).get("completion_tokens")
        if generated is None and timings:
            generated = timings.get("predicted_n")
        if generated is None:
            rec["error"] = rec["error"] or "no usage and no timings: the generated tokens are unknown"
        rec.update({"text": "".join(texts), "generated_tokens": generated,
                    "prompt_tokens": (usage or {}).get("prompt_tokens", (timings or {}).get("prompt_n")),
                    "text_events": len(times),
                    "ttft_ms": (times[0] - t_send) * 1e3 if times else None,
                    "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])]})
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return rec


def run_load(url, requests, parallel, timeout=1800.0):
    """Sends the requests from `parallel` threads; returns (per-request records, summary)."""
    host, port = parse_url(url)
    results = [None] * len(requests)
    next_index = [0]
    lock = threading.Lock()
    n_threads = min(parallel, len(requests))
    barrier = threading.Barrier(n_threads + 1)

    def worker():
        barrier.wait()
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(requests):
                return
            results[i] = stream_request(host, port, requests[i], timeout)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if not r["error"]]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    itl = [g for r in ok for g in r["itl_ms"]]
    generated = sum(r["generated_tokens"] for r in ok)
    summary = {
        "requests": len(requests), "errors": len(results) - len(ok), "parallel": parallel,
        "wall_seconds": wall, "generated_tokens": generated,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "text_events": sum(r["text_events"] for r in ok),
        "generated_tok_per_s": generated / wall if wall > 0 else 0.0,
        "ttft_ms_p50": quantile(ttft, 0.5), "ttft_ms_p99": quantile(ttft, 0.99),
        "itl_ms_p50": quantile(itl, 0.5), "itl_ms_p99": quantile(itl, 0.99),
    }
    return results, summary


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process started from `command` (its port already in it), its output in log_path;
    ready once /health answers 200. Stops on exit of the with block."""

    def __init__(self, command, port, log_path, wait_seconds=300):
        self.command, self.port, self.log_path, self.wait_seconds = command, port, log_path, wait_seconds

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_health("127.0.0.1", self.port, self.wait_seconds)
        except RuntimeError:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def process_cpu_seconds(pid):
    """User plus system CPU seconds a process has used so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times():
    """The machine's /proc/stat cpu line: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def read_requests(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--wait-health", type=float, default=0.0)
    args = ap.parse_args()
    if args.parallel < 1:
        sys.exit("openai_stream_client.py: --parallel must be at least 1")
    requests = read_requests(args.prompts_file)
    if not requests:
        sys.exit("openai_stream_client.py: no request in the prompts file")
    if args.wait_health > 0:
        wait_health(*parse_url(args.url), args.wait_health)
    results, summary = run_load(args.url, requests, args.parallel)
    for r in results:
        if r["error"]:
            print(json.dumps({"id": r["id"], "error": r["error"]}))
    print(json.dumps(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
