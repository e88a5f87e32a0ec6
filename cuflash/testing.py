"""Test helpers shared by the CPU and GPU tests: inputs, the float64 oracle, the yardstick, the rule.

The accuracy rule (docs/testing.md gives the reasoning). Every result is compared with the float64
reference computed from the *same* low-precision inputs.

* o, dq, dk, dv: at most FACTOR (= 2) times the error of the *yardstick* plus one rounding of the
  largest reference value:

      max|got - ref| <= FACTOR * max|yard - ref| + u * max|ref|        (u: the input dtype's)

  The yardstick (:func:`faithful_attention`, :func:`faithful_attention_backward`) is the
  arithmetic a correct kernel promises, materialized: scores, the softmax and every accumulation
  in float32 (float64 for float32 inputs, which the kernels compute in float64; exponentials
  below the smallest normal float32 are zero, as the GPU's exp2 gives them), the unnormalized
  P and dS rounded to the input dtype before their products (as the tensor cores take them),
  D = rowsum(dO * O) from the rounded O, and each output rounded once. Its error is measured, not
  assumed, so the bound tracks the inputs. A kernel that rounds the scores to the input dtype
  before the softmax, or accumulates in the input dtype, is several times worse and fails.
* lse (float32 in the interface): per row, an a-priori bound of float32 arithmetic,
  :func:`lse_bound`:

      |lse_i - lse64_i| <= u32 * ((2d + 4) * A_i + 4 * N_i + 8 + 2 * |lse64_i|)

  with A_i = scale * max over the keys j row i sees of sum_t |q_it k_jt|, N_i the number of keys
  row i sees, u32 = 2^-24. Rows that see no key must give exactly -inf.

The oracle side (the float64 reference, the yardstick, the bounds) takes its visibility from
:func:`visibility` (cuflash.backends.reference.visibility: explicit index comparisons), never from
cuflash.core.masks. ``mask=`` (every function below that takes it): an explicit boolean (Nq, Nk)
visibility matrix that replaces ``causal``/``window``.

Works for NumPy and CuPy arrays (CuPy arrays are copied to the host with ``.get()``); bfloat16
comes from ml_dtypes.
"""

from __future__ import annotations

import math

import numpy as np

from .backends import reference
from .core.arrays import BFLOAT16, UNIT_ROUNDOFF, dtype_name
from .core.layout import from_bhsd, to_bhsd
from .core.problem import validate_forward

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

FACTOR = 2.0  # o, dq, dk, dv: at most FACTOR x the yardstick's error + one rounding (docs/testing.md)
REALIZATIONS = 4  # the yardstick's error is the largest of at least this many rounding realizations
SAMPLES = 128  # ... and of enough of them that rows x realizations reaches this (docs/testing.md)
MAX_REALIZATIONS = 32
U32 = 2.0**-24


def to_numpy(a):
    """A NumPy array of ``a`` (CuPy arrays are copied from the device)."""
    if type(a).__module__.split(".")[0] == "cupy":
        if a.dtype == BFLOAT16:  # CuPy's bfloat16 is storage only: copy the bits
            return a.view(np.uint16).get().view(BFLOAT16)
        return a.get()
    return np.asarray(a)


def random_array(rng, shape, dtype, scale=1.0):
    """Fresh standard-normal values times ``scale``, rounded to ``dtype`` (NumPy)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def random_inputs(rng, shape_q, shape_kv, dtype, scale=1.0):
    """(q, k, v) NumPy arrays of fresh random normal values times ``scale``, in ``dtype``.

    ``scale`` may be a number or a (q, k, v) triple of numbers."""
    scales = scale if isinstance(scale, (tuple, list)) else (scale, scale, scale)
    q = random_array(rng, shape_q, dtype, scales[0])
    k = random_array(rng, shape_kv, dtype, scales[1])
    v = random_array(rng, shape_kv, dtype, scales[2])
    return q, k, v


# ----------------------------------------------------------------------------- the oracle side

def causal_mode(causal):
    """The public causal= argument as None, "top_left" or "bottom_right" (True is bottom-right)."""
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if causal not in ("top_left", "bottom_right"):
        raise ValueError(f"causal: {causal!r}")
    return causal


def visibility(causal, nq, nk, window=None):
    """(nq, nk) boolean visibility of the oracle: reference.visibility (own index comparisons)."""
    win = None if window is None or tuple(window) == (-1, -1) else tuple(int(w) for w in window)
    return reference.visibility(np, causal_mode(causal), win, nq, nk)


class _Case:
    """One problem on the oracle side: float64 (B, H, N, d) arrays (k-side per query head, GQA by
    h // group), the visibility, the problem's shape facts."""

    def __init__(self, q, k, v, causal, scale, layout, mask, window, q_side=(), mods=None):
        q, k, v = (to_numpy(a) for a in (q, k, v))
        p = validate_forward(q, k, v, scale=scale, layout=layout)
        self.p = p
        # Score modifiers (None: off): softcap c; ALiBi slopes as (B, Hq, 1, 1); sinks as (1, Hq, 1, 1).
        mods = mods or {}
        self.softcap = None if mods.get("softcap") is None else float(mods["softcap"])
        a = mods.get("alibi_slopes")
        self.alibi = None if a is None else np.broadcast_to(
            to_numpy(a).astype(_F64).reshape(-1, p.hq), (p.batch, p.hq))[:, :, None, None]
        sk = mods.get("sinks")
        self.sinks = None if sk is None else to_numpy(sk).astype(_F64).reshape(1, p.hq, 1, 1)
        # The oracle's own default scale, not the problem's (a wrong default must not reach both sides).
        self.scale = 1.0 / math.sqrt(p.d) if scale is None and p.d > 0 else (1.0 if scale is None else float(scale))
        if mask is None:
            mask = visibility(causal, p.nq, p.nk, window)
        self.mask = np.asarray(mask, dtype=bool)
        assert self.mask.shape == (p.nq, p.nk), f"mask shape {self.mask.shape}, want {(p.nq, p.nk)}"
        self.heads = np.arange(p.hq) // max(p.group, 1)
        self.q4 = to_bhsd(q, p, p.hq, p.nq).astype(_F64)
        self.k4 = to_bhsd(k, p, p.hkv, p.nk).astype(_F64)[:, self.heads]
        self.v4 = to_bhsd(v, p, p.hkv, p.nk).astype(_F64)[:, self.heads]
        self.q_side = [to_bhsd(to_numpy(a), p, p.hq, p.nq).astype(_F64) for a in q_side]

    def group_sum(self, g):
        """(B, Hq, Nk, d) per query head -> (B, Hkv, Nk, d): the heads of a group summed."""
        p = self.p
        return g.reshape(p.batch, p.hkv, p.group, p.nk, g.shape[-1]).sum(axis=2)

    def out_q(self, a4):
        return from_bhsd(a4, self.p, self.p.hq, self.p.nq)

    def out_kv(self, a4):
        return from_bhsd(a4, self.p, self.p.hkv, self.p.nk)


def _modify(c, s):
    """(modified scores, derivative of the softcap or None) of the oracle, in s's dtype: the
    softcap c tanh(s / c), then ALiBi's bias -slope |i + Nk - Nq - j| (FlashAttention-2)."""
    p = c.p
    deriv = None
    if c.softcap is not None:
        cap = s.dtype.type(c.softcap)
        th = np.tanh(s / cap)
        s = th * cap
        deriv = 1 - th * th
    if c.alibi is not None:
        rel = np.subtract.outer(np.arange(p.nq) + (p.nk - p.nq), np.arange(p.nk))
        s = s + (-c.alibi).astype(s.dtype) * np.abs(rel).astype(s.dtype)
    return s, deriv


def _sink_parts(c, m, dtype):
    """(row max including the sink, the sink as (1, Hq, 1, 1) or None) in ``dtype``."""
    if c.sinks is None:
        return m, None
    sink = c.sinks.astype(dtype)
    return np.maximum(m, sink), sink


def _softmax_parts(c):
    """(e, l, shift) of the oracle's softmax, float64 (B, Hq, Nq, Nk / 1): e = exp(s - shift) on
    the visible pairs, 0 elsewhere; l its row sums (0 where a row sees no key), the sink's
    exp(sink - shift) included."""
    s = np.matmul(c.q4, c.k4.swapaxes(-1, -2)) * c.scale
    s = np.where(c.mask, _modify(c, s)[0], -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m, sink = _sink_parts(c, m, _F64)
    shift = np.where(m == -np.inf, 0.0, m)
    e = np.exp(s - shift)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - shift)
    return e, l, shift


def _probabilities(c):
    """float64 P (B, Hq, Nq, Nk) of the oracle's case (0 where a row sees no key)."""
    e, l, _ = _softmax_parts(c)
    return e / np.where(l > 0, l, 1.0)


def _reference_forward4(c):
    """float64 (o4, lse3) by the materializing reference, with the oracle's visibility."""
    p = c.p
    e, l, shift = _softmax_parts(c)
    seen = l > 0
    o4 = np.matmul(e / np.where(seen, l, 1.0), c.v4)
    lse = np.where(seen, shift + np.log(np.where(seen, l, 1.0)), -np.inf)
    return o4, lse[..., 0]


def reference64(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None, **mods):
    """(o, lse) of the float64 reference from the same (low-precision) inputs, as NumPy float64.

    The formula written out here with float64 NumPy (its visibility: :func:`visibility`); it
    shares no arithmetic or mask code with the backends. ``mods``: softcap, alibi_slopes, sinks
    as cuflash.attention takes them (lse includes the sink)."""
    c = _Case(q, k, v, causal, scale, layout, mask, window, mods=mods)
    o4, lse3 = _reference_forward4(c)
    return c.out_q(o4), lse3.reshape(c.p.lse_shape())


def reference64_backward(do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None, **mods):
    """(dq, dk, dv) of the float64 reference from the same inputs, as NumPy float64; with sinks
    (dq, dk, dv, dsinks).

    P is rebuilt in float64 and D_i = sum_j P_ij dP_ij (= rowsum(dO * O) exactly); the softcap's
    derivative multiplies dS; dsink_h = -sum_rows P_sink D."""
    c = _Case(q, k, v, causal, scale, layout, mask, window, q_side=(do,), mods=mods)
    p, (do4,) = c.p, c.q_side
    s = np.matmul(c.q4, c.k4.swapaxes(-1, -2)) * c.scale
    s, deriv = _modify(c, s)
    e, l, shift = _softmax_parts(c)
    probs = e / np.where(l > 0, l, 1.0)
    dprobs = np.matmul(do4, c.v4.swapaxes(-1, -2))
    row_dot = (probs * dprobs).sum(axis=-1, keepdims=True)
    ds = probs * (dprobs - row_dot)
    if deriv is not None:
        ds = ds * deriv
    dq4 = np.matmul(ds, c.k4) * c.scale
    dk4 = c.group_sum(np.matmul(ds.swapaxes(-1, -2), c.q4) * c.scale)
    dv4 = c.group_sum(np.matmul(probs.swapaxes(-1, -2), do4))
    grads = (c.out_q(dq4), c.out_kv(dk4), c.out_kv(dv4))
    if c.sinks is None:
        return grads
    p_sink = np.exp(c.sinks - shift) / l
    return grads + (-(p_sink * row_dot).sum(axis=(0, 2, 3)),)


# ----------------------------------------------------------------------------- the yardstick

def _acc(dtype):
    """The yardstick's arithmetic: float32 for 16-bit inputs, float64 for float32 inputs."""
    return _F64 if np.dtype(dtype) == _F32 else _F32


def _flush(x, acc):
    """x with its float32 subnormals (|x| below the smallest normal float32) set to zero, as the
    kernels' float32 arithmetic gives them; float64 keeps its subnormals."""
    if acc == _F32:
        x = np.where(np.abs(x) < np.finfo(_F32).tiny, acc.type(0), x)
    return x


def _exp(x, acc):
    """exp in the yardstick's arithmetic: in float32, results below the smallest normal float32 are
    zero, as the kernels' exp2 (ex2.approx.ftz) gives them."""
    return _flush(np.exp(x), acc)


def _rnd(x, dtype):
    """x rounded to the input dtype, kept in x's dtype."""
    return x.astype(dtype).astype(x.dtype)


def _row_scales(c, realization, acc, salt):
    """Per-row factors in [1, 2) that move where P or dS is rounded (realization 0: none).

    round(x * c) / c is the same rounding of x at another point of the binade: what a kernel
    gets when it rounds exp(s - m') against a running max m' = m - log(c) of a tile instead of
    the row max. Drawn from a fixed generator, so the yardstick is a function of its inputs."""
    p = c.p
    if realization == 0:
        return acc.type(1)
    g = np.random.default_rng([realization, salt, p.nq, p.nk])
    return g.uniform(1.0, 2.0, size=(p.batch, p.hq, p.nq, 1)).astype(acc)


def _rnd_at(x, dtype, scales):
    """x rounded to the input dtype at the points moved by ``scales`` (per row), kept in x's dtype."""
    return _rnd(x * scales, dtype) / scales


def realizations(p) -> int:
    """How many yardstick realizations a problem's bound takes the largest error of: REALIZATIONS,
    more for a problem of few rows (B Hq Nq), so that rows x realizations reaches SAMPLES (at most
    MAX_REALIZATIONS). With few rows the largest error over them is a small sample of a
    heavy-tailed error (docs/testing.md)."""
    rows = max(p.batch * p.hq * p.nq, 1)
    return int(min(MAX_REALIZATIONS, max(REALIZATIONS, -(-SAMPLES // rows))))


def _faithful_forward4(c, realization=0):
    """(o4 before its rounding to the input dtype, lse3, scores s) in the yardstick's arithmetic
    (acc dtype)."""
    p = c.p
    acc = _acc(p.dtype)
    qa, ka, va = (a.astype(acc) for a in (c.q4, c.k4, c.v4))
    s = np.matmul(qa, ka.swapaxes(-1, -2))
    s = s * acc.type(c.scale)
    s, c.yard_deriv = _modify(c, s)
    s = np.where(c.mask, s, acc.type(-np.inf))
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m, sink = _sink_parts(c, m, acc)
    shift = np.where(m == -np.inf, acc.type(0), m)
    e = _exp(s - shift, acc)  # unnormalized P in acc; rounded to the input dtype for P V only
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + _exp(sink - shift, acc)
    seen = l > 0
    o4 = np.matmul(_rnd_at(e, p.dtype, _row_scales(c, realization, acc, 1)), va) / np.where(seen, l, acc.type(1))
    o4 = _flush(o4, acc)  # the split-KV decode kernels return 0 for a float32 output below 2^-126
    lse3 = np.where(seen, shift + np.log(np.where(seen, l, acc.type(1))), acc.type(-np.inf))[..., 0]
    return o4.astype(acc), lse3.astype(acc), s


def faithful_attention(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None, **mods):
    """(o, lse): the yardstick forward (module docstring), o in the input dtype and lse float32,
    NumPy arrays shaped like cuflash.attention's outputs."""
    return _faithful_forward(_Case(q, k, v, causal, scale, layout, mask, window, mods=mods))


def _faithful_forward(c, realization=0):
    o4, lse3, _ = _faithful_forward4(c, realization)
    return c.out_q(o4.astype(c.p.dtype)), lse3.astype(_F32).reshape(c.p.lse_shape())


def _forward_yardsticks(c):
    """o of each of the problem's realizations, rounded to the input dtype and before that rounding
    (assert_within_rule's ``yard``: the final rounding may land one on the reference's own nearest
    value and hide its arithmetic's error; docs/testing.md)."""
    raws = [_faithful_forward4(c, r)[0] for r in range(realizations(c.p))]
    return [c.out_q(o4.astype(c.p.dtype)) for o4 in raws] + [c.out_q(o4) for o4 in raws]


def faithful_attention_backward(do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None,
                                **mods):
    """(dq, dk, dv): the yardstick backward, in the input dtype.

    P = exp(s - lse) with s and lse of the yardstick forward; dV = round(P)^T dO; dP = dO V^T;
    D = rowsum(dO * O) with O the yardstick's rounded output; dS = P (dP - D); dQ = scale
    round(dS) K; dK = scale round(dS)^T Q; everything in the accumulator type, the heads of a
    group summed there, each gradient rounded once. The softcap's derivative multiplies dS before
    its rounding; with sinks a fourth result, dsinks = -sum_rows P_sink D in the accumulator type
    (float32 out)."""
    return _faithful_backward(_Case(q, k, v, causal, scale, layout, mask, window, q_side=(do,), mods=mods))


def _faithful_backward(c, realization=0):
    return _faithful_backward_both(c, realization)[0]


def _faithful_backward_both(c, realization=0):
    """(gradients, the same before their final rounding) of one realization of the yardstick
    backward (dsinks is float32 in both)."""
    p = c.p
    acc = _acc(p.dtype)
    o4, lse3, s = _faithful_forward4(c, realization)
    o4 = _rnd(o4, p.dtype)
    do4 = c.q_side[0].astype(acc)
    ka, va, qa = (a.astype(acc) for a in (c.k4, c.v4, c.q4))
    lse_safe = np.where(lse3 == -np.inf, acc.type(np.inf), lse3)[..., None]
    probs = _exp(s - lse_safe, acc)
    dv4 = np.matmul(_rnd_at(probs, p.dtype, _row_scales(c, realization, acc, 2)).swapaxes(-1, -2), do4)
    dprobs = np.matmul(do4, va.swapaxes(-1, -2))
    row_dot = (do4 * o4).sum(axis=-1, keepdims=True)
    ds = probs * (dprobs - row_dot)
    if c.yard_deriv is not None:
        ds = ds * c.yard_deriv
    ds = _rnd_at(ds, p.dtype, _row_scales(c, realization, acc, 3))
    sc = acc.type(c.scale)
    dq4 = np.matmul(ds, ka) * sc
    dk4 = np.matmul(ds.swapaxes(-1, -2), qa) * sc
    raw = (c.out_q(dq4), c.out_kv(c.group_sum(dk4).astype(acc)), c.out_kv(c.group_sum(dv4).astype(acc)))
    grads = tuple(g.astype(p.dtype) for g in raw)
    if c.sinks is None:
        return grads, raw
    p_sink = _exp(c.sinks.astype(acc) - lse_safe, acc)
    dsinks = ((-(p_sink * row_dot).sum(axis=(0, 2, 3))).astype(_F32),)
    return grads + dsinks, raw + dsinks


def lse_bound(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None, **mods):
    """Per-row a-priori bound on |lse - lse64| for an lse computed in float32 arithmetic (the
    module docstring's formula; docs/testing.md derives it), shaped like lse; 0 where a row sees
    no key (there lse must be exactly -inf). Score modifiers widen A_i: the softcap's tanh adds
    two roundings of c (its derivative is at most 1, so the score's own error does not grow),
    ALiBi's bias its magnitude (one product and one sum)."""
    c = _Case(q, k, v, causal, scale, layout, mask, window, mods=mods)
    p = c.p
    ref_lse = _reference_forward4(c)[1]
    a = np.matmul(np.abs(c.q4), np.abs(c.k4).swapaxes(-1, -2)) * c.scale
    if c.softcap is not None:
        a = a + 2 * c.softcap
    if c.alibi is not None:
        a = a + np.abs(c.alibi) * np.abs(np.subtract.outer(np.arange(p.nq) + (p.nk - p.nq), np.arange(p.nk)))
    a = np.where(c.mask, a, 0.0).max(axis=-1, initial=0.0)
    n = c.mask.sum(axis=-1)  # (Nq,)
    finite = np.isfinite(ref_lse)
    bound = U32 * ((2 * p.d + 4) * a + 4 * n + 8 + 2 * np.abs(np.where(finite, ref_lse, 0.0)))
    return np.where(finite, bound, 0.0).reshape(p.lse_shape())


def _under_allocator(fn, on_alloc):
    """fn() with CuPy's default pool allocating through a hook: on_alloc(memory, nbytes) sees every
    allocation fn makes. The device is synchronized before and after."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def malloc(nbytes):
        mem = pool.malloc(nbytes)
        on_alloc(mem, nbytes)
        return mem

    cupy.cuda.Device().synchronize()
    cupy.cuda.set_allocator(malloc)
    try:
        result = fn()
        cupy.cuda.Device().synchronize()
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    return result


def recorded_allocations(fn):
    """(fn(), the byte sizes of every allocation fn makes from CuPy's default memory pool, in
    order), recorded through CuPy's allocator hook; the device is synchronized before and after."""
    sizes = []
    result = _under_allocator(fn, lambda mem, nbytes: sizes.append(nbytes))
    return result, sizes


def max_abs(x):
    return float(np.max(np.abs(x))) if x.size else 0.0


def _finite_checks(name, got, ref):
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != reference shape {ref.shape}"
    assert not np.isnan(ref).any(), f"{name}: the float64 reference has NaN"
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(got)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values where the reference is finite"
    wrong_inf = ~finite & (got != ref)
    assert not wrong_inf.any(), (
        f"{name}: {int(wrong_inf.sum())} values differ where the reference is infinite "
        f"(e.g. got {got[wrong_inf][:3]}, want {ref[wrong_inf][:3]})"
    )
    return finite


def assert_within_rule(name, got, ref64, yard, dtype, factor=FACTOR):
    """Assert max|got - ref| <= factor * max|yard - ref| + u * max|ref| (u of ``dtype``).

    ``yard``: one yardstick result or a list of its realizations (the largest error counts).

    Also: shapes agree, got is finite wherever ref is finite and equals ref where ref is
    infinite. The yardstick must itself be finite where ref is (else the bound is vacuous).
    Returns (error, bound)."""
    got = to_numpy(got).astype(_F64)
    ref = to_numpy(ref64).astype(_F64)
    yards = [to_numpy(y).astype(_F64) for y in (yard if isinstance(yard, (list, tuple)) else [yard])]
    dtype = np.dtype(dtype)
    finite = _finite_checks(name, got, ref)
    for yd in yards:
        assert yd.shape == ref.shape, f"{name}: yardstick shape {yd.shape} != reference shape {ref.shape}"
        assert np.isfinite(yd[finite]).all(), (
            f"{name}: the yardstick overflowed where the reference is finite; the bound would be vacuous")
    err = max_abs(got[finite] - ref[finite])
    yard_err = max(max_abs(yd[finite] - ref[finite]) for yd in yards)
    u = UNIT_ROUNDOFF[dtype]
    bound = factor * yard_err + u * max_abs(ref[finite])
    assert err <= bound, (
        f"{name} ({dtype_name(dtype)}): max error {err:.3e} > bound {bound:.3e} "
        f"= {factor} x yardstick error {yard_err:.3e} + u x max|ref| ({u:.1e} x {max_abs(ref[finite]):.3e})"
    )
    return err, bound


def assert_lse_within_bound(name, got, ref_lse, bound):
    """Assert |got - ref| <= bound row by row (bound: :func:`lse_bound`); -inf exactly where ref is.
    Returns (max error, max of error / bound over the rows that see a key)."""
    got = to_numpy(got)
    assert got.dtype == _F32, f"{name}: dtype {dtype_name(got.dtype)}, want float32"
    got = got.astype(_F64)
    ref = to_numpy(ref_lse).astype(_F64)
    bound = np.asarray(bound, dtype=_F64)
    finite = _finite_checks(name, got, ref)
    err = np.zeros_like(ref)
    err[finite] = np.abs(got[finite] - ref[finite])
    over = err > bound
    assert not over.any(), (
        f"{name}: {int(over.sum())} rows beyond the float32 bound, e.g. error {err[over][:3]} > bound {bound[over][:3]}")
    ratio = float(np.max(err[finite] / bound[finite])) if finite.any() else 0.0
    return (max_abs(err), ratio)


def assert_forward_accurate(o, lse, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None,
                            factor=FACTOR, **mods):
    """The accuracy rule for a forward result: o against the yardstick rule, lse (unless None)
    against the float32 a-priori bound. ``mods``: softcap, alibi_slopes, sinks."""
    dtype = to_numpy(q).dtype
    kw = dict(causal=causal, scale=scale, layout=layout, mask=mask, window=window, **mods)
    ref_o, ref_lse = reference64(q, k, v, **kw)
    c = _Case(q, k, v, causal, scale, layout, mask, window, mods=mods)
    yard_o = _forward_yardsticks(c)
    assert to_numpy(o).dtype == dtype, f"o: dtype {dtype_name(to_numpy(o).dtype)}, want {dtype_name(dtype)}"
    assert_within_rule("o", o, ref_o, yard_o, dtype, factor)
    if lse is not None:
        assert_lse_within_bound("lse", lse, ref_lse, lse_bound(q, k, v, **kw))


def _one_key_rows(c, P) -> bool:
    """Whether every row's probability rests on one key up to less than one accumulator rounding
    (every row sees at most one key, or the others' P sum to <= u of the accumulator). dS = P (dP - D)
    then cancels to below what the accumulator resolves, and dq, dk are rounding noise of a zero."""
    if c.p.nk == 0:
        return False
    rest = 1.0 - P.max(axis=-1, initial=0.0)
    seen = c.mask.any(axis=-1)
    return bool(np.all(rest[..., seen] <= UNIT_ROUNDOFF[_acc(c.p.dtype)]))


def assert_backward_accurate(grads, do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None,
                             factor=FACTOR, **mods):
    """The accuracy rule for (dq, dk, dv) against the float64 reference gradients.

    When every row's probability rests on one key (it sees one key, or the others' P sum to less
    than one accumulator rounding), dq and dk are exactly or nearly 0 and the rule's bound would
    ask for bit-exact cancellation; they are then held to :func:`assert_single_key_gradients`'
    a-priori bound instead (dv still to the rule).

    ``mods``: softcap, alibi_slopes, sinks; with sinks ``grads`` is (dq, dk, dv, dsinks) and dsinks
    (float32) is held to the same rule (u of the input dtype: D comes from the rounded o)."""
    dtype = to_numpy(q).dtype
    kw = dict(causal=causal, scale=scale, layout=layout, mask=mask, window=window)
    refs = reference64_backward(do, q, k, v, **kw, **mods)
    c = _Case(q, k, v, causal, scale, layout, mask, window, q_side=(do,), mods=mods)
    yards = _backward_yardsticks(c)
    single = _one_key_rows(c, _probabilities(c)) and all(m is None for m in mods.values())
    names = ("dq", "dk", "dv", "dsinks")
    assert len(grads) == len(refs), f"{len(grads)} gradients, want {len(refs)} ({', '.join(names[:len(refs)])})"
    for name, got, ref, yard in zip(names, grads, refs, yards):
        if name == "dsinks":
            assert to_numpy(got).dtype == _F32, f"dsinks: dtype {dtype_name(to_numpy(got).dtype)}, want float32"
        else:
            assert to_numpy(got).dtype == dtype, f"{name}: dtype {dtype_name(to_numpy(got).dtype)}, want {dtype_name(dtype)}"
        if single and name not in ("dv", "dsinks"):
            continue
        assert_within_rule(name, got, ref, yard, dtype, factor)
    if single:
        assert_single_key_gradients(grads, do, q, k, v, **kw)


def assert_single_key_gradients(grads, do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None,
                                window=None):
    """dq and dk when every row's probability rests on one key j*, against an a-priori bound.

    With P = 1 on (i, j*) the exact dS = P (dP - D) is 0 and so are dq and dk. A kernel computes
    D = rowsum(dO * O) (O = V_j* here) and dP = dO V^T as two sums of the same exact products in
    different orders, so it leaves |dP - D| <= 2 gamma_d sum|dO V| (Higham; gamma_n = n u_acc /
    (1 - n u_acc)), carried through dQ = scale dS K and dK = scale dS^T Q with their roundings.
    u_acc is twice the accumulator's unit roundoff: a tensor-core addition may truncate instead of
    rounding to nearest. Where the other keys hold a probability rest_i <= u (_one_key_rows), the
    bound adds what they can contribute: their own dS (at most P_ij (|dO_i||V_j| + |D_i|)) and
    O's distance from V_j* (at most rest_i |V_j* - V_j| per column, or one rounding of the output
    where that distance could move O's rounding off V_j*). Keys no row sees must have dk = 0."""
    c = _Case(q, k, v, causal, scale, layout, mask, window, q_side=(do,))
    p = c.p
    P = _probabilities(c)
    vis = c.mask.sum(axis=-1)
    assert _one_key_rows(c, P), "assert_single_key_gradients: a row's probability spreads over several keys"
    dq4 = to_bhsd(to_numpy(grads[0]), p, p.hq, p.nq).astype(_F64)
    dk4 = to_bhsd(to_numpy(grads[1]), p, p.hkv, p.nk).astype(_F64)
    u_acc = 2 * UNIT_ROUNDOFF[_acc(p.dtype)]
    u_in = UNIT_ROUNDOFF[p.dtype]

    def gamma(n):
        return n * u_acc / (1 - n * u_acc)

    do4 = c.q_side[0]
    top = P.argmax(axis=-1)  # (B, Hq, Nq): the key j* each row rests on
    dk_bound = np.zeros((p.batch, p.hkv, p.nk, p.d))
    for i in range(p.nq):
        if vis[i] == 0:
            assert np.all(dq4[:, :, i] == 0), f"dq row {i} sees no key but is not 0"
            continue
        j = top[:, :, i]  # (B, Hq)
        kj = np.take_along_axis(c.k4, j[:, :, None, None], axis=2)[:, :, 0]  # (B, Hq, d)
        vj = np.take_along_axis(c.v4, j[:, :, None, None], axis=2)[:, :, 0]
        doi = do4[:, :, i]  # (B, Hq, d)
        Pi = P[:, :, i]  # (B, Hq, Nk)
        others = Pi.copy()
        np.put_along_axis(others, j[:, :, None], 0.0, axis=-1)
        rest = others.sum(axis=-1, keepdims=True)  # (B, Hq, 1)
        vmax = np.abs(c.v4).max(axis=2)  # (B, Hq, d): the largest |V| of each column
        # O's distance from V_j*: rest |V_j* - V_j| <= rest (|V_j*| + vmax); where that could carry
        # O's rounding to another value than V_j*, one rounding of the output more.
        drift = rest * (np.abs(vj) + vmax)
        flips = drift >= 0.25 * u_in * np.abs(vj)
        o_dev = drift + np.where(flips, u_in * (np.abs(vj) + drift), 0.0)
        terms = np.abs(doi * vj).sum(axis=-1, keepdims=True)  # (B, Hq, 1)
        ds_bound = (2 * gamma(p.d) * terms + 2 * (np.abs(doi) * o_dev).sum(axis=-1, keepdims=True)) \
            * (1 + gamma(4)) * (1 + u_in)
        d_i = np.abs((doi * vj)).sum(axis=-1, keepdims=True) * (1 + 2 * u_in)  # >= |D_i| with O within a rounding of V_j*
        ds_others = others * (np.abs(np.matmul(c.v4, doi[..., None]))[..., 0] + d_i) * 2  # (B, Hq, Nk)
        dq_bound = c.scale * (ds_bound * np.abs(kj) + np.matmul(ds_others[:, :, None, :], np.abs(c.k4))[:, :, 0]) \
            * (1 + gamma(p.nk + 2)) * (1 + u_in)
        assert np.all(np.abs(dq4[:, :, i]) <= dq_bound), f"dq row {i}: {max_abs(dq4[:, :, i]):.3e} beyond the bound"
        per_key = np.zeros((p.batch, p.hq, p.nk, p.d))
        np.put_along_axis(per_key, j[:, :, None, None], (c.scale * ds_bound * np.abs(c.q4[:, :, i]))[:, :, None, :],
                          axis=2)
        per_key += c.scale * ds_others[..., None] * np.abs(c.q4[:, :, i])[:, :, None, :]
        dk_bound += per_key.reshape(p.batch, p.hkv, p.group, p.nk, p.d).sum(axis=2)
    dk_bound *= (1 + gamma(p.nq * p.group + 2)) * (1 + u_in)
    assert np.all(np.abs(dk4) <= dk_bound), f"dk: {max_abs(dk4):.3e} exceeds the summation bound"


def _backward_yardsticks(c):
    """[[each realization's dq, rounded and before], [dk ...], [dv ...] (, [dsinks ...])]."""
    runs = [run for r in range(realizations(c.p)) for run in _faithful_backward_both(c, r)]
    return [list(g) for g in zip(*runs)]


def faithful_realizations(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None):
    """[o of each yardstick realization, rounded and before its rounding] (for assert_within_rule's
    ``yard``)."""
    return _forward_yardsticks(_Case(q, k, v, causal, scale, layout, mask, window))


def faithful_backward_realizations(do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None, window=None):
    """([dq realizations], [dk realizations], [dv realizations]) of the yardstick backward, each
    rounded and before its rounding."""
    return tuple(_backward_yardsticks(_Case(q, k, v, causal, scale, layout, mask, window, q_side=(do,))))


def poison(a):
    """Fill ``a`` (NumPy or CuPy, C-contiguous) with 0xFF bytes: NaN in float16, bfloat16 and
    float32, -1 in integers. Returns ``a``."""
    a.reshape(-1).view(np.uint8).fill(0xFF)  # (np.uint8 is also CuPy's dtype)
    return a


def poisoned_allocations(fn):
    """fn() with every allocation it makes from CuPy's default memory pool filled with 0xFF bytes
    first (NaN in every float dtype cuflash writes), so an output element or workspace entry that a
    kernel never writes cannot inherit a correct value from a pooled buffer. The device is
    synchronized before and after the call."""
    import cupy

    def poison_memory(mem, nbytes):
        if nbytes:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes, cupy.cuda.get_current_stream().ptr)

    return _under_allocator(fn, poison_memory)
