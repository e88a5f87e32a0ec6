"""The float32 GPU backward's plan, checked without a GPU: which kernels run, their shared memory,
the arguments the launcher passes against the kernels' PTX parameters, and the accounting.
(The numbers themselves: tests/test_gpu_backward_fp32.py on the device.)"""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
from _targets import SM80, SM90, on_target

import cuflash
from cuflash.kernels import build
from cuflash.kernels import fp32 as fp32_kernels
from cuflash.core import problem
from cuflash.plan import schedule
from cuflash.core.arrays import FLOAT32
from cuflash.backends import cuda
from cuflash.kernels import forward as forward_kernels
from cuflash.plan import backward as plan_backward
from cuflash.plan import forward as plan_forward
from cuflash.plan import fp32 as plan_fp32


def test_float32_backward_runs_the_float64_kernels():
    specs, hd, t = plan_backward.backward_specs(FLOAT32, 100, True, True, False)
    assert hd == 128 and t == plan_fp32.BACKWARD_TILES_FP32[128]
    assert specs["dq"].expression == "attn_bwd_f32_dq<128, 64, 32, 256, true>"
    assert specs["kv"].expression == "attn_bwd_f32_kv<128, 32, 32, 256, true>"
    # deterministic or not: the same kernels (no atomics either way)
    assert plan_backward.backward_specs(FLOAT32, 100, True, True, True)[0] == specs
    with pytest.raises(NotImplementedError, match="float32 GPU inputs"):
        plan_backward.backward_specs(FLOAT32, 64, True, True, False, band=True)
    assert set(plan_fp32.all_backward_specs_fp32()) <= set(plan_backward.all_backward_specs())


@pytest.mark.parametrize("hd", sorted(plan_fp32.BACKWARD_TILES_FP32_MMA))
def test_tensor_core_shared_memory_by_hand(hd):
    # MmaF64Layout: rows of hd + 4 doubles; the K/V kernel's P^T hand-over is 4 pairs x (block_m / 8)
    # column tiles x 32 lanes x 4 doubles, then lse2 and D. The forward: Q, K, V.
    t, f = plan_fp32.BACKWARD_TILES_FP32_MMA[hd], plan_fp32.FORWARD_TILES_FP32_MMA[hd]
    ld = hd + 4
    assert ld % 16 == 4  # conflict-free fragment loads
    assert t.dq_smem_bytes(hd) == 8 * (2 * 64 + 2 * t.dq_block_n) * ld <= 232448
    assert t.kv_smem_bytes(hd) == 8 * ((2 * 64 + 2 * t.kv_block_m) * ld + 4 * (t.kv_block_m // 8) * 128 + 2 * t.kv_block_m) <= 232448
    assert f.smem_bytes(hd) == 8 * (f.block_m + 2 * f.block_n) * ld <= 232448
    assert (t.dq_block_m, t.kv_block_n, t.dq_threads, t.kv_threads) == (64, 64, 256, 256)
    assert t.dq_block_n % 16 == 0  # two warps take half of every key tile each
    assert f.block_m == 16 * (f.threads // 32)  # 16 query rows per warp
    assert t.dq_block_n % 8 == 0 and t.kv_block_m % 8 == 0 and f.block_n % 8 == 0


def test_tensor_core_kernels_where_they_run(monkeypatch):

    assert plan_fp32.mma_runs(100, SM90) and not plan_fp32.mma_runs(192, SM90) and not plan_fp32.mma_runs(100, SM80)
    spec, t = plan_forward.forward_spec(FLOAT32, 100, True, True, target=SM90)
    assert spec.expression == "attn_fwd_f32_mma<128, 32, 8, true>" and t.mma and spec.threads == 256
    assert plan_forward.forward_spec(FLOAT32, 100, True, True, target=SM80)[0].expression.startswith("attn_fwd_f32<128,")
    assert plan_forward.forward_spec(FLOAT32, 200, True, True, target=SM90)[0].expression.startswith("attn_fwd_f32<256,")
    specs, _, _ = plan_backward.backward_specs(FLOAT32, 64, False, True, False, target=SM90)
    assert specs["dq"].expression == "attn_bwd_f32_mma_dq<64, 32, false>"
    assert specs["kv"].expression == "attn_bwd_f32_mma_kv<64, 32, false>" and specs["kv"].threads == 256
    monkeypatch.setenv("CUFLASH_KERNELS", "mma_sync")  # the Hopper kernels off: the FMA ones
    assert not plan_fp32.mma_runs(100, SM90)
    assert plan_forward.forward_spec(FLOAT32, 100, True, True, target=SM90)[0].expression.startswith("attn_fwd_f32<128,")
    # CI compiles both families; the accounting models the H200's
    names = {s.expression for s in plan_forward.all_forward_specs()} | {s.expression for s in plan_backward.all_backward_specs()}
    assert {"attn_fwd_f32_mma<128, 32, 8, true>", "attn_bwd_f32_mma_kv<128, 32, true>", "attn_fwd_f32<128, 64, 32, 256, true>"} <= names
    monkeypatch.delenv("CUFLASH_KERNELS")
    assert cuflash.accounting.backward_launch("float32", 128).source.startswith("attn_bwd_f32_mma_kv")


@pytest.mark.parametrize("hd", schedule.HEAD_DIM_BUCKETS)
def test_shared_memory_by_hand(hd):
    # float64 tiles, rows of hd + 2 doubles; product tiles of cols + 2; the K/V kernel's lse2 and D.
    t = plan_fp32.BACKWARD_TILES_FP32[hd]
    ld = hd + 2
    dq = 8 * ((2 * t.dq_block_m + 2 * t.dq_block_n) * ld + t.dq_block_m * (t.dq_block_n + 2))
    kv = 8 * ((2 * t.kv_block_n + 2 * t.kv_block_m) * ld + 2 * t.kv_block_n * (t.kv_block_m + 2) + 2 * t.kv_block_m)
    assert t.dq_smem_bytes(hd) == dq <= 232448
    assert t.kv_smem_bytes(hd) == kv <= 232448
    # the layout's constraints (f64_tile.cuh's static_asserts): whole 8-lane row groups, pairs of columns
    for rows, cols in ((t.dq_block_m, t.dq_block_n), (t.kv_block_n, t.kv_block_m)):
        assert rows % (t.threads // 8) == 0 and cols % 16 == 0
        assert (rows * hd) % t.threads == 0 and (cols * hd) % t.threads == 0


def _ptx_params(spec):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    _, prog = nvrtc.nvrtcCreateProgram(build.load_source(spec.source).encode(), spec.source.encode(), 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, spec.expression.encode())
        opts = [o.encode() for o in build.BASE_OPTIONS + ("-arch=sm_90a",)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        _, lowered = nvrtc.nvrtcGetLoweredName(prog, spec.expression.encode())
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetPTX(prog, buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ptx = buf.decode(errors="replace")
    body = re.search(r"\.entry\s+" + re.escape(lowered.decode()) + r"\s*\(([^)]*)\)", ptx).group(1)
    return re.findall(r"\.param\s+\.(\w+)", body)


def _kind(arg):
    if isinstance(arg, np.ndarray):
        return "u64"  # a pointer
    return {np.dtype(np.int64): "u64", np.dtype(np.int32): "u32", np.dtype(np.float64): "f64"}[np.asarray(arg).dtype]


@pytest.mark.parametrize("mma", [False, True], ids=["fma", "tensor-cores"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_launch_arguments_match_the_kernels(monkeypatch, causal, mma):
    """Every argument the launcher passes has the kernel's parameter type, in order (a stand-in
    CuPy allocates with NumPy; the launches are recorded, not run)."""
    def reduction(*_):  # the D of the given o: rowsum(do * o) in float64
        return lambda a, b, axis: (a.astype(np.float64) * b.astype(np.float64)).sum(axis=axis)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=np.empty, ascontiguousarray=np.ascontiguousarray,
                                                                   multiply=np.multiply, ReductionKernel=reduction))
    calls = []
    monkeypatch.setattr(fp32_kernels, "get_function", lambda spec: lambda grid, block, args, **kw: calls.append((spec, grid, block, args, kw)))
    on_target(monkeypatch, SM90 if mma else SM80)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 70, 96)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 90, 96)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    p = problem.validate_forward(q, k, v, causal=causal, scale=0.3)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(k)
    cuda.backward(p, do, q, k, v, np.zeros_like(q), np.zeros((2, 4, 70), np.float32), dq, dk, dv)
    kernels = ["attn_bwd_f32_mma_dq", "attn_bwd_f32_mma_kv"] if mma else ["attn_bwd_f32_dq", "attn_bwd_f32_kv"]
    assert [c[0].expression.split("<")[0] for c in calls] == kernels
    (dq_spec, dq_grid, dq_block, dq_args, dq_kw), (kv_spec, kv_grid, kv_block, kv_args, kv_kw) = calls
    t = (plan_fp32.BACKWARD_TILES_FP32_MMA if mma else plan_fp32.BACKWARD_TILES_FP32)[128]
    assert dq_grid == (-(-70 // t.dq_block_m), 4, 2) and kv_grid == (-(-90 // t.kv_block_n), 2, 2)
    assert (dq_block, kv_block) == ((t.dq_threads,), (t.kv_threads,))
    assert dq_kw["shared_mem"] == dq_spec.smem_bytes and kv_kw["shared_mem"] == kv_spec.smem_bytes
    for spec, args in ((dq_spec, dq_args), (kv_spec, kv_args)):
        assert [_kind(a) for a in args] == _ptx_params(spec), spec.expression
    # the scale reaches the float64 arithmetic unrounded; the workspace is float64
    assert dq_args[-2] == p.scale * 1.4426950408889634 and dq_args[-1] == p.scale
    assert dq_args[5].dtype == np.float64 and dq_args[5].shape == (2, 4, 70)
    assert np.shares_memory(kv_args[4], dq_args[5]) and np.shares_memory(kv_args[5], dq_args[6])  # lse2, D handed over


def test_accounting_matches_the_launch():
    p = problem.validate_forward(*(np.zeros((2, 4, 1000, 128), np.float32),) * 3)
    assert plan_backward.workspace_bytes(p) == plan_fp32.backward_workspace_bytes(p) == 2 * 8 * 2 * 4 * 1000
    r = cuflash.memory_report((2, 4, 1000, 128), (2, 4, 1000, 128), pass_="bwd", dtype="float32")
    ws = {e.name: e.bytes for e in r.entries if e.category == "workspace"}
    assert ws == {"LSE (float64)": 64000, "D": 64000}
    b = cuflash.accounting.backward_launch("float32", 128, causal=True)  # the modelled H200: tensor cores
    specs, _, _ = plan_fp32.backward_specs_fp32(128, True, plan_fp32.BACKWARD_TILES_FP32_MMA[128])
    assert (b.smem, b.dq_smem) == (specs["kv"].smem_bytes, specs["dq"].smem_bytes)
    m = cuflash.io_model((2, 4, 1000, 128), dtype="float32", pass_="bwd")
    names = {e.name for e in m.entries}
    assert "O (preprocess)" not in names and "LSE, D" in names
    assert {"O, dO (given D)", "LSE (given)"} <= names  # the given statistics, read once


@pytest.mark.parametrize("mma", [False, True], ids=["fma", "tensor-cores"])
def test_forward_launch_arguments_match_the_kernel(monkeypatch, mma):

    calls = []
    monkeypatch.setattr(forward_kernels, "get_function", lambda spec: lambda grid, block, args, **kw: calls.append((spec, args)))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in (5, 7, 7))
    p = problem.validate_forward(q, k, v, causal="top_left", scale=0.3)
    spec, tile = plan_forward.forward_spec(p.dtype, p.d, True, False, target=SM90 if mma else SM80)
    assert tile.mma == mma
    forward_kernels.launch_forward(spec, tile.block_m, p, q, k, v, np.empty_like(q), np.empty((1, 2, 5), np.float32))
    ((spec, args),) = calls
    assert [_kind(a) for a in args] == _ptx_params(spec), spec.expression
