"""Shared by tests/test_distributed.py (gloo processes) and the one-process ring simulations
(CPU and GPU): the cases, and the accuracy checks of a reassembled result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from _merge_cases import _gradients_for_statistics

from cuflash.testing import (assert_backward_accurate, assert_forward_accurate, assert_lse_within_bound,
                             faithful_backward_realizations, faithful_realizations, lse_bound, reference64,
                             reference64_backward, visibility)

NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def cases_for(world, seed):
    base = dict(b=1, d=16, layout="bhsd", balance="zigzag", mode="ring")
    cases = [
        dict(base, hq=2, hkv=2, n=4 * world + 3, dtype="float32", causal=True),  # odd length
        dict(base, hq=2, hkv=2, n=6 * world, dtype="bfloat16", causal=True, layout="bshd"),
        dict(base, hq=2, hkv=2, n=5 * world + 1, dtype="float16", causal=False),
        dict(base, hq=4, hkv=2, n=4 * world + 1, dtype="bfloat16", causal=True),  # GQA on the ring
        dict(base, hq=4, hkv=1, n=4 * world + 2, dtype="float32", causal=True, mode="auto"),  # MQA: all-gather
        dict(base, hq=4, hkv=2, n=3 * world + 2, dtype="float16", causal=False, mode="allgather", layout="bshd"),
        dict(base, hq=2, hkv=1, n=4 * world - 1, dtype="float32", causal=False, balance="contiguous"),
        dict(base, hq=2, hkv=2, n=2 * world - 1, dtype="float32", causal=True),  # an empty chunk
        dict(base, hq=4, hkv=2, n=4 * world + 1, dtype="bfloat16", causal=True, dv=8),  # v narrower than q, k
    ]
    for i, c in enumerate(cases):
        c["seed"] = seed + i
    return cases


def check_case(case, world, inputs, results):
    """The accuracy rule for one case's reassembled (o, lse, dq, dk, dv) (NumPy float32 arrays)."""
    dt = NUMPY[case["dtype"]]
    q, k, v, do = inputs
    o, lse, dq, dk, dv = results
    kw = dict(causal=case["causal"], layout=case["layout"])
    try:
        if dt == np.float32:  # the float32 lse of the interface sets a floor (docs/merging.md)
            _float32_checks(o, lse, (dq, dk, dv), do, q, k, v, **kw)
        else:
            assert_forward_accurate(o.astype(dt), lse, q, k, v, **kw)
            assert_backward_accurate((dq.astype(dt), dk.astype(dt), dv.astype(dt)), do, q, k, v, **kw)
    except AssertionError as e:
        raise AssertionError(f"P={world}, case {case}: {e}") from None


def _bhsd(a, layout):
    return a if layout == "bhsd" else np.swapaxes(a, 1, 2)


def _float32_checks(o, lse, grads, do, q, k, v, *, causal, layout):
    """float32: the rule, plus what float32 lse costs.

    Forward: each partial lse is rounded once from float64 (the NumPy backend's float32 path), so
    it is off by delta_i <= 2^-24 |lse_p| <= 2^-24 (max_j |s_ij| + log N_i) (lse_p lies between the
    part's largest score and that plus log of its key count); the weights exp(lse_p - m) then move
    the merged row by at most 2 delta_i max_j |v_j - o_i| (o_p is a convex combination of the v_j).
    Backward: the gradients are exact for the global o and lse it is given
    (_merge_cases._gradients_for_statistics); those differ from the exact ones by their rounding."""
    kw = dict(causal=causal, layout=layout)
    ref_o, ref_lse = reference64(q, k, v, **kw)
    assert_lse_within_bound("lse", lse, ref_lse, lse_bound(q, k, v, **kw))
    q4, k4, v4, o4, r4 = (_bhsd(a.astype(np.float64), layout) for a in (q, k, v, o, ref_o))
    g = q4.shape[1] // k4.shape[1]
    k4, v4 = np.repeat(k4, g, axis=1), np.repeat(v4, g, axis=1)
    vis = visibility(causal, q4.shape[2], k4.shape[2])
    s = np.abs(np.matmul(q4, k4.swapaxes(-1, -2))) / np.sqrt(q4.shape[-1])
    delta = 2.0**-24 * (np.where(vis, s, 0).max(axis=-1) + np.log(np.maximum(vis.sum(axis=-1), 1)))
    # max over visible j of |v_j - o_i| (by columns: the extremes of v over the keys row i sees;
    # one sequence attending to itself, so causal rows see a prefix)
    if causal:
        vmax, vmin = np.maximum.accumulate(v4, axis=2), np.minimum.accumulate(v4, axis=2)
    else:
        vmax, vmin = (np.broadcast_to(f(v4, axis=2, keepdims=True), r4.shape) for f in (np.max, np.min))
    spread = np.maximum(vmax - r4, r4 - vmin).max(axis=-1)
    floor = 2 * delta * spread
    err = np.abs(o4 - r4).max()
    yard = max(np.abs(_bhsd(y.astype(np.float64), layout) - r4).max() for y in faithful_realizations(q, k, v, **kw))
    bound = 2 * yard + 2.0**-24 * np.abs(r4).max() + floor.max()
    assert err <= bound, f"o (float32): error {err:.3e} > bound {bound:.3e} (lse floor {floor.max():.3e})"
    ref = reference64_backward(do, q, k, v, **kw)
    given = _gradients_for_statistics(do, q, k, v, o, lse, **kw)
    yards = faithful_backward_realizations(do, q, k, v, **kw)
    for name, got, r, gv, ys in zip(("dq", "dk", "dv"), grads, ref, given, yards):
        err = np.abs(got - r).max()
        yard = max(np.abs(y - r).max() for y in ys)
        floor = np.abs(gv - r).max()
        bound = 2 * yard + 2.0**-24 * np.abs(r).max() + floor
        assert err <= bound, f"{name} (float32): error {err:.3e} > bound {bound:.3e} (given statistics {floor:.3e})"
