#!/usr/bin/env bash
# Installs the carried FlashInfer payload (.peers/) on the device machine and exports what
# bench/decode_peers.py needs to JIT-compile FlashInfer's decode kernels there, offline.
#
# usage (repository root, `carry: [".peers"]`):
#   source bench/peers_setup.sh && python3 bench/decode_peers.py --kv KV --out $OUT/peers.jsonl
# REQUIRES: python3 with torch (CUDA), nvcc, a host C++ compiler; no network.
#
# The payload (untracked, made on a machine with PyPI, ~5.5 MB):
#   flashinfer_python-0.6.9-py3-none-any.whl  the PyPI wheel without flashinfer/data/cutlass/ and
#       flashinfer/data/spdlog/ (the decode and FA2 prefill modules include neither; RECORD trimmed
#       to match). Its other requirements are on the image (click, einops, ninja, numpy,
#       nvidia-ml-py, packaging, requests, tabulate, torch, tqdm, filelock, jinja2) or only
#       imported by kernels this benchmark does not use (nvidia-cutlass-dsl, nvidia-cudnn-frontend,
#       cuda-tile).
#   apache_tvm_ffi-0.1.9-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#       (needs typing-extensions, on the image).
# To remake it:
#   python3 -m pip download --no-deps -d /tmp/fiw flashinfer-python==0.6.9
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .peers apache-tvm-ffi==0.1.9
#   then copy the flashinfer wheel into .peers/ leaving out the two folders above, and their
#   lines in flashinfer_python-0.6.9.dist-info/RECORD.

peers_setup() {
  local site=${PEERS_SITE:-/tmp/site}
  if ! ls .peers/*.whl >/dev/null 2>&1; then
    echo "peers_setup: no .peers/*.whl here (run from the repository root, carry .peers)" >&2
    return 1
  fi
  echo "peers_setup: installing $(cd .peers && echo *.whl) into $site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .peers/*.whl || { echo "peers_setup: pip install failed" >&2; return 1; }

  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_ws  # JIT cache: /tmp/flashinfer_ws/.cache/flashinfer
  export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache
  export TORCH_CUDA_ARCH_LIST=9.0
  export FLASHINFER_CUDA_ARCH_LIST=9.0a  # sm_90a, what FlashInfer picks by itself on an H200
  export MAX_JOBS=16
  if [ -z "${CUDA_HOME:-}" ]; then
    if command -v nvcc >/dev/null; then
      CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    else
      CUDA_HOME=/usr/local/cuda
    fi
    export CUDA_HOME
  fi
  if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
    echo "peers_setup: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)" >&2
    return 1
  fi
  export PATH="$CUDA_HOME/bin:$PATH"
  if ! command -v "${CXX:-c++}" >/dev/null; then  # FlashInfer links with $CXX, default c++
    if ! command -v g++ >/dev/null; then
      echo "peers_setup: no host C++ compiler (c++ or g++)" >&2
      return 1
    fi
    export CXX=g++
  fi
  if ! command -v ninja >/dev/null; then  # FlashInfer runs `ninja` from PATH
    local ninja_dir
    if ! ninja_dir=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null); then
      echo "peers_setup: no ninja on PATH nor the ninja Python package" >&2
      return 1
    fi
    export PATH="$ninja_dir:$PATH"
  fi

  echo "peers_setup: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') at $CUDA_HOME," \
    "ninja $(ninja --version), MAX_JOBS=$MAX_JOBS, JIT cache under $FLASHINFER_WORKSPACE_BASE"
  python3 -c 'import torch, tvm_ffi, flashinfer
print(f"peers_setup: flashinfer {flashinfer.__version__}, tvm_ffi {tvm_ffi.__version__},"
      f" torch {torch.__version__}, CUDA device: {torch.cuda.is_available()}")' ||
    { echo "peers_setup: import flashinfer failed" >&2; return 1; }
}

peers_setup
