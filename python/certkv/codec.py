"""GAAC, the lossless exponent codec of certkv's KV cache (docs/gaac.md), on NumPy arrays.

Rows are one stream of KV: ``[n_tokens, head_dim]`` elements of one (layer, K or V, kv_head), in
token order, as bf16 bit patterns (``uint16``, or ``ml_dtypes.bfloat16``) or FP8 bytes
(``uint8`` with ``element="e4m3"`` / ``"e5m2"``, or ml_dtypes' float8 arrays). As the cache
does, every complete page of ``block_tokens`` rows is coded into a slot of fixed size; a page
whose escapes do not fit its slot, and the partial last page, are kept raw. Decoding gives back
every bit: NaN payloads, infinities, subnormals and -0 included.

    cal = certkv.codec.calibrate(rows)          # bases and escape capacity, from the rows
    enc = certkv.codec.encode(rows, cal)        # slots, raw pages, tail
    assert (certkv.codec.decode(enc) == rows).all()
    certkv.codec.verify(rows, cal)              # the same, as a report

The lossy schemes' page codecs (fp8, rtn, kivi2, dither8; docs/format/) are here too, a page of
``block_tokens`` bf16 rows at a time, with the meter's side data in each page: the bytes and the
reconstruction are those a :class:`certkv.KvStore` holding the same rows keeps and attends over.

    pages = certkv.codec.lossy_encode(rows, "dither8", key=True, layer=3, kv_head=1)
    k_hat = certkv.codec.lossy_decode(pages)   # float32 [n_tokens, head_dim]: what attention reads
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays
from . import _certkv

__all__ = ["Calibration", "Encoded", "VerifyReport", "calibrate", "encode", "decode", "verify", "LossyPages",
           "lossy_encode", "lossy_decode"]


@dataclass(frozen=True)
class Calibration:
    """GAAC's parameters of one stream: per channel the bases of the 3-bit window [b3, b3 + 8)
    and the 4-bit window [b4, b4 + 16) of exponents, and the escape bytes a slot holds."""

    element: str  #: "bf16", "e4m3" or "e5m2"
    block_tokens: int  #: rows per page
    head_dim: int
    b3: np.ndarray  #: [head_dim] uint8
    b4: np.ndarray  #: [head_dim] uint8
    escape_capacity_bytes: int

    def _codec(self) -> Any:
        return _certkv.GaacCodec(self.element, self.block_tokens, self.head_dim,
                                 np.ascontiguousarray(self.b3, dtype=np.uint8),
                                 np.ascontiguousarray(self.b4, dtype=np.uint8),
                                 int(self.escape_capacity_bytes))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one coded page: the fixed part plus the escape capacity."""
        return int(self._codec().slot_bytes)


@dataclass(frozen=True)
class Encoded:
    """A stream of rows coded as the cache stores it."""

    calibration: Calibration
    n_tokens: int
    slots: np.ndarray  #: [n_pages, slot_bytes] uint8, one per complete page
    used_bytes: np.ndarray  #: [n_pages] uint64: bytes written, 0 where the page did not fit
    raw_pages: np.ndarray  #: [n_raw, block_tokens, head_dim]: the pages that did not fit, in order
    tail: np.ndarray  #: [n_tokens % block_tokens, head_dim]: the partial last page, raw

    @property
    def fits(self) -> np.ndarray:
        """[n_pages] bool: the pages coded into their slot."""
        return self.used_bytes > 0

    @property
    def stored_bytes(self) -> int:
        """Slots of the pages that fit, plus the raw pages and the tail (no block table)."""
        return int(self.fits.sum()) * self.calibration.slot_bytes + self.raw_pages.nbytes + self.tail.nbytes

    @property
    def ratio(self) -> float:
        """Raw bytes / stored bytes."""
        raw = self.n_tokens * self.calibration.head_dim * _arrays.ELEMENT_BITS[self.calibration.element].itemsize
        return raw / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`."""

    ok: bool  #: every bit came back
    n_tokens: int
    pages: int  #: complete pages
    raw_pages: int  #: of them, kept raw (escapes past the slot)
    stored_bytes: int
    ratio: float  #: raw bytes / stored bytes
    first_mismatch: tuple[int, int] | None  #: (token, channel) of the first differing element


def _rows(rows: Any, element: str | None) -> tuple[np.ndarray, str]:
    array, element = _arrays.element_bits("rows", rows, element)
    _arrays.require_ndim("rows", array, 2, "[n_tokens, head_dim]")
    _arrays.require_contiguous("rows", array)
    if array.shape[0] < 1:
        raise ValueError("rows: expected at least one row, got shape " + str(array.shape))
    return array, element


def calibrate(rows: Any, block_tokens: int = 16, element: str | None = None) -> Calibration:
    """Calibrates GAAC on one stream of rows [n_tokens, head_dim] (see the module's doc for the
    dtypes). Calibrate on text as long as the deployment's: RoPE drifts key exponents with
    position. head_dim must be one GAAC tiles (a multiple of 8 in equal tiles of at most 128)."""
    array, element = _rows(rows, element)
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens: expected an integer >= 1, got {block_tokens!r}")
    b3, b4, capacity = _certkv.gaac_calibrate(element, block_tokens, array.shape[1], array, array.shape[0])
    return Calibration(element, block_tokens, int(array.shape[1]), b3, b4, int(capacity))


def _element_of(calibration: Any) -> str | None:
    return calibration.element if isinstance(calibration, Calibration) else None


def _check_matches(array: np.ndarray, element: str, calibration: Calibration) -> None:
    if not isinstance(calibration, Calibration):
        raise TypeError(f"calibration: expected a certkv.codec.Calibration, got {type(calibration).__name__}")
    if element != calibration.element:
        raise ValueError(f"rows: element {element!r}, but the calibration is for {calibration.element!r}")
    if array.shape[1] != calibration.head_dim:
        raise ValueError(f"rows: head_dim {array.shape[1]}, but the calibration has head_dim {calibration.head_dim}")


def encode(rows: Any, calibration: Calibration, element: str | None = None) -> Encoded:
    """Codes the complete pages of rows [n_tokens, head_dim] into slots; keeps raw the pages that
    do not fit and the partial last page."""
    array, element = _rows(rows, element or _element_of(calibration))
    _check_matches(array, element, calibration)
    bt, d = calibration.block_tokens, calibration.head_dim
    n_pages = array.shape[0] // bt
    pages = array[: n_pages * bt].reshape(n_pages, bt, d)
    slots, used = _certkv.gaac_encode(calibration._codec(), np.ascontiguousarray(pages), n_pages)
    return Encoded(calibration, int(array.shape[0]), slots, used, pages[used == 0].copy(),
                   array[n_pages * bt:].copy())


def decode(encoded: Encoded) -> np.ndarray:
    """The rows [n_tokens, head_dim] an :func:`encode` coded, as bit patterns (uint16 or uint8).
    A slot the format rejects raises :class:`certkv.CorruptError`."""
    if not isinstance(encoded, Encoded):
        raise TypeError(f"encoded: expected a certkv.codec.Encoded, got {type(encoded).__name__}")
    cal = encoded.calibration
    dtype = _arrays.ELEMENT_BITS[cal.element]
    n_pages = encoded.slots.shape[0]
    fits = encoded.fits
    coded = np.zeros((int(fits.sum()), cal.block_tokens, cal.head_dim), dtype=dtype)
    _certkv.gaac_decode(cal._codec(), np.ascontiguousarray(encoded.slots[fits]), coded.shape[0], coded)
    out = np.empty((encoded.n_tokens, cal.head_dim), dtype=dtype)
    pages = out[: n_pages * cal.block_tokens].reshape(n_pages, cal.block_tokens, cal.head_dim)
    pages[fits] = coded
    pages[~fits] = encoded.raw_pages
    out[n_pages * cal.block_tokens:] = encoded.tail
    return out


def verify(rows: Any, calibration: Calibration, element: str | None = None) -> VerifyReport:
    """Encodes and decodes rows and compares every bit."""
    encoded = encode(rows, calibration, element)
    array, _ = _rows(rows, element or _element_of(calibration))
    decoded = decode(encoded)
    diff = np.argwhere(decoded != array)
    return VerifyReport(ok=diff.shape[0] == 0, n_tokens=encoded.n_tokens, pages=int(encoded.slots.shape[0]),
                        raw_pages=int(encoded.raw_pages.shape[0]), stored_bytes=encoded.stored_bytes,
                        ratio=encoded.ratio,
                        first_mismatch=tuple(int(i) for i in diff[0]) if diff.shape[0] else None)


@dataclass(frozen=True)
class LossyPages:
    """Pages of a lossy scheme (:func:`lossy_encode`): ``pages`` uint8 ``[n_pages, page_bytes]``,
    ``encoded`` bool ``[n_pages]`` (False: the encoder refused the block, a value not finite or a
    scale past fp16; the cache keeps such a block exact), and the codec they were made with."""
    kv: str
    key: bool
    block_tokens: int
    head_dim: int
    rope_layout: str
    witness: str | None
    layer: int
    kv_head: int
    outlier_pairs: tuple[int, ...]
    first_block: int
    pages: np.ndarray
    encoded: np.ndarray

    def _codec(self) -> Any:
        return _certkv.LossyCodec(self.kv, self.key, self.block_tokens, self.head_dim, self.rope_layout,
                                  self.witness, self.layer, self.kv_head, list(self.outlier_pairs))


def lossy_encode(rows: Any, kv: str, *, key: bool = True, block_tokens: int = 16,
                 rope_layout: str = "interleaved", witness: str | None = None, layer: int = 0, kv_head: int = 0,
                 outlier_pairs: Any = (), first_block: int = 0) -> LossyPages:
    """Encodes rows ``[n_tokens, head_dim]`` of bf16 values (uint16 bit patterns or
    ``ml_dtypes.bfloat16``; n_tokens a multiple of block_tokens) into pages of the lossy scheme
    ``kv``: K pages (``key=True``: the Tier A witness, dither8's dither and outlier pairs) or V
    pages. Page i is block ``first_block + i`` of its sequence (dither8's counter); ``layer`` and
    ``kv_head`` name the stream dither8's dither is keyed by, as a KvStore's layer and kv head.
    Bad arguments raise ``certkv.InvalidArgumentError`` or ``UnsupportedError`` naming them."""
    array, _ = _rows(rows, "bf16")
    if not isinstance(kv, str):
        raise TypeError(f"kv: expected a scheme name (str), got {type(kv).__name__}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens: expected an int >= 1, got {block_tokens!r}")
    if array.shape[0] % block_tokens:
        raise ValueError(f"rows: {array.shape[0]} rows are not whole pages of block_tokens {block_tokens}")
    pairs = tuple(int(p) for p in outlier_pairs)
    pages = LossyPages(kv, bool(key), block_tokens, int(array.shape[1]), rope_layout, witness, int(layer), int(kv_head),
                       pairs, int(first_block), np.empty((0, 0), np.uint8), np.empty(0, bool))
    n_pages = array.shape[0] // block_tokens
    data, encoded = _certkv.lossy_encode(pages._codec(), array.view(np.uint16), n_pages, pages.first_block)
    return LossyPages(**{**pages.__dict__, "pages": data, "encoded": encoded.astype(bool)})


def lossy_decode(pages: LossyPages) -> np.ndarray:
    """The reconstruction attention reads of every page: float32 ``[n_pages * block_tokens,
    head_dim]`` (a page the encoder refused decodes to whatever its bytes hold: keep those rows'
    exact values, as the cache does)."""
    if not isinstance(pages, LossyPages):
        raise TypeError(f"pages: expected a certkv.codec.LossyPages, got {type(pages).__name__}")
    n_pages = pages.pages.shape[0]
    out = _certkv.lossy_decode(pages._codec(), np.ascontiguousarray(pages.pages), n_pages, pages.first_block)
    return out.reshape(n_pages * pages.block_tokens, pages.head_dim)
