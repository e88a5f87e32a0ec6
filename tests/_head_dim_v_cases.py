"""Shared by tests/test_head_dim_v.py (NumPy) and tests/test_gpu_head_dim_v.py (CuPy): attention
with v's head dim unlike q's and k's, forward and backward, against the float64 reference by the
accuracy rule. ``xp``: the array library the calls run on (inputs are made with NumPy)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, random_array, to_numpy

WIDTHS = [(192, 128), (128, 64), (64, 128), (40, 24)]  # MLA prefill; narrower v; wider v; d not a multiple of 16


def matrix(test):
    """The forward/backward test matrix both backends run: (d, dv), layout, mask, dtype."""
    marks = [pytest.mark.parametrize("d,dv", WIDTHS), pytest.mark.parametrize("layout", ["bhsd", "bshd"]),
             pytest.mark.parametrize("causal", [False, True]),
             pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32], ids=["f16", "bf16", "f32"])]
    for mark in marks:
        test = mark(test)
    return test


def shapes(layout, b, hq, hkv, nq, nk, d, dv):
    if layout == "bhsd":
        return (b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)
    return (b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, dv)


def poisoned(xp, shape, dtype):
    a = xp.empty(shape, dtype=dtype)
    bits = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    a.view(bits).fill({2: 0x7FFF, 4: 0x7FFFFFFF}[np.dtype(dtype).itemsize])  # NaN in every float dtype
    return a


def to_xp(xp, a):
    if xp is np:
        return a
    bits = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return xp.asarray(np.ascontiguousarray(a).view(bits)).view(a.dtype)


def check_forward(rng, xp, dtype, layout, causal, d, dv, *, batch=2, hq=4, hkv=2, nq=70, nk=90, **opts):
    """The forward of fresh random inputs into a poisoned ``out`` against the float64 reference;
    returns the NumPy inputs, their ``xp`` copies and the outputs (o, lse) for the backward."""
    sq, sk, sv = shapes(layout, batch, hq, hkv, nq, nk, d, dv)
    q, k, v = (random_array(rng, s, dtype) for s in (sq, sk, sv))
    qx, kx, vx = (to_xp(xp, a) for a in (q, k, v))
    o_shape = sq[:-1] + (dv,)
    out = poisoned(xp, o_shape, dtype)
    o, lse = cuflash.attention(qx, kx, vx, causal=causal, layout=layout, return_lse=True, out=out, **opts)
    assert o is out and tuple(o.shape) == o_shape
    assert_forward_accurate(to_numpy(o), to_numpy(lse), q, k, v, causal=causal, layout=layout, **opts)
    return (q, k, v), (qx, kx, vx), (o, lse)


def check_forward_backward(rng, xp, dtype, layout, causal, d, dv, *, hq=4, hkv=2, nq=70, nk=90, **opts):
    (q, k, v), (qx, kx, vx), (o, lse) = check_forward(rng, xp, dtype, layout, causal, d, dv, hq=hq, hkv=hkv, nq=nq,
                                                      nk=nk, **opts)
    do = random_array(rng, tuple(o.shape), dtype)
    dox = to_xp(xp, do)
    grads = tuple(poisoned(xp, a.shape, dtype) for a in (q, k, v))
    got = cuflash.attention_backward(dox, qx, kx, vx, o, lse, causal=causal, layout=layout, out=grads, **opts)
    assert all(g is w for g, w in zip(got, grads))
    assert_backward_accurate([to_numpy(g) for g in grads], do, q, k, v, causal=causal, layout=layout, **opts)
