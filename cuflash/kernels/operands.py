"""The arrays of one launch as the kernels take them: element strides, unit-stride rows, the
alignment facts the dispatch reads (plan.dispatch.Operands), and the band kernels' bounds."""

from __future__ import annotations

import math

import numpy as np

from ..core import masks
from ..plan.dispatch import Operands
from . import tma

LOG2E = 1.4426950408889634  # the kernels' softmax runs on exp2: scores are scaled by scale * log2(e)
OPEN = 2**31 - 1  # an open side of the band kernels' mask; they clamp it to the sequence


def elem_strides(a4):
    return tuple(s // a4.itemsize for s in a4.strides)


def unit_d(a4):
    """The kernels read rows contiguously: copy an input whose head dim is strided (documented)."""
    if a4.shape[-1] > 1 and a4.strides[-1] != a4.itemsize:
        import cupy

        return cupy.ascontiguousarray(a4)
    return a4


def vector_ok(arrays, d) -> bool:
    """16-byte cp.async/stores need d % 8 == 0, 16-byte aligned bases and row strides % 8 == 0."""
    if d % 8:
        return False
    for a in arrays:
        if a.data.ptr % 16:
            return False
        if any(s % 8 for n, s in zip(a.shape[:3], elem_strides(a)[:3]) if n > 1):
            return False
    return True


def vector_ok_bytes(arrays, d) -> bool:
    """vector_ok by bytes, for arrays of any element size (an e4m3 cache: d % 16 == 0)."""
    for a in arrays:
        if (d * a.itemsize) % 16 or a.data.ptr % 16:
            return False
        if any(s % 16 for n, s in zip(a.shape[:3], a.strides[:3]) if n > 1):
            return False
    return True


def tma_ok(*arrays) -> bool:
    """Whether these (B, H, N, d) views can be read through tensor maps: cuda-bindings present,
    no empty axis (a map's extents are >= 1; e.g. an empty cache), unit-stride rows, 16-byte
    aligned bases and strides (TMA's rule)."""
    if not tma.available():
        return False
    return all(min(a.shape) > 0 and a.strides[-1] == a.itemsize and tma.encodable(a.data.ptr, tma.bhsd_strides(a))
               for a in arrays)


def describe(d, q4, k4, v4, *rest, grads=(), maps: bool = True) -> Operands:
    """The Operands of a forward (rest: o) or backward (rest: o, dO; grads: dq, dk, dv) call.
    Query-side tensor maps cover q and, in the backward, dO; ``maps=False`` (no Hopper target)
    skips the tensor-map checks."""
    every = (q4, k4, v4, *rest, *grads)
    query_side = (q4, rest[-1]) if grads else (q4,)
    return Operands(vec=vector_ok(every, d), tma_q=maps and tma_ok(*query_side), tma_kv=maps and tma_ok(k4, v4),
                    kv_vec=vector_ok((k4, v4), d))


def band_offsets(p):
    """(hi, lo, align) for the band kernels: masks.row_bounds relative to the diagonal (rows see
    keys diag + lo .. diag + hi), an open side as +-OPEN; align: the diagonal is i + nk - nq of
    each sequence (bottom-right), else i (top-left)."""
    lo, hi = masks.row_bounds(p.causal, p.window, 0, 0)  # nq = nk = 0: offsets from the diagonal
    return (OPEN if hi is None else hi), (-OPEN if lo is None else lo), int(p.causal != "top_left")


def score_mod_args(p, first=0):
    """The score-modifier arguments of the *_mod kernels (cuda_src/score_mod.cuh), for a launch
    whose first batch entry (or packed sequence) is ``first``: cap_ex2 (2 log2(e) scale / softcap,
    the factor of the softcap's exp2), cap_out (softcap / scale), inv_scale, the
    ALiBi slopes (null: none) and their row stride, and - forward only, the caller appends it -
    the sinks (sink_pointer)."""
    import cupy

    cap_ex2 = 2.0 * math.log2(math.e) * p.scale / p.softcap if p.softcap is not None else 0.0
    cap_out = p.softcap / p.scale if p.softcap is not None else 0.0
    alibi = np.uint64(0) if p.alibi is None else cupy.ascontiguousarray(p.alibi, dtype=np.float32)[first:]
    return (np.float32(cap_ex2), np.float32(cap_out), np.float32(1.0 / p.scale), alibi, np.int32(p.hq))


def sink_pointer(p):
    """The sinks as the forward's *_mod kernel reads them (null: none)."""
    import cupy

    return np.uint64(0) if p.sinks is None else cupy.ascontiguousarray(p.sinks, dtype=np.float32)
