"""CUDA backward vs float64 reference gradients (the accuracy rule of cuflash.testing, docs/testing.md).

Inputs are fresh random values; the forward's o and lse come from cuflash itself (what a user
passes), the reference gradients are float64 from the same low-precision inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.kernels import device
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import assert_backward_accurate, poison, poisoned_allocations, random_inputs, recorded_allocations, to_numpy
from cuflash.plan import backward as plan_backward
from cuflash.plan import hopper as plan_hopper

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


def _run(rng, b, hq, hkv, nq, nk, d, dtype, causal, *, scale=1.0, deterministic=False, layout="bhsd"):
    if layout == "bhsd":
        sq, skv = (b, hq, nq, d), (b, hkv, nk, d)
    else:
        sq, skv = (b, nq, hq, d), (b, nk, hkv, d)
    q, k, v = random_inputs(rng, sq, skv, dtype, scale=scale)
    do = random_inputs(rng, sq, sq, dtype)[0]
    qg, kg, vg, dog = (cupy.asarray(a) for a in (q, k, v, do))
    before = [a.copy() for a in (qg, kg, vg, dog)]
    # Every output starts as NaN: o and lse (allocated inside, from a poisoning allocator), dq, dk, dv
    # (out=, poisoned here) and any workspace the calls allocate.
    o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal=causal, layout=layout, return_lse=True))
    out = tuple(poison(cupy.empty(a.shape, dtype=a.dtype)) for a in (qg, kg, vg))
    dq, dk, dv = poisoned_allocations(lambda: cuflash.attention_backward(
        dog, qg, kg, vg, o, lse, causal=causal, layout=layout, deterministic=deterministic, out=out))
    assert all(g is o_ for g, o_ in zip((dq, dk, dv), out))
    for a, a0 in zip((qg, kg, vg, dog), before):  # inputs untouched
        assert np.array_equal(to_numpy(a).view(np.uint16), to_numpy(a0).view(np.uint16))
    grads = tuple(to_numpy(g) for g in (dq, dk, dv))
    assert_backward_accurate(grads, do, q, k, v, causal=causal, layout=layout)
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 40, 64, 96, 111, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
def test_backward_head_dims(kernels, dtype, d, causal):
    rng = np.random.default_rng([d, len(str(causal)), dtype.itemsize, 11])
    _run(rng, 1, 2, 2, 97, 130, d, dtype, causal)


# (1, 239) top-left: the single query sees exactly one key, so P = 1 and the exact dq and dk are 0;
# the kernel's D (from the bf16 O) and dP (tensor-core float32 sum) round in different orders and
# leave ~1e-7 |dO||v|. assert_backward_accurate holds dv to the rule and dq, dk to the a-priori
# bound of that cancellation (cuflash.testing.assert_single_key_gradients), keys nobody sees to 0.


@pytest.mark.parametrize("nq,nk", [(1, 239), (113, 203), (203, 113), (257, 255), (255, 257)])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
def test_backward_lengths(kernels, nq, nk, causal):
    rng = np.random.default_rng([nq, nk, len(str(causal))])
    _run(rng, 2, 2, 2, nq, nk, 64, BFLOAT16, causal)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_gqa(kernels, hq, hkv, deterministic):
    rng = np.random.default_rng([hq, hkv, int(deterministic)])
    _run(rng, 2, hq, hkv, 150, 170, 128, BFLOAT16, True, deterministic=deterministic)


@pytest.mark.parametrize("n", [1, 2, 5, 17, 128, 1025])
@pytest.mark.parametrize("scale", [5.0, 3.0])
def test_backward_large_scores_no_nan(kernels, n, scale):
    # The overflow case that once broke FlashAttention: large logits, short non-tile lengths.
    rng = np.random.default_rng([n, int(scale)])
    grads = _run(rng, 1, 2, 2, n, n, 64, FLOAT16, True, scale=scale)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)


def test_backward_bshd_layout_and_fully_masked_rows(kernels):
    rng = np.random.default_rng(5)
    # Nq > Nk with bottom-right alignment: the first Nq - Nk rows see no key, dq there must be 0.
    dq, dk, dv = _run(rng, 1, 4, 2, 150, 60, 64, BFLOAT16, "bottom_right", layout="bshd")
    assert np.all(dq[:, :90].astype(np.float32) == 0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_deterministic_bitwise(kernels, d):
    rng = np.random.default_rng(d)
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (2, 4, 300, d), (2, 4, 300, d), BFLOAT16))
    do = cupy.asarray(random_inputs(rng, (2, 4, 300, d), (2, 4, 300, d), BFLOAT16)[0])
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    first = [to_numpy(g).view(np.uint16) for g in cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)]
    for _ in range(100):
        again = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert np.array_equal(a, to_numpy(b).view(np.uint16))


def test_backward_workspace_is_dq_accumulator_and_d():
    """Every device allocation the backward makes, recorded through CuPy's allocator hook."""
    from cuflash.plan import schedule
    from cuflash.core.problem import validate_forward

    rng = np.random.default_rng(3)
    b, h, n, d = 2, 4, 1000, 128
    q, k, v = (cupy.asarray(a) for a in random_inputs(rng, (b, h, n, d), (b, h, n, d), BFLOAT16))
    do = cupy.asarray(random_inputs(rng, (b, h, n, d), (b, h, n, d), BFLOAT16)[0])
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse)  # compile and warm up
    grads, sizes = recorded_allocations(lambda: cuflash.attention_backward(do, q, k, v, o, lse))
    grad_bytes = b * h * n * d * 2
    # dq, dk, dv; the float32 dQ accumulator (128-wide rows; on Hopper the warp-specialized kernel's
    # 64 x 64 chunks pad each head's 1000 rows to 1024) and D.
    hopper_ws = plan_hopper.backward_applies(validate_forward(q, k, v), True, device.current()) and schedule.hopper_backward_tile(128, False).ws
    acc_rows = 1024 if hopper_ws else n
    expected = [grad_bytes] * 3 + [b * h * acc_rows * 128 * 4, b * h * n * 4]
    assert sorted(sizes) == sorted(expected), sizes
    assert plan_backward.workspace_bytes(validate_forward(q, k, v), hopper_ws) == b * h * acc_rows * 128 * 4 + b * h * n * 4
    del grads
