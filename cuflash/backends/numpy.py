"""NumPy backend: the GPU's tiled algorithm, written with NumPy on (B, H, tile) blocks.

Forward: for each query tile of ``block_m`` rows, stream K/V tiles of ``block_n`` keys, keep a
running row max m, running sum l and an unnormalized accumulator, normalize once at the end and
write O (input dtype) and the natural-log LSE (float32). Nothing Nq x Nk is ever built; the
largest temporary is one (B, Hq, block_m, block_n) score tile. Like the CUDA kernel:

* the tile sizes are the kernel's (:func:`cuflash.plan.schedule.cpu_blocks`), so the CPU tests walk
  the same ragged last tiles, skipped fully-masked tiles and diagonal tiles;
* a sliding window (``p.window``, :func:`cuflash.core.masks.row_bounds`) computes only the K/V tiles
  that meet the band of a query tile, on both sides; tiles the band cuts are masked to -inf;
* K/V tiles are always ``block_n`` keys wide, zero-filled past Nk, and keys past Nk are masked
  to -inf (zero-filled keys would otherwise score 0 and leak into the softmax);
* the arithmetic is wider than the inputs and P is rounded to the input dtype before P V, as
  the tensor-core kernel packs it for mma.

Accumulator type: float32 for float16/bfloat16 inputs (the GPU's), float64 for float32 inputs.
Float32 accumulation of float32 inputs measured up to 4x the error allowed by the accuracy rule
(docs/testing.md) at d >= 64: d-term dot products and Nk-term sums rounded in the same precision
as the inputs lose to arithmetic one step wider. One step wider is the same principle the 16-bit
path follows.

Backward: recompute P tile by tile from the saved LSE, D = rowsum(dO * O), dV = P^T dO,
dP = dO V^T, dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q, all accumulated in the
accumulator type (P and dS are rounded to the input dtype before their products, as the tensor
cores take them). dK and dV are summed over the query heads of a group. For float32 inputs the
float32 LSE is first refined in float64 by one extra pass over the K tiles (see _refine_lse).
The loops are sequential, so the CPU backward is always deterministic: ``deterministic`` has no
effect.

GQA is done without copying K/V per query head: a query tile (B, Hq, R, d) is viewed as
(B, Hkv, group * R, d), whose rows all read the same K/V head.
"""

from __future__ import annotations

import numpy as np

from ..core import masks
from ..plan import schedule

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_NEG_INF = -np.inf


def accumulator_dtype(dtype):
    """The arithmetic type: wider than the input, float32 for 16-bit inputs, float64 for float32."""
    return _F64 if np.dtype(dtype) == _F32 else _F32


def _blocks(p, block_m, block_n):
    bm, bn = schedule.cpu_blocks(p.d)
    bm = bm if block_m is None else block_m
    bn = bn if block_n is None else block_n
    for name, val in (("block_m", bm), ("block_n", bn)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name}: expected a positive int, got {val!r}")
    return int(bm), int(bn)


def _round_to_input(x, dtype):
    """Round an operand (P or dS) to the input dtype, as the kernel packs it for its matmuls."""
    return x.astype(dtype).astype(x.dtype)


def _query_tile(a4, p, m0, m1):
    """Rows [m0, m1) of a (B, Hq, N, d) array in the accumulator type, as (B, Hkv, group * R, d)."""
    t = a4[:, :, m0:m1].astype(accumulator_dtype(p.dtype))
    return t.reshape(p.batch, p.hkv, p.group * (m1 - m0), t.shape[-1])


def _key_tile(a4, n0, block_n):
    """Keys [n0, n0 + block_n) of a (B, Hkv, Nk, d) array in the accumulator type, zero-filled past Nk."""
    b, h, nk, d = a4.shape
    t = np.zeros((b, h, block_n, d), dtype=accumulator_dtype(a4.dtype))
    cols = min(block_n, nk - n0)
    t[:, :, :cols] = a4[:, :, n0:n0 + cols]
    return t


def _scores(p, qt, kt, m0, m1, n0, bn, grad=False):
    """scale * Q K^T for one tile as (B, Hkv, group, R, block_n), score-modified (softcap, then
    ALiBi) and masked only where needed. ``grad``: also return d(modified)/d(scaled) of the
    softcap, 1 - tanh^2 (None without softcap; ALiBi's bias does not depend on q or k)."""
    r = m1 - m0
    s = np.matmul(qt, kt.swapaxes(-1, -2))
    s *= s.dtype.type(p.scale)
    s = s.reshape(p.batch, p.hkv, p.group, r, bn)
    factor = None
    if p.softcap is not None:
        c = s.dtype.type(p.softcap)
        t = np.tanh(s / c)
        s = c * t
        if grad:
            factor = 1 - t * t
    if p.alibi is not None:
        slopes = np.asarray(p.alibi, dtype=s.dtype).reshape(p.batch, p.hkv, p.group, 1, 1)
        dist = np.abs(np.arange(m0, m1)[:, None] + (p.nk - p.nq) - np.arange(n0, n0 + bn)[None, :])
        s = s - slopes * dist.astype(s.dtype)
    if masks.tile_needs_mask(p.causal, p.nq, p.nk, m0, n0, n0 + bn, p.window, m1):
        s = np.where(masks.visibility(np, p.causal, p.nq, p.nk, m0, m1, n0, n0 + bn, p.window), s, _NEG_INF)
    return (s, factor) if grad else s


def _sink_logits(p, acc_t, r):
    """The sinks as (1, Hkv, group, 1) in the accumulator type, broadcast over rows (None: none)."""
    if p.sinks is None:
        return None
    return np.asarray(p.sinks, dtype=acc_t).reshape(1, p.hkv, p.group, 1)


def _key_tiles(p, m0, m1, bn):
    """Start columns of the K/V tiles (multiples of bn) that rows [m0, m1) can see: the tiles
    covering the rows' key range (masks.key_range); fully masked tiles are skipped."""
    c0, c1 = masks.key_range(p.causal, p.nq, p.nk, m0, m1, p.window)
    return range(c0 - c0 % bn, c1, bn) if c1 > c0 else range(0)


def forward(p, q4, k4, v4, o4, lse3, *, block_m=None, block_n=None):
    """Write o4 (B, Hq, Nq, dv) in its dtype (the input's, or float32) and lse3 (B, Hq, Nq) float32.

    ``block_m`` / ``block_n`` override the kernel's tile sizes (tests use small ones so that
    short sequences still span many tiles)."""
    bm, bn = _blocks(p, block_m, block_n)
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    acc_t = accumulator_dtype(p.dtype)
    for m0 in range(0, p.nq, bm):
        m1 = min(m0 + bm, p.nq)
        r = m1 - m0
        qt = _query_tile(q4, p, m0, m1)
        stat_shape = (p.batch, p.hkv, p.group, r)
        m = np.full(stat_shape, _NEG_INF, dtype=acc_t)  # running max of scaled scores
        l = np.zeros(stat_shape, dtype=acc_t)  # running sum of exp(s - m)
        sink = _sink_logits(p, acc_t, r)
        if sink is not None:  # the sink is a key of its own that carries no value: exp(sink - sink) = 1
            m = np.broadcast_to(sink, stat_shape).copy()
            l[...] = 1
        acc = np.zeros((p.batch, p.hkv, p.group * r, p.dv), dtype=acc_t)  # unnormalized O
        for n0 in _key_tiles(p, m0, m1, bn):
            s = _scores(p, qt, _key_tile(k4, n0, bn), m0, m1, n0, bn)
            m_new = np.maximum(m, s.max(axis=-1))
            # A row that has seen no key yet keeps max -inf: shift by 0 so -inf - (-inf) never forms.
            shift = np.where(m_new == _NEG_INF, acc_t.type(0), m_new)
            alpha = np.exp(m - shift)  # exp(-inf) = 0 on a row's first visible tile
            probs = np.exp(s - shift[..., None])
            l = l * alpha + probs.sum(axis=-1)
            m = m_new
            acc *= alpha.reshape(p.batch, p.hkv, p.group * r, 1)
            pv_in = _round_to_input(probs, p.dtype).reshape(p.batch, p.hkv, p.group * r, bn)
            acc += np.matmul(pv_in, _key_tile(v4, n0, bn))
        seen = l > 0
        inv_l = np.divide(acc_t.type(1), l, out=np.zeros_like(l), where=seen)
        o = acc * inv_l.reshape(p.batch, p.hkv, p.group * r, 1)
        log_l = np.log(l, out=np.zeros_like(l), where=seen)
        lse = np.where(seen, m + log_l, _NEG_INF)
        # o4's dtype: q's, or float32 (out_dtype): the accumulator then is stored, never rounded to 16 bits.
        o4[:, :, m0:m1] = o.reshape(p.batch, p.hq, r, p.dv).astype(o4.dtype)
        lse3[:, :, m0:m1] = lse.reshape(p.batch, p.hq, r).astype(_F32)


def _refine_lse(p, q4, k4, lse, m0, m1, bn):
    """lse + log(sum_j exp(s_j - lse)) over the visible keys of rows [m0, m1), in float64, where
    that is within lse_tolerance of lse; elsewhere lse as given.

    Only for float32 inputs: the float32 lse of the interface has an absolute error up to
    u32 * |lse|, which exp(s - lse) turns into a relative error of every P in the row, larger
    than the rounding the float64 accumulator otherwise leaves. One pass over the K tiles,
    shifted by the stored lse (so no running max is needed), removes it."""
    qt = _query_tile(q4, p, m0, m1)
    shift = np.where(lse == _NEG_INF, 0.0, lse)
    total = np.zeros_like(lse)
    sink = _sink_logits(p, lse.dtype, m1 - m0)
    if sink is not None:
        total += np.exp(sink - shift)
    for n0 in _key_tiles(p, m0, m1, bn):
        s = _scores(p, qt, _key_tile(k4, n0, bn), m0, m1, n0, bn)
        total += np.exp(s - shift[..., None]).sum(axis=-1)
    seen = total > 0
    refined = np.where(seen, shift + np.log(total, out=np.zeros_like(total), where=seen), _NEG_INF)
    # The lse given may be over more keys than these (a merged, global lse: context parallelism
    # passes a slice of the keys). Only an lse within a few float32 roundings of these keys' own
    # is taken as theirs and refined; any other is honoured as given.
    both = np.isfinite(refined) & np.isfinite(lse)
    diff = np.subtract(refined, lse, out=np.full_like(lse, np.inf), where=both)
    close = np.abs(diff) <= lse_tolerance(lse)
    return np.where(close, refined, lse)


def lse_tolerance(lse):
    """How far a float32 lse may be from the exact log-sum-exp of its keys and still be taken as
    theirs: 2^-21 |lse| (4 to 8 float32 ulps; the forward rounds once, a merge adds about one),
    at least 2^-21. An lse over a superset of the keys that carry all but a fraction 2^-21 |lse|
    of the mass is within it; using the refined value then moves P by at most that."""
    return np.ldexp(np.maximum(np.abs(np.where(np.isfinite(lse), lse, 0.0)), 1.0), -21)


def backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, block_m=None, block_n=None,
             dsinks=None):
    """Write dq4 (B, Hq, Nq, d), dk4 (B, Hkv, Nk, d) and dv4 (B, Hkv, Nk, dv) in the input dtype; with sinks, add
    this problem's dsink_h = -sum_rows P_sink D into ``dsinks`` (Hq,) float32.

    The softcap's derivative 1 - tanh^2 multiplies dS before it is rounded for its products
    (the gradient with respect to the scaled, uncapped scores).

    Outer loop over K/V tiles (dK, dV of one tile stay in an accumulator), inner loop over the
    query tiles that see it; dQ accumulates in a (B, Hq, Nq, d) buffer of the accumulator type,
    like the GPU's dQ accumulator. ``deterministic`` is accepted for the common signature; the
    CPU is always deterministic."""
    bm, bn = _blocks(p, block_m, block_n)
    if p.batch == 0 or p.hkv == 0:
        return
    acc_t = accumulator_dtype(p.dtype)
    nq_tiles = [(m0, min(m0 + bm, p.nq)) for m0 in range(0, p.nq, bm)]
    # D = rowsum(dO * O) and the LSE with -inf replaced by +inf (a row that sees no key then gets
    # P = exp(-inf - inf) = 0, never exp(-inf + inf) = NaN), per query tile.
    row_dot, lse_safe = [], []
    for m0, m1 in nq_tiles:
        d = (do4[:, :, m0:m1].astype(acc_t) * o4[:, :, m0:m1].astype(acc_t)).sum(axis=-1)
        row_dot.append(d.reshape(p.batch, p.hkv, p.group, m1 - m0))
        lt = lse3[:, :, m0:m1].astype(acc_t).reshape(p.batch, p.hkv, p.group, m1 - m0)
        if acc_t != _F32:
            lt = _refine_lse(p, q4, k4, lt, m0, m1, bn)
        lse_safe.append(np.where(lt == _NEG_INF, np.inf, lt))
    if p.sinks is not None and dsinks is not None:
        # dL/dsink = -sum_i P_sink,i D_i: the sink's probability takes mass from every key in
        # proportion, and sum_j P_ij dP_ij = D_i (the sink carries no value).
        total = np.zeros(p.hq, dtype=acc_t)
        for t, (m0, m1) in enumerate(nq_tiles):
            p_sink = np.exp(_sink_logits(p, acc_t, m1 - m0) - lse_safe[t])
            total += -(p_sink * row_dot[t]).sum(axis=(0, 3)).reshape(p.hq)
        dsinks += total.astype(_F32)
    dq_acc = np.zeros((p.batch, p.hq, p.nq, p.d), dtype=acc_t)
    sc = acc_t.type(p.scale)
    for n0 in range(0, p.nk, bn):
        cols = min(bn, p.nk - n0)
        kt, vt = _key_tile(k4, n0, bn), _key_tile(v4, n0, bn)
        dk_acc = np.zeros((p.batch, p.hkv, bn, p.d), dtype=acc_t)
        dv_acc = np.zeros((p.batch, p.hkv, bn, p.dv), dtype=acc_t)
        for t, (m0, m1) in enumerate(nq_tiles):
            if not masks.tile_is_visible(p.causal, p.nq, p.nk, m0, m1, n0, p.window, n0 + bn):
                continue
            r = m1 - m0
            rows = p.group * r
            qt = _query_tile(q4, p, m0, m1)
            dot = _query_tile(do4, p, m0, m1)
            s, factor = _scores(p, qt, kt, m0, m1, n0, bn, grad=True)
            probs = np.exp(s - lse_safe[t][..., None])  # (B, Hkv, group, R, block_n)
            probs_mma = _round_to_input(probs, p.dtype).reshape(p.batch, p.hkv, rows, bn)
            dv_acc += np.matmul(probs_mma.swapaxes(-1, -2), dot)
            dprobs = np.matmul(dot, vt.swapaxes(-1, -2)).reshape(p.batch, p.hkv, p.group, r, bn)
            ds = probs * (dprobs - row_dot[t][..., None])
            if factor is not None:
                ds *= factor
            ds_mma = _round_to_input(ds, p.dtype).reshape(p.batch, p.hkv, rows, bn)
            dq_acc[:, :, m0:m1] += (np.matmul(ds_mma, kt) * sc).reshape(p.batch, p.hq, r, p.d)
            dk_acc += np.matmul(ds_mma.swapaxes(-1, -2), qt) * sc
        dk4[:, :, n0:n0 + cols] = dk_acc[:, :, :cols].astype(p.dtype)
        dv4[:, :, n0:n0 + cols] = dv_acc[:, :, :cols].astype(p.dtype)
    dq4[...] = dq_acc.astype(p.dtype)


def merge(o5, lse4, out4, lse_out3):
    """Log-sum-exp merge of partial results over disjoint key sets: o5 (P, B, H, N, d) parts and
    lse4 (P, B, H, N) float32 -> out4 (B, H, N, d) and lse_out3 (B, H, N) float32.

    m = max_i lse_i, w_i = exp(lse_i - m), o = sum_i w_i o_i / sum_i w_i, lse = m + log(sum_i w_i),
    in the accumulator type of the parts' dtype (as cuda_src/merge.cu). A part with lse = -inf saw
    no key and does not count, whatever its o holds; a row no part saw gets o = 0, lse = -inf."""
    acc_t = accumulator_dtype(o5.dtype)
    lse = lse4.astype(acc_t)
    m = lse.max(axis=0)
    seen_part = lse != _NEG_INF
    shift = np.where(m == _NEG_INF, acc_t.type(0), m)
    w = np.where(seen_part, np.exp(lse - shift), acc_t.type(0))
    total = w.sum(axis=0)
    parts = np.where(seen_part[..., None], o5.astype(acc_t), acc_t.type(0))  # a skipped part's NaN stays out
    acc = (w[..., None] * parts).sum(axis=0)
    seen = total > 0
    inv = np.divide(acc_t.type(1), total, out=np.zeros_like(total), where=seen)
    out4[...] = (acc * inv[..., None]).astype(out4.dtype)
    log_total = np.log(total, out=np.zeros_like(total), where=seen)
    lse_out3[...] = np.where(seen, m + log_total, _NEG_INF).astype(_F32)
