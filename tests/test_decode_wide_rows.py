"""Wide-rows decode blocks (schedule.DECODE_TILES_WIDE_ROWS, attn_decode RING 3): one K/V head with
many query heads, each warp a row tile over every key of the block ring's steps. Opt-in (tile=)
until measured.

CPU: how a wide-rows tile plans (row blocks, row tiles, no cluster, no key-tile shrink).
GPU: the kernel against the float64 reference per sequence - kv_lens 0, 1, mid-split and full,
outputs poisoned; one split and several merged by the last split and by the combine kernel; idle
warps (3 row tiles), several tokens per head under causality and a window, a paged cache, fp16.
"""
import types

import numpy as np
import pytest
from _kvlens_check import check_per_sequence
from _launches import record_launches


from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import random_inputs
from cuflash.kernels import decode as decode_kernels
from cuflash.kernels import device
from cuflash.plan import decode as plan_decode

H200_SMS = 132


def _problem(batch, hq, hkv, nq, nk, d, causal=None, dtype=BFLOAT16):
    return types.SimpleNamespace(dtype=np.dtype(dtype), d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv,
                                 batch=batch, causal=causal)


# ---- CPU: planning a wide-rows tile ----

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq, nq, rt", [(64, 1, 4), (48, 1, 3), (16, 3, 3), (32, 2, 4), (128, 1, 4)])
def test_wide_rows_plan(d, hq, nq, rt):
    # All of a K/V head's packed rows in one block up to 64 (Hq=128: two row blocks of 64); the
    # key tile is not shrunk for the rows (each warp holds one row tile's scores); never a cluster.
    t = schedule.DECODE_TILES_WIDE_ROWS[d]
    p = _problem(4, hq, 1, nq, 8192, d)
    lp = plan_decode.launch_plan(p, H200_SMS, tile=t)
    assert lp.row_tiles == rt and lp.tile == t and not lp.cluster
    assert plan_decode.launch_problem(p, H200_SMS, t).hkv == (2 if hq * nq > 64 else 1)
    spec = plan_decode.launch_spec(p.dtype, d, False, lp)
    assert spec.expression.startswith(f"attn_decode<Bf16, {d}, {rt}, {t.block_n}, 4, {t.stages},")
    assert spec.expression.endswith(f", {t.ring}>")
    assert spec in plan_decode.all_decode_specs()
    for splits in (1, 4):
        assert not plan_decode.launch_plan(p, H200_SMS, splits=splits, tile=t).cluster
    with pytest.raises(ValueError, match="wide-rows"):
        plan_decode.launch_plan(p, H200_SMS, tile=t, cluster=True)


def test_wide_rows_tiles_fit_their_kernel():
    # a row tile per warp, and the rings hold the block's float32 O at the end (the kernel's asserts)
    for hd, t in [*schedule.DECODE_TILES_WIDE_ROWS.items(), *schedule.DECODE_TILES_WIDE_ROWS_LONG.items()]:
        assert t.ring in (3, 4) and t.max_row_tiles <= t.warps
        assert 16 * t.max_row_tiles * hd * 4 <= t.warps * 2 * t.stages * t.block_n * hd * 2


# ---- GPU ----

def _launch(monkeypatch):
    from cuflash.api import plan_cache

    monkeypatch.setattr(plan_cache, "enabled", False)
    return record_launches(monkeypatch, decode_kernels)


def _poisoned(shape, dtype):
    import cupy

    a = cupy.empty(shape, dtype=dtype)
    a.view(np.uint16).fill({np.dtype(FLOAT16): 0x7E00, np.dtype(BFLOAT16): 0x7FC0}[np.dtype(dtype)])
    return a


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["one", "last", "kernel"])
@pytest.mark.parametrize("case", ["mqa64-d128", "mqa64-d64", "mqa48-idle-warp", "gqa16x3-br", "mqa32x2-window",
                                  "mqa64-paged", "mqa128-fp16", "ring4-mqa64", "ring4-mqa64-paged", "ring4-gqa16x4-br",
                                  "ring4-mqa32x2-window-fp16", "ring4-mqa48-idle-warp", "mqa64-qview", "ring4-mqa64-qview",
                                  "mqa128-qview-fp16"])
def test_wide_rows_decode(rng, monkeypatch, case, merge):
    # ring4-*: schedule.DECODE_TILES_WIDE_ROWS_LONG's tile (FA2's copies: one K and one V buffer);
    # *-qview: q a view whose base is 2 bytes past 16-byte alignment and whose rows are d + 3 elements
    # apart, so that Q's 8-column pieces take both the vector and the element loads (decode_q_piece)
    import cupy

    from cuflash.core.layout import to_bhsd
    from cuflash.core.problem import validate_forward, validate_paged

    hq, nq, d = {"mqa64-d128": (64, 1, 128), "mqa64-d64": (64, 1, 64), "mqa48-idle-warp": (48, 1, 128),
                 "gqa16x3-br": (16, 3, 128), "mqa32x2-window": (32, 2, 64), "mqa64-paged": (64, 1, 128),
                 "mqa128-fp16": (128, 1, 64), "ring4-mqa64": (64, 1, 128), "ring4-mqa64-paged": (64, 1, 128),
                 "ring4-gqa16x4-br": (16, 4, 128), "ring4-mqa32x2-window-fp16": (32, 2, 128),
                 "ring4-mqa48-idle-warp": (48, 1, 128), "mqa64-qview": (64, 1, 128), "ring4-mqa64-qview": (64, 1, 128),
                 "mqa128-qview-fp16": (128, 1, 64)}[case]
    dtype = FLOAT16 if case.endswith("fp16") else BFLOAT16
    causal = "bottom_right" if case.endswith("-br") or "window" in case else False
    window = (300, 0) if "window" in case else None
    nk, splits = 1500, (1 if merge == "one" else 4)
    chunk = -(-nk // max(splits, 2))
    lens = np.array([0, 1, int(rng.integers(2, chunk)), int(rng.integers(chunk, nk)), nk], dtype=np.int32)
    q, k, v = random_inputs(rng, (len(lens), hq, nq, d), (len(lens), 1, nk, d), dtype)
    o4 = _poisoned((len(lens), hq, nq, d), dtype)
    lse3 = cupy.full((len(lens), hq, nq), np.nan, dtype=np.float32)
    lg = cupy.asarray(lens)
    t = (schedule.DECODE_TILES_WIDE_ROWS_LONG if case.startswith("ring4") else schedule.DECODE_TILES_WIDE_ROWS)[d]
    kw = dict(kv_lens=lg, splits=splits, tile=t, cluster=False, merge=None if merge == "one" else merge)
    launched = _launch(monkeypatch)
    if case.endswith("paged"):
        from test_paged import paged_cache

        kc, vc, table = paged_cache(rng, k, v, lens, 64)
        qg, kcg, vcg, tg = (cupy.asarray(a) for a in (q, kc, vc, table))
        p, block = validate_paged(qg, kcg, vcg, tg)
        decode_kernels.forward(p, to_bhsd(qg, p, hq, nq), kcg, vcg, o4, lse3, paged=(tg, block), **kw)
    else:
        qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
        if "qview" in case:
            wide = cupy.full(q.shape[:-1] + (d + 3,), np.nan, dtype=dtype)
            wide[..., 1:d + 1] = qg
            qg = wide[..., 1:d + 1]
            assert qg.data.ptr % 16 == 2 and qg.strides[-2] == (d + 3) * qg.itemsize
        p = validate_forward(qg, kg, vg, causal=causal, window=window)
        decode_kernels.forward(p, qg, kg, vg, o4, lse3, **kw)
    rt = -(-min(hq * nq, 64) // 16)
    assert launched and launched[0].startswith(f"attn_decode<{'Fp16' if dtype == FLOAT16 else 'Bf16'}, {d}, {rt},")
    assert launched[0].endswith(f", {t.ring}>"), launched
    if merge == "kernel":
        assert launched[-1].startswith("attn_decode_combine<"), launched
    else:
        assert len(launched) == 1, launched
    check_per_sequence(o4, lse3, q, k, v, lens, causal, dtype, window=window)


def test_wide_rows_planner_rule(monkeypatch):
    # The planner's own launch takes the wide-rows tile for more than 32 packed rows per K/V head
    # at d = 64 / 128 unless its splits are short (_short_blocks) and it would launch few blocks or the
    # table's splits merge in a cluster; a caller's tile, splits or waves, or cluster=True, stand;
    # CUFLASH_DECODE_WIDE_ROWS=0 (WIDE_ROWS_AUTO) turns it off.
    wide = schedule.DECODE_TILES_WIDE_ROWS
    for b, hq, nq, nk, d, rt in [(8, 64, 1, 32768, 128, 4), (32, 64, 1, 16384, 128, 4), (8, 64, 1, 16384, 64, 4),
                                 (128, 64, 1, 2048, 64, 4), (64, 48, 1, 16384, 64, 3), (64, 128, 1, 16384, 64, 4)]:
        lp = plan_decode.launch_plan(_problem(b, hq, 1, nq, nk, d), H200_SMS)
        assert plan_decode.wide_rows(lp.tile) and lp.row_tiles == rt and not lp.cluster, (b, hq, nk, d, lp)
    p = _problem(8, 64, 1, 1, 16384, 128)
    assert plan_decode.launch_problem(p, tile=wide[128]).hkv == 1  # (one row block of 64 rows per head)
    for q in [_problem(1, 64, 1, 1, 16384, 128), _problem(1, 64, 1, 1, 8192, 128),  # short splits, few blocks
              _problem(2, 64, 1, 1, 16384, 64),
              _problem(16, 48, 1, 1, 4096, 64),  # short splits, the table's merge in a cluster
              _problem(8, 32, 1, 1, 16384, 128),  # 32 rows: two row tiles
              _problem(8, 64, 1, 1, 16384, 256)]:  # no d=256 wide tile
        assert plan_decode.launch_plan(q, H200_SMS).tile.ring < 3, q
    # short splits, but the wide tile's own launch has WIDE_SHORT_MIN_WAVES blocks per SM
    for b, hq, nq, nk, d in [(2, 48, 1, 32768, 128), (4, 64, 1, 16384, 128), (4, 128, 1, 8192, 128),
                             (1, 128, 1, 32768, 64), (1, 32, 16, 8192, 128), (1, 64, 1, 32768, 128),
                             (2, 64, 1, 16384, 128), (5, 32, 16, 1024, 128)]:
        q = _problem(b, hq, hq // 4 if nq == 16 else 1, nq, nk, d)
        assert plan_decode._short_blocks(plan_decode.launch_problem(q, tile=wide[d]), H200_SMS), q
        lp = plan_decode.launch_plan(q, H200_SMS)
        blocks = lp.splits * plan_decode.launch_problem(q, H200_SMS).hkv * b
        assert lp.tile == wide[d] and blocks >= plan_decode.WIDE_SHORT_MIN_WAVES[d] * H200_SMS, (q, lp)
    # four row tiles with splits of WIDE_LONG_MIN_CHUNK keys or more: ring 4 (WIDE_LONG_AUTO, on by
    # default; off, ring 3), the same split count
    long = schedule.DECODE_TILES_WIDE_ROWS_LONG[128]
    monkeypatch.setattr(plan_decode, "WIDE_LONG_AUTO", False)
    assert plan_decode.launch_plan(_problem(8, 64, 1, 1, 32768, 128), H200_SMS).tile == wide[128]
    monkeypatch.setattr(plan_decode, "WIDE_LONG_AUTO", True)
    for b, hq, nq, nk, d, want in [(8, 64, 1, 32768, 128, long), (64, 64, 1, 16384, 128, long),
                                   (16, 128, 1, 8192, 128, long), (8, 32, 16, 4096, 128, long),
                                   (16, 48, 1, 8192, 128, wide[128]),  # (three row tiles)
                                   (1, 64, 1, 131072, 128, wide[128]), (4, 64, 1, 16384, 128, wide[128]),  # (short)
                                   (16, 64, 1, 16384, 64, wide[64])]:  # (no d=64 ring-4 tile)
        q = _problem(b, hq, hq // 4 if nq == 16 else 1, nq, nk, d)
        lp = plan_decode.launch_plan(q, H200_SMS)
        three = plan_decode.launch_plan(q, H200_SMS, tile=wide[d])
        assert lp.tile == want and lp.splits in (three.splits, three.splits - 1), (q, lp, three)
        assert (lp.tile == long) == (lp.row_tiles == 4 and three.chunk >= schedule.WIDE_LONG_MIN_CHUNK and d == 128)
        assert plan_decode.launch_spec(q.dtype, d, False, lp) in plan_decode.all_decode_specs()
    monkeypatch.setattr(plan_decode, "WIDE_LONG_AUTO", False)
    table = schedule.DECODE_TILES[128]
    assert plan_decode.launch_plan(p, H200_SMS, tile=table).tile.ring == 0
    for kw in (dict(splits=8), dict(waves=1), dict(cluster=True)):
        assert plan_decode.launch_plan(p, H200_SMS, **kw).tile.ring < 3, kw
    assert plan_decode.launch_plan(p, H200_SMS, cluster=False).tile == wide[128]  # (merges through memory anyway)
    # the launch problem carries the choice: planned again, the same launch
    lpp = plan_decode.launch_problem(p, H200_SMS)
    assert lpp.hkv == 1 and plan_decode.launch_plan(lpp, H200_SMS) == plan_decode.launch_plan(p, H200_SMS)
    assert plan_decode.launch_problem(p, H200_SMS, cluster=True).hkv == 2  # (two blocks of two row tiles)
    # cluster=True launches those row blocks too (the accounting reads launch_problem)
    forced = plan_decode.launch_plan(p, H200_SMS, cluster=True)
    assert forced.cluster and forced.tile.ring < 3 and forced.row_tiles == 2
    d64 = _problem(8, 32, 1, 4, 16384, 64)  # (128 packed rows: four row blocks of two row tiles)
    assert plan_decode.launch_plan(d64, H200_SMS, cluster=True).row_tiles == 128 // 16 // (
        plan_decode.launch_problem(d64, H200_SMS, cluster=True).hkv)
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", False)
    assert plan_decode.launch_plan(p, H200_SMS).tile.ring < 3


@pytest.mark.parametrize("long_auto", [False, True])
def test_decode_launch_plans_as_launch_plan(monkeypatch, long_auto):
    # What decode_launch launches is launch_plan's plan (which the accounting reads), for the
    # planner's own launch and a caller's: fefb761 launched ring 3 where launch_plan said ring 4.
    from cuflash.core.problem import validate_forward

    monkeypatch.setattr(device, "sm_count", lambda dev: H200_SMS)
    monkeypatch.setattr(device, "compute_capability", lambda dev: 90)
    monkeypatch.setattr(plan_decode, "WIDE_LONG_AUTO", long_auto)
    strides = ((1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), 0)
    for b, hq, hkv, nq, nk, d in [(8, 64, 1, 1, 32768, 128), (64, 64, 1, 1, 16384, 128), (2, 48, 1, 1, 32768, 128),
                                  (8, 32, 8, 16, 4096, 128), (8, 32, 8, 1, 16384, 128), (1, 64, 1, 1, 32768, 128),
                                  (16, 64, 1, 1, 16384, 64)]:
        p = validate_forward(np.empty((b, hq, nq, d), BFLOAT16), *(np.empty((b, hkv, nk, d), BFLOAT16) for _ in "kv"))
        for kw in ({}, {"splits": 8}, {"tile": schedule.DECODE_TILES_WIDE_ROWS[d]}):
            launch = decode_kernels.decode_launch(p, 0, strides, **kw)
            assert launch.plan == plan_decode.launch_plan(p, H200_SMS, **kw), (p, kw)
        if long_auto and (b, hq, nk) in ((8, 64, 32768), (64, 64, 16384)):
            assert decode_kernels.decode_launch(p, 0, strides).plan.tile.ring == 4
