"""Hopper plans (wgmma, sm_90a): which problems the wgmma forward (cuda_src/attn_fwd_wgmma.cu)
and the backward's wgmma K/V kernel (cuda_src/attn_bwd_wgmma.cu) take, their tiles, the key split
of short full-attention grids, and the instantiations.

They cover 16-bit inputs with 16-byte-aligned rows (the same condition as the mma.sync kernels'
vector path) and head dims whose padded size has a HOPPER_FORWARD_TILES / HOPPER_BACKWARD_TILES
entry; everything else, and every other GPU, runs the portable kernels (plan.forward,
plan.backward). Sliding windows and packed sequences run the forward's band instantiation
(attn_fwd_wgmma_band) here too; their backward stays on the mma.sync band kernels. v's head dim
unlike q's runs the forward's dv kernel (attn_fwd_wgmma_tma_dv) for the (d, dv) buckets of
HOPPER_FORWARD_DV_TILES (plan.dispatch.head_dim_v_plan), else one head dim on zero-padded copies.
``CUFLASH_KERNELS=mma_sync`` (core.config) turns the Hopper kernels off.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core import config, masks
from ..core.arrays import BFLOAT16, FLOAT16, KERNEL_TYPE
from . import schedule
from .backward import CONVERT_THREADS
from .device_limits import H200
from .spec import KernelSpec
from .target import Target

ENV = config.KERNELS


def enabled() -> bool:
    return config.hopper_kernels()


def _applies(p, vec: bool, table, target: Target) -> bool:
    if not vec or np.dtype(p.dtype) not in KERNEL_TYPE:
        return False
    if schedule.head_dim_bucket(p.d) not in table or not enabled():
        return False
    return target.hopper


def applies(p, vec: bool, target: Target) -> bool:
    """Whether the target runs this problem's forward on the wgmma kernel (a window or packed
    sequences: its band instantiation, see forward_band_spec)."""
    return _applies(p, vec, schedule.HOPPER_FORWARD_TILES, target)


def backward_applies(p, vec: bool, target: Target) -> bool:
    """Whether the target runs this problem's backward K/V kernel on wgmma (never with a window:
    the mma.sync band kernels take windows and packed sequences)."""
    if getattr(p, "window", None) is not None:
        return False
    return _applies(p, vec, schedule.HOPPER_BACKWARD_TILES, target)


def _forward_spec(kernel, dtype, d, flags, tile):
    hd = schedule.head_dim_bucket(d)
    t = tile or schedule.HOPPER_FORWARD_TILES[hd]
    if t.tma:  # its own kernel (tensor-map parameters); always warp-specialized
        kernel = kernel + ("_tma_persistent" if t.persistent else "_tma")
        producer = f", {'true' if t.pingpong else 'false'}" + (", true" if t.wg_epilogue else "")
    else:
        producer = ", true" if t.producer else ""
    expr = f"{kernel}<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {t.block_n}, {t.warpgroups}, {t.stages}{flags}{producer}>"
    return KernelSpec("attn_fwd_wgmma.cu", expr, t.threads, t.smem_bytes(hd)), t


def default_tile(d: int, causal, nq: int, nk: int) -> schedule.HopperTile:
    """The TMA tile the dispatch picks for this shape: a persistent kernel while a query tile sees
    few key tiles on average (schedule.persistent_rule), HOPPER_FORWARD_LONG_ROWS' longer key tile
    while rows see many keys, else the table's. `causal`: None, False or the mask kind
    (masks.normalize_causal's)."""
    hd = schedule.head_dim_bucket(d)
    if nq > 0:
        kind = masks.normalize_causal(causal)
        mean_keys = masks.pair_count(kind, nq, nk) // nq  # visible keys per row, whole keys
        rule = schedule.persistent_rule(hd, kind is not None, mean_keys)
        if rule is not None:
            return rule.tile
        long_rows = schedule.HOPPER_FORWARD_LONG_ROWS.get(hd)
        if long_rows is not None and mean_keys >= long_rows.min_keys:
            return long_rows.tile
    return schedule.HOPPER_FORWARD_TILES[hd]


def forward_spec(dtype, d: int, causal: bool, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of the wgmma forward for these runtime choices (no tile: the table's)."""
    tile = tile or schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(d)]
    return _forward_spec("attn_fwd_wgmma", dtype, d, f", {'true' if causal else 'false'}", tile)


def mod_tile(d: int, causal, nq: int | None, nk: int | None) -> schedule.HopperTile:
    """The tile of the score-modifier kernel: the plain kernel's for the shape (default_tile);
    a persistent one only within schedule.HOPPER_MOD_PERSISTENT_MAX_KEY_TILES, else (and without
    a shape) the table's."""
    hd = schedule.head_dim_bucket(d)
    if nq is None or nk is None:
        return schedule.HOPPER_FORWARD_TILES[hd]
    t = default_tile(d, causal, nq, nk)
    if not t.persistent:
        return t
    limits = schedule.HOPPER_MOD_PERSISTENT_MAX_KEY_TILES.get(hd)
    kind = masks.normalize_causal(causal)
    mean_keys = masks.pair_count(kind, nq, nk) // nq  # (default_tile's measure; nq > 0 here)
    if limits is not None and mean_keys <= limits[kind is not None] * t.block_n:
        return t
    return schedule.HOPPER_FORWARD_TILES[hd]


def mod_spec(dtype, d: int, causal: bool, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of the TMA kernel with softcap, ALiBi and sinks (no mask or a causal
    one): attn_fwd_wgmma_tma_mod (one query tile per block) or, on a persistent tile,
    attn_fwd_wgmma_tma_persistent_mod; the modifiers' arguments after the plain ones (and after
    the persistent kernel's head and batch counts)."""
    hd = schedule.head_dim_bucket(d)
    t = tile or schedule.HOPPER_FORWARD_TILES[hd]
    if not t.tma:
        raise ValueError("tile: the score-modifier kernel runs a TMA kernel (tma=True)")
    kernel = "attn_fwd_wgmma_tma_persistent_mod" if t.persistent else "attn_fwd_wgmma_tma_mod"
    b = lambda x: "true" if x else "false"  # noqa: E731
    params = (f"{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {t.block_n}, {t.warpgroups}, {t.stages}, {b(causal)}, "
              f"{b(t.pingpong)}, {b(t.wg_epilogue)}")
    return KernelSpec("attn_fwd_wgmma.cu", f"{kernel}<{params}>", t.threads, t.smem_bytes(hd)), t


def split_spec(dtype, d: int, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of attn_fwd_wgmma_tma_split: full attention on a per-tile TMA
    tile (the table's by default), every query tile split into key ranges."""
    hd = schedule.head_dim_bucket(d)
    t = tile or schedule.HOPPER_FORWARD_TILES[hd]
    if not t.tma or t.persistent:
        raise ValueError("tile: the key split runs the per-tile TMA kernel (tma=True, persistent=False)")
    if hd not in schedule.SPLIT_HEAD_DIMS:
        raise ValueError(f"d={d}: the key split is built for head-dim buckets {schedule.SPLIT_HEAD_DIMS}")
    b = lambda x: "true" if x else "false"  # noqa: E731
    params = f"{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {t.block_n}, {t.warpgroups}, {t.stages}, {b(t.pingpong)}, {b(t.wg_epilogue)}"
    return KernelSpec("attn_fwd_wgmma.cu", f"attn_fwd_wgmma_tma_split<{params}>", t.threads, t.smem_bytes(hd)), t


def split_plan(p, t: schedule.HopperTile, sm_count: int):
    """Pieces per query tile of the key split for this problem on tile t, or None: full attention
    (no causal mask) on a per-tile TMA tile whose grid has fewer query tiles than SMs
    (schedule.key_splits). Every per-tile TMA tile runs one block per SM (its setmaxnreg split
    takes the whole register file)."""
    if (p.causal is not None or not t.tma or t.persistent or p.nk == 0
            or schedule.head_dim_bucket(p.d) not in schedule.SPLIT_HEAD_DIMS):
        return None
    tiles = -(-p.nq // t.block_m) * p.hq * p.batch
    return schedule.key_splits(tiles, sm_count, -(-p.nk // t.block_n))


def auto_split(p, sm_count: int):
    """(table tile, pieces per tile) when the dispatch splits this problem's query tiles by keys
    (split_plan on the full-attention table tile, which then replaces a persistent tile), else None."""
    if p.causal is not None or schedule.head_dim_bucket(p.d) not in schedule.SPLIT_HEAD_DIMS:
        return None
    t = schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(p.d)]
    splits = split_plan(p, t, sm_count)
    return None if splits is None else (t, splits)


def split_partials(p, t: schedule.HopperTile, splits: int) -> tuple[int, int, int]:
    """(slots, rows, columns) of the key split's float32 partials: one slot per piece but each
    tile's last, a tile's block_m rows of O over the head-dim bucket (accumulator order) and of LSE."""
    tiles = -(-p.nq // t.block_m) * p.hq * p.batch
    return tiles * (splits - 1), t.block_m, schedule.head_dim_bucket(p.d)


def dv_buckets(d: int, dv: int) -> tuple[int, int]:
    """The key of schedule.HOPPER_FORWARD_DV_TILES for q's (and k's) head dim d and v's dv."""
    return schedule.head_dim_bucket(d), schedule.head_dim_bucket(dv)


def dv_spec(dtype, d: int, dv: int, causal: bool, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of attn_fwd_wgmma_tma_dv: v's (and o's) head dim dv unlike q's and
    k's d, each at its own bucket, no mask or a causal one, on the table's tile
    (schedule.HOPPER_FORWARD_DV_TILES) or ``tile``; v's width follows the plain kernel's arguments."""
    hd, hv = dv_buckets(d, dv)
    t = tile or schedule.HOPPER_FORWARD_DV_TILES[(hd, hv)]
    if not t.tma or t.persistent:
        raise ValueError("tile: the dv kernel runs the per-tile TMA kernel (tma=True, persistent=False)")
    b = lambda x: "true" if x else "false"  # noqa: E731
    params = (f"{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {hv}, {t.block_n}, {t.warpgroups}, {t.stages}, {b(causal)}, "
              f"{b(t.pingpong)}, {b(t.wg_epilogue)}")
    return (KernelSpec("attn_fwd_wgmma.cu", f"attn_fwd_wgmma_tma_dv<{params}>", t.threads,
                       t.smem_bytes(hd, head_dim_v=hv)), t)


def all_hopper_dv_forward_specs():
    """Every attn_fwd_wgmma_tma_dv instantiation: the dv table's tiles and their ping-pong / own-pace
    twins (for measuring), both 16-bit dtypes, both masks."""
    return [dv_spec(dtype, hd, hv, causal, tile)[0]
            for dtype in (FLOAT16, BFLOAT16)
            for (hd, hv), t in schedule.HOPPER_FORWARD_DV_TILES.items()
            for causal in (False, True)
            for tile in (t, dataclasses.replace(t, pingpong=not t.pingpong, reason=""))]


def forward_band_spec(dtype, d: int, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of attn_fwd_wgmma_band: sliding window and/or packed sequences,
    the arguments of cuflash.kernels.forward's attn_fwd_band (bounds and cu_seqlens at run time)."""
    if tile is not None and tile.tma:
        raise ValueError("tile: the band kernel has no TMA variant (packed sequences share one tensor)")
    return _forward_spec("attn_fwd_wgmma_band", dtype, d, "", tile or cp_async_tile(d))


def cp_async_tile(d: int) -> schedule.HopperTile:
    """The cp.async kernel's tile (band problems, and rows TMA cannot address)."""
    return schedule.HOPPER_FORWARD_CP_ASYNC_TILES[schedule.head_dim_bucket(d)]


def warp_specialized(t: schedule.HopperTile) -> schedule.HopperTile:
    """The table tile with a producer warpgroup (at most 2 math warpgroups: the producer's
    registers come out of theirs). Measured slower at d >= 128 with cp.async loads;
    kept selectable and compiled in CI as the base of a TMA producer."""
    return schedule.HopperTile(t.block_n, min(t.warpgroups, 2), t.stages, "warp-specialized " + t.reason, True)


def persistent_variants(t: schedule.HopperTile, head_dim: int) -> list[schedule.HopperTile]:
    """The persistent forms of a TMA tile (own-pace and ping-pong, block-wide or per-warpgroup
    epilogue) whose extra O tile still fits
    a block's shared memory on the H200; none for the others (d = 192, 256). At most 2 math
    warpgroups (the tiles the schedule search sweeps); d=64's 3-warpgroup persistent tile is a rule of its own
    (schedule.HOPPER_FORWARD_PERSISTENT)."""
    out = []
    for pp in (False, True):
        for wge in (False, True):
            v = dataclasses.replace(t, warpgroups=min(t.warpgroups, 2), pingpong=pp, persistent=True, wg_epilogue=wge,
                                    reason="")
            if t.tma and v.smem_bytes(head_dim) <= H200.smem_per_block_optin:
                out.append(v)
    return out


def all_hopper_forward_specs():
    """Every wgmma forward instantiation the package can launch: what CI compiles for sm_90a (the
    TMA table's tiles, their ping-pong and persistent variants, the cp.async tiles and their
    warp-specialized variants, the band instantiations, and the dv kernel's)."""
    plain = [
        forward_spec(dtype, hd, causal, tile)[0]
        for dtype in (FLOAT16, BFLOAT16)
        for hd, t in schedule.HOPPER_FORWARD_TILES.items()
        for causal in (False, True)
        for tile in dict.fromkeys((t, dataclasses.replace(t, pingpong=True, persistent=False, wg_epilogue=False, reason=""),
                                   dataclasses.replace(t, pingpong=False, persistent=False, wg_epilogue=False, reason=""),
                                   *persistent_variants(t, hd), cp_async_tile(hd),
                                   *(r.tile for r in schedule.HOPPER_FORWARD_PERSISTENT.get(hd, ()) if r.for_mask(causal)),
                                   *([schedule.HOPPER_FORWARD_LONG_ROWS[hd].tile] if hd in schedule.HOPPER_FORWARD_LONG_ROWS else []),
                                   warp_specialized(cp_async_tile(hd))))
    ]
    plain = list(dict.fromkeys(plain))  # the table's ping-pong tiles are their own variant
    band = [forward_band_spec(dtype, hd)[0] for dtype in (FLOAT16, BFLOAT16) for hd in schedule.HOPPER_FORWARD_TILES]
    split = [split_spec(dtype, hd)[0] for dtype in (FLOAT16, BFLOAT16) for hd in schedule.SPLIT_HEAD_DIMS]
    mods = [mod_spec(dtype, hd, causal, tile)[0]
            for dtype in (FLOAT16, BFLOAT16)
            for hd, t in schedule.HOPPER_FORWARD_TILES.items()
            for causal in (False, True)
            for tile in dict.fromkeys((t, *([schedule.HOPPER_FORWARD_LONG_ROWS[hd].tile]
                                            if hd in schedule.HOPPER_FORWARD_LONG_ROWS else []),
                                       *(r.tile for r in schedule.HOPPER_FORWARD_PERSISTENT.get(hd, ())
                                         if r.for_mask(causal) and hd in schedule.HOPPER_MOD_PERSISTENT_MAX_KEY_TILES)))]
    return plain + band + split + list(dict.fromkeys(mods)) + all_hopper_dv_forward_specs()


def persistent_units(nq: int, block_m: int, causal: bool, heads: int, batch: int) -> int:
    """Work units of a persistent forward (cuda_src/hopper/tile_scheduler.cuh): query tiles, or
    under a causal mask pairs of them, of every (batch entry, head)."""
    m_blocks = -(-nq // block_m)
    return (-(-m_blocks // 2) if causal else m_blocks) * heads * batch


VT_GROUP = 32  # vt's keys (the e4m3 forward's transposed V) are padded to a whole group
# The e4m3 forward's key tiles: whole k32 steps with a WgmmaE4m3<N> wrapper (tools/gen_wgmma.py's
# E4M3_SHAPES); below 128 keys vt's whole 128-key boxes would read more keys than the tile uses.
FP8_KEY_TILES = (128, 160, 192, 224, 256)


def vt_keys(nk: int) -> int:
    """vt's key extent: nk rounded up to VT_GROUP (the padding is zeros)."""
    return -(-nk // VT_GROUP) * VT_GROUP


FP8_VT_THREADS = 256  # fp8_pack_vt's block (cuda_src/fp8_vt.cu)
FP8_VT_KEYS, FP8_VT_COLS = 128, 128  # its block's keys x columns of V (kVtKeys, kVtCols)
FP8_VT_SMEM_BYTES = FP8_VT_KEYS * FP8_VT_COLS  # its static shared memory (the tile; no dynamic)


def _fp8_tile(d: int, tile: schedule.HopperTile | None, causal: bool | None = None):
    """(head-dim bucket, tile) of the e4m3 kernels: ``tile`` checked, or the table's (``causal``
    given: the plain kernel's, schedule.fp8_forward_tile; None: the band kernel's per-tile one)."""
    hd = schedule.fp8_head_dim(d)
    t = tile or (schedule.HOPPER_FP8_FORWARD_TILES[hd] if causal is None else schedule.fp8_forward_tile(hd, causal))
    if not t.tma or (t.wg_epilogue and not t.persistent) or t.block_n not in FP8_KEY_TILES or t.warpgroups > 2:
        raise ValueError("tile: the e4m3 kernel runs a TMA tile of 1 or 2 math warpgroups and key tiles of "
                         f"{', '.join(map(str, FP8_KEY_TILES))} keys (tma=True; wg_epilogue only when persistent)")
    return hd, t


def fp8_forward_spec(out_dtype, d: int, causal: bool, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of attn_fwd_wgmma_tma_fp8: float8_e4m3fn q, k, v (bytes), o in
    ``out_dtype`` (bfloat16 or float16), no mask or a causal one; the table's tile by default
    (schedule.fp8_forward_tile), ping-pong or not; a persistent tile runs
    attn_fwd_wgmma_tma_fp8_persistent."""
    hd, t = _fp8_tile(d, tile, bool(causal))
    b = lambda x: "true" if x else "false"  # noqa: E731
    params = (f"E4m3<{KERNEL_TYPE[np.dtype(out_dtype)]}>, {hd}, {t.block_n}, {t.warpgroups}, {t.stages}, "
              f"{b(causal)}, {b(t.pingpong)}")
    kernel = "attn_fwd_wgmma_tma_fp8"
    if t.persistent:
        kernel, params = kernel + "_persistent", params + (", true" if t.wg_epilogue else "")
    return KernelSpec("attn_fwd_wgmma.cu", f"{kernel}<{params}>", t.threads, t.smem_bytes(hd, 1)), t


def fp8_forward_band_spec(out_dtype, d: int, tile: schedule.HopperTile | None = None):
    """(KernelSpec, HopperTile) of attn_fwd_wgmma_tma_fp8_band: the e4m3 kernel with a sliding
    window and/or packed sequences (bounds and cu_seqlens at run time, as attn_fwd_wgmma_band's),
    on the plain kernel's tiles."""
    hd, t = _fp8_tile(d, tile)
    if t.persistent:
        raise ValueError("tile: the e4m3 band kernel runs one query tile per block (persistent=False)")
    params = (f"E4m3<{KERNEL_TYPE[np.dtype(out_dtype)]}>, {hd}, {t.block_n}, {t.warpgroups}, {t.stages}, "
              f"{'true' if t.pingpong else 'false'}")
    return (KernelSpec("attn_fwd_wgmma.cu", f"attn_fwd_wgmma_tma_fp8_band<{params}>", t.threads, t.smem_bytes(hd, 1)),
            t)


def fp8_vt_spec(vec: bool) -> KernelSpec:
    """fp8_pack_vt (cuda_src/fp8_vt.cu): the e4m3 forward's transposed V; ``vec``: 16-byte loads."""
    return KernelSpec("fp8_vt.cu", f"fp8_pack_vt<{'true' if vec else 'false'}>", FP8_VT_THREADS, 0)


def all_hopper_fp8_forward_specs():
    """Every e4m3 forward instantiation (both output dtypes, both masks, the per-tile table's tiles
    and their ping-pong / own-pace twins, the persistent table's tiles; the band kernel on the
    per-tile tiles) and the vt kernels: what CI compiles for sm_90a."""
    specs = []
    for out in (BFLOAT16, FLOAT16):
        for hd, t in schedule.HOPPER_FP8_FORWARD_TILES.items():
            for causal in (False, True):
                tiles = (t, dataclasses.replace(t, pingpong=not t.pingpong, reason=""),
                         schedule.fp8_forward_tile(hd, causal))
                specs += [fp8_forward_spec(out, hd, causal, tile)[0] for tile in tiles]
    specs = list(dict.fromkeys(specs))
    band = [fp8_forward_band_spec(out, hd)[0] for out in (BFLOAT16, FLOAT16) for hd in schedule.FP8_HEAD_DIMS]
    return specs + band + [fp8_vt_spec(True), fp8_vt_spec(False)]


def backward_kv_spec(dtype, d: int, causal: bool, deterministic: bool, tile: schedule.HopperBwdTile | None = None):
    """(KernelSpec, HopperBwdTile) of the wgmma backward K/V kernel (same arguments as attn_bwd_kv)."""
    bucket = schedule.head_dim_bucket(d)
    t = tile or schedule.hopper_backward_tile(bucket, causal)
    hd = schedule.hopper_backward_head_dim(bucket)  # the kernel's HEAD_DIM (192: the 256 kernel)
    if t.split_d != (hd > 128):
        raise ValueError(f"tile: split_d must be {hd > 128} at head dim {hd} (HopperBwdTraits::kSplitD)")
    if t.split_d and t.ws:  # (its dQ halves do not fit the warp-specialized kernel's 64 x 64 dQ tiles)
        t = dataclasses.replace(t, ws=False, persistent=False, math_stats=False)
    if t.ws and (deterministic or not t.tma):  # the warp-specialized kernel adds dQ atomically, by TMA
        t = dataclasses.replace(t, ws=False)
    if t.persistent and not t.ws:  # only the warp-specialized kernel walks units
        t = dataclasses.replace(t, persistent=False)
    if t.persistent and not t.math_stats:  # its producer has no room for them
        t = dataclasses.replace(t, math_stats=True)
    if not t.ws and t.math_stats:
        t = dataclasses.replace(t, math_stats=False)
    if t.ws:
        tail = "" if t.persistent else f", {'true' if t.math_stats else 'false'}"
        expr = (f"attn_bwd_kv_wgmma_ws{'_persistent' if t.persistent else ''}<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, "
                f"{t.block_m}, {t.warpgroups}, {'true' if causal else 'false'}{tail}>")
        return KernelSpec("attn_bwd_wgmma.cu", expr, t.threads, t.smem_bytes(hd)), t
    expr = (
        f"attn_bwd_kv_wgmma{'_tma' if t.tma else ''}<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {t.block_m}, {t.warpgroups}, "
        f"{'true' if causal else 'false'}, {'false' if deterministic else 'true'}>"
    )
    return KernelSpec("attn_bwd_wgmma.cu", expr, t.threads, t.smem_bytes(hd)), t


MOD_BACKWARD_HEAD_DIMS = (64, 128)  # the warp-specialized kernel's buckets (d = 192/256 run no WS kernel)


def backward_mod_applies(p, ops_vec: bool, tma_q: bool, target: Target, deterministic: bool) -> bool:
    """Whether the softcap / ALiBi backward runs its K/V kernel on wgmma (attn_bwd_kv_wgmma_ws_mod):
    the warp-specialized kernel's buckets, Q and dO rows TMA can address, atomic dQ (deterministic
    runs need the band dQ kernel's modifiers: the mma.sync band kernels)."""
    return (backward_applies(p, ops_vec, target) and tma_q and not deterministic
            and schedule.head_dim_bucket(p.d) in MOD_BACKWARD_HEAD_DIMS)


def backward_kv_mod_spec(dtype, d: int, causal: bool):
    """(KernelSpec, HopperBwdTile) of attn_bwd_kv_wgmma_ws_mod: the default warp-specialized tile of
    the bucket (not persistent), softcap and ALiBi arguments after the plain ones."""
    hd = schedule.head_dim_bucket(d)
    if hd not in MOD_BACKWARD_HEAD_DIMS:
        raise ValueError(f"d={d}: the score-modifier wgmma backward is built for buckets {MOD_BACKWARD_HEAD_DIMS}")
    t = dataclasses.replace(backward_tma(schedule.hopper_backward_tile(hd, causal)), ws=True, persistent=False)
    if hd == 64 and causal:  # with the producer's row statistics it spills 4 words here
        t = dataclasses.replace(t, math_stats=True)
    expr = (f"attn_bwd_kv_wgmma_ws_mod<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {t.block_m}, {t.warpgroups}, "
            f"{'true' if causal else 'false'}, {'true' if t.math_stats else 'false'}>")
    return KernelSpec("attn_bwd_wgmma.cu", expr, t.threads, t.smem_bytes(hd)), t


def dq_convert_frag_spec(dtype, hd: int) -> KernelSpec:
    """attn_bwd_dq_convert (FRAG): dQ from attn_bwd_kv_wgmma_ws's fragment-order accumulator."""
    return KernelSpec("attn_bwd.cu", f"attn_bwd_dq_convert<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, true>",
                      CONVERT_THREADS, 0)


def backward_tma(t: schedule.HopperBwdTile) -> schedule.HopperBwdTile:
    """The tile with Q and dO fetched by TMA (attn_bwd_kv_wgmma_tma)."""
    return t if t.tma else dataclasses.replace(t, tma=True, reason="TMA-fed " + t.reason)


def all_hopper_backward_specs():
    specs = [
        backward_kv_spec(dtype, hd, causal, det, tile)[0]
        for dtype in (FLOAT16, BFLOAT16)
        for hd, t in schedule.HOPPER_BACKWARD_TILES.items()
        for tile in ((dataclasses.replace(backward_tma(t), ws=False),) if t.split_d else  # (no cp.async variant: it spills)
                     (dataclasses.replace(t, tma=False), dataclasses.replace(backward_tma(t), ws=False),
                      dataclasses.replace(backward_tma(t), ws=True),
                      dataclasses.replace(backward_tma(t), ws=True, math_stats=True),
                      dataclasses.replace(backward_tma(t), ws=True, persistent=True)))
        for causal in (False, True)
        for det in (False, True)
    ]
    specs += [dq_convert_frag_spec(dtype, schedule.hopper_backward_head_dim(hd))
              for dtype in (FLOAT16, BFLOAT16) for hd in schedule.HOPPER_BACKWARD_TILES]
    specs += [backward_kv_mod_spec(dtype, hd, causal)[0]
              for dtype in (FLOAT16, BFLOAT16) for hd in MOD_BACKWARD_HEAD_DIMS for causal in (False, True)]
    return list(dict.fromkeys(specs))
