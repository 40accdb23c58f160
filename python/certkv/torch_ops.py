"""certkv's kernels as PyTorch custom operators (torch.library), with fake (meta) kernels so that
they trace under torch.compile:

- ``torch.ops.certkv.kv_store_attend(store, seq, layer, q)``: decode attention over a
  :class:`certkv.KvStore`'s pages of (seq, layer) for the query of its last position, q
  [n_heads, head_dim] float32; returns the output [n_heads, head_dim] float32 and the meter of
  every head, [n_heads, 5] float64 (meter, log_a, value_rho, v_norm_max, output_bound). ``store``
  is the integer :func:`register_store` gave the store. CPU tensors, a cpu store.
- ``torch.ops.certkv.kv_store_decode(store, layer, seqs, q)``: one decode step of several
  sequences of a layer, q [len(seqs), n_heads, head_dim] float32 (the query of each sequence's last
  position); returns the output, q's shape, and each head's meter, [len(seqs), n_heads] float32
  (0 for a lossless scheme). On CUDA tensors over a store of device "cuda" (one launch for every
  sequence, on the store's stream, which must be torch's current stream), and on CPU tensors over
  a cpu store (one call per sequence).
- ``torch.ops.certkv.kv_store_step_planned(store, layer, k, v, q)``: one planned decode step of
  a layer (``KvStore.plan_device`` first): the planned sequences' new rows k, v [n_seqs,
  n_kv_heads, head_dim] appended at the positions the device holds, then their queries q [n_seqs,
  n_heads, head_dim] attended; returns the output, q's shape, and each head's meter [n_seqs,
  n_heads]. CUDA tensors, on torch's current stream, kernels only: a ``torch.cuda.graph`` capture
  of a model's decode step holds it, and each replay is the next step (``finish_planned_device``
  takes the steps that ran).
- ``torch.ops.certkv.gaac_encode_pages(pages, b3, b4, escape_capacity_bytes)``: GAAC slots of
  pages [n_pages, block_tokens, head_dim] of bf16 (lossless), and the bytes each used (0: the
  page does not fit its slot; keep it raw).
- ``torch.ops.certkv.gaac_decode_pages(slots, b3, b4, escape_capacity_bytes, block_tokens,
  head_dim)``: the pages back, bf16.
- ``torch.ops.certkv.lossy_encode_pages(pages, kv, key, rope_layout, witness, layer, kv_head,
  outlier_pairs, first_block)``: pages [n_pages, block_tokens, head_dim] of bf16 coded as the lossy
  scheme ``kv`` (fp8, rtn, kivi2, dither8; K or V pages), uint8 [n_pages, page_bytes], and whether
  each was encoded (False: keep the block exact); page i is block first_block + i.
- ``torch.ops.certkv.lossy_decode_pages(pages, kv, key, block_tokens, head_dim, rope_layout,
  witness, layer, kv_head, outlier_pairs, first_block)``: the reconstruction attention reads,
  float32 [n_pages, block_tokens, head_dim] (certkv.codec.lossy_encode / lossy_decode).

kv_store_attend and the GAAC and lossy page operators run on CPU tensors only: CUDA tensors raise
an error saying so. Importing this module imports torch.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np
import torch

from . import _certkv
from . import _errors as certkv_errors
from .kv_store import KvStore

__all__ = ["register_store", "kv_store_attend", "kv_store_decode", "kv_store_step_planned", "gaac_encode_pages",
           "gaac_decode_pages", "lossy_encode_pages", "lossy_decode_pages"]

_stores: "weakref.WeakValueDictionary[int, KvStore]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


def register_store(store: KvStore) -> int:
    """The integer handle that names ``store`` in torch.ops.certkv.kv_store_attend and
    kv_store_decode (kept while the store lives)."""
    if not isinstance(store, KvStore):
        raise TypeError(f"store: expected a certkv.KvStore, got {type(store).__name__}")
    with _lock:
        handle = next(_ids)
        _stores[handle] = store
    return handle


def _cpu_only(op: str, what: str):
    def refuse(*args, **kwargs):
        devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        raise RuntimeError(f"certkv::{op}: {what} (tensors on {', '.join(devices)})")
    return refuse


def _live_store(store: int) -> KvStore:
    s = _stores.get(store)
    if s is None:
        raise ValueError(f"store: {store} names no live certkv.KvStore (certkv.torch_ops.register_store)")
    return s


def _require(name: str, x: torch.Tensor, dtype: torch.dtype, ndim: int, what: str) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {what}, got shape {tuple(x.shape)}")


# -- decode attention over a KV store ------------------------------------------------------------

@torch.library.custom_op("certkv::kv_store_attend", mutates_args=(), device_types="cpu")
def kv_store_attend(store: int, seq: int, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = _live_store(store)
    _require("q", q, torch.float32, 2, "[n_heads, head_dim]")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    meters = torch.empty((q.shape[0], 5), dtype=torch.float64)
    s._store.attend(int(seq), int(layer), q.contiguous().numpy(), 1, out.numpy(), meters.numpy())
    return out, meters


@kv_store_attend.register_fake
def _(store, seq, layer, q):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0], 5), dtype=torch.float64)


torch.library.register_kernel("certkv::kv_store_attend", "cuda", _cpu_only(
    "kv_store_attend", "runs on CPU tensors over a cpu KvStore; for CUDA tensors over a KvStore(device='cuda') "
    "use certkv::kv_store_decode"))


def _decode_args(s: KvStore, seqs: list[int], q: torch.Tensor) -> None:
    _require("q", q, torch.float32, 3, "[n_seqs, n_heads, head_dim]")
    if q.shape[0] != len(seqs) or q.shape[1:] != (s.n_heads, s.head_dim):
        raise ValueError(f"q: expected shape [{len(seqs)}, {s.n_heads}, {s.head_dim}] ([len(seqs), n_heads, "
                         f"head_dim]), got {tuple(q.shape)}")


@torch.library.custom_op("certkv::kv_store_decode", mutates_args=(), device_types="cpu")
def kv_store_decode(store: int, layer: int, seqs: list[int], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = _live_store(store)
    if s.device != "cpu":
        raise ValueError(f"store: a KvStore of device {s.device!r} takes CUDA tensors (q is on {q.device})")
    _decode_args(s, seqs, q)
    q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    meter = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    meters = np.empty((q.shape[1], 5), dtype=np.float64)
    for i, seq in enumerate(seqs):
        s._store.attend(int(seq), int(layer), q[i].numpy(), 1, out[i].numpy(), meters)
        meter[i] = torch.from_numpy(meters[:, 0])
    return out, meter


@kv_store_decode.register_kernel("cuda")
def _(store, layer, seqs, q):
    s = _live_store(store)
    if s.device != "cuda":
        raise ValueError(f"store: a KvStore of device {s.device!r} takes CPU tensors (q is on {q.device}); for "
                         f"CUDA tensors make the store with device='cuda'")
    _decode_args(s, seqs, q)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    if stream != (s.cuda_stream or 0):
        # The store enqueues on its own stream: on another, its reads of q and writes of out would
        # race with torch's work.
        raise RuntimeError(f"certkv::kv_store_decode: torch's current stream ({stream:#x}) is not the store's "
                           f"cuda_stream ({s.cuda_stream or 0:#x})")
    q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    meter = q.new_empty((q.shape[0], q.shape[1]))
    with torch.cuda.device(q.device):  # the store launches on the current device
        s.attend_device(int(layer), seqs, q.data_ptr(), out.data_ptr(), meter.data_ptr())
    return out, meter


@kv_store_decode.register_fake
def _(store, layer, seqs, q):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0], q.shape[1]))


# -- planned decode steps (CUDA graphs) ----------------------------------------------------------

@torch.library.custom_op("certkv::kv_store_step_planned", mutates_args=(), device_types="cuda")
def kv_store_step_planned(store: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                          q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = _live_store(store)
    if s.device != "cuda":
        raise ValueError(f"store: planned steps run over a KvStore(device='cuda'), not device {s.device!r}")
    n = s.planned_sequences
    if n == 0:
        raise certkv_errors.error_for_status("invalid argument", 1, "certkv::kv_store_step_planned: no planned "
                                             "steps (KvStore.plan_device first)")
    for name, x, heads in (("k", k, s.n_kv_heads), ("v", v, s.n_kv_heads), ("q", q, s.n_heads)):
        _require(name, x, torch.float32, 3, "[n_seqs, heads, head_dim]")
        if x.shape != (n, heads, s.head_dim) or x.device != q.device:
            raise ValueError(f"{name}: expected shape [{n}, {heads}, {s.head_dim}] ([the planned sequences, heads, "
                             f"head_dim]) on {q.device}, got {tuple(x.shape)} on {x.device}")
    k, v, q = k.contiguous(), v.contiguous(), q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    meter = q.new_empty((q.shape[0], q.shape[1]))
    # torch's default stream is handle 0, which the C calls read as "the store's stream": name it
    # cudaStreamLegacy (1) instead, so the launches stay ordered with torch's work on it.
    stream = torch.cuda.current_stream(q.device).cuda_stream or 1
    with torch.cuda.device(q.device):
        s.append_planned_device(int(layer), k.data_ptr(), v.data_ptr(), stream)
        s.attend_planned_device(int(layer), q.data_ptr(), out.data_ptr(), meter.data_ptr(), stream)
    return out, meter


@kv_store_step_planned.register_fake
def _(store, layer, k, v, q):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0], q.shape[1]))


# -- GAAC pages ----------------------------------------------------------------------------------

_GAAC_CPU = "certkv's GAAC page decode runs on CPU tensors (attention decodes the pages on the device)"

def _codec(b3: torch.Tensor, b4: torch.Tensor, escape_capacity_bytes: int, block_tokens: int, head_dim: int):
    return _certkv.GaacCodec("bf16", int(block_tokens), int(head_dim), b3.contiguous().numpy(),
                             b4.contiguous().numpy(), int(escape_capacity_bytes))


def _slot_bytes(escape_capacity_bytes: int, block_tokens: int, head_dim: int) -> int:
    zeros = np.zeros(head_dim, dtype=np.uint8)
    return _certkv.GaacCodec("bf16", int(block_tokens), int(head_dim), zeros, zeros, int(escape_capacity_bytes)).slot_bytes


@torch.library.custom_op("certkv::gaac_encode_pages", mutates_args=(), device_types="cpu")
def gaac_encode_pages(pages: torch.Tensor, b3: torch.Tensor, b4: torch.Tensor,
                      escape_capacity_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    _require("pages", pages, torch.bfloat16, 3, "[n_pages, block_tokens, head_dim]")
    _require("b3", b3, torch.uint8, 1, "[head_dim]")
    _require("b4", b4, torch.uint8, 1, "[head_dim]")
    n_pages, block_tokens, head_dim = pages.shape
    codec = _codec(b3, b4, escape_capacity_bytes, block_tokens, head_dim)
    bits = pages.contiguous().view(torch.int16).numpy().view(np.uint16)
    slots, used = _certkv.gaac_encode(codec, bits, n_pages)
    return torch.from_numpy(slots), torch.from_numpy(used.astype(np.int64))


@gaac_encode_pages.register_fake
def _(pages, b3, b4, escape_capacity_bytes):
    n_pages, block_tokens, head_dim = pages.shape
    slot = _slot_bytes(escape_capacity_bytes, block_tokens, head_dim)
    return pages.new_empty((n_pages, slot), dtype=torch.uint8), pages.new_empty((n_pages,), dtype=torch.int64)


@gaac_encode_pages.register_kernel("cuda")
def _(pages, b3, b4, escape_capacity_bytes):
    # The device encoder, on torch's current stream. The bases go up with the launch from the host
    # (bases on the device come down first, a wait for the stream).
    _require("pages", pages, torch.bfloat16, 3, "[n_pages, block_tokens, head_dim]")
    _require("b3", b3, torch.uint8, 1, "[head_dim]")
    _require("b4", b4, torch.uint8, 1, "[head_dim]")
    n_pages, block_tokens, head_dim = pages.shape
    codec = _codec(b3.cpu(), b4.cpu(), escape_capacity_bytes, block_tokens, head_dim)
    pages = pages.contiguous()
    slots = torch.empty((n_pages, codec.slot_bytes), dtype=torch.uint8, device=pages.device)
    used = torch.empty((n_pages,), dtype=torch.int32, device=pages.device)
    with torch.cuda.device(pages.device):
        _certkv.gaac_encode_device(codec, pages.data_ptr(), n_pages, slots.data_ptr(), used.data_ptr(),
                                   torch.cuda.current_stream(pages.device).cuda_stream)
    used = used.to(torch.int64) & 0xFFFFFFFF  # the device's uint32; UINT32_MAX: did not fit, 0 as on the CPU
    return slots, torch.where(used == 0xFFFFFFFF, torch.zeros_like(used), used)


@torch.library.custom_op("certkv::gaac_decode_pages", mutates_args=(), device_types="cpu")
def gaac_decode_pages(slots: torch.Tensor, b3: torch.Tensor, b4: torch.Tensor, escape_capacity_bytes: int,
                      block_tokens: int, head_dim: int) -> torch.Tensor:
    _require("slots", slots, torch.uint8, 2, "[n_pages, slot_bytes]")
    codec = _codec(b3, b4, escape_capacity_bytes, block_tokens, head_dim)
    if slots.shape[1] != codec.slot_bytes:
        raise ValueError(f"slots: expected {codec.slot_bytes} bytes per slot, got {slots.shape[1]}")
    out = np.empty((slots.shape[0], block_tokens, head_dim), dtype=np.uint16)
    _certkv.gaac_decode(codec, slots.contiguous().numpy(), slots.shape[0], out)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


@gaac_decode_pages.register_fake
def _(slots, b3, b4, escape_capacity_bytes, block_tokens, head_dim):
    return slots.new_empty((slots.shape[0], block_tokens, head_dim), dtype=torch.bfloat16)


torch.library.register_kernel("certkv::gaac_decode_pages", "cuda", _cpu_only("gaac_decode_pages", _GAAC_CPU))


# -- lossy pages ---------------------------------------------------------------------------------

_LOSSY_CPU = "certkv's lossy page decode runs on CPU tensors (attention decodes the pages on the device)"


def _lossy_codec(kv: str, key: bool, block_tokens: int, head_dim: int, rope_layout: str, witness: str | None,
                 layer: int, kv_head: int, outlier_pairs: list[int]):
    return _certkv.LossyCodec(kv, bool(key), int(block_tokens), int(head_dim), rope_layout, witness, int(layer),
                              int(kv_head), [int(p) for p in outlier_pairs])


@torch.library.custom_op("certkv::lossy_encode_pages", mutates_args=(), device_types="cpu")
def lossy_encode_pages(pages: torch.Tensor, kv: str, key: bool, rope_layout: str, witness: str | None, layer: int,
                       kv_head: int, outlier_pairs: list[int], first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    _require("pages", pages, torch.bfloat16, 3, "[n_pages, block_tokens, head_dim]")
    n_pages, block_tokens, head_dim = pages.shape
    codec = _lossy_codec(kv, key, block_tokens, head_dim, rope_layout, witness, layer, kv_head, outlier_pairs)
    bits = pages.contiguous().view(torch.int16).numpy().view(np.uint16)
    data, encoded = _certkv.lossy_encode(codec, bits, n_pages, int(first_block))
    return torch.from_numpy(data), torch.from_numpy(encoded.astype(np.bool_))


@lossy_encode_pages.register_fake
def _(pages, kv, key, rope_layout, witness, layer, kv_head, outlier_pairs, first_block):
    n_pages, block_tokens, head_dim = pages.shape
    codec = _lossy_codec(kv, key, block_tokens, head_dim, rope_layout, witness, layer, kv_head, outlier_pairs)
    return (pages.new_empty((n_pages, codec.page_bytes), dtype=torch.uint8),
            pages.new_empty((n_pages,), dtype=torch.bool))


@lossy_encode_pages.register_kernel("cuda")
def _(pages, kv, key, rope_layout, witness, layer, kv_head, outlier_pairs, first_block):
    # The device encoder (fp8-e4m3, fp8-e5m2, dither8), on torch's current stream.
    _require("pages", pages, torch.bfloat16, 3, "[n_pages, block_tokens, head_dim]")
    n_pages, block_tokens, head_dim = pages.shape
    codec = _lossy_codec(kv, key, block_tokens, head_dim, rope_layout, witness, layer, kv_head, outlier_pairs)
    pages = pages.contiguous()
    out = torch.empty((n_pages, codec.page_bytes), dtype=torch.uint8, device=pages.device)
    encoded = torch.empty((n_pages,), dtype=torch.uint8, device=pages.device)
    with torch.cuda.device(pages.device):
        _certkv.lossy_encode_device(codec, pages.data_ptr(), n_pages, int(first_block), out.data_ptr(),
                                    encoded.data_ptr(), torch.cuda.current_stream(pages.device).cuda_stream)
    return out, encoded.to(torch.bool)


@torch.library.custom_op("certkv::lossy_decode_pages", mutates_args=(), device_types="cpu")
def lossy_decode_pages(pages: torch.Tensor, kv: str, key: bool, block_tokens: int, head_dim: int, rope_layout: str,
                       witness: str | None, layer: int, kv_head: int, outlier_pairs: list[int],
                       first_block: int) -> torch.Tensor:
    _require("pages", pages, torch.uint8, 2, "[n_pages, page_bytes]")
    codec = _lossy_codec(kv, key, block_tokens, head_dim, rope_layout, witness, layer, kv_head, outlier_pairs)
    if pages.shape[1] != codec.page_bytes:
        raise ValueError(f"pages: expected {codec.page_bytes} bytes per page, got {pages.shape[1]}")
    out = _certkv.lossy_decode(codec, pages.contiguous().numpy(), pages.shape[0], int(first_block))
    return torch.from_numpy(out)


@lossy_decode_pages.register_fake
def _(pages, kv, key, block_tokens, head_dim, rope_layout, witness, layer, kv_head, outlier_pairs, first_block):
    return pages.new_empty((pages.shape[0], block_tokens, head_dim), dtype=torch.float32)


torch.library.register_kernel("certkv::lossy_decode_pages", "cuda", _cpu_only("lossy_decode_pages", _LOSSY_CPU))
