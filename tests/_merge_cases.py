"""Shared by test_merge.py (NumPy) and test_gpu_merge.py (CuPy): attention over disjoint key
slices, merged, against the float64 reference of the whole problem; and the backward of each key
slice with the global o and lse (context parallelism's contract).

Causal (bottom-right, the whole problem's Nq x Nk) over a key slice [a, b) is the window
(-1, Nk - b) of the slice's own problem: diag = i + (b - a) - Nq, so j_local <= diag + Nk - b
is a + j_local <= i + Nk - Nq (slice_options; the float32 GPU kernels take no window, so the GPU
tests cut the keys where only the last slice needs a mask)."""

from __future__ import annotations

import numpy as np

import cuflash
from cuflash.core.arrays import UNIT_ROUNDOFF
from cuflash.testing import (assert_lse_within_bound, faithful_backward_realizations,
                             faithful_realizations, lse_bound, max_abs, reference64, reference64_backward, to_numpy,
                             visibility)


def slice_options(causal, nq, nk, b):
    """The mask of key slice [a, b) of a bottom-right causal Nq x Nk problem, in the slice's own
    terms: none where every query sees the whole slice, causal for the last slice, else the window."""
    if not causal or b - 1 <= nk - nq:
        return {}
    if b == nk:
        return dict(causal=True)
    return dict(window=(-1, nk - b))


def key_axis(layout):
    return -2 if layout == "bhsd" else -3


def key_slice(a, layout, a0, a1):
    idx = [slice(None)] * a.ndim
    idx[a.ndim + key_axis(layout)] = slice(a0, a1)
    return a[tuple(idx)]


def partials(q, k, v, cuts, *, causal, layout, out_dtype=np.float32):
    """[(o, lse)] of attention over each key slice [cuts[i], cuts[i+1])."""
    nq, nk = q.shape[key_axis(layout)], k.shape[key_axis(layout)]
    res = []
    for a0, a1 in zip(cuts, cuts[1:]):
        res.append(cuflash.attention(q, key_slice(k, layout, a0, a1), key_slice(v, layout, a0, a1), layout=layout,
                                     return_lse=True, out_dtype=out_dtype, **slice_options(causal, nq, nk, a1)))
    return res


def check_merge_equals_full(q, k, v, cuts, *, causal, layout, xp=np):
    """Merged partials (float32 parts) = full attention by the accuracy rule (o in q's dtype, lse
    by the float32 bound)."""
    parts = partials(q, k, v, cuts, causal=causal, layout=layout)
    o_parts = xp.stack([o for o, _ in parts])
    lse_parts = xp.stack([lse for _, lse in parts])
    o, lse = cuflash.merge_attention_states(o_parts, lse_parts, layout=layout, dtype=q.dtype)
    qn, kn, vn = (to_numpy(a) for a in (q, k, v))
    kw = dict(causal=bool(causal), layout=layout)
    assert_lse_within_bound("lse", to_numpy(lse), reference64(qn, kn, vn, **kw)[1], lse_bound(qn, kn, vn, **kw))
    assert to_numpy(o).dtype == qn.dtype
    assert_merged_o_accurate(to_numpy(o), [(to_numpy(a), to_numpy(b)) for a, b in parts], qn, kn, vn, cuts, **kw)
    return o, lse


def _rows(a, layout):
    """o (..., H, N, d) / (..., N, H, d) -> (..., H, N, d); lse is (..., H, N) in both layouts."""
    return a if layout == "bhsd" or a.ndim == 2 else np.swapaxes(a, -2, -3)


def assert_merged_o_accurate(o, parts, q, k, v, cuts, *, causal, layout):
    """The accuracy rule for the merged o, plus what the float32 lse of the interface costs it.

    Each part's lse carries a float32 rounding delta_p (measured against the part's float64
    reference); exp(lse_p - m) then weighs o_p by a relative error delta_p - (weighted mean), so
    the merged row moves by at most 2 max_p |delta_p| max_p |o_p - o| (first order). For 16-bit
    inputs this is far below one rounding of o; for float32 inputs it is |lse| 2^-24 relative, the
    floor any merge of float32 lse meets."""
    ref, _ = reference64(q, k, v, causal=causal, layout=layout)
    yards = faithful_realizations(q, k, v, causal=causal, layout=layout)
    nq, nk = q.shape[key_axis(layout)], k.shape[key_axis(layout)]
    extra = np.zeros(ref.shape[:-1] if layout == "bhsd" or ref.ndim == 2 else np.swapaxes(ref, -2, -3).shape[:-1])
    dist = np.zeros_like(extra)
    delta = np.zeros_like(extra)
    ref_rows = _rows(ref, layout)
    for (o_p, lse_p), a0, a1 in zip(parts, cuts, cuts[1:]):
        opts = slice_options(causal, nq, nk, a1)
        ks, vs = key_slice(k, layout, a0, a1), key_slice(v, layout, a0, a1)
        _, lse_ref = reference64(q, ks, vs, layout=layout, **opts)
        seen = np.isfinite(lse_ref)
        d = np.abs(np.where(seen, lse_p.astype(np.float64) - np.where(seen, lse_ref, 0.0), 0.0))
        delta = np.maximum(delta, d)
        gap = np.abs(_rows(o_p.astype(np.float64), layout) - ref_rows).max(axis=-1, initial=0.0)
        dist = np.maximum(dist, np.where(seen, gap, 0.0))
    extra = 2 * delta * dist
    got = o.astype(np.float64)
    assert np.isfinite(got).all(), "o: non-finite values"
    err = max_abs(got - ref)
    yard_err = max(max_abs(y - ref) for y in yards)
    bound = 2 * yard_err + UNIT_ROUNDOFF[np.dtype(q.dtype)] * max_abs(ref) + float(extra.max(initial=0.0))
    assert err <= bound, (f"o ({np.dtype(q.dtype)}): max error {err:.3e} > bound {bound:.3e} (2 x yardstick "
                          f"{yard_err:.3e} + u max|ref| + lse term {float(extra.max(initial=0.0)):.3e})")


def check_slice_backward(do, q, k, v, cuts, *, causal, layout):
    """attention_backward over each key slice with the global o, lse: dk, dv of a slice are the
    full gradient's rows (the accuracy rule on those rows) and the slices' dq add up to the full
    dq. dq of a slice is rounded once to the input dtype (a part of a sum), so the sum is allowed
    one rounding per part: max|sum - ref| <= 2 x yardstick error + u x sum_s max|dq_s|."""
    o, lse = cuflash.attention(q, k, v, layout=layout, causal=bool(causal), return_lse=True)
    nq, nk = q.shape[key_axis(layout)], k.shape[key_axis(layout)]
    dqs, dks, dvs = [], [], []
    for a0, a1 in zip(cuts, cuts[1:]):
        dq, dk, dv = cuflash.attention_backward(do, q, key_slice(k, layout, a0, a1), key_slice(v, layout, a0, a1),
                                                o, lse, layout=layout, **slice_options(causal, nq, nk, a1))
        dqs.append(to_numpy(dq).astype(np.float64))
        dks.append(to_numpy(dk))
        dvs.append(to_numpy(dv))
    args = [to_numpy(a) for a in (do, q, k, v)]
    kw = dict(causal=bool(causal), layout=layout)
    ref = reference64_backward(*args, **kw)
    # The float32 lse and the o of the interface fix P and D up to their rounding: the exact
    # gradient for the given statistics differs from the exact one by that much (for 16-bit
    # inputs far below a rounding of the result; for float32 the |lse| 2^-24 floor of a given lse).
    given = _gradients_for_statistics(*args, to_numpy(o), to_numpy(lse), causal=bool(causal), layout=layout)
    yards = faithful_backward_realizations(*args, **kw)
    dtype = np.dtype(to_numpy(q).dtype)
    u = UNIT_ROUNDOFF[dtype]
    ax = key_axis(layout)
    got = (sum(dqs), np.concatenate(dks, axis=ax).astype(np.float64), np.concatenate(dvs, axis=ax).astype(np.float64))
    # dq of a slice is one part of a sum, rounded once to the input dtype: one rounding per part.
    output_rounding = (u * sum(max_abs(d) for d in dqs), u * max_abs(ref[1]), u * max_abs(ref[2]))
    for name, g, r, gv, y, rnd in zip(("dq", "dk", "dv"), got, ref, given, yards, output_rounding):
        assert np.isfinite(g).all(), f"{name}: non-finite values"
        err = max_abs(g - r)
        yard_err = max(max_abs(yd - r) for yd in y)
        floor = max_abs(gv - r)
        bound = 2 * yard_err + rnd + floor
        assert err <= bound, (f"{name} ({dtype}): error {err:.3e} > bound {bound:.3e} (2 x yardstick {yard_err:.3e}, "
                              f"output rounding {rnd:.3e}, given statistics {floor:.3e})")


def _gradients_for_statistics(do, q, k, v, o, lse, *, causal, layout):
    """(dq, dk, dv) in float64 with P = exp(s - lse) from the given float32 lse and D = rowsum(do o)
    from the given o, 4-D inputs (the exact gradients those statistics define)."""
    if layout == "bshd":
        do, q, k, v, o = (np.swapaxes(a, 1, 2) for a in (do, q, k, v, o))
    do, q, k, v, o = (a.astype(np.float64) for a in (do, q, k, v, o))
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = 1.0 / np.sqrt(d)
    vis = visibility(causal, nq, nk)
    s = np.where(vis, np.matmul(q, kr.swapaxes(-1, -2)) * scale, -np.inf)
    lse = lse.astype(np.float64)[..., None]
    p = np.where(vis & np.isfinite(lse), np.exp(s - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    dp = np.matmul(do, vr.swapaxes(-1, -2))
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    dq = np.matmul(ds, kr) * scale
    dk = (np.matmul(ds.swapaxes(-1, -2), q) * scale).reshape(b, hkv, g, nk, d).sum(axis=2)
    dv = np.matmul(p.swapaxes(-1, -2), do).reshape(b, hkv, g, nk, d).sum(axis=2)
    if layout == "bshd":
        dq, dk, dv = (np.swapaxes(a, 1, 2) for a in (dq, dk, dv))
    return dq, dk, dv
