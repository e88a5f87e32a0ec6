"""The Hopper wgmma forward as a tuned op ("fwd_wgmma"), on the CPU.

Shared-memory, register and occupancy figures are worked out by hand from the recorded H200
limits (232448 B opt-in per block, 233472 B per SM with 1 KiB reserved per block; 65536
registers per SM in four sub-partitions, allocated per warp in units of 256). A few NVRTC
compiles for sm_90a (skipped without cuda.bindings) check that what the tuner compiles is what
hopper launches, and that the compile report, not the estimate, decides spills.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _targets import FAKE, SM80, SM90, on_target

import cuflash
from cuflash.cli import tune as cli_tune
from cuflash.kernels import hopper as hopper_kernels
from cuflash.kernels import operands
from cuflash.kernels import build
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.core.problem import Problem
from cuflash.plan.device_limits import H200, occupancy
from cuflash.plan.schedule import HopperTile
from cuflash.autotune import search
from cuflash.plan.tuning import Candidate, CompileInfo, TuneCache, TuneCacheWarning, bucket_key, candidates, hopper_forward_violations, legal_candidates, register_cap, shortlist, table_tile, violations
from cuflash import autotune
from cuflash.backends import cuda
from cuflash.plan import hopper as plan_hopper
from cuflash.plan import tuning

# The stand-in tuner, the NVRTC skip, and the fixtures (isolated_cache is autouse here too: pytest
# collects fixtures from the module's namespace).
from test_tune import FakeTuner, _nvrtc_or_skip, cupy_or_stand_in, fake_gpu, isolated_cache  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def hop(bn, wg, st, hd=128):
    return Candidate("fwd_wgmma", hd, HopperTile(bn, wg, st, "test"))


# --------------------------------------------------------------------------- the space, legality


def test_space_buckets_and_names():
    assert tuning.op_buckets("fwd_wgmma") == tuple(schedule.HOPPER_FORWARD_TILES) == (64, 128, 192, 256)
    cands = candidates("fwd_wgmma", 64)
    assert len(cands) == 8 * 3 * 4
    assert len({c.name for c in cands}) == len(cands)
    table = [c for c in cands if tuning.same_tile("fwd_wgmma", c.tile, schedule.HOPPER_FORWARD_TILES[64])]
    assert [c.name for c in table] == ["192x128wg3s2"]
    # The TMA table tile: 3 math warpgroups and the producer warpgroup; 192 query rows x 128 keys.
    assert table[0].threads == 512 and table[0].area == 192 * 128
    with pytest.raises(ValueError, match="bucket"):
        candidates("fwd_wgmma", 32)  # hopper never launches the wgmma kernel there


def test_wrappers_match_the_generator():
    # The legality check reads the generated header; it must list what tools/gen_wgmma.py writes.
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_wgmma
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert tuning.wgmma_shapes() == tuple(sorted(gen_wgmma.SHAPES))
    assert set(tuning.WGMMA_SPACE["block_n"]) <= set(tuning.wgmma_shapes())
    # the e4m3 forward's key tiles and head dims each have a WgmmaE4m3<N>
    assert set(plan_hopper.FP8_KEY_TILES) | set(schedule.FP8_HEAD_DIMS) <= set(gen_wgmma.E4M3_SHAPES)


def test_table_tiles_are_legal():
    for hd, t in schedule.HOPPER_FORWARD_TILES.items():
        assert violations(Candidate("fwd_wgmma", hd, t), H200) == []
        assert any(tuning.same_tile("fwd_wgmma", c.tile, t) for c in legal_candidates("fwd_wgmma", hd, H200))


def test_shared_memory_by_hand():
    # (64 x warpgroups + 2 x stages x block_n) rows x d x 2 B + 1024 B of alignment slack.
    assert hop(128, 2, 3).smem_bytes == (128 + 768) * 128 * 2 + 1024 == 230400  # the d=128 cp.async tile: fits
    assert hop(128, 3, 3, 64).smem_bytes == (192 + 768) * 64 * 2 + 1024 == 123904
    assert hop(96, 1, 5, 128).smem_bytes == (64 + 960) * 256 + 1024 == 263168  # > 232448: illegal
    assert violations(hop(96, 1, 5, 128), H200) and not violations(hop(96, 1, 4, 128), H200)  # 214016
    assert hop(64, 3, 5).smem_bytes == (192 + 640) * 256 + 1024 == 214016


def test_d256_table_tile():
    # d=256: one table tile for causal and full attention (64 keys, per-warpgroup epilogue), and
    # the dispatch runs it for both.
    t = schedule.HOPPER_FORWARD_TILES[256]
    assert t.block_n == 64 and t.wg_epilogue and t.tma and not t.pingpong
    assert plan_hopper.default_tile(256, "bottom_right", 4096, 4096) is t
    assert plan_hopper.default_tile(256, None, 4096, 4096) is t
    assert plan_hopper.forward_spec(BFLOAT16, 256, True)[0].expression == "attn_fwd_wgmma_tma<Bf16, 256, 64, 2, 2, true, false, true>"
    assert plan_hopper.forward_spec(BFLOAT16, 256, False)[0].expression == "attn_fwd_wgmma_tma<Bf16, 256, 64, 2, 2, false, false, true>"
    assert all(plan_hopper.forward_spec(BFLOAT16, 256, c)[0] in plan_hopper.all_hopper_forward_specs() for c in (False, True))
    assert hopper_forward_violations(256, t) == []
    assert any("epilogue" in v for v in hopper_forward_violations(256, replace(t, pingpong=True)))


@pytest.mark.parametrize("tiles,slots,key_tiles,want", [
    (64, 132, 64, 2),  # halves of 64 tiles fit one round (1/2); thirds need 2 rounds (2/3)
    (43, 132, 64, 3),  # d=64 one head of N=8k: thirds in one round (1/3); sixths 2 rounds of 1/6 (1/3): the smaller wins
    (20, 132, 64, 6),  # sixths in one round
    (20, 132, 16, 2),  # 16 key tiles: at most 2 pieces of 8
    (128, 132, 64, None),  # 128 of 132: no split does better than a whole tile
    (132, 132, 64, None),  # a whole wave: not split
    (2048, 132, 32, None),  # longer grids are not split (their last partial wave: see schedule)
    (20, 132, 15, None),  # pieces would be shorter than 8 key tiles
    (0, 132, 64, None),
])
def test_key_split_plan(tiles, slots, key_tiles, want):
    # schedule.key_splits: k pieces of each of the tiles take ceil(k tiles / slots) / k tile times;
    # worked out by hand per case.
    assert schedule.key_splits(tiles, slots, key_tiles) == want


def test_key_split_applies_to_full_attention_on_per_tile_tiles():
    # Only grids of fewer query tiles than SMs split: B=1, H=1, N=8k at d=128 is 64 tiles of 64
    # key tiles (halves: one round); the benchmark's B=4, H=16, N=4k (2048 tiles) does not.
    t = schedule.HOPPER_FORWARD_TILES[128]
    small = Problem(np, "bhsd", (1,), 1, 1, 8192, 8192, 128, np.dtype(BFLOAT16), None, 1.0)
    assert plan_hopper.split_plan(small, t, 132) == 2
    assert plan_hopper.split_plan(replace(small, nq=4096, nk=4096, batch_shape=(4,), hq=16, hkv=16), t, 132) is None
    assert plan_hopper.split_plan(replace(small, causal="bottom_right"), t, 132) is None
    # N=2k: the dispatch's tile is the persistent one; the split takes the table's instead
    short = replace(small, nq=2048, nk=2048, hq=4, hkv=4)
    assert plan_hopper.default_tile(128, None, 2048, 2048).persistent
    assert plan_hopper.auto_split(short, 132) == (t, 2)
    assert plan_hopper.split_plan(small, schedule.HOPPER_FORWARD_PERSISTENT[128][0].tile, 132) is None
    assert plan_hopper.split_plan(replace(small, d=256), schedule.HOPPER_FORWARD_TILES[256], 132) is None  # spills
    spec = plan_hopper.split_spec(BFLOAT16, 128)[0]
    assert spec.expression == "attn_fwd_wgmma_tma_split<Bf16, 128, 128, 2, 2, false, false>"
    assert spec in plan_hopper.all_hopper_forward_specs()


# d=128 (the TMA kernel: its 8 x (1 + 4 s) bytes of mbarriers too): 64 x wg + 2 x s x bn <=
# (232448 - 1024 - 8 - 32 s) / 256 = 903 rows (904 before; no tile sits exactly there), worked
# out per block_n by hand: 2 stages: up to 176 keys any wg, 192 keys wg <= 2; 3 stages and more:
# 64 and 80 keys every (wg, s) but 80 keys s=5 (wg 1 only); 96 keys: s=3 any wg, s=4 wg <= 2;
# 128 keys: s=3, wg <= 2; 160+: none.
LEGAL_D128 = sorted(
    [f"{64 * wg}x{bn}wg{wg}s2" for wg in (1, 2, 3) for bn in (64, 80, 96, 128, 160, 176)]
    + ["64x192wg1s2", "128x192wg2s2"]
    + [f"{64 * wg}x{bn}wg{wg}s{s}" for wg in (1, 2, 3) for s in (3, 4, 5) for bn in (64, 80) if (bn, s) != (80, 5)]
    + ["64x80wg1s5"]
    + [f"{64 * wg}x96wg{wg}s3" for wg in (1, 2, 3)] + ["64x96wg1s4", "128x96wg2s4"]
    + ["64x128wg1s3", "128x128wg2s3"])


def test_legal_set_at_d128_by_hand():
    assert sorted(c.name for c in legal_candidates("fwd_wgmma", 128, H200)) == LEGAL_D128


@pytest.mark.parametrize("cand,why", [
    (hop(128, 2, 4), "shared memory 295936"),  # (128 + 1024) * 256 + 1024
    (hop(128, 2, 1), "stages < 2"),
    (hop(112, 2, 3), "no wgmma wrapper m64n112k16"),  # a multiple of 16, but not generated
    (hop(72, 1, 3), "not a multiple of 16"),
    (Candidate("fwd_wgmma", 32, HopperTile(64, 1, 3, "t")), "multiple of 64 columns"),
    (hop(256, 3, 3, 64), None),  # 222208 B: legal statically (the compile then finds it spills)
])
def test_violations_with_reason(cand, why):
    v = violations(cand, H200)
    if why is None:
        assert v == []
    else:
        assert any(why in x for x in v), v


def test_thread_limit_applies():
    small = replace(H200, max_threads_per_block=256)
    assert any("384 threads > 256" in x for x in violations(hop(64, 3, 3), small))
    assert violations(hop(64, 2, 3), small) == []


# --------------------------------------------------------------------------- registers and occupancy


def test_register_cap_of_launch_bounds():
    # __launch_bounds__(128 x wg, 1): 65536 / threads, in whole units of 8, at most 255.
    assert register_cap(H200, 128) == 255  # 512 -> 255
    assert register_cap(H200, 256) == 255  # 256 -> 255
    assert register_cap(H200, 384) == 168  # 170.67 -> 170 -> 168


def test_estimate_orders_spills_like_ptxas():
    # S (block_n/2) + O (d/2) + P (block_n/4) + 40; measured with NVRTC 13 for sm_90a: 192x128wg3
    # at d=64 compiles to 167 registers (cap 168), 192x160wg3 and 192x96wg3 at d=128 spill.
    assert tuning.estimated_registers(hop(128, 3, 3, 64)) == 64 + 32 + 32 + 40 == 168
    assert not tuning.likely_spills(hop(128, 3, 3, 64), H200)
    assert tuning.likely_spills(hop(160, 3, 3, 64), H200)
    assert tuning.likely_spills(hop(96, 3, 3, 128), H200)
    assert tuning.likely_spills(hop(256, 1, 3, 64), H200)  # 264 > 255
    assert not tuning.likely_spills(hop(128, 1, 3, 128), H200)


@pytest.mark.parametrize("cand,regs,blocks,warps,limiter", [
    # 167 x 32 = 5344 -> 5376 per warp; 16384 // 5376 = 3 warps per partition -> 12 warps = 1 block
    # of 12; shared memory 123904 + 1024 -> 1 block too (tie: registers named first).
    (hop(128, 3, 3, 64), 167, 1, 12, "registers"),
    # 236 x 32 = 7552 -> 7680; 2 warps per partition -> 8 warps = 1 block of 8.
    (hop(128, 2, 3, 128), 236, 1, 8, "registers"),
    # 138 x 32 = 4416 -> 4608; 3 per partition -> 12 warps = 3 blocks of 4; but 91136 + 1024 B
    # per block leaves room for 2.
    (hop(64, 1, 5, 64), 138, 2, 8, "shared memory"),
    # 136 x 32 = 4352 (exactly 17 units) -> 3 per partition -> 3 blocks; 58368 + 1024 -> 3 blocks.
    (hop(64, 1, 3, 64), 136, 3, 12, "registers"),
])
def test_occupancy_by_hand(cand, regs, blocks, warps, limiter):
    occ = occupancy(H200, cand.threads, regs, cand.smem_bytes)
    assert (occ.blocks_per_sm, occ.warps_per_sm, occ.limiter) == (blocks, warps, limiter)


def test_logical_bytes_follow_block_m():
    # Non-causal: every query tile reads all of K and V; 64-row tiles (1 warpgroup) read them
    # twice as often as 128-row ones: 2 (K, V) x B*H x N*d x 2 B x (N/64 - N/128) more.
    shape = (1, 2, 1024, 128)
    one, two = (autotune.logical_bytes(hop(64, wg, 3), shape) for wg in (1, 2))
    assert one - two == 2 * 2 * 1024 * 128 * 2 * 8
    assert two == cuflash.io_model(shape, schedule.TileConfig(128, 64, 4, 2, "t"), pass_="fwd").bytes


# --------------------------------------------------------------------------- compiles (NVRTC, no GPU)


def _launched_spec(op, dtype, hd, causal):
    """What hopper launches with the table's tile passed as the tile (the backward K/V kernel:
    atomic dQ, the TMA kernel; without a tile the default may be the warp-specialized one, which
    the tuner does not time: pick_hopper_backward_tile then returns None)."""
    if op == "fwd_wgmma":
        return plan_hopper.forward_spec(dtype, hd, causal, schedule.HOPPER_FORWARD_TILES[hd])[0]
    return plan_hopper.backward_kv_spec(dtype, hd, causal, False, tile=schedule.HOPPER_BACKWARD_TILES[hd])[0]


@pytest.mark.parametrize("op,hd", [("fwd_wgmma", hd) for hd in sorted(schedule.HOPPER_FORWARD_TILES)]
                         + [("bwd_wgmma", hd) for hd in sorted(schedule.HOPPER_BACKWARD_TILES)])
@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT16], ids=["bf16", "fp16"])
def test_table_tiles_compile_clean_for_sm90a(op, hd, dtype):
    _nvrtc_or_skip()
    cand = Candidate(op, hd, table_tile(op, hd))
    for causal in (False, True):
        spec = tuning.spec_for(cand, dtype, causal)
        assert spec == _launched_spec(op, dtype, hd, causal)  # the tuner compiles what runs
        assert spec.source == tuning.OP_SOURCE[op] and spec.threads == cand.threads
        info = autotune.compile_offline_info(spec, "sm_90a", TuneCache())
        assert info.error is None and info.clean, info
        assert 0 < info.registers <= register_cap(H200, cand.threads)


def test_compile_report_decides_spills():
    _nvrtc_or_skip()
    # A statically legal tile whose 64 x 256 S, O and P do not fit 255 registers: the search sees
    # "spills" from the compiler, and a new block_n (96, a generated wrapper) compiles cleanly.
    spilled = hop(256, 2, 3, 64)
    assert violations(spilled, H200) == []
    ev = autotune.evaluate_static(spilled, H200, lambda c: autotune.compile_offline_info(
        tuning.spec_for(c, BFLOAT16, False), "sm_90a"))
    assert ev.status == "spills" and ev.compile.spill_bytes > 0
    clean = autotune.compile_offline_info(tuning.spec_for(hop(96, 2, 4, 128), BFLOAT16, True), "sm_90a")
    assert clean.clean and clean.registers <= 255


# --------------------------------------------------------------------------- the cache


def _result(hd=128, winner_name=None, op="fwd_wgmma"):
    cands = shortlist(candidates(op, hd), 4, H200, table_tile(op, hd))
    winner_name = winner_name or cands[1].name
    return search(cands, H200, compile_fn=lambda c: CompileInfo(128, 0, 0, "fake"), check_fn=lambda c: None,
                  time_fn=lambda c: 1e-3 if c.name == winner_name else 2e-3, table=table_tile(op, hd))


def check_cache_round_trip(op, res, tile_cls, source, mma_sync_op, mma_sync_source):
    """A Hopper op's winner at d=128 survives the cache file, keyed by its own kernel source; the
    mma.sync kernel's entry for the same bucket stays separate."""
    key = bucket_key(op, "FakeGPU", BFLOAT16, 128, True, 4096, 4096)
    assert key.source_hash == build.source_hash(source) != build.source_hash(mma_sync_source)
    assert source in str(key) and f"|{op}|" in str(key)
    assert not tuning.same_tile(op, res.best_tile, table_tile(op, 128))  # a winner that is not the table's
    TuneCache().put(key, res, shape=(2, 16, 16, 4096, 4096, 128))
    tuning.clear_memo()
    found, tile = TuneCache().winner(key)
    assert found and isinstance(tile, tile_cls)
    assert tuning.same_tile(op, tile, res.best_tile) and "autotuned on FakeGPU" in tile.reason
    assert TuneCache().winner(bucket_key(mma_sync_op, "FakeGPU", BFLOAT16, 128, True, 4096, 4096)) == (False, None)


def test_cache_round_trip(isolated_cache):
    check_cache_round_trip("fwd_wgmma", _result(), HopperTile, "attn_fwd_wgmma.cu", "fwd", "attn_fwd.cu")


# Fields the kernels' static_asserts refuse: one stage; 128 queries per step on one warpgroup.
@pytest.mark.parametrize("op,bad", [("fwd_wgmma", {"stages": 1}), ("bwd_wgmma", {"block_m": 128, "warpgroups": 1})])
def test_cache_rejects_an_illegal_hopper_tile(isolated_cache, op, bad):
    import json

    key = bucket_key(op, "FakeGPU", BFLOAT16, 64, False, 1024, 1024)
    TuneCache().put(key, _result(64, op=op))
    data = json.loads(isolated_cache.read_text())
    data["entries"][str(key)]["winner"]["tile"].update(bad)
    isolated_cache.write_text(json.dumps(data))
    with pytest.warns(TuneCacheWarning, match="corrupt"):
        assert TuneCache().winner(key) == (False, None)


def test_wgmma_source_change_leaves_other_entries(isolated_cache, monkeypatch):
    TuneCache().put(bucket_key("fwd_wgmma", "FakeGPU", BFLOAT16, 128, False, 4096, 4096), _result())
    fwd_key = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)
    fwd_res = search(shortlist(candidates("fwd", 128), 2, H200, table_tile("fwd", 128)), H200,
                     compile_fn=lambda c: CompileInfo(128, 0, 0, "fake"), check_fn=lambda c: None,
                     time_fn=lambda c: 1e-3)
    TuneCache().put(fwd_key, fwd_res)
    real = tuning.source_hash
    monkeypatch.setattr(tuning, "source_hash", lambda op: "0" * 16 if op == "fwd_wgmma" else real(op))
    with pytest.warns(TuneCacheWarning, match="1 stale"):
        cache = TuneCache()
        assert cache.winner(bucket_key("fwd_wgmma", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)) == (False, None)
    assert cache.winner(fwd_key)[0]


# --------------------------------------------------------------------------- the planner hook


def _problem(d=128, n=4096, dtype=BFLOAT16):
    return Problem(np, "bhsd", (2,), 16, 16, n, n, d, np.dtype(dtype), "bottom_right", 1 / math.sqrt(d))


@pytest.mark.parametrize("env", [None, "0"])
@pytest.mark.parametrize("op,pick", [("fwd_wgmma", "pick_hopper_forward_tile"), ("bwd_wgmma", "pick_hopper_backward_tile")])
def test_pick_is_none_when_tuning_is_off(fake_gpu, isolated_cache, monkeypatch, env, op, pick):
    if env is not None:
        monkeypatch.setenv("CUFLASH_TUNE", env)
    TuneCache().put(bucket_key(op, "FakeGPU", BFLOAT16, 128, True, 4096, 4096), _result(op=op))
    tuning.clear_memo()
    assert getattr(tuning, pick)(_problem(), FAKE) is None  # even with a cached winner
    assert fake_gpu.made == []


def test_pick_tunes_then_reads_the_cache(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    cands = shortlist(candidates("fwd_wgmma", 64), tuning.DEFAULT_MAX_CANDIDATES, H200, table_tile("fwd_wgmma", 64))
    fake_gpu.fastest, fake_gpu.wrong = cands[2].name, {cands[1].name}
    tile = tuning.pick_hopper_forward_tile(_problem(d=64), FAKE)
    assert isinstance(tile, HopperTile) and Candidate("fwd_wgmma", 64, tile).name == cands[2].name
    assert fake_gpu.made == [("fwd_wgmma", 64)]
    # The fastest is wrong: never picked.
    fake_gpu.fastest, fake_gpu.wrong = cands[3].name, {cands[3].name}
    tile128 = tuning.pick_hopper_forward_tile(_problem(d=128), FAKE)
    assert tile128 is not None and Candidate("fwd_wgmma", 128, tile128).name != cands[3].name
    tuning.clear_memo()
    monkeypatch.setenv("CUFLASH_TUNE", "cached")
    assert tuning.pick_hopper_forward_tile(_problem(d=64), FAKE) == tile
    assert tuning.pick_hopper_forward_tile(_problem(d=64, n=16384), FAKE) is None  # other N bucket, not tuned
    assert len(fake_gpu.made) == 2
    # The mma.sync forward's pick is separate: nothing cached for it.
    assert tuning.pick_forward_tile(_problem(d=64), FAKE) is None


def test_pick_outside_the_hopper_buckets(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    assert tuning.pick_hopper_forward_tile(_problem(d=32), FAKE) is None
    assert tuning.pick_hopper_forward_tile(_problem(d=100), FAKE) is None  # d % 8: scalar loads
    assert fake_gpu.made == []


def test_gpu_tuner_refuses_what_the_kernel_cannot_run():
    p = _problem(d=128)
    with pytest.raises(ValueError, match="sm_90"):
        autotune.GpuTuner("fwd_wgmma", p, limits=replace(H200, name="A100", cc=80), cupy=object())
    with pytest.raises(ValueError, match="bucket"):
        autotune.GpuTuner("fwd_wgmma", _problem(d=32), limits=H200, cupy=object())


# --------------------------------------------------------------------------- tune(), command line


@pytest.fixture
def fake_device(fake_gpu, monkeypatch):
    """tune() without CuPy: problems built on NumPy, a settable compute capability."""
    state = {"cc": 90}
    monkeypatch.setattr(autotune, "_problem_for_shape", lambda shape, dtype, causal, hkv=None: _problem(d=shape[-1]))
    monkeypatch.setattr(autotune, "_current_device_cc", lambda: state["cc"])
    monkeypatch.delenv("CUFLASH_KERNELS", raising=False)
    return state


def test_tune_auto_tunes_the_kernels_that_run(fake_device, fake_gpu):
    # sm_90, d=128 and d=256: both wgmma kernels; d=32: neither Hopper kernel.
    assert 128 in schedule.HOPPER_BACKWARD_TILES and 256 in schedule.HOPPER_BACKWARD_TILES
    assert 256 in schedule.HOPPER_FORWARD_TILES and 32 not in schedule.HOPPER_FORWARD_TILES
    assert 32 not in schedule.HOPPER_BACKWARD_TILES
    cuflash.tune((2, 16, 4096, 128), (2, 8, 4096, 256), (2, 16, 4096, 32), progress=False)
    assert fake_gpu.made == [("fwd_wgmma", 128), ("bwd_wgmma", 128), ("fwd_wgmma", 256), ("bwd_wgmma", 256),
                             ("fwd", 32), ("bwd", 32)]
    fake_gpu.made.clear()
    fake_device["cc"] = 80
    cuflash.tune((2, 16, 4096, 64), progress=False)
    assert fake_gpu.made == [("fwd", 64), ("bwd", 64)]


def test_tune_auto_respects_the_mma_sync_switch(fake_device, fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_KERNELS", "mma_sync")
    cuflash.tune((2, 16, 4096, 128), progress=False)
    assert fake_gpu.made == [("fwd", 128), ("bwd", 128)]


def test_tune_explicit_wgmma_is_checked_before_timing(fake_device, fake_gpu):
    fake_device["cc"] = 80
    with pytest.raises(ValueError, match="sm_90"):
        cuflash.tune((2, 16, 4096, 128), ops=("fwd_wgmma",), progress=False)
    fake_device["cc"] = 90
    with pytest.raises(ValueError, match="buckets"):
        cuflash.tune((2, 16, 4096, 64), (2, 16, 4096, 32), ops="fwd_wgmma", progress=False)
    assert fake_gpu.made == []  # nothing was tuned for the valid first shape either
    out = cuflash.tune((2, 16, 4096, 64), ops="fwd_wgmma", progress=False)
    assert fake_gpu.made == [("fwd_wgmma", 64)] and len(out) == 1
    assert "|fwd_wgmma|" in next(iter(out))


def test_tune_cli_reports_wgmma_off_hopper(fake_device, monkeypatch, capsys):
    from cuflash.cli import main as cli

    monkeypatch.setattr(cli_tune, "gpu_unavailable_reason", lambda: None)
    fake_device["cc"] = 80
    assert cli.main(["tune", "--shape", "2,16,4096,128", "--ops", "fwd_wgmma"]) == 2
    assert "sm_90" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune", "--shape", "2,16,4096,128", "--ops", "fwd_mystery"])


def test_schedules_cli_shows_both_forward_kernels_on_h200(capsys):
    from cuflash.cli.main import main

    assert main(["schedules", "--shape", "2,16,4096,128", "--no-compile", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert out.index("forward (mma.sync)") < out.index("forward, Hopper wgmma kernel")
    assert "the forward runs the wgmma kernel for this bucket" in out
    # The d=128 table tile (TMA): Q + 2 x 2 tiles of 128 keys + 9 mbarriers + 1 KiB alignment slack.
    line = next(ln for ln in out.splitlines() if ln.startswith("128x128wg2s2 "))
    assert "table" in line and f"{(128 + 512) * 256 + 72 + 1024:,}" == "164,936" and "164,936" in line
    assert " 1 " in line  # one block per SM by shared memory (no compile: registers unknown)
    assert "--ops fwd_wgmma" in out
    # Only the Hopper kernel; and a head dim it does not run for is refused.
    assert main(["schedules", "--shape", "2,16,4096,64", "--no-compile", "--device", "h200", "--wgmma"]) == 0
    out = capsys.readouterr().out
    assert "forward (mma.sync)" not in out and "128x64wg2s2" in out
    assert main(["schedules", "--shape", "2,64,4096,32", "--no-compile", "--device", "h200", "--wgmma"]) == 2
    assert "head-dim buckets (64, 128, 192, 256)" in capsys.readouterr().err
    # d=32: the wgmma kernel does not run, so the default shows the mma.sync forward only.
    assert main(["schedules", "--shape", "2,64,4096,32", "--no-compile", "--device", "h200"]) == 0
    assert "Hopper wgmma" not in capsys.readouterr().out


def test_schedule_search_skips_wgmma_off_hopper(tmp_path, monkeypatch):
    """The evidence run on a non-Hopper GPU leaves the wgmma buckets out instead of failing."""
    cupy = cupy_or_stand_in(monkeypatch)
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import schedule_search as s
    finally:
        sys.path.remove(str(ROOT / "tools"))
    monkeypatch.setattr(s.device_limits, "from_cupy", lambda: replace(H200, name="A100", cc=80))
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(autotune, "compile_device_info", lambda spec: CompileInfo(100, 0, 0, "fake"))
    monkeypatch.setattr(s, "run_shape", lambda op, d, n, b, h, causal, chosen, *a: {
        "d": d, "n": n, "b": b, "h": h, "causal": causal, "torch_flash_s": 1e-3, "candidates": {}})
    assert s.main(["--out", str(tmp_path), "--workers", "0", "--ds", "64", "--ns", "1024"]) == 0
    import json

    res = json.loads((tmp_path / "schedule_search.json").read_text())
    assert sorted(res["buckets"]) == ["bwd-d64", "fwd-d64"]
    assert any("fwd_wgmma skipped" in ln for ln in res["log"]) and any("bwd_wgmma skipped" in ln for ln in res["log"])


class _DeviceArrayStandIn:
    """What cuda.forward reads of a CuPy array before it launches: shape, strides, alignment."""

    def __init__(self, shape, itemsize=2):
        self.shape, self.itemsize = shape, itemsize
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
        self.data = type("Mem", (), {"ptr": 1 << 20})()


@pytest.mark.parametrize("env", [None, "1"])
def test_gpu_forward_passes_the_tuned_tile_to_the_wgmma_launch(monkeypatch, env):

    if env is not None:
        monkeypatch.setenv("CUFLASH_TUNE", env)
    tuned = HopperTile(96, 2, 4, "autotuned (stand-in)")
    asked, launched = [], []

    def pick(p, target, autotuner=None):  # stands in for the cache/tuner, honouring the mode like _pick does
        asked.append(p)
        return tuned if tuning.tune_mode() != "off" else None

    monkeypatch.setattr(tuning, "pick_hopper_forward_tile", pick)
    on_target(monkeypatch, SM90)
    monkeypatch.setattr(operands, "tma_ok", lambda *arrays: True)
    monkeypatch.setattr(hopper_kernels, "launch", lambda plan, p, *arrays, **kw: launched.append(plan))
    p = _problem(d=128, n=1024)
    q4, k4, v4, o4 = (_DeviceArrayStandIn((2, 16, 1024, 128)) for _ in range(4))
    cuda.forward(p, q4, k4, v4, o4, _DeviceArrayStandIn((2, 16, 1024), 4))
    assert asked == [p] and len(launched) == 1
    plan = launched[0]
    want = tuned if env == "1" else plan_hopper.default_tile(p.d, p.causal, p.nq, p.nk)
    assert plan.kernel == "wgmma" and plan.tile == want
