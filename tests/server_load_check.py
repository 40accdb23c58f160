#!/usr/bin/env python3
"""certkv-serve under load: 64 concurrent streaming clients, 20 requests each, some hanging up.

Starts one certkv-serve on a free loopback port (SmolLM2, fp8-e4m3, -np 16, a KV pool of 2,048
tokens) and runs CLIENTS threads, each sending REQUESTS
streaming requests one after another: completions and chats of mixed prompt lengths (prefixes of
8 excerpts of the books in tests/data/corpus, 2 to 30 words), 1 to 4 new tokens, greedy. A
seeded draw makes a client hang up mid-stream (after its second event) on about one request in
seven; those ask for 64 tokens with ignore_eos, so that only the hang-up can end them early.
Meanwhile a monitor polls /health and /metrics. It checks:
  - no request fails: every response is 200, nothing 5xx, /health stays ok, the server lives;
  - every completed stream is well formed: each `data:` event parses as JSON of the endpoint's
    chunk object under one id, one finish_reason, a usage chunk (include_usage) with
    total = prompt + completion tokens, completion tokens within max_tokens (equal to it when
    the finish reason is "length", fewer only with "stop"), the same prompt_tokens for the same
    prompt, the certificate's meter_cells = 30 layers x 9 heads per one-token forward, and the
    stream ends with `data: [DONE]`;
  - every hung-up request is cancelled, or ran to its 64 tokens before the server saw the
    hang-up (a fast device writes them all before the client closes): /metrics counts
    requests_finished_total{reason="cancelled"} plus the "length" finishes beyond the completed
    streams' own equal to the hang-ups, at least one was cancelled, and every request finished;
  - the page pool: kv_pool_pages_in_use (pages running requests hold, measured from their block
    tables) was above 0 during the load and is 0 at the end; kv_pool_pages_cached (pages only the
    prefix cache holds) is above 0 after the load, at most the capacity, and equals every
    allocated page at the end;
  - eviction: rounds of 12 requests of 150-word prompts (at most 4), whose blocks the pool cannot
    hold beside the cached ones, are admitted by evicting (prefix_cache_evictions_total grows)
    and complete.

Exit status: 0 passed, 1 failed.
usage: server_load_check.py --serve CERTKV_SERVE --model GGUF --corpus DIR [--clients 64] [--requests 20]
       [--device cpu|cuda] [--cells-per-step N --bytes-per-token B --evicting-words W]  (another
       model than SmolLM2)
"""
import argparse
import http.client
import json
import os
import pathlib
import random
import sys
import tempfile
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

import serve_process

CONTEXT_TOKENS = 256
PARALLEL = 16
# One forward thread: the clients and the HTTP threads share the machine's cores with it.
THREADS = 1
# A pool of 2,048 tokens (128 blocks; bf16 tail pages: 2 x 30 layers x 3 kv heads x 64 x 2 bytes
# a token for SmolLM2; --bytes-per-token for another model), too small for EVICTING_REQUESTS
# prompts of EVICTING_WORDS words at once.
POOL_TOKENS = 2048
BYTES_PER_TOKEN = 23040
EVICTING_REQUESTS = 12
# Rounds of EVICTING_REQUESTS distinct prompts, until admission has evicted: the pool's bytes hold
# more tokens of a class with smaller pages (on cuda --pool-bytes counts fp8 pages, about half a
# bf16 one), and the prompts of earlier rounds stay cached.
EVICTING_ROUNDS = 4
EVICTING_WORDS = 150
CELLS_PER_STEP = 30 * 9  # the meter's cells of one decode step: layers x query heads (SmolLM2's)
HANG_UP_AFTER_EVENTS = 2
HANG_UP_MAX_TOKENS = 64
SEED = 25


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def start_server(serve, model, log_path, clients, device):
    try:
        return serve_process.start_server(
            serve, ["-m", model, "-c", str(CONTEXT_TOKENS), "-np", str(PARALLEL), "--kv", "fp8-e4m3", "--pool-bytes",
                    str(POOL_TOKENS * BYTES_PER_TOKEN), "-t", str(THREADS), "--threads-http", str(clients + 8), "--device", device],
            log_path)
    except serve_process.ServeError as e:
        fail(str(e))


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def metrics(port):
    status, text = get(port, "/metrics")
    if status != 200:
        fail(f"/metrics answered {status}")
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def prompts_of(corpus):
    books = sorted(pathlib.Path(corpus).glob("*.txt"))
    if len(books) < 8:
        fail(f"expected 8 books in {corpus}, found {len(books)}")
    excerpts = [b.read_text(encoding="utf-8", errors="replace").split()[1000:1030] for b in books[:8]]
    return [" ".join(words[:n]) for words in excerpts for n in (2, 6, 14, 30)]


def evicting_prompts(corpus, n):
    books = sorted(pathlib.Path(corpus).glob("*.txt"))
    words = [b.read_text(encoding="utf-8", errors="replace").split() for b in books]
    first = [1200 + 160 * (i // len(words)) for i in range(n)]
    prompts = [" ".join(words[i % len(words)][first[i]:first[i] + EVICTING_WORDS]) for i in range(n)]
    if any(len(p.split()) != EVICTING_WORDS for p in prompts) or len(set(prompts)) != n:
        fail(f"the corpus has too few words for {n} distinct prompts of {EVICTING_WORDS} words")
    return prompts


def complete(port, prompt, out, i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        out[i] = (r.status, r.read().decode("utf-8", "replace"))
    finally:
        c.close()


class Outcome:
    def __init__(self):
        self.lock = threading.Lock()
        self.completed = 0
        self.hung_up = 0
        self.completed_by_length = 0
        self.errors = []
        self.prompt_tokens = {}  # (endpoint, prompt) -> usage.prompt_tokens

    def error(self, message):
        with self.lock:
            self.errors.append(message)


def check_stream(lines, chat, max_tokens, hang_up, where, outcome, key):
    """lines: the response's lines. Returns None when well formed, else why not."""
    events = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data: "):
            return f"{where}: a line that is not an event: {line[:120]!r}"
        events.append(line[6:])
    if hang_up:
        return None
    if not events or events[-1] != "[DONE]":
        return f"{where}: the stream does not end with data: [DONE] (last {events[-1:]!r})"
    chunks = []
    for e in events[:-1]:
        try:
            chunks.append(json.loads(e))
        except ValueError as err:
            return f"{where}: an event that is not JSON ({err}): {e[:120]!r}"
    want_object = "chat.completion.chunk" if chat else "text_completion"
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1 or any(c.get("object") != want_object for c in chunks):
        return f"{where}: chunks of several ids or of another object: {ids}"
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    if len(finishes) != 1 or len(usages) != 1 or chunks[-1].get("choices") or not chunks[-1].get("usage"):
        return f"{where}: finish reasons {finishes}, {len(usages)} usage chunks, the last {chunks[-1]}"
    u = usages[0]
    n = u["completion_tokens"]
    if u["total_tokens"] != u["prompt_tokens"] + n or not 1 <= n <= max_tokens:
        return f"{where}: usage {u} with max_tokens {max_tokens}"
    # "stop" may come with max_tokens tokens too: an end token generated last (it counts).
    if finishes[0] not in ("length", "stop") or (finishes[0] == "length") and n != max_tokens or \
            n < max_tokens and finishes[0] != "stop":
        return f"{where}: finish reason {finishes[0]} with {n} of {max_tokens} tokens"
    # Every forward of one token is a metered decode step: each token after the first, and the
    # first too when the prefix cache left one prompt token to compute.
    cert = u.get("certkv", {})
    steps = n - 1 + (u["prompt_tokens"] - cert.get("prefix_cache_tokens", 0) == 1)
    if cert.get("metered") is not True or cert.get("meter_cells") != steps * CELLS_PER_STEP:
        return f"{where}: certificate {cert} for {n} tokens"
    with outcome.lock:
        outcome.completed_by_length += finishes[0] == "length"
        seen = outcome.prompt_tokens.setdefault(key, u["prompt_tokens"])
    if seen != u["prompt_tokens"]:
        return f"{where}: prompt_tokens {u['prompt_tokens']}, {seen} before for the same prompt"
    return None


def client(port, index, n_requests, prompts, outcome, start):
    rng = random.Random(SEED * 1000 + index)
    start.wait()
    for i in range(n_requests):
        where = f"client {index} request {i}"
        prompt = rng.choice(prompts)
        chat = rng.random() < 0.25
        hang_up = rng.random() < 1 / 7
        max_tokens = HANG_UP_MAX_TOKENS if hang_up else rng.randint(1, 4)
        body = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if hang_up:
            body["ignore_eos"] = True
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                outcome.error(f"{where}: HTTP {resp.status} {resp.read()[:300]!r}")
                continue
            lines, events = [], 0
            while True:
                raw = resp.readline()
                if not raw:
                    break
                line = raw.decode("utf-8")
                lines.append(line)
                if line.startswith("data: "):
                    events += 1
                    if hang_up and events == HANG_UP_AFTER_EVENTS:
                        break
                    if line.startswith("data: [DONE]"):
                        break
            if hang_up and events < HANG_UP_AFTER_EVENTS:
                outcome.error(f"{where}: the stream ended after {events} events, before the hang-up")
                continue
            why = check_stream(lines, chat, max_tokens, hang_up, where, outcome, (chat, prompt))
            if why:
                outcome.error(why)
                continue
            with outcome.lock:
                if hang_up:
                    outcome.hung_up += 1
                else:
                    outcome.completed += 1
        except (OSError, http.client.HTTPException, UnicodeDecodeError) as e:
            outcome.error(f"{where}: {type(e).__name__}: {e}")
        finally:
            # Hanging up: the socket closes with the stream unread.
            conn.close()


def main():
    global CELLS_PER_STEP, BYTES_PER_TOKEN, EVICTING_WORDS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="certkv-serve's --device")
    parser.add_argument("--cells-per-step", type=int, default=CELLS_PER_STEP,
                        help="another model's layers x query heads (default: SmolLM2's)")
    parser.add_argument("--bytes-per-token", type=int, default=BYTES_PER_TOKEN,
                        help="another model's bf16 K and V bytes of a token over its layers (default: SmolLM2's)")
    parser.add_argument("--evicting-words", type=int, default=EVICTING_WORDS,
                        help="words of the eviction phase's prompts (fewer for a tokenizer that splits more)")
    args = parser.parse_args()
    CELLS_PER_STEP, BYTES_PER_TOKEN, EVICTING_WORDS = args.cells_per_step, args.bytes_per_token, args.evicting_words
    work = tempfile.mkdtemp(prefix="certkv-load-")
    log_path = os.path.join(work, "serve.log")
    proc, port = start_server(args.serve, args.model, log_path, args.clients, args.device)
    try:
        prompts = prompts_of(args.corpus)
        outcome = Outcome()
        start = threading.Barrier(args.clients + 1)
        threads = [threading.Thread(target=client, args=(port, i, args.requests, prompts, outcome, start))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        began = time.time()
        start.wait()
        most_live_pages, health_failures, polls = 0.0, [], 0
        while any(t.is_alive() for t in threads):
            status, body = get(port, "/health")
            if status != 200:
                health_failures.append(f"{status} {body[:200]}")
            live = value(metrics(port), "certkv:kv_pool_pages_in_use")
            most_live_pages = max(most_live_pages, live)
            polls += 1
            time.sleep(0.1)
        for t in threads:
            t.join()
        load_seconds = time.time() - began
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        print(f"load: {load_seconds:.1f} s, {polls} polls, server cpu {server_cpu:.1f} s, "
              f"this process cpu {sum(os.times()[:2]):.1f} s", file=sys.stderr)
        if outcome.errors:
            fail(f"{len(outcome.errors)} requests failed, the first: " + "; ".join(outcome.errors[:5]))
        if health_failures:
            fail(f"/health failed during the load: {health_failures[:3]}")
        if proc.poll() is not None:
            fail("certkv-serve died:\n" + open(log_path).read()[-2000:])
        total = args.clients * args.requests
        if outcome.completed + outcome.hung_up != total:
            fail(f"{outcome.completed} completed and {outcome.hung_up} hung up of {total}")

        # Cancellations reach the engine at its next step: wait until nothing runs.
        deadline = time.time() + 20
        while True:
            m = metrics(port)
            idle = value(m, "certkv:requests_running") == 0 and value(m, "certkv:requests_waiting") == 0
            finished = sum(v for (name, _), v in m.items() if name == "certkv:requests_finished_total")
            if (idle and finished == total) or time.time() > deadline:
                break
            time.sleep(0.2)
        if not idle or finished != total:
            fail(f"after the load: {finished} of {total} requests finished, "
                 f"{value(m, 'certkv:requests_running')} running, {value(m, 'certkv:requests_waiting')} waiting")
        cancelled = value(m, "certkv:requests_finished_total", reason="cancelled")
        # A hung-up request the server finished before it saw the hang-up ends by "length".
        ran_out = value(m, "certkv:requests_finished_total", reason="length") - outcome.completed_by_length
        if cancelled < 1 or cancelled + ran_out != outcome.hung_up:
            fail(f"{outcome.hung_up} clients hung up mid-stream: {cancelled} requests were cancelled and "
                 f"{ran_out} ran to their length")
        if value(m, "certkv:requests_finished_total", reason="error") or value(m, "certkv:requests_rejected_total"):
            fail("requests finished in error or were rejected: " +
                 str({k: v for k, v in m.items() if k[0] in ("certkv:requests_finished_total",
                                                             "certkv:requests_rejected_total")}))
        cached_after_load = value(m, "certkv:kv_pool_pages_cached")
        evictions_after_load = value(m, "certkv:prefix_cache_evictions_total")

        # Prompts whose blocks the pool cannot hold beside the cached ones: admission evicts.
        texts = evicting_prompts(args.corpus, EVICTING_REQUESTS * EVICTING_ROUNDS)
        sent = 0
        while sent < len(texts):
            batch = texts[sent:sent + EVICTING_REQUESTS]
            out = [None] * len(batch)
            evicting = [threading.Thread(target=complete, args=(port, p, out, i)) for i, p in enumerate(batch)]
            for t in evicting:
                t.start()
            for t in evicting:
                t.join()
            sent += len(batch)
            if any(o is None or o[0] != 200 for o in out):
                fail(f"a request of the eviction phase failed: {[o for o in out if o is None or o[0] != 200][:2]}")
            if value(metrics(port), "certkv:prefix_cache_evictions_total") > evictions_after_load:
                break
        m = metrics(port)
        live = value(m, "certkv:kv_pool_pages_in_use")
        cached = value(m, "certkv:kv_pool_pages_cached")
        capacity = value(m, "certkv:kv_pool_capacity_pages")
        allocated = sum(v for (name, _), v in m.items() if name == "certkv:kv_pages_in_use")
        evictions = value(m, "certkv:prefix_cache_evictions_total")
        if most_live_pages <= 0:
            fail(f"kv_pool_pages_in_use never rose above 0 over {polls} polls of the load")
        if live != 0:
            fail(f"{live} pages are still held by running requests after the load")
        if not 0 < cached <= capacity or cached != allocated:
            fail(f"kv_pool_pages_cached {cached}, capacity {capacity}, pages allocated {allocated}")
        if cached_after_load <= 0 or evictions <= evictions_after_load:
            fail(f"{cached_after_load} pages cached after the load; {evictions_after_load} evictions then and "
                 f"{evictions} after {sent} prompts the pool cannot hold beside them")
        status, body = get(port, "/health")
        if status != 200 or json.loads(body).get("status") != "ok":
            fail(f"/health after the load: {status} {body}")
        log = open(log_path).read()
        if "failed" in log:
            fail("the server logged a failure:\n" + log[-2000:])
        print(f"PASS: {total} streaming requests from {args.clients} clients in {load_seconds:.1f} s: "
              f"{outcome.completed} well formed, {outcome.hung_up} hung up ({cancelled:.0f} cancelled, "
              f"{ran_out:.0f} ran to their length first); at most "
              f"{most_live_pages:.0f} pages held by running requests, 0 at the end, {cached:.0f} cached "
              f"of {capacity:.0f}, {evictions:.0f} prefixes evicted ({evictions_after_load:.0f} in the load, the rest by {sent} prompts); "
              f"{value(m, 'certkv:preemptions_total'):.0f} preemptions, "
              f"{value(m, 'certkv:prefill_tokens_total'):.0f} prompt tokens computed, "
              f"{value(m, 'certkv:generation_tokens_total'):.0f} generated, "
              f"{value(m, 'certkv:engine_steps_total'):.0f} steps")
        return 0
    finally:
        serve_process.stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
