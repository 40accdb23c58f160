#!/usr/bin/env python3
"""certkv-serve through the official `openai` Python client (PyPI's `openai`).

Starts certkv-serve on a free loopback port (fp8-e4m3, an API key) and checks, with greedy
decoding unless said otherwise:
  - /v1/models lists the model file;
  - greedy answers equal `certkv run`'s on the same prompt, context, threads and scheme: a chat
    (run applies the chat template) and a completion (run --raw), each prompt's first request;
  - chat and completion, streaming and not: the streamed text equals the whole answer, the
    finish reasons and usage counts are right, and usage carries the certificate (usage.certkv),
    in the stream's usage chunk too;
  - a stop string ends the text before it; a seed reproduces a sampled answer;
  - errors reach the client as its exceptions: a wrong key, an unknown model, a prompt too long.

Exit status: 0 passed, 1 failed, 77 skipped (the openai package is not installed).
usage: server_openai_check.py --serve CERTKV_SERVE --certkv CERTKV --model GGUF
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import serve_process

API_KEY = "openai-client-test-key"
CONTEXT_TOKENS = 256
THREADS = 2


def check(condition, message):
    if not condition:
        print("FAIL: " + message, file=sys.stderr)
        sys.exit(1)


def start_server(serve, model, log_path):
    try:
        return serve_process.start_server(serve, ["-m", model, "-c", str(CONTEXT_TOKENS), "-np", "2", "--kv",
                                                  "fp8-e4m3", "-t", str(THREADS), "--api-key", API_KEY], log_path)
    except serve_process.ServeError as e:
        check(False, str(e))


def certificate(usage, completion_tokens):
    check(usage is not None, "no usage")
    check(usage.completion_tokens == completion_tokens,
          f"usage.completion_tokens {usage.completion_tokens}, expected {completion_tokens}")
    check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, "usage.total_tokens is not the sum")
    c = (usage.model_extra or {}).get("certkv")
    check(isinstance(c, dict), f"usage lacks the certkv extension: {usage}")
    check(c["scheme"] == "fp8-e4m3" and c["metered"] is True, f"certificate {c}")
    check(0 <= c["meter_p99"] <= c["meter_max"] <= 1, f"certificate meters {c}")
    # SmolLM2: 30 layers x 9 query heads per decode step; the first token comes from the prefill.
    check(c["meter_cells"] == (completion_tokens - 1) * 30 * 9, f"certificate cells {c['meter_cells']}")
    return c


def certkv_run(certkv, model, prompt, max_tokens, raw):
    """`certkv run`'s greedy text: the same scheme, context and threads as the server."""
    command = [certkv, "run", "-m", model, "-p", prompt, "-n", str(max_tokens), "-c", str(CONTEXT_TOKENS),
               "-t", str(THREADS), "--kv", "fp8-e4m3", "--json"] + (["--raw"] if raw else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    check(done.returncode == 0, f"{' '.join(command)} exited {done.returncode}: {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", required=True)
    parser.add_argument("--certkv", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    try:
        import openai
    except ImportError:
        print("SKIP: the openai package is not installed (scripts/install_deps.sh installs it)")
        return 77
    work = tempfile.mkdtemp(prefix="certkv-openai-")
    proc, port = start_server(args.serve, args.model, os.path.join(work, "serve.log"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        model_id = os.path.basename(args.model)
        check([m.id for m in client.models.list().data] == [model_id], "models.list")

        # Greedy answers equal certkv run's. First requests of their prompts: with fp8-e4m3 a
        # prompt whose blocks come from the prefix cache attends their fp8 pages (see below).
        for raw, prompt in ((False, "Name three rivers of Europe."), (True, "The oldest bridge in the city")):
            if raw:
                served = client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0)
                text, usage = served.choices[0].text, served.usage
            else:
                served = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=20, temperature=0)
                text, usage = served.choices[0].message.content, served.usage
            run = certkv_run(args.certkv, args.model, prompt, 20, raw)
            what = "completion" if raw else "chat"
            check(text == run["text"], f"greedy {what} {text!r} != certkv run's {run['text']!r}")
            check((usage.prompt_tokens, usage.completion_tokens) == (run["prompt_tokens"], run["generated_tokens"]),
                  f"greedy {what}: usage {usage} against certkv run's {run['prompt_tokens']} prompt and "
                  f"{run['generated_tokens']} generated tokens")

        # Each prompt runs once before the answers compared: a lossy scheme's greedy output differs
        # between a prompt prefilled whole and one whose first blocks come from the prefix cache
        # (fp8 pages, not the exact values the prefill read), so both sides of each comparison
        # start from the same cache.
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = "The three primary colours are"
        client.chat.completions.create(model=model_id, messages=messages, max_tokens=1, temperature=0)
        client.completions.create(model=model_id, prompt=prompt, max_tokens=1, temperature=0)

        chat = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0)
        text = chat.choices[0].message.content
        check(chat.object == "chat.completion" and text, f"chat: {chat}")
        check(chat.choices[0].finish_reason in ("length", "stop"), f"chat finish {chat.choices[0].finish_reason}")
        certificate(chat.usage, chat.usage.completion_tokens)
        if chat.choices[0].finish_reason == "length":
            check(chat.usage.completion_tokens == 12, "a chat at its length limit has 12 tokens")

        pieces, usage, finish = [], None, None
        for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            check(chunk.object == "chat.completion.chunk", f"chunk {chunk}")
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
            if chunk.usage is not None:
                check(not chunk.choices, "the usage chunk has choices")
                usage = chunk.usage
        check("".join(pieces) == text, f"streamed chat {''.join(pieces)!r} != whole {text!r}")
        check(finish == chat.choices[0].finish_reason, f"streamed finish {finish}")
        certificate(usage, chat.usage.completion_tokens)

        completion = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0)
        ctext = completion.choices[0].text
        check(completion.object == "text_completion" and ctext, f"completion: {completion}")
        certificate(completion.usage, completion.usage.completion_tokens)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model_id, prompt=prompt, max_tokens=10, temperature=0, stream=True) if c.choices)
        check(streamed == ctext, f"streamed completion {streamed!r} != whole {ctext!r}")

        # A stop string from the middle of the greedy text ends the text before it.
        words = ctext.split()
        check(len(words) >= 3, f"too few words to pick a stop string from: {ctext!r}")
        stop = " " + words[2]
        stopped = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
        check(stopped.choices[0].finish_reason == "stop", f"stop: finish {stopped.choices[0].finish_reason}")
        check(stopped.choices[0].text == ctext[:ctext.index(stop)], f"stop {stop!r}: {stopped.choices[0].text!r}")

        # A seed reproduces a sampled answer.
        sampled = [client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=1.0,
                                             top_p=0.95, seed=1234).choices[0].text for _ in range(2)]
        check(sampled[0] == sampled[1], f"seed 1234 gave {sampled[0]!r} and {sampled[1]!r}")

        # Errors come back as the client's exceptions.
        try:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
            check(False, "a wrong key was accepted")
        except openai.AuthenticationError:
            pass
        try:
            client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
            check(False, "an unknown model was accepted")
        except openai.NotFoundError as e:
            check(e.body.get("code") == "model_not_found", f"unknown model: {e.body}")
        try:
            client.completions.create(model=model_id, prompt=[1] * (CONTEXT_TOKENS + 1), max_tokens=1)
            check(False, "a prompt longer than the context was accepted")
        except openai.BadRequestError as e:
            check(e.body.get("code") == "context_length_exceeded", f"too long: {e.body}")
        print("PASS: greedy answers equal certkv run's; chat and completion, streaming and not, stop, seed and errors "
              "through the openai client "
              f"{openai.__version__}")
        return 0
    finally:
        serve_process.stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
