"""Randomized sweep of the NumPy backend (forward and backward) against the float64 reference.

On top of the fixed parameter cases: shapes, GQA groups, causal modes, sliding windows, layouts,
scales, large scores and tile sizes drawn at random from a fresh seed every run, for a wall-clock
budget (CUFLASH_SWEEP_SECONDS, default 12 s per test) and at least a minimum number of cases.
Outputs are poisoned with NaN before each launch; the rule and the visibility are the oracle's
(cuflash.testing). A failure prints the case and the seed (CUFLASH_SEED=<seed> replays it).
"""

import numpy as np

import cuflash
from cuflash.backends import numpy as cpu
from cuflash.core import problem
from cuflash.core.layout import to_bhsd
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, random_array, random_inputs

from _sweep import budget_seconds, run_sweep


def _forward(case, q, k, v):
    p = problem.validate_forward(q, k, v, causal=case.causal, scale=case.scale, layout=case.layout, window=case.window)
    o = np.full(p.q_shape(), np.nan, dtype=p.dtype)
    lse = np.full(p.lse_shape(), np.nan, dtype=np.float32)
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    cpu.forward(p, q4, k4, v4, to_bhsd(o, p, p.hq, p.nq), lse.reshape(p.batch, p.hq, p.nq),
                block_m=case.block_m, block_n=case.block_n)
    return p, o, lse


def _backward(p, case, do, q, k, v, o, lse):
    dq = np.full(p.q_shape(), np.nan, dtype=p.dtype)
    dk = np.full(p.kv_shape(), np.nan, dtype=p.dtype)
    dv = np.full(p.kv_shape(), np.nan, dtype=p.dtype)
    q_side = [to_bhsd(a, p, p.hq, p.nq) for a in (do, q, o)]
    k_side = [to_bhsd(a, p, p.hkv, p.nk) for a in (k, v, dk, dv)]
    cpu.backward(p, q_side[0], q_side[1], k_side[0], k_side[1], q_side[2], lse.reshape(p.batch, p.hq, p.nq),
                 to_bhsd(dq, p, p.hq, p.nq), k_side[2], k_side[3], block_m=case.block_m, block_n=case.block_n)
    return dq, dk, dv


def check_case(rng, case):
    shape_q, shape_kv = case.shapes()
    q, k, v = random_inputs(rng, shape_q, shape_kv, case.dtype, case.input_scale)
    do = random_array(rng, shape_q, case.dtype)
    opts = dict(causal=case.causal, scale=case.scale, layout=case.layout, window=case.window)
    p, o, lse = _forward(case, q, k, v)
    assert_forward_accurate(o, lse, q, k, v, **opts)
    grads = _backward(p, case, do, q, k, v, o, lse)
    assert_backward_accurate(grads, do, q, k, v, **opts)


def test_random_sweep_backend(rng):
    cases = run_sweep(rng, check_case, seconds=budget_seconds(12), min_cases=20)
    assert len(cases) >= 20


def check_api_case(rng, case):
    """The public API (default tiles, its own dispatch) on the same kind of case."""
    shape_q, shape_kv = case.shapes()
    q, k, v = random_inputs(rng, shape_q, shape_kv, case.dtype, case.input_scale)
    do = random_array(rng, shape_q, case.dtype)
    opts = dict(causal=case.causal, scale=case.scale, layout=case.layout, window=case.window)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=out, **opts)
    assert o is out
    assert_forward_accurate(o, lse, q, k, v, **opts)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **opts)
    assert_backward_accurate(grads, do, q, k, v, **opts)


def test_random_sweep_api(rng):
    cases = run_sweep(rng, check_api_case, seconds=budget_seconds(6), min_cases=10, blocks=False, max_n=300)
    assert len(cases) >= 10
