"""Split-KV decode: the splits merged inside a thread-block cluster (attn_decode_cluster), by the
last split of each pair through the float32 workspace, or by the combine kernel, each forced,
against the float64 reference (naive-error rule).

CPU: the planner's choice of merge and cluster size, the workspace it implies, and that what it
launches is in all_decode_specs (compiled by test_compile). GPU: the three merges for 2, 4 and 8 splits
with kv_lens 0 and 1 and lengths that leave splits empty, causal bottom_right, GQA groups, a
head dim below its bucket, paged caches; outputs poisoned with NaN before each launch.
"""

import dataclasses
import types

import numpy as np
import pytest

from cuflash.plan import schedule
from cuflash.plan.device_limits import H200
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import random_inputs
from cuflash.backends import cuda
from cuflash.kernels import decode as decode_kernels
from cuflash.kernels import device
from cuflash.plan import decode as plan_decode

from _kvlens_check import check_per_sequence
from _launches import record_launches

H200_SMS = 132


def _problem(batch, hq, hkv, nq, nk, d, causal=None, dtype=BFLOAT16):
    return types.SimpleNamespace(dtype=np.dtype(dtype), d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv,
                                 batch=batch, causal=causal)


# ---- CPU: the planner ----

@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("window", [(100, 0), (100, -1), (100, 7), (0, 0)])
def test_window_splits_cover_its_span(causal, window):
    # Under a window with a left side the splits cover the nq + left keys the tokens see (+ 15:
    # the kernel starts on a 16-key boundary), not the cache: a long cache then needs one split,
    # and splits x chunk still covers every key some token sees, wherever the span starts.
    p = _problem(8, 32, 8, 3, 65536, 128, causal)
    p.window = window
    assert plan_decode.span_keys(p) == 3 + window[0] + 15
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.splits * lp.chunk >= 3 + window[0] + 15
    assert lp.splits == 1  # 118 keys or fewer: one split keeps >= 4 tiles per warp
    p.window = (-1, 7)  # no left side: the whole cache, as without a window
    assert plan_decode.span_keys(p) == 65536
    assert plan_decode.launch_plan(p, H200_SMS)[2:] == plan_decode.launch_plan(_problem(8, 32, 8, 3, 65536, 128, causal),
                                                                             H200_SMS)[2:]


def test_window_specs_are_compiled():
    # What a windowed decode launches is in all_decode_specs (compiled by test_compile).
    names = {s.short_name for s in plan_decode.all_decode_specs()}
    for causal in (False, True):
        for rt in (1, 2):
            p = _problem(2, 8 * rt, 1, 2, 40000, 128, "bottom_right" if causal else None)
            p.window = (5000, 0)
            lp = plan_decode.launch_plan(p, H200_SMS)
            spec = plan_decode.launch_spec(p.dtype, 128, causal, lp, True)
            assert spec.short_name.endswith(",true>") and spec.short_name in names

@pytest.mark.parametrize("nk", [4096, 12288, 14336, 16384, 65536])
def test_few_block_cells_merge_in_a_cluster(nk):
    # B=8, Hkv=8: 64 (sequence, head) blocks take 4 splits for two blocks per SM (264 // 64,
    # rounded down: the decode probe's fastest either way), merged in a 4-block cluster while a split
    # holds at most CLUSTER4_MAX_CHUNK keys (4k, 12k), through the workspace beyond (14k, 16k, 64k).
    p = _problem(8, 32, 8, 1, nk, 128)
    assert plan_decode.num_splits(p, schedule.DECODE_TILES[128], H200_SMS) == 4
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.splits == 4 and lp.cluster == (nk // 4 <= plan_decode.CLUSTER4_MAX_CHUNK) == (nk <= 12288)
    assert lp.chunk % lp.tile.block_n == 0 and lp.chunk * 4 >= nk and lp.chunk * 3 < nk
    assert plan_decode.workspace_bytes(p, lp.splits, lp.cluster) == (0 if lp.cluster else 8 * 8 * 4 * 4 * (128 + 1) * 4)
    # forced combine: the same 4 splits, with their float32 partials
    rt, t, splits, chunk, cluster = plan_decode.launch_plan(p, H200_SMS, cluster=False)
    assert not cluster and splits == 4 and plan_decode.workspace_bytes(p, splits) == 8 * 8 * 4 * 4 * (128 + 1) * 4
    assert plan_decode.plan(p, H200_SMS, cluster=False) == (rt, t, splits, chunk)


def test_two_splits_cluster_and_no_split_has_neither():
    p = _problem(8, 32, 8, 1, 500, 128)  # 500 keys: two splits of >= 256 keys at most
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.cluster and lp.splits == 2 and lp.chunk == 256
    for b, hkv in ((64, 8), (8, 32)):  # a (sequence, head) block per SM: no split, nothing to merge
        p = _problem(b, 32, hkv, 1, 4096, 128)
        lp = plan_decode.launch_plan(p, H200_SMS)
        assert not lp.cluster and lp.splits == 1 and plan_decode.workspace_bytes(p, 1) == 0


def test_many_splits_take_the_combine_kernel():
    p = _problem(2, 32, 8, 1, 16384, 128)  # 16 blocks take 16 splits (264 // 16): more than a cluster holds
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert not lp.cluster and lp.splits == 16 and plan_decode.workspace_bytes(p, lp.splits, lp.cluster) > 0
    forced = plan_decode.launch_plan(p, H200_SMS, cluster=True)
    assert forced.cluster and forced.splits == 8


@pytest.mark.parametrize("batch, hkv, want", [(1, 8, 33), (2, 8, 16), (4, 8, 8), (1, 32, 8), (5, 8, 6), (8, 8, 4)])
def test_few_pairs_fill_the_slots_once(batch, hkv, want):
    # Fewer (sequence, head) pairs than SMs: the split count rounds down so that pairs x splits fits
    # two blocks per SM; 8 or more splits merge in the combine kernel (a 4-block cluster would leave
    # half the slots empty), 3-7 become a 4-block cluster as before (B=5: 6 -> 4).
    p = _problem(batch, 32, hkv, 1, 65536, 128)
    assert plan_decode.num_splits(p, schedule.DECODE_TILES[128], H200_SMS) == want
    assert batch * hkv * want <= 2 * H200_SMS < batch * hkv * (want + 1)
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.splits == (want if want >= 8 else 4) and lp.cluster is False  # (64k keys: 16k per split of 4)
    short = plan_decode.launch_plan(_problem(batch, 32, hkv, 1, 8192, 128), H200_SMS)
    assert short.cluster == (want < 8)
    if want >= 8:  # as many as fill the slots while each warp keeps 4 key tiles (B=1: 32 of 256 keys)
        t = schedule.DECODE_TILES[128]
        assert short.splits == min(want, 8192 // (4 * t.warps * t.block_n))


@pytest.mark.parametrize("d", [192, 256])
def test_wide_heads_with_few_pairs_take_two_warp_blocks(d):
    few = plan_decode.launch_plan(_problem(8, 32, 8, 1, 4096, d), H200_SMS)  # (4 splits in a cluster)
    assert few.cluster and few.tile == schedule.DECODE_TILES_FEW_PAIRS[d] and few.tile.warps == 2
    # splits merged through memory: 2 warps at d=256, the table's 4 at d=192 (DECODE_FEW_PAIRS_CLUSTERS_ONLY)
    for b, nk in [(8, 16384), (1, 65536), (4, 16384)]:
        lp = plan_decode.launch_plan(_problem(b, 32, 8, 1, nk, d), H200_SMS)
        want = schedule.DECODE_TILES[d] if d == 192 else schedule.DECODE_TILES_FEW_PAIRS[d]
        assert not lp.cluster and lp.tile == want, (b, nk, lp)
    # at d=192 the 2-warp tile stays where the 4-warp tile's own splits would merge in a cluster
    # (B=1 L=1k: 4 of 256 keys; the 2-warp tile's 8 of 128 merge through memory)
    short = _problem(1, 32, 8, 1, 1024, 192)
    assert plan_decode.launch_plan(short, H200_SMS, tile=schedule.DECODE_TILES[192]).cluster
    assert plan_decode.launch_plan(short, H200_SMS).tile == schedule.DECODE_TILES_FEW_PAIRS[192]
    # three (d=256) or four (d=192) such blocks share an SM, against one or two of the table's tile
    per_sm = lambda t: H200.smem_per_sm // (t.smem_bytes(d, 1) + H200.smem_reserved_per_block)  # noqa: E731
    assert per_sm(few.tile) >= 3 > per_sm(schedule.DECODE_TILES[d])
    many = plan_decode.launch_plan(_problem(64, 32, 8, 1, 4096, d), H200_SMS)  # a pair per SM: the table's tile
    assert many.tile == schedule.DECODE_TILES[d] and many.splits == 1


@pytest.mark.parametrize("d, hkv, nq, last", [(128, 8, 1, True), (64, 8, 1, True), (128, 8, 2, False),
                                              (256, 8, 1, False), (128, 32, 1, True)])
def test_the_last_split_merges_with_a_thread_per_column_group(monkeypatch, d, hkv, nq, last):
    # Splits merged through memory: by their last split where its block has a thread for every
    # 4-column group of the pair's rows (d=128, 4 rows: 128 groups, 128 threads) and all partials
    # fit its shared memory (33 splits x 4 rows x 129 floats: 68112 of 69632 bytes), else by the
    # combine kernel (8 rows at d=128; d=256's 2-warp blocks); merge= / MERGE force either.
    monkeypatch.setattr(plan_decode, "MERGE", "auto")
    p = _problem(1, 32, hkv, nq, 65536, d)
    lp = plan_decode.launch_plan(p, H200_SMS)
    rows = p.group * nq
    assert lp.splits > 1 and not lp.cluster
    assert plan_decode.last_split_merges(lp, rows, d) == last
    assert plan_decode.last_split_merges(lp, rows, d, "last") and not plan_decode.last_split_merges(lp, rows, d, "kernel")
    assert not plan_decode.last_split_merges(plan_decode.launch_plan(p, H200_SMS, splits=4, cluster=True), rows, d, "last")
    monkeypatch.setattr(plan_decode, "MERGE", "kernel")
    assert not plan_decode.last_split_merges(lp, rows, d)


def test_the_last_split_merges_only_partials_its_shared_memory_holds(monkeypatch):
    # One sequence, one K/V head of 4 query heads: 256 splits of 256 keys, 528 KB of partials for one
    # block to pull through its SM - the combine kernel merges (4 rows: a thread per group).
    monkeypatch.setattr(plan_decode, "MERGE", "auto")
    p = _problem(1, 4, 1, 1, 65536, 128)
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.splits == 256 and not lp.cluster
    assert not plan_decode.last_split_merges(lp, 4, 128)
    assert plan_decode.last_split_merges(lp._replace(splits=33), 4, 128)
    assert not plan_decode.last_split_merges(lp._replace(splits=34), 4, 128)


def test_packed_combines_are_programmatic():
    small, large = _problem(1, 32, 8, 1, 8192, 128), _problem(8, 32, 8, 1, 65536, 128)
    assert not decode_kernels.combine_programmatic(small) and decode_kernels.combine_programmatic(large)
    assert decode_kernels.combine_programmatic(small, packed=True)
    assert not decode_kernels.combine_programmatic(large, packed=True, splits=decode_kernels.PDL_COMBINE_MAX_SPLITS)


@pytest.mark.parametrize("d,hq,b,nk,splits,cluster", [
    (128, 32, 64, 4096, 4, False), (128, 32, 64, 16384, 4, False), (128, 64, 32, 8192, 4, False),  # 4 splits,
    (64, 32, 64, 4096, 4, False), (64, 32, 64, 16384, 4, False), (64, 32, 64, 8192, 4, False),  # 2+ row tiles
    (128, 32, 128, 2048, 2, True), (128, 32, 128, 8192, 2, True), (64, 32, 128, 4096, 2, True)])  # 2 splits
def test_four_block_clusters_hold_one_row_tile(monkeypatch, d, hq, b, nk, splits, cluster):
    # MQA with many sequences: blocks of two or more row tiles split in 4 merge through the
    # workspace (decode probe: 0.57-0.83x cuDNN in a 4-block cluster, 0.87-1.33x through memory),
    # in 2 still in a 2-block cluster (ahead by 4-14%). The split count stays either way. (Hq=64
    # takes the wide-rows tile by default: here the table's, as under CUFLASH_DECODE_WIDE_ROWS=0.)
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", False)
    p = _problem(b, hq, 1, 1, nk, d)
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.row_tiles > 1 and (lp.splits, lp.cluster) == (splits, cluster)
    assert plan_decode.workspace_bytes(plan_decode.launch_problem(p, H200_SMS), lp.splits, lp.cluster) == (
        0 if cluster else b * splits * hq * (d + 1) * 4)
    # one row tile, 4 splits of 3072 keys or fewer: still a cluster
    short = plan_decode.launch_plan(_problem(8, 32, 8, 1, 12288, d), H200_SMS)
    assert short.row_tiles == 1 and short.cluster and short.splits == 4


def test_rounding_down_keeps_each_split_long_enough():
    # 88 blocks want 3 splits; 4 splits of an 800-key cache would hold 200 < 256 keys: round down.
    short = plan_decode.launch_plan(_problem(11, 32, 8, 1, 800, 128), H200_SMS)
    assert short.cluster and short.splits == 2
    long = plan_decode.launch_plan(_problem(11, 32, 8, 1, 4096, 128), H200_SMS)
    assert long.cluster and long.splits == 4


def test_explicit_and_forced_choices():
    p = _problem(8, 32, 8, 1, 4096, 128)
    assert plan_decode.launch_plan(p, H200_SMS, splits=4)[2:] == (4, 1024, True)
    assert plan_decode.launch_plan(p, H200_SMS, splits=5).cluster is False  # not a cluster size
    assert plan_decode.launch_plan(p, H200_SMS, splits=4, cluster=False).cluster is False
    with pytest.raises(ValueError, match="splits=5"):
        plan_decode.launch_plan(p, H200_SMS, splits=5, cluster=True)
    with pytest.raises(ValueError, match="sm_90"):
        plan_decode.launch_plan(p, H200_SMS, cluster=True, clusters=False)
    assert not plan_decode.launch_plan(p, H200_SMS, clusters=False).cluster  # pre-Hopper: combine
    tma = schedule.DECODE_TMA_TILES[128]
    assert not plan_decode.launch_plan(p, H200_SMS, tile=tma).cluster
    with pytest.raises(ValueError, match="tma_tile"):
        plan_decode.launch_plan(p, H200_SMS, tile=tma, cluster=True)
    # one wanted split, forced into a cluster: the smallest cluster
    one = plan_decode.launch_plan(_problem(64, 32, 8, 1, 4096, 128), H200_SMS, cluster=True)
    assert one.cluster and one.splits == 2
    with pytest.raises(ValueError, match="cluster size"):
        plan_decode.cluster_spec(BFLOAT16, 128, 1, False, True, 3)


def test_trailing_splits_may_be_empty():
    # 300 keys in 8 splits of 48 keys (whole 16-key tiles): the 8th split starts past the cache.
    lp = plan_decode.launch_plan(_problem(8, 32, 8, 1, 300, 128), H200_SMS, splits=8)
    assert lp.cluster and lp.splits == 8 and lp.chunk == 48 and 7 * lp.chunk > 300


@pytest.mark.parametrize("batch,hkv,want", [(8, 8, "table"), (8, 16, "table"), (33, 4, "no_split"),
                                             (8, 32, "no_split"), (79, 5, "no_split"), (64, 8, "no_split")])
def test_default_tile_by_blocks_per_sm(batch, hkv, want):
    # (sequence, K/V head) blocks on 132 SMs: fewer than one per SM, the table's tile with splits;
    # one per SM or more, the no-split tile (one wave or several; never split).
    p = _problem(batch, 4 * hkv, hkv, 1, 16384, 128)
    tile, waves = plan_decode.default_tile(p, H200_SMS)
    assert tile == {"table": schedule.DECODE_TILES[128], "no_split": schedule.DECODE_TILES_NO_SPLIT[128]}[want]
    assert (batch * hkv >= H200_SMS) == (want == "no_split")
    if want == "no_split":
        assert waves == 1 and plan_decode.launch_plan(p, H200_SMS).splits == 1
    else:
        assert plan_decode.launch_plan(p, H200_SMS).splits > 1


def test_no_split_tile_holds_two_blocks_per_sm():
    # The no-split tile's 70 KiB would let three blocks share an H200 SM; its launch asks for enough
    # shared memory that exactly two do (max_blocks_per_sm), with one or two row tiles.
    from cuflash.plan.device_limits import H200, occupancy

    t = schedule.DECODE_TILES_NO_SPLIT[128]
    assert t.max_blocks_per_sm == 2
    for rt in range(1, t.max_row_tiles + 1):
        uncapped = dataclasses.replace(t, max_blocks_per_sm=0)
        assert occupancy(H200, t.threads, 168, uncapped.smem_bytes(128, rt)).blocks_per_sm == 3
        assert occupancy(H200, t.threads, 168, t.smem_bytes(128, rt)).blocks_per_sm == 2


@pytest.mark.parametrize("nk,cluster,want_ring", [(4096, None, 0), (8192, None, 1), (12288, None, 1), (16384, None, 0), (65536, None, 2),
                                                   (65536, False, 2), (16384, False, 0), (16384, True, 1)])
def test_split_rings_by_chunk(nk, cluster, want_ring):
    # Splits merged by the combine kernel and longer than CLUSTER_MAX_CHUNK keys run the
    # DECODE_TILES_LONG_SPLITS tile (ring 2), cluster-merged splits of CLUSTER_RING_MIN_CHUNK keys
    # or more DECODE_TILES_LONG_CLUSTER_SPLITS' (ring 1), shorter ones the table's (ring 0): the same
    # key tiles, so the same chunk. A caller's tile stands.
    p = _problem(8, 32, 8, 1, nk, 128)
    lp = plan_decode.launch_plan(p, H200_SMS, cluster=cluster)
    assert lp.splits > 1
    assert lp.tile.ring == want_ring
    if lp.cluster:
        assert want_ring == (1 if lp.chunk >= plan_decode.CLUSTER_RING_MIN_CHUNK else 0)
    else:
        assert want_ring == (2 if lp.chunk > plan_decode.CLUSTER_MAX_CHUNK else 0)
    table = schedule.DECODE_TILES[128]
    assert (lp.tile.block_n, lp.tile.warps, lp.tile.stages) == (table.block_n, table.warps, table.stages)
    forced = plan_decode.launch_plan(p, H200_SMS, cluster=cluster, tile=table)
    assert forced.tile.ring == 0 and forced.chunk == lp.chunk and forced.splits == lp.splits


_FEW_BLOCKS = [(8, 32, 8, 1, 4096, 128), (4, 32, 8, 1, 8192, 128), (8, 16, 8, 7, 4096, 128),
               (8, 8, 2, 16, 4096, 64), (8, 4, 4, 16, 4096, 256), (2, 40, 1, 1, 4096, 32), (2, 64, 1, 1, 4096, 32),
               (8, 8, 2, 7, 4096, 40), (8, 32, 8, 1, 500, 128)]
_MANY_BLOCKS = [(8, 32, 32, 1, 4096, 128), (64, 32, 8, 1, 4096, 128), (64, 32, 8, 7, 4096, 128)]  # no split (forcing a cluster there is a probe's experiment)


@pytest.mark.parametrize("shape,cluster", [(s, c) for s in _FEW_BLOCKS for c in (None, False, True)]
                         + [(s, c) for s in _MANY_BLOCKS for c in (None, False)])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_what_is_launched_is_compiled_by_the_cpu_test(shape, causal, cluster):
    # The kernel a plan launches must be one of all_decode_specs (test_compile checks those for
    # spills on sm_90a); d=32 with 3-4 row tiles once launched a 16-key tile that list lacked.
    p = _problem(*shape, causal=causal)
    lp = plan_decode.launch_plan(p, H200_SMS, cluster=cluster)
    spec = plan_decode.launch_spec(p.dtype, p.d, causal is not None, lp)
    assert spec.short_name in {s.short_name for s in plan_decode.all_decode_specs()}
    assert ("attn_decode_cluster<" in spec.expression) == lp.cluster
    if lp.cluster:
        assert spec.expression.endswith(f", {lp.splits}>")


def test_all_decode_specs_lists_every_cluster_size():
    names = {s.short_name for s in plan_decode.all_decode_specs()}
    for dtype in (FLOAT16, BFLOAT16):
        for hd, t in schedule.DECODE_TILES.items():
            for rt in range(1, t.max_row_tiles + 1):
                for causal in (False, True):
                    main = plan_decode.decode_specs(dtype, hd, rt, causal, True)[0]
                    for size in plan_decode.CLUSTER_SIZES:
                        spec = plan_decode.cluster_spec(dtype, hd, rt, causal, True, size)
                        assert spec.short_name in names
                        assert (spec.threads, spec.smem_bytes) == (main.threads, main.smem_bytes)


# ---- GPU: both merges against the float64 reference ----

def _launch(monkeypatch):
    """Record the expressions gpu_decode fetches (which kernels ran), on every call: uncached
    (a planned geometry, cuflash.api.plan_cache, launches without fetching)."""
    from cuflash.api import plan_cache

    monkeypatch.setattr(plan_cache, "enabled", False)
    return record_launches(monkeypatch, decode_kernels)


def _check_kernels(launched, merge, splits):
    """merge: "cluster" (one cluster launch), "last" (the last split merges: one launch) or
    "kernel" (the split kernel, then attn_decode_combine)."""
    if merge == "cluster":
        # the cluster size is the ninth template argument (a window or ring tail may follow it)
        assert launched and all(e.startswith("attn_decode_cluster<") and e[:-1].split(", ")[8] == str(splits)
                                for e in launched), launched
    elif merge == "last":
        assert launched and all(e.startswith("attn_decode<") for e in launched), launched
    else:
        assert launched[0].startswith("attn_decode<") and launched[-1].startswith("attn_decode_combine<"), launched


# How the GPU merge tests merge the splits: in a cluster, in the last split, or in the combine kernel.
MERGES = ["cluster", "last", "kernel"]


def _merge_kwargs(merge):
    return {"cluster": True} if merge == "cluster" else {"cluster": False, "merge": merge}


def _poisoned(shape, dtype):
    """A device array of NaNs (through raw bits: CuPy's bfloat16 support is storage-level)."""
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    a.view(np.uint16).fill({np.dtype(FLOAT16): 0x7E00, np.dtype(BFLOAT16): 0x7FC0}[np.dtype(dtype)])
    return a


def _lens(rng, nk, splits, block_n=16):
    """0 and 1 keys, a length inside the first split (the others empty), one that ends inside a
    later split, and the whole cache."""
    chunk = -(-(-(-nk // splits)) // block_n) * block_n
    return np.array([0, 1, int(rng.integers(2, min(chunk, nk))), int(rng.integers(chunk, nk)), nk], dtype=np.int32)


_SHAPES = [(hq, hkv, nq, d) for hq, hkv, d in ((32, 8, 128), (16, 8, 128), (8, 2, 40), (4, 4, 256)) for nq in (1, 7, 16)
           if (hq // hkv) * nq <= 16 * schedule.DECODE_TILES[schedule.head_dim_bucket(d)].max_row_tiles]


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
@pytest.mark.parametrize("hq,hkv,nq,d", _SHAPES)
def test_merge_kv_lens(rng, monkeypatch, merge, splits, causal, hq, hkv, nq, d):
    import cupy

    from cuflash.core.problem import validate_forward

    dtype = FLOAT16 if d == 40 else BFLOAT16
    nk = 1500
    lens = _lens(rng, nk, splits)
    q, k, v = random_inputs(rng, (len(lens), hq, nq, d), (len(lens), hkv, nk, d), dtype)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    p = validate_forward(qg, kg, vg, causal=causal)
    o4 = _poisoned(qg.shape, qg.dtype)  # every element must be written
    lse3 = cupy.full((len(lens), hq, nq), np.nan, dtype=np.float32)
    launched = _launch(monkeypatch)
    decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=lg, splits=splits, **_merge_kwargs(merge))
    _check_kernels(launched, merge, splits)
    check_per_sequence(o4, lse3, q, k, v, lens, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
def test_merge_without_kv_lens_and_an_empty_trailing_split(rng, monkeypatch, merge, causal):
    # 300 keys over 8 splits of 48: the cluster's 8th block has no key at all.
    import cupy

    from cuflash.core.problem import validate_forward

    b, hq, hkv, nq, nk, d = 3, 32, 8, 1, 300, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg, causal=causal)
    o4 = _poisoned(qg.shape, qg.dtype)
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    launched = _launch(monkeypatch)
    decode_kernels.forward(p, qg, kg, vg, o4, lse3, splits=8, **_merge_kwargs(merge))
    _check_kernels(launched, merge, 8)
    check_per_sequence(o4, lse3, q, k, v, [nk] * b, causal, BFLOAT16)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("hq,hkv,nq,d,causal", [(32, 8, 1, 128, False), (8, 2, 7, 64, "bottom_right")])
def test_merge_paged(rng, monkeypatch, merge, splits, bs, hq, hkv, nq, d, causal):
    import cupy

    from cuflash.core.layout import to_bhsd
    from cuflash.core.problem import validate_paged
    from test_paged import paged_cache  # shuffled pages, NaN in every unused page

    nk = 1300
    lens = _lens(rng, nk, splits)
    q, k, v = random_inputs(rng, (len(lens), hq, nq, d), (len(lens), hkv, nk, d), BFLOAT16)
    kc, vc, table = paged_cache(rng, k, v, lens, bs)
    qg, kcg, vcg, tg, lg = (cupy.asarray(a) for a in (q, kc, vc, table, lens))
    p, block = validate_paged(qg, kcg, vcg, tg, causal=causal)
    assert cuda.decode_applies(p, kcg, vcg)
    o4 = _poisoned(qg.shape, qg.dtype)
    lse3 = cupy.full((len(lens), hq, nq), np.nan, dtype=np.float32)
    launched = _launch(monkeypatch)
    decode_kernels.forward(p, to_bhsd(qg, p, hq, nq), kcg, vcg, o4, lse3, kv_lens=lg, paged=(tg, block), splits=splits,
                       **_merge_kwargs(merge))
    _check_kernels(launched, merge, splits)
    check_per_sequence(o4, lse3, q, k, v, lens, causal, BFLOAT16)


@pytest.mark.gpu
def test_last_split_counters_are_left_zero(rng):
    # The merge by the last split counts each pair's finished splits in a buffer kept per stream
    # (cuflash.kernels.counters), which every launch must leave zero: one geometry run twice, one
    # with more pairs than the buffer held (it grows), one on another stream, then the first
    # again - each against the reference, and bitwise equal to its first run and to the combine
    # kernel's merge. Outputs poisoned.
    import cupy

    from cuflash.core.problem import validate_forward

    def run(b, hkv, nk, splits, stream=None, merge="last"):
        q, k, v = random_inputs(np.random.default_rng([b, hkv, nk, splits]), (b, 2 * hkv, 1, 64), (b, hkv, nk, 64),
                                BFLOAT16)
        lens = np.arange(b, dtype=np.int32) * 7 % (nk + 1)  # (0, 1-key and full sequences among them)
        with stream or cupy.cuda.Stream.null:
            qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
            p = validate_forward(qg, kg, vg)
            o4 = _poisoned(qg.shape, qg.dtype)
            lse3 = cupy.full((b, 2 * hkv, 1), np.nan, dtype=np.float32)
            decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=lg, splits=splits, cluster=False, merge=merge)
            o, lse = o4.get(), lse3.get()
        check_per_sequence(o, lse, q, k, v, lens, False, BFLOAT16)
        return o.view(np.uint16), lse

    first = run(3, 2, 900, 5)
    again = [run(3, 2, 900, 5), run(1040, 1, 300, 2), run(4, 4, 700, 3, cupy.cuda.Stream(non_blocking=True)),
             run(3, 2, 900, 5)]
    # (up to 8 splits - 5 here - the combine kernel merges in one slice, the last split's arithmetic: the same bits)
    for o, lse in (again[0], again[3], run(3, 2, 900, 5, merge="kernel")):
        np.testing.assert_array_equal(o, first[0])
        np.testing.assert_array_equal(lse, first[1])
    from cuflash.kernels import counters

    cupy.cuda.Device().synchronize()
    assert int(cupy.abs(counters.view(1040, cupy.cuda.Stream.null.ptr)).max()) == 0


def test_combine_slices():
    # attn_decode_combine's slices of whole 8-split batches (at most 8) and its lanes per group.
    assert [plan_decode.merge_slices(n) for n in (1, 8, 9, 16, 17, 64, 65, 100, 200, 264)] == [1, 1, 2, 2, 3, 8, 5, 7, 7, 7]
    assert [plan_decode.combine_lanes(n) for n in (1, 8, 9, 17, 33, 64, 100)] == [1, 1, 2, 4, 8, 8, 8]
    p = _problem(1, 32, 1, 1, 65536, 128)
    assert plan_decode.combine_grid(p, 32, 256) == (32 * 32 * 8 // 128, 1, 1)
    assert plan_decode.combine_grid(p, 32, 8) == (32 * 32 // 128, 1, 1)


def test_combine_constants_match_the_kernel():
    # The host sizes the combine grid from constants that decode_common.cuh defines too.
    import re

    from cuflash.kernels.build import load_source

    src = load_source("decode_common.cuh")
    consts = {name: int(value) for name, value in re.findall(r"constexpr int (k\w+) = (\d+);", src)}
    assert consts["kMergeBatch"] == plan_decode.MERGE_BATCH
    assert consts["kMergeSlices"] == plan_decode.MERGE_SLICES
    assert consts["kCombineThreads"] == plan_decode._COMBINE_THREADS


@pytest.mark.gpu
@pytest.mark.parametrize("hq, splits", [(1, 100), (2, 50), (4, 9), (4, 8), (32, 100), (4, 200)])
def test_sliced_combine(hq, splits):
    # More than 8 splits: the combine kernel merges slices of whole batches on their own threads,
    # then the slices' states in order (100 splits: 7 slices of 16, the last 4; 9: 8 + 1); the last
    # split's merge makes one pass (from shared memory, or with two row tiles at hq=32 from global
    # memory). Both against the reference; with one slice (8 splits) the same bits. kv_lens 0 and 1
    # among the sequences leave whole slices empty. Outputs poisoned.
    import cupy

    from cuflash.core.problem import validate_forward

    b, hkv, nk, d = 3, 1, 6400, 128  # (splits of whole 16-key tiles: 100 x 64, 50 x 128, 9 x 720, 200 x 32)
    q, k, v = random_inputs(np.random.default_rng([hq, splits]), (b, hq, 1, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, nk - 333][:b], dtype=np.int32)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    p = validate_forward(qg, kg, vg)
    assert plan_decode.launch_plan(p, 132, splits, cluster=False).splits == splits
    out = {}
    for merge in ("last", "kernel"):
        o4 = _poisoned(qg.shape, qg.dtype)
        lse3 = cupy.full((b, hq, 1), np.nan, dtype=np.float32)
        decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=lg, splits=splits, cluster=False, merge=merge)
        o, lse = o4.get(), lse3.get()
        check_per_sequence(o, lse, q, k, v, lens, False, BFLOAT16)
        out[merge] = (o.view(np.uint16), lse)
    if plan_decode.merge_slices(splits) == 1:
        np.testing.assert_array_equal(out["last"][0], out["kernel"][0])
        np.testing.assert_array_equal(out["last"][1], out["kernel"][1])


@pytest.mark.gpu
def test_api_default_takes_the_cluster_on_a_few_block_cell(rng, monkeypatch):
    # B=8, Hkv=8, Hq=32 at 4k keys: on sm_90 the API's own choice is one cluster launch.
    import cupy

    import cuflash

    q, k, v = random_inputs(rng, (8, 32, 1, 128), (8, 8, 4096, 128), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    dev = cupy.cuda.Device()
    lp = plan_decode.launch_plan(_problem(8, 32, 8, 1, 4096, 128), dev.attributes["MultiProcessorCount"],
                                clusters=int(dev.compute_capability) >= 90)
    assert lp.cluster == (int(dev.compute_capability) >= 90)
    launched = _launch(monkeypatch)
    o, lse = cuflash.attention(qg, kg, vg, return_lse=True, out=_poisoned(qg.shape, qg.dtype))
    _check_kernels(launched, "cluster" if lp.cluster else "last" if plan_decode.last_split_merges(lp, 4, 128) else "kernel",
                   lp.splits)
    check_per_sequence(o, lse, q, k, v, [4096] * 8, False, BFLOAT16)


@pytest.mark.gpu
def test_cluster_path_allocates_no_workspace():
    # What memory_report predicts for the default launch (a cluster on sm_90: no partials) is
    # what the call allocates: O and LSE only.
    import cupy

    import cuflash
    from test_gpu_accounting import _inputs, _predicted, _recorded

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("the report models the H200's launch, a cluster (sm_90)")
    q, k, v = _inputs((8, 32, 1, 128), (8, 8, 4096, 128), 11)
    sizes = _recorded(lambda: cuflash.attention(q, k, v, return_lse=True))
    rep = cuflash.memory_report(q, k, v, method="tiled", pass_="fwd")
    assert not any(e.category == "workspace" for e in rep.entries)
    assert sum(sizes) == _predicted(rep, {"output", "saved state"}) == 8 * 32 * 128 * 2 + 8 * 32 * 4, (sizes, rep.table())


@pytest.mark.parametrize("hq, hkv, nq, blocks", [(64, 1, 1, 2), (128, 2, 1, 2), (96, 1, 1, 3), (128, 1, 1, 4),
                                                  (32, 1, 2, 2), (6, 1, 16, 3), (32, 8, 1, 1)])
def test_row_blocks(hq, hkv, nq, blocks):
    # A K/V head whose packed rows (group x tokens) exceed the tile's 32 (d=128) runs as row blocks,
    # each a divisor's share of its query heads, planned as that many K/V heads; past 4 row blocks
    # the prefill kernel stays.
    p = _problem(2, hq, hkv, nq, 32768, 128)
    assert plan_decode.row_blocks(p) == blocks
    pv = plan_decode.launch_problem(p)
    assert (pv.hkv, pv.group, pv.hq) == (hkv * blocks, hq // hkv // blocks, hq)
    assert plan_decode.row_tiles_for(p) == -(-(pv.group * nq) // 16) <= 2
    assert plan_decode.launch_plan(p, H200_SMS, splits=16) == plan_decode.launch_plan(pv, H200_SMS, splits=16)
    planned = plan_decode.launch_problem(p, H200_SMS)  # (the planner's own launch may take one-row-tile blocks)
    assert plan_decode.launch_plan(p, H200_SMS) == plan_decode.launch_plan(planned, H200_SMS)
    assert plan_decode.row_tiles_for(_problem(2, 64, 1, 16, 32768, 128)) is None  # 32 row blocks: prefill


@pytest.mark.parametrize("batch, hq, hkv, nk, blocks", [
    (1, 32, 1, 8192, 2), (1, 32, 1, 32768, 2), (1, 32, 1, 65536, 2), (1, 32, 1, 131072, 1), (8, 32, 1, 32768, 1),
    (1, 64, 1, 32768, 4), (1, 64, 1, 65536, 2), (2, 64, 1, 32768, 2), (1, 128, 1, 16384, 8), (1, 128, 1, 32768, 4),
    (1, 48, 1, 32768, 3), (1, 32, 8, 4096, 1)])
def test_one_tile_row_blocks(monkeypatch, batch, hq, hkv, nk, blocks):
    # The planner's own launch at d=128 (132 SMs) with the table's tiles (the wide-rows rule off: it
    # takes some of these shapes, test_wide_rows_planner_rule): where the two-row-tile blocks' split
    # count is held down by the shortest split (B=1 MQA up to 64k keys, Hq=64 up to 32k), one-row-tile
    # row blocks (16 packed rows each); with longer splits, or a caller's splits / tile / waves, the
    # fewest row blocks that fit. Planned again, a launch problem stays as it is.
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", False)
    p = _problem(batch, hq, hkv, 1, nk, 128)
    assert plan_decode.row_blocks(p, H200_SMS) == blocks
    planned = plan_decode.launch_problem(p, H200_SMS)
    assert plan_decode.launch_problem(planned, H200_SMS).hkv == planned.hkv == hkv * blocks
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.row_tiles == -(-(hq // hkv // blocks) // 16)
    min_tiles = -(-(hq // hkv // plan_decode.row_blocks(p)) // 16)
    for kw in ({"splits": 16}, {"tile": plan_decode.schedule.decode_tile(128)[1]}, {"waves": 2}):
        assert plan_decode.launch_plan(p, H200_SMS, **kw).row_tiles == min_tiles, kw


@pytest.mark.parametrize("batch, hq, hkv, nk, d, blocks", [
    (1, 32, 1, 32768, 64, 2), (1, 32, 1, 131072, 64, 2), (1, 64, 1, 32768, 64, 4), (8, 32, 1, 32768, 64, 1),
    (1, 32, 1, 32768, 256, 2), (1, 32, 1, 32768, 32, 1)])
def test_one_tile_row_blocks_other_dims(batch, hq, hkv, nk, d, blocks):
    # d=64 (up to four row tiles, splits of >= 512 keys) takes the rule too; d=256 holds one row tile
    # anyway; d=32 (not measured) keeps the fewest row blocks.
    p = _problem(batch, hq, hkv, 1, nk, d)
    assert plan_decode.row_blocks(p, H200_SMS) == blocks
    assert plan_decode.launch_plan(p, H200_SMS).row_tiles == -(-(hq // hkv // blocks) // 16)


@pytest.mark.parametrize("batch, hq, nk, blocks, cluster", [
    (32, 64, 8192, 2, False), (64, 64, 2048, 2, True), (8, 64, 16384, 2, False), (32, 48, 4096, 2, False),
    (16, 128, 8192, 4, False), (128, 64, 4096, 1, True), (1, 64, 32768, 4, False)])
def test_wide_d64_blocks_split_in_two(monkeypatch, batch, hq, nk, blocks, cluster):
    # d=64, one K/V head: blocks of three or four row tiles whose splits would merge through memory
    # become blocks of at most _WIDE_D64_ROWS rows (mqa_rows_probe: 0.62-0.76 -> 0.73-0.94 of the
    # faster peer); where they merge in a 2-block cluster (B=128) they stay; short splits still take
    # one-row-tile blocks first (B=1). A caller's splits keep the fewest row blocks that fit. By
    # default the wide-rows tile (planner_tile) takes these shapes unless their splits are short.
    p = _problem(batch, hq, 1, 1, nk, 64)
    assert plan_decode.wide_rows(plan_decode.launch_plan(p, H200_SMS).tile) == (batch > 1)
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", False)
    p = _problem(batch, hq, 1, 1, nk, 64)
    assert plan_decode.row_blocks(p, H200_SMS) == blocks
    lp = plan_decode.launch_plan(p, H200_SMS)
    assert lp.cluster == cluster and lp.row_tiles == -(-(hq // blocks) // 16)
    if blocks == 2:
        assert not plan_decode._clusters(p, H200_SMS) and lp.row_tiles <= plan_decode._WIDE_D64_ROWS // 16
    assert plan_decode.launch_plan(p, H200_SMS, splits=8).row_tiles == -(-(hq // plan_decode.row_blocks(p)) // 16)
    # at d=128 blocks hold two row tiles at most: the rule does not apply
    assert plan_decode.row_blocks(_problem(32, 64, 1, 1, 8192, 128), H200_SMS) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("case", ["mqa64", "gqa64-paged", "mqa48-window", "mqa48-br"])
def test_row_blocks_decode(rng, monkeypatch, merge, case):
    # Row blocks on the GPU: each block reads its K/V head (the kernel's row_blocks) and writes its
    # own query heads' rows; against the reference per sequence, kv_lens 0 and 1 among them, outputs
    # poisoned; merged in a cluster, by the last split and by the combine kernel.
    import cupy

    from cuflash.core.layout import to_bhsd
    from cuflash.core.problem import validate_forward, validate_paged

    hq, hkv, nq, d = {"mqa64": (64, 1, 1, 128), "gqa64-paged": (128, 2, 1, 128), "mqa48-window": (48, 1, 2, 64),
                      "mqa48-br": (48, 1, 2, 128)}[case]
    causal = "bottom_right" if case == "mqa48-br" else False
    nk, splits = 1500, 4
    lens = _lens(rng, nk, splits)
    q, k, v = random_inputs(rng, (len(lens), hq, nq, d), (len(lens), hkv, nk, d), BFLOAT16)
    o4 = _poisoned((len(lens), hq, nq, d), BFLOAT16)
    lse3 = cupy.full((len(lens), hq, nq), np.nan, dtype=np.float32)
    launched = _launch(monkeypatch)
    lg = cupy.asarray(lens)
    if case == "gqa64-paged":
        from test_paged import paged_cache

        kc, vc, table = paged_cache(rng, k, v, lens, 64)
        qg, kcg, vcg, tg = (cupy.asarray(a) for a in (q, kc, vc, table))
        p, block = validate_paged(qg, kcg, vcg, tg)
        assert plan_decode.row_blocks(p) == 2 and cuda.decode_applies(p, kcg, vcg)
        decode_kernels.forward(p, to_bhsd(qg, p, hq, nq), kcg, vcg, o4, lse3, kv_lens=lg, paged=(tg, block),
                           splits=splits, **_merge_kwargs(merge))
        window = None
    else:
        window = (300, 0) if case == "mqa48-window" else None
        qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
        p = validate_forward(qg, kg, vg, causal=causal, window=window)
        assert plan_decode.row_blocks(p) > 1 and cuda.decode_applies(p, kg, vg)
        decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=lg, splits=splits, **_merge_kwargs(merge))
    _check_kernels(launched, merge, splits)
    check_per_sequence(o4, lse3, q, k, v, lens, causal, BFLOAT16, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, hq, nk, d", [(2, 64, 5000, 128), (1, 32, 6000, 64), (1, 64, 6000, 64), (2, 32, 9000, 128)])
def test_row_blocks_through_the_api(rng, batch, hq, nk, d):
    # cuflash.attention takes the decode kernel for one K/V head of many query heads (64 at d=128
    # took the prefill kernel before row blocks), prepared and plain calls alike, in the planner's
    # row blocks: here one-row-tile blocks (short splits, row_blocks with the device's SM count).
    import cupy

    import cuflash
    from cuflash.core.problem import validate_forward

    q, k, v = random_inputs(rng, (batch, hq, 1, d), (batch, 1, nk, d), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg)
    # (short splits on any GPU of 80 SMs or more)
    assert plan_decode.row_blocks(p, device.sm_count(cupy.cuda.Device().id)) == hq // 16 > plan_decode.row_blocks(p)
    run = cuflash.prepare_attention(qg, kg, vg, return_lse=True)
    assert run.path == "decode", run
    for o, lse in (cuflash.attention(qg, kg, vg, return_lse=True), run(qg, kg, vg)):
        check_per_sequence(o, lse, q, k, v, [nk] * batch, False, BFLOAT16)


@pytest.mark.gpu
@pytest.mark.parametrize("wide_auto", [False, True], ids=["rows32", "wide"])
def test_wide_d64_row_blocks_through_the_api(rng, monkeypatch, wide_auto):
    # d=64, Hq=64 over one K/V head, 32 sequences: the planner takes the wide-rows tile (one block
    # of four row tiles, a warp each: plan_decode.WIDE_ROWS_AUTO); with that rule off, it splits the
    # 64 packed rows into two blocks of two row tiles (_WIDE_D64_ROWS). Through cuflash.attention
    # with kv_lens 0, 1, random and full, output poisoned, against the reference per sequence.
    import cupy

    import cuflash
    from cuflash.core.problem import validate_forward

    b, hq, nk, d = 32, 64, 8192, 64
    q, k, v = random_inputs(rng, (b, hq, 1, d), (b, 1, nk, d), BFLOAT16)
    lens = rng.integers(2, nk + 1, size=b).astype(np.int32)
    lens[:3] = [0, 1, nk]
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    sms = device.sm_count(cupy.cuda.Device().id)
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", wide_auto)
    if sms >= 120:  # (the H200's 132: the probe's shape; smaller GPUs may plan otherwise)
        assert plan_decode.row_blocks(validate_forward(qg, kg, vg), sms) == 2
    launched = _launch(monkeypatch)
    out = _poisoned(qg.shape, BFLOAT16)
    o, lse = cuflash.attention(qg, kg, vg, kv_lens=lg, return_lse=True, out=out)
    if sms < 120:
        assert launched and launched[0].startswith("attn_decode<"), launched
    elif wide_auto:  # (four row tiles, ring 3)
        assert launched and launched[0].startswith("attn_decode<Bf16, 64, 4,") and launched[0].endswith(", 3>"), launched
    else:  # (two row tiles)
        assert launched and launched[0].startswith("attn_decode<Bf16, 64, 2,"), launched
    check_per_sequence(o, lse, q, k, v, lens, False, BFLOAT16)
