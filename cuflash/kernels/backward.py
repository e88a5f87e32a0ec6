"""CUDA backward: D = rowsum(dO*O), the K/V-parallel main kernel, dQ (atomic or deterministic)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..plan import schedule
from ..core.arrays import BFLOAT16, FLOAT16, FLOAT32, KERNEL_TYPE
from .build import KernelSpec, get_function

_LOG2E = 1.4426950408889634
_PREP_THREADS = 256
_CONVERT_THREADS = 256  # (attn_bwd_dq_convert's launch bound)
_MAX_GRID_YZ = 65535
# Blocks of the persistent backward kernel; None: one per SM (tests set a few, so that each walks
# many units).
_PERSISTENT_BLOCKS: int | None = None


def _b(x: bool) -> str:
    return "true" if x else "false"


def prep_lanes(hd: int) -> int:
    """attn_bwd_prep's threads per query row: one 8-column (16-byte) load each per pass."""
    return 4 if hd <= 32 else 8 if hd <= 64 else 16 if hd <= 128 else 32


def convert_grid(frag: bool, hq: int, nq: int, hd: int, n_batch: int) -> tuple:
    """attn_bwd_dq_convert's grid for n_batch entries: a block per 64 x 64 fragment-order chunk,
    or 8 columns of a row per thread."""
    if frag:
        return (hq * (-(-nq // 64)) * (hd // 64), n_batch)
    return (-(-(hq * nq * (hd // 8)) // _CONVERT_THREADS), n_batch)


def dq_convert_spec(dtype, acc_hd: int) -> KernelSpec:
    """attn_bwd_dq_convert: dQ from the float32 accumulator, rows acc_hd floats apart."""
    return KernelSpec("attn_bwd.cu", f"attn_bwd_dq_convert<{KERNEL_TYPE[np.dtype(dtype)]}, {acc_hd}>", _CONVERT_THREADS, 0)


def backward_specs(dtype, d: int, causal: bool, vec: bool, deterministic: bool, tile=None, band: bool = False):
    """({role: KernelSpec}, head-dim bucket, BackwardTile) of every kernel one backward launches.

    ``band``: the sliding-window / packed-sequence kernels attn_bwd_kv_band and attn_bwd_dq_band
    (``causal`` is then ignored: the bounds are run-time arguments). CI compiles exactly these;
    `tile` overrides the table (schedule search)."""
    dtype = np.dtype(dtype)
    if dtype == FLOAT32:
        from .forward import _FP32_BAND
        from .fp32 import backward_specs_fp32

        if band:
            raise NotImplementedError(_FP32_BAND)
        return backward_specs_fp32(d, causal, tile)  # float64 arithmetic, deterministic either way
    tag = KERNEL_TYPE[dtype]
    hd, t = schedule.backward_tile(d)
    t = tile or t
    kv_head = f"{tag}, {hd}, {t.block_m}, {t.block_n}, {t.warps}, {t.warps_d}"
    dq_head = f"{tag}, {hd}, {t.dq_block_m}, {t.dq_block_n}, {t.dq_warps}, {t.dq_split}"
    mask = "" if band else f"{_b(causal)}, "
    suffix = "_band" if band else ""
    specs = {
        "prep": KernelSpec("attn_bwd.cu", f"attn_bwd_prep<{tag}, {prep_lanes(hd)}>", _PREP_THREADS, 0),
        "kv": KernelSpec(
            "attn_bwd.cu",
            f"attn_bwd_kv{suffix}<{kv_head}, {mask}{_b(vec)}, {_b(not deterministic)}>",
            t.threads,
            t.smem_bytes(hd),
        ),
        "convert": dq_convert_spec(dtype, hd),
    }
    if deterministic:
        specs["dq"] = KernelSpec(
            "attn_bwd.cu",
            f"attn_bwd_dq{suffix}<{dq_head}, {mask}{_b(vec)}>",
            32 * t.dq_warps,
            t.dq_smem_bytes(hd),
        )
    return specs, hd, t


def all_backward_specs():
    from .fp32 import all_backward_specs_fp32

    specs = all_backward_specs_fp32()
    for dtype in (FLOAT16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for causal in (False, True):
                for vec in (False, True):
                    for det in (False, True):
                        specs.extend(backward_specs(dtype, hd, causal, vec, det)[0].values())
                        if causal:  # the band kernels, once per (vec, det)
                            specs.extend(backward_specs(dtype, hd, True, vec, det, band=True)[0].values())
    return list(dict.fromkeys(specs))


def _strides3(a4):
    return [np.int64(s // a4.itemsize) for s in a4.strides[:3]]


def workspace_bytes(p, frag_dq: bool = False, hopper_atomic: bool = False) -> int:
    """Device bytes the backward allocates beyond dq, dk, dv: the float32 dQ accumulator (rows
    padded to the head-dim bucket, or with hopper_atomic - the wgmma K/V kernel adds dQ - to its
    HEAD_DIM; with frag_dq, the warp-specialized wgmma kernel's, each head's Nq padded to 64) and D.
    float32 inputs: the float64 lse2 and D of gpu_fp32.backward_workspace_bytes."""
    if np.dtype(p.dtype) == FLOAT32:
        from .fp32 import backward_workspace_bytes

        return backward_workspace_bytes(p)
    width = schedule.dq_accumulator_width(schedule.head_dim_bucket(p.d), hopper_atomic)
    return (schedule.dq_accumulator_floats(p.batch, p.hq, p.nq, width, frag_dq) + p.batch * p.hq * p.nq) * 4


def backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, tile=None, hopper_tile=None,
             cu_seqlens=None, max_seqlens=None):
    """hopper_tile (a schedule.HopperBwdTile, schedule search): the wgmma K/V kernel's tile; only
    where hopper.backward_applies, else ValueError. tile: the mma.sync kernels' BackwardTile.

    A window (p.window) or packed sequences (``cu_seqlens=(cu_q, cu_k)``, device int32 offsets;
    the arrays are then (1, H, total, d) views of the packed ones, lse3 (1, Hq, total_q), and
    ``max_seqlens=(longest q, longest k)`` host ints size the grids) run the band kernels, one
    launch each for all sequences."""
    import cupy

    from . import decode
    from . import hopper
    from .forward import _unit_d, _vector_ok

    band = p.window is not None or cu_seqlens is not None
    if band and cu_seqlens is not None and max_seqlens is None:
        raise ValueError("max_seqlens: required with cu_seqlens (the grids cover the longest sequences)")
    if np.dtype(p.dtype) == FLOAT32:  # float64 arithmetic on the FMA pipes (gpu_fp32)
        if band:
            from .forward import _FP32_BAND

            raise NotImplementedError(_FP32_BAND)
        if tile is not None or hopper_tile is not None:
            raise ValueError("tile / hopper_tile: float32 runs its own kernels (gpu_fp32.BACKWARD_TILES_FP32)")
        from .fp32 import backward_fp32

        backward_fp32(p, do4, q4, k4, v4, dq4, dk4, dv4)
        return
    if p.batch == 0 or p.hq == 0:
        return
    do4, q4, k4, v4, o4 = (_unit_d(a) for a in (do4, q4, k4, v4, o4))
    vec = _vector_ok((do4, q4, k4, v4, o4, dq4, dk4, dv4), p.d)
    hopper_kv = None
    if hopper_tile is not None:
        if band or not hopper.backward_applies(p, vec):
            raise ValueError("hopper_tile: the wgmma backward K/V kernel does not run for this problem here (it needs "
                             "sm_90, float16/bfloat16 with 16-byte-aligned rows, a head dim of HOPPER_BACKWARD_TILES "
                             f"{tuple(schedule.HOPPER_BACKWARD_TILES)} and {hopper.ENV}=auto)")
        hopper_kv = hopper.backward_kv_spec(p.dtype, p.d, p.causal is not None, deterministic, tile=hopper_tile)
    elif tile is None and not band and hopper.backward_applies(p, vec):  # sm_90: the K/V kernel on wgmma
        from ..tune import pick_hopper_backward_tile

        hopper_kv = hopper.backward_kv_spec(p.dtype, p.d, p.causal is not None, deterministic,
                                                tile=pick_hopper_backward_tile(p, deterministic))
    if hopper_kv is not None and hopper_kv[1].tma and not hopper.tma_ok(
            q4, do4, *((k4, v4) if hopper_kv[1].persistent else ())):
        if hopper_tile is not None:
            raise ValueError("hopper_tile: the TMA kernel needs cuda-bindings and 16-byte aligned Q/dO rows and strides")
        # The cp.async variant of a split-head-dim tile spills (255 registers), so the mma.sync kernels run.
        hopper_kv = None if hopper_kv[1].split_d else hopper.backward_kv_spec(
            p.dtype, p.d, p.causal is not None, deterministic, tile=dataclasses.replace(hopper_kv[1], tma=False, ws=False))
    if hopper_kv is not None and hopper_kv[1].persistent and (
            -(-p.nk // hopper_kv[1].block_n) * p.hkv * min(p.batch, _MAX_GRID_YZ) >= 2**31):  # int32 unit count
        hopper_kv = hopper.backward_kv_spec(p.dtype, p.d, p.causal is not None, deterministic,
                                                tile=dataclasses.replace(hopper_kv[1], persistent=False))
    if tile is None and vec and hopper_kv is None and not band:  # autotuned winner when CUFLASH_TUNE asks, else the table
        from ..tune import pick_backward_tile

        tile = pick_backward_tile(p, deterministic=deterministic)
    specs, hd, t = backward_specs(p.dtype, p.d, p.causal is not None, vec, deterministic, tile, band=band)
    kv_block_n = t.block_n
    if hopper_kv is not None:
        specs["kv"], kv_block_n = hopper_kv[0], hopper_kv[1].block_n
    off = np.int32(p.causal_offset if p.causal is not None else 0)
    band_args = ()
    if band:
        from .forward import band_offsets

        hi, lo, align = band_offsets(p)
        off, band_args = np.int32(hi), (np.int32(lo), np.int32(align))
    # Grid z: batch entries, or the packed sequences (each block reads its rows from the offsets).
    n_rows_q, n_rows_k = (p.nq, p.nk) if cu_seqlens is None else (int(x) for x in max_seqlens)

    def z_chunks(b0, b1):
        """(grid z, offsets passed to the band kernels) per launch of the batch chunk [b0, b1)."""
        if cu_seqlens is None:
            return [(b1 - b0, (np.uint64(0), np.uint64(0)))]
        n_seq = cu_seqlens[0].shape[0] - 1
        return [(min(n_seq, s0 + _MAX_GRID_YZ) - s0, (cu_seqlens[0][s0:], cu_seqlens[1][s0:]))
                for s0 in range(0, n_seq, _MAX_GRID_YZ)]
    scale_log2 = np.float32(p.scale * _LOG2E)
    lse3 = cupy.ascontiguousarray(lse3)

    dsum = cupy.empty((p.batch, p.hq, p.nq), dtype=np.float32)
    frag_dq = hopper_kv is not None and hopper_kv[1].ws  # fragment-order dQ accumulator, its own convert
    # Rows of the accumulator: the wgmma K/V kernel adds dQ rows of its own HEAD_DIM (192: 256).
    acc_hd = schedule.dq_accumulator_width(hd, hopper_kv is not None and not deterministic)
    if frag_dq:
        dq_acc = cupy.zeros((p.batch, schedule.dq_accumulator_floats(1, p.hq, p.nq, acc_hd, True)), dtype=np.float32)
        specs["convert"] = hopper.dq_convert_frag_spec(p.dtype, acc_hd)
    else:
        dq_acc = (cupy.empty if deterministic else cupy.zeros)((p.batch, p.hq, p.nq, acc_hd), dtype=np.float32)
        if acc_hd != hd:
            specs["convert"] = dq_convert_spec(p.dtype, acc_hd)
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
        common = (*_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(do4))
        n_blocks = -(-n_rows_k // kv_block_n)
        for nz, cu in z_chunks(b0, b1):
            extra = (*band_args, *cu) if band else ()
            if n_blocks > 0:  # also when nq == 0: the blocks then write dK = dV = 0
                maps = ()
                if hopper_kv is not None and hopper_kv[1].tma:  # Q and dO boxes of block_m rows
                    from . import tma

                    maps = (tma.bhsd_map(q4[sl], hopper_kv[1].block_m), tma.bhsd_map(do4[sl], hopper_kv[1].block_m))
                    if hopper_kv[1].persistent:  # and K, V boxes of the block's keys
                        maps += (tma.bhsd_map(k4[sl], kv_block_n), tma.bhsd_map(v4[sl], kv_block_n))
                grid = (n_blocks, p.hkv, nz)
                if hopper_kv is not None and hopper_kv[1].persistent:  # units walked by <= one block per SM
                    units = n_blocks * p.hkv * nz
                    grid = (min(units, _PERSISTENT_BLOCKS or decode._sm_count(cupy.cuda.Device().id)), 1, 1)
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
