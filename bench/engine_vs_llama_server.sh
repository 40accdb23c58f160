#!/usr/bin/env bash
# certkv's continuous-batching engine (`certkv batch`) against llama.cpp's server with continuous
# batching (`llama-server -np 8 -cb`): same GGUF, same threads, the same 8 requests sent at once,
# greedy. Runs the two alternately REPEATS times (llama-server first each time: start it on a free
# loopback port, wait for /health, run bench/llama_server_client.py, stop it; then certkv batch)
# and writes one JSON file with every run's summary, the medians, the ratios certkv/llama-server,
# the commit, the CPU and the exact commands.
#
# usage (repository root):
#   bench/engine_vs_llama_server.sh LLAMA_SERVER_BIN [OUT_JSON]
#     OUT_JSON default: docs/bench/engine_vs_llama_server_cpu.json
# environment (defaults):
#   MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf  THREADS=2  PARALLEL=8  REPEATS=3
#   PROMPTS=<made here: bench/batch_prompts.py books $CORPUS 8 410 128>  CORPUS=../shared/data/corpus
#   CERTKV=build/tools/certkv/certkv  WORK=<a new mktemp -d, keeps every run's output and log>
#   LLAMA_CPP_VERSION=<free text recorded with the results, e.g. the sdist and commit>
#   CTX_MARGIN=512 (llama-server -c = PARALLEL x (longest request's tokens bound 640) + CTX_MARGIN)
# Only loopback traffic; the server started here is stopped on exit.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
LLAMA_SERVER=$(readlink -f "$1")
[ -x "$LLAMA_SERVER" ] || { echo "engine_vs_llama_server.sh: no executable $1" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT_JSON=${2:-docs/bench/engine_vs_llama_server_cpu.json}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-8}
REPEATS=${REPEATS:-3}
CORPUS=${CORPUS:-../shared/data/corpus}
CERTKV=${CERTKV:-build/tools/certkv/certkv}
CTX_MARGIN=${CTX_MARGIN:-512}
WORK=${WORK:-$(mktemp -d /tmp/engine_vs_llama_server.XXXXXX)}
mkdir -p "$WORK"
[ -f "$MODEL" ] || { echo "engine_vs_llama_server.sh: no model $MODEL" >&2; exit 2; }
[ -x "$CERTKV" ] || { echo "engine_vs_llama_server.sh: no certkv at $CERTKV (build first)" >&2; exit 2; }

PROMPTS_CMD="python3 bench/batch_prompts.py books $CORPUS $PARALLEL 410 128"
if [ -z "${PROMPTS:-}" ]; then
  PROMPTS=$WORK/requests.jsonl
  $PROMPTS_CMD > "$PROMPTS"
else
  PROMPTS_CMD="(given) $PROMPTS"
fi
CTX=$((PARALLEL * 640 + CTX_MARGIN))

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT INT TERM

CERTKV_CMD="$CERTKV batch --model $MODEL --prompts-file $PROMPTS --raw --parallel $PARALLEL --threads $THREADS --temp 0"
SERVER_CMD_TEMPLATE="$LLAMA_SERVER -m $MODEL -t $THREADS -np $PARALLEL -cb -c $CTX --host 127.0.0.1 --port PORT"
CLIENT_CMD_TEMPLATE="python3 bench/llama_server_client.py --url http://127.0.0.1:PORT --prompts-file $PROMPTS --parallel $PARALLEL --wait-health 300"

CERTKV_SHA_BEFORE=$(sha256sum "$CERTKV" | cut -c1-16)
for r in $(seq 1 "$REPEATS"); do
  port=$(free_port)
  server_cmd=${SERVER_CMD_TEMPLATE//PORT/$port}
  client_cmd=${CLIENT_CMD_TEMPLATE//PORT/$port}
  echo "[run $r/$REPEATS] llama-server on 127.0.0.1:$port" >&2
  cat /proc/loadavg > "$WORK/load_llama_server_$r.txt"
  grep '^cpu ' /proc/stat > "$WORK/stat_llama_server_$r.txt"
  $server_cmd > "$WORK/llama_server_$r.log" 2>&1 &
  SERVER_PID=$!
  if ! $client_cmd > "$WORK/llama_server_$r.jsonl"; then
    echo "engine_vs_llama_server.sh: the client failed (run $r); server log tail:" >&2
    tail -20 "$WORK/llama_server_$r.log" >&2
    exit 1
  fi
  grep '^cpu ' /proc/stat >> "$WORK/stat_llama_server_$r.txt"
  stop_server
  tail -1 "$WORK/llama_server_$r.jsonl" >&2
  echo "[run $r/$REPEATS] certkv batch" >&2
  cat /proc/loadavg > "$WORK/load_certkv_$r.txt"
  grep '^cpu ' /proc/stat > "$WORK/stat_certkv_$r.txt"
  $CERTKV_CMD > "$WORK/certkv_$r.jsonl"
  grep '^cpu ' /proc/stat >> "$WORK/stat_certkv_$r.txt"
  tail -1 "$WORK/certkv_$r.jsonl" >&2
done

CERTKV_VERSION=$("$CERTKV" --version 2>&1 | tr '\n' ' ' | sed 's/ $//') || true
SERVER_VERSION=$("$LLAMA_SERVER" --version 2>&1 | tr '\n' ' ' | sed 's/  */ /g; s/ $//') || true
CPU_MODEL=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD)
DIRTY=$(git -C "$ROOT" status --porcelain --untracked-files=no | wc -l)
DIRTY_DIFF_SHA=$(git -C "$ROOT" diff HEAD | sha256sum | cut -c1-16)
CERTKV_SHA_AFTER=$(sha256sum "$CERTKV" | cut -c1-16)
CERTKV_MTIME=$(date -u -r "$CERTKV" +%Y-%m-%dT%H:%M:%SZ)

export WORK REPEATS OUT_JSON MODEL THREADS PARALLEL CTX PROMPTS PROMPTS_CMD CERTKV_CMD
export SERVER_CMD_TEMPLATE CLIENT_CMD_TEMPLATE SERVER_VERSION CERTKV_VERSION CPU_MODEL COMMIT DIRTY
export DIRTY_DIFF_SHA CERTKV_SHA_BEFORE CERTKV_SHA_AFTER CERTKV_MTIME
export LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-}
python3 - <<'EOF'
import datetime, json, os, re, statistics

E = os.environ
work, repeats = E["WORK"], int(E["REPEATS"])
fields = ["generated_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
          "prefill_tok_per_s", "decode_tok_per_s", "wall_seconds", "generated_tokens", "prefill_tokens"]


def load(path):
    lines = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]
    return [l for l in lines if not l.get("summary")], next(l for l in lines if l.get("summary"))


runs = {"llama_server": [], "certkv": []}
reqs = {"llama_server": [], "certkv": []}
for r in range(1, repeats + 1):
    for name, f in (("llama_server", f"llama_server_{r}.jsonl"), ("certkv", f"certkv_{r}.jsonl")):
        per, summary = load(os.path.join(work, f))
        summary["ttft_ms_sorted"] = sorted(round(x["ttft_ms"], 1) for x in per if x.get("ttft_ms") is not None)
        summary["loadavg_before"] = open(os.path.join(work, f"load_{name}_{r}.txt")).read().split()[:3]
        # /proc/stat over the run (llama-server: from its start to the client's end; certkv: the
        # whole command with the model load): the share of CPU time the hypervisor stole
        a, b = ([int(x) for x in l.split()[1:]] for l in open(os.path.join(work, f"stat_{name}_{r}.txt")))
        d = [y - x for x, y in zip(a, b)]
        summary["cpu_steal_fraction"] = d[7] / sum(d) if sum(d) and len(d) > 7 else None
        runs[name].append(summary)
        reqs[name].append(per)

medians = {name: {k: statistics.median(s[k] for s in runs[name]) for k in fields} for name in runs}
ratios = {k: medians["certkv"][k] / medians["llama_server"][k]
          for k in ("generated_tok_per_s", "ttft_ms_p50") if medians["llama_server"][k]}


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Sanity of the outputs: each system's texts the same in every run (greedy), and the two against
# each other request by request (first run).
agreement = []
for a, b in zip(reqs["certkv"][0], reqs["llama_server"][0]):
    ta, tb = a.get("text", ""), b.get("text", "")
    agreement.append({
        "id": a.get("id"), "prompt_tokens": {"certkv": a.get("prompt_tokens"), "llama_server": b.get("prompt_tokens")},
        "generated_tokens": {"certkv": a.get("generated_tokens"), "llama_server": b.get("generated_tokens")},
        "same_text": ta == tb, "common_prefix_chars": common_prefix(ta, tb),
        "certkv_text_head": ta[:120], "llama_server_text_head": tb[:120],
    })
stable = {name: all([x.get("text") for x in reqs[name][i]] == [x.get("text") for x in reqs[name][0]]
                    for i in range(repeats)) for name in reqs}

notes = []
log = open(os.path.join(work, "llama_server_1.log"), encoding="utf-8", errors="replace").read()
for pat in (r".*n_ctx is not divisible.*", r".*n_threads = .*", r".*n_ctx_slot.*", r".*launch_slot_.*",
            r".*prompt eval time.*", r".*[^t] eval time.*"):
    for m in re.findall(pat, log)[:8]:
        if m.strip() not in notes:
            notes.append(m.strip())

out = {
    "benchmark": "certkv batch vs llama-server continuous batching, 8 concurrent requests, CPU",
    "commit": E["COMMIT"],
    "worktree_modified_tracked_files": int(E["DIRTY"]),
    "worktree_diff_sha256_16": E["DIRTY_DIFF_SHA"],
    "worktree_note": ("tracked files differed from the commit while this ran; the certkv binary may have been built with those changes"
                      if int(E["DIRTY"]) else "tracked files as committed"),
    "certkv_binary": {"version_output": E["CERTKV_VERSION"], "built_utc": E["CERTKV_MTIME"],
                      "sha256_16_before": E["CERTKV_SHA_BEFORE"], "sha256_16_after": E["CERTKV_SHA_AFTER"]},
    "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "cpu": E["CPU_MODEL"],
    "cpu_count": os.cpu_count(),
    "model": os.path.basename(E["MODEL"]),
    "threads": int(E["THREADS"]),
    "parallel": int(E["PARALLEL"]),
    "repeats": repeats,
    "order": "alternating, llama-server then certkv in each repeat; no warm-up run",
    "requests": {"count": len(reqs["certkv"][0]), "prompts_command": E["PROMPTS_CMD"],
                 "sampling": "greedy (temperature 0)", "max_tokens": 128, "raw_prompts": True},
    "llama_cpp": {"version": E["LLAMA_CPP_VERSION"], "server_version_output": E["SERVER_VERSION"],
                  "server_settings": "defaults besides the command (n_batch 2048, n_ubatch 512, f16 KV, flash_attn auto, one KV per slot: kv_unified false with -np 8)",
                  "server_log_notes_first_run": notes},
    "commands": {
        "prompts": E["PROMPTS_CMD"],
        "llama_server": E["SERVER_CMD_TEMPLATE"] + "  (PORT: a free loopback port per run)",
        "client": E["CLIENT_CMD_TEMPLATE"],
        "certkv": E["CERTKV_CMD"],
    },
    "metric_notes": {
        "generated_tok_per_s": "all generated tokens / wall seconds from submitting the 8 requests to the last one done",
        "ttft/itl": "certkv: engine clock per request; llama-server: client clock on streamed chunks (one token each)",
        "prefill/decode tok/s": "certkv: engine stats (step time apportioned by token counts); llama-server: its per-request timings placed on the client clock, tokens over the union of the prompt (decode) intervals",
    },
    "medians": medians,
    "ratios_certkv_over_llama_server": ratios,
    "runs": runs,
    "outputs": {"texts_identical_across_runs": stable, "per_request_first_run": agreement},
}
with open(E["OUT_JSON"], "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2, ensure_ascii=False)
    f.write("\n")
print(json.dumps({"medians": medians, "ratios_certkv_over_llama_server": ratios,
                  "same_text": sum(a["same_text"] for a in agreement), "of": len(agreement),
                  "stable": stable}, indent=1))
EOF
echo "wrote $OUT_JSON (runs kept in $WORK)" >&2
