"""Float32 backward launches (cuda_src/attn_bwd_fp32.cu, attn_fp32_mma.cu) of a
plan.dispatch.BackwardPlan: attn_bwd_f32_dq (query tiles: the exact row statistics lse2 and D,
then dQ) and attn_bwd_f32_kv (key tiles: dK, dV over the group's query heads). The float32
forward shares attn_fwd's arguments (cuflash.kernels.forward.launch_forward)."""

from __future__ import annotations

import functools

import numpy as np

from ..plan.dispatch import BackwardPlan
from .build import get_function
from .operands import LOG2E as _LOG2E
from ..plan.device_limits import MAX_GRID_YZ as _MAX_GRID_YZ
from .operands import elem_strides, unit_d


@functools.lru_cache(maxsize=None)
def _row_dot():
    """rowsum(dO * O) in float64 of float32 rows, without float64 copies of dO and O; built once
    (a ReductionKernel costs host time to construct on every call)."""
    import cupy

    return cupy.ReductionKernel("float32 a, float32 b", "float64 y", "(double)a * (double)b", "a + b", "y = a", "0",
                                "cuflash_row_dot_f64")


def launch_backward(plan: BackwardPlan, p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4):
    """dq4, dk4, dv4 (B, H, N, d) float32 views with a unit head-dim stride receive the gradients.

    The row statistics are recomputed in float64 (see attn_bwd_fp32.cu) and replace the given lse3
    and rowsum(do4 * o4) where lse3 is this call's own up to float32 rounding; a given lse over
    more keys (a global lse, a slice of the keys here) is honoured with its D. Deterministic by
    construction (no atomics)."""
    import cupy

    if p.batch == 0 or p.hkv == 0:
        return
    do4, q4, k4, v4 = (unit_d(a) for a in (do4, q4, k4, v4))
    specs, t = plan.specs, plan.tile
    off = np.int32(p.causal_offset if p.causal is not None else 0)
    # Python floats are doubles: the scale reaches the float64 arithmetic unrounded.
    scale_log2, scale = np.float64(p.scale * _LOG2E), np.float64(p.scale)
    # The kernels read the caller's statistics from these workspaces before writing their own.
    lse2 = cupy.ascontiguousarray(cupy.multiply(lse3, np.float64(_LOG2E), dtype=np.float64))
    dsum = cupy.ascontiguousarray(_row_dot()(do4, o4, axis=-1))

    def strides(*arrays):
        return [np.int64(s) for a in arrays for s in elem_strides(a)[:3]]

    dims = (np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group), off, scale_log2, scale)
    for b0 in range(0, p.batch, _MAX_GRID_YZ):
        sl = slice(b0, min(p.batch, b0 + _MAX_GRID_YZ))
        nb = sl.stop - b0
        if p.nq > 0 and p.hq > 0:
            get_function(specs["dq"])(
                (-(-p.nq // t.dq_block_m), p.hq, nb), (specs["dq"].threads,),
                (q4[sl], k4[sl], v4[sl], do4[sl], dq4[sl], lse2[sl], dsum[sl],
                 *strides(q4, k4, v4, do4, dq4), *dims),
                shared_mem=specs["dq"].smem_bytes)
        if p.nk > 0:  # also when nq == 0: the blocks then write dK = dV = 0
            get_function(specs["kv"])(
                (-(-p.nk // t.kv_block_n), p.hkv, nb), (specs["kv"].threads,),
                (q4[sl], k4[sl], v4[sl], do4[sl], lse2[sl], dsum[sl], dk4[sl], dv4[sl],
                 *strides(q4, k4, v4, do4, dk4, dv4), np.int32(p.hq), *dims),
                shared_mem=specs["kv"].smem_bytes)
