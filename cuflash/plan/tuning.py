"""Tile tuning, the plan side: the search space of each tunable kernel, legality (the kernels'
static_asserts mirrored, shared memory, threads), register estimates, the tuning cache and the
pick the dispatch reads.

Five kernels have a tile to choose (``OPS``): ``"fwd"`` (the mma.sync forward, a
schedule.TileConfig), ``"fwd_wgmma"`` (the Hopper forward, a schedule.HopperTile), ``"bwd"`` (the
backward's K/V-parallel main kernel: block_m, block_n, warps, warps_d of a schedule.BackwardTile,
timed as the whole backward with atomic dQ), ``"bwd_dq"`` (the deterministic dQ kernel's dq_*
fields) and ``"bwd_wgmma"`` (the Hopper backward K/V kernel, a schedule.HopperBwdTile).

With ``CUFLASH_TUNE=1`` a bucket (kernel, head-dim bucket, dtype, causal, Nq and Nk rounded up to
powers of two, device name) is autotuned on first use by cuflash.autotune (checked against the
float64 reference, then timed); the winner goes to a JSON cache (core.config.cache_dir()/tune.json)
keyed by device name, cuflash version and the kernel source's hash; a corrupt or stale cache is
ignored with a TuneCacheWarning and rebuilt. ``CUFLASH_TUNE=cached`` reads winners only;
unset or ``0``: the built-in tables only, nothing is read or timed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

import numpy as np

from ..core import config
from ..core.arrays import BFLOAT16, FLOAT16, dtype_name
from ..core.problem import stream_is_capturing
from ..core.sources import load_source
from ..core.sources import source_hash as _text_source_hash
from ..core.version import __version__
from . import schedule
from .backward import backward_specs
from .device_limits import DeviceLimits, occupancy
from .forward import forward_spec
from .hopper import backward_kv_spec
from .hopper import forward_spec as hopper_forward_spec
from .schedule import BackwardTile, HopperBwdTile, HopperTile, TileConfig

OPS = ("fwd", "bwd", "bwd_dq", "fwd_wgmma", "bwd_wgmma")


FORWARD_OPS = ("fwd", "fwd_wgmma")


HOPPER_OPS = ("fwd_wgmma", "bwd_wgmma")  # sm_90a kernels, for the buckets of their Hopper tables


OP_SOURCE = {"fwd": "attn_fwd.cu", "bwd": "attn_bwd.cu", "bwd_dq": "attn_bwd.cu", "fwd_wgmma": "attn_fwd_wgmma.cu",
             "bwd_wgmma": "attn_bwd_wgmma.cu"}


OP_TITLE = {"fwd": "forward (mma.sync)", "bwd": "backward main kernel (K/V-parallel, atomic dQ)",
            "bwd_dq": "backward deterministic dQ kernel", "fwd_wgmma": "forward, Hopper wgmma kernel (sm_90a)",
            "bwd_wgmma": "backward K/V kernel, Hopper wgmma (sm_90a, atomic dQ)"}


_TILE_CLASS = {"fwd": TileConfig, "fwd_wgmma": HopperTile, "bwd_wgmma": HopperBwdTile}  # else BackwardTile


TUNED_DTYPES = (FLOAT16, BFLOAT16)  # the float32 kernels have their own fixed tile


# The search space per kernel.
FWD_SPACE = dict(block_m=(64, 128, 256), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))


BWD_SPACE = dict(block_m=(32, 64, 128), block_n=(32, 64, 128), warps=(4, 8), warps_d=(1, 2, 4))


DQ_SPACE = dict(dq_block_m=(64, 128), dq_block_n=(16, 32, 64), dq_warps=(4, 8), dq_split=(1, 2, 4))


# block_n values need a generated wgmma wrapper (tools/gen_wgmma.py SHAPES); a value without one
# is illegal, not a compile failure. 256 is kept although it spills at d 64/128 (so the tables
# show where the register file ends). Stages: slots of each of the K and V rings, >= 2.
WGMMA_SPACE = dict(block_n=(64, 80, 96, 128, 160, 176, 192, 256), warpgroups=(1, 2, 3), stages=(2, 3, 4, 5))


# Hopper backward K/V kernel: keys owned = 64 x warpgroups; queries per step 64 or 64 x warpgroups.
BWD_WGMMA_SPACE = dict(block_m=(64, 128, 192), warpgroups=(1, 2, 3))


_SPACES = {"fwd": FWD_SPACE, "bwd": BWD_SPACE, "bwd_dq": DQ_SPACE, "fwd_wgmma": WGMMA_SPACE,
           "bwd_wgmma": BWD_WGMMA_SPACE}


ENV_MODE = config.TUNE


ENV_CACHE_DIR = config.CACHE_DIR


ENV_MAX_CANDIDATES = config.TUNE_MAX_CANDIDATES


DEFAULT_MAX_CANDIDATES = config.DEFAULT_MAX_CANDIDATES  # autotune on first use: candidates timed per bucket


CACHE_FORMAT = "cuflash-tune-1"


class TuneCacheWarning(UserWarning):
    """The tuning cache was unreadable, corrupt or stale and is being rebuilt."""


@dataclass(frozen=True)
class Candidate:
    """One tile choice for one kernel and head-dim bucket."""

    op: str
    hd: int
    tile: object  # TileConfig ("fwd"), BackwardTile ("bwd", "bwd_dq"), HopperTile ("fwd_wgmma"), HopperBwdTile

    @property
    def name(self) -> str:
        t = self.tile
        if self.op == "fwd":
            return f"{t.block_m}x{t.block_n}w{t.warps}s{t.stages}" + ("" if getattr(t, "lazy_rescale", True) else "-eager")
        if self.op == "fwd_wgmma":  # query rows x keys, warpgroups, stages
            return f"{t.block_m}x{t.block_n}wg{t.warpgroups}s{t.stages}"
        if self.op == "bwd_wgmma":  # queries per step, keys owned, warpgroups
            return f"q{t.block_m}k{t.block_n}wg{t.warpgroups}"
        if self.op == "bwd":  # q rows streamed, k keys owned, warps, warps splitting d
            return f"q{t.block_m}k{t.block_n}w{t.warps}d{t.warps_d}"
        return f"q{t.dq_block_m}k{t.dq_block_n}w{t.dq_warps}x{t.dq_split}"

    @property
    def threads(self) -> int:
        if self.op in HOPPER_OPS:
            return self.tile.threads
        return 32 * (self.tile.dq_warps if self.op == "bwd_dq" else self.tile.warps)

    @property
    def stages(self) -> int:
        """K/V tiles in flight (forward kernels), 0 where the kernel has no ring to size."""
        return self.tile.stages if self.op in FORWARD_OPS else 0

    @property
    def kernel_hd(self) -> int:
        """The kernel's HEAD_DIM: the bucket, but for the wgmma backward its kernel's
        (schedule.HOPPER_BACKWARD_KERNEL_HD: bucket 192 runs the 256 kernel)."""
        return schedule.hopper_backward_head_dim(self.hd) if self.op == "bwd_wgmma" else self.hd

    @property
    def smem_bytes(self) -> int:
        if self.op == "bwd_dq":
            return self.tile.dq_smem_bytes(self.hd)
        return self.tile.smem_bytes(self.kernel_hd)

    @property
    def area(self) -> int:
        t = self.tile
        return t.dq_block_m * t.dq_block_n if self.op == "bwd_dq" else t.block_m * t.block_n

    def fields(self) -> dict:
        return tile_to_dict(self.tile)


def tile_to_dict(tile) -> dict:
    return {f.name: getattr(tile, f.name) for f in fields(tile)}


def tile_from_dict(op: str, d: dict):
    """The tile a cache entry stores, each field checked against its type; fields the entry lacks
    take their defaults (a field added to the dataclass later), unknown ones are refused."""
    cls = _TILE_CLASS.get(op, BackwardTile)
    known = {f.name: f for f in fields(cls)}
    if not isinstance(d, dict) or not set(d) <= set(known):
        raise ValueError(f"tile: expected fields among {sorted(known)}, got {d!r}")
    for name, f in known.items():
        if name not in d:
            if f.default is MISSING:
                raise ValueError(f"tile: field {name} is missing")
            continue
        x, kind = d[name], str(f.type)
        ok = {"str": isinstance(x, str), "bool": isinstance(x, bool)}.get(
            kind, isinstance(x, int) and not isinstance(x, bool) and x >= 1)
        if not ok:
            raise ValueError(f"tile: field {name} ({kind}) has the value {x!r}")
    return cls(**d)


def op_fields(op: str) -> tuple:
    """The tile fields kernel ``op`` reads (the others belong to the other backward kernel)."""
    return tuple(_SPACES[_check_op(op)])


def same_tile(op: str, a, b) -> bool:
    """a and b launch kernel ``op`` identically (reasons and the other kernel's fields aside)."""
    return a is not None and b is not None and all(getattr(a, f) == getattr(b, f) for f in op_fields(op))


def table_tile(op: str, hd: int):
    """The built-in table's tile for this kernel and head-dim bucket."""
    if op == "fwd_wgmma":
        return schedule.HOPPER_FORWARD_TILES[hd]
    if op == "bwd_wgmma":
        return schedule.HOPPER_BACKWARD_TILES[hd]
    return schedule.FORWARD_TILES[hd] if op == "fwd" else schedule.BACKWARD_TILES[hd]


def op_buckets(op: str) -> tuple:
    """The head-dim buckets kernel ``op`` runs for: every bucket, except the Hopper kernels, which
    plan.hopper.applies / backward_applies dispatch only where HOPPER_FORWARD_TILES /
    HOPPER_BACKWARD_TILES have an entry."""
    if _check_op(op) == "fwd_wgmma":
        return tuple(schedule.HOPPER_FORWARD_TILES)
    if op == "bwd_wgmma":
        return tuple(schedule.HOPPER_BACKWARD_TILES)
    return schedule.HEAD_DIM_BUCKETS


def _check_op(op):
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    return op


def candidates(op: str, hd: int, base=None) -> list[Candidate]:
    """Every candidate of the search space (legal or not) for kernel ``op`` at head-dim bucket hd.

    The fields outside the search space (the other backward kernel's, the forward's lazy_rescale)
    come from ``base``, by default the table's tile."""
    _check_op(op)
    if hd not in op_buckets(op):
        raise ValueError(f"hd: expected a head-dim bucket of {op}, {op_buckets(op)}, got {hd}")
    out = []
    base = base or table_tile("bwd" if op == "bwd_dq" else op, hd)
    space = _SPACES[op]
    for values in itertools.product(*space.values()):
        out.append(Candidate(op, hd, replace(base, reason="search", **dict(zip(space, values)))))
    return out


def _swizzle_ok(cols: int) -> bool:
    # common.cuh Swizzle: rows of 32 elements or a multiple of 64.
    return cols % 64 == 0 or cols == 32


def forward_violations(hd: int, t: TileConfig) -> list[str]:
    """FwdTraits' and Swizzle's static_asserts (attn_fwd.cu, common.cuh), in Python."""
    v = []
    threads, chunks = 32 * t.warps, hd // 8
    if not _swizzle_ok(hd):
        v.append(f"head dim {hd}: swizzled rows need 32 or a multiple of 64 columns")
    if t.block_m % t.warps or (t.block_m // t.warps) % 16:
        v.append(f"rows per warp {t.block_m}/{t.warps} is not a multiple of 16 (whole mma tiles)")
    if t.block_n % 16 or hd % 16:
        v.append("block_n and the head dim must be multiples of 16 (mma k-steps)")
    if (t.block_m * chunks) % threads or (t.block_n * chunks) % threads:
        v.append(f"tile loads do not split evenly over {threads} threads")
    if t.stages < 2:
        v.append("stages < 2: the ring needs one tile in use and one in flight")
    return v


def backward_violations(hd: int, t: BackwardTile) -> list[str]:
    """BwdTraits' static_asserts (attn_bwd.cu) and the loops that assume them."""
    v = []
    threads, chunks = 32 * t.warps, hd // 8
    if t.warps % t.warps_d:
        v.append(f"warps_d {t.warps_d} does not divide {t.warps} warps")
        return v
    warps_n = t.warps // t.warps_d
    if t.block_n % warps_n or (t.block_n // warps_n) % 16:
        v.append(f"key rows per warp {t.block_n}/{warps_n} is not a multiple of 16")
    if hd % t.warps_d or (hd // t.warps_d) % 16:
        v.append(f"dK/dV columns per warp {hd}/{t.warps_d} is not a multiple of 16")
    row_tiles = t.block_m // 16
    if t.block_m % 16 or row_tiles == 0 or t.warps % row_tiles:
        v.append(f"dQ tiles ({t.block_m}/16 row tiles) do not cover the {t.warps} warps exactly")
    else:
        slices = t.warps // row_tiles
        if hd % slices or (hd // slices) % 16:
            v.append(f"dQ columns per warp {hd}/{slices} is not a multiple of 16")
    if not _swizzle_ok(t.block_m):
        v.append(f"block_m {t.block_m}: the dS tile's swizzled rows need 32 or a multiple of 64 columns")
    if (t.block_m * chunks) % threads or (t.block_n * chunks) % threads:
        v.append(f"tile loads do not split evenly over {threads} threads")
    return v


def dq_violations(hd: int, t: BackwardTile) -> list[str]:
    """DqTraits' static_asserts and attn_bwd_dq's column-slice assert (attn_bwd.cu)."""
    v = []
    threads, chunks = 32 * t.dq_warps, hd // 8
    if t.dq_block_m % t.dq_warps or (t.dq_block_m // t.dq_warps) % 16:
        v.append(f"rows per warp {t.dq_block_m}/{t.dq_warps} is not a multiple of 16")
    if t.dq_block_n % 16:
        v.append("dq_block_n must be a multiple of 16 (pairs of 8-column S tiles)")
    if (t.dq_block_m * chunks) % threads or (t.dq_block_n * chunks) % threads:
        v.append(f"tile loads do not split evenly over {threads} threads")
    if chunks % t.dq_split or (chunks // t.dq_split) % 2:
        v.append(f"dq_split {t.dq_split}: dQ column slices must be pairs of 8-column tiles")
    return v


_WRAPPER = re.compile(r"struct\s+Wgmma\s*<\s*T\s*,\s*(\d+)\s*>")


def wgmma_shapes() -> tuple:
    """The N of every wgmma wrapper in cuda_src/wgmma_ops.cuh (generated by tools/gen_wgmma.py)."""
    return tuple(sorted({int(n) for n in _WRAPPER.findall(load_source("wgmma_ops.cuh"))}))


def hopper_forward_violations(hd: int, t: HopperTile) -> list[str]:
    """HopperFwdTraits', Sw128Tile's static_asserts and the wgmma wrappers attn_fwd_wgmma.cu
    instantiates: Wgmma<T, block_n> for S = Q K^T and Wgmma<T, head dim> for O += P V."""
    v = []
    shapes = wgmma_shapes()
    if hd % 64:
        v.append(f"head dim {hd}: 128-byte swizzle atoms need a multiple of 64 columns")
    elif hd not in shapes:
        v.append(f"head dim {hd}: no wgmma wrapper m64n{hd}k16 for P V (tools/gen_wgmma.py SHAPES)")
    if t.block_n % 16:
        v.append(f"block_n {t.block_n} is not a multiple of 16 (whole k-steps of P V)")
    if t.block_n not in shapes:
        v.append(f"block_n {t.block_n}: no wgmma wrapper m64n{t.block_n}k16 (tools/gen_wgmma.py SHAPES {shapes})")
    if t.stages < 2:
        v.append("stages < 2: a K (and a V) tile in use while the next one loads")
    if t.pingpong and (not t.tma or not 2 <= t.warpgroups <= 3):
        v.append("ping-pong takes turns between 2 or 3 math warpgroups of the TMA kernel")
    if t.specialized and t.warpgroups > 3:
        v.append("a producer warpgroup and more than 3 math warpgroups exceed 512 threads")
    if t.wg_epilogue and (not t.tma or (t.pingpong and not t.persistent)):
        v.append("the per-warpgroup epilogue is the TMA kernels', with ping-pong only in the persistent one")
    return v


def hopper_dq_columns(hd: int, t: HopperBwdTile) -> int:
    """HopperBwdTraits::kDqCols: the N of the dQ = dS K wgmma (dQ split by query rows when
    block_m = 64 x warpgroups, else by 64-column blocks where the head dim allows, else by keys)."""
    by_rows = t.block_m == 64 * t.warpgroups
    return hd // t.warpgroups if not by_rows and hd % (64 * t.warpgroups) == 0 else hd


def hopper_backward_violations(hd: int, t: HopperBwdTile) -> list[str]:
    """HopperBwdTraits' static_asserts (attn_bwd_wgmma.cu) and the wgmma wrappers it instantiates:
    Wgmma<T, 64> for S^T and dP^T (split_d: Wgmma<T, 32>, each warpgroup's 32 queries), Wgmma<T, head dim>
    (split_d: its share) for dV and dK, Wgmma<T, kDqCols> for dQ."""
    v = []
    shapes = wgmma_shapes()
    if hd % 64:
        v.append(f"head dim {hd}: 128-byte swizzle atoms need a multiple of 64 columns")
    if t.block_m % 64:
        v.append(f"block_m {t.block_m}: 128-byte swizzle atoms need a multiple of 64 query rows")
    if t.block_m != 64 and t.block_m != 64 * t.warpgroups:
        v.append(f"block_m {t.block_m} is neither 64 nor 64 x {t.warpgroups} warpgroups (dQ = dS K takes one "
                 f"64-row wgmma tile per warpgroup)")
    if t.split_d != (hd > 128):
        v.append(f"split_d {t.split_d}: HopperBwdTraits splits dK/dV's columns exactly when the head dim exceeds 128")
    dkv_cols = hd // t.warpgroups if t.split_d else hd
    if t.split_d and (t.block_m != 64 or t.warpgroups < 2 or hd % (64 * t.warpgroups)):
        v.append(f"split head dim: 64-query steps, 2+ warpgroups (dQ by columns) and whole 64-column blocks per "
                 f"warpgroup (block_m {t.block_m}, {hd} columns over {t.warpgroups} warpgroups)")
    wrappers = sorted({dkv_cols, hopper_dq_columns(hd, t)}) if hd % 64 == 0 and dkv_cols % 8 == 0 else []
    wrappers += [32] if t.split_d else []  # split S: each warpgroup's S^T over 32 queries
    for n in wrappers:
        if n not in shapes:
            v.append(f"no wgmma wrapper m64n{n}k16 (tools/gen_wgmma.py SHAPES {shapes})")
    return v


def violations(cand: Candidate, limits: DeviceLimits | None = None) -> list[str]:
    """Why a candidate cannot launch (empty when it is legal before compiling)."""
    check = {"fwd": forward_violations, "bwd": backward_violations, "bwd_dq": dq_violations,
             "fwd_wgmma": hopper_forward_violations, "bwd_wgmma": hopper_backward_violations}[cand.op]
    v = check(cand.kernel_hd, cand.tile)
    if limits is not None:
        if cand.threads > limits.max_threads_per_block:
            v.append(f"{cand.threads} threads > {limits.max_threads_per_block} per block")
        if cand.smem_bytes > limits.smem_per_block_optin:
            v.append(f"shared memory {cand.smem_bytes} B > {limits.smem_per_block_optin} B opt-in per block")
    return v


def legal_candidates(op: str, hd: int, limits: DeviceLimits, base=None) -> list[Candidate]:
    return [c for c in candidates(op, hd, base) if not violations(c, limits)]


def register_cap(limits: DeviceLimits, threads: int) -> int:
    """The most registers per thread __launch_bounds__(threads) leaves ptxas: one block must fit
    the per-block register file, allocated in units of 8 per thread, and at most 255."""
    unit = limits.reg_alloc_unit // limits.warp_size
    return min(limits.max_regs_per_thread, (limits.regs_per_block // threads) // unit * unit)


def estimated_registers(cand: Candidate) -> int:
    """A rough count of the accumulators a thread keeps live, plus addressing overhead.

    Only ORDERS the search (likely spills last); the compiler's report decides legality."""
    t, hd = cand.tile, cand.kernel_hd
    if cand.op == "fwd_wgmma":
        # Per thread (64 rows x N columns over a warpgroup's 128 threads): S = block_n/2 floats,
        # O = hd/2, P = block_n/4 packed pairs; +40 matched ptxas (sm_90a, NVRTC 13) on d 64/128.
        return t.block_n // 2 + hd // 2 + t.block_n // 4 + 40
    if cand.op == "bwd_wgmma":
        # Per thread (64 key rows per warpgroup): dK + dV = hd floats, S^T and dP^T of a 64-query
        # half = 64, a quarter of the dQ columns; +40 matched ptxas (sm_90a, NVRTC 13) on d 64/128.
        # split_d: each warpgroup's dK + dV columns, S^T and dP^T whole, dQ's 128 columns / 8
        # (ptxas: 250 for d=256 q64k64wg2, clean).
        if t.split_d:
            return hd // t.warpgroups + 64 + hopper_dq_columns(hd, t) // 8 + 40
        return hd + 64 + hopper_dq_columns(hd, t) // 4 + 40
    if cand.op == "fwd":
        rows = t.block_m // max(t.warps, 1)
        q_regs = rows * hd // 64 if hd <= 64 else 0
        return rows * hd // 32 + 3 * rows * t.block_n // 64 + q_regs + 24
    if cand.op == "bwd":
        rows = t.block_n // max(t.warps // max(t.warps_d, 1), 1)
        slices = max(t.warps // max(t.block_m // 16, 1), 1)
        return 2 * rows * (hd // t.warps_d) // 32 + 3 * rows * t.block_m // 32 + hd // slices // 2 + rows // 2 + 32
    rows = t.dq_block_m // max(t.dq_warps, 1)
    return rows * (hd // t.dq_split) // 32 + 3 * rows * t.dq_block_n // 32 + rows // 2 + 32


def likely_spills(cand: Candidate, limits: DeviceLimits) -> bool:
    return estimated_registers(cand) > register_cap(limits, cand.threads)


def shortlist(cands: list[Candidate], k: int | None, limits: DeviceLimits, table=None) -> list[Candidate]:
    """Legal candidates in the order to try them, at most k (None: all).

    The table's tile first (the baseline), then the largest tile, then one variant per distinct
    block shape, round robin, so a short list still spans the shapes: shapes unlikely to spill
    first, nearest the table's shape first; within a shape, the variant least likely to spill and
    then with the most warps resident (estimated)."""
    legal = [c for c in cands if not violations(c, limits)]
    if not legal:
        return []

    def shape(c):
        t = c.tile
        if c.op in FORWARD_OPS or c.op == "bwd_wgmma":
            return (t.block_m, t.block_n)
        if c.op == "bwd":
            return (t.block_m, t.block_n, t.warps_d)
        return (t.dq_block_m, t.dq_block_n, t.dq_split)

    ref = next((c for c in legal if same_tile(c.op, c.tile, table)), None)
    ref_shape = shape(ref) if ref is not None else shape(legal[0])

    def distance(s):
        return sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(s, ref_shape))

    def variant_key(c):
        occ = occupancy(limits, c.threads, min(estimated_registers(c), 255), c.smem_bytes)
        return (likely_spills(c, limits), -occ.warps_per_sm, c.stages, c.name)

    by_shape: dict = {}
    for c in legal:
        by_shape.setdefault(shape(c), []).append(c)
    for s in by_shape:
        by_shape[s].sort(key=variant_key)
    shapes = sorted(by_shape, key=lambda s: (likely_spills(by_shape[s][0], limits), distance(s), s))
    order = [ref] if ref is not None else []
    largest = max(legal, key=lambda c: (not likely_spills(c, limits), c.area, c.threads, c.name))
    order.append(largest)
    for depth in itertools.count():
        added = False
        for s in shapes:
            if depth < len(by_shape[s]):
                order.append(by_shape[s][depth])
                added = True
        if not added:
            break
    seen, out = set(), []
    for c in order:
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out if k is None else out[:k]


def largest_first(cands: list[Candidate], limits: DeviceLimits) -> list[Candidate]:
    """Legal candidates, largest tile first (the "largest legal tile" is the first that compiles cleanly)."""
    legal = [c for c in cands if not violations(c, limits)]
    return sorted(legal, key=lambda c: (-c.area, -c.threads, -c.stages, c.name))


@dataclass(frozen=True)
class CompileInfo:
    registers: int | None
    spill_bytes: int  # spill stores + loads (ptxas), or local memory per thread (device)
    stack_bytes: int
    how: str  # "nvrtc sm_90a (offline)" or "device"
    error: str | None = None

    @property
    def clean(self) -> bool:
        return self.error is None and self.spill_bytes == 0 and self.stack_bytes == 0


def spec_for(cand: Candidate, dtype, causal: bool, vec: bool = True):
    """The KernelSpec of the kernel this candidate changes, as the launch code builds it."""
    if cand.op == "fwd":
        return forward_spec(dtype, cand.hd, causal, vec, cand.tile)[0]
    if cand.op == "fwd_wgmma":  # vector loads only: the kernel has no scalar path
        return hopper_forward_spec(dtype, cand.hd, causal, cand.tile)[0]
    if cand.op == "bwd_wgmma":  # the atomic-dQ instantiation, the one the tuner times
        return backward_kv_spec(dtype, cand.hd, causal, False, cand.tile)[0]
    specs = backward_specs(dtype, cand.hd, causal, vec, cand.op == "bwd_dq", cand.tile)[0]
    return specs["kv" if cand.op == "bwd" else "dq"]


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _version() -> str:
    return __version__


def source_hash(op: str) -> str:
    return _text_source_hash(OP_SOURCE[_check_op(op)])


@dataclass(frozen=True)
class BucketKey:
    device: str
    op: str
    dtype: str
    hd: int
    causal: bool
    nq: int  # power-of-two bucket
    nk: int
    version: str
    source_hash: str

    def __str__(self):
        return (f"{self.device}|cuflash {self.version}|{OP_SOURCE[self.op]} {self.source_hash}|{self.op}|"
                f"{self.dtype}|d{self.hd}|{'causal' if self.causal else 'full'}|nq{self.nq}|nk{self.nk}")


def bucket_key(op, device, dtype, d, causal, nq, nk) -> BucketKey:
    return BucketKey(device, _check_op(op), dtype_name(dtype), schedule.head_dim_bucket(d), bool(causal),
                     pow2_bucket(nq), pow2_bucket(nk), _version(), source_hash(op))


def cache_path() -> Path:
    """Where the tuning cache lives: $CUFLASH_CACHE_DIR, $XDG_CACHE_HOME/cuflash or ~/.cache/cuflash."""
    return config.cache_dir() / "tune.json"


_ENTRY_FIELDS = ("device", "op", "dtype", "hd", "causal", "nq", "nk", "version", "source_hash", "winner", "candidates")


class TuneCache:
    """The JSON file of tuning winners (and offline compile reports), read once, written atomically.

    Anything unreadable is reported with a TuneCacheWarning and dropped; the next write replaces
    the file with what is valid."""

    def __init__(self, path=None):
        self.path = Path(path) if path is not None else cache_path()
        self._data = None
        self._lock = threading.Lock()
        self._dirty_reason = None

    def _empty(self):
        return {"format": CACHE_FORMAT, "entries": {}, "compile": {}}

    def _load(self):
        if self._data is not None:
            return self._data
        data = self._empty()
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._data = data
            return data
        except OSError as exc:
            warnings.warn(f"cuflash tune cache {self.path}: unreadable ({exc}); starting empty", TuneCacheWarning, 2)
            self._data = data
            return data
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT:
                raise ValueError(f"not a {CACHE_FORMAT} file")
            if not isinstance(raw.get("entries"), dict) or not isinstance(raw.get("compile", {}), dict):
                raise ValueError("entries/compile are not objects")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"cuflash tune cache {self.path}: corrupt ({exc}); ignored, it will be rebuilt",
                          TuneCacheWarning, 2)
            self._dirty_reason = "corrupt"
            self._data = data
            return data
        dropped = {"stale": 0, "corrupt": 0}
        for key, entry in raw["entries"].items():
            why = self._entry_problem(key, entry)
            if why is None:
                data["entries"][key] = entry
            else:
                dropped[why] += 1
        current = {source_hash(op) for op in OPS}
        for key, rec in raw.get("compile", {}).items():
            parts = key.split("|") if isinstance(key, str) else []
            if not (isinstance(rec, dict) and set(rec) == {"registers", "spill_bytes", "stack_bytes", "how", "error"}
                    and len(parts) == 4):
                dropped["corrupt"] += 1
            elif parts[2] not in current:
                dropped["stale"] += 1  # compiled from an older kernel source
            else:
                data["compile"][key] = rec
        if any(dropped.values()):
            warnings.warn(f"cuflash tune cache {self.path}: ignored {dropped['stale']} stale entries (other cuflash "
                          f"version or kernel source) and {dropped['corrupt']} corrupt ones; they will be rebuilt",
                          TuneCacheWarning, 2)
            self._dirty_reason = "dropped"
        self._data = data
        return data

    @staticmethod
    def _entry_problem(key, entry):
        if not isinstance(entry, dict) or any(f not in entry for f in _ENTRY_FIELDS):
            return "corrupt"
        try:
            if entry["op"] not in OPS:
                return "corrupt"
            if entry["version"] != _version() or entry["source_hash"] != source_hash(entry["op"]):
                return "stale"
            k = BucketKey(entry["device"], entry["op"], entry["dtype"], entry["hd"], entry["causal"], entry["nq"],
                          entry["nk"], entry["version"], entry["source_hash"])
            if str(k) != key:
                return "corrupt"
            if entry["winner"] is not None:
                cand = Candidate(entry["op"], entry["hd"], tile_from_dict(entry["op"], entry["winner"]["tile"]))
                if violations(cand):  # a hand-edited or foreign tile that cannot launch
                    return "corrupt"
        except (TypeError, ValueError, KeyError):
            return "corrupt"
        return None

    def get(self, key: BucketKey):
        """The stored entry for key (a dict), or None."""
        with self._lock:
            return self._load()["entries"].get(str(key))

    def winner(self, key: BucketKey):
        """(found, tile): found is False when the bucket was never tuned; tile None = keep the table."""
        entry = self.get(key)
        if entry is None:
            return False, None
        w = entry["winner"]
        return True, (tile_from_dict(key.op, w["tile"]) if w is not None else None)

    def put(self, key: BucketKey, result, shape=None, device_limits_dict=None):
        """Store a search result (cuflash.autotune.SearchResult) for key."""
        w = result.winner
        winner = None
        if w is not None:
            t = w.candidate.tile
            table_t = result.table.time_s if result.table is not None else None
            why = f"autotuned on {key.device}: {w.time_s * 1e3:.4g} ms" + (
                f" vs table {table_t * 1e3:.4g} ms" if table_t else "")
            winner = {"name": w.candidate.name, "tile": tile_to_dict(replace(t, reason=why)), "time_s": w.time_s}
        entry = {
            "device": key.device, "op": key.op, "dtype": key.dtype, "hd": key.hd, "causal": key.causal,
            "nq": key.nq, "nk": key.nk, "version": key.version, "source_hash": key.source_hash,
            "shape": list(shape) if shape is not None else None, "winner": winner,
            "candidates": [e.to_record() for e in result.evaluations],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if device_limits_dict is not None:
            entry["limits"] = device_limits_dict
        with self._lock:
            self._load()["entries"][str(key)] = entry
            self._save()

    def compile_record(self, key: str):
        with self._lock:
            rec = self._load()["compile"].get(key)
        return CompileInfo(**rec) if rec is not None else None

    def put_compile_record(self, key: str, info: CompileInfo):
        with self._lock:
            self._load()["compile"][key] = {"registers": info.registers, "spill_bytes": info.spill_bytes,
                                            "stack_bytes": info.stack_bytes, "how": info.how, "error": info.error}
            self._save()

    def save(self):
        with self._lock:
            self._load()
            self._save()

    def _save(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self._dirty_reason = None
        except OSError as exc:
            warnings.warn(f"cuflash tune cache {self.path}: cannot write ({exc}); results kept in memory only",
                          TuneCacheWarning, 3)


_memo: dict = {}


_memo_lock = threading.RLock()


_caches: dict = {}


def tune_mode() -> str:
    """"off" (CUFLASH_TUNE unset/0: tables only), "auto" (1) or "cached"."""
    return config.tune_mode()


def _cache() -> TuneCache:
    path = cache_path()
    c = _caches.get(path)
    if c is None:
        c = _caches[path] = TuneCache(path)
    return c


def clear_memo():
    """Forget what this process has read or tuned (tests; after editing the cache by hand)."""
    with _memo_lock:
        _memo.clear()
        _caches.clear()


_autotuner = None  # the factory that times a bucket on first use (cuflash.autotune registers GpuTuner)


def register_autotuner(factory):
    """Set the autotuner CUFLASH_TUNE=1 runs on first use: ``factory(op, p, base=...)`` returning an
    object whose ``run(max_candidates=, progress=)`` gives a search result, and ``.shape``."""
    global _autotuner
    _autotuner = factory


def pick_forward_tile(p, target, autotuner=None) -> TileConfig | None:
    """The forward tile for problem p (vectorized path) on the target, or None to use the built-in
    table. ``autotuner``: the factory that times a bucket on first use (cuflash.autotune.GpuTuner);
    without one a bucket missing from the cache keeps the table."""
    return _pick("fwd", p, target, tuner_factory=autotuner)


def pick_hopper_forward_tile(p, target, autotuner=None) -> HopperTile | None:
    """The wgmma forward's tile for p (the caller checked plan.hopper.applies), or None to use
    HOPPER_FORWARD_TILES."""
    return _pick("fwd_wgmma", p, target, tuner_factory=autotuner)


def pick_hopper_backward_tile(p, target, deterministic: bool = False, autotuner=None) -> HopperBwdTile | None:
    """The wgmma backward K/V kernel's tile for p (the caller checked plan.hopper.backward_applies),
    or None to use HOPPER_BACKWARD_TILES. The tuner checks and times the atomic-dQ kernel, so the
    deterministic backward (ATOMIC_DQ = false, an instantiation it never ran) keeps the table.
    The tuner times the TMA kernel only: a pick with the table tile's fields returns None, so the
    default (warp-specialized where schedule.HOPPER_BACKWARD_WS says) runs."""
    t = None if deterministic else _pick("bwd_wgmma", p, target, tuner_factory=autotuner)
    if t is not None and same_tile("bwd_wgmma", t, table_tile("bwd_wgmma", schedule.head_dim_bucket(p.d))):
        return None
    return t


def pick_backward_tile(p, target, deterministic: bool = False, autotuner=None) -> BackwardTile | None:
    """The backward tile for p: the tuned main-kernel fields and, when deterministic, the tuned
    dQ-kernel fields, each falling back to the table's; None when neither was tuned."""
    kv = _pick("bwd", p, target, tuner_factory=autotuner)
    dq = _pick("bwd_dq", p, target, base=kv, tuner_factory=autotuner) if deterministic else None
    if kv is None and dq is None:
        return None
    tile = kv or schedule.backward_tile(p.d)[1]
    if dq is not None:
        tile = replace(tile, **{k: getattr(dq, k) for k in DQ_SPACE}, reason=tile.reason + "; " + dq.reason)
    return tile


def _pick(op, p, target, base=None, *, tuner_factory=None):
    mode = tune_mode()
    if mode == "off" or np.dtype(p.dtype) not in TUNED_DTYPES or p.nq == 0 or p.nk == 0 or p.batch * p.hq == 0:
        return None
    if p.d > schedule.MAX_HEAD_DIM or p.d % 8:
        return None  # d % 8 != 0 runs the scalar-load kernel, whose tiles are not tuned
    if schedule.head_dim_bucket(p.d) not in op_buckets(op):
        return None  # a bucket this kernel is never launched for
    if not target.name:
        return None  # a target without a device name (a model): nothing was tuned for it
    key = bucket_key(op, target.name, p.dtype, p.d, p.causal is not None, p.nq, p.nk)
    memo_key = (str(cache_path()), str(key))
    with _memo_lock:
        if memo_key in _memo:
            return _memo[memo_key]
        cache = _cache()
        found, tile = cache.winner(key)
        tuner_factory = tuner_factory or _autotuner
        if not found and mode == "auto" and tuner_factory is not None:
            tile = _autotune_on_first_use(op, p, key, cache, base, tuner_factory)
        if found or (mode == "auto" and tuner_factory is not None):
            _memo[memo_key] = tile
        return tile


def _autotune_on_first_use(op, p, key, cache, base, tuner_factory):
    try:
        if _stream_is_capturing():
            return None  # timing inside a CUDA graph capture is impossible; keep the table
        tuner = tuner_factory(op, p, base=base)
        result = tuner.run(max_candidates=_max_candidates(), progress=None)
    except Exception as exc:  # noqa: BLE001 - tuning must never break the call it serves
        warnings.warn(f"cuflash autotune {key}: failed ({type(exc).__name__}: {exc}); using the built-in table",
                      RuntimeWarning, 4)
        return None
    cache.put(key, result, shape=tuner.shape)
    return cache.winner(key)[1]  # the stored tile, whose reason records the measurement


def _max_candidates() -> int:
    return config.tune_max_candidates()


def _stream_is_capturing() -> bool:
    return stream_is_capturing()
