#!/usr/bin/env bash
# certkv-serve as a process: bad options exit 2 naming the flag; on a free port (sparse decode) it
# loads, answers /health and completions, with the sparse budget and estimated mass in the
# certificate and on /metrics, and stops cleanly on SIGTERM, answering a request in flight with 503.
# usage: server_cli.sh CERTKV_SERVE MODEL
set -euo pipefail
serve=$1
model=$2
work=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

expect_usage_error() {
  local want=$1
  shift
  set +e
  "$serve" "$@" >"$work/out" 2>&1
  local rc=$?
  set -e
  if [ "$rc" -ne 2 ] || ! grep -q -- "$want" "$work/out"; then
    echo "FAIL: certkv-serve $* exited $rc, expected 2 naming '$want':"; cat "$work/out"; exit 1
  fi
}
expect_usage_error "flag -m/--model is required" --port 0
expect_usage_error "unknown flag '--bogus'" -m "$model" --bogus
expect_usage_error "flag --port" -m "$model" --port 70000
expect_usage_error "flag --device" -m "$model" --device tpu
expect_usage_error "flag --sparse" -m "$model" --sparse p=2
expect_usage_error "do not combine" -m "$model" --sparse 0.9 --gate --kv rtn8
expect_usage_error "flags --gate and --no-meter contradict" -m "$model" --gate --no-meter --kv rtn8
expect_usage_error "flag --threads-http" -m "$model" --threads-http 0
expect_usage_error "flag --step-tokens" -m "$model" --step-tokens 0
expect_usage_error "flag --request-timeout" -m "$model" --request-timeout 0
expect_usage_error "flag --request-timeout" -m "$model" --request-timeout soon
# A witness its scheme cannot keep: the server stops at load (exit 1), naming the witness and the scheme.
set +e
"$serve" -m "$model" --port 0 --kv rtn8 --witness exponent >"$work/out" 2>&1
rc=$?
set -e
if [ "$rc" -ne 1 ] || ! grep -q "witness exponent is not sound for kv rtn8" "$work/out"; then
  echo "FAIL: certkv-serve --kv rtn8 --witness exponent exited $rc:"; cat "$work/out"; exit 1
fi

"$serve" -m "$model" --port 0 -c 128 -np 2 --sparse p=0.9,window=16 >"$work/log" 2>&1 &
pid=$!
port=
for _ in $(seq 1 100); do
  port=$(sed -n 's|.*listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$work/log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "FAIL: no port in the log:"; cat "$work/log"; exit 1; }
python3 - "$port" "$pid" <<'PY'
import json, os, signal, sys, threading, time, urllib.request, urllib.error
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        with urllib.request.urlopen(base + "/health") as r:
            if json.load(r)["status"] == "ok":
                break
    except urllib.error.HTTPError as e:
        assert e.code == 503, e.code
    time.sleep(0.1)
else:
    sys.exit("FAIL: /health never turned 200")
req = urllib.request.Request(base + "/v1/completions", method="POST",
                             data=json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req) as r:
    body = json.load(r)
assert body["usage"]["completion_tokens"] == 3, body
assert body["usage"]["certkv"]["scheme"] == "bf16", body
assert body["usage"]["certkv"]["metered"] is False, body

# Sparse decode over a prompt long enough to index blocks before the 16-token window: the
# certificate carries the budget and the index's estimated mass of the Top-p selections, at
# least p = 0.9 by construction; /metrics has both per-request histograms.
prompt = " ".join(["The river ran past the mill and under the old stone bridge."] * 8)
req = urllib.request.Request(base + "/v1/completions", method="POST",
                             data=json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0}).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req) as r:
    cert = json.load(r)["usage"]["certkv"]
assert 0 < cert["sparse_budget"] < 1, cert
assert 0.9 <= cert["sparse_estimated_mass"] <= 1 + 1e-9, cert
with urllib.request.urlopen(base + "/metrics") as r:
    metrics = r.read().decode()
def sample(name):
    return float(next(l.split()[-1] for l in metrics.splitlines() if l.startswith(name + " ")))
assert sample("certkv:request_sparse_estimated_mass_count") == 1, metrics
assert abs(sample("certkv:request_sparse_estimated_mass_sum") - cert["sparse_estimated_mass"]) < 1e-9, metrics
assert sample("certkv:request_sparse_budget_count") == 2, metrics

# A request still generating when the server is told to stop is cancelled and answered 503.
status = []
def long_request():
    req = urllib.request.Request(base + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "Hello", "max_tokens": 120, "temperature": 0,
                                                  "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req)
        status.append(200)
    except urllib.error.HTTPError as e:
        status.append(e.code)
t = threading.Thread(target=long_request)
t.start()
# Told to stop once the request is running (a fixed sleep could fire before it arrived on a
# loaded machine, and then nothing is in flight).
deadline = time.time() + 30
while time.time() < deadline:
    with urllib.request.urlopen(base + "/metrics") as r:
        if "certkv:requests_running 1" in r.read().decode():
            break
    time.sleep(0.02)
else:
    raise AssertionError("the long request never ran")
os.kill(int(sys.argv[2]), signal.SIGTERM)
t.join(30)
assert status == [503], status
PY
set +e
wait "$pid"
rc=$?
set -e
pid=
if [ "$rc" -ne 0 ]; then echo "FAIL: certkv-serve exited $rc on SIGTERM:"; cat "$work/log"; exit 1; fi
grep -q "stopping (signal 15)" "$work/log" || { echo "FAIL: no clean stop in the log:"; cat "$work/log"; exit 1; }

# --no-meter: a lossy scheme serves without the meter; the certificate says so, /metrics counts
# no metered cell.
"$serve" -m "$model" --port 0 -c 128 -np 1 --kv fp8-e4m3 --no-meter >"$work/log_no_meter" 2>&1 &
pid=$!
port=
for _ in $(seq 1 100); do
  port=$(sed -n 's|.*listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$work/log_no_meter")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "FAIL: no port in the log:"; cat "$work/log_no_meter"; exit 1; }
python3 - "$port" <<'PY'
import json, sys, time, urllib.request, urllib.error
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        with urllib.request.urlopen(base + "/health") as r:
            break
    except urllib.error.HTTPError:
        time.sleep(0.1)
req = urllib.request.Request(base + "/v1/completions", method="POST",
                             data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req) as r:
    cert = json.load(r)["usage"]["certkv"]
assert cert["scheme"] == "fp8-e4m3" and cert["metered"] is False and cert["meter_tier"] == "none", cert
assert "meter_max" not in cert, cert
with urllib.request.urlopen(base + "/metrics") as r:
    metrics = r.read().decode()
assert 'certkv:meter_cells_total{scheme="fp8-e4m3"} 0' in metrics, metrics
assert "certkv:meter_coverage" not in metrics, metrics
PY
kill "$pid"
wait "$pid" || { echo "FAIL: certkv-serve --no-meter did not stop cleanly:"; cat "$work/log_no_meter"; exit 1; }
pid=
echo "server_cli: ok"
