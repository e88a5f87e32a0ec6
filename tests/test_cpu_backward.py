"""NumPy backend backward vs the float64 reference gradients, by the accuracy rule (cuflash.testing).

The float64 reference gradients are themselves checked against central finite differences of the
float64 reference forward. Gradients are poisoned with NaN before each run; inputs are compared
with copies afterwards.
"""

import numpy as np
import pytest

import cuflash
from cuflash.core import problem
from cuflash.backends import numpy as cpu
from cuflash.backends import reference
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16
from cuflash.core.layout import is_view_of, to_bhsd
from cuflash.testing import assert_backward_accurate, max_abs, random_array, random_inputs

DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(np.float32, id="f32")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


def seed_of(*params):
    """A seed that differs per parameter combination (stable across runs)."""
    return int.from_bytes(repr(params).encode(), "little") % (2**63)


def forward_inputs(seed, shape_q, shape_kv, dtype, input_scale=1.0, **kw):
    """Fresh q, k, v, do (inputs times input_scale) and the CPU forward's o, lse for them."""
    rng = np.random.default_rng(seed)
    q, k, v = random_inputs(rng, shape_q, shape_kv, dtype, input_scale)
    do = random_array(rng, shape_q, dtype)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    return do, q, k, v, o, lse


def run_cpu_backward(do, q, k, v, o, lse, *, causal=False, scale=None, layout="bhsd", block_m=None, block_n=None,
                     deterministic=False):
    """cpu.backward into NaN-poisoned dq, dk, dv; checks that no input was modified."""
    args = (do, q, k, v, o, lse)
    before = [a.copy() for a in args]
    p = problem.validate_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout)
    dq = np.full(p.q_shape(), np.nan, dtype=p.dtype)
    dk = np.full(p.kv_shape(), np.nan, dtype=p.dtype)
    dv = np.full(p.kv_shape(), np.nan, dtype=p.dtype)
    grads4 = (to_bhsd(dq, p, p.hq, p.nq), to_bhsd(dk, p, p.hkv, p.nk), to_bhsd(dv, p, p.hkv, p.nk))
    assert all(is_view_of(g4, g) for g4, g in zip(grads4, (dq, dk, dv)))
    do4, q4, o4 = (to_bhsd(a, p, p.hq, p.nq) for a in (do, q, o))
    k4, v4 = (to_bhsd(a, p, p.hkv, p.nk) for a in (k, v))
    lse3 = lse.reshape((p.batch, p.hq, p.nq))
    cpu.backward(p, do4, q4, k4, v4, o4, lse3, *grads4, deterministic=deterministic,
                 block_m=block_m, block_n=block_n)
    for name, a, b in zip(("do", "q", "k", "v", "o", "lse"), args, before):
        assert a.tobytes() == b.tobytes(), f"{name} was modified"
    return dq, dk, dv


def check(seed, shape_q, shape_kv, dtype, *, causal=False, scale=None, layout="bhsd", block_m=None, block_n=None,
          input_scale=1.0):
    do, q, k, v, o, lse = forward_inputs(seed, shape_q, shape_kv, dtype, input_scale, causal=causal, scale=scale,
                                         layout=layout)
    grads = run_cpu_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout,
                             block_m=block_m, block_n=block_n)
    # Rows that see one key only: dq, dk against an a-priori bound (cuflash.testing.assert_single_key_gradients).
    assert_backward_accurate(grads, do, q, k, v, causal=causal, scale=scale, layout=layout)
    return grads, (do, q, k, v, o, lse)


# ----------------------------------------------------------------------------- lengths, masks, dtypes

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("nq, nk", [(1, 239), (113, 203), (203, 113)])
def test_lengths_not_multiple_of_tile(dtype, causal, nq, nk):
    seed = seed_of("len", np.dtype(dtype).name, causal, nq, nk)
    check(seed, (1, 2, nq, 64), (1, 1, nk, 64), dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 40, 111, 128, 256])
def test_head_dims(dtype, d):
    bm, bn = schedule.cpu_blocks(d)
    check(seed_of("d", np.dtype(dtype).name, d), (1, 2, bm + 37, d), (1, 1, bn + 23, d), dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (7, 13)])
@pytest.mark.parametrize("nq, nk", [(45, 77), (77, 45)])
def test_small_blocks(dtype, causal, block_m, block_n, nq, nk):
    seed = seed_of("blocks", np.dtype(dtype).name, causal, block_m, block_n, nq, nk)
    check(seed, (2, 2, nq, 24), (2, 1, nk, 24), dtype, causal=causal, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", CAUSAL)
def test_gqa(dtype, hq, hkv, causal):
    seed = seed_of("gqa", np.dtype(dtype).name, hq, hkv, causal)
    check(seed, (2, hq, 70, 32), (2, hkv, 90, 32), dtype, causal=causal, block_m=32, block_n=32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m, block_n", [(None, None), (16, 8)])
def test_fully_masked_rows(dtype, block_m, block_n):
    nq, nk = 70, 29  # bottom-right: the first 41 rows see no key
    (dq, dk, dv), _ = check(seed_of("masked", np.dtype(dtype).name, block_m), (2, 2, nq, 32), (2, 2, nk, 32), dtype,
                            causal=True, block_m=block_m, block_n=block_n)
    assert np.all(dq[:, :, : nq - nk].astype(np.float32) == 0)
    for g in (dq, dk, dv):
        assert np.isfinite(g.astype(np.float32)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_keys_no_query_sees(dtype, causal):
    # top-left with Nk > Nq: keys past Nq - 1 are seen by nobody, their dk and dv must be 0.
    (dq, dk, dv), _ = check(seed_of("unseen", np.dtype(dtype).name, causal), (1, 2, 20, 16), (1, 2, 50, 16), dtype,
                            causal=causal, block_m=8, block_n=8)
    if causal == "top_left":
        assert np.all(dk[:, :, 20:].astype(np.float32) == 0) and np.all(dv[:, :, 20:].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("n", [1, 2, 5, 17, 128])
def test_large_scores(dtype, causal, n):
    # q x5 and k x3: scores of a few hundred; exp must not overflow, P must come back from lse.
    (dq, dk, dv), _ = check(seed_of("large", np.dtype(dtype).name, causal, n), (1, 2, n, 64), (1, 2, n, 64), dtype,
                            causal=causal, block_m=16, block_n=16, input_scale=(5.0, 3.0, 1.0))
    for g in (dq, dk, dv):
        assert not np.isnan(g.astype(np.float32)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_bshd_layout(dtype, causal):
    seed = seed_of("bshd", np.dtype(dtype).name, causal)
    grads, args = check(seed, (2, 50, 4, 40), (2, 66, 2, 40), dtype, causal=causal, layout="bshd",
                        block_m=16, block_n=32)
    # Same bits as the bhsd computation on transposed arrays: the layout only changes addressing.
    t_args = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in args[:5]]
    lse = args[5]
    t_grads = run_cpu_backward(*t_args, lse, causal=causal, block_m=16, block_n=32)
    for g, tg in zip(grads, t_grads):
        assert np.array_equal(g, tg.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_2d_single_head(dtype, causal):
    do, q, k, v, o, lse = forward_inputs(seed_of("2d", np.dtype(dtype).name, causal), (57, 16), (83, 16), dtype,
                                         causal=causal)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_backward_accurate(grads, do, q, k, v, causal=causal)
    grads4 = run_cpu_backward(*(a[None, None] for a in (do, q, k, v, o, lse)), causal=causal)
    for g, g4 in zip(grads, grads4):
        assert np.array_equal(g, g4[0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.3, 2.5])
def test_explicit_scale(dtype, scale):
    check(seed_of("scale", np.dtype(dtype).name, scale), (1, 2, 40, 32), (1, 2, 55, 32), dtype, scale=scale,
          causal=True, block_m=16, block_n=16)


# ----------------------------------------------------------------------------- empty problems

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_no_keys(dtype, causal):
    do, q, k, v, o, lse = forward_inputs(seed_of("nk0", np.dtype(dtype).name, causal), (2, 4, 9, 16), (2, 2, 0, 16),
                                         dtype, causal=causal)
    dq, dk, dv = run_cpu_backward(do, q, k, v, o, lse, causal=causal)
    assert np.all(dq.astype(np.float32) == 0) and dk.shape == dv.shape == (2, 2, 0, 16)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal)
    assert np.array_equal(ref[0], dq) and ref[1].shape == dk.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_no_queries(dtype, causal):
    do, q, k, v, o, lse = forward_inputs(seed_of("nq0", np.dtype(dtype).name, causal), (2, 4, 0, 16), (2, 2, 7, 16),
                                         dtype, causal=causal)
    dq, dk, dv = run_cpu_backward(do, q, k, v, o, lse, causal=causal)
    assert dq.shape == (2, 4, 0, 16)
    assert np.all(dk.astype(np.float32) == 0) and np.all(dv.astype(np.float32) == 0)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal)
    assert np.array_equal(ref[1], dk) and np.array_equal(ref[2], dv)


def test_empty_batch():
    do, q, k, v, o, lse = forward_inputs(seed_of("b0"), (0, 4, 5, 16), (0, 2, 7, 16), np.float16)
    grads = cuflash.attention_backward(do, q, k, v, o, lse)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ----------------------------------------------------------------------------- API paths and determinism

def test_vjp_and_deterministic_flag_agree():
    do, q, k, v, o, lse = forward_inputs(seed_of("vjp"), (1, 4, 150, 64), (1, 2, 140, 64), BFLOAT16, causal=True)
    a = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    b = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    o2, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    c = vjp(do)
    assert np.array_equal(o, o2)
    for x, y, z in zip(a, b, c):  # bitwise: the CPU is always deterministic
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))
        assert np.array_equal(x.view(np.uint16), z.view(np.uint16))


@pytest.mark.parametrize("dtype", [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")])
@pytest.mark.parametrize("causal", CAUSAL)
def test_reference_float32_backward(dtype, causal):
    do, q, k, v, o, lse = forward_inputs(seed_of("ref", np.dtype(dtype).name, causal), (1, 4, 113, 48),
                                         (1, 2, 203, 48), dtype, causal=causal)
    grads = reference.attention_backward(do, q, k, v, o, lse, causal=causal)
    assert_backward_accurate(grads, do, q, k, v, causal=causal)


# ----------------------------------------------------------------------------- finite differences

def reference_f64(p, q4, k4, v4, do4):
    """<do, o> as a float64 function of float64 (B, H, N, d) arrays, through the reference forward."""
    o4, _ = reference.forward_bhsd(p, q4, k4, v4)
    return float(np.sum(do4 * o4))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("hq, hkv, nq, nk", [(2, 1, 5, 7), (2, 2, 6, 4), (3, 1, 1, 5)])
def test_reference_gradient_by_finite_differences(causal, hq, hkv, nq, nk):
    """Every element of the float64 reference gradient against central differences.

    Truncation error is estimated from the measurement itself: with steps h and h/2, Richardson
    extrapolation R = (4 f'(h/2) - f'(h)) / 3 removes the O(h^2) term, so |R - g| must not exceed
    |f'(h/2) - R| (the remaining truncation estimate) plus the float64 rounding of f divided by h.
    """
    d = 4
    rng = np.random.default_rng(seed_of("fd", causal, hq, hkv, nq, nk))
    q, k, v = random_inputs(rng, (1, hq, nq, d), (1, hkv, nk, d), np.float32)
    do = random_array(rng, q.shape, np.float32)
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = reference.attention_backward(do, q, k, v, o, lse, causal=causal, precision="float64")
    p = problem.validate_forward(q, k, v, causal=causal)
    base = [a.astype(np.float64) for a in (q, k, v)]
    do64 = do.astype(np.float64)
    f0 = reference_f64(p, *base, do64)
    magnitude = float(np.sum(np.abs(do64 * reference.forward_bhsd(p, *base)[0]))) + abs(f0)
    h = 2.0**-8
    for which, g in enumerate(grads):
        fd = {}
        for step in (h, h / 2):
            est = np.empty(base[which].shape)
            for idx in np.ndindex(base[which].shape):
                vals = []
                for sign in (1, -1):
                    args = [a.copy() for a in base]
                    args[which][idx] += sign * step
                    vals.append(reference_f64(p, *args, do64))
                est[idx] = (vals[0] - vals[1]) / (2 * step)
            fd[step] = est
        rich = (4 * fd[h / 2] - fd[h]) / 3
        # f is a sum of ~nk*d terms per output element: allow that many roundings of its magnitude.
        rounding = np.finfo(np.float64).eps * magnitude * nk * d / h
        err = max_abs(rich - g)
        allowed = max_abs(fd[h / 2] - rich) + rounding
        assert err <= allowed, f"{'qkv'[which]}: |extrapolated FD - gradient| {err:.3e} > {allowed:.3e}"
        # The check has teeth: the gradient is not small compared with what it allows.
        assert max_abs(g) > 100 * allowed or max_abs(g) == 0


@pytest.mark.parametrize("causal", CAUSAL)
def test_cpu_backward_against_checked_reference(causal):
    # The same tiny problems, float32 inputs: the CPU gradients against the (FD-checked) reference.
    for hq, hkv, nq, nk in [(2, 1, 5, 7), (2, 2, 6, 4), (3, 1, 1, 5)]:
        seed = seed_of("fd-cpu", causal, hq, hkv, nq, nk)
        check(seed, (1, hq, nq, 4), (1, hkv, nk, 4), np.float32, causal=causal, block_m=2, block_n=3)
