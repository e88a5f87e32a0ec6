"""Sliding window and packed variable-length sequences (issue #5) on the NumPy backend.

The oracle is the float64 reference evaluated with a mask this file builds itself, pair by pair
from the documented definition (_brute_mask), never with cuflash.core.masks: a windowed problem is
held to ``mask=brute_visible(...)``, a packed batch to the block-diagonal mask of its sequences
(one big problem over the packed arrays, so the varlen code is not part of its own oracle).
Accuracy is the rule of cuflash.testing (docs/testing.md): the same factor forward and backward.
Every test draws fresh inputs (the ``rng`` fixture reports its seed on failure).
"""

import sys
import types

import numpy as np
import pytest
from _targets import SM80, SM90, on_target

import cuflash
from cuflash.core import problem as _problem
from cuflash.backends import numpy as cpu
from cuflash.core import masks
from cuflash.backends import reference
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16
from cuflash.core.layout import to_bhsd
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, random_array, random_inputs, reference64, reference64_backward
from cuflash.backends import cuda
from cuflash.kernels import forward as forward_kernels
from cuflash.kernels import operands
from cuflash.plan import backward as plan_backward
from cuflash.plan import forward as plan_forward
from cuflash.plan import hopper as plan_hopper

from _brute_mask import block_diagonal_mask, brute_visible, packed_batch

DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(np.float32, id="f32")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]
# Bounded on both sides, on one side (-1 = unbounded), zero-width sides, and wider than the problem.
WINDOWS = [(0, 0), (5, 3), (0, -1), (-1, 0), (17, -1), (-1, 9), (3, 40), (100, 100)]


def window_id(w):
    return f"w{w[0]}_{w[1]}"


def forward_cpu(q, k, v, *, causal, window, block_m=None, block_n=None):
    """cpu.forward on a windowed problem into NaN-poisoned o, lse (bhsd)."""
    p = _problem.validate_forward(q, k, v, causal=causal, window=window)
    o = np.full(p.q_shape(), np.nan, dtype=p.dtype)
    lse = np.full(p.lse_shape(), np.nan, dtype=np.float32)
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    cpu.forward(p, q4, k4, v4, to_bhsd(o, p, p.hq, p.nq), lse.reshape(p.batch, p.hq, p.nq),
                block_m=block_m, block_n=block_n)
    return o, lse


def backward_cpu(do, q, k, v, o, lse, *, causal, window, block_m=None, block_n=None):
    """cpu.backward on a windowed problem into NaN-poisoned gradients (bhsd)."""
    p = _problem.validate_backward(do, q, k, v, o, lse, causal=causal, window=window)
    grads = [np.full(s, np.nan, dtype=p.dtype) for s in (p.q_shape(), p.kv_shape(), p.kv_shape())]
    q_side = [to_bhsd(a, p, p.hq, p.nq) for a in (do, q, o)]
    k_side = [to_bhsd(a, p, p.hkv, p.nk) for a in (k, v)]
    g4 = [to_bhsd(g, p, h, n) for g, (h, n) in zip(grads, ((p.hq, p.nq), (p.hkv, p.nk), (p.hkv, p.nk)))]
    cpu.backward(p, q_side[0], q_side[1], *k_side, q_side[2], lse.reshape(p.batch, p.hq, p.nq), *g4,
                 block_m=block_m, block_n=block_n)
    return grads


def assert_hidden_rows_are_zero(o, lse, vis):
    """Rows that see no key: o exactly 0 and lse -inf (bhsd o, lse (..., H, N))."""
    hidden = ~vis.any(axis=1)
    assert np.all(o[..., hidden, :].astype(np.float32) == 0)
    assert np.all(lse[..., hidden] == -np.inf)
    assert np.isfinite(lse[..., ~hidden]).all()


# ----------------------------------------------------------------------------- masks: the one definition


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [None, (0, 0), (2, -1), (-1, 1), (1, 3), (4, 0), (0, 5), (30, 30)])
@pytest.mark.parametrize("nq, nk", [(0, 4), (4, 0), (1, 1), (5, 3), (3, 7), (8, 8), (13, 6), (6, 13)])
def test_mask_matrix_and_row_counts_match_brute_force(causal, window, nq, nk):
    from cuflash import accounting

    vis = brute_visible(causal, window, nq, nk)
    c, w = masks.normalize_causal(causal), masks.normalize_window(window)
    assert np.array_equal(masks.mask_matrix(np, c, nq, nk, w), vis)
    assert np.array_equal(masks.visible_keys_per_row(c, nq, nk, w), vis.sum(axis=1))
    assert accounting.pairs_per_head(causal, nq, nk, window) == int(vis.sum())


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(0, 0), (2, -1), (-1, 1), (1, 3), (0, -1)])
@pytest.mark.parametrize("nq, nk", [(5, 3), (3, 7), (8, 8), (9, 4)])
def test_tile_predicates_with_window_match_brute_force(causal, window, nq, nk):
    c = masks.normalize_causal(causal)
    vis = brute_visible(causal, window, nq, nk)
    padded = np.zeros((nq, nk + 4), dtype=bool)  # columns past nk are never visible
    padded[:, :nk] = vis
    for row0 in range(nq):
        for row1 in range(row0 + 1, nq + 1):
            c0, c1 = masks.key_range(c, nq, nk, row0, row1, window)
            cols = np.flatnonzero(vis[row0:row1].any(axis=0))  # one interval, or none
            if cols.size:
                assert (c0, c1) == (cols[0], cols[-1] + 1) and cols.size == c1 - c0, (row0, row1)
            else:
                assert c0 >= c1, (row0, row1)
            for col0 in range(nk + 3):
                for col1 in range(col0 + 1, nk + 4):
                    tile = padded[row0:row1, col0:col1]
                    got = masks.tile_is_visible(c, nq, nk, row0, row1, col0, window, col1)
                    assert got == bool(tile.any()), (row0, row1, col0, col1)
                    got = masks.tile_needs_mask(c, nq, nk, row0, col0, col1, window, row1)
                    assert got == (not bool(tile.all())), (row0, row1, col0, col1)


@pytest.mark.parametrize("value, want", [(None, None), ((-1, -1), None), ((3, 0), (3, 0)), ([0, -1], (0, -1)),
                                         (np.array([2, 5], dtype=np.int32), (2, 5))])
def test_normalize_window(value, want):
    got = masks.normalize_window(value)
    assert got == want and (got is None or all(type(x) is int for x in got))


# ----------------------------------------------------------------------------- window: forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS, ids=window_id)
@pytest.mark.parametrize("nq, nk, block_m, block_n", [(45, 77, 16, 32), (77, 45, 7, 13), (64, 64, 16, 16)])
def test_window_forward_matches_brute_force_reference(rng, dtype, causal, window, nq, nk, block_m, block_n):
    q, k, v = random_inputs(rng, (2, 4, nq, 24), (2, 2, nk, 24), dtype)
    o, lse = forward_cpu(q, k, v, causal=causal, window=window, block_m=block_m, block_n=block_n)
    vis = brute_visible(causal, window, nq, nk)
    assert_forward_accurate(o, lse, q, k, v, mask=vis)
    assert_hidden_rows_are_zero(o, lse, vis)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(70, 20), (0, 130), (-1, 5), (200, -1)], ids=window_id)
def test_window_public_api_default_tiles(rng, causal, window):
    # The kernel's tile sizes (128 x 128 at d = 64): bands that cut tiles mid-way, ragged ends.
    q, k, v = random_inputs(rng, (1, 2, 300, 64), (1, 2, 333, 64), BFLOAT16)
    o, lse = cuflash.attention(q, k, v, causal=causal, window=window, return_lse=True)
    vis = brute_visible(causal, window, 300, 333)
    assert_forward_accurate(o, lse, q, k, v, mask=vis)
    o2, lse2 = forward_cpu(q, k, v, causal=causal, window=window)
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2)
    # The materializing reference takes the same arguments.
    o3, lse3 = reference.attention(q, k, v, causal=causal, window=window, return_lse=True, precision="float64")
    ref_o, ref_lse = reference64(q, k, v, mask=vis)
    assert np.allclose(o3, ref_o, rtol=0, atol=1e-12) and np.array_equal(np.isinf(lse3), np.isinf(ref_lse))
    assert np.allclose(lse3[np.isfinite(lse3)], ref_lse[np.isfinite(ref_lse)], rtol=1e-13, atol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_window_layout_and_2d(rng, layout):
    q, k, v = random_inputs(rng, (2, 50, 4, 16), (2, 66, 2, 16), np.float16)
    if layout == "bhsd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    o, lse = cuflash.attention(q, k, v, causal=True, window=(6, 0), layout=layout, return_lse=True)
    assert_forward_accurate(o, lse, q, k, v, layout=layout, mask=brute_visible(True, (6, 0), 50, 66))
    q2, k2, v2 = random_inputs(rng, (40, 16), (30, 16), np.float32)
    o2, lse2 = cuflash.attention(q2, k2, v2, window=(2, 3), return_lse=True)
    assert o2.shape == (40, 16) and lse2.shape == (40,)
    assert_forward_accurate(o2, lse2, q2, k2, v2, mask=brute_visible(False, (2, 3), 40, 30))


def test_window_minus_one_both_sides_is_no_window(rng):
    q, k, v = random_inputs(rng, (1, 2, 70, 32), (1, 2, 90, 32), np.float16)
    for causal in (False, True, "top_left"):
        a = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        b = cuflash.attention(q, k, v, causal=causal, window=(-1, -1), return_lse=True)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_window_with_kv_lens_aligns_per_sequence(rng):
    q, k, v = random_inputs(rng, (3, 2, 5, 16), (3, 2, 40, 16), np.float32)
    lens = np.array([0, 17, 40], dtype=np.int32)
    o, lse = cuflash.attention(q, k, v, causal=True, window=(4, 0), kv_lens=lens, return_lse=True)
    for b, n in enumerate(lens.tolist()):
        sl = slice(b, b + 1)
        assert_forward_accurate(o[sl], lse[sl], q[sl], k[sl, :, :n], v[sl, :, :n],
                                          mask=brute_visible(True, (4, 0), 5, n))


# ----------------------------------------------------------------------------- window: backward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(1, 0), (5, 3), (0, 2), (-1, 1), (17, -1), (4, -1)], ids=window_id)
@pytest.mark.parametrize("nq, nk, block_m, block_n", [(45, 77, 16, 32), (77, 45, 7, 13)])
def test_window_backward_matches_brute_force_reference(rng, dtype, causal, window, nq, nk, block_m, block_n):
    q, k, v = random_inputs(rng, (2, 4, nq, 24), (2, 2, nk, 24), dtype)
    do = random_array(rng, q.shape, dtype)
    o, lse = cuflash.attention(q, k, v, causal=causal, window=window, return_lse=True)
    grads = backward_cpu(do, q, k, v, o, lse, causal=causal, window=window, block_m=block_m, block_n=block_n)
    vis = brute_visible(causal, window, nq, nk)
    assert_backward_accurate(grads, do, q, k, v, mask=vis)
    # Keys no query sees get exactly zero gradients.
    unseen = ~vis.any(axis=0)
    assert np.all(grads[1][:, :, unseen].astype(np.float32) == 0)
    assert np.all(grads[2][:, :, unseen].astype(np.float32) == 0)


def test_window_vjp_and_reference_backward(rng):
    q, k, v = random_inputs(rng, (1, 4, 150, 64), (1, 2, 140, 64), np.float16)
    do = random_array(rng, q.shape, np.float16)
    o, vjp = cuflash.attention_vjp(q, k, v, causal=True, window=(33, 0))
    grads = vjp(do)
    vis = brute_visible(True, (33, 0), 150, 140)
    assert_forward_accurate(o, None, q, k, v, mask=vis)
    assert_backward_accurate(grads, do, q, k, v, mask=vis)
    o32, lse32 = reference.attention(q, k, v, causal=True, window=(33, 0), return_lse=True)
    ref = reference.attention_backward(do, q, k, v, o32, lse32, causal=True, window=(33, 0), precision="float64")
    oracle = reference64_backward(do, q, k, v, mask=vis)
    for got, want in zip(ref, oracle):
        assert np.allclose(got, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- skipped tiles


@pytest.mark.parametrize("causal, window", [(False, (20, 10)), ("bottom_right", (37, 0)), ("top_left", (0, -1)),
                                            (False, (-1, 3)), (False, (5, -1))])
def test_only_band_tiles_are_computed(rng, monkeypatch, causal, window):
    # Count the score tiles the NumPy backend computes (every computed tile goes through
    # cpu._scores once per pass for 16-bit inputs) and compare with the tiles that meet the band.
    nq, nk, bm, bn = 200, 190, 16, 24
    q, k, v = random_inputs(rng, (1, 2, nq, 16), (1, 1, nk, 16), np.float16)
    do = random_array(rng, q.shape, np.float16)
    seen = []
    real = cpu._scores
    def counted(p, qt, kt, m0, m1, n0, b, **kw):
        seen.append((m0, n0))
        return real(p, qt, kt, m0, m1, n0, b, **kw)

    monkeypatch.setattr(cpu, "_scores", counted)
    vis = brute_visible(causal, window, nq, nk)
    band = {(m0, n0) for m0 in range(0, nq, bm) for n0 in range(0, nk, bn) if vis[m0:m0 + bm, n0:n0 + bn].any()}
    all_tiles = {(m0, n0) for m0 in range(0, nq, bm) for n0 in range(0, nk, bn)}
    assert band and band != all_tiles  # the window must leave tiles out, or the test proves nothing
    o, lse = forward_cpu(q, k, v, causal=causal, window=window, block_m=bm, block_n=bn)
    assert sorted(seen) == sorted(band)  # each band tile exactly once, nothing else
    seen.clear()
    grads = backward_cpu(do, q, k, v, o, lse, causal=causal, window=window, block_m=bm, block_n=bn)
    assert sorted(seen) == sorted(band)
    assert_forward_accurate(o, lse, q, k, v, mask=vis)
    assert_backward_accurate(grads, do, q, k, v, mask=vis)
    if window[0] >= 0:  # a left bound: some tiles left of the band are skipped too
        assert any(n0 + bn <= min((n for m, n in band if m == m0), default=-1) for m0, n0 in all_tiles - band)


# ----------------------------------------------------------------------------- packed sequences


# Nq in {1, 2, 7, 16} per sequence, empty sequences on either side and both, Nq > Nk and Nq < Nk.
BATCHES = [
    pytest.param([1, 0, 2, 7, 16, 0, 7], [9, 4, 0, 3, 40, 0, 7], id="mixed"),
    pytest.param([16, 1, 2], [16, 30, 1], id="no-empty"),
    pytest.param([0, 7], [0, 20], id="leading-empty"),
]


@pytest.fixture(params=[None, (4, 8)], ids=["default-tiles", "tiles4x8"])
def tiles(request, monkeypatch):
    """The kernel's tile sizes, or small ones so that every sequence spans several tiles."""
    if request.param is not None:
        monkeypatch.setattr(schedule, "cpu_blocks", lambda d: request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [None, (3, 0), (2, 2), (-1, 1)],
                         ids=lambda w: "nowin" if w is None else window_id(w))
@pytest.mark.parametrize("nqs, nks", BATCHES)
def test_varlen_forward_and_backward(rng, tiles, dtype, causal, window, nqs, nks):
    q, k, v, cq, ck = packed_batch(rng, dtype, nqs, nks)
    before = [a.copy() for a in (q, k, v, cq, ck)]
    o, lse = cuflash.attention(q, k, v, causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck,
                               return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (4, q.shape[0]) and lse.dtype == np.float32
    vis = block_diagonal_mask(causal, window, cq, ck)
    # The oracle is one problem over the packed arrays ((total, H, d) read as bshd without batch).
    assert_forward_accurate(o, lse, q, k, v, layout="bshd", mask=vis)
    hidden = ~vis.any(axis=1)
    assert np.all(o[hidden].astype(np.float32) == 0) and np.all(lse[:, hidden] == -np.inf)
    do = random_array(rng, q.shape, dtype)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, cu_seqlens_q=cq,
                                       cu_seqlens_k=ck)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_backward_accurate(grads, do, q, k, v, layout="bshd", mask=vis)
    unseen = ~vis.any(axis=0)
    assert np.all(grads[1][unseen].astype(np.float32) == 0) and np.all(grads[2][unseen].astype(np.float32) == 0)
    for a, a0 in zip((q, k, v, cq, ck), before):
        assert np.array_equal(a.view(np.uint8), a0.view(np.uint8))


@pytest.mark.parametrize("causal", CAUSAL)
def test_varlen_reference_and_out(rng, causal):
    q, k, v, cq, ck = packed_batch(rng, np.float32, [7, 0, 16, 2], [7, 5, 9, 30])
    vis = block_diagonal_mask(causal, (5, 1), cq, ck)
    kw = dict(causal=causal, window=(5, 1), cu_seqlens_q=cq, cu_seqlens_k=ck)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, precision="float64", **kw)
    want_o, want_lse = reference64(q, k, v, layout="bshd", mask=vis)
    assert np.allclose(o_ref, want_o, rtol=0, atol=1e-12)
    assert np.array_equal(lse_ref == -np.inf, want_lse == -np.inf)
    assert np.allclose(lse_ref[np.isfinite(lse_ref)], want_lse[np.isfinite(want_lse)], rtol=1e-13)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    o, lse = cuflash.attention(q, k, v, out=out, return_lse=True, **kw)
    assert o is out
    assert_forward_accurate(o, lse, q, k, v, layout="bshd", mask=vis)
    do = random_array(rng, q.shape, np.float32)
    dq, dk, dv = (np.full(a.shape, np.nan, dtype=a.dtype) for a in (q, k, v))
    got = cuflash.attention_backward(do, q, k, v, o, lse, out=(dq, dk, dv), **kw)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    assert_backward_accurate(got, do, q, k, v, layout="bshd", mask=vis)
    g_ref = reference.attention_backward(do, q, k, v, o, lse, precision="float64", **kw)
    for a, b in zip(g_ref, reference64_backward(do, q, k, v, layout="bshd", mask=vis)):
        assert np.allclose(a, b, rtol=0, atol=1e-12)
    o2, vjp = cuflash.attention_vjp(q, k, v, **kw)
    assert np.array_equal(o2, o)
    assert all(np.array_equal(a, b) for a, b in zip(vjp(do), got))


def test_varlen_equals_separate_calls(rng):
    # Each packed sequence gives the same bits as the same problem run on its own.
    q, k, v, cq, ck = packed_batch(rng, BFLOAT16, [5, 16, 1], [12, 16, 8], d=32)
    o, lse = cuflash.attention(q, k, v, causal=True, window=(6, -1), cu_seqlens_q=cq, cu_seqlens_k=ck,
                               return_lse=True)
    for b in range(3):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ob, lb = cuflash.attention(q[None, qs], k[None, ks], v[None, ks], causal=True, window=(6, -1),
                                   layout="bshd", return_lse=True)
        assert np.array_equal(o[qs].view(np.uint16), ob[0].view(np.uint16)) and np.array_equal(lse[:, qs], lb[0])


def test_varlen_no_sequences(rng):
    q, k, v = random_inputs(rng, (0, 2, 8), (0, 1, 8), np.float16)
    cu = np.zeros(1, dtype=np.int32)
    o, lse = cuflash.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    assert o.shape == (0, 2, 8) and lse.shape == (2, 0)


# ----------------------------------------------------------------------------- validation


def small(rng, dtype=np.float16):
    return random_inputs(rng, (2, 4, 6, 8), (2, 2, 5, 8), dtype)


@pytest.mark.parametrize("fn", ["attention", "backward", "reference"])
@pytest.mark.parametrize("window, exc, msg", [
    ("ab", TypeError, r"^window: expected None or a pair"),
    ((1,), TypeError, r"^window: expected None or a pair"),
    ((1, 2, 3), TypeError, r"^window: expected None or a pair"),
    (4, TypeError, r"^window: expected None or a pair"),
    ((1.0, 2), TypeError, r"^window: expected a pair of ints .*window\[0\] of type float"),
    ((0, True), TypeError, r"^window: expected a pair of ints .*window\[1\] of type bool"),
    ((-2, 0), ValueError, r"^window: expected values >= -1 .*window\[0\] = -2"),
    ((3, -7), ValueError, r"^window: expected values >= -1 .*window\[1\] = -7"),
])
def test_bad_window(rng, fn, window, exc, msg):
    q, k, v = small(rng)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    call = {"attention": lambda: cuflash.attention(q, k, v, window=window),
            "backward": lambda: cuflash.attention_backward(o, q, k, v, o, lse, window=window),
            "reference": lambda: reference.attention(q, k, v, window=window)}[fn]
    with pytest.raises(exc, match=msg):
        call()


def varlen_inputs(rng):
    q, k, v = random_inputs(rng, (9, 4, 8), (12, 2, 8), np.float16)
    return q, k, v, np.array([0, 4, 9], dtype=np.int32), np.array([0, 7, 12], dtype=np.int32)


I32 = np.int32


@pytest.mark.parametrize("change, exc, msg, also_reference", [
    (dict(cu_seqlens_q=np.array([0, 4, 9], dtype=np.int64)), TypeError,
     r"^cu_seqlens_q: expected dtype int32, got int64", True),
    (dict(cu_seqlens_k=np.array([0, 7, 12], dtype=np.uint32)), TypeError, r"^cu_seqlens_k: expected dtype int32", True),
    (dict(cu_seqlens_q=np.array([[0, 4, 9]], dtype=I32)), ValueError,
     r"^cu_seqlens_q: expected a 1-D array of B \+ 1", True),
    (dict(cu_seqlens_q=np.zeros(0, dtype=I32), cu_seqlens_k=np.zeros(0, dtype=I32)), ValueError,
     r"^cu_seqlens_q: expected a 1-D array of B \+ 1 offsets, got shape \(0,\)", True),
    (dict(cu_seqlens_q=np.array([1, 4, 9], dtype=I32)), ValueError,
     r"^cu_seqlens_q: expected cumulative offsets starting at 0", True),
    (dict(cu_seqlens_k=np.array([0, 13, 12], dtype=I32)), ValueError,
     r"^cu_seqlens_k: offsets must be non-decreasing, got cu_seqlens_k\[1\] = 13 > cu_seqlens_k\[2\] = 12", True),
    (dict(cu_seqlens_q=np.array([0, 4, 8], dtype=I32)), ValueError,
     r"^cu_seqlens_q: last offset 8 must equal the packed length 9 \(q.shape\[0\]\)", True),
    (dict(cu_seqlens_k=np.array([0, 7, 13], dtype=I32)), ValueError,
     r"^cu_seqlens_k: last offset 13 .* length 12", True),
    (dict(cu_seqlens_k=np.array([0, 3, 7, 12], dtype=I32)), ValueError,
     r"^cu_seqlens_k: expected cu_seqlens_q's shape \(3,\) .*got \(4,\)", True),
    (dict(cu_seqlens_k=None), ValueError, r"^cu_seqlens_k: packed sequences need both", True),
    (dict(cu_seqlens_q=None), ValueError, r"^cu_seqlens_q: packed sequences need both", True),
    (dict(cu_seqlens_q=[0, 4, 9]), TypeError, r"^cu_seqlens_q: expected an array", False),
    (dict(kv_lens=np.array([3, 4], dtype=I32)), ValueError, r"^kv_lens: cannot be combined with cu_seqlens", False),
    (dict(layout="sbhd"), ValueError, r"^layout:", True),
])
def test_bad_cu_seqlens(rng, change, exc, msg, also_reference):
    q, k, v, cq, ck = varlen_inputs(rng)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    kw.update(change)
    o, lse = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    with pytest.raises(exc, match=msg):
        cuflash.attention(q, k, v, **kw)
    kw.pop("kv_lens", None)  # the backward and the reference take no kv_lens
    if also_reference:
        with pytest.raises(exc, match=msg):
            cuflash.attention_backward(o, q, k, v, o, lse, **kw)
        with pytest.raises(exc, match=msg):
            reference.attention(q, k, v, **kw)


@pytest.mark.parametrize("fn", [cuflash.attention, reference.attention])
def test_cu_seqlens_with_batched_arrays(rng, fn):
    q, k, v, cq, ck = varlen_inputs(rng)
    with pytest.raises(ValueError, match=r"^q: with cu_seqlens_q/cu_seqlens_k expected a packed \(total_q, Hq, d\) "
                                         r"array, got shape \(1, 9, 4, 8\)"):
        fn(q[None], k[None], v[None], cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match=r"^k: with cu_seqlens_q/cu_seqlens_k expected a packed \(total_k, Hkv, d\)"):
        fn(q, k[0], v, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_cu_seqlens_backward_checks_packed_shapes(rng):
    q, k, v, cq, ck = varlen_inputs(rng)
    o, lse = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match=r"^lse: expected shape \(4, 9\)"):
        cuflash.attention_backward(o, q, k, v, o, lse.T.copy(), **kw)
    with pytest.raises(ValueError, match=r"^do: expected q's shape \(9, 4, 8\)"):
        cuflash.attention_backward(o[:8], q, k, v, o, lse, **kw)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: last offset 9 must equal the packed length 8"):
        cuflash.attention_backward(o[:8], q[:8], k, v, o[:8], lse[:, :8], **kw)
    with pytest.raises(TypeError, match=r"^deterministic:"):
        cuflash.attention_backward(o, q, k, v, o, lse, deterministic="yes", **kw)


# ----------------------------------------------------------------------------- max_seqlen_q / max_seqlen_k


@pytest.mark.parametrize("validate", [True, False])
def test_max_seqlens_leave_the_result_unchanged(rng, validate):
    # FlashAttention's varlen maxima: at or above the longest sequences they change nothing (the
    # NumPy backend reads the offsets whatever validate says), forward, backward and vjp.
    q, k, v, cq, ck = packed_batch(rng, BFLOAT16, [3, 0, 9], [5, 2, 11], 2, 1, 16)
    kw = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    do = random_array(rng, q.shape, BFLOAT16)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    for lengths in (dict(max_seqlen_q=9, max_seqlen_k=11), dict(max_seqlen_q=np.int64(40)), dict(max_seqlen_k=12)):
        o2, lse2 = cuflash.attention(q, k, v, return_lse=True, validate=validate, **kw, **lengths)
        assert np.array_equal(o2, o) and np.array_equal(lse2, lse)
        for g, g2 in zip(grads, cuflash.attention_backward(do, q, k, v, o, lse, validate=validate, **kw, **lengths)):
            assert np.array_equal(g, g2)
        o3, vjp = cuflash.attention_vjp(q, k, v, validate=validate, **kw, **lengths)
        assert np.array_equal(o3, o)
        assert all(np.array_equal(a, b) for a, b in zip(vjp(do), grads))


@pytest.mark.parametrize("lengths, exc, msg", [
    (dict(max_seqlen_q=8), ValueError, r"^max_seqlen_q: 8 is less than the longest packed sequence \(9 rows\)"),
    (dict(max_seqlen_k=10), ValueError, r"^max_seqlen_k: 10 is less than the longest packed sequence \(11 rows\)"),
    (dict(max_seqlen_q=-1), ValueError, r"^max_seqlen_q: expected an int >= 0, got -1"),
    (dict(max_seqlen_k=True), TypeError, r"^max_seqlen_k: expected an int, got bool"),
    (dict(max_seqlen_q=9.0), TypeError, r"^max_seqlen_q: expected an int, got float"),
    (dict(max_seqlen_q="9"), TypeError, r"^max_seqlen_q: expected an int, got str"),
])
@pytest.mark.parametrize("validate", [True, False])
def test_bad_max_seqlens_name_the_argument(rng, lengths, exc, msg, validate):
    # The NumPy backend checks the maxima against the offsets it reads (with validate=False too),
    # so that it accepts what the GPU's validated calls accept.
    q, k, v, cq, ck = packed_batch(rng, BFLOAT16, [3, 0, 9], [5, 2, 11], 2, 1, 16)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, validate=validate, **lengths)
    o, lse = cuflash.attention(q, k, v, return_lse=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    for call in (lambda: cuflash.attention(q, k, v, **kw), lambda: cuflash.attention_backward(o, q, k, v, o, lse, **kw),
                 lambda: cuflash.attention_vjp(q, k, v, **kw)):
        with pytest.raises(exc, match=msg):
            call()


def test_max_seqlens_only_with_packed_sequences(rng):
    q, k, v = random_inputs(rng, (1, 2, 5, 16), (1, 2, 6, 16), BFLOAT16)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    for call in (lambda: cuflash.attention(q, k, v, max_seqlen_q=5),
                 lambda: cuflash.attention_backward(o, q, k, v, o, lse, max_seqlen_q=5),
                 lambda: cuflash.attention_vjp(q, k, v, max_seqlen_q=5)):
        with pytest.raises(ValueError, match=r"^max_seqlen_q: only with cu_seqlens_q / cu_seqlens_k"):
            call()
    with pytest.raises(TypeError, match=r"^validate:"):
        cuflash.attention_backward(o, q, k, v, o, lse, validate="no")


# ----------------------------------------------------------------------------- GPU inputs: routing


class StubCupyArray:
    """Looks like a CuPy array to the routing (module name and .device); reading it fails the test."""

    __module__ = "cupy._core.core"
    device = types.SimpleNamespace(id=0)

    def __getattr__(self, name):
        raise AssertionError(f"the routing must not read the array before validation (read .{name})")


class ReachedValidation(Exception):
    pass


@pytest.mark.parametrize("kw, validator", [
    (dict(window=(4, 0)), "validate_forward"), (dict(window=(-1, 3)), "validate_forward"),
    (dict(cu_seqlens_q=StubCupyArray(), cu_seqlens_k=StubCupyArray()), "validate_varlen"),
    (dict(cu_seqlens_q=StubCupyArray()), "validate_varlen"),
])
def test_gpu_inputs_with_window_or_cu_seqlens_reach_validation(fake_cupy, monkeypatch, kw, validator):
    # The GPU runs both now (issue #5): no guard stops them, and they reach the same validation as
    # NumPy inputs (which names bad arguments), with the window passed on.
    def reached(*a, **k):
        if "window" in kw:
            assert k.get("window") == kw["window"]
        raise ReachedValidation

    def unreachable(*a, **k):
        raise AssertionError("the wrong validation was reached")

    for name in ("validate_forward", "validate_backward", "validate_varlen"):
        monkeypatch.setattr(_problem, name, unreachable)
    monkeypatch.setattr(_problem, validator, reached)
    if validator == "validate_forward":
        monkeypatch.setattr(_problem, "validate_backward", reached)
    a = StubCupyArray()
    for call in (lambda: cuflash.attention(a, a, a, causal=True, **kw),
                 lambda: cuflash.attention_backward(a, a, a, a, a, a, **kw),
                 lambda: cuflash.attention_vjp(a, a, a, **kw)):
        with pytest.raises(ReachedValidation):
            call()


@pytest.mark.parametrize("window", [None, (-1, -1)])
def test_gpu_inputs_without_the_new_arguments_take_the_old_path(fake_cupy, monkeypatch, window):
    # No window (or the no-op (-1, -1)) and no cu_seqlens: the guard lets the call through to the
    # unchanged validation, which is where the existing GPU path starts.
    def reached(*a, **k):
        assert k.get("window") in (None, (-1, -1))
        raise ReachedValidation

    monkeypatch.setattr(_problem, "validate_forward", reached)
    monkeypatch.setattr(_problem, "validate_backward", reached)
    a = StubCupyArray()
    with pytest.raises(ReachedValidation):
        cuflash.attention(a, a, a, window=window)
    with pytest.raises(ReachedValidation):
        cuflash.attention_backward(a, a, a, a, a, a, window=window)


def test_gpu_bad_window_is_still_a_value_error(fake_cupy):
    a = StubCupyArray()
    with pytest.raises(ValueError, match=r"^window:"):
        cuflash.attention(a, a, a, window=(-3, 0))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [None, (0, 0), (2, -1), (-1, 1), (1, 3), (4, 0), (0, 5), (30, 30), (-1, -1)])
def test_band_kernel_offsets_match_brute_force(causal, window):
    # The band kernels get the bounds relative to the diagonal (cuflash.kernels.forward.band_offsets), add each
    # sequence's nk - nq when aligned bottom-right, and clamp an open side (+-OPEN) to nk / -nq.
    # Done the kernels' way (64-bit sums, then the clamp) for every small (nq, nk), that must be
    # the documented mask.

    p = types.SimpleNamespace(causal=masks.normalize_causal(causal), window=masks.normalize_window(window))
    hi_rel, lo_rel, align = forward_kernels.band_offsets(p)
    assert -operands.OPEN <= lo_rel <= hi_rel <= operands.OPEN and operands.OPEN == 2**31 - 1
    for nq in range(0, 9):
        for nk in range(0, 9):
            shift = nk - nq if align else 0
            hi, lo = min(hi_rel + shift, nk), max(lo_rel + shift, -nq)
            i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
            got = (j <= i + hi) & (j >= i + lo)
            assert np.array_equal(got, brute_visible(causal, window, nq, nk)), (nq, nk)


def test_window_problems_take_the_hopper_forward_but_not_the_hopper_backward(rng, monkeypatch):
    # The wgmma forward has a band instantiation (attn_fwd_wgmma_band), so on sm_90 applies()
    # takes a windowed problem; the wgmma backward masks no band: backward_applies() refuses it
    # before it asks for a device. CUFLASH_KERNELS=mma_sync turns the forward's off as well.

    q, k, v = random_inputs(rng, (1, 2, 8, 64), (1, 2, 300, 64), np.float16)
    p = _problem.validate_forward(q, k, v, causal=True, window=(16, 0))
    assert plan_hopper.backward_applies(p, True, SM90) is False
    monkeypatch.delenv(plan_hopper.ENV, raising=False)
    assert plan_hopper.applies(p, True, SM90) is True and plan_hopper.backward_applies(p, True, SM90) is False
    assert plan_hopper.applies(p, False, SM90) is False  # unaligned rows: the mma.sync band kernel's scalar path
    monkeypatch.setenv(plan_hopper.ENV, "mma_sync")
    assert plan_hopper.applies(p, True, SM90) is False
    monkeypatch.setenv(plan_hopper.ENV, "auto")
    assert plan_hopper.applies(p, True, SM80) is False


class _Arr:
    """What cuda.forward_band reads of a CuPy array before a launch: shape, strides, alignment,
    and slicing (returned unchanged)."""

    def __init__(self, shape, itemsize=2):
        self.shape, self.itemsize = shape, itemsize
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
        self.data = types.SimpleNamespace(ptr=1 << 20)

    def __getitem__(self, key):
        return self


@pytest.mark.parametrize("hopper", [False, True], ids=["other", "sm90"])
@pytest.mark.parametrize("mode", ["auto", "mma_sync"])
@pytest.mark.parametrize("d", [64, 128, 111])
def test_forward_band_dispatch(rng, monkeypatch, hopper, mode, d):
    # cuda.forward_band with CuPy and the launches stubbed: on sm_90 (CUFLASH_KERNELS=auto, 16-bit
    # aligned rows, a head dim of HOPPER_FORWARD_TILES) the window and the packed batch launch
    # attn_fwd_wgmma_band, with the mma.sync band kernel's arguments and grid (64 x warpgroups rows
    # per block); otherwise attn_fwd_band. An explicit tile= (schedule search) keeps mma.sync.

    fake = types.ModuleType("cupy")
    fake.ascontiguousarray = lambda a: a
    monkeypatch.setitem(sys.modules, "cupy", fake)
    made = []

    def get_function(spec):
        def launch(grid, block, args, shared_mem=0):
            made.append((spec.expression, grid, block[0], shared_mem, args))
        return launch

    monkeypatch.setattr(forward_kernels, "get_function", get_function)
    on_target(monkeypatch, SM90 if hopper else SM80)
    monkeypatch.setenv(plan_hopper.ENV, mode)
    nq, nk = 300, 333
    q, k, v = random_inputs(rng, (2, 4, nq, d), (2, 2, nk, d), np.float16)
    p = _problem.validate_forward(q, k, v, causal=True, window=(70, 20))
    q4, k4, o4, lse3 = _Arr((2, 4, nq, d)), _Arr((2, 2, nk, d)), _Arr((2, 4, nq, d)), _Arr((2, 4, nq), 4)
    cuda.forward_band(p, q4, k4, k4, o4, lse3)
    cu = (_Arr((6,), 4), _Arr((6,), 4))
    cuda.forward_band(p, q4, k4, k4, o4, lse3, cu_seqlens=cu, max_seqlen_q=200)
    wgmma = hopper and mode == "auto" and d in (64, 128)
    if wgmma:
        spec, t = plan_hopper.forward_band_spec(np.float16, d)
        assert spec.expression.startswith("attn_fwd_wgmma_band<")
    else:
        spec, t = plan_forward.forward_spec(np.float16, d, True, d % 8 == 0, band=True)
        assert spec.expression.startswith("attn_fwd_band<")
    assert [m[:4] for m in made] == [(spec.expression, (-(-nq // t.block_m), 4, 2), spec.threads, spec.smem_bytes),
                                     (spec.expression, (-(-200 // t.block_m), 4, 5), spec.threads, spec.smem_bytes)]
    hi, lo, align = forward_kernels.band_offsets(p)
    assert made[0][4][-6:-2] == (hi, np.float32(p.scale * operands.LOG2E), lo, align)
    assert made[0][4][-2:] == (0, 0) and made[1][4][-2:] == cu
    made.clear()
    cuda.forward_band(p, q4, k4, k4, o4, lse3, tile=schedule.forward_tile(d, d % 8 == 0)[1])
    assert len(made) == 1 and made[0][0].startswith("attn_fwd_band<")


def test_hopper_band_kernels_are_compiled_in_ci():

    names = {s.expression for s in plan_hopper.all_hopper_forward_specs()}
    for dtype in (np.float16, BFLOAT16):
        for hd in schedule.HOPPER_FORWARD_TILES:
            assert plan_hopper.forward_band_spec(dtype, hd)[0].expression in names


def test_float32_band_kernel_is_not_implemented():

    with pytest.raises(NotImplementedError, match="float32 GPU inputs"):
        plan_forward.forward_spec(np.float32, 64, True, True, band=True)
    # every 16-bit (head dim, load path) has its band kernel in the list CI compiles
    names = {s.expression for s in plan_forward.all_forward_specs()}
    for dtype in (np.float16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for vec in (False, True):
                assert plan_forward.forward_spec(dtype, hd, True, vec, band=True)[0].expression in names


def test_backward_band_kernels_are_compiled_in_ci():

    names = {s.expression for s in plan_backward.all_backward_specs()}
    for dtype in (np.float16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for vec in (False, True):
                for det in (False, True):
                    specs = plan_backward.backward_specs(dtype, hd, True, vec, det, band=True)[0]
                    assert specs["kv"].expression.startswith("attn_bwd_kv_band<")
                    assert not det or specs["dq"].expression.startswith("attn_bwd_dq_band<")
                    assert {s.expression for s in specs.values()} <= names
