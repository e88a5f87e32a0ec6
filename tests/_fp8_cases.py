"""FP8 forward cases and their accuracy check, shared by the e4m3 GPU kernel's tests
(test_gpu_fp8_forward.py) and the CPU tests of the check itself (test_fp8_forward_bound.py).

Inputs: N(0, 1) values times a magnitude per (batch entry, head) and tensor - the B x H values
2^-SPREAD .. 2^SPREAD evenly spaced in log, in random order - quantized to e4m3 per tensor or per
(batch, head): per-head descales then differ by at least 2^(2 SPREAD / (B H - 1)) from head to
head, so a kernel reading another head's descale is off by such a factor.

The check (:func:`assert_fp8_forward`), o against the float64 reference of the dequantized values
(the test's own dequantization) by the project's rule (cuflash.testing, docs/testing.md):

    max|o - ref| <= FACTOR * max_r |yard_r - ref| + u_out * max|ref|.

The yardstick realizations yard_r are cuflash.fp8.emulate_attention: float32 scores, P rounded to
e4m3 for P V, float32 accumulation, o rounded once. What the kernel's o differs from ref by:

(i) P's e4m3 rounding (relative error <= 2^-4 down to 2^-6, absolute <= 2^-10 below), at the
    kernel's rounding points: the online softmax rounds exp(S - m_t) against the running max m_t
    of the key tiles seen so far, not the row's max - so the first realization is emulated at the
    kernel's own points (its tile's block_n), the others at the row max and at two shorter tiles'
    running maxima;
(ii) the tensor cores' accumulation: FP8 wgmma keeps fewer significand bits than float32 in each
    k32 step (DeepSeek-V3's report: about 14; the PTX ISA does not say). In S that moves the
    e4m3 rounding of a small share of the P values to their neighbours (another realization of
    (i)); in P V it adds a few units of 2^-13 of a step's magnitudes per 32 keys;
(iii) float32 sums, ex2.approx (~2^-22 relative) and the descale product's roundings: orders of
    magnitude below (i);
(iv) o's one rounding to the output dtype: u_out * max|ref|.
The realizations' largest error bounds one realization of (i) and FACTOR = 2 leaves the same again
for another realization plus (ii)-(iii) - the rule's reasoning for the 16-bit kernels, where P is
rounded to bf16. A kernel that drops v's descale is off by a factor 1/v_descale ~ 100, one that
reads another head's descale by a factor of the magnitudes' spacing: far outside
(test_fp8_forward_bound.py shows both fail this check).

lse (float32 out of float32 arithmetic on scores from the tensor cores): |lse - lse64| <=
cuflash.testing.lse_bound (float32) + steps * 33 * 2^-13 * A_i, A_i = max over the keys row i sees
of scale * sum_t |q_it k_jt| (dequantized): lse moves by at most the largest score error, and each
of the kernel's HEAD_DIM / 32 k-steps loses less than one unit of 2^-13 of its largest magnitude
(<= A_i) on each of its 33 terms (the accumulator and 32 products) when it keeps 14 bits: the
worst case of that model, loose next to its typical ~2 units per row.
"""

from __future__ import annotations

import numpy as np

from cuflash import fp8
from cuflash.testing import FACTOR, assert_lse_within_bound, assert_within_rule, lse_bound, reference64, visibility

SPREAD = 1.0  # per-(batch, head) magnitudes 2^U(-1, 1)
FP8_STEP_LOSS = 33 * 2.0**-13  # per k32 step of S, relative to its largest magnitude (module docstring)


def _heads_axis(layout):
    return 1 if layout == "bhsd" else 2


def _expand(descale, layout):
    """A (B, H) descale broadcast against (B, H, N, d) / (B, N, H, d) values."""
    return descale[:, :, None, None] if layout == "bhsd" else descale[:, None, :, None]


def make_case(rng, b, hq, hkv, nq, nk, d, *, granularity="head", layout="bhsd", q_per_kv_head=False):
    """dict of NumPy e4m3 q8, k8, v8 and their float32 descales qd, kd, vd: per tensor (shape ())
    or per (batch, head) ((B, H)); ``q_per_kv_head``: q's descale per (batch, K/V head), shared by
    the group (FlashAttention-3's), from the group's amax."""
    ax = _heads_axis(layout)

    def values(h, n):
        shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
        mag = 2.0 ** rng.permutation(np.linspace(-SPREAD, SPREAD, b * h)).reshape(b, h)
        return (rng.standard_normal(shape) * _expand(mag, layout)).astype(np.float32)

    q, k, v = values(hq, nq), values(hkv, nk), values(hkv, nk)
    out = {}
    for name, x in (("k", k), ("v", v)):
        out[name + "8"], out[name + "d"] = fp8.quantize(x, granularity=granularity, layout=layout)
    if q_per_kv_head:
        group = hq // hkv
        amax = np.abs(q).max(axis=(2, 3) if layout == "bhsd" else (1, 3)).reshape(b, hkv, group).max(axis=2)
        qd = np.where(amax > 0, amax / fp8.E4M3_MAX, 1.0).astype(np.float32)  # (B, Hkv)
        out["q8"] = fp8.to_e4m3(q / _expand(np.repeat(qd, group, axis=1), layout))
        out["qd"] = qd
    else:
        out["q8"], out["qd"] = fp8.quantize(q, granularity=granularity, layout=layout)
    out["layout"] = layout
    assert out["q8"].shape[ax] == hq and out["k8"].shape[ax] == hkv
    return out


def q_descale_per_q_head(case):
    """q's descale as emulate_attention takes it: () or (B, Hq) (a per-K/V-head one repeated)."""
    qd, ax = case["qd"], _heads_axis(case["layout"])
    hq, hkv = case["q8"].shape[ax], case["k8"].shape[ax]
    return np.repeat(qd, hq // hkv, axis=1) if qd.ndim == 2 and qd.shape[1] != hq else qd


def dequantized(case):
    """(q, k, v) float32: the values the e4m3 inputs stand for, by this module's own arithmetic
    (the product of a 4-bit and a 24-bit significand is exact in float64, rounded once)."""
    layout = case["layout"]
    out = []
    for x8, d in ((case["q8"], q_descale_per_q_head(case)), (case["k8"], case["kd"]), (case["v8"], case["vd"])):
        x = x8.astype(np.float64)
        d = np.asarray(d, dtype=np.float64)
        out.append((x * (d if d.ndim == 0 else _expand(d, layout))).astype(np.float32))
    return tuple(out)


def yardstick(case, *, causal, block_n, out_dtype, descales=None, scale=None, window=None):
    """The realizations of module docstring (i): emulate_attention at the kernel's rounding points
    (block_n), then at the row max and at running maxima over block_n / 2 and
    block_n / 4 keys. ``descales``: (qd, kd, vd) to emulate with instead of the case's (per q head).
    ``window``: a sliding window (the band kernel's key tiles start on multiples of block_n too)."""
    qd, kd, vd = descales if descales is not None else (q_descale_per_q_head(case), case["kd"], case["vd"])
    kw = dict(causal=causal, layout=case["layout"], out_dtype=out_dtype, scale=scale, window=window)
    args = (case["q8"], case["k8"], case["v8"], qd, kd, vd)
    first = fp8.emulate_attention(*args, block_n=block_n, **kw)
    others = [fp8.emulate_attention(*args, block_n=bn, **kw) for bn in (None, block_n // 2, block_n // 4)]
    return [first] + others


def score_error_bound(q, k, *, causal, layout, steps, scale=None, mask=None):
    """Per row (lse's shape): steps * FP8_STEP_LOSS * A_i (module docstring), 0 where a row sees no key.
    ``mask``: the (Nq, Nk) visibility in place of causal's."""
    qa, ka = (np.swapaxes(x, 1, 2) if layout == "bshd" else x for x in (q, k))
    qa, ka = np.abs(qa.astype(np.float64)), np.abs(ka.astype(np.float64))
    group = qa.shape[1] // ka.shape[1]
    ka = np.repeat(ka, group, axis=1)
    d = qa.shape[-1]
    sc = 1.0 / np.sqrt(d) if scale is None else scale
    a = sc * (qa @ np.swapaxes(ka, -1, -2))
    vis = visibility(causal, qa.shape[2], ka.shape[2]) if mask is None else mask
    a = np.where(vis, a, 0.0).max(axis=-1, initial=0.0)
    return steps * FP8_STEP_LOSS * a


def assert_fp8_forward(o, lse, case, *, causal, block_n, steps, out_dtype, scale=None, descales=None, window=None,
                       mask=None, yards=None):
    """The module docstring's check of a forward result (o in out_dtype, lse float32 or None).
    ``steps``: the kernel's k-steps of S (HEAD_DIM / 32). ``mask``: the reference's (Nq, Nk)
    visibility (a window's or packed sequences', built by tests/_brute_mask.py; causal then
    False); ``window``: the yardstick's window; ``yards``: its realizations given (packed_yardstick).
    Returns (o's error, its bound)."""
    layout = case["layout"]
    wide = dequantized(case)
    ref_o, ref_lse = reference64(*wide, causal=causal, layout=layout, scale=scale, mask=mask)
    if yards is None:
        yards = yardstick(case, causal=causal, block_n=block_n, out_dtype=out_dtype, descales=descales, scale=scale,
                          window=window)
    err = assert_within_rule("o", o, ref_o, [y[0] for y in yards], out_dtype, FACTOR)
    if lse is not None:
        bound = lse_bound(*wide, causal=causal, layout=layout, scale=scale, mask=mask)
        bound = bound + score_error_bound(wide[0], wide[1], causal=causal, layout=layout, steps=steps, scale=scale,
                                          mask=mask)
        assert_lse_within_bound("lse", lse, ref_lse, bound)
    return err


def packed_case(rng, nqs, nks, hq, hkv, d):
    """make_case of one batch entry of sum(nqs) queries and sum(nks) keys ("bshd", per-tensor
    descales: what packed sequences take) and the int32 offsets of sequences of nqs[b] queries and
    nks[b] keys; the packed arrays are its q8[0], k8[0], v8[0]."""
    cq = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(nks)]).astype(np.int32)
    case = make_case(rng, 1, hq, hkv, int(cq[-1]), int(ck[-1]), d, granularity="tensor", layout="bshd")
    return case, cq, ck


def packed_yardstick(case, cq, ck, *, causal, window, block_n, out_dtype, key_group=32):
    """yardstick's realizations of a packed_case, sequence by sequence. The band kernel's key tiles
    of sequence b start at the key group of its first key (ck[b] rounded down to ``key_group``, the
    e4m3 kernel's vt groups), so its rounding points are emulated over the keys from there, the
    earlier ones masked; the other realizations over the sequence's own keys."""
    hq, d = case["q8"].shape[2], case["q8"].shape[3]
    nq_total = case["q8"].shape[1]
    outs = [(np.zeros((1, nq_total, hq, d), dtype=out_dtype), np.full((1, hq, nq_total), -np.inf, np.float32))
            for _ in range(4)]
    descales = (case["qd"], case["kd"], case["vd"])
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cq[b], cq[b + 1], ck[b], ck[b + 1]))
        if q1 == q0 or k1 == k0:  # (no query, or no key: o = 0, lse = -inf)
            continue
        q8 = case["q8"][:, q0:q1]
        start = k0 - k0 % key_group
        vis = visibility(causal, q1 - q0, k1 - k0, window)
        vis_from_group = np.concatenate([np.zeros((q1 - q0, k0 - start), dtype=bool), vis], axis=1)
        realizations = [fp8.emulate_attention(q8, case["k8"][:, start:k1], case["v8"][:, start:k1], *descales,
                                              layout="bshd", out_dtype=out_dtype, block_n=block_n, mask=vis_from_group)]
        for bn in (None, block_n // 2, block_n // 4):
            realizations.append(fp8.emulate_attention(q8, case["k8"][:, k0:k1], case["v8"][:, k0:k1], *descales,
                                                      causal=causal, window=window, layout="bshd",
                                                      out_dtype=out_dtype, block_n=bn))
        for (o, lse), (ob, lb) in zip(outs, realizations):
            o[:, q0:q1] = ob
            lse[:, :, q0:q1] = lb
    return outs


def batch_entry_case(case, b, nk):
    """The case of batch entry b over its first nk keys (kv_lens), its descales' row b."""
    ax = _heads_axis(case["layout"])
    keys = (slice(b, b + 1), slice(None), slice(0, nk)) if ax == 1 else (slice(b, b + 1), slice(0, nk))
    out = dict(case, q8=case["q8"][b:b + 1], k8=case["k8"][keys], v8=case["v8"][keys])
    for name in ("qd", "kd", "vd"):
        out[name] = case[name] if case[name].ndim == 0 else case[name][b:b + 1]
    return out

