#!/usr/bin/env bash
# The certkv option table: short flags (-m -p -f -n -c -t -s) give the same run as their long
# forms; each command's help lists that command's flags only; `certkv -h` lists the commands;
# an unknown flag is one error line naming it and the command (with a near miss suggested), exit
# status 2, never a crash; --version; the --threads default is the physical cores and the help
# says so; --json stays valid UTF-8 when generation stops inside a multi-byte character.
# usage: cli_options.sh CERTKV_BINARY MODEL.gguf
set -u
bin=$1 model=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0 passed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failures=$((failures + 1)); }

# Short and long forms: the same greedy text, context, threads and seed.
printf 'Name a colour.' >"$tmp/prompt.txt"
"$bin" run --model "$model" --prompt "Name a colour." --n 6 --ctx 96 --threads 1 --seed 3 --json >"$tmp/long.json" 2>"$tmp/long.err"
"$bin" run -m "$model" -p "Name a colour." -n 6 -c 96 -t 1 -s 3 --json >"$tmp/short.json" 2>"$tmp/short.err"
"$bin" run -m "$model" -f "$tmp/prompt.txt" -n 6 -c 96 -t 1 -s 3 --json >"$tmp/file.json" 2>"$tmp/file.err"
if python3 - "$tmp/long.json" "$tmp/short.json" "$tmp/file.json" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
keys = ("text", "prompt_tokens", "generated_tokens", "context_tokens", "threads")
for r in runs[1:]:
    for k in keys:
        assert r[k] == runs[0][k], (k, r[k], runs[0][k])
assert runs[0]["generated_tokens"] == 6 and runs[0]["context_tokens"] == 96 and runs[0]["threads"] == 1, runs[0]
PY
then ok "short flags -m -p -f -n -c -t -s run as --model --prompt --prompt-file --n --ctx --threads --seed"
else bad "short flags differ from long ones"; cat "$tmp/long.err" "$tmp/short.err" "$tmp/file.err"; fi

# Per-command help: stdout, exit 0, that command's flags and no other command's.
help_case() {  # name, command words..., then "--" and patterns: +present / -absent
  local name=$1; shift
  local args=()
  while [ "$1" != "--" ]; do args+=("$1"); shift; done
  shift
  "$bin" "${args[@]}" >"$tmp/help.out" 2>"$tmp/help.err"
  local rc=$? missing=""
  for p in "$@"; do
    case $p in
      +*) grep -qF -- "${p#+}" "$tmp/help.out" || missing="$missing [lacks '${p#+}']" ;;
      -*) ! grep -qF -- "${p#-}" "$tmp/help.out" || missing="$missing [has '${p#-}']" ;;
    esac
  done
  if [ $rc -eq 0 ] && [ -z "$missing" ] && [ ! -s "$tmp/help.err" ]; then ok "$name"
  else bad "$name: rc=$rc$missing"; head -5 "$tmp/help.out" "$tmp/help.err"; fi
}
help_case "run -h lists run's flags only" run -h -- "+usage: certkv run" "+-m, --model PATH" "+-p, --prompt TEXT" \
  "+-f, --prompt-file" "+-n, --n N" "+-c, --ctx N" "+-t, --threads N" "+-s, --seed S" "+--kv SCHEME" "+dither8" \
  "+--sparse" "+--device" "---prompts-file" "---parallel" "---codec" "---calib" "---lengths" "---text-file" "---out "
help_case "run --help is run -h" run --help -- "+usage: certkv run" "---parallel"
help_case "batch -h lists batch's flags only" batch -h -- "+usage: certkv batch" "+--prompts-file F.jsonl" \
  "+--parallel N" "+--pool-bytes" "+-n, --n N" "---prompt TEXT" "---prompt-file" "---codec"
help_case "codec -h lists codec's flags only" codec -h -- "+usage: certkv codec" "+--calib" "+--verify" \
  "+--save-calibration" "---model" "---kv SCHEME" "---threads" "---prompt"
help_case "eval needle -h lists needle's flags only" eval needle -h -- "+usage: certkv eval needle" "+--lengths" \
  "+--variant" "+--kv SCHEME" "---text-file" "---per-position" "---prompt"
help_case "serve -h lists the server's flags" serve -h -- "+usage: certkv serve" "+--port" "+--api-key" "---prompts-file"
help_case "batch -h takes --device" batch -h -- "+--device cpu|cuda"
help_case "dump-kv -h lists dump-kv's flags only" dump-kv -h -- "+--text-file" "+--layers" "+--out" "---kv SCHEME" "---prompt"
help_case "certkv -h lists the commands, not their flags" -h -- "+run" "+batch" "+dump-kv" "+eval needle" "+audit" \
  "+codec" "+--version" "---prompt TEXT" "---threads" "---kv SCHEME"

# The --threads default: the physical cores (distinct package and core ids of the online CPUs).
cores=$(python3 - <<'PY'
import glob, os, re
def online():
    try:
        spec = open('/sys/devices/system/cpu/online').read().strip()
    except OSError:
        return []
    cpus = []
    for part in spec.split(','):
        lo, _, hi = part.partition('-')
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus
pairs = set()
for c in online():
    t = '/sys/devices/system/cpu/cpu%d/topology/' % c
    try:
        pairs.add((open(t + 'physical_package_id').read().strip(), open(t + 'core_id').read().strip()))
    except OSError:
        pairs = set(); break
print(len(pairs) if pairs else os.cpu_count())
PY
)
"$bin" run -h >"$tmp/run.help"
if grep -qF -- "-t, --threads N" "$tmp/run.help" && grep -q -- "--threads N .*physical cores, $cores)" "$tmp/run.help"; then
  ok "run -h shows the --threads default: the $cores physical cores"
else bad "run -h does not show --threads defaulting to $cores"; grep -- "--threads" "$tmp/run.help"; fi
"$bin" run -m "$model" -p hi -n 1 --json >"$tmp/threads.json" 2>/dev/null
if python3 -c "import json,sys; r=json.load(open('$tmp/threads.json')); sys.exit(0 if r['threads'] == $cores else 1)"; then
  ok "run without --threads uses $cores threads"
else bad "run without --threads: $(cat "$tmp/threads.json")"; fi

# --version.
"$bin" --version >"$tmp/version" 2>&1
if [ $? -eq 0 ] && grep -qE '^certkv [0-9]+\.[0-9]+\.[0-9]+$' "$tmp/version"; then ok "--version: $(cat "$tmp/version")"
else bad "--version: $(cat "$tmp/version")"; fi

# Usage mistakes: exit 2, one line on stderr naming the command and the flag, nothing on stdout.
usage_error() {  # name, expected substring, args...
  local name=$1 want=$2; shift 2
  timeout 60 "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ $rc -eq 2 ] && [ "$lines" -eq 1 ] && [ ! -s "$tmp/out" ] && grep -qF -- "$want" "$tmp/err"; then ok "$name: $(cat "$tmp/err")"
  else bad "$name: rc=$rc, stderr ($lines lines): $(cat "$tmp/err")"; fi
}
usage_error unknown-flag "certkv run: unknown flag --bogus" run --bogus
usage_error unknown-flag-near-miss "unknown flag --thread (did you mean --threads?)" run -m "$model" --thread 2
usage_error unknown-flag-typo "did you mean --prompt?" run --promt hi
usage_error unknown-short-flag "certkv batch: unknown flag -p" batch -p hi
usage_error flag-of-another-command "flag --parallel is not a flag of certkv run (certkv batch takes it" run --parallel 2
usage_error eval-needle-flag-of-other-tasks "flag --text-file is not a flag of certkv eval needle (certkv dump-kv, certkv eval teacher-forced, certkv audit take it" eval needle --kv bf16 --text-file x
usage_error unexpected-argument "unexpected argument 'hello'" run hello
usage_error short-needs-value "flag -n needs a value" run -n
usage_error short-bad-number "flag --n expects an integer" run -m "$model" -n abc
usage_error short-and-long-twice "flag --n given twice" run -n 2 --n 3
usage_error switch-with-value "flag --json takes no value" run --json=1

# --json is valid UTF-8 even when generation stops inside a multi-byte character: SmolLM2's
# byte-level tokens split a Chinese character, and the 2nd token of this greedy continuation is
# the first bytes of one (written as U+FFFD).
"$bin" run -m "$model" --raw -p "大海是" -n 2 --json >"$tmp/cjk.json" 2>"$tmp/cjk.err"
if python3 - "$tmp/cjk.json" <<'PY2'
import json, sys
r = json.loads(open(sys.argv[1], 'rb').read().decode('utf-8'))
assert r["generated_tokens"] == 2, r
assert r["text"].startswith("\u4e00"), repr(r["text"])
PY2
then ok "--json cut inside a multi-byte character is valid UTF-8 JSON"
else bad "--json cut inside a multi-byte character: $(cat "$tmp/cjk.err")"; fi

echo "$passed passed, $failures failed"
[ "$failures" -eq 0 ]
