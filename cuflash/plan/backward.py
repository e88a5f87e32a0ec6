"""Backward plans of the portable kernels (cuda_src/attn_bwd.cu): D = rowsum(dO * O), the
K/V-parallel main kernel, dQ (atomic, or a separate deterministic kernel) and its conversion from
the float32 accumulator; the instantiations, grids and workspace a tile names."""

from __future__ import annotations

import numpy as np

from ..core.arrays import BFLOAT16, FLOAT16, FLOAT32, KERNEL_TYPE
from . import schedule
from .fp32 import all_backward_specs_fp32, backward_specs_fp32
from .fp32 import backward_workspace_bytes as fp32_workspace_bytes
from .forward import FP32_BAND, MODS_FP32, MODS_NEED_VEC
from .spec import KernelSpec
from .spec import cpp_bool as _b

PREP_THREADS = 256
CONVERT_THREADS = 256  # (attn_bwd_dq_convert's launch bound)


def prep_lanes(hd: int) -> int:
    """attn_bwd_prep's threads per query row: one 8-column (16-byte) load each per pass."""
    return 4 if hd <= 32 else 8 if hd <= 64 else 16 if hd <= 128 else 32


def convert_grid(frag: bool, hq: int, nq: int, hd: int, n_batch: int) -> tuple:
    """attn_bwd_dq_convert's grid for n_batch entries: a block per 64 x 64 fragment-order chunk,
    or 8 columns of a row per thread."""
    if frag:
        return (hq * (-(-nq // 64)) * (hd // 64), n_batch)
    return (-(-(hq * nq * (hd // 8)) // CONVERT_THREADS), n_batch)


def dq_convert_spec(dtype, acc_hd: int) -> KernelSpec:
    """attn_bwd_dq_convert: dQ from the float32 accumulator, rows acc_hd floats apart."""
    return KernelSpec("attn_bwd.cu", f"attn_bwd_dq_convert<{KERNEL_TYPE[np.dtype(dtype)]}, {acc_hd}>", CONVERT_THREADS, 0)


def backward_specs(dtype, d: int, causal: bool, vec: bool, deterministic: bool, tile=None, band: bool = False,
                   target=None, mods: bool = False):
    """({role: KernelSpec}, head-dim bucket, BackwardTile) of every kernel one backward launches.

    ``band``: the sliding-window / packed-sequence kernels attn_bwd_kv_band and attn_bwd_dq_band
    (``causal`` is then ignored: the bounds are run-time arguments). CI compiles exactly these;
    `tile` overrides the table (schedule search). ``mods``: the band kernels with the softcap and
    ALiBi (attn_bwd_kv_band_mod, attn_bwd_dq_band_mod; 16-byte loads only)."""
    dtype = np.dtype(dtype)
    if mods and (dtype == FLOAT32 or not vec):
        raise NotImplementedError(MODS_FP32 if dtype == FLOAT32 else MODS_NEED_VEC)
    band = band or mods
    if dtype == FLOAT32:
        if band:
            raise NotImplementedError(FP32_BAND)
        return backward_specs_fp32(d, causal, tile, target)  # float64 arithmetic, deterministic either way
    tag = KERNEL_TYPE[dtype]
    hd, t = schedule.backward_tile(d)
    t = tile or t
    kv_head = f"{tag}, {hd}, {t.block_m}, {t.block_n}, {t.warps}, {t.warps_d}"
    dq_head = f"{tag}, {hd}, {t.dq_block_m}, {t.dq_block_n}, {t.dq_warps}, {t.dq_split}"
    mask = "" if band else f"{_b(causal)}, "
    suffix = "_band_mod" if mods else "_band" if band else ""
    specs = {
        "prep": KernelSpec("attn_bwd.cu", f"attn_bwd_prep<{tag}, {prep_lanes(hd)}>", PREP_THREADS, 0),
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
    specs = all_backward_specs_fp32()
    for dtype in (FLOAT16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for causal in (False, True):
                for vec in (False, True):
                    for det in (False, True):
                        specs.extend(backward_specs(dtype, hd, causal, vec, det)[0].values())
                        if causal:  # the band kernels, once per (vec, det)
                            specs.extend(backward_specs(dtype, hd, True, vec, det, band=True)[0].values())
                        if causal and vec:  # and with the score modifiers
                            specs.extend(backward_specs(dtype, hd, True, vec, det, mods=True)[0].values())
    return list(dict.fromkeys(specs))


def workspace_bytes(p, frag_dq: bool = False, hopper_atomic: bool = False) -> int:
    """Device bytes the backward allocates beyond dq, dk, dv: the float32 dQ accumulator (rows
    padded to the head-dim bucket, or with hopper_atomic - the wgmma K/V kernel adds dQ - to its
    HEAD_DIM; with frag_dq, the warp-specialized wgmma kernel's, each head's Nq padded to 64) and D.
    float32 inputs: the float64 lse2 and D of plan.fp32.backward_workspace_bytes."""
    if np.dtype(p.dtype) == FLOAT32:
        return fp32_workspace_bytes(p)
    width = schedule.dq_accumulator_width(schedule.head_dim_bucket(p.d), hopper_atomic)
    return (schedule.dq_accumulator_floats(p.batch, p.hq, p.nq, width, frag_dq) + p.batch * p.hq * p.nq) * 4
