"""Logical layout <-> the canonical 4-D (B, H, N, d) view every backend computes on."""

from __future__ import annotations


def to_bhsd(a, p, heads: int, n: int, d: int | None = None):
    """A (B, H, N, d) view of one input or output of problem p (``d``: its head dim, the array's
    last axis unless given: p.d for q, k, dq, dk; p.dv for v, o, do, dv).

    Leading batch axes merge into B; NumPy/CuPy reshape returns a view when the strides allow it
    and a copy otherwise (callers that write into the result check with :func:`is_view_of`).
    """
    d = a.shape[-1] if d is None else d
    if p.single_head:
        return a[None, None]
    b = p.batch
    if p.layout == "bhsd":
        return a.reshape((b, heads, n, d))
    return a.reshape((b, n, heads, d)).transpose(0, 2, 1, 3)


def from_bhsd(a4, p, heads: int, n: int):
    """Inverse of to_bhsd for arrays this package allocates in canonical (B, H, N, d) order."""
    d = a4.shape[-1]
    if p.single_head:
        return a4[0, 0]
    if p.layout == "bhsd":
        return a4.reshape(p.batch_shape + (heads, n, d))
    return a4.transpose(0, 2, 1, 3).reshape(p.batch_shape + (n, heads, d))


def is_view_of(view, base) -> bool:
    """True when `view` aliases `base`'s memory (so writes through it land in base)."""
    if view.size == 0:
        return True
    xp_mod = type(base).__module__.split(".")[0]
    if xp_mod == "numpy":
        import numpy as np

        return bool(np.shares_memory(view, base))
    return view.data.ptr >= base.data.ptr and view.data.mem is base.data.mem
