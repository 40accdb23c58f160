#!/usr/bin/env python3
"""Concurrent streaming client for llama.cpp's llama-server, measured like `certkv batch`.

Reads the same request file as `certkv batch --prompts-file` (one JSON object a line: "id",
"prompt", "max_tokens"; lines written by bench/batch_prompts.py), sends every request to the
server's native `/completion` endpoint from PARALLEL client threads at once (stream: true,
n_predict = max_tokens, temperature 0 (greedy), cache_prompt false, return_tokens true), and
prints, like certkv batch, one JSON line per request in input order and then one summary line
with "summary": true. Standard library only (http.client, threading).

usage:
  bench/llama_server_client.py --url http://127.0.0.1:PORT --prompts-file F.jsonl
                               [--parallel 8] [--wait-health 300] [--timeout 1800]

  --url           the server, loopback only (e.g. http://127.0.0.1:8080)
  --prompts-file  the JSONL requests ("max_tokens" defaults to --n, 128)
  --parallel      client threads, each sending one request at a time (default 8)
  --wait-health   first poll GET /health until it answers 200, up to this many seconds (0: don't)
  --timeout       socket timeout of one request in seconds

  e.g. llama-server -m M.gguf -t 2 -np 8 -cb -c 5632 --host 127.0.0.1 --port 8080 &
       python3 bench/batch_prompts.py books ../shared/data/corpus 8 410 128 > /tmp/books8.jsonl
       python3 bench/llama_server_client.py --url http://127.0.0.1:8080 \
           --prompts-file /tmp/books8.jsonl --parallel 8 --wait-health 300

What is measured (client clock, time.perf_counter):
  wall_seconds         from just before the threads send their requests (all released together
                       by a barrier) to the end of the last response
  ttft_ms              per request, from sending it to the first streamed chunk carrying a token
  itl_ms               the gaps between consecutive token-carrying chunks of one request (the
                       server streams one token per chunk; a chunk with k > 1 tokens counts as one
                       gap, reported as multi_token_chunks)
  generated_tokens     the server's timings.predicted_n (tokens_predicted), checked against the
                       streamed token count (stream_tokens)
  generated_tok_per_s  all generated tokens / wall_seconds (as certkv batch)
  ttft_ms_p50/p99, itl_ms_p50/p99   nearest-rank quantiles over requests / over all gaps, the same
                       rule as certkv batch
  prefill_tok_per_s    sum of timings.prompt_n / the length of the union of the requests' prompt
                       intervals, each [first token - timings.prompt_ms, first token]
  decode_tok_per_s     sum of timings.predicted_n / the length of the union of their generation
                       intervals, each [first token, first token + timings.predicted_ms]
                       (llama-server's own timings placed on the client clock: aggregate rates
                       over all slots, comparable to certkv's, which apportions each step's time
                       between its prompt and decode tokens; here a step mixing both counts in
                       both unions)
  server_prompt_per_second_mean, server_predicted_per_second_mean   the means over requests of
                       llama-server's per-slot timings.prompt_per_second / predicted_per_second
"""
import argparse
import http.client
import json
import math
import sys
import threading
import time
import urllib.parse


def quantile(values, q):
    """Nearest rank, as certkv batch: the ceil(q * n)-th smallest (at least the first)."""
    if not values:
        return 0.0
    v = sorted(values)
    rank = max(1, math.ceil(q * len(v)))
    return v[min(rank, len(v)) - 1]


def union_length(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def parse_url(url):
    u = urllib.parse.urlparse(url)
    if u.scheme != "http" or not u.hostname:
        sys.exit(f"llama_server_client.py: --url must be http://HOST:PORT, got {url!r}")
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"llama_server_client.py: loopback servers only, got {u.hostname!r}")
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
    sys.exit(f"llama_server_client.py: /health not ready after {seconds} s ({last})")


def run_request(host, port, req, default_n, timeout, start_barrier, out):
    body = {
        "prompt": req["prompt"],
        "n_predict": int(req.get("max_tokens", default_n)),
        "temperature": 0.0,
        "stream": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    payload = json.dumps(body).encode("utf-8")
    rec = {"id": req.get("id"), "error": None}
    if start_barrier is not None:
        start_barrier.wait()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t_send = time.perf_counter()
        conn.request("POST", "/completion", body=payload,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:500].decode('utf-8', 'replace')}"
            out.update(rec)
            return
        token_times, texts, final = [], [], None
        stream_tokens, multi = 0, 0
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
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec["error"] = json.dumps(chunk["error"])[:500]
                break
            toks = chunk.get("tokens") or []
            content = chunk.get("content") or ""
            if toks or content:
                token_times.append(now)
                stream_tokens += len(toks)
                if len(toks) > 1:
                    multi += 1
                texts.append(content)
            if chunk.get("stop"):
                final = chunk
                break
        t_end = time.perf_counter()
        if rec["error"] is None and final is None:
            rec["error"] = "stream ended without a final chunk"
        timings = (final or {}).get("timings", {})
        rec.update({
            "text": "".join(texts),
            "t_send": t_send,
            "t_first": token_times[0] if token_times else None,
            "t_end": t_end,
            "ttft_ms": (token_times[0] - t_send) * 1e3 if token_times else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(token_times, token_times[1:])],
            "stream_tokens": stream_tokens,
            "multi_token_chunks": multi,
            "generated_tokens": int(timings.get("predicted_n", (final or {}).get("tokens_predicted", stream_tokens))),
            "prompt_tokens": int(timings.get("prompt_n", (final or {}).get("tokens_evaluated", 0))),
            "stop_type": (final or {}).get("stop_type"),
            "timings": timings,
        })
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out.update(rec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--n", type=int, default=128, help="max_tokens of lines without one")
    ap.add_argument("--wait-health", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    host, port = parse_url(args.url)

    reqs = []
    with open(args.prompts_file, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    reqs.append(json.loads(line))
                except ValueError as e:
                    sys.exit(f"llama_server_client.py: {args.prompts_file} line {i}: {e}")
    if not reqs:
        sys.exit("llama_server_client.py: no request in the prompts file")
    if args.parallel < 1:
        sys.exit("llama_server_client.py: --parallel must be at least 1")
    if args.wait_health > 0:
        wait_health(host, port, args.wait_health)

    results = [dict() for _ in reqs]
    next_index = [0]
    lock = threading.Lock()
    n_threads = min(args.parallel, len(reqs))
    barrier = threading.Barrier(n_threads + 1)

    def worker():
        first = True
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(reqs):
                if first:
                    barrier.wait()
                return
            run_request(host, port, reqs[i], args.n, args.timeout, barrier if first else None, results[i])
            first = False

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start

    ttft, itl, prompt_iv, decode_iv = [], [], [], []
    generated = prompt_tokens = errors = multi = 0
    pps, tps = [], []
    for r in results:
        if r.get("error"):
            errors += 1
            print(json.dumps({"id": r.get("id"), "error": r["error"]}, ensure_ascii=False))
            continue
        t = r["timings"]
        if r["ttft_ms"] is not None:
            ttft.append(r["ttft_ms"])
        itl.extend(r["itl_ms"])
        generated += r["generated_tokens"]
        prompt_tokens += r["prompt_tokens"]
        multi += r["multi_token_chunks"]
        if r["t_first"] is not None and "prompt_ms" in t and "predicted_ms" in t:
            prompt_iv.append((r["t_first"] - t["prompt_ms"] / 1e3, r["t_first"]))
            decode_iv.append((r["t_first"], r["t_first"] + t["predicted_ms"] / 1e3))
        if "prompt_per_second" in t:
            pps.append(float(t["prompt_per_second"]))
        if "predicted_per_second" in t:
            tps.append(float(t["predicted_per_second"]))
        print(json.dumps({
            "id": r["id"], "text": r["text"], "finish_reason": r["stop_type"],
            "prompt_tokens": r["prompt_tokens"], "generated_tokens": r["generated_tokens"],
            "stream_tokens": r["stream_tokens"], "ttft_ms": r["ttft_ms"],
            "wall_ms": (r["t_end"] - r["t_send"]) * 1e3, "timings": t,
        }, ensure_ascii=False))
    prefill_s, decode_s = union_length(prompt_iv), union_length(decode_iv)
    decode_tokens = sum(r["generated_tokens"] for r in results if not r.get("error"))
    summary = {
        "summary": True,
        "system": "llama-server",
        "requests": len(reqs),
        "errors": errors,
        "parallel": args.parallel,
        "wall_seconds": wall,
        "prefill_tokens": prompt_tokens,
        "generated_tokens": generated,
        "prefill_tok_per_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_tok_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "generated_tok_per_s": generated / wall if wall > 0 else 0.0,
        "ttft_ms_p50": quantile(ttft, 0.5),
        "ttft_ms_p99": quantile(ttft, 0.99),
        "itl_ms_p50": quantile(itl, 0.5),
        "itl_ms_p99": quantile(itl, 0.99),
        "prefill_union_seconds": prefill_s,
        "decode_union_seconds": decode_s,
        "server_prompt_per_second_mean": sum(pps) / len(pps) if pps else 0.0,
        "server_predicted_per_second_mean": sum(tps) / len(tps) if tps else 0.0,
        "multi_token_chunks": multi,
    }
    print(json.dumps(summary))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
