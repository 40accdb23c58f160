#!/usr/bin/env bash
# certkv batch on the embedded default: one valid JSON line per request in input order, then the
# summary; each output equal to the request run alone; a request too long for the context fails
# alone; a malformed line is an error naming its line number; a pool too small is refused.
# usage: cli_batch.sh CERTKV_BINARY MODEL.gguf
set -eu
bin=$1 model=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/in.jsonl" <<'JSONL'
{"id": "sea", "prompt": "Write one sentence about the sea.", "max_tokens": 20}
{"id": "colours", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "stop": ["\n"]}

{"prompt": "\u7528\u4e00\u53e5\u8bdd\u63cf\u8ff0\u5927\u6d77\u3002", "max_tokens": 3}
{"id": "long", "prompt": "Count to five.", "max_tokens": 5000}
{"id": "sampled", "prompt": "Say hello.", "max_tokens": 8, "temperature": 0.8, "top_k": 20, "seed": 5}
{"id": "past-eos", "prompt": "Say hello.", "max_tokens": 40, "ignore_eos": true}
JSONL
"$bin" batch --model "$model" --prompts-file "$tmp/in.jsonl" --parallel 3 --ctx 512 --step-tokens 16 >"$tmp/out.jsonl"
head -1 "$tmp/in.jsonl" >"$tmp/one.jsonl"
"$bin" batch --model "$model" --prompts-file "$tmp/one.jsonl" --parallel 1 --ctx 512 >"$tmp/alone.jsonl"
sed -n 6p "$tmp/in.jsonl" >"$tmp/sampled.jsonl"
"$bin" batch --model "$model" --prompts-file "$tmp/sampled.jsonl" --parallel 1 --ctx 512 >"$tmp/sampled_alone.jsonl"
python3 - "$tmp/out.jsonl" "$tmp/alone.jsonl" "$tmp/sampled_alone.jsonl" <<'PY'
import json, sys
lines = open(sys.argv[1], 'rb').read().decode('utf-8').splitlines()
rows = [json.loads(l) for l in lines]
assert len(rows) == 7, len(rows)
assert [r.get("id") for r in rows[:6]] == ["sea", "colours", "4", "long", "sampled", "past-eos"], rows
sea, colours, cjk, long_, sampled, past_eos, summary = rows
assert past_eos["generated_tokens"] == 40 and past_eos["finish_reason"] == "length", past_eos
for r in (sea, colours, cjk, sampled):
    for key in ("text", "prompt_tokens", "generated_tokens", "ttft_ms", "finish_reason", "certkv"):
        assert key in r, (key, r)
    assert r["ttft_ms"] > 0 and r["prompt_tokens"] > 5
    assert r["certkv"]["scheme"] == "bf16" and r["certkv"]["kv_bytes"]["bf16"] > 0
assert "context" in long_["error"], long_
assert colours["finish_reason"] in ("stop", "length", "end") and "\n" not in colours["text"]
assert sea["generated_tokens"] == 20 and sea["finish_reason"] == "length"
alone = json.loads(open(sys.argv[2]).read().splitlines()[0])
assert alone["text"] == sea["text"], (alone["text"], sea["text"])
sampled_alone = json.loads(open(sys.argv[3]).read().splitlines()[0])
assert sampled_alone["text"] == sampled["text"], (sampled_alone["text"], sampled["text"])
assert summary["summary"] is True and summary["requests"] == 6
for key in ("prefill_tok_per_s", "decode_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
            "itl_ms_p99", "kv_bytes_peak", "preemptions", "shared_blocks"):
    assert key in summary, key
assert summary["decode_tok_per_s"] > 0 and summary["kv_bytes_peak"]["bf16"] > 0
print("batch ok:", sea["text"][:60])
PY
printf '{"prompt": "fine"}\n{"prompt": "broken"\n' >"$tmp/bad.jsonl"
if "$bin" batch --model "$model" --prompts-file "$tmp/bad.jsonl" >"$tmp/bad.out" 2>"$tmp/bad.err"; then
  echo "a malformed line was accepted"; exit 1
fi
grep -q "line 2" "$tmp/bad.err" || { cat "$tmp/bad.err"; exit 1; }
printf '{"max_tokens": 3}\n' >"$tmp/noprompt.jsonl"
if "$bin" batch --model "$model" --prompts-file "$tmp/noprompt.jsonl" 2>"$tmp/np.err"; then exit 1; fi
grep -q 'line 1: needs "prompt" or "messages"' "$tmp/np.err" || { cat "$tmp/np.err"; exit 1; }
printf '{"prompt": "a"}\n{"prompt": "b", "ignore_eos": "yes"}\n' >"$tmp/eos.jsonl"
if "$bin" batch --model "$model" --prompts-file "$tmp/eos.jsonl" 2>"$tmp/eos.err"; then exit 1; fi
grep -q 'line 2: a field has the wrong type' "$tmp/eos.err" || { cat "$tmp/eos.err"; exit 1; }
if "$bin" batch --model "$model" --prompts-file "$tmp/one.jsonl" --ctx 512 --pool-bytes 100000 2>"$tmp/pool.err"; then exit 1; fi
grep -q "fewer than one sequence" "$tmp/pool.err" || { cat "$tmp/pool.err"; exit 1; }
echo "5 passed, 0 failed"
