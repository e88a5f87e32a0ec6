"""Split-KV decoding plans: row packing, row blocks, the number of splits, the tile, and how the
splits' partial results merge; the instantiations they name.

Used for 16-bit inputs when all query rows that share a K/V head (GQA group x new tokens) fit in
the decode tile's packed rows. Everything else takes the prefill kernel.

With several splits the blocks' partial results go through a float32 workspace and the last split
of each (sequence, K/V head) to finish merges them (a counter per pair), or, with 2, 4 or 8 splits
on sm_90, the splits of one (K/V head, sequence) form a thread-block cluster and merge through
distributed shared memory (attn_decode_cluster; no workspace). Either way one launch.
attn_decode_combine, a second kernel, merges the workspace where that measured faster
(last_split_merges), where asked (merge="kernel") and for the TMA kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from ..core.arrays import BFLOAT16, FLOAT16, KERNEL_TYPE
from . import schedule
from .spec import KernelSpec

_COMBINE_THREADS = 128  # (kCombineThreads in decode_common.cuh)
MIN_KEYS = 256  # below this a single prefill tile loop is as good


def _b(x):
    return "true" if x else "false"


def row_tiles_for(p):
    """16-row mma tiles for the packed (head, token) rows of one block (row_blocks of them per K/V
    head), or None if decode doesn't apply."""
    if p.dtype not in KERNEL_TYPE or p.nq > 16 or row_blocks(p) > MAX_ROW_BLOCKS:
        return None
    hd, t = schedule.decode_tile(p.d)
    tiles = -(-(launch_problem(p).group * p.nq) // 16)
    return tiles if tiles <= t.max_row_tiles else None


# At most this many row blocks of two row tiles per K/V head (each reads the head's K/V; more go to
# the prefill kernel, which reads K/V once per 64-192 query rows). The planner's one-row-tile blocks
# for short splits (row_blocks) may be more: Hq=128 Hkv=1 B=1 L=16k at d=128, 8 of them, 22.7 us
# against 24.0 with 4 (cuDNN 19.4).
MAX_ROW_BLOCKS = 4


def row_blocks(p, sm_count=None) -> int:
    """Blocks per K/V head: where its packed rows (group x nq) exceed the tile's (32 at d=128: one
    K/V head for Hq=64), the smallest divisor of the group whose share of the query heads fits. Each
    such block reads the K/V head once (attn_decode's row_blocks; from L2 when they run together).
    sm_count (the planner's own launch: no explicit tile, splits or waves): at d=64 and d=128, where
    the multi-row-tile blocks' split count is held down by the shortest split (few blocks for the SMs,
    each with few keys), one-row-tile blocks instead (_short_blocks); at d=64, blocks of three or
    four row tiles whose splits merge through memory become blocks of at most two (_WIDE_D64_ROWS)."""
    if p.dtype not in KERNEL_TYPE or p.nq > 16 or p.hkv == 0:
        return 1
    hd, t = schedule.decode_tile(p.d)
    r = _fitting_row_blocks(p, 16 * t.max_row_tiles)
    if sm_count is None or hd not in (64, 128) or (p.group // r) * p.nq <= 16:
        return r
    if _short_blocks(_with_row_blocks(p, r), sm_count):
        return _fitting_row_blocks(p, 16)
    if hd == 64 and (p.group // r) * p.nq > _WIDE_D64_ROWS and not _clusters(_with_row_blocks(p, r), sm_count):
        r = _fitting_row_blocks(p, _WIDE_D64_ROWS)
        return _fitting_row_blocks(p, 16) if _short_blocks(_with_row_blocks(p, r), sm_count) else r
    return r


# At d=64 the planner's blocks of 3-4 row tiles (one K/V head's 33-64 packed rows) lose to twice as
# many blocks of at most this many rows, each reading the K/V head, unless their splits merge in a
# 2-block cluster. H200, Hq=64 Hkv=1, x the faster of cuDNN / FA2, one block of four row tiles ->
# two of two: B=8 L=16k 0.76 -> 0.94, B=16 L=8k / 16k 0.68 / 0.68 -> 0.85 / 0.80, B=32 L=4k / 8k /
# 16k 0.63 / 0.69 / 0.75 -> 0.79 / 0.82 / 0.84, B=64 L=2k / 4k / 8k / 16k 0.62 / 0.63 / 0.65 / 0.69
# -> 0.88 / 0.82 / 0.77 / 0.73; in 2-block clusters (B=128, L=2k-8k) the four-row-tile blocks stay
# ahead, 0.71-0.73 against 0.66-0.70.
_WIDE_D64_ROWS = 32


def _clusters(p, sm_count: int) -> bool:
    """Whether the planner's own launch of launch problem p merges its splits in a cluster (the
    launch_plan steps up to the merge, without the row-block step that calls this)."""
    return _merges_in_cluster(p, *_own_launch_tile(p, sm_count), sm_count)


def _merges_in_cluster(p, t, waves, sm_count: int) -> bool:
    """Whether launch tile t's plan for launch problem p, at its own split count, merges in a cluster."""
    n = num_splits(p, t, sm_count, waves)
    return _merge_plan(span_keys(p), n, _min_split_keys(t), False, None, row_tiles_for(p))[1]


def _fitting_row_blocks(p, rows: int) -> int:
    """The smallest divisor r of the group with (group / r) x nq packed rows <= rows."""
    g = p.group
    return next(r for r in range(1, g + 1) if g % r == 0 and (g // r) * p.nq <= rows)


def _short_blocks(p, sm_count: int) -> bool:
    """Whether the planner's split count for launch problem p is held down by the shortest split
    (num_splits' key bound at or below the wanted count): blocks of few keys, whose start and end
    (Q's load, the warps' merge, the store: 7-8 us with two row tiles against 3 with one) are most
    of their time. There, one-row-tile blocks - twice as many, each K/V head read from L2 by each -
    were ahead (H200, d=128 bf16, us, two-row-tile blocks / one-row-tile blocks (cuDNN): Hkv=1,
    B=1: Hq=32 L=8k 19.4 / 15.9 (13.7), 16k 19.9 / 16.9 (14.9), 32k 21.9 / 19.8 (18.0), 64k 27.9 /
    24.7 (23.3); Hq=64 L=16k 20.6 / 18.5 (16.8), 32k 24.9 / 23.3 (20.6); Hq=48 L=32k 23.0 / 21.7
    (19.7); Hq=128 L=16k 24.0 / 22.7 (19.4); B=4 Hq=32 L=16k 25.8 / 24.9 (23.2); B=2 Hq=32 L=32k 26.2 /
    26.4 (24.0). Where the splits are longer, two row tiles stay: Hq=32 B=1 L=128k 35.6 / 35.6, B=8
    L=32k 48.8 / 54.4; Hq=64 B=1 L=64k 30.6 / 33.1, B=2 L=32k 30.5 / 31.9; Hq=128 B=1 L=32k 29.8 / 31.9.
    d=64 (32-key tiles: splits of >= 512 keys), B=1: Hq=32 L=32k 21.4 / 15.2 (14.9), L=128k 28.9 / 22.7
    (26.2); Hq=64 L=32k (four row tiles) 29.9 / 16.4 (16.8).)"""
    t, waves = _own_launch_tile(p, sm_count)
    return -(-span_keys(p) // _min_split_keys(t)) <= _wanted_splits(p, sm_count, waves)


def _own_launch_tile(p, sm_count: int):
    """(launch tile, waves) of the planner's own launch of launch problem p (launch_plan's steps
    before the split count), for the row-block rules that run before launch_plan."""
    tile, waves = default_tile(p, sm_count)
    return decode_specs(p.dtype, p.d, row_tiles_for(p), p.causal is not None, True, tile)[3], waves


def _with_row_blocks(p, r: int):
    """p as the decode kernel's grid sees it with r row blocks: each K/V head counted r times."""
    if r == 1:
        return p
    if dataclasses.is_dataclass(p):
        return dataclasses.replace(p, hkv=p.hkv * r)
    return SimpleNamespace(**{**vars(p), "hkv": p.hkv * r, "group": p.group // r})  # (the accounting's shape)


def _own_plan_sms(sm_count: int, splits, tile, waves):
    """sm_count where the planner picks the launch (no caller's splits, tile or waves), else None:
    the SM count row_blocks takes for its one-row-tile rule, and planner_tile for the wide-rows tile."""
    return sm_count if splits is None and tile is None and waves is None else None


def launch_problem(p, sm_count=None, tile=None, cluster=None):
    """p as the decode kernel's grid sees it: each K/V head counted once per row block
    (row_blocks(p, sm_count); with a wide-rows tile - a caller's, or the planner's own where
    sm_count is given (planner_tile) - the fewest that its rows hold). Planned again, the result
    stays as it is."""
    if tile is None and sm_count is not None:
        tile = planner_tile(p, sm_count, cluster)
    return _row_blocked(p, sm_count, tile)


def _row_blocked(p, sm_count, tile):
    """launch_problem for a tile already chosen (None: the table's)."""
    if wide_rows(tile):
        return _with_row_blocks(p, _fitting_row_blocks(p, 16 * tile.max_row_tiles))
    return _with_row_blocks(p, row_blocks(p, sm_count))


def _launch_problem_and_tile(p, sm_count: int, splits, tile, waves, cluster):
    """(launch problem, tile, own) of a launch: for the planner's own (own: no caller's splits,
    tile or waves), planner_tile's choice of tile; otherwise the caller's tile (None: the table's)."""
    own = _own_plan_sms(sm_count, splits, tile, waves)
    if own is not None:
        tile = planner_tile(p, own, cluster)
    return _row_blocked(p, own, tile), tile, own is not None


# The planner's own launch (no caller's tile, splits or waves; cluster not forced on) takes the
# wide-rows tile (schedule.DECODE_TILES_WIDE_ROWS: a row tile per warp over all of a step's keys,
# FA2's order) for K/V heads of more than two row tiles of packed rows (MQA with Hq >= 48 at nq = 1,
# nq = 16 tokens of a GQA group of 4). H200, Hkv=1, x the faster of cuDNN / FA2, planner -> wide:
# d=128 Hq=64 B=8 L=32k 0.82 -> 0.92, B=32 L=16k 0.77 -> 0.95, B=64 L=4k 0.74 -> 0.83; d=64 Hq=64
# B=8 L=16k 0.93 -> 1.14, B=32 L=8k 0.83 -> 1.03, B=64 L=4k 0.84 -> 0.93, B=128 L=2k 0.70 -> 0.90,
# Hq=48 B=64 L=16k 0.76 -> 1.01. At 32 packed rows (Hq=32) the two-row-tile blocks stay ahead
# (1.05 against 1.02 at B=8 L=32k).
# Where its splits are held down by the shortest split (_short_blocks) the wide tile needs at least
# WIDE_SHORT_MIN_WAVES blocks per SM (two passes, x cuDNN, table -> wide). d=128 with 128 wide
# blocks (since the wide block loads Q in one round trip, attn_decode's kQBatch: block start
# 5.6-6.7 -> 2.6 us) won at all 16 shapes measured: B=1 Hq=64 L=32k 0.91 -> 0.94, Hq=48 0.91 ->
# 0.96, Hq=128 L=16k 0.88 -> 0.91, B=2 Hq=64 L=16k 0.91 -> 0.96, B=4 Hq=64 L=8k 0.89 -> 0.94, B=8
# Hq=64 L=4k 0.87 -> 0.91, GQA nq=16 B=5 L=1k 0.94 -> 1.41, nq=4 Hkv=2 B=4 L=4k 2.57 -> 2.68; with
# 64 the table stays ahead (B=1 Hq=64 L=16k 0.92 vs 0.89 at 128 splits, L=8k 0.95 vs 0.87). d=64
# (x the faster peer) with 128 wide blocks: B=1 Hq=128 L=32k 1.01 -> 1.06, B=4 Hq=64 L=16k 0.99 ->
# 1.04; with 48-64 the table stays ahead (B=2 Hq=64 L=16k 0.97 against 0.87, B=1 Hq=64 L=32k 1.00 /
# 0.89, B=2 Hq=128 L=8k 0.97 / 0.86).
# Nor with short splits where the table's own launch merges its splits in a cluster: the 50 shapes
# this moved (d=64 / 128, B=1-16, MQA Hq=48-128 and nq=16 GQA) ran the wide tile 0-10% faster,
# except three at d=64 (B=4 Hq=32 Hkv=8 nq=16 L=2k 1.28 against 1.49, B=16 Hq=48 L=4k 1.09 / 1.19,
# B=16 Hq=128 L=2k 0.92 / 1.02); e.g. d=128 B=1 Hq=128 L=32k 0.91 -> 0.99, B=8 Hq=48 L=8k 0.90 ->
# 0.99, B=1 Hq=32 Hkv=8 nq=16 L=8k 1.58 -> 1.68 (x the faster peer, two passes).
WIDE_SHORT_MIN_WAVES = {64: 0.9, 128: 0.9}
WIDE_ROWS_AUTO = True  # the planner may take the wide-rows tile (tests turn it off to reach the table)


def planner_tile(p, sm_count: int, cluster=None):
    """For the planner's own launch (no caller's tile, splits or waves; cluster not forced on), the
    wide-rows tile where a K/V head's packed rows exceed two row tiles and its splits are not short
    or it launches WIDE_SHORT_MIN_WAVES blocks per SM anyway (see WIDE_ROWS_AUTO), else None (the
    table's tile)."""
    if cluster or not WIDE_ROWS_AUTO or p.dtype not in KERNEL_TYPE or p.nq > 16 or p.group * p.nq <= 32:
        return None
    hd = schedule.head_dim_bucket(p.d)
    wide = schedule.DECODE_TILES_WIDE_ROWS.get(hd)
    if wide is None:
        return None
    wp = _row_blocked(p, None, wide)
    if _short_blocks(wp, sm_count):
        blocks = launch_plan(p, sm_count, tile=wide).splits * wp.hkv * wp.batch
        if blocks < WIDE_SHORT_MIN_WAVES.get(hd, math.inf) * sm_count or _clusters(_row_blocked(p, sm_count, None), sm_count):
            return None
    return wide


def wide_rows(tile) -> bool:
    """Whether a launch tile is schedule.DECODE_TILES_WIDE_ROWS' kind (ring 3 / 4: a row tile per warp)."""
    return isinstance(tile, schedule.DecodeTile) and tile.ring >= 3


def _launch_tile(t, row_tiles):
    """More packed rows mean a taller S tile: shrink the key tile to keep S's registers constant
    (a power of two, at least one 16-key mma step). Applied once, to a table or caller's tile."""
    if t.ring >= 3:  # (wide rows: each warp holds one row tile's S whatever the block's rows)
        return t
    bn = t.block_n
    while bn > 16 and bn * row_tiles > 2 * t.block_n:
        bn //= 2
    return dataclasses.replace(t, block_n=bn)


CLUSTER_SIZES = (2, 4, 8)  # cluster sizes attn_decode_cluster is instantiated for (8: the portable limit)


@functools.lru_cache(maxsize=None)  # a few dozen keys: tiles and cluster sizes, not lengths
def _kernel_spec(dtype, hd, row_tiles, t, causal, vec, cluster=0, window=False, mods=False):
    """attn_decode (cluster 0) or attn_decode_cluster (`cluster` splits per cluster) with launch
    tile t; window: the instantiation that masks a sliding window; mods: attn_decode_mod /
    attn_decode_cluster_mod (score modifiers), whose band mask covers every mask (causal and window
    are not part of its name)."""
    if mods:
        if t.kv_bytes != 2:
            raise ValueError("mods: the score-modifier decode kernel reads 16-bit caches only")
        head = f"{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {row_tiles}, {t.block_n}, {t.warps}, {t.stages}, {_b(vec)}"
        if cluster and cluster not in CLUSTER_SIZES:
            raise ValueError(f"cluster size {cluster}: attn_decode_cluster_mod is instantiated for {CLUSTER_SIZES}")
        expr = (f"attn_decode_cluster_mod<{head}, {cluster}, {t.ring}>" if cluster
                else f"attn_decode_mod<{head}, {t.ring}>")
        return KernelSpec("attn_decode.cu", expr, t.threads, t.smem_bytes(hd, row_tiles))
    params = f"{KERNEL_TYPE[np.dtype(dtype)]}, {hd}, {row_tiles}, {t.block_n}, {t.warps}, {t.stages}, {_b(causal)}, {_b(vec)}"
    tail = ", true" if window else ""
    kv8 = "_kv8" if t.kv_bytes == 1 else ""  # (an e4m3 cache: the _kv8 kernels, every argument spelled out)
    if t.ring or kv8:
        tail = f", {_b(window)}, {t.ring}"
    if cluster:
        if cluster not in CLUSTER_SIZES:
            raise ValueError(f"cluster size {cluster}: attn_decode_cluster is instantiated for {CLUSTER_SIZES}")
        expr = f"attn_decode_cluster{kv8}<{params}, {cluster}{tail}>"
    else:
        expr = f"attn_decode{kv8}<{params}{tail}>"
    return KernelSpec("attn_decode.cu", expr, t.threads, t.smem_bytes(hd, row_tiles))


@functools.lru_cache(maxsize=None)  # asked on every decode call: keep the host path short
def decode_specs(dtype, d, row_tiles, causal, vec, tile=None, window=False, mods=False):
    """(attn_decode, attn_decode_combine, head-dim bucket, launch tile) for the table's tile or
    `tile`, its key tile shrunk for row_tiles (pass a launch_plan tile to launch_spec instead);
    mods: attn_decode_mod (_kernel_spec)."""
    hd, t = schedule.decode_tile(d)
    t = _launch_tile(tile or t, row_tiles)
    return _kernel_spec(dtype, hd, row_tiles, t, causal, vec, 0, window, mods), combine_spec(dtype, d), hd, t


@functools.lru_cache(maxsize=None)
def cluster_spec(dtype, d, row_tiles, causal, vec, size, tile=None, window=False, mods=False):
    """attn_decode_cluster: decode_specs' main kernel with `size` splits per thread-block cluster."""
    hd, t = schedule.decode_tile(d)
    return _kernel_spec(dtype, hd, row_tiles, _launch_tile(tile or t, row_tiles), causal, vec, size, window, mods)


def launch_spec(dtype, d, causal, plan, window=False, mods=False):
    """The cp.async kernel a DecodePlan launches: attn_decode, or attn_decode_cluster when its
    splits merge in a cluster (plan.tile is the launch tile already: no second shrink); mods: their
    score-modifier variants (_kernel_spec)."""
    hd, _ = schedule.decode_tile(d)
    return _kernel_spec(dtype, hd, plan.row_tiles, plan.tile, causal, True, plan.splits if plan.cluster else 0,
                        window, mods)


def combine_spec(dtype, d):
    hd, _ = schedule.decode_tile(d)
    return KernelSpec("attn_decode.cu", f"attn_decode_combine<{KERNEL_TYPE[np.dtype(dtype)]}, {hd}>", _COMBINE_THREADS, 0)


def tma_spec(dtype, d, row_tiles, causal, tile=None):
    """attn_decode_tma's instantiation (d is 64 or 128 exactly: rows are whole 128-byte boxes)."""
    t = tile or schedule.DECODE_TMA_TILES[d]
    tag = KERNEL_TYPE[np.dtype(dtype)]
    expr = f"attn_decode_tma<{tag}, {d}, {row_tiles}, {t.consumer_warps}, {t.stages}, {_b(causal)}>"
    return KernelSpec("attn_decode_tma.cu", expr, t.threads, t.smem_bytes(d, row_tiles)), t


def _instances(*tables):
    """(head-dim bucket, tile, row tiles, causal, window) of every decode instantiation a table's
    tiles launch: every packed-row count up to the tile's, each mask."""
    for table in tables:
        for hd, t in table.items():
            for rt in range(1, t.max_row_tiles + 1):
                for causal in (False, True):
                    for window in (False, True):
                        yield hd, t, rt, causal, window


def all_decode_specs():
    specs = []
    for dtype in (FLOAT16, BFLOAT16):
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TILES):
            main, combine, _, _ = decode_specs(dtype, hd, rt, causal, True, window=window)
            specs += [main, combine]
            specs += [cluster_spec(dtype, hd, rt, causal, True, size, window=window) for size in CLUSTER_SIZES]
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TILES_NO_SPLIT, schedule.DECODE_TILES_LONG_SPLITS,
                                                     schedule.DECODE_TILES_WIDE_ROWS,
                                                     schedule.DECODE_TILES_WIDE_ROWS_LONG):
            specs.append(decode_specs(dtype, hd, rt, causal, True, t, window)[0])
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TILES_FEW_PAIRS):
            specs.append(decode_specs(dtype, hd, rt, causal, True, t, window)[0])
            specs += [cluster_spec(dtype, hd, rt, causal, True, size, t, window) for size in CLUSTER_SIZES]
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TILES_LONG_CLUSTER_SPLITS):
            specs += [cluster_spec(dtype, hd, rt, causal, True, size, t, window) for size in CLUSTER_SIZES]
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TMA_TILES):
            if not window:  # (the TMA kernel has no band mask)
                specs.append(tma_spec(dtype, hd, rt, causal)[0])
        for hd, t, rt, causal, window in _instances(schedule.DECODE_TILES_KV8):
            specs.append(decode_specs(dtype, hd, rt, causal, True, t, window)[0])
            specs += [cluster_spec(dtype, hd, rt, causal, True, size, t, window) for size in CLUSTER_SIZES]
        specs += mod_decode_specs(dtype)
    return list(dict.fromkeys(specs))


def mod_decode_specs(dtype):
    """The score-modifier instantiations (attn_decode_mod, attn_decode_cluster_mod): the 16-bit
    tiles and cluster sizes all_decode_specs lists (TMA's and e4m3's aside), one per tile and
    row-tile count, their band mask serving every mask."""
    specs = []
    for hd, t, rt in _tile_rows(schedule.DECODE_TILES, schedule.DECODE_TILES_NO_SPLIT, schedule.DECODE_TILES_LONG_SPLITS,
                                schedule.DECODE_TILES_WIDE_ROWS, schedule.DECODE_TILES_WIDE_ROWS_LONG,
                                schedule.DECODE_TILES_FEW_PAIRS):
        specs.append(decode_specs(dtype, hd, rt, False, True, t, mods=True)[0])
    for hd, t, rt in _tile_rows(schedule.DECODE_TILES, schedule.DECODE_TILES_FEW_PAIRS,
                                schedule.DECODE_TILES_LONG_CLUSTER_SPLITS):
        specs += [cluster_spec(dtype, hd, rt, False, True, size, t, mods=True) for size in CLUSTER_SIZES]
    return list(dict.fromkeys(specs))


def _tile_rows(*tables):
    """(head-dim bucket, tile, row tiles) of every tile of the tables and packed-row count up to its own."""
    for table in tables:
        for hd, t in table.items():
            for rt in range(1, t.max_row_tiles + 1):
                yield hd, t, rt


WAVES = 2  # blocks per SM the split count aims for


def span_keys(p) -> int:
    """Keys the splits of one sequence cover (at most): all Nk, or under a window with a left
    side (any causal mode) the nq + left keys its tokens see, + 15 since the kernel starts the
    span on a 16-key boundary (DecodeSpan)."""
    window = getattr(p, "window", None)
    if window is None or window[0] < 0:
        return p.nk
    return min(p.nk, p.nq + window[0] + 15)


def num_splits(p, tile, sm_count: int, waves: int | None = None) -> int:
    """About `waves` blocks per SM, each warp keeping >= 4 tiles. With fewer (sequence, K/V head)
    pairs than SMs the count is rounded down, so that the splits fit the SMs' block slots in one
    round: a few more blocks than slots ran as a second round or a third block on some SMs (H200,
    bf16 d=128 Hq=32 Hkv=8, us against cuDNN: B=2 L=128k 16 splits 249.9 vs 17 255.3 / 246.5;
    B=4 L=32k 8 vs 9 130.2 vs 133.1 / 129.3)."""
    want = _wanted_splits(p, sm_count, waves)
    keys, per_split_min = span_keys(p), _min_split_keys(tile)
    # (With the combine kernel, splits of >= 512 keys had paid: B=1 Hkv=8 L=8k, 16 splits 22.1 us
    # against 32 of 256 keys 24.4. Merged by the last split, 32 are ahead: 18.0 vs 18.5; cuDNN 19.2.)
    return max(1, min(want, -(-keys // per_split_min)))


def _min_split_keys(tile) -> int:
    """The fewest keys num_splits gives a split: four key tiles per warp."""
    return tile.warps * tile.block_n * 4


def _wanted_splits(p, sm_count: int, waves=None) -> int:
    """num_splits' count before its bound by the keys: about `waves` blocks per SM (see there)."""
    blocks = max(1, p.batch * p.hkv)
    w = (waves or WAVES) * sm_count
    return max(1, w // blocks) if blocks < sm_count else -(-w // blocks)


def default_tile(p, sm_count: int, waves=None):
    """(tile, waves): with a (sequence, K/V head) block for every SM the no-split tile in one wave
    (schedule.DECODE_TILES_NO_SPLIT), else the table's tile (split into about WAVES blocks per SM),
    or for wide heads with fewer pairs than SMs schedule.DECODE_TILES_FEW_PAIRS."""
    hd, t = schedule.decode_tile(p.d)
    pairs, rt = p.batch * p.hkv, row_tiles_for(p)
    one = schedule.DECODE_TILES_NO_SPLIT.get(hd)
    if one is not None and pairs >= sm_count and rt <= one.max_row_tiles:
        return one, waves or 1
    few = schedule.DECODE_TILES_FEW_PAIRS.get(hd)
    if few is not None and pairs < sm_count and rt <= few.max_row_tiles:
        if hd in schedule.DECODE_FEW_PAIRS_CLUSTERS_ONLY and not _merges_in_cluster(
                p, decode_specs(p.dtype, p.d, rt, p.causal is not None, True, t)[3], waves, sm_count):
            return t, waves  # (the table's 4-warp tile, its splits merged through memory)
        return few, waves
    return t, waves


# An e4m3 cache splits for WAVES blocks per SM like a 16-bit one, few pairs included. B=1 Hkv=8
# L=128k, 16 splits (one wave) against 33 (two): H200 86.2 against 74.7-74.9 us (0.733 against
# 0.843-0.846x the copy rate; 32-key tiles, rings 0-2, one pass); H100 97.3-97.8 against 98.7-99.3
# (0.904 against 0.890x). One block of four warps per SM issues too few copies for the H200's rate.
def e4m3_launch(p, sm_count: int, tile=None, waves=None):
    """(tile, waves) of a launch over an e4m3 K/V cache: schedule.DECODE_TILES_KV8's tile unless
    `tile`; `waves` as given (None: num_splits' WAVES)."""
    if tile is not None:
        return tile, waves
    return schedule.DECODE_TILES_KV8[schedule.head_dim_bucket(p.d)], waves


class DecodePlan(NamedTuple):
    row_tiles: int
    tile: object  # schedule.DecodeTile (block_n as launched) or schedule.DecodeTmaTile
    splits: int  # blocks along the keys (grid x)
    chunk: int  # keys per split, a whole number of key tiles
    cluster: bool  # the splits form one thread-block cluster and merge in it (no workspace, no combine)


# The automatic merge for a few (sequence, head) blocks (H200, B=8 Hkv=8 Hq=32 d=128, decode kernel
# alone, us against cuDNN's 41.6 / 130.1 / 482.2 at L = 4k / 16k / 64k): 4 splits beat the 5 that
# two waves ask for either way (combine 45.1 / 133.8 / 490.9 vs 46.5 / 136.4 / 495.0); a cluster of
# 4 helps while splits are short (42.9 / 134.3 / 505.3) and 8-block clusters are slow (52.8 / 159.6
# / 581.4). So: 3-7 wanted splits become 4 (2 stay 2), merged in a cluster up to CLUSTER_MAX_CHUNK
# keys per split, through the workspace beyond. 8 or more (at most 33 pairs) keep their count and
# the combine kernel: 4 would leave half the SMs' slots empty (B=4 Hkv=8 L=32k: 4 in a cluster 153.4
# us, 8 combined 130.2, cuDNN 129.3).
CLUSTER_MAX_CHUNK = 4096
# A 4-block cluster stops earlier, and holds blocks of one row tile only. H200, x cuDNN over three
# alternating passes, 4-block cluster -> the same 4 splits through memory: one row tile, B=8 Hkv=8
# d=128 L=16k (4 x 4096 keys) 1.00-1.01 -> 1.024-1.025, L=14k (4 x 3584) 0.99-1.01 -> 1.01-1.02, B=2
# Hkv=32 L=16k 0.99-1.00 -> 1.01-1.02, d=64 B=8 Hkv=8 L=16k 0.99-1.00 -> 1.00-1.02; at 4 x 3072 keys
# the cluster stays ahead by 1-3% (B=8 Hq=64 Hkv=8, B=16 Hkv=4, d=64 B=8 Hkv=8). Two or four row
# tiles (MQA, B >= 32): B=64 Hq=32 Hkv=1 d=128 L=4k / 8k / 12k / 16k 0.75 / 0.77 / 0.81 / 0.83 ->
# 0.98 / 1.10 / 1.14 / 1.21, B=32 Hq=64 L=8k 0.82 -> 1.31, d=64 B=64 Hq=32 L=4k / 8k 0.78 / 0.96 ->
# 1.04 / 1.33, Hq=64 L=4k 0.57 -> 0.87. 2-block clusters keep CLUSTER_MAX_CHUNK: with 2-4 row tiles
# they stay ahead by 4-14% (B=128 Hq=32 Hkv=1 L=2k 0.88 vs 0.77), with one 0-3% (B=16 Hkv=8
# L=4k-8k).
CLUSTER4_MAX_CHUNK = 3072
# Cluster-merged splits of at least this many keys take schedule.DECODE_TILES_LONG_CLUSTER_SPLITS
# (ring 1: +1% at 2k and 4k keys per split; ring 0 stays ahead at 1k).
CLUSTER_RING_MIN_CHUNK = 2048


def _merge_plan(nk, n, min_chunk, explicit, cluster, row_tiles=1):
    """(splits, merged in a cluster) for n wanted splits of nk keys, blocks of `row_tiles` row
    tiles. An explicit split count is kept (a cluster when it is an instantiated size, unless
    cluster is False); cluster=True rounds to an instantiated size (up while every split keeps
    min_chunk keys, else down); auto follows the measurements above."""
    if cluster is False:
        return n, False
    if explicit:
        if n in CLUSTER_SIZES:
            return n, True
        if cluster:
            raise ValueError(f"splits={n}: the cluster merge runs {', '.join(map(str, CLUSTER_SIZES))} splits")
        return n, False
    if cluster:
        up = next((s for s in CLUSTER_SIZES if s >= n), None)
        down = max((s for s in CLUSTER_SIZES if s <= n), default=0)
        if up is not None and (up == n or -(-nk // up) >= min_chunk or not down):
            return up, True
        return down, True
    if not CLUSTER_SIZES[0] <= n < CLUSTER_SIZES[-1]:  # (8 or more: the combine, see above)
        return n, False
    if n >= 3 and -(-nk // 4) >= min_chunk:  # (4 splits either way; merged in a cluster while short)
        return 4, row_tiles == 1 and -(-nk // 4) <= CLUSTER4_MAX_CHUNK
    return 2, -(-nk // 2) <= CLUSTER_MAX_CHUNK


def launch_plan(p, sm_count: int, splits=None, tile=None, waves=None, cluster=None, clusters=True) -> DecodePlan:
    """The launch's geometry. `cluster`: None picks (see _merge_plan), False
    forces the combine kernel, True the cluster merge (ValueError where it cannot run);
    `clusters`: whether the device runs thread-block clusters (sm_90). The accounting reads the
    split count and the merge from here too."""
    # (a K/V head over several row blocks: planned as that many heads; one-row-tile blocks where the
    # planner's own two-row-tile blocks would be short, row_blocks)
    p, tile, own = _launch_problem_and_tile(p, sm_count, splits, tile, waves, cluster)
    return _plan_launch(p, sm_count, splits, tile, waves, cluster, clusters, own)


def _plan_launch(p, sm_count, splits, tile, waves, cluster, clusters, own):
    """launch_plan for launch problem p and tile as _launch_problem_and_tile gave them; `own`:
    whether the launch is the planner's own (no caller's splits, tile or waves)."""
    wide = wide_rows(tile)
    rt = -(-(p.group * p.nq) // 16) if wide else row_tiles_for(p)
    if wide and (rt > tile.max_row_tiles or p.nq > 16):
        raise ValueError(f"tile={tile}: at most {16 * tile.max_row_tiles} packed rows per block, got {p.group * p.nq}")
    table_tile = tile is None
    if table_tile:
        tile, waves = default_tile(p, sm_count, waves)
    tma = isinstance(tile, schedule.DecodeTmaTile)
    if tma:
        t, waves = tile, waves or tile.waves
    else:
        _, _, _, t = decode_specs(p.dtype, p.d, rt, p.causal is not None, True, tile)
    step = t.stage_keys if tma else t.block_n
    keys = span_keys(p)
    n = splits or num_splits(p, t, sm_count, waves)
    if cluster and (tma or not clusters or wide):
        raise ValueError("cluster=True: the cluster merge needs an sm_90 device and the cp.async decode kernel "
                         "(not tma_tile, not a wide-rows tile)")
    if own and wide and WIDE_LONG_AUTO:
        t = _wide_long_tile(p, rt, t, -(-max(keys, 1) // n))
        step = t.block_n
    if not tma and clusters and not wide:
        n, in_cluster = _merge_plan(keys, n, _min_split_keys(t), splits is not None, cluster, rt)
        if in_cluster:
            # Exactly n blocks per cluster: trailing splits past the keys run empty and merge as -inf.
            chunk = -(-max(keys, 1) // n)
            chunk = -(-chunk // step) * step
            if table_tile and chunk >= CLUSTER_RING_MIN_CHUNK:
                t = _same_keys_tile(schedule.DECODE_TILES_LONG_CLUSTER_SPLITS, p, rt, t)
            return DecodePlan(rt, t, n, chunk, True)
    chunk = -(-max(keys, 1) // n)
    chunk = -(-chunk // step) * step
    splits = -(-max(keys, 1) // chunk)
    if table_tile and not tma and splits > 1 and chunk > CLUSTER_MAX_CHUNK:
        t = _same_keys_tile(schedule.DECODE_TILES_LONG_SPLITS, p, rt, t)  # FA2's order for long splits
    return DecodePlan(rt, t, splits, chunk, False)


# Ring 4 for the planner's long wide-rows splits (schedule.DECODE_TILES_WIDE_ROWS_LONG; measured in
# schedule's comment). Tests turn it off to reach ring 3.
WIDE_LONG_AUTO = True


def _wide_long_tile(p, rt, t, chunk):
    """The planner's wide-rows launch tile for splits of `chunk` keys: four row tiles with splits of
    at least schedule.WIDE_LONG_MIN_CHUNK keys take schedule.DECODE_TILES_WIDE_ROWS_LONG's tile
    (ring 4; the same split count, the chunk rounded to its key tile), otherwise launch tile t."""
    long = schedule.DECODE_TILES_WIDE_ROWS_LONG.get(schedule.head_dim_bucket(p.d))
    ok = long is not None and rt == long.max_row_tiles and chunk >= schedule.WIDE_LONG_MIN_CHUNK
    return long if ok else t


def _same_keys_tile(table, p, rt, t):
    """The table's tile for p's head dim in place of launch tile t where it splits the keys the
    same way (same key tile and warps: the chunk stays a whole number of steps), else t."""
    other = table.get(schedule.head_dim_bucket(p.d))
    if other is None or rt > other.max_row_tiles:
        return t
    other = _launch_tile(other, rt)
    return other if (other.block_n, other.warps) == (t.block_n, t.warps) else t


def plan(p, sm_count: int, splits=None, tile=None, waves=None, cluster=None, clusters=True):
    """(row_tiles, tile, splits, chunk) of launch_plan: each split covers `chunk` keys, a whole
    number of key tiles."""
    return tuple(launch_plan(p, sm_count, splits, tile, waves, cluster, clusters)[:4])


def workspace_bytes(p, splits: int, cluster: bool = False) -> int:
    """Partial O (float32, d per row) and LSE per split; nothing with one split or when the
    splits merge in a cluster (launch_plan's `cluster`)."""
    if splits <= 1 or cluster:
        return 0
    rows = p.batch * p.hkv * splits * p.group * p.nq
    return rows * p.d * 4 + rows * 4


# attn_decode_combine's merge in slices (decode_common.cuh: kMergeBatch, kMergeSlices): at most
# MERGE_SLICES slices of whole batches of MERGE_BATCH splits, each its own running merge on its own
# thread, the slices' states then merged in order, so that a thread waits for fewer L2 round trips
# (one K/V head at B=1: 128-256 splits; the last split's merge reads shared memory in one pass).
MERGE_BATCH, MERGE_SLICES = 8, 8


def merge_slices(splits: int) -> int:
    """How many slices attn_decode_combine merges the splits in (decode_merge_slice)."""
    batches = -(-splits // MERGE_BATCH)
    slice_ = -(-batches // MERGE_SLICES) * MERGE_BATCH
    return -(-splits // slice_)


def combine_lanes(splits: int) -> int:
    """attn_decode_combine's threads per 4-column group for `splits` splits: the slices, rounded up
    to a power of two (decode_merge_lanes)."""
    return 1 << (merge_slices(splits) - 1).bit_length()


def combine_grid(p, rows, splits):
    """attn_decode_combine's grid: a thread per slice of a 4-column group of a pair's rows, (blocks, Hkv, B)."""
    hd, _ = schedule.decode_tile(p.d)
    return (-(-rows * (hd // 4) * combine_lanes(splits) // _COMBINE_THREADS), p.hkv, p.batch)


# How a launch's workspace partials merge: "last" - the last split of each (sequence, K/V head)
# merges them inside attn_decode (one launch); "kernel" - attn_decode_combine, a second launch;
# "auto" - the last split where its block has a thread for every 4-column group of the pair's rows
# and all the pair's partials fit its shared memory at once (one L2 round trip to stage them,
# decode_merge_pair_staged), else the combine kernel: one block then pulls every partial of its
# pair through one SM, and where a thread has several groups (GQA 8, several tokens, d=192 / 256's
# 2-warp blocks) that cost more than a second launch. H200, bf16 Hq=32 Hkv=8, us (cuDNN) last /
# kernel: B=1 d=128 L=8k 17.7 / 18.7 (19.1), L=32k 41.8 / 42.4 (41.0), B=2 L=8k 24.3 / 26.1 (26.0),
# B=4 L=8k 39.5 / 41.4 (40.1), d=64 B=1 L=32k 24.4 / 26.4 (25.1); but Hq=64 B=1 L=32k 44.4+ / 42.1
# (40.9), B=2 71.0 / 70.0, nq=4 48.8+ / 44.6, d=256 B=1 L=64k 141.8 / 135.9. Before either (the
# old combine kernel, rows of one column per thread) the combine ended 5-10 us after the split
# kernel at B=1 (CUPTI), where cuDNN's reduction takes 2.8 us after a 1 us gap. Tests set it.
MERGE = "auto"


def last_split_merges(plan, rows: int, d: int, merge=None) -> bool:
    """Whether the last split of each pair merges plan's workspace partials (`rows` packed rows of
    head dim d; merge: None for MERGE, or "auto" / "last" / "kernel"), not attn_decode_combine."""
    merge = merge or MERGE
    if plan.splits <= 1 or plan.cluster or merge == "kernel":
        return False
    if merge == "last":
        return True
    hd, _ = schedule.decode_tile(d)
    t = plan.tile
    return rows * (hd // 4) <= t.threads and plan.splits * rows * (d + 1) * 4 <= t.buffer_bytes(hd, plan.row_tiles)


