"""The randomized sweep on the GPU: the CUDA backend (forward and backward) against the float64
reference, the twin of tests/test_random_sweep.py.

Cases are drawn from a fresh seed every run (tests/_sweep.py) for a wall-clock budget
(CUFLASH_SWEEP_SECONDS, default 60 s per test) and at least a minimum number of cases. Every
output (o, lse, dq, dk, dv) is poisoned with NaN bits before each launch; the inputs are compared
bit for bit afterwards. Both kernel families run (the ``kernels`` fixture). float32 draws no window
(not implemented on the GPU: NotImplementedError).
"""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.backends import cuda
from cuflash.core import problem
from cuflash.core.arrays import FLOAT32
from cuflash.core.layout import to_bhsd
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, random_array, random_inputs

from _sweep import budget_seconds, run_sweep
from test_gpu_forward import poisoned as _poisoned
from test_gpu_forward import raw as _raw
from test_gpu_forward import to_device as _to_device
from test_gpu_forward import to_host as _to_host

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

def check_case(rng, case):
    shape_q, shape_kv = case.shapes()
    hosts = random_inputs(rng, shape_q, shape_kv, case.dtype, case.input_scale)
    do_h = random_array(rng, shape_q, case.dtype)
    q, k, v, do = (_to_device(a) for a in (*hosts, do_h))
    before = [_raw(a).copy() for a in (q, k, v, do)]
    opts = dict(causal=case.causal, scale=case.scale, layout=case.layout, window=case.window)
    p = problem.validate_forward(q, k, v, **opts)
    o, lse = _poisoned(p.q_shape(), p.dtype), _poisoned(p.lse_shape(), FLOAT32)
    q4, o4, do4 = (to_bhsd(a, p, p.hq, p.nq) for a in (q, o, do))
    k4, v4 = (to_bhsd(a, p, p.hkv, p.nk) for a in (k, v))
    lse3 = lse.reshape(p.batch, p.hq, p.nq)
    cuda.forward(p, q4, k4, v4, o4, lse3)
    cupy.cuda.Device().synchronize()
    assert_forward_accurate(_to_host(o), _to_host(lse), *hosts, **opts)
    dq = _poisoned(p.q_shape(), p.dtype)
    dk, dv = _poisoned(p.kv_shape(), p.dtype), _poisoned(p.kv_shape(), p.dtype)
    cuda.backward(p, do4, q4, k4, v4, o4, lse3, to_bhsd(dq, p, p.hq, p.nq), to_bhsd(dk, p, p.hkv, p.nk),
                  to_bhsd(dv, p, p.hkv, p.nk), deterministic=bool(rng.integers(2)))
    cupy.cuda.Device().synchronize()
    for name, a, b in zip(("q", "k", "v", "do"), (q, k, v, do), before):
        assert bool(cupy.array_equal(_raw(a), b)), f"{name} was modified"
    assert_backward_accurate(tuple(_to_host(g) for g in (dq, dk, dv)), do_h, *hosts, **opts)


def test_gpu_random_sweep(kernels, rng):
    cases = run_sweep(rng, check_case, seconds=budget_seconds(60), min_cases=30, blocks=False, max_n=700,
                      head_dims=(8, 16, 32, 40, 64, 72, 96, 111, 128, 192, 256),
                      window_ok=lambda dtype: np.dtype(dtype) != FLOAT32)
    assert len(cases) >= 30
