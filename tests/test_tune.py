"""Tile schedule search on the CPU: legality, occupancy arithmetic, the cache, the planner hook.

Occupancy figures are worked out by hand below from the recorded H200 limits (65536 registers
per SM in four sub-partitions, allocated per warp in units of 256; 233472 B of shared memory per
SM, 1 KiB reserved per block). The tuner's selection runs with injected compile/check/timer
functions, so "never picks a failed or wrong candidate" is tested without a GPU. A few NVRTC
compiles (skipped without cuda.bindings) confirm that the Python mirror of the kernels'
static_asserts rejects what the compiler rejects.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
import warnings
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _targets import FAKE, SM80, SM90, on_target

import cuflash
from cuflash.cli import tune as cli_tune
from cuflash.kernels import build
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.problem import Problem
from cuflash.plan.device_limits import H200, from_attributes, occupancy
from cuflash.plan.schedule import TileConfig
from cuflash.autotune import evaluate_static, logical_bytes, search
from cuflash.plan.tuning import OPS, Candidate, CompileInfo, TuneCache, TuneCacheWarning, bucket_key, candidates, legal_candidates, pow2_bucket, shortlist, table_tile, violations
from cuflash import autotune
from cuflash.backends import cuda
from cuflash.plan import tuning

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory, tuning off, and a forgetful process memo."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUFLASH_TUNE", raising=False)
    tuning.clear_memo()
    yield tmp_path / "cache" / "tune.json"
    tuning.clear_memo()


def fwd(bm, bn, w, st, hd=128):
    return Candidate("fwd", hd, TileConfig(bm, bn, w, st, "test"))


def bwd(bm, bn, w, wd, hd=128):
    return Candidate("bwd", hd, replace(schedule.BACKWARD_TILES[hd], block_m=bm, block_n=bn, warps=w, warps_d=wd))


def dq(bm, bn, w, split, hd=128):
    return Candidate("bwd_dq", hd, replace(schedule.BACKWARD_TILES[hd], dq_block_m=bm, dq_block_n=bn, dq_warps=w,
                                           dq_split=split))


# --------------------------------------------------------------------------- device limits, occupancy


def test_tune_export_is_the_function_and_module_stays_importable():
    assert callable(cuflash.tune) and cuflash.tune is autotune.tune
    assert "tune" in cuflash.__all__
    assert tuning.pick_forward_tile is not None


def test_limits_from_cupy_attribute_names():
    attrs = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448,
             "MaxSharedMemoryPerMultiprocessor": 233472, "MaxRegistersPerMultiprocessor": 65536,
             "MaxRegistersPerBlock": 65536, "MaxThreadsPerMultiProcessor": 2048, "MaxBlocksPerMultiprocessor": 32,
             "L2CacheSize": 62914560, "MaxThreadsPerBlock": 1024, "ReservedSharedMemoryPerBlock": 1024,
             "ClockRate": 1980000}
    assert from_attributes("NVIDIA H200", 90, attrs) == H200
    del attrs["L2CacheSize"]
    with pytest.raises(ValueError, match="l2_bytes"):
        from_attributes("x", 90, attrs)


def test_recorded_h200_matches_device_facts():
    # The recorded limits are the values measured on the lent machine.
    facts = Path("/work/shared/reference/device-facts.md")
    if not facts.exists():
        pytest.skip("device-facts.md not present")
    text = facts.read_text()
    for value in (H200.sm_count, H200.smem_per_block_optin, H200.smem_per_sm, H200.regs_per_sm,
                  H200.max_threads_per_sm, H200.l2_bytes):
        assert str(value) in text
    assert H200.arch == "sm_90a"


@pytest.mark.parametrize("threads,regs,smem,blocks,warps,limiter", [
    # 255 regs x 32 lanes = 8160 -> 8192 per warp; 16384 per sub-partition -> 2 warps each -> 8 warps.
    (128, 255, 0, 2, 8, "registers"),
    # 196608 + 1024 reserved = 197632 B per block; 233472 // 197632 = 1.
    (128, 64, 192 * 1024, 1, 4, "shared memory"),
    # 98304 + 1024 = 99328; 233472 // 99328 = 2.
    (128, 64, 96 * 1024, 2, 8, "shared memory"),
    # 128 x 32 = 4096 per warp -> 4 warps per partition -> 16 warps = 2 blocks of 8 warps.
    (256, 128, 0, 2, 16, "registers"),
    # 33 x 32 = 1056 -> 1280 (granularity) -> 12 warps per partition -> 48 warps = 12 blocks
    # (without the granularity it would be 65536 // (33 * 128) = 15).
    (128, 33, 0, 12, 48, "registers"),
    # One warp of 32 regs: 64 blocks by registers and by threads, but at most 32 blocks per SM.
    (32, 32, 0, 32, 32, "blocks"),
    # 8 warps of 64 regs (2048 per warp): 8 warps per partition -> 32 warps = 4 blocks; threads
    # allow 2048 / 256 = 8.
    (256, 64, 0, 4, 32, "registers"),
    # The whole opt-in shared memory: 232448 + 1024 = 233472 -> exactly one block.
    (128, 64, 232448, 1, 4, "shared memory"),
])
def test_occupancy_hand_computed(threads, regs, smem, blocks, warps, limiter):
    occ = occupancy(H200, threads, regs, smem)
    assert (occ.blocks_per_sm, occ.warps_per_sm, occ.limiter) == (blocks, warps, limiter)
    assert occ.fraction == warps / 64


def test_occupancy_zero_when_a_block_cannot_launch():
    assert occupancy(H200, 1024, 255, 0).blocks_per_sm == 0  # 8192 x 32 warps > 65536 per block
    assert occupancy(H200, 128, 64, 232449).blocks_per_sm == 0  # one byte over the opt-in limit
    assert occupancy(H200, 2048, 16, 0).blocks_per_sm == 0  # over 1024 threads per block


# --------------------------------------------------------------------------- legality


def test_table_tiles_are_legal_candidates():
    for op in OPS:
        for hd in tuning.op_buckets(op):
            legal = legal_candidates(op, hd, H200)
            table = table_tile(op, hd)
            assert any(tuning.same_tile(op, c.tile, table) for c in legal), (op, hd)


@pytest.mark.parametrize("cand,why", [
    (fwd(64, 64, 8, 2, 64), "rows per warp 64/8"),  # 8 rows per warp
    (fwd(256, 32, 8, 2, 32), "split evenly"),  # 32 keys x 4 chunks = 128 loads over 256 threads
    (fwd(128, 128, 8, 2, 256), "shared memory 327680"),  # (128 + 2*2*128) * 256 * 2 B
    (bwd(128, 32, 4, 1), "dQ tiles"),  # 8 query row tiles for 4 warps
    (bwd(32, 64, 8, 4, 32), "columns per warp 32/4"),  # 8 dK/dV columns per warp
    (dq(64, 16, 4, 4, 32), "pairs of 8-column"),  # 4 chunks / 4 = 1 tile per split
    (dq(64, 16, 8, 1, 64), "rows per warp 64/8"),
])
def test_illegal_candidates_with_reason(cand, why):
    v = violations(cand, H200)
    assert v and any(why in x for x in v), v


def test_legal_candidates_satisfy_mirrored_asserts():
    for op in OPS:
        for hd in tuning.op_buckets(op):
            for c in legal_candidates(op, hd, H200):
                assert c.smem_bytes <= H200.smem_per_block_optin
                assert c.threads <= H200.max_threads_per_block
                t = c.tile
                if op == "fwd":
                    assert (t.block_m // t.warps) % 16 == 0 and t.block_m % t.warps == 0
                elif op == "bwd":
                    assert (t.block_n // (t.warps // t.warps_d)) % 16 == 0
                    assert t.warps % (t.block_m // 16) == 0
                elif op == "fwd_wgmma":  # HopperFwdTraits, Sw128Tile, and the generated wrappers
                    assert t.stages >= 2 and t.block_n % 16 == 0 and hd % 64 == 0
                    assert t.block_n in tuning.wgmma_shapes() and hd in tuning.wgmma_shapes()
                elif op == "bwd_wgmma":  # HopperBwdTraits
                    assert hd % 64 == 0 and t.block_m in (64, 64 * t.warpgroups) and hd in tuning.wgmma_shapes()
                else:
                    assert (t.dq_block_m // t.dq_warps) % 16 == 0


def _nvrtc_or_skip():
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("CUFLASH_REQUIRE_NVRTC") == "1":
            pytest.fail(f"NVRTC required but unusable: {exc!r}")
        pytest.skip(f"cuda.bindings NVRTC not usable: {exc!r}")


@pytest.mark.parametrize("cand", [
    fwd(64, 64, 8, 2, 64),  # rows per warp
    bwd(128, 32, 4, 1, 64),  # dQ tiles vs warps
    dq(64, 16, 4, 4, 32),  # dQ column slices
], ids=lambda c: f"{c.op}-{c.name}-d{c.hd}")
def test_compiler_rejects_what_the_mirror_rejects(cand):
    _nvrtc_or_skip()
    assert violations(cand, H200)
    with pytest.raises(build.CompileError):
        build.compile_offline(tuning.spec_for(cand, BFLOAT16, False))


def test_compile_report_is_cached_across_processes(isolated_cache, monkeypatch):
    _nvrtc_or_skip()
    cand = fwd(64, 32, 4, 2, 32)  # a small legal kernel: fast to compile
    assert not violations(cand, H200)
    spec = tuning.spec_for(cand, BFLOAT16, False)
    info = autotune.compile_offline_info(spec, "sm_90a", TuneCache())
    assert info.error is None and info.registers and 0 < info.registers <= 255
    tuning.clear_memo()

    def no_compile(*a, **k):
        raise AssertionError("should have come from the cache file")

    monkeypatch.setattr(build, "compile_offline", no_compile)
    again = autotune.compile_offline_info(spec, "sm_90a", TuneCache())
    assert again == info


# --------------------------------------------------------------------------- selection


def _fake_compile(table):
    def compile_fn(c):
        info = table.get(c.name, CompileInfo(128, 0, 0, "fake"))
        if isinstance(info, Exception):
            raise info
        return info
    return compile_fn


def test_search_never_picks_a_failed_or_wrong_candidate():
    names = ["128x64w4s2", "64x64w4s2", "128x32w8s2", "64x32w4s2", "128x64w8s2", "128x32w4s2", "64x128w4s2",
             "128x64w4s3"]
    cands = [c for n in names for c in candidates("fwd", 128) if c.name == n]
    assert [c.name for c in cands] == names
    compile_table = {
        "64x64w4s2": CompileInfo(None, 0, 0, "fake", "error: static assertion failed"),
        "128x32w8s2": CompileInfo(255, 64, 16, "fake"),  # spills
        "64x32w4s2": RuntimeError("NVRTC crashed"),
    }
    wrong = {"128x64w4s2", "128x64w4s3"}  # fastest of all, but wrong
    times = {"128x64w4s2": 0.5, "128x64w4s3": 0.6, "64x64w4s2": 0.1, "128x32w8s2": 0.1, "64x32w4s2": 0.1,
             "128x64w8s2": 2.0, "128x32w4s2": float("nan"), "64x128w4s2": 1.5}
    checked, timed = [], []

    def check_fn(c):
        checked.append(c.name)
        if c.name == "128x64w4s3":
            return False
        if c.name in wrong:
            raise AssertionError("o: max error 1.0 > bound 0.01")

    def time_fn(c):
        timed.append(c.name)
        return times[c.name]

    res = search(cands, H200, compile_fn=_fake_compile(compile_table), check_fn=check_fn, time_fn=time_fn,
                 table=schedule.FORWARD_TILES[128])
    status = {e.candidate.name: e.status for e in res.evaluations}
    assert status == {"128x64w4s2": "wrong", "64x64w4s2": "compile failed", "128x32w8s2": "spills",
                      "64x32w4s2": "compile failed", "128x64w8s2": "ok", "128x32w4s2": "timing failed",
                      "64x128w4s2": "ok", "128x64w4s3": "wrong"}
    assert res.winner.candidate.name == "64x128w4s2"
    # Nothing that failed to compile or spilled was run; nothing wrong was timed.
    assert set(checked) == {"128x64w4s2", "128x64w8s2", "128x32w4s2", "64x128w4s2", "128x64w4s3"}
    assert not set(timed) & wrong
    assert res.table.candidate.name == "128x64w4s2"


def test_search_with_no_passing_candidate_has_no_winner():
    cands = candidates("fwd", 64)[:5]

    def check_fn(c):
        raise AssertionError("wrong")

    res = search(cands, H200, compile_fn=_fake_compile({}), check_fn=check_fn, time_fn=lambda c: 1.0)
    assert res.winner is None and res.best_tile is None


def test_evaluate_static_marks_illegal_and_oversubscribed():
    ev = evaluate_static(fwd(64, 64, 8, 2, 64), H200, _fake_compile({}))
    assert ev.status == "illegal" and ev.compile is None  # never compiled
    # 1024 threads x 255 registers cannot launch although the static checks pass.
    big = Candidate("fwd", 32, TileConfig(256, 128, 8, 2, "t"))
    ev = evaluate_static(big, H200, _fake_compile({big.name: CompileInfo(255, 0, 0, "fake")}))
    assert ev.status == "legal" and ev.occupancy.blocks_per_sm == 1


def test_shortlist_starts_with_table_spans_shapes_and_is_legal():
    for op in OPS:
        for hd in tuning.op_buckets(op):
            cands = candidates(op, hd)
            sl = shortlist(cands, 6, H200, table_tile(op, hd))
            assert 1 <= len(sl) <= 6
            assert tuning.same_tile(op, sl[0].tile, table_tile(op, hd))
            assert all(not violations(c, H200) for c in sl)
            assert len({c.name for c in sl}) == len(sl)
            full = shortlist(cands, None, H200, table_tile(op, hd))
            assert len(full) == len(legal_candidates(op, hd, H200))  # nothing legal is lost


# --------------------------------------------------------------------------- logical traffic


def test_logical_bytes_follow_the_tile():
    # Non-causal forward: every query tile reads all of K and V, so going from 128-row to 64-row
    # tiles adds 2 (K, V) * B*H * N*d * 2 B * (N/64 - N/128) = 2*2*1024*64*2*8 bytes.
    shape = (1, 2, 1024, 64)
    b64 = logical_bytes(fwd(64, 64, 4, 2, 64), shape)
    b128 = logical_bytes(fwd(128, 64, 4, 2, 64), shape)
    assert b64 - b128 == 2 * 2 * 1024 * 64 * 2 * 8
    assert b128 == cuflash.io_model(shape, TileConfig(128, 64, 4, 2, "t"), pass_="fwd").bytes
    # Backward: Q and dO are reread once per K/V tile, so fewer keys per block means more traffic.
    assert logical_bytes(bwd(32, 64, 4, 1, 64), shape) > logical_bytes(bwd(32, 128, 8, 1, 64), shape)
    # Deterministic dQ kernel: splitting the columns over 2 blocks reads its inputs twice.
    one, two = logical_bytes(dq(64, 32, 4, 1, 64), shape), logical_bytes(dq(64, 32, 4, 2, 64), shape)
    acc_write = 1 * 2 * 1024 * 64 * 4
    assert two - acc_write == 2 * (one - acc_write)


# --------------------------------------------------------------------------- keys and the cache


def test_pow2_buckets_and_keys():
    assert [pow2_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025, 16384)] == [1, 2, 4, 1024, 1024, 2048, 16384]
    k1 = bucket_key("fwd", "GPU", BFLOAT16, 100, True, 3000, 3000)
    k2 = bucket_key("fwd", "GPU", BFLOAT16, 128, True, 4096, 4096)
    assert k1 == k2 and k1.hd == 128 and k1.nq == 4096
    assert bucket_key("fwd", "GPU", BFLOAT16, 128, True, 5000, 5000) != k2
    assert bucket_key("fwd", "GPU", FLOAT16, 128, True, 4096, 4096) != k2
    assert bucket_key("fwd", "Other GPU", BFLOAT16, 128, True, 4096, 4096) != k2
    assert bucket_key("bwd", "GPU", BFLOAT16, 128, True, 4096, 4096).source_hash == build.source_hash("attn_bwd.cu")
    assert k2.version == cuflash.__version__ and k2.source_hash == build.source_hash("attn_fwd.cu")


def test_cache_path_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "a"))
    assert tuning.cache_path() == tmp_path / "a" / "tune.json"
    monkeypatch.delenv("CUFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_path() == tmp_path / "xdg" / "cuflash" / "tune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_path() == tmp_path / "home" / ".cache" / "cuflash" / "tune.json"


def _result(op="fwd", hd=128, winner_name=None):
    cands = shortlist(candidates(op, hd), 4, H200, table_tile(op, hd))
    winner_name = winner_name or cands[1].name
    return search(cands, H200, compile_fn=_fake_compile({}), check_fn=lambda c: None,
                  time_fn=lambda c: 1e-3 if c.name == winner_name else 2e-3, table=table_tile(op, hd))


def test_cache_round_trip(isolated_cache):
    key = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)
    res = _result()
    TuneCache().put(key, res, shape=(4, 16, 16, 4096, 4096, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found, tile = TuneCache().winner(key)
    assert found and tuning.same_tile("fwd", tile, res.best_tile)
    assert "autotuned on FakeGPU" in tile.reason
    entry = TuneCache().get(key)
    assert entry["version"] == cuflash.__version__ and entry["source_hash"] == build.source_hash("attn_fwd.cu")
    assert len(entry["candidates"]) == len(res.evaluations)
    assert TuneCache().winner(bucket_key("fwd", "FakeGPU", BFLOAT16, 128, True, 4096, 4096)) == (False, None)


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2, 3]", '{"format": "something else", "entries": {}}',
                                     '{"format": "cuflash-tune-1", "entries": []}'])
def test_corrupt_cache_warns_and_is_rebuilt(isolated_cache, garbage):
    isolated_cache.parent.mkdir(parents=True)
    isolated_cache.write_text(garbage)
    key = bucket_key("fwd", "FakeGPU", BFLOAT16, 64, True, 1024, 1024)
    cache = TuneCache()
    with pytest.warns(TuneCacheWarning, match="corrupt"):
        assert cache.winner(key) == (False, None)
    cache.put(key, _result("fwd", 64))
    data = json.loads(isolated_cache.read_text())  # rebuilt: valid JSON again
    assert data["format"] == "cuflash-tune-1" and str(key) in data["entries"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuneCache().winner(key)[0]


def test_corrupt_entry_is_dropped_others_kept(isolated_cache):
    good = bucket_key("fwd", "FakeGPU", BFLOAT16, 64, False, 1024, 1024)
    bad = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, False, 1024, 1024)
    cache = TuneCache()
    cache.put(good, _result("fwd", 64))
    cache.put(bad, _result("fwd", 128))
    data = json.loads(isolated_cache.read_text())
    data["entries"][str(bad)]["winner"]["tile"]["block_m"] = "lots"
    isolated_cache.write_text(json.dumps(data))
    fresh = TuneCache()
    with pytest.warns(TuneCacheWarning, match="1 corrupt"):
        assert fresh.winner(bad) == (False, None)
    assert fresh.winner(good)[0]
    # An illegal tile smuggled into the cache is not trusted either.
    data["entries"][str(bad)]["winner"]["tile"].update(block_m=64, warps=8)  # 8 rows per warp
    isolated_cache.write_text(json.dumps(data))
    with pytest.warns(TuneCacheWarning, match="corrupt"):
        assert TuneCache().winner(bad) == (False, None)


@pytest.mark.parametrize("what", ["version", "source"])
def test_version_or_source_change_invalidates(isolated_cache, monkeypatch, what):
    old = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)
    other = bucket_key("bwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)
    TuneCache().put(old, _result())
    TuneCache().put(other, _result("bwd", 128))
    if what == "version":
        monkeypatch.setattr(tuning, "_version", lambda: "999.0")
    else:
        real = tuning.source_hash
        monkeypatch.setattr(tuning, "source_hash", lambda op: "0123456789abcdef" if op == "fwd" else real(op))
    new = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)
    assert new != old
    cache = TuneCache()
    with pytest.warns(TuneCacheWarning, match="stale"):
        assert cache.winner(new) == (False, None)
    cache.put(new, _result())
    kept = json.loads(isolated_cache.read_text())["entries"]
    assert str(old) not in kept and str(new) in kept  # the stale entry is gone after the rebuild
    # A source edit of the forward kernel leaves the backward's entries alone.
    assert (str(bucket_key("bwd", "FakeGPU", BFLOAT16, 128, False, 4096, 4096)) in kept) == (what == "source")


# --------------------------------------------------------------------------- the planner hook


def _problem(dtype=BFLOAT16, d=128, n=4096, causal="bottom_right", hq=16, hkv=16):
    return Problem(np, "bhsd", (2,), hq, hkv, n, n, d, np.dtype(dtype), causal, 1 / math.sqrt(d))


class FakeTuner:
    """Stands in for GpuTuner: a search over real candidates with fake compile/check/time."""

    made = []
    fastest = None  # the candidate name to make fastest
    wrong = set()
    limits = H200  # what tune() records beside the winner

    def __init__(self, op, p, base=None):
        self.op, self.p, self.base = op, p, base
        self.shape = (p.batch, p.hq, p.hkv, p.nq, p.nk, p.d)
        FakeTuner.made.append((op, p.d))

    def run(self, max_candidates=None, progress=None):
        hd = schedule.head_dim_bucket(self.p.d)
        cands = shortlist(candidates(self.op, hd, self.base if self.op == "bwd_dq" else None), max_candidates, H200,
                          table_tile(self.op, hd))

        def check_fn(c):
            if c.name in FakeTuner.wrong:
                raise AssertionError("wrong")

        return search(cands, H200, compile_fn=_fake_compile({}), check_fn=check_fn,
                      time_fn=lambda c: 1e-3 if c.name == FakeTuner.fastest else 5e-3, table=table_tile(self.op, hd))


@pytest.fixture
def fake_gpu(monkeypatch):
    on_target(monkeypatch, FAKE)
    monkeypatch.setattr(tuning, "_autotuner", FakeTuner)  # first-use autotuning (registered by cuflash.autotune)
    monkeypatch.setattr(autotune, "GpuTuner", FakeTuner)  # cuflash.tune() ahead of time
    monkeypatch.setattr(tuning, "_stream_is_capturing", lambda: False)
    FakeTuner.made, FakeTuner.fastest, FakeTuner.wrong = [], None, set()
    return FakeTuner


@pytest.mark.parametrize("env", [None, "0"])
def test_tune_off_uses_the_table_and_touches_nothing(fake_gpu, isolated_cache, monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("CUFLASH_TUNE", env)
    # Even a cached winner is ignored when tuning is off.
    key = bucket_key("fwd", "FakeGPU", BFLOAT16, 128, True, 4096, 4096)
    TuneCache().put(key, _result())
    before = isolated_cache.read_text()
    assert tuning.pick_forward_tile(_problem(), FAKE) is None
    assert tuning.pick_backward_tile(_problem(), FAKE, deterministic=True) is None
    assert fake_gpu.made == [] and isolated_cache.read_text() == before


def test_autotune_on_first_use_then_cache(fake_gpu, isolated_cache, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    p = _problem(d=104)  # bucket 128
    cands = shortlist(candidates("fwd", 128), tuning.DEFAULT_MAX_CANDIDATES, H200, table_tile("fwd", 128))
    fake_gpu.fastest, fake_gpu.wrong = cands[1].name, {cands[2].name}
    tile = tuning.pick_forward_tile(p, FAKE)
    assert Candidate("fwd", 128, tile).name == cands[1].name and fake_gpu.made == [("fwd", 104)]
    assert tuning.pick_forward_tile(p, FAKE) == tile and len(fake_gpu.made) == 1  # memo
    tuning.clear_memo()  # a new process: read from the file, no tuning
    monkeypatch.setenv("CUFLASH_TUNE", "cached")
    assert tuning.pick_forward_tile(p, FAKE) == tile and len(fake_gpu.made) == 1
    # Same bucket (N 3000 -> 4096, d 128), other N bucket -> not tuned in "cached" mode.
    assert tuning.pick_forward_tile(_problem(d=128, n=3000), FAKE) == tile
    assert tuning.pick_forward_tile(_problem(d=128, n=8192), FAKE) is None and len(fake_gpu.made) == 1


def test_autotune_never_picks_a_wrong_candidate(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    cands = shortlist(candidates("fwd", 64), tuning.DEFAULT_MAX_CANDIDATES, H200, table_tile("fwd", 64))
    fake_gpu.fastest = cands[3].name
    fake_gpu.wrong = {cands[3].name}  # the fastest is wrong
    tile = tuning.pick_forward_tile(_problem(d=64), FAKE)
    assert tile is not None and Candidate("fwd", 64, tile).name != cands[3].name
    # All wrong: the table stays (None), and that verdict is cached too.
    fake_gpu.wrong = {c.name for c in candidates("fwd", 32)}
    assert tuning.pick_forward_tile(_problem(d=32), FAKE) is None
    entry = TuneCache().get(bucket_key("fwd", "FakeGPU", BFLOAT16, 32, True, 4096, 4096))
    assert entry["winner"] is None and all(c["status"] == "wrong" for c in entry["candidates"])


def test_autotune_failure_falls_back_to_table(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")

    class Broken(FakeTuner):
        def run(self, **kw):
            raise RuntimeError("out of memory")

    monkeypatch.setattr(tuning, "_autotuner", Broken)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        assert tuning.pick_forward_tile(_problem(), FAKE) is None


def test_untuned_dtypes_and_bad_mode(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    assert tuning.pick_forward_tile(_problem(dtype=FLOAT32), FAKE) is None  # float32 has its own kernel
    assert tuning.pick_forward_tile(_problem(d=100), FAKE) is None  # d % 8 != 0: the scalar-load kernel
    assert fake_gpu.made == []
    with pytest.raises(ValueError, match="multiple of 8"):
        cuflash.tune((1, 2, 128, 60))
    monkeypatch.setenv("CUFLASH_TUNE", "sometimes")
    with pytest.warns(RuntimeWarning, match="CUFLASH_TUNE"):
        assert tuning.pick_forward_tile(_problem(), FAKE) is None


def test_backward_pick_combines_main_and_dq_winners(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUFLASH_TUNE", "1")
    p = _problem(d=64)
    kv_cands = shortlist(candidates("bwd", 64), tuning.DEFAULT_MAX_CANDIDATES, H200, table_tile("bwd", 64))
    fake_gpu.fastest = kv_cands[2].name
    plain = tuning.pick_backward_tile(p, FAKE)
    assert Candidate("bwd", 64, plain).name == kv_cands[2].name
    table = schedule.BACKWARD_TILES[64]
    assert all(getattr(plain, f) == getattr(table, f) for f in tuning.DQ_SPACE)  # dq fields untouched
    dq_cands = shortlist(candidates("bwd_dq", 64, plain), tuning.DEFAULT_MAX_CANDIDATES, H200, table)
    fake_gpu.fastest = dq_cands[1].name
    det = tuning.pick_backward_tile(p, FAKE, deterministic=True)
    assert tuning.same_tile("bwd", det, plain)
    assert Candidate("bwd_dq", 64, det).name == dq_cands[1].name
    assert fake_gpu.made == [("bwd", 64), ("bwd_dq", 64)]


# --------------------------------------------------------------------------- command line, tools


def test_schedules_cli_on_cpu(capsys, isolated_cache):
    from cuflash.cli.main import main

    assert main(["schedules", "--shape", "2,8,1024,128", "--causal", "--no-compile", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    table_name = Candidate("fwd", 128, schedule.FORWARD_TILES[128]).name
    line = next(ln for ln in out.splitlines() if ln.startswith(table_name + " "))
    assert "table" in line
    occ = occupancy(H200, 128, None, schedule.FORWARD_TILES[128].smem_bytes(128))
    assert f" {occ.blocks_per_sm} " in line  # shared-memory bound without a compile
    assert "not tuned for NVIDIA H200" in out
    # With a tuned entry for the H200: times and the choice appear.
    key = bucket_key("bwd", "NVIDIA H200", BFLOAT16, 128, True, 1024, 1024)
    res = _result("bwd", 128)
    TuneCache().put(key, res)
    tuning.clear_memo()
    assert main(["schedules", "--shape", "2,8,1024,128", "--causal", "--bwd", "--no-compile", "--device", "h200",
                 "--all"]) == 0
    out = capsys.readouterr().out
    wline = next(ln for ln in out.splitlines() if ln.startswith(res.winner.candidate.name + " "))
    assert "tuned" in wline and f"{res.winner.time_s * 1e3:.4g}" in wline
    assert "illegal" in out  # --all lists them with reasons


def test_tune_cli_needs_a_gpu(monkeypatch, capsys):
    from cuflash.cli import main as cli

    monkeypatch.setattr(cli_tune, "gpu_unavailable_reason", lambda: "no CUDA device (test)")
    assert cli.main(["tune", "--shape", "1,2,128,64"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune", "--shape", "1,2,128"])


def test_tune_function_validates_arguments():
    with pytest.raises(ValueError, match="shapes"):
        cuflash.tune()
    with pytest.raises(ValueError, match="op"):
        cuflash.tune((1, 2, 128, 64), ops=("sideways",))


def _run_tool(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "tools" / "schedule_search.py"), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_schedule_search_dry_run():
    r = _run_tool("--dry-run")
    assert r.returncode == 0, r.stderr
    for op, ds in (("fwd", (64, 128, 256)), ("bwd", (64, 128, 256)), ("fwd_wgmma", (64, 128, 256)),
                   ("bwd_wgmma", (64, 128, 256))):
        for d in ds:
            assert f"\n{op} d={d}:" in r.stdout
            assert Candidate(op, d, table_tile(op, d)).name in r.stdout
    assert "(64, 16384, 1, 32)" in r.stdout  # B*N = 16384, H*d = 2048


def test_schedule_search_plan_and_no_gpu_imports():
    code = ("import sys; sys.path.insert(0, 'tools'); import schedule_search as s; "
            "pl = s.plan(); print(len(pl), 'cupy' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["12", "False", "False"]  # fwd, bwd, fwd_wgmma, bwd_wgmma at 3 head dims each
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import schedule_search as s
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for (op, d), entry in s.plan().items():
        assert tuning.same_tile(op, entry["order"][0].tile, table_tile(op, d))
        assert all(not violations(c, H200) for c in entry["order"] + entry["largest"])
        areas = [c.area for c in entry["largest"]]
        assert areas == sorted(areas, reverse=True)
    shapes = s.planned_shapes()
    assert all(b * n == 16384 and h * d == 2048 for d, n, b, h in shapes) and len(shapes) == 9


# --------------------------------------------------------------------------- the GPU tuner's plumbing


class _NumpyAsCupy:
    """Just enough of CuPy's surface for GpuTuner's correctness check, backed by NumPy."""

    asarray, full, empty, empty_like = staticmethod(np.asarray), staticmethod(np.full), staticmethod(np.empty), \
        staticmethod(np.empty_like)
    uint16, float32 = np.uint16, np.float32

    class cuda:
        @staticmethod
        def Device():
            class _D:
                def synchronize(self):
                    pass
            return _D()


@pytest.mark.parametrize("op", ["fwd", "bwd", "fwd_wgmma"])
def test_gpu_tuner_check_and_selection_with_the_cpu_backend(monkeypatch, op):
    """GpuTuner's check (small ragged problem, reference, accuracy rule) and run(), with the CPU
    backend standing in for the kernels (it honours block_m/block_n) and a fake timer. A kernel
    that corrupts one output element must fail the check and never be picked."""
    from cuflash.backends import numpy as cpu

    corrupt = {"name": None}

    def fake_forward(p, q4, k4, v4, o4, lse3, *, tile=None):
        assert isinstance(tile, TileConfig)  # a HopperTile must never reach the mma.sync launch
        cpu.forward(p, q4, k4, v4, o4, lse3, block_m=tile.block_m, block_n=tile.block_n)
        if op == "fwd" and tile.reason == "search" and Candidate("fwd", 64, tile).name == corrupt["name"]:
            o4[0, 1, 7, 3] += 0.25

    def fake_hopper_forward(p, q4, k4, v4, o4, lse3, *, tile=None):
        assert isinstance(tile, schedule.HopperTile)
        cpu.forward(p, q4, k4, v4, o4, lse3, block_m=tile.block_m, block_n=tile.block_n)
        if Candidate("fwd_wgmma", 64, tile).name == corrupt["name"]:
            o4[0, 1, 7, 3] += 0.25

    def fake_backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, tile=None):
        cpu.backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, block_m=tile.block_m, block_n=tile.block_n)
        if Candidate("bwd", 64, tile).name == corrupt["name"]:
            dk4[0, 0, 5, 2] += 0.25

    monkeypatch.setattr(cuda, "forward", fake_forward)
    monkeypatch.setattr(cuda, "forward_wgmma", fake_hopper_forward)
    monkeypatch.setattr(cuda, "backward", fake_backward)
    p = Problem(np, "bhsd", (1,), 4, 2, 300, 300, 64, np.dtype(BFLOAT16), "bottom_right", 0.125)
    tuner = autotune.GpuTuner(op, p, limits=H200, seed=1, cupy=_NumpyAsCupy)
    small = tuner._small_problem()
    assert small["ps"].nq == 300 and small["ps"].hkv == 1 and small["ps"].hq == 2  # GQA kept
    assert_wrong_candidate_never_wins(monkeypatch, tuner, corrupt)


def assert_wrong_candidate_never_wins(monkeypatch, tuner, corrupt):
    """tuner.check passes the first of 3 short-listed candidates and rejects the second, which
    the kernel stand-in corrupts (corrupt["name"]); run() then never picks the second although
    it times fastest."""
    cands = tuner.candidate_list(3)
    corrupt["name"] = cands[1].name
    assert tuner.check(cands[0]) is True
    with pytest.raises(AssertionError):
        tuner.check(cands[1])
    monkeypatch.setattr(tuner, "compile", lambda c: CompileInfo(128, 0, 0, "fake"))
    monkeypatch.setattr(tuner, "time", lambda c: 1e-3 if c.name == cands[1].name else 2e-3 + 1e-4 * cands.index(c))
    monkeypatch.setattr(tuner, "io", lambda c: 0)
    res = tuner.run(max_candidates=3)
    assert [e.status for e in res.evaluations] == ["ok", "wrong", "ok"]
    assert res.winner.candidate.name == cands[0].name


def test_schedule_search_writes_three_files(tmp_path):
    """The report writer on a synthetic result: one JSON, one markdown (a section per op, a table
    per head dim) and one log, however many ops (the device run returns only a few files)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import schedule_search as s
    finally:
        sys.path.remove(str(ROOT / "tools"))
    result = {"device": H200.to_dict(), "buckets": {}, "log": ["first line", "second line"]}
    for op in ("fwd", "bwd", "bwd_wgmma"):
        for d in (64, 128):
            table = Candidate(op, d, table_tile(op, d)).name
            other = shortlist(candidates(op, d), 3, H200, table_tile(op, d))[1].name
            result["buckets"][f"{op}-d{d}"] = {
                "op": op, "d": d, "chosen": [table, other], "largest": other,
                "compile": {table: {"registers": [200, 210]}, other: {"registers": [150, 160]}},
                "occupancy": {n: [{"blocks_per_sm": 1, "warps_per_sm": 8}] * 2 for n in (table, other)},
                "shapes": [{"d": d, "n": 1024, "b": 16, "h": 2048 // d, "causal": True, "torch_flash_s": 1e-3,
                            "candidates": {table: {"status": "ok", "time_s": 2e-3, "tflops": 100.0},
                                           other: {"status": "mismatch"}}},
                           {"d": d, "n": 4096, "b": 4, "h": 2048 // d, "causal": False, "skipped": "budget"}],
            }
    s.write_outputs(result, tmp_path, ("fwd", "bwd", "bwd_wgmma"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["schedule_search.json", "schedule_search.log", "schedule_search.md"]
    assert (tmp_path / "schedule_search.log").read_text() == "first line\nsecond line\n"
    md = (tmp_path / "schedule_search.md").read_text()
    assert md.count(", d = ") == 6
    for op in ("fwd", "bwd", "bwd_wgmma"):  # each op's section holds its own two tables
        section = md.split(f"# {op}: ")[1].split("\n# ")[0]
        assert section.count(f"## {op}, d = ") == 2
    wg64 = Candidate("bwd_wgmma", 64, table_tile("bwd_wgmma", 64)).name
    assert f"| {wg64}: 2.000 |" in md
    table64 = Candidate("fwd", 64, table_tile("fwd", 64)).name
    row = next(ln for ln in md.splitlines() if ln.startswith("| 1024 ") and table64 in ln)
    assert "| 2.000 |" in row and "| 210 |" in row and "mismatch" in row and "| 1 / 1 |" in row
    assert "skipped (budget)" in md
    assert json.loads((tmp_path / "schedule_search.json").read_text())["device"]["name"] == H200.name


def cupy_or_stand_in(monkeypatch):
    """CuPy, or where it is not installed an empty module in its place (the device path's
    `import cupy` then succeeds; the test patches what it uses)."""
    try:
        import cupy
    except ImportError:
        cupy = types.ModuleType("cupy")
        cupy.uint8 = np.uint8
        monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def test_schedule_search_device_flow_with_fakes(tmp_path, monkeypatch):
    """The device run's control flow (screening, causal compiles, spill handling per mask, budget,
    outputs) with a fake compiler and a fake shape runner, so a typo cannot waste GPU time."""
    cupy = cupy_or_stand_in(monkeypatch)
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import schedule_search as s
    finally:
        sys.path.remove(str(ROOT / "tools"))
    monkeypatch.setattr(s.device_limits, "from_cupy", lambda: H200)
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: None, raising=False)

    def fake_compile(spec):
        # Every third expression spills; causal instantiations of 8-warp forward tiles spill too.
        spills = zlib.crc32(spec.expression.encode()) % 3 == 0 or ("true, true>" in spec.expression and ", 8, " in spec.expression)
        return CompileInfo(200, 16 if spills else 0, 0, "fake")

    monkeypatch.setattr(autotune, "compile_device_info", fake_compile)
    ran = []

    def fake_run_shape(op, d, n, b, h, causal, chosen, flush, budget, log):
        ran.append((op, d, n, causal, tuple(c.name for c in chosen)))
        return {"d": d, "n": n, "b": b, "h": h, "causal": causal, "torch_flash_s": 1e-3,
                "candidates": {c.name: {"status": "ok", "time_s": 1e-3 * (1 + i), "tflops": 1.0}
                               for i, c in enumerate(chosen)}}

    monkeypatch.setattr(s, "run_shape", fake_run_shape)
    assert s.main(["--out", str(tmp_path), "--workers", "0", "--ds", "64,128", "--ns", "1024,4096"]) == 0
    res = json.loads((tmp_path / "schedule_search.json").read_text())
    assert sorted(res["buckets"]) == ["bwd-d128", "bwd-d64", "bwd_wgmma-d128", "bwd_wgmma-d64", "fwd-d128", "fwd-d64",
                                      "fwd_wgmma-d128", "fwd_wgmma-d64"]
    for key, bucket in res["buckets"].items():
        assert 1 <= len(bucket["chosen"]) <= s.PER_BUCKET[bucket["op"]] + 1 and bucket["largest"] in bucket["chosen"]
        for name in bucket["chosen"]:
            assert bucket["compile"][name]["clean"][0]  # screened on the non-causal instantiation
            assert len(bucket["compile"][name]["registers"]) == 2
        assert len(bucket["shapes"]) == 4
    # A candidate whose causal instantiation spills is not run on causal shapes.
    for op, d, n, causal, names in ran:
        bucket = res["buckets"][f"{op}-d{d}"]
        assert all(bucket["compile"][nm]["clean"][int(causal)] for nm in names)
    causal_rows = [sh for b in res["buckets"].values() for sh in b["shapes"] if sh["causal"]]
    assert any(c.get("status") == "spills (this mask)" for sh in causal_rows for c in sh["candidates"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # the device returns only a few files
        "schedule_search.json", "schedule_search.log", "schedule_search.md"]
    # A zero budget: nothing timed, every shape recorded as skipped, outputs still written.
    ran.clear()
    assert s.main(["--out", str(tmp_path / "b"), "--workers", "0", "--ds", "64", "--ns", "1024", "--budget-s", "0"]) == 0
    res = json.loads((tmp_path / "b" / "schedule_search.json").read_text())
    assert ran == [] and all(sh.get("skipped") == "budget" for b in res["buckets"].values() for sh in b["shapes"])
