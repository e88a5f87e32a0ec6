"""The TMA-fed wgmma forward (attn_fwd_wgmma_tma) vs the float64 reference, by the naive-error rule.

The tile is forced through cuda.forward_wgmma (the table's TMA tiles and variants of them). What TMA changes is where tiles come from: rank-4 tensor maps over (d, rows, heads, batch)
whose boxes past the tensor are zero-filled by the copy engine. So the cases are the ones that
stress addressing: lengths that end mid-box, Nq != Nk, padded head dims (d < the tile's), GQA
(K/V head = h / group), several batch entries, the bshd layout (row stride = H * d), rows that
see no key, and a misaligned view (falls back with a clear ValueError, not a wrong answer).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash.core import problem as _problem
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.layout import to_bhsd
from cuflash.backends import cuda
from cuflash.kernels import forward as forward_kernels
from cuflash.plan import hopper as plan_hopper
from test_gpu_forward import (
    assert_unchanged,
    check_rows,
    device_inputs,
    poisoned,
    raw,
    shapes,
    to_device,
)

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_with_tma():
    from cuflash.kernels import tma

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("not a Hopper GPU: attn_fwd_wgmma_tma needs sm_90")
    if not tma.available():
        pytest.skip("cuda-bindings is not installed: tensor maps cannot be encoded")


def tma_tile(d, block_n=None, stages=None, pingpong=None):
    t = schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(d)]
    assert t.tma
    if block_n is None and stages is None and pingpong is None:
        return t
    pp = t.pingpong if pingpong is None else pingpong
    return schedule.HopperTile(block_n or t.block_n, t.warpgroups, stages or t.stages, "test", False, True, pp)


def forward_tma(q, k, v, tile, *, causal=False, layout="bhsd", persistent_blocks=None, split=False):
    before = [raw(a).copy() for a in (q, k, v)]
    p = _problem.validate_forward(q, k, v, causal=causal, layout=layout)
    o = poisoned(p.q_shape(), p.dtype)
    lse = poisoned(p.lse_shape(), FLOAT32)
    o4, lse3 = to_bhsd(o, p, p.hq, p.nq), lse.reshape((p.batch, p.hq, p.nq))
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    cuda.forward_wgmma(p, q4, k4, v4, o4, lse3, tile=tile, persistent_blocks=persistent_blocks, split=split)
    assert_unchanged((q, k, v), before)
    return o, lse


def run_and_check(rng, dtype, batch, hq, hkv, nq, nk, d, *, causal, tile=None, layout="bhsd", persistent_blocks=None):
    sq, skv = shapes(layout, batch, hq, hkv, nq, nk, d)
    q, k, v = device_inputs(rng, sq, skv, dtype)
    o, lse = forward_tma(q, k, v, tile or tma_tile(d), causal=causal, layout=layout,
                         persistent_blocks=persistent_blocks)
    check_rows(o, lse, q, k, v, causal=causal, layout=layout, rng=rng)


DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 72, 96, 128, 192, 256])
def test_head_dims_and_ragged_lengths(rng, dtype, causal, d):
    run_and_check(rng, dtype, (2,), 3, 3, 131, 333, d, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("nq,nk", [(1, 1), (7, 300), (300, 7), (128, 128), (257, 1000), (1000, 257)])
def test_rectangular(rng, dtype, causal, nq, nk):
    run_and_check(rng, dtype, (1,), 2, 2, nq, nk, 128, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_batch_and_layouts(rng, dtype, layout, d):
    run_and_check(rng, dtype, (3,), 8, 2, 200, 190, d, causal="bottom_right", layout=layout)


@pytest.mark.parametrize("d,block_n,stages", [(64, 128, 3), (64, 64, 4), (128, 128, 2), (128, 64, 4)])
def test_other_tiles(rng, d, block_n, stages):
    run_and_check(rng, BFLOAT16, (2,), 2, 1, 515, 700, d, causal=False, tile=tma_tile(d, block_n, stages))
    run_and_check(rng, BFLOAT16, (1,), 2, 1, 700, 515, d, causal="top_left", tile=tma_tile(d, block_n, stages))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [72, 128])
def test_long_rows_tile(rng, dtype, causal, d):
    # HOPPER_FORWARD_LONG_ROWS' 192-key tile: ragged query and key ends (not multiples of 192 or
    # 128), Nq != Nk both ways, GQA.
    tile = schedule.HOPPER_FORWARD_LONG_ROWS[128].tile
    run_and_check(rng, dtype, (2,), 4, 2, 331, 1000, d, causal=causal, tile=tile)
    run_and_check(rng, dtype, (1,), 2, 1, 1000, 385, d, causal=causal, tile=tile)


def test_long_rows_dispatch(rng, monkeypatch):
    # The dispatch takes the long-rows tile once rows see min_keys keys on average (min_keys
    # lowered so that a smaller problem qualifies: rows past the persistent rule's 2048 keys,
    # enough query tiles that no key split applies) and the result is right.

    rule = schedule.HOPPER_FORWARD_LONG_ROWS[128]
    monkeypatch.setattr(schedule, "HOPPER_FORWARD_LONG_ROWS", {128: dataclasses.replace(rule, min_keys=2100)})
    seen = []
    real = forward_kernels.launch_forward
    monkeypatch.setattr(forward_kernels, "launch_forward", lambda spec, *a, **kw: seen.append(spec.expression) or real(spec, *a, **kw))
    sq, skv = shapes("bhsd", (4,), 4, 4, 2100, 2100, 128)
    q, k, v = device_inputs(rng, sq, skv, BFLOAT16)
    before = [raw(a).copy() for a in (q, k, v)]
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    assert_unchanged((q, k, v), before)
    check_rows(o, lse, q, k, v, causal=False, layout="bhsd", rng=rng)
    assert seen and all(", 128, 192, 2, 2," in e for e in seen), seen


@pytest.mark.parametrize("pingpong", [False, True], ids=["own-pace", "pingpong"])
@pytest.mark.parametrize("warpgroups", [None, 2], ids=["table-wg", "wg2"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_warpgroup_schedules(rng, pingpong, warpgroups, causal, d):
    # Both schedules of the two math warpgroups, with key-tile counts 0 (bottom_right rows before
    # the diagonal's first key), 1 and many per block.
    tile = tma_tile(d, pingpong=pingpong)  # d=64: three math warpgroups (round robin when ping-pong)
    if warpgroups is not None:
        if tile.warpgroups == warpgroups:
            pytest.skip("the table tile already has this many warpgroups")
        tile = dataclasses.replace(tile, warpgroups=warpgroups)
    for nq, nk in ((200, 70), (129, 129), (77, 1000)):
        run_and_check(rng, FLOAT16, (2,), 2, 1, nq, nk, d, causal=causal, tile=tile)


@pytest.mark.parametrize("pingpong", [False, True], ids=["own-pace", "pingpong"])
@pytest.mark.parametrize("causal", [pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")])
@pytest.mark.parametrize("d", [64, 192, 256])
def test_warpgroup_key_extent(rng, pingpong, causal, d):
    # Each math warpgroup stops at its own rows' last key tile and only passes on its turns and
    # releases its ring slots for the rest (192-row tiles at d=64, 80 / 96-key tiles at d=256 /
    # 192): warpgroups with fewer tiles than the block (1000 x 1000, 450 x 1300), with none while
    # another has some (300 x 150 bottom_right: the first tile's warpgroups 0 and 1 see no key,
    # warpgroup 2 one tile), and with no valid rows (ragged last tiles).
    tile = tma_tile(d, pingpong=pingpong)
    for nq, nk in ((1000, 1000), (450, 1300), (300, 150)):
        run_and_check(rng, BFLOAT16, (2,), 2, 1, nq, nk, d, causal=causal, tile=tile)
    wge = dataclasses.replace(schedule.HOPPER_FORWARD_TILES[d], pingpong=False, wg_epilogue=True, reason="")
    run_and_check(rng, FLOAT16, (1,), 3, 1, 1000, 1000, d, causal=causal, tile=wge)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [128, 192, 256])
def test_warpgroup_epilogue(rng, causal, d):
    # HopperTile.wg_epilogue in the non-persistent kernel: each warpgroup stages its own O rows in
    # its Q rows and stores them without waiting for the other (the causal d=256 rule's tile).
    tile = dataclasses.replace(schedule.HOPPER_FORWARD_TILES[d], pingpong=False, wg_epilogue=True, reason="")
    for batch, hq, hkv, nq, nk in ((2, 3, 1, 515, 700), (1, 2, 2, 77, 33), (1, 2, 1, 1, 300)):
        run_and_check(rng, BFLOAT16, (batch,), hq, hkv, nq, nk, d, causal=causal, tile=tile)


@pytest.mark.parametrize("epilogue", [False, True], ids=["block-epilogue", "wg-epilogue"])
@pytest.mark.parametrize("blocks", [None, 1, 5], ids=["per-SM", "one-block", "five-blocks"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["own-pace", "pingpong"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_schedule(rng, epilogue, blocks, pingpong, causal, d):
    # attn_fwd_wgmma_tma_persistent: a few blocks walk many (batch, head, query-tile) items, the
    # K/V ring and the barrier phases running on across tiles of different key-tile counts (0
    # under bottom_right with nq > nk, 1, many; odd counts flip the ring's parity mid-tile), GQA,
    # a ragged last query tile, odd query-tile counts (a causal unit pairs tiles m and M-1-m; the
    # middle one of an odd count runs alone) and units that do not divide among the blocks.
    variants = plan_hopper.persistent_variants(schedule.HOPPER_FORWARD_TILES[d], d)
    tile = next(t for t in variants if t.pingpong == pingpong and t.wg_epilogue == epilogue)
    for batch, hq, hkv, nq, nk in ((3, 3, 1, 515, 700), (2, 4, 2, 300, 129), (1, 2, 2, 1000, 257)):
        run_and_check(rng, FLOAT16, (batch,), hq, hkv, nq, nk, d, causal=causal, tile=tile, persistent_blocks=blocks)


@pytest.mark.parametrize("blocks", [None, 1, 5], ids=["per-SM", "one-block", "five-blocks"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_persistent_three_warpgroups(rng, blocks, causal, dtype):
    # d=64's 3-warpgroup persistent tile (192-row query tiles, 3 stages, turns round robin, each
    # warpgroup storing its own O rows): ragged query tiles whose last warpgroups have no rows,
    # key-tile counts 0, 1 and many, GQA, units that do not divide among the blocks.
    tile = schedule._PERSIST_64_WG3
    for batch, hq, hkv, nq, nk in ((3, 3, 1, 515, 700), (2, 4, 2, 300, 129), (1, 2, 2, 1000, 257), (1, 2, 1, 70, 70)):
        run_and_check(rng, dtype, (batch,), hq, hkv, nq, nk, 64, causal=causal, tile=tile, persistent_blocks=blocks)


def test_persistent_many_tiles_per_sm(rng):
    # One block per SM with about 4 tiles each (132 SMs on the H200), bshd layout.
    tile = plan_hopper.persistent_variants(schedule.HOPPER_FORWARD_TILES[128], 128)[0]
    run_and_check(rng, BFLOAT16, (4,), 16, 4, 1031, 1031, 128, causal="bottom_right", tile=tile, layout="bshd")


# The key split (attn_fwd_wgmma_tma_split): every query tile runs as key ranges whose last piece
# merges the others' float32 partials. Forced piece counts: 2 to 6, pieces of one key tile and
# pieces with none (2 key tiles in 4 pieces: their LSE is -inf and must weigh nothing), a ragged
# last query tile and key tile, GQA, several batch entries, bshd rows. Every row is checked, and
# the outputs start poisoned.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("case", [
    pytest.param(((2, 3, 1, 300, 1000), 2), id="k2"),
    pytest.param(((2, 3, 1, 300, 1000), 6), id="k6"),
    pytest.param(((1, 4, 2, 257, 200), 4), id="empty-pieces"),
    pytest.param(((3, 2, 2, 129, 777), 3), id="k3"),
])
def test_key_split(rng, dtype, d, case):
    (batch, hq, hkv, nq, nk), splits = case
    tile = tma_tile(d)
    for layout in ("bhsd", "bshd"):
        sq, skv = shapes(layout, (batch,), hq, hkv, nq, nk, d)
        q, k, v = device_inputs(rng, sq, skv, dtype)
        o, lse = forward_tma(q, k, v, tile, layout=layout, split=splits)
        check_rows(o, lse, q, k, v, layout=layout)


def test_key_split_twice_and_counters_reset(rng):
    # Two launches back to back on one stream share the per-tile counters: the first launch's last
    # pieces must have zeroed them, or the second's would merge before its partials were written.
    tile = tma_tile(128)
    for _ in range(2):
        q, k, v = device_inputs(rng, (1, 8, 700, 128), (1, 8, 1100, 128), BFLOAT16)
        o, lse = forward_tma(q, k, v, tile, split=3)
        check_rows(o, lse, q, k, v)
    cupy.cuda.Device().synchronize()
    from cuflash.kernels import counters as stream_counters

    assert int(stream_counters.view(64, cupy.cuda.get_current_stream().ptr).max()) == 0


def test_key_split_plan_runs(rng):
    # The automatic plan through the public API on a grid under one wave (d=128, N=2k, 4 heads:
    # 64 query tiles on 132 SMs, halves of 8 key tiles), where the dispatch's own tile would be
    # the persistent one: the split runs the table's tile instead.
    import cuflash

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if sms < 128:
        pytest.skip(f"the case is sized for 128+ SMs, this GPU has {sms}")
    q, k, v = device_inputs(rng, (1, 4, 2048, 128), (1, 4, 2048, 128), BFLOAT16)
    p = _problem.validate_forward(q, k, v)
    assert plan_hopper.auto_split(p, sms) == (tma_tile(128), 2)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    check_rows(o, lse, q, k, v, rng=rng)


# Per key tile, the scaled (base 2) score level of its keys: the d=256 kernel keeps a row's running
# max while a tile's max exceeds it by at most 2^8 (OnlineSoftmax STALE). For rows with q = 1 * e0
# the levels walk: 7.5 above the first tile's max (kept: probabilities up to 2^7.5), 8.5 (moves),
# +3.5 (kept), down to 3 (kept), +8.5 (moves); rows with q = 0.5 * e0 see half of each and keep
# their first max until 8.5 (tile 5). The last tile is ragged.
STALE_LEVELS = (0.0, 7.5, 8.5, 12.0, 3.0, 17.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), pytest.param("bottom_right", id="br")])
def test_stale_max_thresholds(rng, dtype, causal):
    d = 256
    tile = tma_tile(d)
    nk = tile.block_n * (len(STALE_LEVELS) - 1) + 37
    nq = 150 if causal is False else nk + 40  # bottom_right with nq > nk: the first 40 rows see no key
    scale = 1.0 / np.sqrt(d)
    level = np.array([STALE_LEVELS[j // tile.block_n] for j in range(nk)])
    raw_level = level / (scale * np.log2(np.e))  # q . k that gives each level for q = e0
    k = np.zeros((1, 2, nk, d), np.float32)
    k[..., 0] = raw_level - rng.uniform(0.0, 2.0, size=(2, nk))  # keys within a tile a little apart
    k[..., 1:] = 0.05 * rng.standard_normal((2, nk, d - 1))
    q = np.zeros((1, 2, nq, d), np.float32)
    q[..., 0] = np.where(np.arange(nq) % 2 == 0, 1.0, 0.5)
    q[..., 1:] = 0.05 * rng.standard_normal((2, nq, d - 1))
    v = rng.standard_normal((1, 2, nk, d)).astype(np.float32)
    q, k, v = (to_device(a.astype(dtype)) for a in (q, k, v))
    o, lse = forward_tma(q, k, v, tile, causal=causal)
    check_rows(o, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key(rng, dtype):
    # top_left with nq > nk: rows past nk see all keys; bottom_right with nq > nk: the first
    # nq - nk rows see none (o = 0, lse = -inf), which check_rows' reference holds them to.
    run_and_check(rng, dtype, (1,), 2, 2, 300, 100, 128, causal="bottom_right")


def test_long_sequence_windows(rng):
    run_and_check(rng, BFLOAT16, (1,), 2, 2, 4099, 4099, 128, causal="bottom_right")


def test_unaligned_rows_raise(rng):
    # A view whose rows are not 16-byte aligned cannot be a tensor map: ValueError, no launch.
    q, k, v = device_inputs(rng, (1, 2, 64, 129), (1, 2, 64, 129), BFLOAT16)
    q, k, v = (a[..., 1:] for a in (q, k, v))
    p = _problem.validate_forward(q, k, v)
    o = poisoned(p.q_shape(), p.dtype)
    lse = poisoned(p.lse_shape(), FLOAT32)
    with pytest.raises(ValueError, match="tile"):
        cuda.forward_wgmma(p, to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk),
                           to_bhsd(o, p, p.hq, p.nq), lse.reshape((p.batch, p.hq, p.nq)), tile=tma_tile(128))
    assert bool(cupy.isnan(lse.astype(np.float32)).all()), "nothing may be launched"
