"""KV dumps (``certkv dump-kv``; docs/format/kv_dump.md) and safetensors files, on NumPy arrays.

A KV dump is a safetensors file holding what the prefill of N tokens wrote into the KV cache: per
dumped layer L, ``layerL.k`` and ``layerL.v`` (bf16 bit patterns, ``[n_kv_heads, N, head_dim]``)
and ``layerL.q`` (float32 queries of the last position, ``[n_heads, head_dim]``), the ``tokens``
and string metadata (``format`` ``certkv-kv-dump/1``, shapes, ``rope_layout``, ...).

    dump = certkv.kvdump.read("kv.safetensors")          # written by certkv dump-kv
    k = dump.k[0][2]                                     # layer 0, kv head 2: [N, head_dim] uint16
    cal = certkv.codec.calibrate(k)
    certkv.kvdump.write("copy.safetensors", dump)

Files are read and written through the C API (``certkv_safetensors_open`` / ``_write``), which
checks every offset and size: a malformed file raises :class:`certkv.CorruptError` naming it, a
missing one :class:`certkv.NotFoundError`; a safetensors file that is not a well-formed KV dump
raises :class:`certkv.CorruptError` naming what is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import _arrays
from . import _certkv
from ._errors import CorruptError

__all__ = ["FORMAT", "KvDump", "read", "write", "read_safetensors", "write_safetensors"]

FORMAT = "certkv-kv-dump/1"  #: the ``format`` metadata of a KV dump

# safetensors dtypes and the NumPy dtype their elements are read as (BF16: its bit patterns).
_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
           "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
           "U8": np.dtype("u1"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
           "BOOL": np.dtype("?")}
# The safetensors dtype of a NumPy array (uint16 is U16 here: pass ("BF16", array) for bf16 bits).
_NAMES = {dtype: name for name, dtype in reversed(list(_DTYPES.items()))}
_NAMES[np.dtype("<u2")] = "U16"


def _path(name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a str or os.PathLike, got {type(value).__name__}")
    return os.fspath(value)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file, by name in the header's order, as NumPy arrays (BF16 as
    uint16 bit patterns; a dtype NumPy has no type for, such as F8_E4M3, as uint8 bytes with a
    last dimension of the element size), and its ``__metadata__``."""
    raw, metadata = _certkv.safetensors_read(_path("path", path))
    tensors = {}
    for name, dtype, shape, data in raw:
        np_dtype = _DTYPES.get(dtype)
        if np_dtype is None:
            array = np.frombuffer(data, dtype=np.uint8).reshape(*shape, -1) if shape else np.frombuffer(data, np.uint8)
        else:
            array = np.frombuffer(data, dtype=np_dtype).reshape(shape)
        tensors[name] = array.copy()  # writable, and aligned for the element type
    return tensors, dict(metadata)


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes tensors (name -> array, or name -> (safetensors dtype, array) to name the dtype,
    e.g. ("BF16", uint16 bits)) and string metadata to a safetensors file, replacing it."""
    path = _path("path", path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping of name to array, got {type(tensors).__name__}")
    entries = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors: expected str names, got {type(name).__name__}")
        dtype_name = None
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            dtype_name, value = value
        array = _arrays.require_array(f"tensors[{name!r}]", value)
        if dtype_name is None:
            dtype_name = _NAMES.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)
            if dtype_name is None:
                raise TypeError(f"tensors[{name!r}]: no safetensors dtype for {array.dtype}")
        elif dtype_name not in _DTYPES or _DTYPES[dtype_name].itemsize != array.dtype.itemsize:
            raise TypeError(f"tensors[{name!r}]: dtype {dtype_name!r} does not hold {array.dtype} elements")
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        entries.append((name, dtype_name, list(array.shape), array.reshape(-1).view(np.uint8)))
    meta = dict(metadata or {})
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata: expected str keys and values, got {key!r}: {value!r}")
    _certkv.safetensors_write(path, entries, sorted(meta.items()))


@dataclass
class KvDump:
    """The contents of a KV dump. Layers are the keys of ``k``, ``v`` and ``q`` (the same)."""

    k: dict[int, np.ndarray]  #: layer -> [n_kv_heads, n_tokens, head_dim] uint16, post-RoPE keys (bf16 bits)
    v: dict[int, np.ndarray]  #: layer -> [n_kv_heads, n_tokens, head_dim] uint16, values (bf16 bits)
    q: dict[int, np.ndarray]  #: layer -> [n_heads, head_dim] float32, the last position's queries
    tokens: np.ndarray  #: [n_tokens] int32
    metadata: dict[str, str] = field(default_factory=dict)  #: model, architecture, rope_layout, ...

    @property
    def layers(self) -> list[int]:
        return sorted(self.k)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.k[self.layers[0]].shape[2])

    @property
    def n_kv_heads(self) -> int:
        return int(self.k[self.layers[0]].shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.q[self.layers[0]].shape[0])

    def problem(self) -> str | None:
        """What makes this not a well-formed KV dump (None: nothing)."""
        if not self.k:
            return "it has no layer"
        if set(self.k) != set(self.v) or set(self.k) != set(self.q):
            return f"layers of k {sorted(self.k)}, v {sorted(self.v)} and q {sorted(self.q)} differ"
        if not isinstance(self.tokens, np.ndarray) or self.tokens.dtype != np.int32 or self.tokens.ndim != 1:
            return "tokens: expected a 1-dimensional int32 array"
        if self.tokens.shape[0] < 1:
            return "tokens: it has no token"
        first = self.layers[0]
        if not isinstance(self.k[first], np.ndarray) or self.k[first].ndim != 3 or not isinstance(
                self.q[first], np.ndarray) or self.q[first].ndim != 2:
            return f"layer {first}: k must be [n_kv_heads, n_tokens, head_dim] and q [n_heads, head_dim] arrays"
        kv_shape = (self.k[first].shape[0], self.n_tokens, self.k[first].shape[2])
        q_shape = (self.q[first].shape[0], kv_shape[2])
        for layer in self.layers:
            for name, array, dtype, shape in (("k", self.k[layer], np.uint16, kv_shape),
                                              ("v", self.v[layer], np.uint16, kv_shape),
                                              ("q", self.q[layer], np.float32, q_shape)):
                if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
                    got = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
                    return f"layer{layer}.{name}: expected {np.dtype(dtype)} {shape}, got {got}"
        if q_shape[0] % kv_shape[0] != 0:
            return f"n_heads {q_shape[0]} is not a multiple of n_kv_heads {kv_shape[0]}"
        return None


def _corrupt(path: str, message: str) -> CorruptError:
    return CorruptError("corrupt", 3, f"KV dump '{path}': {message}")


def _metadata_int(path: str, metadata: Mapping[str, str], key: str) -> int:
    value = metadata.get(key)
    if value is None or not value.isdigit():
        raise _corrupt(path, f"metadata '{key}' = {value!r} is not a count")
    return int(value)


def read(path: str | os.PathLike[str]) -> KvDump:
    """Reads a KV dump. A file that is not a safetensors file, or not a KV dump of format
    ``certkv-kv-dump/1`` whose tensors match its metadata, raises :class:`certkv.CorruptError`."""
    path = _path("path", path)
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise _corrupt(path, f"metadata 'format' is {metadata.get('format')!r}, not {FORMAT!r}")
    layers_text = metadata.get("layers", "")
    try:
        layers = [int(item) for item in layers_text.split(",")]
    except ValueError:
        raise _corrupt(path, f"metadata 'layers' = {layers_text!r} is not a comma list of layers") from None
    k, v, q = {}, {}, {}
    for layer in layers:
        for name, into in (("k", k), ("v", v), ("q", q)):
            tensor = tensors.get(f"layer{layer}.{name}")
            if tensor is None:
                raise _corrupt(path, f"no tensor 'layer{layer}.{name}'")
            into[layer] = tensor
    if "tokens" not in tensors:
        raise _corrupt(path, "no tensor 'tokens'")
    dump = KvDump(k, v, q, tensors["tokens"], metadata)
    problem = dump.problem()
    if problem is not None:
        raise _corrupt(path, problem)
    for key, value in (("n_tokens", dump.n_tokens), ("head_dim", dump.head_dim),
                       ("n_kv_heads", dump.n_kv_heads), ("n_heads", dump.n_heads)):
        if _metadata_int(path, metadata, key) != value:
            raise _corrupt(path, f"metadata '{key}' = {metadata[key]!r}, but the tensors have {value}")
    return dump


def write(path: str | os.PathLike[str], dump: KvDump) -> None:
    """Writes a KV dump as ``certkv dump-kv`` does. The shape metadata (format, head_dim,
    n_heads, n_kv_heads, n_tokens, layers, and n_layers and softmax_scale when absent) are
    set from the arrays; the rest of ``dump.metadata`` is written as it is. A dump whose arrays
    do not fit together raises ValueError naming them."""
    path = _path("path", path)
    if not isinstance(dump, KvDump):
        raise TypeError(f"dump: expected a certkv.kvdump.KvDump, got {type(dump).__name__}")
    problem = dump.problem()
    if problem is not None:
        raise ValueError(f"dump: {problem}")
    tensors: dict[str, Any] = {}
    for layer in dump.layers:
        tensors[f"layer{layer}.k"] = ("BF16", dump.k[layer])
        tensors[f"layer{layer}.v"] = ("BF16", dump.v[layer])
        tensors[f"layer{layer}.q"] = dump.q[layer]
    tensors["tokens"] = dump.tokens
    metadata = {"n_layers": str(max(dump.layers) + 1), "softmax_scale": f"{1 / np.sqrt(dump.head_dim):.9g}",
                **dump.metadata}
    metadata.update(format=FORMAT, head_dim=str(dump.head_dim), n_heads=str(dump.n_heads),
                    n_kv_heads=str(dump.n_kv_heads), n_tokens=str(dump.n_tokens),
                    layers=",".join(str(layer) for layer in dump.layers))
    write_safetensors(path, tensors, metadata)
