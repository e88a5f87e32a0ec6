"""The float32 forward's one rounding: attn_fwd_f32 computes in float64, so its score scale must
arrive as a double. Rounded to float32 (as the 16-bit kernels take it) it moved every score by up
to 2^-24 relative and lse by up to an ulp beyond its final rounding (4% of seeds failed the lse
bound on the H200). Checked on the CPU: the kernel's parameter type in its PTX, and what the
launcher passes."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.core import problem
from cuflash.core.arrays import FLOAT16, FLOAT32
from cuflash.kernels import forward as forward_kernels
from cuflash.plan import forward as plan_forward
from test_fp32_backward import _ptx_params  # the kernel's PTX parameter types


def _launch_args(monkeypatch, dtype):
    calls = []
    monkeypatch.setattr(forward_kernels, "get_function", lambda spec: lambda grid, block, args, **kw: calls.append(args))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, n, 96)).astype(dtype) for n in (5, 7, 7))
    p = problem.validate_forward(q, k, v, causal="top_left", scale=0.3)
    o, lse = np.empty_like(q), np.empty((1, 2, 5), np.float32)
    spec, tile = plan_forward.forward_spec(p.dtype, p.d, True, False)
    forward_kernels.launch_forward(spec, tile.block_m, p, q, k, v, o, lse)
    (args,) = calls
    return spec, args[-1], p


def test_launcher_passes_the_float32_kernel_a_double_scale(monkeypatch):
    spec, scale_log2, p = _launch_args(monkeypatch, FLOAT32)
    assert spec.source == "attn_fwd_fp32.cu"
    assert type(scale_log2) is np.float64
    assert scale_log2 == p.scale * 1.4426950408889634


def test_launcher_passes_16_bit_kernels_a_float_scale(monkeypatch):
    spec, scale_log2, _ = _launch_args(monkeypatch, FLOAT16)
    assert spec.source != "attn_fwd_fp32.cu"
    assert type(scale_log2) is np.float32


def test_float32_kernel_takes_its_scale_as_a_double():
    pytest.importorskip("cuda.bindings.nvrtc")
    spec, _ = plan_forward.forward_spec(FLOAT32, 96, True, False)
    assert _ptx_params(spec)[-1] == "f64", f"last parameter of {spec.expression}"
