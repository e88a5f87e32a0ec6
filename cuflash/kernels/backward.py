"""Backward launches of a plan.dispatch.BackwardPlan for 16-bit inputs: attn_bwd_prep (D =
rowsum(dO * O)), the K/V-parallel kernel (mma.sync, band, or wgmma), the deterministic dQ kernel,
and the conversion of the float32 dQ accumulator; float32 inputs run cuflash.kernels.fp32."""

from __future__ import annotations

import numpy as np

from ..plan import schedule
from ..plan.backward import CONVERT_THREADS as _CONVERT_THREADS
from ..plan.backward import PREP_THREADS as _PREP_THREADS
from ..plan.backward import convert_grid, prep_lanes
from ..plan.dispatch import BackwardPlan
from . import device, tma
from .build import get_function
from .operands import LOG2E as _LOG2E
from ..plan.device_limits import MAX_GRID_YZ as _MAX_GRID_YZ
from .operands import band_offsets, score_mod_args

# Blocks of the persistent backward kernel; None: one per SM (tests set a few, so that each walks
# many units).
_PERSISTENT_BLOCKS: int | None = None


def _strides3(a4):
    return [np.int64(s // a4.itemsize) for s in a4.strides[:3]]


def launch(plan: BackwardPlan, p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, band=False,
           cu_seqlens=None, max_seqlens=None, dsinks=None):
    """dq4, dk4, dv4 receive the gradients. Packed sequences (``cu_seqlens=(cu_q, cu_k)``, device
    int32 offsets): the arrays are (1, H, total, d) views of the packed ones, lse3 (1, Hq, total_q),
    and ``max_seqlens=(longest q, longest k)`` host ints size the grids; one launch each for all
    sequences. ``dsinks`` (with sinks): a float32 (Hq,) array that receives -sum_rows
    exp(sink - lse) D added in, from the prep kernel's D."""
    import cupy

    specs, hd, t, hopper_kv = dict(plan.specs), plan.head_dim, plan.tile, plan.hopper
    kv_block_n, frag_dq, acc_hd = plan.kv_block_n, plan.frag_dq, plan.acc_head_dim
    off = np.int32(p.causal_offset if p.causal is not None else 0)
    band_args = ()
    if band:
        hi, lo, align = band_offsets(p)
        off, band_args = np.int32(hi), (np.int32(lo), np.int32(align))
    # Grid z: batch entries, or the packed sequences (each block reads its rows from the offsets).
    n_rows_q, n_rows_k = (p.nq, p.nk) if cu_seqlens is None else (int(x) for x in max_seqlens)

    mods = getattr(p, "scores_modified", False)  # the *_band_mod kernels: the modifiers' arguments follow

    def z_chunks(b0, b1):
        """(grid z, arguments after the band's) per launch of the batch chunk [b0, b1): the packed
        offsets and, with score modifiers, their arguments for the chunk's first entry."""
        if cu_seqlens is None:
            return [(b1 - b0, (np.uint64(0), np.uint64(0)) + (score_mod_args(p, b0) if mods else ()))]
        n_seq = cu_seqlens[0].shape[0] - 1
        return [(min(n_seq, s0 + _MAX_GRID_YZ) - s0, (cu_seqlens[0][s0:], cu_seqlens[1][s0:])
                 + (score_mod_args(p, s0) if mods else ())) for s0 in range(0, n_seq, _MAX_GRID_YZ)]
    scale_log2 = np.float32(p.scale * _LOG2E)
    lse3 = cupy.ascontiguousarray(lse3)

    dsum = cupy.empty((p.batch, p.hq, p.nq), dtype=np.float32)
    if frag_dq:  # a fragment-order accumulator (dQ added by bulk reduce-adds), its own convert
        dq_acc = cupy.zeros((p.batch, schedule.dq_accumulator_floats(1, p.hq, p.nq, acc_hd, True)), dtype=np.float32)
    else:
        dq_acc = (cupy.empty if deterministic else cupy.zeros)((p.batch, p.hq, p.nq, acc_hd), dtype=np.float32)
    for b0 in range(0, p.batch, _MAX_GRID_YZ):
        b1 = min(p.batch, b0 + _MAX_GRID_YZ)
        nb = b1 - b0
        sl = slice(b0, b1)
        if p.nq > 0:
            rows = p.hq * p.nq
            get_function(specs["prep"])(
                (-(-rows // (_PREP_THREADS // prep_lanes(hd))), nb), (_PREP_THREADS,),
                (o4[sl], do4[sl], dsum[sl], *_strides3(o4), *_strides3(do4), np.int32(p.hq), np.int32(p.nq), np.int32(p.d)),
            )
            if p.sinks is not None and dsinks is not None:  # dsink_h = -sum_rows P_sink D
                sink = cupy.asarray(p.sinks, dtype=np.float32).reshape(1, p.hq, 1)
                dsinks -= (cupy.exp(sink - lse3[sl]) * dsum[sl]).sum(axis=(0, 2), dtype=np.float32)
        common = (*_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(do4))
        n_blocks = -(-n_rows_k // kv_block_n)
        for nz, cu in z_chunks(b0, b1):
            # (the wgmma K/V kernel with modifiers: their arguments after the plain ones)
            extra = (*band_args, *cu) if band else (*cu[2:],) if mods else ()
            if n_blocks > 0:  # also when nq == 0: the blocks then write dK = dV = 0
                maps = ()
                if hopper_kv is not None and hopper_kv.tma:  # Q and dO boxes of block_m rows
                    maps = (tma.bhsd_map(q4[sl], hopper_kv.block_m), tma.bhsd_map(do4[sl], hopper_kv.block_m))
                    if hopper_kv.persistent:  # and K, V boxes of the block's keys
                        maps += (tma.bhsd_map(k4[sl], kv_block_n), tma.bhsd_map(v4[sl], kv_block_n))
                grid = (n_blocks, p.hkv, nz)
                if hopper_kv is not None and hopper_kv.persistent:  # units walked by <= one block per SM
                    units = n_blocks * p.hkv * nz
                    grid = (min(units, _PERSISTENT_BLOCKS or device.sm_count(device.current_id())), 1, 1)
                    extra = (np.int32(n_blocks), np.int32(p.hkv), np.int32(units))
                get_function(specs["kv"])(
                    grid, (specs["kv"].threads,),
                    (*maps, q4[sl], k4[sl], v4[sl], do4[sl], lse3[sl], dsum[sl], dq_acc[sl], dk4[sl], dv4[sl],
                     *common, *_strides3(dk4), *_strides3(dv4),
                     np.int32(p.hq), np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group), off, scale_log2,
                     *extra),
                    shared_mem=specs["kv"].smem_bytes,
                )
            if deterministic and n_rows_q > 0:
                get_function(specs["dq"])(
                    (-(-n_rows_q // t.dq_block_m) * t.dq_split, p.hq, nz), (32 * t.dq_warps,),
                    (q4[sl], k4[sl], v4[sl], do4[sl], lse3[sl], dsum[sl], dq_acc[sl], *common,
                     np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group), off, scale_log2, *extra),
                    shared_mem=specs["dq"].smem_bytes,
                )
        per_batch = p.hq * p.nq * p.d
        if per_batch > 0:
            get_function(specs["convert"])(
                convert_grid(frag_dq, p.hq, p.nq, acc_hd, nb), (_CONVERT_THREADS,),
                (dq_acc[sl], dq4[sl], *_strides3(dq4), np.int32(p.hq), np.int32(p.nq), np.int32(p.d), np.float32(p.scale)),
            )
