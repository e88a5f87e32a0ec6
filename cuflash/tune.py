"""Tile schedule search: legal configurations from device limits, occupancy, autotuning, a cache.

Five kernels have a tile to choose (``OPS``):

* ``"fwd"``: the mma.sync forward kernel, a :class:`~cuflash.plan.schedule.TileConfig` (block_m, block_n,
  warps, stages);
* ``"fwd_wgmma"``: the Hopper forward (attn_fwd_wgmma.cu, sm_90a only), a
  :class:`~cuflash.plan.schedule.HopperTile` (block_n, warpgroups, stages), for the head-dim buckets of
  ``schedule.HOPPER_FORWARD_TILES``; it is what ``gpu.forward`` runs on sm_90 for 16-bit inputs
  with 16-byte-aligned rows (picked by :func:`pick_hopper_forward_tile`);
* ``"bwd"``: the backward's K/V-parallel main kernel (the block_m, block_n, warps, warps_d fields of
  a :class:`~cuflash.plan.schedule.BackwardTile`), timed as the whole backward with atomic dQ;
* ``"bwd_dq"``: the deterministic dQ kernel (the dq_* fields), timed as the whole deterministic
  backward;
* ``"bwd_wgmma"``: the Hopper backward K/V kernel (attn_bwd_wgmma.cu, sm_90a only), a
  :class:`~cuflash.plan.schedule.HopperBwdTile` (block_m, warpgroups), for the head-dim buckets of
  ``schedule.HOPPER_BACKWARD_TILES``; timed as the whole atomic-dQ backward, it is the K/V kernel
  ``gpu_backward.backward`` runs on sm_90 for 16-bit inputs with 16-byte-aligned rows (picked by
  :func:`pick_hopper_backward_tile`).

For each head-dim bucket the candidates are the product of a few values per field. A candidate is
LEGAL when it satisfies the kernel's ``static_assert``s (mirrored here from FwdTraits, BwdTraits,
DqTraits, HopperFwdTraits, HopperBwdTraits, Swizzle and Sw128Tile; for the wgmma kernel also that the generated
wrappers exist), its shared memory (with the wgmma kernel's 1 KiB alignment slack) fits the
device's opt-in limit per block, its threads fit a block, and it compiles without spilling
(ptxas's report from :func:`cuflash.kernels.build.compile_offline`, no GPU needed, or the compiled
kernel's ``num_regs``/``local_size_bytes`` on a GPU). For a legal
candidate :func:`cuflash.plan.device_limits.occupancy` gives resident blocks and warps per SM, and
:func:`cuflash.accounting.io_model` its logical HBM traffic.

Autotuning (``CUFLASH_TUNE=1``) happens on first use per bucket: (kernel, head-dim bucket, dtype,
causal, Nq and Nk rounded up to powers of two, device name). Each candidate is checked against the
float64 reference on a small input with the accuracy rule of :mod:`cuflash.testing` (a candidate
that fails to compile, spills or gives a wrong answer is never picked), then timed with CUDA events
on fresh inputs of the caller's shapes (L2 flushed by writing 256 MiB before every repeat; median).
The winner goes to a JSON cache (``$CUFLASH_CACHE_DIR/tune.json``, else
``$XDG_CACHE_HOME/cuflash/tune.json``, else ``~/.cache/cuflash/tune.json``) keyed by device name,
cuflash version and the kernel source's hash; a corrupt or stale cache is ignored with a
:class:`TuneCacheWarning` and rebuilt.

``CUFLASH_TUNE``: unset or ``0`` (the default for now): the built-in tables only, nothing is read or
timed; ``1``: cached winners, autotuning a bucket on first use; ``cached``: cached winners only
(from ``cuflash tune`` run ahead of time), never timing during a call.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .plan import device_limits
from .plan import schedule
from .core.arrays import BFLOAT16, FLOAT16, dtype_name
from .plan.device_limits import DeviceLimits, Occupancy, occupancy
from .plan.schedule import BackwardTile, HopperBwdTile, HopperTile, TileConfig

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

ENV_MODE = "CUFLASH_TUNE"
ENV_CACHE_DIR = "CUFLASH_CACHE_DIR"
ENV_MAX_CANDIDATES = "CUFLASH_TUNE_MAX_CANDIDATES"
DEFAULT_MAX_CANDIDATES = 8  # autotune on first use: candidates timed per bucket
CACHE_FORMAT = "cuflash-tune-1"
FLUSH_BYTES = 256 * 2**20  # more than 4x the H200's 60 MiB L2


class TuneCacheWarning(UserWarning):
    """The tuning cache was unreadable, corrupt or stale and is being rebuilt."""


# --------------------------------------------------------------------------- candidates


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
    gpu_hopper.applies / backward_applies dispatch only where HOPPER_FORWARD_TILES /
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


# --------------------------------------------------------------------------- legality (static)


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
    from .kernels.build import load_source

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
    Wgmma<T, 64> for S^T and dP^T, Wgmma<T, head dim> (split_d: its share) for dV and dK, Wgmma<T, kDqCols> for dQ."""
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


# --------------------------------------------------------------------------- register estimate


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


# --------------------------------------------------------------------------- compile reports


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


_compile_memo: dict = {}
_compile_lock = threading.Lock()


def spec_for(cand: Candidate, dtype, causal: bool, vec: bool = True):
    """The KernelSpec of the kernel this candidate changes, as the launch code builds it."""
    if cand.op == "fwd":
        from .kernels.forward import forward_spec

        return forward_spec(dtype, cand.hd, causal, vec, cand.tile)[0]
    if cand.op == "fwd_wgmma":  # vector loads only: the kernel has no scalar path
        from .kernels.hopper import forward_spec

        return forward_spec(dtype, cand.hd, causal, cand.tile)[0]
    if cand.op == "bwd_wgmma":  # the atomic-dQ instantiation, the one the tuner times
        from .kernels.hopper import backward_kv_spec

        return backward_kv_spec(dtype, cand.hd, causal, False, cand.tile)[0]
    from .kernels.backward import backward_specs

    specs = backward_specs(dtype, cand.hd, causal, vec, cand.op == "bwd_dq", cand.tile)[0]
    return specs["kv" if cand.op == "bwd" else "dq"]


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - only part of a cache key
        return "unknown"


def compile_offline_info(spec, arch: str = "sm_90a", cache: "TuneCache | None" = None) -> CompileInfo:
    """ptxas's register/spill report for spec (NVRTC through cuda.bindings, no GPU), memoized in
    this process and, with ``cache``, across processes (keyed by arch, NVRTC version, source hash)."""
    from .kernels import build

    key = f"{arch}|nvrtc{_nvrtc_version()}|{build.source_hash(spec.source)}|{spec.expression}"
    with _compile_lock:
        hit = _compile_memo.get(key)
    if hit is None and cache is not None:
        rec = cache.compile_record(key)
        if rec is not None:
            hit = rec
    if hit is None:
        try:
            r = build.compile_offline(spec, arch)
            hit = CompileInfo(r.registers, r.spill_stores + r.spill_loads, r.stack_bytes, f"nvrtc {arch} (offline)")
        except build.CompileError as exc:
            hit = CompileInfo(None, 0, 0, f"nvrtc {arch} (offline)", _first_error(str(exc)))
        if cache is not None:
            cache.put_compile_record(key, hit)
    with _compile_lock:
        _compile_memo[key] = hit
    return hit


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()[:300]
    return log.strip().splitlines()[0][:300] if log.strip() else "compile failed"


def compile_device_info(spec) -> CompileInfo:
    """Compile spec for the current GPU (CuPy/NVRTC, as a launch would) and read its attributes."""
    from .kernels.build import get_function

    try:
        fn = get_function(spec)
        regs, local = int(fn.num_regs), int(fn.local_size_bytes)
    except Exception as exc:  # noqa: BLE001 - CompileException, or a launch-config error
        return CompileInfo(None, 0, 0, "device", _first_error(str(exc)) or type(exc).__name__)
    return CompileInfo(regs, local, 0, "device")


# --------------------------------------------------------------------------- evaluation


@dataclass
class Evaluation:
    """What the search learned about one candidate."""

    candidate: Candidate
    status: str = "pending"  # illegal, compile failed, spills, does not fit, wrong, timing failed, ok, legal
    detail: str = ""
    compile: CompileInfo | None = None
    occupancy: Occupancy | None = None
    logical_bytes: int | None = None
    time_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_record(self) -> dict:
        c = self.compile
        o = self.occupancy
        return {
            "name": self.candidate.name, "tile": self.candidate.fields(), "status": self.status,
            "detail": self.detail, "registers": c.registers if c else None,
            "spill_bytes": c.spill_bytes if c else None, "smem_bytes": self.candidate.smem_bytes,
            "threads": self.candidate.threads,
            "blocks_per_sm": o.blocks_per_sm if o else None, "warps_per_sm": o.warps_per_sm if o else None,
            "logical_bytes": self.logical_bytes, "time_s": self.time_s,
        }


def evaluate_static(cand: Candidate, limits: DeviceLimits, compile_fn=None, io_fn=None) -> Evaluation:
    """Legality, compile report (when compile_fn is given) and occupancy of one candidate."""
    ev = Evaluation(cand)
    v = violations(cand, limits)
    if v:
        ev.status, ev.detail = "illegal", "; ".join(v)
        return ev
    if io_fn is not None:
        ev.logical_bytes = io_fn(cand)
    regs = None
    if compile_fn is not None:
        try:
            info = compile_fn(cand)
        except Exception as exc:  # noqa: BLE001 - a failed compile disqualifies, nothing more
            info = CompileInfo(None, 0, 0, "?", f"{type(exc).__name__}: {exc}"[:300])
        ev.compile = info
        if info.error is not None:
            ev.status, ev.detail = "compile failed", info.error
            return ev
        if not info.clean:
            ev.status = "spills"
            ev.detail = f"{info.spill_bytes} B spilled, {info.stack_bytes} B stack ({info.how})"
            regs = info.registers
        else:
            regs = info.registers
    ev.occupancy = occupancy(limits, cand.threads, regs, cand.smem_bytes)
    if ev.status == "spills":
        return ev
    if ev.occupancy.blocks_per_sm == 0:
        ev.status, ev.detail = "does not fit", ev.occupancy.limiter
        return ev
    ev.status = "legal"
    return ev


@dataclass
class SearchResult:
    op: str
    hd: int
    evaluations: list
    winner: Evaluation | None
    table: Evaluation | None  # the built-in table's candidate, when it was evaluated

    @property
    def best_tile(self):
        return self.winner.candidate.tile if self.winner else None


def search(cands, limits: DeviceLimits, *, compile_fn, check_fn, time_fn, io_fn=None, progress=None,
           table=None, budget_s: float | None = None) -> SearchResult:
    """Evaluate candidates in order and pick the fastest one that passed every check.

    compile_fn(cand) -> CompileInfo; check_fn(cand) returns None or True when the candidate's
    output is right (False, or any exception, means wrong); time_fn(cand) -> seconds. A candidate
    is a winner only if it is legal, compiles cleanly, fits on an SM, passes the check and has a
    finite positive time. ``progress(i, n, evaluation)`` is called after each candidate."""
    cands = list(cands)
    if not cands:
        raise ValueError("cands: nothing to search")
    op, hd = cands[0].op, cands[0].hd
    t0 = time.monotonic()
    evals = []
    for i, cand in enumerate(cands):
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            ev = Evaluation(cand, "not timed", "time budget spent")
        else:
            ev = evaluate_static(cand, limits, compile_fn, io_fn)
            if ev.status == "legal":
                _check_and_time(ev, check_fn, time_fn)
        evals.append(ev)
        if progress is not None:
            progress(i + 1, len(cands), ev)
    ok = [e for e in evals if e.ok]
    winner = min(ok, key=lambda e: e.time_s) if ok else None
    table_ev = None
    if table is not None:
        table_ev = next((e for e in evals if same_tile(op, e.candidate.tile, table)), None)
    return SearchResult(op, hd, evals, winner, table_ev)


def _check_and_time(ev: Evaluation, check_fn, time_fn):
    try:
        verdict = check_fn(ev.candidate)
    except Exception as exc:  # noqa: BLE001 - AssertionError (wrong values) or a launch failure
        ev.status, ev.detail = "wrong", f"{type(exc).__name__}: {exc}"[:500]
        return
    if verdict is False:
        ev.status, ev.detail = "wrong", "check returned False"
        return
    try:
        t = float(time_fn(ev.candidate))
    except Exception as exc:  # noqa: BLE001
        ev.status, ev.detail = "timing failed", f"{type(exc).__name__}: {exc}"[:500]
        return
    if not (math.isfinite(t) and t > 0):
        ev.status, ev.detail = "timing failed", f"time {t!r}"
        return
    ev.status, ev.time_s = "ok", t


# --------------------------------------------------------------------------- logical traffic


class _IoTile:
    """The two fields io_model reads of a config, for a backward tile (whose smem_bytes differs)."""

    def __init__(self, block_m, block_n, threads, smem):
        self.block_m, self.block_n, self.threads, self._smem = block_m, block_n, threads, smem

    def smem_bytes(self, head_dim, itemsize=2):
        return self._smem


def logical_bytes(cand: Candidate, shape, *, dtype="bfloat16", causal=False, nk=None, hkv=None) -> int:
    """Logical HBM bytes of the pass this candidate's kernel belongs to (accounting.io_model).

    "fwd", "fwd_wgmma": the forward; "bwd", "bwd_wgmma": the whole atomic-dQ backward; "bwd_dq": the
    deterministic dQ kernel alone (each of dq_split blocks per query tile reads Q, dO, LSE, D, K and V)."""
    from .accounting import io_model

    t = cand.tile
    if cand.op == "fwd":
        return io_model(shape, t, dtype=dtype, causal=causal, pass_="fwd", nk=nk, hkv=hkv).bytes
    if cand.op == "fwd_wgmma":  # same traffic model; the Hopper tile's smem formula has no itemsize
        cfg = _IoTile(t.block_m, t.block_n, cand.threads, cand.smem_bytes)
        return io_model(shape, cfg, dtype=dtype, causal=causal, pass_="fwd", nk=nk, hkv=hkv).bytes
    if cand.op in ("bwd", "bwd_wgmma"):
        cfg = _IoTile(t.block_m, t.block_n, cand.threads, cand.smem_bytes)
        return io_model(shape, cfg, dtype=dtype, causal=causal, pass_="bwd", nk=nk, hkv=hkv).bytes
    cfg = _IoTile(t.dq_block_m, t.dq_block_n, cand.threads, cand.smem_bytes)
    m = io_model(shape, cfg, dtype=dtype, causal=causal, pass_="bwd", nk=nk, hkv=hkv, deterministic=True)
    reads = sum(e.bytes for e in m.entries if "(dQ kernel)" in e.name)
    acc = next(e for e in m.entries if e.name.endswith("dQ accumulator"))
    return t.dq_split * reads + acc.writes * acc.itemsize


# --------------------------------------------------------------------------- keys and the cache


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _version() -> str:
    import cuflash

    return cuflash.__version__


def source_hash(op: str) -> str:
    from .kernels.build import source_hash as h

    return h(OP_SOURCE[_check_op(op)])


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
    d = os.environ.get(ENV_CACHE_DIR)
    if d:
        return Path(d) / "tune.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cuflash" / "tune.json"


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

    def put(self, key: BucketKey, result: SearchResult, shape=None, device_limits_dict=None):
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


# --------------------------------------------------------------------------- the planner hook


_memo: dict = {}
_memo_lock = threading.RLock()
_caches: dict = {}


def tune_mode() -> str:
    """"off" (CUFLASH_TUNE unset/0: tables only), "auto" (1) or "cached"."""
    raw = os.environ.get(ENV_MODE, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return "off"
    if raw in ("1", "on", "true", "yes", "auto"):
        return "auto"
    if raw == "cached":
        return "cached"
    warnings.warn(f"{ENV_MODE}={raw!r}: expected 0, 1 or 'cached'; using the built-in tables", RuntimeWarning, 3)
    return "off"


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
        _compile_memo.clear()


def pick_forward_tile(p) -> TileConfig | None:
    """The forward tile for problem p (vectorized path), or None to use the built-in table."""
    return _pick("fwd", p)


def pick_hopper_forward_tile(p) -> HopperTile | None:
    """The wgmma forward's tile for p (the caller checked gpu_hopper.applies), or None to use
    HOPPER_FORWARD_TILES."""
    return _pick("fwd_wgmma", p)


def pick_hopper_backward_tile(p, deterministic: bool = False) -> HopperBwdTile | None:
    """The wgmma backward K/V kernel's tile for p (the caller checked gpu_hopper.backward_applies),
    or None to use HOPPER_BACKWARD_TILES. The tuner checks and times the atomic-dQ kernel, so the
    deterministic backward (ATOMIC_DQ = false, an instantiation it never ran) keeps the table.
    The tuner times the TMA kernel only: a pick with the table tile's fields returns None, so the
    default (warp-specialized where schedule.HOPPER_BACKWARD_WS says) runs."""
    t = None if deterministic else _pick("bwd_wgmma", p)
    if t is not None and same_tile("bwd_wgmma", t, table_tile("bwd_wgmma", schedule.head_dim_bucket(p.d))):
        return None
    return t


def pick_backward_tile(p, deterministic: bool = False) -> BackwardTile | None:
    """The backward tile for p: the tuned main-kernel fields and, when deterministic, the tuned
    dQ-kernel fields, each falling back to the table's; None when neither was tuned."""
    kv = _pick("bwd", p)
    dq = _pick("bwd_dq", p, base=kv) if deterministic else None
    if kv is None and dq is None:
        return None
    tile = kv or schedule.backward_tile(p.d)[1]
    if dq is not None:
        tile = replace(tile, **{k: getattr(dq, k) for k in DQ_SPACE}, reason=tile.reason + "; " + dq.reason)
    return tile


def _pick(op, p, base=None, *, tuner_factory=None):
    mode = tune_mode()
    if mode == "off" or np.dtype(p.dtype) not in TUNED_DTYPES or p.nq == 0 or p.nk == 0 or p.batch * p.hq == 0:
        return None
    if p.d > schedule.MAX_HEAD_DIM or p.d % 8:
        return None  # d % 8 != 0 runs the scalar-load kernel, whose tiles are not tuned
    if schedule.head_dim_bucket(p.d) not in op_buckets(op):
        return None  # a bucket this kernel is never launched for
    try:
        device = _current_device_name()
    except Exception:  # noqa: BLE001 - no CuPy/device: nothing to tune for
        return None
    key = bucket_key(op, device, p.dtype, p.d, p.causal is not None, p.nq, p.nk)
    memo_key = (str(cache_path()), str(key))
    with _memo_lock:
        if memo_key in _memo:
            return _memo[memo_key]
        cache = _cache()
        found, tile = cache.winner(key)
        if not found and mode == "auto":
            tile = _autotune_on_first_use(op, p, key, cache, base, tuner_factory)
        if found or mode == "auto":
            _memo[memo_key] = tile
        return tile


def _current_device_name() -> str:
    import cupy

    return device_limits.device_name(cupy.cuda.Device().id)


def _autotune_on_first_use(op, p, key, cache, base, tuner_factory):
    try:
        if _stream_is_capturing():
            return None  # timing inside a CUDA graph capture is impossible; keep the table
        factory = tuner_factory or GpuTuner
        tuner = factory(op, p, base=base)
        result = tuner.run(max_candidates=_max_candidates(), progress=None)
    except Exception as exc:  # noqa: BLE001 - tuning must never break the call it serves
        warnings.warn(f"cuflash autotune {key}: failed ({type(exc).__name__}: {exc}); using the built-in table",
                      RuntimeWarning, 4)
        return None
    cache.put(key, result, shape=tuner.shape)
    return cache.winner(key)[1]  # the stored tile, whose reason records the measurement


def _max_candidates() -> int:
    raw = os.environ.get(ENV_MAX_CANDIDATES)
    try:
        return max(1, int(raw)) if raw else DEFAULT_MAX_CANDIDATES
    except ValueError:
        return DEFAULT_MAX_CANDIDATES


def _stream_is_capturing() -> bool:
    from .core.problem import stream_is_capturing

    return stream_is_capturing()


# --------------------------------------------------------------------------- GPU tuner


def cuda_median_time(run, *, warmup=2, repeats=10, flush=None, max_total_s=3.0) -> float:
    """Median seconds of run() by CUDA events; ``flush`` (a device buffer) is rewritten before
    every repeat, outside the timed interval, so each repeat starts with a cold L2."""
    import cupy

    for _ in range(warmup):
        run()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeats):
        if flush is not None:
            flush.fill(i & 0xFF)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        if sum(times) > max_total_s and len(times) >= 3:
            break
    return statistics.median(times)


def _random_device(cupy, shape, dtype, rng):
    from .backends.reference import float32_to_bfloat16

    x = cupy.asarray(rng.standard_normal(shape, dtype=np.float32))
    return float32_to_bfloat16(cupy, x) if np.dtype(dtype) == BFLOAT16 else x.astype(dtype)


def _poisoned(cupy, shape, dtype):
    a = cupy.empty(shape, dtype=dtype)
    if np.dtype(dtype).itemsize == 2:
        a.view(cupy.uint16).fill(0x7FC0)  # NaN in float16 and bfloat16 alike
    else:
        a.fill(np.nan)
    return a


def forward_launcher(op: str):
    """The launch function that takes forward op's tile: gpu.forward would run a HopperTile
    through the mma.sync spec, so the wgmma op launches gpu_hopper.forward directly."""
    if op == "fwd_wgmma":
        from .kernels import hopper as gpu_hopper

        return gpu_hopper.forward
    from .kernels import forward as gpu

    return gpu.forward


def backward_tile_kwargs(op: str, tile) -> dict:
    """The keyword gpu_backward.backward takes backward op's tile by: the wgmma K/V kernel's
    HopperBwdTile goes to hopper_tile (which also keeps the mma.sync tile out of the way)."""
    return {"hopper_tile": tile} if op == "bwd_wgmma" else {"tile": tile}


class GpuTuner:
    """Autotune one kernel for the shapes of problem p on the current GPU.

    The correctness check runs the candidate on a small problem with p's head dim, dtype, mask
    and GQA grouping (ragged lengths, several tiles) and applies cuflash.testing's rule against the
    float64 reference; timing uses fresh inputs of p's full shapes (extra device memory of about
    one more set of p's inputs and outputs while tuning)."""

    CHECK_N = 549  # > 2 x the largest block_m, and not a multiple of any tile

    def __init__(self, op, p, *, base=None, limits=None, seed=None, cupy=None):
        if cupy is None:  # tests pass a stand-in, so they run where CuPy is not installed
            import cupy
        self.cupy = cupy
        self.op = _check_op(op)
        self.p = p
        self.hd = schedule.head_dim_bucket(p.d)
        self.limits = limits or device_limits.from_cupy()
        if self.hd not in op_buckets(op):
            raise ValueError(f"{op}: head dim {p.d} (bucket {self.hd}) is not one of its buckets {op_buckets(op)}")
        if op in HOPPER_OPS and self.limits.cc != 90:
            raise ValueError(f"{op}: the wgmma kernel needs an sm_90 GPU; {self.limits.name} is cc {self.limits.cc}")
        if op == "bwd_wgmma":
            from .kernels import hopper as gpu_hopper

            if not gpu_hopper.enabled():  # gpu_backward.backward would refuse every hopper_tile
                raise ValueError(f"{op}: {gpu_hopper.ENV}=mma_sync turns the wgmma backward off")
        self.base = base
        self.causal = p.causal is not None
        self.rng = np.random.default_rng(seed)
        self.shape = (p.batch, p.hq, p.hkv, p.nq, p.nk, p.d)
        self._check_data = None
        self._time_data = None
        self._flush = None

    # -- candidates
    def candidate_list(self, max_candidates=None):
        table = table_tile(self.op, self.hd)
        if self.op == "bwd_dq":
            base = self.base or schedule.BACKWARD_TILES[self.hd]
        else:
            base = None
        cands = candidates(self.op, self.hd, base)
        return shortlist(cands, max_candidates, self.limits, table)

    def compile(self, cand):
        return compile_device_info(spec_for(cand, self.p.dtype, self.causal))

    # -- correctness on a small problem
    def _small_problem(self):
        if self._check_data is not None:
            return self._check_data
        from . import testing
        from .core.layout import to_bhsd
        from .core.problem import validate_forward

        cp, p = self.cupy, self.p
        # Keep the sign of Nk - Nq (where the causal diagonal sits), bounded.
        nq = min(p.nq, self.CHECK_N)
        nk = nq + min(p.nk - p.nq, self.CHECK_N) if p.nk > p.nq else min(p.nk, self.CHECK_N)
        hkv = 1 if p.group > 1 else 2
        hq = 2
        host = testing.random_inputs(self.rng, (1, hq, nq, p.d), (1, hkv, nk, p.d), p.dtype)
        dev = [cp.asarray(a) for a in host]
        ps = validate_forward(*dev, causal=p.causal, scale=p.scale)
        q4, k4, v4 = (to_bhsd(a, ps, h, n) for a, h, n in zip(dev, (hq, hkv, hkv), (nq, nk, nk)))
        data = {"ps": ps, "host": host, "q4": q4, "k4": k4, "v4": v4}
        if self.op in FORWARD_OPS:
            data["ref"] = testing.reference64(*host, causal=p.causal, scale=p.scale)
            data["naive"] = testing.naive_attention_in_dtype(*host, causal=p.causal, scale=p.scale)
        else:
            from .kernels import forward as gpu

            do_h = testing.random_array(self.rng, (1, hq, nq, p.d), p.dtype)
            data["do_host"], data["do4"] = do_h, cp.asarray(do_h)
            o4 = _poisoned(cp, q4.shape, p.dtype)
            lse3 = cp.full((1, hq, nq), np.nan, dtype=cp.float32)
            gpu.forward(ps, q4, k4, v4, o4, lse3, tile=schedule.forward_tile(p.d)[1])
            data["o4"], data["lse3"] = o4, lse3
            data["ref"] = testing.reference64_backward(do_h, *host, causal=p.causal, scale=p.scale)
            data["naive"] = testing.naive_attention_backward_in_dtype(do_h, *host, causal=p.causal, scale=p.scale)
        self._check_data = data
        return data

    def check(self, cand):
        from . import testing

        cp, p = self.cupy, self.p
        s = self._small_problem()
        ps = s["ps"]
        if self.op in FORWARD_OPS:
            o4 = _poisoned(cp, s["q4"].shape, p.dtype)
            lse3 = cp.full((1, ps.hq, ps.nq), np.nan, dtype=cp.float32)
            forward_launcher(self.op)(ps, s["q4"], s["k4"], s["v4"], o4, lse3, tile=cand.tile)
            cp.cuda.Device().synchronize()
            testing.assert_within_naive_error("o", o4, s["ref"][0], s["naive"][0], p.dtype)
            testing.assert_within_naive_error("lse", lse3.reshape(s["ref"][1].shape), s["ref"][1], s["naive"][1], p.dtype)
            return True
        from .kernels import backward as gpu_backward

        grads = [_poisoned(cp, a.shape, p.dtype) for a in (s["q4"], s["k4"], s["v4"])]
        gpu_backward.backward(ps, s["do4"], s["q4"], s["k4"], s["v4"], s["o4"], s["lse3"], *grads,
                              deterministic=self.op == "bwd_dq", **backward_tile_kwargs(self.op, cand.tile))
        cp.cuda.Device().synchronize()
        for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, s["ref"], s["naive"]):
            testing.assert_within_naive_error(name, got, ref, naive, p.dtype, factor=3.0)
        return True

    # -- timing on the caller's shapes
    def _timing_data(self):
        if self._time_data is not None:
            return self._time_data
        from .core.layout import to_bhsd
        from .core.problem import validate_forward

        cp, p = self.cupy, self.p
        q = _random_device(cp, p.q_shape(), p.dtype, self.rng)
        k = _random_device(cp, p.kv_shape(), p.dtype, self.rng)
        v = _random_device(cp, p.kv_shape(), p.dtype, self.rng)
        pt = validate_forward(q, k, v, causal=p.causal, scale=p.scale, layout=p.layout)
        q4, k4, v4 = to_bhsd(q, pt, pt.hq, pt.nq), to_bhsd(k, pt, pt.hkv, pt.nk), to_bhsd(v, pt, pt.hkv, pt.nk)
        o4 = cp.empty((pt.batch, pt.hq, pt.nq, pt.d), dtype=p.dtype)
        lse3 = cp.empty((pt.batch, pt.hq, pt.nq), dtype=cp.float32)
        data = {"pt": pt, "q4": q4, "k4": k4, "v4": v4, "o4": o4, "lse3": lse3}
        if self.op not in FORWARD_OPS:
            from .kernels import forward as gpu

            gpu.forward(pt, q4, k4, v4, o4, lse3, tile=schedule.forward_tile(p.d)[1])
            data["do4"] = _random_device(cp, o4.shape, p.dtype, self.rng)
            data["grads"] = (cp.empty_like(o4), cp.empty(k4.shape, dtype=p.dtype), cp.empty(v4.shape, dtype=p.dtype))
        self._time_data = data
        if self._flush is None:
            self._flush = cp.empty(FLUSH_BYTES, dtype=cp.uint8)
        return data

    def time(self, cand):
        t = self._timing_data()
        if self.op in FORWARD_OPS:
            fwd = forward_launcher(self.op)

            def run():
                fwd(t["pt"], t["q4"], t["k4"], t["v4"], t["o4"], t["lse3"], tile=cand.tile)
        else:
            from .kernels import backward as gpu_backward

            def run():
                gpu_backward.backward(t["pt"], t["do4"], t["q4"], t["k4"], t["v4"], t["o4"], t["lse3"], *t["grads"],
                                      deterministic=self.op == "bwd_dq", **backward_tile_kwargs(self.op, cand.tile))
        return cuda_median_time(run, flush=self._flush)

    def io(self, cand):
        p = self.p
        return logical_bytes(cand, (p.batch, p.hq, p.nq, p.d), dtype=p.dtype, causal=p.causal, nk=p.nk, hkv=p.hkv)

    def run(self, max_candidates=None, progress=None, budget_s=None) -> SearchResult:
        cands = self.candidate_list(max_candidates)
        try:
            return search(cands, self.limits, compile_fn=self.compile, check_fn=self.check, time_fn=self.time,
                          io_fn=self.io, progress=progress, table=table_tile(self.op, self.hd), budget_s=budget_s)
        finally:
            self._time_data = None
            self._flush = None


# --------------------------------------------------------------------------- ahead-of-time tuning


def _problem_for_shape(shape, dtype, causal, hkv=None):
    from .core.problem import Problem
    from .core.masks import normalize_causal

    if len(shape) == 4:
        b, h, n, d = shape
        nk = n
    elif len(shape) == 5:
        b, h, n, nk, d = shape
    else:
        raise ValueError(f"shapes: expected (B, H, N, d) or (B, H, Nq, Nk, d), got {shape!r}")
    for name, x in zip(("B", "H", "N", "Nk", "d"), (b, h, n, nk, d)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"shapes: {name} must be a positive integer, got {x!r}")
    if d % 8:
        raise ValueError(f"shapes: head dim {d} is not a multiple of 8; only the vectorized kernels are tuned")
    hkv = h if hkv is None else hkv
    if h % hkv:
        raise ValueError(f"hkv: {hkv} must divide the {h} query heads")
    dt = _parse_dtype(dtype)
    import cupy

    return Problem(cupy, "bhsd", (int(b),), int(h), int(hkv), int(n), int(nk), int(d), dt,
                   normalize_causal(causal), 1.0 / math.sqrt(d))


def _parse_dtype(dtype):
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return BFLOAT16
    dt = np.dtype(dtype)
    if dt not in TUNED_DTYPES:
        raise TypeError(f"dtype: only float16 and bfloat16 kernels have tiles to tune, got {dtype_name(dt)}")
    return dt


def _text_progress(prefix, stream=None):
    stream = stream or sys.stderr

    def report(i, n, ev):
        width = 24
        filled = width * i // n
        t = f"{ev.time_s * 1e3:.4g} ms" if ev.time_s is not None else ev.status
        print(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {i}/{n} {ev.candidate.name}: {t}"[:160].ljust(100),
              end="\n" if i == n else "", file=stream, flush=True)

    return report


def ops_that_run(hd: int, cc: int) -> tuple:
    """The tuned kernels that gpu.forward and gpu_backward.backward launch for 16-bit,
    16-byte-aligned inputs of head-dim bucket hd on compute capability cc (the conditions of
    gpu_hopper.applies / backward_applies): the forward, "fwd_wgmma" or "fwd", and the backward's
    K/V kernel, "bwd_wgmma" or "bwd"."""
    from .kernels import hopper as gpu_hopper

    hopper = cc == 90 and gpu_hopper.enabled()
    fwd = "fwd_wgmma" if hopper and hd in op_buckets("fwd_wgmma") else "fwd"
    bwd = "bwd_wgmma" if hopper and hd in op_buckets("bwd_wgmma") else "bwd"
    return (fwd, bwd)


def _current_device_cc() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


def tune(*shapes, ops="auto", causal=False, dtype="bfloat16", hkv=None, max_candidates=None,
         force=False, progress=True):
    """Autotune the tiles for these shapes ahead of time and store the winners in the cache.

    shapes: (B, H, N, d) tuples (or (B, H, Nq, Nk, d)); ops: "auto" (the tuned kernels that run for
    each shape on this GPU, see :func:`ops_that_run`) or any of "fwd", "fwd_wgmma", "bwd",
    "bwd_dq", "bwd_wgmma"; max_candidates: how many candidates to time per bucket (None: every legal one).
    Buckets already in the cache are skipped unless ``force``. Returns {bucket key string:
    SearchResult or None (cached)}. The winners are used when CUFLASH_TUNE is 1 or "cached".
    Needs a CUDA device (sm_90 for "fwd_wgmma" and "bwd_wgmma"); an op that cannot run for a shape raises
    ValueError before anything is timed."""
    if not shapes:
        raise ValueError("shapes: give at least one (B, H, N, d) shape")
    auto = ops == "auto"
    if isinstance(ops, str) and not auto:
        ops = (ops,)
    if not auto:
        for op in ops:
            _check_op(op)
    problems = [_problem_for_shape(tuple(shape), dtype, causal, hkv) for shape in shapes]
    cc = _current_device_cc()
    plans = []
    for p in problems:  # every explicit request is checked before anything is timed
        hd = schedule.head_dim_bucket(p.d)
        p_ops = ops_that_run(hd, cc) if auto else tuple(ops)
        for op in (op for op in HOPPER_OPS if op in p_ops):
            if cc != 90:
                raise ValueError(f"ops: {op} needs an sm_90 GPU; this one is cc {cc}")
            if hd not in op_buckets(op):
                raise ValueError(f"ops: {op} runs for head-dim buckets {op_buckets(op)}, not d={p.d}")
        plans.append((p, p_ops))
    out = {}
    cache = _cache()
    for p, p_ops in plans:
        device = _current_device_name()
        kv_tile = None
        for op in p_ops:
            key = bucket_key(op, device, p.dtype, p.d, p.causal is not None, p.nq, p.nk)
            if op == "bwd_dq" and kv_tile is None:  # the main kernel's tile the dQ kernel runs beside
                kv_tile = cache.winner(bucket_key("bwd", device, p.dtype, p.d, p.causal is not None, p.nq, p.nk))[1]
            found, tile = cache.winner(key)
            if found and not force:
                out[str(key)] = None
                if op == "bwd":
                    kv_tile = tile
                continue
            tuner = GpuTuner(op, p, base=kv_tile if op == "bwd_dq" else None)
            label = f"{op} d{p.d} N{p.nq}{' causal' if p.causal else ''}"
            result = tuner.run(max_candidates=max_candidates, progress=_text_progress(label) if progress else None)
            cache.put(key, result, shape=tuner.shape, device_limits_dict=tuner.limits.to_dict())
            stored = cache.winner(key)[1]
            with _memo_lock:
                _memo[(str(cache.path), str(key))] = stored
            if op == "bwd":
                kv_tile = stored
            out[str(key)] = result
    return out


# --------------------------------------------------------------------------- the schedules table


def schedule_rows(shape, *, op="fwd", causal=False, dtype="bfloat16", limits=None, compile=True, hkv=None,
                  nk=None, cache=None, progress=None):
    """One Evaluation per candidate of the bucket of ``shape = (B, H, N, d)`` (illegal ones too),
    plus the cached tuning entry for ``limits.name`` if there is one: (evaluations, entry).

    Registers come from offline NVRTC compiles for ``limits.arch`` (``compile=False`` skips them)."""
    _check_op(op)
    limits = limits or device_limits.H200
    b, h, n, d = shape
    hd = schedule.head_dim_bucket(d)
    dt = _parse_dtype(dtype)
    cache = cache if cache is not None else _cache()
    is_causal = bool(causal)
    entry = cache.get(bucket_key(op, limits.name, dt, d, is_causal, n, nk or n))
    base = None
    if op == "bwd_dq":
        kv_entry = cache.get(bucket_key("bwd", limits.name, dt, d, is_causal, n, nk or n))
        if kv_entry and kv_entry["winner"]:
            base = tile_from_dict("bwd", kv_entry["winner"]["tile"])

    def compile_fn(cand):
        return compile_offline_info(spec_for(cand, dt, is_causal), limits.arch, cache)

    def io_fn(cand):
        return logical_bytes(cand, (b, h, n, d), dtype=dt, causal=causal, nk=nk, hkv=hkv)

    cands = candidates(op, hd, base)
    evals = []
    legal = [c for c in cands if not violations(c, limits)]
    done = 0
    for c in cands:
        use_compile = compile_fn if compile and c in legal else None
        ev = evaluate_static(c, limits, use_compile, io_fn)
        evals.append(ev)
        if c in legal:
            done += 1
            if progress is not None:
                progress(done, len(legal), ev)
    if entry is not None:
        times = {r["name"]: r.get("time_s") for r in entry["candidates"]}
        for ev in evals:
            ev.time_s = times.get(ev.candidate.name)
    return evals, entry


def format_schedule_table(evals, entry, *, op, limits, show_illegal=False, table=None) -> str:
    from .accounting import format_table

    winner = entry["winner"]["name"] if entry and entry.get("winner") else None
    table_name = Candidate(op, evals[0].candidate.hd, table).name if table is not None else None
    rows = []
    for ev in evals:
        if ev.status == "illegal" and not show_illegal:
            continue
        c, info, occ = ev.candidate, ev.compile, ev.occupancy
        chosen = []
        if c.name == winner:
            chosen.append("tuned")
        if c.name == table_name:
            chosen.append("table")
        rows.append((
            c.name,
            "-" if info is None or info.registers is None else str(info.registers),
            "-" if info is None else ("0" if info.clean else (str(info.spill_bytes) if info.error is None else "-")),
            f"{c.smem_bytes:,}",
            "-" if occ is None else str(occ.blocks_per_sm),
            "-" if occ is None else str(occ.warps_per_sm),
            "-" if occ is None or occ.blocks_per_sm == 0 else occ.limiter,
            "-" if ev.logical_bytes is None else f"{ev.logical_bytes:,}",
            "-" if ev.time_s is None else f"{ev.time_s * 1e3:.4g}",
            ",".join(chosen) or "",
            ev.status if ev.status != "legal" else "ok" if info is not None else "legal (not compiled)",
            ev.detail[:70] if ev.status not in ("legal", "ok") else "",
        ))
    head = ("config", "regs", "spill B", "smem B", "blocks/SM", "warps/SM", "limiter", "logical bytes", "time ms",
            "chosen", "status", "why")
    return format_table(head, rows)


# --------------------------------------------------------------------------- command line


def _parse_shape(text):
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected B,H,N,d integers, got {text!r}") from None
    if len(parts) != 4 or min(parts) < 1:
        raise ValueError(f"--shape: expected four positive integers B,H,N,d, got {text!r}")
    return parts


def _common_args(ap):
    ap.add_argument("--shape", action="append", required=True, metavar="B,H,N,d",
                    help="problem shape (repeatable for tune)")
    ap.add_argument("--causal", nargs="?", const="bottom_right", default=None, choices=("bottom_right", "top_left"),
                    help="causal mask (bare --causal: bottom_right)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--hkv", type=int, default=None, help="K/V heads (GQA), default H")


def main_tune(argv) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="cuflash tune", description="Autotune tile schedules ahead of time "
                                 "(needs a GPU); winners go to the cache used when CUFLASH_TUNE=1 or 'cached'.")
    _common_args(ap)
    ap.add_argument("--ops", default="auto",
                    help="comma-separated: fwd, fwd_wgmma, bwd, bwd_dq, bwd_wgmma; default auto: the tuned kernels "
                         "that run here (on sm_90: fwd_wgmma, with bwd_wgmma for d <= 128 and bwd above; elsewhere fwd "
                         "and bwd)")
    ap.add_argument("--max-candidates", type=int, default=None, help="candidates timed per bucket (default all legal)")
    ap.add_argument("--force", action="store_true", help="retune buckets already in the cache")
    args = ap.parse_args(argv)
    try:
        shapes = [_parse_shape(s) for s in args.shape]
        ops = "auto" if args.ops.strip() == "auto" else tuple(o.strip() for o in args.ops.split(",") if o.strip())
        for op in () if ops == "auto" else ops:
            _check_op(op)
    except ValueError as exc:
        ap.error(str(exc))
    from .cli.main import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"cuflash tune: needs a GPU, but {reason}. `cuflash schedules` shows the legal tiles without one.",
              file=sys.stderr)
        return 2
    try:
        results = tune(*shapes, ops=ops, causal=args.causal or False, dtype=args.dtype, hkv=args.hkv,
                       max_candidates=args.max_candidates, force=args.force)
    except ValueError as exc:  # e.g. a wgmma op asked for off Hopper: said before anything is timed
        print(f"cuflash tune: {exc}", file=sys.stderr)
        return 2
    print(f"cache: {cache_path()}")
    for key, res in results.items():
        if res is None:
            print(f"{key}: cached (use --force to retune)")
            continue
        tbl = res.table
        w = res.winner
        if w is None:
            print(f"{key}: no candidate passed; the built-in table stays")
        else:
            vs = f" (table {tbl.candidate.name}: {tbl.time_s * 1e3:.4g} ms)" if tbl is not None and tbl.time_s else ""
            print(f"{key}: {w.candidate.name} {w.time_s * 1e3:.4g} ms{vs}")
        bad = [e for e in res.evaluations if e.status not in ("ok",)]
        for e in bad:
            print(f"    {e.candidate.name}: {e.status} {e.detail[:120]}")
    return 0


def main_schedules(argv) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="cuflash schedules", description="The candidate tiles of one bucket: "
                                 "registers, shared memory, occupancy, logical HBM bytes, cached times, the choice.")
    _common_args(ap)
    ap.add_argument("--bwd", action="store_true", help="the backward's K/V kernel instead of the forward (both "
                    "kernels, the wgmma one where the device is sm_90 and the head dim has a Hopper tile)")
    ap.add_argument("--dq", action="store_true", help="the deterministic backward's dQ kernel")
    ap.add_argument("--wgmma", action="store_true", help="only the Hopper wgmma kernel: the forward, or with --bwd "
                    "the backward K/V kernel (default: both kernels, the wgmma one where the device is sm_90 and "
                    "the head dim has a Hopper tile)")
    ap.add_argument("--device", choices=("auto", "h200", "current"), default="auto",
                    help="limits: the current GPU's, or the recorded H200's (auto: the GPU if there is one)")
    ap.add_argument("--no-compile", action="store_true", help="skip the NVRTC compiles (no register counts)")
    ap.add_argument("--all", action="store_true", help="also list the illegal candidates and why")
    args = ap.parse_args(argv)
    try:
        shapes = [_parse_shape(s) for s in args.shape]
    except ValueError as exc:
        ap.error(str(exc))
    if args.dq + args.bwd > 1 or args.dq + args.wgmma > 1:
        ap.error("--dq is one kernel: give it without --bwd or --wgmma (--bwd --wgmma: the Hopper backward only)")
    from .cli.main import gpu_unavailable_reason

    if args.device == "h200" or (args.device == "auto" and gpu_unavailable_reason() is not None):
        limits = device_limits.H200
        where = "recorded H200 limits (/work/shared/reference/device-facts.md)"
    else:
        if gpu_unavailable_reason() is not None:
            print(f"cuflash schedules: --device current, but {gpu_unavailable_reason()}", file=sys.stderr)
            return 2
        limits = device_limits.from_cupy()
        where = "this GPU"
    compile_ok = not args.no_compile
    if compile_ok:
        try:
            from cuda.bindings import nvrtc  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"note: cuda.bindings NVRTC unavailable ({type(exc).__name__}); registers not shown", file=sys.stderr)
            compile_ok = False
    jobs = []
    for shape in shapes:
        hd = schedule.head_dim_bucket(shape[3])
        family = "bwd" if args.bwd else "fwd"
        hopper_op = f"{family}_wgmma"
        wgmma = limits.cc == 90 and hd in op_buckets(hopper_op)
        if args.wgmma and not wgmma:
            what = "backward K/V kernel" if args.bwd else "forward"
            print(f"cuflash schedules: the wgmma {what} runs on sm_90 for head-dim buckets {op_buckets(hopper_op)}; "
                  f"not for d={shape[3]} on {limits.name} (cc {limits.cc})", file=sys.stderr)
            return 2
        ops = (["bwd_dq"] if args.dq else [hopper_op] if args.wgmma
               else [family] + ([hopper_op] if wgmma else []))
        jobs += [(shape, op) for op in ops]
    for shape, op in jobs:
        b, h, n, d = shape
        hd = schedule.head_dim_bucket(d)
        prog = _text_progress(f"compiling {op} d{hd}") if compile_ok else None
        evals, entry = schedule_rows(shape, op=op, causal=args.causal or False, dtype=args.dtype, limits=limits,
                                     compile=compile_ok, hkv=args.hkv, progress=prog)
        table = table_tile(op, hd)
        n_illegal = sum(e.status == "illegal" for e in evals)
        print(f"{OP_TITLE[op]}: B={b} H={h} N={n} d={d} (bucket {hd}) {args.dtype} causal={args.causal or False} on "
              f"{limits.name}, {where}")
        running = ops_that_run(hd, limits.cc)
        if op == "fwd" and "fwd_wgmma" in running:
            print("note: on this device gpu.forward runs the wgmma kernel for this bucket (table below); "
                  "this one runs with CUFLASH_KERNELS=mma_sync or for unaligned inputs")
        if op == "bwd" and "bwd_wgmma" in running:
            print("note: on this device the backward's K/V kernel for this bucket is the wgmma one (bwd_wgmma, "
                  "table below); this one runs with CUFLASH_KERNELS=mma_sync or for unaligned inputs")
        print(f"limits: {limits.smem_per_block_optin:,} B shared memory per block (opt-in), {limits.smem_per_sm:,} per SM, "
              f"{limits.regs_per_sm} registers/SM (allocated per warp in {limits.reg_alloc_unit}s), "
              f"{limits.max_threads_per_sm} threads/SM")
        print(format_schedule_table(evals, entry, op=op, limits=limits, show_illegal=args.all, table=table))
        if not args.all:
            print(f"({n_illegal} of {len(evals)} candidates break a kernel static_assert or a device limit; --all lists them)")
        if entry is None:
            flags = f" --ops {op}" + (f" --causal {args.causal}" if args.causal else "")
            print(f"time: not tuned for {limits.name} (run `cuflash tune --shape {b},{h},{n},{d}{flags}` on the GPU; "
                  f"{ENV_MODE}=1 or 'cached' uses the winner)")
        elif entry["winner"] is None:
            print("tuned: no candidate passed; the built-in table is used")
        print(f"table: {Candidate(op, hd, table).name}: {table.reason}")
        print()
    return 0
