"""What the command-line tools share."""

from __future__ import annotations

import argparse


def gpu_unavailable_reason():
    """None when CuPy imports and sees a device, else why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA install that fails on import
        return f"cupy is not importable ({type(exc).__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver / no device
        return f"no CUDA device ({type(exc).__name__})"
    return None if n > 0 else "no CUDA device"


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
