"""certkv's paged KV cache without a model: keep K and V rows that you compute (a PyTorch model's,
say) in the pages of a KV scheme, read them back, and run certkv's decode attention over them
with the meter (the C API's certkv_kv_store_*).

    store = certkv.KvStore("dither8", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                           rope_layout="half-split")
    store.append(0, layer, k, v)           # [n_kv_heads, n_tokens, head_dim] bf16 bits or float
    out, meters = store.attend(0, layer, q)  # q [n_heads, head_dim] at the last position
    assert (meters["meter"] >= 0).all()
    print(store.certificate())

A store holds ``n_sequences`` sequences (a batch's rows), each layer of each appended on its own.
Complete blocks of ``block_tokens`` rows are encoded once (fill-then-finalize); GAAC schemes
without ``gaac_calibration`` calibrate each layer on its first append.

``gate=True`` (lossy schemes, cpu stores) repairs a decode step whose meter exceeds ``meter_tau``
on some head: the lossy blocks with the largest share of its bound are replaced, in that
sequence's tables only, by their exact values from the backing store, and the step is attended
again; ``attend`` returns the repaired step's output and meters, and ``certificate()`` counts the
pages repaired (``gate_repairs``) while its coverage is the steps' before repair.

``sparse=0.9`` (or a dict with p, deviations, window, dense_layers, rotation) decodes the layers
past ``dense_layers`` sparsely: each (layer, sequence) keeps a RaBitQ key index of its keys, and a
decode step attends the fewest indexed tokens holding estimated attention mass p plus the tokens
not indexed (the newest ``window``). ``sparse_stats()`` gives the budget attended. A cuda store
serves it over bf16 pages, its indexes built on the device.

A store of ``device="cuda"`` keeps its pages in the memory of the CUDA device current at its
creation and takes device memory instead of NumPy arrays: ``append_device``, ``attend_device`` and
``note_queries_device`` take device pointers (ints, as torch's ``data_ptr()`` or CuPy's
``data.ptr`` give them) and enqueue their work on ``cuda_stream``; ``append`` and ``attend``
refuse it (certkv.UnsupportedError), as the ``_device`` methods refuse a cpu store
(certkv.InvalidArgumentError).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from . import _arrays
from . import _certificate
from . import _certkv

__all__ = ["KvStore", "METER_DTYPE"]

#: The meter of each query head of a decode step (certkv_head_meter): meter >= the total
#: variation between attention over the stored and over the exact keys; output_bound >= the
#: norm of the attention output's error.
METER_DTYPE = np.dtype([("meter", np.float64), ("log_a", np.float64), ("value_rho", np.float64),
                        ("v_norm_max", np.float64), ("output_bound", np.float64)])

_ROPE_LAYOUTS = ("interleaved", "half-split")
_DEVICES = ("cpu", "cuda")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _ints(name: str, values: Any, minimum: int) -> list[int]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    ints = [_int(f"{name}[{i}]", value, minimum) for i, value in enumerate(values)]
    if not ints:
        raise ValueError(f"{name}: expected at least one entry")
    return ints


def sparse_options(sparse: float | Mapping[str, Any] | None) -> dict[str, Any]:
    """The sparse_* parameters of a ``sparse=`` argument (a session's or a store's): None for dense
    decode, p in (0, 1], or a dict with p and any of deviations, window, dense_layers, rotation."""
    if sparse is None:
        return {}
    spec = {"p": sparse} if isinstance(sparse, (int, float)) and not isinstance(sparse, bool) else sparse
    known = {"p", "deviations", "window", "dense_layers", "rotation"}
    if not isinstance(spec, Mapping) or set(spec) - known or "p" not in spec:
        raise ValueError(f"sparse: expected p in (0, 1] or a dict with p and any of deviations, window, "
                         f"dense_layers, rotation; got {sparse!r}")
    return {"sparse_p": float(spec["p"]), "sparse_deviations": spec.get("deviations"),
            "sparse_window": spec.get("window"), "sparse_dense_layers": spec.get("dense_layers"),
            "sparse_rotation": spec.get("rotation")}


class KvStore:
    """Paged, compressed K and V of ``n_sequences`` sequences of a model's ``n_layers`` layers."""

    def __init__(self, kv: str = "bf16", *, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, block_tokens: int = 16, n_sequences: int = 1,
                 max_tokens: int | None = None, rope_layout: str = "interleaved",
                 sm_scale: float | None = None, outlier_pairs: int | None = None,
                 recent_window_tokens: int | None = None, witness: str | None = None,
                 gaac_calibration: str | os.PathLike[str] | None = None,
                 meter_delta: float | None = None, meter_tau: float | None = None,
                 meter_planned_steps: int | None = None, n_threads: int = 1, device: str = "cpu",
                 cuda_stream: int | None = None, gate: bool = False,
                 sparse: float | Mapping[str, Any] | None = None) -> None:
        if not isinstance(kv, str):
            raise TypeError(f"kv: expected a scheme name (str), got {type(kv).__name__}")
        if rope_layout not in _ROPE_LAYOUTS:
            raise ValueError(f"rope_layout: expected one of {', '.join(_ROPE_LAYOUTS)}, got {rope_layout!r}")
        if not isinstance(device, str) or device not in _DEVICES:
            raise ValueError(f"device: expected one of {', '.join(_DEVICES)} (a cuda store takes the CUDA device "
                             f"current at its creation), got {device!r}")
        if not isinstance(gate, bool):
            raise TypeError(f"gate: expected a bool, got {type(gate).__name__}")
        if cuda_stream is not None:
            if device != "cuda":
                raise ValueError(f"cuda_stream: only with device 'cuda', not {device!r}")
            cuda_stream = _int("cuda_stream", cuda_stream, 0)
        self.kv = kv
        self.device = device
        self.cuda_stream = cuda_stream
        self.n_layers = _int("n_layers", n_layers, 1)
        self.n_heads = _int("n_heads", n_heads, 1)
        self.n_kv_heads = _int("n_kv_heads", n_kv_heads, 1)
        self.head_dim = _int("head_dim", head_dim, 1)
        self.n_sequences = _int("n_sequences", n_sequences, 1)
        options = {
            "kv": kv, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "block_tokens": _int("block_tokens", block_tokens, 1),
            "n_sequences": self.n_sequences, "rope_layout": rope_layout, "n_threads": _int("n_threads", n_threads, 1),
            "max_tokens": None if max_tokens is None else _int("max_tokens", max_tokens, 1),
            "sm_scale": None if sm_scale is None else float(sm_scale),
            "outlier_pairs": outlier_pairs, "recent_window_tokens": recent_window_tokens, "witness": witness,
            "gaac_calibration": None if gaac_calibration is None else os.fspath(gaac_calibration),
            "meter_delta": meter_delta, "meter_tau": meter_tau, "meter_planned_steps": meter_planned_steps,
            "device": device, "cuda_stream": cuda_stream, "gate": gate, **sparse_options(sparse),
        }
        self._store = _certkv.KvStore(options)
        self.planned_sequences = 0  # rows of each planned step's k, v and q (plan_device)

    # -- rows ---------------------------------------------------------------------------------

    def _rows(self, name: str, value: Any) -> np.ndarray:
        array = _arrays.require_array(name, value)
        _arrays.require_ndim(name, array, 3, "[n_kv_heads, n_tokens, head_dim]")
        if array.shape[0] != self.n_kv_heads or array.shape[2] != self.head_dim or array.shape[1] < 1:
            raise ValueError(f"{name}: expected shape [{self.n_kv_heads}, n_tokens >= 1, {self.head_dim}] "
                             f"([n_kv_heads, n_tokens, head_dim]), got {array.shape}")
        _arrays.require_contiguous(name, array)
        if array.dtype.name == "bfloat16":
            return array.view(np.uint16)
        if array.dtype == np.int16:  # torch.bfloat16 viewed as int16
            return array.view(np.uint16)
        if array.dtype == np.uint16:
            return array
        if array.dtype.kind == "f":
            return np.ascontiguousarray(array, dtype=np.float32)
        raise TypeError(f"{name}: expected bf16 bit patterns (uint16 or int16, or ml_dtypes.bfloat16) or "
                        f"floating-point values, got {array.dtype}")

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """Appends n_tokens rows of K and V to (seq, layer). k, v: [n_kv_heads, n_tokens,
        head_dim], bf16 bit patterns (uint16, int16, ml_dtypes.bfloat16) or floats (rounded to
        bf16, nearest even), both of one kind."""
        k = self._rows("k", k)
        v = self._rows("v", v)
        if k.shape != v.shape:
            raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
        if k.dtype != v.dtype:
            raise TypeError(f"v: expected the kind of k ({'bf16 bits' if k.dtype == np.uint16 else 'float'}), "
                            f"got {v.dtype}")
        if k.dtype == np.uint16:
            self._store.append_bf16(int(seq), int(layer), k, v, k.shape[1])
        else:
            self._store.append_f32(int(seq), int(layer), k, v, k.shape[1])

    def length(self, seq: int = 0, layer: int = 0) -> int:
        """Positions stored in (seq, layer)."""
        return self._store.length(int(seq), int(layer))

    def read(self, seq: int, layer: int, kv: str = "k", begin: int = 0, end: int | None = None, *,
             exact: bool = False) -> np.ndarray:
        """K or V of (seq, layer) at positions [begin, end) as float32 [n_kv_heads, n, head_dim]:
        what attention reads (a lossy page's reconstruction), or with exact=True the exact values
        (a lossy page's from the backing store). A cuda store decodes its pages on the host (it
        waits for its stream) and refuses exact=True for a lossy scheme (certkv.UnsupportedError)."""
        if kv not in ("k", "v"):
            raise ValueError(f"kv: expected 'k' or 'v', got {kv!r}")
        if end is None:
            end = self.length(seq, layer)
        return self._store.read(int(seq), int(layer), 0 if kv == "k" else 1, int(begin), int(end), bool(exact))

    # -- attention ----------------------------------------------------------------------------

    def attend(self, seq: int, layer: int, q: Any, *, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Attention over (seq, layer)'s pages. q: [n_heads, head_dim], the query of the last
        position (a decode step): returns the output [n_heads, head_dim] and the meter of every
        head (a structured array of METER_DTYPE). q: [n_queries, n_heads, head_dim], the last
        n_queries positions, causal (a prefill): the output [n_queries, n_heads, head_dim] and
        None (prefills are not metered). out, when given, receives the output (float32,
        C-contiguous, q's shape)."""
        q_array = _arrays.require_array("q", q)
        if q_array.ndim not in (2, 3) or q_array.shape[-2:] != (self.n_heads, self.head_dim):
            raise ValueError(f"q: expected shape [{self.n_heads}, {self.head_dim}] ([n_heads, head_dim]) or "
                             f"[n_queries, {self.n_heads}, {self.head_dim}], got {q_array.shape}")
        q_array = _arrays.float32_array("q", q_array, q_array.ndim, "")
        n_queries = 1 if q_array.ndim == 2 else q_array.shape[0]
        if out is None:
            out = np.empty(q_array.shape, dtype=np.float32)
        else:
            _arrays.require_array("out", out)
            if out.dtype != np.float32 or out.shape != q_array.shape:
                raise ValueError(f"out: expected float32 of shape {q_array.shape}, got {out.dtype} {out.shape}")
            _arrays.require_contiguous("out", out)
        meters = np.empty((self.n_heads, 5), dtype=np.float64) if n_queries == 1 else None
        self._store.attend(int(seq), int(layer), q_array, n_queries, out, meters)
        return out, None if meters is None else meters.view(METER_DTYPE).reshape(self.n_heads)

    # -- device memory (a store of device "cuda") ----------------------------------------------

    def append_device(self, layer: int, seqs: Sequence[int], n_tokens: Sequence[int], k_ptr: int,
                      v_ptr: int) -> None:
        """Appends rows of several sequences to one layer, in one launch: seqs[i] (distinct) gets
        n_tokens[i] >= 1 rows. k_ptr, v_ptr: device pointers (ints; torch's data_ptr(), CuPy's
        data.ptr) to float32 [sum of n_tokens, n_kv_heads, head_dim], C-contiguous, the rows of
        seqs[0] first (rounded to bf16 as ``append`` rounds floats). The work is enqueued on the
        store's cuda_stream, not waited for: the memory must stay valid until that stream has
        run it (memory of torch's caching allocator freed on that same stream is)."""
        seqs = _ints("seqs", seqs, 0)
        n_tokens = _ints("n_tokens", n_tokens, 1)
        if len(n_tokens) != len(seqs):
            raise ValueError(f"n_tokens: expected {len(seqs)} counts (one per entry of seqs), got {len(n_tokens)}")
        self._store.append_device(_int("layer", layer, 0), seqs, n_tokens, _int("k_ptr", k_ptr, 1),
                                  _int("v_ptr", v_ptr, 1))

    def attend_device(self, layer: int, seqs: Sequence[int], q_ptr: int, out_ptr: int, meters_ptr: int = 0) -> None:
        """One decode step of several sequences of one layer, in one launch: the query of seqs[i]
        (distinct, at its last position) attends to every position of seqs[i]. q_ptr, out_ptr:
        device pointers to float32 [len(seqs), n_heads, head_dim], C-contiguous; meters_ptr: a
        device pointer to float32 [len(seqs), n_heads], each head's meter (0 for a lossless
        scheme), or 0 for none. Enqueued on the store's cuda_stream, not waited for; a lossy
        scheme's meters reach meter_stats() and certificate() (which wait for the stream)
        whether meters_ptr is given or not."""
        seqs = _ints("seqs", seqs, 0)
        self._store.attend_device(_int("layer", layer, 0), seqs, _int("q_ptr", q_ptr, 1), _int("out_ptr", out_ptr, 1),
                                  _int("meters_ptr", meters_ptr, 0))

    def note_queries_device(self, layer: int, seqs: Sequence[int], n_tokens: Sequence[int], q_ptr: int) -> None:
        """A prompt's queries, for a front end that attends prompts itself: the query centroid of a
        sparse store's key index, as the prefills ``attend`` attends on a cpu store give it.
        seqs[i] (distinct) notes n_tokens[i] rows, at most the positions it holds of the layer;
        q_ptr: a device pointer to float32 [sum of n_tokens, n_heads, head_dim], C-contiguous,
        the rows of seqs[0] first. A sequence's first sparse step takes c_q as the mean of the
        queries noted (that step's query when none were). Nothing is noted for a dense layer, a
        store without sparse decode, or a sequence whose centroids are set. Waits for the stream."""
        seqs = _ints("seqs", seqs, 0)
        n_tokens = _ints("n_tokens", n_tokens, 1)
        if len(n_tokens) != len(seqs):
            raise ValueError(f"n_tokens: expected {len(seqs)} counts (one per entry of seqs), got {len(n_tokens)}")
        self._store.note_queries_device(_int("layer", layer, 0), seqs, n_tokens, _int("q_ptr", q_ptr, 1))

    # -- planned decode steps (a CUDA graph may capture them) -------------------------------------

    def plan_device(self, seqs: Sequence[int], steps: int) -> bool:
        """Plans ``steps`` decode steps of seqs (distinct, each holding a prompt in every layer):
        their pages are taken now and their state goes to the device, so that
        ``append_planned_device`` and ``attend_planned_device`` launch kernels only and a CUDA graph
        that captured a step replays as the next one. Waits for the store's stream. Returns True
        when a graph captured under the previous plan must be captured again (the plan moved or
        resized memory it reads), False when it stays valid. ``finish_planned_device`` ends the
        plan; until then the store refuses its other changes. ``planned_sequences`` is the
        number of rows each planned call's k, v and q hold (0 without a plan)."""
        seqs = _ints("seqs", seqs, 0)
        recapture = self._store.plan_device(seqs, _int("steps", steps, 1))
        self.planned_sequences = len(seqs)
        return recapture

    def append_planned_device(self, layer: int, k_ptr: int, v_ptr: int, stream: int = 0) -> None:
        """One row of each planned sequence (plan order) for ``layer``: k_ptr, v_ptr device
        pointers to float32 [n_seqs, n_kv_heads, head_dim], C-contiguous, written at the position
        the device holds for each sequence. Enqueued on ``stream`` (0: the store's), kernels only."""
        self._store.append_planned_device(_int("layer", layer, 0), _int("k_ptr", k_ptr, 1), _int("v_ptr", v_ptr, 1),
                                          _int("stream", stream, 0))

    def attend_planned_device(self, layer: int, q_ptr: int, out_ptr: int, meters_ptr: int = 0,
                              stream: int = 0) -> None:
        """Decode attention of the planned sequences of ``layer`` after its ``append_planned_device``:
        q_ptr, out_ptr float32 [n_seqs, n_heads, head_dim], meters_ptr float32 [n_seqs, n_heads] or
        0. Enqueued on ``stream`` (0: the store's), kernels only."""
        self._store.attend_planned_device(_int("layer", layer, 0), _int("q_ptr", q_ptr, 1),
                                          _int("out_ptr", out_ptr, 1), _int("meters_ptr", meters_ptr, 0),
                                          _int("stream", stream, 0))

    def finish_planned_device(self, stream: int = 0) -> None:
        """Waits for ``stream`` (give the stream the replays ran on; 0 waits for the store's alone)
        and takes the planned steps that ran: their rows appended, the blocks
        they completed encoded, their meters recorded, the pages no row reached given back. Raises
        ``OutOfRangeError`` when a replay ran past the plan (what was written is kept)."""
        stream = _int("stream", stream, 0)
        try:
            self._store.finish_planned_device(stream)
        finally:
            # Finish closes the plan once it has taken the steps, even when it then fails (a replay
            # past the plan, a commit that failed); before that, a failure leaves it open.
            if not self._store.planned_device():
                self.planned_sequences = 0

    # -- sequences ----------------------------------------------------------------------------

    def crop(self, seq: int, n_tokens: int) -> None:
        """Keeps the first n_tokens positions of seq in every layer. A cuda store with a lossy scheme
        refuses (certkv.UnsupportedError, the store unchanged) an n_tokens that ends inside a block
        it has encoded (the device keeps no exact values of it)."""
        self._store.crop(int(seq), int(n_tokens))

    def reorder(self, src: Sequence[int]) -> None:
        """Sequence i becomes what sequence src[i] was (beam search); pages are shared, not copied."""
        src = [int(i) for i in src]
        if len(src) != self.n_sequences:
            raise ValueError(f"src: expected {self.n_sequences} entries (n_sequences), got {len(src)}")
        self._store.reorder(src)

    def select(self, src: Sequence[int]) -> None:
        """The store holds len(src) sequences from here on: sequence i is what sequence src[i] was
        (several samples of one prompt, beam expansion, finished rows dropped). Pages are shared by
        reference count, not copied; a sequence src does not name is freed. ``reorder`` is the case
        len(src) == n_sequences. Raises ValueError for an empty src, certkv.OutOfRangeError (an
        IndexError) for an entry outside [0, n_sequences). A cuda store copies a partial last
        block's raw pages on its stream."""
        src = [int(i) for i in src]
        if not src:
            raise ValueError("src: expected at least one entry")
        self._store.select(src)
        self.n_sequences = len(src)

    # -- reports ------------------------------------------------------------------------------

    def meter_stats(self) -> dict[str, Any]:
        return self._store.meter_stats()

    def kv_stats(self) -> dict[str, Any]:
        return self._store.kv_stats()

    def sparse_stats(self) -> dict[str, Any]:
        """Sparse decode since the store was made (a session's sparse_stats: sparse, p, deviations,
        window_tokens, dense_layers, steps, cells, mean_budget, mean_budget_all_layers,
        index_bytes, indexed_tokens, index_appended_tokens, index_build_seconds,
        widened_fraction); steps counts (sequence, layer) decode steps of the sparse layers.
        {"sparse": False, ...} for a dense store. A cuda store waits for its stream first."""
        return self._store.sparse_stats()

    def certificate(self) -> dict[str, Any]:
        """The certificate of the decode steps attended so far: scheme, metered; for a lossy
        scheme its tier, tau, coverage at tau, meter_max, meter_p50, meter_p99 over the
        (layer, query head, step) cells; the KV bytes by storage class; with sparse decode, the
        mean budget attended (``sparse``: p, cells, mean_budget, mean_budget_all_layers; the meter
        covers the attended set, the mass left outside it is the sparse tier's recall)."""
        cert = _certificate.certificate(self.kv, self.meter_stats(), self.kv_stats())
        sparse = self.sparse_stats()
        if sparse["sparse"]:
            cert["sparse"] = {key: sparse[key] for key in ("p", "cells", "mean_budget", "mean_budget_all_layers")}
        return cert
