"""certkv as the KV cache of a Hugging Face transformers model (PyTorch, CPU or CUDA tensors).

    import certkv.transformers as ct
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="certkv")
    cache = ct.CertkvCache(model.config, scheme="dither8")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32, do_sample=False)
    print(cache.certificate())

``CertkvCache`` is a ``transformers.Cache`` whose layers keep K and V in the pages of a certkv KV
scheme (a :class:`certkv.KvStore`, one store sequence per batch row). With
``attn_implementation="certkv"`` (registered through ``transformers.AttentionInterface`` when this
module is imported) attention runs in certkv's decode attention over the pages, with the meter of
every (layer, query head, decode step); the cache's ``certificate()`` reports it. With another
attention implementation the cache hands the model its K and V read back from the pages (what
attention would read: lossless for gaac, the reconstruction for a lossy scheme), unmetered.

On CUDA tensors the store is a KvStore of device "cuda": its pages live in the memory of the
model's device and its work is enqueued on torch's current stream of that device. Only
``attn_implementation="certkv"`` is served there (the pages are read by certkv's attention, never
handed back to the model). Each layer's new rows of the whole batch are appended in one launch and
a decode step of the whole batch attends in one launch (``torch.ops.certkv.kv_store_decode``),
metered as on the CPU. A prompt (several tokens into an empty cache) attends exactly, through
transformers' SDPA over its own rows (no page has been read yet), and its rows are then appended.
A later chunk of several tokens (a prompt given in parts) attends as that many decode steps, each
position's rows appended and attending in turn: each reads what a decode step there reads and is
metered as one (on the CPU a later chunk runs certkv's prefill attention, unmetered), at two
launches per position and layer. ``crop``, ``reorder_cache``, ``batch_repeat_interleave`` and
``batch_select_indices`` share whole blocks and copy a partial last block's raw pages on the
device; with a lossy scheme (fp8-e4m3, fp8-e5m2, dither8) a crop must not end inside a block the
device already encoded (its exact values are not kept: ``certkv.UnsupportedError``; a multiple of
16 positions, or a point inside the partial last block, is always served). Not served on CUDA: the
schemes the device does not serve (kivi2, rtn4, ...; ``certkv.UnsupportedError`` naming the
scheme), and CUDA graph capture (each append keeps host bookkeeping).

Batches: left padding (generate's default for decoder-only models) is read from the attention
mask; padded positions are not stored. transformers and torch are imported by this module only.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import _certkv
from ._errors import UnsupportedError
from .kv_store import KvStore

__all__ = ["CertkvCache", "certkv_attention", "ATTENTION_NAME"]

#: The name of certkv's attention function in transformers.AttentionInterface.
ATTENTION_NAME = "certkv"

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEVICE_BLOCK_TOKENS = 16  # a cuda store's block size (the device serves 16 only)

# certkv_attention receives the model's tensors, not its cache: CertkvCache's update records
# itself here, per thread and layer, for the attention call that follows it.
_current = threading.local()


def _current_caches() -> dict[int, "CertkvCache"]:
    if not hasattr(_current, "caches"):
        _current.caches = {}
    return _current.caches


def _numpy_rows(name: str, x: torch.Tensor) -> np.ndarray:
    """[n_kv_heads, n, head_dim] of one batch row as NumPy: bf16 as its bits (a view through
    int16), float16 and float32 as float32."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy()
    return x.to(torch.float32).numpy()


class _CertkvLayer(CacheLayerMixin):
    """One layer of a CertkvCache: positions seen (padding included), as transformers counts them;
    the rows live in the cache's store."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: "CertkvCache", layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache._start(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self._cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder_cache(beam_idx)

    def reset(self) -> None:
        raise NotImplementedError("CertkvCache: make a new cache instead of reset()")


class CertkvCache(Cache):
    """A transformers Cache keeping K and V in certkv pages of ``scheme`` (a name of
    ``certkv.kv_schemes()``: "bf16", "gaac", "dither8", "fp8-e4m3", ...).

    config: the model's config (layers, heads, head_dim). Options are those of
    :class:`certkv.KvStore` (block_tokens, max_tokens, gaac_calibration, meter_tau, ...);
    rope_layout defaults to "half-split", Hugging Face's RoPE layout. The store's device is that of
    the first K and V the cache is given (CPU or CUDA; see the module's documentation). On the CPU
    keep n_threads at 1 (the default): the store attends on the calling thread, while torch's own
    threads hold the cores between its operators (2 threads made decode attention 5x slower)."""

    def __init__(self, config: Any, scheme: str = "gaac", **store_options: Any) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.n_layers = int(text.num_hidden_layers)
        self.n_heads = int(text.num_attention_heads)
        self.n_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.n_heads)
        names = [s["name"] for s in _certkv.kv_schemes()]
        if scheme not in names:
            raise ValueError(f"scheme: unknown KV scheme {scheme!r} (available: {', '.join(names)})")
        for option in ("device", "cuda_stream"):
            if option in store_options:
                raise ValueError(f"{option}: CertkvCache takes the device (and torch's current stream) of the "
                                 f"model's tensors; do not pass it")
        self.scheme = scheme
        self._config = config
        self._options = dict(store_options)
        self._options.setdefault("rope_layout", "half-split")
        self._options.setdefault("sm_scale", self.head_dim ** -0.5)
        self.store: KvStore | None = None
        self.device: torch.device | None = None  # of the store, from the first update
        self._handle = 0  # the store's name in torch.ops.certkv (CUDA)
        self._pads: list[int] = []  # per batch row: padded positions not stored (left padding)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # CUDA: the rows counted at (kv_length, n_new), reused by every layer of that forward pass
        # (one copy from the device per pass; kv_length only grows on CUDA).
        self._counts_at: tuple[int, int] | None = None
        self._counts: list[int] = []
        super().__init__(layers=[_CertkvLayer(self, i) for i in range(self.n_layers)])

    # -- the store ------------------------------------------------------------------------------

    def _start(self, key_states: torch.Tensor) -> None:
        if self.store is not None:
            return
        if key_states.device.type not in ("cpu", "cuda"):
            raise ValueError(f"CertkvCache: served on CPU and CUDA tensors, not on device {key_states.device}")
        if key_states.dtype not in _DTYPES:
            raise TypeError(f"key_states: expected bfloat16, float16 or float32, got {key_states.dtype}")
        if key_states.ndim != 4 or key_states.shape[1] != self.n_kv_heads or key_states.shape[3] != self.head_dim:
            raise ValueError(f"key_states: expected shape [batch, {self.n_kv_heads}, n_tokens, {self.head_dim}] "
                             f"(the config's num_key_value_heads and head_dim), got {tuple(key_states.shape)}")
        batch = key_states.shape[0]
        options = dict(self._options)
        options.setdefault("max_tokens", max(4096, int(getattr(self._config, "max_position_embeddings", 0) or 0)) * batch)
        shape = dict(n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                     n_sequences=batch)
        device = key_states.device
        if device.type == "cuda":
            from . import torch_ops  # torch.ops.certkv: the CPU path does without it

            with torch.cuda.device(device):  # the store's pages go to the current device
                self.store = KvStore(self.scheme, **shape, device="cuda",
                                     cuda_stream=torch.cuda.current_stream(device).cuda_stream, **options)
            self._handle = torch_ops.register_store(self.store)
        else:
            self.store = KvStore(self.scheme, **shape, **options)
        self.device = device
        self._pads = [0] * batch

    def _check(self, name: str, x: torch.Tensor, like: torch.Tensor | None = None) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"{name}: expected a tensor on {self.device} (the device of the cache's first update), "
                             f"got {x.device}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
        batch = self.store.n_sequences if self.store is not None else x.shape[0]
        if x.ndim != 4 or x.shape[0] != batch or x.shape[1] != self.n_kv_heads or x.shape[3] != self.head_dim:
            raise ValueError(f"{name}: expected shape [{batch}, {self.n_kv_heads}, n_tokens, {self.head_dim}] "
                             f"([batch, num_key_value_heads, n_tokens, head_dim]), got {tuple(x.shape)}")
        if like is not None and (x.shape != like.shape or x.dtype != like.dtype):
            raise ValueError(f"{name}: expected the shape and dtype of key_states {tuple(like.shape)} {like.dtype}, "
                             f"got {tuple(x.shape)} {x.dtype}")

    def _attention_is_certkv(self) -> bool:
        text = self._config.get_text_config() if hasattr(self._config, "get_text_config") else self._config
        return getattr(text, "_attn_implementation", None) == ATTENTION_NAME

    def _update(self, layer: _CertkvLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        self._check("key_states", key_states)
        self._check("value_states", value_states, key_states)
        attention_is_certkv = self._attention_is_certkv()
        if self.device.type == "cuda" and not attention_is_certkv:
            raise ValueError("CertkvCache: the CUDA pages are read by certkv's attention only: use "
                             f"attn_implementation={ATTENTION_NAME!r}")
        if attention_is_certkv:
            # certkv_attention appends them (it sees the mask, hence the padding) and attends.
            if layer.layer_idx in self._pending:
                raise RuntimeError(f"CertkvCache: layer {layer.layer_idx}'s previous K and V were not used by "
                                   f"attn_implementation {ATTENTION_NAME!r}")
            self._pending[layer.layer_idx] = (key_states, value_states)
            _current_caches()[layer.layer_idx] = self
            layer.seen += key_states.shape[2]
            return key_states, value_states
        # Another attention implementation: store every position, hand back what the pages hold.
        n = key_states.shape[2]
        for b in range(self.store.n_sequences):
            self.store.append(b, layer.layer_idx, _numpy_rows("key_states", key_states[b]),
                              _numpy_rows("value_states", value_states[b]))
        layer.seen += n
        keys = torch.stack([torch.from_numpy(self.store.read(b, layer.layer_idx, "k")) for b in range(self.store.n_sequences)])
        values = torch.stack([torch.from_numpy(self.store.read(b, layer.layer_idx, "v")) for b in range(self.store.n_sequences)])
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    # -- what transformers asks of a cache ------------------------------------------------------

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` positions (transformers >= 5.17), or keeps the
        first ``tokens_to_remove`` when it is positive (the older convention)."""
        seen = self.layers[0].seen
        keep = seen + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, seen)
        if keep < 0:
            raise ValueError(f"tokens_to_remove: {tokens_to_remove} removes more than the {seen} positions held")
        if keep == seen or self.store is None:
            return
        if self.device.type == "cuda":
            self._check_crop_on_cuda(keep)
        for b in range(self.store.n_sequences):
            self.store.crop(b, max(0, keep - self._pads[b]))
            self._pads[b] = min(self._pads[b], keep)
        for layer in self.layers:
            layer.seen = keep
        self._counts_at = None

    def _check_crop_on_cuda(self, keep: int) -> None:
        """Refuses a crop the device would refuse for some row, before any row is cropped: with a
        lossy scheme, a row's crop point inside a whole block (encoded; its exact values are not
        kept on the device). Blocks the encoder kept exact would be served; they are refused
        here too."""
        if not next((s["lossy"] for s in _certkv.kv_schemes() if s["name"] == self.scheme), True):
            return
        for b in range(self.store.n_sequences):
            kept, held = max(0, keep - self._pads[b]), self.store.length(b, 0)
            if kept % _DEVICE_BLOCK_TOKENS and (kept // _DEVICE_BLOCK_TOKENS + 1) * _DEVICE_BLOCK_TOKENS <= held:
                raise UnsupportedError(
                    "CERTKV_ERR_UNSUPPORTED", 4,
                    f"CertkvCache.crop: row {b} would keep {kept} of its {held} positions, inside block "
                    f"{kept // _DEVICE_BLOCK_TOKENS}, which the device keeps only as a lossy {self.scheme} page (its "
                    f"exact values are not kept); crop to a multiple of {_DEVICE_BLOCK_TOKENS} positions or within "
                    f"the partial last block")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Sequence i becomes what sequence beam_idx[i] was (beam search); pages are shared."""
        if self.store is None:
            return
        src = [int(i) for i in beam_idx.tolist()]
        self.store.reorder(src)
        self._pads = [self._pads[i] for i in src]
        self._counts_at = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence repeated ``repeats`` times in place (rows i * repeats to i * repeats +
        repeats - 1 are what row i was), as DynamicCache's: several samples of one prompt, whose
        copies share its pages (reference counts, no copy)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
        if self.store is None:
            return
        self._select([i for i in range(self.store.n_sequences) for _ in range(repeats)], "batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only the rows ``indices`` selects are kept, in its order (an index tensor or list, or a
        boolean mask over the rows), as DynamicCache's ``keys[indices]``; a row kept twice shares
        its pages."""
        if self.store is None:
            return
        rows = torch.arange(self.store.n_sequences)
        try:
            src = rows[torch.as_tensor(indices, device="cpu")].reshape(-1).tolist()
        except IndexError as e:
            raise IndexError(f"indices: {e} (the cache holds {self.store.n_sequences} rows)") from None
        self._select(src, "batch_select_indices")

    def _select(self, src: list[int], what: str) -> None:
        if not src:
            raise ValueError(f"CertkvCache.{what}: no row would be left")
        self.store.select(src)
        self._pads = [self._pads[i] for i in src]
        self._counts_at = None

    def certificate(self) -> dict[str, Any]:
        """The certificate of the attention so far: scheme, metered; for a lossy scheme with
        attn_implementation "certkv" the tier, tau, coverage, meter_max, meter_p50, meter_p99
        over the (layer, query head, decode step) cells; the KV bytes by storage class."""
        if self.store is None:
            return {"scheme": self.scheme, "metered": False, "kv_tokens": 0}
        return self.store.certificate()


def _valid_suffixes(attention_mask: torch.Tensor | None, batch: int, n_new: int, kv_length: int) -> list[int]:
    """How many of the n_new positions of each batch row are real tokens, from the mask (True or 0:
    attend) of the row's last query: with left padding, the real tokens are a suffix. One copy
    from the mask's device for the whole batch."""
    if attention_mask is None:
        return [n_new] * batch
    rows = attention_mask[:, 0, -1, kv_length - n_new:kv_length].expand(batch, n_new)
    valid = rows if rows.dtype == torch.bool else rows == 0
    counts = valid.sum(-1)
    suffix = torch.arange(n_new, device=valid.device) >= (n_new - counts)[:, None]
    *counts_list, left_padded = torch.cat([counts, (valid == suffix).all().view(1).to(counts.dtype)]).tolist()
    if not left_padded:
        raise ValueError("attention_mask: certkv attention takes left padding (each row's padding before its "
                         "tokens); this mask has padding after a token")
    return counts_list


def _certkv_attention_cuda(module: torch.nn.Module, cache: CertkvCache, layer_idx: int, query: torch.Tensor,
                           k_new: torch.Tensor, v_new: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None, **kwargs: Any) -> torch.Tensor:
    """certkv_attention on CUDA tensors: the rows of the whole batch appended in one launch, a
    decode step in one (torch.ops.certkv.kv_store_decode); a prompt into an empty cache attends
    exactly over its own rows (transformers' SDPA: no page has been read yet); a later chunk of
    several tokens attends as that many decode steps (_chunk_as_decode_steps)."""
    store = cache.store
    batch, n_heads, n_new, head_dim = query.shape
    kv_length = cache.layers[layer_idx].seen
    stream = torch.cuda.current_stream(cache.device).cuda_stream
    if stream != store.cuda_stream:
        # The store enqueues on the stream it was made with: on another, its reads of the rows
        # below would race with torch's reuse of their memory.
        raise RuntimeError(f"CertkvCache: torch's current stream ({stream:#x}) is not the one the cache's store was "
                           f"made with ({store.cuda_stream:#x})")
    if cache._counts_at != (kv_length, n_new):
        cache._counts = _valid_suffixes(attention_mask, batch, n_new, kv_length)
        cache._counts_at = (kv_length, n_new)
    counts = cache._counts
    if layer_idx == 0:
        for b in range(batch):
            cache._pads[b] += n_new - counts[b]
    if n_new > 1 and kv_length != n_new:
        return _chunk_as_decode_steps(cache, layer_idx, query, k_new, v_new, counts)
    seqs = [b for b in range(batch) if counts[b] > 0]
    prompt_out = None
    if n_new > 1:
        prompt_out, _ = sdpa_attention_forward(module, query, k_new, v_new, attention_mask, dropout=0.0,
                                               scaling=scaling, **kwargs)
    if seqs:
        def rows(x: torch.Tensor) -> torch.Tensor:
            """x [batch, heads, n_new, head_dim] as rows [sum of counts, heads, head_dim] float32,
            C-contiguous, those of seqs[0] first (each row's tokens are the last counts[b])."""
            if len(seqs) == batch and all(c == n_new for c in counts):
                # .to() returns a float32 view as it is (strided): .contiguous() makes the rows.
                return x.transpose(1, 2).to(torch.float32).contiguous()
            return torch.cat([x[b, :, n_new - counts[b]:].transpose(0, 1) for b in seqs]).to(torch.float32)

        k, v = rows(k_new), rows(v_new)
        with torch.cuda.device(cache.device):  # the store launches on the current device
            store.append_device(layer_idx, seqs, [counts[b] for b in seqs], k.data_ptr(), v.data_ptr())
            if prompt_out is not None and cache._options.get("sparse") is not None:
                # The prompt's queries make the key index's query centroid, as on the CPU, where
                # the store attends the prompt itself.
                q = rows(query)
                store.note_queries_device(layer_idx, seqs, [counts[b] for b in seqs], q.data_ptr())
    if prompt_out is not None:
        return prompt_out
    out = torch.zeros((batch, 1, n_heads, head_dim), dtype=torch.float32, device=query.device)
    if seqs:
        q = query[:, :, 0, :] if len(seqs) == batch else query[seqs, :, 0, :]
        q = q.to(torch.float32).contiguous()
        rows, _ = torch.ops.certkv.kv_store_decode(cache._handle, layer_idx, seqs, q)
        if len(seqs) == batch:
            return rows.unsqueeze(1).to(query.dtype)
        out[seqs, 0] = rows
    return out.to(query.dtype)


def _chunk_as_decode_steps(cache: CertkvCache, layer_idx: int, query: torch.Tensor, k_new: torch.Tensor,
                           v_new: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """A later chunk of n_new tokens on CUDA (chunked prefill, assisted decoding's candidates): for
    each position in turn, the rows that have a token there are appended and attend in one decode
    launch over every page before them and their own row, as n_new decode steps would, so each row
    reads what a decode step at its position reads, and each is metered as one. The cost is two
    launches per position and layer: long prompts are better given in one call."""
    batch, n_heads, n_new, head_dim = query.shape
    out = torch.zeros((batch, n_new, n_heads, head_dim), dtype=torch.float32, device=query.device)
    for i in range(n_new):
        seqs = [b for b in range(batch) if counts[b] >= n_new - i]  # left padding: a row's tokens end the chunk
        if not seqs:
            continue
        k = k_new[seqs, :, i].to(torch.float32).contiguous()  # [rows, n_kv_heads, head_dim]
        v = v_new[seqs, :, i].to(torch.float32).contiguous()
        with torch.cuda.device(cache.device):
            cache.store.append_device(layer_idx, seqs, [1] * len(seqs), k.data_ptr(), v.data_ptr())
        q = query[seqs, :, i, :].to(torch.float32).contiguous()
        rows, _ = torch.ops.certkv.kv_store_decode(cache._handle, layer_idx, seqs, q)
        out[seqs, i] = rows
    return out.to(query.dtype)


def certkv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface "certkv"): appends the layer's new K and V
    to the CertkvCache's pages and runs certkv's attention over them: decode attention with the
    meter for one new token, causal prefill attention for several. query: [batch, n_heads, n_new,
    head_dim]; returns [batch, n_new, n_heads, head_dim]. On CUDA tensors a prompt attends exactly
    (SDPA over its own rows) and a later chunk of several tokens as that many decode steps (see the
    module's documentation)."""
    past = kwargs.get("past_key_values")
    layer_idx = getattr(module, "layer_idx", None)
    cache = _current_caches().pop(layer_idx, None) if layer_idx is not None else None
    if cache is None or layer_idx not in cache._pending:
        raise RuntimeError(f"attn_implementation {ATTENTION_NAME!r} needs past_key_values=CertkvCache(...) "
                           f"(and use_cache=True); got {type(past).__name__ if past is not None else 'no cache'}")
    if dropout and module.training:
        raise ValueError("dropout: certkv attention is for inference (dropout must be 0)")
    k_new, v_new = cache._pending.pop(layer_idx)
    store = cache.store
    if scaling is not None and not math.isclose(float(scaling), cache._options["sm_scale"], rel_tol=1e-6):
        raise ValueError(f"scaling: the model's softmax scale {scaling} is not the cache's sm_scale "
                         f"{cache._options['sm_scale']} (pass sm_scale= to CertkvCache)")
    if query.device != cache.device:
        raise ValueError(f"query: expected a tensor on {cache.device} (the device of the cache's K and V), got "
                         f"{query.device}")
    if cache.device.type == "cuda":
        return _certkv_attention_cuda(module, cache, layer_idx, query, k_new, v_new, attention_mask, scaling,
                                      **kwargs), None
    batch, n_heads, n_new, head_dim = query.shape
    kv_length = cache.layers[layer_idx].seen
    out = torch.zeros((batch, n_new, n_heads, head_dim), dtype=torch.float32)
    counts = _valid_suffixes(attention_mask, batch, n_new, kv_length)
    for b in range(batch):
        n_valid = counts[b]
        if layer_idx == 0:
            cache._pads[b] += n_new - n_valid
        if n_valid == 0:
            continue
        store.append(b, layer_idx, _numpy_rows("key", k_new[b, :, n_new - n_valid:]),
                     _numpy_rows("value", v_new[b, :, n_new - n_valid:]))
        q = query[b, :, n_new - n_valid:].transpose(0, 1).to(torch.float32).contiguous().numpy()
        rows = out[b, n_new - n_valid:].numpy()
        store.attend(b, layer_idx, q[0] if n_valid == 1 else q, out=rows[0] if n_valid == 1 else rows)
    return out.to(query.dtype), None


transformers.AttentionInterface.register(ATTENTION_NAME, certkv_attention)
# The mask certkv_attention reads: sdpa's (a boolean mask, or none for plain causal attention).
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
