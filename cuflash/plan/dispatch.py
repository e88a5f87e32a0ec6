"""The one dispatch: which kernel, tile and schedule run a validated problem on a target GPU.

Every launcher (cuflash.kernels, through cuflash.backends.cuda), the accounting and the tuner read
these plans, so what is launched, what is counted and what is compiled in CI cannot drift apart.
A plan depends on the problem, the target (plan.target.Target: sm_90 or not, its SM count) and a
few facts of the call's arrays (Operands); an explicit tile (schedule search, tests) overrides the
tables, and with ``CUFLASH_TUNE`` the tuning cache's winner does (plan.tuning).

Order of the forward's choice:
  MLA's head dims (576 for q and k, 512 for v; decode shapes only) -> attn_decode_mla
  (plan.decode_mla, mla_decode_applies);
  few query rows per K/V head over a long cache -> split-KV decode (plan.decode), with score
  modifiers too (attn_decode_mod, plan.decode.mod_decode_specs);
  score modifiers (softcap, ALiBi, sinks) -> on sm_90 without a window, rows TMA can address, the
  wgmma TMA kernel with them (attn_fwd_wgmma_tma_mod); else the mma.sync band kernel with them
  (attn_fwd_band_mod), on every GPU and for every mask (the backward: the *_band_mod kernels for
  softcap / ALiBi; sinks alone keep the plain backward);
  a window or packed sequences -> the band kernels (wgmma on sm_90, else mma.sync);
  sm_90, 16-bit, 16-byte-aligned rows, a head dim of the Hopper tables -> the wgmma forward, on a
  tile that depends on the shape (persistent, long rows, a key split of short full-attention grids);
  everything else -> the portable mma.sync kernel (float32: the float64 kernels).
v's head dim unlike q's (dv != d) is decided before all of this by head_dim_v_plan: the dv kernel
(attn_fwd_wgmma_tma_dv) where it applies, else the problem at max(d, dv) on zero-padded copies
(the choices above). float8_e4m3fn q, k, v take fp8_forward_plan: the e4m3 TMA kernel on sm_90,
its band instantiation for windows and packed sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..core.arrays import FLOAT32, KERNEL_TYPE
from ..core.problem import is_mla
from . import decode, decode_mla, hopper, schedule, tuning
from .backward import backward_specs, dq_convert_spec
from .device_limits import MAX_GRID_YZ
from .forward import FP32_BAND, MODS_FP32, forward_spec
from .fp32 import backward_specs_fp32
from .spec import KernelSpec
from .target import Target


@dataclass(frozen=True)
class Operands:
    """What the dispatch reads of a call's arrays."""

    vec: bool  # every array: d % 8 == 0, 16-byte aligned bases and row strides (16-byte loads)
    tma_q: bool = False  # q (backward: q and dO) readable through tensor maps
    tma_kv: bool = False  # k and v readable through tensor maps
    kv_vec: bool = False  # k and v alone allow 16-byte loads (split-KV decode)


ALIGNED = Operands(vec=True, tma_q=True, tma_kv=True, kv_vec=True)  # contiguous arrays: what the accounting models


@dataclass(frozen=True)
class ForwardPlan:
    kernel: str  # "mma" | "band" | "wgmma" | "wgmma_band" | "wgmma_split" | "wgmma_mod" | "wgmma_fp8" |
    #              "wgmma_fp8_band" | "wgmma_dv"
    spec: KernelSpec
    tile: object  # schedule.TileConfig, schedule.HopperTile or plan.fp32.Fp32TileConfig
    splits: int = 0  # wgmma_split: key pieces per query tile

    @property
    def block_m(self) -> int:
        return self.tile.block_m


@dataclass(frozen=True)
class BackwardPlan:
    kernel: str  # "mma" | "band" | "wgmma" (the K/V kernel on wgmma) | "fp32"
    specs: dict  # role -> KernelSpec: prep, kv, convert and, deterministic, dq (fp32: dq, kv)
    head_dim: int  # the head-dim bucket of the portable kernels
    tile: object  # schedule.BackwardTile (the prep / dq / convert kernels') or plan.fp32.Fp32BackwardTile
    hopper: schedule.HopperBwdTile | None = None  # the wgmma K/V kernel's tile
    kv_block_n: int = 0  # keys per block of the K/V kernel that runs
    frag_dq: bool = False  # dQ added in fragment-order chunks (HopperBwdTile.frag_dq)
    acc_head_dim: int = 0  # floats per row of the float32 dQ accumulator


def _known(p, *names) -> bool:
    """Whether the problem gives these fields (the accounting may plan without lengths or a grid:
    the tables' tiles then)."""
    return all(getattr(p, f, None) is not None for f in names)


def decode_applies(p, kv_vec: bool) -> bool:
    """Split-KV decode takes few query rows per K/V head over a long cache, with 16-byte loads of K
    and V (unaligned caches take the prefill kernel, whose scalar-load path handles them); score
    modifiers included (attn_decode_mod)."""
    return p.nq <= 16 and p.nk >= decode.MIN_KEYS and decode.row_tiles_for(p) is not None and kv_vec


def mla_decode_applies(p) -> bool:
    """MLA decoding's head dims (576 for q and k, 512 for v: plan.decode_mla): validation admits the
    pair in decode shapes only (core.problem.check_head_dims), and attn_decode_mla runs all of them -
    contiguous or paged caches, kv_lens, causal, any group - so the pair alone decides."""
    return is_mla(p)


def decode_applies_e4m3(p, kv_vec: bool) -> bool:
    """decode_applies for an e4m3 K/V cache (attn_decode_kv8): its head dims
    (schedule.DECODE_TILES_KV8) and 16-byte copies of the caches' rows (kv_vec: d a multiple of 16);
    no score modifiers (no _kv8 kernel takes them)."""
    if getattr(p, "modified", False):
        return False
    return schedule.head_dim_bucket(p.d) in schedule.DECODE_TILES_KV8 and decode_applies(p, kv_vec)


def decode_tma_applies(p, tile, target: Target, tma_kv: bool) -> bool:
    """Whether attn_decode_tma can run this problem with this tile: sm_90 with cuda-bindings, d of
    64 or 128, few enough packed rows, K and V rows whose base and strides TMA can address, no score
    modifiers."""
    if getattr(p, "modified", False):
        return False
    if p.d not in schedule.DECODE_TMA_TILES or decode.row_blocks(p) > 1 or decode.row_tiles_for(p) > tile.max_row_tiles:
        return False
    return target.hopper and tma_kv


def forward_plan(p, target: Target, ops: Operands, *, tile=None, tuned: bool = True, autotuner=None) -> ForwardPlan:
    """The prefill forward's plan (the caller checked decode_applies first). ``tile``: a forced
    tile of the portable kernel; ``tuned``: consult the tuning cache (``autotuner``: a
    plan.tuning autotuner factory for CUFLASH_TUNE=1's first use)."""
    if (getattr(p, "modified", False) and tile is None and getattr(p, "window", None) is None
            and hopper.applies(p, ops.vec, target) and ops.tma_q and ops.tma_kv):
        t = hopper.mod_tile(p.d, p.causal, getattr(p, "nq", None), getattr(p, "nk", None))
        spec, t = hopper.mod_spec(p.dtype, p.d, p.causal is not None, t)
        return ForwardPlan("wgmma_mod", spec, t)
    if getattr(p, "window", None) is not None or getattr(p, "modified", False):
        return band_forward_plan(p, target, ops, tile=tile)
    if tile is None and hopper.applies(p, ops.vec, target):
        picked = tuning.pick_hopper_forward_tile(p, target, autotuner) if tuned else None
        if picked is not None and picked.tma and not (ops.tma_q and ops.tma_kv):
            picked = None  # a TMA winner, rows TMA cannot address: the cp.async kernel's tile
        return wgmma_forward_plan(p, target, ops, tile=picked)
    if tile is None and ops.vec and tuned:
        tile = tuning.pick_forward_tile(p, target, autotuner)
    spec, tile = forward_spec(p.dtype, p.d, p.causal is not None, ops.vec, tile, target=target)
    return ForwardPlan("mma", spec, tile)


def one_width(p):
    """p at w = max(d, dv) for both head dims: the problem the padded path runs (the narrower side
    zero-padded; cuflash.backends.cuda._one_width)."""
    w = max(p.d, p.dv)
    if dataclasses.is_dataclass(p):
        return dataclasses.replace(p, d=w, head_dim_v=None)
    return SimpleNamespace(**{**vars(p), "d": w, "dv": w})  # (the accounting's shape)


def head_dim_v_plan(p, target: Target, ops: Operands, *, tile=None) -> ForwardPlan | None:
    """v's (and o's) head dim dv unlike q's and k's d: the dv kernel's plan (attn_fwd_wgmma_tma_dv on
    the (d, dv) buckets' tile of schedule.HOPPER_FORWARD_DV_TILES, or ``tile``), or None, where the
    caller runs one_width(p) on zero-padded copies. The dv kernel takes sm_90 with the Hopper
    kernels on, 16-bit inputs, d and dv multiples of 8 with rows TMA can address (``ops``: q, k, v
    and o), no mask or a causal one (no window, packed sequences or score modifiers), outside
    split-KV decode shapes (those pad and run the decode kernel). A ``tile`` where it does not
    apply is a ValueError."""
    buckets = hopper.dv_buckets(p.d, p.dv) if p.d != p.dv and max(p.d, p.dv) <= schedule.HEAD_DIM_BUCKETS[-1] else None
    native = (buckets in schedule.HOPPER_FORWARD_DV_TILES
              and target.hopper and hopper.enabled() and np.dtype(p.dtype) in KERNEL_TYPE
              and p.d % 8 == 0 and p.dv % 8 == 0 and ops.vec and ops.tma_q and ops.tma_kv  # 16-byte rows, tensor maps
              and getattr(p, "window", None) is None and not getattr(p, "modified", False)
              and not (_known(p, "nq", "nk", "hq", "hkv") and decode_applies(one_width(p), True)))
    if not native:
        if tile is not None:
            raise ValueError(f"tile: the dv kernel does not run this problem here (d={p.d}, dv={p.dv}: it needs sm_90, "
                             "float16/bfloat16, (d, dv) buckets of HOPPER_FORWARD_DV_TILES "
                             f"{tuple(schedule.HOPPER_FORWARD_DV_TILES)}, rows TMA can address, no window, "
                             f"packed sequences or score modifiers, not a decode shape, and {hopper.ENV}=auto)")
        return None
    spec, t = hopper.dv_spec(p.dtype, p.d, p.dv, p.causal is not None, tile)
    return ForwardPlan("wgmma_dv", spec, t)


FP8_NEEDS_SM90 = ("float8_e4m3fn GPU inputs run on Hopper (sm_90) only: the e4m3 kernel multiplies with FP8 wgmma "
                  "(NumPy inputs run on the NumPy backend; other GPUs take 16-bit inputs)")


def fp8_forward_plan(p, target: Target, out_dtype, *, packed: bool = False, tile=None) -> ForwardPlan:
    """float8_e4m3fn q, k, v (the caller checked the options): no mask or a causal one ->
    attn_fwd_wgmma_tma_fp8; a window (p.window) or packed sequences (``packed``) -> its band
    instantiation attn_fwd_wgmma_tma_fp8_band (any causal mask too); on the table's tile
    (schedule.HOPPER_FP8_FORWARD_TILES) or ``tile``. NotImplementedError off sm_90. Not subject to
    CUFLASH_KERNELS: no mma.sync kernel takes e4m3."""
    if not target.hopper:
        raise NotImplementedError(FP8_NEEDS_SM90)
    if packed or getattr(p, "window", None) is not None:
        spec, t = hopper.fp8_forward_band_spec(out_dtype, p.d, tile)
        return ForwardPlan("wgmma_fp8_band", spec, t)
    spec, t = hopper.fp8_forward_spec(out_dtype, p.d, p.causal is not None, tile)
    return ForwardPlan("wgmma_fp8", spec, t)


def wgmma_forward_plan(p, target: Target, ops: Operands, *, tile=None, split=None) -> ForwardPlan:
    """The wgmma forward (the caller checked hopper.applies). Without a tile: the TMA kernel on
    the shape's tile (hopper.default_tile) where the rows are TMA-addressable, else the cp.async
    kernel's. ``split``: the key split of full attention on a per-tile TMA tile - None: the
    plan's choice (hopper.split_plan), False: none, an int: that many pieces per query tile."""
    addressable = ops.tma_q and ops.tma_kv
    grid = _known(p, "nq", "nk", "batch", "hq")
    if split is None and addressable and (tile is None or (tile.tma and not tile.persistent)) and grid:
        if tile is None:
            auto = hopper.auto_split(p, target.sm_count)
            if auto is not None:
                tile, split = auto
        else:
            split = hopper.split_plan(p, tile, target.sm_count)
    if tile is None:
        tile = (hopper.default_tile(p.d, p.causal, p.nq, p.nk) if addressable and _known(p, "nq", "nk")
                else schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(p.d)] if addressable
                else hopper.cp_async_tile(p.d))
    spec, t = hopper.forward_spec(p.dtype, p.d, p.causal is not None, tile)
    if t.tma and not addressable:
        raise ValueError("tile: the TMA-fed kernel needs cuda-bindings and 16-byte aligned rows and strides")
    if split:
        if p.causal is not None or not t.tma or p.batch > MAX_GRID_YZ or not 1 <= split <= 64:
            raise ValueError(f"split={split}: the key split needs full attention, a TMA tile, at most "
                             f"{MAX_GRID_YZ} batch entries and 1 <= split <= 64")
        spec, _ = hopper.split_spec(p.dtype, p.d, t)
        return ForwardPlan("wgmma_split", spec, t, splits=int(split))
    return ForwardPlan("wgmma", spec, t)


def band_forward_plan(p, target: Target, ops: Operands, *, tile=None) -> ForwardPlan:
    """Sliding window and/or packed sequences: attn_fwd_wgmma_band where hopper.applies (and no
    tile is forced), else attn_fwd_band (every GPU, 16-bit inputs). Score modifiers (softcap,
    ALiBi, sinks; any mask, packed sequences): attn_fwd_band_mod, on every GPU (forward_plan sends
    the ones without a window to the wgmma kernel on sm_90)."""
    if getattr(p, "modified", False):
        spec, t = forward_spec(p.dtype, p.d, True, ops.vec, tile, band=True, mods=True)
        return ForwardPlan("band", spec, t)
    if np.dtype(p.dtype) == FLOAT32:
        raise NotImplementedError(FP32_BAND)
    if tile is None and hopper.applies(p, ops.vec, target):  # same arguments, grid and lse layout
        spec, t = hopper.forward_band_spec(p.dtype, p.d)
        return ForwardPlan("wgmma_band", spec, t)
    spec, t = forward_spec(p.dtype, p.d, True, ops.vec, tile, band=True)
    return ForwardPlan("band", spec, t)


def backward_plan(p, target: Target, ops: Operands, *, deterministic: bool = False, packed: bool = False, tile=None,
                  hopper_tile=None, tuned: bool = True, autotuner=None) -> BackwardPlan:
    """The backward's kernels. ``tile``: the portable kernels' BackwardTile; ``hopper_tile`` (a
    schedule.HopperBwdTile): the wgmma K/V kernel's, only where hopper.backward_applies (else
    ValueError). A window or packed sequences run the band kernels; the softcap and ALiBi their
    score-modifier variants (sinks need no change of the kernels: lse includes them)."""
    mods = getattr(p, "scores_modified", False)
    causal = p.causal is not None
    # softcap / ALiBi without a window or packed rows: the wgmma K/V kernel with them where it applies
    mod_kv = (mods and not packed and getattr(p, "window", None) is None and tile is None and hopper_tile is None
              and np.dtype(p.dtype) != FLOAT32 and hopper.backward_mod_applies(p, ops.vec, ops.tma_q, target, deterministic))
    band = getattr(p, "window", None) is not None or packed or (mods and not mod_kv)
    if getattr(p, "modified", False) and np.dtype(p.dtype) == FLOAT32:
        raise NotImplementedError(MODS_FP32)
    if np.dtype(p.dtype) == FLOAT32:  # float64 arithmetic (plan.fp32), deterministic either way
        if band:
            raise NotImplementedError(FP32_BAND)
        if tile is not None or hopper_tile is not None:
            raise ValueError("tile / hopper_tile: float32 runs its own kernels (plan.fp32.BACKWARD_TILES_FP32)")
        specs, hd, t = backward_specs_fp32(p.d, causal, target=target)
        return BackwardPlan("fp32", specs, hd, t, kv_block_n=t.kv_block_n)
    kv = hopper.backward_kv_mod_spec(p.dtype, p.d, causal) if mod_kv else None
    if hopper_tile is not None:
        if band or not hopper.backward_applies(p, ops.vec, target):
            raise ValueError("hopper_tile: the wgmma backward K/V kernel does not run for this problem here (it needs "
                             "sm_90, float16/bfloat16 with 16-byte-aligned rows, a head dim of HOPPER_BACKWARD_TILES "
                             f"{tuple(schedule.HOPPER_BACKWARD_TILES)} and {hopper.ENV}=auto)")
        kv = hopper.backward_kv_spec(p.dtype, p.d, causal, deterministic, tile=hopper_tile)
    elif kv is None and tile is None and not band and hopper.backward_applies(p, ops.vec, target):
        picked = tuning.pick_hopper_backward_tile(p, target, deterministic, autotuner) if tuned else None
        kv = hopper.backward_kv_spec(p.dtype, p.d, causal, deterministic, tile=picked)
    if kv is not None and kv[1].tma and not (ops.tma_q and (ops.tma_kv or not kv[1].persistent)):
        if hopper_tile is not None:
            raise ValueError("hopper_tile: the TMA kernel needs cuda-bindings and 16-byte aligned Q/dO rows and strides")
        # The cp.async variant of a split-head-dim tile spills (255 registers), so the mma.sync kernels run.
        kv = None if kv[1].split_d else hopper.backward_kv_spec(
            p.dtype, p.d, causal, deterministic, tile=dataclasses.replace(kv[1], tma=False, ws=False))
    if kv is not None and kv[1].persistent and _known(p, "nk", "hkv", "batch") and (
            -(-p.nk // kv[1].block_n) * p.hkv * min(p.batch, MAX_GRID_YZ) >= 2**31):  # int32 unit count
        kv = hopper.backward_kv_spec(p.dtype, p.d, causal, deterministic,
                                     tile=dataclasses.replace(kv[1], persistent=False))
    if tile is None and ops.vec and kv is None and not band and tuned:
        tile = tuning.pick_backward_tile(p, target, deterministic, autotuner)
    specs, hd, t = backward_specs(p.dtype, p.d, causal, ops.vec, deterministic, tile, band=band, mods=mods and band)
    kv_block_n = t.block_n
    frag_dq = kv is not None and kv[1].frag_dq(deterministic)
    # Rows of the accumulator: the wgmma K/V kernel adds dQ rows of its own HEAD_DIM (192: 256).
    acc_hd = schedule.dq_accumulator_width(hd, kv is not None and not deterministic)
    if kv is not None:
        specs["kv"], kv_block_n = kv[0], kv[1].block_n
    if frag_dq:
        specs["convert"] = hopper.dq_convert_frag_spec(p.dtype, acc_hd)
    elif acc_hd != hd:
        specs["convert"] = dq_convert_spec(p.dtype, acc_hd)
    kernel = "wgmma" if kv is not None else "band" if band else "mma"
    return BackwardPlan(kernel, specs, hd, t, kv[1] if kv is not None else None, kv_block_n, frag_dq, acc_hd)
