"""float8_e4m3fn GPU inputs without a GPU: which calls take the e4m3 kernel's path (windows, packed
sequences and kv_lens included), what it refuses (NotImplementedError naming the option), the
errors naming the argument, the plans and the launches' arguments (stand-in CuPy arrays and a
stubbed launch), and the vt key order against the register layouts it serves."""

from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.core import problem as _problem
from cuflash.api import functional
from cuflash.backends import cuda
from cuflash.core import fp8_inputs
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import fp8_forward
from cuflash.kernels.operands import LOG2E
from cuflash.plan import dispatch, registry, schedule
from cuflash.plan import hopper as plan_hopper

from _targets import SM80, SM90

ROOT = Path(__file__).resolve().parent.parent


class FakeCupyArray:
    """What the routing and the checks read of a CuPy array: module name, dtype, shape, device."""

    __module__ = "cupy._core.core"

    def __init__(self, shape, dtype=np.uint8, device=0):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.device = types.SimpleNamespace(id=device)
        self.size = int(np.prod(shape))


class Reached(Exception):
    pass


def _qkv(b=2, hq=4, hkv=2, nq=40, nk=50, d=128, dtype=np.uint8):
    return (FakeCupyArray((b, hq, nq, d), dtype), FakeCupyArray((b, hkv, nk, d), dtype),
            FakeCupyArray((b, hkv, nk, d), dtype))


def _f32(shape, device=0):
    return FakeCupyArray(shape, np.float32, device)


@pytest.mark.parametrize("option, value", [("block_table", "x"), ("softcap", 5.0), ("alibi_slopes", "x"),
                                           ("sinks", "x")])
def test_options_the_gpu_kernel_does_not_take_name_themselves(fake_cupy, option, value):
    q, k, v = _qkv()
    kw = {option: FakeCupyArray((2,), np.int32) if value == "x" else value}
    with pytest.raises(NotImplementedError, match=f"^{option}: not implemented for float8_e4m3fn GPU inputs"):
        cuflash.attention(q, k, v, k_descale=_f32(()), **kw)


def test_dtypes_out_dtype_and_the_kv_cache_form(fake_cupy, monkeypatch):
    q, k, v = _qkv()
    one = _f32(())
    with pytest.raises(TypeError, match=r"^k: expected the e4m3 bits of a float8_e4m3fn GPU input .* got float16"):
        cuflash.attention(q, FakeCupyArray(k.shape, np.float16), v, k_descale=one)

    def cache_path(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(functional, "_fp8_cache_on_gpu", cache_path)
    with pytest.raises(Reached):  # (a 16-bit q with e4m3 k and v: the FP8 KV cache's decode kernel)
        cuflash.attention(FakeCupyArray(q.shape, BFLOAT16), k, v, k_descale=one)
    with pytest.raises(NotImplementedError, match="^out_dtype: float32 is not implemented"):
        cuflash.attention(q, k, v, k_descale=one, out_dtype=np.float32)
    with pytest.raises(ValueError, match="^out_dtype: with float8_e4m3fn GPU inputs expected bfloat16 or float16"):
        cuflash.attention(q, k, v, k_descale=one, out_dtype=np.int8)
    with pytest.raises(TypeError, match="^return_lse:"):
        cuflash.attention(q, k, v, k_descale=one, return_lse="yes")
    with pytest.raises(NotImplementedError, match="^v: a head dim"):
        cuflash.attention(q, k, FakeCupyArray(k.shape[:3] + (64,)), k_descale=one)


def test_descales_are_checked_and_name_themselves(fake_cupy):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="^q_descale: is a NumPy array but q is a CuPy array"):
        cuflash.attention(q, k, v, q_descale=np.ones((), np.float32))
    with pytest.raises(TypeError, match="^k_descale: expected dtype float32, got float64"):
        cuflash.attention(q, k, v, k_descale=FakeCupyArray((), np.float64))
    with pytest.raises(ValueError, match=r"^v_descale: expected shape \(\) or \(2, 2\), got \(2, 4\)"):
        cuflash.attention(q, k, v, v_descale=_f32((2, 4)))
    with pytest.raises(ValueError, match="^k_descale: is on cuda:1 but q is on cuda:0"):
        cuflash.attention(q, k, v, k_descale=_f32((), device=1))


def test_a_call_reaches_the_kernel_with_its_problem_and_descales(fake_cupy, monkeypatch):
    # q's descale per K/V head (FlashAttention-3's) and per query head are both shapes q takes;
    # the backend gets the problem as the e4m3 kernel reads it.
    seen = {}

    def forward_fp8(p, q4, k4, v4, o4, lse3, descales):
        seen.update(p=p, descales=descales, o=o4)
        raise Reached

    monkeypatch.setattr(functional, "_forward_outputs", lambda p, out, odt: ("o", ("o4", odt), True, "lse"))
    monkeypatch.setattr(functional, "to_bhsd", lambda a, *args: a)
    monkeypatch.setattr(cuda, "forward_fp8", forward_fp8)
    q, k, v = _qkv(nq=40, nk=50, d=96)
    for qd_shape in ((2, 2), (2, 4), (1,)):
        qd, kd, vd = _f32(qd_shape), _f32((2, 2)), _f32(())
        with pytest.raises(Reached):
            cuflash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal="top_left", out_dtype=np.float16)
        p = seen["p"]
        assert (p.dtype, p.hq, p.hkv, p.nq, p.nk, p.d, p.causal) == (fp8_inputs.E4M3, 4, 2, 40, 50, 96, "top_left")
        assert seen["descales"] == [qd, kd, vd] and seen["o"] == ("o4", np.dtype(FLOAT16))
    with pytest.raises(Reached):  # no descale but v's: the others None (read as 1)
        cuflash.attention(q, k, v, v_descale=vd)
    assert seen["descales"] == [None, None, vd] and seen["o"] == ("o4", BFLOAT16)


class FakeValues(FakeCupyArray):
    """A stand-in CuPy array with values (kv_lens, offsets, descales): get(), reshape, slices."""

    __module__ = "cupy._core.core"

    def __init__(self, values):
        self.values = np.asarray(values)
        super().__init__(self.values.shape, self.values.dtype)

    def get(self):
        return self.values

    def reshape(self, *shape):
        return FakeValues(self.values.reshape(*shape))

    def __getitem__(self, key):
        return FakeValues(self.values[key])


def _stub_kernel_side(monkeypatch, fake_cupy):
    """forward_fp8 recording its calls (the problem, the arrays' shapes, the descales, the packed
    arguments); NumPy arrays for the outputs and the (B, H, N, d) views."""
    calls = []

    def forward_fp8(p, q4, k4, v4, o4, lse3, descales, **packed):
        calls.append(dict(p=p, shapes=(q4.shape, k4.shape, v4.shape, o4.shape, lse3.shape), descales=descales,
                          **packed))

    def outputs(p, out, odt):
        return "o", np.zeros((p.batch, p.hq, p.nq, p.d), np.uint16), True, np.zeros((p.batch, p.hq, p.nq), np.float32)

    def views(a, p, h, n, d=None):
        return np.zeros((p.batch, h, n, p.d if d is None else d), np.uint8)

    fake_cupy.ascontiguousarray = lambda a: a
    fake_cupy.empty = lambda shape, dtype: np.zeros(shape, dtype)
    monkeypatch.setattr(functional, "_forward_outputs", outputs)
    monkeypatch.setattr(functional, "_forward_result", lambda p, o, o4, direct, lse3, return_lse: "result")
    monkeypatch.setattr(functional, "to_bhsd", views)
    monkeypatch.setattr(functional, "_packed_offsets",
                        lambda p, cq, ck, spans: ("cu_q", "cu_k") if spans is not None else ("clamped q", "clamped k"))
    monkeypatch.setattr(functional, "_packed_outputs", lambda p, arrays, rows: ([views(None, p, p.hq, p.nq)], [True]))
    monkeypatch.setattr(cuda, "forward_fp8", forward_fp8)
    return calls


def test_a_window_reaches_the_kernel_with_the_problems_window(fake_cupy, monkeypatch):
    calls = _stub_kernel_side(monkeypatch, fake_cupy)
    q, k, v = _qkv()
    cuflash.attention(q, k, v, k_descale=_f32(()), window=(8, 0), causal="top_left")
    cuflash.attention(q, k, v, k_descale=_f32(()), window=(-1, -1))  # (no window)
    assert [c["p"].window for c in calls] == [(8, 0), None]
    assert calls[0]["p"].causal == "top_left" and "cu_seqlens" not in calls[0]
    with pytest.raises(ValueError, match=r"^window: expected values >= -1"):
        cuflash.attention(q, k, v, k_descale=_f32(()), window=(-2, 0))


def test_kv_lens_runs_each_batch_entry_over_its_keys(fake_cupy, monkeypatch):
    # As the 16-bit prefill fallback: entry b alone over its first kv_lens[b] keys, its row of a
    # per-(batch, head) descale; a per-tensor one as it is.
    calls = _stub_kernel_side(monkeypatch, fake_cupy)
    q, k, v = _qkv(b=2, hq=4, hkv=2, nq=40, nk=50)
    qd, kd = FakeValues(np.ones((2, 2), np.float32)), _f32(())
    assert cuflash.attention(q, k, v, q_descale=qd, k_descale=kd, kv_lens=FakeValues(np.int32([7, 50])),
                             window=(3, 3)) == "result"
    assert [c["p"].nk for c in calls] == [7, 50] and all(c["p"].window == (3, 3) for c in calls)
    assert [c["shapes"][1] for c in calls] == [(1, 2, 7, 128), (1, 2, 50, 128)]
    assert [c["shapes"][0] for c in calls] == [(1, 4, 40, 128)] * 2
    for b, c in enumerate(calls):
        cqd, ckd, cvd = c["descales"]
        assert cqd.shape == (1, 2) and np.array_equal(cqd.values, qd.values[b:b + 1]) and ckd is kd and cvd is None
    with pytest.raises(ValueError, match=r"^kv_lens: values must lie in \[0, Nk=50\]"):
        cuflash.attention(q, k, v, k_descale=kd, kv_lens=FakeValues(np.int32([7, 51])))
    with pytest.raises(TypeError, match="^kv_lens: expected dtype int32"):
        cuflash.attention(q, k, v, k_descale=kd, kv_lens=FakeValues(np.int64([7, 5])))


def test_packed_sequences_reach_the_kernel_in_one_call(fake_cupy, monkeypatch):
    calls = _stub_kernel_side(monkeypatch, fake_cupy)
    cq, ck = FakeValues(np.int32([0, 3, 3, 40])), FakeValues(np.int32([0, 30, 31, 90]))
    q, k, v = (FakeCupyArray((40, 4, 128)), FakeCupyArray((90, 2, 128)), FakeCupyArray((90, 2, 128)))
    one = _f32(())
    o, lse = cuflash.attention(q, k, v, k_descale=one, v_descale=_f32((1,)), cu_seqlens_q=cq, cu_seqlens_k=ck,
                               causal=True, window=(5, 0), return_lse=True)
    (c,) = calls
    p = c["p"]
    assert (p.batch, p.hq, p.hkv, p.nq, p.nk, p.causal, p.window) == (1, 4, 2, 40, 90, "bottom_right", (5, 0))
    assert c["cu_seqlens"] == ("cu_q", "cu_k") and c["max_seqlen_q"] == 37
    assert c["shapes"][4] == (1, 4, 40) and c["descales"][1] is one and lse.shape == (4, 40)
    # max_seqlen_q / max_seqlen_k with validate=False: the offsets are not read (spans None: their
    # device clamp), and the grid covers the given length
    calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_problem, "to_host", lambda a, name, why: pytest.fail(f"{name} was read on the host"))
        cuflash.attention(q, k, v, k_descale=one, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=50, max_seqlen_k=60,
                          validate=False)
    (c,) = calls
    assert c["cu_seqlens"] == ("clamped q", "clamped k") and c["max_seqlen_q"] == 50
    for bad in ((2,), (1, 2)):  # one factor per tensor, as on the NumPy backend
        with pytest.raises(ValueError, match=r"^k_descale: expected shape \(\) \(packed sequences take one factor "
                                             r"per tensor\), got"):
            cuflash.attention(q, k, v, k_descale=_f32(bad), cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match="^kv_lens: cannot be combined with cu_seqlens"):
        cuflash.attention(q, k, v, k_descale=one, cu_seqlens_q=cq, cu_seqlens_k=ck,
                          kv_lens=FakeValues(np.int32([1, 1, 1])))
    with pytest.raises(ValueError, match="^cu_seqlens_k: packed sequences need both"):
        cuflash.attention(q, k, v, k_descale=one, cu_seqlens_q=cq)
    with pytest.raises(ValueError, match="^cu_seqlens_k: offsets must be non-decreasing"):
        cuflash.attention(q, k, v, k_descale=one, cu_seqlens_q=cq, cu_seqlens_k=FakeValues(np.int32([0, 30, 29, 90])))
    with pytest.raises(ValueError, match=r"^q: with cu_seqlens_q/cu_seqlens_k expected a packed"):
        cuflash.attention(*_qkv(), k_descale=one, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_uint8_without_descales_is_not_taken_for_e4m3(fake_cupy, monkeypatch):
    # A CuPy uint8 array alone is no FP8 call: it goes the 16-bit path, whose validation rejects it.
    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(functional._problem, "validate_forward", reached)
    with pytest.raises(Reached):
        cuflash.attention(*_qkv())


def test_the_plan_needs_sm90_and_names_the_instantiation():
    p = types.SimpleNamespace(d=96, causal="bottom_right")
    with pytest.raises(NotImplementedError, match="sm_90"):
        dispatch.fp8_forward_plan(p, SM80, BFLOAT16)
    plan = dispatch.fp8_forward_plan(types.SimpleNamespace(d=96, causal=None), SM90, BFLOAT16)
    t = schedule.HOPPER_FP8_FORWARD_TILES[128]
    assert plan.kernel == "wgmma_fp8" and plan.tile == t
    assert plan.spec.expression == (f"attn_fwd_wgmma_tma_fp8<E4m3<Bf16>, 128, {t.block_n}, {t.warpgroups}, {t.stages}, "
                                    f"false, {'true' if t.pingpong else 'false'}>")
    # causal: the persistent table's tile where it has one
    plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16)
    t = schedule.fp8_forward_tile(128, True)
    assert plan.tile == t
    kernel = "attn_fwd_wgmma_tma_fp8_persistent" if t.persistent else "attn_fwd_wgmma_tma_fp8"
    assert plan.spec.expression.startswith(f"{kernel}<E4m3<Bf16>, 128, {t.block_n}, {t.warpgroups}, {t.stages}, ")
    # (d=200 runs the 256 kernel; its shared memory is the traits' byte count)
    spec, t = plan_hopper.fp8_forward_spec(FLOAT16, 200, False)
    assert spec.expression.startswith("attn_fwd_wgmma_tma_fp8<E4m3<Fp16>, 256, ")
    assert spec.smem_bytes == (t.block_m + 2 * t.stages * t.block_n) * 256 + 8 * (1 + 4 * t.stages) + 1024
    for bad in (64, 96, 200, 288):  # no e4m3 wgmma wrapper, or less than one vt box
        with pytest.raises(ValueError, match="^tile:"):
            plan_hopper.fp8_forward_spec(BFLOAT16, 128, False, schedule.HopperTile(bad, 2, 2, "", tma=True))
    # 160-224-key tiles: vt's ring slots hold two whole 128-key boxes (HopperFwdTraits::kVtKeys)
    spec, t = plan_hopper.fp8_forward_spec(BFLOAT16, 128, False, schedule.HopperTile(224, 2, 3, "", tma=True))
    assert spec.expression == "attn_fwd_wgmma_tma_fp8<E4m3<Bf16>, 128, 224, 2, 3, false, false>"
    assert spec.smem_bytes == (128 + 3 * (224 + 256)) * 128 + 8 * (1 + 4 * 3) + 1024
    with pytest.raises(ValueError, match="head dim 300"):
        schedule.fp8_head_dim(300)


def test_windows_and_packed_sequences_plan_the_band_kernel():
    t = schedule.HOPPER_FP8_FORWARD_TILES[128]
    pp = "true" if t.pingpong else "false"
    for window, packed in (((8, 0), False), (None, True), ((3, 3), True)):
        p = types.SimpleNamespace(d=96, causal="bottom_right", window=window)
        plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16, packed=packed)
        assert plan.kernel == "wgmma_fp8_band" and plan.tile == t
        assert plan.spec.expression == (f"attn_fwd_wgmma_tma_fp8_band<E4m3<Bf16>, 128, {t.block_n}, {t.warpgroups}, "
                                        f"{t.stages}, {pp}>")
    p = types.SimpleNamespace(d=96, causal=None, window=None)
    assert dispatch.fp8_forward_plan(p, SM90, FLOAT16).kernel == "wgmma_fp8"
    with pytest.raises(NotImplementedError, match="sm_90"):
        dispatch.fp8_forward_plan(p, SM80, BFLOAT16, packed=True)
    spec, t = plan_hopper.fp8_forward_band_spec(FLOAT16, 200)
    assert spec.expression.startswith("attn_fwd_wgmma_tma_fp8_band<E4m3<Fp16>, 256, ")
    assert spec.smem_bytes == plan_hopper.fp8_forward_spec(FLOAT16, 200, True)[0].smem_bytes
    with pytest.raises(ValueError, match="^tile:"):
        plan_hopper.fp8_forward_band_spec(BFLOAT16, 128, schedule.HopperTile(64, 2, 2, "", tma=True))


def test_every_instantiation_is_in_the_ci_compile_list():
    names = {s.expression for s in registry.all_specs()}
    for out in (BFLOAT16, FLOAT16):
        for d in schedule.FP8_HEAD_DIMS:
            assert plan_hopper.fp8_forward_band_spec(out, d)[0].expression in names
            for causal in (False, True):
                assert plan_hopper.fp8_forward_spec(out, d, causal)[0].expression in names
    assert {plan_hopper.fp8_vt_spec(True).expression, plan_hopper.fp8_vt_spec(False).expression} <= names


def test_descale_pointers_and_strides():
    null, *rest = fp8_forward.scale_args(None, 2, 4)
    assert null == 0 and rest == [0, 0, 0]
    one = np.ones((), np.float32)
    assert fp8_forward.scale_args(one, 2, 4)[1:] == (0, 0, 0)
    per_q = np.ones((2, 4), np.float32)
    assert fp8_forward.scale_args(per_q, 2, 4, q_heads=4)[1:] == (4, 1, 0)
    per_kv = np.ones((2, 2), np.float32)  # q's descale per K/V head: indexed by hk
    assert fp8_forward.scale_args(per_kv, 2, 2, q_heads=4)[1:] == (2, 0, 1)
    assert fp8_forward.scale_args(np.ones((3, 2, 2), np.float32), 6, 2)[1:] == (2, 1, 0)  # batch axes merged
    assert fp8_forward.scale_args(np.ones((1, 2), np.float32), 1, 2)[1:] == (0, 1, 0)


def _kernel_parameters(kernel="attn_fwd_wgmma_tma_fp8"):
    """The parameter names of a kernel in cuda_src/attn_fwd_wgmma.cu (its parameter macro expanded)."""
    text = (ROOT / "cuda_src" / "attn_fwd_wgmma.cu").read_text()
    m = re.search("\n" + kernel + r"\(([^)]*)\)", text)
    params = m.group(1)
    if "FWD_FP8_PARAMS" in params:
        body = re.search(r"#define FWD_FP8_PARAMS\s*((?:[^\n]*\\\n)*[^\n]*)", text).group(1)
        params = params.replace("FWD_FP8_PARAMS", body.replace("\\\n", " ").replace("\\", " "))
    return [re.split(r"[\s*]+", part.strip())[-1] for part in params.split(",")]


def test_launch_arguments_follow_the_kernel_signature(monkeypatch):
    # The launch's arguments in the kernel's order (checked by name against the source), grid
    # (query tiles, heads, batch) and the descales' strides; vt, the maps and the launch stubbed.
    launches = []
    monkeypatch.setattr(fp8_forward, "get_function", lambda spec: lambda grid, block, args, shared_mem: launches.append(
        (spec, grid, block, args, shared_mem)))
    monkeypatch.setattr(fp8_forward, "pack_vt", lambda v4: ("vt", v4))
    monkeypatch.setattr(fp8_forward.tma, "bhsd_map", lambda a, rows: ("map", a, rows))
    monkeypatch.setattr(fp8_forward, "vt_map", lambda vt, hd: ("vtmap", hd))
    monkeypatch.setattr(schedule, "HOPPER_FP8_FORWARD_PERSISTENT", {})  # (the per-tile kernel; the persistent one below)
    p = types.SimpleNamespace(batch=2, hq=4, hkv=2, nq=300, nk=333, d=96, group=2, scale=0.1, causal="bottom_right",
                              causal_offset=33)
    plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16)
    q4, k4 = np.zeros((2, 4, 300, 96), np.uint8), np.zeros((2, 2, 333, 96), np.uint8)
    o4, lse3 = np.zeros((2, 4, 300, 96), np.uint16), np.zeros((2, 4, 300), np.float32)
    qd, kd = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    fp8_forward.launch(plan, p, q4, k4, k4, o4, lse3, (qd, kd, None))
    (spec, grid, block, args, smem), = launches
    t = plan.tile
    assert grid == (-(-300 // t.block_m), 4, 2) and block == (spec.threads,) and smem == spec.smem_bytes
    names = _kernel_parameters()
    assert len(args) == len(names) == 24
    a = dict(zip(names, args))
    def same(x, y):  # (the launch passes its batch chunk's views)
        return x.shape == y.shape and x.__array_interface__["data"] == y.__array_interface__["data"]

    assert a["tmap_q"][0] == "map" and same(a["tmap_q"][1], q4) and a["tmap_q"][2] == t.block_m
    assert a["tmap_k"][0] == "map" and same(a["tmap_k"][1], k4) and a["tmap_k"][2] == t.block_n
    assert a["tmap_vt"] == ("vtmap", 128) and same(a["o"], o4) and same(a["lse"], lse3)
    assert (a["o_sb"], a["o_sh"], a["o_sn"]) == (4 * 300 * 96, 300 * 96, 96)
    assert (a["nq"], a["nk"], a["d"], a["group"], a["causal_off"]) == (300, 333, 96, 2, 33)
    assert a["scale_log2"] == np.float32(0.1 * LOG2E)
    assert a["v_descale"] == 0  # null: 1
    assert (a["qd_sb"], a["qd_sh"], a["qd_shk"], a["kd_sb"], a["kd_sh"], a["vd_sb"], a["vd_sh"]) == (2, 0, 1, 2, 1, 0, 0)


def test_persistent_launch_arguments(monkeypatch):
    # A persistent tile: one launch of a 1-D grid of at most one block per SM (or
    # persistent_blocks) over every work unit - query tiles, causal: pairs of them - of all batch
    # entries and heads, the head and batch counts after the descales' strides.
    launches = _stub_launches(monkeypatch)
    monkeypatch.setattr(fp8_forward.device, "current_id", lambda: 0)
    monkeypatch.setattr(fp8_forward.device, "sm_count", lambda device_id: 132)
    tile = schedule.HopperTile(192, 2, 3, "", tma=True, persistent=True, wg_epilogue=True)
    q4, k4 = np.zeros((2, 4, 300, 128), np.uint8), np.zeros((2, 2, 333, 128), np.uint8)
    o4, lse3 = np.zeros((2, 4, 300, 128), np.uint16), np.zeros((2, 4, 300), np.float32)
    names = _kernel_parameters("attn_fwd_wgmma_tma_fp8_persistent")
    assert names[-2:] == ["n_heads", "n_batch"] and names[:-2] == _kernel_parameters()
    for causal, units in ((None, 3 * 4 * 2), ("bottom_right", 2 * 4 * 2)):  # 300 rows: 3 tiles, 2 pairs
        p = types.SimpleNamespace(batch=2, hq=4, hkv=2, nq=300, nk=333, d=128, group=2, scale=0.1, causal=causal,
                                  causal_offset=33)
        plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16, tile=tile)
        assert plan.spec.expression.startswith("attn_fwd_wgmma_tma_fp8_persistent<E4m3<Bf16>, 128, 192, 2, 3, ")
        assert plan.spec.expression.endswith(", false, true>")
        for blocks, grid in ((None, units), (5, 5)):
            launches.clear()
            fp8_forward.launch(plan, p, q4, k4, k4, o4, lse3, (None, None, None), persistent_blocks=blocks)
            (spec, g, _, args, smem), = launches
            assert g == (grid,) and smem == spec.smem_bytes == tile.smem_bytes(128, 1)
            a = dict(zip(names, args))
            assert len(args) == len(names) and (a["n_heads"], a["n_batch"]) == (4, 2)
    with pytest.raises(ValueError, match="^tile:"):  # windows and packed sequences: per tile
        plan_hopper.fp8_forward_band_spec(BFLOAT16, 128, tile)
    # O stored from the accumulators: the per-tile layout and the "Q empty" barrier, so 224-key
    # tiles fit in 3 stages (a 16-bit persistent tile adds O's own staging tile).
    per_tile = schedule.HopperTile(192, 2, 3, "", tma=True)
    assert tile.smem_bytes(128, 1) - per_tile.smem_bytes(128, 1) == 8
    wide = schedule.HopperTile(224, 2, 3, "", tma=True, persistent=True, wg_epilogue=True)
    assert wide.smem_bytes(128, 1) <= 232448
    assert tile.smem_bytes(128, 2) - per_tile.smem_bytes(128, 2) == 128 * 128 * 2 + 8


def _stub_launches(monkeypatch):
    launches = []
    monkeypatch.setattr(fp8_forward, "get_function", lambda spec: lambda grid, block, args, shared_mem: launches.append(
        (spec, grid, block, args, shared_mem)))
    monkeypatch.setattr(fp8_forward, "pack_vt", lambda v4: v4)
    monkeypatch.setattr(fp8_forward.tma, "bhsd_map", lambda a, rows: ("map", a, rows))
    monkeypatch.setattr(fp8_forward, "vt_map", lambda vt, hd: ("vtmap", vt, hd))
    return launches


def test_band_launch_arguments_follow_the_kernel_signature(monkeypatch):
    # A window on a batch: the plain kernel's arguments with the band's bounds (hi, lo, align:
    # operands.band_offsets) and null offsets; grid (query tiles, heads, batch).
    launches = _stub_launches(monkeypatch)
    p = types.SimpleNamespace(batch=2, hq=4, hkv=2, nq=300, nk=333, d=128, group=2, scale=0.1, causal="top_left",
                              window=(20, 5))
    plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16)
    q4, k4 = np.zeros((2, 4, 300, 128), np.uint8), np.zeros((2, 2, 333, 128), np.uint8)
    o4, lse3 = np.zeros((2, 4, 300, 128), np.uint16), np.zeros((2, 4, 300), np.float32)
    kd = np.ones((2, 2), np.float32)
    fp8_forward.launch(plan, p, q4, k4, k4, o4, lse3, (None, kd, None))
    (spec, grid, block, args, smem), = launches
    t = plan.tile
    assert spec is plan.spec and grid == (-(-300 // t.block_m), 4, 2) and smem == spec.smem_bytes
    names = _kernel_parameters("attn_fwd_wgmma_tma_fp8_band")
    assert len(args) == len(names) == 28
    a = dict(zip(names, args))
    assert (a["nq"], a["nk"], a["d"], a["group"]) == (300, 333, 128, 2)
    assert (a["hi_off"], a["lo_off"], a["align"]) == (0, -20, 0)  # top-left: j <= i, j >= i - 20
    assert a["scale_log2"] == np.float32(0.1 * LOG2E) and a["cu_q"] == 0 and a["cu_k"] == 0
    assert a["q_descale"] == 0 and np.shares_memory(a["k_descale"], kd) and (a["kd_sb"], a["kd_sh"]) == (2, 1)
    # Packed: the whole (1, H, total, d) arrays' maps, lse (1, Hq, total_q), grid z the sequences
    # (in chunks of 65535, each with its offsets from its first sequence on), per-tensor descales.
    launches.clear()
    p = types.SimpleNamespace(batch=1, hq=4, hkv=2, nq=70, nk=90, d=128, group=2, scale=0.1, causal=None,
                              window=None)
    plan = dispatch.fp8_forward_plan(p, SM90, BFLOAT16, packed=True)
    q4, k4 = np.zeros((1, 4, 70, 128), np.uint8), np.zeros((1, 2, 90, 128), np.uint8)
    o4, lse3 = np.zeros((1, 4, 70, 128), np.uint16), np.zeros((1, 4, 70), np.float32)
    n_seq = 70000
    cu_q, cu_k = np.zeros(n_seq + 1, np.int32), np.zeros(n_seq + 1, np.int32)
    one = np.ones((), np.float32)
    fp8_forward.launch(plan, p, q4, k4, k4, o4, lse3, (one, one, None), cu_seqlens=(cu_q, cu_k), max_seqlen_q=129)
    assert [g for _, g, _, _, _ in launches] == [(2, 4, 65535), (2, 4, n_seq - 65535)]
    for (_, _, _, args, _), s0 in zip(launches, (0, 65535)):
        a = dict(zip(names, args))
        assert a["tmap_q"][1] is q4 and a["tmap_k"][1] is k4 and a["tmap_vt"][1] is k4 and a["lse"] is lse3
        assert a["cu_q"].shape == (n_seq + 1 - s0,) and a["cu_k"].shape == (n_seq + 1 - s0,)
        assert (a["hi_off"], a["lo_off"], a["align"]) == (2**31 - 1, -(2**31 - 1), 1)
        assert a["q_descale"] is one and (a["qd_sb"], a["qd_sh"], a["qd_shk"]) == (0, 0, 0)
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        fp8_forward.launch(plan, p, q4, k4, k4, o4, lse3, (None,) * 3, cu_seqlens=(cu_q, cu_k))


def test_vt_key_order_turns_the_accumulator_into_the_a_fragment():
    # The documented layouts (PTX ISA): the float32 accumulator gives lane 4 g + c of a warp the
    # columns 8 j + 2 c + e (j < 4, e < 2) of rows g, g + 8 of each 32-key group; register r of
    # the k32 e4m3 A fragment holds row g + 8 (r & 1) at k = 16 (r >> 1) + 4 c + i. The kernel
    # packs byte i of register r from block KEY >> 3, element (KEY & 1) + 2 (r & 1), KEY =
    # KEY_OF_POS[16 (r >> 1) + i] (hopper/fwd_fp8.cuh), and vt holds key KEY_OF_POS[p] at position
    # p: then A[row, p] = P[row, KEY_OF_POS[p]], so A vt = P V.
    key = fp8_forward.KEY_OF_POS
    assert sorted(key) == list(range(32))
    rng = np.random.default_rng(0)
    P, V = rng.standard_normal((16, 32)), rng.standard_normal((32, 8))
    A = np.full((16, 32), np.nan)
    for g in range(8):
        for c in range(4):
            acc = {(8 * j + 2 * c + e, row): P[row, 8 * j + 2 * c + e]
                   for j in range(4) for e in range(2) for row in (g, g + 8)}
            for r in range(4):
                row = g + 8 * (r & 1)
                for i in range(4):
                    kk = key[16 * (r >> 1) + i]
                    col = 8 * (kk >> 3) + 2 * c + (kk & 1)  # the accumulator element the kernel reads
                    A[row, 16 * (r >> 1) + 4 * c + i] = acc[(col, row)]
    vt = V[list(key)]  # vt's rows (as B's K) in KEY_OF_POS order
    np.testing.assert_allclose(A @ vt, P @ V, rtol=1e-12)
    np.testing.assert_array_equal(A, P[:, list(key)])


def test_the_vt_order_is_the_kernels():
    # KEY_OF_POS spells cuda_src/fp8_keys.cuh's formula (the kernels' one source of it).
    text = (ROOT / "cuda_src" / "fp8_keys.cuh").read_text()
    expr = re.search(r"kFp8KeyOfPos\(int p\) \{\s*return (.*?);", text, re.S).group(1)
    assert tuple(eval(expr, {"p": p}) for p in range(32)) == fp8_forward.KEY_OF_POS  # noqa: S307 - our own source
