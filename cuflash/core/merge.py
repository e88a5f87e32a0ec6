"""Validation and canonical views of cuflash.merge_attention_states' arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .arrays import FLOAT32, SUPPORTED_DTYPES, dtype_name, may_share_memory
from .problem import check_layout, check_out, same_library


@dataclass(frozen=True)
class MergeProblem:
    """P partial results of one attention output: o parts (P, *o_shape), lse parts (P, *lse_shape)."""

    xp: object
    layout: str
    parts: int
    batch_shape: tuple
    heads: int
    n: int
    d: int
    dtype: np.dtype  # the parts' dtype
    out_dtype: np.dtype
    single_head: bool

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    def o_shape(self):
        if self.single_head:
            return (self.n, self.d)
        tail = (self.heads, self.n, self.d) if self.layout == "bhsd" else (self.n, self.heads, self.d)
        return self.batch_shape + tail

    def lse_shape(self):
        return (self.n,) if self.single_head else self.batch_shape + (self.heads, self.n)

    def o5(self, a):
        """(P, B, H, N, d) view (a copy where the strides do not merge) of (P, *o_shape) parts
        (P = a.shape[0]: also a single output as a[None])."""
        if self.single_head:
            return a[:, None, None]
        p, b = a.shape[0], self.batch
        if self.layout == "bhsd":
            return a.reshape((p, b, self.heads, self.n, self.d))
        return a.reshape((p, b, self.n, self.heads, self.d)).swapaxes(2, 3)

    def lse4(self, a):
        return a[:, None, None] if self.single_head else a.reshape((a.shape[0], self.batch, self.heads, self.n))


def _stacked(name, parts):
    """An array with a leading parts axis; a list/tuple of NumPy or CuPy arrays is stacked (a copy)."""
    if not isinstance(parts, (list, tuple)):
        return parts
    if len(parts) == 0:
        raise ValueError(f"{name}: expected at least one part, got an empty {type(parts).__name__}")
    xp = same_library([(f"{name}[{i}]", a) for i, a in enumerate(parts)])
    shapes = {tuple(a.shape) for a in parts}
    if len(shapes) > 1:
        raise ValueError(f"{name}: the parts have different shapes {sorted(shapes)}")
    dtypes = {np.dtype(a.dtype) for a in parts}
    if len(dtypes) > 1:
        raise TypeError(f"{name}: the parts have different dtypes {sorted(dtype_name(t) for t in dtypes)}")
    return xp.stack(parts)


def validate_merge(o_parts, lse_parts, *, layout="bhsd", dtype=None, out=None, lse_out=None):
    """(MergeProblem, o_parts, lse_parts) with list/tuple parts stacked, or ValueError/TypeError
    naming the argument."""
    check_layout(layout)
    o_parts = _stacked("o_parts", o_parts)
    lse_parts = _stacked("lse_parts", lse_parts)
    xp = same_library((("o_parts", o_parts), ("lse_parts", lse_parts)))
    if o_parts.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"o_parts: dtype {dtype_name(o_parts.dtype)} is not supported; "
                        "expected float16, bfloat16 or float32")
    if lse_parts.dtype != FLOAT32:
        raise TypeError(f"lse_parts: expected dtype float32 (as attention(..., return_lse=True) returns it), "
                        f"got {dtype_name(lse_parts.dtype)}")
    if o_parts.ndim < 3:
        raise ValueError("o_parts: expected a leading parts axis and an output of at least 2 dimensions, "
                         f"(P, N, d) or (P, ..., H, N, d), got shape {tuple(o_parts.shape)}")
    if o_parts.shape[0] < 1:
        raise ValueError("o_parts: expected at least one part (parts axis of length >= 1)")
    shape = tuple(o_parts.shape[1:])
    single = len(shape) == 2
    if single:
        batch, heads, n, d = (), 1, shape[0], shape[1]
    elif layout == "bhsd":
        batch, heads, n, d = shape[:-3], shape[-3], shape[-2], shape[-1]
    else:
        batch, heads, n, d = shape[:-3], shape[-2], shape[-3], shape[-1]
    out_dtype = np.dtype(o_parts.dtype) if dtype is None else _out_dtype(dtype)
    mp = MergeProblem(xp, layout, o_parts.shape[0], tuple(batch), heads, n, d, np.dtype(o_parts.dtype), out_dtype,
                      single)
    want = (mp.parts,) + mp.lse_shape()
    if tuple(lse_parts.shape) != want:
        raise ValueError(f"lse_parts: expected shape {want} for o_parts of shape {tuple(o_parts.shape)} "
                         f"(layout {layout!r}), got {tuple(lse_parts.shape)}")
    inputs = (("o_parts", o_parts), ("lse_parts", lse_parts))
    check_out("out", out, mp.o_shape(), out_dtype, xp, inputs)
    check_out("lse_out", lse_out, mp.lse_shape(), FLOAT32, xp, inputs)
    if out is not None and lse_out is not None and may_share_memory(out, lse_out):
        raise ValueError("lse_out: must not overlap out")
    return mp, o_parts, lse_parts


def _out_dtype(dtype):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype!r}") from None
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: {dtype_name(dt)} is not supported; expected float16, bfloat16 or float32")
    return dt


