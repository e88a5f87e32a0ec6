"""Score modifiers (softcap, ALiBi slopes, attention sinks) on the CPU: the NumPy backend and the
materializing reference against the float64 oracle (cuflash.testing, whose modifiers are written
independently), with the project's accuracy rule; masked rows, GQA, windows, kv_lens, packed and
paged inputs; finite differences of the oracle's gradients (dsinks, the softcap's chain rule);
validation."""

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash.backends import numpy as cpu
from cuflash.backends import reference
from cuflash.core import problem
from cuflash.core.arrays import BFLOAT16
from cuflash.core.layout import to_bhsd
from cuflash.testing import (assert_backward_accurate, assert_forward_accurate, random_array, random_inputs,
                             reference64, reference64_backward)

from test_paged import paged_cache

DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(np.float32, id="f32")]
MODS = ["softcap", "alibi", "alibi_batch", "sinks", "all"]


def make_mods(rng, which, hq, batch):
    """The keyword arguments of one modifier case, with fresh values."""
    slopes = lambda shape: rng.uniform(0.01, 0.5, shape).astype(np.float32)  # noqa: E731
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    return {
        "softcap": dict(softcap=float(rng.uniform(1.0, 5.0))),
        "alibi": dict(alibi_slopes=slopes(hq)),
        "alibi_batch": dict(alibi_slopes=slopes((batch, hq))),
        "sinks": dict(sinks=sinks),
        "all": dict(softcap=float(rng.uniform(1.0, 5.0)), alibi_slopes=slopes((batch, hq)), sinks=sinks),
    }[which]


def backend_run(q, k, v, do, *, causal, mods, block_m, block_n):
    """The NumPy backend with forced (small) tiles: o, lse, then (dq, dk, dv[, dsinks]), outputs
    NaN-poisoned first and inputs checked unchanged."""
    before = [a.copy() for a in (q, k, v, do)]
    p = problem.validate_forward(q, k, v, causal=causal)
    p = problem.check_score_mods(p, q, **mods)
    o = np.full(p.q_shape(), np.nan, dtype=p.dtype)
    lse = np.full(p.lse_shape(), np.nan, dtype=np.float32)
    q4, o4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(o, p, p.hq, p.nq)
    k4, v4 = to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    lse3 = lse.reshape(p.batch, p.hq, p.nq)
    cpu.forward(p, q4, k4, v4, o4, lse3, block_m=block_m, block_n=block_n)
    grads = [np.full(s, np.nan, dtype=p.dtype) for s in (p.q_shape(), p.kv_shape(), p.kv_shape())]
    g4 = [to_bhsd(grads[0], p, p.hq, p.nq)] + [to_bhsd(g, p, p.hkv, p.nk) for g in grads[1:]]
    extra = {}
    if p.sinks is not None:
        extra["dsinks"] = np.zeros(p.hq, dtype=np.float32)
    cpu.backward(p, to_bhsd(do, p, p.hq, p.nq), q4, k4, v4, o4, lse3, *g4, block_m=block_m, block_n=block_n, **extra)
    for a, b in zip((q, k, v, do), before):
        assert a.tobytes() == b.tobytes(), "an input was modified"
    return o, lse, tuple(grads) + tuple(extra.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", MODS)
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("nq, nk", [(37, 45), (45, 29)])  # (45, 29) bottom-right: rows that see no key
def test_forward_and_backward_small_tiles(rng, dtype, which, causal, nq, nk):
    b, hq, hkv, d = 2, 4, 2, 32  # GQA
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    do = random_array(rng, q.shape, dtype)
    mods = make_mods(rng, which, hq, b)
    o, lse, grads = backend_run(q, k, v, do, causal=causal, mods=mods, block_m=16, block_n=16)
    assert_forward_accurate(o, lse, q, k, v, causal=causal, **mods)
    assert_backward_accurate(grads, do, q, k, v, causal=causal, **mods)
    if causal == "bottom_right" and nq > nk:  # the first nq - nk rows see no key
        dead = slice(0, nq - nk)
        assert np.all(o[:, :, dead].astype(np.float32) == 0)
        want = -np.inf if "sinks" not in mods else np.broadcast_to(mods["sinks"][None, :, None], (b, hq, nq - nk))
        np.testing.assert_array_equal(lse[:, :, dead], want)


@pytest.mark.parametrize("which", MODS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_public_api_default_tiles_and_reference(rng, which, layout):
    b, hq, hkv, nq, nk, d = 2, 6, 2, 150, 170, 64
    shape_q = (b, hq, nq, d) if layout == "bhsd" else (b, nq, hq, d)
    shape_kv = (b, hkv, nk, d) if layout == "bhsd" else (b, nk, hkv, d)
    q, k, v = random_inputs(rng, shape_q, shape_kv, BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mods = make_mods(rng, which, hq, b)
    o, vjp = cuflash.attention_vjp(q, k, v, causal=True, layout=layout, **mods)
    o2, lse = cuflash.attention(q, k, v, causal=True, layout=layout, return_lse=True, **mods)
    assert o.tobytes() == o2.tobytes()
    assert_forward_accurate(o, lse, q, k, v, causal=True, layout=layout, **mods)
    grads = vjp(do)
    assert len(grads) == (4 if "sinks" in mods else 3)
    assert_backward_accurate(grads, do, q, k, v, causal=True, layout=layout, **mods)
    again = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, layout=layout, **mods)
    for a, g in zip(again, grads):
        assert a.tobytes() == g.tobytes()
    # The materializing reference (float64) against the oracle, and its float32 variant by the rule.
    ro, rlse = reference.attention(q, k, v, causal=True, layout=layout, return_lse=True, precision="float64", **mods)
    wo, wlse = reference64(q, k, v, causal=True, layout=layout, **mods)
    np.testing.assert_allclose(ro, wo, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rlse, wlse, rtol=1e-12, atol=1e-12)
    rg = reference.attention_backward(do, q, k, v, o, lse, causal=True, layout=layout, precision="float64", **mods)
    for a, w in zip(rg, reference64_backward(do, q, k, v, causal=True, layout=layout, **mods)):
        np.testing.assert_allclose(a, w, rtol=1e-10, atol=1e-12)
    o32, lse32 = reference.attention(q, k, v, causal=True, layout=layout, return_lse=True, **mods)
    assert_forward_accurate(o32, lse32, q, k, v, causal=True, layout=layout, **mods)


def test_window_with_modifiers(rng):
    b, hq, hkv, nq, nk, d = 1, 4, 1, 70, 90, 32
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), np.float16)
    do = random_array(rng, q.shape, np.float16)
    mods = make_mods(rng, "all", hq, b)
    o, lse = cuflash.attention(q, k, v, window=(7, 3), return_lse=True, **mods)
    assert_forward_accurate(o, lse, q, k, v, window=(7, 3), **mods)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, window=(7, 3), **mods)
    assert_backward_accurate(grads, do, q, k, v, window=(7, 3), **mods)


def test_softcap_bounds_the_scores(rng):
    """With large scores the capped softmax differs from the plain one, and no score exceeds the cap:
    lse <= softcap + log(Nk)."""
    q, k, v = random_inputs(rng, (1, 2, 40, 32), (1, 2, 50, 32), np.float32, scale=4.0)
    o, lse = cuflash.attention(q, k, v, softcap=1.5, return_lse=True)
    plain = cuflash.attention(q, k, v)
    assert np.all(lse <= 1.5 + np.log(50) + 1e-5)
    assert np.abs(o - plain).max() > 1e-2
    assert_forward_accurate(o, lse, q, k, v, softcap=1.5)


def test_alibi_bias_definition(rng):
    """One key per distance: with q = 0 every score is the bias, so P ~ exp(-slope |i + Nk - Nq - j|)."""
    nq, nk, d = 5, 9, 16
    q = np.zeros((1, 1, nq, d), np.float32)
    k = np.zeros((1, 1, nk, d), np.float32)
    v = np.eye(nk, d, dtype=np.float32)[None, None]
    slope = np.array([0.7], np.float32)
    o = cuflash.attention(q, k, v, alibi_slopes=slope)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    w = np.exp(-0.7 * np.abs(i + nk - nq - j))
    np.testing.assert_allclose(o[0, 0, :, :nk], w / w.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_sinks_definition(rng):
    """A sink takes exp(sink) / (exp(sink) + sum_j exp(s_j)) of every row's mass and adds no value."""
    q, k, v = random_inputs(rng, (1, 3, 8, 16), (1, 3, 11, 16), np.float32)
    sinks = np.array([-1.0, 0.5, 3.0], np.float32)
    o, lse = cuflash.attention(q, k, v, sinks=sinks, return_lse=True)
    o0, lse0 = cuflash.attention(q, k, v, return_lse=True)
    keep = np.exp(lse0 - lse)[..., None]  # the keys' share of the row's mass
    np.testing.assert_allclose(o, o0 * keep, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.exp(lse), np.exp(lse0) + np.exp(sinks)[None, :, None], rtol=2e-5)


def _loss(q, k, v, do, mods):
    """sum(do * o) of the float64 materializing reference (cuflash.backends.reference.forward_bhsd
    on float64 arrays, causal); ``mods`` may hold float64 sinks (the formula reads any array)."""
    p = problem.validate_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal=True)
    p = dataclasses.replace(p, softcap=mods.get("softcap"), sinks=mods.get("sinks"),
                            alibi=None if mods.get("alibi_slopes") is None
                            else np.broadcast_to(np.reshape(mods["alibi_slopes"], (-1, p.hq)), (p.batch, p.hq)))
    o4, _ = reference.forward_bhsd(p, q, k, v)
    return float((o4 * do).sum())


def test_finite_differences_of_dsinks(rng):
    """The oracle's and the NumPy backend's dsinks against central differences of the float64
    reference forward (with softcap and ALiBi on, GQA, masked rows)."""
    b, hq, hkv, nq, nk, d = 2, 4, 2, 12, 9, 16
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), np.float32)
    do = random_array(rng, q.shape, np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    slopes = rng.uniform(0.05, 0.3, (b, hq)).astype(np.float32)
    mods = dict(softcap=2.5, alibi_slopes=slopes)
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
    h = 1e-4
    fd = np.empty(hq)
    for i in range(hq):
        up, dn = sinks.astype(np.float64), sinks.astype(np.float64)
        up[i] += h
        dn[i] -= h
        fd[i] = (_loss(q64, k64, v64, do64, dict(mods, sinks=up)) - _loss(q64, k64, v64, do64, dict(mods, sinks=dn))) / (2 * h)
    ref = reference64_backward(do, q, k, v, causal=True, sinks=sinks, **mods)[3]
    np.testing.assert_allclose(ref, fd, rtol=1e-6, atol=1e-9)
    # the NumPy backend on float32 inputs (float64 arithmetic) against the oracle
    o, lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, **mods)
    got = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, sinks=sinks, **mods)[3]
    assert got.dtype == np.float32 and got.shape == (hq,)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("mods", [dict(softcap=1.7), dict(alibi_slopes=np.array([0.2, 0.4], np.float32))])
def test_finite_differences_of_dq_dk(rng, mods):
    """The oracle's dq, dk against central differences of the float64 reference forward: the
    softcap's chain rule, ALiBi's bias that depends on neither q nor k."""
    q, k, v = random_inputs(rng, (1, 2, 6, 8), (1, 2, 7, 8), np.float32, scale=1.5)
    do = random_array(rng, q.shape, np.float32)
    dq, dk, _ = reference64_backward(do, q, k, v, causal=True, **mods)
    x64 = {"q": q.astype(np.float64), "k": k.astype(np.float64), "v": v.astype(np.float64)}
    # (a central difference errs by ~eps |loss| / h from rounding and ~h^2 |f'''| from truncation:
    # h = 1e-6 left the rounding part near the 1e-9 bound, 3 of 300 seeds over it; at 1e-5 the
    # worst of 300 seeds used a tenth of the same bound)
    h = 1e-5
    for name, g in (("q", dq), ("k", dk)):
        for idx in [(0, 0, 3, 1), (0, 1, 5, 7), (0, 1, 2, 0)]:
            up, dn = dict(x64), dict(x64)
            up[name], dn[name] = x64[name].copy(), x64[name].copy()
            up[name][idx] += h
            dn[name][idx] -= h
            fd = (_loss(up["q"], up["k"], up["v"], do, mods) - _loss(dn["q"], dn["k"], dn["v"], do, mods)) / (2 * h)
            np.testing.assert_allclose(g[idx], fd, rtol=1e-6, atol=1e-9)


def test_kv_lens_and_paged_align_alibi_per_sequence(rng):
    b, hq, hkv, nq, nk, d = 3, 4, 2, 5, 64, 32
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), np.float16)
    lens = np.array([64, 17, 40], np.int32)
    mods = make_mods(rng, "all", hq, b)
    o, lse = cuflash.attention(q, k, v, kv_lens=lens, causal=True, return_lse=True, **mods)
    kc, vc, table = paged_cache(rng, k, v, lens, 16)
    po, plse = cuflash.attention(q, kc, vc, block_table=table, kv_lens=lens, causal=True, return_lse=True, **mods)
    for bi, n in enumerate(lens):
        seq_mods = dict(mods, alibi_slopes=mods["alibi_slopes"][bi])
        sl = slice(bi, bi + 1)
        for got_o, got_l in ((o, lse), (po, plse)):
            assert_forward_accurate(got_o[sl], got_l[sl], q[sl], k[sl, :, :n], v[sl, :, :n], causal=True, **seq_mods)


def test_varlen_per_sequence_slopes(rng):
    hq, hkv, d = 4, 2, 32
    nqs, nks = [5, 0, 33, 17], [9, 4, 20, 40]
    cq = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(nks)]).astype(np.int32)
    q, k, v = random_inputs(rng, (cq[-1], hq, d), (ck[-1], hkv, d), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mods = make_mods(rng, "all", hq, len(nqs))
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, **mods)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    assert len(grads) == 4
    per_sequence = []
    for bi in range(len(nqs)):
        qs, ks = slice(cq[bi], cq[bi + 1]), slice(ck[bi], ck[bi + 1])
        seq_mods = dict(mods, alibi_slopes=mods["alibi_slopes"][bi])
        sq, sk, sv, sdo, so = (a[None].transpose(0, 2, 1, 3) for a in (q[qs], k[ks], v[ks], do[qs], o[qs]))
        slse = lse[None, :, qs]
        assert_forward_accurate(so, slse, sq, sk, sv, causal=True, **seq_mods)
        # this sequence's dsinks share, from the same backend on the sequence alone
        share = cuflash.attention_backward(sdo, sq, sk, sv, so, slse, causal=True, **seq_mods)[3]
        per_sequence.append(share)
        seq_grads = [g[None].transpose(0, 2, 1, 3) for g in (grads[0][qs], grads[1][ks], grads[2][ks])]
        assert_backward_accurate(seq_grads + [share], sdo, sq, sk, sv, causal=True, **seq_mods)
    total = np.sum(per_sequence, axis=0, dtype=np.float64)
    np.testing.assert_allclose(grads[3], total, rtol=1e-5, atol=1e-6 * np.abs(total).max())


def test_prepare_attention_with_modifiers(rng):
    q, k, v = random_inputs(rng, (2, 4, 3, 32), (2, 2, 80, 32), np.float16)
    mods = make_mods(rng, "all", 4, 2)
    run = cuflash.prepare_attention(q, k, v, causal=True, return_lse=True, **mods)
    assert run.path == "attention"
    o, lse = run(q, k, v)
    o2, lse2 = cuflash.attention(q, k, v, causal=True, return_lse=True, **mods)
    assert o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()
    with pytest.raises(ValueError, match="sinks"):
        cuflash.prepare_attention(q, k, v, sinks=np.zeros(3, np.float32))


def test_2d_single_head(rng):
    q, k, v = random_inputs(rng, (20, 16), (30, 16), np.float32)
    mods = dict(softcap=3.0, alibi_slopes=np.array([0.25], np.float32), sinks=np.array([0.5], np.float32))
    o, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
    assert o.shape == (20, 16) and lse.shape == (20,)
    assert_forward_accurate(o, lse, q, k, v, **mods)


# ----------------------------------------------------------------------------- validation

def _qkv(rng):
    return random_inputs(rng, (2, 4, 8, 16), (2, 2, 8, 16), np.float16)


@pytest.mark.parametrize("value, exc, msg", [
    (0.0, ValueError, "softcap"), (-1.0, ValueError, "softcap"), (float("nan"), ValueError, "softcap"),
    (float("inf"), ValueError, "softcap"), ("2", TypeError, "softcap"), (True, TypeError, "softcap"),
    (np.array([1.0]), TypeError, "softcap"),
])
def test_bad_softcap(rng, value, exc, msg):
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match=msg):
        cuflash.attention(q, k, v, softcap=value)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(exc, match=msg):
        cuflash.attention_backward(q, q, k, v, o, lse, softcap=value)
    with pytest.raises(exc, match=msg):
        reference.attention(q, k, v, softcap=value)


@pytest.mark.parametrize("name, value, exc, msg", [
    ("alibi_slopes", np.zeros(4, np.float64), TypeError, "alibi_slopes: expected dtype float32"),
    ("alibi_slopes", np.zeros(3, np.float32), ValueError, r"alibi_slopes: expected shape \(4,\) or \(2, 4\)"),
    ("alibi_slopes", np.zeros((4, 2), np.float32), ValueError, "alibi_slopes: expected shape"),
    ("alibi_slopes", [0.1, 0.2, 0.3, 0.4], TypeError, "alibi_slopes"),
    ("alibi_slopes", 0.5, TypeError, "alibi_slopes"),
    ("sinks", np.zeros(4, np.float16), TypeError, "sinks: expected dtype float32"),
    ("sinks", np.zeros((2, 4), np.float32), ValueError, r"sinks: expected shape \(4,\)"),
    ("sinks", np.zeros(2, np.float32), ValueError, "sinks: expected shape"),
    ("sinks", [0.0] * 4, TypeError, "sinks"),
])
def test_bad_modifier_arrays(rng, name, value, exc, msg):
    q, k, v = _qkv(rng)
    with pytest.raises(exc, match=msg):
        cuflash.attention(q, k, v, **{name: value})
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(exc, match=msg):
        cuflash.attention_backward(q, q, k, v, o, lse, **{name: value})
    with pytest.raises(exc, match=msg):
        reference.attention(q, k, v, **{name: value})
    with pytest.raises(exc, match=msg):
        cuflash.attention_vjp(q, k, v, **{name: value})


def test_varlen_slopes_count_sequences(rng):
    q, k, v = random_inputs(rng, (10, 4, 16), (12, 2, 16), np.float16)
    cq, ck = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(4,\) or \(2, 4\) .*packed sequence"):
        cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=np.zeros((3, 4), np.float32))
    o = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=np.zeros((2, 4), np.float32))
    assert o.shape == q.shape


def test_multi_axis_batch_slopes(rng):
    q, k, v = random_inputs(rng, (2, 3, 4, 8, 16), (2, 3, 2, 8, 16), np.float32)
    slopes = rng.uniform(0.1, 0.5, (2, 3, 4)).astype(np.float32)
    o, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    flat = cuflash.attention(q.reshape(6, 4, 8, 16), k.reshape(6, 2, 8, 16), v.reshape(6, 2, 8, 16),
                             alibi_slopes=slopes.reshape(6, 4))
    assert o.reshape(6, 4, 8, 16).tobytes() == flat.tobytes()
    assert_forward_accurate(o, lse, q, k, v, alibi_slopes=slopes)


def test_inputs_unchanged_and_noncontiguous_modifier_arrays(rng):
    q, k, v = _qkv(rng)
    big = rng.uniform(0.1, 0.5, (4, 2)).astype(np.float32)
    slopes = big[:, 0]  # strided
    sinks = rng.standard_normal(8).astype(np.float32)[::2]
    before = (slopes.copy(), sinks.copy())
    o, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, return_lse=True)
    assert_forward_accurate(o, lse, q, k, v, alibi_slopes=np.ascontiguousarray(slopes),
                            sinks=np.ascontiguousarray(sinks))
    assert slopes.tobytes() == before[0].tobytes() and sinks.tobytes() == before[1].tobytes()


# ----------------------------------------------------------------------------- the GPU's plan (no GPU needed)

def _planned(mods, causal=True, d=128, nq=4096, nk=4096, window=None):
    from cuflash.plan import dispatch
    from cuflash.plan.target import Target

    q = np.zeros((1, 4, nq, d), np.float16)
    k = np.zeros((1, 2, nk, d), np.float16)
    p = problem.check_score_mods(problem.validate_forward(q, k, k, causal=causal, window=window), q, **mods)
    h100 = Target(90, 132, "NVIDIA H100")
    return (dispatch.forward_plan(p, h100, dispatch.ALIGNED, tuned=False),
            dispatch.backward_plan(p, h100, dispatch.ALIGNED, tuned=False),
            dispatch.backward_plan(p, h100, dispatch.ALIGNED, deterministic=True, tuned=False),
            dispatch.decode_applies(p, True))


@pytest.mark.parametrize("which", ["softcap", "alibi", "all"])
def test_plan_runs_the_mod_kernels(which):
    mods = {"softcap": dict(softcap=2.0), "alibi": dict(alibi_slopes=np.zeros(4, np.float32)),
            "all": dict(softcap=2.0, alibi_slopes=np.zeros(4, np.float32), sinks=np.zeros(4, np.float32))}[which]
    fwd, bwd, det, _ = _planned(mods)
    # sm_90 without a window: the wgmma kernels with the modifiers (the backward's K/V kernel
    # warp-specialized, dQ atomic); deterministic: the band kernels' dQ and K/V
    assert fwd.kernel == "wgmma_mod" and fwd.spec.expression.startswith("attn_fwd_wgmma_tma_mod<")
    assert bwd.specs["kv"].expression.startswith("attn_bwd_kv_wgmma_ws_mod<") and bwd.kernel == "wgmma"
    assert det.specs["dq"].expression.startswith("attn_bwd_dq_band_mod<")
    assert det.specs["kv"].expression.startswith("attn_bwd_kv_band_mod<")
    # a window, a head dim without the warp-specialized backward: the band kernels
    wfwd, wbwd, _, _ = _planned(mods, window=(100, 0))
    assert wfwd.spec.expression.startswith("attn_fwd_band_mod<")
    assert wbwd.specs["kv"].expression.startswith("attn_bwd_kv_band_mod<")
    dfwd, dbwd, _, _ = _planned(mods, d=256)
    assert dfwd.spec.expression.startswith("attn_fwd_wgmma_tma_mod<")
    assert dbwd.specs["kv"].expression.startswith("attn_bwd_kv_band_mod<")
    from cuflash.plan.registry import all_specs

    listed = set(all_specs())
    for spec in [fwd.spec, *bwd.specs.values(), *det.specs.values(), wfwd.spec, *wbwd.specs.values(), dfwd.spec,
                 *dbwd.specs.values()]:
        assert spec in listed, f"{spec.expression} is not in plan.registry (CI would not compile it)"
    # decode shapes take the split-KV decode kernel with them (tests/test_decode_mods_plan.py)
    assert _planned(mods, nq=1, nk=8192)[3]
    assert _planned({}, nq=1, nk=8192)[3]
    assert not _planned(mods, nq=64, nk=8192)[3]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_modifiers_take_the_plain_kernels_tile(d, causal):
    """The modified forward runs the plain forward's tile for its shape (where the plain forward
    splits the keys of a short grid, the modified one, which has no split, keeps that tile), but a
    persistent tile only within schedule.HOPPER_MOD_PERSISTENT_MAX_KEY_TILES (d = 128: rows of at
    most 16 key tiles without a mask, 8 causal); every such instantiation is in the registry."""
    from cuflash.plan import hopper, schedule
    from cuflash.plan.registry import all_specs

    listed = set(all_specs())
    mods = dict(softcap=2.0, alibi_slopes=np.zeros(4, np.float32), sinks=np.zeros(4, np.float32))
    persistent_up_to = {(128, False): 2048, (128, True): 2048}.get((d, causal), 0)
    for n in (1024, 2048, 4096, 8192, 16384):
        fwd = _planned(mods, causal=causal, d=d, nq=n, nk=n)[0]
        plain = _planned({}, causal=causal, d=d, nq=n, nk=n)[0]
        shape_tile = hopper.default_tile(d, causal or None, n, n)
        persistent = fwd.spec.expression.startswith("attn_fwd_wgmma_tma_persistent_mod<")
        assert fwd.kernel == "wgmma_mod" and persistent == (n <= persistent_up_to) == fwd.tile.persistent, n
        assert fwd.tile == (shape_tile if persistent or not shape_tile.persistent
                            else schedule.HOPPER_FORWARD_TILES[d]), (n, fwd.tile)
        assert plain.kernel != "wgmma" or not persistent or plain.tile == fwd.tile, (n, fwd.tile, plain.tile)
        assert fwd.spec in listed, f"{fwd.spec.expression} is not in plan.registry"


def test_plan_sinks_backward_keeps_the_plain_kernels():
    """Sinks change only the softmax's denominator, which the backward reads from lse: the plain
    backward kernels run (dsinks comes from D); the forward needs the sink kernel."""
    fwd, bwd, _, _ = _planned(dict(sinks=np.zeros(4, np.float32)))
    plain_fwd, plain_bwd, _, _ = _planned({})
    assert fwd.spec.expression.startswith("attn_fwd_wgmma_tma_mod<")
    assert bwd.specs == plain_bwd.specs
    assert not plain_fwd.spec.expression.startswith("attn_fwd_band")


def test_plan_refuses_what_has_no_kernel():
    from cuflash.plan import dispatch
    from cuflash.plan.target import Target

    h100 = Target(90, 132, "NVIDIA H100")
    q = np.zeros((1, 2, 64, 60), np.float16)  # d % 8 != 0: no 16-byte loads
    p = problem.check_score_mods(problem.validate_forward(q, q, q), q, softcap=2.0)
    with pytest.raises(NotImplementedError, match="16-byte"):
        dispatch.forward_plan(p, h100, dispatch.Operands(vec=False), tuned=False)
    q = np.zeros((1, 2, 64, 64), np.float32)
    p = problem.check_score_mods(problem.validate_forward(q, q, q), q, sinks=np.zeros(2, np.float32))
    with pytest.raises(NotImplementedError, match="float32"):
        dispatch.forward_plan(p, h100, dispatch.ALIGNED, tuned=False)
    with pytest.raises(NotImplementedError, match="float32"):
        dispatch.backward_plan(p, h100, dispatch.ALIGNED, tuned=False)


# ----------------------------------------------------------------------------- accounting

def test_flops_count_the_modifiers_apart():
    base = cuflash.flops((2, 4, 300, 64), (2, 2, 500, 64), causal=True)
    for pass_, softcap_ops, alibi_ops in (("fwd", 1, 1), ("bwd", 2, 1), ("fwd+bwd", 3, 2)):
        plain = cuflash.flops((2, 4, 300, 64), (2, 2, 500, 64), causal=True, pass_=pass_)
        both = cuflash.flops((2, 4, 300, 64), (2, 2, 500, 64), causal=True, pass_=pass_, softcap=30.0,
                             alibi_slopes=np.zeros(4, np.float32), sinks=np.zeros(4, np.float32))
        cap = cuflash.flops((2, 4, 300, 64), (2, 2, 500, 64), causal=True, pass_=pass_, softcap=30.0)
        assert both.flops == plain.flops and both.pairs == plain.pairs == base.pairs
        assert plain.elementwise == 0
        assert cap.elementwise == softcap_ops * plain.pairs
        assert both.elementwise == (softcap_ops + alibi_ops) * plain.pairs
        assert "score modifiers" in both.convention


def test_memory_report_lists_modifier_inputs():
    plain = cuflash.memory_report((2, 4, 300, 64), (2, 2, 500, 64), pass_="fwd+bwd")
    rep = cuflash.memory_report((2, 4, 300, 64), (2, 2, 500, 64), pass_="fwd+bwd",
                                alibi_slopes=np.zeros((2, 4), np.float32), sinks=(4,))
    names = {e.name: e for e in rep.entries}
    assert names["ALiBi slopes"].bytes == 2 * 4 * 4 and names["sinks"].bytes == 16 and names["dsinks"].bytes == 16
    assert rep.device_bytes == plain.device_bytes + 32 + 16 + 16
    with pytest.raises(ValueError, match="sinks"):
        cuflash.memory_report((2, 4, 300, 64), (2, 2, 500, 64), sinks=(3,))


def test_rule_on_outputs_below_the_smallest_normal(rng):
    """A sink far above every ALiBi-shifted score leaves outputs near 1e-37, many below the smallest
    normal float32 (1.2e-38), which the GPU kernels return as 0. The yardstick's float32 outputs are
    flushed there too, so such a result passes; the bound stays a few such flushes wide (the
    bound is 2-7 of them here), so an error of twenty fails."""
    tiny = float(np.finfo(np.float32).tiny)
    hq, nq, nk, d = 4, 3, 1500, 64
    q, k, v = random_inputs(rng, (1, hq, nq, d), (1, 1, nk, d), BFLOAT16)
    mods = dict(alibi_slopes=np.full(hq, 86.0 / (nk - 1), np.float32), sinks=np.zeros(hq, np.float32))
    ref_o, ref_lse = reference64(q, k, v, causal="top_left", **mods)
    ref_o = np.asarray(ref_o, np.float64)
    below = np.abs(ref_o) < tiny
    assert below.mean() > 0.03 and np.abs(ref_o).max() < 1e-34  # the case is what it claims
    flushed = np.where(below, 0.0, ref_o)
    assert_forward_accurate(flushed.astype(np.float32).astype(BFLOAT16), ref_lse.astype(np.float32), q, k, v,
                            causal="top_left", **mods)
    off = flushed.copy()
    off.flat[np.flatnonzero(below)[0]] = 20 * tiny
    with pytest.raises(AssertionError, match="^o "):
        assert_forward_accurate(off.astype(np.float32).astype(BFLOAT16), ref_lse.astype(np.float32), q, k, v,
                                causal="top_left", **mods)
