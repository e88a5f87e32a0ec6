"""Which array library an array belongs to, and dtype facts, without importing CuPy eagerly."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
SUPPORTED_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
# The 16-bit kernels' element type T in their template name expressions (common.cuh's Fp16, Bf16).
KERNEL_TYPE = {FLOAT16: "Fp16", BFLOAT16: "Bf16"}

# Unit roundoff (half the machine epsilon) of each input dtype: one rounding of the result.
UNIT_ROUNDOFF = {
    FLOAT16: 2.0**-11,
    BFLOAT16: 2.0**-8,
    FLOAT32: 2.0**-24,
    np.dtype(np.float64): 2.0**-53,
}


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def is_cupy_array(x) -> bool:
    # Checked by module name so that importing cuflash never imports CuPy.
    return type(x).__module__.split(".")[0] == "cupy"


def array_namespace(x):
    """numpy for NumPy arrays, cupy for CuPy arrays, else None."""
    if isinstance(x, np.ndarray):
        return np
    if is_cupy_array(x):
        import cupy

        return cupy
    return None


def is_real_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def byte_range(a):
    """[start, end) byte addresses an array's elements can touch (for alias checks)."""
    if isinstance(a, np.ndarray):
        start = a.__array_interface__["data"][0]
    else:
        start = a.data.ptr
    if a.size == 0:
        return start, start
    lo = start + sum(min(0, (n - 1) * s) for n, s in zip(a.shape, a.strides))
    hi = start + sum(max(0, (n - 1) * s) for n, s in zip(a.shape, a.strides)) + a.itemsize
    return lo, hi


def may_share_memory(a, b) -> bool:
    """Conservative overlap test on byte ranges; exact enough for aliasing of out= with inputs."""
    if a.size == 0 or b.size == 0:
        return False
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1


def widen_to_float32(a):
    """A float32 copy of a float16/bfloat16/float32 NumPy or CuPy array (exact). CuPy's bfloat16 is
    storage only (no casts): its bits are widened instead (a bfloat16 is a float32's top half)."""
    if np.dtype(a.dtype) == BFLOAT16 and not isinstance(a, np.ndarray):
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(FLOAT32)
