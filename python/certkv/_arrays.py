"""Argument checks shared by certkv.codec and certkv.meter: a wrong dtype, shape or layout is a
TypeError or ValueError naming the argument and what was expected, before any native call."""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # ml_dtypes is optional: its bfloat16 and float8 arrays are viewed as their bit patterns.
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

# The element names of certkv.codec, the NumPy dtype of their bit patterns, and the ml_dtypes
# type whose arrays are accepted as that element.
ELEMENT_BITS = {"bf16": np.dtype(np.uint16), "e4m3": np.dtype(np.uint8), "e5m2": np.dtype(np.uint8)}
_ML_DTYPE_ELEMENT = {"bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def require_array(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(value).__name__}")
    return value


def require_contiguous(name: str, array: np.ndarray) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (use numpy.ascontiguousarray), "
                         f"got strides {array.strides} for shape {array.shape}")


def require_ndim(name: str, array: np.ndarray, ndim: int, what: str) -> None:
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {what}, got shape {array.shape}")


def element_bits(name: str, value: Any, element: str | None) -> tuple[np.ndarray, str]:
    """The array as bit patterns (uint16 for bf16, uint8 for FP8) and its element name.

    uint16 arrays are bf16; uint8 arrays need ``element`` ("e4m3" or "e5m2"); ml_dtypes arrays
    (bfloat16, float8_e4m3fn, float8_e5m2) are viewed as their bits."""
    array = require_array(name, value)
    if element is not None and element not in ELEMENT_BITS:
        raise ValueError(f"element: expected one of {', '.join(ELEMENT_BITS)}, got {element!r}")
    ml_element = _ML_DTYPE_ELEMENT.get(array.dtype.name) if _ml_dtypes is not None else None
    if ml_element is not None:
        if element is not None and element != ml_element:
            raise ValueError(f"{name}: an array of {array.dtype.name} is element {ml_element!r}, "
                             f"not {element!r}")
        element = ml_element
        array = array.view(ELEMENT_BITS[element])
    elif array.dtype == np.uint16:
        if element not in (None, "bf16"):
            raise TypeError(f"{name}: uint16 holds bf16 bit patterns, but element is {element!r} "
                            "(FP8 elements are uint8)")
        element = "bf16"
    elif array.dtype == np.uint8:
        if element not in ("e4m3", "e5m2"):
            raise TypeError(f"{name}: uint8 holds FP8 bytes; pass element='e4m3' or 'e5m2'")
    else:
        raise TypeError(f"{name}: expected bf16 bit patterns (uint16, or ml_dtypes.bfloat16) or FP8 "
                        f"bytes (uint8, or ml_dtypes float8_e4m3fn / float8_e5m2), got {array.dtype}")
    return array, element


def float32_array(name: str, value: Any, ndim: int, what: str) -> np.ndarray:
    """A float32, C-contiguous array of ndim dimensions (float16/float64 are converted; other
    dtypes are a TypeError)."""
    array = require_array(name, value)
    if array.dtype.kind != "f":
        raise TypeError(f"{name}: expected a floating-point array (float32), got {array.dtype}")
    require_ndim(name, array, ndim, what)
    require_contiguous(name, array)
    return np.ascontiguousarray(array, dtype=np.float32)
