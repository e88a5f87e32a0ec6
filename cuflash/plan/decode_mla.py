"""MLA decoding plans: (dqk, dv) = (576, 512), DeepSeek's latent cache (attn_decode_mla.cu).

q (B, Hq, Nq, 576) with few query tokens against one 576-wide cache row per key and K/V head; v is
the first 512 columns of that row (v aliasing k: the kernel reads each row once) or a separate
array. The (head, token) rows of one K/V head are packed into 16-row mma tiles as in the split-KV
decode kernel (plan.decode): at most MLA_TILE.max_row_tiles tiles per block, more rows as row
blocks; the keys are split over blocks for about WAVES blocks per SM (MAX_PARTIAL_SHARE caps the
splits' partial traffic), and the splits' partials merge in attn_decode_combine<T, 512>.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core.arrays import BFLOAT16, FLOAT16, KERNEL_TYPE
from ..core.problem import MLA_HEAD_DIMS, MLA_MAX_QUERY_TOKENS
from .decode import combine_lanes
from .spec import KernelSpec, cpp_bool

D, DV = MLA_HEAD_DIMS
COMBINE_THREADS = 128  # (kCombineThreads in decode_common.cuh)


@dataclass(frozen=True)
class MlaTile:
    """attn_decode_mla's compile-time shape (MlaDecodeTraits in attn_decode_mla.cu)."""

    block_n: int  # keys per ring stage
    warps: int
    max_row_tiles: int  # 16-row tiles of packed rows per block
    stages: int  # ring stages with v aliasing k (separate v: stages_separate)
    stages_separate: int
    d_parts: int  # S's products split over the head dim (each warp: a quarter of 576 columns, all keys)
    reason: str

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, row_tiles: int, v_in_k: bool) -> int:
        """Q, the ring of K (and V) stages, P, and the float statistics, as kSmemBytes."""
        rows = 16 * row_tiles
        stages = self.stages if v_in_k else self.stages_separate
        ring = stages * self.block_n * (D + (0 if v_in_k else DV)) * 2
        slices = 4
        partials = self.d_parts * rows * (self.block_n + 8)  # partial S, rows padded by 8 floats
        return rows * D * 2 + ring + rows * self.block_n * 2 + (2 * slices * rows + 2 * rows + partials) * 4


# The one tile table (keyed by the one head-dim pair), with its reason.
MLA_TILES = {
    (D, DV): MlaTile(
        block_n=32, warps=8, max_row_tiles=2, stages=4, stages_separate=2, d_parts=4,
        reason="O's 512 fp32 columns split over 8 warps (64 each): 32 registers per row tile; two row tiles "
               "(207-237 registers, no spills; four spilled at 255 when a warp per 8-key slice computed S). 32-key "
               "stages of 36.9 KB: with "
               "the 36.9 KB Q tile, four K stages (three in flight) or two K+V stages fit 227 KB; S computed "
               "once, by (row tile, quarter of the head dim) warps over all 32 keys (each Q fragment feeds four "
               "mma tiles; partials summed in shared memory) and shared as P: at Hq = 128 (242 flop/byte) the "
               "block is near the compute ridge, so S is not recomputed per column-split warp."),
}
MLA_TILE = MLA_TILES[(D, DV)]

# One block per SM: a block's shared memory (166-203 KB of sm_90's 227 KB) leaves no room for a
# second, so the split count aims at one full wave (two would run as two waves, not side by side).
WAVES = 1
MIN_SPLIT_KEYS = 256  # the fewest keys per split: eight 32-key stages, so a split's start and end stay small
# Each split writes its rows' float32 partial O (512 wide) and the combine reads it again: 4 KB per
# row and split against 1152 bytes per cached key. At Hq = 128, one token, L = 32k, the 64 splits
# that fill the SMs would add 32 MB of partials to a 38 MB cache; the cap keeps them to a quarter of
# the cache's bytes (18 splits there).
MAX_PARTIAL_SHARE = 0.25


def row_blocks(p) -> int:
    """Blocks per K/V head: the smallest divisor r of the group whose share (group / r) x nq of
    packed rows fits a block's tiles (any group fits with r = group: nq <= MLA_MAX_QUERY_TOKENS)."""
    rows = 16 * MLA_TILE.max_row_tiles
    g = p.group
    return next(r for r in range(1, g + 1) if g % r == 0 and (g // r) * p.nq <= rows)


def row_tiles(p) -> int:
    return -(-((p.group // row_blocks(p)) * p.nq) // 16)


def num_splits(p, sm_count: int, waves: int | None = None) -> int:
    """About `waves` blocks per SM over the (sequence, K/V head, row block) blocks; each split at
    least MIN_SPLIT_KEYS keys, and the partials' traffic at most MAX_PARTIAL_SHARE of the cache's."""
    blocks = max(1, p.batch * p.hkv * row_blocks(p))
    want = max(1, ((waves or WAVES) * sm_count) // blocks)
    by_keys = -(-max(p.nk, 1) // MIN_SPLIT_KEYS)
    cache_bytes = p.hkv * p.nk * D * 2  # per sequence
    partial_bytes = 2 * p.hq * p.nq * DV * 4  # per sequence and split: written, then read by the combine
    by_traffic = max(1, int(MAX_PARTIAL_SHARE * cache_bytes) // partial_bytes)
    return max(1, min(want, by_keys, by_traffic))


class MlaPlan(NamedTuple):
    row_tiles: int
    row_blocks: int
    splits: int  # blocks along the keys (grid x)
    chunk: int  # keys per split, a whole number of 32-key stages
    tile: MlaTile


def launch_plan(p, sm_count: int, splits: int | None = None, waves: int | None = None) -> MlaPlan:
    """The launch's geometry; `splits` forces the split count (1: no combine)."""
    if splits is not None and splits < 1:
        raise ValueError(f"splits: expected at least 1, got {splits}")
    n = splits or num_splits(p, sm_count, waves)
    step = MLA_TILE.block_n
    chunk = -(-max(p.nk, 1) // n)
    chunk = -(-chunk // step) * step
    return MlaPlan(row_tiles(p), row_blocks(p), -(-max(p.nk, 1) // chunk), chunk, MLA_TILE)


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype, rt: int, causal: bool, v_in_k: bool) -> KernelSpec:
    t = MLA_TILE
    expr = f"attn_decode_mla<{KERNEL_TYPE[np.dtype(dtype)]}, {rt}, {cpp_bool(causal)}, {cpp_bool(v_in_k)}>"
    return KernelSpec("attn_decode_mla.cu", expr, t.threads, t.smem_bytes(rt, v_in_k))


@functools.lru_cache(maxsize=None)
def combine_spec(dtype) -> KernelSpec:
    """attn_decode_combine over 512-wide partial O rows."""
    return KernelSpec("attn_decode.cu", f"attn_decode_combine<{KERNEL_TYPE[np.dtype(dtype)]}, {DV}>",
                      COMBINE_THREADS, 0)


def combine_grid(rows: int, splits: int, hkv_launch: int, batch: int):
    """attn_decode_combine's grid as plan.decode.combine_grid, for 512-wide rows."""
    return (-(-rows * (DV // 4) * combine_lanes(splits) // COMBINE_THREADS), hkv_launch, batch)


def workspace_bytes(p, plan: MlaPlan) -> int:
    """Partial O (float32, 512 per row) and LSE per split; nothing with one split."""
    if plan.splits <= 1:
        return 0
    rows = p.batch * p.hq * p.nq * plan.splits
    return rows * DV * 4 + rows * 4


def all_mla_specs():
    """Every attn_decode_mla instantiation (16-bit types x row tiles x causal x v aliasing k) and the
    512-wide combine."""
    specs = []
    for dtype in (FLOAT16, BFLOAT16):
        for rt in range(1, MLA_TILE.max_row_tiles + 1):
            for causal in (False, True):
                for v_in_k in (True, False):
                    specs.append(kernel_spec(dtype, rt, causal, v_in_k))
        specs.append(combine_spec(dtype))
    return specs


__all__ = ["MLA_TILES", "MLA_TILE", "MLA_MAX_QUERY_TOKENS", "launch_plan", "kernel_spec", "combine_spec",
           "combine_grid", "all_mla_specs", "workspace_bytes", "row_blocks", "row_tiles", "num_splits"]
