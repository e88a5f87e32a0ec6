"""v's head dim unlike q's and k's without a GPU: which problems the forward's dv kernel
(attn_fwd_wgmma_tma_dv, plan.dispatch.head_dim_v_plan) takes and which are padded to max(d, dv),
its instantiations in the CI compile list, its shared memory against the kernel's traits, the
launch's arguments against the kernel's signature, the backend's routing (stand-in arrays, the
launches stubbed), and the accounting of either path."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash import accounting
from cuflash.backends import cuda
from cuflash.core import config
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.problem import Problem
from cuflash.kernels import forward as forward_kernels
from cuflash.kernels import hopper as hopper_kernels
from cuflash.kernels.operands import LOG2E
from cuflash.plan import dispatch, registry, schedule
from cuflash.plan import hopper as plan_hopper
from cuflash.plan.device_limits import H200 as H200_LIMITS

from _targets import SM80, SM90, on_target

ROOT = Path(__file__).resolve().parent.parent
TABLE = schedule.HOPPER_FORWARD_DV_TILES


@pytest.fixture(autouse=True)
def _hopper_kernels_on(monkeypatch):
    monkeypatch.setenv(config.KERNELS, "auto")  # (whatever the environment says: the plans are for sm_90)


def problem(d, dv, *, causal=None, nq=300, nk=333, hq=4, hkv=2, dtype=BFLOAT16, **extra):
    return Problem(xp=np, layout="bhsd", batch_shape=(2,), hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=np.dtype(dtype),
                   causal=causal, scale=1 / math.sqrt(d), head_dim_v=None if dv == d else dv, **extra)


def native(d, dv) -> bool:
    """What the dispatch should take natively: the table's (d, dv) buckets, 16-byte rows of both."""
    return (schedule.head_dim_bucket(d), schedule.head_dim_bucket(dv)) in TABLE and d % 8 == 0 and dv % 8 == 0


PAIRS = [(d, dv) for d in (40, 64, 96, 100, 120, 128, 136, 192, 256) for dv in (24, 64, 100, 120, 128, 192) if d != dv]


@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
def test_the_dv_kernel_takes_exactly_the_tables_pairs(causal, dtype):
    assert {(192, 128), (128, 64)} <= set(TABLE)
    taken = set()
    for d, dv in PAIRS:
        plan = dispatch.head_dim_v_plan(problem(d, dv, causal=causal, dtype=dtype), SM90, dispatch.ALIGNED)
        assert (plan is not None) == native(d, dv), (d, dv)
        if plan is None:
            continue
        taken.add((d, dv))
        hd, hv = plan_hopper.dv_buckets(d, dv)
        t = TABLE[(hd, hv)]
        assert plan.kernel == "wgmma_dv" and plan.tile == t and plan.block_m == t.block_m
        b = lambda x: "true" if x else "false"  # noqa: E731
        assert plan.spec.expression == (f"attn_fwd_wgmma_tma_dv<{'Bf16' if dtype == BFLOAT16 else 'Fp16'}, {hd}, {hv}, "
                                        f"{t.block_n}, {t.warpgroups}, {t.stages}, {b(causal is not None)}, "
                                        f"{b(t.pingpong)}, {b(t.wg_epilogue)}>")
    assert {(192, 128), (136, 120), (128, 64), (120, 64)} <= taken


@pytest.mark.parametrize("d, dv", sorted(TABLE))
def test_everything_else_is_padded(d, dv, monkeypatch):
    aligned = dispatch.ALIGNED

    def plan(p=None, target=SM90, ops=aligned):
        return dispatch.head_dim_v_plan(p or problem(d, dv), target, ops)

    assert plan() is not None
    assert plan(problem(d, dv, window=(16, 0))) is None
    assert plan(problem(d, dv, causal="bottom_right", window=(16, 0))) is None
    assert plan(problem(d, dv, softcap=5.0)) is None
    assert plan(problem(d, dv, alibi=np.ones((2, 4), np.float32))) is None
    assert plan(problem(d, dv, sinks=np.zeros(4, np.float32))) is None
    assert plan(problem(d, dv, dtype=FLOAT32)) is None
    assert plan(problem(d, d)) is None  # (one head dim: the plain kernels)
    assert plan(target=SM80) is None
    assert plan(ops=dataclasses.replace(aligned, tma_q=False)) is None
    assert plan(ops=dataclasses.replace(aligned, tma_kv=False)) is None
    assert plan(ops=dataclasses.replace(aligned, vec=False)) is None
    # split-KV decode shapes pad and run the decode kernel at max(d, dv)
    p = problem(d, dv, nq=1, nk=4096)
    assert dispatch.decode_applies(dispatch.one_width(p), True) and plan(p) is None
    assert plan(problem(d, dv, nq=17, nk=4096)) is not None
    monkeypatch.setenv(config.KERNELS, "mma_sync")
    assert plan() is None


def test_a_forced_tile_and_where_it_does_not_apply():
    t = TABLE[(192, 128)]
    twin = dataclasses.replace(t, pingpong=not t.pingpong, reason="")
    plan = dispatch.head_dim_v_plan(problem(192, 128), SM90, dispatch.ALIGNED, tile=twin)
    assert plan.tile == twin and plan.spec.expression.endswith(f"{'true' if twin.pingpong else 'false'}, false>")
    with pytest.raises(ValueError, match="^tile: the dv kernel does not run this problem here"):
        dispatch.head_dim_v_plan(problem(64, 128), SM90, dispatch.ALIGNED, tile=twin)
    with pytest.raises(ValueError, match="^tile: the dv kernel runs the per-tile TMA kernel"):
        plan_hopper.dv_spec(BFLOAT16, 192, 128, False, dataclasses.replace(t, persistent=True))


def test_every_instantiation_is_in_the_ci_compile_list():
    names = {s.expression for s in registry.all_specs()}
    for dtype in (FLOAT16, BFLOAT16):
        for (hd, hv), t in TABLE.items():
            for causal in (False, True):
                for tile in (t, dataclasses.replace(t, pingpong=not t.pingpong)):
                    assert plan_hopper.dv_spec(dtype, hd, hv, causal, tile)[0].expression in names
    assert {s.expression for s in plan_hopper.all_hopper_dv_forward_specs()} <= {
        s.expression for s in registry.FAMILIES["hopper_forward"]()}


@pytest.mark.parametrize("hd, hv", sorted(TABLE))
def test_shared_memory_is_the_traits_byte_count_and_fits(hd, hv):
    # HopperFwdTraits::kSmemBytes: Q, STAGES x (a K slot + a narrower V slot), the mbarriers, 1 KiB
    spec, t = plan_hopper.dv_spec(BFLOAT16, hd, hv, True)
    want = 2 * (t.block_m * hd + t.stages * t.block_n * (hd + hv)) + 8 * (1 + 4 * t.stages) + 1024
    assert spec.smem_bytes == want <= H200_LIMITS.smem_per_block_optin
    assert spec.smem_bytes < t.smem_bytes(hd)  # (the padded kernel's V slots would be hd wide)
    assert spec.threads == 128 * (t.warpgroups + 1) and t.tma and not t.persistent
    assert "x cuDNN" in t.reason  # the table gives what the tile measured against the peer


def _kernel_parameters():
    """The parameter names of attn_fwd_wgmma_tma_dv in cuda_src/attn_fwd_wgmma.cu (FWD_TMA_PARAMS, dv)."""
    text = (ROOT / "cuda_src" / "attn_fwd_wgmma.cu").read_text()
    macro = re.search(r"#define FWD_TMA_PARAMS((?:[^\n]*\\\n)*[^\n]*)", text).group(1).replace("\\\n", " ")
    params = re.search(r"attn_fwd_wgmma_tma_dv\(([^)]*)\)", text).group(1).replace("FWD_TMA_PARAMS", macro)
    return [re.split(r"[\s*]+", part.strip())[-1] for part in params.split(",")]


def test_launch_arguments_follow_the_kernel_signature(monkeypatch):
    # v's map over its own dv columns, o dv wide, d (q's and k's) and dv both passed; launch stubbed.
    launches = []
    monkeypatch.setattr(forward_kernels, "get_function", lambda spec: lambda grid, block, args, shared_mem:
                        launches.append((spec, grid, block, args, shared_mem)))
    monkeypatch.setattr(hopper_kernels.tma, "bhsd_map", lambda a, rows: ("map", a.shape, rows))
    p = problem(192, 128, causal="bottom_right", nq=300, nk=333)
    plan = dispatch.head_dim_v_plan(p, SM90, dispatch.ALIGNED)
    q4, k4 = np.zeros((2, 4, 300, 192), np.uint16), np.zeros((2, 2, 333, 192), np.uint16)
    v4, o4 = np.zeros((2, 2, 333, 128), np.uint16), np.zeros((2, 4, 300, 128), np.uint16)
    lse3 = np.zeros((2, 4, 300), np.float32)
    hopper_kernels.launch(plan, p, q4, k4, v4, o4, lse3)
    (spec, grid, block, args, smem), = launches
    t = plan.tile
    assert spec == plan.spec and grid == (-(-300 // t.block_m), 4, 2) and block == (spec.threads,)
    assert smem == spec.smem_bytes
    names = _kernel_parameters()
    assert len(args) == len(names) == 27
    a = dict(zip(names, args))
    assert a["tmap_q"] == ("map", q4.shape, t.block_m) and a["tmap_k"] == ("map", k4.shape, t.block_n)
    assert a["tmap_v"] == ("map", v4.shape, t.block_n)
    assert (a["v_sb"], a["v_sh"], a["v_sn"]) == (2 * 333 * 128, 333 * 128, 128)
    assert (a["o_sb"], a["o_sh"], a["o_sn"]) == (4 * 300 * 128, 300 * 128, 128)
    assert (a["nq"], a["nk"], a["d"], a["group"], a["causal_off"], a["dv"]) == (300, 333, 192, 2, 33, 128)
    assert a["scale_log2"] == np.float32(p.scale * LOG2E)


def _arrays(p):
    q4 = np.zeros((p.batch, p.hq, p.nq, p.d), np.uint16)
    k4 = np.zeros((p.batch, p.hkv, p.nk, p.d), np.uint16)
    v4 = np.zeros((p.batch, p.hkv, p.nk, p.dv), np.uint16)
    o4 = np.zeros((p.batch, p.hq, p.nq, p.dv), np.uint16)
    return q4, k4, v4, o4, np.zeros((p.batch, p.hq, p.nq), np.float32)


@pytest.mark.parametrize("d, dv, causal", [(192, 128, None), (192, 128, "bottom_right"), (128, 64, "top_left"),
                                           (64, 128, None), (40, 24, "bottom_right"), (192, 128, "window")])
def test_the_backend_runs_the_dv_kernel_or_pads(d, dv, causal, monkeypatch):
    on_target(monkeypatch, SM90)
    monkeypatch.setattr(cuda, "describe", lambda *args, **kw: dispatch.ALIGNED)  # (aligned device arrays)
    launched, padded = [], []
    monkeypatch.setattr(cuda.hopper, "launch", lambda plan, p, *arrays: launched.append((plan, p, arrays)))
    monkeypatch.setattr(cuda, "_to_width", lambda a, w, copy=False: a if a.shape[-1] == w else ("padded", a.shape, w))
    monkeypatch.setattr(cuda, "_from_width", lambda dst, src: None)
    real = cuda.forward

    def forward(p, *arrays, **kw):  # the padded path's inner call: recorded, not run
        if p.dv == p.d:
            padded.append((p, arrays))
            return
        real(p, *arrays, **kw)

    monkeypatch.setattr(cuda, "forward", forward)
    window = causal == "window"
    p = problem(d, dv, causal="bottom_right" if window else causal, window=(16, 0) if window else None)
    arrays = _arrays(p)
    cuda.forward(p, *arrays)
    if native(d, dv) and not window:
        (plan, lp, got), = launched
        assert not padded and plan.kernel == "wgmma_dv" and lp is p
        assert all(g is a for g, a in zip(got, arrays))  # q, k, v, o as they are: no copy
    else:
        (pw, got), = padded
        assert not launched and pw.d == pw.dv == max(d, dv)
        assert [g[2] if isinstance(g, tuple) else g.shape[-1] for g in got[:4]] == [max(d, dv)] * 4


@pytest.mark.parametrize("d, dv", sorted(TABLE))
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_memory_report_of_the_dv_kernel(d, dv, pass_):
    B, Hq, Hkv, N = 2, 8, 2, 1000
    shapes = (B, Hq, N, d), (B, Hkv, N, d), (B, Hkv, N, dv)
    r = cuflash.memory_report(*shapes, pass_=pass_, registers=200)
    by_name = {e.name: e for e in r.entries}
    spec, t = plan_hopper.dv_spec(BFLOAT16, d, dv, False)
    copies = [e for e in r.entries if "zero-padded" in e.name]
    assert all(e.phase == "bwd" for e in copies)  # the forward copies nothing
    assert bool(copies) == (pass_ != "fwd")
    if pass_ != "bwd":
        smem = by_name["shared memory / block (fwd)"]
        assert smem.bytes == spec.smem_bytes and spec.short_name in smem.note
        assert by_name["registers / block (fwd)"].bytes == 200 * 4 * spec.threads
        assert "no copy" in r.notes[-1] and not any(e.name.endswith("(key split)") for e in r.entries)
        launch = accounting.forward_launch(BFLOAT16, d, False, nq=N, nk=N, batch=B, hq=Hq, dv=dv, hkv=Hkv)
        assert (launch.smem, launch.hd, launch.hd_v, launch.source) == (spec.smem_bytes, d, dv, spec.short_name)
    # a decode shape, score modifiers or a forced split count: the padded forward's copies
    for kw in (dict(), dict(alibi_slopes=(Hq,)), dict(splits=2)):
        q = (B, Hq, 1, d) if not kw else shapes[0]
        r = cuflash.memory_report(q, *shapes[1:], pass_="fwd", **kw)
        assert any(e.phase == "fwd" and "zero-padded" in e.name for e in r.entries), kw
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(config.KERNELS, "mma_sync")
        r = cuflash.memory_report(*shapes, pass_="fwd")
        assert any("zero-padded" in e.name for e in r.entries)
