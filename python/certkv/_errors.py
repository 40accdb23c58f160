"""Exceptions of the certkv package: one per C API status, each carrying certkv_last_error()."""

from __future__ import annotations


class CertkvError(RuntimeError):
    """A failed C API call. ``status`` is the status name ("invalid argument", "not found", ...);
    the message is the library's one-line message naming the file, flag or value at fault."""

    def __init__(self, status: str, code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class InvalidArgumentError(CertkvError, ValueError):
    """CERTKV_ERR_INVALID_ARGUMENT: a bad value (also a ValueError)."""


class NotFoundError(CertkvError, FileNotFoundError):
    """CERTKV_ERR_NOT_FOUND: a missing file (also a FileNotFoundError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptError(CertkvError):
    """CERTKV_ERR_CORRUPT: a file or encoded page the format rejects."""


class UnsupportedError(CertkvError):
    """CERTKV_ERR_UNSUPPORTED: a configuration this build or machine does not serve."""


class OutOfRangeError(CertkvError, IndexError):
    """CERTKV_ERR_OUT_OF_RANGE: a size or index past a limit (a prompt longer than the context)."""


_BY_CODE = {1: InvalidArgumentError, 2: NotFoundError, 3: CorruptError, 4: UnsupportedError,
            6: OutOfRangeError}


def error_for_status(status: str, code: int, message: str) -> CertkvError:
    """The exception for a C API status (called by the native module)."""
    error = _BY_CODE.get(code, CertkvError)(status, code, message)
    if isinstance(error, OSError):
        # OSError's constructor takes (errno, strerror); keep the library's message as the text.
        error.args = (message,)
    return error
