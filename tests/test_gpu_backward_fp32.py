"""float32 GPU backward (cuda_src/attn_bwd_fp32.cu, float64 arithmetic) vs the float64 reference
gradients: <= 3x the naive-in-float32 error + one rounding, as every dtype.

Inputs are fresh random values; o and lse come from cuflash's own float32 forward (what a user
passes); the outputs are NaN-poisoned through out= so that an unwritten element fails."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import FLOAT32
from cuflash.testing import assert_backward_accurate, random_inputs, recorded_allocations, to_numpy
from cuflash.plan import backward as plan_backward

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


def _run(rng, b, hq, hkv, nq, nk, d, causal, *, scale=1.0, layout="bhsd", deterministic=False, view=False):
    sq, skv = ((b, hq, nq, d), (b, hkv, nk, d)) if layout == "bhsd" else ((b, nq, hq, d), (b, nk, hkv, d))
    q, k, v = random_inputs(rng, sq, skv, FLOAT32, scale=scale)
    do = random_inputs(rng, sq, sq, FLOAT32)[0]
    qg, kg, vg, dog = (cupy.asarray(a) for a in (q, k, v, do))
    if view:  # strided views: every other row of a wider buffer (no copies expected)
        qg, kg, vg, dog = (_spread(a) for a in (qg, kg, vg, dog))
    before = [a.copy() for a in (qg, kg, vg, dog)]
    o, lse = cuflash.attention(qg, kg, vg, causal=causal, layout=layout, return_lse=True)
    out = tuple(cupy.full(a.shape, np.nan, dtype=np.float32) for a in (qg, kg, vg))
    dq, dk, dv = cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal, layout=layout,
                                            deterministic=deterministic, out=out)
    cupy.cuda.Device().synchronize()
    assert all(g is o_ for g, o_ in zip((dq, dk, dv), out))
    for a, a0 in zip((qg, kg, vg, dog), before):  # inputs untouched
        assert cupy.array_equal(a.view(np.uint32), a0.view(np.uint32))
    grads = tuple(to_numpy(g) for g in (dq, dk, dv))
    assert_backward_accurate(grads, do, q, k, v, causal=causal, layout=layout)
    return grads


def _spread(a):
    wide = cupy.empty(a.shape[:-2] + (2 * a.shape[-2], a.shape[-1]), dtype=a.dtype)
    view = wide[..., ::2, :]
    view[...] = a
    return view


@pytest.mark.parametrize("d", [32, 40, 64, 96, 111, 128, 192, 256])
@pytest.mark.parametrize("causal", CAUSAL)
def test_head_dims(kernels, d, causal):
    # kernels: "auto" runs the float64 tensor-core kernels on sm_90 (d <= 128), "mma_sync" the FMA ones
    _run(np.random.default_rng([d, len(str(causal)), 41]), 1, 2, 2, 97, 130, d, causal)


@pytest.mark.parametrize("nq,nk", [(1, 239), (113, 203), (203, 113), (257, 255), (255, 257), (64, 64)])
@pytest.mark.parametrize("causal", CAUSAL)
def test_lengths(kernels, nq, nk, causal):
    # (1, 239) top-left: one visible key, dq analytically 0 - exact here (P = 1 and D = dP in float64).
    dq, _, _ = _run(np.random.default_rng([nq, nk, len(str(causal)), 42]), 2, 2, 2, nq, nk, 64, causal)
    if (nq, nk, causal) == (1, 239, "top_left"):
        assert np.all(dq == 0)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (4, 4)])
def test_gqa(kernels, hq, hkv):
    _run(np.random.default_rng([hq, hkv, 43]), 2, hq, hkv, 150, 170, 128, "bottom_right")


@pytest.mark.parametrize("n", [1, 2, 5, 17, 128, 1025])
@pytest.mark.parametrize("scale", [5.0, 3.0])
def test_large_scores(kernels, n, scale):
    # Large logits (|lse| up to ~100, where the saved float32 lse is off by ~4e-6 absolute: the
    # reason the kernels recompute it), short non-tile lengths.
    grads = _run(np.random.default_rng([n, int(scale), 44]), 1, 2, 2, n, n, 64, True, scale=scale)
    assert all(np.isfinite(g).all() for g in grads)


def test_bshd_strided_and_fully_masked_rows(kernels):
    # Nq > Nk bottom-right: the first Nq - Nk rows see no key, their dq is 0.
    dq, _, _ = _run(np.random.default_rng(45), 1, 4, 2, 150, 60, 64, "bottom_right", layout="bshd")
    assert np.all(dq[:, :90] == 0)
    _run(np.random.default_rng(46), 2, 2, 1, 77, 91, 128, False, view=True)


def test_empty_queries_give_zero_dk_dv():
    rng = np.random.default_rng(47)
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (1, 2, 0, 64), (1, 2, 33, 64), FLOAT32))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    out = (cupy.empty_like(q), cupy.full(k.shape, np.nan, np.float32), cupy.full(v.shape, np.nan, np.float32))
    _, dk, dv = cuflash.attention_backward(cupy.empty_like(q), q, k, v, o, lse, out=out)
    assert bool((dk == 0).all()) and bool((dv == 0).all())


def test_bitwise_reproducible(kernels):
    # No atomics: every run, deterministic or not, gives the same bits.
    rng = np.random.default_rng(48)
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (2, 4, 300, 128), (2, 2, 300, 128), FLOAT32))
    do = cupy.asarray(random_inputs(rng, (2, 4, 300, 128), (2, 4, 300, 128), FLOAT32)[0])
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    first = [g.copy() for g in cuflash.attention_backward(do, q, k, v, o, lse, causal=True)]
    for det in (False, True) * 10:
        for a, b in zip(first, cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=det)):
            assert cupy.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_workspace_is_float64_lse_and_d():
    """Every device allocation the backward makes, recorded through CuPy's allocator hook."""
    from cuflash.core.problem import validate_forward

    rng = np.random.default_rng(49)
    b, h, n, d = 2, 4, 1000, 128
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (b, h, n, d), (b, h, n, d), FLOAT32))
    do = cupy.asarray(random_inputs(rng, (b, h, n, d), (b, h, n, d), FLOAT32)[0])
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse)  # compile and warm up
    grads, sizes = recorded_allocations(lambda: cuflash.attention_backward(do, q, k, v, o, lse))
    grad_bytes = b * h * n * d * 4
    assert sorted(sizes) == sorted([grad_bytes] * 3 + [b * h * n * 8] * 2), sizes
    assert plan_backward.workspace_bytes(validate_forward(q, k, v)) == 2 * b * h * n * 8
    del grads


def test_window_and_varlen_raise():
    rng = np.random.default_rng(50)
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (1, 2, 40, 64), (1, 2, 40, 64), FLOAT32))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="float32 GPU inputs"):
        cuflash.attention_backward(cupy.ones_like(q), q, k, v, o, lse, window=(8, 0))
