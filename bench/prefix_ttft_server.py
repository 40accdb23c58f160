#!/usr/bin/env python3
"""Time to first token of requests that share a cached prompt prefix, through `certkv serve`.

The engine goal (docs/engine.md): 8 requests sharing a ~2,048-token prefix; the 2nd..8th requests'
time to first token at most 20% of the first's. Here the first request runs alone (its prompt's
whole blocks stay in the prefix cache), then the other seven arrive together. Time to first token
is measured by the client, from sending the request to the first streamed text.

usage: prefix_ttft_server.py CERTKV_BIN MODEL CORPUS_DIR [THREADS]
Prints one JSON document.
"""
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import pathlib


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_ttft(port, prompt, max_tokens, out, i):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out[i] = {"error": resp.status, "body": resp.read().decode(errors="replace")}
        return
    first = None
    text = ""
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for c in chunk.get("choices", []):
            if c.get("text"):
                if first is None:
                    first = time.perf_counter()
                text += c["text"]
        if chunk.get("usage"):
            usage = chunk["usage"]
    out[i] = {"ttft_ms": (first - start) * 1000 if first else None, "text": text, "usage": usage}


def main():
    binary, model, corpus = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    threads = sys.argv[4] if len(sys.argv) > 4 else "2"
    book = sorted(corpus.glob("*.txt"))[0]
    words = book.read_text(encoding="utf-8", errors="replace").split()[2000:3500]
    prefix = " ".join(words)
    questions = ["Who speaks first?", "Where does this take place?", "What happens next?",
                 "Summarize it in one line.", "Which names appear?", "What is the mood?",
                 "What time of day is it?", "What does the narrator want?"]
    prompts = [prefix + "\n\nQuestion " + str(i) + ": " + q for i, q in enumerate(questions)]
    port = free_port()
    server = subprocess.Popen([binary, "serve", "-m", model, "--port", str(port), "-np", "8", "-c", "2400",
                               "-t", threads], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        out = [None] * 8
        stream_ttft(port, prompts[0], 16, out, 0)
        threads_ = [threading.Thread(target=stream_ttft, args=(port, prompts[i], 16, out, i)) for i in range(1, 8)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/metrics")
        metrics = [l for l in c.getresponse().read().decode().splitlines()
                   if l.startswith("certkv:prefix") or l.startswith("certkv:prompt_tokens")]
    finally:
        server.terminate()
        server.wait(timeout=30)
    first = out[0]["ttft_ms"]
    later = [o["ttft_ms"] for o in out[1:]]
    commit = subprocess.run(["git", "-C", str(pathlib.Path(__file__).resolve().parent.parent), "rev-parse", "--short",
                             "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "commit": commit, "threads": int(threads), "model": pathlib.Path(model).name,
        "command": "python3 bench/prefix_ttft_server.py build/tools/certkv/certkv MODEL ../shared/data/corpus " + threads,
        "prompt_tokens": [o["usage"]["prompt_tokens"] if o.get("usage") else None for o in out],
        "first_ttft_ms": first, "later_ttft_ms": later,
        "later_over_first": [t / first for t in later],
        "max_later_over_first": max(later) / first,
        "metrics": metrics}, indent=1))


if __name__ == "__main__":
    main()
