"""The sparse tier's RaBitQ key index and Top-p selection (docs/sparse.md), on NumPy arrays.

A :class:`Head` is one (layer, kv_head) of the index: the prefill centroids ``c_q``, ``c_k`` and
the seeded rotation P. :func:`encode_keys` makes one record per key (the sign code of
P^T (k - c_k) / ||k - c_k||, alpha, ||k - c_k||, <c_q, k>: docs/format/rabitq_index.md);
:func:`estimate_scores` estimates <q, k_t> from the records alone (seed 002, Eq. 6 over the
binary x 4-bit product, Eq. 17-20); :func:`top_p_select` chooses the tokens whose softmax mass
reaches p on logits quantized to 1/256 logit, taking the whole threshold bucket.

    head = certkv.index.Head(c_q, c_k, rotation="haar", seed=0)   # c_q, c_k: [head_dim]
    records = certkv.index.encode_keys(head, k)                   # k: [n_tokens, head_dim]
    scores = certkv.index.estimate_scores(head, records, q)       # ~ k @ q
    sel = certkv.index.top_p_select(scores / np.sqrt(head_dim), p=0.9)
    print(sel.mask.sum(), sel.threshold, sel.mass)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays
from . import _certkv

__all__ = ["HEAD_DIMS", "ROTATIONS", "Head", "TopPSelection", "record_dtype", "encode_keys",
           "estimate_scores", "top_p_select"]

HEAD_DIMS = (32, 64, 96, 128, 256)  #: the head_dims the index serves
ROTATIONS = ("haar", "hadamard")  #: Haar, or randomized Hadamard (head_dim a power of two)


def _vector(name: str, value: Any, head_dim: int | None = None) -> np.ndarray:
    array = _arrays.float32_array(name, value, 1, "[head_dim]")
    if head_dim is not None and array.shape[0] != head_dim:
        raise ValueError(f"{name}: expected head_dim {head_dim} values, got shape {array.shape}")
    return array


@dataclass(frozen=True)
class Head:
    """One (layer, kv_head) of the key index: the centroids of its prefill's queries and keys and
    the rotation P, a pure function of (rotation, head_dim, seed)."""

    c_q: np.ndarray  #: [head_dim] float32
    c_k: np.ndarray  #: [head_dim] float32
    rotation: str = "haar"
    seed: int = 0

    def __post_init__(self) -> None:
        c_q = _vector("c_q", self.c_q)
        if c_q.shape[0] not in HEAD_DIMS:
            raise ValueError(f"c_q: head_dim {c_q.shape[0]} is not one the index serves {HEAD_DIMS}")
        object.__setattr__(self, "c_q", c_q)
        object.__setattr__(self, "c_k", _vector("c_k", self.c_k, c_q.shape[0]))
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation: expected one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= int(self.seed) < 1 << 64:
            raise ValueError(f"seed: expected an integer in [0, 2^64), got {self.seed!r}")

    @property
    def head_dim(self) -> int:
        return int(self.c_q.shape[0])

    def _args(self) -> tuple[Any, ...]:
        return self.c_q, self.c_k, self.rotation, int(self.seed)


def record_dtype(head_dim: int) -> np.dtype:
    """The NumPy structured dtype of one record (docs/format/rabitq_index.md): ``code``
    (ceil(head_dim / 64) uint64 words; bit i of the code is 1 iff coordinate i of P^T k_c >= 0),
    ``alpha``, ``norm_k_centered``, ``cq_dot_k`` (float32) and ``code_popcount`` (int32)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: {head_dim!r} is not one the index serves {HEAD_DIMS}")
    dtype = np.dtype([("code", "<u8", ((head_dim + 63) // 64,)), ("alpha", "<f4"),
                      ("norm_k_centered", "<f4"), ("cq_dot_k", "<f4"), ("code_popcount", "<i4")])
    assert dtype.itemsize == _certkv.rabitq_record_bytes(head_dim)
    return dtype


def encode_keys(head: Head, k: Any) -> np.ndarray:
    """One record per key: k [n_tokens, head_dim] (float) gives [n_tokens] records of
    :func:`record_dtype`. A key equal to ``c_k`` gets code 0, alpha 1 and norm 0: its score is
    then exact."""
    if not isinstance(head, Head):
        raise TypeError(f"head: expected a certkv.index.Head, got {type(head).__name__}")
    keys = _arrays.float32_array("k", k, 2, "[n_tokens, head_dim]")
    if keys.shape[1] != head.head_dim:
        raise ValueError(f"k: head_dim {keys.shape[1]}, but the head has head_dim {head.head_dim}")
    raw = _certkv.rabitq_encode_keys(*head._args(), keys, keys.shape[0])
    return raw.view(record_dtype(head.head_dim)).reshape(keys.shape[0])


def estimate_scores(head: Head, records: np.ndarray, q: Any, rounding_seed: int = 0, *,
                    reference: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The estimated <q, k_t> of every record, float32 [n_tokens] (not scaled by the softmax
    scale). The query is centered, normalized, rotated and quantized to 4 bits with randomized
    rounding drawn from ``rounding_seed``; over the rotation's seed and the rounding, the
    estimate is unbiased. ``reference=True`` also returns the float reference estimate of the
    same quantized query (``index::rabitq_estimate_scores_ref``), equal up to float rounding.
    Records are checked as the encoder writes them (alpha in (0, 1], finite norm and <c_q, k>, no
    code bit past head_dim, the code's popcount): InvalidArgumentError names a record that is not."""
    if not isinstance(head, Head):
        raise TypeError(f"head: expected a certkv.index.Head, got {type(head).__name__}")
    dtype = record_dtype(head.head_dim)
    array = _arrays.require_array("records", records)
    if array.dtype != dtype:
        raise TypeError(f"records: expected records of head_dim {head.head_dim} (certkv.index.record_dtype), "
                        f"got {array.dtype}")
    _arrays.require_ndim("records", array, 1, "[n_tokens]")
    _arrays.require_contiguous("records", array)
    query = _vector("q", q, head.head_dim)
    if not isinstance(rounding_seed, (int, np.integer)) or not 0 <= int(rounding_seed) < 1 << 64:
        raise ValueError(f"rounding_seed: expected an integer in [0, 2^64), got {rounding_seed!r}")
    scores, scores_ref = _certkv.rabitq_estimate_scores(*head._args(), array.view(np.uint8), array.shape[0],
                                                        query, int(rounding_seed), bool(reference))
    return (scores, scores_ref) if reference else scores


@dataclass(frozen=True)
class TopPSelection:
    """The outcome of :func:`top_p_select`."""

    mask: np.ndarray  #: [n] bool: the selected tokens
    threshold: float  #: theta: the selected tokens are exactly those with logits >= theta
    bucket: int  #: B: the selected tokens are those with floor(256 (max - logit)) <= B
    n_selected: int
    mass: float  #: a lower bound on the selected set's softmax mass, >= p
    n_boundary: int  #: tokens of the threshold bucket B, all of them selected


def top_p_select(logits: Any, p: float) -> TopPSelection:
    """Top-p on logits [n] quantized to 1/256 logit (docs/sparse.md, "Top-p on quantized
    logits"): each token's bucket is a_t = min(11264, floor(256 (max(logits) - logit_t))); the
    threshold bucket B is the first, from the top, whose upper set certainly holds softmax mass p
    (exact integer bounds of each bucket's weights); every token of bucket B is taken. The set
    holds exact softmax mass >= p and contains the exact Top-p set of the same logits."""
    array = _arrays.float32_array("logits", logits, 1, "[n]")
    if array.shape[0] < 1:
        raise ValueError("logits: expected at least one logit, got shape " + str(array.shape))
    if not np.isfinite(array).all():
        raise ValueError("logits: every logit must be finite")
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) or not 0 < p <= 1:
        raise ValueError(f"p: expected a number in (0, 1], got {p!r}")
    mask, info = _certkv.top_p_select(array, float(p))
    return TopPSelection(mask=mask.astype(bool), threshold=float(info["threshold"]), bucket=int(info["bucket"]),
                         n_selected=int(info["n_selected"]), mass=float(info["mass"]),
                         n_boundary=int(info["n_boundary"]))
