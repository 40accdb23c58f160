"""The meter of one attention row (docs/meter.md): a sound upper bound on the total variation
between the attention distribution over exact keys and the one over stored (compressed) keys.

For a query q and keys K (exact) and K-hat (stored), p~ = softmax(sm_scale q . k-hat_t), and c_t
bounds the logit error of token t:

- Tier A (every lossy scheme but dither8; Theorem 2): c_t = |sm_scale| sum_b ||q_b|| w_{t,b},
  w_{t,b} the norm of k-hat_t - k_t over band b of RoPE frequency pairs. Holds for any query.
- Tier B (dither8; Lemma 2): c_t = sqrt(2 sigma_t^2 log(2 S / delta_loc)) plus the dither grid's
  slack, sigma_t^2 = sm_scale^2 sum_c q_c^2 s_{c,t}^2 / 12 with s the per-token scales of each
  group of 32 channels. Holds with probability 1 - delta_loc for queries that do not depend on
  the dither (non-adaptive).

Then A = sum_t p~_t e^{c_t} and meter = min(1, (A^2 - 1) / 2) (Theorem 1). Both functions return
the engine's double-precision reference (the C API's certkv_meter_tier_a / _tier_b) with the
true total variation beside the bound:

    row = certkv.meter.tier_a(q, k, k_hat)
    assert row.tv <= row.meter
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _arrays
from . import _certkv

__all__ = ["MeterRow", "tier_a", "tier_b"]

_ROPE_LAYOUTS = ("interleaved", "half-split")


@dataclass(frozen=True)
class MeterRow:
    """The meter of one (query, keys) row."""

    meter: float  #: min(1, (A^2 - 1) / 2), the bound on tv
    log_a: float  #: log A (inf when A overflowed: meter 1)
    tv: float  #: the true total variation between softmax over K and over K-hat
    max_bound: float  #: max_t c_t
    bounds: np.ndarray  #: [n_tokens] float64, c_t


def _row_inputs(q: Any, k: Any, k_hat: Any, sm_scale: float | None, rope_layout: str):
    q = _arrays.float32_array("q", q, 1, "[head_dim]")
    k = _arrays.float32_array("k", k, 2, "[n_tokens, head_dim]")
    k_hat = _arrays.float32_array("k_hat", k_hat, 2, "[n_tokens, head_dim]")
    d = q.shape[0]
    if k.shape[1] != d:
        raise ValueError(f"k: expected shape [n_tokens, {d}] (head_dim of q), got {k.shape}")
    if k_hat.shape != k.shape:
        raise ValueError(f"k_hat: expected the shape of k {k.shape}, got {k_hat.shape}")
    if k.shape[0] < 1:
        raise ValueError("k: expected at least one token")
    if rope_layout not in _ROPE_LAYOUTS:
        raise ValueError(f"rope_layout: expected one of {', '.join(_ROPE_LAYOUTS)}, got {rope_layout!r}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    return q, k, k_hat, scale


def _row(d: dict) -> MeterRow:
    return MeterRow(float(d["meter"]), float(d["log_a"]), float(d["tv"]), float(d["max_bound"]), d["bounds"])


def tier_a(q: Any, k: Any, k_hat: Any, *, sm_scale: float | None = None,
           rope_layout: str = "interleaved") -> MeterRow:
    """Tier A meter of one row. q: [head_dim]; k, k_hat: [n_tokens, head_dim] float arrays;
    sm_scale: the softmax scale (default 1 / sqrt(head_dim)); rope_layout: which channels form a
    RoPE pair, "interleaved" (2j, 2j+1; GGUF Llama) or "half-split" (j, j + head_dim/2; Hugging
    Face, Qwen)."""
    q, k, k_hat, scale = _row_inputs(q, k, k_hat, sm_scale, rope_layout)
    return _row(_certkv.meter_tier_a(q, k, k_hat, k.shape[0], q.shape[0], rope_layout, scale))


def tier_b(q: Any, k: Any, k_hat: Any, scales: Any, *, delta_loc: float,
           sm_scale: float | None = None, rope_layout: str = "interleaved",
           outlier_pairs: Sequence[int] = ()) -> MeterRow:
    """Tier B (dither8) meter of one row. scales: [n_tokens, head_dim / 32] float, the per-token
    scale of each group of 32 channels; delta_loc in (0, 1): the row's failure probability
    (delta_req / (layers x heads x steps) in the engine); outlier_pairs: RoPE pairs kept exact
    (increasing). head_dim: a multiple of 32, at most 256."""
    q, k, k_hat, scale = _row_inputs(q, k, k_hat, sm_scale, rope_layout)
    d = q.shape[0]
    if d % 32 != 0:
        raise ValueError(f"q: Tier B needs head_dim a multiple of 32, got {d}")
    scales = _arrays.float32_array("scales", scales, 2, "[n_tokens, head_dim / 32]")
    if scales.shape != (k.shape[0], d // 32):
        raise ValueError(f"scales: expected shape ({k.shape[0]}, {d // 32}), got {scales.shape}")
    if not 0.0 < float(delta_loc) < 1.0:
        raise ValueError(f"delta_loc: expected a value in (0, 1), got {delta_loc!r}")
    pairs = np.asarray(list(outlier_pairs), dtype=np.int64)
    if pairs.size and (pairs.min() < 0 or pairs.max() >= d // 2 or np.any(np.diff(pairs) <= 0)):
        raise ValueError(f"outlier_pairs: expected increasing pair indices in [0, {d // 2}), got {list(outlier_pairs)}")
    return _row(_certkv.meter_tier_b(q, k, k_hat, scales, k.shape[0], d, rope_layout,
                                     pairs.astype(np.uint16), scale, float(delta_loc)))
