#!/usr/bin/env python3
"""Reference logits from llama.cpp (llama-cpp-python) for certkv's forward-pass tests.

For a preset model this writes, under tests/golden/:
  <prefix>_logits.bin      binary golden described below
  <prefix>_passage.txt     the exact UTF-8 text whose tokenization is the golden's token ids
  <prefix>_meta.json       provenance: book, offsets, model sha256, llama.cpp settings
  <prefix>_generation.txt  greedy chat generation (only presets with a chat prompt)

With --engine numpy (llama architecture only) it writes <prefix>_f32_logits.bin and
<prefix>_f32_meta.json instead: the same passage run through a plain NumPy forward pass with
the GGUF weights dequantized to F32, F32 activations throughout (no activation quantization,
unlike llama.cpp's CPU matmuls), and K and V rounded to BF16 after RoPE as certkv's cache
stores them. The tokens still come from llama.cpp's tokenizer.

Binary layout of <prefix>_logits.bin (all little-endian, no padding):
  offset  size               field
  0       8                  magic, the ASCII bytes "CKVLOGIT"
  8       4   u32            format version = 1
  12      4   u32            n_vocab      (length of one logit vector)
  16      4   u32            n_tokens     (length of the passage in tokens)
  20      4   u32            top_k        (pairs stored per position)
  24      4   u32            n_full       (positions stored with the whole logit vector)
  28      4*n_tokens  i32    token ids of the passage, in order
  then    n_tokens*top_k*8   per position p = 0..n_tokens-1: top_k pairs (i32 token id, f32 logit),
                             logit descending, equal logits by ascending id. Row p holds the
                             logits produced after reading tokens 0..p (predicting token p+1).
  then    4*n_full    u32    the full-vector positions, ascending
  then    n_full*n_vocab*4   f32 logits, one whole vector per full-vector position, in that order
  The file ends there; readers should check that the size matches exactly.

Usage:
  scripts/make_reference_logits.py                       # preset smollm2 (default)
  scripts/make_reference_logits.py --preset qwen2-coder-0.5b
"""

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
MAGIC = b"CKVLOGIT"
FORMAT_VERSION = 1
GGML_TYPE_F32 = 0

PRESETS = {
    "smollm2": {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "prefix": "smollm2_reference",
        "n_tokens": 1000,
        "full_positions": [0, 1, 10, 100, 250, 500, 750, 999],
        "numpy_full_positions": [0, 100, 500, 999],
        "chat_prompt": "Write one sentence about the sea.",
    },
    "qwen2-coder-0.5b": {
        "model": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "prefix": "qwen2_coder_0_5b_reference",
        "n_tokens": 200,
        "full_positions": [0, 1, 100, 199],
        "chat_prompt": None,
    },
}

# The passage: H. G. Wells, The Time Machine (an evaluation book), from the first paragraph
# boundary at or after character 10,000 (a blank line; the passage starts after it).
BOOK = "wells-time-machine.txt"
SEARCH_FROM_CHAR = 10000
TOP_K = 20
N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
GENERATION_TOKENS = 64


def fail(message):
    sys.exit(f"make_reference_logits.py: error: {message}")


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def git_commit():
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "none"


def load_model(path, logits_all):
    import llama_cpp
    return llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                           n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=logits_all,
                           type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False,
                           seed=0, verbose=False)


def add_bos_from_metadata(llm):
    value = llm.metadata.get("tokenizer.ggml.add_bos_token")
    if value is None:
        fail("model metadata has no tokenizer.ggml.add_bos_token; refusing to guess")
    return value == "true"


def passage_tokens(llm, corpus_dir, n_tokens, add_bos):
    """Returns (text, char_offset, byte_offset, tokens): text tokenizes to exactly tokens."""
    book_path = corpus_dir / BOOK
    if not book_path.is_file():
        fail(f"corpus book {book_path} not found")
    book = book_path.read_text(encoding="utf-8")
    boundary = book.find("\n\n", SEARCH_FROM_CHAR)
    if boundary < 0:
        fail(f"no paragraph boundary after character {SEARCH_FROM_CHAR} in {BOOK}")
    char_offset = boundary + 2
    window = book[char_offset:char_offset + 12 * n_tokens]
    tokens = llm.tokenize(window.encode("utf-8"), add_bos=add_bos, special=False)
    if len(tokens) < n_tokens + 1:
        fail(f"{BOOK} window from char {char_offset} gives only {len(tokens)} tokens")
    tokens = tokens[:n_tokens]
    # Cut the text at the end of the last kept token, then check that it tokenizes back to
    # exactly the kept ids, so a tokenizer test can start from the text file alone.
    content = tokens[1:] if add_bos else tokens
    text = llm.detokenize(content).decode("utf-8")
    if not window.startswith(text):
        fail("detokenized passage is not a prefix of the book text")
    again = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    if again != tokens:
        fail("passage text does not tokenize back to the same ids; pick another length")
    byte_offset = len(book[:char_offset].encode("utf-8"))
    return text, char_offset, byte_offset, tokens


def top_k_rows(logits, k):
    """Per row: (ids, values) of the k largest logits, descending, ties by ascending id."""
    n_rows = logits.shape[0]
    ids = np.empty((n_rows, k), dtype=np.int32)
    values = np.empty((n_rows, k), dtype=np.float32)
    for p in range(n_rows):
        row = logits[p]
        order = np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k]
        ids[p] = order
        values[p] = row[order]
    return ids, values


def write_golden(path, tokens, logits, full_positions, top_k):
    n_tokens, n_vocab = logits.shape
    ids, values = top_k_rows(logits, top_k)
    pairs = np.empty((n_tokens, top_k), dtype=[("id", "<i4"), ("logit", "<f4")])
    pairs["id"] = ids
    pairs["logit"] = values
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<5I", FORMAT_VERSION, n_vocab, n_tokens, top_k, len(full_positions)))
        f.write(np.asarray(tokens, dtype="<i4").tobytes())
        f.write(pairs.tobytes())
        f.write(np.asarray(full_positions, dtype="<u4").tobytes())
        f.write(np.ascontiguousarray(logits[full_positions], dtype="<f4").tobytes())


def read_golden(path):
    """Reads the file back (used here as a self-check of the writer)."""
    data = Path(path).read_bytes()
    if data[:8] != MAGIC:
        fail(f"{path}: bad magic")
    version, n_vocab, n_tokens, top_k, n_full = struct.unpack_from("<5I", data, 8)
    at = 28
    tokens = np.frombuffer(data, "<i4", n_tokens, at)
    at += 4 * n_tokens
    pairs = np.frombuffer(data, [("id", "<i4"), ("logit", "<f4")], n_tokens * top_k, at)
    at += 8 * n_tokens * top_k
    positions = np.frombuffer(data, "<u4", n_full, at)
    at += 4 * n_full
    full = np.frombuffer(data, "<f4", n_full * n_vocab, at).reshape(n_full, n_vocab)
    at += 4 * n_full * n_vocab
    if at != len(data):
        fail(f"{path}: size {len(data)} does not match header (expected {at})")
    return version, tokens, pairs.reshape(n_tokens, top_k), positions, full


def round_to_bf16(values):
    """Round-to-nearest-even to BF16, returned as F32 (NaN-free input)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def numpy_llama_logits(model_path, tokens):
    """Logits of every position from a plain F32 forward pass of a llama-architecture GGUF.

    Llama block (RMSNorm, GQA attention with RoPE on adjacent pairs as llama.cpp's
    LLAMA_ROPE_TYPE_NORM, SwiGLU FFN), weights dequantized by the gguf package, K and V
    rounded to BF16 after RoPE.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(str(model_path))

    def field(key):
        f = reader.fields[key]
        return f.parts[f.data[0]][0]

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        fail(f"--engine numpy handles the llama architecture only, {model_path} is {arch}")
    n_layers = int(field("llama.block_count"))
    dim = int(field("llama.embedding_length"))
    n_heads = int(field("llama.attention.head_count"))
    n_kv_heads = int(field("llama.attention.head_count_kv"))
    head_dim = dim // n_heads
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    theta = float(field("llama.rope.freq_base"))
    weights = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32)
               for t in reader.tensors}
    output = weights.get("output.weight", weights["token_embd.weight"])

    n = len(tokens)
    angles = np.arange(n)[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)[None, :]
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]

    def rms_norm(x, w):
        scale = 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
        return (x * scale.astype(np.float32)) * w

    def rope(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    x = weights["token_embd.weight"][np.asarray(tokens)]
    for layer in range(n_layers):
        w = lambda name: weights[f"blk.{layer}.{name}.weight"]
        h = rms_norm(x, w("attn_norm"))
        q = rope((h @ w("attn_q").T).reshape(n, n_heads, head_dim))
        k = round_to_bf16(rope((h @ w("attn_k").T).reshape(n, n_kv_heads, head_dim)))
        v = round_to_bf16((h @ w("attn_v").T).reshape(n, n_kv_heads, head_dim))
        attended = np.empty((n, n_heads, head_dim), dtype=np.float32)
        for head in range(n_heads):
            group = head // (n_heads // n_kv_heads)
            scores = q[:, head, :] @ k[:, group, :].T / np.float32(np.sqrt(head_dim)) + causal
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            attended[:, head, :] = probs @ v[:, group, :]
        x = x + attended.reshape(n, dim) @ w("attn_output").T
        h = rms_norm(x, w("ffn_norm"))
        gate = h @ w("ffn_gate").T
        x = x + ((gate / (1.0 + np.exp(-gate))) * (h @ w("ffn_up").T)) @ w("ffn_down").T
    return (rms_norm(x, weights["output_norm.weight"]) @ output.T).astype(np.float32)


def chat_prompt_text(llm, user_text):
    """Renders the GGUF's own chat template (tokenizer.chat_template) with jinja2."""
    import jinja2.sandbox
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        fail("model has no tokenizer.chat_template")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    vocab = llm.metadata

    def token_text(key):
        token_id = vocab.get(key)
        return "" if token_id is None else llm.detokenize([int(token_id)], special=True).decode()

    return env.from_string(template).render(
        messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
        bos_token=token_text("tokenizer.ggml.bos_token_id"),
        eos_token=token_text("tokenizer.ggml.eos_token_id"))


def greedy_generation(llm, prompt, add_bos, n_new):
    """Argmax decoding, stopping at an end-of-generation token or after n_new tokens."""
    import llama_cpp
    prompt_tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
    llm.reset()
    llm.eval(prompt_tokens)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    generated = []
    stopped_at_eog = False
    for _ in range(n_new):
        next_id = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if llama_cpp.llama_vocab_is_eog(vocab, next_id):
            stopped_at_eog = True
            generated.append(next_id)
            break
        generated.append(next_id)
        llm.eval([next_id])
    return prompt_tokens, generated, stopped_at_eog


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--engine", choices=["llama.cpp", "numpy"], default="llama.cpp",
                        help="numpy: exact-F32 reference described at the top of this file")
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--corpus-dir", type=Path,
                        default=REPO_ROOT.parent / "shared" / "data" / "corpus")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "tests" / "golden")
    args = parser.parse_args()
    preset = PRESETS[args.preset]

    try:
        import llama_cpp
    except ImportError:
        fail("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    model_path = args.models_dir / preset["model"]
    if not model_path.is_file():
        fail(f"{model_path} not found; run scripts/fetch_models.sh"
             + (" --all" if args.preset != "smollm2" else ""))

    llm = load_model(model_path, logits_all=True)
    add_bos = add_bos_from_metadata(llm)
    n_tokens = preset["n_tokens"]
    text, char_offset, byte_offset, tokens = passage_tokens(llm, args.corpus_dir, n_tokens, add_bos)
    if args.engine == "numpy":
        if "numpy_full_positions" not in preset:
            fail(f"preset {args.preset} has no numpy reference")
        logits = numpy_llama_logits(model_path, tokens)
        full_positions = preset["numpy_full_positions"]
        prefix = args.out_dir / (preset["prefix"] + "_f32")
    else:
        llm.reset()
        llm.eval(tokens)
        logits = np.array(llm.scores[:n_tokens], dtype=np.float32)
        full_positions = preset["full_positions"]
        prefix = args.out_dir / preset["prefix"]
    if not np.all(np.isfinite(logits)) or np.all(logits == 0):
        fail(f"{args.engine} produced non-finite or all-zero logits")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    golden_path = Path(f"{prefix}_logits.bin")
    write_golden(golden_path, tokens, logits, full_positions, TOP_K)
    _, tokens_back, pairs_back, positions_back, full_back = read_golden(golden_path)
    assert list(tokens_back) == tokens and list(positions_back) == full_positions
    assert np.array_equal(full_back, logits[full_positions])
    assert np.array_equal(pairs_back["logit"][:, 0], logits.max(axis=1))
    if args.engine == "llama.cpp":
        Path(f"{prefix}_passage.txt").write_bytes(text.encode("utf-8"))

    meta = {
        "model_file": preset["model"],
        "model_sha256": sha256_file(model_path),
        "engine": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp built from source, CPU)",
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH,
                     "n_ubatch": N_BATCH, "logits_all": True, "kv_cache_type": "f32",
                     "flash_attn": False},
        "tokens_from": "llama.cpp tokenizer",
        "book": BOOK,
        "passage_char_offset": char_offset,
        "passage_byte_offset": byte_offset,
        "passage_chars": len(text),
        "passage_bytes": len(text.encode("utf-8")),
        "add_bos": add_bos,
        "n_tokens": n_tokens,
        "n_vocab": int(logits.shape[1]),
        "top_k": TOP_K,
        "full_positions": full_positions,
        "argmax_first_8_positions": [int(i) for i in logits[:8].argmax(axis=1)],
        "repo_commit": git_commit(),
    }

    if args.engine == "numpy":
        meta["engine"] = (f"numpy {np.__version__} F32 forward, weights dequantized, "
                          "K/V rounded to BF16")
        meta["settings"] = {"activations": "f32",
                            "kv": "bf16 (round to nearest even, K after RoPE)"}
        meta["passage_file"] = preset["prefix"] + "_passage.txt"
    elif preset["chat_prompt"]:
        llm_gen = load_model(model_path, logits_all=True)
        prompt = chat_prompt_text(llm_gen, preset["chat_prompt"])
        prompt_tokens, generated, stopped = greedy_generation(llm_gen, prompt, add_bos,
                                                              GENERATION_TOKENS)
        reply = llm_gen.detokenize(generated, special=True).decode("utf-8", "replace")
        lines = [
            "# llama.cpp greedy generation (argmax, up to 64 new tokens, stop at "
            "end-of-generation)",
            f"# model: {preset['model']}  engine: {meta['engine']}",
            f"# user message: {preset['chat_prompt']}",
            f"# prompt tokens ({len(prompt_tokens)}): {' '.join(map(str, prompt_tokens))}",
            f"# generated tokens ({len(generated)}, stopped at end-of-generation: {stopped}): "
            + " ".join(map(str, generated)),
            "# --- prompt (chat template of the GGUF, rendered) ---",
            prompt.rstrip("\n"),
            "# --- reply ---",
            reply,
        ]
        Path(f"{prefix}_generation.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        meta["generation"] = {"prompt_tokens": prompt_tokens, "generated_tokens": generated,
                              "stopped_at_eog": stopped}

    Path(f"{prefix}_meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    for suffix in ("_logits.bin", "_passage.txt", "_meta.json", "_generation.txt"):
        path = Path(f"{prefix}{suffix}")
        if path.exists():
            print(f"wrote {path.relative_to(REPO_ROOT)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
