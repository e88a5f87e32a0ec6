"""The materializing reference: attention written as the textbook formula.

S = scale * Q K^T and P = softmax(S) are built as explicit (..., Hq, Nq, Nk) arrays in the inputs'
own library (NumPy or CuPy), so this is the O(N^2)-memory baseline the benchmarks compare
against and the float64 oracle the tests compare with. Validation and semantics are those of
:func:`cuflash.attention` (GQA by index h // group, both causal alignments, rows that see no key
give o = 0 and lse = -inf, Nk = 0 gives zeros and -inf, 2-D input is one head).

``precision`` picks the arithmetic: "float32" (default) casts the inputs to float32 and returns o
in the input dtype and lse in float32, like cuflash.attention; "float64" computes in float64 and
returns float64 arrays (o, lse and gradients), for use as an oracle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core import fp8_inputs
from ..core import problem as _problem
from ..core.arrays import BFLOAT16
from ..core.layout import from_bhsd, to_bhsd

_PRECISIONS = {"float32": np.float32, "float64": np.float64}
_NEG_INF = float("-inf")


def _compute_dtype(precision):
    if precision not in _PRECISIONS:
        raise ValueError(f"precision: expected 'float32' or 'float64', got {precision!r}")
    return np.dtype(_PRECISIONS[precision])


def bfloat16_to_float32(xp, a):
    """Exact bfloat16 -> float32 through the bits (a bfloat16 is the top half of a float32).

    CuPy holds bfloat16 as storage only, so its arrays cannot rely on astype."""
    return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bfloat16(xp, a):
    """float32 -> bfloat16 rounded to nearest, ties to even, through the bits; NaN stays NaN."""
    bits = a.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    rounded = xp.where(xp.isnan(a), xp.uint32(0x7FC0), rounded)
    return rounded.astype(xp.uint16).view(BFLOAT16)


def _native_bfloat16(xp):
    """NumPy computes with ml_dtypes' bfloat16; CuPy only stores it."""
    return xp is np


def _widen(xp, a, cdt):
    """An input-dtype array in the compute dtype."""
    if a.dtype == BFLOAT16 and not _native_bfloat16(xp):
        return bfloat16_to_float32(xp, a).astype(cdt)
    return a.astype(cdt)


def _narrow(xp, a, dtype):
    """A compute-dtype array rounded to the output dtype."""
    if dtype == BFLOAT16 and not _native_bfloat16(xp):
        return float32_to_bfloat16(xp, xp.ascontiguousarray(a.astype(xp.float32)))
    return a.astype(dtype)


def _heads_as_query_heads(a4, p):
    """(B, Hkv, N, d) -> (B, Hq, N, d): query head h reads K/V head h // group."""
    if p.group == 1:
        return a4
    return a4[:, p.xp.arange(p.hq) // p.group]


def visibility(xp, causal, window, nq, nk):
    """(nq, nk) boolean visibility written from the definitions, sharing no code with cuflash.core.masks
    (the oracle must not inherit a bug of what it checks). ``causal``: None, "top_left" or
    "bottom_right"; ``window``: None or (left, right) with -1 for an open side.

    Query i sees key j iff j <= i (top_left) or j <= i + nk - nq (bottom_right) when causal, and
    diag - left <= j <= diag + right under a window, diag = i for top_left, else i + nk - nq."""
    i = xp.arange(nq).reshape(nq, 1)
    j = xp.arange(nk).reshape(1, nk)
    diag = i if causal == "top_left" else i + (nk - nq)
    seen = xp.ones((nq, nk), dtype=bool)
    if causal is not None:
        seen &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= diag - left
        if right >= 0:
            seen &= j <= diag + right
    return seen


def modified_scores(p, s, cdt):
    """(s', softcap derivative or None): the scaled scores s (B, Hq, Nq, Nk) with the softcap
    c tanh(s / c) and then the ALiBi bias -slope |i + Nk - Nq - j| (FlashAttention-2's) applied,
    written from the definitions (no code shared with the backends)."""
    xp = p.xp
    deriv = None
    if p.softcap is not None:
        t = xp.tanh(s / cdt.type(p.softcap))
        s = cdt.type(p.softcap) * t
        deriv = 1 - t * t
    if p.alibi is not None:
        i = xp.arange(p.nq).reshape(p.nq, 1)
        j = xp.arange(p.nk).reshape(1, p.nk)
        dist = xp.abs(i + (p.nk - p.nq) - j).astype(cdt)
        s = s - p.alibi.astype(cdt).reshape(p.batch, p.hq, 1, 1) * dist
    return s, deriv


def _probabilities(p, q4, k4, cdt, mask=None, with_deriv=False):
    """Materialized P (B, Hq, Nq, Nk), the masked row max m and the row sum l (keepdims); the row
    max and sum count the sink as one more key (without a value). ``with_deriv``: also the
    softcap's derivative (modified_scores).

    ``mask``: an explicit boolean (Nq, Nk) visibility that replaces p's causal/window mask (tests
    pass one built independently). Rows that see no key have P = 0, l = 0 and m = -inf (with a
    sink: l = 1 and m = the sink)."""
    xp = p.xp
    kq = _heads_as_query_heads(k4, p)
    s = xp.matmul(q4, kq.swapaxes(-1, -2)) * cdt.type(p.scale)
    s, deriv = modified_scores(p, s, cdt)
    if mask is None and (p.causal is not None or p.window is not None):
        mask = visibility(xp, p.causal, p.window, p.nq, p.nk)
    if mask is not None:
        s = xp.where(mask, s, cdt.type(_NEG_INF))
    m = s.max(axis=-1, keepdims=True)
    if p.sinks is not None:
        m = xp.maximum(m, p.sinks.astype(cdt).reshape(1, p.hq, 1, 1))
    # Subtract 0 instead of -inf in rows that see nothing, so exp gives 0 there and never NaN.
    shift = xp.where(m == _NEG_INF, cdt.type(0), m)
    e = xp.exp(s - shift)
    l = e.sum(axis=-1, keepdims=True)
    if p.sinks is not None:
        l = l + xp.exp(p.sinks.astype(cdt).reshape(1, p.hq, 1, 1) - shift)
    seen = l > 0
    probs = e / xp.where(seen, l, cdt.type(1))
    if with_deriv:
        return probs, m, l, deriv
    return probs, m, l


def forward_bhsd(p, q4, k4, v4, mask=None):
    """(o4, lse3) for canonical (B, H, N, d) arrays already in the compute dtype; no validation.

    The arithmetic is that of the arrays' dtype, so float64 arrays give a float64 function
    (tests take finite differences of it)."""
    xp = p.xp
    cdt = q4.dtype
    if p.nk == 0:  # no keys: every row sees nothing (a max over an empty axis is undefined)
        lse = _NEG_INF if p.sinks is None else p.sinks.astype(cdt).reshape(1, p.hq, 1)
        return (xp.zeros((p.batch, p.hq, p.nq, p.dv), dtype=cdt),
                xp.broadcast_to(xp.asarray(lse, dtype=cdt), (p.batch, p.hq, p.nq)).copy())
    probs, m, l = _probabilities(p, q4, k4, cdt, mask)
    o4 = xp.matmul(probs, _heads_as_query_heads(v4, p))
    seen = l > 0
    shift = xp.where(seen, m, cdt.type(0))
    lse3 = xp.where(seen, shift + xp.log(xp.where(seen, l, cdt.type(1))), cdt.type(_NEG_INF))
    return o4, lse3[..., 0]


def backward_bhsd(p, do4, q4, k4, v4, mask=None):
    """(dq4, dk4, dv4) for canonical arrays already in the compute dtype; no validation. With
    sinks, (dq4, dk4, dv4, dsinks): dsinks (Hq,) = -sum over rows of P_sink * sum_j P_ij dP_ij."""
    xp = p.xp
    cdt = q4.dtype
    if p.nk == 0:
        grads = (xp.zeros((p.batch, p.hq, p.nq, p.d), dtype=cdt),
                 xp.zeros((p.batch, p.hkv, 0, p.d), dtype=cdt),
                 xp.zeros((p.batch, p.hkv, 0, p.dv), dtype=cdt))
        return grads + ((xp.zeros(p.hq, dtype=cdt),) if p.sinks is not None else ())
    probs, m, l, deriv = _probabilities(p, q4, k4, cdt, mask, with_deriv=True)
    kq, vq = _heads_as_query_heads(k4, p), _heads_as_query_heads(v4, p)
    dv_per_qhead = xp.matmul(probs.swapaxes(-1, -2), do4)  # (B, Hq, Nk, dv)
    dprobs = xp.matmul(do4, vq.swapaxes(-1, -2))  # (B, Hq, Nq, Nk)
    row_dot = (probs * dprobs).sum(axis=-1, keepdims=True)
    ds = probs * (dprobs - row_dot)
    if deriv is not None:  # chain rule through c tanh(s / c)
        ds = ds * deriv
    sc = cdt.type(p.scale)
    dq4 = xp.matmul(ds, kq) * sc
    dk_per_qhead = xp.matmul(ds.swapaxes(-1, -2), q4) * sc
    # Query heads g*group .. (g+1)*group-1 read K/V head g: sum their contributions.
    grouped = (p.batch, p.hkv, p.group, p.nk)
    grads = (dq4, dk_per_qhead.reshape(grouped + (p.d,)).sum(axis=2),
             dv_per_qhead.reshape(grouped + (p.dv,)).sum(axis=2))
    if p.sinks is None:
        return grads
    shift = xp.where(m == _NEG_INF, cdt.type(0), m)
    p_sink = xp.exp(p.sinks.astype(cdt).reshape(1, p.hq, 1, 1) - shift) / l
    return grads + (-(p_sink * row_dot).sum(axis=(0, 2, 3)),)


def _wide_bhsd(p, cdt, q_side=(), k_side=()):
    """Canonical (B, H, N, d) views of q-side and k-side arrays, in the compute dtype."""
    return ([_widen(p.xp, to_bhsd(a, p, p.hq, p.nq), cdt) for a in q_side]
            + [_widen(p.xp, to_bhsd(a, p, p.hkv, p.nk), cdt) for a in k_side])


def _out_dtype(p, cdt):
    return p.dtype if cdt == np.float32 else cdt


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, precision="float32",
              window=None, cu_seqlens_q=None, cu_seqlens_k=None, softcap=None, alibi_slopes=None, sinks=None,
              q_descale=None, k_descale=None, v_descale=None):
    """o = softmax(scale * q k^T [masked]) v with S and P materialized.

    ``softcap``, ``alibi_slopes``, ``sinks`` as for :func:`cuflash.attention` (lse includes the
    sink). ``float8_e4m3fn`` inputs with ``q_descale``, ``k_descale``, ``v_descale`` as for
    :func:`cuflash.attention` (NumPy arrays): the formula of the dequantized float32 values, o in
    the FP8 output dtype (precision="float64": float64).

    Same arguments and results as :func:`cuflash.attention` (no ``out=``, ``kv_lens``), plus
    ``precision`` ("float32" or "float64", see the module docstring). lse is the natural-log
    log-sum-exp of the scaled, masked scores, -inf for rows that see no key. ``window`` and
    ``cu_seqlens_q``/``cu_seqlens_k`` work on NumPy and CuPy arrays alike (CuPy offsets are
    copied to the host to slice the sequences).
    """
    cdt = _compute_dtype(precision)
    _problem.check_flag("return_lse", return_lse)
    descales = (q_descale, k_descale, v_descale)
    if fp8_inputs.requested((q, k, v), descales):
        odt = fp8_inputs.check_call((q, k, v), descales, None)
        _problem.check_layout(layout)
        dense = cu_seqlens_q is None and cu_seqlens_k is None
        checked = fp8_inputs.checked_descales((q, k, v), descales, layout, dense)
        wide = [a.astype(np.float32) if d is None else _dequantized(a, d, layout) for a, d in zip((q, k, v), checked)]
        res = attention(*wide, causal=causal, scale=scale, layout=layout, return_lse=True, precision=precision,
                        window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks)
        o = res[0] if cdt == np.float64 else res[0].astype(odt)
        return (o, res[1]) if return_lse else o
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cdt, return_lse, causal=causal, scale=scale,
                                 layout=layout, window=window, mods=(softcap, alibi_slopes, sinks))
    p = _problem.validate_forward(q, k, v, causal=causal, scale=scale, layout=layout, window=window)
    p = _problem.check_score_mods(p, q, softcap, alibi_slopes, sinks)
    xp = p.xp
    o4, lse3 = forward_bhsd(p, *_wide_bhsd(p, cdt, (q,), (k, v)))
    o = from_bhsd(_narrow(xp, o4, _out_dtype(p, cdt)), p, p.hq, p.nq)
    if return_lse:
        return o, lse3.reshape(p.lse_shape())
    return o


def _dequantized(x8, descale, layout):
    """x8 * descale, written here from the definition: the product of an e4m3 value and a float32
    factor is exact in float64, then rounded once to float32."""
    x = x8.astype(np.float64)
    d = np.asarray(descale, dtype=np.float64)
    if d.ndim == 0:
        return (x * d).astype(np.float32)
    if x8.ndim == 2:
        return (x * d.reshape(())).astype(np.float32)
    heads = x8.shape[-3] if layout == "bhsd" else x8.shape[-2]
    d = np.repeat(d, heads // d.shape[-1], axis=-1)  # (q per K/V head: each factor for its group)
    d = d[..., :, None, None] if layout == "bhsd" else d[..., None, :, None]
    return (x * d).astype(np.float32)


def _sequences(p, cu_seqlens_q, cu_seqlens_k):
    """(problem of one packed sequence, its q rows, its k rows), read straight from the offsets."""
    cq, ck = (a.get() if hasattr(a, "get") else a for a in (cu_seqlens_q, cu_seqlens_k))
    cq, ck = [int(x) for x in cq], [int(x) for x in ck]
    for b in range(len(cq) - 1):
        alibi = None if p.alibi is None else p.alibi[b:b + 1]  # sequence b's own slopes
        yield (dataclasses.replace(p, nq=cq[b + 1] - cq[b], nk=ck[b + 1] - ck[b], alibi=alibi),
               slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]))


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cdt, return_lse, mods, **options):
    """Packed sequences: the formula per sequence, written into packed o (total_q, Hq, d), lse (Hq, total_q)."""
    p, spans = _problem.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    p = _problem.check_score_mods(p, q, *mods, sequences=len(spans))
    xp = p.xp
    o = xp.empty(p.o_shape(), dtype=_out_dtype(p, cdt))
    lse = xp.empty(p.lse_shape(), dtype=cdt)
    for pb, qs, ks in _sequences(p, cu_seqlens_q, cu_seqlens_k):
        o4, lse3 = forward_bhsd(pb, *_wide_bhsd(pb, cdt, (q[qs],), (k[ks], v[ks])))
        o[qs] = from_bhsd(_narrow(xp, o4, o.dtype), pb, pb.hq, pb.nq)
        lse[:, qs] = lse3[0]
    return (o, lse) if return_lse else o


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, layout="bhsd", precision="float32",
                       window=None, cu_seqlens_q=None, cu_seqlens_k=None, softcap=None, alibi_slopes=None, sinks=None):
    """(dq, dk, dv) of :func:`attention` for the upstream gradient ``do``, by the explicit formula.

    ``o`` and ``lse`` are validated exactly as :func:`cuflash.attention_backward` validates them,
    but their values are not used: P is rebuilt from q and k, and D_i = sum_j P_ij dP_ij
    (= rowsum(do * o) in exact arithmetic), so the reference does not inherit the rounding of a
    forward pass. dk and dv are summed over the query heads that share a K/V head. Gradients
    have the input dtype for precision "float32" and are float64 for "float64". ``window`` and
    ``cu_seqlens_q``/``cu_seqlens_k`` as for :func:`attention`. With ``sinks``, a fourth result:
    dsinks (Hq,), float32 for "float32", float64 for "float64".
    """
    cdt = _compute_dtype(precision)
    mods = (softcap, alibi_slopes, sinks)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        p, spans = _problem.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, grads=(do, o, lse), causal=causal,
                                            scale=scale, layout=layout, window=window)
        p = _problem.check_score_mods(p, q, *mods, sequences=len(spans))
        grads = [p.xp.empty(shape, dtype=_out_dtype(p, cdt)) for shape in (p.q_shape(), p.kv_shape(), p.v_shape())]
        dsinks = p.xp.zeros(p.hq, dtype=cdt)
        for pb, qs, ks in _sequences(p, cu_seqlens_q, cu_seqlens_k):
            parts = _backward_in(pb, cdt, do[qs], q[qs], k[ks], v[ks])
            for g, rows, part in zip(grads, (qs, ks, ks), parts):
                g[rows] = part
            if p.sinks is not None:
                dsinks += parts[3]
        return tuple(grads) + ((dsinks.astype(np.float32 if cdt == np.float32 else cdt),) if p.sinks is not None else ())
    p = _problem.validate_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout, window=window)
    p = _problem.check_score_mods(p, q, *mods)
    return _backward_in(p, cdt, do, q, k, v)


def _backward_in(p, cdt, do, q, k, v):
    """(dq, dk, dv[, dsinks]) in the caller's layout, for validated arrays of problem p."""
    xp = p.xp
    dq4, dk4, dv4, *dsinks = backward_bhsd(p, *_wide_bhsd(p, cdt, (do, q), (k, v)))
    out_dtype = _out_dtype(p, cdt)
    return (
        from_bhsd(_narrow(xp, dq4, out_dtype), p, p.hq, p.nq),
        from_bhsd(_narrow(xp, dk4, out_dtype), p, p.hkv, p.nk),
        from_bhsd(_narrow(xp, dv4, out_dtype), p, p.hkv, p.nk),
    ) + tuple(g.astype(np.float32 if cdt == np.float32 else cdt) for g in dsinks)
