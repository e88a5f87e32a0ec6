"""The Hopper wgmma backward K/V kernel as a tuned op ("bwd_wgmma"), on the CPU.

Shared-memory figures are worked out by hand from HopperBwdTile.smem_bytes and the recorded H200
limits (232448 B opt-in per block); register figures quoted below are NVRTC 13 / ptxas reports for
sm_90a (bfloat16, atomic dQ, non-causal unless said). An offline compile (skipped without
cuda.bindings) checks that the compiler's report, not the estimate, decides spills; the table
tiles' sm_90a compiles are in test_tune_hopper.py, beside the forward's.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import numpy as np
import pytest
from _targets import FAKE, SM80, SM90, on_target

from cuflash.cli import tune as cli_tune
from cuflash.backends import numpy as cpu
from cuflash.kernels import operands
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16
from cuflash.core.problem import Problem
from cuflash.plan.device_limits import H200
from cuflash.plan.schedule import HopperBwdTile, TileConfig
from cuflash.plan.tuning import Candidate, candidates, legal_candidates, register_cap, shortlist, table_tile, violations
from cuflash import autotune
from cuflash.kernels import backward as backward_kernels
from cuflash.backends import cuda
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import backward as plan_backward
from cuflash.plan import hopper as plan_hopper
from cuflash.plan import tuning

from test_tune import (  # noqa: F401 - fixtures are found in the module's namespace
    _NumpyAsCupy, _nvrtc_or_skip, assert_wrong_candidate_never_wins, fake_gpu, isolated_cache,
)
from test_tune_hopper import _result as hopper_result, check_cache_round_trip



def kv(bm, wg, hd=128):
    return Candidate("bwd_wgmma", hd, HopperBwdTile(bm, wg, "test"))


def _problem(d=128, n=4096, dtype=BFLOAT16):
    return Problem(np, "bhsd", (2,), 16, 16, n, n, d, np.dtype(dtype), "bottom_right", 1 / math.sqrt(d))


# --------------------------------------------------------------------------- the space, legality


def test_space_buckets_and_names():
    assert tuning.op_buckets("bwd_wgmma") == tuple(schedule.HOPPER_BACKWARD_TILES) == (64, 128, 192, 256)
    cands = candidates("bwd_wgmma", 64)
    assert len(cands) == 3 * 3 and len({c.name for c in cands}) == 9
    assert Candidate("bwd_wgmma", 64, schedule.HOPPER_BACKWARD_TILES[64]).name == "q128k128wg2"
    assert Candidate("bwd_wgmma", 128, schedule.HOPPER_BACKWARD_TILES[128]).name == "q64k128wg2"
    # d=256: the warpgroups split the head dim, so the block owns 64 keys, not 64 per warpgroup
    assert Candidate("bwd_wgmma", 256, schedule.HOPPER_BACKWARD_TILES[256]).name == "q64k64wg2"
    assert all(c.tile.split_d for c in candidates("bwd_wgmma", 256))
    # bucket 192 runs the 256 kernel (whole 64-column blocks per warpgroup): its tile, shared
    # memory and legality are the 256 kernel's
    assert schedule.hopper_backward_head_dim(192) == 256 and schedule.hopper_backward_head_dim(128) == 128
    c192 = Candidate("bwd_wgmma", 192, schedule.HOPPER_BACKWARD_TILES[192])
    assert c192.kernel_hd == 256 and c192.name == "q64k64wg2"
    assert c192.smem_bytes == schedule.HOPPER_BACKWARD_TILES[256].smem_bytes(256)
    c = kv(192, 3, 64)
    assert (c.threads, c.area, c.stages, c.kernel_hd) == (384, 192 * 192, 0, 64)
    with pytest.raises(ValueError, match="bucket"):
        candidates("bwd_wgmma", 32)  # plan_hopper.backward_applies is false there


def test_shared_memory_by_hand():
    # (2 x block_n + 4 x block_m) rows x d x 2 B + block_n x block_m x 2 B (dS^T) + 16 B x block_m + 1 KiB.
    assert kv(64, 2).smem_bytes == (256 + 256) * 256 + 128 * 64 * 2 + 1024 + 1024 == 149504  # d=128 table
    assert kv(128, 2).smem_bytes == (256 + 512) * 256 + 128 * 128 * 2 + 2048 + 1024 == 232448  # exactly the limit
    assert kv(192, 3).smem_bytes == (384 + 768) * 256 + 192 * 192 * 2 + 3072 + 1024 == 372736  # > limit
    assert kv(192, 3, 64).smem_bytes == (384 + 768) * 128 + 192 * 192 * 2 + 3072 + 1024 == 225280  # fits at d=64


# block_m == 64 or 64 x warpgroups leaves (64, 1), (64, 2), (64, 3), (128, 2), (192, 3) of the 9;
# at d=128 (192, 3) needs 372736 B of shared memory, and (128, 2) needs the 232448 B limit plus
# the TMA kernel's 16 B of mbarriers (the candidates inherit the table's tma=True).
# d=256 (split head dim): only (64, 2): 64-query steps, 128 columns per warpgroup, dQ by columns.
LEGAL = {64: ["q128k128wg2", "q192k192wg3", "q64k128wg2", "q64k192wg3", "q64k64wg1"],
         128: ["q64k128wg2", "q64k192wg3", "q64k64wg1"],
         192: ["q64k64wg2"],  # (the 256 kernel)
         256: ["q64k64wg2"]}


@pytest.mark.parametrize("hd", [64, 128, 192, 256])
def test_legal_set_by_hand(hd):
    assert sorted(c.name for c in legal_candidates("bwd_wgmma", hd, H200)) == LEGAL[hd]
    table = schedule.HOPPER_BACKWARD_TILES[hd]
    assert violations(Candidate("bwd_wgmma", hd, table), H200) == []


@pytest.mark.parametrize("cand,why", [
    (kv(128, 1), "neither 64 nor 64 x 1"),  # 128 queries over one warpgroup's dQ tile
    (kv(192, 2), "neither 64 nor 64 x 2"),
    (kv(128, 3, 64), "neither 64 nor 64 x 3"),
    (kv(192, 3), "shared memory 372736"),
    (Candidate("bwd_wgmma", 32, HopperBwdTile(64, 1, "t")), "multiple of 64 columns"),
    (Candidate("bwd_wgmma", 64, HopperBwdTile(96, 1, "t")), "multiple of 64 query rows"),
    (Candidate("bwd_wgmma", 256, HopperBwdTile(64, 2, "t", tma=True)), "split_d False"),
    (Candidate("bwd_wgmma", 128, HopperBwdTile(64, 2, "t", tma=True, split_d=True)), "split_d True"),
    (Candidate("bwd_wgmma", 256, HopperBwdTile(64, 1, "t", tma=True, split_d=True)), "split head dim"),
    (Candidate("bwd_wgmma", 256, HopperBwdTile(64, 3, "t", tma=True, split_d=True)), "split head dim"),
])
def test_violations_with_reason(cand, why):
    v = violations(cand, H200)
    assert any(why in x for x in v), v


def test_thread_limit_applies():
    small = replace(H200, max_threads_per_block=256)
    assert any("384 threads > 256" in x for x in violations(kv(64, 3), small))
    assert violations(kv(64, 2), small) == []


@pytest.mark.parametrize("cand,cols", [
    (kv(64, 1, 64), 64),  # rows: block_m = 64 x 1
    (kv(128, 2, 64), 64),  # rows: the d=64 table
    (kv(64, 2, 64), 64),  # keys: 64 % 128 != 0, so each warpgroup adds all 64 columns over its keys
    (kv(64, 2, 128), 64),  # columns: the d=128 table, one 64-column block per warpgroup
    (kv(64, 3, 128), 128),  # keys: 128 % 192 != 0
])
def test_dq_columns_follow_the_traits(cand, cols):
    assert tuning.hopper_dq_columns(cand.hd, cand.tile) == cols


def test_estimate_orders_spills_like_ptxas():
    # dK + dV (d) + S^T, dP^T (64) + dQ columns / 4 + 40. ptxas: d=64 q64k64wg1 211 regs,
    # q64k128wg2 195, q128k128wg2 216 (cap 255): clean; q64k192wg3 and q192k192wg3 spill at the
    # 168 cap of 384 threads. d=128: q64k128wg2 251, clean; q128k128wg2 spills 120 B, q64k192wg3
    # 1832 B; q64k64wg1 is 255 non-causal and spills causal.
    assert register_cap(H200, 384) == 168
    assert tuning.estimated_registers(kv(128, 2, 64)) == 64 + 64 + 16 + 40 == 184
    assert tuning.estimated_registers(kv(64, 2, 128)) == 128 + 64 + 16 + 40 == 248
    clean = {(hd, c.name) for hd in (64, 128) for c in legal_candidates("bwd_wgmma", hd, H200)
             if not tuning.likely_spills(c, H200)}
    assert clean == {(64, "q64k64wg1"), (64, "q64k128wg2"), (64, "q128k128wg2"), (128, "q64k128wg2")}
    assert not tuning.likely_spills(kv(64, 2, 128), H200) and tuning.likely_spills(kv(128, 2, 128), H200)


def test_shortlist_starts_with_the_table_and_keeps_every_legal_tile():
    for hd in (64, 128):
        order = shortlist(candidates("bwd_wgmma", hd), None, H200, table_tile("bwd_wgmma", hd))
        assert order[0].name == Candidate("bwd_wgmma", hd, schedule.HOPPER_BACKWARD_TILES[hd]).name
        assert sorted(c.name for c in order) == LEGAL[hd]


def test_logical_bytes_are_the_backward_model():
    import cuflash

    shape = (1, 2, 1024, 128)
    c = kv(64, 2)
    want = cuflash.io_model(shape, autotune._IoTile(64, 128, 256, c.smem_bytes), pass_="bwd").bytes
    assert autotune.logical_bytes(c, shape) == want
    # Non-causal: each key block re-reads Q, dO, LSE, D: half as many key blocks, less traffic.
    assert autotune.logical_bytes(kv(64, 1), shape) > want


# --------------------------------------------------------------------------- compiles (NVRTC, no GPU)


def test_compile_report_decides_spills():
    _nvrtc_or_skip()
    # d=128, 128 queries per step: legal (exactly the shared-memory limit), but dK, dV, S^T, dP^T
    # and a 128-column dQ do not fit 255 registers.
    c = kv(128, 2, 128)
    assert violations(c, H200) == []
    ev = autotune.evaluate_static(c, H200, lambda x: autotune.compile_offline_info(
        tuning.spec_for(x, BFLOAT16, False), "sm_90a"))
    assert ev.status == "spills" and ev.compile.spill_bytes > 0


# --------------------------------------------------------------------------- the cache


def test_cache_round_trip(isolated_cache):
    res = hopper_result(op="bwd_wgmma")
    check_cache_round_trip("bwd_wgmma", res, HopperBwdTile, "attn_bwd_wgmma.cu", "bwd", "attn_bwd.cu")


def test_pick_tunes_checks_then_reads_the_cache(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    cands = shortlist(candidates("bwd_wgmma", 64), None, H200, table_tile("bwd_wgmma", 64))
    fake_gpu.fastest, fake_gpu.wrong = cands[1].name, {cands[1].name}  # the fastest is wrong: never picked
    # None: the table tile won, and its default kernel (warp-specialized per HOPPER_BACKWARD_WS) runs
    tile = tuning.pick_hopper_backward_tile(_problem(d=64), FAKE) or table_tile("bwd_wgmma", 64)
    assert isinstance(tile, HopperBwdTile) and Candidate("bwd_wgmma", 64, tile).name != cands[1].name
    assert fake_gpu.made == [("bwd_wgmma", 64)]
    # The deterministic backward runs the ATOMIC_DQ = false instantiation, which was never checked.
    assert tuning.pick_hopper_backward_tile(_problem(d=64), FAKE, deterministic=True) is None
    tuning.clear_memo()
    monkeypatch.setenv("CUFLASH_TUNE", "cached")
    assert tuning.same_tile("bwd_wgmma", tuning.pick_hopper_backward_tile(_problem(d=64), FAKE) or table_tile("bwd_wgmma", 64),
                              tile)
    assert tuning.pick_hopper_backward_tile(_problem(d=32), FAKE) is None  # no Hopper backward there
    assert tuning.pick_backward_tile(_problem(d=64), FAKE) is None  # the mma.sync op is separate
    assert fake_gpu.made == [("bwd_wgmma", 64)]


def test_gpu_tuner_refuses_what_the_kernel_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="sm_90"):
        autotune.GpuTuner("bwd_wgmma", _problem(), limits=replace(H200, name="A100", cc=80), cupy=object())
    with pytest.raises(ValueError, match="bucket"):
        autotune.GpuTuner("bwd_wgmma", _problem(d=32), limits=H200, cupy=object())
    monkeypatch.setenv("CUFLASH_KERNELS", "mma_sync")
    with pytest.raises(ValueError, match="mma_sync"):  # cuda.backward would refuse every hopper_tile
        autotune.GpuTuner("bwd_wgmma", _problem(), limits=H200, cupy=object())


def test_gpu_tuner_checks_gradients_before_timing(monkeypatch):
    """GpuTuner's check for bwd_wgmma (small ragged GQA problem against the float64 reference),
    with the CPU backend standing in for the kernel: the tile must arrive as hopper_tile, and a
    candidate whose dK is off in one element is "wrong" and never picked, however fast."""
    monkeypatch.delenv("CUFLASH_KERNELS", raising=False)
    corrupt = {"name": None}

    def fake_forward(p, q4, k4, v4, o4, lse3, *, tile=None):
        assert isinstance(tile, TileConfig)
        cpu.forward(p, q4, k4, v4, o4, lse3, block_m=tile.block_m, block_n=tile.block_n)

    def fake_backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, tile=None, hopper_tile=None):
        assert tile is None and isinstance(hopper_tile, HopperBwdTile) and not deterministic
        cpu.backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, block_m=hopper_tile.block_m,
                     block_n=hopper_tile.block_n)
        if Candidate("bwd_wgmma", 64, hopper_tile).name == corrupt["name"]:
            dk4[0, 0, 5, 2] += 0.25

    monkeypatch.setattr(cuda, "forward", fake_forward)
    monkeypatch.setattr(cuda, "backward", fake_backward)
    p = Problem(np, "bhsd", (1,), 4, 2, 300, 300, 64, np.dtype(BFLOAT16), "bottom_right", 0.125)
    tuner = autotune.GpuTuner("bwd_wgmma", p, limits=H200, seed=1, cupy=_NumpyAsCupy)
    assert_wrong_candidate_never_wins(monkeypatch, tuner, corrupt)


# --------------------------------------------------------------------------- cuda.backward


class _Arr:
    """What cuda.backward reads of a CuPy array before a launch: shape, strides, alignment,
    and slicing by batch (returned unchanged: one batch chunk)."""

    def __init__(self, shape, itemsize=2):
        self.shape, self.itemsize = shape, itemsize
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
        self.data = type("Mem", (), {"ptr": 1 << 20})()

    def __getitem__(self, key):
        return self


@pytest.fixture
def launches(monkeypatch):
    """cuda.backward with CuPy and the kernels stubbed: the (expression, grid, threads)
    of every launch, in order."""
    import types

    fake = types.ModuleType("cupy")
    fake.ascontiguousarray = lambda a: a
    fake.empty = fake.zeros = lambda shape, dtype=None: _Arr(tuple(shape), 4)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    made = []

    def get_function(spec):
        def launch(grid, block, args, shared_mem=0):
            made.append((spec.expression, grid, block[0], shared_mem))
        return launch

    monkeypatch.setattr(backward_kernels, "get_function", get_function)
    monkeypatch.delenv("CUFLASH_KERNELS", raising=False)
    on_target(monkeypatch, SM90)
    return made


def _run_backward(p, **kw):
    q = _Arr((2, 16, p.nq, p.d))
    lse = _Arr((2, 16, p.nq), 4)
    cuda.backward(p, q, q, q, q, q, lse, q, q, q, **kw)


def _kv_launch(made):
    return next(m for m in made if "attn_bwd_kv" in m[0])


def test_backward_rejects_a_hopper_tile_where_the_kernel_does_not_run(launches, monkeypatch):
    monkeypatch.setattr(plan_hopper, "backward_applies", lambda p, vec, target: False)  # e.g. not sm_90
    with pytest.raises(ValueError, match="hopper_tile"):
        _run_backward(_problem(n=1024), hopper_tile=HopperBwdTile(64, 1, "t"))
    assert launches == []  # refused before anything launched
    # And the real condition on sm_90: d=32 has no Hopper backward tile, so it never applies; 128,
    # 192 (the 256 kernel) and 256 have.
    on_target(monkeypatch, SM90)
    table = schedule.HOPPER_BACKWARD_TILES
    assert not plan_hopper._applies(_problem(d=32), True, table, SM90)
    assert all(plan_hopper._applies(_problem(d=d), True, table, SM90) for d in (128, 160, 192, 256))
    assert not plan_hopper._applies(_problem(d=256), False, table, SM90)  # rows without 16-byte alignment


@pytest.mark.parametrize("tma", [True, False])
def test_backward_at_d256_runs_the_split_head_dim_tile_or_mma_sync(launches, monkeypatch, tma):
    # d=256 on sm_90: the TMA kernel of the split-head-dim tile (64 keys per block, 256 threads),
    # and where TMA cannot run, the mma.sync kernels (that tile's cp.async variant spills).
    from cuflash.kernels import tma as tma_mod

    monkeypatch.setattr(tuning, "pick_hopper_backward_tile", lambda p, target, deterministic=False, autotuner=None: None)
    monkeypatch.setattr(plan_hopper, "backward_applies", lambda p, vec, target: vec)
    monkeypatch.setattr(operands, "tma_ok", lambda *arrays: tma)
    monkeypatch.setattr(tma_mod, "bhsd_map", lambda a, rows: ("map", rows))
    p = _problem(d=256, n=1000)
    _run_backward(p)
    expr, grid, threads, smem = _kv_launch(launches)
    if tma:
        t = schedule.HOPPER_BACKWARD_TILES[256]
        assert t.split_d and t.block_n == 64 and not t.ws
        assert expr == "attn_bwd_kv_wgmma_tma<Bf16, 256, 64, 2, true, true>"
        assert grid == (-(-1000 // 64), 16, 2) and threads == 256 and smem == t.smem_bytes(256) <= H200.smem_per_block_optin
        # dQ staged in the Q/dO tiles and added in 64 x 64 fragment-order chunks
        assert any("attn_bwd_dq_convert<Bf16, 256, true>" == m[0] for m in launches)
    else:
        assert expr.startswith("attn_bwd_kv<") and "wgmma" not in expr


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("tma", [True, False])
def test_backward_at_d192_runs_the_d256_kernel(launches, monkeypatch, tma, deterministic):
    # Head dims 129-192 on sm_90: the d=256 split-head-dim kernel (columns past d zero-filled by
    # TMA), whose atomic dQ rows are 256 floats: the accumulator and its convert are 256 wide.
    # Deterministic: that kernel without atomics and the mma.sync dQ kernel, whose rows are the
    # bucket's 192. Without TMA, the mma.sync kernels (192 wide).
    import cupy as fake

    from cuflash.kernels import tma as tma_mod

    allocated = []
    zeros = fake.zeros
    fake.zeros = fake.empty = lambda shape, dtype=None: allocated.append(tuple(shape)) or zeros(shape, dtype)
    monkeypatch.setattr(tuning, "pick_hopper_backward_tile", lambda p, target, deterministic=False, autotuner=None: None)
    monkeypatch.setattr(plan_hopper, "backward_applies", lambda p, vec, target: vec)
    monkeypatch.setattr(operands, "tma_ok", lambda *arrays: tma)
    monkeypatch.setattr(tma_mod, "bhsd_map", lambda a, rows: ("map", rows))
    p = _problem(d=160, n=1000)
    _run_backward(p, deterministic=deterministic)
    expr, grid, threads, smem = _kv_launch(launches)
    names = [m[0] for m in launches]
    if tma:
        assert expr == f"attn_bwd_kv_wgmma_tma<Bf16, 256, 64, 2, true, {'false' if deterministic else 'true'}>"
        assert grid == (-(-1000 // 64), 16, 2) and threads == 256
        assert smem == schedule.HOPPER_BACKWARD_TILES[192].smem_bytes(256) <= H200.smem_per_block_optin
    else:
        assert expr.startswith("attn_bwd_kv<Bf16, 192,") and "wgmma" not in expr
    staged = tma and not deterministic  # dQ staged in the Q/dO tiles: 64 x 64 fragment-order chunks, 256 wide
    if staged:
        assert (2, 16 * 1024 * 256) in allocated  # each head's 1000 rows padded to 1024
        assert "attn_bwd_dq_convert<Bf16, 256, true>" in names
        assert plan_backward.workspace_bytes(p, True, True) == (2 * 16 * 1024 * 256 + 2 * 16 * 1000) * 4
    else:
        assert (2, 16, 1000, 192) in allocated
        assert "attn_bwd_dq_convert<Bf16, 192>" in names
        assert plan_backward.workspace_bytes(p, False, False) == (2 * 16 * 1000 * 192 + 2 * 16 * 1000) * 4
    assert any(n.startswith("attn_bwd_dq<Bf16, 192,") for n in names) == deterministic


@pytest.mark.parametrize("env", [None, "1"])
def test_backward_launches_the_hopper_tile(launches, monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("CUFLASH_TUNE", env)
    tuned = HopperBwdTile(64, 1, "autotuned (stand-in)")
    asked = []

    def pick(p, target, deterministic=False, autotuner=None):  # stands in for the cache/tuner, honouring the mode like _pick does
        asked.append(deterministic)
        return tuned if tuning.tune_mode() != "off" else None

    monkeypatch.setattr(tuning, "pick_hopper_backward_tile", pick)
    monkeypatch.setattr(plan_hopper, "backward_applies", lambda p, vec, target: vec)
    # The stand-in arrays cannot be encoded as tensor maps: the table's tile runs with cp.async loads.
    monkeypatch.setattr(operands, "tma_ok", lambda *arrays: False)
    p = _problem(d=128, n=1024)
    # No tile: the table's (CUFLASH_TUNE unset) or the pick's.
    _run_backward(p)
    expr, grid, threads, smem = _kv_launch(launches)
    want = tuned if env == "1" else replace(schedule.HOPPER_BACKWARD_TILES[128], tma=False)
    assert expr == plan_hopper.backward_kv_spec(BFLOAT16, 128, True, False, want)[0].expression
    assert grid[0] == -(-1024 // want.block_n) and threads == want.threads and smem == want.smem_bytes(128)
    assert asked == [False]
    # An explicit hopper_tile wins over the pick (which is not asked).
    launches.clear()
    explicit = HopperBwdTile(64, 3, "search")
    _run_backward(p, hopper_tile=explicit, deterministic=True)
    expr, grid, threads, _ = _kv_launch(launches)
    assert expr == plan_hopper.backward_kv_spec(BFLOAT16, 128, True, True, explicit)[0].expression
    assert grid[0] == -(-1024 // 192) and threads == 384 and asked == [False]
    assert any("attn_bwd_dq<" in m[0] for m in launches)  # deterministic: the mma.sync dQ kernel too


# --------------------------------------------------------------------------- tune(), command line


def test_tune_cli_refuses_bwd_wgmma_off_hopper(fake_gpu, monkeypatch, capsys):
    from cuflash.cli import main as cli

    monkeypatch.setattr(cli_tune, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(autotune, "_problem_for_shape", lambda shape, dtype, causal, hkv=None: _problem(d=shape[-1]))
    monkeypatch.setattr(autotune, "_current_device_cc", lambda: 80)
    assert cli.main(["tune", "--shape", "2,16,4096,128", "--ops", "bwd_wgmma"]) == 2
    assert "bwd_wgmma needs an sm_90" in capsys.readouterr().err
    monkeypatch.setattr(autotune, "_current_device_cc", lambda: 90)
    assert cli.main(["tune", "--shape", "2,8,4096,32", "--ops", "bwd_wgmma"]) == 2
    assert "head-dim buckets (64, 128, 192, 256)" in capsys.readouterr().err
    assert fake_gpu.made == []
    assert cli.main(["tune", "--shape", "2,16,4096,64", "--ops", "bwd_wgmma"]) == 0
    assert fake_gpu.made == [("bwd_wgmma", 64)] and "|bwd_wgmma|" in capsys.readouterr().out


def test_schedules_cli_shows_the_hopper_backward_on_h200(capsys):
    from cuflash.cli.main import main

    args = ["--no-compile", "--device", "h200"]
    assert main(["schedules", "--shape", "2,16,4096,128", "--bwd", *args]) == 0
    out = capsys.readouterr().out
    assert out.index("backward main kernel") < out.index("backward K/V kernel, Hopper wgmma")
    assert "K/V kernel for this bucket is the wgmma one (bwd_wgmma, table below)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("q64k128wg2 "))
    assert "table" in line and "149,520" in line  # the TMA kernel: 149,504 + two mbarriers
    assert "--ops bwd_wgmma" in out
    # Only the Hopper kernel: at d=64 its table tile.
    assert main(["schedules", "--shape", "2,32,4096,64", "--bwd", "--wgmma", *args]) == 0
    out = capsys.readouterr().out
    assert "backward main kernel" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("q128k128wg2 "))
    assert "table" in line and "134,160" in line  # the TMA kernel: 134,144 + two mbarriers
    # d=192: the 256 kernel's tile and shared memory; d=32 has none.
    assert main(["schedules", "--shape", "2,8,4096,192", "--bwd", "--wgmma", *args]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("q64k64wg2 "))
    assert "table" in line and f"{schedule.HOPPER_BACKWARD_TILES[256].smem_bytes(256):,}" in line
    assert main(["schedules", "--shape", "2,8,4096,32", "--bwd", "--wgmma", *args]) == 2
    assert "backward K/V kernel runs on sm_90 for head-dim buckets (64, 128, 192, 256)" in capsys.readouterr().err
    assert main(["schedules", "--shape", "2,8,4096,32", "--bwd", *args]) == 0
    assert "Hopper wgmma" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["schedules", "--shape", "2,8,4096,128", "--dq", "--wgmma", *args])


def test_a_pick_of_the_table_tile_leaves_the_default_kernel(monkeypatch):
    # The tuner times the TMA kernel; when its winner is the table's tile, the default (on the H200
    # warp-specialized for d=128) must run, not the TMA kernel the tuner timed.
    monkeypatch.setattr(tuning, "_pick", lambda op, p, target, base=None, **kw: replace(table_tile(op, 128), reason="tuned"))
    assert tuning.pick_hopper_backward_tile(_problem(d=128), SM90) is None
    other = HopperBwdTile(64, 1, "tuned")
    monkeypatch.setattr(tuning, "_pick", lambda op, p, target, base=None, **kw: other)
    assert tuning.pick_hopper_backward_tile(_problem(d=128), SM90) is other
