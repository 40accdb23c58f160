"""certkv's kernels as PyTorch custom operators (torch.library), on CPU tensors, with fake (meta)
kernels so that they trace under torch.compile:

- ``torch.ops.certkv.kv_store_attend(store, seq, layer, q)``: decode attention over a
  :class:`certkv.KvStore`'s pages of (seq, layer) for the query of its last position, q
  [n_heads, head_dim] float32; returns the output [n_heads, head_dim] float32 and the meter of
  every head, [n_heads, 5] float64 (meter, log_a, value_rho, v_norm_max, output_bound). ``store``
  is the integer :func:`register_store` gave the store.
- ``torch.ops.certkv.gaac_encode_pages(pages, b3, b4, escape_capacity_bytes)``: GAAC slots of
  pages [n_pages, block_tokens, head_dim] of bf16 (lossless), and the bytes each used (0: the
  page does not fit its slot; keep it raw).
- ``torch.ops.certkv.gaac_decode_pages(slots, b3, b4, escape_capacity_bytes, block_tokens,
  head_dim)``: the pages back, bf16.

This build of certkv has no CUDA kernels behind these operators: CUDA tensors raise an error
saying so. Importing this module imports torch.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import numpy as np
import torch

from . import _certkv
from .kv_store import KvStore

__all__ = ["register_store", "kv_store_attend", "gaac_encode_pages", "gaac_decode_pages"]

_stores: "weakref.WeakValueDictionary[int, KvStore]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


def register_store(store: KvStore) -> int:
    """The integer handle that names ``store`` in torch.ops.certkv.kv_store_attend (kept while the
    store lives)."""
    if not isinstance(store, KvStore):
        raise TypeError(f"store: expected a certkv.KvStore, got {type(store).__name__}")
    with _lock:
        handle = next(_ids)
        _stores[handle] = store
    return handle


def _no_cuda(op: str):
    def refuse(*args, **kwargs):
        devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        raise RuntimeError(f"certkv::{op}: this build of certkv has no CUDA operators (tensors on "
                           f"{', '.join(devices)}); run it on CPU tensors")
    return refuse


def _require(name: str, x: torch.Tensor, dtype: torch.dtype, ndim: int, what: str) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {what}, got shape {tuple(x.shape)}")


# -- decode attention over a KV store ------------------------------------------------------------

@torch.library.custom_op("certkv::kv_store_attend", mutates_args=(), device_types="cpu")
def kv_store_attend(store: int, seq: int, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = _stores.get(store)
    if s is None:
        raise ValueError(f"store: {store} names no live certkv.KvStore (certkv.torch_ops.register_store)")
    _require("q", q, torch.float32, 2, "[n_heads, head_dim]")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    meters = torch.empty((q.shape[0], 5), dtype=torch.float64)
    s._store.attend(int(seq), int(layer), q.contiguous().numpy(), 1, out.numpy(), meters.numpy())
    return out, meters


@kv_store_attend.register_fake
def _(store, seq, layer, q):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0], 5), dtype=torch.float64)


torch.library.register_kernel("certkv::kv_store_attend", "cuda", _no_cuda("kv_store_attend"))


# -- GAAC pages ----------------------------------------------------------------------------------

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


torch.library.register_kernel("certkv::gaac_encode_pages", "cuda", _no_cuda("gaac_encode_pages"))


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


torch.library.register_kernel("certkv::gaac_decode_pages", "cuda", _no_cuda("gaac_decode_pages"))
