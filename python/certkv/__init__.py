"""certkv: long-context LLM inference with a compressed, certified KV cache.

Python bindings of certkv's C API (include/certkv/certkv.h; docs/python.md):

- :class:`Model` loads a GGUF file or a Hugging Face folder (the embedded default,
  SmolLM2-135M-Instruct, when no path is given);
- :class:`Session` runs one sequence with its own KV cache: ``generate`` returns the text and
  the certificate of its attention, ``stream`` yields the text piece by piece, ``prefill`` and
  ``decode`` give logits;
- :class:`Engine` serves many requests over one page pool (continuous batching, prefix sharing,
  preemption); each request's certificate is its own;
- :mod:`certkv.codec` (GAAC on NumPy arrays), :mod:`certkv.meter` (Tier A / Tier B bounds),
  :mod:`certkv.index` (RaBitQ records, estimates, Top-p selection) and :mod:`certkv.kvdump`
  (KV dumps and safetensors files).

    import certkv
    session = certkv.Session(kv="dither8", gate=True)
    result = session.generate("Write one sentence about the sea.", max_tokens=32)
    print(result.text, result.certificate["meter_max"])
"""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from . import _certkv
from ._errors import (CertkvError, CorruptError, InvalidArgumentError, NotFoundError,
                      OutOfRangeError, UnsupportedError)
from . import _certificate, codec, index, kvdump, meter
from .kv_store import KvStore, _int, sparse_options

__all__ = ["Model", "Session", "Engine", "KvStore", "GenerateResult", "TokenLogprob", "kv_schemes", "default_model_path",
           "__version__", "CertkvError", "InvalidArgumentError", "NotFoundError", "CorruptError",
           "UnsupportedError", "OutOfRangeError", "codec", "index", "kvdump", "meter"]

__version__: str = _certkv.version()


def kv_schemes() -> list[dict[str, Any]]:
    """The KV storage schemes (``kv=``): name, summary, meter_tier ("none", "A", "B"), lossless,
    lossy, needs_calibration, cuda_route, batch_invariant, default_window_tokens."""
    return _certkv.kv_schemes()


def default_model_path() -> str:
    """$CERTKV_MODEL, else the embedded default model that scripts/fetch_models.sh puts in the
    checkout's models/ (SmolLM2-135M-Instruct.Q4_1.gguf)."""
    return os.environ.get("CERTKV_MODEL") or _certkv.default_model_path()


class Model:
    """A loaded model (read-only; sessions and engines share it)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 tokenizer: str | os.PathLike[str] | None = None) -> None:
        """Loads a GGUF file or a Hugging Face folder; None: :func:`default_model_path`. With
        tokenizer (a tokenizer.bin), path is a llama2.c checkpoint (no chat template: prompt with
        chat=False). A missing file raises :class:`NotFoundError` naming it."""
        self.path = os.fspath(path) if path is not None else default_model_path()
        self.tokenizer = os.fspath(tokenizer) if tokenizer is not None else None
        self._model = _certkv.Model(self.path, self.tokenizer)
        self.info: dict[str, Any] = self._model.info()
        """architecture, name, rope_layout, weight_type, n_layers, dim, n_heads, n_kv_heads,
        head_dim, ffn_dim, n_vocab, context_length, rope_theta, weight_bytes."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of text; add_special adds BOS where the model asks for it; parse_special
        reads control-token text ("<|im_start|>") as those tokens."""
        return self._model.tokenize(_text("text", text), add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], *, render_special: bool = False) -> str:
        """The text tokenize read from (a SentencePiece model's prepended space dropped); control
        tokens ("<|im_end|>") give their text only with render_special. Bytes that are not valid
        UTF-8 are replaced; an id outside the vocabulary raises InvalidArgumentError naming it."""
        return self._model.detokenize([int(t) for t in tokens], bool(render_special)).decode("utf-8", errors="replace")

    def is_end(self, token: int) -> bool:
        """Whether token ends a generation (end of sequence or of turn)."""
        return self._model.is_end(int(token))

    def chat_prompt(self, prompt: str, *, system: str | None = None) -> str:
        """prompt as a user turn in the model's chat template, ready for the assistant's reply."""
        messages = ([("system", _c_text("system", system))] if system is not None else []) + \
            [("user", _c_text("prompt", prompt))]
        return self._model.chat(messages, True)

    def chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """A conversation of several turns in the model's chat template: messages as OpenAI's chat
        API takes them, dicts of role ("system", "user" or "assistant") and content; with
        add_generation_prompt the text ends where the assistant's next reply begins."""
        return self._model.chat(_chat_messages(messages), bool(add_generation_prompt))

    def _prompt_tokens(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]], chat: bool,
                       system: str | None) -> list[int]:
        # Chats are tokenized with the template's turn markers parsed and the messages' text as
        # text (certkv_tokenize_chat): a message cannot open a turn of its own.
        if isinstance(prompt, str):
            if chat:
                messages = ([("system", _c_text("system", system))] if system is not None else []) + \
                    [("user", _c_text("prompt", prompt))]
                tokens = self._model.chat_tokens(messages, True)
            else:
                tokens = self.tokenize(prompt, add_special=True, parse_special=False)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            if not chat or system is not None:
                raise ValueError("prompt: a list of messages is a chat (chat=True; put the system message in the list)")
            tokens = self._model.chat_tokens(_chat_messages(prompt), True)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            tokens = list(prompt)
        else:
            raise TypeError(f"prompt: expected a str, a list of chat messages or a sequence of token ids, got "
                            f"{type(prompt).__name__}")
        if not tokens:
            raise ValueError("prompt: it has no tokens")
        return tokens


@dataclass
class GenerateResult:
    """One generation: its text and the certificate of its attention."""

    text: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  #: "length", "end", "stop" (Engine), "cancelled", "error"
    certificate: dict[str, Any]
    """scheme, metered, and for a metered (lossy) scheme tier, tau, coverage (the fraction of
    (layer, head, step) cells with meter <= tau), meter_max, meter_p99, cells, gate_repairs; for
    every scheme kv_bytes_by_class (bytes of the KV pages per storage class)."""
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    """Engine requests with logprobs: one per generated token (None when not asked for)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """Engine requests with prompt_logprobs: one per prompt token after the first (None when not
    asked for)."""


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's distribution at its position (the log-softmax
    of the raw logits, before the sampler's temperature and truncation), and the most likely
    tokens' (most likely first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


_CHAT_ROLES = ("system", "user", "assistant")


def _chat_messages(messages: Any) -> list[tuple[str, str]]:
    """OpenAI-style messages as (role, content) pairs, checked."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError(f"messages: expected a non-empty list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}")
    pairs = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with role and content, got {m!r}")
        if m["role"] not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}]: role {m['role']!r} is not one of {', '.join(_CHAT_ROLES)}")
        pairs.append((m["role"], _c_text(f"messages[{i}].content", m["content"])))
    return pairs


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    return value


def _c_text(name: str, value: Any) -> str:
    """A str the C API takes NUL-terminated (chat messages, stop strings): a NUL would cut it."""
    text = _text(name, value)
    if "\0" in text:
        raise ValueError(f"{name}: contains a NUL character (U+0000), where the text would be cut")
    return text


def _session_options(kv: str, sparse: float | Mapping[str, Any] | None, gate: bool,
                     tau: float | None, delta: float | None, meter: bool, window: int | None,
                     outlier_pairs: int | None, witness: str | None, gaac_calibration: str | None,
                     threads: int | None, context_tokens: int | None, block_tokens: int | None,
                     activations: str | None, device: str) -> dict[str, Any]:
    """The certkv_session_params of the keyword arguments, checked against the scheme table."""
    schemes = {s["name"]: s for s in kv_schemes()}
    kv = _text("kv", kv)
    if kv not in schemes:
        raise ValueError(f"kv: unknown KV scheme {kv!r} (available: {', '.join(schemes)})")
    if not isinstance(device, str) or device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    lossy = schemes[kv]["lossy"]
    for name, value in (("gate", gate or None), ("tau", tau), ("delta", delta), ("window", window)):
        if value is not None and not lossy:
            raise ValueError(f"{name}: applies to lossy schemes (the meter) only, not kv={kv!r}")
    options: dict[str, Any] = {"kv": kv, "gate": bool(gate), "meter": bool(meter), "meter_tau": tau,
                               "meter_delta": delta, "recent_window_tokens": window,
                               "outlier_pairs": outlier_pairs, "witness": witness,
                               "gaac_calibration": os.fspath(gaac_calibration) if gaac_calibration else None,
                               "n_threads": threads, "context_tokens": context_tokens,
                               "block_tokens": block_tokens, "activations": activations, "device": device}
    options.update(sparse_options(sparse))
    return options


def _model_of(model: Model | str | os.PathLike[str] | None) -> Model:
    return model if isinstance(model, Model) else Model(model)


_OPTIONS_DOC = """
        kv: the KV storage scheme (:func:`kv_schemes`): "bf16", "gaac" (lossless), "fp8-e4m3",
            "dither8", ... (lossy, with the meter).
        sparse: sparse decode: p in (0, 1], or a dict with p and any of deviations, window,
            dense_layers, rotation ("haar" or "hadamard").
        gate: repair from the exact backing store where a meter exceeds tau (lossy schemes).
        tau, delta: the coverage / gate threshold (default 0.2) and the Tier B failure budget
            (default 1e-2) of lossy schemes; meter=False turns the meter off.
        window: lossy schemes: newest tokens kept bf16; outlier_pairs: dither8's exact RoPE
            pairs; witness: "fp16", "u8" (Tier A schemes) or "exponent" (fp8-e4m3: no witness
            bytes); gaac_calibration: a calibration
            file (GAAC schemes calibrate themselves without one).
        threads, context_tokens, block_tokens, activations ("int8" or "f32"): as
            certkv_session_params.
        device: "cpu", or "cuda" (a build with the CUDA backend and a device): a Session's
            decode attention and KV pages go to the device (the forward pass stays on the CPU);
            an Engine runs its CUDA backend, the whole forward pass and the page pool on the
            device. Schemes of the table's cuda_route; no gate on an Engine's device."""


class Session:
    """One sequence with its own paged KV cache. Not thread-safe: one thread at a time."""

    def __init__(self, model: Model | str | os.PathLike[str] | None = None, *, kv: str = "bf16",
                 sparse: float | Mapping[str, Any] | None = None, gate: bool = False,
                 tau: float | None = None, delta: float | None = None, meter: bool = True,
                 window: int | None = None, outlier_pairs: int | None = None,
                 witness: str | None = None, gaac_calibration: str | None = None,
                 threads: int | None = None, context_tokens: int | None = 4096,
                 block_tokens: int | None = None, activations: str | None = None,
                 device: str = "cpu") -> None:
        self.model = _model_of(model)
        self.kv = kv
        self._context = context_tokens or self.model.info["context_length"]
        self._sparse_rules = 0  # Top-p rules added to the sparse audit
        self._session = _certkv.Session(self.model._model, _session_options(
            kv, sparse, gate, tau, delta, meter, window, outlier_pairs, witness, gaac_calibration,
            threads, context_tokens, block_tokens, activations, device))

    __init__.__doc__ = """model: a Model, a path, or None (the default model).""" + _OPTIONS_DOC

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, *, chat: bool = True,
                 system: str | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_at_end: bool = True) -> GenerateResult:
        """Generates from a fresh sequence (the session is reset first). prompt: text (in the
        chat template unless chat=False), a conversation (a list of {"role", "content"} dicts, in
        the chat template: Model.chat_template), or token ids. Greedy unless temperature >= 1e-6."""
        tokens = self._start(prompt, max_tokens, chat, system)
        pieces, r = self._session.generate(tokens, max_tokens, stop_at_end, float(temperature),
                                           int(top_k), float(top_p), int(seed))
        text = b"".join(pieces).decode("utf-8", errors="replace")
        # certkv_generate stops at max_tokens, at the context's end, or at an end token.
        full = r["generated_tokens"] >= max_tokens or self._session.n_past() >= self._context
        finish = "length" if full else "end"
        timings = {k: r[k] for k in ("prefill_seconds", "decode_seconds")}
        return GenerateResult(text, r["prompt_tokens"], r["generated_tokens"], finish, self.certificate(), timings)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, *, chat: bool = True,
               system: str | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_at_end: bool = True) -> Iterator[str]:
        """As :meth:`generate`, yielding the text as it comes (whole UTF-8 characters); the same
        tokens as generate for the same arguments. :meth:`certificate` afterwards."""
        tokens = self._start(prompt, max_tokens, chat, system)
        sampler = _certkv.Sampler(float(temperature), int(top_k), float(top_p), int(seed))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        logits = self._session.prefill(tokens)
        # The loop of certkv_generate: the first token from the prefill's logits.
        for i in range(max_tokens):
            token = sampler.sample(logits)
            end = stop_at_end and self.model.is_end(token)
            if not end:
                piece = decoder.decode(self.model._model.piece(token))
                if piece:
                    yield piece
            if end or i + 1 == max_tokens or self._session.n_past() >= self._context:
                break
            logits = self._session.decode(token)
        rest = decoder.decode(b"", final=True)
        if rest:
            yield rest

    def prefill(self, tokens: Sequence[int]) -> Any:
        """Appends tokens to the sequence; returns the last token's logits, [n_vocab] float32."""
        return self._session.prefill([int(t) for t in tokens])

    def decode(self, token: int) -> Any:
        """Appends one token; returns its logits, [n_vocab] float32."""
        return self._session.decode(int(token))

    def reset(self) -> None:
        """Empties the sequence and its meter and sparse counters."""
        self._session.reset()

    @property
    def n_past(self) -> int:
        """Tokens in the sequence."""
        return self._session.n_past()

    def certificate(self) -> dict[str, Any]:
        """The certificate of the sequence's decode steps so far (see GenerateResult)."""
        cert = _certificate.certificate(self.kv, self._session.meter_stats(), self._session.kv_stats())
        sparse = self._session.sparse_stats()
        if sparse["sparse"]:
            cert["sparse"] = sparse
        return cert

    def audit(self, *, dump_cells: int = 0, seed: int = 0) -> None:
        """Audits the meter from here on: each metered decode step also computes the true total
        variation between attention over the exact keys (the backing store) and over the pages,
        per (layer, query head), and checks meter >= TV (:meth:`audit_stats`). A lossy scheme with
        the meter on, on device "cpu"; dump_cells > 0 keeps that many sampled cells (and those of
        the largest TV and meter) for :meth:`audit_dump`. Raises InvalidArgumentError otherwise."""
        self._session.audit_enable(_int("dump_cells", dump_cells, 0), _int("seed", seed, 0))

    def audit_stats(self) -> dict[str, Any]:
        """cells, violations (meter < TV), coverage at tau, max_meter, max_tv, the quantiles of
        meter / TV (tightness_q01 ... q99), worst_margin (max TV - meter: negative when sound), and
        layers: per layer cells, violations, coverage."""
        return self._session.audit_stats()

    def audit_dump(self, path: str | os.PathLike[str]) -> None:
        """Writes the kept cells to a safetensors file (query, exact and stored keys, scale, meter)."""
        self._session.audit_dump(os.fspath(path))

    def sparse_audit(self, *, rules: Sequence[float | tuple[float, float]] = (), dump_cells: int = 0,
                     seed: int = 0) -> None:
        """Audits sparse decode from here on (a session made with sparse=..., on device "cpu"):
        each sparse (layer, head, step) also computes exact attention over every token, giving the
        recall of the attended set, the estimator's error, and fixed top-k and Quest baselines at
        the same budget. rules: more Top-p rules audited on the same cells, each p or (p,
        deviations). Call before the first decode step; see :meth:`sparse_audit_stats`."""
        pairs = []
        for i, rule in enumerate(rules):
            if isinstance(rule, (int, float)) and not isinstance(rule, bool):
                rule = (rule, 0.0)
            if not (isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(x, (int, float)) for x in rule)):
                raise TypeError(f"rules[{i}]: expected p or (p, deviations), got {rule!r}")
            pairs.append((float(rule[0]), float(rule[1])))
        self._session.sparse_audit_enable(_int("dump_cells", dump_cells, 0), _int("seed", seed, 0), pairs)
        self._sparse_rules = len(pairs)

    def sparse_audit_stats(self) -> dict[str, Any]:
        """cells, mean_budget, mean_recall, recall quantiles, the estimator's error, the baselines
        (topk_estimated_*, topk_oracle_*, quest_*), layers (per layer cells, mean_budget,
        mean_recall, min_recall) and rules (per added rule cells, mean_budget, mean_recall,
        recall_q10)."""
        return self._session.sparse_audit_stats(self._sparse_rules)

    def sparse_audit_dump(self, path: str | os.PathLike[str]) -> None:
        """Writes the kept cells to a safetensors file (query, exact keys, the attended tokens)."""
        self._session.sparse_audit_dump(os.fspath(path))

    def device_stats(self) -> dict[str, Any]:
        """What ran on the CUDA device (device="cuda"): on_device, attention_calls and seconds, the
        KV pages there by kind and their bytes; on_device False on the CPU."""
        return self._session.device_stats()

    def _start(self, prompt: str | Sequence[int], max_tokens: int, chat: bool, system: str | None) -> list[int]:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}")
        tokens = self.model._prompt_tokens(prompt, chat, system)
        self._session.reset()
        return tokens


class Engine:
    """Many requests over one page pool: continuous batching, chunked prefill, prefix sharing,
    preemption. Each request's logits, and so its greedy text, are those it would get alone.
    Not thread-safe: one thread at a time."""

    def __init__(self, model: Model | str | os.PathLike[str] | None = None, *, kv: str = "bf16",
                 sparse: float | Mapping[str, Any] | None = None, gate: bool = False,
                 tau: float | None = None, delta: float | None = None, meter: bool = True,
                 window: int | None = None, outlier_pairs: int | None = None,
                 witness: str | None = None, gaac_calibration: str | None = None,
                 threads: int | None = None, context_tokens: int | None = 2048,
                 block_tokens: int | None = None, activations: str | None = None,
                 max_sequences: int = 4, step_tokens: int = 512, pool_bytes: int = 0,
                 prefix_sharing: bool = True, device: str = "cpu") -> None:
        self.model = _model_of(model)
        self.kv = kv
        self._tier = {s["name"]: s["meter_tier"] for s in kv_schemes()}.get(kv)
        self._tau = _certkv.default_meter_tau() if tau is None else float(tau)
        self._engine = _certkv.Engine(self.model._model, _session_options(
            kv, sparse, gate, tau, delta, meter, window, outlier_pairs, witness, gaac_calibration,
            threads, context_tokens, block_tokens, activations, device), int(max_sequences), int(step_tokens),
            int(pool_bytes), bool(prefix_sharing))
        self._pieces: dict[int, list[bytes]] = {}
        self._logprobs_asked: dict[int, tuple[bool, bool]] = {}  # (generated, prompt)
        self.last_result: GenerateResult | None = None
        """The result of the last :meth:`stream`, once it ended (finished or cancelled)."""

    __init__.__doc__ = """model: a Model, a path, or None (the default model). context_tokens: the
        most tokens of one request; max_sequences: requests running at once; step_tokens: the
        most tokens one step runs; pool_bytes: the KV pool (0: room for max_sequences
        contexts); prefix_sharing: share whole prompt blocks between requests.""" + _OPTIONS_DOC

    def submit(self, prompt: str | Sequence[int], max_tokens: int = 64, *, chat: bool = True,
               system: str | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (),
               ignore_end: bool = False, logprobs: int | None = None, prompt_logprobs: bool = False) -> int:
        """Queues a request; returns its id (see :meth:`run`, :meth:`result`). logprobs: the
        result carries each generated token's log-probability with this many alternatives (0 to
        20); prompt_logprobs: the prompt's tokens' too (its prompt is then computed whole)."""
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= 20):
            raise ValueError(f"logprobs: expected None or an integer in [0, 20], got {logprobs!r}")
        stop_list = [_c_text("stop", s) for s in ([stop] if isinstance(stop, str) else stop)]
        tokens = self.model._prompt_tokens(prompt, chat, system)
        request = self._engine.submit(tokens, max_tokens, float(temperature), int(top_k), float(top_p),
                                      int(seed), stop_list, bool(ignore_end), -1 if logprobs is None else logprobs,
                                      bool(prompt_logprobs))
        self._pieces[request] = []
        self._logprobs_asked[request] = (logprobs is not None, bool(prompt_logprobs))
        return request

    def step(self) -> bool:
        """Runs one batched step; True while requests remain."""
        pieces, active = self._engine.step()
        for request, text in pieces:
            self._pieces.setdefault(request, []).append(text)
        return active

    def run(self) -> None:
        """Steps until no request remains."""
        while self.step():
            pass

    def result(self, request: int, *, release: bool = True) -> GenerateResult:
        """A finished request's result (release: forget it afterwards)."""
        r = self._engine.result(int(request))
        if not r["finished"]:
            raise ValueError(f"request {request} has not finished (call run() or step())")
        cert: dict[str, Any] = {"scheme": self.kv, "metered": r["metered"]}
        if r["metered"]:
            cert.update(tier=self._tier, tau=self._tau, coverage=r["coverage"], meter_max=r["meter_max"], meter_p99=r["meter_p99"],
                        cells=r["meter_cells"], gate_repairs=r["gate_repairs"])
        cert["kv_bytes_by_class"] = r["kv_bytes"]
        if r["sparse_budget"] < 1:
            cert.update(sparse_budget=r["sparse_budget"], sparse_estimated_mass=r["sparse_estimated_mass"])
        if r["error"]:
            cert["error"] = r["error"]
        timings = {"ttft_ms": r["ttft_ms"], "itl_ms_mean": r["itl_ms_mean"]}
        result = GenerateResult(r["text"].decode("utf-8", errors="replace"), r["prompt_tokens"],
                                r["generated_tokens"], r["finish_reason"], cert, timings)
        asked = self._logprobs_asked.get(int(request), (False, False))
        for prompt in (False, True):
            if not asked[prompt]:
                continue
            values = [TokenLogprob(t, lp, list(top)) for t, lp, top in self._engine.logprobs(int(request), prompt)]
            if prompt:
                result.prompt_logprobs = values
            else:
                result.logprobs = values
        if release:
            self._engine.release(int(request))
            self._pieces.pop(int(request), None)
            self._logprobs_asked.pop(int(request), None)
        return result

    def generate(self, prompt: str | Sequence[int] | Sequence[str], max_tokens: int = 64,
                 **kwargs: Any) -> Any:
        """One prompt: its GenerateResult; a list of prompts (str): a list of results, run
        together. kwargs: as :meth:`submit`."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            ids = [self.submit(p, max_tokens, **kwargs) for p in prompt]
            self.run()
            return [self.result(i) for i in ids]
        request = self.submit(prompt, max_tokens, **kwargs)
        self.run()
        return self.result(request)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 64, **kwargs: Any) -> Iterator[str]:
        """Submits a request and yields its text as the steps complete it (whole UTF-8
        characters; held back while a stop string may be starting). Other queued requests run
        alongside. Abandoning the iterator cancels the request."""
        request = self.submit(prompt, max_tokens, **kwargs)
        finished = False
        try:
            while True:
                active = self.step()
                for piece in self._pieces.get(request, []):
                    yield piece.decode("utf-8", errors="replace")
                self._pieces[request] = []
                if self._engine.result(request)["finished"] or not active:
                    finished = True
                    break
        finally:
            if not finished:
                self._engine.cancel(request)
            self.last_result = self.result(request)
