"""Freed heap pages handed back to the system after a load (which frees far more than it keeps)."""

from __future__ import annotations


def trim_heap() -> None:
    """glibc's malloc_trim(0): freed heap pages back to the system (a load frees far more than it
    keeps: tokenizer JSON, dequantized floats); nothing where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
