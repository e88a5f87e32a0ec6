"""The launches the accounting counts: plan.dispatch's choices for the modelled H200 with contiguous,
16-byte-aligned arrays (tiles, shared memory, threads, splits), whatever GPU this machine has."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..core import masks
from ..plan import decode, dispatch, schedule
from ..plan.hopper import split_partials
from ..plan.target import H200
from .arguments import check_config, check_dtype


# The H200's shared memory per SM (device attribute MaxSharedMemoryPerMultiprocessor, 233472 bytes
# = 228 KiB): the "SRAM" of the FlashAttention paper's two-level model for this chip.
H200_SMEM_PER_SM_BYTES = 228 * 1024


MODEL = H200  # 132 SMs
H200_SM_COUNT = MODEL.sm_count


def model_problem(dtype, d, causal, nq=None, nk=None, batch=None, hq=None, hkv=None, dv=None):
    """The few problem fields the dispatch reads (lengths None: the tables' tiles)."""
    kind = masks.normalize_causal(causal)
    hkv = hkv or hq
    return SimpleNamespace(dtype=np.dtype(dtype), d=d, dv=d if dv is None else dv, causal=kind, nq=nq, nk=nk,
                           batch=batch, hq=hq, hkv=hkv, group=(hq // hkv) if hq and hkv else 1, window=None)


def _backward_plan(dtype, d, causal, deterministic):
    """The backward plan on the modelled H200, or None where no GPU kernel exists for the dtype."""
    try:
        return dispatch.backward_plan(model_problem(dtype, d, causal), MODEL, dispatch.ALIGNED,
                                      deterministic=bool(deterministic), tuned=False)
    except (NotImplementedError, KeyError):
        return None


def dq_accumulator_width(dtype, hd, deterministic, causal=False) -> int:
    """Floats per row of the modelled GPU's dQ accumulator (plan.dispatch.BackwardPlan.acc_head_dim)."""
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan.acc_head_dim if plan is not None and plan.kernel != "fp32" else hd


def backward_frag_dq(dtype, hd, causal, deterministic) -> bool:
    """Whether the modelled GPU's backward adds dQ in fragment-order chunks (the warp-specialized
    wgmma kernel, or the split-head-dim one with dQ staged in its Q/dO tiles)."""
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan is not None and plan.frag_dq


def backward_on_wgmma(dtype, hd, causal, deterministic) -> bool:
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan is not None and plan.kernel == "wgmma"


def model_forward_plan(dtype, d, causal=False, nq=None, nk=None, batch=None, hq=None):
    """plan.dispatch.forward_plan of this shape on the modelled H200 (contiguous arrays)."""
    return dispatch.forward_plan(model_problem(np.dtype(dtype), d, causal, nq, nk, batch, hq), MODEL, dispatch.ALIGNED,
                                 tuned=False)


def forward_launch(dtype, d, causal=False, config=None, nq=None, nk=None, batch=None, hq=None, dv=None, hkv=None):
    """Tile, shared memory and threads of the forward kernel cuflash launches (contiguous arrays) on
    the modelled GPU, the H200: plan.dispatch.forward_plan's (the wgmma kernel where it applies;
    CUFLASH_KERNELS=mma_sync: the mma.sync kernel). With the sequence lengths (nq, nk) and the grid
    (batch, hq), the tile and key split the dispatch picks for them, else the table's.

    ``dv``: v's head dim where it differs from d: the dv kernel's launch where
    plan.dispatch.head_dim_v_plan takes the problem (``hd_v``: v's head-dim bucket), else the
    padded problem's, at max(d, dv) (``hkv``: the K/V heads, for the split-KV decode rule).

    A ``config`` replaces the table's TileConfig (its smem_bytes is then trusted)."""
    dtype = check_dtype("dtype", dtype)
    if dv is not None and dv != d:
        native = forward_dv_launch(dtype, d, dv, causal, nq, nk, batch, hq, hkv) if config is None else None
        if native is not None:
            return native
        d = max(d, dv)
    hd = schedule.head_dim_bucket(d)
    if config is not None:
        check_config(config)
        return SimpleNamespace(block_m=config.block_m, block_n=config.block_n, hd=hd, threads=config.threads,
                               smem=config.smem_bytes(hd, dtype.itemsize), source="config")
    try:
        plan = model_forward_plan(dtype, d, causal, nq, nk, batch, hq)
    except (NotImplementedError, KeyError):
        _, t = schedule.forward_tile(d)
        return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=hd, threads=t.threads,
                               smem=t.smem_bytes(hd, dtype.itemsize), source="schedule.FORWARD_TILES")
    t, spec = plan.tile, plan.spec
    return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=hd, threads=spec.threads,
                           smem=spec.smem_bytes, source=spec.short_name)


def forward_dv_launch(dtype, d, dv, causal, nq=None, nk=None, batch=None, hq=None, hkv=None):
    """forward_launch's answer for the dv kernel where plan.dispatch.head_dim_v_plan runs v's head
    dim dv unlike d on the modelled H200 (contiguous arrays), else None (the GPU pads)."""
    plan = dispatch.head_dim_v_plan(model_problem(dtype, d, causal, nq, nk, batch, hq, hkv, dv=dv), MODEL,
                                    dispatch.ALIGNED)
    if plan is None:
        return None
    t, spec = plan.tile, plan.spec
    return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=schedule.head_dim_bucket(d),
                           hd_v=schedule.head_dim_bucket(dv), threads=spec.threads, smem=spec.smem_bytes,
                           source=spec.short_name)


def forward_key_split(p, causal):
    """(slots, rows, columns) of the key split's float32 partials in the forward cuflash launches
    on the modelled H200 for this shape (contiguous inputs), or None."""
    if p.nq == 0:
        return None
    mp = model_problem(p.dtype, p.d, causal, p.nq, p.nk, p.batch, p.hq)
    try:
        plan = dispatch.forward_plan(mp, MODEL, dispatch.ALIGNED, tuned=False)
    except (NotImplementedError, KeyError):
        return None
    return split_partials(mp, plan.tile, plan.splits) if plan.kernel == "wgmma_split" else None


def decode_launch(dtype, d, causal, batch, hq, hkv, nq, nk, cluster=None, kv_e4m3=False):
    """The split-KV decode launch cuflash makes for this shape (contiguous inputs), or None.
    cluster=False: the launch whose splits merge through memory (plan.decode.launch_plan).
    kv_e4m3: an e4m3 K/V cache (plan.decode.e4m3_launch's tile and waves)."""
    p = SimpleNamespace(dtype=dtype, d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv, batch=batch,
                        causal=masks.normalize_causal(causal), window=None)
    if not (dispatch.decode_applies_e4m3 if kv_e4m3 else dispatch.decode_applies)(p, True):
        return None
    tile, waves = decode.e4m3_launch(p, H200_SM_COUNT) if kv_e4m3 else (None, None)
    lp = decode.launch_plan(p, H200_SM_COUNT, tile=tile, waves=waves, cluster=cluster)
    # (launch_plan's choice: the planner's own launch, wide-rows blocks included)
    row_blocks = decode.launch_problem(p, None if kv_e4m3 else H200_SM_COUNT, tile, cluster).hkv // hkv
    off = masks.causal_offset(p.causal, nq, nk)
    keys = nk if off is None else max(0, min(nk, nq + off))  # keys the last query token sees
    main = decode.launch_spec(dtype, d, p.causal is not None, lp)
    # cluster: the splits merge in the cluster's distributed shared memory (no partials in memory)
    # last_merges: the partials go through memory and the last split of each pair merges them
    last_merges = decode.last_split_merges(lp, p.group // row_blocks * nq, d)
    return SimpleNamespace(splits=lp.splits, cluster=lp.cluster, keys=keys, source=main.short_name,
                           smem=main.smem_bytes, threads=main.threads, rows=16 * lp.row_tiles, block_n=lp.tile.block_n,
                           last_merges=last_merges, row_blocks=row_blocks)


def backward_launch(dtype, d, causal=False, deterministic=False):
    """Tiles and shared memory of the backward kernels cuflash launches, or None where there is none.

    From plan.dispatch.backward_plan on the modelled H200: the K/V-parallel main kernel (block_n
    keys per block, streaming block_m query rows; the wgmma one where it applies) and, when
    deterministic, the separate dQ kernel. float32: attn_bwd_f32_kv (block_n keys, block_m-row
    query tiles) and attn_bwd_f32_dq, which always runs (row statistics, then dQ)."""
    dtype = check_dtype("dtype", dtype)
    plan = _backward_plan(dtype, d, causal, deterministic)
    if plan is None:
        return None
    specs, t = plan.specs, plan.tile
    if plan.kernel == "fp32":  # the float64 kernels (tensor cores where they exist on the H200)
        return SimpleNamespace(block_m=t.kv_block_m, block_n=t.kv_block_n, hd=plan.head_dim, threads=specs["kv"].threads,
                               smem=specs["kv"].smem_bytes, source=specs["kv"].short_name,
                               dq_block_m=t.dq_block_m, dq_block_n=t.dq_block_n, dq_threads=specs["dq"].threads,
                               dq_smem=specs["dq"].smem_bytes, fp64=True)
    dq = specs.get("dq")
    kv_tile = plan.hopper or t
    return SimpleNamespace(block_m=kv_tile.block_m, block_n=kv_tile.block_n, hd=plan.head_dim, threads=specs["kv"].threads,
                           smem=specs["kv"].smem_bytes, source=specs["kv"].short_name,
                           dq_block_m=t.dq_block_m if dq else None, dq_block_n=t.dq_block_n if dq else None,
                           dq_threads=dq.threads if dq else None, dq_smem=dq.smem_bytes if dq else None, fp64=False)
